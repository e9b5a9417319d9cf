//! The byte budget: reservations charged before anything is written, released when dropped
//! or turned into an entry's charge; eviction (whom [`evict`](super::evict) chooses) to make
//! room, as far as a load's [`Purpose`] allows.

use std::sync::Arc;
use std::time::Instant;

use super::evict::{self, Candidate};
use super::{Entry, FetchError, Inner, Purpose, Slot, State};
use crate::config::url::ShardUrl;

/// Bytes charged against the budget until dropped or turned into an entry's charge.
pub(super) struct Reservation {
    inner: Arc<Inner>,
    pub(super) bytes: u64,
}

impl Reservation {
    /// Takes over another reservation's bytes.
    pub(super) fn absorb(&mut self, mut other: Reservation) {
        self.bytes += std::mem::take(&mut other.bytes);
    }

    /// Gives back all but `keep` bytes.
    pub(super) fn shrink_to(&mut self, keep: u64) {
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

/// Counts a load as waiting for space (see [`Usage::waiting`](super::Usage::waiting)) while
/// it lives.
struct Waiting<'a>(&'a Inner);

impl Waiting<'_> {
    fn new(inner: &Inner) -> Waiting<'_> {
        inner.state.lock().unwrap().waiting += 1;
        Waiting(inner)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.state.lock().unwrap().waiting -= 1;
    }
}

impl Inner {
    pub(super) fn publish(&self, st: &State) {
        self.metrics.cache_bytes.set(st.charged as i64);
        if st.charged as i64 > self.metrics.cache_bytes_max.get() {
            self.metrics.cache_bytes_max.set(st.charged as i64);
        }
        self.metrics.cache_resident_bytes.set(st.resident as i64);
        self.metrics.cache_pinned_bytes.set(st.pinned as i64);
    }

    pub(super) fn release(&self, bytes: u64) {
        let mut st = self.state.lock().unwrap();
        st.charged -= bytes;
        st.releases += 1;
        self.publish(&st);
        drop(st);
        self.space.notify_waiters();
        self.events.notify_one();
    }

    /// Removes an unpinned entry that left the slot table, then releases its bytes.
    pub(super) async fn forget(self: &Arc<Self>, entry: Arc<Entry>) {
        let inner = self.clone();
        let _ = tokio::task::spawn_blocking(move || inner.delete(&entry)).await;
    }

    /// Deletes an entry's files and releases its charge. Blocking.
    pub(super) fn delete(&self, entry: &Entry) {
        if let Err(e) = self.disk.remove(&entry.meta) {
            tracing::warn!(url = %entry.meta.url, error = %e, "could not remove a cache entry");
        }
        let mut st = self.state.lock().unwrap();
        st.resident -= entry.charge;
        drop(st);
        self.release(entry.charge);
    }

    /// Adds `bytes` to a load's reservation under the rules of its purpose, waiting for
    /// space as [`reserve`](Inner::reserve) does. Blocking: for the thread that decompresses.
    pub(super) fn grow(
        self: &Arc<Self>,
        shard: &ShardUrl,
        reservation: &mut Reservation,
        bytes: u64,
        purpose: Purpose,
    ) -> Result<(), FetchError> {
        let held = reservation.bytes;
        let more = tokio::runtime::Handle::current()
            .block_on(self.reserve(shard, bytes, purpose))
            .map_err(|mut e| {
                if let FetchError::CacheFull { need, .. } = &mut e {
                    *need += held; // what the whole load needs, not this step
                }
                e
            })?;
        reservation.absorb(more);
        Ok(())
    }

    /// Reserves `bytes`, evicting what the purpose allows; a demand waits for pins to be
    /// released, up to `cache.space_timeout`.
    pub(super) async fn reserve(
        self: &Arc<Self>,
        shard: &ShardUrl,
        bytes: u64,
        purpose: Purpose,
    ) -> Result<Reservation, FetchError> {
        let started = Instant::now();
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
                let needed = st.charged + bytes - self.limits.max_bytes;
                self.take_victims(&mut st, shard, needed, purpose)
            };
            match victims {
                Some(victims) => {
                    let inner = self.clone();
                    let _ = tokio::task::spawn_blocking(move || {
                        for entry in victims {
                            inner.delete(&entry);
                        }
                    })
                    .await;
                }
                None if purpose != Purpose::Demand => {
                    return Err(FetchError::NoRoom {
                        url: shard.to_string(),
                    });
                }
                None => self.wait_for_space(shard, bytes, started, space).await?,
            }
        }
    }

    /// Waits for a release of bytes or pins (`space`), or fails with `cache_full` once the
    /// demand for `bytes` started at `started` has waited `cache.space_timeout`.
    async fn wait_for_space(
        &self,
        shard: &ShardUrl,
        bytes: u64,
        started: Instant,
        space: std::pin::Pin<&mut tokio::sync::futures::Notified<'_>>,
    ) -> Result<(), FetchError> {
        let left = self.limits.space_timeout.saturating_sub(started.elapsed());
        let waiting = Waiting::new(self);
        let woken = !left.is_zero() && tokio::time::timeout(left, space).await.is_ok();
        drop(waiting);
        if woken {
            return Ok(());
        }
        let st = self.state.lock().unwrap();
        self.metrics.cache_full_total.inc();
        Err(FetchError::CacheFull {
            url: shard.to_string(),
            need: bytes,
            limit: self.limits.max_bytes,
            pinned: st.pinned,
            reserved: st.charged - st.resident,
            waited: started.elapsed(),
        })
    }

    /// Takes the entries to evict for a load of `shard` out of the slot table (they stay
    /// charged until deleted), as far as its purpose allows: a warm-up evicts nothing, a
    /// prefetch only entries needed later than it, and not even a demand evicts what a
    /// stream needs before this shard. `None` when that cannot free `needed` bytes.
    /// The foresight is asked about the candidates only, under the state lock (the lock
    /// order is the cache's state, then the plans').
    pub(super) fn take_victims(
        &self,
        st: &mut State,
        shard: &ShardUrl,
        needed: u64,
        purpose: Purpose,
    ) -> Option<Vec<Arc<Entry>>> {
        if purpose == Purpose::Warm {
            return None;
        }
        let (mut urls, mut candidates): (Vec<&str>, Vec<Candidate>) = st
            .slots
            .iter()
            .filter_map(|(url, slot)| match slot {
                Slot::Ready(r) if r.pins == 0 => Some((
                    url.as_str(),
                    Candidate {
                        bytes: r.entry.charge,
                        next_use: None,
                        last_used: r.last_used,
                    },
                )),
                _ => None,
            })
            .unzip();
        urls.push(shard.as_str());
        let mut next = self.foresight.next_uses(&urls);
        let own = next.pop().flatten();
        for (c, next_use) in candidates.iter_mut().zip(next) {
            c.next_use = next_use;
        }
        let sooner_than = match purpose {
            Purpose::Demand => own,
            Purpose::Prefetch { distance } => Some(distance),
            Purpose::Warm => unreachable!("a warm-up evicts nothing"),
        };
        let chosen = evict::choose(&candidates, needed, sooner_than)?;
        let urls: Vec<String> = chosen.iter().map(|&i| urls[i].to_string()).collect();
        Some(self.evict(st, &urls))
    }

    /// Takes `urls` out of the slot table, counted as evictions.
    fn evict(&self, st: &mut State, urls: &[String]) -> Vec<Arc<Entry>> {
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
        victims
    }
}
