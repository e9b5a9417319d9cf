//! `shardd plan`: what every host of a job of H hosts × R ranks × K workers reads in one
//! epoch, from the config (and the dataset's manifest) alone: nothing is read from the
//! shards and no daemon is asked. For each host, every one of its R × K streams is planned
//! with `plan::plan_stream`, exactly as the daemons would plan them: samples delivered,
//! distinct shards fetched, their bytes (the manifest's sizes: a shard is fetched whole even
//! when the host reads a piece of it), and samples dropped. Then the spread between hosts.
//! Without a manifest (shard-level plans) there are no sample counts nor sizes: shards only.
//! With `--from`, also what an elastic resume from another topology reads on each new host
//! and what of it must be fetched (see [`resize`]).

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::config::Config;
use crate::ops::metrics::Metrics;
use crate::plan::{self, Shape, StreamRequest, Topology};
use crate::shard::manifest::Manifest;
use crate::store::Stores;
use anyhow::{Context, bail};
use serde::Serialize;

/// `--from H0,R0,K0`: the topology a job is resized from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct From {
    pub hosts: u32,
    pub ranks: u32,
    pub workers: u32,
}

impl std::str::FromStr for From {
    type Err = String;
    fn from_str(s: &str) -> Result<From, String> {
        let parts: Vec<&str> = s.split(',').collect();
        let bad = || format!("{s:?} is not HOSTS,RANKS,WORKERS (three positive numbers)");
        let [h, r, k] = parts[..] else {
            return Err(bad());
        };
        let n = |x: &str| {
            x.trim()
                .parse::<u32>()
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(bad)
        };
        Ok(From {
            hosts: n(h)?,
            ranks: n(r)?,
            workers: n(k)?,
        })
    }
}

/// `shardd plan`'s flags (besides `--config`).
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Hosts in the job (the config's host section is ignored).
    #[arg(long)]
    pub hosts: u32,
    /// Ranks (trainer processes) per host.
    #[arg(long)]
    pub ranks: u32,
    /// DataLoader workers per rank.
    #[arg(long)]
    pub workers: u32,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[arg(long, default_value_t = 0)]
    pub epoch: u64,
    /// The dataset (needed when the config has more than one).
    #[arg(long)]
    pub dataset: Option<String>,
    /// One JSON object on stdout instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Also what an elastic resume from a job of H0 hosts × R0 ranks × K0 workers would
    /// read: per new host, the rest of the epoch it reads and how much of it is not in
    /// its own old share (must be fetched from the store). Needs a manifest.
    #[arg(long, value_name = "H0,R0,K0")]
    pub from: Option<From>,
    /// With --from: samples each old worker's stream had delivered at the checkpoint
    /// (default: half of an old stream).
    #[arg(long, requires = "from")]
    pub position: Option<u64>,
}

/// One host's epoch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HostReport {
    pub host: u32,
    /// Samples all its streams deliver (None without a manifest).
    pub samples: Option<u64>,
    /// Distinct shards its streams read (a shard split with another host counts on both).
    pub shards: u64,
    /// Bytes of those shards (None without a manifest).
    pub bytes: Option<u64>,
    /// Samples of its share this epoch leaves out so that its streams are equal.
    pub dropped: u64,
    /// Bytes of every shard the host may read in any epoch (its share, `warm` loads it): a
    /// cache that holds them serves every epoch after the first from disk. None without a
    /// manifest.
    pub share_bytes: Option<u64>,
    /// What its ranks × workers streams hold at once: `working_set.min_budget` is the least
    /// cache.max_size that serves them. None without a manifest.
    pub working_set: Option<crate::config::space::WorkingSet>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Spread {
    pub min: u64,
    pub max: u64,
    /// max / min (None when min is 0).
    pub ratio: Option<f64>,
}

impl Spread {
    fn of(values: impl Iterator<Item = u64>) -> Option<Spread> {
        let (mut min, mut max, mut any) = (u64::MAX, 0, false);
        for v in values {
            (min, max, any) = (min.min(v), max.max(v), true);
        }
        any.then(|| Spread {
            min,
            max,
            ratio: (min > 0).then(|| max as f64 / min as f64),
        })
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    /// Sums over hosts.
    pub total_samples: Option<u64>,
    pub total_shards: u64,
    pub total_bytes: Option<u64>,
    pub total_dropped: u64,
    pub samples: Option<Spread>,
    pub shards: Option<Spread>,
    pub bytes: Option<Spread>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    pub dataset: String,
    /// The dataset: shards, and with a manifest its samples and bytes.
    pub dataset_shards: u64,
    pub dataset_samples: Option<u64>,
    pub dataset_bytes: Option<u64>,
    pub hosts: u32,
    pub ranks: u32,
    pub workers: u32,
    pub seed: u64,
    pub epoch: u64,
    /// Samples each stream delivers (with a manifest: the same for every stream).
    pub samples_per_stream: Option<u64>,
    pub per_host: Vec<HostReport>,
    pub summary: Summary,
    /// With `--from`: what the elastic resume reads.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resize: Option<Resize>,
    /// What the working sets assume, and the config's cache budget.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sizing: Option<Sizing>,
}

/// The inputs of the per-host working sets ([`size`]).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Sizing {
    pub streams_per_host: u64,
    pub shuffle_buffer: u64,
    pub zero_copy_maps: u64,
    pub zero_copy_share: f64,
    /// cache.max_size in bytes, when the config gives a size (not a share of the free space,
    /// which is each host's own).
    pub cache_max_bytes: Option<u64>,
    /// cache.max_size's share of the free space (`"auto"`, `"N%"`).
    pub cache_max_share: Option<f64>,
}

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

pub async fn run(config: &Path, args: Args) -> anyhow::Result<()> {
    if args.hosts == 0 || args.ranks == 0 || args.workers == 0 {
        bail!("--hosts, --ranks and --workers must be at least 1");
    }
    let mut config = Config::load(config)?;
    let name = match &args.dataset {
        Some(name) => name.clone(),
        None if config.datasets.len() == 1 => config.datasets.keys().next().unwrap().clone(),
        None => bail!(
            "the config has {} datasets: say which with --dataset ({})",
            config.datasets.len(),
            config
                .datasets
                .keys()
                .map(String::as_str)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    if !config.datasets.contains_key(&name) {
        let known: Vec<&str> = config.datasets.keys().map(String::as_str).collect();
        bail!(
            "unknown dataset {name:?}; the config has: {}",
            known.join(", ")
        );
    }
    // Only this dataset's store is built (and asked for credentials).
    config.datasets.retain(|n, _| *n == name);
    let stores = Stores::from_config(&config, Arc::new(Metrics::new()))?;
    let mut dataset = config.datasets.remove(&name).expect("checked above");
    let sizes = match dataset.manifest.clone() {
        None => None,
        Some(source) => {
            stores.check_credentials().await?;
            let text = stores
                .read_whole(&source)
                .await
                .with_context(|| format!("reading the manifest {source}"))?;
            let (counts, sizes) = {
                let manifest = Manifest::parse(&text, source.as_str())?;
                drop(text);
                let at = manifest.positions(source.as_str(), &dataset.shards)?;
                let counts: Vec<u64> = at.iter().map(|&i| manifest.shards[i].samples).collect();
                let sizes: Vec<u64> = at
                    .iter()
                    .map(|&i| manifest.shards[i].version.size)
                    .collect();
                (counts, sizes)
            };
            dataset.set_counts(counts.into());
            Some(sizes)
        }
    };
    let json = args.json;
    let sizing = Sizing {
        streams_per_host: args.ranks as u64 * args.workers as u64,
        shuffle_buffer: dataset.shuffle_buffer as u64,
        zero_copy_maps: config.zero_copy_maps as u64,
        zero_copy_share: crate::config::space::zero_copy_share(&config),
        cache_max_bytes: config
            .cache_max_share
            .is_none()
            .then_some(config.cache_max_bytes),
        cache_max_share: config.cache_max_share,
    };
    let report = tokio::task::spawn_blocking(move || {
        let mut r = report(&name, dataset.shape(), sizes.as_deref(), &args, threads())?;
        size(&mut r, dataset.shape(), sizes.as_deref(), sizing);
        if let Some(from) = args.from {
            let window = dataset.shuffle_buffer;
            r.resize = Some(resize(
                dataset.shape(),
                sizes.as_deref(),
                window,
                &args,
                from,
            )?);
        }
        anyhow::Ok(r)
    })
    .await??;
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", text(&report));
    }
    for w in budget_warnings(&report) {
        eprintln!("warning: {w}");
    }
    Ok(())
}

/// Each host's share (for cached epochs) and the working set of its streams, from the
/// manifest's sizes and counts (nothing without them).
pub fn size(r: &mut Report, shape: Shape, sizes: Option<&[u64]>, sizing: Sizing) {
    if let (Some(sizes), Some(counts)) = (sizes, shape.counts) {
        let per_host = on_threads(r.per_host.len(), threads(), |h| {
            let topo = Topology {
                index: h as u32,
                count: r.hosts,
            };
            let share = plan::warm_shards(shape, topo);
            let bytes: u64 = share.iter().map(|&i| sizes[i]).sum();
            let samples: u64 = share.iter().map(|&i| counts[i]).sum();
            let ws = crate::config::space::working_set(
                sizing.streams_per_host,
                sizing.shuffle_buffer,
                share.len() as u64,
                samples,
                bytes,
                sizing.zero_copy_maps,
                sizing.zero_copy_share,
            );
            (bytes, ws)
        });
        for (host, (bytes, ws)) in r.per_host.iter_mut().zip(per_host) {
            host.share_bytes = Some(bytes);
            host.working_set = Some(ws);
        }
    }
    r.sizing = Some(sizing);
}

/// A budget (a size in the config) below a host's working set, or that holds no host's share.
pub fn budget_warnings(r: &Report) -> Vec<String> {
    let mut out = Vec::new();
    let Some(max) = r.sizing.as_ref().and_then(|s| s.cache_max_bytes) else {
        return out;
    };
    let short: Vec<&HostReport> = r
        .per_host
        .iter()
        .filter(|h| h.working_set.is_some_and(|w| max < w.min_budget))
        .collect();
    let need = |h: &HostReport| h.working_set.map_or(0, |w| w.min_budget);
    // The first host that needs the most.
    let worst = short
        .iter()
        .fold(None, |best: Option<&&HostReport>, h| match best {
            Some(b) if need(b) >= need(h) => Some(b),
            _ => Some(h),
        });
    if let Some(worst) = worst {
        let w = worst.working_set.expect("filtered");
        out.push(format!(
            "cache.max_size ({max} bytes) is below the working set of {} of {} hosts (host {} needs {} bytes: {} streams × {} shards of {} bytes, with zero copy's maps): streams wait for space and fail with cache_full",
            short.len(),
            r.per_host.len(),
            worst.host,
            w.min_budget,
            w.streams,
            w.stream_shards,
            w.shard_bytes
        ));
    }
    out
}

/// `shardd check`: one stream's working set of dataset `d` (from its manifest) and how many
/// streams' cache.max_size holds at once: lines to print, and a warning when not even one.
pub async fn check_working_set(
    config: &Config,
    stores: &Stores,
    d: &crate::config::Dataset,
) -> anyhow::Result<(Vec<String>, Vec<String>)> {
    let name = &d.name;
    // Without a manifest there are no samples per shard to size a shuffle window in shards.
    let Some(source) = &d.manifest else {
        return Ok((vec![], vec![]));
    };
    let (manifest, at) = crate::shard::manifest::load(stores, source, &d.shards)
        .await
        .with_context(|| format!("dataset {name}: reading the manifest {source}"))?;
    let bytes: u64 = at.iter().map(|&i| manifest.shards[i].version.size).sum();
    let samples: u64 = at.iter().map(|&i| manifest.shards[i].samples).sum();
    let (maps, share) = (
        config.zero_copy_maps as u64,
        crate::config::space::zero_copy_share(config),
    );
    let one = crate::config::space::working_set(
        1,
        d.shuffle_buffer as u64,
        d.shards.len() as u64,
        samples,
        bytes,
        maps,
        share,
    );
    let max = config.cache_max_bytes;
    let fits = crate::config::space::streams_that_fit(max, &one, maps, share);
    let line = format!(
        "dataset {name}: a stream holds {} shards ({} of its shuffle window of {} samples, + 2) of {} bytes on average: {} bytes, {} with zero copy's maps; cache.max_size ({max} bytes) holds {fits} streams at once (shardd plan sizes a whole job)",
        one.stream_shards,
        one.window_shards,
        d.shuffle_buffer,
        one.shard_bytes,
        one.bytes,
        one.min_budget
    );
    let warnings = if fits == 0 {
        vec![format!(
            "cache.max_size ({max} bytes) is below the working set of one stream of dataset {name} ({} bytes, with zero copy's maps): streams wait for space and fail with cache_full",
            one.min_budget
        )]
    } else {
        vec![]
    };
    Ok((vec![line], warnings))
}

fn threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// `f(0..n)` on `threads` threads (each takes the next index), in index order.
fn on_threads<T: Send>(n: usize, threads: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let next = AtomicUsize::new(0);
    let done: Vec<Vec<(usize, T)>> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads.clamp(1, n.max(1)))
            .map(|_| {
                scope.spawn(|| {
                    let mut mine = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= n {
                            return mine;
                        }
                        mine.push((i, f(i)));
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().expect("planning does not panic"))
            .collect()
    });
    let mut out: Vec<Option<T>> = (0..n).map(|_| None).collect();
    for (i, r) in done.into_iter().flatten() {
        out[i] = Some(r);
    }
    out.into_iter()
        .map(|r| r.expect("every index was run"))
        .collect()
}

/// A host's report and the samples of one of its streams, or why it cannot be planned.
type HostResult = anyhow::Result<(HostReport, Option<u64>)>;

/// Plans every stream of every host (`threads` hosts at a time) and sums them up per host.
pub fn report(
    name: &str,
    shape: Shape,
    sizes: Option<&[u64]>,
    args: &Args,
    threads: usize,
) -> anyhow::Result<Report> {
    let world = args
        .hosts
        .checked_mul(args.ranks)
        .context("--hosts × --ranks is past 2^32")?;
    let hosts = args.hosts as usize;
    let per_host = on_threads(hosts, threads, |h| {
        one_host(shape, sizes, args, world, h as u32)
    });
    let mut reports = Vec::with_capacity(hosts);
    let mut per_stream = None;
    for r in per_host {
        let (report, stream_samples) = r?;
        per_stream = per_stream.or(stream_samples);
        reports.push(report);
    }
    let sum = |f: fn(&HostReport) -> Option<u64>| reports.iter().map(f).sum::<Option<u64>>();
    let spread = |f: fn(&HostReport) -> Option<u64>| {
        reports
            .iter()
            .map(f)
            .collect::<Option<Vec<u64>>>()
            .and_then(|v| Spread::of(v.into_iter()))
    };
    let summary = Summary {
        total_samples: sum(|r| r.samples),
        total_shards: reports.iter().map(|r| r.shards).sum(),
        total_bytes: sum(|r| r.bytes),
        total_dropped: reports.iter().map(|r| r.dropped).sum(),
        samples: spread(|r| r.samples),
        shards: spread(|r| Some(r.shards)),
        bytes: spread(|r| r.bytes),
    };
    Ok(Report {
        dataset: name.to_string(),
        dataset_shards: shape.num_shards as u64,
        dataset_samples: shape.counts.map(|c| c.iter().sum()),
        dataset_bytes: sizes.map(|s| s.iter().sum()),
        hosts: args.hosts,
        ranks: args.ranks,
        workers: args.workers,
        seed: args.seed,
        epoch: args.epoch,
        samples_per_stream: per_stream,
        per_host: reports,
        summary,
        resize: None,
        sizing: None,
    })
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

/// Plans the host's R × K streams; returns its report and the samples of one stream.
fn one_host(shape: Shape, sizes: Option<&[u64]>, args: &Args, world: u32, host: u32) -> HostResult {
    let topo = Topology {
        index: host,
        count: args.hosts,
    };
    let mut shards = Vec::new();
    let mut samples = Some(0u64);
    let mut per_stream = None;
    let mut dropped = 0;
    for rank in host * args.ranks..(host + 1) * args.ranks {
        for worker in 0..args.workers {
            let req = StreamRequest {
                seed: args.seed,
                epoch: args.epoch,
                rank,
                world_size: world,
                worker,
                num_workers: args.workers,
            };
            let p = plan::plan_stream(shape, topo, &req)
                .with_context(|| format!("host {host}, rank {rank}, worker {worker}"))?;
            shards.extend(p.shards());
            samples = samples.zip(p.samples).map(|(a, b)| a + b);
            per_stream = p.samples;
            dropped = p.dropped;
        }
    }
    shards.sort_unstable();
    shards.dedup();
    let bytes = sizes.map(|s| shards.iter().map(|&i| s[i]).sum());
    Ok((
        HostReport {
            host,
            samples,
            shards: shards.len() as u64,
            bytes,
            dropped,
            share_bytes: None,
            working_set: None,
        },
        per_stream,
    ))
}

/// The report for a terminal: one line per host, then the spread.
pub fn text(r: &Report) -> String {
    use std::fmt::Write;
    let opt = |v: Option<u64>| v.map_or("-".to_string(), |v| v.to_string());
    let mut out = String::new();
    let _ = writeln!(
        out,
        "dataset {}: {} shards, {} samples, {} bytes; {} hosts × {} ranks × {} workers (world_size {}), seed {}, epoch {}",
        r.dataset,
        r.dataset_shards,
        opt(r.dataset_samples),
        opt(r.dataset_bytes),
        r.hosts,
        r.ranks,
        r.workers,
        r.hosts as u64 * r.ranks as u64,
        r.seed,
        r.epoch
    );
    if let Some(n) = r.samples_per_stream {
        let _ = writeln!(out, "every stream: {n} samples");
    }
    if let Some(z) = &r.sizing {
        let budget = match (z.cache_max_bytes, z.cache_max_share) {
            (Some(b), _) => format!("{b} bytes"),
            (None, Some(share)) => format!("{}% of each host's free space", share * 100.0),
            (None, None) => "-".into(),
        };
        let _ = writeln!(
            out,
            "cache per host: MIN BUDGET = {} streams × (⌈shuffle_buffer {} / samples per shard⌉ + 2) shards × the mean shard size, plus zero copy's maps ({} shards a stream, at most {} of the budget); SHARE = every shard the host reads in any epoch (cached epochs); cache.max_size: {budget}",
            z.streams_per_host, z.shuffle_buffer, z.zero_copy_maps, z.zero_copy_share
        );
    }
    let _ = writeln!(
        out,
        "{:>6} {:>14} {:>10} {:>18} {:>8} {:>18} {:>18}",
        "HOST", "SAMPLES", "SHARDS", "BYTES", "DROPPED", "MIN BUDGET", "SHARE"
    );
    for h in &r.per_host {
        let _ = writeln!(
            out,
            "{:>6} {:>14} {:>10} {:>18} {:>8} {:>18} {:>18}",
            h.host,
            opt(h.samples),
            h.shards,
            opt(h.bytes),
            h.dropped,
            opt(h.working_set.map(|w| w.min_budget)),
            opt(h.share_bytes)
        );
    }
    let s = &r.summary;
    let spread = |what: &str, sp: &Option<Spread>| match sp {
        Some(sp) => format!(
            "{what} min {} max {} (max/min {})",
            sp.min,
            sp.max,
            sp.ratio.map_or("-".into(), |x| format!("{x:.4}"))
        ),
        None => format!("{what} -"),
    };
    let _ = writeln!(
        out,
        "total: {} samples, {} shard reads, {} bytes, {} dropped",
        opt(s.total_samples),
        s.total_shards,
        opt(s.total_bytes),
        s.total_dropped
    );
    let _ = writeln!(
        out,
        "spread between hosts: {}; {}; {}",
        spread("samples", &s.samples),
        spread("shards", &s.shards),
        spread("bytes", &s.bytes)
    );
    if let Some(z) = &r.resize {
        let _ = writeln!(
            out,
            "elastic resume from {} (hosts,ranks,workers) with every old worker at sample {}: {} samples left, {} dropped; per new host (fetch: not in the same host index's old share):",
            z.from, z.position, z.remainder, z.dropped
        );
        for h in &z.per_host {
            let _ = writeln!(
                out,
                "  host {:>5}: {} samples, {} shards, {} bytes; fetch {} shards, {} bytes",
                h.host,
                h.samples,
                h.shards,
                opt(h.bytes),
                h.fetch_shards,
                opt(h.fetch_bytes)
            );
        }
        let _ = writeln!(
            out,
            "elastic resume fetches {:.1}% of what it reads from the store",
            100.0 * z.fetch_fraction
        );
    }
    out
}

#[cfg(test)]
mod tests;
