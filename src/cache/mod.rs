//! The host-level shard source: one per daemon, shared by every stream of every dataset.
//!
//! A shard is keyed by its URL and held as a verified file under `cache.dir` that survives
//! restarts (layout and commit protocol in [`disk`]). What the cache promises:
//! - **Single flight.** However many streams, datasets or epochs want a shard at once, it is
//!   read from its source once; the others wait for that one load.
//! - **Pins.** A stream reading a shard holds a pin, released when the last of its bytes is
//!   dropped; a pinned entry is never evicted or replaced.
//! - **Verified.** A download is checked by the store against the checksums its source
//!   vouches for (`store.verify`; see [`crate::store`]), from the CRC-32C computed as it was
//!   written: the cache never reads a download back to check it. A mismatch is fetched once
//!   more, then fails the stream naming the shard and both checksums. Every entry's CRC-32C
//!   is recorded; an entry found at start-up is checked against it before it is first served.
//!   Nothing that did not verify is served or kept.
//! - **Fresh.** An entry not checked against its source for `cache.revalidate` is checked
//!   (a HEAD, or a `stat` of a local file) when next used and fetched again if it changed.
//! - **A hard budget.** Bytes on disk (entries, downloads and decompression in progress, and
//!   a fixed [`disk::META_MAX`] per record) never exceed `cache.max_size`: space is reserved
//!   before it is written, by evicting unpinned entries farthest-next-use first ([`evict`]).
//!   A stream that needs space nobody can free waits up to `cache.space_timeout` for pins to
//!   be released, then fails with `cache_full`; a prefetch that does not fit simply waits.
//!
//! The mutex around the state is never held across an await or around file I/O. The
//! foresight (the plans' lock) is asked under it, about eviction candidates only: the plans'
//! lock is taken after the state's, never before.
//!
//! # Rooms
//! | file | job |
//! |---|---|
//! | `mod.rs` | the [`Cache`] facade, its state (slots, entries) and errors |
//! | `load.rs` | single flight, rechecking an entry, fetch → verify → decompress → commit |
//! | `budget.rs` | reservations against `cache.max_size`, eviction to make room |
//! | `pin.rs` | pins and mappings that keep an entry while a stream reads it |
//! | `decompress.rs` | gzip and zstd shards: detection by content, streaming decoders |
//! | `disk.rs` | the directory: layout, lock, atomic commits, checksums |
//! | `evict.rs` | whom to evict: farthest next use first |
//! | `bytes.rs` | [`ShardBytes`]: shard bytes, and whether they may be spliced |

mod budget;
pub mod bytes;
pub mod decompress;
pub mod disk;
pub mod evict;
mod load;
mod pin;

use crate::store::pacing::Urgency;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

pub use self::bytes::ShardBytes;
use self::disk::{Disk, META_MAX, Meta};
use self::evict::Foresight;
use self::load::SharedLoad;
use self::pin::{Pin, Pinned, map_entry};
use crate::config::url::ShardUrl;
use crate::ops::metrics::Metrics;
use crate::store::{ReadError, Stores};

#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error(transparent)]
    Read(#[from] ReadError),
    #[error("{url}: {size} bytes do not fit in cache.max_size ({limit} bytes)")]
    TooLarge { url: String, size: u64, limit: u64 },
    #[error(
        "{url}: decompresses to more than the cache can hold (cache.max_size {limit} bytes; {free} were free for it)"
    )]
    DecompressedTooLarge { url: String, limit: u64, free: u64 },
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

    /// Whether a fetch that failed so is worth another: a checksum mismatch, a source that
    /// changed mid-read, or a cache file deleted under the daemon while it was written.
    fn worth_another_try(&self) -> bool {
        match self {
            FetchError::Verify { .. } | FetchError::Read(ReadError::Changed { .. }) => true,
            FetchError::Io { source, .. } => source.kind() == std::io::ErrorKind::NotFound,
            _ => false,
        }
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
    /// Demand loads waiting for space.
    waiting: usize,
}

/// What a load ends with: the bytes it read from the source (0 if it only checked an
/// existing entry), or why it failed.
type LoadResult = Result<u64, Arc<FetchError>>;

enum Slot {
    Ready(Ready),
    /// A load in flight, and how urgent its requests to the store are: a stream that comes
    /// to wait for a prefetch raises it ahead of the other prefetches.
    Loading(SharedLoad, Urgency),
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
        /// Unique in this process: what is derived from an entry's bytes is kept by its id.
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        Ready {
            entry: Arc::new(Entry {
                id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
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
    /// Never reused, not even for the same shard fetched again.
    id: u64,
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
    /// Loads waiting for pins to be released (the cache is full of what streams read now).
    #[serde(default)]
    pub waiting: usize,
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
    /// load in progress or starts one. An entry whose file was deleted under the daemon
    /// (an operator, a cleaner) is fetched again.
    pub async fn get(&self, shard: &ShardUrl) -> Result<ShardBytes, FetchError> {
        Ok(self.get_identified(shard).await?.0)
    }

    /// [`Cache::get`], and the id of the entry the bytes are (an id no other entry has had or
    /// will have in this process: a shard fetched again is a new entry), for what is derived
    /// from them and kept ([`crate::shard::sample_index`]).
    pub async fn get_identified(&self, shard: &ShardUrl) -> Result<(ShardBytes, u64), FetchError> {
        // A missing file is fetched again once every reader that pinned its entry has let go
        // (`until_unpinned`); more than two attempts in case it goes missing again.
        const ATTEMPTS: u32 = 3;
        let mut attempts = 0;
        loop {
            attempts += 1;
            let entry = self.pin(shard).await?;
            let pin = Pin {
                inner: self.inner.clone(),
                url: shard.as_str().to_string(),
                entry: entry.clone(),
            };
            match map_entry(&entry).await {
                Ok(Some(map)) => {
                    return Ok((ShardBytes::cache_file(Pinned { map, _pin: pin }), entry.id));
                }
                Ok(None) => return Ok((ShardBytes::default(), entry.id)), // empty; `pin` drops
                Err(e) if e.kind() == std::io::ErrorKind::NotFound && attempts < ATTEMPTS => {
                    tracing::warn!(url = %shard, path = %entry.path.display(), "a cache file was deleted under the daemon: fetching it again");
                    drop(pin);
                    self.inner.distrust(&entry);
                    self.inner.until_unpinned(&entry).await;
                }
                Err(e) => return Err(FetchError::io(shard, "mapping the cache file")(e)),
            }
        }
    }

    /// Pins a shard's entry, waiting for a load in progress or starting one.
    async fn pin(&self, shard: &ShardUrl) -> Result<Arc<Entry>, FetchError> {
        let mut first = true;
        // An entry a load has just made or checked is served even if `cache.revalidate` is
        // shorter than the load took.
        let mut loaded = false;
        let entry = loop {
            let (load, new) = {
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
                    Some(Slot::Loading(load, urgency)) => {
                        urgency.raise();
                        (load.clone(), None)
                    }
                    _ => {
                        let (load, new) = self.inner.start_load(&mut st, shard, Purpose::Demand);
                        (load, Some(new))
                    }
                }
            };
            if let Some(new) = new {
                new.spawn(); // the lock is released
            }
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
        Ok(entry)
    }

    /// Makes sure a shard is in the cache (or being loaded) without pinning it: what the
    /// prefetcher and `shardd warm` call.
    pub async fn ensure(&self, shard: &ShardUrl, purpose: Purpose) -> Result<Ensured, FetchError> {
        let (load, new) = {
            let mut st = self.inner.state.lock().unwrap();
            match st.slots.get(shard.as_str()) {
                Some(Slot::Ready(r)) if r.pins > 0 || self.inner.usable(r) => {
                    return Ok(Ensured::Present);
                }
                Some(Slot::Loading(..)) => return Ok(Ensured::Present),
                _ => self.inner.start_load(&mut st, shard, purpose),
            }
        };
        new.spawn(); // the lock is released
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
                .filter(|s| matches!(s, Slot::Loading(..)))
                .count(),
            waiting: st.waiting,
        }
    }

    /// Moves whenever bytes or pins are released.
    pub fn releases(&self) -> u64 {
        self.inner.state.lock().unwrap().releases
    }

    /// For zero-copy delivery (`mapped.rs`): the committed cache file that `piece` (bytes of
    /// `url` this cache returned, so pinned while `piece` lives) is a slice of, as a fresh
    /// read-only descriptor (`O_RDONLY | O_CLOEXEC`; never the file being written), with the
    /// address and length of the mapping `piece` lies in. `None` for heap bytes, or when the
    /// file cannot be opened or is not the mapping's (the piece is then sent inline).
    pub fn committed_file(
        &self,
        url: &str,
        piece: &ShardBytes,
    ) -> Option<(std::fs::File, usize, usize)> {
        piece.spliceable()?;
        let entry = {
            let st = self.inner.state.lock().unwrap();
            match st.slots.get(url) {
                Some(Slot::Ready(r)) if r.pins > 0 => r.entry.clone(),
                _ => return None,
            }
        };
        let map = entry.map.lock().unwrap().upgrade()?;
        let (base, len) = (map.as_ptr() as usize, map.len());
        let at = piece.as_ptr() as usize;
        if at < base || at + piece.len() > base + len {
            return None;
        }
        // std opens with O_CLOEXEC; read-only, so the client can only read this shard.
        let file = std::fs::File::open(&entry.path).ok()?;
        (file.metadata().ok()?.len() == len as u64).then_some((file, base, len))
    }

    pub fn max_bytes(&self) -> u64 {
        self.inner.limits.max_bytes
    }
}

#[cfg(test)]
mod tests;
