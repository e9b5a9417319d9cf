//! The epoch plan: which samples a stream reads, in which order. A pure function of the
//! dataset's shape (shard count, per-shard sample counts when a manifest gives them,
//! `share_seed`, `samples_per_epoch`), the host topology and the request (seed, epoch,
//! world_size, rank, num_workers, worker): every host computes the same plan with no
//! communication, and nothing here depends on timing or cache state. A plan is a list of
//! [`Piece`]s: runs of one shard's samples, in tar order.
//!
//! **Shard-level mode** (no manifest: sample counts unknown until a shard is read), as
//! webdataset does it, with two changes:
//! 1. **Host share, stable across epochs and runs.** The shard list is permuted with the
//!    dataset's `share_seed` (default 0), never the run's seed, and dealt round-robin to the
//!    hosts, so a host reads the same shards every epoch of every run and its cache keeps
//!    serving it. Only the `S mod H` shards left over rotate: leftover j goes to host
//!    `(j + epoch) mod H`, so no host always reads more than the others.
//! 2. **Epoch order.** The host's shards are permuted with (seed, epoch, host).
//! 3. **Ranks, then workers.** Local rank ρ takes the positions `i ≡ ρ + epoch (mod L)` of that
//!    order (L = ranks per host), and worker w the positions `j ≡ w + epoch (mod K)` of its
//!    rank's list: ranks (and workers) differ by at most one shard, and which ones get the
//!    extra shard changes every epoch.
//!
//! **Sample-level mode** (a manifest gives every shard's sample count): exact, equal epochs.
//! 1. **Host share by samples.** The shards, permuted with `share_seed`, are concatenated and
//!    the sample sequence cut into H equal ranges (±1); a shard on a boundary is split between
//!    two hosts. Stable across epochs and runs, balanced by samples.
//! 2. **Passes.** Pass p of a host is its pieces permuted with (seed, p, host), concatenated;
//!    the host's sample sequence is pass 0, pass 1, ... end to end.
//! 3. **Equal counts.** Every stream (rank × worker) of every host gets `C = ⌊⌊N/H⌋ / S⌋`
//!    samples (N samples in all, S streams per host), or exactly `samples_per_epoch` when that
//!    is set. Epoch e reads pass e (the last `N_h − C·S` samples of the pass are dropped: fewer
//!    than S + 1 per host, and which ones changes with the epoch), or with
//!    `samples_per_epoch` = E the samples `[e·E·S, (e+1)·E·S)` of the endless sequence, wrapping
//!    into the next pass like webdataset's `with_epoch`.
//! 4. **Streams.** Stream s = local rank · K + worker takes the s-th run of C samples: a few
//!    contiguous pieces, so a stream touches few shards.
//!
//! In both modes every stream's samples are then shuffled in windows (`shuffle.rs`), which is
//! what makes an exact resume cost one window.

pub mod elastic;
pub mod mix;
pub mod passes;
pub mod request;
pub mod shuffle;

use std::sync::Arc;

use shuffle::{SplitMix64, tag};

use crate::config::ShareCache;
pub use crate::config::host::Topology;

impl crate::config::Dataset {
    /// What the plan needs to know about this dataset.
    pub fn shape(&self) -> Shape<'_> {
        Shape {
            num_shards: self.shards.len(),
            counts: self.counts.as_deref(),
            share_seed: self.share_seed,
            samples_per_epoch: self.samples_per_epoch,
            resampled: self.resampled,
            epoch_base: None,
            share: Some(&self.share),
            passes: passes::Passes::default(),
        }
    }
}

/// What a trainer asks for: its place in the job and the epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamRequest {
    pub seed: u64,
    pub epoch: u64,
    pub rank: u32,
    pub world_size: u32,
    pub worker: u32,
    pub num_workers: u32,
}

/// What the plan needs to know about a dataset.
#[derive(Debug, Clone, Copy)]
pub struct Shape<'a> {
    pub num_shards: usize,
    /// Samples in each shard (a manifest's): sample-level mode. `None`: shard-level mode.
    pub counts: Option<&'a [u64]>,
    pub share_seed: u64,
    /// Samples per stream per epoch, fixed (sample-level mode only).
    pub samples_per_epoch: Option<u64>,
    /// Streams draw pieces of the host's share with replacement (needs `samples_per_epoch`).
    pub resampled: bool,
    /// With `samples_per_epoch`: where the epoch starts in the host's endless sequence, when
    /// earlier epochs did not all read `samples_per_epoch` per stream (a mix whose weights
    /// changed: each source continues where it was). `None`: `epoch × samples_per_epoch ×
    /// streams`.
    pub epoch_base: Option<u128>,
    /// The dataset's [`ShareCache`], when it has one (the daemon's datasets do).
    pub share: Option<&'a ShareCache>,
    /// With `samples_per_epoch`: the topologies the job had before this one, so that its
    /// passes go on across them ([`passes`]). None: the job never resized.
    pub passes: passes::Passes<'a>,
}

impl Shape<'_> {
    /// A dataset planned by whole shards.
    pub fn shards(num_shards: usize) -> Shape<'static> {
        Shape {
            num_shards,
            counts: None,
            share_seed: 0,
            samples_per_epoch: None,
            resampled: false,
            epoch_base: None,
            share: None,
            passes: passes::Passes::default(),
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PlanError {
    #[error("world_size must be at least 1")]
    ZeroWorld,
    #[error("rank {rank} must be less than world_size {world_size}")]
    RankOutOfRange { rank: u32, world_size: u32 },
    #[error(
        "world_size {world_size} is not divisible by the host count {hosts}: every host serves as many ranks; set host.count in the daemon's config to the number of hosts the job runs on (or host.count = \"auto\")"
    )]
    UnevenHosts { world_size: u32, hosts: u32 },
    #[error(
        "rank {rank} is not on this host: host {host} of {hosts} serves ranks {first}..={last} of world_size {world_size}; rank {rank} is host {owner}'s: each host's daemon needs its own host.index (\"auto\" on a TPU VM)",
        owner = .rank / (.world_size / .hosts).max(1)
    )]
    RankNotOnHost {
        rank: u32,
        world_size: u32,
        host: u32,
        hosts: u32,
        first: u32,
        last: u32,
    },
    #[error("num_workers must be at least 1")]
    ZeroWorkers,
    #[error("worker {worker} must be less than num_workers {num_workers}")]
    WorkerOutOfRange { worker: u32, num_workers: u32 },
    #[error("samples_per_epoch is set but this host's share of the dataset has no samples")]
    NoSamples,
    #[error("epoch {epoch} is past the end of what samples_per_epoch can number")]
    EpochTooLarge { epoch: u64 },
    #[error(
        "an elastic resume (resume_from) needs the dataset's sample counts: give it a manifest (`shardd index`)"
    )]
    ElasticNeedsManifest,
    #[error("resume_from: {0}")]
    BadOrigin(String),
    #[error("history: {0}")]
    BadHistory(String),
}

/// A run of one shard's samples, in tar order: samples `start..end` (`end: None` = to the
/// end of the shard; shard-level plans read whole shards).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    pub shard: usize,
    pub start: u64,
    pub end: Option<u64>,
}

/// One stream's share of an epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamPlan {
    /// What the stream reads, in order.
    pub pieces: Vec<Piece>,
    /// Keys the stream's sample shuffle: (seed, epoch, rank, worker, num_workers).
    pub stream_key: u64,
    /// Samples the stream delivers, when known (sample-level mode).
    pub samples: Option<u64>,
    /// Samples this host leaves out this epoch so that every stream gets as many.
    pub dropped: u64,
    /// The pass over the host's share this stream starts in (sample-level mode; with
    /// `samples_per_epoch` an epoch may start in a later pass).
    pub pass: u64,
}

impl StreamPlan {
    /// The shards the stream reads, in order (a shard may appear twice when it wraps).
    pub fn shards(&self) -> impl Iterator<Item = usize> + '_ {
        self.pieces.iter().map(|p| p.shard)
    }
}

/// Plans one stream, or says why the request cannot be served by this host.
pub fn plan_stream(
    shape: Shape,
    host: Topology,
    req: &StreamRequest,
) -> Result<StreamPlan, PlanError> {
    let local_rank = validate(host, req)?;
    let stream_key = stream_key(req);
    match shape.counts {
        Some(counts) if shape.resampled => plan_resampled(counts, shape, host, stream_key),
        None => Ok(StreamPlan {
            pieces: plan_shards(shape, host, req, local_rank)
                .into_iter()
                .map(|shard| Piece {
                    shard,
                    start: 0,
                    end: None,
                })
                .collect(),
            stream_key,
            samples: None,
            dropped: 0,
            pass: 0,
        }),
        Some(counts) => plan_samples(counts, shape, host, req, local_rank, stream_key),
    }
}

/// Keys a stream's shuffle (and a mix's interleave): (seed, epoch, rank, worker, num_workers).
pub fn stream_key(req: &StreamRequest) -> u64 {
    shuffle::key(&[
        tag::STREAM,
        req.seed,
        req.epoch,
        req.rank as u64,
        req.worker as u64,
        req.num_workers as u64,
    ])
}

/// The shuffle key of a mix source's stream: the stream's own, keyed apart per source so the
/// sources do not share window orders.
pub fn source_key(stream_key: u64, source: u32) -> u64 {
    shuffle::key(&[tag::MIX_SOURCE, stream_key, source as u64])
}

fn plan_shards(shape: Shape, host: Topology, req: &StreamRequest, local_rank: usize) -> Vec<usize> {
    let ranks_per_host = (req.world_size / host.count) as u64;
    let workers = req.num_workers as u64;
    let mut order = host_shards(shape, host, req.epoch);
    let mut rng = SplitMix64::new(shuffle::key(&[
        tag::EPOCH_ORDER,
        req.seed,
        req.epoch,
        host.index as u64,
    ]));
    shuffle::shuffle(&mut order, &mut rng);
    let rank_slot = ((local_rank as u64 + req.epoch % ranks_per_host) % ranks_per_host) as usize;
    let worker_slot = ((req.worker as u64 + req.epoch % workers) % workers) as usize;
    order
        .into_iter()
        .skip(rank_slot)
        .step_by(ranks_per_host as usize)
        .skip(worker_slot)
        .step_by(workers as usize)
        .collect()
}

/// The shard-level share of a host in one epoch: its fixed shards, in ascending position of
/// the permutation keyed by `share_seed`, then the leftovers that fall to it this epoch.
pub fn host_shards(shape: Shape, host: Topology, epoch: u64) -> Vec<usize> {
    let num_shards = shape.num_shards;
    let all = share_order(shape);
    let hosts = host.count as usize;
    let fixed = num_shards / hosts * hosts;
    let leftovers = all[fixed..]
        .iter()
        .enumerate()
        .filter(|(j, _)| (*j as u64 + epoch) % hosts as u64 == host.index as u64)
        .map(|(_, &s)| s);
    all[..fixed]
        .iter()
        .skip(host.index as usize)
        .step_by(hosts)
        .copied()
        .chain(leftovers)
        .collect()
}

/// Every shard this host may read in some epoch: what `warm` fills the cache with.
pub fn warm_shards(shape: Shape, host: Topology) -> Vec<usize> {
    match shape.counts {
        Some(counts) => host_pieces(counts, shape, host)
            .0
            .iter()
            .map(|p| p.shard)
            .collect(),
        None => {
            let all = share_order(shape);
            let fixed = shape.num_shards / host.count as usize * host.count as usize;
            let mut mine = host_shards(shape, host, 0);
            mine.retain(|s| !all[fixed..].contains(s));
            mine.extend_from_slice(&all[fixed..]);
            mine
        }
    }
}

/// The shard list permuted by `share_seed`.
fn share_order(shape: Shape) -> Arc<[usize]> {
    let compute = || {
        let mut all: Vec<usize> = (0..shape.num_shards).collect();
        shuffle::shuffle(
            &mut all,
            &mut SplitMix64::new(shuffle::key(&[tag::HOST_SHARE, shape.share_seed])),
        );
        Arc::from(all)
    };
    match shape.share {
        Some(cache) => cache.order.get_or_init(compute).clone(),
        None => compute(),
    }
}

/// Running sample counts along the share order (see [`ShareCache`]).
fn share_ends(shape: Shape, counts: &[u64]) -> Arc<[u64]> {
    let compute = || {
        let mut at = 0u64;
        share_order(shape)
            .iter()
            .map(|&shard| {
                at = at.saturating_add(counts[shard]);
                at
            })
            .collect()
    };
    match shape.share {
        Some(cache) => cache.ends.get_or_init(compute).clone(),
        None => compute(),
    }
}

/// A host's pieces (share order) and the total samples of the dataset.
fn host_pieces(counts: &[u64], shape: Shape, host: Topology) -> (Vec<Piece>, u128) {
    let (spans, total) = host_spans(counts, shape, host);
    (spans.into_iter().map(|s| s.piece).collect(), total)
}

/// A host's pieces (share order) with where each lies in the share order, and the total
/// samples of the dataset: the shards whose samples fall in the host's range, found by
/// binary search on the running counts.
fn host_spans(counts: &[u64], shape: Shape, host: Topology) -> (Vec<passes::Span>, u128) {
    let order = share_order(shape);
    let ends = share_ends(shape, counts);
    let total = ends.last().copied().unwrap_or(0) as u128;
    let (h, hosts) = (host.index as u128, host.count as u128);
    let (lo, hi) = (total * h / hosts, total * (h + 1) / hosts);
    let mut pieces = Vec::new();
    let first = ends.partition_point(|&end| (end as u128) <= lo);
    for i in first..order.len() {
        let shard = order[i];
        let b = ends[i] as u128;
        let a = b - counts[shard] as u128;
        if a >= hi {
            break;
        }
        let (x, y) = (a.max(lo), b.min(hi));
        if x < y {
            pieces.push(passes::Span {
                piece: Piece {
                    shard,
                    start: (x - a) as u64,
                    end: Some((y - a) as u64),
                },
                at: x,
            });
        }
    }
    (pieces, total)
}

fn plan_samples(
    counts: &[u64],
    shape: Shape,
    host: Topology,
    req: &StreamRequest,
    local_rank: usize,
    stream_key: u64,
) -> Result<StreamPlan, PlanError> {
    let (spans, total) = host_spans(counts, shape, host);
    let here: u128 = spans.iter().map(|s| len(&s.piece) as u128).sum();
    let streams = (req.world_size / host.count) as u128 * req.num_workers as u128;
    let resized = !shape.passes.hops.is_empty() && shape.samples_per_epoch.is_some();
    let stream = local_rank as u128 * req.num_workers as u128 + req.worker as u128;
    let epoch = req.epoch as u128;
    let (per_stream, epoch_start, dropped) = match shape.samples_per_epoch {
        None => {
            let c = total / host.count as u128 / streams;
            (c, epoch.checked_mul(here), here - c * streams)
        }
        Some(e) => {
            if here == 0 {
                return Err(PlanError::NoSamples);
            }
            let e = e as u128;
            // Up to 2^64 · 2^64 · 2^64: past u128 for absurd epochs, refused below.
            let start = match shape.epoch_base {
                _ if resized => {
                    let job = req.world_size as u128 * req.num_workers as u128;
                    let first = shape.passes.first_epoch();
                    passes::position(&shape, job, streams, first, req.epoch)
                }
                Some(base) => Some(base),
                None => epoch.checked_mul(e).and_then(|x| x.checked_mul(streams)),
            };
            (e, start, 0)
        }
    };
    // The host's sequence: its passes, after a head when the job was resized.
    let sequence = if resized {
        let spans_of = |t: Topology| host_spans(counts, shape, t).0;
        passes::sequence(&shape, req.seed, host, total, &spans_of)?
    } else {
        passes::Sequence::new(spans, Vec::new(), req.seed, host)
    };
    let head = sequence.head_len();
    // The stream's first sample in the host's endless sequence; its pass must fit a u64.
    let from = epoch_start
        .and_then(|s| s.checked_add(stream * per_stream))
        .filter(|from| {
            from.checked_add(per_stream)
                .is_some_and(|end| end.saturating_sub(head) / here.max(1) <= u64::MAX as u128)
        });
    let Some(from) = from else {
        return Err(PlanError::EpochTooLarge { epoch: req.epoch });
    };
    Ok(StreamPlan {
        pieces: sequence.take(from, per_stream),
        stream_key,
        samples: Some(per_stream as u64),
        dropped: dropped as u64,
        pass: (from.saturating_sub(head) / here.max(1)) as u64,
    })
}

/// Samples every stream of a sample-level epoch delivers at `hosts` hosts (`plan_samples`'s
/// `C`); `None` when the host's share is empty and `samples_per_epoch` is set.
pub fn stream_samples(
    counts: &[u64],
    shape: Shape,
    hosts: u32,
    req: &StreamRequest,
) -> Option<u64> {
    let streams = (req.world_size / hosts) as u128 * req.num_workers as u128;
    match shape.samples_per_epoch {
        Some(e) => Some(e),
        None => {
            let total: u128 = counts.iter().map(|&n| n as u128).sum();
            Some((total / hosts as u128 / streams) as u64)
        }
    }
}

/// `samples_per_epoch` samples drawn from the host's pieces with replacement, a piece at a
/// time (webdataset's `resampled=True`, deterministic): piece `i` of the stream is drawn
/// uniformly by a generator keyed (seed, epoch, stream), the last one cut short.
fn plan_resampled(
    counts: &[u64],
    shape: Shape,
    host: Topology,
    stream_key: u64,
) -> Result<StreamPlan, PlanError> {
    // No piece is empty (`host_spans`).
    let (pieces, _) = host_pieces(counts, shape, host);
    let want = shape.samples_per_epoch.unwrap_or(0);
    if pieces.is_empty() && want > 0 {
        return Err(PlanError::NoSamples);
    }
    let mut rng = SplitMix64::new(shuffle::key(&[tag::RESAMPLE, stream_key]));
    let mut out = Vec::new();
    let mut left = want;
    while left > 0 {
        let mut p = pieces[rng.below(pieces.len() as u64) as usize];
        let n = len(&p).min(left);
        p.end = Some(p.start + n);
        left -= n;
        out.push(p);
    }
    Ok(StreamPlan {
        pieces: out,
        stream_key,
        samples: Some(want),
        dropped: 0,
        pass: 0,
    })
}

fn len(p: &Piece) -> u64 {
    p.end.expect("sample-level pieces are bounded") - p.start
}

/// Checks the request against the topology; returns the rank's index among this host's ranks.
pub(crate) fn validate(host: Topology, req: &StreamRequest) -> Result<usize, PlanError> {
    if req.world_size == 0 {
        return Err(PlanError::ZeroWorld);
    }
    if req.rank >= req.world_size {
        return Err(PlanError::RankOutOfRange {
            rank: req.rank,
            world_size: req.world_size,
        });
    }
    if !req.world_size.is_multiple_of(host.count) {
        return Err(PlanError::UnevenHosts {
            world_size: req.world_size,
            hosts: host.count,
        });
    }
    let per_host = req.world_size / host.count;
    let first = host.index * per_host;
    if !(first..first + per_host).contains(&req.rank) {
        return Err(PlanError::RankNotOnHost {
            rank: req.rank,
            world_size: req.world_size,
            host: host.index,
            hosts: host.count,
            first,
            last: first + per_host - 1,
        });
    }
    if req.num_workers == 0 {
        return Err(PlanError::ZeroWorkers);
    }
    if req.worker >= req.num_workers {
        return Err(PlanError::WorkerOutOfRange {
            worker: req.worker,
            num_workers: req.num_workers,
        });
    }
    Ok((req.rank - first) as usize)
}

#[cfg(test)]
mod tests;
