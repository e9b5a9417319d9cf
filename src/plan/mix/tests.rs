use super::*;

fn rng_weights(rng: &mut SplitMix64, k: usize, max: u64) -> Vec<u64> {
    (0..k).map(|_| 1 + rng.below(max)).collect()
}

fn depth(k: usize) -> u64 {
    (k as u64).next_power_of_two().trailing_zeros() as u64
}

/// Max over prefixes and sources of |count_i(n)·W − w_i·n|, in units of W (rounded up).
fn prefix_error(weights: &[u64], labels: impl Iterator<Item = usize>) -> u64 {
    let total: u128 = weights.iter().map(|&w| w as u128).sum();
    let mut counts = vec![0u128; weights.len()];
    let mut worst = 0u128;
    for (n, label) in labels.enumerate() {
        counts[label] += 1;
        let n = n as u128 + 1;
        for (c, &w) in counts.iter().zip(weights) {
            worst = worst.max((c * total).abs_diff(w as u128 * n));
        }
    }
    worst.div_ceil(total) as u64
}

/// The quotas by the definition, independently of `Mix`.
fn tree_quotas(weights: &[u64], e: u64) -> Vec<u64> {
    if weights.len() == 1 {
        return vec![e];
    }
    let half = weights.len().div_ceil(2);
    let wl: u128 = weights[..half].iter().map(|&w| w as u128).sum();
    let wt: u128 = weights.iter().map(|&w| w as u128).sum();
    let a = ((2 * e as u128 * wl + wt) / (2 * wt)) as u64;
    let mut q = tree_quotas(&weights[..half], a);
    q.extend(tree_quotas(&weights[half..], e - a));
    q
}

#[test]
fn draws_are_splitmix_below() {
    let mut rng = SplitMix64::new(8);
    for n in [1, 2, 3, 10, 1000, u64::MAX / 3 * 2, u64::MAX] {
        let seed = rng.next_u64();
        let (mut a, mut b) = (SplitMix64::new(seed), SplitMix64::new(seed));
        for _ in 0..1000 {
            assert_eq!(below(&mut a, n, n.wrapping_neg() % n), b.below(n));
        }
    }
}

#[test]
fn rejects_bad_weights() {
    assert_eq!(Mix::new(&[5], 10).err(), Some(MixError::TooFewSources(1)));
    assert_eq!(Mix::new(&[], 10).err(), Some(MixError::TooFewSources(0)));
    assert_eq!(
        Mix::new(&[1, 0, 2], 10).err(),
        Some(MixError::ZeroWeight(1))
    );
    assert_eq!(
        Mix::new(&[u64::MAX, 1], 10).err(),
        Some(MixError::WeightOverflow)
    );
    assert!(Mix::new(&[u64::MAX - 1, 1], 10).is_ok());
}

#[test]
fn quotas_sum_to_e_and_follow_the_tree() {
    let mut rng = SplitMix64::new(1);
    assert_eq!(quotas(&[1, 1], 3).unwrap(), vec![2, 1]); // 1.5 rounds up
    assert_eq!(quotas(&[1, 2, 1], 8).unwrap(), vec![2, 4, 2]);
    for _ in 0..2000 {
        let k = 2 + rng.below(7) as usize;
        let max = 1 + rng.below(1000);
        let weights = rng_weights(&mut rng, k, max);
        let bits = rng.below(40) + 1;
        let e = rng.below(1 << bits);
        let q = quotas(&weights, e).unwrap();
        assert_eq!(q.iter().sum::<u64>(), e);
        assert_eq!(q, tree_quotas(&weights, e), "{weights:?} {e}");
        let total: u128 = weights.iter().map(|&w| w as u128).sum();
        for (&a, &w) in q.iter().zip(&weights) {
            let err = (a as u128 * total).abs_diff(w as u128 * e as u128);
            assert!(err <= depth(k) as u128 * total, "{weights:?} {e} {q:?}");
        }
    }
}

/// Every node's walk over whole epochs, small blocks so pins are everywhere: the walk
/// never runs out of moves (the debug_asserts in `walk`), stays within 1 of w·t, and
/// reaches every pin.
#[test]
fn every_walk_stays_within_one_and_hits_its_pins() {
    for wt in 2..=13u64 {
        for wl in 1..wt {
            for shift in [0, 2, 3, 5] {
                for len in (0..120).chain([299, 1000, 1023, 1024, 1025]) {
                    let mix = Mix::with_shift(&[wl, wt - wl], len, shift).unwrap();
                    let Kind::Split(sp) = mix.nodes[0].kind else {
                        unreachable!()
                    };
                    let mut c = 0u64;
                    for (t, label) in mix.cursor(wt * 1000 + wl, 0).enumerate() {
                        let t = t as u64 + 1;
                        c += u64::from(label == 0);
                        assert!((c * wt).abs_diff(wl * t) <= wt, "{wl}/{wt} {len} {t}");
                        if t.is_multiple_of(1 << shift) || t == len {
                            assert_eq!(c, sp.ideal(len, t));
                        }
                    }
                    assert_eq!(c, sp.a);
                }
            }
        }
    }
}

#[test]
fn prefix_bound_over_random_weights() {
    let mut rng = SplitMix64::new(2);
    for round in 0..150 {
        let k = 2 + round % 5;
        let weights = rng_weights(&mut rng, k, 1000);
        let e = rng.below(50_001);
        let shift = if round % 3 == 0 { 4 } else { BLOCK_SHIFT };
        let mix = Mix::with_shift(&weights, e, shift).unwrap();
        for stream in 0..3 {
            let err = prefix_error(&weights, mix.cursor(stream, 0));
            assert!(err <= depth(k), "{weights:?} {e}: {err}");
        }
    }
    // Skewed and huge weights.
    for weights in [
        vec![1, 1_000_000],
        vec![u64::MAX / 2, u64::MAX / 2],
        vec![1, u64::MAX - 1],
        vec![3, 1, 4, 1, 5, 9, 2, 6],
    ] {
        let mix = Mix::new(&weights, 20_000).unwrap();
        let err = prefix_error(&weights, mix.cursor(9, 0));
        assert!(err <= depth(weights.len()), "{weights:?}: {err}");
    }
}

#[test]
fn counts_match_the_cursor_everywhere_on_small_epochs() {
    for (weights, e, shift) in [
        (vec![1, 1], 5000, BLOCK_SHIFT),
        (vec![3, 7, 2], 4100, BLOCK_SHIFT),
        (vec![5, 1, 1, 9, 2], 3000, 3),
        (vec![1, 2], 1, 2),
    ] {
        let mix = Mix::with_shift(&weights, e, shift).unwrap();
        let labels: Vec<usize> = mix.cursor(77, 0).collect();
        assert_eq!(labels.len() as u64, e);
        // A cursor from anywhere knows how many labels are left, at every step.
        for from in [0, e / 3, e - 1, e] {
            let mut cursor = mix.cursor(77, from);
            for left in (0..=(e - from) as usize).rev() {
                assert_eq!(
                    cursor.size_hint(),
                    (left, Some(left)),
                    "{weights:?} from {from}"
                );
                assert_eq!(cursor.next().is_some(), left > 0);
            }
        }
        let mut counts = vec![0; weights.len()];
        for t in 0..=e {
            assert_eq!(mix.counts_at(77, t), counts, "{weights:?} t {t}");
            if t < e {
                counts[labels[t as usize]] += 1;
            }
        }
        assert_eq!(counts, mix.quotas());
    }
}

#[test]
fn cursor_resumes_anywhere_on_a_large_epoch() {
    let weights = [5, 3, 2, 8];
    let e = 10_000_000;
    let mix = Mix::new(&weights, e).unwrap();
    let labels: Vec<u8> = mix.cursor(123, 0).map(|l| l as u8).collect();
    assert_eq!(labels.len() as u64, e);
    let mut rng = SplitMix64::new(3);
    for n in 0..40 {
        let from = if n == 0 { e - 1 } else { rng.below(e) };
        let resumed: Vec<u8> = mix.cursor(123, from).take(3000).map(|l| l as u8).collect();
        let end = (from as usize + 3000).min(labels.len());
        assert_eq!(resumed, labels[from as usize..end], "from {from}");
        let mut counts = vec![0u64; 4];
        for &l in &labels[..from as usize] {
            counts[l as usize] += 1;
        }
        assert_eq!(mix.counts_at(123, from), counts, "at {from}");
    }
    assert_eq!(mix.cursor(123, e).next(), None);
}

#[test]
fn deterministic_and_keyed() {
    let mix = Mix::new(&[2, 3, 5], 100_000).unwrap();
    let a: Vec<usize> = mix.cursor(1, 0).collect();
    assert_eq!(
        a,
        Mix::new(&[2, 3, 5], 100_000)
            .unwrap()
            .cursor(1, 0)
            .collect::<Vec<_>>()
    );
    let b: Vec<usize> = mix.cursor(2, 0).collect();
    assert_ne!(a[..64], b[..64]);
    let same = a.iter().zip(&b).filter(|(x, y)| x == y).count();
    assert!(same < 90_000, "{same}");
    assert_eq!(mix.counts_at(1, 100_000), mix.counts_at(2, 100_000));
}

#[test]
fn not_periodic() {
    for weights in [vec![1, 1], vec![1, 3], vec![1, 1, 1, 1]] {
        let labels: Vec<usize> = Mix::new(&weights, 20_000).unwrap().cursor(5, 0).collect();
        for p in 1..=4096 {
            assert!(
                (0..labels.len() - p).any(|t| labels[t] != labels[t + p]),
                "{weights:?} period {p}"
            );
        }
    }
}

#[test]
fn tiny_epochs() {
    let mix = Mix::new(&[1, 1, 1, 1, 1], 0).unwrap();
    assert_eq!(mix.quotas(), [0; 5]);
    assert_eq!(mix.cursor(0, 0).next(), None);
    assert_eq!(mix.counts_at(0, 0), vec![0; 5]);
    for e in 1..5 {
        let mix = Mix::new(&[1, 1, 1, 1, 1], e).unwrap();
        assert_eq!(mix.quotas().iter().sum::<u64>(), e);
        let labels: Vec<usize> = mix.cursor(0, 0).collect();
        assert_eq!(labels.len() as u64, e);
        let mut counts = vec![0; 5];
        for &l in &labels {
            counts[l] += 1;
        }
        assert_eq!(counts, mix.quotas());
    }
}

#[test]
fn huge_epochs_count_fast() {
    let weights = [7, 1, 3, 3, 100, 2];
    let e = 1 << 40;
    let mix = Mix::new(&weights, e).unwrap();
    let total: u128 = weights.iter().map(|&w| w as u128).sum();
    let mut rng = SplitMix64::new(4);
    let start = std::time::Instant::now();
    for n in 0..200 {
        let t = if n == 0 { e } else { rng.below(e + 1) };
        let counts = mix.counts_at(n, t);
        assert_eq!(counts.iter().sum::<u64>(), t);
        for (&c, &w) in counts.iter().zip(&weights) {
            let err = (c as u128 * total).abs_diff(w as u128 * t as u128);
            assert!(err <= 3 * total, "{t} {counts:?}");
        }
        // The resumed cursor agrees with the counts a few steps on.
        if n % 20 == 0 && t + 100 <= e {
            let mut expect = counts;
            for l in mix.cursor(n, t).take(100) {
                expect[l] += 1;
            }
            assert_eq!(mix.counts_at(n, t + 100), expect);
        }
    }
    assert!(start.elapsed().as_secs() < 20, "{:?}", start.elapsed());
}

#[test]
fn golden_vectors() {
    // Changing these is a protocol change: every stream of a mixed dataset moves.
    /// Weights, E, stream key, first labels, quotas, counts at 10^6.
    type Golden = (
        &'static [u64],
        u64,
        u64,
        [u8; 64],
        &'static [u64],
        &'static [u64],
    );
    let golden: [Golden; 2] = [
        (
            &[1, 1],
            2_000_000,
            0xfeed,
            [
                1, 0, 0, 0, 1, 0, 1, 1, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1, 0, 1, 0, 0, 0, 0, 1, 0, 1, 0,
                1, 0, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 0, 1, 0, 1, 0, 0, 0, 1, 1, 0, 1, 0, 0, 1, 1, 1,
                0, 1, 0, 0, 0, 0, 1, 0,
            ],
            &[1_000_000, 1_000_000],
            &[500_001, 499_999],
        ),
        (
            &[7, 11, 13, 2],
            3_000_001,
            42,
            [
                1, 1, 2, 2, 2, 0, 2, 0, 1, 2, 3, 1, 1, 0, 0, 2, 2, 3, 1, 2, 1, 0, 2, 1, 2, 0, 1, 0,
                2, 1, 2, 1, 2, 2, 1, 0, 2, 2, 0, 2, 1, 3, 1, 2, 0, 1, 0, 2, 1, 1, 3, 2, 1, 1, 0, 2,
                0, 2, 1, 2, 0, 2, 2, 1,
            ],
            &[636_364, 1_000_000, 1_181_819, 181_818],
            &[212_121, 333_334, 393_940, 60_605],
        ),
    ];
    for (weights, e, stream, first, quotas, counts) in golden {
        let mix = Mix::new(weights, e).unwrap();
        let labels: Vec<u8> = mix.cursor(stream, 0).take(64).map(|l| l as u8).collect();
        assert_eq!(labels, first, "{weights:?}");
        assert_eq!(mix.quotas(), quotas, "{weights:?}");
        assert_eq!(mix.counts_at(stream, 1_000_000), counts, "{weights:?}");
    }
}

/// CPU time of this thread (the machine is shared: wall time says little).
fn cpu_ns() -> u64 {
    let stat = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap();
    stat.split_whitespace().next().unwrap().parse().unwrap()
}

/// `cargo test --release --lib mix::tests::speed -- --ignored --nocapture`
#[test]
#[ignore]
fn speed() {
    let mix = Mix::new(&[1, 1], 1 << 40).unwrap();
    let mut dirs = vec![0; BLOCK as usize];
    let cpu = cpu_ns();
    let sum: u64 = (0..100_000)
        .map(|j| mix.walk(0, 1, j, BLOCK, Some(&mut dirs)))
        .sum();
    let cpu = (cpu_ns() - cpu) as f64 / 1e9;
    println!("walk: {:.1} M steps/s of CPU time ({sum})", 102.4 / cpu);
    for weights in [
        vec![1, 1],
        vec![5, 3, 2],
        vec![5, 3, 2, 8],
        vec![1, 2, 3, 4, 5, 6],
        vec![1, 2, 3, 4, 5, 6, 7, 8],
    ] {
        let mix = Mix::new(&weights, 100_000_000).unwrap();
        let (wall, cpu) = (std::time::Instant::now(), cpu_ns());
        let sum: usize = mix.cursor(1, 0).sum();
        let cpu = (cpu_ns() - cpu) as f64 / 1e9;
        let wall = wall.elapsed().as_secs_f64();
        println!(
            "{weights:?}: {:.1} M labels/s of CPU time, {:.1} M/s wall ({sum})",
            100.0 / cpu,
            100.0 / wall
        );
    }
}
