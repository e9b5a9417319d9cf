//! Steps two to four of `--verify`: the ledger of samples. Each dataset's runs are turned
//! into sample ids as the stream reader reads them (`run_ids`), then marked in two bitmaps
//! (or counters) per dataset: the epoch, what the old streams delivered, what the new
//! streams read; then tallied. Its own module because the bit-level bookkeeping (`Marks`,
//! what a `Ledger` holds) is private to it: `check` only sees the steps and the
//! `SourceCheck`s they close.

use super::*;
use crate::plan::StreamPlan;
use crate::plan::request::Run;
use crate::plan::shuffle::WindowShuffle;

/// A dataset of the replay: how its samples are numbered, and its shuffle window.
pub struct Ids {
    /// `first[shard]`: samples of the shards before it (the sample id of its sample 0).
    first: Vec<u64>,
    total: u64,
    window: usize,
}

impl Ids {
    pub fn new(counts: &[u64], window: usize) -> Ids {
        let mut at = 0;
        let first = counts
            .iter()
            .map(|&n| {
                at += n;
                at - n
            })
            .collect();
        Ids {
            first,
            total: at,
            window,
        }
    }
}

/// Which samples one dataset's runs mark: bits, or counts once the epoch itself reads a
/// sample more than once.
enum Marks {
    Bits(Vec<u64>),
    Counts(Vec<u16>),
}

impl Marks {
    fn bits(n: u64) -> Marks {
        Marks::Bits(vec![0; n.div_ceil(64) as usize])
    }

    /// Marks samples `a..b`; returns how many were marked already.
    fn range(&mut self, a: u64, b: u64) -> u64 {
        match self {
            Marks::Bits(words) => {
                let mut seen = 0;
                let mut i = a;
                while i < b {
                    let (w, bit) = ((i / 64) as usize, i % 64);
                    let n = (64 - bit).min(b - i);
                    let mask = if n == 64 {
                        u64::MAX
                    } else {
                        ((1u64 << n) - 1) << bit
                    };
                    seen += (words[w] & mask).count_ones() as u64;
                    words[w] |= mask;
                    i += n;
                }
                seen
            }
            Marks::Counts(c) => {
                let mut seen = 0;
                for x in &mut c[a as usize..b as usize] {
                    seen += u64::from(*x > 0);
                    *x = x.saturating_add(1);
                }
                seen
            }
        }
    }
}

/// One dataset's ledger: what the epoch holds, and what was delivered or read.
pub(super) struct Ledger {
    expected: Marks,
    got: Marks,
    check: SourceCheck,
}

/// Positions `a..b` of base stream `plan` (a run of it), as `(first id, last id + 1)`
/// ranges, each window cut by `a` or `b` permuted as the stream reader permutes it.
pub(crate) fn run_ids(plan: &StreamPlan, a: u64, b: u64, ids: &Ids, out: &mut dyn FnMut(u64, u64)) {
    if a >= b {
        return;
    }
    let run = Run {
        plan: plan.clone(),
        from: a,
        to: Some(b),
    };
    let pieces = crate::serve::stream::run_pieces(&run, ids.window);
    let length = plan.samples.expect("a manifest plan knows its length");
    let window_at = |p: u64| {
        let mut w = WindowShuffle::new(plan.stream_key, ids.window);
        let start = w.seek(p);
        let len = (w.next_len() as u64).min(length - start);
        (w, start, len)
    };
    let (_, first, _) = window_at(a);
    // The pieces hold the stream's positions from `first` on: offsets of `first`.
    let mut ends = Vec::with_capacity(pieces.len());
    let mut at = 0;
    for p in &pieces {
        at += p.end.expect("bounded") - p.start;
        ends.push(at);
    }
    let seq = |lo: u64, hi: u64, out: &mut dyn FnMut(u64, u64)| {
        let mut i = ends.partition_point(|&e| e <= lo - first);
        let mut x = lo - first;
        while x < hi - first {
            let p = &pieces[i];
            let start = ends[i] - (p.end.unwrap() - p.start);
            let y = ends[i].min(hi - first);
            let id = ids.first[p.shard] + p.start + (x - start);
            out(id, id + (y - x));
            (x, i) = (y, i + 1);
        }
    };
    let cut = |p: u64, lo: u64, hi: u64, out: &mut dyn FnMut(u64, u64)| {
        let (mut w, start, len) = window_at(p);
        if lo == start && hi == start + len {
            return seq(lo, hi, out);
        }
        let mut window = Vec::with_capacity(len as usize);
        seq(start, start + len, &mut |x, y| window.extend(x..y));
        w.permute(&mut window);
        for &id in &window[(lo - start) as usize..(hi - start) as usize] {
            out(id, id + 1);
        }
    };
    let (_, hs, hl) = window_at(a);
    if b <= hs + hl {
        return cut(a, a, b, out);
    }
    cut(a, a, hs + hl, out);
    let (_, ts, _) = window_at(b - 1);
    seq(hs + hl, ts, out);
    cut(b - 1, ts, b, out);
}

/// The runs of each lane a stream's positions `0..n` take: `(lane, run, from, to)`.
fn prefix(plan: &Plan, n: u64) -> Vec<(usize, &Run, u64, u64)> {
    let per_lane: Vec<u64> = match &plan.mix {
        Some(i) => i.mix.counts_at(i.key, n),
        None => vec![n],
    };
    let mut out = Vec::new();
    for (l, (lane, &want)) in plan.lanes.iter().zip(&per_lane).enumerate() {
        let mut left = want;
        for run in &lane.runs {
            let len = run.len().expect("a manifest run has an end");
            let k = len.min(left);
            if k > 0 {
                out.push((l, run, run.from, run.from + k));
            }
            left -= k;
        }
    }
    out
}

pub(super) fn lane_len(runs: &[Run]) -> u64 {
    runs.iter().map(|r| r.len().unwrap_or(0)).sum()
}

pub(super) type Ledgers<'a> = BTreeMap<&'a str, Ledger>;

/// An empty ledger per dataset, in bits.
pub(super) fn ledgers(ids: &BTreeMap<String, Ids>, drop_allowance: u64) -> Ledgers<'_> {
    ids.iter()
        .map(|(name, d)| {
            let check = SourceCheck {
                dataset: name.clone(),
                epoch: 0,
                delivered: 0,
                read: 0,
                duplicates: 0,
                foreign: 0,
                unread: 0,
                drop_allowance,
            };
            let ledger = Ledger {
                expected: Marks::bits(d.total),
                got: Marks::bits(d.total),
                check,
            };
            (name.as_str(), ledger)
        })
        .collect()
}

/// The epoch: every base stream whole. A dataset whose epoch reads a sample twice is marked
/// again, with counters.
pub(super) fn mark_epoch(r: &Replay, ids: &BTreeMap<String, Ids>, ledgers: &mut Ledgers) {
    let mut repeated = mark_epoch_of(r, ids, ledgers, None);
    repeated.sort();
    repeated.dedup();
    for name in &repeated {
        let l = ledgers.get_mut(name.as_str()).unwrap();
        let n = ids[name].total as usize;
        (l.expected, l.got) = (Marks::Counts(vec![0; n]), Marks::Counts(vec![0; n]));
        l.check.epoch = 0;
        mark_epoch_of(r, ids, ledgers, Some(name));
    }
}

/// Marks the epoch's samples of every dataset (or `only` one); returns the datasets whose
/// epoch marked a sample already marked.
fn mark_epoch_of(
    r: &Replay,
    ids: &BTreeMap<String, Ids>,
    ledgers: &mut Ledgers,
    only: Option<&str>,
) -> Vec<String> {
    let mut repeated = Vec::new();
    for plan in &r.epoch {
        for lane in &plan.lanes {
            if only.is_some_and(|o| o != lane.dataset) {
                continue;
            }
            let l = ledgers
                .get_mut(lane.dataset.as_str())
                .expect("a known dataset");
            let d = &ids[&lane.dataset];
            let mut again = 0;
            for run in &lane.runs {
                let to = run.to.unwrap_or(0);
                run_ids(&run.plan, run.from, to, d, &mut |a, b| {
                    again += l.expected.range(a, b)
                });
                l.check.epoch += to - run.from;
            }
            if again > 0 {
                repeated.push(lane.dataset.clone());
            }
        }
    }
    repeated
}

/// What the old streams delivered: the base epoch's streams and each later hop's, up to
/// their checkpoint positions.
pub(super) fn mark_delivered(r: &Replay, ids: &BTreeMap<String, Ids>, ledgers: &mut Ledgers) {
    let hops = r.epoch.iter().zip(&r.epoch_delivered);
    for (plan, n) in hops.chain(r.delivered.iter().map(|(p, n)| (p, n))) {
        for (lane, run, a, b) in prefix(plan, *n) {
            let name = plan.lanes[lane].dataset.as_str();
            let l = ledgers.get_mut(name).unwrap();
            run_ids(&run.plan, a, b, &ids[name], &mut |x, y| {
                l.check.duplicates += l.got.range(x, y)
            });
            l.check.delivered += b - a;
        }
    }
}

/// What the new streams read: marked in the ledgers, with their counts per rank and worker
/// and, for a mix, the prefix bound, each breach of those named.
pub(super) fn read_new(
    r: &Replay,
    ids: &BTreeMap<String, Ids>,
    ledgers: &mut Ledgers,
    breaches: &mut Vec<String>,
) -> (Counts, Option<MixBound>) {
    let (ranks, workers) = (r.ranks as usize, r.workers as usize);
    let mut rank_totals = Vec::new();
    let mut per_worker = vec![(u64::MAX, 0u64); workers];
    let mut bound: Option<MixBound> = None;
    for (h, host) in r.new.iter().enumerate() {
        for (s, plan) in host.iter().enumerate() {
            let who = || {
                format!(
                    "host {h}, rank {}, worker {}",
                    h * ranks + s / workers,
                    s % workers
                )
            };
            let samples = plan.samples.unwrap_or(0);
            let held: u64 = plan.lanes.iter().map(|l| lane_len(&l.runs)).sum();
            if held != samples {
                breaches.push(format!(
                    "count: {}: its runs hold {held} samples, its plan says {samples}",
                    who()
                ));
            }
            if s % workers == 0 {
                rank_totals.push(0);
            }
            *rank_totals.last_mut().unwrap() += held;
            let w = &mut per_worker[s % workers];
            *w = (w.0.min(held), w.1.max(held));
            for lane in &plan.lanes {
                let l = ledgers.get_mut(lane.dataset.as_str()).unwrap();
                for run in &lane.runs {
                    let to = run.to.unwrap_or(run.from);
                    run_ids(&run.plan, run.from, to, &ids[&lane.dataset], &mut |x, y| {
                        l.check.duplicates += l.got.range(x, y)
                    });
                    l.check.read += to - run.from;
                }
            }
            check_mix(plan, &who, &mut bound, breaches);
        }
    }
    let counts = Counts {
        rank_min: rank_totals.iter().copied().min().unwrap_or(0),
        rank_max: rank_totals.iter().copied().max().unwrap_or(0),
        workers: per_worker.into_iter().map(|(a, b)| (a.min(b), b)).collect(),
    };
    if counts.rank_min != counts.rank_max {
        breaches.push(format!(
            "count: the new ranks get from {} to {} samples, not all the same",
            counts.rank_min, counts.rank_max
        ));
    }
    for (w, &(a, b)) in counts.workers.iter().enumerate() {
        if a != b {
            breaches.push(format!(
                "count: worker {w} gets from {a} to {b} samples across the ranks"
            ));
        }
    }
    (counts, bound)
}

/// Each dataset's tally, with its duplicates, foreign reads and skips past the allowance
/// named.
pub(super) fn close(ledgers: Ledgers, breaches: &mut Vec<String>) -> Vec<SourceCheck> {
    let mut sources = Vec::new();
    for (name, mut l) in ledgers {
        let (foreign, unread, dup) = tally(&l.expected, &l.got);
        let c = &mut l.check;
        c.foreign = foreign;
        c.unread = unread;
        if let Some(d) = dup {
            c.duplicates = d;
        }
        if c.duplicates > 0 {
            breaches.push(format!(
                "duplicate: {name}: {} reads of samples already delivered or read",
                c.duplicates
            ));
        }
        if c.foreign > 0 {
            breaches.push(format!(
                "foreign: {name}: {} samples read that are not in the epoch",
                c.foreign
            ));
        }
        if c.unread > c.drop_allowance {
            breaches.push(format!(
                "skip: {name}: {} samples of the epoch are neither delivered nor read, more than \
                 the {} a resume may drop (fewer than the world size)",
                c.unread, c.drop_allowance
            ));
        }
        sources.push(l.check);
    }
    sources
}

/// (foreign, unread, duplicates when counted here) of a ledger.
fn tally(expected: &Marks, got: &Marks) -> (u64, u64, Option<u64>) {
    match (expected, got) {
        (Marks::Bits(e), Marks::Bits(g)) => {
            let (mut foreign, mut unread) = (0, 0);
            for (e, g) in e.iter().zip(g) {
                foreign += (g & !e).count_ones() as u64;
                unread += (e & !g).count_ones() as u64;
            }
            (foreign, unread, None)
        }
        (Marks::Counts(e), Marks::Counts(g)) => {
            let (mut foreign, mut unread, mut dup) = (0, 0, 0);
            for (&e, &g) in e.iter().zip(g) {
                let (e, g) = (e as u64, g as u64);
                if e == 0 {
                    foreign += g;
                } else if g > e {
                    dup += g - e;
                } else {
                    unread += e - g;
                }
            }
            (foreign, unread, Some(dup))
        }
        _ => unreachable!("a ledger's marks are of one kind"),
    }
}
