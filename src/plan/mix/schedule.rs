//! A mix's schedule: which weights each position of an epoch interleaves its sources by.
//!
//! A schedule entry starts at an epoch (`epoch = N`) or at a job-wide sample (`at = N`).
//! Both are placed on the job's *steps*: step g is position `g mod E` of epoch `⌊g / E⌋` of
//! every stream (E = `samples_per_epoch`), and before it the job's S streams (world_size ×
//! num_workers; they read in step: their lengths are equal) have read `g·S` samples. So
//! `epoch = N` starts at step `N·E`, and `at = N` at step `⌈N / S⌉`: the first step at which
//! the job has read N samples or more.
//!
//! An epoch is cut into *segments* where entries start inside it; each segment is its own
//! [`Mix`] over its length, with its entry's weights. So the ±⌈log2 k⌉ prefix bound holds in
//! each segment counted from its start, each source's count in a segment is its quota there,
//! and counts at a position cost one quota lookup per segment before it plus one walk. A
//! segment that starts at position 0 is ordered by the stream's key (an epoch schedule orders
//! as before segments existed), a later one by (stream key, its start).
//!
//! Where each source's stream starts an epoch (`epoch_base`) sums its quotas over the earlier
//! epochs, which change only at epochs where an entry starts: O(entries · log entries).

use std::sync::Arc;

use super::{Cursor, Mix, MixError};
use crate::config::{MixDataset, ScheduleFrom};
use crate::plan::shuffle::{key, tag};

/// Positions `start..` (to the next segment's start, or the epoch's end) of an epoch,
/// interleaved by `weights`.
#[derive(Debug, Clone)]
pub struct Segment {
    pub start: u64,
    /// The schedule entry in force: 0 for the mix's first weights, n for the n-th entry.
    pub entry: usize,
    pub weights: Vec<u64>,
    pub mix: Mix,
}

/// An epoch of a mix: one or more segments, end to end. Cheap to clone (every stream's
/// cursor holds one): the segments are shared.
#[derive(Debug, Clone)]
pub struct EpochMix {
    segments: Arc<[Segment]>,
    /// Each source's samples in the segments before each segment.
    before: Arc<[Vec<u64>]>,
    quotas: Vec<u64>,
    e: u64,
}

impl EpochMix {
    /// An epoch of `e` positions cut at `cuts` (start, entry, weights): the first starts at 0,
    /// starts increase. A cut at the start of the next is left out (it has no position).
    pub fn new(e: u64, cuts: Vec<(u64, usize, Vec<u64>)>) -> Result<EpochMix, MixError> {
        debug_assert!(cuts.first().is_some_and(|c| c.0 == 0));
        let mut segments: Vec<Segment> = Vec::with_capacity(cuts.len());
        for (j, (start, entry, weights)) in cuts.iter().enumerate() {
            let end = cuts.get(j + 1).map_or(e, |next| next.0);
            debug_assert!(*start <= end && end <= e);
            if end == *start && !(end == e && segments.is_empty()) {
                continue;
            }
            segments.push(Segment {
                start: *start,
                entry: *entry,
                weights: weights.clone(),
                mix: Mix::new(weights, end - start)?,
            });
        }
        let mut quotas = vec![0; segments[0].weights.len()];
        let mut before = Vec::with_capacity(segments.len());
        for s in &segments {
            before.push(quotas.clone());
            for (q, &n) in quotas.iter_mut().zip(s.mix.quotas()) {
                *q += n;
            }
        }
        Ok(EpochMix {
            segments: segments.into(),
            before: before.into(),
            quotas,
            e,
        })
    }

    /// One segment: the whole epoch by one mix of `weights`.
    pub fn single(weights: &[u64], e: u64) -> Result<EpochMix, MixError> {
        Self::new(e, vec![(0, 0, weights.to_vec())])
    }

    /// Samples of each source in the epoch.
    pub fn quotas(&self) -> &[u64] {
        &self.quotas
    }

    pub fn epoch_len(&self) -> u64 {
        self.e
    }

    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// The segment that position `t` is in (the last one at the epoch's end).
    pub fn segment_at(&self, t: u64) -> usize {
        self.segments.partition_point(|s| s.start <= t).max(1) - 1
    }

    /// Keys a segment's order (module docs).
    fn key(segment: &Segment, stream_key: u64) -> u64 {
        match segment.start {
            0 => stream_key,
            start => key(&[tag::MIX_SEGMENT, stream_key, start]),
        }
    }

    /// Samples of each source among positions `0..t` of stream `stream_key` (t capped at E).
    pub fn counts_at(&self, stream_key: u64, t: u64) -> Vec<u64> {
        let t = t.min(self.e);
        let at = self.segment_at(t);
        let mut counts = self.before[at].clone();
        let s = &self.segments[at];
        let here = s.mix.counts_at(Self::key(s, stream_key), t - s.start);
        for (c, n) in counts.iter_mut().zip(here) {
            *c += n;
        }
        counts
    }

    /// The sources of positions `from..E` of stream `stream_key`, in order.
    pub fn cursor(&self, stream_key: u64, from: u64) -> EpochCursor {
        let from = from.min(self.e);
        let at = self.segment_at(from);
        let s = &self.segments[at];
        EpochCursor {
            inner: s.mix.cursor(Self::key(s, stream_key), from - s.start),
            epoch: self.clone(),
            segment: at,
            stream_key,
        }
    }
}

/// Labels an epoch's positions in order, segment after segment.
#[derive(Debug, Clone)]
pub struct EpochCursor {
    epoch: EpochMix,
    segment: usize,
    inner: Cursor,
    stream_key: u64,
}

impl EpochCursor {
    /// The schedule entry of the segment the last label came from (or the next one will).
    pub fn entry(&self) -> usize {
        self.epoch.segments[self.segment].entry
    }
}

impl Iterator for EpochCursor {
    /// The source index of the next position.
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        loop {
            if let Some(label) = self.inner.next() {
                return Some(label);
            }
            let next = self.segment + 1;
            let s = self.epoch.segments.get(next)?;
            self.inner = s.mix.cursor(EpochMix::key(s, self.stream_key), 0);
            self.segment = next;
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let s = &self.epoch.segments[self.segment];
        let left = self.epoch.e - s.start - self.inner.position();
        let left = usize::try_from(left);
        (left.unwrap_or(usize::MAX), left.ok())
    }
}

/// A mix's plan, epoch by epoch (the config holds what it says: sources, weights, schedule).
impl MixDataset {
    /// The step entry `from` starts at, with `streams` streams job-wide (module docs).
    pub fn step(&self, from: ScheduleFrom, streams: u128) -> u128 {
        match from {
            ScheduleFrom::Epoch(n) => n as u128 * self.samples_per_epoch as u128,
            ScheduleFrom::Sample(n) => (n as u128).div_ceil(streams.max(1)),
        }
    }

    /// How many schedule entries start at or before step `g` (entries' steps never decrease).
    fn entries_by(&self, g: u128, streams: u128) -> usize {
        self.schedule
            .partition_point(|(from, _)| self.step(*from, streams) <= g)
    }

    fn entry_weights(&self, entry: usize) -> Vec<u64> {
        match entry {
            0 => self.sources.iter().map(|s| s.1).collect(),
            n => self.schedule[n - 1].1.clone(),
        }
    }

    /// Epoch `epoch` of the mix at `streams` streams job-wide: its segments.
    pub fn epoch_mix(&self, epoch: u64, streams: u128) -> EpochMix {
        let e = self.samples_per_epoch;
        let lo = epoch as u128 * e as u128;
        let first = self.entries_by(lo, streams);
        let mut cuts = vec![(0, first, self.entry_weights(first))];
        for n in first + 1..=self.schedule.len() {
            let g = self.step(self.schedule[n - 1].0, streams);
            if g >= lo + e as u128 {
                break;
            }
            cuts.push(((g - lo) as u64, n, self.entry_weights(n)));
        }
        EpochMix::new(e, cuts).expect("the config checked the weights")
    }

    /// Each source's quota in `epoch`.
    pub fn quotas(&self, epoch: u64, streams: u128) -> Vec<u64> {
        self.epoch_mix(epoch, streams).quotas
    }

    /// Where each source's streams start `epoch` in its host's endless sequence: its quotas
    /// of every epoch before, times `host_streams` (per host), so that each source continues
    /// where the earlier weights left it. `streams`: job-wide, for where entries start.
    /// `None` past u128.
    pub fn epoch_bases(&self, epoch: u64, streams: u128, host_streams: u128) -> Option<Vec<u128>> {
        let e = self.samples_per_epoch as u128;
        // The epochs whose quotas may differ from the epoch's before: 0 and those an entry
        // starts in (sorted: entries' steps never decrease). Between two of them, every
        // epoch has the weights in force at the end of the first, whole.
        let mut changes: Vec<u64> = std::iter::once(0)
            .chain(self.schedule.iter().map(|(from, _)| {
                u64::try_from(self.step(*from, streams) / e.max(1)).unwrap_or(u64::MAX)
            }))
            .filter(|&c| c < epoch)
            .collect();
        changes.dedup();
        let mut at = vec![0u128; self.sources.len()];
        let mut add = |quotas: Vec<u64>, times: u128| -> Option<()> {
            for (a, q) in at.iter_mut().zip(quotas) {
                *a = a.checked_add((q as u128).checked_mul(times)?.checked_mul(host_streams)?)?;
            }
            Some(())
        };
        for (j, &c) in changes.iter().enumerate() {
            let next = changes.get(j + 1).copied().unwrap_or(epoch);
            add(self.quotas(c, streams), 1)?;
            let whole = (next - c - 1) as u128;
            if whole > 0 {
                add(self.quotas(c + 1, streams), whole)?;
            }
        }
        Some(at)
    }

    /// Source `i`'s entry of [`Self::epoch_bases`].
    pub fn epoch_base(
        &self,
        i: usize,
        epoch: u64,
        streams: u128,
        host_streams: u128,
    ) -> Option<u128> {
        self.epoch_bases(epoch, streams, host_streams).map(|b| b[i])
    }
}

/// A mix of `weights.len()` sources (named s0, s1, ...) of `e` samples per stream and epoch.
#[cfg(test)]
pub(crate) fn mix_of(
    weights: &[u64],
    e: u64,
    schedule: Vec<(ScheduleFrom, Vec<u64>)>,
) -> MixDataset {
    MixDataset {
        name: "mix".into(),
        sources: (weights.iter().enumerate())
            .map(|(i, &w)| (format!("s{i}"), w))
            .collect(),
        samples_per_epoch: e,
        schedule,
    }
}

#[cfg(test)]
mod tests;
