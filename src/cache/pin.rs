//! Pins: a stream reading an entry holds one, and the entry is never evicted or replaced
//! until the last slice of its bytes is dropped.

use std::sync::Arc;

use super::{Entry, Inner, Slot};

/// Keeps an entry pinned, and its mapping alive, while any slice of its bytes lives.
pub(super) struct Pinned {
    pub(super) map: Arc<memmap2::Mmap>,
    pub(super) _pin: Pin,
}

impl AsRef<[u8]> for Pinned {
    fn as_ref(&self) -> &[u8] {
        &self.map
    }
}

pub(super) struct Pin {
    pub(super) inner: Arc<Inner>,
    pub(super) url: String,
    pub(super) entry: Arc<Entry>,
}

impl Drop for Pin {
    fn drop(&mut self) {
        let mut st = self.inner.state.lock().unwrap();
        if let Some(Slot::Ready(r)) = st.slots.get_mut(&self.url)
            && Arc::ptr_eq(&r.entry, &self.entry)
        {
            r.pins -= 1;
            if r.pins == 0 {
                st.pinned -= self.entry.charge;
                st.releases += 1;
                self.inner.publish(&st);
                drop(st);
                self.inner.space.notify_waiters();
                self.inner.events.notify_one();
            }
        }
    }
}

/// Maps a cache file read-only, pages read in (in a blocking thread, so that sending never
/// faults on disk reads); `None` for an empty file, which cannot be mapped.
pub(super) fn map_file(path: &std::path::Path) -> std::io::Result<Option<memmap2::Mmap>> {
    let file = std::fs::File::open(path)?;
    if file.metadata()?.len() == 0 {
        return Ok(None);
    }
    // SAFETY: the file is a committed cache entry in a directory this daemon holds the lock
    // on; the daemon never writes to a committed entry, and eviction unlinks it, which leaves
    // a mapping intact. (An operator truncating files inside cache.dir while the daemon runs
    // is outside this contract.)
    let map = unsafe { memmap2::MmapOptions::new().populate().map(&file) }?;
    Ok(Some(map))
}
