//! The host-level shard source: one per daemon, shared by every stream of every dataset.
//!
//! A shard is keyed by its URL and held as a verified file under `cache.dir` that survives
//! restarts (layout and commit protocol in [`disk`]). What the cache promises:
//! - **Single flight.** However many streams, datasets or epochs want a shard at once, it is
//!   read from its source once; the others wait for that one load.
//! - **Pins.** A stream reading a shard holds a pin, released when the last of its bytes is
//!   dropped; a pinned entry is never evicted or replaced.
//! - **Verified.** A download's size is checked, and its MD5 against the store's when the store
//!   vouches for one (see [`Version::md5`]); a mismatch is fetched once more, then fails the
//!   stream naming the shard. Every entry's CRC-32C is recorded; an entry found at start-up is
//!   checked against it before it is first served. Nothing that did not verify is served or
//!   kept.
//! - **Fresh.** An entry not checked against its source for `cache.revalidate` is checked
//!   (a HEAD, or a `stat` of a local file) when next used and fetched again if it changed.
//! - **A hard budget.** Bytes on disk (entries, downloads and decompression in progress, and
//!   a fixed [`disk::META_MAX`] per record) never exceed `cache.max_size`: space is reserved
//!   before it is written, by evicting unpinned entries farthest-next-use first ([`evict`]).
//!   A stream that needs space nobody can free waits up to `cache.space_timeout` for pins to
//!   be released, then fails with `cache_full`; a prefetch that does not fit simply waits.
//!
//! The mutex around the state is never held across an await or around file I/O.

pub mod bytes;
pub mod disk;
pub mod evict;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use tokio::sync::Notify;

pub use self::bytes::ShardBytes;
use self::disk::{Disk, META_MAX, Meta};
use self::evict::{Candidate, Foresight};
use crate::metrics::Metrics;
use crate::store::{ReadError, Stores, Version};
use crate::url::ShardUrl;

#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error(transparent)]
    Read(#[from] ReadError),
    #[error("{url}: {size} bytes do not fit in cache.max_size ({limit} bytes)")]
    TooLarge { url: String, size: u64, limit: u64 },
    #[error(
        "{url}: decompresses to more than the cache can hold (cache.max_size {limit} bytes; {free} were free for it)"
    )]
    GzipTooLarge { url: String, limit: u64, free: u64 },
    #[error(
        "cache full: {url} needs {need} bytes but cache.max_size is {limit} bytes, of which {pinned} are pinned by open streams and {reserved} reserved by loads in progress; waited {waited:?} (cache.space_timeout)"
    )]
    CacheFull {
        url: String,
        need: u64,
        limit: u64,
        pinned: u64,
        reserved: u64,
        waited: Duration,
    },
    #[error("{url}: checksum mismatch: {what}")]
    Verify { url: String, what: String },
    #[error("{url}: {what}: {source}")]
    Io {
        url: String,
        what: &'static str,
        source: std::io::Error,
    },
    /// A prefetch found no room without evicting something needed sooner; not an error
    /// anybody sees (a stream that needs the shard then loads it itself).
    #[error("{url}: no room to prefetch")]
    NoRoom { url: String },
    /// A bug (a panic in a load): fails the streams waiting for it, never the daemon.
    #[error("{url}: internal error: {what}")]
    Internal { url: String, what: String },
    /// The error of a load another stream started and this one waited for.
    #[error("{0}")]
    Shared(Arc<FetchError>),
}

impl FetchError {
    fn io(url: &ShardUrl, what: &'static str) -> impl FnOnce(std::io::Error) -> FetchError {
        let url = url.to_string();
        move |source| FetchError::Io { url, what, source }
    }

    /// The error itself, seen through the single-flight wrapper.
    pub fn root(&self) -> &FetchError {
        match self {
            FetchError::Shared(e) => e.root(),
            e => e,
        }
    }
}

/// Why a shard is being loaded: how hard to try for space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    /// A stream needs it now: evict unpinned entries not needed before it, and wait for pins
    /// to be released up to `cache.space_timeout`.
    Demand,
    /// Needed `distance` shards from now: evict only entries needed later, never wait.
    Prefetch { distance: u64 },
    /// Filling the cache ahead of a job: only free space, never evict, never wait.
    Warm,
}

/// The limits the cache works within.
#[derive(Debug, Clone)]
pub struct Limits {
    pub max_bytes: u64,
    pub space_timeout: Duration,
    pub revalidate: Duration,
}

#[derive(Clone)]
pub struct Cache {
    inner: Arc<Inner>,
}

struct Inner {
    disk: Disk,
    stores: Arc<Stores>,
    limits: Limits,
    foresight: Arc<dyn Foresight>,
    metrics: Arc<Metrics>,
    state: Mutex<State>,
    /// Woken whenever bytes are released or a pin dropped (waiting for space).
    space: Notify,
    /// Woken when a load ends or space is released (the prefetcher listens).
    pub events: Arc<Notify>,
}

#[derive(Default)]
struct State {
    slots: HashMap<String, Slot>,
    /// Bytes charged against the budget: resident entries plus reservations.
    charged: u64,
    resident: u64,
    pinned: u64,
    tick: u64,
    /// Counts releases of bytes or pins: a prefetch that found no room is worth retrying
    /// only once this has moved.
    releases: u64,
}

/// What a load ends with: the bytes it read from the source (0 if it only checked an
/// existing entry), or why it failed.
type LoadResult = Result<u64, Arc<FetchError>>;

enum Slot {
    Ready(Ready),
    Loading(Shared<BoxFuture<'static, LoadResult>>),
}

struct Ready {
    entry: Arc<Entry>,
    pins: usize,
    /// Checked against its recorded CRC-32C (entries found at start-up are not, yet).
    verified: bool,
    /// Last time its source was seen unchanged; `None` for an entry found at start-up.
    checked: Option<Instant>,
    last_used: u64,
}

impl Ready {
    fn new(
        disk: &Disk,
        meta: Meta,
        charge: u64,
        verified: bool,
        checked: Option<Instant>,
        last_used: u64,
    ) -> Ready {
        Ready {
            entry: Arc::new(Entry {
                path: disk.data_path(&meta),
                meta,
                charge,
                map: Mutex::new(Weak::new()),
            }),
            pins: 0,
            verified,
            checked,
            last_used,
        }
    }
}

/// One committed entry.
struct Entry {
    meta: Meta,
    path: PathBuf,
    /// Bytes charged for it: data plus the record allowance.
    charge: u64,
    /// The mapping streams share while any of them reads the entry.
    map: Mutex<Weak<memmap2::Mmap>>,
}

/// The cache's numbers, for `/status`.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Usage {
    pub max_bytes: u64,
    pub charged_bytes: u64,
    pub resident_bytes: u64,
    pub pinned_bytes: u64,
    pub entries: usize,
    pub loading: usize,
}

/// What [`Cache::ensure`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ensured {
    /// Already there, or being loaded by someone else.
    Present,
    /// Read from its source now: these many bytes.
    Loaded(u64),
}

impl Cache {
    /// Opens (and locks) the cache directory, taking over the entries earlier runs left.
    /// Blocking.
    pub fn open(
        dir: &std::path::Path,
        limits: Limits,
        stores: Arc<Stores>,
        foresight: Arc<dyn Foresight>,
        metrics: Arc<Metrics>,
    ) -> Result<Cache, disk::OpenError> {
        let (disk, found) = Disk::open(dir)?;
        let mut state = State::default();
        let mut found: Vec<Meta> = found;
        // Oldest-first by name is arbitrary but stable; what does not fit goes now.
        found.sort_by(|a, b| a.url.cmp(&b.url));
        for meta in found {
            let charge = meta.size + META_MAX;
            if state.charged + charge > limits.max_bytes {
                tracing::info!(url = %meta.url, "cache.max_size shrank: dropping an entry");
                if let Err(e) = disk.remove(&meta) {
                    tracing::warn!(error = %e, url = %meta.url, "could not remove a cache entry");
                }
                continue;
            }
            state.charged += charge;
            state.resident += charge;
            let url = meta.url.clone();
            // Unverified and unchecked: its checksum and its source are checked on first use.
            let ready = Ready::new(&disk, meta, charge, false, None, 0);
            state.slots.insert(url, Slot::Ready(ready));
        }
        tracing::info!(
            dir = %dir.display(),
            entries = state.slots.len(),
            bytes = state.resident,
            "cache opened"
        );
        metrics.cache_capacity_bytes.set(limits.max_bytes as i64);
        let inner = Arc::new(Inner {
            disk,
            stores,
            limits,
            foresight,
            metrics,
            state: Mutex::new(state),
            space: Notify::new(),
            events: Arc::new(Notify::new()),
        });
        inner.publish(&inner.state.lock().unwrap());
        Ok(Cache { inner })
    }

    /// Woken when a load ends or space is freed.
    pub fn events(&self) -> Arc<Notify> {
        self.inner.events.clone()
    }

    pub fn stores(&self) -> &Arc<Stores> {
        &self.inner.stores
    }

    /// The bytes of a shard, pinned until the last slice of them is dropped. Waits for a
    /// load in progress or starts one.
    pub async fn get(&self, shard: &ShardUrl) -> Result<ShardBytes, FetchError> {
        let mut first = true;
        // An entry a load has just made or checked is served even if `cache.revalidate` is
        // shorter than the load took.
        let mut loaded = false;
        let entry = loop {
            let load = {
                let mut st = self.inner.state.lock().unwrap();
                st.tick += 1;
                let tick = st.tick;
                match st.slots.get_mut(shard.as_str()) {
                    Some(Slot::Ready(r)) if loaded || r.pins > 0 || self.inner.usable(r) => {
                        r.pins += 1;
                        r.last_used = tick;
                        let entry = r.entry.clone();
                        if r.pins == 1 {
                            st.pinned += entry.charge;
                        }
                        self.inner.publish(&st);
                        break entry;
                    }
                    Some(Slot::Loading(load)) => load.clone(),
                    _ => self.inner.start_load(&mut st, shard, Purpose::Demand),
                }
            };
            if std::mem::take(&mut first) {
                self.inner.metrics.cache_misses_total.inc();
            }
            match load.await {
                Err(e) if matches!(e.root(), FetchError::NoRoom { .. }) => continue,
                Err(e) => return Err(FetchError::Shared(e)),
                Ok(_) => loaded = true,
            }
        };
        if first {
            self.inner.metrics.cache_hits_total.inc();
        }
        let pin = Pin {
            inner: self.inner.clone(),
            url: shard.as_str().to_string(),
            entry: entry.clone(),
        };
        let map = entry.map.lock().unwrap().upgrade();
        let map = match map {
            Some(map) => map,
            None => {
                let e = entry.clone();
                let mapped = tokio::task::spawn_blocking(move || map_file(&e.path))
                    .await
                    .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())))
                    .map_err(FetchError::io(shard, "mapping the cache file"))?;
                let Some(map) = mapped else {
                    return Ok(ShardBytes::default()); // an empty shard; `pin` drops here
                };
                let map = Arc::new(map);
                *entry.map.lock().unwrap() = Arc::downgrade(&map);
                map
            }
        };
        Ok(ShardBytes::cache_file(Pinned { map, _pin: pin }))
    }

    /// Makes sure a shard is in the cache (or being loaded) without pinning it: what the
    /// prefetcher and `shardd warm` call.
    pub async fn ensure(&self, shard: &ShardUrl, purpose: Purpose) -> Result<Ensured, FetchError> {
        let load = {
            let mut st = self.inner.state.lock().unwrap();
            match st.slots.get(shard.as_str()) {
                Some(Slot::Ready(r)) if r.pins > 0 || self.inner.usable(r) => {
                    return Ok(Ensured::Present);
                }
                Some(Slot::Loading(_)) => return Ok(Ensured::Present),
                _ => self.inner.start_load(&mut st, shard, purpose),
            }
        };
        Ok(match load.await.map_err(FetchError::Shared)? {
            0 => Ensured::Present,
            fetched => Ensured::Loaded(fetched),
        })
    }

    /// Whether a shard is ready to be served without waiting.
    pub fn is_ready(&self, shard: &ShardUrl) -> bool {
        let st = self.inner.state.lock().unwrap();
        matches!(st.slots.get(shard.as_str()), Some(Slot::Ready(r)) if r.pins > 0 || self.inner.usable(r))
    }

    /// Bytes that could still be charged without evicting anything.
    pub fn free_bytes(&self) -> u64 {
        let st = self.inner.state.lock().unwrap();
        self.inner.limits.max_bytes.saturating_sub(st.charged)
    }

    /// What the cache holds now.
    pub fn usage(&self) -> Usage {
        let st = self.inner.state.lock().unwrap();
        Usage {
            max_bytes: self.inner.limits.max_bytes,
            charged_bytes: st.charged,
            resident_bytes: st.resident,
            pinned_bytes: st.pinned,
            entries: st
                .slots
                .values()
                .filter(|s| matches!(s, Slot::Ready(_)))
                .count(),
            loading: st
                .slots
                .values()
                .filter(|s| matches!(s, Slot::Loading(_)))
                .count(),
        }
    }

    /// Moves whenever bytes or pins are released.
    pub fn releases(&self) -> u64 {
        self.inner.state.lock().unwrap().releases
    }

    pub fn max_bytes(&self) -> u64 {
        self.inner.limits.max_bytes
    }
}

/// Keeps an entry pinned, and its mapping alive, while any slice of its bytes lives.
struct Pinned {
    map: Arc<memmap2::Mmap>,
    _pin: Pin,
}

impl AsRef<[u8]> for Pinned {
    fn as_ref(&self) -> &[u8] {
        &self.map
    }
}

struct Pin {
    inner: Arc<Inner>,
    url: String,
    entry: Arc<Entry>,
}

impl Drop for Pin {
    fn drop(&mut self) {
        let mut st = self.inner.state.lock().unwrap();
        if let Some(Slot::Ready(r)) = st.slots.get_mut(&self.url)
            && Arc::ptr_eq(&r.entry, &self.entry)
        {
            r.pins -= 1;
            if r.pins == 0 {
                st.pinned -= self.entry.charge;
                st.releases += 1;
                self.inner.publish(&st);
                drop(st);
                self.inner.space.notify_waiters();
                self.inner.events.notify_one();
            }
        }
    }
}

/// Bytes charged against the budget until dropped or turned into an entry's charge.
struct Reservation {
    inner: Arc<Inner>,
    bytes: u64,
}

impl Reservation {
    /// Gives back all but `keep` bytes.
    fn shrink_to(&mut self, keep: u64) {
        let give = self.bytes.saturating_sub(keep);
        if give > 0 {
            self.bytes -= give;
            self.inner.release(give);
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.bytes > 0 {
            self.inner.release(self.bytes);
        }
    }
}

/// Removes a `Loading` slot whose load ended without filling it (error, panic, shutdown).
/// (Only until the load has written its outcome: after that the slot may already hold
/// another load, which is not this guard's to remove.)
struct LoadingGuard {
    inner: Arc<Inner>,
    url: String,
    armed: bool,
}

impl Drop for LoadingGuard {
    fn drop(&mut self) {
        if self.armed {
            let mut st = self.inner.state.lock().unwrap();
            if let Some(Slot::Loading(_)) = st.slots.get(&self.url) {
                st.slots.remove(&self.url);
            }
        }
        self.inner.events.notify_one();
    }
}

impl Inner {
    /// Whether a ready entry may be served as it is: verified, and checked against its
    /// source recently enough.
    fn usable(&self, r: &Ready) -> bool {
        r.verified
            && r.checked
                .is_some_and(|at| at.elapsed() < self.limits.revalidate)
    }

    fn publish(&self, st: &State) {
        self.metrics.cache_bytes.set(st.charged as i64);
        self.metrics.cache_resident_bytes.set(st.resident as i64);
        self.metrics.cache_pinned_bytes.set(st.pinned as i64);
    }

    fn release(&self, bytes: u64) {
        let mut st = self.state.lock().unwrap();
        st.charged -= bytes;
        st.releases += 1;
        self.publish(&st);
        drop(st);
        self.space.notify_waiters();
        self.events.notify_one();
    }

    /// Starts loading a shard (the caller holds the state lock and found no usable entry):
    /// a task of its own, so that it finishes for the others even if the stream that
    /// started it goes away.
    fn start_load(
        self: &Arc<Self>,
        st: &mut State,
        shard: &ShardUrl,
        purpose: Purpose,
    ) -> Shared<BoxFuture<'static, LoadResult>> {
        // A stale or unverified entry is taken out to be checked (never a pinned one).
        let old = match st.slots.remove(shard.as_str()) {
            Some(Slot::Ready(r)) => Some(r),
            _ => None,
        };
        let inner = self.clone();
        let url = shard.clone();
        let guard = LoadingGuard {
            inner: self.clone(),
            url: shard.as_str().to_string(),
            armed: true,
        };
        let task = tokio::spawn(async move {
            let mut guard = guard;
            let result = inner.load(&url, old, purpose).await;
            let mut st = inner.state.lock().unwrap();
            guard.armed = false;
            let result = match result {
                Ok((ready, fetched)) => {
                    st.slots
                        .insert(url.as_str().to_string(), Slot::Ready(ready));
                    // A new unpinned entry is something a waiting reservation may evict.
                    inner.space.notify_waiters();
                    Ok(fetched)
                }
                Err(e) => {
                    st.slots.remove(url.as_str());
                    Err(Arc::new(e))
                }
            };
            inner.publish(&st);
            result
        });
        let what = shard.to_string();
        let load = async move {
            task.await.unwrap_or_else(|e| {
                Err(Arc::new(FetchError::Internal {
                    url: what,
                    what: e.to_string(),
                }))
            })
        }
        .boxed()
        .shared();
        st.slots
            .insert(shard.as_str().to_string(), Slot::Loading(load.clone()));
        load
    }

    /// Checks an existing entry, or fetches the shard.
    async fn load(
        self: &Arc<Self>,
        shard: &ShardUrl,
        old: Option<Ready>,
        purpose: Purpose,
    ) -> Result<(Ready, u64), FetchError> {
        if let Some(mut old) = old {
            match self.recheck(shard, &mut old).await {
                Ok(true) => return Ok((old, 0)),
                Ok(false) => self.forget(old.entry).await,
                Err(e) => {
                    self.forget(old.entry).await;
                    return Err(e);
                }
            }
        }
        let ready = self.fetch(shard, purpose).await?;
        let fetched = ready.entry.meta.version.size;
        if purpose != Purpose::Demand {
            self.metrics.cache_prefetched_bytes_total.inc_by(fetched);
        }
        Ok((ready, fetched))
    }

    /// Whether an existing entry can go on being served: its bytes match their checksum
    /// (checked once per daemon run) and its source has not changed.
    async fn recheck(&self, shard: &ShardUrl, r: &mut Ready) -> Result<bool, FetchError> {
        if !r.verified {
            let path = r.entry.path.clone();
            let sums = tokio::task::spawn_blocking(move || disk::checksums(&path, false))
                .await
                .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())));
            match sums {
                Ok((crc, _)) if crc == r.entry.meta.crc32c => r.verified = true,
                Ok((crc, _)) => {
                    self.metrics.cache_verify_failures_total.inc();
                    tracing::warn!(url = %shard, want = r.entry.meta.crc32c, got = crc, "cache entry corrupted on disk: fetching it again");
                    return Ok(false);
                }
                Err(e) => {
                    tracing::warn!(url = %shard, error = %e, "cache entry unreadable: fetching it again");
                    return Ok(false);
                }
            }
        }
        if self.usable(r) {
            return Ok(true);
        }
        match self.stores.version(shard).await {
            Ok(v) if v == r.entry.meta.version => {
                r.checked = Some(Instant::now());
                Ok(true)
            }
            Ok(_) => {
                tracing::info!(url = %shard, "the source changed: fetching it again");
                Ok(false)
            }
            Err(e @ ReadError::NotFound { .. }) => Err(e.into()),
            Err(e) => {
                // The bytes are verified and were current when last seen: better served
                // than a stream failed because the store is briefly unreachable.
                tracing::warn!(url = %shard, error = %e, "could not check the source; serving the cached copy");
                r.checked = Some(Instant::now());
                Ok(true)
            }
        }
    }

    /// Removes an unpinned entry that left the slot table, then releases its bytes.
    async fn forget(self: &Arc<Self>, entry: Arc<Entry>) {
        let inner = self.clone();
        let _ = tokio::task::spawn_blocking(move || inner.delete(&entry)).await;
    }

    /// Deletes an entry's files and releases its charge. Blocking.
    fn delete(&self, entry: &Entry) {
        if let Err(e) = self.disk.remove(&entry.meta) {
            tracing::warn!(url = %entry.meta.url, error = %e, "could not remove a cache entry");
        }
        let mut st = self.state.lock().unwrap();
        st.resident -= entry.charge;
        drop(st);
        self.release(entry.charge);
    }

    /// Reads a shard from its source into a new entry: HEAD (or stat), reserve, read,
    /// verify, decompress if gzipped, commit. A checksum mismatch, or a source that changed
    /// mid-read, is tried once more.
    async fn fetch(
        self: &Arc<Self>,
        shard: &ShardUrl,
        purpose: Purpose,
    ) -> Result<Ready, FetchError> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let version = self.stores.version(shard).await?;
            let need = version.size + META_MAX;
            if need > self.limits.max_bytes {
                return Err(FetchError::TooLarge {
                    url: shard.to_string(),
                    size: version.size,
                    limit: self.limits.max_bytes,
                });
            }
            let reservation = self.reserve(shard, need, purpose).await?;
            let (temp, file) = {
                let inner = self.clone();
                tokio::task::spawn_blocking(move || inner.disk.temp_file())
                    .await
                    .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())))
                    .map_err(FetchError::io(shard, "creating a cache file"))?
            };
            let read = self.stores.read_into(shard, &version, file).await;
            let result = match read {
                Ok(()) => {
                    let (inner, url, version) = (self.clone(), shard.clone(), version.clone());
                    tokio::task::spawn_blocking(move || {
                        inner.finish(&url, version, temp, reservation)
                    })
                    .await
                    .unwrap_or_else(|e| {
                        Err(FetchError::Internal {
                            url: shard.to_string(),
                            what: e.to_string(),
                        })
                    })
                }
                Err(e) => {
                    // Unlinking is file I/O: not on a runtime thread.
                    let _ = tokio::task::spawn_blocking(move || drop(temp)).await;
                    Err(e.into())
                }
            };
            match result {
                Err(FetchError::Verify { .. } | FetchError::Read(ReadError::Changed { .. }))
                    if attempt == 1 =>
                {
                    tracing::warn!(url = %shard, error = %result.err().unwrap(), "fetching once more");
                }
                result => return result,
            }
        }
    }

    /// Verifies a completed read, decompresses it if it is gzip, and commits it. Blocking.
    fn finish(
        self: &Arc<Self>,
        shard: &ShardUrl,
        version: Version,
        temp: disk::TempFile,
        mut reservation: Reservation,
    ) -> Result<Ready, FetchError> {
        let want_md5 = version.md5();
        let (crc, md5) = disk::checksums(temp.path(), want_md5.is_some())
            .map_err(FetchError::io(shard, "reading back the download"))?;
        if want_md5 != md5 {
            self.metrics.cache_verify_failures_total.inc();
            return Err(FetchError::Verify {
                url: shard.to_string(),
                what: format!(
                    "the store says MD5 {}, the {} bytes received hash to {}",
                    want_md5.unwrap_or_default(),
                    version.size,
                    md5.unwrap_or_default()
                ),
            });
        }
        let gzip = disk::is_gzip(temp.path())
            .map_err(FetchError::io(shard, "reading back the download"))?;
        let (data, size, crc) = if gzip {
            let (plain, size, crc) = self.gunzip(shard, &temp, &mut reservation)?;
            drop(temp);
            reservation.shrink_to(size + META_MAX);
            (plain, size, crc)
        } else {
            (temp, version.size, crc)
        };
        let meta = Meta {
            format: 1,
            url: shard.to_string(),
            version,
            data: String::new(),
            size,
            crc32c: crc,
            gzip,
        };
        let meta = self
            .disk
            .commit(data, meta)
            .map_err(FetchError::io(shard, "committing the cache entry"))?;
        let charge = size + META_MAX;
        reservation.shrink_to(charge);
        reservation.bytes = 0; // its bytes are the entry's charge now
        let mut st = self.state.lock().unwrap();
        st.resident += charge;
        st.tick += 1;
        let last_used = st.tick;
        drop(st);
        let now = Some(Instant::now());
        Ok(Ready::new(&self.disk, meta, charge, true, now, last_used))
    }

    /// Decompresses a gzipped download into a second cache file, reserving its space as it
    /// grows (from what is left of the budget, evicting entries nobody is reading), so a
    /// gzip bomb stops at the budget. Returns the file, its size and CRC-32C. Blocking.
    fn gunzip(
        self: &Arc<Self>,
        shard: &ShardUrl,
        compressed: &disk::TempFile,
        reservation: &mut Reservation,
    ) -> Result<(disk::TempFile, u64, u32), FetchError> {
        use std::io::{Read, Write};
        const STEP: u64 = 1 << 20;
        let io = |what| FetchError::io(shard, what);
        let (plain, file) = self.disk.temp_file().map_err(io("creating a cache file"))?;
        let input =
            std::fs::File::open(compressed.path()).map_err(io("reading back the download"))?;
        let mut decoder = flate2::read::MultiGzDecoder::new(std::io::BufReader::new(input));
        let mut out = std::io::BufWriter::new(file);
        let base = reservation.bytes;
        let (mut size, mut crc) = (0u64, 0u32);
        let mut buf = vec![0u8; 256 << 10];
        loop {
            let n = decoder
                .read(&mut buf)
                .map_err(io("decompressing the gzip shard"))?;
            if n == 0 {
                break;
            }
            size += n as u64;
            while base + size > reservation.bytes {
                if !self.grow_now(reservation, STEP) {
                    let st = self.state.lock().unwrap();
                    return Err(FetchError::GzipTooLarge {
                        url: shard.to_string(),
                        limit: self.limits.max_bytes,
                        free: reservation.bytes - base
                            + self.limits.max_bytes.saturating_sub(st.charged),
                    });
                }
            }
            crc = crc32c::crc32c_append(crc, &buf[..n]);
            out.write_all(&buf[..n])
                .map_err(io("writing to the cache"))?;
        }
        out.flush().map_err(io("writing to the cache"))?;
        Ok((plain, size, crc))
    }

    /// Adds `bytes` to a reservation now, evicting unpinned entries if that makes room;
    /// never waits. Blocking (it may delete files).
    fn grow_now(self: &Arc<Self>, reservation: &mut Reservation, bytes: u64) -> bool {
        let next = self.foresight.next_uses();
        loop {
            let victims = {
                let mut st = self.state.lock().unwrap();
                if st.charged + bytes <= self.limits.max_bytes {
                    st.charged += bytes;
                    reservation.bytes += bytes;
                    self.publish(&st);
                    return true;
                }
                let needed = st.charged + bytes - self.limits.max_bytes;
                match self.take_victims(&mut st, &next, needed, None) {
                    Some(v) => v,
                    None => return false,
                }
            };
            for entry in victims {
                self.delete(&entry);
            }
        }
    }

    /// Reserves `bytes`, evicting what the purpose allows; a demand waits for pins to be
    /// released, up to `cache.space_timeout`.
    async fn reserve(
        self: &Arc<Self>,
        shard: &ShardUrl,
        bytes: u64,
        purpose: Purpose,
    ) -> Result<Reservation, FetchError> {
        let started = Instant::now();
        let mut next: Option<HashMap<String, u64>> = None;
        loop {
            let space = self.space.notified();
            tokio::pin!(space);
            space.as_mut().enable();
            let victims = {
                let mut st = self.state.lock().unwrap();
                if st.charged + bytes <= self.limits.max_bytes {
                    st.charged += bytes;
                    self.publish(&st);
                    return Ok(Reservation {
                        inner: self.clone(),
                        bytes,
                    });
                }
                if next.is_none() {
                    // Asked outside the lock: the oracle takes its own.
                    drop(st);
                    next = Some(self.foresight.next_uses());
                    continue;
                }
                let needed = st.charged + bytes - self.limits.max_bytes;
                let next = next.as_ref().unwrap();
                let sooner_than = match purpose {
                    // Not even a demand evicts what a stream needs before this shard.
                    Purpose::Demand => next.get(shard.as_str()).copied(),
                    Purpose::Prefetch { distance } => Some(distance),
                    Purpose::Warm => Some(u64::MAX),
                };
                let victims = match purpose {
                    Purpose::Warm => None,
                    _ => self.take_victims(&mut st, next, needed, sooner_than),
                };
                match victims {
                    Some(v) => Ok(v),
                    None => Err(()),
                }
            };
            match victims {
                Ok(victims) => {
                    let inner = self.clone();
                    let _ = tokio::task::spawn_blocking(move || {
                        for entry in victims {
                            inner.delete(&entry);
                        }
                    })
                    .await;
                }
                Err(_) if purpose != Purpose::Demand => {
                    return Err(FetchError::NoRoom {
                        url: shard.to_string(),
                    });
                }
                Err(()) => {
                    let left = self.limits.space_timeout.saturating_sub(started.elapsed());
                    if left.is_zero() || tokio::time::timeout(left, space).await.is_err() {
                        let st = self.state.lock().unwrap();
                        let (pinned, reserved) = (st.pinned, st.charged - st.resident);
                        self.metrics.cache_full_total.inc();
                        return Err(FetchError::CacheFull {
                            url: shard.to_string(),
                            need: bytes,
                            limit: self.limits.max_bytes,
                            pinned,
                            reserved,
                            waited: started.elapsed(),
                        });
                    }
                    next = None; // the plans may have moved on while we waited
                }
            }
        }
    }

    /// Takes the entries to evict out of the slot table (they stay charged until deleted).
    fn take_victims(
        &self,
        st: &mut State,
        next: &HashMap<String, u64>,
        needed: u64,
        sooner_than: Option<u64>,
    ) -> Option<Vec<Arc<Entry>>> {
        let (urls, candidates): (Vec<&String>, Vec<Candidate>) = st
            .slots
            .iter()
            .filter_map(|(url, slot)| match slot {
                Slot::Ready(r) if r.pins == 0 => Some((
                    url,
                    Candidate {
                        bytes: r.entry.charge,
                        next_use: next.get(url).copied(),
                        last_used: r.last_used,
                    },
                )),
                _ => None,
            })
            .unzip();
        let chosen = evict::choose(&candidates, needed, sooner_than)?;
        let urls: Vec<String> = chosen.iter().map(|&i| urls[i].clone()).collect();
        let victims: Vec<Arc<Entry>> = urls
            .iter()
            .filter_map(|url| match st.slots.remove(url) {
                Some(Slot::Ready(r)) => Some(r.entry),
                _ => None,
            })
            .collect();
        self.metrics
            .cache_evictions_total
            .inc_by(victims.len() as u64);
        for v in &victims {
            tracing::debug!(url = %v.meta.url, bytes = v.charge, "evicting");
        }
        Some(victims)
    }
}

/// Maps a cache file read-only, pages read in (in a blocking thread, so that sending never
/// faults on disk reads); `None` for an empty file, which cannot be mapped.
fn map_file(path: &std::path::Path) -> std::io::Result<Option<memmap2::Mmap>> {
    let file = std::fs::File::open(path)?;
    if file.metadata()?.len() == 0 {
        return Ok(None);
    }
    // SAFETY: the file is a committed cache entry in a directory this daemon holds the lock
    // on; the daemon never writes to a committed entry, and eviction unlinks it, which leaves
    // a mapping intact. (An operator truncating files inside cache.dir while the daemon runs
    // is outside this contract.)
    let map = unsafe { memmap2::MmapOptions::new().populate().map(&file) }?;
    Ok(Some(map))
}

#[cfg(test)]
mod tests;
