//! Configuration: the TOML file as written by an operator ([`FileConfig`]), validated once at
//! start into the runtime [`Config`]. Every key and its default is documented in
//! `config.example.toml`; unknown keys are an error so a typo never silently falls back to a
//! default.

pub mod braces;
pub mod host;
pub mod space;
pub mod url;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

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

// ---------------------------------------------------------------------------------------------
// Layer 1: what the file says.

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    #[serde(default)]
    pub server: ServerSection,
    #[serde(default)]
    pub host: HostSection,
    #[serde(default)]
    pub cache: CacheSection,
    #[serde(default)]
    pub store: StoreSection,
    pub gcs: Option<GcsSection>,
    pub s3: Option<S3Section>,
    #[serde(default)]
    pub datasets: BTreeMap<String, DatasetSection>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerSection {
    pub socket: PathBuf,
    pub socket_mode: String,
    pub socket_group: Option<String>,
    pub metrics_addr: String,
    pub max_connections: usize,
    pub handshake_timeout: String,
    pub stall_timeout: String,
    pub zero_copy_maps: usize,
    pub zero_copy_share: f64,
}

impl Default for ServerSection {
    fn default() -> Self {
        Self {
            socket: "/run/shardd/shardd.sock".into(),
            socket_mode: "0660".into(),
            socket_group: None,
            metrics_addr: "127.0.0.1:9464".into(),
            max_connections: 1024,
            handshake_timeout: "10s".into(),
            stall_timeout: "60s".into(),
            zero_copy_maps: 16,
            zero_copy_share: 0.25,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HostSection {
    pub index: HostValue,
    pub count: HostValue,
}

/// `index = 3`, or `index = "auto"`: found at start, or (index only) `"from-clients"`:
/// learned from the first stream (see `host.rs`).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum HostValue {
    Number(u32),
    Word(String),
}

impl Default for HostSection {
    fn default() -> Self {
        Self {
            index: HostValue::Number(0),
            count: HostValue::Number(1),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CacheSection {
    pub dir: PathBuf,
    pub max_size: String,
    pub prefetch_shards: usize,
    pub revalidate: String,
    pub space_timeout: String,
    pub index_memory: String,
}

impl Default for CacheSection {
    fn default() -> Self {
        Self {
            dir: "/var/cache/shardd".into(),
            max_size: "auto".into(),
            prefetch_shards: 4,
            revalidate: "10m".into(),
            space_timeout: "30s".into(),
            index_memory: "256MiB".into(),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreSection {
    pub max_downloads: usize,
    pub connect_timeout: String,
    pub read_timeout: String,
    pub retries: usize,
    pub retry_timeout: String,
    pub credentials_timeout: String,
    pub part_size: String,
    pub parts_in_flight: usize,
    pub verify: String,
}

impl Default for StoreSection {
    fn default() -> Self {
        Self {
            max_downloads: 16,
            connect_timeout: "10s".into(),
            read_timeout: "60s".into(),
            retries: 10,
            retry_timeout: "3m".into(),
            credentials_timeout: "10s".into(),
            part_size: "64MiB".into(),
            parts_in_flight: 4,
            verify: "auto".into(),
        }
    }
}

#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GcsSection {
    pub endpoint: Option<String>,
    /// A service-account key file (relative paths: to the config file's directory).
    pub credentials: Option<PathBuf>,
    pub anonymous: bool,
    /// A plain-http endpoint that is not loopback is refused unless this says so.
    pub allow_http: bool,
}

#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct S3Section {
    pub endpoint: Option<String>,
    pub region: Option<String>,
    pub anonymous: bool,
    pub allow_http: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatasetSection {
    /// Required, unless the dataset is a mix.
    #[serde(default)]
    pub shards: Option<Patterns>,
    /// A mix of other datasets: `mix = { web = 3, books = 1 }` (integer weights).
    #[serde(default)]
    pub mix: Option<BTreeMap<String, u64>>,
    /// A mix's curriculum: other weights from an epoch on.
    #[serde(default)]
    pub schedule: Vec<ScheduleEntry>,
    #[serde(default = "default_shuffle_buffer")]
    pub shuffle_buffer: usize,
    #[serde(default)]
    pub share_seed: u64,
    #[serde(default)]
    pub warm: bool,
    #[serde(default)]
    pub manifest: Option<String>,
    #[serde(default)]
    pub samples_per_epoch: Option<u64>,
    #[serde(default)]
    pub resampled: bool,
}

/// `schedule = [{ epoch = 10, mix = { web = 1, books = 1 } }]`: from `epoch` on, these weights.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScheduleEntry {
    pub epoch: u64,
    pub mix: BTreeMap<String, u64>,
}

fn default_shuffle_buffer() -> usize {
    10_000
}

/// `shards = "pattern"` or `shards = ["pattern", ...]`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Patterns {
    One(String),
    Many(Vec<String>),
}

// ---------------------------------------------------------------------------------------------
// Layer 2: the validated runtime configuration.

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
    pub max_downloads: usize,
    pub connect_timeout: Duration,
    pub read_timeout: Duration,
    pub retries: usize,
    /// How long one request may be retried, from its first attempt.
    pub retry_timeout: Duration,
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
    /// A curriculum: (first epoch, weights in `sources` order), epochs increasing.
    pub schedule: Vec<(u64, Vec<u64>)>,
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
    /// Reads, parses and validates a config file. Relative local shard paths are resolved
    /// against the config file's directory, so a config means the same whatever the cwd.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.into(),
            source,
        })?;
        let base = path.parent().unwrap_or(Path::new("."));
        Self::parse(&text, base).map_err(|e| match e {
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

impl FileConfig {
    pub fn validate(self, base_dir: &Path) -> Result<Config, ConfigError> {
        let s = self.server;
        let socket_mode = u32::from_str_radix(s.socket_mode.trim_start_matches("0o"), 8)
            .ok()
            .filter(|m| *m <= 0o777)
            .ok_or_else(|| {
                invalid(format!(
                    "server.socket_mode {:?} is not an octal file mode like \"0660\"",
                    s.socket_mode
                ))
            })?;
        let metrics_addr = if s.metrics_addr.is_empty() {
            None
        } else {
            Some(s.metrics_addr.parse().map_err(|_| {
                invalid(format!(
                    "server.metrics_addr {:?} is not an address like \"127.0.0.1:9464\"",
                    s.metrics_addr
                ))
            })?)
        };
        if s.max_connections == 0 {
            return Err(invalid("server.max_connections must be at least 1"));
        }
        let handshake_timeout = parse_timeout(&s.handshake_timeout, "server.handshake_timeout")?;
        let stall_timeout = parse_timeout(&s.stall_timeout, "server.stall_timeout")?;

        let auto = |value: &HostValue, key: &str| match value {
            HostValue::Number(n) => Ok(Some(*n)),
            HostValue::Word(w) if w == "auto" => Ok(None),
            HostValue::Word(w) if w == crate::config::host::FROM_CLIENTS && key == "host.index" => {
                Ok(Some(0))
            }
            HostValue::Word(w) if key == "host.index" => Err(invalid(format!(
                "{key} {w:?} is neither a number, \"auto\" nor \"from-clients\""
            ))),
            HostValue::Word(w) => Err(invalid(format!(
                "{key} {w:?} is neither a number nor \"auto\""
            ))),
        };
        let from_clients = matches!(&self.host.index, HostValue::Word(w) if w == crate::config::host::FROM_CLIENTS);
        let (index, count) = (
            auto(&self.host.index, "host.index")?,
            auto(&self.host.count, "host.count")?,
        );
        let host_auto = HostAuto {
            index: index.is_none(),
            count: count.is_none(),
            from_clients,
        };
        let host = Topology {
            index: index.unwrap_or(0),
            count: count.unwrap_or(1),
        };
        if !host_auto.count {
            host.check().map_err(invalid)?;
        }

        let (cache_max_bytes, cache_max_share) =
            crate::config::space::cache_budget(&self.cache.max_size, &self.cache.dir)?;
        if !(0.0..=1.0).contains(&s.zero_copy_share) {
            return Err(invalid(format!(
                "server.zero_copy_share {} is not a share of cache.max_size between 0 and 1",
                s.zero_copy_share
            )));
        }
        let zero_copy_bytes = (cache_max_bytes as f64 * s.zero_copy_share) as u64;
        if self.cache.prefetch_shards == 0 {
            return Err(invalid("cache.prefetch_shards must be at least 1"));
        }
        if self.store.max_downloads == 0 {
            return Err(invalid("store.max_downloads must be at least 1"));
        }
        let revalidate = parse_duration(&self.cache.revalidate, "cache.revalidate")?;
        let space_timeout = parse_timeout(&self.cache.space_timeout, "cache.space_timeout")?;
        let index_memory = parse_size(&self.cache.index_memory, "cache.index_memory")?;
        let part_size = parse_size(&self.store.part_size, "store.part_size")?;
        if part_size < 1 << 20 {
            return Err(invalid("store.part_size must be at least 1MiB"));
        }
        if self.store.parts_in_flight == 0 {
            return Err(invalid("store.parts_in_flight must be at least 1"));
        }
        let connect_timeout = parse_timeout(&self.store.connect_timeout, "store.connect_timeout")?;
        let read_timeout = parse_timeout(&self.store.read_timeout, "store.read_timeout")?;
        let retry_timeout = parse_timeout(&self.store.retry_timeout, "store.retry_timeout")?;
        let credentials_timeout =
            parse_timeout(&self.store.credentials_timeout, "store.credentials_timeout")?;
        let verify = match self.store.verify.as_str() {
            "auto" => Verify::Auto,
            "size" => Verify::Size,
            "checksum" => Verify::Checksum,
            other => {
                return Err(invalid(format!(
                    "store.verify {other:?} is none of \"auto\", \"size\", \"checksum\""
                )));
            }
        };

        let mut gcs = self.gcs;
        if let Some(g) = &mut gcs {
            check_endpoint(g.endpoint.as_deref(), g.allow_http, "gcs")?;
            if g.anonymous && g.credentials.is_some() {
                return Err(invalid(
                    "gcs.credentials and gcs.anonymous = true contradict each other: choose one",
                ));
            }
            g.credentials = g.credentials.as_ref().map(|p| base_dir.join(p));
        }
        if let Some(s) = &self.s3 {
            check_endpoint(s.endpoint.as_deref(), s.allow_http, "s3")?;
        }
        if self.datasets.is_empty() {
            return Err(invalid("no [datasets.NAME] section: nothing to serve"));
        }
        let mut datasets = BTreeMap::new();
        let mut mix_sections = Vec::new();
        for (name, d) in self.datasets {
            if d.mix.is_some() {
                mix_sections.push((name, d));
                continue;
            }
            let dataset = validate_dataset(&name, d, base_dir)?;
            datasets.insert(name, dataset);
        }
        let mut mixes = BTreeMap::new();
        for (name, d) in mix_sections {
            let mix = validate_mix(&name, d, &datasets)?;
            mixes.insert(name, mix);
        }

        Ok(Config {
            socket: s.socket,
            socket_mode,
            socket_group: s.socket_group,
            metrics_addr,
            max_connections: s.max_connections,
            handshake_timeout,
            stall_timeout,
            zero_copy_maps: s.zero_copy_maps,
            zero_copy_bytes,
            zero_copy_share: s.zero_copy_share,
            host,
            host_auto,
            deferred_warm: Vec::new(),
            cache_dir: self.cache.dir,
            cache_max_bytes,
            cache_max_share,
            prefetch_shards: self.cache.prefetch_shards,
            revalidate,
            space_timeout,
            index_memory,
            max_downloads: self.store.max_downloads,
            connect_timeout,
            read_timeout,
            retries: self.store.retries,
            retry_timeout,
            credentials_timeout,
            part_size,
            parts_in_flight: self.store.parts_in_flight,
            verify,
            gcs,
            s3: self.s3,
            datasets,
            mixes,
        })
    }
}

/// A mix names at least two datasets of this config that have manifests (its streams are
/// exact in samples), with weights ≥ 1, and its `samples_per_epoch`; nothing of its own else.
fn validate_mix(
    name: &str,
    d: DatasetSection,
    datasets: &BTreeMap<String, Dataset>,
) -> Result<MixDataset, ConfigError> {
    let mix = d.mix.unwrap_or_default();
    if d.shards.is_some() || d.manifest.is_some() || d.resampled || d.warm {
        // (and `schedule` belongs to mixes only: checked in validate_dataset)
        return Err(invalid(format!(
            "dataset {name:?}: a mix has no shards, manifest, resampled or warm of its own: set them on its sources"
        )));
    }
    if mix.len() < 2 {
        return Err(invalid(format!(
            "dataset {name:?}: mix needs at least two sources, e.g. mix = {{ web = 3, books = 1 }}"
        )));
    }
    let Some(samples_per_epoch) = d.samples_per_epoch.filter(|&n| n > 0) else {
        return Err(invalid(format!(
            "dataset {name:?}: a mix needs samples_per_epoch (at least 1): the samples every stream gets per epoch"
        )));
    };
    for (source, &weight) in &mix {
        let Some(s) = datasets.get(source) else {
            let known: Vec<&str> = datasets.keys().map(String::as_str).collect();
            return Err(invalid(format!(
                "dataset {name:?}: mix source {source:?} is not a dataset of this config (they are: {}); a mix cannot contain a mix",
                known.join(", ")
            )));
        };
        if s.manifest.is_none() {
            return Err(invalid(format!(
                "dataset {name:?}: mix source {source:?} needs a manifest (shardd index): a mix reads its sources in samples"
            )));
        }
        if weight == 0 {
            return Err(invalid(format!(
                "dataset {name:?}: mix weight of {source:?} must be at least 1"
            )));
        }
    }
    let sources: Vec<(String, u64)> = mix.into_iter().collect();
    let weights: Vec<u64> = sources.iter().map(|s| s.1).collect();
    weights_fit(&weights).map_err(|e| invalid(format!("dataset {name:?}: mix: {e}")))?;
    let mut schedule = Vec::new();
    let mut last = 0;
    for entry in d.schedule {
        if entry.epoch <= last {
            return Err(invalid(format!(
                "dataset {name:?}: schedule epochs must increase from 1 (epoch {} after {last})",
                entry.epoch
            )));
        }
        last = entry.epoch;
        let names: Vec<&String> = entry.mix.keys().collect();
        if names != sources.iter().map(|s| &s.0).collect::<Vec<_>>() {
            return Err(invalid(format!(
                "dataset {name:?}: schedule entry for epoch {} must weigh the mix's sources, all of them: {}",
                entry.epoch,
                sources
                    .iter()
                    .map(|s| s.0.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        let w: Vec<u64> = entry.mix.into_values().collect();
        if w.contains(&0) {
            return Err(invalid(format!(
                "dataset {name:?}: schedule weights must be at least 1 (epoch {})",
                entry.epoch
            )));
        }
        weights_fit(&w).map_err(|e| {
            invalid(format!(
                "dataset {name:?}: schedule entry for epoch {}: {e}",
                entry.epoch
            ))
        })?;
        schedule.push((entry.epoch, w));
    }
    Ok(MixDataset {
        name: name.to_string(),
        sources,
        samples_per_epoch,
        schedule,
    })
}

fn validate_dataset(
    name: &str,
    d: DatasetSection,
    base_dir: &Path,
) -> Result<Dataset, ConfigError> {
    if !d.schedule.is_empty() {
        return Err(invalid(format!(
            "dataset {name:?}: schedule is a mix's curriculum: this dataset has no mix"
        )));
    }
    let Some(shards) = d.shards else {
        return Err(invalid(format!(
            "dataset {name:?}: missing field `shards` (or `mix`, for a mix of other datasets)"
        )));
    };
    let patterns = match shards {
        Patterns::One(p) => vec![p],
        Patterns::Many(ps) => ps,
    };
    if patterns.is_empty() {
        return Err(invalid(format!(
            "dataset {name:?}: shards is an empty list"
        )));
    }
    if d.shuffle_buffer == 0 {
        return Err(invalid(format!(
            "dataset {name:?}: shuffle_buffer must be at least 1 (1 means no sample shuffle)"
        )));
    }
    let mut shards = Vec::new();
    for pattern in &patterns {
        let expanded = braces::expand(pattern)
            .map_err(|e| invalid(format!("dataset {name:?}: pattern {pattern:?}: {e}")))?;
        for url in expanded {
            let shard = ShardUrl::parse(&url, base_dir).map_err(|source| ConfigError::Url {
                dataset: name.to_string(),
                source,
            })?;
            shards.push(shard);
        }
    }
    let manifest = d
        .manifest
        .as_deref()
        .map(|m| ShardUrl::parse(m, base_dir))
        .transpose()
        .map_err(|source| ConfigError::Url {
            dataset: name.to_string(),
            source,
        })?;
    match d.samples_per_epoch {
        Some(0) => {
            return Err(invalid(format!(
                "dataset {name:?}: samples_per_epoch must be at least 1"
            )));
        }
        Some(_) if manifest.is_none() => {
            return Err(invalid(format!(
                "dataset {name:?}: samples_per_epoch needs a manifest (shardd index) to count samples"
            )));
        }
        None if d.resampled => {
            return Err(invalid(format!(
                "dataset {name:?}: resampled = true needs samples_per_epoch (and a manifest): a resampled stream has no end of its own"
            )));
        }
        _ => {}
    }
    let mut seen = rustc_hash::FxHashSet::default();
    seen.reserve(shards.len());
    if let Some(dup) = shards.iter().find(|s| !seen.insert(s.as_str())) {
        return Err(invalid(format!(
            "dataset {name:?}: shard {} is listed twice; every sample must appear once per epoch",
            dup.as_str()
        )));
    }
    Ok(Dataset {
        name: name.to_string(),
        shuffle_buffer: d.shuffle_buffer,
        share_seed: d.share_seed,
        warm: d.warm,
        identity: identity(&shards, None),
        share: Default::default(),
        manifest,
        samples_per_epoch: d.samples_per_epoch,
        resampled: d.resampled,
        counts: None,
        shards: shards.into(),
    })
}

/// Credentials must not travel in clear text by mistake: a plain-http endpoint is accepted
/// only on loopback (an emulator) or when the config says `allow_http = true`.
fn check_endpoint(
    endpoint: Option<&str>,
    allow_http: bool,
    section: &str,
) -> Result<(), ConfigError> {
    let Some(endpoint) = endpoint else {
        return Ok(());
    };
    let url = ::url::Url::parse(endpoint)
        .map_err(|e| invalid(format!("{section}.endpoint {endpoint:?} is not a URL: {e}")))?;
    let loopback = match url.host() {
        Some(::url::Host::Domain(d)) => d == "localhost",
        Some(::url::Host::Ipv4(ip)) => ip.is_loopback(),
        Some(::url::Host::Ipv6(ip)) => ip.is_loopback(),
        None => false,
    };
    if url.scheme() == "http" && !loopback && !allow_http {
        return Err(invalid(format!(
            "{section}.endpoint {endpoint:?} is plain http: credentials would travel in clear text; use https, a loopback address, or set {section}.allow_http = true"
        )));
    }
    Ok(())
}

fn identity(shards: &[ShardUrl], counts: Option<&[u64]>) -> [u8; 16] {
    use md5::Digest;
    let mut h = md5::Md5::new();
    for shard in shards {
        h.update(shard.as_str().as_bytes());
        h.update([0]);
    }
    for n in counts.into_iter().flatten() {
        h.update(n.to_le_bytes());
    }
    h.finalize().into()
}

/// Splits "1.5 GiB" into its number (if it is one, and not negative) and its unit.
fn number_and_unit(text: &str) -> (Option<f64>, String) {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let num = num
        .parse::<f64>()
        .ok()
        .filter(|n| n.is_finite() && *n >= 0.0);
    (num, unit.trim().to_ascii_lowercase())
}

/// Parses "100GiB", "512MB", "1.5 MB", "1 TiB", "4096" (bytes), case-insensitive, exactly
/// (no floating point: parse-size computes in integers).
pub fn parse_size(text: &str, key: &str) -> Result<u64, ConfigError> {
    match parse_size::parse_size(text.trim()) {
        Ok(bytes) => Ok(bytes),
        Err(parse_size::Error::PosOverflow) => Err(invalid(format!("{key} {text:?} is too large"))),
        Err(_) => Err(invalid(format!(
            "{key} {text:?} is not a size like \"100GiB\", \"512MB\" or \"4096\""
        ))),
    }
}

/// Parses "30s", "500ms", "5m", "1h".
pub fn parse_duration(text: &str, key: &str) -> Result<Duration, ConfigError> {
    let (num, unit) = number_and_unit(text);
    let secs: f64 = match unit.as_str() {
        "ms" => 0.001,
        "s" => 1.0,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        _ => f64::NAN,
    };
    match num {
        // try_: `from_secs_f64` panics on a value too large for a Duration.
        Some(n) if secs.is_finite() => Duration::try_from_secs_f64(n * secs)
            .map_err(|_| invalid(format!("{key} {text:?} is too long"))),
        _ => Err(invalid(format!(
            "{key} {text:?} is not a duration like \"30s\", \"500ms\" or \"5m\""
        ))),
    }
}

/// A duration that bounds a wait: zero would fail every wait at once, so it is refused.
pub fn parse_timeout(text: &str, key: &str) -> Result<Duration, ConfigError> {
    let d = parse_duration(text, key)?;
    if d.is_zero() {
        return Err(invalid(format!("{key} {text:?} must be longer than zero")));
    }
    Ok(d)
}

// ---------------------------------------------------------------------------------------------
// Config files merged into one (`shardd merge-config`: a TPU VM's defaults and the config in
// its metadata).

/// A config file's text as a TOML table, not yet validated; errors name `path`.
pub fn parse_table(text: &str, path: &Path) -> Result<toml::Table, ConfigError> {
    toml::from_str(text).map_err(|e| ConfigError::Parse {
        path: path.into(),
        message: e.to_string(),
    })
}

/// Merges `overlay` into `base` table by table, at every depth: where both hold a table under
/// the same key, the two are merged the same way; any other value of `overlay` (a string, a
/// number, an array, an array of tables, or a table where `base` has something else) replaces
/// `base`'s. Keys only in `base` stay. So `[cache] max_size` over defaults that hold
/// `[cache] dir` gives a `[cache]` with both, the overlay's `max_size` winning.
pub fn merge_tables(base: &mut toml::Table, overlay: toml::Table) {
    for (key, value) in overlay {
        match (base.get_mut(&key), value) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge_tables(b, o),
            (_, value) => {
                base.insert(key, value);
            }
        }
    }
}

/// What `plan::mix` needs of a mix's weights beyond the checks above (two or more sources,
/// none 0): a sum that fits in a u64. The same message as its `MixError`.
fn weights_fit(weights: &[u64]) -> Result<(), &'static str> {
    weights
        .iter()
        .try_fold(0u64, |sum, &w| sum.checked_add(w))
        .map(|_| ())
        .ok_or("the source weights add up to more than 2^64 - 1")
}

#[cfg(test)]
mod merge_tests;

#[cfg(test)]
mod tests;
