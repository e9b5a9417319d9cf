//! Passes across a resize: the epochs after a job moved to another topology continue the pass
//! over the data that was in progress, sample for sample.
//!
//! With `samples_per_epoch` (and for a mix's sources) a host's epochs are consecutive runs of
//! its *sequence*, pass after pass over its share (`take`). Every topology cuts its host
//! shares from the same coordinates, the shards in share order, concatenated: host h of H
//! owns `[N·h/H, N·(h+1)/H)`. A resize changes the shares, so the new hosts' passes cannot
//! simply go on from the old position. Instead each new host's sequence starts with a
//! **head**: what the old hosts had not yet read of the pass (or head) each was in when the
//! job left the old topology, dealt to the new hosts as many to each (±1), each first keeping
//! what lies in its own share (old host by old host, in the old order), the rest filling the
//! hosts still short. Then come its own passes. So every sample of the interrupted pass is
//! read once (in the old pass or in a head), every new host ends its head within a sample of
//! the others, and only then starts the next pass: at every epoch boundary the samples' reads
//! differ by at most one, as in a job that never resized (with equal host shares). A chain of
//! resizes repeats the rule, the old hosts' sequences having heads of their own; an old host
//! that stands exactly at the end of a pass while another is past it passes on its whole next
//! pass (`unit_rest`).
//!
//! The request carries the topologies before its own, `history` (a [`Hop`] each: hosts,
//! world size, workers, and the last epoch counted in that topology's sequences, normally the
//! epoch it was resized in, which its elastic resume finished). A host of the current
//! topology counts its epochs from the last hop's `last_epoch + 1`. With no history the
//! sequence is the plain one: plans are those of a job that never resized.
//!
//! The cost is one pass order per old host per hop: O(hops × (pieces of the dataset + hosts)),
//! bounded by [`MAX_HOSTS`] old hosts and [`crate::plan::elastic::MAX_HOPS`] hops.

use serde::{Deserialize, Serialize};

use super::{Piece, PlanError, Shape, Topology, shuffle, tag};
use crate::config::MixDataset;

/// The most hosts the hops of a history may have together: each is a sequence to order.
pub const MAX_HOSTS: u64 = 1 << 18;

/// A topology the job had before its current one, and the last epoch its sequences counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hop {
    pub hosts: u32,
    pub world_size: u32,
    pub num_workers: u32,
    pub last_epoch: u64,
}

impl Hop {
    fn host_streams(&self) -> u128 {
        (self.world_size / self.hosts) as u128 * self.num_workers as u128
    }

    fn job_streams(&self) -> u128 {
        self.world_size as u128 * self.num_workers as u128
    }
}

/// What a plan needs of the job's history: the hops, and for a mix's source the mix (its
/// quotas move a source's position by more than `samples_per_epoch` × streams).
#[derive(Debug, Clone, Copy, Default)]
pub struct Passes<'a> {
    pub hops: &'a [Hop],
    pub mix: Option<(&'a MixDataset, usize)>,
}

impl Passes<'_> {
    /// The first epoch of the current topology's sequences.
    pub fn first_epoch(&self) -> u64 {
        self.hops.last().map_or(0, |h| h.last_epoch + 1)
    }
}

/// The history of the epochs after an elastic resume of `epoch` from `origin` under
/// `history`: the topology that planned that epoch (the oldest of the origin chain) joins it,
/// with `epoch` its last (the Python client's `next_history`).
pub fn after(history: &[Hop], origin: &crate::plan::elastic::Origin, epoch: u64) -> Vec<Hop> {
    let mut base = origin;
    while let Some(earlier) = &base.from {
        base = earlier;
    }
    let mut out = history.to_vec();
    out.push(Hop {
        hosts: base.hosts,
        world_size: base.world_size,
        num_workers: base.num_workers,
        last_epoch: epoch,
    });
    out
}

/// Checks a request's history: each hop a topology (hosts divide the world size, workers
/// at least 1), last epochs increasing and before `epoch`, and bounded in hops and hosts.
pub fn check(hops: &[Hop], epoch: u64) -> Result<(), PlanError> {
    let bad = |m: String| Err(PlanError::BadHistory(m));
    if hops.len() > crate::plan::elastic::MAX_HOPS {
        return bad(format!(
            "{} hops, more than {}",
            hops.len(),
            crate::plan::elastic::MAX_HOPS
        ));
    }
    let hosts: u64 = hops.iter().map(|h| h.hosts as u64).sum();
    if hosts > MAX_HOSTS {
        return bad(format!(
            "{hosts} hosts over its hops, more than {MAX_HOSTS}"
        ));
    }
    let mut after = None;
    for (i, h) in hops.iter().enumerate() {
        if h.hosts == 0 || h.world_size == 0 || h.num_workers == 0 {
            return bad(format!(
                "hop {i}: hosts, world_size and num_workers must be at least 1"
            ));
        }
        if !h.world_size.is_multiple_of(h.hosts) {
            return bad(format!(
                "hop {i}: world_size {} is not divisible by its hosts {}",
                h.world_size, h.hosts
            ));
        }
        if after.is_some_and(|a| h.last_epoch <= a) {
            return bad(format!(
                "hop {i}: last_epoch {} does not come after the hop before's",
                h.last_epoch
            ));
        }
        after = Some(h.last_epoch);
    }
    if let Some(last) = after
        && last >= epoch
    {
        return bad(format!(
            "the last hop's last_epoch {last} is not before the requested epoch {epoch}"
        ));
    }
    Ok(())
}

/// Where the hosts of a topology (`host_streams` streams each, `job_streams` in the job)
/// whose sequences start at epoch `from` stand at the start of epoch `to`.
pub(crate) fn position(
    shape: &Shape,
    job_streams: u128,
    host_streams: u128,
    from: u64,
    to: u64,
) -> Option<u128> {
    match shape.passes.mix {
        Some((m, i)) => {
            let to = m.epoch_bases(to, job_streams, host_streams)?[i];
            let from = m.epoch_bases(from, job_streams, host_streams)?[i];
            to.checked_sub(from)
        }
        None => ((to - from) as u128)
            .checked_mul(shape.samples_per_epoch? as u128)?
            .checked_mul(host_streams),
    }
}

/// A run of one shard's samples and where its first lies in the share order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Span {
    pub piece: Piece,
    pub at: u128,
}

impl Span {
    fn len(&self) -> u128 {
        super::len(&self.piece) as u128
    }

    /// Its samples `x..y` (offsets into it).
    fn cut(&self, x: u128, y: u128) -> Span {
        Span {
            piece: Piece {
                shard: self.piece.shard,
                start: self.piece.start + x as u64,
                end: Some(self.piece.start + y as u64),
            },
            at: self.at + x,
        }
    }
}

/// Samples `lo..hi` of the concatenation of `spans`, appended to `out`.
pub(crate) fn extract(spans: &[Span], lo: u128, hi: u128, out: &mut Vec<Span>) {
    let mut start = 0u128;
    for s in spans {
        let end = start + s.len();
        let (x, y) = (lo.max(start), hi.min(end));
        if x < y {
            out.push(s.cut(x - start, y - start));
        }
        if end >= hi {
            break;
        }
        start = end;
    }
}

/// A host's endless sequence: its head, then pass after pass over its share.
pub(crate) struct Sequence {
    head: Vec<Span>,
    head_len: u128,
    /// The host's share, in share order.
    share: Vec<Span>,
    /// Samples in the share.
    pub here: u128,
    seed: u64,
    host: Topology,
}

impl Sequence {
    pub fn new(share: Vec<Span>, head: Vec<Span>, seed: u64, host: Topology) -> Sequence {
        Sequence {
            head_len: head.iter().map(Span::len).sum(),
            here: share.iter().map(Span::len).sum(),
            head,
            share,
            seed,
            host,
        }
    }

    pub fn head_len(&self) -> u128 {
        self.head_len
    }

    /// Pass `p`: the share's pieces permuted with (seed, p, host), rotated by an offset drawn
    /// from the same key (so the samples an epoch leaves out at a pass's end change).
    fn pass(&self, p: u64) -> (Vec<Span>, u128) {
        let mut rng = shuffle::SplitMix64::new(shuffle::key(&[
            tag::PASS_ORDER,
            self.seed,
            p,
            self.host.index as u64,
        ]));
        let mut order = self.share.clone();
        shuffle::shuffle(&mut order, &mut rng);
        let rotate = rng.below(self.here as u64) as u128;
        (order, rotate)
    }

    /// Samples `x..y` of pass `p` (x < y ≤ here), appended to `out`.
    fn pass_range(&self, p: u64, x: u128, y: u128, out: &mut Vec<Span>) {
        let here = self.here;
        let (order, rotate) = self.pass(p);
        let (a, b) = (x + rotate, y + rotate);
        if b <= here {
            extract(&order, a, b, out);
        } else if a >= here {
            extract(&order, a - here, b - here, out);
        } else {
            extract(&order, a, here, out);
            extract(&order, 0, b - here, out);
        }
    }

    /// Samples `from..from + count` of the sequence. The caller checks that every pass index
    /// fits a u64.
    pub fn take(&self, from: u128, count: u128) -> Vec<Piece> {
        let mut out = Vec::new();
        let (mut at, end) = (from, from + count);
        if at < self.head_len {
            let to = end.min(self.head_len);
            extract(&self.head, at, to, &mut out);
            at = to;
        }
        while at < end {
            let off = at - self.head_len;
            let p = (off / self.here) as u64;
            let pass_start = p as u128 * self.here;
            let y = (end - self.head_len).min(pass_start + self.here) - pass_start;
            self.pass_range(p, off - pass_start, y, &mut out);
            at = self.head_len + pass_start + y;
        }
        out.into_iter().map(|s| s.piece).collect()
    }

    /// How far into its own passes the host is at `at` (None: still in its head).
    fn past_head(&self, at: u128) -> Option<u128> {
        at.checked_sub(self.head_len)
    }

    /// What is left, at position `at`, of the pass (or head) the host is in. At the boundary
    /// between two: nothing, unless another host of its topology is already into the next
    /// pass (`lead`, the furthest into its passes any is: heads differ by one), whose samples
    /// would then be read once more than this host's; then the whole next pass. `None` when
    /// the pass index passes a u64.
    fn unit_rest(&self, at: u128, lead: u128) -> Option<Vec<Span>> {
        let mut out = Vec::new();
        let Some(off) = self.past_head(at) else {
            extract(&self.head, at, self.head_len, &mut out);
            return Some(out);
        };
        if self.here == 0 {
            return Some(out);
        }
        let (p, x) = (u64::try_from(off / self.here).ok()?, off % self.here);
        if x > 0 {
            self.pass_range(p, x, self.here, &mut out);
        } else if off < lead {
            self.pass_range(p, 0, self.here, &mut out);
        }
        Some(out)
    }
}

/// Host `h`'s range of the share order at `hosts` hosts, of `total` samples.
fn range(total: u128, h: u32, hosts: u32) -> (u128, u128) {
    (
        total * h as u128 / hosts as u128,
        total * (h as u128 + 1) / hosts as u128,
    )
}

/// The host whose range holds share-order position `x` (< total).
fn owner(total: u128, x: u128, hosts: u32) -> u32 {
    // Host g's range starts at ⌊N·g/H⌋: the owner is the last host whose start is ≤ x.
    let (mut a, mut b) = (0u32, hosts - 1);
    while a < b {
        let mid = a + (b - a).div_ceil(2);
        if range(total, mid, hosts).0 <= x {
            a = mid;
        } else {
            b = mid - 1;
        }
    }
    a
}

/// Deals the old hosts' `rests` (in old host order) to `hosts` new hosts as their heads, as
/// many to each (±1), so that every new host ends the interrupted pass at the same step:
/// each first keeps what lies in its own share (it is in its cache), up to its due; what is
/// left fills the hosts still short, in index order.
fn deal(rests: Vec<Vec<Span>>, hosts: u32, total: u128) -> Vec<Vec<Span>> {
    let r: u128 = rests.iter().flatten().map(Span::len).sum();
    let due = |h: u32| r * (h as u128 + 1) / hosts as u128 - r * h as u128 / hosts as u128;
    let mut heads: Vec<Vec<Span>> = vec![Vec::new(); hosts as usize];
    let mut filled = vec![0u128; hosts as usize];
    let mut surplus = Vec::new();
    for mut s in rests.into_iter().flatten() {
        // The span, cut where it crosses into the next host's share.
        while s.len() > 0 {
            let h = owner(total, s.at, hosts);
            let end = range(total, h, hosts).1;
            let part = s.cut(0, (end - s.at).min(s.len()));
            s = s.cut(part.len(), s.len());
            let keep = (due(h) - filled[h as usize]).min(part.len());
            if keep > 0 {
                heads[h as usize].push(part.cut(0, keep));
                filled[h as usize] += keep;
            }
            if keep < part.len() {
                surplus.push(part.cut(keep, part.len()));
            }
        }
    }
    let mut h = 0;
    for mut s in surplus {
        while s.len() > 0 {
            while filled[h] == due(h as u32) {
                h += 1;
            }
            let n = (due(h as u32) - filled[h]).min(s.len());
            heads[h].push(s.cut(0, n));
            filled[h] += n;
            s = s.cut(n, s.len());
        }
    }
    heads
}

/// Heads kept per dataset: a daemon's streams of one job share one (per mix source).
const HEADS_KEPT: usize = 4;

/// The sequence of `host` (a host of the current topology) given the job's history: its
/// share, and its head dealt from what the hosts before it left of their pass (module docs).
/// `spans_of` gives a host's share at a host count; `total` is the dataset's samples. The
/// heads of every host of the topology are computed together, once per dataset and key
/// (every stream of a job, and every old stream of an elastic resume, shares them).
pub(crate) fn sequence(
    shape: &Shape,
    seed: u64,
    host: Topology,
    total: u128,
    spans_of: &dyn Fn(Topology) -> Vec<Span>,
) -> Result<Sequence, PlanError> {
    let heads = match shape.share {
        None => std::sync::Arc::new(all_heads(shape, seed, host.count, total, spans_of)?),
        Some(cache) => {
            let mut key = vec![seed, host.count as u64];
            for h in shape.passes.hops {
                key.extend([
                    h.hosts as u64,
                    h.world_size as u64,
                    h.num_workers as u64,
                    h.last_epoch,
                ]);
            }
            if let Some((m, i)) = shape.passes.mix {
                key.push(i as u64);
                key.extend(m.name.bytes().map(u64::from));
            }
            let found = cache
                .heads
                .lock()
                .unwrap()
                .iter()
                .find(|(k, _)| *k == key)
                .cloned();
            match found.and_then(|(_, v)| v.downcast::<Vec<Vec<Span>>>().ok()) {
                Some(heads) => heads,
                None => {
                    let heads =
                        std::sync::Arc::new(all_heads(shape, seed, host.count, total, spans_of)?);
                    let mut kept = cache.heads.lock().unwrap();
                    if kept.len() == HEADS_KEPT {
                        kept.remove(0);
                    }
                    kept.push((key, heads.clone()));
                    heads
                }
            }
        }
    };
    let head = heads[host.index as usize].clone();
    Ok(Sequence::new(spans_of(host), head, seed, host))
}

/// The heads of every host of a topology of `count` hosts (module docs).
fn all_heads(
    shape: &Shape,
    seed: u64,
    count: u32,
    total: u128,
    spans_of: &dyn Fn(Topology) -> Vec<Span>,
) -> Result<Vec<Vec<Span>>, PlanError> {
    let too_large = || PlanError::EpochTooLarge {
        epoch: shape.passes.first_epoch(),
    };
    // Level by level: what each topology's hosts had left of their pass when the job left
    // it, dealt to the next topology's hosts as their heads.
    let mut rests: Vec<Vec<Span>> = Vec::new();
    for (k, hop) in shape.passes.hops.iter().enumerate() {
        let heads = deal(rests, hop.hosts, total);
        let from = match k {
            0 => 0,
            _ => shape.passes.hops[k - 1].last_epoch + 1,
        };
        let at = position(
            shape,
            hop.job_streams(),
            hop.host_streams(),
            from,
            hop.last_epoch + 1,
        )
        .ok_or_else(too_large)?;
        let level: Vec<Sequence> = (heads.into_iter().enumerate())
            .map(|(g, head)| {
                let t = Topology {
                    index: g as u32,
                    count: hop.hosts,
                };
                Sequence::new(spans_of(t), head, seed, t)
            })
            .collect();
        let lead = (level.iter())
            .filter_map(|s| s.past_head(at))
            .max()
            .unwrap_or(0);
        rests = (level.iter())
            .map(|s| s.unit_rest(at, lead))
            .collect::<Option<_>>()
            .ok_or_else(too_large)?;
    }
    Ok(deal(rests, count, total))
}

#[cfg(test)]
mod tests;
