//! Local shards (`file://` URLs and plain paths): copied into the cache, never mapped in place.
//! A file the operator may truncate or rewrite (a gcsfuse or NFS path) must never be mapped
//! by the daemon, or a truncation would kill it with SIGBUS. The copy reads the file in
//! pieces straight into the cache file's blocks ([`BlockWriter`]), checksumming each piece
//! while it is in the CPU's cache: one read, one write, no read-back, and large page-cache
//! folios for the trainers that map the entry (`copy_file_range` wrote 64 KiB folios on ext4,
//! and shared extents only on XFS and btrfs). A local file's [`Version`] is its size, inode
//! and modification time: a file that changes while it is copied is an error, never a mixed
//! copy. Every function here blocks.

use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;

use bytes::Bytes;

use super::{ReadError, Version};
use crate::blocks::BlockWriter;
use crate::config::url::ShardUrl;

fn not_found_or(url: &ShardUrl, what: &'static str) -> impl FnOnce(std::io::Error) -> ReadError {
    let url = url.clone();
    move |e| match e.kind() {
        std::io::ErrorKind::NotFound => ReadError::NotFound {
            url: url.to_string(),
        },
        _ => ReadError::io(&url, what)(e),
    }
}

pub(super) fn version(path: &Path, url: &ShardUrl) -> Result<Version, ReadError> {
    let meta = std::fs::metadata(path).map_err(not_found_or(url, "reading the file's metadata"))?;
    Ok(Version {
        size: meta.len(),
        e_tag: Some(format!(
            "local:{}:{}:{}",
            meta.ino(),
            meta.mtime(),
            meta.mtime_nsec()
        )),
        generation: None,
    })
}

pub(super) fn read(path: &Path, url: &ShardUrl) -> Result<Bytes, ReadError> {
    std::fs::read(path)
        .map(Bytes::from)
        .map_err(not_found_or(url, "reading the file"))
}

pub(super) fn write(path: &Path, url: &ShardUrl, bytes: &[u8]) -> Result<(), ReadError> {
    std::fs::write(path, bytes).map_err(ReadError::io(url, "writing the file"))
}

/// Copies exactly `version` of a local file; a file that changed size, inode or mtime
/// before or during the copy is an error (the cache then holds no mixed copy). Returns the
/// copy's CRC-32C, which the cache records to check the entry when a restarted daemon first
/// serves it. `block`: `cache.block_size`.
pub(super) fn copy(
    src: &Path,
    url: &ShardUrl,
    version: &Version,
    dst: std::fs::File,
    block: usize,
) -> Result<u32, ReadError> {
    /// Bytes read at once: small enough that the checksum finds them in the CPU's cache.
    const PIECE: usize = 256 << 10;
    let file = std::fs::File::open(src).map_err(ReadError::io(url, "opening the file"))?;
    let mut out = BlockWriter::new(dst, block);
    let (mut crc, mut copied) = (0u32, 0u64);
    while copied < version.size {
        let want = PIECE.min((version.size - copied) as usize);
        let n = out
            .fill(
                |room| {
                    let n = want.min(room.len());
                    loop {
                        match file.read_at(&mut room[..n], copied) {
                            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                            read => return read,
                        }
                    }
                },
                |piece| crc = crc32c::crc32c_append(crc, piece),
            )
            .map_err(ReadError::io(url, "copying the file into the cache"))?;
        if n == 0 {
            break; // shorter than its version: reported below
        }
        copied += n as u64;
    }
    out.finish()
        .map_err(ReadError::io(url, "copying the file into the cache"))?;
    let now = self::version(src, url)?;
    if copied != version.size || now != *version {
        return Err(ReadError::Changed {
            url: url.to_string(),
            what: format!(
                "copied {copied} of {} bytes; the file is now {} bytes",
                version.size, now.size
            ),
        });
    }
    Ok(crc)
}
