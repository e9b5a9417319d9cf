//! Cache files are written in whole, aligned blocks of [`BLOCK`] bytes, so that the page
//! cache holds them in large folios.
//!
//! A buffered write's folio is at most as large as the write, and aligned to its offset
//! (Linux 6.x; ext4 since 6.16, XFS since 5.18). Written in 64 KiB pieces (what
//! `copy_file_range` between ext4 files does) or at unaligned offsets, a shard sits in the
//! page cache as 16-page folios. Every reader that maps it then pays a page fault per 16
//! pages: mapping a file written in 64 KiB writes cost 65-85 ms per GB, in 2 MiB writes
//! 0.9-1.2 ms (`bench/cache_blocks.py`, `MADV_POPULATE_READ`, 6.18 guest). That was most
//! of a zero-copy trainer's system time per sample (docs/benchmarks.md, "Touched bytes"). On a kernel or
//! file system without large folios the writes are merely larger.

use std::io;
use std::os::unix::fs::FileExt;

/// The block: a PMD-sized folio with 4 KiB pages (x86-64, arm64), mapped in one fault.
pub const BLOCK: usize = 2 << 20;

/// The next block boundary after `at` (`at` itself is not one).
pub fn next_boundary(at: u64) -> u64 {
    (at / BLOCK as u64 + 1) * BLOCK as u64
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
    pub fn new(file: std::fs::File) -> Self {
        BlockWriter {
            file,
            buf: vec![0u8; BLOCK].into_boxed_slice(),
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
        if self.len == BLOCK {
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
        let n = data.len().min(BLOCK - self.len);
        self.buf[self.len..self.len + n].copy_from_slice(&data[..n]);
        self.len += n;
        if self.len == BLOCK {
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

    use super::{BLOCK, BlockWriter, next_boundary};

    fn contents(mut file: std::fs::File) -> Vec<u8> {
        let mut out = Vec::new();
        file.rewind().unwrap();
        file.read_to_end(&mut out).unwrap();
        out
    }

    #[test]
    fn written_through_write_or_fill_a_file_holds_exactly_the_bytes_given() {
        let data: Vec<u8> = (0..2 * BLOCK + 12345)
            .map(|i| (i * 7 + i / 4099) as u8)
            .collect();
        // Odd chunk sizes that straddle every block boundary.
        let mut w = BlockWriter::new(tempfile::tempfile().unwrap());
        for chunk in data.chunks(100_003) {
            w.write_all(chunk).unwrap();
        }
        assert_eq!(contents(w.finish().unwrap()), data);

        let mut w = BlockWriter::new(tempfile::tempfile().unwrap());
        let (mut at, mut seen) = (0, Vec::new());
        while at < data.len() {
            let n = w
                .fill(
                    |room| {
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
        let mut w = BlockWriter::new(tempfile::tempfile().unwrap());
        w.write_all(b"kept").unwrap();
        let err = w.fill(|_| Err(std::io::Error::other("boom")), |_| {});
        assert_eq!(err.unwrap_err().to_string(), "boom");
        assert_eq!(contents(w.finish().unwrap()), b"kept");
    }

    #[test]
    fn boundaries_are_the_next_multiple_of_the_block() {
        assert_eq!(next_boundary(0), BLOCK as u64);
        assert_eq!(next_boundary(1), BLOCK as u64);
        assert_eq!(next_boundary(BLOCK as u64), 2 * BLOCK as u64);
    }
}
