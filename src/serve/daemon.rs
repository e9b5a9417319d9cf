//! Wires the boxes together: metrics, stores, the cache and its prefetcher, the socket, the
//! HTTP side, and a clean shutdown (the socket file is removed on the way out).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio::net::UnixListener;
use tokio_util::sync::CancellationToken;

use crate::cache::{Cache, Limits, disk::OpenError};
use crate::config::Config;
use crate::ops::metrics::Metrics;
use crate::serve::prefetch::{self, Plans};
use crate::serve::server::{self, Daemon};
use crate::serve::stream::StreamContext;
use crate::shard::sample_index::SampleIndexes;
use crate::store::{StoreError, Stores};

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot bind the socket {path} (server.socket): {source}")]
    Socket {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "another shardd is already serving on {path}; stop it, or set server.socket to another path"
    )]
    InUse { path: PathBuf },
    #[error("cannot give the socket {path} the group {group:?} (server.socket_group): {source}")]
    SocketGroup {
        path: PathBuf,
        group: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Cache(#[from] OpenError),
    #[error(transparent)]
    Host(#[from] crate::config::host::HostError),
    #[error("dataset {dataset:?}: {source}{}", manifest_hint(dataset, source))]
    Manifest {
        dataset: String,
        source: crate::shard::manifest::ManifestError,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Credentials(#[from] crate::store::CredentialsError),
    #[error("cannot listen on server.metrics_addr {addr}: {source}")]
    Metrics {
        addr: String,
        source: std::io::Error,
    },
}

/// What to do about a manifest that names other shards, or shards changed since indexing.
fn manifest_hint(dataset: &str, e: &crate::shard::manifest::ManifestError) -> String {
    use crate::shard::manifest::ManifestError;
    match e {
        ManifestError::Mismatch { .. } | ManifestError::Shard { .. } => format!(
            "; run `shardd index` on datasets.{dataset}.shards again to rewrite datasets.{dataset}.manifest, or fix datasets.{dataset}.shards"
        ),
        _ => String::new(),
    }
}

/// Runs the daemon until `shutdown` is cancelled.
pub async fn run(mut config: Config, shutdown: CancellationToken) -> Result<(), StartError> {
    let notifier = crate::ops::systemd::Notifier::from_env();
    crate::config::host::resolve(&mut config).await?;
    let metrics = Arc::new(Metrics::new());
    for name in config.datasets.keys() {
        metrics.init_dataset(name);
    }
    raise_fd_limit();
    let plans = Arc::new(Plans::default());
    let cache = open_cache(&config, metrics.clone(), plans.clone()).await?;
    load_manifests(&mut config, cache.stores()).await?;
    let http = match config.metrics_addr {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|source| StartError::Metrics {
                    addr: addr.to_string(),
                    source,
                })?,
        ),
        None => None,
    };
    // A socket systemd passed (socket activation) is systemd's: used, never removed.
    let (listener, guard) = match crate::ops::systemd::activated_listener() {
        Ok(Some(l)) => (
            UnixListener::from_std(l).map_err(|source| StartError::Socket {
                path: config.socket.clone(),
                source,
            })?,
            None,
        ),
        Ok(None) => {
            let (listener, guard) = bind_socket(
                &config.socket,
                config.socket_mode,
                config.socket_group.as_deref(),
            )?;
            (listener, Some(guard))
        }
        Err(source) => {
            return Err(StartError::Socket {
                path: config.socket.clone(),
                source,
            });
        }
    };
    // Bound at a temporary name and renamed into place: the config's path is the socket's
    // (a socket systemd passed is where systemd made it).
    let socket = match guard {
        Some(_) => config.socket.clone(),
        None => listener
            .local_addr()
            .ok()
            .and_then(|a| a.as_pathname().map(Path::to_path_buf))
            .unwrap_or_else(|| config.socket.clone()),
    };
    tracing::info!(
        socket = %socket.display(),
        activated = guard.is_none(),
        metrics = %config.metrics_addr.map_or("off".to_string(), |a| a.to_string()),
        datasets = config.datasets.len(),
        host = config.host.index,
        hosts = config.host.count,
        "serving"
    );
    let learned = Arc::new(crate::serve::learned_host::Learned::new(
        config.deferred_warm.clone(),
    ));
    crate::serve::learned_host::export_fixed(&config, &metrics.registry);
    let board =
        crate::serve::status::Board::new(Arc::new(config.clone()), cache.clone(), learned.clone());
    let http_task = http.map(|l| {
        tokio::spawn(crate::serve::http::serve(
            l,
            metrics.clone(),
            board.clone(),
            shutdown.clone(),
        ))
    });
    let prefetcher = tokio::spawn(prefetch::run(
        plans.clone(),
        cache.clone(),
        config.prefetch_shards,
        config.max_downloads,
        shutdown.clone(),
    ));
    let warmer = tokio::spawn(warm_at_start(config.clone(), cache.clone()));
    // Ready: the socket is bound, the cache open, the stores built, the manifests checked.
    notifier.send(&format!(
        "READY=1\nSTATUS=serving {} datasets as host {} of {}",
        config.datasets.len(),
        config.host.index,
        config.host.count
    ));
    // The watchdog hears from a task on the same runtime the streams run on: if that
    // runtime wedges, systemd restarts the daemon.
    let watchdog = notifier.watchdog_interval().map(|every| {
        let notifier = crate::ops::systemd::Notifier::from_env();
        tokio::spawn(async move {
            loop {
                notifier.send("WATCHDOG=1");
                tokio::time::sleep(every).await;
            }
        })
    });
    let daemon = Arc::new(Daemon {
        streams: StreamContext {
            cache,
            indexes: Arc::new(SampleIndexes::new(
                usize::try_from(config.index_memory).unwrap_or(usize::MAX),
                &metrics,
            )),
            plans,
            map_budget: Arc::new(crate::serve::mapped::MapBudget::new(
                config.zero_copy_bytes,
                metrics.zero_copy_mapped_bytes.clone(),
            )),
            metrics,
            stall_timeout: config.stall_timeout,
        },
        board,
        learned,
        config,
    });
    server::run(listener, daemon, shutdown).await;
    notifier.send("STOPPING=1\nSTATUS=stopping");
    if let Some(w) = watchdog {
        w.abort();
    }
    warmer.abort();
    let _ = prefetcher.await;
    if let Some(t) = http_task {
        let _ = t.await;
    }
    if let Some(guard) = guard {
        guard.remove();
    }
    tracing::info!("stopped");
    Ok(())
}

/// Builds the stores, makes sure each can get its credentials (one line within seconds if
/// not, rather than a failure per shard later), and opens (and locks) the cache directory.
pub async fn open_cache(
    config: &Config,
    metrics: Arc<Metrics>,
    plans: Arc<Plans>,
) -> Result<Cache, StartError> {
    let stores = Arc::new(Stores::from_config(config, metrics.clone())?);
    stores.check_credentials().await?;
    let limits = Limits {
        max_bytes: config.cache_max_bytes,
        space_timeout: config.space_timeout,
        revalidate: config.revalidate,
    };
    let dir = config.cache_dir.clone();
    let cache =
        tokio::task::spawn_blocking(move || Cache::open(&dir, limits, stores, plans, metrics))
            .await
            .expect("opening the cache does not panic")?;
    Ok(cache)
}

/// Reads every dataset's manifest, which must name exactly the configured shards, and checks
/// that this host's share of them is unchanged since it was indexed (one HEAD or stat per
/// shard, `store.max_downloads` at a time): a mismatch stops the daemon, naming the shard.
/// Only the share: across a job every shard is then checked once, by the host that reads it,
/// rather than by every host (a thousand hosts would send a thousand HEADs per shard). The
/// split itself needs only the manifest's counts, the same on every host.
pub async fn load_manifests(config: &mut Config, stores: &Stores) -> Result<(), StartError> {
    let parallel = config.max_downloads;
    let host = config.host;
    // Each dataset's samples and bytes, to size its streams against the budget below.
    let mut sizes = Vec::new();
    for dataset in config.datasets.values_mut() {
        let Some(source) = dataset.manifest.clone() else {
            continue;
        };
        let name = dataset.name.clone();
        let failed = |source| StartError::Manifest {
            dataset: name.clone(),
            source,
        };
        let started = std::time::Instant::now();
        let (manifest, at) = crate::shard::manifest::load(stores, &source, &dataset.shards)
            .await
            .map_err(failed)?;
        let loaded = started.elapsed();
        dataset.set_counts(at.iter().map(|&i| manifest.samples(i)).collect());
        sizes.push((
            dataset.name.clone(),
            at.iter().map(|&i| manifest.samples(i)).sum(),
            at.iter().map(|&i| manifest.size(i)).sum(),
        ));
        let share = crate::plan::warm_shards(dataset.shape(), host);
        let share_at: Vec<usize> = share.iter().map(|&i| at[i]).collect();
        // Only the share: this host reads no other shard, and a million entries cost
        // hundreds of MB.
        know_crc32c(stores, &manifest, &dataset.shards, &share, &share_at);
        let share: Vec<_> = share
            .into_iter()
            .map(|i| dataset.shards[i].clone())
            .collect();
        crate::shard::manifest::check_unchanged(
            stores, &manifest, &source, &share, &share_at, parallel,
        )
        .await
        .map_err(failed)?;
        tracing::info!(
            dataset = %dataset.name,
            manifest = %source,
            samples = manifest.total_samples,
            checked_shards = share.len(),
            loaded_seconds = loaded.as_secs_f64(),
            seconds = started.elapsed().as_secs_f64(),
            "manifest checked"
        );
    }
    for (name, samples, bytes) in sizes {
        let dataset = &config.datasets[&name];
        let (fit, below) = crate::config::space::streams_line(config, dataset, samples, bytes);
        tracing::info!("{fit}");
        if let Some(warning) = below {
            tracing::warn!("{warning}");
        }
    }
    Ok(())
}

/// Tells the stores the CRC-32C the manifest records for each shard of `share` (indexes in
/// `shards`; `share_at`: the same shards' indexes in the manifest), to verify reads with.
/// The URL is the configured shard's: the manifest's is the same (see `Loaded::positions`).
pub(crate) fn know_crc32c(
    stores: &Stores,
    manifest: &crate::shard::manifest::Loaded,
    shards: &[crate::config::url::ShardUrl],
    share: &[usize],
    share_at: &[usize],
) {
    let known: Vec<_> = share_at
        .iter()
        .map(|&i| (manifest.version(i), manifest.crc32c(i)))
        .collect();
    stores.know_crc32c(
        share
            .iter()
            .zip(&known)
            .map(|(&s, (version, crc))| (shards[s].as_str(), version, *crc)),
    );
}

/// `[datasets.X] warm = true`: loads this host's share of those datasets into free cache
/// space, in the background, before (and while) trainers connect.
async fn warm_at_start(config: Config, cache: Cache) {
    warn_of_missing_first_shards(&config, &cache).await;
    for dataset in config.datasets.values().filter(|d| d.warm) {
        let share: Vec<_> = crate::plan::warm_shards(dataset.shape(), config.host)
            .into_iter()
            .map(|i| dataset.shards[i].clone())
            .collect();
        let (mut loaded, mut failed) = (0u64, 0usize);
        let complete = prefetch::warm(&cache, &share, config.max_downloads, |r| match r {
            Ok(crate::cache::Ensured::Loaded(n)) => loaded += n,
            Ok(_) => {}
            Err(_) => failed += 1,
        })
        .await;
        tracing::info!(
            dataset = %dataset.name,
            shards = share.len(),
            loaded_bytes = loaded,
            failed,
            complete,
            "warmed the cache"
        );
    }
}

/// Asks for each dataset's first shard once at start (as `/readyz` does) and logs a warning
/// for one that is not there: a daemon serving a dataset whose shards are missing says so in
/// its log, not only on `/readyz` (`shardd check` lists every missing shard).
async fn warn_of_missing_first_shards(config: &Config, cache: &Cache) {
    for d in config.datasets.values() {
        let first = &d.shards[0];
        if let Err(e @ crate::store::ReadError::NotFound { .. }) =
            cache.stores().version(first).await
        {
            tracing::warn!(
                dataset = %d.name,
                "{e}: streams of this dataset will fail (`shardd check --config ...` lists every shard that is missing)"
            );
        }
    }
}

/// The daemon's hold on its socket path, from [`bind_socket`].
pub struct SocketGuard {
    path: PathBuf,
    /// (device, inode) of the socket file we made: removed on the way out only if the path
    /// still names it.
    made: (u64, u64),
    /// `<socket>.lock`, flocked for as long as we serve on the path.
    _lock: std::fs::File,
}

impl SocketGuard {
    /// Removes the socket file if it is still ours.
    pub fn remove(self) {
        use std::os::unix::fs::MetadataExt;
        if let Ok(m) = std::fs::symlink_metadata(&self.path)
            && (m.dev(), m.ino()) == self.made
        {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Binds the Unix socket with the configured mode (and group) from the first moment: it is
/// made under a temporary name, given its mode, then renamed into place. A lock file beside
/// it decides which of two daemons starting at once on one path serves it; a stale socket
/// file from a crashed run is replaced, a live one is an error.
pub fn bind_socket(
    path: &Path,
    mode: u32,
    group: Option<&str>,
) -> Result<(UnixListener, SocketGuard), StartError> {
    use std::os::unix::fs::MetadataExt;
    let err = |source| StartError::Socket {
        path: path.to_path_buf(),
        source,
    };
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(err)?;
    let mut lock_path = path.as_os_str().to_owned();
    lock_path.push(".lock");
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(err)?;
    match lock.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            return Err(StartError::InUse { path: path.into() });
        }
        Err(std::fs::TryLockError::Error(e)) => return Err(err(e)),
    }
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(StartError::InUse { path: path.into() });
        }
        std::fs::remove_file(path).map_err(err)?;
    }
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let temp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let _ = std::fs::remove_file(&temp);
    let listener = std::os::unix::net::UnixListener::bind(&temp).map_err(err)?;
    let placed = (|| {
        std::fs::set_permissions(&temp, std::fs::Permissions::from_mode(mode)).map_err(err)?;
        if let Some(group) = group {
            group_id(group)
                .and_then(|gid| std::os::unix::fs::chown(&temp, None, Some(gid)))
                .map_err(|source| StartError::SocketGroup {
                    path: path.to_path_buf(),
                    group: group.to_string(),
                    source,
                })?;
        }
        std::fs::rename(&temp, path).map_err(err)
    })();
    if let Err(e) = placed {
        let _ = std::fs::remove_file(&temp);
        return Err(e);
    }
    let m = std::fs::symlink_metadata(path).map_err(err)?;
    listener.set_nonblocking(true).map_err(err)?;
    let guard = SocketGuard {
        path: path.to_path_buf(),
        made: (m.dev(), m.ino()),
        _lock: lock,
    };
    Ok((UnixListener::from_std(listener).map_err(err)?, guard))
}

/// A group given by number or by name (looked up in /etc/group).
pub fn group_id(group: &str) -> std::io::Result<u32> {
    if let Ok(gid) = group.parse() {
        return Ok(gid);
    }
    std::fs::read_to_string("/etc/group")?
        .lines()
        .find_map(|line| {
            let mut fields = line.split(':');
            (fields.next() == Some(group))
                .then(|| fields.nth(1).and_then(|gid| gid.parse().ok()))
                .flatten()
        })
        .ok_or_else(|| std::io::Error::other(format!("no group {group:?} in /etc/group")))
}

/// Each stream holds a socket, a pipe and shard files: lift the soft limit on open files to
/// the hard one (1024 by default would stop a daemon with many streams long before
/// `server.max_connections`).
fn raise_fd_limit() {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let lim = getrlimit(Resource::Nofile);
    // `None` is RLIM_INFINITY.
    let below_hard = match (lim.current, lim.maximum) {
        (Some(cur), Some(max)) => cur < max,
        (Some(_), None) => true,
        (None, _) => false,
    };
    if below_hard {
        let raised = Rlimit {
            current: lim.maximum,
            maximum: lim.maximum,
        };
        if setrlimit(Resource::Nofile, raised).is_ok() {
            tracing::debug!(from = ?lim.current, to = ?lim.maximum, "raised the open-files limit");
        }
    }
}
