use super::*;
use crate::plan::shuffle::SplitMix64;

/// A config of `text` whose datasets get sample counts drawn from `rng` (1 to `most` each).
fn config(text: &str, rng: &mut SplitMix64, most: u64) -> Config {
    let mut c = Config::parse(text, std::path::Path::new("/")).unwrap();
    for d in c.datasets.values_mut() {
        let counts: Vec<u64> = (0..d.shards.len()).map(|_| 1 + rng.below(most)).collect();
        d.set_counts(counts.into());
    }
    c
}

fn ids(c: &Config) -> BTreeMap<String, Ids> {
    c.datasets
        .values()
        .map(|d| {
            let ids = Ids::new(d.counts.as_deref().unwrap(), d.shuffle_buffer);
            (d.name.clone(), ids)
        })
        .collect()
}

fn origin(hosts: u32, ranks: u32, positions: Vec<u64>) -> Origin {
    Origin {
        hosts,
        world_size: hosts * ranks,
        num_workers: positions.len() as u32,
        positions,
        from: None,
    }
}

fn run(c: &Config, name: &str, to: (u32, u32, u32), o: &Origin) -> (Replay, Verification) {
    let r = replay(c, name, to, (3, 1), o, &[]).unwrap();
    let v = check(&r, &ids(c), name, o, to.0);
    (r, v)
}

const PLAIN: &str =
    "[datasets.d]\nshards = \"/d/s-{0..40}.tar\"\nshuffle_buffer = 7\nmanifest = \"/d/m.json\"\n";

/// Resizes up, down and sideways, at positions inside windows and at the ends: every one is
/// certified, and the ledger adds up: delivered + read + dropped = the epoch.
#[test]
fn certifies_the_daemons_resizes() {
    let mut rng = SplitMix64::new(11);
    let c = config(PLAIN, &mut rng, 30);
    let cases = [
        ((2, 2, 2), (4, 1, 3)),
        ((4, 1, 2), (2, 2, 1)),
        ((3, 2, 1), (1, 1, 4)),
        ((2, 1, 1), (2, 1, 1)),
    ];
    for ((h0, r0, k0), to) in cases {
        let length = plan::stream_samples(
            c.datasets["d"].counts.as_deref().unwrap(),
            c.datasets["d"].shape(),
            h0,
            &StreamRequest {
                seed: 3,
                epoch: 1,
                rank: 0,
                world_size: h0 * r0,
                worker: 0,
                num_workers: k0,
            },
        )
        .unwrap();
        for positions in [
            vec![0; k0 as usize],
            (0..k0).map(|_| rng.below(length + 1)).collect(),
            vec![length; k0 as usize],
        ] {
            let o = origin(h0, r0, positions);
            let (_, v) = run(&c, "d", to, &o);
            assert!(v.breaches.is_empty(), "{o:?} → {to:?}: {:?}", v.breaches);
            let s = &v.sources[0];
            assert_eq!(s.delivered + s.read + s.unread, s.epoch, "{o:?}");
            assert!(s.unread < (to.0 * to.1) as u64);
            assert_eq!((s.duplicates, s.foreign), (0, 0));
            assert_eq!(v.counts.rank_min, v.counts.rank_max);
        }
    }
}

/// A checkpoint taken during an elastic epoch (a chain): the earlier hop's drop is allowed
/// too, and nothing is read twice.
#[test]
fn certifies_a_resume_of_a_resume() {
    let mut rng = SplitMix64::new(5);
    let c = config(PLAIN, &mut rng, 30);
    let first = origin(2, 2, vec![5, 9]);
    let second = Origin {
        hosts: 3,
        world_size: 3,
        num_workers: 2,
        positions: vec![4, 2],
        from: Some(Box::new(first)),
    };
    let (r, v) = run(&c, "d", (1, 2, 2), &second);
    assert!(v.breaches.is_empty(), "{:?}", v.breaches);
    assert_eq!(r.drop_allowance, 1 + 2);
    let s = &v.sources[0];
    assert_eq!(s.delivered + s.read + s.unread, s.epoch);
}

const MIX: &str = "[datasets.web]\nshards = \"/w/{0..19}.tar\"\nshuffle_buffer = 5\nmanifest = \"/w/m.json\"\n\
                   [datasets.books]\nshards = \"/b/{0..2}.tar\"\nshuffle_buffer = 4\nmanifest = \"/b/m.json\"\n\
                   [datasets.both]\nmix = { web = 3, books = 2 }\nsamples_per_epoch = 40\n";

/// A mix (its small source drawn past its share, so counted per sample, not in bits): every
/// source is checked apart and every new stream keeps the ±1 prefix bound.
#[test]
fn certifies_a_mix_per_source() {
    let mut rng = SplitMix64::new(8);
    let c = config(MIX, &mut rng, 6);
    for to in [(4, 1, 2), (1, 1, 1), (2, 2, 1)] {
        let o = origin(2, 1, vec![13, 21]);
        let (_, v) = run(&c, "both", to, &o);
        assert!(v.breaches.is_empty(), "{to:?}: {:?}", v.breaches);
        assert_eq!(v.sources.len(), 2);
        let b = v.mix_bound.as_ref().unwrap();
        assert_eq!(b.bound, 1);
        assert!(b.worst <= 1.0 && b.worst > 0.0, "{b:?}");
        for s in &v.sources {
            assert_eq!(s.delivered + s.read + s.unread, s.epoch, "{s:?}");
            assert!(s.unread < (to.0 * to.1) as u64, "{s:?}");
        }
    }
}

/// A verifier that cannot fail certifies nothing: a split with one run given to two streams,
/// or one run lost, or a run shifted by one sample, is refused, naming the breach.
#[test]
fn refuses_broken_splits() {
    let mut rng = SplitMix64::new(21);
    let c = config(PLAIN, &mut rng, 30);
    let o = origin(2, 2, vec![6, 11]);
    let to = (4, 1, 2);
    let ids = ids(&c);
    let breaches = |r: &Replay| check(r, &ids, "d", &o, to.0).breaches;

    let (mut r, _) = run(&c, "d", to, &o);
    let twice = r.new[0][0].lanes[0].runs[0].clone();
    r.new[1][0].lanes[0].runs.push(twice);
    let b = breaches(&r);
    assert!(b.iter().any(|b| b.starts_with("duplicate: d:")), "{b:?}");
    assert!(b.iter().any(|b| b.starts_with("count:")), "{b:?}");

    let (mut r, _) = run(&c, "d", to, &o);
    let lost = r.new[2][1].lanes[0].runs.pop().unwrap();
    let b = breaches(&r);
    assert!(b.iter().any(|b| b.starts_with("skip: d:")), "{b:?}");
    assert!(
        b.iter().any(|b| b.contains("runs hold")),
        "lost {lost:?}: {b:?}"
    );

    // Same counts everywhere, one sample off: read twice at one end, never at the other.
    let (mut r, _) = run(&c, "d", to, &o);
    let run0 = &mut r.new[3][0].lanes[0].runs[0];
    assert!(run0.from > 0);
    (run0.from, run0.to) = (run0.from - 1, run0.to.map(|t| t - 1));
    let b = breaches(&r);
    assert!(b.iter().any(|b| b.starts_with("duplicate:")), "{b:?}");
    assert!(!b.iter().any(|b| b.starts_with("count:")), "{b:?}");

    // The old streams credited with 2 samples fewer than the new ones skip: read by nobody.
    let (mut r, _) = run(&c, "d", to, &o);
    r.epoch_delivered
        .iter_mut()
        .for_each(|n| *n = n.saturating_sub(2));
    let b = breaches(&r);
    assert!(b.iter().any(|b| b.starts_with("skip:")), "{b:?}");
}

/// The reads of a run are the samples the stream reader delivers for it: whole streams'
/// ranges and cut windows add up to every sample of the host's epoch once.
#[test]
fn a_runs_samples_are_the_streams_positions() {
    let mut rng = SplitMix64::new(2);
    let c = config(PLAIN, &mut rng, 30);
    let d = &c.datasets["d"];
    let ids = ids(&c);
    let req = StreamRequest {
        seed: 1,
        epoch: 0,
        rank: 0,
        world_size: 1,
        worker: 0,
        num_workers: 1,
    };
    let host = Topology { index: 0, count: 1 };
    let plan = plan::plan_stream(d.shape(), host, &req).unwrap();
    let n = plan.samples.unwrap();
    let mut whole = Vec::new();
    run_ids(&plan, 0, n, &ids["d"], &mut |a, b| whole.extend(a..b));
    for _ in 0..50 {
        let (x, y) = (rng.below(n + 1), rng.below(n + 1));
        let (x, y) = (x.min(y), x.max(y));
        let mut cuts = Vec::new();
        for (a, b) in [(0, x), (x, y), (y, n)] {
            run_ids(&plan, a, b, &ids["d"], &mut |p, q| cuts.extend(p..q));
        }
        let (mut w, mut c) = (whole.clone(), cuts.clone());
        w.sort();
        c.sort();
        assert_eq!(w, c, "{x}..{y}");
    }
}
