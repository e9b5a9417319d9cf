use super::*;

fn args(hosts: u32, ranks: u32, workers: u32) -> Args {
    Args {
        from: None,
        position: None,
        verify: false,
        positions: None,
        resume_from: None,
        history: None,
        hosts,
        ranks,
        workers,
        seed: 5,
        epoch: 2,
        dataset: None,
        json: false,
    }
}

#[test]
fn parses_from() {
    assert_eq!(
        "8,4,2".parse::<From>().unwrap(),
        From {
            hosts: 8,
            ranks: 4,
            workers: 2
        }
    );
    for bad in ["8,4", "8,4,0", "a,b,c", "1,2,3,4"] {
        assert!(bad.parse::<From>().is_err(), "{bad}");
    }
}

/// Sizes 2^i make a host's bytes the set of shards it reads: over the hosts every shard
/// is read, and only the shards split between two hosts are read twice.
#[test]
fn every_shard_is_counted_and_the_threads_do_not_matter() {
    let counts = [7u64, 3, 12, 5, 9, 1, 4, 8, 6, 2, 11, 10];
    let sizes: Vec<u64> = (0..counts.len()).map(|i| 1 << i).collect();
    let shape = Shape {
        counts: Some(&counts),
        ..Shape::shards(counts.len())
    };
    let a = args(3, 2, 2);
    let r = report("t", shape, Some(&sizes), &a, 1).unwrap();
    assert_eq!(r, report("t", shape, Some(&sizes), &a, 4).unwrap());
    let total: u64 = counts.iter().sum();
    let per_stream = total / 3 / 4;
    assert_eq!(r.samples_per_stream, Some(per_stream));
    assert!(r.per_host.iter().all(|h| h.samples == Some(per_stream * 4)));
    assert_eq!(
        r.summary.total_samples.unwrap() + r.summary.total_dropped,
        total
    );
    let union = r.per_host.iter().fold(0, |u, h| u | h.bytes.unwrap());
    assert_eq!(union, (1 << counts.len()) - 1, "every shard is read");
    let split = r.summary.total_shards - counts.len() as u64;
    assert!(split <= 2, "at most hosts - 1 shards are split: {split}");
    assert_eq!(
        r.summary.bytes.as_ref().unwrap().max,
        r.per_host.iter().map(|h| h.bytes.unwrap()).max().unwrap()
    );
}

#[test]
fn shard_level_counts_shards_only() {
    let a = args(4, 2, 3);
    let r = report("t", Shape::shards(50), None, &a, 2).unwrap();
    assert_eq!(r.summary.total_shards, 50);
    assert_eq!(r.summary.total_samples, None);
    assert_eq!(r.summary.bytes, None);
    let s = r.summary.shards.as_ref().unwrap();
    assert_eq!((s.min, s.max), (12, 13));
    assert!(text(&r).contains("spread between hosts: samples -; shards min 12 max 13"));
}
