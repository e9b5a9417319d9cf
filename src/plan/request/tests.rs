//! The entry point alone, against what a job must read: every stream of a job planned as its
//! hosts plan it, and the samples each stream reads expanded from its pieces.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use super::*;
use crate::plan::Topology;
use crate::plan::elastic::Origin;
use crate::plan::passes::Hop;

const MIX: &str = "[datasets.web]\nshards = \"/w/{0..99}.tar\"\nshuffle_buffer = 5\nmanifest = \"/w/m.json\"\n\
                   [datasets.books]\nshards = \"/b/{0..59}.tar\"\nshuffle_buffer = 4\nmanifest = \"/b/m.json\"\n\
                   [datasets.both]\nmix = { web = 3, books = 2 }\nsamples_per_epoch = 10\n\
                   [datasets.stepped]\nmix = { web = 3, books = 2 }\nsamples_per_epoch = 10\n\
                   schedule = [{ at = 100, mix = { web = 1, books = 1 } }]\n\
                   [datasets.fixed]\nshards = \"/f/{0..39}.tar\"\nshuffle_buffer = 3\nmanifest = \"/f/m.json\"\n\
                   samples_per_epoch = 6\n";

/// The mix's config, shard `i` of each source holding `4 + i % 5` samples.
fn config() -> Config {
    let mut c = Config::parse(MIX, Path::new("/")).unwrap();
    for d in c.datasets.values_mut() {
        let counts: Vec<u64> = (0..d.shards.len() as u64).map(|i| 4 + i % 5).collect();
        d.set_counts(counts.into());
    }
    c
}

/// Every stream of the job `hosts × ranks × workers` planned by its host, in stream order.
fn job(
    c: &Config,
    name: &str,
    topology: (u32, u32, u32),
    epoch: u64,
    with_next: bool,
    history: &[Hop],
) -> Vec<Plan> {
    resumed_job(c, name, topology, epoch, with_next, history, None)
}

/// [`job`], resuming `origin`'s checkpoint elastically when there is one.
fn resumed_job(
    c: &Config,
    name: &str,
    (hosts, ranks, workers): (u32, u32, u32),
    epoch: u64,
    with_next: bool,
    history: &[Hop],
    origin: Option<&Origin>,
) -> Vec<Plan> {
    let mut plans = Vec::new();
    for h in 0..hosts {
        let mut c = c.clone();
        c.host = Topology {
            index: h,
            count: hosts,
        };
        for s in 0..ranks * workers {
            let req = StreamRequest {
                seed: 5,
                epoch,
                rank: h * ranks + s / workers,
                world_size: hosts * ranks,
                worker: s % workers,
                num_workers: workers,
            };
            plans.push(plan(&c, name, req, origin, history, with_next).unwrap());
        }
    }
    plans
}

/// Per source, every (shard, sample) the plans read, from their pieces.
fn reads(c: &Config, plans: &[Plan]) -> BTreeMap<String, Vec<(usize, u64)>> {
    let mut out: BTreeMap<String, Vec<(usize, u64)>> = BTreeMap::new();
    for plan in plans {
        for lane in &plan.lanes {
            let counts = c.datasets[&lane.dataset].counts.clone().unwrap();
            for run in &lane.runs {
                let before = out.get(&lane.dataset).map_or(0, Vec::len);
                for p in &run.plan.pieces {
                    let end = p.end.unwrap_or(counts[p.shard]);
                    let got = out.entry(lane.dataset.clone()).or_default();
                    got.extend((p.start..end).map(|i| (p.shard, i)));
                }
                let read = out.get(&lane.dataset).map_or(0, Vec::len) - before;
                assert_eq!(
                    Some(read as u64),
                    run.len(),
                    "a whole run reads all its pieces"
                );
            }
        }
    }
    out
}

/// Adds what `plans` read to `seen`, per source; a sample read again fails, naming `what`.
fn read_once(
    seen: &mut BTreeMap<String, BTreeSet<(usize, u64)>>,
    c: &Config,
    plans: &[Plan],
    what: &str,
) {
    for (source, samples) in reads(c, plans) {
        let fresh = seen.entry(source.clone()).or_default();
        for s in samples {
            assert!(fresh.insert(s), "{what}: {source} {s:?} read again");
        }
    }
}

/// A mix's epochs, with several hosts, ranks and workers: each source's samples are read
/// once job-wide in an epoch (two epochs take less than a pass of either source), in the quotas of its weight, and the next epoch goes on where
/// this one stopped (no sample of a source read again while its pass lasts). Where each
/// epoch starts depends on the job's streams and a host's: got wrong, epochs overlap.
#[test]
fn a_mix_reads_each_source_once_per_pass_across_epochs_and_streams() {
    let c = config();
    for topology in [(2, 2, 2), (1, 3, 2), (3, 1, 1)] {
        let mut seen: BTreeMap<String, BTreeSet<(usize, u64)>> = BTreeMap::new();
        for epoch in 0..2 {
            let plans = job(&c, "both", topology, epoch, false, &[]);
            let got = reads(&c, &plans);
            let streams = plans.len() as u64;
            let delivered: u64 = plans.iter().map(|p| p.samples.unwrap()).sum();
            assert_eq!(
                delivered,
                10 * streams,
                "{topology:?}: samples_per_epoch is each stream's"
            );
            // 3 : 2 of each stream's samples.
            assert_eq!(
                got["web"].len() as u64,
                delivered * 3 / 5,
                "{topology:?} epoch {epoch}"
            );
            assert_eq!(
                got["books"].len() as u64,
                delivered * 2 / 5,
                "{topology:?} epoch {epoch}"
            );
            read_once(
                &mut seen,
                &c,
                &plans,
                &format!("{topology:?} epoch {epoch}"),
            );
        }
    }
}

/// What a stream prefetches for its next epoch is what it reads then, source by source: in a
/// mix whose schedule changes its quotas between epochs too, and in a plain dataset.
#[test]
fn a_streams_next_epoch_shards_are_those_it_reads_next_epoch() {
    let c = config();
    for name in ["both", "stepped", "web"] {
        for topology in [(2, 2, 2), (1, 3, 2)] {
            for epoch in 0..3 {
                let now = job(&c, name, topology, epoch, true, &[]);
                let next = job(&c, name, topology, epoch + 1, false, &[]);
                for (a, b) in now.iter().zip(&next) {
                    for lane in &a.lanes {
                        let then = b.lanes.iter().find(|l| l.dataset == lane.dataset).unwrap();
                        let shards: Vec<usize> =
                            then.runs.iter().flat_map(|r| r.plan.shards()).collect();
                        assert!(!shards.is_empty());
                        assert_eq!(
                            lane.next_epoch, shards,
                            "{name} {topology:?} epoch {epoch} {}",
                            lane.dataset
                        );
                    }
                }
            }
        }
    }
}

/// A schedule's `at` is job-wide: the new weights start at the first step at which the
/// job's streams (world_size × num_workers, reading in step) have read that many samples, and
/// every source still goes on where it was.
#[test]
fn a_schedules_at_is_counted_over_the_jobs_streams() {
    let c = config();
    for topology in [(2, 2, 2), (1, 3, 2), (3, 1, 1)] {
        let mut seen: BTreeMap<String, BTreeSet<(usize, u64)>> = BTreeMap::new();
        for epoch in 0..4 {
            let plans = job(&c, "stepped", topology, epoch, false, &[]);
            let streams = plans.len() as u64;
            // An epoch is 10 steps of every stream: the job has read `start` samples before it.
            let start = 10 * streams * epoch;
            let want = match (100u64.saturating_sub(start)).div_ceil(streams) {
                0 => vec![(0, 1)],
                step if step < 10 => vec![(0, 0), (step, 1)],
                _ => vec![(0, 0)],
            };
            for p in &plans {
                let got: Vec<(u64, usize)> = p
                    .segments
                    .as_ref()
                    .unwrap()
                    .iter()
                    .map(|s| (s.position, s.entry))
                    .collect();
                assert_eq!(got, want, "{topology:?} epoch {epoch}");
            }
            read_once(
                &mut seen,
                &c,
                &plans,
                &format!("{topology:?} epoch {epoch}"),
            );
        }
    }
}

/// Across a resize (the job's history of topologies), each source of a mix, and a dataset of
/// a fixed samples_per_epoch, goes on where the old topology left it: its epochs there, and
/// a mix's `at` schedule, are counted over the old topology's streams.
#[test]
fn a_mix_and_a_fixed_epoch_go_on_across_a_resize() {
    let c = config();
    for (old, new) in [((2, 2, 2), (3, 1, 1)), ((1, 3, 2), (2, 2, 2))] {
        let hops = [Hop {
            hosts: old.0,
            world_size: old.0 * old.1,
            num_workers: old.2,
            last_epoch: 1,
        }];
        for name in ["both", "stepped", "fixed"] {
            let mut seen: BTreeMap<String, BTreeSet<(usize, u64)>> = BTreeMap::new();
            for epoch in 0..4 {
                let plans = match epoch {
                    0 | 1 => job(&c, name, old, epoch, false, &[]),
                    _ => job(&c, name, new, epoch, false, &hops),
                };
                read_once(
                    &mut seen,
                    &c,
                    &plans,
                    &format!("{name} {old:?} → {new:?}, epoch {epoch}"),
                );
            }
        }
    }
}

/// Each source's shuffle is keyed apart (a golden vector: orders are a contract).
#[test]
fn source_keys_are_pinned() {
    assert_eq!(crate::plan::source_key(7, 0), 6395785482253289984);
    assert_eq!(crate::plan::source_key(7, 1), 5822386694794808127);
}

/// An elastic resume's pieces are counted across its runs, and refused past the bound.
#[test]
fn the_piece_budget_counts_every_run_and_refuses_past_its_bound() {
    let pieces = |n: usize| crate::plan::StreamPlan {
        pieces: vec![
            crate::plan::Piece {
                shard: 0,
                start: 0,
                end: Some(1),
            };
            n
        ],
        stream_key: 0,
        samples: Some(n as u64),
        dropped: 0,
        pass: 0,
    };
    let mut budget = PieceBudget(MAX_RESUMED_PIECES - 3);
    assert_eq!(budget.take(pieces(2)).unwrap().pieces.len(), 2);
    assert_eq!(budget.take(pieces(1)).unwrap().pieces.len(), 1);
    let refused = budget.take(pieces(1)).unwrap_err().to_string();
    assert!(
        refused.contains(&format!("more than {MAX_RESUMED_PIECES} pieces")),
        "{refused}"
    );
}

#[test]
fn every_stream_of_a_job_has_its_epochs_fingerprint_and_another_plan_another() {
    // The fingerprint names an epoch's plan for every rank of the job (a reconnecting client
    // checks it): the same on every host, rank and worker; another for another epoch,
    // topology or history.
    let c = config();
    let h = Hop {
        hosts: 1,
        world_size: 2,
        num_workers: 1,
        last_epoch: 0,
    };
    for name in ["web", "both"] {
        let fingerprints = |topo, epoch, history: &[Hop]| -> BTreeSet<String> {
            job(&c, name, topo, epoch, false, history)
                .into_iter()
                .map(|p| p.fingerprint)
                .collect()
        };
        let one = fingerprints((2, 2, 2), 1, &[]);
        assert_eq!(one.len(), 1, "{name}: {one:?}");
        let others = [
            fingerprints((2, 2, 2), 2, &[]),
            fingerprints((2, 2, 1), 1, &[]),
            fingerprints((1, 4, 2), 1, &[]),
            fingerprints((2, 2, 2), 1, &[h]),
        ];
        let mut all = BTreeSet::new();
        for f in others.iter().chain([&one]) {
            assert_eq!(f.len(), 1, "{name}: {f:?}");
            all.extend(f.iter().cloned());
        }
        assert_eq!(all.len(), 5, "{name}: {all:?}");
        // Golden: a daemon upgraded mid-job must give a reconnecting client the fingerprint
        // it had (else the client raises PlanChanged). A change here is a protocol change.
        let golden = GOLDEN_FINGERPRINTS.iter().find(|g| g.0 == name).unwrap();
        assert_eq!(
            (
                one.first().unwrap().as_str(),
                others[3].first().unwrap().as_str()
            ),
            (golden.1, golden.2),
            "{name}: without a history, and with one"
        );
    }
}

const GOLDEN_FINGERPRINTS: [(&str, &str, &str); 2] = [
    ("web", "f86df677575fe0cc", "07850832f9550f5a"),
    ("both", "c511307c86828eaf", "bf6c82ec12ab56dd"),
];

/// After an elastic resume: the new streams share out the old ones' rest (no run of an old
/// stream read by two new ones), and what each prefetches for the next epoch is what it reads
/// then, planned with the history the resume adds (`passes::after`).
#[test]
fn an_elastic_epoch_deals_each_old_streams_rest_once_and_prefetches_the_next_epoch() {
    let c = config();
    let origin = Origin {
        hosts: 2,
        world_size: 4,
        num_workers: 2,
        positions: vec![3, 4],
        from: None,
    };
    for name in ["both", "fixed"] {
        for new in [(1, 2, 2), (3, 1, 2)] {
            let what = format!("{name} {new:?}");
            let now = resumed_job(&c, name, new, 1, true, &[], Some(&origin));
            let mut runs: BTreeMap<(String, u64), Vec<(u64, u64)>> = BTreeMap::new();
            for lane in now.iter().flat_map(|p| &p.lanes) {
                for r in &lane.runs {
                    let to = r.to.unwrap();
                    runs.entry((lane.dataset.clone(), r.plan.stream_key))
                        .or_default()
                        .push((r.from, to));
                }
            }
            assert!(!runs.is_empty(), "{what}: no run");
            for ((source, key), mut ranges) in runs {
                ranges.sort();
                for w in ranges.windows(2) {
                    assert!(
                        w[0].1 <= w[1].0,
                        "{what}: {source} stream {key}: {ranges:?}"
                    );
                }
            }
            let history = crate::plan::passes::after(&[], &origin, 1);
            let next = job(&c, name, new, 2, false, &history);
            for (a, b) in now.iter().zip(&next) {
                for lane in &a.lanes {
                    let then = b.lanes.iter().find(|l| l.dataset == lane.dataset).unwrap();
                    let shards: Vec<usize> =
                        then.runs.iter().flat_map(|r| r.plan.shards()).collect();
                    assert_eq!(lane.next_epoch, shards, "{what} {}", lane.dataset);
                }
            }
        }
    }
}
