//! The wire protocol, as specified in `proto/PROTOCOL.md` (the single source of truth that
//! this file and the Python client follow). Shared by the server and the Rust client.
//!
//! Control frames carry JSON (rare, evolvable, readable in a packet dump); sample frames carry
//! a binary batch laid out so that a pure-Python reader decodes a whole batch with one
//! `struct.unpack_from` and slices, and so that the daemon sends field data straight out of
//! the shard's bytes ([`Part::Shard`], spliced by `sink.rs` when they are cache-file memory)
//! without copying it.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::cache::ShardBytes;
use crate::shard::Sample;

/// First bytes each side sends: magic, then the protocol version (u16, little-endian).
pub const MAGIC: &[u8; 6] = b"SHARDD";
pub const VERSION: u16 = 7;
/// The oldest client version the daemon still serves (version 1 has no `start`).
pub const OLDEST_VERSION: u16 = 1;
pub const PREAMBLE_LEN: usize = 8;
/// Frame header: body length (u32 LE, not counting the header) and kind (u8).
pub const HEADER_LEN: usize = 5;
/// Largest frame a client may send; requests are small JSON documents.
pub const MAX_CLIENT_FRAME: u32 = 64 * 1024;

/// Batches are cut at about this much payload...
pub const BATCH_TARGET_BYTES: usize = 1 << 20;
/// ...a MAPPED_BATCH at this much, its mapped fields counted (its small pieces still at
/// `BATCH_TARGET_BYTES`): its frame carries 5 words per mapped field, not the bytes, and at
/// 1 MiB a frame of 100 KB samples was 10 samples sharing the client's cost of a frame
/// (receives, tables, the unpack; 4-5 µs a sample in Python).
pub const MAPPED_BATCH_TARGET_BYTES: usize = 4 << 20;
/// ...or this many samples, whichever comes first.
pub const BATCH_MAX_SAMPLES: usize = 4096;
/// Pieces up to this size are copied into the frame; larger ones are sent from the shard's
/// bytes in place (a syscall-level iovec costs more than copying a small piece).
pub const INLINE_MAX: usize = 4096;
/// Keeps one batch within the kernel's iovec limit (IOV_MAX = 1024).
pub const MAX_PARTS: usize = 960;
/// n_samples, n_words, n_names, n_urls, payload_offset, max_piece: six u32.
pub const BATCH_HEADER_LEN: usize = 24;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    Request = 1,
    Start = 2,
    Batch = 3,
    End = 4,
    Error = 5,
    /// (v5) A shard's committed cache file, its descriptor attached (SCM_RIGHTS).
    Map = 6,
    /// (v5) A batch whose large pieces are (map, offset, length) descriptors.
    MappedBatch = 7,
    /// (v5) Map ids the daemon will not refer to again.
    Unmap = 8,
    /// (v5, client → daemon) Map ids the client no longer maps.
    Release = 9,
}

impl Kind {
    pub fn from_u8(b: u8) -> Option<Kind> {
        Some(match b {
            1 => Kind::Request,
            2 => Kind::Start,
            3 => Kind::Batch,
            4 => Kind::End,
            5 => Kind::Error,
            6 => Kind::Map,
            7 => Kind::MappedBatch,
            8 => Kind::Unmap,
            9 => Kind::Release,
            _ => return None,
        })
    }
}

/// REQUEST (client → daemon): `op` "stream" (one stream per connection) or, from version 3,
/// "plan" (only the START that a stream would get; nothing is loaded).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Request {
    pub op: String,
    pub dataset: String,
    pub epoch: u64,
    pub rank: u32,
    pub world_size: u32,
    #[serde(default)]
    pub worker: u32,
    #[serde(default = "one")]
    pub num_workers: u32,
    #[serde(default)]
    pub seed: u64,
    /// Samples of this stream already delivered (a resume): the stream starts after them.
    /// Version 2.
    #[serde(default)]
    pub start: u64,
    /// An elastic resume: the rest of `epoch` after a checkpoint taken at another topology
    /// (`elastic.rs`); `start` then counts samples of the new stream. Version 4.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resume_from: Option<crate::plan::elastic::Origin>,
    /// Zero-copy delivery (`mapped.rs`): shard files passed as descriptors. Version 5.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub zero_copy: bool,
    /// The topologies the job had before this one, oldest first, so that its passes go on
    /// across resizes (`plan/passes.rs`). Version 7.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub history: Vec<crate::plan::passes::Hop>,
}

impl Request {
    /// What the plan needs of the request: the stream's place in the job and its epoch.
    pub fn stream_request(&self) -> crate::plan::StreamRequest {
        crate::plan::StreamRequest {
            seed: self.seed,
            epoch: self.epoch,
            rank: self.rank,
            world_size: self.world_size,
            worker: self.worker,
            num_workers: self.num_workers,
        }
    }
}

/// REQUEST with `op` "get" (version 6): one shard's whole bytes from the host's cache, for
/// `shardd get` (webdataset's `pipe:` URLs). The answer is a [`GetStart`], then a MAP frame
/// carrying the committed cache file's descriptor, then END.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GetRequest {
    pub op: String,
    /// The shard's URL, exactly as a configured dataset lists it.
    pub url: String,
}

/// START of a `get`: the shard and its length in bytes (the cache file's: a compressed shard's
/// decompressed tar).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GetStart {
    pub url: String,
    pub bytes: u64,
}

/// The `op` of a REQUEST body, read before the body is parsed as the op's own request type
/// (None when the body is not a JSON object with a string `op`).
pub fn op_of(body: &[u8]) -> Option<String> {
    #[derive(Deserialize)]
    struct Op {
        op: String,
    }
    serde_json::from_slice::<Op>(body).ok().map(|o| o.op)
}

fn one() -> u32 {
    1
}

/// START (daemon → client): the request was accepted; samples follow.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Start {
    pub dataset: String,
    /// Shards this stream will read (0 is possible when there are fewer shards than streams).
    pub shards: usize,
    pub host: u32,
    pub hosts: u32,
    /// Samples in the whole stream this epoch, when the dataset has a manifest; `None` in
    /// shard-level mode. Version 2.
    #[serde(default)]
    pub samples: Option<u64>,
    /// Where the stream starts (the request's `start`). Version 2.
    #[serde(default)]
    pub position: u64,
    /// Samples this host leaves out this epoch to equalise the streams. Version 2.
    #[serde(default)]
    pub dropped: u64,
    /// Identifies the epoch's plan: equal on every rank of a job that asked for the same epoch
    /// of the same data. Version 2.
    #[serde(default)]
    pub fingerprint: String,
    /// On an elastic resume: the samples the checkpoint left of the epoch, job-wide (of which
    /// `dropped`, job-wide too, are left out so that every rank gets as many). Version 4.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remainder: Option<u64>,
    /// A mix's sources: how many samples of each this stream carries this epoch and which
    /// pass over the source's host share it starts in. Version 4.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sources: Option<Vec<SourceStart>>,
    /// Whether the stream is delivered zero-copy: present when the request asked. Version 5.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zero_copy: Option<bool>,
    /// A mix's segments this epoch: where its schedule changes the weights inside it (one
    /// segment when it does not). Absent after an elastic resume. Version 7.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub segments: Option<Vec<SegmentStart>>,
    /// Which of `segments` holds `position`. Version 7.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub segment: Option<usize>,
}

/// One segment of a mixed stream's epoch, in START.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SegmentStart {
    /// The stream position it starts at.
    pub position: u64,
    /// The schedule entry in force: 0 for the mix's first weights, n for the n-th entry.
    pub entry: usize,
    /// The weights, by source.
    pub mix: std::collections::BTreeMap<String, u64>,
}

/// One source of a mixed stream, in START.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SourceStart {
    pub dataset: String,
    pub weight: u64,
    pub samples: u64,
    pub pass: u64,
}

/// END (daemon → client): the stream is complete.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct End {
    pub samples: u64,
    pub bytes: u64,
}

/// ERROR (daemon → client): the stream (or handshake) failed; the daemon closes the connection.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorFrame {
    pub code: String,
    pub message: String,
}

pub fn preamble() -> [u8; PREAMBLE_LEN] {
    let mut p = [0u8; PREAMBLE_LEN];
    p[..6].copy_from_slice(MAGIC);
    p[6..].copy_from_slice(&VERSION.to_le_bytes());
    p
}

/// Checks a peer's preamble; returns its version.
pub fn parse_preamble(p: &[u8; PREAMBLE_LEN]) -> Option<u16> {
    (&p[..6] == MAGIC).then(|| u16::from_le_bytes([p[6], p[7]]))
}

/// A whole control frame: header plus JSON body.
pub fn json_frame<T: Serialize>(kind: Kind, msg: &T) -> Vec<u8> {
    let body = serde_json::to_vec(msg).expect("control messages serialize");
    let mut out = Vec::with_capacity(HEADER_LEN + body.len());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.push(kind as u8);
    out.extend_from_slice(&body);
    out
}

/// Reads one frame, refusing bodies over `max_len`.
pub async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    max_len: u32,
) -> std::io::Result<(u8, Bytes)> {
    let mut header = [0u8; HEADER_LEN];
    r.read_exact(&mut header).await?;
    let len = u32::from_le_bytes(header[..4].try_into().unwrap());
    if len > max_len {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("frame of {len} bytes is over the limit of {max_len}"),
        ));
    }
    // Grow the body as its bytes arrive: a header may claim up to 4 GiB that never come.
    let mut body = Vec::with_capacity((len as usize).min(FIRST_READ));
    r.take(len as u64).read_to_end(&mut body).await?;
    if body.len() < len as usize {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    Ok((header[4], Bytes::from(body)))
}

/// The most `read_frame` allocates before a frame's body has arrived.
const FIRST_READ: usize = 4 << 20;

/// One piece of an encoded frame, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Part {
    /// Bytes built for this frame (headers, small pieces copied together).
    Inline(Bytes),
    /// A slice of a shard's bytes, which the sink may hand to the kernel by reference
    /// instead of copying when they are cache-file pages (see `sink.rs`).
    Shard(ShardBytes),
}

impl Part {
    pub fn bytes(&self) -> &[u8] {
        match self {
            Part::Inline(b) => b,
            Part::Shard(b) => b,
        }
    }
}

/// Takes samples from the front of `samples` for one batch (at least one): about `target`
/// bytes of payload ([`BATCH_TARGET_BYTES`], [`MAPPED_BATCH_TARGET_BYTES`]) and at most
/// `BATCH_TARGET_BYTES` of small pieces (the key, fields up to `INLINE_MAX`: copied into
/// the frame whatever the delivery), within the iovec and sample limits. A function of the
/// samples alone, so a batch cut by a park is cut the same again.
pub fn take_batch(samples: &mut std::collections::VecDeque<Sample>, target: usize) -> Vec<Sample> {
    let mut batch = Vec::new();
    let (mut payload, mut small, mut parts) = (0usize, 0usize, 1usize);
    while let Some(s) = samples.front() {
        let (mut big, mut s_small) = (0, s.key.bytes().len());
        for (_, d) in &s.fields {
            if d.len() > INLINE_MAX {
                big += 1;
            } else {
                s_small += d.len();
            }
        }
        if !batch.is_empty()
            && (payload + s.payload_len() > target
                || small + s_small > BATCH_TARGET_BYTES
                || parts + 2 * big + 1 > MAX_PARTS
                || batch.len() >= BATCH_MAX_SAMPLES)
        {
            break;
        }
        payload += s.payload_len();
        small += s_small;
        parts += 2 * big + 1;
        batch.push(samples.pop_front().unwrap());
    }
    batch
}

/// Takes samples from the front of `samples` for one batch and encodes them as a BATCH frame:
/// a list of parts to write in order.
pub fn encode_batch(
    samples: &mut std::collections::VecDeque<Sample>,
) -> Result<(Vec<Part>, Vec<Sample>), String> {
    let batch = take_batch(samples, BATCH_TARGET_BYTES);
    let mut names: Vec<&str> = Vec::new();
    let mut urls: Vec<&str> = Vec::new();
    let mut words: Vec<u32> = Vec::new();
    for s in &batch {
        let url = index_of(&mut urls, &s.url);
        words.push(url | ((s.fields.len() as u32) << 16));
        words.push(s.key.bytes().len() as u32);
        for (name, data) in &s.fields {
            words.push(index_of(&mut names, name));
            words.push(u32::try_from(data.len()).map_err(|_| {
                format!(
                    "{}: sample {:?} field {name:?} is {} bytes, over the protocol's 4 GiB limit",
                    s.url,
                    s.key,
                    data.len()
                )
            })?);
        }
    }
    let payload = batch.iter().map(Sample::payload_len).sum();
    let max_piece = batch
        .iter()
        .flat_map(|s| {
            std::iter::once(s.key.bytes().len()).chain(s.fields.iter().map(|(_, d)| d.len()))
        })
        .max()
        .unwrap_or(0);
    let head = frame_head(
        Kind::Batch,
        batch.len(),
        &names,
        &urls,
        &words,
        payload,
        max_piece,
    )?;
    let out = payload_parts(head, &batch, || false);
    Ok((out, batch))
}

/// A batch frame up to its payload: frame header, batch header, name and URL tables, words.
/// `payload`: the bytes that follow it in the frame.
pub(crate) fn frame_head(
    kind: Kind,
    samples: usize,
    names: &[&str],
    urls: &[&str],
    words: &[u32],
    payload: usize,
    max_piece: usize,
) -> Result<BytesMut, String> {
    let tables: usize = names.iter().chain(urls.iter()).map(|t| 4 + t.len()).sum();
    let payload_offset = BATCH_HEADER_LEN + tables + 4 * words.len();
    let body_len = u32::try_from(payload_offset + payload)
        .map_err(|_| "a batch frame is over the protocol's 4 GiB limit".to_string())?;
    let mut head = BytesMut::with_capacity(HEADER_LEN + payload_offset + 4096);
    head.put_u32_le(body_len);
    head.put_u8(kind as u8);
    for n in [
        samples,
        words.len(),
        names.len(),
        urls.len(),
        payload_offset,
        max_piece,
    ] {
        head.put_u32_le(n as u32);
    }
    for t in names.iter().chain(urls.iter()) {
        head.put_u32_le(t.len() as u32);
        head.put_slice(t.as_bytes());
    }
    for w in words {
        head.put_u32_le(*w);
    }
    debug_assert_eq!(head.len(), HEADER_LEN + payload_offset);
    Ok(head)
}

/// The frame's parts: `head`, then each sample's key and fields in order; small pieces are
/// appended to the running inline buffer, big ones go as they are, and fields `skip` says
/// (called once per field, in order) take no payload (a MAPPED_BATCH's mapped fields).
pub(crate) fn payload_parts(
    head: BytesMut,
    batch: &[Sample],
    mut skip: impl FnMut() -> bool,
) -> Vec<Part> {
    let mut out = Vec::new();
    let mut inline = head;
    for s in batch {
        inline.put_slice(s.key.bytes());
        for (_, data) in &s.fields {
            if skip() {
                continue;
            }
            if data.len() > INLINE_MAX {
                out.push(Part::Inline(std::mem::take(&mut inline).freeze()));
                out.push(Part::Shard(data.clone()));
            } else {
                inline.put_slice(data);
            }
        }
    }
    if !inline.is_empty() {
        out.push(Part::Inline(inline.freeze()));
    }
    out
}

pub(crate) fn index_of<'a>(table: &mut Vec<&'a str>, item: &'a str) -> u32 {
    match table.iter().position(|t| *t == item) {
        Some(i) => i as u32,
        None => {
            table.push(item);
            (table.len() - 1) as u32
        }
    }
}

/// A sample as a client receives it.
#[derive(Debug, Clone, PartialEq)]
pub struct ReceivedSample {
    pub key: String,
    pub url: String,
    pub fields: Vec<(String, Bytes)>,
}

/// Decodes a BATCH body (the Rust client's side of [`encode_batch`]).
pub fn decode_batch(body: Bytes) -> Result<Vec<ReceivedSample>, String> {
    let short = || "batch frame is shorter than its header says".to_string();
    let mut b = body.clone();
    if b.remaining() < BATCH_HEADER_LEN {
        return Err(short());
    }
    let (n, n_words, n_names, n_urls) = (
        b.get_u32_le(),
        b.get_u32_le(),
        b.get_u32_le(),
        b.get_u32_le(),
    );
    let (_payload_offset, _max_piece) = (b.get_u32_le(), b.get_u32_le());
    let mut table = |count: u32| -> Result<Vec<String>, String> {
        (0..count)
            .map(|_| {
                if b.remaining() < 4 {
                    return Err(short());
                }
                let len = b.get_u32_le() as usize;
                if b.remaining() < len {
                    return Err(short());
                }
                String::from_utf8(b.split_to(len).to_vec()).map_err(|e| e.to_string())
            })
            .collect()
    };
    let names = table(n_names)?;
    let urls = table(n_urls)?;
    if b.remaining() < n_words as usize * 4 {
        return Err(short());
    }
    let words: Vec<u32> = (0..n_words).map(|_| b.get_u32_le()).collect();
    // A sample takes at least two words: counts in the header are no reason to allocate.
    let mut out = Vec::with_capacity((n as usize).min(words.len() / 2));
    let mut words = words.into_iter();
    let mut next = || words.next().ok_or_else(short);
    for _ in 0..n {
        let head = next()?;
        let key_len = next()? as usize;
        if b.remaining() < key_len {
            return Err(short());
        }
        let key = String::from_utf8(b.split_to(key_len).to_vec()).map_err(|e| e.to_string())?;
        let url = urls
            .get((head & 0xffff) as usize)
            .ok_or_else(short)?
            .clone();
        let mut fields = Vec::new();
        for _ in 0..head >> 16 {
            let name = names.get(next()? as usize).ok_or_else(short)?.clone();
            let len = next()? as usize;
            if b.remaining() < len {
                return Err(short());
            }
            fields.push((name, b.split_to(len)));
        }
        out.push(ReceivedSample { key, url, fields });
    }
    Ok(out)
}

/// Writes a control frame and flushes.
pub async fn write_json<W: AsyncWrite + Unpin, T: Serialize>(
    w: &mut W,
    kind: Kind,
    msg: &T,
) -> std::io::Result<()> {
    w.write_all(&json_frame(kind, msg)).await?;
    w.flush().await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;
    use std::sync::Arc;

    fn sample(key: &str, url: &Arc<str>, fields: &[(&str, usize)]) -> Sample {
        Sample {
            key: key.into(),
            url: url.clone(),
            fields: fields
                .iter()
                .map(|(n, len)| {
                    (
                        Arc::from(*n),
                        ShardBytes::heap(Bytes::from(vec![key.len() as u8; *len])),
                    )
                })
                .collect(),
        }
    }

    #[test]
    fn batch_roundtrip_small_and_large_fields() {
        let (u1, u2): (Arc<str>, Arc<str>) = (Arc::from("gs://b/0.tar"), Arc::from("gs://b/1.tar"));
        let mut q: VecDeque<Sample> = VecDeque::from(vec![
            sample("a", &u1, &[("jpg", 10), ("cls", 1)]),
            sample("bb", &u2, &[("jpg", 100_000)]),
            sample("ccc", &u1, &[("seg.png", 5000), ("json", 0)]),
        ]);
        let want: Vec<Sample> = q.iter().cloned().collect();
        let (parts, sent) = encode_batch(&mut q).unwrap();
        assert!(q.is_empty());
        assert_eq!(sent, want);
        let frame: Vec<u8> = parts.iter().flat_map(|p| p.bytes().to_vec()).collect();
        let len = u32::from_le_bytes(frame[..4].try_into().unwrap()) as usize;
        assert_eq!(len, frame.len() - HEADER_LEN);
        assert_eq!(frame[4], Kind::Batch as u8);
        let body = &frame[HEADER_LEN..];
        let word =
            |i: usize| u32::from_le_bytes(body[4 * i..4 * i + 4].try_into().unwrap()) as usize;
        assert_eq!(word(5), 100_000, "max_piece");
        let payload: usize = want.iter().map(Sample::payload_len).sum();
        assert_eq!(word(4), body.len() - payload, "payload_offset");
        let got = decode_batch(Bytes::from(body.to_vec())).unwrap();
        assert_eq!(got.len(), 3);
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(g.key, w.key.as_str());
            assert_eq!(g.url, &*w.url);
            let wf: Vec<(String, Bytes)> = w
                .fields
                .iter()
                .map(|(n, d)| (n.to_string(), d.as_bytes().clone()))
                .collect();
            assert_eq!(g.fields, wf);
        }
    }

    #[test]
    fn batches_are_cut_by_size() {
        let u: Arc<str> = Arc::from("u");
        let mut q: VecDeque<Sample> = (0..60)
            .map(|i| sample(&format!("k{i}"), &u, &[("bin", 100_000)]))
            .collect();
        let (_, first) = encode_batch(&mut q).unwrap();
        assert_eq!(first.len(), BATCH_TARGET_BYTES / 100_003);
        // A zero-copy frame takes 4× the samples: its mapped fields are a few words each...
        assert_eq!(
            take_batch(&mut q, MAPPED_BATCH_TARGET_BYTES).len(),
            MAPPED_BATCH_TARGET_BYTES / 100_003
        );
        // ...but no more small pieces, which are copied into it all the same.
        let mut q: VecDeque<Sample> = (0..1000)
            .map(|i| sample(&format!("k{i:03}"), &u, &[("txt", INLINE_MAX)]))
            .collect();
        let small = take_batch(&mut q, MAPPED_BATCH_TARGET_BYTES).len();
        assert_eq!(small, BATCH_TARGET_BYTES / (INLINE_MAX + 4));
        // One sample bigger than the target still travels, alone.
        let mut q: VecDeque<Sample> = (0..2)
            .map(|i| sample(&format!("k{i}"), &u, &[("bin", 3 << 20)]))
            .collect();
        assert_eq!(encode_batch(&mut q).unwrap().1.len(), 1);
    }

    #[test]
    fn preamble_roundtrip() {
        assert_eq!(parse_preamble(&preamble()), Some(VERSION));
        assert_eq!(parse_preamble(b"GET / HT"), None);
    }
}
