//! Elastic resume: the rest of an epoch checkpointed at one topology, read at another.
//!
//! A synchronous job checkpoints when every rank has taken the same number of batches, so
//! every old rank's worker `w` has delivered the same number of samples `p_w` (streams are
//! of equal length), and one rank's state says what every old stream consumed: its shuffled
//! output positions `0..p_w`. What is left of old stream `s` is its positions `p_w..C`: a
//! *segment* of a base stream, read exactly as a `start=` resume reads it (the window that
//! holds `p_w`, permuted as before, then on to the end). Nothing consumed is ever read.
//!
//! **Redistribution** (manifest mode only: lengths must be known before reading):
//! 1. Old host `h`'s remainder is its streams' segments in stream order (local rank, then
//!    worker): `Q_h` samples. `R = Σ Q_h`.
//! 2. Every new stream gets `C' = ⌊R / (H'·S')⌋` samples (S' streams per new host), so every
//!    new rank takes as many steps; new host `h` needs `D = S'·C'`. Fewer than `H'·S'`
//!    samples, the end of the order below, are dropped (and reported).
//! 3. **Locality.** New host `h < min(H, H')` first takes up to `D` from the front of old
//!    host `h`'s remainder (assuming host indices name machines: the shards are in its
//!    cache). What is left of the old hosts, in host order, then fills the new hosts that
//!    still need samples, in index order. So 2→4 hosts: new hosts 0 and 1 each read half of
//!    their own old share, 2 and 3 the other halves; 64→32: new host `h` reads old host `h`'s
//!    remainder and then old host `32 + h`'s.
//! 4. New host `h'`'s segments, in that order, are cut into `S'` runs of `C'`: stream
//!    `local rank · K' + worker` takes the s-th run. A new stream reads its segments one
//!    after another, each in its old shuffled order.
//!
//! A checkpoint taken during an elastic epoch resumes the same way: its streams are lists of
//! segments, consumed from the front ([`Origin::from`] chains the hops). The cost is
//! O(old streams × segments) arithmetic, no sample is read, and the next epoch is a normal
//! epoch of the new topology.

use serde::{Deserialize, Serialize};

use crate::plan::mix::EpochMix;
use crate::plan::{self, PlanError, Shape, StreamRequest, Topology};

/// The most streams an elastic resume may deal, counted over the new topology and every hop
/// of its origin chain (`world_size × num_workers` each), times a mix's sources. The split
/// lists every old and new stream's segments, so its time and memory grow with these
/// numbers, and they come from a request: without a bound, one client could make the daemon
/// allocate for four billion streams. 2^18 is 3.6× the streams of a full 8,960-chip pod slice
/// with 8 workers per chip. At the bound, the worst request (a 2-source mix's whole rest for
/// one new stream: 13 million samples in 326,534 pieces) took 0.7 s and 112 MB in a release
/// build on the 2-core development VM, and 262,143 old hosts for one new stream 0.6 s and
/// 200 MB (`redistribute` is linear in the segments); the server plans elastic resumes two
/// at a time.
pub const MAX_STREAMS: u64 = 1 << 18;
/// The most hops of an origin chain (`from`): resumes of resumes, each a resize.
pub const MAX_HOPS: usize = 16;

/// Where a checkpoint was taken: the topology and how far each worker's stream had got.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Origin {
    /// Host count of the daemons that served the old streams (`START.hosts`).
    pub hosts: u32,
    pub world_size: u32,
    pub num_workers: u32,
    /// Samples worker `w`'s stream had delivered, on every rank (index = worker).
    pub positions: Vec<u64>,
    /// The origin of the old streams when they were an elastic resume themselves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<Box<Origin>>,
}

/// A run of a base (non-elastic) stream's shuffled output: positions `from..to`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// The host that served the base stream, and its request.
    pub host: Topology,
    pub req: StreamRequest,
    pub from: u64,
    pub to: u64,
    /// When the base stream is a mix's stream of one of its sources: which, and its quota.
    pub source: Option<SourceOf>,
}

/// Source `index` of a mix, whose streams read `quota` samples of it per epoch (its
/// `samples_per_epoch`, keyed apart: see the server's mix plan).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SourceOf {
    pub index: u32,
    pub quota: u64,
}

impl Segment {
    fn len(&self) -> u64 {
        self.to - self.from
    }
}

/// One stream's share of an elastic resume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ElasticPlan {
    pub segments: Vec<Segment>,
    /// Samples the stream delivers.
    pub samples: u64,
    /// What was left of the epoch at the checkpoint, job-wide.
    pub remainder: u64,
    /// Of it, what no new stream reads (so that all have `C'`), job-wide.
    pub dropped: u64,
}

/// Plans stream `req` (at the new topology `host`) of the rest of `req.epoch` after the
/// checkpoint `origin`.
pub fn plan(
    shape: Shape,
    host: Topology,
    req: &StreamRequest,
    origin: &Origin,
) -> Result<ElasticPlan, PlanError> {
    let local_rank = plan::validate(host, req)?;
    let split = split(shape, host.count, req, origin)?;
    let stream = local_rank * req.num_workers as usize + req.worker as usize;
    Ok(ElasticPlan {
        segments: split.hosts[host.index as usize][stream].clone(),
        samples: split.lengths[req.worker as usize],
        remainder: split.remainder,
        dropped: split.dropped,
    })
}

type Lanes = Vec<Vec<Vec<Segment>>>;

/// Every new stream's segments: `hosts[h][s]`.
pub struct Split {
    pub hosts: Lanes,
    /// Samples of each new worker's stream (the same on every rank).
    pub lengths: Vec<u64>,
    pub remainder: u64,
    pub dropped: u64,
}

/// The redistribution of the module docs, for every new host and stream.
pub fn split(
    shape: Shape,
    hosts: u32,
    req: &StreamRequest,
    origin: &Origin,
) -> Result<Split, PlanError> {
    let counts = shape.counts.ok_or(PlanError::ElasticNeedsManifest)?;
    check_size(req, origin, 1)?;
    if shape.resampled {
        return Err(PlanError::BadOrigin(
            "a resampled dataset has no remainder to redistribute: resume it at its own topology"
                .into(),
        ));
    }
    let (old, old_lengths) = streams(shape, counts, req, origin)?;
    let left: Vec<u64> = (origin.positions.iter().zip(&old_lengths))
        .map(|(p, n)| n - p)
        .collect();
    let consumed: Vec<Vec<u64>> = old
        .iter()
        .map(|streams| {
            (0..streams.len())
                .map(|s| origin.positions[s % origin.num_workers as usize])
                .collect()
        })
        .collect();
    Ok(redistribute(&old, &consumed, hosts, req, Some(&left)))
}

/// Deals what the old streams (`old[h][s]`, of which `consumed[h][s]` samples were read) have
/// left to the new hosts and streams (module docs). `keep`: each old worker's remainder, kept
/// as the new workers' lengths when the ranks and workers are the old ones.
fn redistribute(
    old: &Lanes,
    consumed: &[Vec<u64>],
    hosts: u32,
    req: &StreamRequest,
    keep: Option<&[u64]>,
) -> Split {
    let remainders: Vec<Vec<Segment>> = old
        .iter()
        .zip(consumed)
        .map(|(streams, consumed)| {
            streams
                .iter()
                .zip(consumed)
                .flat_map(|(lane, &p)| after(lane, p))
                .collect()
        })
        .collect();
    let sizes: Vec<u64> = remainders.iter().map(|r| total(r)).collect();
    let remainder: u64 = sizes.iter().sum();
    let lengths = worker_lengths(remainder, req, keep);
    let ranks = (req.world_size / hosts) as usize;
    let demand: u64 = lengths.iter().sum::<u64>() * ranks as u64;
    // Each new host keeps what its old self had left, up to `demand`; the surplus fills the
    // hosts short of it, in order. Cursors and running totals keep this linear in the
    // segments and streams (cutting each piece from the start took 709 s for 262,143 hosts).
    let mut rest: Vec<Cursor> = remainders.iter().map(|r| Cursor::new(r)).collect();
    let mut left = sizes.clone();
    let mut mine: Vec<Vec<Segment>> = vec![Vec::new(); hosts as usize];
    let mut filled = vec![0u64; hosts as usize];
    for h in 0..remainders.len().min(hosts as usize) {
        let n = sizes[h].min(demand);
        mine[h] = rest[h].take(n);
        (filled[h], left[h]) = (n, sizes[h] - n);
    }
    let mut to = 0;
    for h in 0..remainders.len() {
        while left[h] > 0 {
            while to < mine.len() && filled[to] == demand {
                to += 1;
            }
            if to == mine.len() {
                break;
            }
            let n = left[h].min(demand - filled[to]);
            mine[to].extend(rest[h].take(n));
            filled[to] += n;
            left[h] -= n;
        }
    }
    let hosts = mine
        .iter()
        .map(|segments| {
            let mut streams = Cursor::new(segments);
            (0..ranks * lengths.len())
                .map(|s| streams.take(lengths[s % lengths.len()]))
                .collect()
        })
        .collect();
    Split {
        hosts,
        lengths,
        remainder,
        dropped: remainder - demand * mine.len() as u64,
    }
}

/// An elastic resume of a mix: each source's rest redistributed as a dataset's is (`split`),
/// where what an old stream consumed of each source is its interleave's count at its
/// position (the old topology's epoch of the mix, schedule and all: `m`).
pub fn split_mix(
    m: &crate::config::MixDataset,
    hosts: u32,
    req: &StreamRequest,
    origin: &Origin,
) -> Result<Vec<Split>, PlanError> {
    check(origin)?;
    check_size(req, origin, m.sources.len() as u64)?;
    let old_req = StreamRequest {
        world_size: origin.world_size,
        num_workers: origin.num_workers,
        ..*req
    };
    let k = origin.num_workers as usize;
    let (lanes, lens, base_mix) = old_mix_streams(m, origin, &old_req)?;
    for (w, &p) in origin.positions.iter().enumerate() {
        let n: u64 = lens.iter().map(|l| l[w]).sum();
        if p > n {
            return Err(PlanError::BadOrigin(format!(
                "position {p} of worker {w} is past the end of its old stream ({n} samples)"
            )));
        }
    }
    // Each old worker's interleave (the same on every rank): the mix's own order at the
    // base, else the order over what an earlier hop left it.
    let orders: Vec<Option<(EpochMix, Vec<usize>)>> = (0..k)
        .map(|w| match &base_mix {
            Some(mix) => Some((mix.clone(), (0..lens.len()).collect())),
            None => interleave(&lens.iter().map(|l| l[w]).collect::<Vec<_>>()),
        })
        .collect();
    let consumed = consumed_per_source(&orders, &lens, origin, &old_req);
    Ok(lanes
        .iter()
        .zip(&consumed)
        .map(|(lanes, consumed)| redistribute(lanes, consumed, hosts, req, None))
        .collect())
}

/// A mix's old streams, per source: their lanes, each old worker's length of the source,
/// and the mix itself when the origin is the base (not an earlier resume's rest).
type OldMix = (Vec<Lanes>, Vec<Vec<u64>>, Option<EpochMix>);

fn old_mix_streams(
    m: &crate::config::MixDataset,
    origin: &Origin,
    old_req: &StreamRequest,
) -> Result<OldMix, PlanError> {
    let k = origin.num_workers as usize;
    Ok(match &origin.from {
        None => {
            let streams = origin.world_size as u128 * origin.num_workers as u128;
            let mix = m.epoch_mix(old_req.epoch, streams);
            let lanes = (mix.quotas().iter().enumerate())
                .map(|(i, &quota)| {
                    let source = SourceOf {
                        index: i as u32,
                        quota,
                    };
                    base_lanes(origin, old_req, quota, Some(source))
                })
                .collect();
            let lens = mix.quotas().iter().map(|&q| vec![q; k]).collect();
            (lanes, lens, Some(mix))
        }
        Some(earlier) => {
            let prev = split_mix(m, origin.hosts, old_req, earlier)?;
            let lens = prev.iter().map(|s| s.lengths.clone()).collect();
            (prev.into_iter().map(|s| s.hosts).collect(), lens, None)
        }
    })
}

/// `consumed[i][h][s]`: what old stream `s` of old host `h` had read of source `i` at the
/// checkpoint, from its worker's interleave (`orders`) and position.
fn consumed_per_source(
    orders: &[Option<(EpochMix, Vec<usize>)>],
    lens: &[Vec<u64>],
    origin: &Origin,
    old_req: &StreamRequest,
) -> Vec<Vec<Vec<u64>>> {
    let ranks = origin.world_size / origin.hosts;
    let streams = (ranks * origin.num_workers) as usize;
    let mut consumed = vec![vec![vec![0; streams]; origin.hosts as usize]; lens.len()];
    for h in 0..origin.hosts {
        for s in 0..ranks * origin.num_workers {
            let w = (s % origin.num_workers) as usize;
            let stream = StreamRequest {
                rank: h * ranks + s / origin.num_workers,
                worker: w as u32,
                ..*old_req
            };
            let own: Vec<u64> = lens.iter().map(|l| l[w]).collect();
            let counts = taken(
                &orders[w],
                &own,
                plan::stream_key(&stream),
                origin.positions[w],
            );
            for (i, c) in counts.into_iter().enumerate() {
                consumed[i][h as usize][s as usize] = c;
            }
        }
    }
    consumed
}

/// The order of an elastic mix stream whose sources have `lens` samples: the sources with
/// samples left, weighted by them (so each is used up exactly at the end); `None` when fewer
/// than two have any. Returns the order and the sources it ranges over.
pub fn interleave(lens: &[u64]) -> Option<(EpochMix, Vec<usize>)> {
    let live: Vec<usize> = (0..lens.len()).filter(|&i| lens[i] > 0).collect();
    let weights: Vec<u64> = live.iter().map(|&i| lens[i]).collect();
    let mix = EpochMix::single(&weights, weights.iter().sum()).ok()?;
    Some((mix, live))
}

/// Samples of each source (of `lens` each) among the first `at` of a mixed stream ordered
/// by `order` (an `interleave`, or none when at most one source has samples).
fn taken(order: &Option<(EpochMix, Vec<usize>)>, lens: &[u64], key: u64, at: u64) -> Vec<u64> {
    let mut out = vec![0; lens.len()];
    match order {
        Some((mix, live)) => {
            for (&i, c) in live.iter().zip(mix.counts_at(key, at)) {
                out[i] = c;
            }
        }
        None => {
            if let Some(i) = lens.iter().position(|&n| n > 0) {
                out[i] = at;
            }
        }
    }
    out
}

/// Samples each new worker's stream gets (the same on every rank, so every rank takes as
/// many steps): each old worker's remainder when the ranks and workers are those of the
/// checkpoint (so the same topology resumes every stream exactly where it was), else the
/// rank's share `⌊R / W'⌋` dealt evenly to its workers.
fn worker_lengths(remainder: u64, req: &StreamRequest, keep: Option<&[u64]>) -> Vec<u64> {
    let per_rank = remainder / req.world_size as u64;
    if let Some(left) = keep
        && req.num_workers as usize == left.len()
        && left.iter().sum::<u64>() == per_rank
    {
        return left.to_vec();
    }
    let k = req.num_workers as u64;
    (0..k)
        .map(|w| per_rank / k + u64::from(w < per_rank % k))
        .collect()
}

/// The old topology's streams, `[host][stream]`, each as its segments (base streams, or the
/// split of an earlier hop), and each old worker's stream length.
fn streams(
    shape: Shape,
    counts: &[u64],
    req: &StreamRequest,
    origin: &Origin,
) -> Result<(Lanes, Vec<u64>), PlanError> {
    check(origin)?;
    let old_req = StreamRequest {
        world_size: origin.world_size,
        num_workers: origin.num_workers,
        ..*req
    };
    let (lanes, length) = match &origin.from {
        Some(earlier) => {
            let s = split(shape, origin.hosts, &old_req, earlier)?;
            (s.hosts, s.lengths)
        }
        None => {
            let length = plan::stream_samples(counts, shape, origin.hosts, &old_req)
                .ok_or(PlanError::NoSamples)?;
            let lanes = base_lanes(origin, &old_req, length, None);
            (lanes, vec![length; origin.num_workers as usize])
        }
    };
    for (w, (p, n)) in origin.positions.iter().zip(&length).enumerate() {
        if p > n {
            return Err(PlanError::BadOrigin(format!(
                "position {p} of worker {w} is past the end of its old stream ({n} samples)"
            )));
        }
    }
    Ok((lanes, length))
}

/// The old topology's base streams, `[host][stream]`, each one whole segment of `length`.
fn base_lanes(
    origin: &Origin,
    old_req: &StreamRequest,
    length: u64,
    source: Option<SourceOf>,
) -> Lanes {
    let ranks = origin.world_size / origin.hosts;
    (0..origin.hosts)
        .map(|h| {
            (0..ranks * origin.num_workers)
                .map(|s| {
                    vec![Segment {
                        host: Topology {
                            index: h,
                            count: origin.hosts,
                        },
                        req: StreamRequest {
                            rank: h * ranks + s / origin.num_workers,
                            worker: s % origin.num_workers,
                            ..*old_req
                        },
                        from: 0,
                        to: length,
                        source,
                    }]
                })
                .collect()
        })
        .collect()
}

/// Refuses a resume whose split would deal more than [`MAX_STREAMS`] streams (`sources` lanes
/// each) or chain more than [`MAX_HOPS`] origins, before anything is allocated for it.
fn check_size(req: &StreamRequest, origin: &Origin, sources: u64) -> Result<(), PlanError> {
    let streams = |world: u32, workers: u32| world as u64 * workers as u64;
    let mut total = streams(req.world_size, req.num_workers);
    let mut hops = 0;
    let mut at = Some(origin);
    while let Some(o) = at {
        hops += 1;
        if hops > MAX_HOPS {
            return Err(PlanError::BadOrigin(format!(
                "an origin chain of more than {MAX_HOPS} resumes (`from`)"
            )));
        }
        total = total.saturating_add(streams(o.world_size, o.num_workers));
        at = o.from.as_deref();
    }
    if total.saturating_mul(sources.max(1)) > MAX_STREAMS {
        return Err(PlanError::BadOrigin(format!(
            "{total} streams (world_size × num_workers, summed over the new topology and each \
             origin{}) is more than an elastic resume deals ({MAX_STREAMS})",
            if sources > 1 {
                format!(", times {sources} sources")
            } else {
                String::new()
            }
        )));
    }
    Ok(())
}

fn check(o: &Origin) -> Result<(), PlanError> {
    let bad = |what: String| Err(PlanError::BadOrigin(what));
    if o.hosts == 0 || o.world_size == 0 || o.num_workers == 0 {
        return bad("hosts, world_size and num_workers must be at least 1".into());
    }
    if !o.world_size.is_multiple_of(o.hosts) {
        return bad(format!(
            "world_size {} is not divisible by hosts {}",
            o.world_size, o.hosts
        ));
    }
    if o.positions.len() != o.num_workers as usize {
        return bad(format!(
            "{} positions for {} workers: give every worker's position",
            o.positions.len(),
            o.num_workers
        ));
    }
    // (world_size / hosts) × num_workers × hosts ≤ world_size × num_workers < 2^64: the
    // stream count cannot overflow; its bound (MAX_STREAMS) is checked where it is dealt.
    Ok(())
}

fn total(segments: &[Segment]) -> u64 {
    segments.iter().map(Segment::len).sum()
}

/// Consecutive runs of samples of the concatenation of segments, each taken in time
/// proportional to its own segments.
struct Cursor<'a> {
    segments: &'a [Segment],
    /// The segment the next run starts in, and how far into it.
    index: usize,
    offset: u64,
}

impl<'a> Cursor<'a> {
    fn new(segments: &'a [Segment]) -> Self {
        Cursor {
            segments,
            index: 0,
            offset: 0,
        }
    }

    /// The next `n` samples (fewer at the end), as segments.
    fn take(&mut self, mut n: u64) -> Vec<Segment> {
        let mut out = Vec::new();
        while n > 0
            && let Some(s) = self.segments.get(self.index)
        {
            let k = (s.len() - self.offset).min(n);
            if k > 0 {
                let from = s.from + self.offset;
                out.push(Segment {
                    from,
                    to: from + k,
                    ..*s
                });
            }
            (n, self.offset) = (n - k, self.offset + k);
            if self.offset == s.len() {
                (self.index, self.offset) = (self.index + 1, 0);
            }
        }
        out
    }
}

/// What follows the first `lo` samples of the concatenation of `segments`, as segments.
fn after(segments: &[Segment], lo: u64) -> Vec<Segment> {
    let mut out = Vec::new();
    let mut at = 0u64;
    for s in segments {
        let (a, b) = (at, at + s.len());
        at = b;
        if lo < b {
            out.push(Segment {
                from: s.from + (a.max(lo) - a),
                ..*s
            });
        }
    }
    out
}

#[cfg(test)]
mod tests;
