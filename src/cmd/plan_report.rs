//! `shardd plan`: what every host of a job of H hosts × R ranks × K workers reads in one
//! epoch, from the config (and the dataset's manifest) alone: nothing is read from the
//! shards and no daemon is asked. For each host, every one of its R × K streams is planned
//! with `plan::plan_stream`, exactly as the daemons would plan them: samples delivered,
//! distinct shards fetched, their bytes (the manifest's sizes: a shard is fetched whole even
//! when the host reads a piece of it), and samples dropped. Then the spread between hosts.
//! Without a manifest (shard-level plans) there are no sample counts nor sizes: shards only.
//! With `--from`, also what an elastic resume from another topology reads on each new host
//! and what of it must be fetched (see [`resize`]). For a mix (`--dataset MIX`): where its
//! schedule changes the weights at this topology, and the epoch's segments ([`schedule`]).

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

mod resize;
mod schedule;
mod sizing;
mod text;
pub mod verify;

pub use resize::{HostFetch, Resize, resize};
pub use sizing::{Sizing, budget_warnings, check_working_set, size};
pub use text::text;

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
    /// Instead of the report: replay the elastic resume from the checkpoint (--from with
    /// --position or --positions, or --resume-from) onto --hosts × --ranks × --workers and
    /// check that it reads every sample the old streams had not delivered exactly once
    /// (but for fewer than the new world size dropped, per source), with equal counts per
    /// rank and worker and a mix's prefix bounds. Exits non-zero, naming each breach.
    #[arg(long)]
    pub verify: bool,
    /// With --verify --from: samples each old worker's stream had delivered, one per old
    /// worker (index = worker), as one rank's state says.
    #[arg(
        long,
        value_name = "P0,P1,...",
        requires = "verify",
        requires = "from",
        conflicts_with = "position",
        value_delimiter = ','
    )]
    pub positions: Option<Vec<u64>>,
    /// With --verify: the checkpoint as the protocol's `resume_from` takes it, a JSON file
    /// `{"hosts", "world_size", "num_workers", "positions", "from"}` (`from`: a resume of a
    /// resume). Instead of --from.
    #[arg(
        long,
        value_name = "FILE",
        requires = "verify",
        conflicts_with = "from"
    )]
    pub resume_from: Option<std::path::PathBuf>,
    /// With --verify: the job's `history` as the protocol's REQUEST carries it, a JSON file
    /// `[{"hosts", "world_size", "num_workers", "last_epoch"}, ...]`: the topologies before
    /// the checkpoint's, when the job was resized before.
    #[arg(long, value_name = "FILE", requires = "verify")]
    pub history: Option<std::path::PathBuf>,
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

pub async fn run(config: &Path, args: Args) -> anyhow::Result<()> {
    if args.hosts == 0 || args.ranks == 0 || args.workers == 0 {
        bail!("--hosts, --ranks and --workers must be at least 1");
    }
    let mut config = Config::load(config)?;
    if args.verify {
        return verify_run(config, args).await;
    }
    if let Some(m) = args.dataset.as_ref().and_then(|n| config.mixes.get(n)) {
        let streams = args.hosts as u128 * args.ranks as u128 * args.workers as u128;
        let r = schedule::report(m, streams, args.epoch);
        if args.json {
            println!("{}", serde_json::to_string(&r)?);
        } else {
            print!("{}", schedule::text(&r));
        }
        return Ok(());
    }
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
        let known: Vec<&str> = (config.datasets.keys())
            .chain(config.mixes.keys())
            .map(String::as_str)
            .collect();
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
                .with_context(|| format!("datasets.{name}.manifest"))?;
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

/// `--verify`: loads the manifests of the dataset (or of the mix's sources), replays the
/// resume and prints the verification; an error when it breaks the contract.
async fn verify_run(mut config: Config, args: Args) -> anyhow::Result<()> {
    let names: Vec<&String> = config.datasets.keys().chain(config.mixes.keys()).collect();
    let name = match &args.dataset {
        Some(name) if names.contains(&name) => name.clone(),
        Some(name) => bail!(
            "unknown dataset {name:?}; the config has: {}",
            names
                .iter()
                .map(|n| n.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ),
        None if names.len() == 1 => names[0].clone(),
        None => bail!(
            "the config has {} datasets and mixes: say which with --dataset ({})",
            names.len(),
            names
                .iter()
                .map(|n| n.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let needed: Vec<String> = match config.mixes.get(&name) {
        Some(m) => m.sources.iter().map(|(n, _)| n.clone()).collect(),
        None => vec![name.clone()],
    };
    config.datasets.retain(|n, _| needed.contains(n));
    config.mixes.retain(|n, _| *n == name);
    let stores = Stores::from_config(&config, Arc::new(Metrics::new()))?;
    stores.check_credentials().await?;
    for d in config.datasets.values_mut() {
        let Some(source) = d.manifest.clone() else {
            bail!(
                "--verify: dataset {} has no manifest: an elastic resume needs its sample counts",
                d.name
            );
        };
        let (manifest, at) = crate::shard::manifest::load(&stores, &source, &d.shards)
            .await
            .map_err(|source| crate::serve::daemon::StartError::Manifest {
                dataset: d.name.clone(),
                source,
            })?;
        d.set_counts(at.iter().map(|&i| manifest.samples(i)).collect());
    }
    let origin = match (&args.resume_from, args.from) {
        (Some(path), _) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            serde_json::from_str::<crate::plan::elastic::Origin>(&text)
                .with_context(|| format!("{}: not a resume_from object", path.display()))?
        }
        (None, Some(from)) => {
            let world = from
                .hosts
                .checked_mul(from.ranks)
                .context("--from is too large")?;
            let positions = match (&args.positions, args.position) {
                (Some(p), _) if p.len() == 1 => vec![p[0]; from.workers as usize],
                (Some(p), _) => p.clone(),
                (None, Some(p)) => vec![p; from.workers as usize],
                (None, None) => bail!(
                    "--verify --from needs the checkpoint's positions: --position P (every old \
                     worker) or --positions P0,P1,... (one per old worker)"
                ),
            };
            crate::plan::elastic::Origin {
                hosts: from.hosts,
                world_size: world,
                num_workers: from.workers,
                positions,
                from: None,
            }
        }
        (None, None) => bail!(
            "--verify needs the checkpoint: --from H0,R0,K0 with --position(s), or --resume-from FILE"
        ),
    };
    let history: Vec<crate::plan::passes::Hop> = match &args.history {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            serde_json::from_str(&text)
                .with_context(|| format!("{}: not a history (a list of hops)", path.display()))?
        }
        None => Vec::new(),
    };
    let json = args.json;
    let v = tokio::task::spawn_blocking(move || {
        let started = std::time::Instant::now();
        let topo = (args.hosts, args.ranks, args.workers);
        let key = (args.seed, args.epoch);
        let r = verify::replay(&config, &name, topo, key, &origin, &history)?;
        let ids = config
            .datasets
            .values()
            .map(|d| {
                let counts = d.counts.as_deref().expect("loaded above");
                (d.name.clone(), verify::Ids::new(counts, d.shuffle_buffer))
            })
            .collect();
        let v = verify::check(&r, &ids, &name, &origin, args.hosts);
        eprintln!("verified in {:.2} s", started.elapsed().as_secs_f64());
        anyhow::Ok(v)
    })
    .await??;
    if json {
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", verify::text(&v));
    }
    if !v.breaches.is_empty() {
        bail!("the resume breaks the contract: {}", v.breaches.join("; "));
    }
    Ok(())
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

#[cfg(test)]
mod tests;
