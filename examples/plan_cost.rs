//! What one plan costs at scale, and where the time goes (prints figures, asserts nothing):
//!
//!     cargo run --release --example plan_cost -- [SHARDS] [HOSTS] [RANKS] [WORKERS]
//!
//! Defaults: 1,000,000 shards of ~1000 samples, 256 hosts × 4 ranks × 4 workers. Times
//! `plan::plan_stream` (sample level, as the daemon plans a stream), `plan::warm_shards` (the
//! host's share alone), and the Fisher-Yates of the whole shard list that both start with
//! (the same shuffle `plan/mod.rs` runs, rebuilt here from `shuffle`'s public parts), each the
//! median of 9.

use std::time::Instant;

use shardd::config::ShareCache;
use shardd::plan::elastic::{self, Origin};
use shardd::plan::shuffle::{self, SplitMix64, tag};
use shardd::plan::{Shape, StreamRequest, Topology, plan_stream, warm_shards};

fn median(mut f: impl FnMut()) -> f64 {
    let mut times: Vec<f64> = (0..9)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[4]
}

fn main() {
    let arg = |i: usize, default: u64| {
        std::env::args()
            .nth(i)
            .map_or(default, |a| a.parse().expect("a number"))
    };
    let (n, hosts, ranks, workers) = (
        arg(1, 1_000_000) as usize,
        arg(2, 256) as u32,
        arg(3, 4) as u32,
        arg(4, 4) as u32,
    );
    let mut rng = SplitMix64::new(13);
    let counts: Vec<u64> = (0..n).map(|_| 800 + rng.below(401)).collect();
    let shape = Shape {
        counts: Some(&counts),
        ..Shape::shards(n)
    };
    let host = Topology {
        index: 17 % hosts,
        count: hosts,
    };
    let req = StreamRequest {
        seed: 7,
        epoch: 3,
        rank: host.index * ranks + 1,
        world_size: hosts * ranks,
        worker: 2,
        num_workers: workers,
    };
    let shuffle_all = median(|| {
        let mut all: Vec<usize> = (0..n).collect();
        shuffle::shuffle(
            &mut all,
            &mut SplitMix64::new(shuffle::key(&[tag::HOST_SHARE, 0])),
        );
        std::hint::black_box(all);
    });
    let share = median(|| {
        std::hint::black_box(warm_shards(shape, host));
    });
    let plan = median(|| {
        std::hint::black_box(plan_stream(shape, host, &req).unwrap());
    });
    let pieces = plan_stream(shape, host, &req).unwrap().pieces.len();
    let shard_level = median(|| {
        std::hint::black_box(plan_stream(Shape::shards(n), host, &req).unwrap());
    });
    // The daemon's case: the dataset keeps its share order and running counts (filled once,
    // by the first plan, timed here apart).
    let cache = ShareCache::default();
    let cached = Shape {
        share: Some(&cache),
        ..shape
    };
    let t = Instant::now();
    plan_stream(cached, host, &req).unwrap();
    let first = t.elapsed().as_secs_f64() * 1e3;
    let plan_cached = median(|| {
        std::hint::black_box(plan_stream(cached, host, &req).unwrap());
    });
    // An elastic resume from twice the hosts, half-way through the epoch: the redistribution
    // and the plans of the old streams the new stream reads the rest of.
    let old_hosts = hosts * 2;
    let old = StreamRequest {
        world_size: old_hosts * ranks,
        ..req
    };
    let length = shardd::plan::stream_samples(&counts, cached, old_hosts, &old).unwrap();
    let origin = Origin {
        hosts: old_hosts,
        world_size: old_hosts * ranks,
        num_workers: workers,
        positions: vec![length / 2; workers as usize],
        from: None,
    };
    let mut segments = 0;
    let resume = median(|| {
        let e = elastic::plan(cached, host, &req, &origin).unwrap();
        segments = e.segments.len();
        for s in &e.segments {
            std::hint::black_box(plan_stream(cached, s.host, &s.req).unwrap());
        }
    });
    println!("{n} shards, {hosts} hosts × {ranks} ranks × {workers} workers, medians of 9:");
    println!("  Fisher-Yates of the {n} shard indices   {shuffle_all:8.1} ms");
    println!("  warm_shards (the host's share)          {share:8.1} ms");
    println!("  plan_stream, sample level ({pieces} pieces) {plan:8.1} ms");
    println!("  plan_stream, shard level                {shard_level:8.1} ms");
    println!("  with the dataset's share cache (the daemon's plans; first fill {first:.1} ms):");
    println!("  plan_stream, sample level               {plan_cached:8.3} ms");
    println!(
        "  elastic resume from {old_hosts} hosts at half the epoch ({segments} runs, planned) {resume:8.3} ms"
    );
}
