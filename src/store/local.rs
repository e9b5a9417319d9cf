//! Local shards (`file://` URLs and plain paths): copied into the cache, never mapped in place.
//! A file the operator may truncate or rewrite (a gcsfuse or NFS path) must never be mapped
//! by the daemon, or a truncation would kill it with SIGBUS. `std::io::copy` between files
//! uses `copy_file_range`, which shares extents (a reflink) on filesystems that can (XFS,
//! btrfs) and copies in the kernel elsewhere. A local file's [`Version`] is its size, inode
//! and modification time: a file that changes while it is copied is an error, never a mixed
//! copy. Every function here blocks.

use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;

use bytes::Bytes;

use super::{ReadError, Version};
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
/// copy's CRC-32C, read back from the copy: the copy itself is in the kernel (or a reflink),
/// so this is the only pass over the bytes in the daemon, and the cache records the CRC to
/// check the entry when a restarted daemon first serves it.
pub(super) fn copy(
    src: &Path,
    url: &ShardUrl,
    version: &Version,
    mut dst: std::fs::File,
) -> Result<u32, ReadError> {
    let file = std::fs::File::open(src).map_err(ReadError::io(url, "opening the file"))?;
    // `Take<&File>` into a `File`: std uses copy_file_range for it.
    let copied = std::io::copy(&mut std::io::Read::take(&file, version.size), &mut dst)
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
    crc32c_of(&dst, copied).map_err(ReadError::io(url, "reading the copy"))
}

/// CRC-32C of the first `len` bytes of a file (positioned reads: the cursor is not moved).
fn crc32c_of(file: &std::fs::File, len: u64) -> std::io::Result<u32> {
    let mut buf = vec![0u8; 1 << 20];
    let (mut crc, mut at) = (0u32, 0u64);
    while at < len {
        let want = buf.len().min((len - at) as usize);
        let n = file.read_at(&mut buf[..want], at)?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        crc = crc32c::crc32c_append(crc, &buf[..n]);
        at += n as u64;
    }
    Ok(crc)
}
