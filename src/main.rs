//! The `shardd` command line: parses flags, sets up tracing, hands over to the library.

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use shardd::config::Config;
use shardd::protocol::Request;
use tokio_util::sync::CancellationToken;

use shardd::cmd::{check, index, plan_report, units, warm};
use shardd::ops::error_line::one_line;
use shardd::ops::malloc;

#[derive(Parser)]
#[command(
    version,
    about = "Streams shuffled WebDataset samples from object storage to local trainers"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Log lines for humans (colours only on a terminal), or one JSON object per line (Cloud
    /// Logging and other collectors).
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Human)]
    log_format: LogFormat,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    Human,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Run the daemon until SIGTERM or SIGINT.
    Serve {
        #[arg(long)]
        config: PathBuf,
    },
    /// `serve` without serving: validate a config, list each dataset's shards, ask the stores
    /// for every shard (a HEAD or stat each: missing ones, total bytes, the largest), and check
    /// the directories `serve` writes. Exit 1 if a shard is missing or anything else would
    /// stop `shardd serve`.
    Check {
        #[arg(long)]
        config: PathBuf,
        /// Ask no store and no metadata server: check the config, the directories, and only
        /// the datasets whose shards and manifest are local files.
        #[arg(long, visible_alias = "offline")]
        no_store: bool,
    },
    /// Read every shard of the patterns and write a manifest (sizes, ETags, checksums,
    /// sample counts) for exact epochs. Re-running reuses the entries of unchanged shards.
    Index {
        /// Shard patterns, as in a dataset's `shards` (brace expansion, gs://, s3://, paths).
        #[arg(required = true)]
        patterns: Vec<String>,
        /// Where to write the manifest: a local path or an object URL.
        #[arg(short, long)]
        output: String,
        /// A config whose [gcs], [s3] and [store] sections say how to reach the store.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Shards read at once.
        #[arg(long, default_value_t = 4)]
        parallel: usize,
        /// Index only part i of N (from 0): the shards whose number in the patterns is i
        /// modulo N. Each host of a pod runs its own part; then one runs --merge.
        #[arg(long, value_name = "i/N", conflicts_with = "merge")]
        part: Option<shardd::shard::manifest::parts::Part>,
        /// Write the patterns' manifest from the parts' manifests (paths or URLs; brace
        /// patterns, repeatable), once they cover the patterns exactly once. Reads no shard.
        #[arg(long, value_name = "PART")]
        merge: Vec<String>,
    },
    /// Fill the cache with this host's share of the datasets (all, or one), ahead of a job.
    /// Idempotent: what is cached and unchanged is not fetched again. Run it while the
    /// daemon is stopped (it takes the cache directory's lock).
    Warm {
        #[arg(long)]
        config: PathBuf,
        #[arg(long)]
        dataset: Option<String>,
    },
    /// Read one stream through the protocol; print a line per sample: key, then field=bytes.
    Cat {
        #[arg(long)]
        socket: PathBuf,
        #[arg(long)]
        dataset: String,
        #[arg(long, default_value_t = 0)]
        epoch: u64,
        #[arg(long, default_value_t = 0)]
        rank: u32,
        #[arg(long, default_value_t = 1)]
        world_size: u32,
        #[arg(long, default_value_t = 0)]
        worker: u32,
        #[arg(long, default_value_t = 1)]
        num_workers: u32,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Stop after this many samples.
        #[arg(long)]
        limit: Option<u64>,
    },
    /// Write shards' bytes to stdout from the host daemon's cache: one download per host for
    /// every process that asks, later epochs from local disk. For webdataset's `pipe:` URLs:
    /// `pipe:shardd get gs://bucket/train-000000.tar` in place of `pipe:gsutil cat ...`. Only
    /// shards of the daemon's configured datasets. This gives each shard's samples in tar
    /// order, no more: shuffled, exact, equal-length streams and resumes need `ShardDataset`.
    Get {
        /// Shard URLs, exactly as a configured dataset's `shards` expand.
        #[arg(required = true)]
        urls: Vec<String>,
        /// The daemon's socket [default: $SHARDD_SOCKET, else /run/shardd/shardd.sock].
        #[arg(long)]
        socket: Option<PathBuf>,
        /// Seconds to wait for a daemon that is away, restarting or busy, per shard.
        #[arg(long, default_value_t = 300.0)]
        wait: f64,
    },
    /// Serve a synthetic dataset through the whole daemon, read and verify one epoch.
    Demo,
    /// Print what every host of a job reads in one epoch (samples, shards, bytes from the
    /// manifest, the spread between hosts), from the config and manifest alone: run it
    /// before starting or resizing a job.
    Plan {
        #[arg(long)]
        config: PathBuf,
        #[command(flatten)]
        args: plan_report::Args,
    },
    /// Print what a running daemon is doing (its /status) as a table.
    Status {
        /// The daemon's HTTP address (server.metrics_addr).
        #[arg(long, default_value = "http://127.0.0.1:9464")]
        url: String,
    },
    /// Write the systemd units built into this binary (shardd.service, shardd.socket), with
    /// ExecStart running this binary; with --config, the drop-ins that config needs (a
    /// cache.dir outside /var/cache/shardd, the socket's path, mode or group).
    InstallUnits {
        #[arg(long, default_value = units::DEFAULT_DIR)]
        dir: PathBuf,
        /// The config the units will run with (read offline).
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Merge config files into one, table by table: each OVERLAY's keys over BASE's (a table
    /// in both is merged key by key, any other value replaced). The result is validated
    /// (offline) before it is written.
    MergeConfig {
        base: PathBuf,
        #[arg(required = true)]
        overlays: Vec<PathBuf>,
        /// Where to write it (atomically, mode 0644); stdout when not given.
        #[arg(short, long)]
        output: Option<PathBuf>,
    },
}

fn main() -> std::process::ExitCode {
    malloc::tune();
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // One line with the whole cause chain: what an operator reads in the journal.
            eprintln!("shardd: error: {}", one_line(e.as_ref()));
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    // The demo prints its own report; the daemon inside it only speaks up about problems.
    // The one-shot commands leave out object_store's info lines (credential fetches): their
    // errors say what failed. Retries are shardd's own debug lines (src/store/http.rs):
    // SHARDD_LOG=info,shardd::store=debug shows each one.
    let default_level = match cli.command {
        Command::Demo => "warn",
        Command::Serve { .. } => "info",
        _ => "info,object_store=warn",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("SHARDD_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match cli.log_format {
        LogFormat::Json => logs.json().with_current_span(true).init(),
        LogFormat::Human => {
            use std::io::IsTerminal;
            logs.with_ansi(std::io::stderr().is_terminal()).init()
        }
    }
    if let Command::Get { urls, socket, wait } = &cli.command {
        // Run once per shard by a trainer's pipe: no runtime, no threads.
        let socket = socket.clone().unwrap_or_else(|| {
            std::env::var_os("SHARDD_SOCKET")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from("/run/shardd/shardd.sock"))
        });
        let wait = std::time::Duration::try_from_secs_f64(*wait)
            .map_err(|_| anyhow::anyhow!("--wait {wait}: not a number of seconds"))?;
        return shardd::cmd::get::run(&socket, urls, wait);
    }
    let runtime = tokio::runtime::Runtime::new()?;
    match cli.command {
        Command::Serve { config } => {
            let config = Config::load(&config)?;
            tracing::info!("{}", shardd::config::space::budget_line(&config));
            for w in shardd::config::space::space_warnings(&config) {
                tracing::warn!("{w}");
            }
            runtime.block_on(serve(config))
        }
        Command::Check { config, no_store } => runtime.block_on(check::run(&config, !no_store)),
        Command::Index {
            patterns,
            output,
            config,
            parallel,
            part,
            merge,
        } => runtime.block_on(index::run(
            index::Args {
                patterns,
                output,
                parallel,
                part,
                merge,
            },
            config,
        )),
        Command::Warm { config, dataset } => {
            let config = Config::load(&config)?;
            runtime.block_on(warm::run(config, dataset))
        }
        Command::Cat {
            socket,
            dataset,
            epoch,
            rank,
            world_size,
            worker,
            num_workers,
            seed,
            limit,
        } => {
            let req = Request {
                worker,
                num_workers,
                seed,
                ..Request::stream(&dataset, epoch, rank, world_size)
            };
            runtime.block_on(cat(socket, req, limit))
        }
        Command::Get { .. } => unreachable!("served above"),
        Command::Demo => runtime.block_on(shardd::cmd::demo::run()),
        Command::Status { url } => runtime.block_on(status(&url)),
        Command::Plan { config, args } => runtime.block_on(plan_report::run(&config, args)),
        Command::InstallUnits { dir, config } => units::install(&dir, config.as_deref()),
        Command::MergeConfig {
            base,
            overlays,
            output,
        } => units::merge_config(&base, &overlays, output.as_deref()),
    }
}

async fn serve(config: Config) -> anyhow::Result<()> {
    let shutdown = CancellationToken::new();
    let signals = {
        let shutdown = shutdown.clone();
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        tokio::spawn(async move {
            tokio::select! {
                _ = term.recv() => tracing::info!("SIGTERM: shutting down (a second signal exits at once)"),
                _ = int.recv() => tracing::info!("SIGINT: shutting down (a second signal exits at once)"),
            }
            shutdown.cancel();
            // Someone who asks twice does not want to wait for the drain.
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            eprintln!("shardd: second signal: exiting now");
            std::process::exit(130);
        })
    };
    shardd::serve::daemon::run(config, shutdown).await?;
    signals.abort();
    Ok(())
}

async fn status(url: &str) -> anyhow::Result<()> {
    use anyhow::Context;
    let url = format!("{}/status", url.trim_end_matches('/'));
    let s: shardd::serve::status::Status = reqwest::get(&url)
        .await
        .and_then(|r| r.error_for_status())
        .with_context(|| format!("asking {url}"))?
        .json()
        .await
        .with_context(|| format!("reading {url}"))?;
    let mb = |b: u64| b as f64 / 1e6;
    println!(
        "shardd {}, host {} of {}, up {:.0}s",
        s.version, s.host_index, s.host_count, s.uptime_seconds
    );
    for d in &s.datasets {
        let samples = d
            .samples
            .map(|n| format!(", {n} samples"))
            .unwrap_or_default();
        println!("dataset {}: {} shards{samples}", d.name, d.shards);
    }
    let c = &s.cache;
    println!(
        "cache: {:.1} MB of {:.1} MB ({:.1} MB resident, {:.1} MB pinned), {} entries, {} loading",
        mb(c.charged_bytes),
        mb(c.max_bytes),
        mb(c.resident_bytes),
        mb(c.pinned_bytes),
        c.entries,
        c.loading
    );
    for b in &s.stores {
        let limit = b
            .request_rate_limit
            .map_or("no limit".to_string(), |r| format!("{r:.1} requests/s"));
        let pushback = match (&b.last_pushback, b.last_pushback_seconds_ago) {
            (Some(how), Some(ago)) => format!(", last pushed back ({how}) {ago:.1} s ago"),
            _ => String::new(),
        };
        println!(
            "store {}: {limit}, {} requests waiting ({} for a trainer){pushback}",
            b.bucket, b.requests_waiting, b.urgent_requests_waiting
        );
    }
    println!(
        "{:<16} {:>6} {:>5} {:>6} {:>10} {:>10} {:>8} {:>8} {:>8} {:>6}",
        "DATASET",
        "EPOCH",
        "RANK",
        "WORKER",
        "POSITION",
        "SAMPLES/S",
        "MB/S",
        "WAITING",
        "PID",
        "UID"
    );
    for t in &s.streams {
        let opt = |v: Option<String>| v.unwrap_or_else(|| "-".into());
        println!(
            "{:<16} {:>6} {:>5} {:>6} {:>10} {:>10.1} {:>8.1} {:>8} {:>8} {:>6}",
            t.dataset,
            t.epoch,
            t.rank,
            t.worker,
            t.position,
            t.samples_per_second,
            t.bytes_per_second / 1e6,
            t.waiting_on,
            opt(t.peer_pid.map(|p| p.to_string())),
            opt(t.peer_uid.map(|u| u.to_string()))
        );
    }
    Ok(())
}

async fn cat(socket: PathBuf, req: Request, limit: Option<u64>) -> anyhow::Result<()> {
    use std::io::Write;
    let mut stream = shardd::client::SampleStream::open(&socket, &req).await?;
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let mut count = 0u64;
    'read: while let Some(batch) = stream.next_batch().await? {
        for s in batch {
            if limit.is_some_and(|l| count >= l) {
                break 'read;
            }
            write!(out, "{}", s.key)?;
            for (name, data) in &s.fields {
                write!(out, " {name}={}", data.len())?;
            }
            writeln!(out)?;
            count += 1;
        }
    }
    out.flush()?;
    eprintln!("{count} samples");
    Ok(())
}
