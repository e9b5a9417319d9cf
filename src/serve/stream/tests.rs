use super::*;
use crate::config::Topology;
use crate::plan::shuffle::SplitMix64;
use crate::plan::{Shape, StreamRequest, plan_stream};

/// What a stream delivers from `start`, as the pump orders it, with the reader replaced
/// by samples named after their (shard, index).
fn deliver(plan: &StreamPlan, counts: &[u64], window: usize, start: u64) -> Vec<String> {
    deliver_run(plan, counts, window, start, None)
}

/// The same for a run that stops at `to`.
fn deliver_run(
    plan: &StreamPlan,
    counts: &[u64],
    window: usize,
    start: u64,
    to: Option<u64>,
) -> Vec<String> {
    let (pieces, mut order) = resume(plan.clone(), window, start, to);
    let url: Arc<str> = Arc::from("u");
    let mut queue: VecDeque<Piece> = pieces.into();
    let mut out = Vec::new();
    loop {
        while order.wants_more() {
            order.push(queue.pop_front().map(|p| {
                (p.start..p.end.unwrap_or(counts[p.shard]))
                    .map(|i| Sample {
                        key: format!("s{}-{i}", p.shard).into(),
                        url: url.clone(),
                        fields: Vec::new(),
                    })
                    .collect()
            }));
        }
        match order.next_window() {
            Some(w) => out.extend(w.into_iter().map(|s| s.key.to_string())),
            None => return out,
        }
    }
}

/// Resume anywhere (0, inside windows, at window and shard edges, the end) gives exactly
/// the rest of the uninterrupted stream, in both plan modes, for random topologies.
#[test]
fn resume_at_any_position_continues_exactly() {
    let mut rng = SplitMix64::new(77);
    for case in 0..60 {
        let shards = 1 + rng.below(12) as usize;
        let counts: Vec<u64> = (0..shards).map(|_| rng.below(30)).collect();
        let hosts = 1 + rng.below(3) as u32;
        let per_host = 1 + rng.below(3) as u32;
        let workers = 1 + rng.below(3) as u32;
        let window = 1 + rng.below(25) as usize;
        let host = Topology {
            index: rng.below(hosts as u64) as u32,
            count: hosts,
        };
        let req = StreamRequest {
            seed: rng.next_u64(),
            epoch: rng.below(5),
            rank: host.index * per_host + rng.below(per_host as u64) as u32,
            world_size: hosts * per_host,
            worker: rng.below(workers as u64) as u32,
            num_workers: workers,
        };
        for exact in [true, false] {
            let shape = Shape {
                counts: exact.then_some(&counts[..]),
                ..Shape::shards(shards)
            };
            let plan = plan_stream(shape, host, &req).unwrap();
            let full = deliver(&plan, &counts, window, 0);
            if let Some(n) = plan.samples {
                assert_eq!(full.len() as u64, n, "case {case}");
                // A run (an elastic resume's segment) is exactly that part of the stream.
                for _ in 0..10 {
                    let to = rng.below(n + 1);
                    let from = rng.below(to + 1);
                    assert_eq!(
                        deliver_run(&plan, &counts, window, from, Some(to)),
                        full[from as usize..to as usize],
                        "case {case} run {from}..{to}"
                    );
                }
            }
            for start in 0..=full.len() {
                assert_eq!(
                    deliver(&plan, &counts, window, start as u64),
                    full[start..],
                    "case {case} exact {exact} start {start}"
                );
            }
            // A parked stream without a manifest knows the counts of the pieces it read:
            // any known prefix gives the same rest.
            for known in [1, plan.pieces.len() / 2, plan.pieces.len()] {
                let mut learnt = plan.clone();
                for p in learnt.pieces.iter_mut().take(known) {
                    p.end = p.end.or(Some(counts[p.shard]));
                }
                for start in 0..=full.len() {
                    assert_eq!(
                        deliver(&learnt, &counts, window, start as u64),
                        full[start..],
                        "case {case} exact {exact} known {known} start {start}"
                    );
                    // Every count known: nothing before the window is read again.
                    let (_, order) = resume(learnt.clone(), window, start as u64, None);
                    if known == plan.pieces.len() {
                        assert_eq!(order.discard, 0, "case {case} start {start}");
                    }
                }
            }
        }
    }
}

/// `shardd plan --verify` turns a run into samples without reading them (ranges, and the
/// window permutation where a run's ends cut a window): the same set the reader delivers.
#[test]
fn the_verifiers_samples_of_a_run_are_the_readers() {
    use crate::cmd::plan_report::verify::{Ids, run_ids};
    let mut rng = SplitMix64::new(91);
    for case in 0..40 {
        let shards = 1 + rng.below(12) as usize;
        let counts: Vec<u64> = (0..shards).map(|_| rng.below(30)).collect();
        let window = 1 + rng.below(25) as usize;
        let workers = 1 + rng.below(3) as u32;
        let req = StreamRequest {
            seed: rng.next_u64(),
            epoch: rng.below(5),
            rank: 0,
            world_size: 1,
            worker: rng.below(workers as u64) as u32,
            num_workers: workers,
        };
        let shape = Shape {
            counts: Some(&counts[..]),
            ..Shape::shards(shards)
        };
        let host = Topology { index: 0, count: 1 };
        let plan = plan_stream(shape, host, &req).unwrap();
        let ids = Ids::new(&counts, window);
        let n = plan.samples.unwrap();
        for _ in 0..10 {
            let to = rng.below(n + 1);
            let from = rng.below(to + 1);
            let mut read = deliver_run(&plan, &counts, window, from, Some(to));
            let mut mine = Vec::new();
            run_ids(&plan, from, to, &ids, &mut |a, b| {
                for id in a..b {
                    let shard = counts
                        .iter()
                        .scan(0, |s, &c| {
                            *s += c;
                            Some(*s)
                        })
                        .position(|end| end > id)
                        .unwrap();
                    let first: u64 = counts[..shard].iter().sum();
                    mine.push(format!("s{shard}-{}", id - first));
                }
            });
            read.sort();
            mine.sort();
            assert_eq!(mine, read, "case {case} run {from}..{to}");
        }
    }
}
