//! The one entry point of planning: a dataset (or a mix) of the config and a stream request
//! → the [`Plan`] the server runs. Each mode meets here: a plain or manifest dataset
//! (`plan_stream`), a resampled one (the same, keyed for endless passes), a weighted mix
//! (each source's own stream, interleaved by [`crate::plan::mix`]) and an elastic resume of
//! either (runs of the old topology's streams, [`crate::plan::elastic`]). What the plan is
//! for: [`crate::serve::stream`] reads its lanes' runs; the server reports its START.

use crate::config::Config;
use crate::plan::passes::{Hop, Passes};
use crate::plan::{PlanError, StreamPlan, StreamRequest};

mod dataset;
mod mix;

use dataset::plan_dataset;
use mix::plan_mix;

/// A run of a base stream's shuffled output, positions `from..to` (`to: None`: to its end).
/// A stream is one run of its own plan, or after an elastic resume, runs of the streams of
/// the topology it was checkpointed at (`elastic`), read one after another.
#[derive(Debug, Clone)]
pub struct Run {
    pub plan: StreamPlan,
    pub from: u64,
    pub to: Option<u64>,
}

impl Run {
    /// A whole stream.
    pub fn whole(plan: StreamPlan) -> Run {
        Run {
            to: plan.samples,
            plan,
            from: 0,
        }
    }

    pub(crate) fn len(&self) -> Option<u64> {
        self.to.map(|to| to - self.from)
    }
}

/// The most pieces the base streams of one elastic resume may hold together: a request
/// chooses how many old streams one new stream resumes (up to `elastic::MAX_STREAMS`), and
/// an old stream of `samples_per_epoch` samples over a tiny host share holds a piece or two
/// per pass: 2^18 old hosts of 3 samples each, 300 per stream, were 50 million pieces (2.5 GB).
/// 2^22 pieces are ~100 MB.
pub const MAX_RESUMED_PIECES: usize = 1 << 22;

/// Counts the pieces of an elastic resume's runs as they are planned; refuses past
/// [`MAX_RESUMED_PIECES`].
#[derive(Default)]
pub(crate) struct PieceBudget(usize);

impl PieceBudget {
    pub(crate) fn take(&mut self, plan: StreamPlan) -> Result<StreamPlan, PlanError> {
        self.0 += plan.pieces.len();
        if self.0 > MAX_RESUMED_PIECES {
            return Err(PlanError::BadOrigin(format!(
                "the old streams this resume reads hold more than {MAX_RESUMED_PIECES} pieces (many small host shares, read pass after pass): resume with fewer old streams per new one"
            )));
        }
        Ok(plan)
    }
}

/// Which lane each position of a mixed stream takes its sample from.
pub struct Interleave {
    pub mix: crate::plan::mix::EpochMix,
    /// Keys the order: (seed, epoch, stream).
    pub key: u64,
    /// Whether its segments are the mix's schedule (not after an elastic resume, whose rest
    /// is interleaved by what is left of each source).
    pub scheduled: bool,
}

/// What a stream reads of one dataset (of a mix's sources, one of them).
pub struct Lane {
    pub dataset: String,
    pub runs: Vec<Run>,
    /// Shards the same stream reads of it next epoch, for the prefetcher.
    pub next_epoch: Vec<usize>,
}

/// What planning a request gives.
pub struct Plan {
    pub lanes: Vec<Lane>,
    pub mix: Option<Interleave>,
    /// Samples the stream delivers (`None`: unknown before reading, without a manifest).
    pub samples: Option<u64>,
    pub dropped: u64,
    /// An elastic resume's rest of the epoch, job-wide.
    pub remainder: Option<u64>,
    /// A mix's sources, as START reports them.
    pub sources: Option<Vec<Source>>,
    /// A mix's segments this epoch, as START reports them (not after an elastic resume:
    /// its rest is interleaved by what is left of each source).
    pub segments: Option<Vec<MixSegment>>,
    pub fingerprint: String,
    /// Samples say which dataset they are of (a mix's).
    pub tag_sources: bool,
}

/// One source of a mix's stream: its weight this epoch, samples, and which pass of it the
/// stream starts in (START's `sources`).
#[derive(Debug, Clone, PartialEq)]
pub struct Source {
    pub dataset: String,
    pub weight: u64,
    pub samples: u64,
    pub pass: u64,
}

/// Where a mix's weights change inside an epoch (START's `segments`).
#[derive(Debug, Clone, PartialEq)]
pub struct MixSegment {
    /// The stream position it starts at.
    pub position: u64,
    /// The schedule entry: 0 for the mix's first weights, n for the n-th entry.
    pub entry: usize,
    pub weights: Vec<u64>,
}

/// Plans stream `req` of `dataset` (one of the config's datasets or mixes): its epoch, or
/// with `resume_from` the rest of it after a checkpoint at another topology (runs of the old
/// streams; for a mix, each source's), and with `with_next` the shards of the same stream's
/// next epoch, for the prefetcher. O(shards of the host's share): the server runs it off the
/// runtime threads. The fuzz target `request` calls it too. `history`: the topologies the
/// job had before this one ([`crate::plan::passes`]; empty: it never resized).
pub fn plan(
    config: &Config,
    dataset: &str,
    req: StreamRequest,
    resume_from: Option<&crate::plan::elastic::Origin>,
    history: &[Hop],
    with_next: bool,
) -> Result<Plan, PlanError> {
    crate::plan::passes::check(history, req.epoch)?;
    let mut plan = match config.mixes.get(dataset) {
        Some(mix) => plan_mix(config, mix, req, resume_from, history, with_next),
        None => plan_dataset(config, dataset, req, resume_from, history, with_next),
    }?;
    if !history.is_empty() {
        // The history places every epoch after a resize: it is part of the plan.
        use md5::Digest;
        let mut h = md5::Md5::new();
        h.update(plan.fingerprint.as_bytes());
        h.update(serde_json::to_vec(history).expect("a history serialises"));
        plan.fingerprint = hex::encode(&h.finalize()[..8]);
    }
    Ok(plan)
}

fn streams_per_host(host: crate::plan::Topology, req: &StreamRequest) -> u128 {
    (req.world_size / host.count) as u128 * req.num_workers as u128
}

/// The job's streams: where a mix's `at` entries start depends on them.
fn job_streams(req: &StreamRequest) -> u128 {
    req.world_size as u128 * req.num_workers as u128
}

/// A base stream's plan of dataset `d`, or of a mix's source (its quota as
/// `samples_per_epoch`, starting where the source's earlier epochs left it, its shuffle keyed
/// apart from the other sources').
fn source_plan(
    d: &crate::config::Dataset,
    host: crate::plan::Topology,
    req: &StreamRequest,
    source: Option<(crate::plan::elastic::SourceOf, &crate::config::MixDataset)>,
    history: &[Hop],
) -> Result<crate::plan::StreamPlan, PlanError> {
    let mut shape = d.shape();
    shape.passes = Passes {
        hops: history,
        mix: source.map(|(s, m)| (m, s.index as usize)),
    };
    if let Some((s, m)) = source {
        shape.samples_per_epoch = Some(s.quota);
        shape.epoch_base = m.epoch_base(
            s.index as usize,
            req.epoch,
            job_streams(req),
            streams_per_host(host, req),
        );
        if shape.epoch_base.is_none() {
            return Err(PlanError::EpochTooLarge { epoch: req.epoch });
        }
    }
    let mut plan = crate::plan::plan_stream(shape, host, req)?;
    if let Some((s, _)) = source {
        plan.stream_key = crate::plan::source_key(plan.stream_key, s.index);
    }
    Ok(plan)
}

/// The shards the same stream reads next epoch (none past the last epoch, or when it cannot
/// be planned, or for a plan request).
fn next_epoch(
    config: &Config,
    shape: crate::plan::Shape,
    req: StreamRequest,
    with_next: bool,
) -> Vec<usize> {
    req.epoch
        .checked_add(1)
        .filter(|_| with_next)
        .and_then(|epoch| {
            let next = StreamRequest { epoch, ..req };
            crate::plan::plan_stream(shape, config.host, &next).ok()
        })
        .map(|p| p.shards().collect())
        .unwrap_or_default()
}

/// Identifies an epoch's plan for every rank of a job: the data (shard list and manifest
/// counts, hashed once per dataset), the topology, the seed, the epoch and the stream length, hashed. Excludes the
/// rank, the worker and this host's index, so all ranks of one job agree on it.
pub fn fingerprint(
    dataset: &crate::config::Dataset,
    config: &Config,
    req: &StreamRequest,
    samples: Option<u64>,
    resume_from: Option<&crate::plan::elastic::Origin>,
) -> String {
    use md5::Digest;
    let mut h = md5::Md5::new();
    h.update(dataset.identity());
    for word in [
        config.host.count as u64,
        req.world_size as u64,
        req.num_workers as u64,
        req.seed,
        req.epoch,
        dataset.share_seed,
        dataset.shuffle_buffer as u64,
        dataset.samples_per_epoch.unwrap_or(0),
        samples.unwrap_or(u64::MAX),
    ] {
        h.update(word.to_le_bytes());
    }
    if dataset.resampled {
        h.update(b"resampled");
    }
    if let Some(origin) = resume_from {
        // An elastic resume's plan is the old checkpoint's too.
        h.update(serde_json::to_vec(origin).expect("an origin serialises"));
    }
    hex::encode(&h.finalize()[..8])
}

#[cfg(test)]
mod tests;
