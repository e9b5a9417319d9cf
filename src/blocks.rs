//! Cache files are written in whole, aligned blocks (`cache.block_size`, [`DEFAULT_BLOCK`]
//! bytes by default), so that the page cache holds them in large folios.
//!
//! A buffered write's folio is at most as large as the write, and aligned to its offset
//! (Linux 6.x; ext4 since 6.16, XFS since 5.18). Written in 64 KiB pieces (what
//! `copy_file_range` between ext4 files does) or at unaligned offsets, a shard sits in the
//! page cache as 16-page folios. Every reader that maps it then pays a page fault per 16
//! pages: mapping a file written in 64 KiB writes cost 65-85 ms per GB, in 2 MiB writes
//! 0.9-1.2 ms (`bench/cache_blocks.py`, `MADV_POPULATE_READ`, 6.18 guest). That was most
//! of a zero-copy trainer's system time per sample (docs/benchmarks.md, "Touched bytes"). On a kernel or
//! file system without large folios the writes are merely larger.
//!
//! A host that takes back free guest memory (virtio-balloon free page reporting) makes the
//! first write of each fresh 2 MiB folio fault on the host: there a cold epoch cost 4.6
//! daemon CPU-s per GB in 2 MiB blocks against 1.6-1.8 in 64 KiB ones, and cached epochs
//! 0.18-0.21 against 0.25-0.27 (docs/benchmarks.md, "2 MiB cache blocks"). Hence the
//! setting.

use std::io;
use std::os::unix::fs::FileExt;

/// The default block: a PMD-sized folio with 4 KiB pages (x86-64, arm64), mapped in one
/// fault. Also the largest `cache.block_size`: no folio is larger.
pub const DEFAULT_BLOCK: usize = 2 << 20;
/// The smallest `cache.block_size`: what `copy_file_range` wrote before blocks.
pub const MIN_BLOCK: usize = 64 << 10;

/// The next boundary of `block`-byte blocks after `at` (`at` itself is not one).
pub fn next_boundary(at: u64, block: usize) -> u64 {
    (at / block as u64 + 1) * block as u64
}

/// Writes a file front to back from offset 0, a whole block at a time (the last one may be
/// shorter). `std::io::Write`, for streams of any chunk size (a decompressor); `fill`, for a
/// reader that reads straight into the block (a local copy, without a copy of its own).
pub struct BlockWriter {
    file: std::fs::File,
    /// The block being gathered: allocated (and zeroed) once, its first `len` bytes filled.
    buf: Box<[u8]>,
    len: usize,
    at: u64,
}

impl BlockWriter {
    /// Writes `file` in blocks of `block` bytes (`cache.block_size`).
    pub fn new(file: std::fs::File, block: usize) -> Self {
        BlockWriter {
            file,
            buf: vec![0u8; block].into_boxed_slice(),
            len: 0,
            at: 0,
        }
    }

    /// Reads into the block being gathered with `read` (given the room left; returns how
    /// many bytes it put there, 0 at its end), writes the block once it is whole; returns
    /// the bytes read, which the caller may look at (a checksum) in `seen`.
    pub fn fill(
        &mut self,
        read: impl FnOnce(&mut [u8]) -> io::Result<usize>,
        seen: impl FnOnce(&[u8]),
    ) -> io::Result<usize> {
        let room = &mut self.buf[self.len..];
        let n = read(room)?.min(room.len());
        seen(&self.buf[self.len..self.len + n]);
        self.len += n;
        if self.len == self.buf.len() {
            self.write_block()?;
        }
        Ok(n)
    }

    fn write_block(&mut self) -> io::Result<()> {
        self.file.write_all_at(&self.buf[..self.len], self.at)?;
        self.at += self.len as u64;
        self.len = 0;
        Ok(())
    }

    /// Writes what is gathered (the file's last, short block) and returns the file.
    pub fn finish(mut self) -> io::Result<std::fs::File> {
        if self.len > 0 {
            self.write_block()?;
        }
        Ok(self.file)
    }
}

impl io::Write for BlockWriter {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        let n = data.len().min(self.buf.len() - self.len);
        self.buf[self.len..self.len + n].copy_from_slice(&data[..n]);
        self.len += n;
        if self.len == self.buf.len() {
            self.write_block()?;
        }
        Ok(n)
    }

    /// Writes nothing: a block is written whole, or by `finish`.
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Seek, Write};

    use super::{BlockWriter, DEFAULT_BLOCK, MIN_BLOCK, next_boundary};

    fn contents(mut file: std::fs::File) -> Vec<u8> {
        let mut out = Vec::new();
        file.rewind().unwrap();
        file.read_to_end(&mut out).unwrap();
        out
    }

    #[test]
    fn written_through_write_or_fill_a_file_holds_exactly_the_bytes_given() {
        for block in [MIN_BLOCK, DEFAULT_BLOCK] {
            written_in_blocks_of(block);
        }
    }

    fn written_in_blocks_of(block: usize) {
        let data: Vec<u8> = (0..2 * block + 12345)
            .map(|i| (i * 7 + i / 4099) as u8)
            .collect();
        // Odd chunk sizes that straddle every block boundary.
        let mut w = BlockWriter::new(tempfile::tempfile().unwrap(), block);
        for chunk in data.chunks(100_003) {
            w.write_all(chunk).unwrap();
        }
        assert_eq!(contents(w.finish().unwrap()), data);

        let mut w = BlockWriter::new(tempfile::tempfile().unwrap(), block);
        let (mut at, mut seen) = (0, Vec::new());
        while at < data.len() {
            let n = w
                .fill(
                    |room| {
                        assert!(room.len() <= block, "a block's room at most");
                        let n = room.len().min(77_777).min(data.len() - at);
                        room[..n].copy_from_slice(&data[at..at + n]);
                        Ok(n)
                    },
                    |bytes| seen.extend_from_slice(bytes),
                )
                .unwrap();
            at += n;
        }
        assert_eq!(seen, data);
        assert_eq!(contents(w.finish().unwrap()), data);
    }

    #[test]
    fn a_failed_read_leaves_the_block_as_it_was() {
        let mut w = BlockWriter::new(tempfile::tempfile().unwrap(), MIN_BLOCK);
        w.write_all(b"kept").unwrap();
        let err = w.fill(|_| Err(std::io::Error::other("boom")), |_| {});
        assert_eq!(err.unwrap_err().to_string(), "boom");
        assert_eq!(contents(w.finish().unwrap()), b"kept");
    }

    #[test]
    fn boundaries_are_the_next_multiple_of_the_block() {
        for block in [MIN_BLOCK, DEFAULT_BLOCK] {
            let b = block as u64;
            assert_eq!(next_boundary(0, block), b);
            assert_eq!(next_boundary(1, block), b);
            assert_eq!(next_boundary(b, block), 2 * b);
        }
    }
}
