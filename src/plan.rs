//! The epoch plan: which shards a stream reads, in which order. A pure function of
//! (shard count, seed, epoch, host topology, world_size, rank, num_workers, worker): every host
//! computes the same plan with no communication, and nothing here depends on timing or cache
//! state.
//!
//! This is the shard-level mode (sample counts unknown until a shard is read), as webdataset
//! does it, with one change for locality:
//! 1. **Host share, stable across epochs and runs.** The shard list is permuted with the
//!    dataset's `share_seed` (default 0), never the run's seed, and dealt round-robin to the
//!    hosts: a host reads the same shards every epoch of every run with the same shard list
//!    and host count, so its cache keeps serving it, and the daemon can fill its cache before
//!    any trainer connects.
//! 2. **Epoch order.** The host's shards are permuted again with (seed, epoch, host).
//! 3. **Ranks, then workers.** Local rank ρ takes every L-th shard of that order starting at ρ
//!    (L = ranks per host), and worker w every K-th shard of its rank's list starting at w, as
//!    webdataset's `split_by_node` / `split_by_worker` do. Ranks of one host differ by at most
//!    one shard.
//!
//! Every shard therefore lands in exactly one stream per epoch. A manifest mode with exact,
//! equal per-rank sample counts (see `docs` in the shared design) is meant to sit beside this
//! one, selected per dataset; the [`StreamPlan`] it yields has the same shape.

use crate::config::Topology;
use crate::shuffle::{self, SplitMix64, tag};

/// What a trainer asks for: its place in the job and the epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamRequest {
    pub seed: u64,
    pub epoch: u64,
    pub rank: u32,
    pub world_size: u32,
    pub worker: u32,
    pub num_workers: u32,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PlanError {
    #[error("world_size must be at least 1")]
    ZeroWorld,
    #[error("rank {rank} must be less than world_size {world_size}")]
    RankOutOfRange { rank: u32, world_size: u32 },
    #[error("world_size {world_size} is not divisible by the host count {hosts}")]
    UnevenHosts { world_size: u32, hosts: u32 },
    #[error(
        "rank {rank} is not on this host: host {host} of {hosts} serves ranks {first}..={last} of world_size {world_size}"
    )]
    RankNotOnHost {
        rank: u32,
        world_size: u32,
        host: u32,
        hosts: u32,
        first: u32,
        last: u32,
    },
    #[error("num_workers must be at least 1")]
    ZeroWorkers,
    #[error("worker {worker} must be less than num_workers {num_workers}")]
    WorkerOutOfRange { worker: u32, num_workers: u32 },
}

/// One stream's share of an epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamPlan {
    /// Indices into the dataset's shard list, in reading order.
    pub shards: Vec<usize>,
    /// Keys the stream's sample shuffle: (seed, epoch, rank, worker, num_workers).
    pub stream_key: u64,
}

/// Plans one stream, or says why the request cannot be served by this host.
pub fn plan_stream(
    num_shards: usize,
    share_seed: u64,
    host: Topology,
    req: &StreamRequest,
) -> Result<StreamPlan, PlanError> {
    let local_rank = validate(host, req)?;
    let ranks_per_host = (req.world_size / host.count) as usize;

    let mut order = host_share(num_shards, share_seed, host);
    let mut rng = SplitMix64::new(shuffle::key(&[
        tag::EPOCH_ORDER,
        req.seed,
        req.epoch,
        host.index as u64,
    ]));
    shuffle::shuffle(&mut order, &mut rng);

    let shards = order
        .into_iter()
        .skip(local_rank)
        .step_by(ranks_per_host)
        .skip(req.worker as usize)
        .step_by(req.num_workers as usize)
        .collect();
    let stream_key = shuffle::key(&[
        tag::STREAM,
        req.seed,
        req.epoch,
        req.rank as u64,
        req.worker as u64,
        req.num_workers as u64,
    ]);
    Ok(StreamPlan { shards, stream_key })
}

/// The shards this host owns in every epoch, in ascending position of the permutation
/// keyed by `share_seed`.
pub fn host_share(num_shards: usize, share_seed: u64, host: Topology) -> Vec<usize> {
    let mut all: Vec<usize> = (0..num_shards).collect();
    shuffle::shuffle(
        &mut all,
        &mut SplitMix64::new(shuffle::key(&[tag::HOST_SHARE, share_seed])),
    );
    all.into_iter()
        .skip(host.index as usize)
        .step_by(host.count as usize)
        .collect()
}

/// Checks the request against the topology; returns the rank's index among this host's ranks.
fn validate(host: Topology, req: &StreamRequest) -> Result<usize, PlanError> {
    if req.world_size == 0 {
        return Err(PlanError::ZeroWorld);
    }
    if req.rank >= req.world_size {
        return Err(PlanError::RankOutOfRange {
            rank: req.rank,
            world_size: req.world_size,
        });
    }
    if !req.world_size.is_multiple_of(host.count) {
        return Err(PlanError::UnevenHosts {
            world_size: req.world_size,
            hosts: host.count,
        });
    }
    let per_host = req.world_size / host.count;
    let first = host.index * per_host;
    if !(first..first + per_host).contains(&req.rank) {
        return Err(PlanError::RankNotOnHost {
            rank: req.rank,
            world_size: req.world_size,
            host: host.index,
            hosts: host.count,
            first,
            last: first + per_host - 1,
        });
    }
    if req.num_workers == 0 {
        return Err(PlanError::ZeroWorkers);
    }
    if req.worker >= req.num_workers {
        return Err(PlanError::WorkerOutOfRange {
            worker: req.worker,
            num_workers: req.num_workers,
        });
    }
    Ok((req.rank - first) as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

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

    /// Every stream of every rank on every host, concatenated in (host, rank, worker) order.
    fn whole_epoch(
        num_shards: usize,
        hosts: u32,
        per_host: u32,
        workers: u32,
        seed: u64,
        epoch: u64,
    ) -> Vec<Vec<usize>> {
        let world = hosts * per_host;
        let mut streams = Vec::new();
        for h in 0..hosts {
            let topo = Topology {
                index: h,
                count: hosts,
            };
            for rank in h * per_host..(h + 1) * per_host {
                for w in 0..workers {
                    let p = plan_stream(
                        num_shards,
                        0,
                        topo,
                        &req(seed, epoch, rank, world, w, workers),
                    )
                    .unwrap();
                    streams.push(p.shards);
                }
            }
        }
        streams
    }

    #[test]
    fn every_shard_exactly_once_per_epoch() {
        for num_shards in [0, 1, 5, 16, 33, 128] {
            for hosts in 1..=4 {
                for per_host in 1..=4 {
                    for workers in 1..=3 {
                        for epoch in 0..2 {
                            let streams =
                                whole_epoch(num_shards, hosts, per_host, workers, 7, epoch);
                            let mut all: Vec<usize> = streams.concat();
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
    fn ranks_on_a_host_differ_by_at_most_one_shard() {
        let streams = whole_epoch(101, 2, 4, 1, 3, 0);
        for host in streams.chunks(4) {
            let lens: Vec<usize> = host.iter().map(Vec::len).collect();
            assert!(
                lens.iter().max().unwrap() - lens.iter().min().unwrap() <= 1,
                "{lens:?}"
            );
        }
    }

    #[test]
    fn deterministic_and_epoch_dependent() {
        let a = whole_epoch(64, 2, 2, 2, 11, 0);
        assert_eq!(a, whole_epoch(64, 2, 2, 2, 11, 0));
        assert_ne!(a, whole_epoch(64, 2, 2, 2, 11, 1));
        assert_ne!(a, whole_epoch(64, 2, 2, 2, 12, 0));
        let topo = Topology { index: 0, count: 1 };
        let k0 = plan_stream(8, 0, topo, &req(1, 0, 0, 1, 0, 1))
            .unwrap()
            .stream_key;
        let k1 = plan_stream(8, 0, topo, &req(1, 1, 0, 1, 0, 1))
            .unwrap()
            .stream_key;
        assert_ne!(k0, k1);
    }

    #[test]
    fn host_share_is_stable_across_epochs() {
        for epoch in 0..5 {
            for h in 0..3 {
                let streams = whole_epoch(50, 3, 2, 2, 5, epoch);
                let mut mine: Vec<usize> = streams[(h * 4) as usize..(h * 4 + 4) as usize].concat();
                mine.sort();
                let mut share = host_share(50, 0, Topology { index: h, count: 3 });
                share.sort();
                assert_eq!(mine, share);
            }
        }
    }

    #[test]
    fn host_share_does_not_depend_on_the_run_seed() {
        for h in 0..3 {
            let topo = Topology { index: h, count: 3 };
            let shares: Vec<Vec<usize>> = (0..4)
                .map(|seed| {
                    let mut mine: Vec<usize> = (0..3)
                        .flat_map(|r| {
                            plan_stream(40, 9, topo, &req(seed, 2, h * 3 + r, 9, 0, 1))
                                .unwrap()
                                .shards
                        })
                        .collect();
                    mine.sort();
                    mine
                })
                .collect();
            assert!(shares.iter().all(|s| *s == shares[0]));
            let mut share = host_share(40, 9, topo);
            share.sort();
            assert_eq!(shares[0], share);
            assert_ne!(host_share(40, 10, topo), host_share(40, 9, topo));
        }
    }

    /// Golden vectors: what a stream reads is a contract (a resumed job must read what it
    /// would have read). A change here is a protocol-level change: say so in PROTOCOL.md.
    #[test]
    fn golden_shard_orders() {
        let topo = Topology { index: 1, count: 2 };
        let p = plan_stream(10, 0, topo, &req(7, 3, 2, 4, 0, 1)).unwrap();
        assert_eq!(host_share(10, 0, topo), GOLDEN_SHARE);
        assert_eq!(p.shards, GOLDEN_RANK2);
        assert_eq!(p.stream_key, GOLDEN_KEY);
    }
    const GOLDEN_SHARE: [usize; 5] = [7, 5, 6, 1, 2];
    const GOLDEN_RANK2: [usize; 3] = [7, 1, 5];
    const GOLDEN_KEY: u64 = 10125191524557636659;

    #[test]
    fn refuses_what_this_host_cannot_serve() {
        let topo = Topology { index: 1, count: 2 };
        let err = |r: StreamRequest| plan_stream(10, 0, topo, &r).unwrap_err().to_string();
        assert_eq!(
            err(req(0, 0, 4, 4, 0, 1)),
            "rank 4 must be less than world_size 4"
        );
        assert_eq!(
            err(req(0, 0, 1, 3, 0, 1)),
            "world_size 3 is not divisible by the host count 2"
        );
        assert_eq!(
            err(req(0, 0, 1, 4, 0, 1)),
            "rank 1 is not on this host: host 1 of 2 serves ranks 2..=3 of world_size 4"
        );
        assert_eq!(
            err(req(0, 0, 2, 4, 2, 2)),
            "worker 2 must be less than num_workers 2"
        );
        assert_eq!(err(req(0, 0, 0, 0, 0, 1)), "world_size must be at least 1");
        assert_eq!(err(req(0, 0, 2, 4, 0, 0)), "num_workers must be at least 1");
    }
}
