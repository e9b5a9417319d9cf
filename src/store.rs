//! The object stores behind shard URLs, and reading a shard's bytes from its source.
//!
//! `gs://` and `s3://` shards are read through `object_store` (one store per bucket, built once
//! at start-up so credential problems show up before the first trainer connects). Local shards
//! (`file://` URLs or plain paths) are copied, not mapped in place: a file the operator may
//! truncate or rewrite (a gcsfuse or NFS path) must never be mapped by the daemon, or a
//! truncation would kill it with SIGBUS. `std::io::copy` between files uses
//! `copy_file_range`, which shares extents (a reflink) on filesystems that can (XFS, btrfs)
//! and copies in the kernel elsewhere.
//!
//! A shard's [`Version`] is what identifies its content: size, ETag and generation for an
//! object, size, inode and modification time for a local file. A download is checked against
//! it: every ranged GET carries `If-Match: <ETag>`, and a local file that changes while it
//! is copied is an error, never a mixed copy.
//!
//! Large objects download as parallel ranged GETs (`store.part_size`,
//! `store.parts_in_flight`), written at their offsets by a blocking writer behind a bounded
//! channel, so a slow disk never blocks a runtime thread. Shard downloads in flight on the
//! host are bounded by `store.max_downloads`.
//!
//! Retries are object_store's, not ours: 5xx, 408, 429 and connection errors are retried with
//! exponential backoff (`store.retries` times, within 3 minutes); a body cut mid-way is resumed
//! with a range request. 404 and other 4xx answers fail at once. The whole-request timeout is
//! disabled (shards are large); `store.connect_timeout` and `store.read_timeout` (the longest
//! silence while reading a body) catch stalled connections instead.

use std::collections::HashMap;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use object_store::path::Path as ObjectPath;
use object_store::{GetOptions, GetRange, ObjectStore, ObjectStoreExt};
use tokio::sync::Semaphore;

use crate::config::{Config, GcsSection, S3Section};
use crate::metrics::Metrics;
use crate::url::{Location, ShardUrl};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot set up the store for {bucket}: {source}")]
    Build {
        bucket: String,
        source: object_store::Error,
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
    #[error("{url}: truncated download: got {got} of {expected} bytes")]
    Truncated {
        url: String,
        got: u64,
        expected: u64,
    },
    #[error("{url}: changed while it was being read ({what})")]
    Changed { url: String, what: String },
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

impl Version {
    /// The content MD5 the store vouches for, in hex. The ETag of a GCS object that is not a
    /// composite, and of an S3 object uploaded in one part, is the MD5 of its bytes: in hex
    /// (GCS's XML API, S3), or in base64 as GCS writes `md5Hash` (fake-gcs-server's ETags).
    /// Other ETags (multipart `…-N`, composite, local) say nothing about the content.
    /// (object_store does not surface `x-goog-hash`, so the ETag is what we have.)
    pub fn md5(&self) -> Option<String> {
        use base64::Engine;
        let tag = self
            .e_tag
            .as_deref()?
            .trim_start_matches("W/")
            .trim_matches('"');
        if tag.len() == 32 && tag.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Some(tag.to_ascii_lowercase());
        }
        let raw = base64::engine::general_purpose::STANDARD.decode(tag).ok()?;
        (tag.len() == 24 && raw.len() == 16)
            .then(|| raw.iter().map(|b| format!("{b:02x}")).collect())
    }
}

/// The object stores of every bucket the config names, built once, and the limits on
/// reading from them.
pub struct Stores {
    by_bucket: HashMap<(&'static str, String), Arc<dyn ObjectStore>>,
    part_size: u64,
    parts_in_flight: usize,
    downloads: Semaphore,
    metrics: Arc<Metrics>,
}

/// Bytes of one part queued for the writer: enough to keep the disk busy, bounded memory.
const WRITE_QUEUE: usize = 16;

impl Stores {
    /// Builds one store per (scheme, bucket) used by the config's datasets.
    pub fn from_config(config: &Config, metrics: Arc<Metrics>) -> Result<Stores, StoreError> {
        let options = object_store::ClientOptions::new()
            .with_timeout_disabled()
            .with_connect_timeout(config.connect_timeout)
            .with_read_timeout(config.read_timeout)
            .with_allow_http(true);
        let retry = object_store::RetryConfig {
            max_retries: config.retries,
            ..Default::default()
        };
        let mut by_bucket = HashMap::new();
        for dataset in config.datasets.values() {
            for shard in dataset.shards.iter().chain(&dataset.manifest) {
                let (scheme, bucket) = match shard.location() {
                    Location::Gcs { bucket, .. } => ("gs", bucket),
                    Location::S3 { bucket, .. } => ("s3", bucket),
                    Location::Local(_) => continue,
                };
                let key = (scheme, bucket.clone());
                if by_bucket.contains_key(&key) {
                    continue;
                }
                let built = match scheme {
                    "gs" => gcs(bucket, config.gcs.as_ref(), options.clone(), retry.clone()),
                    _ => s3(bucket, config.s3.as_ref(), options.clone(), retry.clone()),
                }
                .map_err(|source| StoreError::Build {
                    bucket: format!("{scheme}://{bucket}"),
                    source,
                })?;
                by_bucket.insert(key, built);
            }
        }
        Ok(Stores {
            by_bucket,
            part_size: config.part_size,
            parts_in_flight: config.parts_in_flight,
            downloads: Semaphore::new(config.max_downloads),
            metrics,
        })
    }

    fn object<'a>(
        &'a self,
        shard: &'a ShardUrl,
    ) -> Option<(&'a Arc<dyn ObjectStore>, &'a ObjectPath)> {
        let (scheme, bucket, path) = match shard.location() {
            Location::Gcs { bucket, path } => ("gs", bucket, path),
            Location::S3 { bucket, path } => ("s3", bucket, path),
            Location::Local(_) => return None,
        };
        let store = self
            .by_bucket
            .get(&(scheme, bucket.clone()))
            .expect("stores are built for every bucket of the config");
        Some((store, path))
    }

    /// The shard's current version: a HEAD request, or a `stat` of a local file.
    pub async fn version(&self, shard: &ShardUrl) -> Result<Version, ReadError> {
        let Some((store, path)) = self.object(shard) else {
            let Location::Local(file) = shard.location().clone() else {
                unreachable!("not an object, so a local file")
            };
            let url = shard.clone();
            return blocking(shard, move || local_version(&file, &url)).await;
        };
        self.count("head", 0);
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
        let Some((store, path)) = self.object(url) else {
            let Location::Local(file) = url.location().clone() else {
                unreachable!("not an object, so a local file")
            };
            let what = url.clone();
            return blocking(url, move || {
                std::fs::read(&file)
                    .map(Bytes::from)
                    .map_err(|e| match e.kind() {
                        std::io::ErrorKind::NotFound => ReadError::NotFound {
                            url: what.to_string(),
                        },
                        _ => ReadError::io(&what, "reading the file")(e),
                    })
            })
            .await;
        };
        self.count("get", 0);
        let got = store
            .get(path)
            .await
            .map_err(|e| self.store_error(url, e))?;
        got.bytes().await.map_err(|e| self.store_error(url, e))
    }

    /// Writes a small object (or local file) whole: a manifest.
    pub async fn write_whole(&self, url: &ShardUrl, bytes: Bytes) -> Result<(), ReadError> {
        let Some((store, path)) = self.object(url) else {
            let Location::Local(file) = url.location().clone() else {
                unreachable!("not an object, so a local file")
            };
            let what = url.clone();
            return blocking(url, move || {
                std::fs::write(&file, &bytes).map_err(ReadError::io(&what, "writing the file"))
            })
            .await;
        };
        store
            .put(path, bytes.into())
            .await
            .map(|_| ())
            .map_err(|e| self.store_error(url, e))
    }

    /// Reads exactly `version` of the shard into `file` (empty, owned by the cache).
    pub async fn read_into(
        &self,
        shard: &ShardUrl,
        version: &Version,
        file: std::fs::File,
    ) -> Result<(), ReadError> {
        let _permit = self.downloads.acquire().await.expect("never closed");
        let _active = crate::metrics::Active::new(&self.metrics.downloads_active);
        let started = Instant::now();
        let result = match self.object(shard) {
            Some((store, path)) => self.download(store, path, shard, version, file).await,
            None => {
                let Location::Local(src) = shard.location().clone() else {
                    unreachable!("not an object, so a local file")
                };
                let (url, version) = (shard.clone(), version.clone());
                blocking(shard, move || copy_local(&src, &url, &version, file)).await
            }
        };
        match &result {
            Ok(()) => {
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

    /// Parallel ranged GETs of `store.part_size`, each pinned to the version with If-Match,
    /// written at their offsets by one blocking writer.
    async fn download(
        &self,
        store: &Arc<dyn ObjectStore>,
        path: &ObjectPath,
        shard: &ShardUrl,
        version: &Version,
        file: std::fs::File,
    ) -> Result<(), ReadError> {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<(u64, Bytes)>(WRITE_QUEUE);
        let writer = tokio::task::spawn_blocking(move || -> std::io::Result<()> {
            while let Some((at, chunk)) = rx.blocking_recv() {
                file.write_all_at(&chunk, at)?;
            }
            Ok(())
        });
        let ranges: Vec<std::ops::Range<u64>> = (0..version.size)
            .step_by(self.part_size as usize)
            .map(|start| start..(start + self.part_size).min(version.size))
            .collect();
        let parts = futures::stream::iter(ranges)
            .map(|range| self.get_part(store, path, shard, version, range, tx.clone()))
            .buffer_unordered(self.parts_in_flight)
            .try_for_each(|()| futures::future::ready(Ok(())))
            .await;
        drop(tx);
        let written = writer
            .await
            .unwrap_or_else(|e| Err(std::io::Error::other(e)));
        // A write error closes the channel, which fails the parts: report the cause.
        written.map_err(ReadError::io(shard, "writing to the cache"))?;
        parts
    }

    async fn get_part(
        &self,
        store: &Arc<dyn ObjectStore>,
        path: &ObjectPath,
        shard: &ShardUrl,
        version: &Version,
        range: std::ops::Range<u64>,
        tx: tokio::sync::mpsc::Sender<(u64, Bytes)>,
    ) -> Result<(), ReadError> {
        let options = GetOptions {
            range: Some(GetRange::Bounded(range.clone())),
            if_match: version.e_tag.clone(),
            ..Default::default()
        };
        self.count("get", 0);
        let asked = Instant::now();
        let got = store.get_opts(path, options).await;
        self.observe("get", asked);
        let got = got.map_err(|e| self.store_error(shard, e))?;
        let mut body = got.into_stream();
        let mut at = range.start;
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|e| self.store_error(shard, e))?;
            let len = chunk.len() as u64;
            if at + len > range.end {
                break; // more than asked for: counted as a bad length below
            }
            self.count("", len);
            if tx.send((at, chunk)).await.is_err() {
                return Ok(()); // the writer failed; `download` reports why
            }
            at += len;
        }
        if at != range.end {
            return Err(ReadError::Truncated {
                url: shard.to_string(),
                got: at - range.start,
                expected: range.end - range.start,
            });
        }
        Ok(())
    }

    fn observe(&self, kind: &str, asked: Instant) {
        self.metrics
            .store_request_seconds
            .with_label_values(&[kind])
            .observe(asked.elapsed().as_secs_f64());
    }

    fn count(&self, request: &str, bytes: u64) {
        if !request.is_empty() {
            self.metrics
                .store_requests_total
                .with_label_values(&[request])
                .inc();
        }
        self.metrics.store_bytes_total.inc_by(bytes);
    }

    fn store_error(&self, shard: &ShardUrl, e: object_store::Error) -> ReadError {
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

fn local_version(path: &Path, url: &ShardUrl) -> Result<Version, ReadError> {
    let meta = std::fs::metadata(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => ReadError::NotFound {
            url: url.to_string(),
        },
        _ => ReadError::io(url, "reading the file's metadata")(e),
    })?;
    Ok(Version {
        size: meta.len(),
        e_tag: Some(format!(
            "local:{}:{}:{}",
            meta.ino(),
            meta.mtime(),
            meta.mtime_nsec()
        )),
        generation: None,
    })
}

/// Copies exactly `version` of a local file; a file that changed size, inode or mtime
/// before or during the copy is an error (the cache then holds no mixed copy).
fn copy_local(
    src: &Path,
    url: &ShardUrl,
    version: &Version,
    mut dst: std::fs::File,
) -> Result<(), ReadError> {
    let changed = |what: String| ReadError::Changed {
        url: url.to_string(),
        what,
    };
    let file = std::fs::File::open(src).map_err(ReadError::io(url, "opening the file"))?;
    // `Take<&File>` into a `File`: std uses copy_file_range for it.
    let copied = std::io::copy(&mut std::io::Read::take(&file, version.size), &mut dst)
        .map_err(ReadError::io(url, "copying the file into the cache"))?;
    let now = local_version(src, url)?;
    if copied != version.size || now != *version {
        return Err(changed(format!(
            "copied {copied} of {} bytes; the file is now {} bytes",
            version.size, now.size
        )));
    }
    Ok(())
}

fn gcs(
    bucket: &str,
    section: Option<&GcsSection>,
    options: object_store::ClientOptions,
    retry: object_store::RetryConfig,
) -> object_store::Result<Arc<dyn ObjectStore>> {
    use object_store::gcp::GoogleCloudStorageBuilder;
    let mut b = match section {
        // `[gcs]` present: only what it says, so a stray env var cannot redirect an emulator run.
        Some(_) => GoogleCloudStorageBuilder::new(),
        None => GoogleCloudStorageBuilder::from_env(),
    }
    .with_bucket_name(bucket)
    .with_client_options(options)
    .with_retry(retry);
    if let Some(s) = section {
        if let Some(endpoint) = &s.endpoint {
            b = b.with_base_url(endpoint.trim_end_matches('/'));
        }
        if s.anonymous {
            b = b.with_skip_signature(true);
        }
    }
    Ok(Arc::new(b.build()?))
}

fn s3(
    bucket: &str,
    section: Option<&S3Section>,
    options: object_store::ClientOptions,
    retry: object_store::RetryConfig,
) -> object_store::Result<Arc<dyn ObjectStore>> {
    use object_store::aws::AmazonS3Builder;
    let mut b = AmazonS3Builder::from_env()
        .with_bucket_name(bucket)
        .with_client_options(options)
        .with_retry(retry);
    if let Some(s) = section {
        if let Some(endpoint) = &s.endpoint {
            b = b.with_endpoint(endpoint).with_allow_http(true);
        }
        if let Some(region) = &s.region {
            b = b.with_region(region);
        }
        if s.anonymous {
            b = b.with_skip_signature(true);
        }
    }
    Ok(Arc::new(b.build()?))
}

#[cfg(test)]
mod tests {
    use super::Version;

    #[test]
    fn md5_comes_from_etags_that_are_one() {
        let v = |tag: &str| Version {
            size: 0,
            e_tag: Some(tag.into()),
            generation: None,
        };
        let hex = "764efa883dda1e11db47671c4a3bbd9e";
        assert_eq!(v(&format!("\"{hex}\"")).md5().as_deref(), Some(hex));
        assert_eq!(
            v("\"dk76iD3aHhHbR2ccSju9ng==\"").md5().as_deref(),
            Some(hex)
        );
        for other in [
            "\"764efa883dda1e11db47671c4a3bbd9e-3\"",
            "CKih16GjycICEAE=",
            "local:1:2:3",
        ] {
            assert_eq!(v(other).md5(), None, "{other}");
        }
    }
}
