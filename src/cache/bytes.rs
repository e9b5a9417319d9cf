//! [`ShardBytes`]: a shard's bytes, and whether they are file memory the sink may splice.

use std::ops::{Deref, RangeBounds};

use bytes::Bytes;

/// A shard's bytes, or a slice of them.
///
/// Only the cache can make one that is *file-backed*: a read-only mapping of a cache file the
/// daemon wrote, committed and never rewrites (evicting unlinks, which leaves mapped pages
/// intact). Only file-backed bytes may be handed to the kernel by reference (`vmsplice`): a
/// heap buffer could be reused before the receiver has read it, and a file someone else can
/// truncate would turn into SIGBUS. Everything else (tests, tools) uses [`ShardBytes::heap`],
/// which is always copied.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ShardBytes {
    bytes: Bytes,
    file_backed: bool,
}

impl ShardBytes {
    /// Bytes in ordinary memory: never spliced.
    pub fn heap(bytes: Bytes) -> ShardBytes {
        ShardBytes {
            bytes,
            file_backed: false,
        }
    }

    /// Bytes of a cache file mapping, kept alive (and the entry pinned) by `owner`.
    pub(super) fn cache_file<T: AsRef<[u8]> + Send + 'static>(owner: T) -> ShardBytes {
        ShardBytes {
            bytes: Bytes::from_owner(owner),
            file_backed: true,
        }
    }

    /// A copy of `pieces`, one after another, in a fresh anonymous mapping made read-only:
    /// spliceable like a cache file's bytes, since nothing writes those pages again (the
    /// mapping is `PROT_READ`, and once the last slice drops it is unmapped, never reused: a
    /// pipe holding the pages keeps them as they are). The sink seals a frame's small pieces
    /// this way so that a whole frame goes into its pipe by reference.
    pub fn sealed<'a>(
        pieces: impl Iterator<Item = &'a [u8]> + Clone,
    ) -> std::io::Result<ShardBytes> {
        let len = pieces.clone().map(<[u8]>::len).sum();
        if len == 0 {
            return Ok(ShardBytes::default());
        }
        let mut map = memmap2::MmapMut::map_anon(len)?;
        let mut at = 0;
        for piece in pieces {
            map[at..at + piece.len()].copy_from_slice(piece);
            at += piece.len();
        }
        Ok(Self::cache_file(map.make_read_only()?))
    }

    /// A file-backed value for the sink's own tests.
    #[cfg(test)]
    pub(crate) fn file_for_test(map: memmap2::Mmap) -> ShardBytes {
        Self::cache_file(map)
    }

    pub fn slice(&self, range: impl RangeBounds<usize>) -> ShardBytes {
        ShardBytes {
            bytes: self.bytes.slice(range),
            file_backed: self.file_backed,
        }
    }

    /// The bytes if they may be spliced into a pipe by reference (see `sink.rs`): cache file
    /// memory, or [`ShardBytes::sealed`].
    pub fn spliceable(&self) -> Option<&[u8]> {
        self.file_backed.then_some(&self.bytes[..])
    }

    pub fn as_bytes(&self) -> &Bytes {
        &self.bytes
    }
}

impl AsRef<[u8]> for ShardBytes {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl Deref for ShardBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.bytes
    }
}
