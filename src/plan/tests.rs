use super::*;
use std::collections::{BTreeSet, HashMap, HashSet};

fn req(
    seed: u64,
    epoch: u64,
    rank: u32,
    world_size: u32,
    worker: u32,
    num_workers: u32,
) -> StreamRequest {
    StreamRequest {
        seed,
        epoch,
        rank,
        world_size,
        worker,
        num_workers,
    }
}

/// Every stream of every rank on every host, in (host, rank, worker) order.
fn whole_epoch(
    shape: Shape,
    hosts: u32,
    per_host: u32,
    workers: u32,
    seed: u64,
    epoch: u64,
) -> Vec<StreamPlan> {
    let world = hosts * per_host;
    let mut streams = Vec::new();
    for h in 0..hosts {
        let topo = Topology {
            index: h,
            count: hosts,
        };
        for rank in h * per_host..(h + 1) * per_host {
            for w in 0..workers {
                let r = req(seed, epoch, rank, world, w, workers);
                streams.push(plan_stream(shape, topo, &r).unwrap());
            }
        }
    }
    streams
}

fn shard_lists(streams: &[StreamPlan]) -> Vec<Vec<usize>> {
    streams.iter().map(|s| s.shards().collect()).collect()
}

#[test]
fn every_shard_exactly_once_per_epoch() {
    for num_shards in [0, 1, 5, 16, 33, 128] {
        for hosts in 1..=4 {
            for per_host in 1..=4 {
                for workers in 1..=3 {
                    for epoch in 0..3 {
                        let streams = whole_epoch(
                            Shape::shards(num_shards),
                            hosts,
                            per_host,
                            workers,
                            7,
                            epoch,
                        );
                        let mut all: Vec<usize> = shard_lists(&streams).concat();
                        all.sort();
                        assert_eq!(
                            all,
                            (0..num_shards).collect::<Vec<_>>(),
                            "shards={num_shards} hosts={hosts} per_host={per_host} workers={workers} epoch={epoch}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn extra_shards_rotate_between_hosts_and_ranks() {
    // 10 shards, 3 hosts of 2 ranks: 1 leftover shard, and uneven ranks within a host.
    let mut host_counts: HashSet<Vec<usize>> = HashSet::new();
    let mut rank_counts: HashSet<Vec<usize>> = HashSet::new();
    for epoch in 0..6 {
        let streams = shard_lists(&whole_epoch(Shape::shards(10), 3, 2, 1, 1, epoch));
        let lens: Vec<usize> = streams.iter().map(Vec::len).collect();
        assert!(
            lens.iter().max().unwrap() - lens.iter().min().unwrap() <= 1,
            "{lens:?}"
        );
        host_counts.insert(lens.chunks(2).map(|c| c.iter().sum()).collect());
        rank_counts.insert(lens);
    }
    assert_eq!(host_counts.len(), 3, "the leftover shard visits every host");
    assert!(rank_counts.len() > 1, "the extra shards move between ranks");
}

#[test]
fn deterministic_and_epoch_dependent() {
    let lists = |seed, epoch| shard_lists(&whole_epoch(Shape::shards(64), 2, 2, 2, seed, epoch));
    let a = lists(11, 0);
    assert_eq!(a, lists(11, 0));
    assert_ne!(a, lists(11, 1));
    assert_ne!(a, lists(12, 0));
    let topo = Topology { index: 0, count: 1 };
    let key = |epoch| {
        plan_stream(Shape::shards(8), topo, &req(1, epoch, 0, 1, 0, 1))
            .unwrap()
            .stream_key
    };
    assert_ne!(key(0), key(1));
}

#[test]
fn host_shares_are_stable_and_do_not_depend_on_the_run_seed() {
    // 48 shards on 3 hosts: no leftovers, so a host's shards are the same in every epoch
    // of every run.
    for h in 0..3 {
        let topo = Topology { index: h, count: 3 };
        let mut share = host_shards(
            Shape {
                share_seed: 9,
                ..Shape::shards(48)
            },
            topo,
            0,
        );
        share.sort();
        for (seed, epoch) in [(0, 0), (1, 0), (5, 3), (2, 7)] {
            let mut mine: Vec<usize> = (0..2)
                .flat_map(|r| {
                    plan_stream(
                        Shape {
                            share_seed: 9,
                            ..Shape::shards(48)
                        },
                        topo,
                        &req(seed, epoch, h * 2 + r, 6, 0, 1),
                    )
                    .unwrap()
                    .shards()
                    .collect::<Vec<_>>()
                })
                .collect();
            mine.sort();
            assert_eq!(mine, share, "host {h} seed {seed} epoch {epoch}");
        }
        assert_ne!(
            host_shards(
                Shape {
                    share_seed: 10,
                    ..Shape::shards(48)
                },
                topo,
                0
            ),
            host_shards(
                Shape {
                    share_seed: 9,
                    ..Shape::shards(48)
                },
                topo,
                0
            )
        );
    }
}

/// Golden vectors: what a stream reads is a contract (a resumed job must read what it
/// would have read). A change here is a protocol-level change: say so in PROTOCOL.md.
#[test]
fn golden_shard_orders() {
    let topo = Topology { index: 1, count: 2 };
    let p = plan_stream(Shape::shards(11), topo, &req(7, 3, 2, 4, 0, 1)).unwrap();
    assert_eq!(p.shards().collect::<Vec<_>>(), GOLDEN_SHARDS);
    assert_eq!(p.stream_key, GOLDEN_KEY);
    let counts = [5, 9, 3, 12, 7, 1, 8];
    let shape = Shape {
        counts: Some(&counts),
        ..Shape::shards(counts.len())
    };
    let p = plan_stream(shape, topo, &req(7, 3, 3, 4, 1, 2)).unwrap();
    assert_eq!(p.pieces, golden_pieces());
    assert_eq!((p.samples, p.dropped), (Some(5), 3));
}
const GOLDEN_SHARDS: [usize; 3] = [2, 4, 0];
const GOLDEN_KEY: u64 = 10125191524557636659;
fn golden_pieces() -> Vec<Piece> {
    let piece = |shard, start, end| Piece {
        shard,
        start,
        end: Some(end),
    };
    vec![piece(0, 1, 5), piece(1, 0, 1)]
}

/// Resampled streams: exactly `samples_per_epoch` samples, drawn from the host's own
/// share only, deterministic, other draws every epoch and stream; pinned by a golden vector.
#[test]
fn resampled_streams_draw_from_the_host_share_with_exact_length() {
    let counts = [5, 9, 3, 12, 7, 1, 8];
    let shape = |spe| Shape {
        counts: Some(&counts),
        samples_per_epoch: Some(spe),
        resampled: true,
        ..Shape::shards(counts.len())
    };
    let topo = Topology { index: 1, count: 2 };
    let share: Vec<(usize, u64)> = {
        let (pieces, _) = host_pieces(&counts, shape(1), topo);
        pieces
            .iter()
            .flat_map(|p| (p.start..p.end.unwrap()).map(move |i| (p.shard, i)))
            .collect()
    };
    for spe in [1, 7, 100] {
        for epoch in 0..3 {
            let p = plan_stream(shape(spe), topo, &req(7, epoch, 3, 4, 1, 2)).unwrap();
            let got = samples_of(&p);
            assert_eq!((got.len() as u64, p.samples), (spe, Some(spe)));
            assert!(got.iter().all(|s| share.contains(s)), "{got:?}");
            assert_eq!(
                p,
                plan_stream(shape(spe), topo, &req(7, epoch, 3, 4, 1, 2)).unwrap()
            );
            if spe == 100 {
                let other = plan_stream(shape(spe), topo, &req(7, epoch + 1, 3, 4, 1, 2));
                assert_ne!(p.pieces, other.unwrap().pieces);
                let worker = plan_stream(shape(spe), topo, &req(7, epoch, 3, 4, 0, 2));
                assert_ne!(p.pieces, worker.unwrap().pieces);
            }
        }
    }
    let p = plan_stream(shape(20), topo, &req(7, 3, 3, 4, 1, 2)).unwrap();
    let pinned: Vec<(usize, u64, u64)> = p
        .pieces
        .iter()
        .map(|x| (x.shard, x.start, x.end.unwrap()))
        .collect();
    assert_eq!(pinned, GOLDEN_RESAMPLED);
}
const GOLDEN_RESAMPLED: [(usize, u64, u64); 3] = [(6, 0, 8), (6, 0, 8), (6, 0, 4)];

/// A dataset's share cache changes nothing but the cost: the same plans with and without.
#[test]
fn the_share_cache_gives_the_same_plans() {
    for case in 0..100 {
        let (counts, hosts, per_host, workers, seed) = random_case(case);
        let cache = ShareCache::default();
        for exact in [true, false] {
            let bare = Shape {
                counts: exact.then_some(&counts[..]),
                share_seed: case,
                ..Shape::shards(counts.len())
            };
            let cached = Shape {
                share: Some(&cache),
                ..bare
            };
            for h in 0..hosts {
                let topo = Topology {
                    index: h,
                    count: hosts,
                };
                let r = req(seed, case % 3, h * per_host, hosts * per_host, 0, workers);
                assert_eq!(plan_stream(bare, topo, &r), plan_stream(cached, topo, &r));
                assert_eq!(warm_shards(bare, topo), warm_shards(cached, topo));
            }
        }
    }
}

/// `warm` fills the cache with what the host reads: every shard it reads in any epoch is in its
/// warm list, the list names each shard once, and the hosts' lists together name every shard.
#[test]
fn warm_shards_are_what_the_host_reads_once_each() {
    for case in 0..100 {
        let (counts, hosts, per_host, workers, seed) = random_case(case);
        for exact in [true, false] {
            let shape = Shape {
                counts: exact.then_some(&counts[..]),
                share_seed: case,
                ..Shape::shards(counts.len())
            };
            let mut everyone = BTreeSet::new();
            for h in 0..hosts {
                let topo = Topology {
                    index: h,
                    count: hosts,
                };
                let warm = warm_shards(shape, topo);
                let once: BTreeSet<usize> = warm.iter().copied().collect();
                assert_eq!(
                    once.len(),
                    warm.len(),
                    "case {case}: a shard twice in {warm:?}"
                );
                everyone.extend(once.iter().copied());
                if !exact {
                    // Nothing more either: every shard warmed is read in some epoch (the
                    // leftovers rotate over the hosts).
                    let some_epoch: BTreeSet<usize> = (0..2 * hosts as u64)
                        .flat_map(|e| host_shards(shape, topo, e))
                        .collect();
                    assert_eq!(once, some_epoch, "case {case}, host {h}");
                }
                for epoch in 0..4 {
                    let read: Vec<usize> = if exact {
                        (0..per_host * workers)
                            .flat_map(|s| {
                                let r = req(
                                    seed,
                                    epoch,
                                    h * per_host + s / workers,
                                    hosts * per_host,
                                    s % workers,
                                    workers,
                                );
                                plan_stream(shape, topo, &r)
                                    .unwrap()
                                    .pieces
                                    .into_iter()
                                    .map(|p| p.shard)
                            })
                            .collect()
                    } else {
                        host_shards(shape, topo, epoch)
                    };
                    assert!(
                        read.iter().all(|s| once.contains(s)),
                        "case {case}, host {h}, epoch {epoch}: reads {read:?}, warms {warm:?}"
                    );
                }
            }
            if !exact {
                assert_eq!(
                    everyone.len(),
                    counts.len(),
                    "case {case}: a shard no host warms"
                );
            }
        }
    }
}

/// A random dataset shape and topology, from a seed.
fn random_case(case: u64) -> (Vec<u64>, u32, u32, u32, u64) {
    let mut r = SplitMix64::new(case);
    let shards = 1 + r.below(40) as usize;
    let counts: Vec<u64> = (0..shards).map(|_| r.below(60)).collect();
    let hosts = 1 + r.below(4) as u32;
    let per_host = 1 + r.below(4) as u32;
    let workers = 1 + r.below(3) as u32;
    (counts, hosts, per_host, workers, r.next_u64())
}

fn samples_of(p: &StreamPlan) -> Vec<(usize, u64)> {
    p.pieces
        .iter()
        .flat_map(|piece| (piece.start..piece.end.unwrap()).map(move |i| (piece.shard, i)))
        .collect()
}

#[test]
fn exact_epochs_are_equal_complete_and_rotate_their_drops() {
    for case in 0..300 {
        let (counts, hosts, per_host, workers, seed) = random_case(case);
        let shape = Shape {
            counts: Some(&counts),
            ..Shape::shards(counts.len())
        };
        let total: u64 = counts.iter().sum();
        let streams_per_host = (per_host * workers) as u64;
        let everything: HashSet<(usize, u64)> = counts
            .iter()
            .enumerate()
            .flat_map(|(s, &n)| (0..n).map(move |i| (s, i)))
            .collect();
        let mut dropped_sets = Vec::new();
        for epoch in 0..3 {
            let streams = whole_epoch(shape, hosts, per_host, workers, seed, epoch);
            let want = total / hosts as u64 / streams_per_host;
            let mut seen = HashSet::new();
            for s in &streams {
                let got = samples_of(s);
                assert_eq!(got.len() as u64, want, "case {case}: unequal streams");
                assert_eq!(s.samples, Some(want));
                for x in got {
                    assert!(seen.insert(x), "case {case}: {x:?} twice in epoch {epoch}");
                }
            }
            let dropped: HashSet<(usize, u64)> = everything.difference(&seen).copied().collect();
            let reported: u64 = streams
                .chunks(streams_per_host as usize)
                .map(|h| h[0].dropped)
                .sum();
            assert_eq!(
                dropped.len() as u64,
                reported,
                "case {case}: drops reported"
            );
            assert!(
                reported < hosts as u64 * (streams_per_host + 1),
                "case {case}: {reported} dropped"
            );
            dropped_sets.push(dropped);
        }
        if dropped_sets[0].len() > 1 && counts.len() > 1 {
            assert!(
                dropped_sets[0] != dropped_sets[1] || dropped_sets[1] != dropped_sets[2],
                "case {case}: the same samples are dropped every epoch"
            );
        }
    }
}

#[test]
fn a_host_reads_only_its_own_share_in_every_epoch() {
    for case in 300..400 {
        let (counts, hosts, per_host, workers, seed) = random_case(case);
        let shape = Shape {
            counts: Some(&counts),
            ..Shape::shards(counts.len())
        };
        for h in 0..hosts {
            let topo = Topology {
                index: h,
                count: hosts,
            };
            let own: HashSet<usize> = warm_shards(shape, topo).into_iter().collect();
            for epoch in 0..3 {
                let streams = whole_epoch(shape, hosts, per_host, workers, seed, epoch);
                let per = (per_host * workers) as usize;
                for s in &streams[h as usize * per..(h as usize + 1) * per] {
                    assert!(s.shards().all(|x| own.contains(&x)), "case {case}");
                }
            }
        }
    }
}

#[test]
fn samples_per_epoch_is_exact_and_wraps_into_the_next_pass() {
    let counts = [10, 7, 13];
    let shape = Shape {
        counts: Some(&counts),
        samples_per_epoch: Some(9),
        ..Shape::shards(3)
    };
    let topo = Topology { index: 0, count: 1 };
    let mut per_sample: HashMap<(usize, u64), u32> = HashMap::new();
    for epoch in 0..6 {
        for w in 0..2 {
            let p = plan_stream(shape, topo, &req(3, epoch, 0, 1, w, 2)).unwrap();
            let got = samples_of(&p);
            assert_eq!(got.len(), 9);
            for x in got {
                *per_sample.entry(x).or_default() += 1;
            }
        }
    }
    // 6 epochs x 18 samples = 108 = 3 whole passes of 30 plus 18: every sample read 3 or
    // 4 times, never more often than the passes allow.
    assert_eq!(per_sample.len(), 30);
    assert!(
        per_sample.values().all(|&n| n == 3 || n == 4),
        "{per_sample:?}"
    );
}

#[test]
fn refuses_what_this_host_cannot_serve() {
    let topo = Topology { index: 1, count: 2 };
    let err = |r: StreamRequest| {
        plan_stream(Shape::shards(10), topo, &r)
            .unwrap_err()
            .to_string()
    };
    assert_eq!(
        err(req(0, 0, 4, 4, 0, 1)),
        "rank 4 must be less than world_size 4"
    );
    assert_eq!(
        err(req(0, 0, 1, 3, 0, 1)),
        "world_size 3 is not divisible by the host count 2: every host serves as many ranks; set host.count in the daemon's config to the number of hosts the job runs on (or host.count = \"auto\")"
    );
    assert_eq!(
        err(req(0, 0, 1, 4, 0, 1)),
        "rank 1 is not on this host: host 1 of 2 serves ranks 2..=3 of world_size 4; rank 1 is host 0's: each host's daemon needs its own host.index (\"auto\" on a TPU VM)"
    );
    assert_eq!(
        err(req(0, 0, 2, 4, 2, 2)),
        "worker 2 must be less than num_workers 2"
    );
    assert_eq!(err(req(0, 0, 0, 0, 0, 1)), "world_size must be at least 1");
    // Another host of another pod: its own range of ranks.
    let third = Topology { index: 2, count: 4 };
    assert_eq!(
        plan_stream(Shape::shards(10), third, &req(0, 0, 10, 12, 0, 1))
            .unwrap_err()
            .to_string(),
        "rank 10 is not on this host: host 2 of 4 serves ranks 6..=8 of world_size 12; rank 10 is host 3's: each host's daemon needs its own host.index (\"auto\" on a TPU VM)"
    );
    assert_eq!(err(req(0, 0, 2, 4, 0, 0)), "num_workers must be at least 1");
    let empty: [u64; 1] = [0];
    let shape = Shape {
        counts: Some(&empty),
        samples_per_epoch: Some(4),
        ..Shape::shards(1)
    };
    assert_eq!(
        plan_stream(shape, topo, &req(0, 0, 2, 4, 0, 1)).unwrap_err(),
        PlanError::NoSamples
    );
    // Nothing to draw from, resampled too.
    let shape = Shape {
        resampled: true,
        ..shape
    };
    assert_eq!(
        plan_stream(shape, topo, &req(0, 0, 2, 4, 0, 1)).unwrap_err(),
        PlanError::NoSamples
    );
}

/// epoch × samples_per_epoch × streams passes u128 for absurd requests: refused, never a
/// panic (debug) or a wrapped plan (release).
#[test]
fn refuses_epochs_whose_start_overflows() {
    let counts = [3u64, 5];
    let topo = Topology { index: 0, count: 1 };
    for (e, epoch, world, workers) in [
        (u64::MAX, u64::MAX, u32::MAX, u32::MAX),
        (u64::MAX, u64::MAX, 1, 1),
        (1 << 40, 1 << 60, 1 << 20, 1 << 20),
    ] {
        let shape = Shape {
            counts: Some(&counts),
            samples_per_epoch: Some(e),
            ..Shape::shards(2)
        };
        let r = req(0, epoch, 0, world, 0, workers);
        assert_eq!(
            plan_stream(shape, topo, &r).unwrap_err(),
            PlanError::EpochTooLarge { epoch },
        );
    }
}

/// A stream's pass (START's `sources[].pass`) is how many times the host's share was read
/// through before the stream's first sample: with one stream, `⌊epoch × samples_per_epoch /
/// share⌋`.
#[test]
fn a_streams_pass_counts_the_shares_read_before_it() {
    let counts = [5, 9, 3];
    let share: u64 = counts.iter().sum();
    let topo = Topology { index: 0, count: 1 };
    for spe in [7, 17, 40] {
        let shape = Shape {
            counts: Some(&counts),
            samples_per_epoch: Some(spe),
            ..Shape::shards(counts.len())
        };
        for epoch in 0..12 {
            let plan = plan_stream(shape, topo, &req(3, epoch, 0, 1, 0, 1)).unwrap();
            assert_eq!(
                plan.pass,
                epoch * spe / share,
                "samples_per_epoch {spe}, epoch {epoch}"
            );
        }
    }
}

#[test]
fn the_extra_shard_visits_every_rank_and_worker_once_in_as_many_epochs() {
    // One host, 3·5 + 1 shards: one stream of three reads a sixth shard. Its slot rotates
    // with the epoch, so over any 3 consecutive epochs each rank (or worker) has it once.
    for (ranks, workers) in [(3, 1), (1, 3)] {
        for first in [0, 1, 4] {
            let mut extra = Vec::new();
            for epoch in first..first + 3 {
                let streams =
                    shard_lists(&whole_epoch(Shape::shards(16), 1, ranks, workers, 5, epoch));
                let lens: Vec<usize> = streams.iter().map(Vec::len).collect();
                let long: Vec<usize> = (0..lens.len()).filter(|&s| lens[s] == 6).collect();
                assert_eq!(
                    long.len(),
                    1,
                    "ranks {ranks} workers {workers} epoch {epoch}: {lens:?}"
                );
                extra.push(long[0]);
            }
            extra.sort();
            assert_eq!(
                extra,
                [0, 1, 2],
                "ranks {ranks} workers {workers}, epochs {first}.."
            );
        }
    }
}

#[test]
fn a_shard_without_samples_is_never_read_nor_warmed() {
    // A manifest may list empty shards: reading (or warming) one would fetch it for nothing.
    let counts = [4, 0, 7, 0, 0, 5, 3, 0, 6];
    for (samples_per_epoch, resampled) in [(None, false), (Some(5), false), (Some(5), true)] {
        let shape = Shape {
            counts: Some(&counts),
            samples_per_epoch,
            resampled,
            ..Shape::shards(counts.len())
        };
        for hosts in 1..=3 {
            for index in 0..hosts {
                let warm = warm_shards(
                    shape,
                    Topology {
                        index,
                        count: hosts,
                    },
                );
                assert!(
                    warm.iter().all(|&s| counts[s] > 0),
                    "hosts {hosts}: warm fetches {warm:?}"
                );
            }
            for epoch in 0..4 {
                for s in whole_epoch(shape, hosts, 2, 1, 9, epoch) {
                    assert!(
                        s.pieces
                            .iter()
                            .all(|p| p.end.is_some_and(|end| end > p.start)),
                        "{samples_per_epoch:?} resampled {resampled} hosts {hosts} epoch {epoch}: {:?}",
                        s.pieces
                    );
                }
            }
        }
    }
}

#[test]
fn an_exact_epoch_after_a_resize_is_the_new_topologys_plain_epoch() {
    // Without samples_per_epoch every epoch reads the dataset once: what the job read before
    // a resize does not move it (the history counts passes, which only a fixed
    // samples_per_epoch carries across epochs).
    let counts = [9, 4, 7, 12, 5, 8, 3, 6];
    let hops = [passes::Hop {
        hosts: 4,
        world_size: 8,
        num_workers: 2,
        last_epoch: 2,
    }];
    let plain = Shape {
        counts: Some(&counts),
        ..Shape::shards(counts.len())
    };
    let resized = Shape {
        passes: passes::Passes {
            hops: &hops,
            mix: None,
        },
        ..plain
    };
    for epoch in 3..6 {
        let a = whole_epoch(plain, 2, 2, 1, 4, epoch);
        let b = whole_epoch(resized, 2, 2, 1, 4, epoch);
        assert_eq!(
            a.iter()
                .map(|s| (&s.pieces, s.samples, s.dropped, s.pass))
                .collect::<Vec<_>>(),
            b.iter()
                .map(|s| (&s.pieces, s.samples, s.dropped, s.pass))
                .collect::<Vec<_>>(),
            "epoch {epoch}"
        );
    }
}
