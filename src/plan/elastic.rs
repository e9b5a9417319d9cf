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

impl Origin {
    fn streams_per_host(&self) -> u64 {
        (self.world_size / self.hosts) as u64 * self.num_workers as u64
    }
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
                .flat_map(|(lane, &p)| cut(lane, p, u64::MAX))
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
    // segments and streams (a `cut` from the start per piece took 709 s for 262,143 hosts).
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
/// position. `weights` and `e`: the mix's.
pub fn split_mix(
    weights: &[u64],
    e: u64,
    hosts: u32,
    req: &StreamRequest,
    origin: &Origin,
) -> Result<Vec<Split>, PlanError> {
    check(origin)?;
    check_size(req, origin, weights.len() as u64)?;
    let old_req = StreamRequest {
        world_size: origin.world_size,
        num_workers: origin.num_workers,
        ..*req
    };
    let k = origin.num_workers as usize;
    let ranks = origin.world_size / origin.hosts;
    // Per source: the old streams' lanes, and each old worker's length of it.
    let (lanes, lens, base_mix): (Vec<Lanes>, Vec<Vec<u64>>, _) = match &origin.from {
        None => {
            let mix = crate::plan::mix::Mix::new(weights, e)
                .map_err(|e| PlanError::BadOrigin(format!("the mix: {e}")))?;
            let lanes = (mix.quotas().iter().enumerate())
                .map(|(i, &quota)| {
                    let source = SourceOf {
                        index: i as u32,
                        quota,
                    };
                    base_lanes(origin, &old_req, quota, Some(source))
                })
                .collect();
            let lens = mix.quotas().iter().map(|&q| vec![q; k]).collect();
            (lanes, lens, Some(mix))
        }
        Some(earlier) => {
            let prev = split_mix(weights, e, origin.hosts, &old_req, earlier)?;
            let lens = prev.iter().map(|s| s.lengths.clone()).collect();
            (prev.into_iter().map(|s| s.hosts).collect(), lens, None)
        }
    };
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
    let orders: Vec<Option<(crate::plan::mix::Mix, Vec<usize>)>> = (0..k)
        .map(|w| match &base_mix {
            Some(mix) => Some((mix.clone(), (0..lens.len()).collect())),
            None => interleave(&lens.iter().map(|l| l[w]).collect::<Vec<_>>()),
        })
        .collect();
    // consumed[i][h][s]: what old stream (h, s) read of source i.
    let mut consumed: Vec<Vec<Vec<u64>>> =
        vec![
            vec![vec![0; (ranks * origin.num_workers) as usize]; origin.hosts as usize];
            lens.len()
        ];
    for h in 0..origin.hosts {
        for s in 0..ranks * origin.num_workers {
            let w = (s % origin.num_workers) as usize;
            let stream = StreamRequest {
                rank: h * ranks + s / origin.num_workers,
                worker: w as u32,
                ..old_req
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
    Ok(lanes
        .iter()
        .zip(&consumed)
        .map(|(lanes, consumed)| redistribute(lanes, consumed, hosts, req, None))
        .collect())
}

/// The order of an elastic mix stream whose sources have `lens` samples: the sources with
/// samples left, weighted by them (so each is used up exactly at the end); `None` when fewer
/// than two have any. Returns the order and the sources it ranges over.
pub fn interleave(lens: &[u64]) -> Option<(crate::plan::mix::Mix, Vec<usize>)> {
    let live: Vec<usize> = (0..lens.len()).filter(|&i| lens[i] > 0).collect();
    let weights: Vec<u64> = live.iter().map(|&i| lens[i]).collect();
    let mix = crate::plan::mix::Mix::new(&weights, weights.iter().sum()).ok()?;
    Some((mix, live))
}

/// Samples of each source (of `lens` each) among the first `at` of a mixed stream ordered
/// by `order` (an `interleave`, or none when at most one source has samples).
fn taken(
    order: &Option<(crate::plan::mix::Mix, Vec<usize>)>,
    lens: &[u64],
    key: u64,
    at: u64,
) -> Vec<u64> {
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
    if o.streams_per_host().checked_mul(o.hosts as u64).is_none() {
        return bad("too many streams".into());
    }
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

    /// The next `n` samples (fewer at the end), as `cut` gives them.
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

/// Samples `lo..hi` of the concatenation of `segments`, as segments.
fn cut(segments: &[Segment], lo: u64, hi: u64) -> Vec<Segment> {
    let mut out = Vec::new();
    let mut at = 0u64;
    for s in segments {
        let (a, b) = (at, at + s.len());
        at = b;
        let (x, y) = (a.max(lo), b.min(hi));
        if x < y {
            out.push(Segment {
                from: s.from + (x - a),
                to: s.from + (y - a),
                ..*s
            });
        }
        if b >= hi {
            break;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::shuffle::SplitMix64;
    use std::collections::HashMap;

    /// A plan's samples in output order, named (shard, index), shuffled as the stream does.
    fn shuffled(p: &plan::StreamPlan, window: usize) -> Vec<(usize, u64)> {
        let mut flat: Vec<(usize, u64)> = p
            .pieces
            .iter()
            .flat_map(|x| (x.start..x.end.unwrap()).map(move |i| (x.shard, i)))
            .collect();
        let mut shuffle = crate::plan::shuffle::WindowShuffle::new(p.stream_key, window);
        let mut out = Vec::new();
        while !flat.is_empty() {
            let n = shuffle.next_len().min(flat.len());
            let mut w: Vec<_> = flat.drain(..n).collect();
            shuffle.permute(&mut w);
            out.extend(w);
        }
        out
    }

    /// A base stream's samples in output order.
    fn base_output(shape: Shape, seg: &Segment, window: usize) -> Vec<(usize, u64)> {
        shuffled(
            &plan::plan_stream(shape, seg.host, &seg.req).unwrap(),
            window,
        )
    }

    fn read(shape: Shape, segments: &[Segment], window: usize) -> Vec<(usize, u64)> {
        segments
            .iter()
            .flat_map(|s| base_output(shape, s, window)[s.from as usize..s.to as usize].to_vec())
            .collect()
    }

    #[derive(Clone, Copy)]
    struct Topo {
        hosts: u32,
        ranks: u32,
        workers: u32,
    }

    fn random_topo(rng: &mut SplitMix64) -> Topo {
        Topo {
            hosts: 1 + rng.below(4) as u32,
            ranks: 1 + rng.below(3) as u32,
            workers: 1 + rng.below(3) as u32,
        }
    }

    /// Every stream of the job at `t` for `origin` (None: a normal epoch), read in full.
    fn all_streams(
        shape: Shape,
        t: &Topo,
        seed: u64,
        epoch: u64,
        origin: Option<&Origin>,
        window: usize,
    ) -> Vec<Vec<Vec<(usize, u64)>>> {
        (0..t.hosts)
            .map(|h| {
                (0..t.ranks * t.workers)
                    .map(|s| {
                        let host = Topology {
                            index: h,
                            count: t.hosts,
                        };
                        let req = StreamRequest {
                            seed,
                            epoch,
                            rank: h * t.ranks + s / t.workers,
                            world_size: t.hosts * t.ranks,
                            worker: s % t.workers,
                            num_workers: t.workers,
                        };
                        match origin {
                            None => {
                                let seg = Segment {
                                    host,
                                    req,
                                    from: 0,
                                    to: u64::MAX,
                                    source: None,
                                };
                                base_output(shape, &seg, window)
                            }
                            Some(o) => {
                                read(shape, &plan(shape, host, &req, o).unwrap().segments, window)
                            }
                        }
                    })
                    .collect()
            })
            .collect()
    }

    /// Every rank gets as many samples, and worker w the same on every rank.
    fn assert_equal_ranks(streams: &[Vec<Vec<(usize, u64)>>], workers: u32, case: u32) {
        let lens: Vec<usize> = streams.iter().flatten().map(Vec::len).collect();
        let k = workers as usize;
        for (s, &l) in lens.iter().enumerate() {
            assert_eq!(l, lens[s % k], "case {case}: {lens:?}");
        }
    }

    /// Old topology → new one (→ another), at random checkpoints: what was consumed plus what
    /// the new streams read is every sample of the epoch exactly once, but the drops; equal
    /// per new stream; the same topology gives exactly the `start=` resume.
    #[test]
    fn the_rest_of_the_epoch_is_read_exactly_once_at_any_topology() {
        let mut rng = SplitMix64::new(2026);
        for case in 0..150 {
            let shards = 1 + rng.below(14) as usize;
            let counts: Vec<u64> = (0..shards).map(|_| rng.below(40)).collect();
            let spe = (rng.below(3) == 0).then(|| 1 + rng.below(30));
            let shape = Shape {
                counts: Some(&counts),
                samples_per_epoch: spe,
                share_seed: rng.next_u64(),
                ..Shape::shards(shards)
            };
            let window = 1 + rng.below(20) as usize;
            let (seed, epoch) = (rng.next_u64(), rng.below(3));
            let t0 = random_topo(&mut rng);
            let hops = 1 + rng.below(2);
            let mut origin: Option<Origin> = None;
            let mut consumed: Vec<(usize, u64)> = Vec::new();
            let mut t = t0;
            let mut dropped_by_hops = 0;
            for _ in 0..hops {
                let streams = all_streams(shape, &t, seed, epoch, origin.as_ref(), window);
                assert_equal_ranks(&streams, t.workers, case);
                let positions: Vec<u64> = (0..t.workers as usize)
                    .map(|w| rng.below(streams[0][w].len() as u64 + 1))
                    .collect();
                for host in &streams {
                    for (s, out) in host.iter().enumerate() {
                        consumed.extend(&out[..positions[s % t.workers as usize] as usize]);
                    }
                }
                let next = Origin {
                    hosts: t.hosts,
                    world_size: t.hosts * t.ranks,
                    num_workers: t.workers,
                    positions,
                    from: origin.map(Box::new),
                };
                t = random_topo(&mut rng);
                let req = StreamRequest {
                    seed,
                    epoch,
                    rank: 0,
                    world_size: t.hosts * t.ranks,
                    worker: 0,
                    num_workers: t.workers,
                };
                let s = split(shape, t.hosts, &req, &next).unwrap();
                assert!(
                    s.dropped < (t.hosts * t.ranks * t.workers) as u64,
                    "case {case}"
                );
                dropped_by_hops += s.dropped;
                origin = Some(next);
            }
            let rest = all_streams(shape, &t, seed, epoch, origin.as_ref(), window);
            assert_equal_ranks(&rest, t.workers, case);
            // Everything the original epoch reads, once each.
            let full = all_streams(shape, &t0, seed, epoch, None, window);
            let mut want: HashMap<(usize, u64), u32> = HashMap::new();
            for x in full.iter().flatten().flatten() {
                *want.entry(*x).or_default() += 1;
            }
            let mut got: HashMap<(usize, u64), u32> = HashMap::new();
            for x in consumed.iter().chain(rest.iter().flatten().flatten()) {
                *got.entry(*x).or_default() += 1;
            }
            let missing: u64 = want
                .iter()
                .map(|(k, &n)| n.saturating_sub(*got.get(k).unwrap_or(&0)) as u64)
                .sum();
            let extra: u64 = got
                .iter()
                .map(|(k, &n)| n.saturating_sub(*want.get(k).unwrap_or(&0)) as u64)
                .sum();
            assert_eq!(extra, 0, "case {case}: samples read twice");
            assert_eq!(
                missing, dropped_by_hops,
                "case {case}: lost beyond the drops"
            );
        }
    }

    /// Resuming at the topology of the checkpoint: each stream continues exactly as a
    /// `start=` resume of its own stream would.
    #[test]
    fn the_same_topology_resumes_each_stream_where_it_was() {
        let counts: Vec<u64> = (0..9).map(|i| 5 + i * 3).collect();
        let shape = Shape {
            counts: Some(&counts),
            ..Shape::shards(9)
        };
        let t = Topo {
            hosts: 2,
            ranks: 2,
            workers: 2,
        };
        let full = all_streams(shape, &t, 7, 1, None, 6);
        let origin = Origin {
            hosts: 2,
            world_size: 4,
            num_workers: 2,
            positions: vec![5, 4],
            from: None,
        };
        let rest = all_streams(shape, &t, 7, 1, Some(&origin), 6);
        for h in 0..2 {
            for s in 0..4 {
                let p = origin.positions[s % 2] as usize;
                assert_eq!(rest[h][s], full[h][s][p..], "host {h} stream {s}");
            }
        }
    }

    #[test]
    fn growth_and_shrink_keep_what_each_host_had() {
        let counts = vec![10u64; 64]; // 640: 2 or 4 hosts, 4 consumed each: no drop
        let shape = Shape {
            counts: Some(&counts),
            ..Shape::shards(64)
        };
        let origin = |hosts| Origin {
            hosts,
            world_size: hosts,
            num_workers: 1,
            positions: vec![4],
            from: None,
        };
        let req = |world_size| StreamRequest {
            seed: 1,
            epoch: 0,
            rank: 0,
            world_size,
            worker: 0,
            num_workers: 1,
        };
        // 2 → 4: new hosts 0 and 1 read only their own old host's streams.
        let s = split(shape, 4, &req(4), &origin(2)).unwrap();
        for h in 0..4usize {
            let from: Vec<u32> = s.hosts[h][0].iter().map(|g| g.host.index).collect();
            assert!(from.iter().all(|&o| o == h as u32 % 2), "{h}: {from:?}");
        }
        // 4 → 2: new host h reads old host h's, then old host h + 2's.
        let s = split(shape, 2, &req(2), &origin(4)).unwrap();
        for h in 0..2usize {
            let from: Vec<u32> = s.hosts[h][0].iter().map(|g| g.host.index).collect();
            assert_eq!(from, vec![h as u32, h as u32 + 2]);
        }
    }

    /// The base output of a mix source's segment (its quota as samples_per_epoch, its key
    /// apart, as the server plans it).
    fn source_output(shape: Shape, seg: &Segment, window: usize) -> Vec<(usize, u64)> {
        let src = seg.source.unwrap();
        let shape = Shape {
            samples_per_epoch: Some(src.quota),
            ..shape
        };
        let mut p = plan::plan_stream(shape, seg.host, &seg.req).unwrap();
        p.stream_key = plan::source_key(p.stream_key, src.index);
        let out = shuffled(&p, window);
        out[seg.from as usize..seg.to as usize].to_vec()
    }

    /// A mix checkpointed at random positions resumes on another topology (and another):
    /// per source, what the old streams' interleaves had taken plus what the new streams
    /// read is the epoch's samples of that source exactly once, but the drops; every new
    /// rank reads as many of each source.
    #[test]
    fn a_mix_resumes_elastically_exactly_once_per_source() {
        let mut rng = SplitMix64::new(99);
        for case in 0..40 {
            let a: Vec<u64> = (0..1 + rng.below(6)).map(|_| 5 + rng.below(25)).collect();
            let b: Vec<u64> = (0..1 + rng.below(6)).map(|_| 5 + rng.below(25)).collect();
            let shapes = [
                Shape {
                    counts: Some(&a),
                    ..Shape::shards(a.len())
                },
                Shape {
                    counts: Some(&b),
                    ..Shape::shards(b.len())
                },
            ];
            let weights = [1 + rng.below(4), 1 + rng.below(4)];
            let e = 1 + rng.below(40);
            let window = 1 + rng.below(8) as usize;
            let (seed, epoch) = (rng.next_u64(), rng.below(3));
            let t0 = random_topo(&mut rng);
            let quotas = crate::plan::mix::Mix::new(&weights, e)
                .unwrap()
                .quotas()
                .to_vec();
            // The whole epoch of each source, and what the old streams consumed of it.
            let mut want = [HashMap::new(), HashMap::new()];
            let mut got: [HashMap<(usize, u64), u32>; 2] = [HashMap::new(), HashMap::new()];
            let positions: Vec<u64> = (0..t0.workers).map(|_| rng.below(e + 1)).collect();
            for h in 0..t0.hosts {
                for s in 0..t0.ranks * t0.workers {
                    let req = StreamRequest {
                        seed,
                        epoch,
                        rank: h * t0.ranks + s / t0.workers,
                        world_size: t0.hosts * t0.ranks,
                        worker: s % t0.workers,
                        num_workers: t0.workers,
                    };
                    let mix = crate::plan::mix::Mix::new(&weights, e).unwrap();
                    let taken =
                        mix.counts_at(plan::stream_key(&req), positions[req.worker as usize]);
                    for i in 0..2 {
                        let seg = Segment {
                            host: Topology {
                                index: h,
                                count: t0.hosts,
                            },
                            req,
                            from: 0,
                            to: quotas[i],
                            source: Some(SourceOf {
                                index: i as u32,
                                quota: quotas[i],
                            }),
                        };
                        let out = source_output(shapes[i], &seg, window);
                        for x in &out {
                            *want[i].entry(*x).or_insert(0) += 1;
                        }
                        for x in &out[..taken[i] as usize] {
                            *got[i].entry(*x).or_insert(0) += 1;
                        }
                    }
                }
            }
            let origin = Origin {
                hosts: t0.hosts,
                world_size: t0.hosts * t0.ranks,
                num_workers: t0.workers,
                positions,
                from: None,
            };
            let t = random_topo(&mut rng);
            let req = StreamRequest {
                seed,
                epoch,
                rank: 0,
                world_size: t.hosts * t.ranks,
                worker: 0,
                num_workers: t.workers,
            };
            let splits = split_mix(&weights, e, t.hosts, &req, &origin).unwrap();
            for (i, split) in splits.iter().enumerate() {
                let mut per_rank = HashMap::new();
                for (h, streams) in split.hosts.iter().enumerate() {
                    for (s, segments) in streams.iter().enumerate() {
                        let rank = h as u32 * t.ranks + s as u32 / t.workers;
                        for seg in segments {
                            for x in source_output(shapes[i], seg, window) {
                                *got[i].entry(x).or_insert(0) += 1;
                                *per_rank.entry(rank).or_insert(0u64) += 1;
                            }
                        }
                    }
                }
                let counts: std::collections::HashSet<u64> = (0..t.hosts * t.ranks)
                    .map(|r| *per_rank.get(&r).unwrap_or(&0))
                    .collect();
                assert_eq!(counts.len(), 1, "case {case} source {i}: {per_rank:?}");
                // Sources repeat samples within an epoch when quotas wrap passes: compare counts.
                for (x, &n) in &got[i] {
                    assert!(
                        n <= *want[i].get(x).unwrap_or(&0),
                        "case {case} source {i}: {x:?} read twice"
                    );
                }
                let missing: u32 = want[i]
                    .iter()
                    .map(|(x, &n)| n - got[i].get(x).copied().unwrap_or(0))
                    .sum();
                assert_eq!(missing as u64, split.dropped, "case {case} source {i}");
                // Each source's rest is dealt on its own: fewer than W' drops per source
                // (so fewer than sources × W' for the mix; PROTOCOL.md).
                assert!(
                    split.dropped < (t.hosts * t.ranks) as u64,
                    "case {case} source {i}"
                );
            }
        }
    }

    /// Golden vector: an elastic resume's segments are a contract like any plan (a change is
    /// a protocol-level change).
    #[test]
    fn golden_split() {
        let counts = [5, 9, 3, 12, 7, 1, 8];
        let shape = Shape {
            counts: Some(&counts),
            ..Shape::shards(counts.len())
        };
        let origin = Origin {
            hosts: 2,
            world_size: 4,
            num_workers: 2,
            positions: vec![3, 1],
            from: None,
        };
        let host = Topology { index: 0, count: 1 };
        let req = StreamRequest {
            seed: 7,
            epoch: 3,
            rank: 1,
            world_size: 3,
            worker: 0,
            num_workers: 1,
        };
        let p = plan(shape, host, &req, &origin).unwrap();
        let pinned: Vec<(u32, u32, u32, u64, u64)> = p
            .segments
            .iter()
            .map(|s| (s.host.index, s.req.rank, s.req.worker, s.from, s.to))
            .collect();
        assert_eq!(pinned, GOLDEN_SEGMENTS);
        assert_eq!((p.samples, p.remainder, p.dropped), (8, 24, 0));
    }
    const GOLDEN_SEGMENTS: [(u32, u32, u32, u64, u64); 3] =
        [(0, 1, 1, 1, 5), (1, 2, 0, 3, 5), (1, 2, 1, 1, 3)];

    /// A one-host job of one stream over shards of `counts` samples (a manifest's).
    fn one_stream(counts: &[u64]) -> (Shape<'_>, Topology, StreamRequest) {
        let shape = Shape {
            counts: Some(counts),
            ..Shape::shards(counts.len())
        };
        let req = StreamRequest {
            seed: 0,
            epoch: 0,
            rank: 0,
            world_size: 1,
            worker: 0,
            num_workers: 1,
        };
        (shape, Topology { index: 0, count: 1 }, req)
    }

    #[test]
    fn bad_origins_are_refused_with_what_is_wrong() {
        let counts = vec![10u64; 4];
        let (shape, host, req) = one_stream(&counts);
        let o = |hosts, world_size, positions: Vec<u64>| Origin {
            hosts,
            world_size,
            num_workers: positions.len().max(1) as u32,
            positions,
            from: None,
        };
        let e = |o: Origin| plan(shape, host, &req, &o).unwrap_err().to_string();
        assert!(e(o(2, 3, vec![0])).contains("not divisible"));
        assert!(e(o(1, 1, vec![41])).contains("past the end"));
        let mut two = o(1, 1, vec![0, 0]);
        two.num_workers = 3;
        assert!(e(two).contains("2 positions for 3 workers"));
        let no_manifest = Shape::shards(4);
        assert_eq!(
            plan(no_manifest, host, &req, &o(1, 1, vec![0])).unwrap_err(),
            PlanError::ElasticNeedsManifest
        );
    }

    /// The absurd topologies of a hostile request are refused before anything is allocated
    /// for them (they used to abort the daemon, or take 14 s and 7.5 GB at 40,000,000).
    #[test]
    fn requests_past_the_bound_are_refused_before_any_work() {
        let counts = vec![300_000u64; 4];
        let (shape, host, req) = one_stream(&counts);
        let origin = |world_size, num_workers| Origin {
            hosts: 1,
            world_size,
            num_workers,
            positions: vec![0; num_workers as usize],
            from: None,
        };
        let refused = |r: Result<ElasticPlan, PlanError>| match r {
            Err(PlanError::BadOrigin(m)) => m,
            other => panic!("not refused: {other:?}"),
        };
        let m = refused(plan(shape, host, &req, &origin(4_000_000_000, 1)));
        assert!(m.contains("4000000001 streams"), "{m}");
        assert!(m.contains(&format!("({MAX_STREAMS})")), "{m}");
        refused(plan(shape, host, &req, &origin(40_000_000, 1)));
        // The new topology counts as well as the old one.
        let wide = StreamRequest {
            world_size: 1 << 18,
            ..req
        };
        refused(plan(shape, host, &wide, &origin(1, 1)));
        // A mix's split is per source.
        let e = split_mix(&[1, 1, 1], 30, 1, &req, &origin(1 << 17, 1)).err();
        assert!(matches!(e, Some(PlanError::BadOrigin(m)) if m.contains("times 3 sources")));
        // A chain of resumes is bounded in hops, whatever its streams.
        let mut chain = origin(1, 1);
        for _ in 0..MAX_HOPS {
            chain = Origin {
                from: Some(Box::new(chain)),
                ..origin(1, 1)
            };
        }
        assert!(refused(plan(shape, host, &req, &chain)).contains("more than 16 resumes"));
        // Just inside the bound is planned: one new stream reads every old stream's rest.
        let at = MAX_STREAMS as u32 - 1;
        let p = plan(shape, host, &req, &origin(1, at)).unwrap();
        let per_stream = 1_200_000 / at as u64;
        assert_eq!(
            (p.remainder, p.samples),
            (per_stream * at as u64, per_stream * at as u64)
        );
    }
}
