//! Writes encoded frames to a client's socket.
//!
//! Copying shard bytes into the socket is the daemon's largest cost (it shares the host's
//! cores with the trainers it feeds), so pieces of cache-file memory of at least
//! [`SPLICE_MIN`] bytes ([`crate::cache::ShardBytes::spliceable`]) are not copied: they are
//! `vmsplice`d into a per-connection pipe by reference and `splice`d from the pipe into the
//! socket, which hands the page-cache pages themselves to the receiving side; the only copy
//! left is the one into the trainer's memory. The rest of such a frame (its header, keys,
//! labels) is copied once into a *sealed* buffer ([`ShardBytes::sealed`]) that goes by
//! reference too, so a whole frame takes one `vmsplice` per pipe-full (many iovecs) rather
//! than a syscall per piece. A frame with nothing to splice is `writev`n to the socket, as is
//! everything when there is no pipe (e.g. out of file descriptors).
//!
//! Why borrowing pages is safe here: spliced parts are slices of read-only mappings whose
//! pages nobody writes again: committed cache files (see `cache/bytes.rs`), or sealed buffers
//! (read-only anonymous mappings, unmapped and never reused once dropped). The kernel holds
//! its own reference on each page until the receiver has read it, so unmapping or unlinking
//! meanwhile is harmless. Ordinary heap memory is never vmspliced: it could be reused before
//! it is read.

use std::io::{self, IoSlice};
use std::os::fd::OwnedFd;
use std::time::Duration;

use rustix::pipe::{IoSliceRaw, PipeFlags, SpliceFlags};

use tokio::io::Interest;
use tokio::net::UnixStream;

use crate::cache::ShardBytes;
use crate::protocol::Part;

/// Mapped pieces at least this large are spliced; smaller ones are copied into the frame's
/// sealed buffer (a piece takes a pipe slot per page it touches, and a pipe has 64).
const SPLICE_MIN: usize = 4 << 10;
/// Iovecs per `vmsplice` (the kernel's limit is 1024).
const IOVECS: usize = 256;
/// Pipe capacity asked for. 1 MiB measured no faster than 256 KiB, and an unprivileged user
/// may hold only 64 MiB of pipes in all (fs.pipe-user-pages-soft): 256 connections at this size.
const PIPE_SIZE: usize = 256 << 10;

pub struct Sink {
    pipe: Option<Pipe>,
    /// The frame being written, while it is partly written: nothing else may be sent on the
    /// socket until it is finished (by the same parts, see [`Sink::send`]).
    partial: Option<Partial>,
}

/// How far a frame got.
#[derive(Debug, Clone, Copy)]
struct Partial {
    /// The frame's length in bytes.
    len: usize,
    /// Its bytes already handed to the kernel (the socket, or the pipe in front of it).
    done: usize,
}

/// Why a frame was not written whole.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    #[error(transparent)]
    Io(#[from] io::Error),
    /// The client took no byte for the stall time. The frame is partly written: the next
    /// `send` must be given the same parts, and goes on where this one stopped.
    #[error("the client took no data for {0:?}")]
    Stalled(Duration),
    /// A frame other than the one cut off was sent (a bug, or shard bytes that changed
    /// under a parked stream): sending it would corrupt the stream.
    #[error("{0}")]
    Resent(String),
}

struct Pipe {
    read: OwnedFd,
    write: OwnedFd,
    /// Bytes in the pipe not yet spliced into the socket.
    pending: usize,
}

impl Sink {
    pub fn new() -> Sink {
        let pipe = Pipe::new()
            .inspect_err(|e| tracing::debug!(error = %e, "no pipe; sending with writev"))
            .ok();
        Sink {
            pipe,
            partial: None,
        }
    }

    /// Whether the last frame was cut off mid-way (the socket then carries a partial frame,
    /// and only finishing it, or closing the socket, is safe).
    pub fn torn(&self) -> bool {
        self.partial.is_some()
    }

    /// Writes one frame's parts, in order, to `sock`. Fails with [`SendError::Stalled`] when
    /// the client takes no byte for `stall` (a slow reader that keeps taking bytes is never
    /// cut); the frame is then partly written, and a later call with the same frame's parts
    /// (re-encoded from the same samples: encoding is deterministic) sends only the rest.
    pub async fn send(
        &mut self,
        sock: &UnixStream,
        parts: &[Part],
        stall: Duration,
    ) -> Result<(), SendError> {
        let len = parts.iter().map(|p| p.bytes().len()).sum();
        let mut at = match self.partial {
            Some(p) if p.len == len => p,
            // A bug, not the client's doing: resending anything else would corrupt the stream.
            Some(p) => {
                return Err(SendError::Resent(format!(
                    "a frame of {len} bytes sent where a frame of {} bytes was cut off",
                    p.len
                )));
            }
            None => Partial { len, done: 0 },
        };
        let result = match &mut self.pipe {
            // Through the pipe only when something gets spliced (otherwise it is one more
            // syscall per frame for nothing: small samples), or when the pipe still holds the
            // start of this frame.
            Some(pipe) if pipe.pending > 0 || parts.iter().any(spliced) => {
                pipe.send(sock, parts, &mut at.done, stall).await
            }
            _ => writev_all(sock, parts, &mut at.done, stall).await,
        };
        self.partial = match result {
            Ok(()) => None,
            Err(_) => Some(at),
        };
        result
    }
}

impl Default for Sink {
    fn default() -> Self {
        Self::new()
    }
}

impl Pipe {
    fn new() -> io::Result<Pipe> {
        let (read, write) = rustix::pipe::pipe_with(PipeFlags::NONBLOCK | PipeFlags::CLOEXEC)?;
        // A bigger pipe means fewer fill/drain rounds per frame; the default (64 KiB) works too.
        let _ = rustix::pipe::fcntl_setpipe_size(&write, PIPE_SIZE);
        Ok(Pipe {
            read,
            write,
            pending: 0,
        })
    }

    /// Sends `parts` from byte `done` on (counting bytes into the pipe as sent; what the pipe
    /// holds from an earlier call goes first), moving `done` as it goes.
    async fn send(
        &mut self,
        sock: &UnixStream,
        parts: &[Part],
        done: &mut usize,
        stall: Duration,
    ) -> Result<(), SendError> {
        let pieces = sealed(parts)?;
        let (mut index, mut offset) = (0usize, 0usize);
        advance(&pieces, &mut index, &mut offset, *done);
        loop {
            // Fill the pipe until it is full or the frame is in it...
            while index < pieces.len() {
                match self.vmsplice(&pieces[index..], offset) {
                    Ok(n) => {
                        self.pending += n;
                        *done += n;
                        advance(&pieces, &mut index, &mut offset, n);
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) => return Err(e.into()),
                }
            }
            // ...then move it into the socket, waiting while the socket is full.
            while self.pending > 0 {
                let splice = sock.async_io(Interest::WRITABLE, || self.splice_into(sock));
                let n = until_stalled(sock, stall, splice).await??;
                if n == 0 {
                    return Err(io::Error::from(io::ErrorKind::WriteZero).into());
                }
                self.pending -= n;
            }
            if index == pieces.len() {
                return Ok(());
            }
        }
    }

    /// Hands `pieces` (from `offset` in the first) to the pipe by reference, as many as one
    /// call takes; returns the bytes it took.
    fn vmsplice(&self, pieces: &[ShardBytes], offset: usize) -> io::Result<usize> {
        let iov: Vec<IoSliceRaw> = pieces
            .iter()
            .take(IOVECS)
            .enumerate()
            .map(|(k, p)| {
                let bytes = p
                    .spliceable()
                    .expect("sealed() makes every piece spliceable");
                IoSliceRaw::from_slice(&bytes[if k == 0 { offset } else { 0 }..])
            })
            .collect();
        // SAFETY: vmsplice hands the pages to the pipe by reference, so they must not change
        // until the receiver has read them. Every piece is a read-only mapping nobody writes
        // again (a committed cache file, or a sealed buffer: see the module docs), and
        // `self.write` is the pipe's write end (the kernel reads the memory, never writes it).
        // No SPLICE_F_GIFT.
        let n = unsafe { rustix::pipe::vmsplice(&self.write, &iov, SpliceFlags::NONBLOCK) }?;
        Ok(n)
    }

    fn splice_into(&self, sock: &UnixStream) -> io::Result<usize> {
        // No offsets: a pipe and a socket are read and written at their current position.
        let flags = SpliceFlags::MOVE | SpliceFlags::NONBLOCK;
        Ok(rustix::pipe::splice(
            &self.read,
            None,
            sock,
            None,
            self.pending,
            flags,
        )?)
    }
}

/// Runs `wait` (a wait for room in `sock`) until it completes, or fails with `Stalled` once
/// the client has taken no byte for `stall`.
///
/// The client's progress is read from the socket's queue, not from our wake-ups: a Unix
/// socket is reported writable only once three quarters of its send buffer are drained
/// (megabytes with a large buffer), which a slow but steady reader may take longer than
/// `stall` to do.
pub(crate) async fn until_stalled<T>(
    sock: &UnixStream,
    stall: Duration,
    wait: impl Future<Output = T>,
) -> Result<T, SendError> {
    let mut wait = std::pin::pin!(wait);
    let mut queued = unread(sock);
    loop {
        if let Ok(done) = tokio::time::timeout(stall, &mut wait).await {
            return Ok(done);
        }
        let now = unread(sock);
        if now >= queued {
            return Err(SendError::Stalled(stall));
        }
        queued = now;
    }
}

/// Bytes written to `sock` that its reader has not taken yet (`SIOCOUTQ`); `usize::MAX` when
/// the kernel does not say, so that a failed query never passes for progress.
fn unread(sock: &UnixStream) -> usize {
    /// `SIOCOUTQ` (= `TIOCOUTQ`) on Linux: for a Unix stream socket, the bytes in its queue.
    const SIOCOUTQ: rustix::ioctl::Opcode = 0x5411;
    // SAFETY: SIOCOUTQ writes one C int, the type the getter provides room for.
    let queued =
        unsafe { rustix::ioctl::ioctl(sock, rustix::ioctl::Getter::<SIOCOUTQ, i32>::new()) };
    queued.map_or(usize::MAX, |n| n.max(0) as usize)
}

/// Whether a part goes to the socket by reference. Decided on the whole part, so a part
/// started by vmsplice is finished by vmsplice.
fn spliced(part: &Part) -> bool {
    matches!(part, Part::Shard(b) if b.len() >= SPLICE_MIN && b.spliceable().is_some())
}

/// The frame as pieces that all go by reference: the spliced parts as they are, and each run
/// of the others as a slice of one sealed copy of them all. The same parts give the same
/// bytes, so a frame cut off by a stall is sealed again and resumed at its byte offset.
fn sealed(parts: &[Part]) -> io::Result<Vec<ShardBytes>> {
    let arena = ShardBytes::sealed(parts.iter().filter(|p| !spliced(p)).map(|p| p.bytes()))?;
    let mut pieces = Vec::with_capacity(parts.len());
    let (mut at, mut run) = (0usize, 0usize);
    for part in parts {
        if spliced(part) {
            if run > 0 {
                pieces.push(arena.slice(at - run..at));
                run = 0;
            }
            if let Part::Shard(b) = part {
                pieces.push(b.clone());
            }
        } else {
            at += part.bytes().len();
            run += part.bytes().len();
        }
    }
    if run > 0 {
        pieces.push(arena.slice(at - run..at));
    }
    Ok(pieces)
}

/// Moves the cursor (`index`, `offset`) forward by `n` bytes over `pieces`.
fn advance(pieces: &[impl AsRef<[u8]>], index: &mut usize, offset: &mut usize, mut n: usize) {
    while n > 0 {
        let left = pieces[*index].as_ref().len() - *offset;
        if n < left {
            *offset += n;
            return;
        }
        n -= left;
        *index += 1;
        *offset = 0;
    }
    while *index < pieces.len() && pieces[*index].as_ref().len() == *offset {
        *index += 1;
        *offset = 0;
    }
}

/// The fallback: vectored writes straight to the socket, from byte `done` of the frame on.
async fn writev_all(
    sock: &UnixStream,
    parts: &[Part],
    done: &mut usize,
    stall: Duration,
) -> Result<(), SendError> {
    let mut slices: Vec<IoSlice<'_>> = parts.iter().map(|p| IoSlice::new(p.bytes())).collect();
    let mut rest = &mut slices[..];
    IoSlice::advance_slices(&mut rest, *done);
    while !rest.is_empty() {
        until_stalled(sock, stall, sock.writable()).await??;
        match sock.try_write_vectored(rest) {
            Ok(0) => return Err(io::Error::from(io::ErrorKind::WriteZero).into()),
            Ok(n) => {
                IoSlice::advance_slices(&mut rest, n);
                *done += n;
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::ShardBytes;
    use bytes::Bytes;
    use tokio::io::AsyncReadExt;

    const LONG: Duration = Duration::from_secs(60);

    /// A file-backed mapping, as the cache produces (vmsplice must only see such memory).
    fn mapped(data: &[u8]) -> ShardBytes {
        use std::io::Write;
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(data).unwrap();
        // SAFETY: a private temp file nobody else writes.
        let map = unsafe { memmap2::Mmap::map(&f) }.unwrap();
        ShardBytes::file_for_test(map)
    }

    async fn roundtrip(mut sink: Sink) {
        let (a, mut b) = UnixStream::pair().unwrap();
        let mut rng = crate::plan::shuffle::SplitMix64::new(5);
        let pool: Vec<u8> = (0..1 << 20)
            .flat_map(|_| rng.next_u64().to_le_bytes())
            .collect();
        let (heap, map) = (Bytes::from(pool.clone()), mapped(&pool));
        let heap_shard = ShardBytes::heap(heap.clone());
        assert!(heap_shard.spliceable().is_none() && map.spliceable().is_some());
        let mut frames = Vec::new();
        for _ in 0..20 {
            let parts: Vec<Part> = (0..rng.below(12) + 1)
                .map(|_| {
                    let len = [0, 1, 100, 5000, SPLICE_MIN, 70_000, 3 << 20][rng.below(7) as usize];
                    let at = rng.below((pool.len() - len) as u64) as usize;
                    match rng.below(3) {
                        0 => Part::Inline(heap.slice(at..at + len)),
                        1 => Part::Shard(heap_shard.slice(at..at + len)),
                        _ => Part::Shard(map.slice(at..at + len)),
                    }
                })
                .collect();
            frames.push(parts);
        }
        let mut want = Vec::new();
        for part in frames.iter().flatten() {
            want.extend_from_slice(part.bytes());
        }
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            b.read_to_end(&mut got).await.unwrap();
            got
        });
        for parts in &frames {
            sink.send(&a, parts, LONG).await.unwrap();
            assert!(!sink.torn());
        }
        drop(a);
        let got = reader.await.unwrap();
        assert_eq!(got.len(), want.len());
        assert!(got == want, "bytes differ");
    }

    #[tokio::test]
    async fn splice_path_delivers_every_byte_in_order() {
        let sink = Sink::new();
        assert!(sink.pipe.is_some());
        roundtrip(sink).await;
    }

    #[tokio::test]
    async fn writev_fallback_delivers_every_byte_in_order() {
        roundtrip(Sink {
            pipe: None,
            partial: None,
        })
        .await;
    }

    /// A frame the client stops taking fails with `Stalled`, partly written; sent again (the
    /// same parts) once the client reads, only its rest goes out: the client gets every byte
    /// once. Another frame in its place is refused. Both send paths.
    #[tokio::test]
    async fn a_stalled_frame_is_finished_by_sending_it_again() {
        for piped in [true, false] {
            let mut sink = Sink::new();
            if !piped {
                sink.pipe = None;
            }
            let (a, mut b) = UnixStream::pair().unwrap();
            let data: Vec<u8> = (0..8 << 20).map(|i: u32| (i % 251) as u8).collect();
            let map = mapped(&data);
            let parts = [
                Part::Inline(Bytes::from_static(b"head")),
                Part::Shard(map.slice(0..data.len())),
            ];
            let short = Duration::from_millis(50);
            let err = sink.send(&a, &parts, short).await.unwrap_err();
            assert!(matches!(err, SendError::Stalled(d) if d == short), "{err}");
            assert!(sink.torn());
            let other = [Part::Inline(Bytes::from_static(b"another frame"))];
            let err = sink.send(&a, &other, LONG).await.unwrap_err();
            assert!(err.to_string().contains("was cut off"), "{err}");
            assert!(sink.torn());
            let reader = tokio::spawn(async move {
                let mut got = Vec::new();
                b.read_to_end(&mut got).await.unwrap();
                got
            });
            sink.send(&a, &parts, LONG).await.unwrap();
            assert!(!sink.torn());
            drop(a);
            let got = reader.await.unwrap();
            assert_eq!(got.len(), 4 + data.len(), "piped {piped}");
            assert!(
                got[..4] == *b"head" && got[4..] == data[..],
                "piped {piped}"
            );
        }
    }
}
