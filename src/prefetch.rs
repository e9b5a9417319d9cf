//! What to fetch next, from the plans of the streams.
//!
//! Every open stream registers its [`Schedule`]: the shards it will read for the rest of its
//! epoch, followed by the shards the *same* stream (dataset, seed, rank, worker) reads in the
//! next epoch. The prefetcher walks the schedules round-robin, k-th upcoming shard of every
//! stream before the (k+1)-th, up to `cache.prefetch_shards` ahead of each, and loads what
//! is missing, at most `store.max_downloads` at a time. When a stream ends, its schedule
//! lingers (for [`LINGER`], or until the stream of the next epoch opens and takes its place),
//! so the first shards of the next epoch are on disk before the trainer asks for them.
//!
//! The same schedules are the eviction oracle ([`Foresight`]): an entry's next use is its
//! smallest distance ahead of any stream's cursor.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::cache::evict::Foresight;
use crate::cache::{Cache, Ensured, FetchError, Purpose};
use crate::url::ShardUrl;

/// How long the schedule of an ended stream keeps guiding prefetch and eviction.
pub const LINGER: Duration = Duration::from_secs(600);
/// How long a shard whose prefetch failed is left to the streams that need it.
const FAILED_BACKOFF: Duration = Duration::from_secs(60);
/// How long a shard the prefetcher loaded or checked is left alone.
const RECHECK_AFTER: Duration = Duration::from_secs(1);
/// Ended streams' schedules kept at most (the oldest go first).
const MAX_LINGERING: usize = 4096;

/// Identifies "the same stream" from one epoch to the next.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamId {
    pub dataset: String,
    pub seed: u64,
    pub rank: u32,
    pub world_size: u32,
    pub worker: u32,
    pub num_workers: u32,
}

struct Schedule {
    shards: Vec<ShardUrl>,
    /// Shards the stream has received so far (the one it is loading is still ahead).
    cursor: usize,
    /// Tells a replaced schedule's handle from the current one's.
    generation: u64,
    /// `None` while its stream is open.
    ended: Option<Instant>,
}

/// The schedules of the open (and recently ended) streams.
#[derive(Default)]
pub struct Plans {
    schedules: Mutex<HashMap<StreamId, Schedule>>,
    next_generation: std::sync::atomic::AtomicU64,
    changed: Notify,
}

/// A stream's hold on its schedule: moves its cursor, and lets it linger when dropped.
pub struct ScheduleHandle {
    plans: Arc<Plans>,
    id: StreamId,
    generation: u64,
}

impl Plans {
    /// Registers a stream about to read `shards` (this epoch, then the next).
    pub fn open(self: &Arc<Self>, id: StreamId, shards: Vec<ShardUrl>) -> ScheduleHandle {
        let generation = self
            .next_generation
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut schedules = self.schedules.lock().unwrap();
        schedules.insert(
            id.clone(),
            Schedule {
                shards,
                cursor: 0,
                generation,
                ended: None,
            },
        );
        drop(schedules);
        self.changed.notify_one();
        ScheduleHandle {
            plans: self.clone(),
            id,
            generation,
        }
    }

    /// The next `per_stream` shards of every schedule, k-th of each before the (k+1)-th,
    /// with their distance k. Expired schedules are dropped on the way.
    pub fn wanted(&self, per_stream: usize) -> Vec<(ShardUrl, u64)> {
        let mut schedules = self.schedules.lock().unwrap();
        expire(&mut schedules);
        let mut ids: Vec<&StreamId> = schedules.keys().collect();
        ids.sort();
        let mut out = Vec::new();
        for k in 0..per_stream {
            for id in &ids {
                let s = &schedules[*id];
                if let Some(shard) = s.shards.get(s.cursor + k) {
                    out.push((shard.clone(), k as u64));
                }
            }
        }
        out
    }
}

impl Foresight for Plans {
    fn next_uses(&self) -> HashMap<String, u64> {
        let schedules = self.schedules.lock().unwrap();
        let mut next: HashMap<String, u64> = HashMap::new();
        for s in schedules.values() {
            for (k, shard) in s.shards.iter().skip(s.cursor).enumerate() {
                let d = next.entry(shard.as_str().to_string()).or_insert(k as u64);
                *d = (*d).min(k as u64);
            }
        }
        next
    }
}

fn expire(schedules: &mut HashMap<StreamId, Schedule>) {
    schedules.retain(|_, s| s.ended.is_none_or(|at| at.elapsed() < LINGER));
    let mut ended: Vec<(Instant, StreamId)> = schedules
        .iter()
        .filter_map(|(id, s)| s.ended.map(|at| (at, id.clone())))
        .collect();
    if ended.len() > MAX_LINGERING {
        ended.sort();
        for (_, id) in &ended[..ended.len() - MAX_LINGERING] {
            schedules.remove(id);
        }
    }
}

impl ScheduleHandle {
    /// The stream has received (pinned) its next shard.
    pub fn advance(&self) {
        let mut schedules = self.plans.schedules.lock().unwrap();
        if let Some(s) = schedules.get_mut(&self.id)
            && s.generation == self.generation
        {
            s.cursor += 1;
        }
        drop(schedules);
        self.plans.changed.notify_one();
    }
}

impl Drop for ScheduleHandle {
    fn drop(&mut self) {
        let mut schedules = self.plans.schedules.lock().unwrap();
        if let Some(s) = schedules.get_mut(&self.id)
            && s.generation == self.generation
        {
            s.ended = Some(Instant::now());
        }
    }
}

/// Runs the prefetcher until `shutdown`.
pub async fn run(
    plans: Arc<Plans>,
    cache: Cache,
    per_stream: usize,
    max_in_flight: usize,
    shutdown: CancellationToken,
) {
    let events = cache.events();
    let mut in_flight = FuturesUnordered::new();
    let mut loading: HashSet<String> = HashSet::new();
    // Shards that found no room, and the cache's release count then: retried only after
    // something was released, so a full cache costs no HEAD per wake-up.
    let mut no_room: HashMap<String, u64> = HashMap::new();
    // Shards whose load failed: not prefetched again for a while (the stream that needs one
    // loads it itself, and reports the error).
    let mut failed: HashMap<String, Instant> = HashMap::new();
    // Shards just loaded or checked: not asked about again for a moment, even when
    // `cache.revalidate` is shorter (each check is a HEAD).
    let mut recent: HashMap<String, Instant> = HashMap::new();
    loop {
        let releases = cache.releases();
        no_room.retain(|_, at| *at == releases);
        failed.retain(|_, at| at.elapsed() < FAILED_BACKOFF);
        recent.retain(|_, at| at.elapsed() < RECHECK_AFTER);
        for (shard, distance) in plans.wanted(per_stream) {
            if in_flight.len() >= max_in_flight {
                break;
            }
            let url = shard.as_str().to_string();
            if loading.contains(&url)
                || no_room.contains_key(&url)
                || failed.contains_key(&url)
                || recent.contains_key(&url)
                || cache.is_ready(&shard)
            {
                continue;
            }
            loading.insert(url.clone());
            let cache = cache.clone();
            in_flight.push(async move {
                let r = cache.ensure(&shard, Purpose::Prefetch { distance }).await;
                (url, r, releases)
            });
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = events.notified() => {}
            _ = plans.changed.notified() => {}
            Some((url, result, releases)) = in_flight.next(), if !in_flight.is_empty() => {
                loading.remove(&url);
                match result {
                    Ok(_) => {
                        recent.insert(url, Instant::now());
                    }
                    Err(e) if matches!(e.root(), FetchError::NoRoom { .. }) => {
                        no_room.insert(url, releases);
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "prefetch failed");
                        failed.insert(url, Instant::now());
                    }
                }
            }
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}

/// Fills the cache with `shards` in order, `parallel` at a time, using free space only.
/// Calls `progress` after each shard with its outcome. Stops starting new loads once one
/// found no room. Returns whether every shard is in the cache.
pub async fn warm(
    cache: &Cache,
    shards: &[ShardUrl],
    parallel: usize,
    mut progress: impl FnMut(&Result<Ensured, FetchError>),
) -> bool {
    let mut next = shards.iter();
    let mut in_flight = FuturesUnordered::new();
    let (mut full, mut all) = (false, true);
    loop {
        while !full && in_flight.len() < parallel {
            let Some(shard) = next.next() else { break };
            in_flight.push(cache.ensure(shard, Purpose::Warm));
        }
        let Some(result) = in_flight.next().await else {
            break;
        };
        if let Err(e) = &result {
            all = false;
            full |= matches!(e.root(), FetchError::NoRoom { .. });
        }
        progress(&result);
    }
    all && next.next().is_none()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn urls(names: &[&str]) -> Vec<ShardUrl> {
        names
            .iter()
            .map(|n| ShardUrl::parse(&format!("gs://b/{n}"), std::path::Path::new("/")).unwrap())
            .collect()
    }

    fn id(rank: u32) -> StreamId {
        StreamId {
            dataset: "d".into(),
            seed: 0,
            rank,
            world_size: 2,
            worker: 0,
            num_workers: 1,
        }
    }

    #[test]
    fn wanted_interleaves_streams_and_follows_cursors() {
        let plans = Arc::new(Plans::default());
        let a = plans.open(id(0), urls(&["a0", "a1", "a2"]));
        let _b = plans.open(id(1), urls(&["b0", "b1"]));
        let names = |w: Vec<(ShardUrl, u64)>| {
            w.into_iter()
                .map(|(u, d)| format!("{}@{d}", &u.as_str()[7..]))
                .collect::<Vec<_>>()
        };
        assert_eq!(names(plans.wanted(2)), ["a0@0", "b0@0", "a1@1", "b1@1"]);
        a.advance();
        a.advance();
        assert_eq!(names(plans.wanted(2)), ["a2@0", "b0@0", "b1@1"]);
        let next = plans.next_uses();
        assert_eq!(next.get("gs://b/a2"), Some(&0));
        assert_eq!(next.get("gs://b/b1"), Some(&1));
        assert_eq!(next.get("gs://b/a0"), None);
        // An ended stream's schedule lingers; the next epoch's stream replaces it.
        drop(a);
        assert_eq!(names(plans.wanted(1)), ["a2@0", "b0@0"]);
        let _a2 = plans.open(id(0), urls(&["x0"]));
        assert_eq!(names(plans.wanted(1)), ["x0@0", "b0@0"]);
    }
}
