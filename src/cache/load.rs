//! Loads: single flight per shard (one task per load, which others wait on), recheck of an
//! existing entry, and a fetch from the source: reserve, read, verify, decompress, commit.

use std::sync::Arc;
use std::time::Instant;

use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use tokio::task::JoinHandle;

use super::budget::Reservation;
use super::decompress::Compression;
use super::disk::{self, META_MAX, Meta};
use super::{FetchError, Inner, LoadResult, Purpose, Ready, Slot, State};
use crate::config::url::ShardUrl;
use crate::store::pacing::{URGENCY, Urgency};
use crate::store::{ReadError, Version};

/// What waiters on a load share.
pub(super) type SharedLoad = Shared<BoxFuture<'static, LoadResult>>;

/// A load's task, not spawned yet: spawned only once the state lock is released, because a
/// runtime that is shutting down drops a task it is handed at once, inside `spawn`, and the
/// dropped task's [`LoadingGuard`] takes the state lock.
#[must_use = "the load's waiters wait until it is spawned"]
pub(super) struct NewLoad {
    run: BoxFuture<'static, LoadResult>,
    handle: tokio::sync::oneshot::Sender<JoinHandle<LoadResult>>,
}

impl NewLoad {
    pub(super) fn spawn(self) {
        let _ = self.handle.send(tokio::spawn(self.run));
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
            if let Some(Slot::Loading(..)) = st.slots.get(&self.url) {
                st.slots.remove(&self.url);
            }
        }
        self.inner.events.notify_one();
    }
}

impl Inner {
    /// Whether a ready entry may be served as it is: verified, and checked against its
    /// source recently enough.
    pub(super) fn usable(&self, r: &Ready) -> bool {
        r.verified
            && r.checked
                .is_some_and(|at| at.elapsed() < self.limits.revalidate)
    }

    /// Starts loading a shard (the caller holds the state lock and found no usable entry):
    /// puts a `Loading` slot in its place and returns what to wait on, with the task to
    /// [spawn](NewLoad::spawn) once the lock is released. A task of its own, so that the
    /// load finishes for the others even if the stream that started it goes away.
    pub(super) fn start_load(
        self: &Arc<Self>,
        st: &mut State,
        shard: &ShardUrl,
        purpose: Purpose,
    ) -> (SharedLoad, NewLoad) {
        // A stale or unverified entry is taken out to be checked (never a pinned one).
        let old = match st.slots.remove(shard.as_str()) {
            Some(Slot::Ready(r)) => Some(r),
            _ => None,
        };
        let (handle, task) = tokio::sync::oneshot::channel::<JoinHandle<LoadResult>>();
        let url = shard.to_string();
        let load = async move {
            let outcome = match task.await {
                Ok(task) => task.await.map_err(|e| e.to_string()),
                Err(_) => Err("the load was never started".to_string()),
            };
            outcome.unwrap_or_else(|what| Err(Arc::new(FetchError::Internal { url, what })))
        }
        .boxed()
        .shared();
        let urgency = match purpose {
            Purpose::Demand => Urgency::urgent(),
            Purpose::Prefetch { .. } | Purpose::Warm => Urgency::prefetch(),
        };
        st.slots.insert(
            shard.as_str().to_string(),
            Slot::Loading(load.clone(), urgency.clone()),
        );
        // Made now, so that a task dropped before it first runs still clears the slot.
        let guard = LoadingGuard {
            inner: self.clone(),
            url: shard.as_str().to_string(),
            armed: true,
        };
        let run = URGENCY
            .scope(
                urgency,
                self.clone().run_load(guard, shard.clone(), old, purpose),
            )
            .boxed();
        (load, NewLoad { run, handle })
    }

    /// A load's task: loads, then puts the outcome in the slot table.
    async fn run_load(
        self: Arc<Self>,
        mut guard: LoadingGuard,
        url: ShardUrl,
        old: Option<Ready>,
        purpose: Purpose,
    ) -> LoadResult {
        let result = self.load(&url, old, purpose).await;
        let mut st = self.state.lock().unwrap();
        guard.armed = false;
        let result = match result {
            Ok((ready, fetched)) => {
                st.slots
                    .insert(url.as_str().to_string(), Slot::Ready(ready));
                // A new unpinned entry is something a waiting reservation may evict.
                self.space.notify_waiters();
                Ok(fetched)
            }
            Err(e) => {
                st.slots.remove(url.as_str());
                Err(Arc::new(e))
            }
        };
        self.publish(&st);
        result
    }

    /// Checks an existing entry, or fetches the shard.
    pub(super) async fn load(
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
    pub(super) async fn recheck(
        &self,
        shard: &ShardUrl,
        r: &mut Ready,
    ) -> Result<bool, FetchError> {
        if !r.verified {
            let path = r.entry.path.clone();
            let sums = tokio::task::spawn_blocking(move || disk::checksums(&path))
                .await
                .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())));
            match sums {
                Ok(crc) if crc == r.entry.meta.crc32c => r.verified = true,
                Ok(crc) => {
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

    /// Reads a shard from its source into a new entry: open (its first part's GET, or a
    /// stat), reserve, read,
    /// verify, decompress if compressed, commit. A checksum mismatch, or a source that changed
    /// mid-read, is tried once more.
    pub(super) async fn fetch(
        self: &Arc<Self>,
        shard: &ShardUrl,
        purpose: Purpose,
    ) -> Result<Ready, FetchError> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            // The first part's GET tells the version (no HEAD); its body waits for the room.
            let opened = self.stores.open(shard).await?;
            let version = opened.version.clone();
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
            let read = self.stores.read_into(shard, opened, file).await;
            let result = match read {
                Ok(fetched) => {
                    let (inner, url, version) = (self.clone(), shard.clone(), version.clone());
                    tokio::task::spawn_blocking(move || {
                        inner.finish(&url, version, fetched.crc32c, temp, reservation, purpose)
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
                    Err(self.read_failed(e))
                }
            };
            match result {
                Err(e) if attempt == 1 && e.worth_another_try() => {
                    tracing::warn!(url = %shard, error = %e, "fetching once more");
                }
                result => return result,
            }
        }
    }

    /// A failed read as the cache reports it: bytes that do not match the checksum their
    /// source vouches for are a verification failure (counted; fetched once more).
    fn read_failed(&self, e: ReadError) -> FetchError {
        match e {
            ReadError::Checksum { url, what } => {
                self.metrics.cache_verify_failures_total.inc();
                FetchError::Verify { url, what }
            }
            e => e.into(),
        }
    }

    /// Decompresses a completed, verified read if it is compressed (gzip or zstd, told by its
    /// first bytes), and commits it; `crc` is the read's CRC-32C (computed as it was
    /// written). Blocking.
    pub(super) fn finish(
        self: &Arc<Self>,
        shard: &ShardUrl,
        version: Version,
        crc: u32,
        temp: disk::TempFile,
        mut reservation: Reservation,
        purpose: Purpose,
    ) -> Result<Ready, FetchError> {
        let compression = Compression::of_file(temp.path())
            .map_err(FetchError::io(shard, "reading back the download"))?;
        let (data, size, crc) = if let Some(compression) = compression {
            let (plain, size, crc) =
                self.decompress(shard, compression, &temp, &mut reservation, purpose)?;
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
            gzip: compression == Some(Compression::Gzip),
            zstd: compression == Some(Compression::Zstd),
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

    /// Decompresses a compressed download into a second cache file, streaming, reserving its
    /// space as it grows under the load's purpose (what it may evict, whether it waits), so
    /// a gzip or zstd bomb stops at the budget. Returns the file, its size and CRC-32C.
    /// Blocking.
    pub(super) fn decompress(
        self: &Arc<Self>,
        shard: &ShardUrl,
        compression: Compression,
        compressed: &disk::TempFile,
        reservation: &mut Reservation,
        purpose: Purpose,
    ) -> Result<(disk::TempFile, u64, u32), FetchError> {
        use std::io::{Read, Write};
        let io = |what| FetchError::io(shard, what);
        let decoding = match compression {
            Compression::Gzip => "decompressing the gzip shard",
            Compression::Zstd => "decompressing the zstd shard",
        };
        let (plain, file) = self.disk.temp_file().map_err(io("creating a cache file"))?;
        let input =
            std::fs::File::open(compressed.path()).map_err(io("reading back the download"))?;
        let mut decoder = compression
            .decoder(std::io::BufReader::new(input))
            .map_err(io(decoding))?;
        let mut out = crate::blocks::BlockWriter::new(file, self.stores.block_size());
        let base = reservation.bytes;
        let (mut size, mut crc) = (0u64, 0u32);
        let mut buf = vec![0u8; 256 << 10];
        loop {
            let n = decoder.read(&mut buf).map_err(io(decoding))?;
            if n == 0 {
                break;
            }
            size += n as u64;
            self.cover(shard, reservation, base, base + size, purpose)?;
            crc = crc32c::crc32c_append(crc, &buf[..n]);
            out.write_all(&buf[..n])
                .map_err(io("writing to the cache"))?;
        }
        out.finish().map_err(io("writing to the cache"))?;
        Ok((plain, size, crc))
    }

    /// Grows a decompression's reservation (`base` bytes before it began) to `target`
    /// bytes, a MiB at a time where the budget allows; refused outright when the load alone
    /// would exceed the budget. Blocking.
    fn cover(
        self: &Arc<Self>,
        shard: &ShardUrl,
        reservation: &mut Reservation,
        base: u64,
        target: u64,
        purpose: Purpose,
    ) -> Result<(), FetchError> {
        const STEP: u64 = 1 << 20;
        let max = self.limits.max_bytes;
        if target <= reservation.bytes {
            return Ok(());
        }
        if target > max {
            return Err(FetchError::DecompressedTooLarge {
                url: shard.to_string(),
                limit: max,
                free: max.saturating_sub(base),
            });
        }
        let step = (target - reservation.bytes).max(STEP.min(max - reservation.bytes));
        self.grow(shard, reservation, step, purpose)
    }
}
