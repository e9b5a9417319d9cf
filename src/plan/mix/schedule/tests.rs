use super::*;
use crate::config::ScheduleFrom::{Epoch, Sample};
use crate::plan::shuffle::SplitMix64;

fn depth(k: usize) -> u64 {
    (k as u64).next_power_of_two().trailing_zeros() as u64
}

/// A random mix with a random `at` schedule, and a random job size.
fn random_case(rng: &mut SplitMix64) -> (MixDataset, u128) {
    let k = 2 + rng.below(3) as usize;
    let weights = |rng: &mut SplitMix64| (0..k).map(|_| 1 + rng.below(9)).collect::<Vec<_>>();
    let e = 1 + rng.below(300);
    let streams = 1 + rng.below(16);
    let mut at = 0;
    let schedule = (0..rng.below(6))
        .map(|_| {
            at += 1 + rng.below(2 * e * streams);
            (Sample(at), weights(rng))
        })
        .collect();
    (mix_of(&weights(rng), e, schedule), streams as u128)
}

#[test]
fn an_at_entry_starts_at_the_first_step_the_job_has_read_that_many() {
    // 8 streams, 10 samples per stream and epoch: the job reads 80 an epoch, 8 a step.
    let m = mix_of(
        &[3, 1],
        10,
        vec![(Sample(100), vec![1, 1]), (Sample(160), vec![1, 3])],
    );
    // Epoch 0: one segment. Epoch 1 (samples 80..160): at = 100 is step 13, position 3.
    assert_eq!(m.epoch_mix(0, 8).segments().len(), 1);
    let epoch1 = m.epoch_mix(1, 8);
    let starts: Vec<(u64, usize, Vec<u64>)> = (epoch1.segments().iter())
        .map(|s| (s.start, s.entry, s.weights.clone()))
        .collect();
    assert_eq!(starts, [(0, 0, vec![3, 1]), (3, 1, vec![1, 1])]);
    // at = 160 is step 20: epoch 2's start, one segment.
    let epoch2 = m.epoch_mix(2, 8);
    assert_eq!(epoch2.segments().len(), 1);
    assert_eq!(epoch2.segments()[0].entry, 2);
    // A job of 16 streams reaches both entries in epoch 0 (160 samples an epoch): steps 7
    // and 10 = E, the next epoch's start.
    let wide = m.epoch_mix(0, 16);
    assert_eq!(
        wide.segments().iter().map(|s| s.start).collect::<Vec<_>>(),
        [0, 7]
    );
    assert_eq!(m.epoch_mix(1, 16).segments()[0].entry, 2);
    // Two entries on the same step: the later one is in force, the first has no position.
    let m = mix_of(
        &[1, 1],
        10,
        vec![(Sample(17), vec![2, 1]), (Sample(20), vec![3, 1])],
    );
    let segs = m.epoch_mix(0, 8);
    assert_eq!(
        (segs.segments().iter())
            .map(|s| (s.start, s.entry))
            .collect::<Vec<_>>(),
        [(0, 0), (3, 2)]
    );
}

#[test]
fn each_segment_holds_the_prefix_bound_from_its_start_and_its_quotas() {
    let mut rng = SplitMix64::new(26);
    let mut several = 0;
    for case in 0..300 {
        let (m, streams) = random_case(&mut rng);
        let epoch = rng.below(4);
        let mix = m.epoch_mix(epoch, streams);
        let key = rng.next_u64();
        let labels: Vec<usize> = mix.cursor(key, 0).collect();
        assert_eq!(labels.len() as u64, m.samples_per_epoch, "case {case}");
        // The last segment ends where the epoch does (its bound is checked to there).
        assert_eq!(mix.epoch_len(), labels.len() as u64, "case {case}");
        several += (mix.segments().len() > 1) as usize;
        let mut total = vec![0u64; m.sources.len()];
        for (j, s) in mix.segments().iter().enumerate() {
            let end = mix
                .segments()
                .get(j + 1)
                .map_or(mix.epoch_len(), |n| n.start);
            let w: u128 = s.weights.iter().map(|&w| w as u128).sum();
            let mut counts = vec![0u64; s.weights.len()];
            for (n, &label) in labels[s.start as usize..end as usize].iter().enumerate() {
                counts[label] += 1;
                for (c, &wi) in counts.iter().zip(&s.weights) {
                    let off = (*c as u128 * w).abs_diff(wi as u128 * (n as u128 + 1));
                    assert!(
                        off <= depth(s.weights.len()) as u128 * w,
                        "case {case}: segment {j} prefix {n}: {counts:?} by {:?}",
                        s.weights
                    );
                }
            }
            assert_eq!(counts, s.mix.quotas(), "case {case}: segment {j}");
            for (t, c) in total.iter_mut().zip(counts) {
                *t += c;
            }
        }
        assert_eq!(total, mix.quotas(), "case {case}");
        assert_eq!(mix.quotas(), m.quotas(epoch, streams));
    }
    assert!(
        several > 30,
        "{several} of 300 epochs had more than one segment"
    );
}

#[test]
fn counts_and_cursors_agree_with_the_labels_at_every_position() {
    let mut rng = SplitMix64::new(27);
    for case in 0..100 {
        let (m, streams) = random_case(&mut rng);
        let mix = m.epoch_mix(rng.below(3), streams);
        let key = rng.next_u64();
        let labels: Vec<usize> = mix.cursor(key, 0).collect();
        let mut counts = vec![0u64; m.sources.len()];
        for t in 0..=labels.len() {
            assert_eq!(mix.counts_at(key, t as u64), counts, "case {case} at {t}");
            if t % 7 == 0 || t + 1 >= labels.len() {
                // A cursor from t: the labels from t, how many are left at each step, and the
                // schedule entry of each label's segment.
                let mut cursor = mix.cursor(key, t as u64);
                let mut rest = Vec::new();
                loop {
                    let (p, left) = (t + rest.len(), labels.len() - t - rest.len());
                    assert_eq!(
                        cursor.size_hint(),
                        (left, Some(left)),
                        "case {case}: at {p}"
                    );
                    let Some(label) = cursor.next() else { break };
                    let segment = mix
                        .segments()
                        .iter()
                        .rev()
                        .find(|s| s.start <= p as u64)
                        .unwrap();
                    assert_eq!(
                        cursor.entry(),
                        segment.entry,
                        "case {case}: the entry at {p}"
                    );
                    rest.push(label);
                }
                assert_eq!(rest, labels[t..], "case {case}: a cursor from {t}");
            }
            if let Some(&label) = labels.get(t) {
                counts[label] += 1;
            }
        }
    }
}

#[test]
fn each_source_starts_an_epoch_where_its_earlier_epochs_left_it() {
    let mut rng = SplitMix64::new(28);
    for case in 0..200 {
        let (m, streams) = random_case(&mut rng);
        let host_streams = 1 + rng.below(4) as u128;
        let mut at = vec![0u128; m.sources.len()];
        for epoch in 0..12 {
            for (i, a) in at.iter_mut().enumerate() {
                assert_eq!(
                    m.epoch_base(i, epoch, streams, host_streams),
                    Some(*a),
                    "case {case}: source {i}, epoch {epoch}"
                );
            }
            for (a, q) in at.iter_mut().zip(m.quotas(epoch, streams)) {
                *a += q as u128 * host_streams;
            }
        }
    }
    // Epoch entries, as before segments: the weights change at the epochs' starts.
    let m = mix_of(
        &[1, 1],
        10,
        vec![(Epoch(2), vec![3, 1]), (Epoch(5), vec![1, 4])],
    );
    assert_eq!(
        m.epoch_base(0, 7, 99, 3),
        Some(2 * 5 * 3 + 3 * 8 * 3 + 2 * 2 * 3)
    );
    assert_eq!(
        m.epoch_base(1, u64::MAX, 99, 1 << 70).map(|_| ()),
        None,
        "past u128"
    );
}

#[test]
fn an_epoch_of_one_segment_orders_as_its_mix() {
    // Schedules of epochs (and no schedule) order as they did before segments: golden.
    let m = mix_of(&[1, 2], 12, vec![(Epoch(1), vec![1, 1])]);
    let key = crate::plan::shuffle::key(&[1, 2, 3]);
    for epoch in 0..2 {
        let mix = m.epoch_mix(epoch, 5);
        let weights = &mix.segments()[0].weights;
        let plain = Mix::new(weights, 12).unwrap();
        assert_eq!(
            mix.cursor(key, 0).collect::<Vec<_>>(),
            plain.cursor(key, 0).collect::<Vec<_>>()
        );
    }
}

#[test]
fn golden_a_segment_inside_an_epoch() {
    // Pinned: the order of a mixed stream is a protocol-level promise (a resume reads what
    // an unbroken run would have). 4 streams, 12 per epoch; at = 20 starts at position 5.
    let m = mix_of(&[3, 1], 12, vec![(Sample(20), vec![1, 2])]);
    let mix = m.epoch_mix(0, 4);
    let key = crate::plan::shuffle::key(&[7, 0, 0]);
    let labels: Vec<usize> = mix.cursor(key, 0).collect();
    assert_eq!(labels, GOLDEN);
    assert_eq!(mix.quotas(), [4 + 2, 1 + 5]);
}

const GOLDEN: [usize; 12] = [0, 0, 0, 1, 0, 1, 0, 1, 1, 1, 1, 0];
