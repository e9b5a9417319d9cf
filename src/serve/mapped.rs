//! Zero-copy delivery (protocol 5, `"zero_copy": true` in the REQUEST; PROTOCOL.md).
//!
//! Instead of copying a large piece's bytes into the socket, the daemon passes the client the
//! shard's *committed cache file* once, as a read-only descriptor (a MAP frame with the
//! descriptor attached, SCM_RIGHTS), and batches then say "map m, offset o, length n"
//! (MAPPED_BATCH frames). The client maps the file read-only and hands out slices of it.
//!
//! Pins: every map holds a slice of the shard's bytes, so its cache entry stays pinned
//! (counted in the hard budget, never evicted) until the client RELEASEs it, the stream ends
//! or the connection closes. A connection holds at most `server.zero_copy_maps` maps; when
//! a piece needs another map beyond that, it is sent inline (the socket path): the stream
//! never waits because its client holds memoryviews.
//!
//! Bytes: maps of all connections together pin at most `server.zero_copy_share` of
//! `cache.max_size` ([`MapBudget`]); a piece whose map would pass that goes inline too. So
//! zero copy cannot fill the cache with pins that the socket path would not hold, whatever
//! the shard size and the number of connections.
//!
//! A map is *active* while batches may still refer to it. When the stream needs a new map it
//! first retires the active maps whose shard has no sample left in the stream (UNMAP: never
//! referred to again); the client RELEASEs a retired map once nothing of it is alive. Only
//! retired maps may be released, so a RELEASE never races a batch in flight.

use std::collections::{HashMap, VecDeque};
use std::io::IoSlice;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::Interest;
use tokio::net::UnixStream;
use tokio::net::unix::OwnedReadHalf;

use crate::cache::{Cache, ShardBytes};
use crate::protocol::{self, BATCH_HEADER_LEN, HEADER_LEN, Kind, Part};
use crate::serve::sink::SendError;
use crate::shard::Sample;

/// Pieces of at least this many bytes are mapped; smaller ones (labels, JSON, keys) are
/// cheaper inline, and stay `bytes` in the client.
pub const MAP_MIN: usize = protocol::INLINE_MAX + 1;
/// Words per field in a MAPPED_BATCH: name index (bit 31: mapped), length, map id, offset
/// (low, high 32 bits).
pub const FIELD_WORDS: usize = 5;
/// Socket send buffer of a zero-copy connection: its batches are small, and a smaller buffer
/// keeps the daemon (and its maps) close behind the client.
pub const SEND_BUFFER: usize = 128 << 10;

/// The bytes the maps of every connection may pin together (a share of the cache budget).
pub struct MapBudget {
    limit: u64,
    used: AtomicU64,
    gauge: prometheus::IntGauge,
}

impl MapBudget {
    pub fn new(limit: u64, gauge: prometheus::IntGauge) -> MapBudget {
        MapBudget {
            limit,
            used: AtomicU64::new(0),
            gauge,
        }
    }

    /// Takes `n` bytes if they fit.
    fn take(&self, n: u64) -> bool {
        let fits = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(n).filter(|&u| u <= self.limit)
            })
            .is_ok();
        if fits {
            self.gauge.add(n as i64);
        }
        fits
    }

    fn give_back(&self, n: u64) {
        self.used.fetch_sub(n, Ordering::AcqRel);
        self.gauge.sub(n as i64);
    }
}

/// One connection's maps.
pub struct Maps {
    limit: usize,
    gauge: prometheus::IntGauge,
    budget: Arc<MapBudget>,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    next_id: u32,
    active: Vec<Map>,
    /// Maps the client was told are unused (UNMAP), until it releases them.
    retired: HashMap<u32, Map>,
    /// Frames to send before the next batch: (bytes, descriptor to attach).
    control: VecDeque<(Vec<u8>, Option<OwnedFd>)>,
    /// The decisions of the batch being sent, until it is whole: a batch cut by a park is
    /// encoded again the same (the sink sends only its rest).
    replay: Option<Vec<Option<(u32, u64)>>>,
}

struct Map {
    id: u32,
    url: Arc<str>,
    base: usize,
    len: usize,
    /// Keeps the entry pinned and its mapping alive.
    _holder: ShardBytes,
}

/// Why a zero-copy client's connection must end.
#[derive(Debug)]
pub enum ReaderEnd {
    /// The client closed its side.
    Left,
    /// It broke the protocol (the message says how).
    Violation(String),
}

impl Maps {
    pub fn new(limit: usize, gauge: prometheus::IntGauge, budget: Arc<MapBudget>) -> Maps {
        Maps {
            limit,
            gauge,
            budget,
            state: Mutex::new(State {
                next_id: 1,
                ..State::default()
            }),
        }
    }

    /// Maps held now (active and retired).
    pub fn held(&self) -> usize {
        let st = self.state.lock().unwrap();
        st.active.len() + st.retired.len()
    }

    /// A RELEASE of map `id`.
    pub fn release(&self, id: u32) -> Result<(), String> {
        let mut st = self.state.lock().unwrap();
        if let Some(m) = st.retired.remove(&id) {
            self.gauge.dec();
            self.budget.give_back(m.len as u64);
            return Ok(());
        }
        Err(match st.active.iter().any(|m| m.id == id) {
            true => format!("RELEASE of map {id}, which is still in use (no UNMAP was sent)"),
            false => format!("RELEASE of map {id}, which this connection does not hold"),
        })
    }

    /// Encodes `batch` as a MAPPED_BATCH frame, queueing the MAP and UNMAP frames it needs.
    /// `live` gives the shards the stream still has samples of (asked only when a new map is
    /// needed).
    pub fn encode(
        &self,
        cache: &Cache,
        batch: &[Sample],
        live: impl FnOnce() -> Vec<Arc<str>>,
    ) -> Result<Vec<Part>, String> {
        let mut st = self.state.lock().unwrap();
        let decisions = match st.replay.clone() {
            Some(d) => d,
            None => {
                let d = self.decide(&mut st, cache, batch, live);
                st.replay = Some(d.clone());
                d
            }
        };
        encode_frame(batch, &decisions)
    }

    fn decide(
        &self,
        st: &mut State,
        cache: &Cache,
        batch: &[Sample],
        live: impl FnOnce() -> Vec<Arc<str>>,
    ) -> Vec<Option<(u32, u64)>> {
        // Maps of shards the stream has no sample left of are retired at once (not when the
        // next map is needed), so the client can release them as soon as it is done with them.
        if st
            .active
            .iter()
            .any(|m| !batch.iter().any(|s| s.url == m.url))
        {
            let mut keep = live();
            keep.extend(batch.iter().map(|s| s.url.clone()));
            self.retire(st, |url| !keep.iter().any(|k| **k == *url));
        }
        let mut refused: Vec<Arc<str>> = Vec::new();
        let mut out = Vec::new();
        for s in batch {
            for (_, data) in &s.fields {
                if data.len() < MAP_MIN || data.spliceable().is_none() {
                    out.push(None);
                    continue;
                }
                let at = data.as_ptr() as usize;
                let found = st
                    .active
                    .iter()
                    .find(|m| m.url == s.url && at >= m.base && at + data.len() <= m.base + m.len);
                if let Some(m) = found {
                    out.push(Some((m.id, (at - m.base) as u64)));
                    continue;
                }
                if refused.contains(&s.url) {
                    out.push(None);
                    continue;
                }
                let mapped = (st.active.len() + st.retired.len() < self.limit)
                    .then(|| cache.committed_file(&s.url, data))
                    .flatten()
                    .filter(|&(_, _, len)| self.budget.take(len as u64));
                let Some((file, base, len)) = mapped else {
                    refused.push(s.url.clone());
                    out.push(None);
                    continue;
                };
                let id = st.next_id;
                st.next_id = st.next_id.wrapping_add(1).max(1);
                let mut frame = Vec::with_capacity(HEADER_LEN + 12);
                frame.extend_from_slice(&12u32.to_le_bytes());
                frame.push(Kind::Map as u8);
                frame.extend_from_slice(&id.to_le_bytes());
                frame.extend_from_slice(&(len as u64).to_le_bytes());
                st.control.push_back((frame, Some(OwnedFd::from(file))));
                st.active.push(Map {
                    id,
                    url: s.url.clone(),
                    base,
                    len,
                    _holder: data.clone(),
                });
                self.gauge.inc();
                out.push(Some((id, (at - base) as u64)));
            }
        }
        out
    }

    /// Retires the active maps `gone` says are of no use, queueing one UNMAP frame.
    fn retire(&self, st: &mut State, gone: impl Fn(&str) -> bool) {
        let mut ids = Vec::new();
        let mut i = 0;
        while i < st.active.len() {
            if gone(&st.active[i].url) {
                let m = st.active.swap_remove(i);
                ids.push(m.id);
                st.retired.insert(m.id, m);
            } else {
                i += 1;
            }
        }
        if !ids.is_empty() {
            st.control.push_back((unmap_frame(&ids), None));
        }
    }

    /// The batch last encoded was sent whole.
    pub fn sent(&self) {
        self.state.lock().unwrap().replay = None;
    }

    /// Sends the queued MAP and UNMAP frames (each whole, before the batch that needs them).
    /// Fails with `Stalled` when the client takes no byte for `stall` (the batches' own
    /// progress check: a slow reader that keeps taking bytes is never parked); nothing is
    /// then cut: the frame stays queued.
    pub async fn flush(&self, sock: &UnixStream, stall: Duration) -> Result<(), SendError> {
        loop {
            let Some((frame, fd)) = self.state.lock().unwrap().control.pop_front() else {
                return Ok(());
            };
            let mut done = 0usize;
            while done < frame.len() {
                let attach = fd.as_ref().filter(|_| done == 0);
                match sock.try_io(Interest::WRITABLE, || {
                    send_with_fd(sock, &frame[done..], attach)
                }) {
                    Ok(n) => done += n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        match crate::serve::sink::until_stalled(sock, stall, sock.writable()).await
                        {
                            Ok(ready) => ready?,
                            Err(stalled) if done == 0 => {
                                self.state.lock().unwrap().control.push_front((frame, fd));
                                return Err(stalled);
                            }
                            // A small frame cut in two: only a stalled, full socket does that.
                            Err(_) => return Err(SendError::Resent("a MAP frame was cut".into())),
                        }
                    }
                    Err(e) => return Err(e.into()),
                }
            }
        }
    }

    /// Reads the client's RELEASE frames until it closes or breaks the protocol.
    pub async fn read_releases(&self, rd: &mut OwnedReadHalf) -> ReaderEnd {
        loop {
            let (kind, body) = match protocol::read_frame(rd, protocol::MAX_CLIENT_FRAME).await {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return ReaderEnd::Left,
                Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
                    return ReaderEnd::Violation(e.to_string());
                }
                Err(_) => return ReaderEnd::Left,
            };
            if kind != Kind::Release as u8 {
                return ReaderEnd::Violation(format!(
                    "a frame of kind {kind} after the request; a zero-copy client sends only RELEASE (kind 9)"
                ));
            }
            if body.len() % 4 != 0 {
                return ReaderEnd::Violation(format!(
                    "a RELEASE of {} bytes (a list of u32 map ids)",
                    body.len()
                ));
            }
            for id in body.chunks_exact(4) {
                if let Err(e) = self.release(u32::from_le_bytes(id.try_into().unwrap())) {
                    return ReaderEnd::Violation(e);
                }
            }
        }
    }
}

impl Drop for Maps {
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap();
        let maps = st.active.iter().chain(st.retired.values());
        let bytes: usize = maps.map(|m| m.len).sum();
        self.budget.give_back(bytes as u64);
        self.gauge.sub(self.held() as i64);
    }
}

fn unmap_frame(ids: &[u32]) -> Vec<u8> {
    let mut frame = Vec::with_capacity(HEADER_LEN + 4 * ids.len());
    frame.extend_from_slice(&(4 * ids.len() as u32).to_le_bytes());
    frame.push(Kind::Unmap as u8);
    for id in ids {
        frame.extend_from_slice(&id.to_le_bytes());
    }
    frame
}

pub(crate) fn send_with_fd(
    sock: &UnixStream,
    data: &[u8],
    fd: Option<&OwnedFd>,
) -> std::io::Result<usize> {
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags, sendmsg};
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut anc = SendAncillaryBuffer::new(&mut space);
    let fds;
    if let Some(fd) = fd {
        fds = [fd.as_fd()];
        anc.push(SendAncillaryMessage::ScmRights(&fds));
    }
    let flags = SendFlags::DONTWAIT | SendFlags::NOSIGNAL;
    Ok(sendmsg(sock, &[IoSlice::new(data)], &mut anc, flags)?)
}

/// A MAPPED_BATCH frame: as a BATCH, with `FIELD_WORDS` words per field; mapped fields take
/// no payload.
fn encode_frame(batch: &[Sample], decisions: &[Option<(u32, u64)>]) -> Result<Vec<Part>, String> {
    let fields: usize = batch.iter().map(|s| s.fields.len()).sum();
    if fields != decisions.len() {
        return Err(format!(
            "a batch of {fields} fields re-encoded with {} decisions",
            decisions.len()
        ));
    }
    let mut names: Vec<&str> = Vec::new();
    let mut urls: Vec<&str> = Vec::new();
    let mut words: Vec<u32> = Vec::with_capacity(2 * batch.len() + FIELD_WORDS * fields);
    let (mut payload, mut max_piece) = (0usize, 0usize);
    let mut d = decisions.iter();
    for s in batch {
        words.push(protocol::index_of(&mut urls, &s.url) | ((s.fields.len() as u32) << 16));
        let key = s.key.bytes().len();
        words.push(key as u32);
        payload += key;
        max_piece = max_piece.max(key);
        for (name, data) in &s.fields {
            let len =
                u32::try_from(data.len()).map_err(|_| format!("{}: a field over 4 GiB", s.url))?;
            let (flag, map, off) = match d.next().unwrap() {
                Some((map, off)) => (1u32 << 31, *map, *off),
                None => {
                    payload += data.len();
                    max_piece = max_piece.max(data.len());
                    (0, 0, 0)
                }
            };
            words.extend_from_slice(&[
                protocol::index_of(&mut names, name) | flag,
                len,
                map,
                off as u32,
                (off >> 32) as u32,
            ]);
        }
    }
    let head = protocol::frame_head(
        Kind::MappedBatch,
        batch.len(),
        &names,
        &urls,
        &words,
        payload,
        max_piece,
    )?;
    let mut d = decisions.iter();
    let out = protocol::payload_parts(head, batch, || d.next().unwrap().is_some());
    Ok(out)
}

/// A field of a decoded MAPPED_BATCH (the Rust side of the client's decoder, for tests).
#[derive(Debug, Clone, PartialEq)]
pub enum Field {
    Inline(Vec<u8>),
    Mapped { map: u32, offset: u64, len: u32 },
}

/// Decodes a MAPPED_BATCH body: per sample (key, url, fields).
#[allow(clippy::type_complexity)]
pub fn decode_frame(body: &[u8]) -> Result<Vec<(String, String, Vec<(String, Field)>)>, String> {
    let short = || "mapped batch shorter than its header says".to_string();
    let u32_at = |p: usize| -> Result<u32, String> {
        body.get(p..p + 4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
            .ok_or_else(short)
    };
    let (n, n_words, n_names, n_urls, payload_offset) =
        (u32_at(0)?, u32_at(4)?, u32_at(8)?, u32_at(12)?, u32_at(16)?);
    let mut p = BATCH_HEADER_LEN;
    let mut tables = Vec::new();
    for _ in 0..n_names + n_urls {
        let len = u32_at(p)? as usize;
        let t = body.get(p + 4..p + 4 + len).ok_or_else(short)?;
        tables.push(String::from_utf8(t.to_vec()).map_err(|e| e.to_string())?);
        p += 4 + len;
    }
    let words: Vec<u32> = (0..n_words as usize)
        .map(|i| u32_at(p + 4 * i))
        .collect::<Result<_, _>>()?;
    let mut at = payload_offset as usize;
    let mut take = |len: usize| -> Result<Vec<u8>, String> {
        let b = body.get(at..at + len).ok_or_else(short)?.to_vec();
        at += len;
        Ok(b)
    };
    let mut w = words.iter().copied();
    let mut next = || w.next().ok_or_else(short);
    let mut out = Vec::new();
    for _ in 0..n {
        let head = next()?;
        let key = String::from_utf8(take(next()? as usize)?).map_err(|e| e.to_string())?;
        let url = tables
            .get(n_names as usize + (head & 0xffff) as usize)
            .ok_or_else(short)?
            .clone();
        let mut fields = Vec::new();
        for _ in 0..head >> 16 {
            let (name, len, map, lo, hi) = (next()?, next()?, next()?, next()?, next()?);
            let fname = tables
                .get((name & 0x7fff_ffff) as usize)
                .ok_or_else(short)?
                .clone();
            let field = match name >> 31 {
                1 => Field::Mapped {
                    map,
                    offset: lo as u64 | (hi as u64) << 32,
                    len,
                },
                _ => Field::Inline(take(len as usize)?),
            };
            fields.push((fname, field));
        }
        out.push((key, url, fields));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn sample(key: &str, url: &Arc<str>, fields: &[(&str, usize)]) -> Sample {
        Sample {
            key: key.into(),
            url: url.clone(),
            fields: fields
                .iter()
                .map(|(n, len)| {
                    (
                        Arc::from(*n),
                        ShardBytes::heap(Bytes::from(vec![*len as u8; *len])),
                    )
                })
                .collect(),
        }
    }

    #[test]
    fn mapped_batch_roundtrip() {
        let u: Arc<str> = Arc::from("gs://b/0.tar");
        let batch = vec![
            sample("a", &u, &[("jpg", 10_000), ("cls", 1)]),
            sample("bb", &u, &[("jpg", 6000), ("big", 20_000)]),
        ];
        let decisions = vec![Some((3, 5 << 32 | 7)), None, None, Some((4, 123))];
        let parts = encode_frame(&batch, &decisions).unwrap();
        let frame: Vec<u8> = parts.iter().flat_map(|p| p.bytes().to_vec()).collect();
        assert_eq!(frame[4], Kind::MappedBatch as u8);
        let len = u32::from_le_bytes(frame[..4].try_into().unwrap()) as usize;
        assert_eq!(len, frame.len() - HEADER_LEN);
        let got = decode_frame(&frame[HEADER_LEN..]).unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(
            (got[0].0.as_str(), got[0].1.as_str()),
            ("a", "gs://b/0.tar")
        );
        assert_eq!(
            got[0].2,
            vec![
                (
                    "jpg".to_string(),
                    Field::Mapped {
                        map: 3,
                        offset: 5 << 32 | 7,
                        len: 10_000
                    }
                ),
                ("cls".to_string(), Field::Inline(vec![1])),
            ]
        );
        assert_eq!(
            got[1].2[0],
            ("jpg".to_string(), Field::Inline(vec![112; 6000]))
        );
        assert_eq!(
            got[1].2[1],
            (
                "big".to_string(),
                Field::Mapped {
                    map: 4,
                    offset: 123,
                    len: 20_000
                }
            )
        );
        // Mismatched decisions (a park re-encoding another batch) are refused.
        assert!(encode_frame(&batch, &decisions[..3]).is_err());
    }

    #[test]
    fn unmap_and_release() {
        let f = unmap_frame(&[1, 2]);
        assert_eq!(f, [8, 0, 0, 0, 8, 1, 0, 0, 0, 2, 0, 0, 0]);
        let gauge = prometheus::IntGauge::new("g", "g").unwrap();
        let bytes = prometheus::IntGauge::new("b", "b").unwrap();
        let budget = Arc::new(MapBudget::new(10, bytes.clone()));
        let maps = Maps::new(2, gauge.clone(), budget.clone());
        assert!(budget.take(5));
        {
            let mut st = maps.state.lock().unwrap();
            let map = Map {
                id: 7,
                url: "u".into(),
                base: 0,
                len: 5,
                _holder: ShardBytes::heap(Bytes::from_static(b"x")),
            };
            st.retired.insert(7, map);
        }
        gauge.inc();
        assert!(!budget.take(6), "past the budget");
        assert!(maps.release(8).unwrap_err().contains("does not hold"));
        maps.release(7).unwrap();
        assert!(maps.release(7).is_err(), "released twice");
        assert_eq!((maps.held(), gauge.get(), bytes.get()), (0, 0, 0));
        assert!(budget.take(10));
    }
}
