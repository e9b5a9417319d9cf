//! Which entries to evict: the one whose next use is farthest away (Belady's rule), with the
//! plans of the open streams as the oracle. The plans know the future exactly, for this
//! epoch and the next, so the cache does not have to guess from the past as LRU does.
//!
//! An entry no open stream will read again before the others comes first; among those, the
//! least recently used. A prefetch may only evict entries needed later than the shard it
//! brings in, so prefetching never pushes out what is needed sooner.

/// What the cache knows about the future: for each of `shards` (URLs), how soon the open
/// streams will read it (in shards, counted per stream from its current position; smaller
/// is sooner), or `None` if no open stream will. The cache asks only about the entries it
/// could evict, only when it must evict, and under its state lock: an implementation must
/// be cheap and must never call into the cache.
pub trait Foresight: Send + Sync {
    fn next_uses(&self, shards: &[&str]) -> Vec<Option<u64>>;
}

/// No knowledge of the future (`shardd warm`, tests): every entry is "not needed".
pub struct NoForesight;

impl Foresight for NoForesight {
    fn next_uses(&self, shards: &[&str]) -> Vec<Option<u64>> {
        vec![None; shards.len()]
    }
}

/// An entry that could be evicted (no stream is reading it).
#[derive(Debug, Clone, Copy)]
pub struct Candidate {
    pub bytes: u64,
    /// Distance to its next use; `None` when no open stream will read it.
    pub next_use: Option<u64>,
    /// When it was last read (larger is more recent).
    pub last_used: u64,
}

/// Picks entries to free at least `needed` bytes, farthest next use first, evicting only
/// entries needed later than `sooner_than` (when given). Returns their indices, or `None`
/// when not enough can be freed (then nothing should be evicted).
pub fn choose(
    candidates: &[Candidate],
    needed: u64,
    sooner_than: Option<u64>,
) -> Option<Vec<usize>> {
    let rank = |c: &Candidate| {
        (
            std::cmp::Reverse(c.next_use.unwrap_or(u64::MAX)),
            c.last_used,
        )
    };
    let mut order: Vec<usize> = (0..candidates.len())
        .filter(|&i| match sooner_than {
            Some(d) => candidates[i].next_use.is_none_or(|n| n > d),
            None => true,
        })
        .collect();
    order.sort_by_key(|&i| rank(&candidates[i]));
    let mut freed = 0;
    let mut chosen = Vec::new();
    for i in order {
        if freed >= needed {
            break;
        }
        freed += candidates[i].bytes;
        chosen.push(i);
    }
    (freed >= needed).then_some(chosen)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::config::Topology;
    use crate::plan::{Shape, StreamRequest, plan_stream};

    #[test]
    fn farthest_next_use_goes_first_and_prefetch_spares_sooner_entries() {
        let c = |bytes, next_use, last_used| Candidate {
            bytes,
            next_use,
            last_used,
        };
        let cands = [
            c(10, Some(1), 5),
            c(10, None, 9),
            c(10, Some(7), 1),
            c(10, None, 2),
        ];
        assert_eq!(choose(&cands, 15, None), Some(vec![3, 1]));
        assert_eq!(choose(&cands, 35, None), Some(vec![3, 1, 2, 0]));
        assert_eq!(choose(&cands, 41, None), None);
        // A prefetch of a shard needed at distance 5 may not evict the one needed at 1.
        assert_eq!(choose(&cands, 30, Some(5)), Some(vec![3, 1, 2]));
        assert_eq!(choose(&cands, 31, Some(5)), None);
    }

    /// Replays `epochs` epochs of one host's schedule (every stream of the host reading its
    /// plan, round-robin, one shard at a time) through a cache of `capacity` shards, and
    /// returns how many shards had to be fetched again after their first fetch.
    fn refetched(belady: bool, shards: usize, capacity: usize, epochs: u64) -> u64 {
        let host = Topology { index: 0, count: 2 };
        let (world, workers) = (8u32, 2u32);
        let plans = |epoch: u64| -> Vec<Vec<usize>> {
            (0..world / 2)
                .flat_map(|rank| {
                    (0..workers).map(move |worker| {
                        let req = StreamRequest {
                            seed: 3,
                            epoch,
                            rank,
                            world_size: world,
                            worker,
                            num_workers: workers,
                        };
                        plan_stream(Shape::shards(shards), host, &req)
                            .unwrap()
                            .shards()
                            .collect()
                    })
                })
                .collect()
        };
        // The global reading order of the host: streams interleaved one shard at a time.
        let mut order: Vec<usize> = Vec::new();
        for epoch in 0..epochs {
            let p = plans(epoch);
            let longest = p.iter().map(Vec::len).max().unwrap_or(0);
            for k in 0..longest {
                order.extend(p.iter().filter_map(|s| s.get(k)));
            }
        }
        let mut cache: HashMap<usize, u64> = HashMap::new(); // shard -> last used
        let (mut fetches, mut seen) = (0u64, std::collections::HashSet::new());
        for (t, &shard) in order.iter().enumerate() {
            if let Some(used) = cache.get_mut(&shard) {
                *used = t as u64;
                continue;
            }
            if !seen.insert(shard) {
                fetches += 1;
            }
            if cache.len() == capacity {
                let keys: Vec<usize> = cache.keys().copied().collect();
                let cands: Vec<Candidate> = keys
                    .iter()
                    .map(|k| Candidate {
                        bytes: 1,
                        next_use: if belady {
                            order[t + 1..].iter().position(|s| s == k).map(|d| d as u64)
                        } else {
                            None
                        },
                        last_used: cache[k],
                    })
                    .collect();
                let victim = choose(&cands, 1, None).unwrap()[0];
                cache.remove(&keys[victim]);
            }
            cache.insert(shard, t as u64);
        }
        fetches
    }

    /// The simulator the cache issue asks for: several epochs of a host's schedule through
    /// a cache holding half of the host's share. LRU re-fetches everything every epoch (a
    /// cyclic scan is its worst case); farthest-next-use keeps about half.
    #[test]
    fn belady_refetches_less_than_lru() {
        let (shards, epochs) = (256, 4);
        let share = shards / 2;
        let belady = refetched(true, shards, share / 2, epochs);
        let lru = refetched(false, shards, share / 2, epochs);
        println!(
            "{epochs} epochs, host share {share} shards, cache {} shards: re-fetched {belady} shards with farthest-next-use, {lru} with LRU",
            share / 2
        );
        assert!(belady < lru, "belady {belady} vs lru {lru}");
        assert!(
            belady * 3 <= lru * 2,
            "belady {belady} vs lru {lru}: expected a clear margin"
        );
    }
}
