//! Layer 1: what the config file says, as serde reads it (unknown keys are an error). Every
//! key and its default is in `config.example.toml` and `docs/configuration.md`.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::Deserialize;

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
#[derive(Debug, Clone)]
pub enum HostValue {
    Number(u32),
    Word(String),
}

/// By hand, not `#[serde(untagged)]`: its error for `index = -1` was "data did not match any
/// variant of untagged enum HostValue"; this one says what is expected.
impl<'de> Deserialize<'de> for HostValue {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = HostValue;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a whole number from 0, \"auto\" or \"from-clients\"")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<HostValue, E> {
                u32::try_from(v)
                    .map(HostValue::Number)
                    .map_err(|_| E::invalid_value(serde::de::Unexpected::Unsigned(v), &self))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<HostValue, E> {
                match u64::try_from(v) {
                    Ok(v) => self.visit_u64(v),
                    Err(_) => Err(E::invalid_value(serde::de::Unexpected::Signed(v), &self)),
                }
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<HostValue, E> {
                Ok(HostValue::Word(v.to_string()))
            }
        }
        d.deserialize_any(Visitor)
    }
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
    pub block_size: String,
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
            block_size: "2MiB".into(),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreSection {
    pub max_downloads: usize,
    pub connect_timeout: String,
    pub read_timeout: String,
    /// Only 0 means something now (no retries): retries are bounded by `retry_timeout`.
    pub retries: usize,
    pub retry_timeout: String,
    /// Requests per second to each bucket at most; 0: no ceiling.
    pub max_requests_per_second: f64,
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
            max_requests_per_second: 0.0,
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
    /// A mix's schedule: other weights from an epoch, or from a job-wide sample, on.
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

/// `schedule = [{ epoch = 10, mix = { web = 1, books = 1 } }]`: from `epoch` on, these
/// weights; or `{ at = 2_000_000, mix = ... }`: from the job-wide sample `at` on.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScheduleEntry {
    #[serde(default)]
    pub epoch: Option<u64>,
    #[serde(default)]
    pub at: Option<u64>,
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
