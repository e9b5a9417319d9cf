//! `--verify`: proof, from the config and the manifests alone, that an elastic resume reads
//! the rest of the epoch exactly once, before a job spends a slice on it.
//!
//! The streams are replayed with the daemon's own entry point (`plan::request::plan`, as the
//! server plans a REQUEST) at every topology of the checkpoint's chain: the base epoch's
//! streams (what the epoch is), each hop's streams up to its checkpoint positions (what was
//! delivered) and the new streams whole (what the resume reads). Each run of a base stream is
//! turned into samples as the stream reader reads it: the pieces `run_pieces` gives and the
//! window permutation of `WindowShuffle`, for the windows a run boundary cuts; a window it
//! holds whole is its pieces, in ranges. A sample is (shard, index) numbered as one u64 of
//! the dataset, so the ledger is two bitmaps per dataset (counters for a dataset whose epoch
//! reads some samples more than once, a mix source drawn past its share): no per-sample
//! hashing, and nothing of the shards is read.

use std::collections::BTreeMap;

use super::*;
use crate::plan::elastic::Origin;
use crate::plan::request::Plan;

mod ledger;
mod replay;
mod text;

pub use self::ledger::Ids;
use self::ledger::{close, lane_len, ledgers, mark_delivered, mark_epoch, read_new};
pub use self::replay::{Replay, replay};
pub use self::text::text;

/// For the tests (these and the stream reader's), which check reads against it.
#[cfg(test)]
pub(crate) use self::ledger::run_ids;

/// What the replay found for one dataset (of a mix, one source).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SourceCheck {
    pub dataset: String,
    /// Samples of the epoch (a sample the epoch reads twice counts twice).
    pub epoch: u64,
    /// Samples the old streams had delivered at the checkpoint(s).
    pub delivered: u64,
    /// Samples the new streams read.
    pub read: u64,
    /// Reads of a sample already delivered or read (by any stream, old or new).
    pub duplicates: u64,
    /// Reads of samples that are not in the epoch.
    pub foreign: u64,
    /// Samples of the epoch nobody reads: allowed up to `drop_allowance`.
    pub unread: u64,
    pub drop_allowance: u64,
}

/// Samples per rank (and per worker across ranks) of the new streams: equal if min == max.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Counts {
    pub rank_min: u64,
    pub rank_max: u64,
    /// Per worker index: (min, max) over the ranks.
    pub workers: Vec<(u64, u64)>,
}

/// The mix's prefix bound over every position of every new stream.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MixBound {
    /// ⌈log₂ k⌉ for k sources left (1 for two).
    pub bound: u64,
    /// The largest |count − n·len/total| seen.
    pub worst: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Verification {
    pub dataset: String,
    pub from: Origin,
    pub hosts: u32,
    pub ranks: u32,
    pub workers: u32,
    pub sources: Vec<SourceCheck>,
    pub counts: Counts,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mix_bound: Option<MixBound>,
    pub planned_dropped: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub planned_remainder: Option<u64>,
    /// Every way the resume breaks the contract; empty: certified.
    pub breaches: Vec<String>,
}

/// Checks the replay against the contract (module docs). `ids`: each dataset's numbering.
pub fn check(
    r: &Replay,
    ids: &BTreeMap<String, Ids>,
    dataset: &str,
    origin: &Origin,
    hosts: u32,
) -> Verification {
    let mut ledgers = ledgers(ids, r.drop_allowance);
    let mut breaches = Vec::new();
    mark_epoch(r, ids, &mut ledgers);
    mark_delivered(r, ids, &mut ledgers);
    let (counts, mix_bound) = read_new(r, ids, &mut ledgers, &mut breaches);
    let sources = close(ledgers, &mut breaches);
    check_totals(r, &sources, &mut breaches);
    Verification {
        dataset: dataset.to_string(),
        from: origin.clone(),
        hosts,
        ranks: r.ranks,
        workers: r.workers,
        sources,
        counts,
        mix_bound,
        planned_dropped: r.planned_dropped,
        planned_remainder: r.planned_remainder,
        breaches,
    }
}

/// A new stream's interleave, if it mixes, against the prefix bound, folded into `bound`.
fn check_mix(
    plan: &Plan,
    who: &dyn Fn() -> String,
    bound: &mut Option<MixBound>,
    breaches: &mut Vec<String>,
) {
    let Some(i) = &plan.mix else { return };
    let lens: Vec<u64> = plan.lanes.iter().map(|l| lane_len(&l.runs)).collect();
    let worst = mix_worst(&i.mix, i.key, &lens);
    let d = (lens.len() as u64).next_power_of_two().trailing_zeros() as u64;
    let b = bound.get_or_insert(MixBound {
        bound: d,
        worst: 0.0,
    });
    b.bound = b.bound.max(d);
    if worst.is_nan() {
        breaches.push(format!(
            "mix: {}: its interleave does not end at its lanes' lengths {lens:?}",
            who()
        ));
    } else {
        if worst > d as f64 + 1e-9 {
            breaches.push(format!(
                "mix bound: {}: a prefix is {worst:.3} samples off its share, more than ±{d}",
                who()
            ));
        }
        b.worst = b.worst.max(worst);
    }
}

/// The plans' own accounts (samples dropped, samples left) against the replay's.
fn check_totals(r: &Replay, sources: &[SourceCheck], breaches: &mut Vec<String>) {
    let unread: u64 = sources.iter().map(|s| s.unread).sum();
    if unread != r.planned_dropped {
        breaches.push(format!(
            "drop: the plans report {} samples dropped, the replay finds {unread} unread",
            r.planned_dropped
        ));
    }
    let left: u64 = sources
        .iter()
        .map(|s| s.epoch - s.delivered.min(s.epoch))
        .sum();
    if let Some(p) = r.planned_remainder
        && p + r.earlier_dropped != left
    {
        breaches.push(format!(
            "remainder: the plans report {p} samples left at the checkpoint, the replay finds {}",
            left.saturating_sub(r.earlier_dropped)
        ));
    }
}

/// The largest |count_i − n·len_i/total| over every prefix `n` of a mixed stream whose lanes
/// hold `lens` (a resumed rest's interleave: one segment, weighted by `lens`); NaN when the
/// order does not end at exactly `lens`.
fn mix_worst(mix: &crate::plan::mix::EpochMix, key: u64, lens: &[u64]) -> f64 {
    let total: u64 = lens.iter().sum();
    let mut counts = vec![0u64; lens.len()];
    let mut worst = 0f64;
    let mut n = 0u64;
    for label in mix.cursor(key, 0) {
        if label >= counts.len() {
            return f64::NAN;
        }
        counts[label] += 1;
        n += 1;
        for (c, &len) in counts.iter().zip(lens) {
            // |c·T − n·len| / T, exactly in integers first.
            let off = (*c as i128 * total as i128 - n as i128 * len as i128).unsigned_abs();
            worst = worst.max(off as f64 / total as f64);
        }
    }
    if counts != lens {
        return f64::NAN;
    }
    worst
}

#[cfg(test)]
mod tests;
