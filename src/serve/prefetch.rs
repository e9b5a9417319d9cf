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
//! smallest distance ahead of any stream's cursor. What that costs, under the one mutex that
//! every stream's `advance` takes too: an index (shard → the schedules that read it, and
//! where) is built when a schedule opens and taken down when it goes, O(its length) each;
//! `advance` is O(1); asking for the next uses of n shards (the cache asks only about its
//! eviction candidates, and only when it must evict) is O(n · r · log p), r schedules reading
//! a shard (usually one or two) and p its reads in one schedule (one per epoch). Nothing
//! walks every schedule.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::cache::evict::Foresight;
use crate::cache::{Cache, Ensured, FetchError, Purpose};
use crate::config::url::ShardUrl;

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
    id: StreamId,
    shards: Vec<ShardUrl>,
    /// Shards the stream has received so far (the one it is loading is still ahead).
    cursor: usize,
    /// `None` while its stream is open.
    ended: Option<Instant>,
}

/// The schedules of the open (and recently ended) streams.
#[derive(Default)]
pub struct Plans {
    schedules: Mutex<Schedules>,
    next_generation: std::sync::atomic::AtomicU64,
    changed: Notify,
}

/// Schedules by generation (a new one for every [`Plans::open`], so a replaced schedule's
/// handle cannot move its successor), with the index the next uses are read from.
#[derive(Default)]
struct Schedules {
    by_generation: HashMap<u64, Schedule>,
    /// The current schedule of each stream.
    current: HashMap<StreamId, u64>,
    /// For each shard URL, the schedules that read it: (generation, its positions there,
    /// ascending).
    readers: HashMap<String, Vec<(u64, Vec<usize>)>>,
}

/// A stream's hold on its schedule: moves its cursor, and lets it linger when dropped.
pub struct ScheduleHandle {
    plans: Arc<Plans>,
    generation: u64,
}

impl Plans {
    /// Registers a stream about to read `shards` (this epoch, then the next).
    pub fn open(self: &Arc<Self>, id: StreamId, shards: Vec<ShardUrl>) -> ScheduleHandle {
        let generation = self
            .next_generation
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut schedules = self.schedules.lock().unwrap();
        schedules.insert(generation, id, shards);
        drop(schedules);
        self.changed.notify_one();
        ScheduleHandle {
            plans: self.clone(),
            generation,
        }
    }

    /// The next `per_stream` shards of every schedule, k-th of each before the (k+1)-th,
    /// with their distance k. Expired schedules are dropped on the way.
    pub fn wanted(&self, per_stream: usize) -> Vec<(ShardUrl, u64)> {
        let mut schedules = self.schedules.lock().unwrap();
        schedules.expire();
        let mut open: Vec<&Schedule> = schedules.by_generation.values().collect();
        open.sort_by(|a, b| a.id.cmp(&b.id));
        let mut out = Vec::new();
        for k in 0..per_stream {
            for s in &open {
                if let Some(shard) = s.shards.get(s.cursor + k) {
                    out.push((shard.clone(), k as u64));
                }
            }
        }
        out
    }
}

impl Foresight for Plans {
    fn next_uses(&self, shards: &[&str]) -> Vec<Option<u64>> {
        let schedules = self.schedules.lock().unwrap();
        shards.iter().map(|s| schedules.next_use(s)).collect()
    }
}

impl Schedules {
    /// Adds a schedule (replacing the stream's earlier one) and indexes its shards.
    fn insert(&mut self, generation: u64, id: StreamId, shards: Vec<ShardUrl>) {
        if let Some(old) = self.current.insert(id.clone(), generation) {
            self.remove(old);
        }
        let mut positions: HashMap<&str, Vec<usize>> = HashMap::new();
        for (at, shard) in shards.iter().enumerate() {
            positions.entry(shard.as_str()).or_default().push(at);
        }
        for (shard, at) in positions {
            let readers = self.readers.entry(shard.to_string()).or_default();
            readers.push((generation, at));
        }
        let schedule = Schedule {
            id,
            shards,
            cursor: 0,
            ended: None,
        };
        self.by_generation.insert(generation, schedule);
    }

    /// Takes a schedule and its index entries out.
    fn remove(&mut self, generation: u64) {
        let Some(s) = self.by_generation.remove(&generation) else {
            return;
        };
        if self.current.get(&s.id) == Some(&generation) {
            self.current.remove(&s.id);
        }
        for shard in &s.shards {
            if let Some(readers) = self.readers.get_mut(shard.as_str()) {
                readers.retain(|(g, _)| *g != generation);
                if readers.is_empty() {
                    self.readers.remove(shard.as_str());
                }
            }
        }
    }

    /// A shard's smallest distance ahead of any schedule's cursor.
    fn next_use(&self, shard: &str) -> Option<u64> {
        let readers = self.readers.get(shard)?;
        readers
            .iter()
            .filter_map(|(generation, at)| {
                let cursor = self.by_generation[generation].cursor;
                let next = at.get(at.partition_point(|&p| p < cursor))?;
                Some((next - cursor) as u64)
            })
            .min()
    }

    /// Drops the schedules of streams that ended more than [`LINGER`] ago, and the oldest
    /// ended ones beyond [`MAX_LINGERING`].
    fn expire(&mut self) {
        let mut ended: Vec<(Instant, u64)> = self
            .by_generation
            .iter()
            .filter_map(|(g, s)| s.ended.map(|at| (at, *g)))
            .collect();
        ended.sort();
        let old = ended.partition_point(|(at, _)| at.elapsed() >= LINGER);
        let over = ended.len().saturating_sub(MAX_LINGERING);
        for (_, generation) in &ended[..old.max(over)] {
            self.remove(*generation);
        }
    }
}

impl ScheduleHandle {
    /// The stream has received (pinned) its next shard.
    pub fn advance(&self) {
        let mut schedules = self.plans.schedules.lock().unwrap();
        if let Some(s) = schedules.by_generation.get_mut(&self.generation) {
            s.cursor += 1;
        }
        drop(schedules);
        self.plans.changed.notify_one();
    }
}

impl Drop for ScheduleHandle {
    fn drop(&mut self) {
        let mut schedules = self.plans.schedules.lock().unwrap();
        if let Some(s) = schedules.by_generation.get_mut(&self.generation) {
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
        let next = plans.next_uses(&["gs://b/a2", "gs://b/b1", "gs://b/a0"]);
        assert_eq!(next, [Some(0), Some(1), None]);
        // An ended stream's schedule lingers; the next epoch's stream replaces it.
        drop(a);
        assert_eq!(names(plans.wanted(1)), ["a2@0", "b0@0"]);
        let _a2 = plans.open(id(0), urls(&["x0"]));
        assert_eq!(names(plans.wanted(1)), ["x0@0", "b0@0"]);
    }

    /// The next uses as the walk over every schedule found them before the index (the
    /// index must change what is evicted in no case).
    fn walk(plans: &Plans, shards: &[&str]) -> Vec<Option<u64>> {
        let schedules = plans.schedules.lock().unwrap();
        let mut next: HashMap<String, u64> = HashMap::new();
        for s in schedules.by_generation.values() {
            for (k, shard) in s.shards.iter().skip(s.cursor).enumerate() {
                let d = next.entry(shard.as_str().to_string()).or_insert(k as u64);
                *d = (*d).min(k as u64);
            }
        }
        shards.iter().map(|s| next.get(*s).copied()).collect()
    }

    #[test]
    fn next_uses_match_a_walk_over_every_schedule() {
        let plans = Arc::new(Plans::default());
        let names: Vec<String> = (0..12).map(|i| format!("s{i}")).collect();
        let pool = urls(&names.iter().map(String::as_str).collect::<Vec<_>>());
        let asked: Vec<&str> = pool.iter().map(ShardUrl::as_str).collect();
        let mut rng = crate::plan::shuffle::SplitMix64::new(7);
        let mut handles: Vec<Option<ScheduleHandle>> = (0..6).map(|_| None).collect();
        let (mut opened, mut found) = (0, 0);
        for _ in 0..3000 {
            let stream = rng.below(6) as usize;
            match rng.below(10) {
                // A stream opens (replacing the same stream's schedule, as the next epoch's does).
                0 | 1 => {
                    let len = rng.below(25);
                    let shards = (0..len).map(|_| pool[rng.below(12) as usize].clone());
                    handles[stream] = Some(plans.open(id(stream as u32), shards.collect()));
                    opened += 1;
                }
                // It ends: its schedule lingers.
                2 => handles[stream] = None,
                _ => {
                    if let Some(h) = &handles[stream] {
                        h.advance();
                    }
                }
            }
            let next = plans.next_uses(&asked);
            assert_eq!(next, walk(&plans, &asked));
            found += next.iter().flatten().count();
        }
        assert!(
            opened > 500 && found > 10_000,
            "{opened} opened, {found} next uses"
        );
        // Replaced schedules left nothing behind in the index.
        let schedules = plans.schedules.lock().unwrap();
        let indexed: usize = schedules.readers.values().map(Vec::len).sum();
        let distinct: usize = schedules
            .by_generation
            .values()
            .map(|s| s.shards.iter().collect::<HashSet<_>>().len())
            .sum();
        assert_eq!(indexed, distinct);
    }
}
