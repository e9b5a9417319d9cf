//! `--from`: what an elastic resume from another topology reads on each new host, and what
//! of it must be fetched.

use super::*;

/// What one new host reads of the rest of an epoch resumed elastically.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HostFetch {
    pub host: u32,
    pub samples: u64,
    /// Distinct shards its runs read (from the shuffle window that holds each start).
    pub shards: u64,
    pub bytes: Option<u64>,
    /// Of them, the shards not in the same host index's old share: fetched from the store
    /// (all of them on a host the old job did not have).
    pub fetch_shards: u64,
    pub fetch_bytes: Option<u64>,
}

/// `--from`: an elastic resume from the old topology at `position`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Resize {
    pub from: String,
    pub position: u64,
    /// What the checkpoint left of the epoch, and of it what no new stream reads.
    pub remainder: u64,
    pub dropped: u64,
    pub per_host: Vec<HostFetch>,
    /// fetch_bytes / bytes over all hosts (fetch_shards / shards without sizes).
    pub fetch_fraction: f64,
}

/// What an elastic resume from `from` (every old worker at `args.position`, default half an
/// old stream) reads on each new host, and what of it each must fetch: shards outside the old
/// share of the host with the same index (host indices name machines; a new index has an
/// empty cache). Plans exactly what the daemons would (`elastic::split`, and the runs' pieces
/// from the window that holds each start).
pub fn resize(
    shape: Shape,
    sizes: Option<&[u64]>,
    window: usize,
    args: &Args,
    from: From,
) -> anyhow::Result<Resize> {
    let counts = shape
        .counts
        .context("--from: an elastic resume needs the dataset's manifest")?;
    let old_world = from
        .hosts
        .checked_mul(from.ranks)
        .context("--from is too large")?;
    let old_req = StreamRequest {
        seed: args.seed,
        epoch: args.epoch,
        rank: 0,
        world_size: old_world,
        worker: 0,
        num_workers: from.workers,
    };
    let length = plan::stream_samples(counts, shape, from.hosts, &old_req).unwrap_or(0);
    let position = args.position.unwrap_or(length / 2);
    let origin = crate::plan::elastic::Origin {
        hosts: from.hosts,
        world_size: old_world,
        num_workers: from.workers,
        positions: vec![position; from.workers as usize],
        from: None,
    };
    let req = StreamRequest {
        world_size: args.hosts * args.ranks,
        num_workers: args.workers,
        ..old_req
    };
    let split = crate::plan::elastic::split(shape, args.hosts, &req, &origin)?;
    let per_host = on_threads(args.hosts as usize, threads(), |h| {
        host_fetch(shape, sizes, window, &split, from, h)
    });
    let fraction = |part: u64, whole: u64| {
        if whole == 0 {
            0.0
        } else {
            part as f64 / whole as f64
        }
    };
    let fetch_fraction = match sizes {
        Some(_) => fraction(
            per_host.iter().filter_map(|h| h.fetch_bytes).sum(),
            per_host.iter().filter_map(|h| h.bytes).sum(),
        ),
        None => fraction(
            per_host.iter().map(|h| h.fetch_shards).sum(),
            per_host.iter().map(|h| h.shards).sum(),
        ),
    };
    Ok(Resize {
        from: format!("{},{},{}", from.hosts, from.ranks, from.workers),
        position,
        remainder: split.remainder,
        dropped: split.dropped,
        per_host,
        fetch_fraction,
    })
}

fn host_fetch(
    shape: Shape,
    sizes: Option<&[u64]>,
    window: usize,
    split: &crate::plan::elastic::Split,
    from: From,
    h: usize,
) -> HostFetch {
    let mut plans = std::collections::HashMap::new();
    let mut shards = std::collections::BTreeSet::new();
    let mut samples = 0;
    for seg in split.hosts[h].iter().flatten() {
        samples += seg.to - seg.from;
        let plan = plans
            .entry((seg.host.index, seg.req.rank, seg.req.worker))
            .or_insert_with(|| {
                plan::plan_stream(shape, seg.host, &seg.req).expect("planned before")
            })
            .clone();
        let run = crate::plan::request::Run {
            plan,
            from: seg.from,
            to: Some(seg.to),
        };
        shards.extend(
            crate::serve::stream::run_pieces(&run, window)
                .iter()
                .map(|p| p.shard),
        );
    }
    let old: std::collections::HashSet<usize> = if (h as u32) < from.hosts {
        let topo = Topology {
            index: h as u32,
            count: from.hosts,
        };
        plan::warm_shards(shape, topo).into_iter().collect()
    } else {
        Default::default()
    };
    let fetch: Vec<usize> = shards
        .iter()
        .copied()
        .filter(|s| !old.contains(s))
        .collect();
    let bytes = |list: &mut dyn Iterator<Item = usize>| sizes.map(|z| list.map(|i| z[i]).sum());
    HostFetch {
        host: h as u32,
        samples,
        shards: shards.len() as u64,
        bytes: bytes(&mut shards.iter().copied()),
        fetch_shards: fetch.len() as u64,
        fetch_bytes: bytes(&mut fetch.iter().copied()),
    }
}
