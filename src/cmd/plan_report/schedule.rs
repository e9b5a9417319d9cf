//! `shardd plan --dataset MIX`: where a mix's schedule changes the weights at a job's
//! topology. An `at` entry lands on a step that depends on the job's streams (world_size ×
//! num_workers), so the same config changes its weights at another position of another epoch
//! on another job: this says where, and each source's quota in the asked epoch's segments.

use serde::Serialize;

use crate::config::MixDataset;

/// Where one schedule entry takes effect.
#[derive(Debug, Serialize)]
pub struct EntryAt {
    /// 0: the mix's first weights; n: the schedule's n-th entry.
    pub entry: usize,
    /// The entry as the config says it (`epoch = N`, `at = N`), or "first weights".
    pub from: String,
    pub mix: std::collections::BTreeMap<String, u64>,
    /// The first step under it, the epoch and stream position of that step, and the samples
    /// the job has read before it.
    pub step: u128,
    pub epoch: u128,
    pub position: u64,
    pub job_samples: u128,
}

/// The schedule at a topology, and the asked epoch's segments.
#[derive(Debug, Serialize)]
pub struct ScheduleReport {
    pub dataset: String,
    pub streams: u128,
    pub samples_per_epoch: u64,
    pub entries: Vec<EntryAt>,
    pub epoch: u64,
    /// The epoch's segments: (first position, entry, each source's quota in it).
    pub segments: Vec<SegmentQuotas>,
}

#[derive(Debug, Serialize)]
pub struct SegmentQuotas {
    pub position: u64,
    pub entry: usize,
    pub quotas: std::collections::BTreeMap<String, u64>,
}

/// The report for mix `m` at `streams` streams job-wide, with `epoch`'s segments.
pub fn report(m: &MixDataset, streams: u128, epoch: u64) -> ScheduleReport {
    let e = m.samples_per_epoch as u128;
    let names = |values: &[u64]| {
        (m.sources.iter())
            .map(|s| s.0.clone())
            .zip(values.iter().copied())
            .collect()
    };
    let first: Vec<u64> = m.sources.iter().map(|s| s.1).collect();
    let entries = std::iter::once(("first weights".to_string(), 0u128, &first))
        .chain((m.schedule.iter()).map(|(from, w)| (from.to_string(), m.step(*from, streams), w)))
        .enumerate()
        .map(|(entry, (from, step, w))| EntryAt {
            entry,
            from,
            mix: names(w),
            step,
            epoch: step / e,
            position: (step % e) as u64,
            job_samples: step * streams,
        })
        .collect();
    let mix = m.epoch_mix(epoch, streams);
    let segments = mix
        .segments()
        .iter()
        .map(|s| SegmentQuotas {
            position: s.start,
            entry: s.entry,
            quotas: names(s.mix.quotas()),
        })
        .collect();
    ScheduleReport {
        dataset: m.name.clone(),
        streams,
        samples_per_epoch: m.samples_per_epoch,
        entries,
        epoch,
        segments,
    }
}

/// The report as text.
pub fn text(r: &ScheduleReport) -> String {
    let mut out = format!(
        "mix {}: {} streams job-wide, {} samples per stream and epoch ({} job-wide)\n",
        r.dataset,
        r.streams,
        r.samples_per_epoch,
        r.samples_per_epoch as u128 * r.streams
    );
    for a in &r.entries {
        let weights: Vec<String> = a.mix.iter().map(|(k, v)| format!("{k} = {v}")).collect();
        out += &format!(
            "  entry {} ({}, {{ {} }}): from step {}, epoch {} position {}, after {} samples job-wide\n",
            a.entry,
            a.from,
            weights.join(", "),
            a.step,
            a.epoch,
            a.position,
            a.job_samples
        );
    }
    out += &format!("epoch {}:\n", r.epoch);
    for s in &r.segments {
        let quotas: Vec<String> = s.quotas.iter().map(|(k, v)| format!("{k} {v}")).collect();
        out += &format!(
            "  from position {} under entry {}: {} per stream\n",
            s.position,
            s.entry,
            quotas.join(", ")
        );
    }
    out
}
