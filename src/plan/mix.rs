//! Mixing sources: which dataset each position of a mixed stream reads from.
//!
//! A mixed stream interleaves k ≥ 2 sources with integer weights w_i. For an epoch of E
//! positions this module decides the source of every position so that
//! 1. source i gets exactly A_i positions ([`quotas`]), the same for every stream and epoch;
//! 2. every prefix is balanced: among positions `0..n`, source i has within ±d of
//!    `w_i·n/Σw` samples, d = ⌈log2 k⌉ (±1 for two sources);
//! 3. the order looks random and is a pure function of (stream key, weights, E);
//! 4. the counts at any position cost O(k·B) (B = [`BLOCK`]), so a resume never replays the
//!    epoch, and a [`Cursor`] labels positions a block at a time.
//!
//! **Tree.** The source list (in the given order) is split into its first ⌈k/2⌉ sources and the
//! rest, recursively, down to single sources: depth ⌈log2 k⌉. An internal node with left weight
//! WL and total WT (w = WL/WT, 0 < w < 1) handles `len` positions (the root: E) and sends
//! `a = round(len·w)` (half up) of them left, `len − a` right; a leaf's quota is its `len`.
//!
//! **A node's walk.** The node sees its own steps `0..len` in order; c(t) is how many of the
//! first t went left. It keeps |c(t) − w·t| ≤ 1, ends at c(len) = a, and moves by 0 or 1 per
//! step. Every B steps it is pinned to `ideal(t) = clamp(round(w·t), a − (len − t), a)`
//! (within 1/2 of w·t and from where a stays reachable), so each block's walk depends on its
//! start alone. Inside a block ending at t1 with pin c1, the walk may be at c at step t iff
//! `L(t) ≤ c ≤ U(t)`, `L(t) = max(⌈w·t − 1⌉, c1 − (t1 − t))`, `U(t) = min(⌊w·t + 1⌋, c1)`; when
//! both moves are allowed it goes left with probability w: every step draws
//! `below(WT) < WL` from a SplitMix64 keyed by (stream key, node, block), used only then.
//!
//! *Why a move always exists:* L and U never decrease and rise by at most 1 per step (w < 1),
//! and L ≤ U everywhere (`⌈x − 1⌉ ≤ ⌊x + 1⌋`; `c1 ≥ w·t1 − 1/2 ≥ w·t − 1`; and
//! `c1 − (t1 − t) ≤ w·t1 + 1/2 − (t1 − t) ≤ w·t + 1/2`). From c ∈ [L(t), U(t)] we have
//! `L(t+1) ≤ c + 1` and `U(t+1) ≥ c`, so [L(t+1), U(t+1)] holds c or c + 1. The start pin lies
//! in [L(t0), U(t0)] (ideal is within 1/2 of w·t and rises by at most 1 per step), and at t1
//! the interval is the single point c1.
//!
//! *The prefix bound (sketch).* Let n_v(n) be how many of the first n positions reach node v
//! and W_v its subtree's weight. Claim: |n_v − n·W_v/W| ≤ depth(v). The root has n_v = n. For
//! the left child l of v, n_l = c_v(n_v) and |c_v(n_v) − w_v·n_v| ≤ 1, while
//! |w_v·n_v − n·W_l/W| = w_v·|n_v − n·W_v/W| ≤ w_v·depth(v); so |n_l − n·W_l/W| ≤ 1 + depth(v)
//! (the right child likewise, with 1 − w_v). A leaf is at depth ≤ ⌈log2 k⌉, and its n_v is
//! the source's count. At n = E this bounds the quotas too.
//!
//! **Labels.** Position t goes left at the root iff c(t+1) − c(t) = 1; in the child it is step
//! c(t) (left) or t − c(t) (right), and so on to a leaf. Counts descend the same way.

use crate::plan::shuffle::{SplitMix64, key, tag};

pub mod schedule;
pub use schedule::{EpochCursor, EpochMix};

/// Steps between pins: a resume replays at most this many steps per node.
pub const BLOCK: u64 = 1 << BLOCK_SHIFT;
const BLOCK_SHIFT: u32 = 10;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MixError {
    #[error("a mix needs at least 2 sources, got {0}")]
    TooFewSources(usize),
    #[error("source {0} has weight 0")]
    ZeroWeight(usize),
    #[error("the source weights add up to more than 2^64 - 1")]
    WeightOverflow,
}

/// The per-source sample counts of an epoch of `e` positions: a function of the weights and
/// `e` only, so every stream and epoch agrees on them.
pub fn quotas(weights: &[u64], e: u64) -> Result<Vec<u64>, MixError> {
    Mix::new(weights, e).map(|mix| mix.quotas)
}

#[derive(Debug, Clone, Copy)]
struct Split {
    /// Left subtree's weight and this subtree's: w = wl / wt.
    wl: u64,
    wt: u64,
    /// How many of the node's `len` steps go left.
    a: u64,
    left: usize,
    right: usize,
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    Leaf(usize),
    Split(Split),
}

#[derive(Debug, Clone, Copy)]
struct Node {
    len: u64,
    kind: Kind,
}

/// The mixing tree of one (weights, E): cheap to build, shared by all the streams of an epoch.
#[derive(Debug, Clone)]
pub struct Mix {
    /// Preorder: a parent comes before its children; the index is the node id in the keys.
    nodes: Vec<Node>,
    quotas: Vec<u64>,
    e: u64,
    /// log2 of the block length; only tests use anything but [`BLOCK_SHIFT`].
    shift: u32,
}

/// `round(x·num/den)`, half up, without overflow (`num < den`).
fn div_round(x: u64, num: u64, den: u64) -> u64 {
    let p = x as u128 * num as u128;
    let den = den as u128;
    let (q, r) = (p / den, p % den);
    (q + u128::from(r >= den - r)) as u64
}

/// `rng.below(n)` given `reject = n.wrapping_neg() % n`, which a walk computes once per block
/// rather than once per draw.
#[inline]
fn below(rng: &mut SplitMix64, n: u64, reject: u64) -> u64 {
    loop {
        let m = rng.next_u64() as u128 * n as u128;
        if m as u64 >= reject {
            return (m >> 64) as u64;
        }
    }
}

impl Split {
    /// The pin at step t (t ≤ len): within 1/2 of w·t, and a is still reachable from it.
    fn ideal(&self, len: u64, t: u64) -> u64 {
        div_round(t, self.wl, self.wt).clamp(self.a.saturating_sub(len - t), self.a)
    }
}

impl Mix {
    pub fn new(weights: &[u64], e: u64) -> Result<Mix, MixError> {
        Self::with_shift(weights, e, BLOCK_SHIFT)
    }

    fn with_shift(weights: &[u64], e: u64, shift: u32) -> Result<Mix, MixError> {
        if weights.len() < 2 {
            return Err(MixError::TooFewSources(weights.len()));
        }
        if let Some(i) = weights.iter().position(|&w| w == 0) {
            return Err(MixError::ZeroWeight(i));
        }
        weights
            .iter()
            .try_fold(0u64, |s, &w| s.checked_add(w))
            .ok_or(MixError::WeightOverflow)?;
        let mut mix = Mix {
            nodes: Vec::with_capacity(2 * weights.len() - 1),
            quotas: vec![0; weights.len()],
            e,
            shift,
        };
        mix.build(weights, 0, e);
        Ok(mix)
    }

    /// Appends the subtree of `weights` (sources `first..`) handling `len` steps; returns its id.
    fn build(&mut self, weights: &[u64], first: usize, len: u64) -> usize {
        let id = self.nodes.len();
        self.nodes.push(Node {
            len,
            kind: Kind::Leaf(first),
        });
        if weights.len() == 1 {
            self.quotas[first] = len;
            return id;
        }
        let half = weights.len().div_ceil(2);
        let wl: u64 = weights[..half].iter().sum();
        let wt: u64 = weights.iter().sum();
        let a = div_round(len, wl, wt);
        let left = self.build(&weights[..half], first, a);
        let right = self.build(&weights[half..], first + half, len - a);
        self.nodes[id].kind = Kind::Split(Split {
            wl,
            wt,
            a,
            left,
            right,
        });
        id
    }

    /// Samples of each source in the epoch.
    pub fn quotas(&self) -> &[u64] {
        &self.quotas
    }

    /// Walks block `j` of split node `id` from its pin for `steps` steps (at most the block's
    /// length) and returns c there. With `dirs`, `dirs[i]` is 1 when the block's step i goes
    /// left, else 0.
    fn walk(&self, id: usize, stream_key: u64, j: u64, steps: u64, dirs: Option<&mut [u8]>) -> u64 {
        let Node {
            len,
            kind: Kind::Split(sp),
        } = self.nodes[id]
        else {
            unreachable!("walk on a leaf")
        };
        let Split { wl, wt, .. } = sp;
        let t0 = j << self.shift;
        let t1 = t0 + (len - t0).min(1 << self.shift);
        debug_assert!(t0 < len && steps <= t1 - t0);
        let c1 = sp.ideal(len, t1);
        let mut c = sp.ideal(len, t0);
        let mut rng = SplitMix64::new(key(&[tag::MIX, stream_key, id as u64, j]));
        // w·t = q + r/wt, advanced one step at a time.
        let p = t0 as u128 * wl as u128;
        let (mut q, mut r) = ((p / wt as u128) as u64, (p % wt as u128) as u64);
        let up = wt - wl;
        // `SplitMix64::below(wt)` with its rejection threshold computed once per block.
        let reject = wt.wrapping_neg() % wt;
        let mut dirs = dirs;
        for i in 0..steps {
            let carry = r >= up;
            r = if carry { r - up } else { r + wl };
            q += u64::from(carry);
            let t = t0 + i + 1;
            // L(t) = max(⌈w·t⌉ − 1, c1 − (t1 − t)), U(t) = min(⌊w·t⌋ + 1, c1); negative
            // bounds saturate at 0, which changes nothing as c ≥ 0.
            let lo = (q + u64::from(r != 0))
                .saturating_sub(1)
                .max(c1.saturating_sub(t1 - t));
            let hi = q.saturating_add(1).min(c1);
            let stay = c >= lo;
            let go = c < hi;
            debug_assert!(stay || go, "no move: c {c} t {t} lo {lo} hi {hi}");
            // One draw every step, used only when both moves are allowed: the step's draw
            // does not depend on the path, and the loop has no unpredictable branch.
            let draw = below(&mut rng, wt, reject);
            let left = go & (!stay | (draw < wl));
            c += u64::from(left);
            debug_assert!(lo <= c && c <= hi);
            if let Some(dirs) = dirs.as_deref_mut() {
                dirs[i as usize] = u8::from(left);
            }
        }
        debug_assert!(steps < t1 - t0 || c == c1);
        c
    }

    /// c(s) of split node `id`: the pin of s's block plus a replay of at most a block.
    fn left_steps(&self, id: usize, stream_key: u64, s: u64) -> u64 {
        let Node {
            len,
            kind: Kind::Split(sp),
        } = self.nodes[id]
        else {
            unreachable!("left_steps on a leaf")
        };
        if s >= len {
            return sp.a;
        }
        let j = s >> self.shift;
        match s - (j << self.shift) {
            0 => sp.ideal(len, s),
            off => self.walk(id, stream_key, j, off, None),
        }
    }

    /// How many of positions `0..t` reach each node (t is capped at E).
    fn node_steps(&self, stream_key: u64, t: u64) -> Vec<u64> {
        let mut steps = vec![0; self.nodes.len()];
        steps[0] = t.min(self.e);
        for id in 0..self.nodes.len() {
            if let Kind::Split(sp) = self.nodes[id].kind {
                let c = self.left_steps(id, stream_key, steps[id]);
                steps[sp.left] = c;
                steps[sp.right] = steps[id] - c;
            }
        }
        steps
    }

    /// Samples of each source among positions `0..t` of stream `stream_key` (t capped at E).
    pub fn counts_at(&self, stream_key: u64, t: u64) -> Vec<u64> {
        debug_assert!(t <= self.e, "position {t} past the epoch ({})", self.e);
        let steps = self.node_steps(stream_key, t);
        let mut counts = vec![0; self.quotas.len()];
        for (node, s) in self.nodes.iter().zip(steps) {
            if let Kind::Leaf(i) = node.kind {
                counts[i] = s;
            }
        }
        counts
    }

    /// The sources of positions `from..E` of stream `stream_key`, in order (`from` capped at E).
    pub fn cursor(&self, stream_key: u64, from: u64) -> Cursor {
        let steps = self.node_steps(stream_key, from);
        Cursor {
            nodes: self
                .nodes
                .iter()
                .zip(steps)
                .map(|(node, next)| NodeState {
                    next,
                    block: u64::MAX,
                    dirs: vec![0; 1 << self.shift],
                    out: Vec::new(),
                    kind: node.kind,
                })
                .collect(),
            mix: self.clone(),
            stream_key,
            pos: from.min(self.e),
            ready: Vec::new(),
            taken: 0,
        }
    }
}

/// Labels a cursor produces at a time.
const CHUNK: u64 = 4096;

#[derive(Debug, Clone)]
struct NodeState {
    /// The node's next step.
    next: u64,
    /// Which block `dirs` holds (`u64::MAX`: none yet).
    block: u64,
    /// 1 when step i of the block goes left (bytes, not bits: a chunk copies them out).
    dirs: Vec<u8>,
    /// The labels this subtree produced for the chunk being built.
    out: Vec<u32>,
    kind: Kind,
}

/// Labels positions in order. It works a chunk of positions at a time, bottom-up: each node
/// copies its next steps' directions from its cached block and merges its children's labels by them,
/// a branch-free pass per tree level instead of a hard-to-predict branch per label and level.
#[derive(Debug, Clone)]
pub struct Cursor {
    nodes: Vec<NodeState>,
    mix: Mix,
    stream_key: u64,
    /// Positions handed out so far, from 0.
    pos: u64,
    ready: Vec<u32>,
    taken: usize,
}

impl Cursor {
    /// The position the next label is for.
    pub fn position(&self) -> u64 {
        self.pos
    }

    fn load(&mut self, id: usize, j: u64) {
        let state = &mut self.nodes[id];
        state.block = j;
        let len = self.mix.nodes[id].len;
        let t0 = j << self.mix.shift;
        let steps = (len - t0).min(1 << self.mix.shift);
        let mut dirs = std::mem::take(&mut state.dirs);
        self.mix
            .walk(id, self.stream_key, j, steps, Some(&mut dirs));
        self.nodes[id].dirs = dirs;
    }

    /// Fills `nodes[id].out` with the labels of the subtree's next `m` steps.
    fn fill(&mut self, id: usize, m: usize) {
        let sp = match self.nodes[id].kind {
            Kind::Leaf(i) => {
                let out = &mut self.nodes[id].out;
                out.clear();
                out.resize(m, i as u32);
                return;
            }
            Kind::Split(sp) => sp,
        };
        // The steps' directions, one byte each, in `out` for now.
        let mut dirs = std::mem::take(&mut self.nodes[id].out);
        dirs.clear();
        let shift = self.mix.shift;
        let mut done = 0;
        while done < m {
            let s = self.nodes[id].next;
            let j = s >> shift;
            if self.nodes[id].block != j {
                self.load(id, j);
            }
            let state = &mut self.nodes[id];
            let i0 = (s - (j << shift)) as usize;
            let here = (m - done).min((1 << shift) - i0);
            dirs.extend(state.dirs[i0..i0 + here].iter().map(|&d| u32::from(d)));
            state.next += here as u64;
            done += here;
        }
        if let (Kind::Leaf(l), Kind::Leaf(r)) =
            (self.nodes[sp.left].kind, self.nodes[sp.right].kind)
        {
            // Two sources below: the labels are the directions, renamed (the most common node).
            for d in dirs.iter_mut() {
                *d = if *d == 1 { l as u32 } else { r as u32 };
            }
            self.nodes[id].out = dirs;
            return;
        }
        let lefts = dirs.iter().sum::<u32>() as usize;
        self.fill(sp.left, lefts);
        self.fill(sp.right, m - lefts);
        let mut left = std::mem::take(&mut self.nodes[sp.left].out);
        let mut right = std::mem::take(&mut self.nodes[sp.right].out);
        // One spare entry each, so both reads stay in bounds and the merge needs no branch.
        left.push(0);
        right.push(0);
        let (mut l, mut r) = (0, 0);
        for d in dirs.iter_mut() {
            let take_left = *d == 1;
            // Both reads, then a select: no branch on a coin flip.
            let (a, b) = (left[l], right[r]);
            let label = if take_left { a } else { b };
            l += take_left as usize;
            r += !take_left as usize;
            *d = label;
        }
        self.nodes[sp.left].out = left;
        self.nodes[sp.right].out = right;
        self.nodes[id].out = dirs;
    }
}

impl Iterator for Cursor {
    /// The source index of the next position.
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        if self.taken == self.ready.len() {
            if self.pos >= self.mix.e {
                return None;
            }
            let m = (self.mix.e - self.pos).min(CHUNK) as usize;
            self.fill(0, m);
            std::mem::swap(&mut self.ready, &mut self.nodes[0].out);
            self.taken = 0;
        }
        let label = self.ready[self.taken];
        self.taken += 1;
        self.pos += 1;
        Some(label as usize)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = usize::try_from(self.mix.e - self.pos);
        (left.unwrap_or(usize::MAX), left.ok())
    }
}

#[cfg(test)]
mod tests;
