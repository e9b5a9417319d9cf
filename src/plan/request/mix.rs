//! A weighted mix's stream: each source's own stream of its quota, interleaved by the mix's
//! order; after an elastic resume, each source's rest, interleaved by what is left of each.

use super::*;

/// A mix's stream: each source's own stream of its quota (`samples_per_epoch` = the quota,
/// keyed apart), interleaved by the mix's order keyed (seed, epoch, stream). After an elastic
/// resume: each source's rest (`elastic::split_mix`), interleaved by what is left of each.
pub(super) fn plan_mix(
    config: &Config,
    m: &crate::config::MixDataset,
    req: StreamRequest,
    resume_from: Option<&crate::plan::elastic::Origin>,
    history: &[Hop],
    with_next: bool,
) -> Result<Plan, PlanError> {
    let mix = m.epoch_mix(req.epoch, job_streams(&req));
    let weights = mix.segments()[0].weights.clone();
    let key = crate::plan::stream_key(&req);
    let datasets: Vec<&crate::config::Dataset> = m
        .sources
        .iter()
        .map(|(name, _)| &config.datasets[name])
        .collect();
    use md5::Digest;
    let mut h = md5::Md5::new();
    let bases = m.epoch_bases(
        req.epoch,
        job_streams(&req),
        streams_per_host(config.host, &req),
    );
    for (i, (d, (&quota, weight))) in datasets
        .iter()
        .zip(mix.quotas().iter().zip(&weights))
        .enumerate()
    {
        h.update(fingerprint(d, config, &req, Some(quota), None));
        h.update(weight.to_le_bytes());
        let base = bases.as_ref().map(|b| b[i]);
        h.update(base.unwrap_or(u128::MAX).to_le_bytes());
    }
    // Segments after the first: where each starts and its weights (an epoch of one segment
    // hashes as it did before schedules had segments).
    for s in &mix.segments()[1..] {
        h.update(s.start.to_le_bytes());
        for w in &s.weights {
            h.update(w.to_le_bytes());
        }
    }
    let segments = resume_from.is_none().then(|| {
        mix.segments()
            .iter()
            .map(|s| crate::plan::request::MixSegment {
                position: s.start,
                entry: s.entry,
                weights: s.weights.clone(),
            })
            .collect()
    });
    let MixLanes {
        lanes,
        interleave,
        lens,
        dropped,
        remainder,
    } = match resume_from {
        None => whole_lanes(config, m, &datasets, &req, &mix, history)?,
        Some(origin) => {
            h.update(serde_json::to_vec(origin).expect("an origin serialises"));
            resumed_lanes(config, m, &datasets, &req, origin, history)?
        }
    };
    // The lanes an interleave ranges over, in its order; one lane when only one source is
    // left (or none: an empty stream).
    let order: Vec<usize> = match &interleave {
        Some((_, live)) => live.clone(),
        None => vec![lens.iter().position(|&n| n > 0).unwrap_or(0)],
    };
    let next = req.epoch.saturating_add(1);
    // After an elastic epoch, the next one carries the topology it resized.
    let after = resume_from.map(|o| crate::plan::passes::after(history, o, req.epoch));
    let next_quotas = m.quotas(next, job_streams(&req));
    let next_bases = m.epoch_bases(next, job_streams(&req), streams_per_host(config.host, &req));
    let mut sources = Vec::new();
    let mut planned = Vec::new();
    for (i, runs) in lanes.into_iter().enumerate() {
        let d = datasets[i];
        sources.push(Source {
            dataset: d.name.clone(),
            weight: weights[i],
            samples: lens[i],
            pass: runs.first().map_or(0, |r| r.plan.pass),
        });
        if order.contains(&i) {
            let shape = crate::plan::Shape {
                samples_per_epoch: Some(next_quotas[i]),
                epoch_base: next_bases.as_ref().map(|b| b[i]),
                passes: Passes {
                    hops: after.as_deref().unwrap_or(history),
                    mix: Some((m, i)),
                },
                ..d.shape()
            };
            planned.push(Lane {
                dataset: d.name.clone(),
                runs,
                next_epoch: next_epoch(config, shape, req, with_next),
            });
        }
    }
    Ok(Plan {
        lanes: planned,
        mix: interleave.map(|(mix, _)| Interleave {
            mix,
            key,
            scheduled: resume_from.is_none(),
        }),
        samples: Some(lens.iter().sum()),
        dropped,
        remainder,
        sources: Some(sources),
        segments,
        fingerprint: hex::encode(&h.finalize()[..8]),
        tag_sources: true,
    })
}

/// What a mix's stream reads of each source (`lanes[i]`: runs of source `i`), the order
/// over the sources with samples, and each source's samples.
struct MixLanes {
    lanes: Vec<Vec<Run>>,
    interleave: Option<(crate::plan::mix::EpochMix, Vec<usize>)>,
    lens: Vec<u64>,
    dropped: u64,
    remainder: Option<u64>,
}

/// An epoch's stream: each source's own stream of its quota, whole.
fn whole_lanes(
    config: &Config,
    m: &crate::config::MixDataset,
    datasets: &[&crate::config::Dataset],
    req: &StreamRequest,
    mix: &crate::plan::mix::EpochMix,
    history: &[Hop],
) -> Result<MixLanes, PlanError> {
    let lanes = (0..datasets.len())
        .map(|i| {
            let source = crate::plan::elastic::SourceOf {
                index: i as u32,
                quota: mix.quotas()[i],
            };
            let plan = source_plan(datasets[i], config.host, req, Some((source, m)), history)?;
            Ok(vec![Run::whole(plan)])
        })
        .collect::<Result<Vec<_>, PlanError>>()?;
    let lens = mix.quotas().to_vec();
    let live = (0..datasets.len()).collect();
    Ok(MixLanes {
        lanes,
        interleave: Some((mix.clone(), live)),
        lens,
        dropped: 0,
        remainder: None,
    })
}

/// After an elastic resume: each source's rest (`elastic::split_mix`), interleaved by what
/// is left of each.
fn resumed_lanes(
    config: &Config,
    m: &crate::config::MixDataset,
    datasets: &[&crate::config::Dataset],
    req: &StreamRequest,
    origin: &crate::plan::elastic::Origin,
    history: &[Hop],
) -> Result<MixLanes, PlanError> {
    // The request's own topology first: the split divides by its world size.
    let local = crate::plan::validate(config.host, req)?;
    let splits = crate::plan::elastic::split_mix(m, config.host.count, req, origin)?;
    let stream = local * req.num_workers as usize + req.worker as usize;
    let mut budget = PieceBudget::default();
    let lanes = splits
        .iter()
        .zip(datasets)
        .map(|(split, d)| {
            split.hosts[config.host.index as usize][stream]
                .iter()
                .map(|seg| {
                    Ok(Run {
                        plan: budget.take(source_plan(
                            d,
                            seg.host,
                            &seg.req,
                            seg.source.map(|s| (s, m)),
                            history,
                        )?)?,
                        from: seg.from,
                        to: Some(seg.to),
                    })
                })
                .collect::<Result<Vec<_>, PlanError>>()
        })
        .collect::<Result<Vec<_>, PlanError>>()?;
    let lens: Vec<u64> = splits
        .iter()
        .map(|s| s.lengths[req.worker as usize])
        .collect();
    let dropped = splits.iter().map(|s| s.dropped).sum();
    let remainder = splits.iter().map(|s| s.remainder).sum();
    Ok(MixLanes {
        interleave: crate::plan::elastic::interleave(&lens),
        lanes,
        lens,
        dropped,
        remainder: Some(remainder),
    })
}
