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
use crate::plan::StreamPlan;
use crate::plan::elastic::Origin;
use crate::plan::passes::Hop;
use crate::plan::request::{Plan, Run};
use crate::plan::shuffle::WindowShuffle;

/// The checkpoint's chain replayed: every stream involved, planned as the daemons would.
pub struct Replay {
    /// The base epoch's streams (the chain's first topology, no resume): what the epoch is.
    pub epoch: Vec<Plan>,
    /// The samples each of them had delivered at the first checkpoint.
    pub epoch_delivered: Vec<u64>,
    /// Each later hop's streams (resumes themselves) with the samples each had delivered
    /// at its checkpoint.
    pub delivered: Vec<(Plan, u64)>,
    /// The new streams, `[host][local rank × K + worker]`.
    pub new: Vec<Vec<Plan>>,
    pub ranks: u32,
    pub workers: u32,
    /// Samples the contract lets the resumes of the chain leave unread: fewer than the world
    /// size at each resume (per source).
    pub drop_allowance: u64,
    /// What the plans of the resumes report dropping, summed over the chain (all sources).
    pub planned_dropped: u64,
    /// Earlier resumes' drops, and the new plans' remainder, to check them against the replay.
    pub earlier_dropped: u64,
    pub planned_remainder: Option<u64>,
}

/// A dataset of the replay: how its samples are numbered, and its shuffle window.
pub struct Ids {
    /// `first[shard]`: samples of the shards before it (the sample id of its sample 0).
    first: Vec<u64>,
    total: u64,
    window: usize,
}

impl Ids {
    pub fn new(counts: &[u64], window: usize) -> Ids {
        let mut at = 0;
        let first = counts
            .iter()
            .map(|&n| {
                at += n;
                at - n
            })
            .collect();
        Ids {
            first,
            total: at,
            window,
        }
    }
}

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

/// Plans every stream of one topology with `plan::request::plan`, `[host][stream]`.
fn streams(
    config: &Config,
    name: &str,
    (hosts, world, workers): (u32, u32, u32),
    (seed, epoch, history): (u64, u64, &[Hop]),
    resume: Option<&Origin>,
    what: &str,
) -> anyhow::Result<Vec<Vec<Plan>>> {
    let ranks = world / hosts.max(1);
    on_threads(hosts as usize, threads(), |h| {
        let mut config = config.clone();
        config.host = Topology {
            index: h as u32,
            count: hosts,
        };
        let mut out = Vec::with_capacity((ranks * workers) as usize);
        for s in 0..ranks * workers {
            let req = StreamRequest {
                seed,
                epoch,
                rank: h as u32 * ranks + s / workers,
                world_size: world,
                worker: s % workers,
                num_workers: workers,
            };
            let plan = plan::request::plan(&config, name, req, resume, history, false)
                .with_context(|| {
                    format!("{what}: host {h}, rank {}, worker {}", req.rank, req.worker)
                })?;
            out.push(plan);
        }
        anyhow::Ok(out)
    })
    .into_iter()
    .collect()
}

/// Replays the chain of `origin` and the resume onto `hosts × ranks × workers`.
pub fn replay(
    config: &Config,
    name: &str,
    (hosts, ranks, workers): (u32, u32, u32),
    (seed, epoch): (u64, u64),
    origin: &Origin,
    history: &[Hop],
) -> anyhow::Result<Replay> {
    let world = hosts
        .checked_mul(ranks)
        .context("--hosts × --ranks is past 2^32")?;
    let key = (seed, epoch, history);
    // The new streams first: their planning checks the origin (positions past an old
    // stream's end, a world not divisible by its hosts, ...) and names what is wrong.
    let new = streams(
        config,
        name,
        (hosts, world, workers),
        key,
        Some(origin),
        "the new streams",
    )?;
    let mut chain = vec![origin];
    while let Some(o) = chain.last().unwrap().from.as_deref() {
        chain.push(o);
    }
    let base = chain.last().unwrap();
    let topo = |o: &Origin| (o.hosts, o.world_size, o.num_workers);
    let epoch_plans = streams(config, name, topo(base), key, None, "the epoch")?;
    let mut delivered = Vec::new();
    let mut drop_allowance = (world - 1) as u64;
    let mut earlier_dropped = 0;
    let at = |o: &Origin, s: usize| o.positions[s % o.num_workers as usize];
    // The first hop's streams are the epoch's: planned once.
    let epoch_delivered = (0..epoch_plans.iter().map(Vec::len).sum())
        .map(|s| at(base, s))
        .collect();
    for o in chain.iter().rev().skip(1) {
        let hop = streams(config, name, topo(o), key, o.from.as_deref(), "an old hop")?;
        drop_allowance += (o.world_size - 1) as u64;
        earlier_dropped += hop.first().and_then(|s| s.first()).map_or(0, |p| p.dropped);
        for (s, plan) in hop.into_iter().flatten().enumerate() {
            delivered.push((plan, at(o, s)));
        }
    }
    let first = new.first().and_then(|s| s.first());
    Ok(Replay {
        epoch: epoch_plans.into_iter().flatten().collect(),
        epoch_delivered,
        delivered,
        planned_dropped: earlier_dropped + first.map_or(0, |p| p.dropped),
        planned_remainder: first.and_then(|p| p.remainder),
        earlier_dropped,
        new,
        ranks,
        workers,
        drop_allowance,
    })
}

/// Which samples one dataset's runs mark: bits, or counts once the epoch itself reads a
/// sample more than once.
enum Marks {
    Bits(Vec<u64>),
    Counts(Vec<u16>),
}

impl Marks {
    fn bits(n: u64) -> Marks {
        Marks::Bits(vec![0; n.div_ceil(64) as usize])
    }

    /// Marks samples `a..b`; returns how many were marked already.
    fn range(&mut self, a: u64, b: u64) -> u64 {
        match self {
            Marks::Bits(words) => {
                let mut seen = 0;
                let mut i = a;
                while i < b {
                    let (w, bit) = ((i / 64) as usize, i % 64);
                    let n = (64 - bit).min(b - i);
                    let mask = if n == 64 {
                        u64::MAX
                    } else {
                        ((1u64 << n) - 1) << bit
                    };
                    seen += (words[w] & mask).count_ones() as u64;
                    words[w] |= mask;
                    i += n;
                }
                seen
            }
            Marks::Counts(c) => {
                let mut seen = 0;
                for x in &mut c[a as usize..b as usize] {
                    seen += u64::from(*x > 0);
                    *x = x.saturating_add(1);
                }
                seen
            }
        }
    }
}

/// One dataset's ledger: what the epoch holds, and what was delivered or read.
struct Ledger {
    expected: Marks,
    got: Marks,
    check: SourceCheck,
}

/// Positions `a..b` of base stream `plan` (a run of it), as `(first id, last id + 1)`
/// ranges, each window cut by `a` or `b` permuted as the stream reader permutes it.
pub(crate) fn run_ids(plan: &StreamPlan, a: u64, b: u64, ids: &Ids, out: &mut dyn FnMut(u64, u64)) {
    if a >= b {
        return;
    }
    let run = Run {
        plan: plan.clone(),
        from: a,
        to: Some(b),
    };
    let pieces = crate::serve::stream::run_pieces(&run, ids.window);
    let length = plan.samples.expect("a manifest plan knows its length");
    let window_at = |p: u64| {
        let mut w = WindowShuffle::new(plan.stream_key, ids.window);
        let start = w.seek(p);
        let len = (w.next_len() as u64).min(length - start);
        (w, start, len)
    };
    let (_, first, _) = window_at(a);
    // The pieces hold the stream's positions from `first` on: offsets of `first`.
    let mut ends = Vec::with_capacity(pieces.len());
    let mut at = 0;
    for p in &pieces {
        at += p.end.expect("bounded") - p.start;
        ends.push(at);
    }
    let seq = |lo: u64, hi: u64, out: &mut dyn FnMut(u64, u64)| {
        let mut i = ends.partition_point(|&e| e <= lo - first);
        let mut x = lo - first;
        while x < hi - first {
            let p = &pieces[i];
            let start = ends[i] - (p.end.unwrap() - p.start);
            let y = ends[i].min(hi - first);
            let id = ids.first[p.shard] + p.start + (x - start);
            out(id, id + (y - x));
            (x, i) = (y, i + 1);
        }
    };
    let cut = |p: u64, lo: u64, hi: u64, out: &mut dyn FnMut(u64, u64)| {
        let (mut w, start, len) = window_at(p);
        if lo == start && hi == start + len {
            return seq(lo, hi, out);
        }
        let mut window = Vec::with_capacity(len as usize);
        seq(start, start + len, &mut |x, y| window.extend(x..y));
        w.permute(&mut window);
        for &id in &window[(lo - start) as usize..(hi - start) as usize] {
            out(id, id + 1);
        }
    };
    let (_, hs, hl) = window_at(a);
    if b <= hs + hl {
        return cut(a, a, b, out);
    }
    cut(a, a, hs + hl, out);
    let (_, ts, _) = window_at(b - 1);
    seq(hs + hl, ts, out);
    cut(b - 1, ts, b, out);
}

/// The runs of each lane a stream's positions `0..n` take: `(lane, run, from, to)`.
fn prefix(plan: &Plan, n: u64) -> Vec<(usize, &Run, u64, u64)> {
    let per_lane: Vec<u64> = match &plan.mix {
        Some(i) => i.mix.counts_at(i.key, n),
        None => vec![n],
    };
    let mut out = Vec::new();
    for (l, (lane, &want)) in plan.lanes.iter().zip(&per_lane).enumerate() {
        let mut left = want;
        for run in &lane.runs {
            let len = run.len().expect("a manifest run has an end");
            let k = len.min(left);
            if k > 0 {
                out.push((l, run, run.from, run.from + k));
            }
            left -= k;
        }
    }
    out
}

fn lane_len(runs: &[Run]) -> u64 {
    runs.iter().map(|r| r.len().unwrap_or(0)).sum()
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

type Ledgers<'a> = BTreeMap<&'a str, Ledger>;

/// An empty ledger per dataset, in bits.
fn ledgers(ids: &BTreeMap<String, Ids>, drop_allowance: u64) -> Ledgers<'_> {
    ids.iter()
        .map(|(name, d)| {
            let check = SourceCheck {
                dataset: name.clone(),
                epoch: 0,
                delivered: 0,
                read: 0,
                duplicates: 0,
                foreign: 0,
                unread: 0,
                drop_allowance,
            };
            let ledger = Ledger {
                expected: Marks::bits(d.total),
                got: Marks::bits(d.total),
                check,
            };
            (name.as_str(), ledger)
        })
        .collect()
}

/// The epoch: every base stream whole. A dataset whose epoch reads a sample twice is marked
/// again, with counters.
fn mark_epoch(r: &Replay, ids: &BTreeMap<String, Ids>, ledgers: &mut Ledgers) {
    let mut repeated = mark_epoch_of(r, ids, ledgers, None);
    repeated.sort();
    repeated.dedup();
    for name in &repeated {
        let l = ledgers.get_mut(name.as_str()).unwrap();
        let n = ids[name].total as usize;
        (l.expected, l.got) = (Marks::Counts(vec![0; n]), Marks::Counts(vec![0; n]));
        l.check.epoch = 0;
        mark_epoch_of(r, ids, ledgers, Some(name));
    }
}

/// Marks the epoch's samples of every dataset (or `only` one); returns the datasets whose
/// epoch marked a sample already marked.
fn mark_epoch_of(
    r: &Replay,
    ids: &BTreeMap<String, Ids>,
    ledgers: &mut Ledgers,
    only: Option<&str>,
) -> Vec<String> {
    let mut repeated = Vec::new();
    for plan in &r.epoch {
        for lane in &plan.lanes {
            if only.is_some_and(|o| o != lane.dataset) {
                continue;
            }
            let l = ledgers
                .get_mut(lane.dataset.as_str())
                .expect("a known dataset");
            let d = &ids[&lane.dataset];
            let mut again = 0;
            for run in &lane.runs {
                let to = run.to.unwrap_or(0);
                run_ids(&run.plan, run.from, to, d, &mut |a, b| {
                    again += l.expected.range(a, b)
                });
                l.check.epoch += to - run.from;
            }
            if again > 0 {
                repeated.push(lane.dataset.clone());
            }
        }
    }
    repeated
}

/// What the old streams delivered: the base epoch's streams and each later hop's, up to
/// their checkpoint positions.
fn mark_delivered(r: &Replay, ids: &BTreeMap<String, Ids>, ledgers: &mut Ledgers) {
    let hops = r.epoch.iter().zip(&r.epoch_delivered);
    for (plan, n) in hops.chain(r.delivered.iter().map(|(p, n)| (p, n))) {
        for (lane, run, a, b) in prefix(plan, *n) {
            let name = plan.lanes[lane].dataset.as_str();
            let l = ledgers.get_mut(name).unwrap();
            run_ids(&run.plan, a, b, &ids[name], &mut |x, y| {
                l.check.duplicates += l.got.range(x, y)
            });
            l.check.delivered += b - a;
        }
    }
}

/// What the new streams read: marked in the ledgers, with their counts per rank and worker
/// and, for a mix, the prefix bound, each breach of those named.
fn read_new(
    r: &Replay,
    ids: &BTreeMap<String, Ids>,
    ledgers: &mut Ledgers,
    breaches: &mut Vec<String>,
) -> (Counts, Option<MixBound>) {
    let (ranks, workers) = (r.ranks as usize, r.workers as usize);
    let mut rank_totals = Vec::new();
    let mut per_worker = vec![(u64::MAX, 0u64); workers];
    let mut bound: Option<MixBound> = None;
    for (h, host) in r.new.iter().enumerate() {
        for (s, plan) in host.iter().enumerate() {
            let who = || {
                format!(
                    "host {h}, rank {}, worker {}",
                    h * ranks + s / workers,
                    s % workers
                )
            };
            let samples = plan.samples.unwrap_or(0);
            let held: u64 = plan.lanes.iter().map(|l| lane_len(&l.runs)).sum();
            if held != samples {
                breaches.push(format!(
                    "count: {}: its runs hold {held} samples, its plan says {samples}",
                    who()
                ));
            }
            if s % workers == 0 {
                rank_totals.push(0);
            }
            *rank_totals.last_mut().unwrap() += held;
            let w = &mut per_worker[s % workers];
            *w = (w.0.min(held), w.1.max(held));
            for lane in &plan.lanes {
                let l = ledgers.get_mut(lane.dataset.as_str()).unwrap();
                for run in &lane.runs {
                    let to = run.to.unwrap_or(run.from);
                    run_ids(&run.plan, run.from, to, &ids[&lane.dataset], &mut |x, y| {
                        l.check.duplicates += l.got.range(x, y)
                    });
                    l.check.read += to - run.from;
                }
            }
            check_mix(plan, &who, &mut bound, breaches);
        }
    }
    let counts = Counts {
        rank_min: rank_totals.iter().copied().min().unwrap_or(0),
        rank_max: rank_totals.iter().copied().max().unwrap_or(0),
        workers: per_worker.into_iter().map(|(a, b)| (a.min(b), b)).collect(),
    };
    if counts.rank_min != counts.rank_max {
        breaches.push(format!(
            "count: the new ranks get from {} to {} samples, not all the same",
            counts.rank_min, counts.rank_max
        ));
    }
    for (w, &(a, b)) in counts.workers.iter().enumerate() {
        if a != b {
            breaches.push(format!(
                "count: worker {w} gets from {a} to {b} samples across the ranks"
            ));
        }
    }
    (counts, bound)
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

/// Each dataset's tally, with its duplicates, foreign reads and skips past the allowance
/// named.
fn close(ledgers: Ledgers, breaches: &mut Vec<String>) -> Vec<SourceCheck> {
    let mut sources = Vec::new();
    for (name, mut l) in ledgers {
        let (foreign, unread, dup) = tally(&l.expected, &l.got);
        let c = &mut l.check;
        c.foreign = foreign;
        c.unread = unread;
        if let Some(d) = dup {
            c.duplicates = d;
        }
        if c.duplicates > 0 {
            breaches.push(format!(
                "duplicate: {name}: {} reads of samples already delivered or read",
                c.duplicates
            ));
        }
        if c.foreign > 0 {
            breaches.push(format!(
                "foreign: {name}: {} samples read that are not in the epoch",
                c.foreign
            ));
        }
        if c.unread > c.drop_allowance {
            breaches.push(format!(
                "skip: {name}: {} samples of the epoch are neither delivered nor read, more than \
                 the {} a resume may drop (fewer than the world size)",
                c.unread, c.drop_allowance
            ));
        }
        sources.push(l.check);
    }
    sources
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

/// (foreign, unread, duplicates when counted here) of a ledger.
fn tally(expected: &Marks, got: &Marks) -> (u64, u64, Option<u64>) {
    match (expected, got) {
        (Marks::Bits(e), Marks::Bits(g)) => {
            let (mut foreign, mut unread) = (0, 0);
            for (e, g) in e.iter().zip(g) {
                foreign += (g & !e).count_ones() as u64;
                unread += (e & !g).count_ones() as u64;
            }
            (foreign, unread, None)
        }
        (Marks::Counts(e), Marks::Counts(g)) => {
            let (mut foreign, mut unread, mut dup) = (0, 0, 0);
            for (&e, &g) in e.iter().zip(g) {
                let (e, g) = (e as u64, g as u64);
                if e == 0 {
                    foreign += g;
                } else if g > e {
                    dup += g - e;
                } else {
                    unread += e - g;
                }
            }
            (foreign, unread, Some(dup))
        }
        _ => unreachable!("a ledger's marks are of one kind"),
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

/// The verification as lines of text.
pub fn text(v: &Verification) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let o = &v.from;
    let _ = writeln!(
        s,
        "verify: {} resumed from {} hosts × {} ranks × {} workers at positions {:?}{} onto {} \
         hosts × {} ranks × {} workers",
        v.dataset,
        o.hosts,
        o.world_size / o.hosts.max(1),
        o.num_workers,
        o.positions,
        if o.from.is_some() {
            " (a resume itself)"
        } else {
            ""
        },
        v.hosts,
        v.ranks,
        v.workers
    );
    for c in &v.sources {
        let _ = writeln!(
            s,
            "  {}: epoch {} samples, delivered {}, read by the new streams {}, duplicates {}, \
             foreign {}, unread {} (dropped, allowed up to {})",
            c.dataset,
            c.epoch,
            c.delivered,
            c.read,
            c.duplicates,
            c.foreign,
            c.unread,
            c.drop_allowance
        );
    }
    let workers: Vec<String> = (v.counts.workers.iter())
        .map(|(a, b)| {
            if a == b {
                a.to_string()
            } else {
                format!("{a}..{b}")
            }
        })
        .collect();
    let _ = writeln!(
        s,
        "  per rank: {} samples; per worker: {}",
        if v.counts.rank_min == v.counts.rank_max {
            v.counts.rank_min.to_string()
        } else {
            format!("{}..{}", v.counts.rank_min, v.counts.rank_max)
        },
        workers.join(", ")
    );
    if let Some(b) = &v.mix_bound {
        let _ = writeln!(
            s,
            "  mix prefix bound: worst {:.3} samples off, allowed ±{}",
            b.worst, b.bound
        );
    }
    if v.breaches.is_empty() {
        let _ = writeln!(
            s,
            "certified: every sample the old streams had not delivered is read exactly once ({} dropped)",
            v.planned_dropped
        );
    } else {
        for b in &v.breaches {
            let _ = writeln!(s, "BREACH {b}");
        }
    }
    s
}

#[cfg(test)]
mod tests;
