//! Writes encoded frames to a client's socket.
//!
//! Copying shard bytes into the socket is the daemon's largest cost (it shares the host's
//! cores with the trainers it feeds), so large [`Part::Shard`] pieces of cache-file memory
//! ([`crate::cache::ShardBytes::spliceable`]) are not copied: they are
//! `vmsplice`d into a per-connection pipe by reference and `splice`d from the pipe into the
//! socket, which hands the page-cache pages themselves to the receiving side; the only copy
//! left is the one into the trainer's memory. Everything else is `write`n into the same pipe
//! (copied, in order). Without a pipe (e.g. out of file descriptors) the sink falls back to
//! `writev` on the socket.
//!
//! Why borrowing pages is safe here: spliceable parts are slices of read-only `MAP_SHARED`
//! mappings of committed cache files (the type says so; see `cache/bytes.rs`). The kernel holds its own reference on each page until the
//! receiver has read it, so unmapping or unlinking the file meanwhile is harmless, and nobody
//! writes to those pages. Heap memory is never vmspliced: it could be reused before it is read.

use std::io::{self, IoSlice};
use std::os::fd::OwnedFd;

use rustix::pipe::{IoSliceRaw, PipeFlags, SpliceFlags};

use tokio::io::Interest;
use tokio::net::UnixStream;

use crate::protocol::Part;

/// Mapped pieces at least this large are spliced; smaller ones are cheaper to copy.
const SPLICE_MIN: usize = 16 << 10;
/// Pipe capacity asked for. 1 MiB measured no faster than 256 KiB, and an unprivileged user
/// may hold only 64 MiB of pipes in all (fs.pipe-user-pages-soft): 256 connections at this size.
const PIPE_SIZE: usize = 256 << 10;

pub struct Sink {
    pipe: Option<Pipe>,
    /// True while a frame is partly written: nothing else may be sent on the socket then.
    torn: bool,
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
        Sink { pipe, torn: false }
    }

    /// Whether the last frame was cut off mid-way (the socket then carries a partial frame,
    /// and only closing it is safe).
    pub fn torn(&self) -> bool {
        self.torn
    }

    /// Writes one frame's parts, in order, to `sock`.
    pub async fn send(&mut self, sock: &UnixStream, parts: &[Part]) -> io::Result<()> {
        self.torn = true;
        match &mut self.pipe {
            // Through the pipe only when something gets spliced: otherwise it is one more
            // syscall per frame for nothing (small samples).
            Some(pipe) if parts.iter().any(spliced) => pipe.send(sock, parts).await?,
            _ => writev_all(sock, parts).await?,
        }
        self.torn = false;
        Ok(())
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

    async fn send(&mut self, sock: &UnixStream, parts: &[Part]) -> io::Result<()> {
        let (mut index, mut offset) = (0usize, 0usize);
        while index < parts.len() {
            // Fill the pipe until it is full or the frame is in it...
            while index < parts.len() {
                let n = if spliced(&parts[index]) {
                    self.vmsplice(&parts[index].bytes()[offset..])
                } else {
                    self.write_inline(&parts[index..], offset)
                };
                match n {
                    Ok(n) => {
                        self.pending += n;
                        advance(parts, &mut index, &mut offset, n);
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) => return Err(e),
                }
            }
            // ...then move it into the socket, waiting while the socket is full.
            while self.pending > 0 {
                let n = sock
                    .async_io(Interest::WRITABLE, || self.splice_into(sock))
                    .await?;
                if n == 0 {
                    return Err(io::ErrorKind::WriteZero.into());
                }
                self.pending -= n;
            }
        }
        Ok(())
    }

    /// Copies the run of parts that are not to be spliced (starting at `offset` in the first)
    /// into the pipe with one writev.
    fn write_inline(&self, parts: &[Part], offset: usize) -> io::Result<usize> {
        let mut slices = Vec::new();
        for (k, part) in parts.iter().enumerate() {
            if k > 0 && spliced(part) {
                break;
            }
            let data = &part.bytes()[if k == 0 { offset } else { 0 }..];
            slices.push(IoSlice::new(data));
            if slices.len() == 64 {
                break;
            }
        }
        Ok(rustix::io::writev(&self.write, &slices)?)
    }

    fn vmsplice(&self, data: &[u8]) -> io::Result<usize> {
        let iov = [IoSliceRaw::from_slice(data)];
        // SAFETY: vmsplice hands the pages to the pipe by reference, so they must not change
        // until the receiver has read them. `data` is a read-only mapping of a committed cache
        // file that nobody writes (see the module docs and `ShardBytes::spliceable`), and
        // `self.write` is the pipe's write end (the kernel reads `data`, never writes it).
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

/// Whether a part goes to the socket by reference. Decided on the whole part, so a part
/// started by vmsplice is finished by vmsplice.
fn spliced(part: &Part) -> bool {
    matches!(part, Part::Shard(b) if b.len() >= SPLICE_MIN && b.spliceable().is_some())
}

/// Moves the cursor (`index`, `offset`) forward by `n` bytes over `parts`.
fn advance(parts: &[Part], index: &mut usize, offset: &mut usize, mut n: usize) {
    while n > 0 {
        let left = parts[*index].bytes().len() - *offset;
        if n < left {
            *offset += n;
            return;
        }
        n -= left;
        *index += 1;
        *offset = 0;
    }
    while *index < parts.len() && parts[*index].bytes().len() == *offset {
        *index += 1;
        *offset = 0;
    }
}

/// The fallback: vectored writes straight to the socket.
async fn writev_all(sock: &UnixStream, parts: &[Part]) -> io::Result<()> {
    let mut slices: Vec<IoSlice<'_>> = parts.iter().map(|p| IoSlice::new(p.bytes())).collect();
    let mut rest = &mut slices[..];
    while !rest.is_empty() {
        sock.writable().await?;
        match sock.try_write_vectored(rest) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut rest, n),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
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
        let mut rng = crate::shuffle::SplitMix64::new(5);
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
            sink.send(&a, parts).await.unwrap();
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
            torn: false,
        })
        .await;
    }
}
