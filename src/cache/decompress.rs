//! Compressed shards: which compression a shard's bytes are in, told by their first bytes
//! (never by the name, as `tarfile` and webdataset tell gzip), and a streaming decoder for
//! each. The cache decompresses a shard into its entry (reserving the output as it grows,
//! see `load.rs`); `shardd index` counts its samples decompressed.

use std::io::{self, BufRead, Read};
use std::path::Path;

/// The largest zstd window decoded: 2^27 bytes (128 MiB), the limit of the `zstd` tool
/// itself without `--memory`. Every compression level (`--ultra -22` included) and plain
/// `--long` stay within it; a frame asking for more (`--long=28` and up) is refused with an
/// error that says so, rather than the daemon allocating gigabytes per decompression.
pub const ZSTD_WINDOW_LOG_MAX: u32 = 27;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// gzip (`.tgz`, `.tar.gz`): magic `1F 8B`; concatenated members are read as one stream.
    Gzip,
    /// Zstandard (`.tar.zst`): a frame's magic `28 B5 2F FD`, or a skippable frame's
    /// (`5? 2A 4D 18`, as `pzstd` writes first); every frame of a multi-frame file is read,
    /// skippable ones skipped.
    Zstd,
}

impl Compression {
    /// The compression a shard starting with `head` is in, if any.
    pub fn detect(head: &[u8]) -> Option<Compression> {
        match head {
            [0x1f, 0x8b, ..] => Some(Compression::Gzip),
            [0x28, 0xb5, 0x2f, 0xfd, ..] | [0x50..=0x5f, 0x2a, 0x4d, 0x18, ..] => {
                Some(Compression::Zstd)
            }
            _ => None,
        }
    }

    /// The compression of the file at `path`, from its first bytes. Blocking.
    pub fn of_file(path: &Path) -> io::Result<Option<Compression>> {
        let mut head = Vec::with_capacity(4);
        std::fs::File::open(path)?.take(4).read_to_end(&mut head)?;
        Ok(Compression::detect(&head))
    }

    pub fn name(self) -> &'static str {
        match self {
            Compression::Gzip => "gzip",
            Compression::Zstd => "zstd",
        }
    }

    /// A streaming decoder of `input` (memory: the decoder's state, at most a
    /// [`ZSTD_WINDOW_LOG_MAX`] window for zstd, never the whole input or output).
    pub fn decoder<'a, R: BufRead + 'a>(self, input: R) -> io::Result<Box<dyn Read + 'a>> {
        Ok(match self {
            Compression::Gzip => Box::new(flate2::bufread::MultiGzDecoder::new(input)),
            Compression::Zstd => {
                let mut decoder = zstd::stream::read::Decoder::with_buffer(input)?;
                decoder.window_log_max(ZSTD_WINDOW_LOG_MAX)?;
                Box::new(ZstdReader(decoder))
            }
        })
    }
}

/// libzstd's decoder with its errors said plainly.
struct ZstdReader<'a, R: BufRead>(zstd::stream::read::Decoder<'a, R>);

impl<R: BufRead> Read for ZstdReader<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.read(buf).map_err(zstd_error)
    }
}

fn zstd_error(e: io::Error) -> io::Error {
    let what = if e.kind() == io::ErrorKind::UnexpectedEof {
        "truncated: the data ends inside a zstd frame".to_string()
    } else if e.to_string() == "Frame requires too much memory for decoding" {
        format!(
            "a zstd frame needs a window larger than {} MiB, the most shardd decodes (as the zstd tool without --memory): compress with a smaller one (zstd --long=N with N <= {ZSTD_WINDOW_LOG_MAX})",
            1u64 << (ZSTD_WINDOW_LOG_MAX - 20)
        )
    } else if e.kind() == io::ErrorKind::Other {
        format!("corrupt zstd data ({e})")
    } else {
        return e; // reading the input failed
    };
    io::Error::new(io::ErrorKind::InvalidData, what)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detection_is_by_content() {
        assert_eq!(
            Compression::detect(&[0x1f, 0x8b, 8]),
            Some(Compression::Gzip)
        );
        let frame = [0x28, 0xb5, 0x2f, 0xfd, 0];
        assert_eq!(Compression::detect(&frame), Some(Compression::Zstd));
        let skippable = [0x5e, 0x2a, 0x4d, 0x18];
        assert_eq!(Compression::detect(&skippable), Some(Compression::Zstd));
        assert_eq!(Compression::detect(&frame[..3]), None);
        assert_eq!(Compression::detect(b"a.txt\0\0\0"), None);
        assert_eq!(Compression::detect(b""), None);
    }
}
