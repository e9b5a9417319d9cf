use super::*;
use crate::plan::shuffle::SplitMix64;
use crate::plan::{StreamRequest, plan_stream};
use std::collections::HashMap;

/// Samples of a plan, named (shard, index).
fn samples(pieces: &[Piece]) -> Vec<(usize, u64)> {
    pieces
        .iter()
        .flat_map(|p| (p.start..p.end.unwrap()).map(move |i| (p.shard, i)))
        .collect()
}

/// One epoch of every stream of a job of `hosts` × `ranks` × `workers` with `hops` before it.
fn epoch(
    counts: &[u64],
    e: u64,
    hops: &[Hop],
    (hosts, ranks, workers): (u32, u32, u32),
    seed: u64,
    epoch: u64,
) -> Vec<(usize, u64)> {
    let shape = Shape {
        counts: Some(counts),
        samples_per_epoch: Some(e),
        share_seed: 5,
        passes: Passes { hops, mix: None },
        ..Shape::shards(counts.len())
    };
    let mut out = Vec::new();
    for h in 0..hosts {
        for r in 0..ranks {
            for w in 0..workers {
                let req = StreamRequest {
                    seed,
                    epoch,
                    rank: h * ranks + r,
                    world_size: hosts * ranks,
                    worker: w,
                    num_workers: workers,
                };
                let host = Topology {
                    index: h,
                    count: hosts,
                };
                let pieces = plan_stream(shape, host, &req).unwrap().pieces;
                // No piece is empty: a host would fetch its shard for nothing.
                assert!(
                    pieces.iter().all(|p| p.end.unwrap() > p.start),
                    "{pieces:?}"
                );
                out.extend(samples(&pieces));
            }
        }
    }
    out
}

/// A job run through a chain of topologies, epoch by epoch, each resize at an epoch
/// boundary (`resizes`: (topology, epochs at it)). Returns the largest spread of read counts
/// over the samples at any epoch boundary.
fn run(
    counts: &[u64],
    e: u64,
    seed: u64,
    resizes: &[((u32, u32, u32), u64)],
    with_history: bool,
) -> u64 {
    let mut read: HashMap<(usize, u64), u64> = HashMap::new();
    let all: Vec<(usize, u64)> = (0..counts.len())
        .flat_map(|s| (0..counts[s]).map(move |i| (s, i)))
        .collect();
    let mut hops: Vec<Hop> = Vec::new();
    let mut worst = 0;
    let mut at = 0;
    for &(topo, epochs) in resizes {
        for ep in at..at + epochs {
            let history = if with_history { &hops[..] } else { &[][..] };
            for x in epoch(counts, e, history, topo, seed, ep) {
                *read.entry(x).or_default() += 1;
            }
            let n: Vec<u64> = all
                .iter()
                .map(|x| read.get(x).copied().unwrap_or(0))
                .collect();
            worst = worst.max(n.iter().max().unwrap() - n.iter().min().unwrap());
        }
        at += epochs;
        let (hosts, ranks, workers) = topo;
        hops.push(Hop {
            hosts,
            world_size: hosts * ranks,
            num_workers: workers,
            last_epoch: at - 1,
        });
    }
    worst
}

#[test]
fn passes_go_on_across_resizes_at_epoch_boundaries() {
    // Shares equal on every topology (120 samples, hosts dividing it, streams too) and 7 per
    // stream: every sample is read once per pass, whatever the chain, so at every epoch
    // boundary reads differ by at most one. Without the history, some differ by two.
    let mut rng = SplitMix64::new(31);
    let mut broken = 0;
    for case in 0..60 {
        let mut counts = vec![0u64; 8];
        for _ in 0..120 {
            counts[rng.below(8) as usize] += 1;
        }
        let topo = |rng: &mut SplitMix64| {
            let hosts = [1, 2, 3, 4][rng.below(4) as usize];
            (hosts, 1 + rng.below(2) as u32, 1 + rng.below(2) as u32)
        };
        let chain: Vec<((u32, u32, u32), u64)> = (0..2 + rng.below(3))
            .map(|_| (topo(&mut rng), 1 + rng.below(4)))
            .collect();
        let e = 1 + rng.below(9);
        let seed = rng.next_u64();
        assert!(
            run(&counts, e, seed, &chain, true) <= 1,
            "case {case}: {chain:?} e {e}"
        );
        broken += u64::from(run(&counts, e, seed, &chain, false) > 1);
    }
    assert!(broken > 0, "the test cannot tell a history from none");
}

#[test]
fn a_history_is_checked() {
    let hop = |hosts, world_size, last_epoch| Hop {
        hosts,
        world_size,
        num_workers: 1,
        last_epoch,
    };
    let err = |hops: &[Hop], epoch| check(hops, epoch).unwrap_err().to_string();
    assert!(check(&[hop(2, 4, 1), hop(1, 1, 3)], 4).is_ok());
    assert!(err(&[hop(2, 4, 3)], 3).contains("not before the requested epoch 3"));
    assert!(
        err(&[hop(2, 4, 3), hop(2, 4, 3)], 9).contains("hop 1: last_epoch 3 does not come after")
    );
    assert!(err(&[hop(3, 4, 0)], 9).contains("world_size 4 is not divisible by its hosts 3"));
    assert!(err(&[hop(0, 4, 0)], 9).contains("must be at least 1"));
    assert!(err(&[hop(1, 0, 0)], 9).contains("must be at least 1"));
    let no_workers = Hop {
        num_workers: 0,
        ..hop(1, 1, 0)
    };
    assert!(err(&[no_workers], 9).contains("must be at least 1"));
    assert!(err(&[hop(1 << 19, 1 << 19, 0)], 9).contains("more than 262144"));
    let long: Vec<Hop> = (0..17).map(|i| hop(1, 1, i)).collect();
    assert!(err(&long, 99).contains("17 hops, more than 16"));
    // The bounds themselves are allowed.
    assert!(check(&long[..16], 99).is_ok());
    assert!(check(&[hop(1 << 18, 1 << 18, 0)], 9).is_ok());
}

#[test]
fn the_history_after_an_elastic_epoch_adds_the_topology_that_planned_it() {
    // A resume of a resume: the epoch was planned at the oldest topology of the chain, and
    // the epochs after it count from the one after it.
    let origin = crate::plan::elastic::Origin {
        hosts: 2,
        world_size: 4,
        num_workers: 2,
        positions: vec![3, 3],
        from: Some(Box::new(crate::plan::elastic::Origin {
            hosts: 4,
            world_size: 8,
            num_workers: 1,
            positions: vec![5],
            from: None,
        })),
    };
    let earlier = Hop {
        hosts: 1,
        world_size: 2,
        num_workers: 3,
        last_epoch: 1,
    };
    let next = after(&[earlier], &origin, 6);
    assert_eq!(
        next,
        [
            earlier,
            Hop {
                hosts: 4,
                world_size: 8,
                num_workers: 1,
                last_epoch: 6,
            }
        ]
    );
    assert!(check(&next, 7).is_ok());
    assert_eq!(
        Passes {
            hops: &next,
            mix: None
        }
        .first_epoch(),
        7
    );
}

#[test]
fn passes_go_on_when_a_host_stands_at_a_pass_boundary_and_another_is_past_it() {
    // Heads differ by one sample, so one host of a topology may stand exactly at the end of
    // its head (or a pass) while another has read the first sample of its next pass: the
    // first host's next pass is then part of what the next topology must finish. Found in
    // review: 6 samples, one per epoch; 1 host for epochs 0-2, 2 hosts for 3-4, then 1.
    let counts = [2, 2, 2];
    let chain = [((1, 1, 1), 3), ((2, 1, 1), 2), ((1, 1, 1), 5)];
    assert!(run(&counts, 1, 0, &chain, true) <= 1);
    // And small datasets where such boundaries are common: 12 samples, hosts dividing them.
    let mut rng = SplitMix64::new(32);
    for case in 0..400 {
        let counts = [3u64, 3, 3, 3];
        let chain: Vec<((u32, u32, u32), u64)> = (0..2 + rng.below(4))
            .map(|_| {
                let hosts = [1, 2, 3, 4, 6][rng.below(5) as usize];
                ((hosts, 1, 1 + rng.below(2) as u32), 1 + rng.below(4))
            })
            .collect();
        let e = 1 + rng.below(3);
        let seed = rng.next_u64();
        assert!(
            run(&counts, e, seed, &chain, true) <= 1,
            "case {case}: {chain:?} e {e} seed {seed}"
        );
    }
}

/// The deal is a rule, and its result an order (heads are read first after a resize): each
/// new host first keeps what of the rests lies in its own share, up to its due; what is left
/// fills the hosts still short, in index order. A rest that crosses a share boundary is cut
/// there. 40 samples, 4 new hosts (shares of 10), rests 8..18 and 20..30: 5 due each.
#[test]
fn the_deal_keeps_what_lies_in_each_hosts_own_share_first() {
    let span = |a: u64, b: u64| Span {
        piece: Piece {
            shard: 0,
            start: a,
            end: Some(b),
        },
        at: a as u128,
    };
    let heads = deal(vec![vec![span(8, 18)], vec![span(20, 30)]], 4, 40);
    let got: Vec<Vec<(u128, u128)>> = heads
        .iter()
        .map(|h| h.iter().map(|s| (s.at, s.at + s.len())).collect())
        .collect();
    assert_eq!(
        got,
        vec![
            vec![(8, 10), (15, 18)], // its own 8..10, then host 1's surplus
            vec![(10, 15)],          // the first 5 of its own 10..18
            vec![(20, 25)],
            vec![(25, 30)], // host 2's surplus: nothing of the rests is in its share
        ]
    );
}

/// A dataset's cache of heads (shared by its streams) changes no plan, holds at most
/// `HEADS_KEPT` of them, and recomputes one it let go.
#[test]
fn cached_heads_plan_as_uncached_ones_and_stay_bounded() {
    let counts: Vec<u64> = (0..13).map(|i| 3 + i % 4).collect();
    let cache = crate::config::ShareCache::default();
    let hops = [Hop {
        hosts: 2,
        world_size: 4,
        num_workers: 1,
        last_epoch: 0,
    }];
    let shape = Shape {
        counts: Some(&counts),
        samples_per_epoch: Some(5),
        share_seed: 5,
        passes: Passes {
            hops: &hops,
            mix: None,
        },
        ..Shape::shards(counts.len())
    };
    let cached = Shape {
        share: Some(&cache),
        ..shape
    };
    // Six seeds (six heads), then the first two again, after they were let go.
    for seed in [1, 2, 3, 4, 5, 6, 1, 2] {
        for (index, rank) in [(0, 0), (2, 5)] {
            let req = StreamRequest {
                seed,
                epoch: 1,
                rank,
                world_size: 6,
                worker: 0,
                num_workers: 1,
            };
            let host = Topology { index, count: 3 };
            let want = plan_stream(shape, host, &req).unwrap();
            assert_eq!(
                plan_stream(cached, host, &req).unwrap(),
                want,
                "seed {seed}"
            );
            let kept = cache.heads.lock().unwrap().len();
            assert!((1..=HEADS_KEPT).contains(&kept), "{kept} heads kept");
        }
    }
}
