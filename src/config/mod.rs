//! Configuration: the TOML file as written by an operator ([`FileConfig`]), validated once at
//! start into the runtime [`Config`]. Every key and its default is documented in
//! `config.example.toml`; unknown keys are an error so a typo never silently falls back to a
//! default.

pub mod braces;
mod file;
pub mod host;
mod merge;
pub mod space;
pub mod url;
mod validate;
mod values;

pub use file::*;
pub use merge::{merge_tables, parse_table};
use validate::identity;
pub use values::{parse_duration, parse_size, parse_timeout};

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::config::url::{ShardUrl, UrlError};
/// The plan owns the topology type; the config fills it in (`[host]`).
pub use host::Topology;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("invalid config {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("invalid config: {0}")]
    Invalid(String),
    #[error("invalid config: dataset {dataset:?}: {source}")]
    Url { dataset: String, source: UrlError },
}

fn invalid(msg: impl Into<String>) -> ConfigError {
    ConfigError::Invalid(msg.into())
}

#[derive(Debug, Clone)]
pub struct Config {
    pub socket: PathBuf,
    pub socket_mode: u32,
    /// Group (name or number) the socket file is given, when set.
    pub socket_group: Option<String>,
    /// `None` when `metrics_addr = ""`: no HTTP listener.
    pub metrics_addr: Option<std::net::SocketAddr>,
    pub max_connections: usize,
    pub handshake_timeout: Duration,
    pub stall_timeout: Duration,
    /// Shard files one zero-copy connection may hold mapped (protocol 5; 0: zero copy off).
    pub zero_copy_maps: usize,
    /// Bytes the maps of all zero-copy connections may pin together...
    pub zero_copy_bytes: u64,
    /// ...`server.zero_copy_share` of `cache_max_bytes`.
    pub zero_copy_share: f64,
    /// This host among the job's hosts; where `host_auto` says so, a placeholder until
    /// [`crate::config::host::resolve`] has found it.
    pub host: Topology,
    pub host_auto: HostAuto,
    /// `host.index = "from-clients"`: the datasets with `warm = true`, warmed once the first
    /// stream says which host this is ([`crate::serve::learned_host`]).
    pub deferred_warm: Vec<String>,
    pub cache_dir: PathBuf,
    /// `cache.max_size`: a size, or (`"auto"`, `"N%"`) a share of the cache file system's
    /// free space found when the config is read (`space::cache_budget`).
    pub cache_max_bytes: u64,
    /// The share of the free space when `cache.max_size` is `"auto"` or `"N%"`.
    pub cache_max_share: Option<f64>,
    pub prefetch_shards: usize,
    pub revalidate: Duration,
    pub space_timeout: Duration,
    /// Memory for the sample indexes of cached shards (`sample_index.rs`).
    pub index_memory: u64,
    /// The size of a cache file's writes (`blocks.rs`).
    pub cache_block_size: usize,
    pub max_downloads: usize,
    pub connect_timeout: Duration,
    pub read_timeout: Duration,
    /// How long a store may push back on one request (429, 5xx, timeouts) before it fails,
    /// from its first failure; zero (`store.retries = 0`): no retries.
    pub retry_timeout: Duration,
    /// `store.max_requests_per_second`: the ceiling of this host's request rate to each
    /// bucket, if any.
    pub max_requests_per_second: Option<f64>,
    /// How long a store may take to produce its credentials when asked at start.
    pub credentials_timeout: Duration,
    pub part_size: u64,
    pub parts_in_flight: usize,
    pub verify: Verify,
    pub gcs: Option<GcsSection>,
    pub s3: Option<S3Section>,
    pub datasets: BTreeMap<String, Dataset>,
    /// Mixes of the datasets above (`[datasets.NAME] mix = {...}`), served like datasets.
    pub mixes: BTreeMap<String, MixDataset>,
}

/// A weighted mix of datasets of the same config: every stream interleaves its sources so
/// that each prefix holds them in proportion (`plan/mix.rs`, which also computes its weights,
/// quotas and where each epoch starts), and reads each as its own stream.
#[derive(Debug, Clone)]
pub struct MixDataset {
    pub name: String,
    /// (source dataset, weight), in name order: the weights of epoch 0.
    pub sources: Vec<(String, u64)>,
    /// Samples every stream of the mix gets per epoch.
    pub samples_per_epoch: u64,
    /// A schedule: (where the weights start, weights in `sources` order), increasing and all
    /// of one kind.
    pub schedule: Vec<(ScheduleFrom, Vec<u64>)>,
}

/// A schedule entry's start, as the config says it: `epoch = N` or `at = N`.
impl std::fmt::Display for ScheduleFrom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ScheduleFrom::Epoch(e) => write!(f, "epoch = {e}"),
            ScheduleFrom::Sample(n) => write!(f, "at = {n}"),
        }
    }
}

/// Where a schedule entry's weights start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScheduleFrom {
    /// At the start of this epoch (≥ 1).
    Epoch(u64),
    /// At the first step where the job has read this many samples (≥ 1), counted over every
    /// stream of the job: `plan/mix/schedule.rs`.
    Sample(u64),
}

/// How a download is checked against its source (`store.verify`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verify {
    /// The strongest check the source allows: a CRC-32C the store or the manifest gives, else
    /// an MD5 the store vouches for, else the size.
    Auto,
    /// The size only (and the ETag pin): for stores whose checksums are known to be wrong.
    Size,
    /// A checksum is required: a download with none to check against fails.
    Checksum,
}

/// Which of `host.index` and `host.count` are `"auto"`, and whether the index is
/// `"from-clients"`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostAuto {
    pub index: bool,
    pub count: bool,
    pub from_clients: bool,
}

#[derive(Debug, Clone)]
pub struct Dataset {
    pub name: String,
    /// Every shard, in the order the patterns expand to. The plan is a function of this order.
    /// Shared: the copies of the config a daemon keeps (status board, warmer) hold one list.
    pub shards: std::sync::Arc<[ShardUrl]>,
    pub shuffle_buffer: usize,
    /// Keys the host share (which shards this host owns); independent of the run's seed so
    /// that a new run on the same hosts finds its shards in the cache.
    pub share_seed: u64,
    /// Fill the cache with this host's share at start, before any trainer asks.
    pub warm: bool,
    /// Where the manifest is (`shardd index` writes it): exact, equal epochs in samples.
    pub manifest: Option<ShardUrl>,
    /// Samples every stream gets per epoch (manifest mode), wrapping into the next pass.
    pub samples_per_epoch: Option<u64>,
    /// Streams draw shards of the host's share with replacement (webdataset's `resampled`).
    pub resampled: bool,
    /// Samples per shard, in `shards` order, once the daemon has loaded and checked the
    /// manifest (set it with [`Dataset::set_counts`]).
    pub counts: Option<std::sync::Arc<[u64]>>,
    /// MD5 of the shard list and the counts: what the data is, for plan fingerprints.
    identity: [u8; 16],
    /// What its plans share; new when the counts are set.
    pub(crate) share: std::sync::Arc<ShareCache>,
}

/// What every plan of a dataset would otherwise recompute from all its shards: the share
/// order and the running sample counts along it (`plan` fills it in). It lives with the dataset (whose shard
/// list, counts and `share_seed` never change once loaded), so a plan costs O(log shards +
/// pieces of the host) instead of a shuffle and a walk over every shard (~80 ms at a million).
#[derive(Default)]
pub struct ShareCache {
    pub(crate) order: std::sync::OnceLock<std::sync::Arc<[usize]>>,
    /// `ends[i]`: samples of the first `i + 1` shards in share order.
    pub(crate) ends: std::sync::OnceLock<std::sync::Arc<[u64]>>,
    /// After a resize, every host's head of its sequence, by what they depend on (seed,
    /// history, host count, mix source), the last few (`plan/passes.rs`).
    #[allow(clippy::type_complexity)]
    pub(crate) heads:
        std::sync::Mutex<Vec<(Vec<u64>, std::sync::Arc<dyn std::any::Any + Send + Sync>)>>,
}

impl std::fmt::Debug for ShareCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ShareCache")
    }
}

impl Dataset {
    pub fn set_counts(&mut self, counts: std::sync::Arc<[u64]>) {
        self.counts = Some(counts);
        self.identity = identity(&self.shards, self.counts.as_deref());
        self.share = Default::default();
    }

    pub fn identity(&self) -> [u8; 16] {
        self.identity
    }
}

impl Config {
    /// Reads, parses and validates a config file. Relative paths in it (shards, manifests,
    /// `cache.dir`, a key file) are resolved against the config file's directory, made
    /// absolute once, so a config means the same whatever the working directory and however
    /// its path was typed (`--config rel.toml` too).
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.into(),
            source,
        })?;
        let base = match path.parent() {
            Some(dir) if !dir.as_os_str().is_empty() => dir,
            _ => Path::new("."),
        };
        let base = std::path::absolute(base).map_err(|source| ConfigError::Read {
            path: path.into(),
            source,
        })?;
        Self::parse(&text, &base).map_err(|e| match e {
            ConfigError::Parse { message, .. } => ConfigError::Parse {
                path: path.into(),
                message,
            },
            other => other,
        })
    }

    pub fn parse(text: &str, base_dir: &Path) -> Result<Config, ConfigError> {
        let file: FileConfig = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: PathBuf::from("<string>"),
            message: e.to_string(),
        })?;
        file.validate(base_dir)
    }
}

#[cfg(test)]
mod tests;
