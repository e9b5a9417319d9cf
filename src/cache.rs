//! Shard bytes on local disk.
//!
//! This first cache is deliberately simple: an object-store shard is downloaded into
//! `<cache.dir>/tmp/`, its size is checked against the object's metadata (a truncated download
//! is an error, never a short shard), the file is memory-mapped and unlinked at once. Samples
//! are `Bytes` slices of that mapping, so nothing is copied after the download, and the space
//! is returned to the disk when the last sample of the shard has been sent. A crash can only
//! leave files in `tmp/`, which start-up empties. Gzip-compressed shards (`.tgz`, detected by
//! their magic bytes, as `tarfile` does) are decompressed into a second file the same way.
//! Local shards are mapped in place: they are on this disk already.
//!
//! `cache.max_size` is a soft limit that gates *prefetching*: a stream starts downloading
//! ahead of need only while the cache holds less than `max_size`; what a stream needs to fill
//! its current shuffle window is always fetched, so streams never deadlock on each other's
//! pinned shards. The excess is about `shuffle_buffer / samples per shard + 1` shards per open
//! stream, and open streams are bounded by `server.max_connections`. In-flight downloads are
//! bounded by `store.max_downloads`.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use bytes::Bytes;
use futures::StreamExt;
use object_store::ObjectStoreExt;
use tokio::sync::Semaphore;

use crate::metrics::Metrics;
use crate::store::Source;

#[derive(Debug, thiserror::Error)]
pub enum FetchError {
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
    #[error("{url}: decompresses to more than cache.max_size ({limit} bytes)")]
    TooLarge { url: String, limit: u64 },
    #[error("{url}: {what}: {source}")]
    Io {
        url: String,
        what: &'static str,
        source: std::io::Error,
    },
}

/// Bytes the cache holds on disk, against the configured soft limit.
#[derive(Debug)]
pub struct Budget {
    used: AtomicU64,
    limit: u64,
}

/// Bytes charged to the budget until dropped.
#[derive(Debug)]
struct Charge {
    budget: Arc<Budget>,
    bytes: u64,
    metrics: Arc<Metrics>,
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.bytes, Ordering::Relaxed);
        self.metrics.cache_bytes.sub(self.bytes as i64);
    }
}

impl Budget {
    pub fn has_room(&self) -> bool {
        self.used.load(Ordering::Relaxed) < self.limit
    }
}

pub struct Cache {
    tmp: PathBuf,
    budget: Arc<Budget>,
    downloads: Semaphore,
    next_file: AtomicU64,
    metrics: Arc<Metrics>,
}

/// Keeps a mapped shard (and its disk charge) alive while any of its samples is.
struct MappedShard {
    map: memmap2::Mmap,
    _charge: Option<Charge>,
}

impl AsRef<[u8]> for MappedShard {
    fn as_ref(&self) -> &[u8] {
        &self.map
    }
}

impl Cache {
    /// Opens the cache directory, creating it, and removes what a crashed run left in `tmp/`.
    pub fn open(
        dir: &Path,
        max_bytes: u64,
        max_downloads: usize,
        metrics: Arc<Metrics>,
    ) -> std::io::Result<Cache> {
        let tmp = dir.join("tmp");
        std::fs::create_dir_all(&tmp)?;
        for entry in std::fs::read_dir(&tmp)? {
            let path = entry?.path();
            if path.extension().is_some_and(|e| e == "part") {
                std::fs::remove_file(&path)?;
                tracing::info!(path = %path.display(), "removed a file left by an earlier run");
            }
        }
        Ok(Cache {
            tmp,
            budget: Arc::new(Budget {
                used: AtomicU64::new(0),
                limit: max_bytes,
            }),
            downloads: Semaphore::new(max_downloads),
            next_file: AtomicU64::new(0),
            metrics,
        })
    }

    pub fn budget(&self) -> &Budget {
        &self.budget
    }

    /// The bytes of one shard, downloaded (or mapped in place) and, if gzipped, decompressed.
    pub async fn fetch(self: &Arc<Self>, source: Source, url: &str) -> Result<Bytes, FetchError> {
        let started = Instant::now();
        let result = match source {
            Source::LocalFile(path) => {
                let (url, this) = (url.to_string(), self.clone());
                let what = url.clone();
                tokio::task::spawn_blocking(move || this.map_local(&path, &url))
                    .await
                    .unwrap_or_else(|e| Err(panicked(&what, e)))
            }
            Source::Object { store, path } => self.download(store.as_ref(), &path, url).await,
        };
        match &result {
            Ok(bytes) => {
                self.metrics.shard_fetches_total.inc();
                self.metrics
                    .shard_fetch_bytes_total
                    .inc_by(bytes.len() as u64);
                self.metrics
                    .shard_fetch_seconds
                    .observe(started.elapsed().as_secs_f64());
            }
            Err(e) => {
                self.metrics.shard_fetch_errors_total.inc();
                tracing::warn!(error = %e, "shard fetch failed");
            }
        }
        result
    }

    async fn download(
        self: &Arc<Self>,
        store: &dyn object_store::ObjectStore,
        path: &object_store::path::Path,
        url: &str,
    ) -> Result<Bytes, FetchError> {
        let _permit = self.downloads.acquire().await.expect("never closed");
        let _active = crate::metrics::Active::new(&self.metrics.downloads_active);
        let io = |what| {
            move |source| FetchError::Io {
                url: url.to_string(),
                what,
                source,
            }
        };
        let got = store.get(path).await.map_err(|e| match e {
            object_store::Error::NotFound { .. } => FetchError::NotFound {
                url: url.to_string(),
            },
            source => FetchError::Store {
                url: url.to_string(),
                source,
            },
        })?;
        let expected = got.meta.size;
        let file_path = self.new_file();
        let charge = self.charge(expected);
        let mut file = std::fs::File::create(&file_path).map_err(io("creating a cache file"))?;
        // The file is unlinked as soon as it is mapped (or on any error); the mapping keeps it.
        let _unlink = scopeguard(|| {
            let _ = std::fs::remove_file(&file_path);
        });
        let mut body = got.into_stream();
        let mut written = 0u64;
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|source| FetchError::Store {
                url: url.to_string(),
                source,
            })?;
            // Small blocking writes into the page cache; cheaper than a thread hop per chunk.
            file.write_all(&chunk).map_err(io("writing to the cache"))?;
            written += chunk.len() as u64;
        }
        if written != expected {
            return Err(FetchError::Truncated {
                url: url.to_string(),
                got: written,
                expected,
            });
        }
        drop(file);
        let (this, url_owned, fp) = (self.clone(), url.to_string(), file_path.clone());
        tokio::task::spawn_blocking(move || this.map_file(&fp, &url_owned, Some(charge)))
            .await
            .unwrap_or_else(|e| Err(panicked(url, e)))
    }

    fn map_local(&self, path: &Path, url: &str) -> Result<Bytes, FetchError> {
        match std::fs::metadata(path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(FetchError::NotFound {
                    url: url.to_string(),
                });
            }
            _ => {}
        }
        self.map_file(path, url, None)
    }

    /// Maps a file; if it is gzip, decompresses it into a cache file and maps that instead.
    fn map_file(
        &self,
        path: &Path,
        url: &str,
        charge: Option<Charge>,
    ) -> Result<Bytes, FetchError> {
        let Some(map) = map(path, url)? else {
            return Ok(Bytes::new());
        };
        if !map.starts_with(&[0x1f, 0x8b]) {
            return Ok(Bytes::from_owner(MappedShard {
                map,
                _charge: charge,
            }));
        }
        // Gzip: decompress once into another cache file, never more than the whole cache may
        // hold (a gzip bomb must not fill the disk), and map that.
        let io = |what| {
            move |source| FetchError::Io {
                url: url.to_string(),
                what,
                source,
            }
        };
        let plain = self.new_file();
        let _unlink = scopeguard(|| {
            let _ = std::fs::remove_file(&plain);
        });
        let mut out = std::fs::File::create(&plain).map_err(io("creating a cache file"))?;
        let limit = self.budget.limit;
        let mut decoder = flate2::read::MultiGzDecoder::new(&map[..]).take(limit.saturating_add(1));
        let written =
            std::io::copy(&mut decoder, &mut out).map_err(io("decompressing the gzip shard"))?;
        if written > limit {
            return Err(FetchError::TooLarge {
                url: url.to_string(),
                limit,
            });
        }
        drop((map, charge));
        let charge = self.charge(written);
        match self::map(&plain, url)? {
            Some(map) => Ok(Bytes::from_owner(MappedShard {
                map,
                _charge: Some(charge),
            })),
            None => Ok(Bytes::new()),
        }
    }

    fn new_file(&self) -> PathBuf {
        let n = self.next_file.fetch_add(1, Ordering::Relaxed);
        self.tmp.join(format!("{}-{n}.part", std::process::id()))
    }

    fn charge(&self, bytes: u64) -> Charge {
        self.budget.used.fetch_add(bytes, Ordering::Relaxed);
        self.metrics.cache_bytes.add(bytes as i64);
        Charge {
            budget: self.budget.clone(),
            bytes,
            metrics: self.metrics.clone(),
        }
    }
}

/// Maps a whole file read-only; `None` for an empty file (which cannot be mapped).
fn map(path: &Path, url: &str) -> Result<Option<memmap2::Mmap>, FetchError> {
    let io = |what| {
        move |source| FetchError::Io {
            url: url.to_string(),
            what,
            source,
        }
    };
    let file = std::fs::File::open(path).map_err(io("opening the shard"))?;
    if file
        .metadata()
        .map_err(io("reading the shard's size"))?
        .len()
        == 0
    {
        return Ok(None);
    }
    // SAFETY: cache files are private to this daemon and unlinked right away; local shards
    // are the operator's and must not be modified while being served (see README).
    let map = unsafe { memmap2::MmapOptions::new().populate().map(&file) }
        .map_err(io("mapping the shard"))?;
    Ok(Some(map))
}

/// A panic in a blocking task is a bug; it fails the stream, not the daemon.
fn panicked(url: &str, e: tokio::task::JoinError) -> FetchError {
    FetchError::Io {
        url: url.to_string(),
        what: "internal error while mapping the shard",
        source: std::io::Error::other(e.to_string()),
    }
}

/// Runs `f` when dropped.
fn scopeguard<F: FnOnce()>(f: F) -> impl Drop {
    struct Guard<F: FnOnce()>(Option<F>);
    impl<F: FnOnce()> Drop for Guard<F> {
        fn drop(&mut self) {
            if let Some(f) = self.0.take() {
                f()
            }
        }
    }
    Guard(Some(f))
}
