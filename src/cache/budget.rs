//! The byte budget: reservations charged before anything is written, released when dropped
//! or turned into an entry's charge; eviction (whom [`evict`](super::evict) chooses) to make
//! room, as far as a load's [`Purpose`] allows.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use super::evict::{self, Candidate};
use super::{Entry, FetchError, Inner, Purpose, Slot, State};
use crate::url::ShardUrl;

/// Bytes charged against the budget until dropped or turned into an entry's charge.
pub(super) struct Reservation {
    inner: Arc<Inner>,
    pub(super) bytes: u64,
}

impl Reservation {
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

impl Inner {
    pub(super) fn publish(&self, st: &State) {
        self.metrics.cache_bytes.set(st.charged as i64);
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

    /// Adds `bytes` to a reservation now, evicting unpinned entries if that makes room;
    /// never waits. Blocking (it may delete files).
    pub(super) fn grow_now(self: &Arc<Self>, reservation: &mut Reservation, bytes: u64) -> bool {
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
    pub(super) async fn reserve(
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
    pub(super) fn take_victims(
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
