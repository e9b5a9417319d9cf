//! `host.index = "auto"` / `host.count = "auto"`: which host of the job this is, found at
//! start so that one config serves every VM of a TPU slice.
//!
//! In order: the environment (`SHARDD_HOST_INDEX`, `SHARDD_HOST_COUNT`: a DaemonSet or a
//! startup script can set them), then the TPU VM metadata server (`agent-worker-number`, and
//! the entries of `worker-network-endpoints`, comma-separated), at `GCE_METADATA_HOST` when
//! set, else `metadata.google.internal`. Neither answering is a clear error.
//!
//! `host.index = "from-clients"` (GKE: one DaemonSet config for every node, where neither
//! is set): the index is learned from the streams ([`bind`]). Every REQUEST carries the
//! trainer's global `rank` and `world_size`, and host `i` of `count` serves ranks
//! `i·L .. i·L+L-1` with `L = world_size / count`, so the first stream says which host this
//! node is: `rank / L`. The daemon then serves that host's share; a stream of another host's
//! rank is refused (`bad_topology`, naming both) while a stream of the learned host is open.
//! Once no stream is open the next one may teach another index (a new job placed its
//! trainers differently): logged, and the cache keeps what it holds until eviction.
//! `SHARDD_HOST_INDEX`, when set, still fixes the index.
//!
//! Also here, because it is found at start too: `cache.max_size = "auto"` (or `"N%"`), a share
//! of the cache file system's free space ([`cache_budget`]), the warnings when a budget does
//! not fit the disk ([`space_warnings`]), and the working set a job needs ([`working_set`]).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::config::{Config, ConfigError};
use crate::plan::Topology;
use crate::protocol::Request;
use crate::serve::server::Daemon;

/// `host.index = "from-clients"`.
pub const FROM_CLIENTS: &str = "from-clients";
/// `cache.max_size = "auto"`: this share of the free space.
pub const AUTO_SHARE: f64 = 0.8;

const METADATA: &str = "metadata.google.internal";
const ATTRIBUTES: &str = "/computeMetadata/v1/instance/attributes";
const TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum HostError {
    #[error(
        "{key} = \"auto\": {var} is not set and the metadata server at {server} did not answer: {why}"
    )]
    NotFound {
        key: &'static str,
        var: &'static str,
        server: String,
        why: String,
    },
    #[error("{key} = \"auto\": {source_name} says {value:?}, which is not a number")]
    NotANumber {
        key: &'static str,
        source_name: String,
        value: String,
    },
    #[error("{0}")]
    Invalid(String),
}

/// Fills in `config.host` where it is `"auto"`, and checks the result.
pub async fn resolve(config: &mut Config) -> Result<(), HostError> {
    if config.host_auto.from_clients
        && let Ok(value) = std::env::var("SHARDD_HOST_INDEX")
    {
        // Set by whoever knows better (a webhook, a sidecar, a script): a fixed index.
        config.host.index = value.trim().parse().map_err(|_| HostError::NotANumber {
            key: "host.index",
            source_name: "SHARDD_HOST_INDEX".into(),
            value,
        })?;
        config.host_auto.from_clients = false;
    }
    if config.host_auto.index {
        config.host.index = find(
            "host.index",
            "SHARDD_HOST_INDEX",
            "agent-worker-number",
            |text| text.trim().to_string(),
        )
        .await?;
    }
    if config.host_auto.count {
        config.host.count = find(
            "host.count",
            "SHARDD_HOST_COUNT",
            "worker-network-endpoints",
            |text| {
                text.split(',')
                    .filter(|e| !e.trim().is_empty())
                    .count()
                    .to_string()
            },
        )
        .await?;
    }
    config.host.check().map_err(HostError::Invalid)?;
    if config.host_auto.from_clients {
        // Until a stream says which host this is, there is no share to check or warm: the
        // datasets' `warm = true` waits for the first stream (`adopt`).
        let mut warm = Vec::new();
        for d in config.datasets.values_mut() {
            if std::mem::take(&mut d.warm) {
                warm.push(d.name.clone());
            }
        }
        config.host_learned.state.lock().unwrap().warm = warm;
        tracing::info!(
            count = config.host.count,
            "host.index = \"from-clients\": this host's place is learned from the first stream (rank / (world_size / host.count))"
        );
    } else if config.host_auto != Default::default() {
        tracing::info!(
            index = config.host.index,
            count = config.host.count,
            "found this host's place"
        );
    }
    Ok(())
}

async fn find(
    key: &'static str,
    var: &'static str,
    attribute: &str,
    read: impl Fn(&str) -> String,
) -> Result<u32, HostError> {
    let (source_name, value) = match std::env::var(var) {
        Ok(v) => (var.to_string(), v),
        Err(_) => {
            let server = std::env::var("GCE_METADATA_HOST").unwrap_or_else(|_| METADATA.into());
            let text = metadata(&server, attribute)
                .await
                .map_err(|why| HostError::NotFound {
                    key,
                    var,
                    server: server.clone(),
                    why,
                })?;
            (format!("the metadata server's {attribute}"), read(&text))
        }
    };
    value.trim().parse().map_err(|_| HostError::NotANumber {
        key,
        source_name,
        value,
    })
}

async fn metadata(server: &str, attribute: &str) -> Result<String, String> {
    let url = format!("http://{server}{ATTRIBUTES}/{attribute}");
    let client = reqwest::Client::builder()
        .timeout(TIMEOUT)
        .build()
        .map_err(|e| e.to_string())?;
    let response = client
        .get(&url)
        .header("Metadata-Flavor", "Google")
        .send()
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    if !response.status().is_success() {
        return Err(format!("{url}: HTTP {}", response.status()));
    }
    response.text().await.map_err(|e| format!("{url}: {e}"))
}

// ---------------------------------------------------------------------------------------------
// host.index = "from-clients": the host learned from the streams.

/// What the streams taught a `"from-clients"` daemon (shared by every copy of its config).
#[derive(Default)]
pub struct Learned {
    state: Mutex<State>,
}

impl std::fmt::Debug for Learned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Learned")
    }
}

#[derive(Default)]
struct State {
    bound: Option<Binding>,
    /// Streams (and plan requests) of the bound host in progress.
    open: usize,
    /// Datasets with `warm = true`: warmed once the host is known.
    warm: Vec<String>,
    /// The host whose share was last checked and warmed.
    adopted: Option<Topology>,
    adopting: Option<tokio::task::AbortHandle>,
    /// `shardd_host_index` (-1 until learned) and `shardd_host_count`.
    gauges: Option<(prometheus::IntGauge, prometheus::IntGauge)>,
}

struct Binding {
    host: Topology,
    /// Who taught it, for the refusal of a stream that disagrees.
    by: String,
    /// The daemon with `config.host` set to it, while a connection holds it (weak: it holds
    /// this state through its config).
    daemon: std::sync::Weak<Daemon>,
}

/// The daemon a connection is served by (with this host's place filled in), held for the
/// connection's life.
pub struct Bound {
    pub daemon: Arc<Daemon>,
    _open: Option<Open>,
}

/// Counts an open stream of the bound host.
struct Open(Arc<Learned>);

impl Drop for Open {
    fn drop(&mut self) {
        let mut state = self.0.state.lock().unwrap();
        state.open = state.open.saturating_sub(1);
    }
}

/// Why a request cannot be served by this daemon's host (an ERROR frame's code and message).
#[derive(Debug)]
pub struct Refused {
    pub code: &'static str,
    pub message: String,
}

/// This host's place as the daemon serves it now: with `"from-clients"`, the host learned
/// from the streams (index 0 until the first one).
pub fn current(config: &Config) -> Topology {
    if !config.host_auto.from_clients {
        return config.host;
    }
    let state = config.host_learned.state.lock().unwrap();
    state.bound.as_ref().map_or(config.host, |b| b.host)
}

/// The daemon that serves `req`: `daemon` itself when its host is fixed; with
/// `host.index = "from-clients"`, the daemon of the host that `req`'s rank is on, learned
/// from the first request (and again from the first one after every stream has ended). A
/// request of another host while a stream of the learned one is open is refused.
pub fn bind(
    daemon: &Arc<Daemon>,
    req: &Request,
    peer: Option<tokio::net::unix::UCred>,
) -> Result<Bound, Refused> {
    let config = &daemon.config;
    let unbound = || Bound {
        daemon: daemon.clone(),
        _open: None,
    };
    if !config.host_auto.from_clients {
        return Ok(unbound());
    }
    let count = config.host.count;
    if req.world_size == 0 || req.rank >= req.world_size || !req.world_size.is_multiple_of(count) {
        // No host to learn: the plan refuses it with the usual message.
        return Ok(unbound());
    }
    let host = Topology {
        index: req.rank / (req.world_size / count),
        count,
    };
    let learned = config.host_learned.clone();
    let mut state = learned.state.lock().unwrap();
    let (index_gauge, count_gauge) = state
        .gauges
        .get_or_insert_with(|| gauges(&daemon.streams.metrics.registry))
        .clone();
    let who = format!(
        "rank {} of world_size {}{}",
        req.rank,
        req.world_size,
        peer.and_then(|p| p.pid())
            .map(|pid| format!(" (pid {pid})"))
            .unwrap_or_default()
    );
    match &state.bound {
        Some(b) if b.host == host => {}
        Some(b) if state.open > 0 => {
            return Err(Refused {
                code: "bad_topology",
                message: format!(
                    "host.index = \"from-clients\": this daemon serves host {} of {count}, learned from the stream of {}; {who} is on host {} of {count}. Every trainer process on a node must be of one host of the job: is host.count ({count}) the number of nodes the job runs on, and does no other job's trainer share this node? (The daemon learns its host again once none of its streams is open.)",
                    b.host.index, b.by, host.index
                ),
            });
        }
        previous => {
            match previous {
                Some(b) => tracing::warn!(
                    from = b.host.index,
                    to = host.index,
                    count,
                    by = %who,
                    "this host's place changed: no stream was open, and a stream of another host came (a new job placed its trainers differently); the cache keeps the old share until it is evicted"
                ),
                None => tracing::info!(
                    index = host.index,
                    count,
                    by = %who,
                    "learned this host's place from the first stream"
                ),
            }
            let bound = as_host(daemon, host);
            if state.adopted != Some(host) {
                if let Some(task) = state.adopting.take() {
                    task.abort();
                }
                let task = tokio::spawn(adopt(bound.clone(), state.warm.clone()));
                state.adopting = Some(task.abort_handle());
                state.adopted = Some(host);
            }
            index_gauge.set(host.index as i64);
            count_gauge.set(count as i64);
            state.bound = Some(Binding {
                host,
                by: who,
                daemon: Arc::downgrade(&bound),
            });
        }
    }
    state.open += 1;
    let binding = state.bound.as_mut().expect("bound above");
    let bound = binding.daemon.upgrade().unwrap_or_else(|| {
        let bound = as_host(daemon, host);
        binding.daemon = Arc::downgrade(&bound);
        bound
    });
    drop(state);
    Ok(Bound {
        daemon: bound,
        _open: Some(Open(learned)),
    })
}

/// `daemon` serving as `host`: the same cache, streams and board.
fn as_host(daemon: &Daemon, host: Topology) -> Arc<Daemon> {
    let mut config = daemon.config.clone();
    config.host = host;
    config.host_auto.from_clients = false;
    let s = &daemon.streams;
    Arc::new(Daemon {
        config,
        streams: crate::serve::stream::StreamContext {
            cache: s.cache.clone(),
            indexes: s.indexes.clone(),
            plans: s.plans.clone(),
            metrics: s.metrics.clone(),
            stall_timeout: s.stall_timeout,
            map_budget: s.map_budget.clone(),
        },
        board: daemon.board.clone(),
    })
}

fn gauges(registry: &prometheus::Registry) -> (prometheus::IntGauge, prometheus::IntGauge) {
    let gauge = |name: &str, help: &str| {
        let g = prometheus::IntGauge::new(name, help).expect("a valid metric");
        // Registered once per daemon (the state holds them).
        let _ = registry.register(Box::new(g.clone()));
        g
    };
    let index = gauge(
        "host_index",
        "This host's index among the job's hosts, learned from the streams (host.index = \"from-clients\"; -1 until the first stream).",
    );
    index.set(-1);
    (
        index,
        gauge("host_count", "host.count: the hosts of the job."),
    )
}

/// What a daemon does at start for its host's share, done once the host is learned: checks
/// that the share is unchanged since each manifest was written (and learns its CRC-32Cs),
/// then warms the datasets that ask for it. In the background: the first stream does not wait.
async fn adopt(daemon: Arc<Daemon>, warm: Vec<String>) {
    let config = &daemon.config;
    let cache = &daemon.streams.cache;
    let stores = cache.stores();
    for dataset in config.datasets.values() {
        let Some(source) = dataset.manifest.clone() else {
            continue;
        };
        let checked = async {
            let (manifest, at) =
                crate::shard::manifest::load(stores, &source, &dataset.shards).await?;
            let share = crate::plan::warm_shards(dataset.shape(), config.host);
            let share_at: Vec<usize> = share.iter().map(|&i| at[i]).collect();
            stores.know_crc32c(share_at.iter().map(|&i| {
                let e = &manifest.shards[i];
                (e.url.as_str(), &e.version, e.crc32c)
            }));
            let urls: Vec<_> = share.iter().map(|&i| dataset.shards[i].clone()).collect();
            crate::shard::manifest::check_unchanged(
                stores,
                &manifest,
                &source,
                &urls,
                &share_at,
                config.max_downloads,
            )
            .await?;
            Ok::<usize, crate::shard::manifest::ManifestError>(urls.len())
        };
        match checked.await {
            Ok(n) => tracing::info!(
                dataset = %dataset.name,
                host = config.host.index,
                checked_shards = n,
                "manifest checked for the learned host's share"
            ),
            Err(e) => tracing::error!(
                dataset = %dataset.name,
                host = config.host.index,
                error = %e,
                "the learned host's share does not match the manifest: re-index the dataset (shardd index)"
            ),
        }
    }
    for name in &warm {
        let Some(dataset) = config.datasets.get(name) else {
            continue;
        };
        let share: Vec<_> = crate::plan::warm_shards(dataset.shape(), config.host)
            .into_iter()
            .map(|i| dataset.shards[i].clone())
            .collect();
        let (mut loaded, mut failed) = (0u64, 0usize);
        let complete =
            crate::serve::prefetch::warm(cache, &share, config.max_downloads, |r| match r {
                Ok(crate::cache::Ensured::Loaded(n)) => loaded += n,
                Ok(_) => {}
                Err(_) => failed += 1,
            })
            .await;
        tracing::info!(
            dataset = %name,
            host = config.host.index,
            shards = share.len(),
            loaded_bytes = loaded,
            failed,
            complete,
            "warmed the cache with the learned host's share"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Sizing: the cache budget against its file system, and the working set of a job.

/// The file system a cache directory is on (the directory, or its nearest existing parent).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Space {
    /// The directory measured.
    pub measured: PathBuf,
    /// The file system's size, and what an unprivileged writer may still use of it.
    pub size: u64,
    pub free: u64,
    /// Disk space the files under the cache directory take now (a restarted daemon's
    /// entries: free for the cache, which replaces them).
    pub cached: u64,
}

impl Space {
    /// What the cache may take: the free space plus what it holds already.
    pub fn available(&self) -> u64 {
        self.free.saturating_add(self.cached)
    }
}

/// Measures the file system of `dir` (statvfs of it or its nearest existing parent) and
/// what the files under `dir` take.
pub fn space(dir: &Path) -> std::io::Result<Space> {
    let mut last = None;
    for at in dir.ancestors() {
        let at = if at.as_os_str().is_empty() {
            Path::new(".")
        } else {
            at
        };
        match rustix::fs::statvfs(at) {
            Ok(v) => {
                return Ok(Space {
                    measured: at.to_path_buf(),
                    size: v.f_blocks.saturating_mul(v.f_frsize),
                    free: v.f_bavail.saturating_mul(v.f_frsize),
                    cached: if at == dir { disk_usage(dir) } else { 0 },
                });
            }
            Err(e) => last = Some(e),
        }
    }
    Err(last.map_or_else(
        || std::io::Error::other("no directory to measure"),
        std::io::Error::from,
    ))
}

/// Bytes of disk the regular files under `dir` take (st_blocks), not following links.
fn disk_usage(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0u64;
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(d) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for entry in entries.flatten() {
            let Ok(m) = entry.metadata() else { continue };
            if m.is_dir() {
                dirs.push(entry.path());
            } else if m.is_file() {
                total = total.saturating_add(m.blocks().saturating_mul(512));
            }
        }
    }
    total
}

/// `cache.max_size`: a size (`"300GiB"`), or `"auto"` (80%) / `"N%"`: that share of what the
/// cache may take of its file system when the config is read (the free space plus what the
/// cache directory holds already, so a restart with a full cache keeps its budget). Returns
/// the bytes and the share.
pub fn cache_budget(spec: &str, dir: &Path) -> Result<(u64, Option<f64>), ConfigError> {
    let text = spec.trim();
    let share = if text.eq_ignore_ascii_case("auto") {
        AUTO_SHARE
    } else if let Some(percent) = text.strip_suffix('%') {
        match percent.trim().parse::<f64>() {
            Ok(p) if p > 0.0 && p <= 100.0 => p / 100.0,
            _ => {
                return Err(ConfigError::Invalid(format!(
                    "cache.max_size {spec:?} is not a share of the free space between 0% and 100% like \"50%\""
                )));
            }
        }
    } else {
        return crate::config::parse_size(text, "cache.max_size").map(|b| (b, None));
    };
    let space = space(dir).map_err(|e| {
        ConfigError::Invalid(format!(
            "cache.max_size {spec:?}: cannot measure the file system of cache.dir {}: {e}",
            dir.display()
        ))
    })?;
    Ok(((space.available() as f64 * share) as u64, Some(share)))
}

/// What `check` and `serve` say about `cache.max_size` against its file system: a budget
/// larger than the file system, or than its free space (plus what the cache holds).
pub fn space_warnings(config: &Config) -> Vec<String> {
    let max = config.cache_max_bytes;
    let space = match space(&config.cache_dir) {
        Ok(s) => s,
        Err(e) => {
            return vec![format!(
                "cannot measure the file system of cache.dir {}: {e}",
                config.cache_dir.display()
            )];
        }
    };
    let on = if space.measured == config.cache_dir {
        format!("{}", space.measured.display())
    } else {
        format!(
            "{} (its nearest existing parent {})",
            config.cache_dir.display(),
            space.measured.display()
        )
    };
    let auto = (AUTO_SHARE * space.available() as f64) as u64;
    let mut out = Vec::new();
    if max > space.size {
        out.push(format!(
            "cache.max_size ({max} bytes) is more than the whole file system of cache.dir {on} holds ({} bytes): the disk fills before the cache does; set max_size = \"auto\" ({AUTO_SHARE} of the free space: {auto} bytes now) or a size below {} bytes",
            space.size,
            space.available()
        ));
    } else if max > space.available() {
        out.push(format!(
            "cache.max_size ({max} bytes) is more than the free space of cache.dir {on}: {} bytes free{}; the disk fills before the cache does; set max_size = \"auto\" ({AUTO_SHARE} of the free space: {auto} bytes now) or a size below {} bytes",
            space.free,
            if space.cached > 0 {
                format!(" and {} held by the cache", space.cached)
            } else {
                String::new()
            },
            space.available()
        ));
    }
    out
}

/// The cache budget in one line, for the daemon's log at start.
pub fn budget_line(config: &Config) -> String {
    let max = config.cache_max_bytes;
    match (config.cache_max_share, space(&config.cache_dir)) {
        (Some(share), Ok(s)) => format!(
            "cache.max_size: {max} bytes ({}% of the {} bytes free on the file system of {} plus the {} bytes the cache holds)",
            share * 100.0,
            s.free,
            s.measured.display(),
            s.cached
        ),
        _ => format!("cache.max_size: {max} bytes"),
    }
}

/// The cache a host needs for `streams` streams of one dataset at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct WorkingSet {
    pub streams: u64,
    /// Shards one shuffle window spans: ⌈shuffle_buffer / samples per shard⌉.
    pub window_shards: u64,
    /// Shards one stream holds: its window's, the one it parses next and one loading.
    pub stream_shards: u64,
    /// The mean shard size (rounded up).
    pub shard_bytes: u64,
    /// streams × stream_shards × shard_bytes, at most the whole share.
    pub bytes: u64,
    /// The budget under which zero copy's maps (server.zero_copy_maps shards per stream, at
    /// most server.zero_copy_share of the budget) still leave room for `bytes`; at most the
    /// whole share.
    pub min_budget: u64,
}

/// The working set of `streams` streams over a share of `shards` shards holding `samples`
/// samples in `bytes` bytes (for a host: its share; `bytes` caps the result: a budget that
/// holds the share holds every window).
pub fn working_set(
    streams: u64,
    shuffle_buffer: u64,
    shards: u64,
    samples: u64,
    bytes: u64,
    zero_copy_maps: u64,
    zero_copy_share: f64,
) -> WorkingSet {
    let shard_bytes = bytes.div_ceil(shards.max(1));
    let window_shards = if samples == 0 {
        1
    } else {
        // ⌈shuffle_buffer / (samples / shards)⌉, in integers.
        ((shuffle_buffer as u128 * shards as u128).div_ceil(samples as u128) as u64).max(1)
    };
    let stream_shards = window_shards + 2;
    let held = streams
        .saturating_mul(stream_shards)
        .saturating_mul(shard_bytes)
        .min(bytes);
    let maps = streams
        .saturating_mul(zero_copy_maps)
        .saturating_mul(shard_bytes);
    // B - min(maps, share·B) >= held: B = held + maps, or held / (1 - share) if smaller.
    let with_maps = held.saturating_add(maps);
    let capped = if zero_copy_share < 1.0 {
        (held as f64 / (1.0 - zero_copy_share)).ceil() as u64
    } else {
        u64::MAX
    };
    WorkingSet {
        streams,
        window_shards,
        stream_shards,
        shard_bytes,
        bytes: held,
        min_budget: with_maps.min(capped).min(bytes).max(held),
    }
}

/// How many streams' working sets `budget` holds at once (with zero copy's maps).
pub fn streams_that_fit(budget: u64, one: &WorkingSet, zero_copy_maps: u64, share: f64) -> u64 {
    let per_stream = one.stream_shards.saturating_mul(one.shard_bytes).max(1);
    let maps = zero_copy_maps.saturating_mul(one.shard_bytes);
    let a = budget / per_stream.saturating_add(maps);
    let b = ((budget as f64 * (1.0 - share.clamp(0.0, 1.0))) / per_stream as f64) as u64;
    a.max(b)
}

/// The share of the budget zero copy's maps may pin, from a validated config.
pub fn zero_copy_share(config: &Config) -> f64 {
    if config.zero_copy_maps == 0 {
        0.0
    } else {
        config.zero_copy_share
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 10 shards of 100 bytes and 10 samples: a window of 25 samples spans 3 shards, a stream
    /// holds 5.
    #[test]
    fn working_sets() {
        let ws = |streams, maps, share| working_set(streams, 25, 10, 100, 1000, maps, share);
        let two = ws(2, 0, 0.0);
        assert_eq!(
            (two.window_shards, two.stream_shards, two.shard_bytes),
            (3, 5, 100)
        );
        assert_eq!((two.bytes, two.min_budget), (1000, 1000));
        let one = ws(1, 0, 0.0);
        assert_eq!((one.bytes, one.min_budget), (500, 500));
        // Maps: 16 a stream (1600 bytes), at most a quarter of the budget: 500 / 0.75.
        assert_eq!(ws(1, 16, 0.25).min_budget, 667);
        // One map a stream is less than that quarter.
        assert_eq!(ws(1, 1, 0.25).min_budget, 600);
        // Every map may pin the whole budget: the maps all count; but never past the share.
        assert_eq!(ws(1, 1, 1.0).min_budget, 600);
        assert_eq!(ws(1, 16, 1.0).min_budget, 1000);
        // An uneven window: 7 samples over shards of 10/3 samples (3 shards, 10 samples) is
        // ⌈7 · 3 / 10⌉ = 3 shards.
        assert_eq!(working_set(1, 7, 3, 10, 300, 0, 0.0).window_shards, 3);
        // No samples known: one shard a window.
        assert_eq!(working_set(1, 7, 3, 0, 300, 0, 0.0).window_shards, 1);
    }

    #[test]
    fn streams_that_fit_the_budget() {
        let one = working_set(1, 25, 10, 100, 1000, 16, 0.25);
        assert_eq!(streams_that_fit(666, &one, 16, 0.25), 0);
        assert_eq!(streams_that_fit(667, &one, 16, 0.25), 1);
        assert_eq!(streams_that_fit(2000, &one, 16, 0.25), 3);
        assert_eq!(streams_that_fit(2000, &one, 0, 0.0), 4);
    }

    #[test]
    fn budgets_are_sizes_or_shares_of_the_free_space() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("entry"), vec![1u8; 1 << 20]).unwrap();
        let s = space(dir.path()).unwrap();
        assert_eq!(s.measured, dir.path());
        assert!(s.cached >= 1 << 20 && s.size >= s.free, "{s:?}");
        // A directory not made yet: its nearest existing parent, holding nothing of the cache.
        let later = space(&dir.path().join("a/b")).unwrap();
        assert_eq!((later.measured.as_path(), later.cached), (dir.path(), 0));
        assert_eq!(
            cache_budget("300GiB", dir.path()).unwrap(),
            (300 << 30, None)
        );
        let (bytes, share) = cache_budget("auto", dir.path()).unwrap();
        assert_eq!(share, Some(0.8));
        let now = space(dir.path()).unwrap().available() as f64;
        assert!(
            (bytes as f64 - 0.8 * now).abs() < 0.01 * now,
            "{bytes} {now}"
        );
        assert_eq!(cache_budget(" 50 %", dir.path()).unwrap().1, Some(0.5));
        for bad in ["0%", "101%", "x%", "-5%"] {
            let err = cache_budget(bad, dir.path()).unwrap_err().to_string();
            assert!(err.contains("between 0% and 100%"), "{bad}: {err}");
        }
    }
}
