//! The object stores behind shard URLs, and reading a shard's bytes from its source.
//!
//! `gs://` and `s3://` shards are read through `object_store`, one store per bucket, built once
//! at start-up ([`build`]); local shards (`file://` URLs or plain paths) are copied ([`local`]).
//! Each URL is resolved once into a [`Source`], so every operation has one object branch and
//! one local branch.
//!
//! A shard's [`Version`] is what identifies its content: size, ETag and generation for an
//! object, size, inode and modification time for a local file. A read is checked against it:
//! every ranged GET carries `If-Match: <ETag>`, and a local file that changes while it is
//! copied is an error, never a mixed copy. A read is also checked against the checksums the
//! source vouches for ([`verify`]), computed while the bytes are written ([`download`]).
//!
//! Before its first request a command asks every store for its credentials
//! ([`Stores::check_credentials`]), so a machine without them fails in seconds with one line.
//! Shard downloads in flight on the host are bounded by `store.max_downloads`, of which
//! prefetches may hold at most three quarters: a shard a trainer waits for never queues
//! behind a host's worth of prefetches that a throttling store slows down.
//!
//! A bucket shared by a pod pushes back (429, 503, silence): each request to it is paced by
//! the host's adaptive rate ([`pacing`]) and retried for `store.retry_timeout` ([`retry`]),
//! in the HTTP client under object_store (`http.rs`), each retry with a token that is still
//! good (`resign.rs`).

mod build;
mod credentials;
mod download;
mod http;
mod local;
mod notice;
pub mod pacing;
mod reported;
mod resign;
pub mod retry;
mod verify;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use object_store::path::Path as ObjectPath;
use object_store::{GetOptions, GetRange, GetResult, ObjectStore, ObjectStoreExt};
use tokio::sync::{Semaphore, SemaphorePermit};

use self::build::Bucket;
pub use self::credentials::CredentialsError;
pub use self::retry::{GaveUp, Outcome};
pub use self::verify::{Checked, Fetched};
use crate::config::url::{Location, ShardUrl};
use crate::config::{Config, Verify};
use crate::ops::metrics::Metrics;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot set up the store for {bucket}: {source}")]
    Build {
        bucket: String,
        source: object_store::Error,
    },
    /// `[gcs] credentials` names a file that is not a service account key.
    #[error("{bucket}: [gcs] credentials = {path:?} {why}")]
    Key {
        bucket: String,
        path: PathBuf,
        why: String,
    },
}

/// Why reading a shard from its source failed. Every message starts with the shard's URL.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("{url}: object not found")]
    NotFound { url: String },
    #[error("{url}: download failed: {source}")]
    Store {
        url: String,
        source: object_store::Error,
    },
    /// The store pushed back (429, 5xx, timeouts) for `store.retry_timeout`.
    #[error("{url}: download failed: {source}")]
    GaveUp { url: String, source: GaveUp },
    #[error("{url}: truncated download: got {got} of {expected} bytes")]
    Truncated {
        url: String,
        got: u64,
        expected: u64,
    },
    #[error("{url}: changed while it was being read ({what})")]
    Changed { url: String, what: String },
    /// The bytes received do not match a checksum the source vouches for.
    #[error("{url}: checksum mismatch: {what}")]
    Checksum { url: String, what: String },
    /// `store.verify = "checksum"`, and the source vouches for no checksum.
    #[error(
        "{url}: no checksum to verify the download against (store.verify = \"checksum\"): the store reports none for this object and no manifest records one"
    )]
    Unverified { url: String },
    #[error("{url}: {what}: {source}")]
    Io {
        url: String,
        what: &'static str,
        source: std::io::Error,
    },
}

impl ReadError {
    fn io(url: &ShardUrl, what: &'static str) -> impl FnOnce(std::io::Error) -> ReadError {
        let url = url.to_string();
        move |source| ReadError::Io { url, what, source }
    }
}

/// What identifies one version of a shard's content.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Version {
    pub size: u64,
    /// The object's ETag (`local:<inode>:<mtime ns>` for a local file).
    pub e_tag: Option<String>,
    /// The object's generation (GCS) or version id (S3), when the store reports one.
    pub generation: Option<String>,
}

/// A shard opened for reading ([`Stores::open`]).
pub struct Opened {
    /// What is read: the version the first part's answer told.
    pub version: Version,
    /// That answer, its body not read yet (`None`: a local file, or opened by a HEAD).
    first: Option<GetResult>,
}

/// Where a shard's bytes come from, resolved once per operation.
enum Source<'a> {
    Object {
        store: &'a Arc<dyn ObjectStore>,
        path: &'a ObjectPath,
    },
    Local(&'a Path),
}

/// The object stores of every bucket the config names, built once, and the limits on
/// reading from them.
pub struct Stores {
    /// By (scheme, bucket): ordered, so that checks report the same store first every time.
    buckets: BTreeMap<(&'static str, String), Bucket>,
    part_size: u64,
    parts_in_flight: usize,
    /// `cache.block_size`: how cache files are written ([`crate::blocks`]).
    block_size: usize,
    downloads: Semaphore,
    /// The share of `downloads` prefetches may hold.
    prefetches: Semaphore,
    /// How long a body cut mid-way may be resumed (`download.rs`), as requests are retried.
    retry_timeout: Duration,
    verify: Verify,
    credentials_timeout: Duration,
    /// CRC-32C recorded by the datasets' manifests ([`Stores::know_crc32c`]).
    indexed: RwLock<verify::Indexed>,
    metrics: Arc<Metrics>,
}

impl Stores {
    /// Builds one store per (scheme, bucket) used by the config's datasets.
    pub fn from_config(config: &Config, metrics: Arc<Metrics>) -> Result<Stores, StoreError> {
        let mut buckets = BTreeMap::new();
        for dataset in config.datasets.values() {
            for shard in dataset.shards.iter().chain(&dataset.manifest) {
                let (scheme, bucket) = match shard.location() {
                    Location::Gcs { bucket, .. } => ("gs", bucket),
                    Location::S3 { bucket, .. } => ("s3", bucket),
                    Location::Local(_) => continue,
                };
                let key = (scheme, bucket.clone());
                if buckets.contains_key(&key) {
                    continue;
                }
                if let (("gs", _), Some(path)) = (
                    &key,
                    config.gcs.as_ref().and_then(|g| g.credentials.as_ref()),
                ) {
                    build::check_key(path).map_err(|why| StoreError::Key {
                        bucket: format!("{scheme}://{bucket}"),
                        path: path.clone(),
                        why,
                    })?;
                }
                let built = build::bucket(scheme, bucket, config, &metrics).map_err(|source| {
                    StoreError::Build {
                        bucket: format!("{scheme}://{bucket}"),
                        source,
                    }
                })?;
                buckets.insert(key, built);
            }
        }
        Ok(Stores {
            buckets,
            part_size: config.part_size,
            parts_in_flight: config.parts_in_flight,
            block_size: config.cache_block_size,
            downloads: Semaphore::new(config.max_downloads),
            prefetches: Semaphore::new(prefetch_downloads(config.max_downloads)),
            retry_timeout: config.retry_timeout,
            verify: config.verify,
            credentials_timeout: config.credentials_timeout,
            indexed: RwLock::default(),
            metrics,
        })
    }

    fn source<'a>(&'a self, shard: &'a ShardUrl) -> Source<'a> {
        let (scheme, bucket, path) = match shard.location() {
            Location::Gcs { bucket, path } => ("gs", bucket, path),
            Location::S3 { bucket, path } => ("s3", bucket, path),
            Location::Local(file) => return Source::Local(file),
        };
        let bucket = self
            .buckets
            .get(&(scheme, bucket.clone()))
            .expect("stores are built for every bucket of the config");
        Source::Object {
            store: &bucket.store,
            path,
        }
    }

    /// `cache.block_size`: the size of the writes of a cache file.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The shard's current version: a HEAD request, or a `stat` of a local file.
    pub async fn version(&self, shard: &ShardUrl) -> Result<Version, ReadError> {
        let (store, path) = match self.source(shard) {
            Source::Object { store, path } => (store, path),
            Source::Local(file) => {
                let (file, url) = (file.to_path_buf(), shard.clone());
                return blocking(shard, move || local::version(&file, &url)).await;
            }
        };
        let asked = Instant::now();
        let head = store.head(path).await;
        self.observe("head", asked);
        head.map(|meta| Version {
            size: meta.size,
            e_tag: meta.e_tag,
            generation: meta.version,
        })
        .map_err(|e| self.store_error(shard, e))
    }

    /// A small object's (or local file's) whole content: a manifest.
    pub async fn read_whole(&self, url: &ShardUrl) -> Result<Bytes, ReadError> {
        let (store, path) = match self.source(url) {
            Source::Object { store, path } => (store, path),
            Source::Local(file) => {
                let (file, shard) = (file.to_path_buf(), url.clone());
                return blocking(url, move || local::read(&file, &shard)).await;
            }
        };
        let got = store
            .get(path)
            .await
            .map_err(|e| self.store_error(url, e))?;
        got.bytes().await.map_err(|e| self.store_error(url, e))
    }

    /// Writes a small object (or local file) whole: a manifest.
    pub async fn write_whole(&self, url: &ShardUrl, bytes: Bytes) -> Result<(), ReadError> {
        let (store, path) = match self.source(url) {
            Source::Object { store, path } => (store, path),
            Source::Local(file) => {
                let (file, shard) = (file.to_path_buf(), url.clone());
                return blocking(url, move || local::write(&file, &shard, &bytes)).await;
            }
        };
        store
            .put(path, bytes.into())
            .await
            .map(|_| ())
            .map_err(|e| self.store_error(url, e))
    }

    /// Opens a shard for reading: its current version, and for an object the answer to its
    /// first part's GET, whose headers carry the version (size, ETag, generation) that a HEAD
    /// would have cost a request of its own. Its body waits, unread, until the cache has room
    /// for the shard; only its reading counts against `store.max_downloads` (a load that
    /// waits for room must not hold a download that a stream's next shard needs).
    ///
    /// An object the ranged GET cannot open (an empty object: 416; a store that ignores
    /// ranges) is opened by a HEAD instead.
    pub async fn open(&self, shard: &ShardUrl) -> Result<Opened, ReadError> {
        let Source::Object { store, path } = self.source(shard) else {
            let version = self.version(shard).await?;
            return Ok(Opened {
                version,
                first: None,
            });
        };
        let options = GetOptions {
            range: Some(GetRange::Bounded(0..self.part_size)),
            ..Default::default()
        };
        let asked = Instant::now();
        let got = store.get_opts(path, options).await;
        self.observe("get", asked);
        let got = match got {
            Ok(got) => got,
            Err(e) => match self.store_error(shard, e) {
                e @ (ReadError::NotFound { .. } | ReadError::GaveUp { .. }) => return Err(e),
                e => {
                    tracing::debug!(url = %shard, error = %e, "a ranged GET could not open it: a HEAD");
                    let version = self.version(shard).await?;
                    return Ok(Opened {
                        version,
                        first: None,
                    });
                }
            },
        };
        let version = Version {
            size: got.meta.size,
            e_tag: got.meta.e_tag.clone(),
            generation: got.meta.version.clone(),
        };
        Ok(Opened {
            version,
            first: Some(got),
        })
    }

    /// Opens a shard whose version is known already (a HEAD told it): its parts are all
    /// pinned to it.
    pub fn open_at(version: Version) -> Opened {
        Opened {
            version,
            first: None,
        }
    }

    /// Reads exactly the version `opened` has of the shard into `file` (empty, owned by the
    /// cache) and checks it against what its source vouches for ([`verify`]).
    pub async fn read_into(
        &self,
        shard: &ShardUrl,
        opened: Opened,
        file: std::fs::File,
    ) -> Result<Fetched, ReadError> {
        let Opened { version, first } = opened;
        let version = &version;
        let _permits = self.download_permits().await;
        let _active = crate::ops::metrics::Active::new(&self.metrics.downloads_active);
        let started = Instant::now();
        let result = self.read_verified(shard, version, file, first).await;
        match &result {
            Ok(fetched) => {
                tracing::debug!(url = %shard, checked = ?fetched.checked, "shard read");
                self.metrics.shard_fetches_total.inc();
                self.metrics.shard_fetch_bytes_total.inc_by(version.size);
                self.metrics
                    .shard_fetch_seconds
                    .observe(started.elapsed().as_secs_f64());
            }
            Err(e) => {
                self.metrics.shard_fetch_errors_total.inc();
                tracing::warn!(error = %e, "shard read failed");
            }
        }
        result
    }

    async fn read_verified(
        &self,
        shard: &ShardUrl,
        version: &Version,
        file: std::fs::File,
        first: Option<GetResult>,
    ) -> Result<Fetched, ReadError> {
        let (received, reported, local) = match self.source(shard) {
            Source::Object { store, path } => {
                let (received, reported) = self
                    .download(store, path, shard, version, file, first)
                    .await?;
                (received, reported, false)
            }
            Source::Local(src) => {
                let (src, url, v) = (src.to_path_buf(), shard.clone(), version.clone());
                let block = self.block_size;
                let crc32c =
                    blocking(shard, move || local::copy(&src, &url, &v, file, block)).await?;
                let received = verify::Received { crc32c, md5: None };
                (received, None, true)
            }
        };
        self.verify(shard, version, received, reported, local)
    }

    /// A download's place among `store.max_downloads`: a prefetch's also among the share
    /// prefetches may hold.
    async fn download_permits(&self) -> (Option<SemaphorePermit<'_>>, SemaphorePermit<'_>) {
        let prefetch = match pacing::Urgency::current().is_urgent() {
            true => None,
            false => Some(self.prefetches.acquire().await.expect("never closed")),
        };
        (
            prefetch,
            self.downloads.acquire().await.expect("never closed"),
        )
    }

    fn observe(&self, kind: &str, asked: Instant) {
        self.metrics
            .store_request_seconds
            .with_label_values(&[kind])
            .observe(asked.elapsed().as_secs_f64());
    }

    /// Body bytes received (requests are counted as they are sent, in `http.rs`).
    fn count_bytes(&self, bytes: u64) {
        self.metrics.store_bytes_total.inc_by(bytes);
    }

    /// How the host's requests to each bucket are paced now: (bucket, state).
    pub fn pacing(&self) -> Vec<(&str, pacing::Snapshot)> {
        self.buckets
            .values()
            .map(|b| (b.name.as_str(), b.pacer.snapshot()))
            .collect()
    }

    fn store_error(&self, shard: &ShardUrl, e: object_store::Error) -> ReadError {
        if let Some(gave_up) = GaveUp::in_chain(&e) {
            self.metrics
                .store_errors_total
                .with_label_values(&["pushback"])
                .inc();
            return ReadError::GaveUp {
                url: shard.to_string(),
                source: gave_up.clone(),
            };
        }
        let kind = match &e {
            object_store::Error::NotFound { .. } => "not_found",
            object_store::Error::Precondition { .. } => "changed",
            _ => "other",
        };
        self.metrics
            .store_errors_total
            .with_label_values(&[kind])
            .inc();
        match e {
            object_store::Error::NotFound { .. } => ReadError::NotFound {
                url: shard.to_string(),
            },
            object_store::Error::Precondition { .. } => ReadError::Changed {
                url: shard.to_string(),
                what: "its ETag no longer matches".into(),
            },
            source => ReadError::Store {
                url: shard.to_string(),
                source,
            },
        }
    }
}

/// Of `max_downloads`, how many prefetches may hold: all but a quarter (and at least one).
fn prefetch_downloads(max_downloads: usize) -> usize {
    (max_downloads - max_downloads / 4).max(1)
}

/// Runs blocking file work off the runtime threads; a panic fails the read, not the daemon.
async fn blocking<T: Send + 'static>(
    shard: &ShardUrl,
    f: impl FnOnce() -> Result<T, ReadError> + Send + 'static,
) -> Result<T, ReadError> {
    tokio::task::spawn_blocking(f).await.unwrap_or_else(|e| {
        Err(ReadError::Io {
            url: shard.to_string(),
            what: "internal error while reading the file",
            source: std::io::Error::other(e.to_string()),
        })
    })
}

#[cfg(test)]
mod tests {
    use super::pacing::{URGENCY, Urgency};
    use super::*;

    #[tokio::test]
    async fn prefetches_leave_a_quarter_of_the_downloads_to_the_shards_trainers_wait_for() {
        let text = "[store]\nmax_downloads = 8\n[datasets.d]\nshards = \"/x.tar\"\n";
        let config = Config::parse(text, Path::new("/")).unwrap();
        let stores = Stores::from_config(&config, Default::default()).unwrap();
        let prefetch = || URGENCY.scope(Urgency::prefetch(), stores.download_permits());
        let mut held = Vec::new();
        for _ in 0..6 {
            held.push(prefetch().await);
        }
        let quick = Duration::from_millis(50);
        assert!(
            tokio::time::timeout(quick, prefetch()).await.is_err(),
            "a 7th prefetch waits"
        );
        let urgent = || URGENCY.scope(Urgency::urgent(), stores.download_permits());
        let (a, b) = (urgent().await, urgent().await);
        assert!(
            tokio::time::timeout(quick, urgent()).await.is_err(),
            "8 in all"
        );
        drop((a, b));
        assert_eq!(prefetch_downloads(1), 1);
        assert_eq!(prefetch_downloads(3), 3);
        assert_eq!(prefetch_downloads(16), 12);
    }
}
