//! Sample indexes: where each sample of a cached shard lies, learnt by its first parse and
//! kept, so that a shard read again (the next epoch, another stream, a resume) is not walked
//! again. Walking a tar touches every member's 512-byte header, cold in the CPU's caches:
//! about half of the daemon's CPU per small sample. From an index, a stream's samples are
//! slices made from offsets, and the shard's pages are touched only where bytes are sent.
//!
//! Indexes are kept per cache entry ([`crate::cache::Cache::get_identified`]: an entry
//! fetched again gets a new id, so an index never outlives the bytes it describes), in memory
//! bounded by `cache.index_memory`, least recently used dropped first. A shard whose index
//! is dropped is parsed again, as it was before indexes existed.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use prometheus::{IntCounter, IntGauge};

use crate::cache::ShardBytes;
use crate::ops::metrics::Metrics;
use crate::shard::{self, Key, Sample, ShardError};

/// The indexes of recently read shards, in a memory budget.
pub struct SampleIndexes {
    budget: usize,
    state: Mutex<State>,
    /// `shardd_sample_index_bytes`, `shardd_shards_parsed_total`.
    bytes_gauge: IntGauge,
    parsed: IntCounter,
}

#[derive(Default)]
struct State {
    /// By cache entry id: the index, and when it was last used.
    indexes: HashMap<u64, (Arc<ShardIndex>, u64)>,
    bytes: usize,
    tick: u64,
}

impl SampleIndexes {
    /// Indexes in at most `budget` bytes (0: none kept, every read parses).
    pub fn new(budget: usize, metrics: &Metrics) -> SampleIndexes {
        SampleIndexes {
            budget,
            state: Mutex::default(),
            bytes_gauge: metrics.sample_index_bytes.clone(),
            parsed: metrics.shards_parsed_total.clone(),
        }
    }

    /// Bytes of the indexes kept.
    pub fn bytes(&self) -> usize {
        self.state.lock().unwrap().bytes
    }

    /// The samples `start..end` of the shard `data` (cache entry `id`, at `url`; `end` =
    /// `None`: to the shard's end), and how many samples the whole shard has; none if `end`
    /// is past that. Parses the shard (blocking: call from a blocking thread) unless its
    /// index is kept.
    pub fn samples(
        &self,
        id: u64,
        data: &ShardBytes,
        url: &Arc<str>,
        start: u64,
        end: Option<u64>,
    ) -> Result<(Vec<Sample>, u64), ShardError> {
        let known = {
            let mut st = self.state.lock().unwrap();
            st.tick += 1;
            let tick = st.tick;
            st.indexes.get_mut(&id).map(|(index, used)| {
                *used = tick;
                index.clone()
            })
        };
        if let Some(index) = known {
            let len = index.len() as u64;
            let end = end.unwrap_or(len);
            if end > len {
                return Ok((Vec::new(), len));
            }
            return Ok((index.samples(data, url, start.min(end)..end), len));
        }
        self.parsed.inc();
        let mut samples = shard::parse(data, url)?;
        let len = samples.len() as u64;
        if let Some(index) = ShardIndex::of(data, &samples) {
            self.keep(id, index);
        }
        let end = end.unwrap_or(len);
        if end > len {
            return Ok((Vec::new(), len));
        }
        samples.truncate(end as usize);
        samples.drain(..start.min(end) as usize);
        Ok((samples, len))
    }

    fn keep(&self, id: u64, index: ShardIndex) {
        let size = index.size();
        if size > self.budget {
            return;
        }
        let mut st = self.state.lock().unwrap();
        while st.bytes + size > self.budget {
            let oldest = st
                .indexes
                .iter()
                .min_by_key(|(_, (_, used))| *used)
                .map(|(id, _)| *id);
            let Some(oldest) = oldest else { break };
            let (gone, _) = st.indexes.remove(&oldest).expect("found just now");
            st.bytes -= gone.size();
        }
        st.tick += 1;
        let tick = st.tick;
        if let Some((old, _)) = st.indexes.insert(id, (Arc::new(index), tick)) {
            st.bytes -= old.size(); // two streams parsed the same shard at once
        }
        st.bytes += size;
        self.bytes_gauge.set(st.bytes as i64);
    }
}

/// One shard's samples as offsets: 12 bytes per sample and 16 per field, plus the keys and
/// small fields themselves.
struct ShardIndex {
    /// The distinct field names, shared by the samples made.
    names: Vec<Arc<str>>,
    samples: Vec<SampleSpan>,
    fields: Vec<FieldSpan>,
    /// Every key, and fields of up to [`SMALL`] bytes, copied: a stream made from the index
    /// reads the shard's pages only for the fields it sends by reference (zero copy), or
    /// copies (the socket); touching a page to copy a few bytes of it costs a page fault.
    own: ShardBytes,
}

struct SampleSpan {
    /// Where the key is in `own`.
    key_at: u32,
    key_len: u32,
    /// The end of this sample's fields in `ShardIndex::fields`.
    fields_end: u32,
}

struct FieldSpan {
    /// Offset into the shard's bytes, or with [`OWN`] set, into `own`.
    at: u64,
    len: u32,
    name: u32,
}

/// Fields of up to this many bytes are copied into the index (a class label, a short JSON).
const SMALL: usize = 64;
const OWN: u64 = 1 << 63;

impl ShardIndex {
    /// The index of `samples`, parsed from `data`; `None` if it cannot describe them (a field
    /// of 4 GiB or more, more than 4 G fields): such a shard is parsed each time.
    fn of(data: &ShardBytes, samples: &[Sample]) -> Option<ShardIndex> {
        let base = data.as_ptr() as usize;
        let mut own = Vec::new();
        let mut copy = |bytes: &[u8]| -> Option<u32> {
            let at = u32::try_from(own.len()).ok()?;
            own.extend_from_slice(bytes);
            Some(at)
        };
        let mut names: Vec<Arc<str>> = Vec::new();
        let mut spans = Vec::with_capacity(samples.len());
        let mut fields = Vec::with_capacity(samples.iter().map(|s| s.fields.len()).sum());
        for s in samples {
            let key = s.key.bytes();
            let (key_at, key_len) = (copy(key)?, u32::try_from(key.len()).ok()?);
            for (name, body) in &s.fields {
                let name = match names.iter().position(|n| Arc::ptr_eq(n, name)) {
                    Some(i) => i,
                    None => {
                        names.push(name.clone());
                        names.len() - 1
                    }
                };
                let at = if body.len() <= SMALL {
                    OWN | u64::from(copy(body)?)
                } else {
                    // A field is always a slice of the shard (`shard::parse`).
                    let at = (body.as_ptr() as usize).checked_sub(base)?;
                    (at + body.len() <= data.len()).then_some(at as u64)?
                };
                fields.push(FieldSpan {
                    at,
                    len: u32::try_from(body.len()).ok()?,
                    name: name as u32,
                });
            }
            spans.push(SampleSpan {
                key_at,
                key_len,
                fields_end: u32::try_from(fields.len()).ok()?,
            });
        }
        Some(ShardIndex {
            names,
            samples: spans,
            fields,
            own: ShardBytes::heap(own.into()),
        })
    }

    fn len(&self) -> usize {
        self.samples.len()
    }

    /// Bytes of memory it takes (what the budget counts).
    fn size(&self) -> usize {
        std::mem::size_of::<ShardIndex>()
            + self.samples.len() * std::mem::size_of::<SampleSpan>()
            + self.fields.len() * std::mem::size_of::<FieldSpan>()
            + self.names.iter().map(|n| n.len() + 16).sum::<usize>()
            + self.own.len()
    }

    /// Samples `range` (within `0..len()`), made of slices of `data` and of the index's own
    /// bytes.
    fn samples(&self, data: &ShardBytes, url: &Arc<str>, range: Range<u64>) -> Vec<Sample> {
        let (start, end) = (range.start as usize, range.end as usize);
        let mut field = if start == 0 {
            0
        } else {
            self.samples[start - 1].fields_end as usize
        };
        self.samples[start..end]
            .iter()
            .map(|s| {
                let at = s.key_at as usize;
                let key = Key::slice_of(&self.own, at..at + s.key_len as usize);
                let fields = self.fields[field..s.fields_end as usize]
                    .iter()
                    .map(|f| {
                        let (bytes, at) = if f.at & OWN != 0 {
                            (&self.own, (f.at & !OWN) as usize)
                        } else {
                            (data, f.at as usize)
                        };
                        (
                            self.names[f.name as usize].clone(),
                            bytes.slice(at..at + f.len as usize),
                        )
                    })
                    .collect();
                field = s.fields_end as usize;
                Sample {
                    key,
                    url: url.clone(),
                    fields,
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A shard with a long key (GNU long name), an empty field, a key joined from a ustar
    /// prefix, and uppercase field names.
    fn shard() -> ShardBytes {
        let long = format!("{}/k1", "d".repeat(120));
        let prefixed = format!("{}/k3", "p".repeat(100));
        let mut b = tar::Builder::new(Vec::new());
        for (name, data, ustar) in [
            ("k0.txt", &b"zero"[..], false),
            ("k0.CLS", b"", false),
            (&format!("{long}.txt"), b"one", false),
            ("k2.seg.PNG", &[7u8; SMALL + 1], false),
            ("k2.json", b"{}", false),
            (&format!("{prefixed}.txt"), b"three", true),
        ] {
            let mut h = if ustar {
                tar::Header::new_ustar()
            } else {
                tar::Header::new_gnu()
            };
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            b.append_data(&mut h, name, data).unwrap();
        }
        ShardBytes::heap(b.into_inner().unwrap().into())
    }

    #[test]
    fn indexed_samples_equal_parsed_ones_for_every_range() {
        let data = shard();
        let url: Arc<str> = Arc::from("file:///s.tar");
        let parsed = shard::parse(&data, &url).unwrap();
        let keys: Vec<String> = parsed.iter().map(|s| s.key.to_string()).collect();
        let long = format!("{}/k1", "d".repeat(120));
        let prefixed = format!("{}/k3", "p".repeat(100));
        assert_eq!(keys, ["k0", &long, "k2", &prefixed]);
        // Keys and the fields of up to SMALL bytes are the index's own; the rest is the shard's.
        let index = ShardIndex::of(&data, &parsed).unwrap();
        let own: usize = keys.iter().map(|k| k.len()).sum::<usize>()
            + "zero".len()
            + "one".len()
            + "{}".len()
            + "three".len();
        assert_eq!(index.own.len(), own);
        let indexes = SampleIndexes::new(1 << 20, &Metrics::new());
        // The first call parses and keeps the index; the rest are made from it.
        let (first, len) = indexes.samples(7, &data, &url, 1, Some(3)).unwrap();
        assert_eq!((first.as_slice(), len), (&parsed[1..3], 4));
        assert!(indexes.bytes() > 0);
        for start in 0..=4u64 {
            for end in start..=4u64 {
                let (got, len) = indexes.samples(7, &data, &url, start, Some(end)).unwrap();
                assert_eq!(
                    (got.as_slice(), len),
                    (&parsed[start as usize..end as usize], 4)
                );
            }
        }
        let (all, _) = indexes.samples(7, &data, &url, 0, None).unwrap();
        assert_eq!(all, parsed);
        let (rest, _) = indexes.samples(7, &data, &url, 3, None).unwrap();
        assert_eq!(rest, parsed[3..]);
        // A manifest that counts more samples than the shard has.
        assert_eq!(
            indexes.samples(7, &data, &url, 0, Some(5)).unwrap(),
            (vec![], 4)
        );
    }

    #[test]
    fn the_budget_drops_the_least_recently_used() {
        let data = shard();
        let url: Arc<str> = Arc::from("file:///s.tar");
        let one = ShardIndex::of(&data, &shard::parse(&data, &url).unwrap())
            .unwrap()
            .size();
        let indexes = SampleIndexes::new(2 * one, &Metrics::new());
        for id in [1, 2, 1, 3] {
            indexes.samples(id, &data, &url, 0, Some(1)).unwrap();
        }
        let kept: Vec<u64> = {
            let mut k: Vec<u64> = indexes
                .state
                .lock()
                .unwrap()
                .indexes
                .keys()
                .copied()
                .collect();
            k.sort();
            k
        };
        assert_eq!(kept, [1, 3]);
        assert_eq!(indexes.bytes(), 2 * one);
        assert_eq!(indexes.bytes_gauge.get(), 2 * one as i64);
        // Parsed: 1, 2, 3 (1 again was made from its index).
        assert_eq!(indexes.parsed.get(), 3);
        // No budget: nothing kept, samples still right.
        let none = SampleIndexes::new(0, &Metrics::new());
        let (s, _) = none.samples(1, &data, &url, 0, None).unwrap();
        assert_eq!(s, shard::parse(&data, &url).unwrap());
        assert_eq!(none.bytes(), 0);
    }

    /// Reading from an index makes it the most recently used, and each index kept is newer
    /// than those kept before: the budget drops the least recently used, never a tie.
    #[test]
    fn reads_and_keeps_advance_the_recency() {
        let data = shard();
        let url: Arc<str> = Arc::from("file:///s.tar");
        let indexes = SampleIndexes::new(1 << 20, &Metrics::new());
        let used = |id: u64| indexes.state.lock().unwrap().indexes[&id].1;
        indexes.samples(1, &data, &url, 0, None).unwrap();
        indexes.samples(2, &data, &url, 0, None).unwrap();
        assert!(used(1) < used(2), "{} {}", used(1), used(2));
        indexes.samples(1, &data, &url, 0, Some(1)).unwrap();
        assert!(used(2) < used(1), "{} {}", used(2), used(1));
    }

    /// Two streams that parse the same shard at once both keep its index: counted once.
    #[test]
    fn an_index_kept_twice_is_counted_once() {
        let data = shard();
        let parsed = shard::parse(&data, &Arc::from("file:///s.tar")).unwrap();
        let index = || ShardIndex::of(&data, &parsed).unwrap();
        let one = index().size();
        let indexes = SampleIndexes::new(1 << 20, &Metrics::new());
        indexes.keep(7, index());
        indexes.keep(7, index());
        assert_eq!(indexes.bytes(), one);
        assert_eq!(indexes.bytes_gauge.get(), one as i64);
    }

    /// What the budget counts: 12 bytes per sample and 16 per field, each distinct field
    /// name with 16 bytes of overhead, and the copied keys and small fields.
    #[test]
    fn size_counts_spans_names_and_own_bytes() {
        let data = shard();
        let parsed = shard::parse(&data, &Arc::from("file:///s.tar")).unwrap();
        let index = ShardIndex::of(&data, &parsed).unwrap();
        assert_eq!((index.samples.len(), index.fields.len()), (4, 6));
        let names: usize = ["txt", "cls", "seg.png", "json"]
            .iter()
            .map(|n| n.len() + 16)
            .sum();
        assert_eq!(
            index.size(),
            std::mem::size_of::<ShardIndex>() + 4 * 12 + 6 * 16 + names + index.own.len()
        );
    }

    /// A field that is not a slice of the shard's bytes cannot be described by offsets into
    /// them: no index (`shard::parse` never makes one, but reading past `data` would panic).
    #[test]
    fn fields_outside_the_shard_are_not_indexed() {
        let whole = ShardBytes::heap(vec![1u8; 1000].into());
        let data = whole.slice(..500);
        let sample = |range: Range<usize>| Sample {
            key: Key::from("k"),
            url: Arc::from("u"),
            fields: vec![(Arc::from("bin"), whole.slice(range))],
        };
        assert!(ShardIndex::of(&data, &[sample(300..500)]).is_some());
        assert!(ShardIndex::of(&data, &[sample(400..600)]).is_none());
    }

    /// A budget of exactly one index keeps it, and an index kept again (two streams parsed
    /// the shard at once) is counted once.
    #[test]
    fn an_index_the_size_of_the_budget_is_kept_and_counted_once() {
        let data = shard();
        let url: Arc<str> = Arc::from("file:///s.tar");
        let parsed = shard::parse(&data, &url).unwrap();
        let size = ShardIndex::of(&data, &parsed).unwrap().size();
        let indexes = SampleIndexes::new(size, &Metrics::new());
        indexes.samples(1, &data, &url, 0, None).unwrap();
        assert_eq!(indexes.bytes(), size);
        indexes.keep(1, ShardIndex::of(&data, &parsed).unwrap());
        assert_eq!(indexes.bytes(), size);
    }

    #[test]
    fn a_corrupt_shard_is_an_error_each_time_and_never_indexed() {
        let mut bytes = shard().to_vec();
        bytes[148] ^= 1; // the first header's checksum
        let data = ShardBytes::heap(bytes.into());
        let url: Arc<str> = Arc::from("file:///bad.tar");
        let indexes = SampleIndexes::new(1 << 20, &Metrics::new());
        for _ in 0..2 {
            assert!(indexes.samples(1, &data, &url, 0, None).is_err());
        }
        assert_eq!(indexes.bytes(), 0);
    }
}
