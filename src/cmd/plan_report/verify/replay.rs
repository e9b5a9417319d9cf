//! Step one of `--verify`: the checkpoint's chain replayed with the daemon's own planner
//! (`plan::request::plan`), every stream of every topology planned as a server plans a
//! REQUEST. Its own module because it is the only step that plans anything: what follows
//! reads the plans it returns and never calls the planner.

use super::*;
use crate::plan::passes::Hop;

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
