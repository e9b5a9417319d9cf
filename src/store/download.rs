//! One object's download: parallel ranged GETs of `store.part_size`, up to
//! `store.parts_in_flight` at once, the first the GET that opened the object and told its
//! version ([`Stores::open`]), the others pinned to that version's ETag with `If-Match`, written
//! at their offsets by one blocking writer behind a bounded channel (a slow disk never blocks
//! a runtime thread, and memory stays bounded). Each part gathers its body chunks into batches
//! that end at 2 MiB boundaries, one channel message and one `pwritev` each.
//!
//! The writer also checksums: a CRC-32C per part as its chunks arrive (in order within a
//! part), combined into the object's CRC-32C at the end, so the bytes are never read back.
//! CRC-32C runs on the CPU's own instructions (SSE 4.2, ARMv8) at many GB/s; an MD5 costs
//! ~1.5 CPU-s per GB in pure Rust and cannot be combined from parts, so it is computed only
//! when it is the one checksum the store gives (an S3 object uploaded in one part, downloaded
//! in one part).

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use futures::{StreamExt, TryFutureExt, TryStreamExt};
use md5::Digest;
use object_store::path::Path as ObjectPath;
use object_store::{GetOptions, GetRange, GetResult, ObjectStore};

use super::reported::Reported;
use super::retry::{GaveUp, Outcome, Retries};
use super::verify::Received;
use super::{ReadError, Stores, Version};
use crate::blocks;
use crate::config::url::ShardUrl;

/// A part gathers its body chunks into batches that end at block boundaries
/// (`cache.block_size`, 2 MiB by default): one message and one `pwritev` each, no copy. The HTTP
/// client's chunks average ~220 KiB here (2.4 k `recv`s and as many `pwrite`s and writer
/// wake-ups per 0.5 GB, `strace -c` on a cold `cache_bench` epoch), and the page cache keeps
/// an aligned 2 MiB write as one large folio, which a trainer maps in one fault.
///
/// Most chunks in one batch: well under `IOV_MAX` (1024); a batch of tiny chunks is sent
/// early, unaligned.
const BATCH_CHUNKS: usize = 512;
/// Batches queued for the writer: enough to keep the disk busy; with the batch the writer
/// holds and the one each part is gathering, a download holds at most
/// (4 + 1 + parts in flight) blocks of body (18 MiB at the defaults).
const WRITE_QUEUE: usize = 4;

/// Consecutive body chunks of part `part`, to be written from `at`; `md5` when the whole
/// object is this one part and its MD5 is the checksum to check.
struct Chunk {
    part: usize,
    at: u64,
    len: u64,
    bufs: Vec<Bytes>,
    md5: bool,
}

impl Chunk {
    fn new(part: usize, at: u64, md5: bool) -> Self {
        Chunk {
            part,
            at,
            len: 0,
            bufs: Vec::new(),
            md5,
        }
    }

    /// Where the next byte of the part goes.
    fn end(&self) -> u64 {
        self.at + self.len
    }
}

/// Gathers one part's body chunks into batches that end at block boundaries: cut with no
/// copy (`Bytes` are shared), so that each batch but the part's first and last is one whole,
/// aligned block (`crate::blocks`).
struct Batcher {
    range: Range<u64>,
    batch: Chunk,
    block: usize,
}

impl Batcher {
    fn new(part: usize, range: Range<u64>, md5: bool, block: usize) -> Self {
        let batch = Chunk::new(part, range.start, md5);
        Batcher {
            range,
            batch,
            block,
        }
    }

    /// Takes the part's next chunk (which lies within the part); appends to `ready` the
    /// batches it completes.
    fn push(&mut self, mut bytes: Bytes, ready: &mut Vec<Chunk>) {
        debug_assert!(self.batch.end() + bytes.len() as u64 <= self.range.end);
        while !bytes.is_empty() {
            let block_end = blocks::next_boundary(self.batch.at, self.block).min(self.range.end);
            let room = (block_end - self.batch.end()) as usize;
            let head = bytes.split_to(room.min(bytes.len()));
            self.batch.len += head.len() as u64;
            self.batch.bufs.push(head);
            if self.batch.end() == block_end || self.batch.bufs.len() >= BATCH_CHUNKS {
                let next = Chunk::new(self.batch.part, self.batch.end(), self.batch.md5);
                ready.push(std::mem::replace(&mut self.batch, next));
            }
        }
    }

    /// The last batch, if the part's end did not complete it.
    fn finish(self) -> Option<Chunk> {
        (!self.batch.bufs.is_empty()).then_some(self.batch)
    }
}

/// What one part's GET brought besides its bytes.
type PartResult = Result<Option<Reported>, ReadError>;

impl Stores {
    /// Reads exactly `version` of the object into `file`; returns what was received (its
    /// CRC-32C, an MD5 if one was needed) and what the store reported about the object.
    /// `first`: the answer to the GET that opened the object ([`Stores::open`]), which is the
    /// first part's.
    pub(super) async fn download(
        &self,
        store: &Arc<dyn ObjectStore>,
        path: &ObjectPath,
        shard: &ShardUrl,
        version: &Version,
        file: std::fs::File,
        first: Option<GetResult>,
    ) -> Result<(Received, Option<Reported>), ReadError> {
        let ranges = self.ranges(version.size);
        let mut first = first.filter(|got| ranges.first() == Some(&got.range));
        let lens: Vec<u64> = ranges.iter().map(|r| r.end - r.start).collect();
        let (tx, rx) = tokio::sync::mpsc::channel::<Chunk>(WRITE_QUEUE);
        let writer = tokio::task::spawn_blocking(move || write(file, rx, &lens));
        let single = ranges.len() == 1;
        let parts: Result<Vec<(usize, Option<Reported>)>, ReadError> =
            futures::stream::iter(ranges.into_iter().enumerate())
                .map(|(part, range)| {
                    let tx = tx.clone();
                    let got = first.take().filter(|_| part == 0);
                    self.get_part(store, path, shard, version, part, range, single, tx, got)
                        .map_ok(move |reported| (part, reported))
                })
                .buffer_unordered(self.parts_in_flight)
                .try_collect()
                .await;
        drop(tx);
        let written = writer
            .await
            .unwrap_or_else(|e| Err(std::io::Error::other(e)));
        // A write error closes the channel, which fails the parts: report the cause.
        let received = written.map_err(ReadError::io(shard, "writing to the cache"))?;
        // Every part reports the whole object's checksums: the first part's are the ones to
        // check (a part that reports others is of another version: the check then fails).
        let reported = parts?
            .into_iter()
            .filter_map(|(part, r)| Some((part, r?)))
            .min_by_key(|(part, _)| *part)
            .map(|(_, r)| r);
        Ok((received, reported))
    }

    fn ranges(&self, size: u64) -> Vec<Range<u64>> {
        (0..size)
            .step_by(self.part_size as usize)
            .map(|start| start..(start + self.part_size).min(size))
            .collect()
    }

    #[allow(clippy::too_many_arguments)]
    async fn get_part(
        &self,
        store: &Arc<dyn ObjectStore>,
        path: &ObjectPath,
        shard: &ShardUrl,
        version: &Version,
        part: usize,
        range: Range<u64>,
        single: bool,
        tx: tokio::sync::mpsc::Sender<Chunk>,
        mut opened: Option<GetResult>,
    ) -> PartResult {
        let mut at = range.start;
        let mut ready = Vec::new();
        let mut reported = None;
        let mut batches = None;
        // A body cut mid-way (a reset, a silence past `store.read_timeout`) is resumed where
        // it stopped, pinned to the same ETag, while the store has not pushed back for
        // `store.retry_timeout`: the same policy as a request's retries (`http.rs`).
        let mut retries = Retries::new(self.retry_timeout);
        'request: loop {
            let got = match opened.take() {
                Some(got) => got,
                None => {
                    let options = GetOptions {
                        range: Some(GetRange::Bounded(at..range.end)),
                        if_match: version.e_tag.clone(),
                        ..Default::default()
                    };
                    let asked = Instant::now();
                    let got = store.get_opts(path, options).await;
                    self.observe("get", asked);
                    got.map_err(|e| self.store_error(shard, e))?
                }
            };
            // The first answer says what the store vouches for.
            let batches = batches.get_or_insert_with(|| {
                reported = got.extensions.get::<Reported>().cloned();
                let md5 = single && self.wants_md5(shard, version, reported.as_ref());
                Batcher::new(part, range.clone(), md5, self.block_size)
            });
            let mut body = got.into_stream();
            while let Some(chunk) = body.next().await {
                let bytes = match chunk {
                    Ok(bytes) => bytes,
                    Err(e) => match retries.failed(Outcome::Timeout) {
                        Some(wait) => {
                            tracing::debug!(url = %shard, error = %e, at, wait = ?wait, "a body was cut: resuming it");
                            tokio::time::sleep(wait).await;
                            continue 'request;
                        }
                        None if retries.waited().is_zero() => {
                            return Err(self.store_error(shard, e)); // no retries
                        }
                        None => {
                            self.metrics
                                .store_errors_total
                                .with_label_values(&["pushback"])
                                .inc();
                            return Err(ReadError::GaveUp {
                                url: shard.to_string(),
                                source: GaveUp {
                                    cause: format!("cut the body ({e})"),
                                    waited: retries.waited(),
                                    attempts: retries.failures(),
                                    timeout: self.retry_timeout,
                                },
                            });
                        }
                    },
                };
                let len = bytes.len() as u64;
                if at + len > range.end {
                    break 'request; // more than asked for: counted as a bad length below
                }
                self.count_bytes(len);
                at += len;
                batches.push(bytes, &mut ready);
                for batch in ready.drain(..) {
                    if tx.send(batch).await.is_err() {
                        return Ok(reported); // the writer failed; `download` reports why
                    }
                }
            }
            break;
        }
        if let Some(batch) = batches.and_then(Batcher::finish)
            && tx.send(batch).await.is_err()
        {
            return Ok(reported);
        }
        if at != range.end {
            return Err(ReadError::Truncated {
                url: shard.to_string(),
                got: at - range.start,
                expected: range.end - range.start,
            });
        }
        Ok(reported)
    }
}

/// The writer: chunks at their offsets, a CRC-32C per part (`lens`: each part's length),
/// an MD5 of the chunks that ask for one. Blocking.
fn write(
    file: std::fs::File,
    mut rx: tokio::sync::mpsc::Receiver<Chunk>,
    lens: &[u64],
) -> std::io::Result<Received> {
    allocate(&file, lens.iter().sum())?;
    let mut crcs = vec![0u32; lens.len()];
    let mut md5: Option<md5::Md5> = None;
    while let Some(chunk) = rx.blocking_recv() {
        for bytes in &chunk.bufs {
            crcs[chunk.part] = crc32c::crc32c_append(crcs[chunk.part], bytes);
            if chunk.md5 {
                md5.get_or_insert_with(md5::Md5::new).update(bytes);
            }
        }
        write_all_at(&file, &chunk.bufs, chunk.at)?;
    }
    Ok(Received {
        crc32c: combine(&crcs, lens),
        md5: md5.map(|h| h.finalize().into()),
    })
}

/// Writes `bufs` one after the other from offset `at`: `pwritev`, again for what a short
/// write left.
fn write_all_at(file: &std::fs::File, bufs: &[Bytes], mut at: u64) -> std::io::Result<()> {
    let mut left: Vec<&[u8]> = bufs
        .iter()
        .map(|b| &b[..])
        .filter(|b| !b.is_empty())
        .collect();
    let mut first = 0;
    while first < left.len() {
        let slices: Vec<std::io::IoSlice> = left[first..]
            .iter()
            .map(|b| std::io::IoSlice::new(b))
            .collect();
        let mut n = match rustix::io::pwritev(file, &slices, at) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => n,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        };
        at += n as u64;
        while n > 0 {
            let len = left[first].len();
            if n < len {
                left[first] = &left[first][n..];
                break;
            }
            n -= len;
            first += 1;
        }
    }
    Ok(())
}

/// Allocates the file's blocks before it is written: a full disk fails the download before
/// its first byte, and the writes into allocated blocks cost the kernel a fifth less (ext4:
/// no delayed allocation per page). A filesystem that cannot (EOPNOTSUPP) just writes.
fn allocate(file: &std::fs::File, size: u64) -> std::io::Result<()> {
    use rustix::fs::{FallocateFlags, fallocate};
    match fallocate(file, FallocateFlags::empty(), 0, size) {
        Err(e) if e == rustix::io::Errno::OPNOTSUPP || size == 0 => Ok(()),
        result => result.map_err(std::io::Error::from),
    }
}

/// The CRC-32C of parts laid end to end, from each part's CRC-32C and length.
pub(super) fn combine(crcs: &[u32], lens: &[u64]) -> u32 {
    crcs.iter().zip(lens).fold(0, |acc, (&crc, &len)| {
        crc32c::crc32c_combine(acc, crc, len as usize)
    })
}

#[cfg(test)]
mod tests {
    use super::{BATCH_CHUNKS, Batcher, combine, write_all_at};
    use crate::blocks::{DEFAULT_BLOCK, MIN_BLOCK};

    #[test]
    fn batches_hold_the_part_exactly_and_end_at_block_boundaries() {
        for block in [MIN_BLOCK, DEFAULT_BLOCK] {
            batches_of(block);
        }
    }

    fn batches_of(block_size: usize) {
        let block = block_size as u64;
        // A part that starts and ends mid-block, fed in odd chunks, some larger than a block.
        let range = 3 * block + 5..9 * block - 77;
        let data: Vec<u8> = (0..range.end - range.start)
            .map(|i| (i % 251) as u8)
            .collect();
        let mut batcher = Batcher::new(3, range.clone(), false, block_size);
        let mut batches = Vec::new();
        let mut rest = &data[..];
        let mut n = 0usize;
        while !rest.is_empty() {
            n += 1;
            let take = [1, 300_000, 5_000_000, 65_536][n % 4].min(rest.len());
            batcher.push(bytes::Bytes::copy_from_slice(&rest[..take]), &mut batches);
            rest = &rest[take..];
        }
        batches.extend(batcher.finish());
        let mut at = range.start;
        let mut got = Vec::new();
        for (i, b) in batches.iter().enumerate() {
            assert_eq!((b.part, b.at), (3, at), "batch {i}");
            assert_eq!(b.len, b.bufs.iter().map(|x| x.len() as u64).sum::<u64>());
            if i > 0 {
                assert_eq!(b.at % block, 0, "batch {i} starts on a boundary");
            }
            if i + 1 < batches.len() {
                assert_eq!(b.end() % block, 0, "batch {i} ends on a boundary");
            }
            b.bufs.iter().for_each(|x| got.extend_from_slice(x));
            at = b.end();
        }
        assert_eq!(at, range.end);
        assert_eq!(got, data);
        assert_eq!(batches.len(), 6); // the head, 4 whole blocks, the tail

        // Tiny chunks: a batch is sent early at BATCH_CHUNKS chunks.
        let mut batcher = Batcher::new(0, 0..block, false, block_size);
        let mut batches = Vec::new();
        for _ in 0..BATCH_CHUNKS + 1 {
            batcher.push(bytes::Bytes::from_static(b"x"), &mut batches);
        }
        assert_eq!(batches.len(), 1);
        assert_eq!(batches[0].len, BATCH_CHUNKS as u64);
        assert_eq!(
            batcher.finish().map(|b| (b.at, b.len)),
            Some((BATCH_CHUNKS as u64, 1))
        );
    }

    #[test]
    fn a_batch_lands_byte_exact_at_its_offset() {
        // More slices than one pwritev takes at once (IOV_MAX 1024), some empty.
        let bufs: Vec<bytes::Bytes> = (0..3000u32)
            .map(|i| bytes::Bytes::from(vec![i as u8; (i % 7) as usize]))
            .collect();
        let want: Vec<u8> = bufs.iter().flat_map(|b| b.iter().copied()).collect();
        let file = tempfile::tempfile().unwrap();
        write_all_at(&file, &bufs, 5).unwrap();
        let mut got = Vec::new();
        std::io::Read::read_to_end(&mut &file, &mut got).unwrap();
        assert_eq!(got[..5], [0; 5]);
        assert_eq!(got[5..], want[..]);
    }

    #[test]
    fn parts_combine_into_the_whole_buffers_crc() {
        let data: Vec<u8> = (0..1_000_003u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
            .collect();
        let whole = crc32c::crc32c(&data);
        for part in [7usize, 4096, 65_536, 333_334, 1_000_003, 2_000_000] {
            let chunks: Vec<&[u8]> = data.chunks(part).collect();
            let crcs: Vec<u32> = chunks.iter().map(|c| crc32c::crc32c(c)).collect();
            let lens: Vec<u64> = chunks.iter().map(|c| c.len() as u64).collect();
            assert_eq!(combine(&crcs, &lens), whole, "parts of {part}");
        }
        assert_eq!(combine(&[], &[]), crc32c::crc32c(b""));
        // The check value of CRC-32C, from two parts.
        let (a, b) = b"123456789".split_at(4);
        let crc = combine(&[crc32c::crc32c(a), crc32c::crc32c(b)], &[4, 5]);
        assert_eq!(crc, 0xE306_9283);
    }
}
