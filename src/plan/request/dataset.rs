//! A dataset's stream (plain, manifest or resampled): one run of its own plan; after an
//! elastic resume, runs of the old topology's streams.

use super::*;

pub(super) fn plan_dataset(
    config: &Config,
    name: &str,
    req: StreamRequest,
    resume_from: Option<&crate::plan::elastic::Origin>,
    history: &[Hop],
    with_next: bool,
) -> Result<Plan, PlanError> {
    let d = &config.datasets[name];
    let shape = crate::plan::Shape {
        passes: Passes {
            hops: history,
            mix: None,
        },
        ..d.shape()
    };
    let (runs, samples, dropped, remainder) = match resume_from {
        None => {
            let plan = crate::plan::plan_stream(shape, config.host, &req)?;
            let (samples, dropped) = (plan.samples, plan.dropped);
            (vec![Run::whole(plan)], samples, dropped, None)
        }
        Some(origin) => {
            let e = crate::plan::elastic::plan(shape, config.host, &req, origin)?;
            let mut budget = PieceBudget::default();
            let runs = e
                .segments
                .iter()
                .map(|s| {
                    Ok(Run {
                        plan: budget.take(source_plan(d, s.host, &s.req, None, history)?)?,
                        from: s.from,
                        to: Some(s.to),
                    })
                })
                .collect::<Result<_, PlanError>>()?;
            (runs, Some(e.samples), e.dropped, Some(e.remainder))
        }
    };
    // An elastic epoch's workers may differ by a sample; its origin fixes them all.
    let fingerprint = fingerprint(
        d,
        config,
        &req,
        samples.filter(|_| resume_from.is_none()),
        resume_from,
    );
    // After an elastic epoch, the next one carries the topology it resized.
    let after = resume_from.map(|o| crate::plan::passes::after(history, o, req.epoch));
    let next_shape = crate::plan::Shape {
        passes: Passes {
            hops: after.as_deref().unwrap_or(history),
            mix: None,
        },
        ..shape
    };
    Ok(Plan {
        lanes: vec![Lane {
            dataset: name.to_owned(),
            runs,
            next_epoch: next_epoch(config, next_shape, req, with_next),
        }],
        mix: None,
        samples,
        dropped,
        remainder,
        sources: None,
        segments: None,
        fingerprint,
        tag_sources: false,
    })
}
