//! Deterministic randomness: a named generator (SplitMix64) and Fisher-Yates written here, so
//! an order never changes with a dependency bump, plus the windowed sample shuffle.
//!
//! The sample shuffle is a *block* shuffle, not webdataset's reservoir buffer: a stream's
//! samples are cut into windows of `shuffle_buffer` consecutive samples (the first window is
//! shortened by a per-stream random offset so window edges move every epoch) and each window
//! is permuted with a generator keyed by (stream key, window index). The output position of
//! every sample is therefore a function of (seed, epoch, stream, position) alone: resuming at
//! position p only needs the window that holds p, never a replay of everything before it.
//! Memory is one window of sample descriptors (the data stays in the shard files).

/// SplitMix64 (Steele, Lea, Flood 2014): tiny, fast, statistically solid for shuffling, and
/// defined by these few lines forever.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        finalize(self.0)
    }

    /// Uniform in `0..n` (Lemire's multiply-shift with rejection: no modulo bias).
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0);
        loop {
            let m = (self.next_u64() as u128) * (n as u128);
            let low = m as u64;
            if low >= n.wrapping_neg() % n {
                return (m >> 64) as u64;
            }
        }
    }
}

fn finalize(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Derives a key from a list of words (a domain tag first, then seed, epoch, ids...): each
/// word is folded in through the SplitMix64 finalizer, so keys for different tags or
/// different word lists are unrelated.
pub fn key(words: &[u64]) -> u64 {
    words.iter().fold(0x6A09_E667_F3BC_C908, |h, w| {
        finalize(h ^ finalize(w.wrapping_add(h)))
    })
}

/// Fisher-Yates shuffle driven by `rng`.
pub fn shuffle<T>(items: &mut [T], rng: &mut SplitMix64) {
    for i in (1..items.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        items.swap(i, j);
    }
}

/// Domain tags, so the same (seed, epoch) never feeds two decisions the same stream of numbers.
pub mod tag {
    pub const HOST_SHARE: u64 = 1;
    pub const EPOCH_ORDER: u64 = 2;
    pub const STREAM: u64 = 3;
    pub const WINDOW_OFFSET: u64 = 4;
    pub const WINDOW: u64 = 5;
    pub const PASS_ORDER: u64 = 6;
    pub const MIX: u64 = 7;
    pub const RESAMPLE: u64 = 8;
    pub const MIX_SOURCE: u64 = 9;
    pub const MIX_SEGMENT: u64 = 10;
}

/// Cuts a stream into windows and permutes each one, as described at the top of this module.
#[derive(Debug, Clone)]
pub struct WindowShuffle {
    stream_key: u64,
    window: usize,
    next_window: u64,
    next_len: usize,
}

impl WindowShuffle {
    /// `stream_key` identifies (seed, epoch, stream); `window` is the shuffle buffer size.
    pub fn new(stream_key: u64, window: usize) -> Self {
        let mut shuffle = Self {
            stream_key,
            window: window.max(1),
            next_window: 0,
            next_len: 0,
        };
        shuffle.next_len = shuffle.first_len();
        shuffle
    }

    /// How many samples the next window takes (fewer only at the end of the stream).
    pub fn next_len(&self) -> usize {
        self.next_len
    }

    /// Moves to the window that holds stream position `position` (samples from the start)
    /// and returns where that window starts: a resume reads from there, permutes the window
    /// as it would have been, and skips `position - start` samples.
    pub fn seek(&mut self, position: u64) -> u64 {
        let first = self.first_len() as u64;
        let window = self.window as u64;
        let (index, start) = if position < first {
            (0, 0)
        } else {
            let k = (position - first) / window;
            (1 + k, first + k * window)
        };
        self.next_window = index;
        self.next_len = if index == 0 {
            first as usize
        } else {
            self.window
        };
        start
    }

    fn first_len(&self) -> usize {
        let offset =
            SplitMix64::new(key(&[tag::WINDOW_OFFSET, self.stream_key])).below(self.window as u64);
        self.window - offset as usize
    }

    /// Permutes one window in place; windows must be given in stream order.
    pub fn permute<T>(&mut self, items: &mut [T]) {
        let mut rng = SplitMix64::new(key(&[tag::WINDOW, self.stream_key, self.next_window]));
        shuffle(items, &mut rng);
        self.next_window += 1;
        self.next_len = self.window;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_reference_values() {
        // First outputs for seed 1234567 from the reference C implementation (Vigna).
        let mut r = SplitMix64::new(1234567);
        assert_eq!(r.next_u64(), 6457827717110365317);
        assert_eq!(r.next_u64(), 3203168211198807973);
    }

    #[test]
    fn below_is_in_range_and_covers_it() {
        let mut r = SplitMix64::new(7);
        let mut seen = [0u32; 7];
        for _ in 0..7000 {
            seen[r.below(7) as usize] += 1;
        }
        assert!(seen.iter().all(|&c| (800..1200).contains(&c)), "{seen:?}");
    }

    #[test]
    fn shuffle_is_a_permutation_and_deterministic() {
        let mut a: Vec<u32> = (0..1000).collect();
        let mut b = a.clone();
        shuffle(&mut a, &mut SplitMix64::new(key(&[1, 2])));
        shuffle(&mut b, &mut SplitMix64::new(key(&[1, 2])));
        assert_eq!(a, b);
        assert_ne!(a, (0..1000).collect::<Vec<_>>());
        let mut sorted = a.clone();
        sorted.sort();
        assert_eq!(sorted, (0..1000).collect::<Vec<_>>());
        let mut c: Vec<u32> = (0..1000).collect();
        shuffle(&mut c, &mut SplitMix64::new(key(&[1, 3])));
        assert_ne!(a, c);
    }

    #[test]
    fn keys_depend_on_every_word_and_order() {
        assert_ne!(key(&[1, 2, 3]), key(&[1, 3, 2]));
        assert_ne!(key(&[1, 2]), key(&[1, 2, 0]));
        assert_ne!(key(&[0]), key(&[]));
    }

    #[test]
    fn windows_have_offset_then_full_length() {
        let mut w = WindowShuffle::new(42, 100);
        let first = w.next_len();
        assert!((1..=100).contains(&first));
        let mut items: Vec<u32> = (0..first as u32).collect();
        w.permute(&mut items);
        assert_eq!(w.next_len(), 100);
        // Different streams get different first-window lengths (edges move).
        let lens: std::collections::HashSet<usize> = (0..20)
            .map(|k| WindowShuffle::new(k, 100).next_len())
            .collect();
        assert!(lens.len() > 10);
    }

    #[test]
    fn seek_lands_on_the_window_that_holds_a_position() {
        let w = WindowShuffle::new(42, 100);
        let first = w.next_len() as u64;
        for (position, start) in [
            (0, 0),
            (first - 1, 0),
            (first, first),
            (first + 250, first + 200),
        ] {
            let mut s = w.clone();
            assert_eq!(s.seek(position), start, "position {position}");
            assert_eq!(s.next_len(), if start == 0 { first as usize } else { 100 });
        }
        // Seeking to a window start permutes that window as reading up to it would have.
        let mut read = w.clone();
        let mut skipped: Vec<u32> = (0..first as u32).collect();
        read.permute(&mut skipped);
        let mut a: Vec<u32> = (0..100).collect();
        read.permute(&mut a);
        let mut sought = w.clone();
        sought.seek(first + 5);
        let mut b: Vec<u32> = (0..100).collect();
        sought.permute(&mut b);
        assert_eq!(a, b);
    }
}
