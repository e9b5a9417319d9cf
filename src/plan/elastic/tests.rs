use super::*;
use crate::plan::mix::schedule::mix_of;
use crate::plan::shuffle::SplitMix64;
use std::collections::HashMap;

/// A plan's samples in output order, named (shard, index), shuffled as the stream does.
fn shuffled(p: &plan::StreamPlan, window: usize) -> Vec<(usize, u64)> {
    let mut flat: Vec<(usize, u64)> = p
        .pieces
        .iter()
        .flat_map(|x| (x.start..x.end.unwrap()).map(move |i| (x.shard, i)))
        .collect();
    let mut shuffle = crate::plan::shuffle::WindowShuffle::new(p.stream_key, window);
    let mut out = Vec::new();
    while !flat.is_empty() {
        let n = shuffle.next_len().min(flat.len());
        let mut w: Vec<_> = flat.drain(..n).collect();
        shuffle.permute(&mut w);
        out.extend(w);
    }
    out
}

/// A base stream's samples in output order.
fn base_output(shape: Shape, seg: &Segment, window: usize) -> Vec<(usize, u64)> {
    shuffled(
        &plan::plan_stream(shape, seg.host, &seg.req).unwrap(),
        window,
    )
}

fn read(shape: Shape, segments: &[Segment], window: usize) -> Vec<(usize, u64)> {
    segments
        .iter()
        .flat_map(|s| base_output(shape, s, window)[s.from as usize..s.to as usize].to_vec())
        .collect()
}

#[derive(Clone, Copy)]
struct Topo {
    hosts: u32,
    ranks: u32,
    workers: u32,
}

fn random_topo(rng: &mut SplitMix64) -> Topo {
    Topo {
        hosts: 1 + rng.below(4) as u32,
        ranks: 1 + rng.below(3) as u32,
        workers: 1 + rng.below(3) as u32,
    }
}

/// Every stream of the job at `t` for `origin` (None: a normal epoch), read in full.
fn all_streams(
    shape: Shape,
    t: &Topo,
    seed: u64,
    epoch: u64,
    origin: Option<&Origin>,
    window: usize,
) -> Vec<Vec<Vec<(usize, u64)>>> {
    (0..t.hosts)
        .map(|h| {
            (0..t.ranks * t.workers)
                .map(|s| {
                    let host = Topology {
                        index: h,
                        count: t.hosts,
                    };
                    let req = StreamRequest {
                        seed,
                        epoch,
                        rank: h * t.ranks + s / t.workers,
                        world_size: t.hosts * t.ranks,
                        worker: s % t.workers,
                        num_workers: t.workers,
                    };
                    match origin {
                        None => {
                            let seg = Segment {
                                host,
                                req,
                                from: 0,
                                to: u64::MAX,
                                source: None,
                            };
                            base_output(shape, &seg, window)
                        }
                        Some(o) => {
                            read(shape, &plan(shape, host, &req, o).unwrap().segments, window)
                        }
                    }
                })
                .collect()
        })
        .collect()
}

/// Every rank gets as many samples, and worker w the same on every rank.
fn assert_equal_ranks(streams: &[Vec<Vec<(usize, u64)>>], workers: u32, case: u32) {
    let lens: Vec<usize> = streams.iter().flatten().map(Vec::len).collect();
    let k = workers as usize;
    for (s, &l) in lens.iter().enumerate() {
        assert_eq!(l, lens[s % k], "case {case}: {lens:?}");
    }
}

/// Old topology → new one (→ another), at random checkpoints: what was consumed plus what
/// the new streams read is every sample of the epoch exactly once, but the drops; equal
/// per new stream; the same topology gives exactly the `start=` resume.
#[test]
fn the_rest_of_the_epoch_is_read_exactly_once_at_any_topology() {
    let mut rng = SplitMix64::new(2026);
    for case in 0..150 {
        let shards = 1 + rng.below(14) as usize;
        let counts: Vec<u64> = (0..shards).map(|_| rng.below(40)).collect();
        let spe = (rng.below(3) == 0).then(|| 1 + rng.below(30));
        let shape = Shape {
            counts: Some(&counts),
            samples_per_epoch: spe,
            share_seed: rng.next_u64(),
            ..Shape::shards(shards)
        };
        let window = 1 + rng.below(20) as usize;
        let (seed, epoch) = (rng.next_u64(), rng.below(3));
        let t0 = random_topo(&mut rng);
        let hops = 1 + rng.below(2);
        let mut origin: Option<Origin> = None;
        let mut consumed: Vec<(usize, u64)> = Vec::new();
        let mut t = t0;
        let mut dropped_by_hops = 0;
        for _ in 0..hops {
            let streams = all_streams(shape, &t, seed, epoch, origin.as_ref(), window);
            assert_equal_ranks(&streams, t.workers, case);
            let positions: Vec<u64> = (0..t.workers as usize)
                .map(|w| rng.below(streams[0][w].len() as u64 + 1))
                .collect();
            for host in &streams {
                for (s, out) in host.iter().enumerate() {
                    consumed.extend(&out[..positions[s % t.workers as usize] as usize]);
                }
            }
            let next = Origin {
                hosts: t.hosts,
                world_size: t.hosts * t.ranks,
                num_workers: t.workers,
                positions,
                from: origin.map(Box::new),
            };
            t = random_topo(&mut rng);
            let req = StreamRequest {
                seed,
                epoch,
                rank: 0,
                world_size: t.hosts * t.ranks,
                worker: 0,
                num_workers: t.workers,
            };
            let s = split(shape, t.hosts, &req, &next).unwrap();
            assert!(
                s.dropped < (t.hosts * t.ranks * t.workers) as u64,
                "case {case}"
            );
            dropped_by_hops += s.dropped;
            origin = Some(next);
        }
        let rest = all_streams(shape, &t, seed, epoch, origin.as_ref(), window);
        assert_equal_ranks(&rest, t.workers, case);
        // Everything the original epoch reads, once each.
        let full = all_streams(shape, &t0, seed, epoch, None, window);
        let mut want: HashMap<(usize, u64), u32> = HashMap::new();
        for x in full.iter().flatten().flatten() {
            *want.entry(*x).or_default() += 1;
        }
        let mut got: HashMap<(usize, u64), u32> = HashMap::new();
        for x in consumed.iter().chain(rest.iter().flatten().flatten()) {
            *got.entry(*x).or_default() += 1;
        }
        let missing: u64 = want
            .iter()
            .map(|(k, &n)| n.saturating_sub(*got.get(k).unwrap_or(&0)) as u64)
            .sum();
        let extra: u64 = got
            .iter()
            .map(|(k, &n)| n.saturating_sub(*want.get(k).unwrap_or(&0)) as u64)
            .sum();
        assert_eq!(extra, 0, "case {case}: samples read twice");
        assert_eq!(
            missing, dropped_by_hops,
            "case {case}: lost beyond the drops"
        );
    }
}

/// Resuming at the topology of the checkpoint: each stream continues exactly as a
/// `start=` resume of its own stream would.
#[test]
fn the_same_topology_resumes_each_stream_where_it_was() {
    let counts: Vec<u64> = (0..9).map(|i| 5 + i * 3).collect();
    let shape = Shape {
        counts: Some(&counts),
        ..Shape::shards(9)
    };
    let t = Topo {
        hosts: 2,
        ranks: 2,
        workers: 2,
    };
    let full = all_streams(shape, &t, 7, 1, None, 6);
    let origin = Origin {
        hosts: 2,
        world_size: 4,
        num_workers: 2,
        positions: vec![5, 4],
        from: None,
    };
    let rest = all_streams(shape, &t, 7, 1, Some(&origin), 6);
    for h in 0..2 {
        for s in 0..4 {
            let p = origin.positions[s % 2] as usize;
            assert_eq!(rest[h][s], full[h][s][p..], "host {h} stream {s}");
        }
    }
}

#[test]
fn growth_and_shrink_keep_what_each_host_had() {
    let counts = vec![10u64; 64]; // 640: 2 or 4 hosts, 4 consumed each: no drop
    let shape = Shape {
        counts: Some(&counts),
        ..Shape::shards(64)
    };
    let origin = |hosts| Origin {
        hosts,
        world_size: hosts,
        num_workers: 1,
        positions: vec![4],
        from: None,
    };
    let req = |world_size| StreamRequest {
        seed: 1,
        epoch: 0,
        rank: 0,
        world_size,
        worker: 0,
        num_workers: 1,
    };
    // 2 → 4: new hosts 0 and 1 read only their own old host's streams.
    let s = split(shape, 4, &req(4), &origin(2)).unwrap();
    for h in 0..4usize {
        let from: Vec<u32> = s.hosts[h][0].iter().map(|g| g.host.index).collect();
        assert!(from.iter().all(|&o| o == h as u32 % 2), "{h}: {from:?}");
    }
    // 4 → 2: new host h reads old host h's, then old host h + 2's.
    let s = split(shape, 2, &req(2), &origin(4)).unwrap();
    for h in 0..2usize {
        let from: Vec<u32> = s.hosts[h][0].iter().map(|g| g.host.index).collect();
        assert_eq!(from, vec![h as u32, h as u32 + 2]);
    }
}

/// The base output of a mix source's segment (its quota as samples_per_epoch, its key
/// apart, as the server plans it).
fn source_output(shape: Shape, seg: &Segment, window: usize) -> Vec<(usize, u64)> {
    let src = seg.source.unwrap();
    let shape = Shape {
        samples_per_epoch: Some(src.quota),
        ..shape
    };
    let mut p = plan::plan_stream(shape, seg.host, &seg.req).unwrap();
    p.stream_key = plan::source_key(p.stream_key, src.index);
    let out = shuffled(&p, window);
    out[seg.from as usize..seg.to as usize].to_vec()
}

/// A mix checkpointed at random positions resumes on another topology (and another):
/// per source, what the old streams' interleaves had taken plus what the new streams
/// read is the epoch's samples of that source exactly once, but the drops; every new
/// rank reads as many of each source.
#[test]
fn a_mix_resumes_elastically_exactly_once_per_source() {
    let mut rng = SplitMix64::new(99);
    for case in 0..40 {
        let a: Vec<u64> = (0..1 + rng.below(6)).map(|_| 5 + rng.below(25)).collect();
        let b: Vec<u64> = (0..1 + rng.below(6)).map(|_| 5 + rng.below(25)).collect();
        let shapes = [
            Shape {
                counts: Some(&a),
                ..Shape::shards(a.len())
            },
            Shape {
                counts: Some(&b),
                ..Shape::shards(b.len())
            },
        ];
        let weights = [1 + rng.below(4), 1 + rng.below(4)];
        let e = 1 + rng.below(40);
        let window = 1 + rng.below(8) as usize;
        let (seed, epoch) = (rng.next_u64(), rng.below(3));
        let t0 = random_topo(&mut rng);
        // Half the cases change the weights inside or around the epoch (a schedule entry at
        // a job-wide sample): the old streams' epoch has two segments.
        let streams0 = (t0.hosts * t0.ranks * t0.workers) as u64;
        let schedule = match case % 2 {
            0 => vec![],
            _ => vec![(
                crate::config::ScheduleFrom::Sample(1 + rng.below((epoch + 2) * e * streams0)),
                vec![1 + rng.below(4), 1 + rng.below(4)],
            )],
        };
        let m = mix_of(&weights, e, schedule);
        let mix = m.epoch_mix(epoch, streams0 as u128);
        let quotas = mix.quotas().to_vec();
        // The whole epoch of each source, and what the old streams consumed of it.
        let mut want = [HashMap::new(), HashMap::new()];
        let mut got: [HashMap<(usize, u64), u32>; 2] = [HashMap::new(), HashMap::new()];
        let positions: Vec<u64> = (0..t0.workers).map(|_| rng.below(e + 1)).collect();
        for h in 0..t0.hosts {
            for s in 0..t0.ranks * t0.workers {
                let req = StreamRequest {
                    seed,
                    epoch,
                    rank: h * t0.ranks + s / t0.workers,
                    world_size: t0.hosts * t0.ranks,
                    worker: s % t0.workers,
                    num_workers: t0.workers,
                };
                let taken = mix.counts_at(plan::stream_key(&req), positions[req.worker as usize]);
                for i in 0..2 {
                    let seg = Segment {
                        host: Topology {
                            index: h,
                            count: t0.hosts,
                        },
                        req,
                        from: 0,
                        to: quotas[i],
                        source: Some(SourceOf {
                            index: i as u32,
                            quota: quotas[i],
                        }),
                    };
                    let out = source_output(shapes[i], &seg, window);
                    for x in &out {
                        *want[i].entry(*x).or_insert(0) += 1;
                    }
                    for x in &out[..taken[i] as usize] {
                        *got[i].entry(*x).or_insert(0) += 1;
                    }
                }
            }
        }
        let origin = Origin {
            hosts: t0.hosts,
            world_size: t0.hosts * t0.ranks,
            num_workers: t0.workers,
            positions,
            from: None,
        };
        let t = random_topo(&mut rng);
        let req = StreamRequest {
            seed,
            epoch,
            rank: 0,
            world_size: t.hosts * t.ranks,
            worker: 0,
            num_workers: t.workers,
        };
        let splits = split_mix(&m, t.hosts, &req, &origin).unwrap();
        for (i, split) in splits.iter().enumerate() {
            let mut per_rank = HashMap::new();
            for (h, streams) in split.hosts.iter().enumerate() {
                for (s, segments) in streams.iter().enumerate() {
                    let rank = h as u32 * t.ranks + s as u32 / t.workers;
                    for seg in segments {
                        for x in source_output(shapes[i], seg, window) {
                            *got[i].entry(x).or_insert(0) += 1;
                            *per_rank.entry(rank).or_insert(0u64) += 1;
                        }
                    }
                }
            }
            let counts: std::collections::HashSet<u64> = (0..t.hosts * t.ranks)
                .map(|r| *per_rank.get(&r).unwrap_or(&0))
                .collect();
            assert_eq!(counts.len(), 1, "case {case} source {i}: {per_rank:?}");
            // Sources repeat samples within an epoch when quotas wrap passes: compare counts.
            for (x, &n) in &got[i] {
                assert!(
                    n <= *want[i].get(x).unwrap_or(&0),
                    "case {case} source {i}: {x:?} read twice"
                );
            }
            let missing: u32 = want[i]
                .iter()
                .map(|(x, &n)| n - got[i].get(x).copied().unwrap_or(0))
                .sum();
            assert_eq!(missing as u64, split.dropped, "case {case} source {i}");
            // Each source's rest is dealt on its own: fewer than W' drops per source
            // (so fewer than sources × W' for the mix; PROTOCOL.md).
            assert!(
                split.dropped < (t.hosts * t.ranks) as u64,
                "case {case} source {i}"
            );
        }
    }
}

/// Golden vector: an elastic resume's segments are a contract like any plan (a change is
/// a protocol-level change).
#[test]
fn golden_split() {
    let counts = [5, 9, 3, 12, 7, 1, 8];
    let shape = Shape {
        counts: Some(&counts),
        ..Shape::shards(counts.len())
    };
    let origin = Origin {
        hosts: 2,
        world_size: 4,
        num_workers: 2,
        positions: vec![3, 1],
        from: None,
    };
    let host = Topology { index: 0, count: 1 };
    let req = StreamRequest {
        seed: 7,
        epoch: 3,
        rank: 1,
        world_size: 3,
        worker: 0,
        num_workers: 1,
    };
    let p = plan(shape, host, &req, &origin).unwrap();
    let pinned: Vec<(u32, u32, u32, u64, u64)> = p
        .segments
        .iter()
        .map(|s| (s.host.index, s.req.rank, s.req.worker, s.from, s.to))
        .collect();
    assert_eq!(pinned, GOLDEN_SEGMENTS);
    assert_eq!((p.samples, p.remainder, p.dropped), (8, 24, 0));
}
const GOLDEN_SEGMENTS: [(u32, u32, u32, u64, u64); 3] =
    [(0, 1, 1, 1, 5), (1, 2, 0, 3, 5), (1, 2, 1, 1, 3)];

/// A one-host job of one stream over shards of `counts` samples (a manifest's).
fn one_stream(counts: &[u64]) -> (Shape<'_>, Topology, StreamRequest) {
    let shape = Shape {
        counts: Some(counts),
        ..Shape::shards(counts.len())
    };
    let req = StreamRequest {
        seed: 0,
        epoch: 0,
        rank: 0,
        world_size: 1,
        worker: 0,
        num_workers: 1,
    };
    (shape, Topology { index: 0, count: 1 }, req)
}

#[test]
fn bad_origins_are_refused_with_what_is_wrong() {
    let counts = vec![10u64; 4];
    let (shape, host, req) = one_stream(&counts);
    let o = |hosts, world_size, positions: Vec<u64>| Origin {
        hosts,
        world_size,
        num_workers: positions.len().max(1) as u32,
        positions,
        from: None,
    };
    let e = |o: Origin| plan(shape, host, &req, &o).unwrap_err().to_string();
    assert!(e(o(2, 3, vec![0])).contains("not divisible"));
    assert!(e(o(1, 1, vec![41])).contains("past the end"));
    let mut two = o(1, 1, vec![0, 0]);
    two.num_workers = 3;
    assert!(e(two).contains("2 positions for 3 workers"));
    // Each count alone at zero.
    let at_least = "hosts, world_size and num_workers must be at least 1";
    assert!(e(o(0, 2, vec![0])).contains(at_least));
    assert!(e(o(1, 0, vec![0])).contains(at_least));
    let mut no_workers = o(1, 1, vec![]);
    no_workers.num_workers = 0;
    assert!(e(no_workers).contains(at_least));
    let no_manifest = Shape::shards(4);
    assert_eq!(
        plan(no_manifest, host, &req, &o(1, 1, vec![0])).unwrap_err(),
        PlanError::ElasticNeedsManifest
    );
}

/// The absurd topologies of a hostile request are refused before anything is allocated
/// for them (they used to abort the daemon, or take 14 s and 7.5 GB at 40,000,000).
#[test]
fn requests_past_the_bound_are_refused_before_any_work() {
    let counts = vec![300_000u64; 4];
    let (shape, host, req) = one_stream(&counts);
    let origin = |world_size, num_workers| Origin {
        hosts: 1,
        world_size,
        num_workers,
        positions: vec![0; num_workers as usize],
        from: None,
    };
    let refused = |r: Result<ElasticPlan, PlanError>| match r {
        Err(PlanError::BadOrigin(m)) => m,
        other => panic!("not refused: {other:?}"),
    };
    let m = refused(plan(shape, host, &req, &origin(4_000_000_000, 1)));
    assert!(m.contains("4000000001 streams"), "{m}");
    assert!(m.contains(&format!("({MAX_STREAMS})")), "{m}");
    refused(plan(shape, host, &req, &origin(40_000_000, 1)));
    // The new topology counts as well as the old one.
    let wide = StreamRequest {
        world_size: 1 << 18,
        ..req
    };
    refused(plan(shape, host, &wide, &origin(1, 1)));
    // A mix's split is per source.
    let e = split_mix(
        &mix_of(&[1, 1, 1], 30, vec![]),
        1,
        &req,
        &origin(1 << 17, 1),
    )
    .err();
    assert!(matches!(e, Some(PlanError::BadOrigin(m)) if m.contains("times 3 sources")));
    // A chain of resumes is bounded in hops, whatever its streams.
    let mut chain = origin(1, 1);
    for _ in 0..MAX_HOPS {
        chain = Origin {
            from: Some(Box::new(chain)),
            ..origin(1, 1)
        };
    }
    assert!(refused(plan(shape, host, &req, &chain)).contains("more than 16 resumes"));
    // ...and a chain of exactly MAX_HOPS is planned.
    let Origin {
        from: Some(within), ..
    } = chain
    else {
        unreachable!()
    };
    plan(shape, host, &req, &within).unwrap();
    // Just inside the bound is planned: one new stream reads every old stream's rest.
    let at = MAX_STREAMS as u32 - 1;
    let p = plan(shape, host, &req, &origin(1, at)).unwrap();
    let per_stream = 1_200_000 / at as u64;
    assert_eq!(
        (p.remainder, p.samples),
        (per_stream * at as u64, per_stream * at as u64)
    );
}

#[test]
fn an_elastic_mix_interleaves_only_the_sources_with_samples_left() {
    // A source an earlier hop used up has no place in the order, and with one source left
    // every sample of the stream is that source's, whichever it is.
    let (_, live) = interleave(&[0, 5, 3]).unwrap();
    assert_eq!(live, [1, 2]);
    for lens in [[0, 4, 0], [4, 0, 0], [0, 0, 4]] {
        assert!(interleave(&lens).is_none(), "{lens:?}");
        let only = lens.iter().position(|&n| n > 0).unwrap();
        let mut want = vec![0; 3];
        want[only] = 3;
        assert_eq!(taken(&None, &lens, 7, 3), want, "{lens:?}");
    }
    let order = interleave(&[0, 5, 3]);
    let counts = taken(&order, &[0, 5, 3], 7, 8);
    assert_eq!(counts, [0, 5, 3], "all of each source by the end");
}
