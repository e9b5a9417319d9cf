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

/// The mapping of an entry's file that its readers share: the live one, or a new one.
/// `None` for an empty file.
pub(super) async fn map_entry(entry: &Arc<Entry>) -> std::io::Result<Option<Arc<memmap2::Mmap>>> {
    if let Some(map) = entry.map.lock().unwrap().upgrade() {
        return Ok(Some(map));
    }
    let e = entry.clone();
    let mapped = tokio::task::spawn_blocking(move || map_file(&e.path))
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())))?;
    Ok(mapped.map(|map| {
        let mut live = entry.map.lock().unwrap();
        // Another reader may have mapped the file meanwhile: share its mapping (and drop
        // this one), so that every live slice of an entry lies in the one mapping
        // `Cache::committed_file` finds; else a zero-copy stream's pieces would match no
        // map and go inline.
        if let Some(theirs) = live.upgrade() {
            return theirs;
        }
        let map = Arc::new(map);
        *live = Arc::downgrade(&map);
        map
    }))
}

impl Inner {
    /// Marks an entry as needing its checksum checked before it is served again (its file
    /// was found missing): the next reader's load rechecks it, finds it unreadable and
    /// fetches the shard again.
    pub(super) fn distrust(&self, entry: &Arc<Entry>) {
        let mut st = self.state.lock().unwrap();
        if let Some(Slot::Ready(r)) = st.slots.get_mut(&entry.meta.url)
            && Arc::ptr_eq(&r.entry, entry)
        {
            r.verified = false;
        }
    }
}

/// Maps a cache file read-only (in a blocking thread) and asks the kernel to read into the
/// page cache what it lacks, ahead of the sends that will touch it; `None` for an empty
/// file, which cannot be mapped.
fn map_file(path: &std::path::Path) -> std::io::Result<Option<memmap2::Mmap>> {
    let file = std::fs::File::open(path)?;
    if file.metadata()?.len() == 0 {
        return Ok(None);
    }
    // SAFETY: the file is a committed cache entry in a directory this daemon holds the lock
    // on; the daemon never writes to a committed entry, and eviction unlinks it, which leaves
    // a mapping intact. (An operator truncating files inside cache.dir while the daemon runs
    // is outside this contract.)
    let map = unsafe { memmap2::MmapOptions::new().map(&file) }?;
    // Start reading what the page cache lacks, without mapping every page (`MAP_POPULATE`
    // did, at a cost per page each time a shard is mapped: most of the daemon's CPU for a
    // zero-copy stream, which touches only the pages whose bytes it sends inline). Even
    // WILLNEED looks up every page (~15 us per MB), so a file that looks resident is left
    // to the faults' own read-ahead.
    if !looks_resident(&file, map.len()) {
        let _ = map.advise(memmap2::Advice::WillNeed);
    }
    Ok(Some(map))
}

/// Whether a few pages spread over the file are all in the page cache: one-byte reads that
/// must not wait for the disk (`RWF_NOWAIT`). False when any is not, or the kernel or file
/// system cannot say.
fn looks_resident(file: &std::fs::File, len: usize) -> bool {
    const PROBES: usize = 16;
    let mut byte = [0u8; 1];
    (0..PROBES).all(|i| {
        let offset = len.saturating_sub(1) / (PROBES - 1) * i;
        let mut bufs = [std::io::IoSliceMut::new(&mut byte)];
        matches!(
            rustix::io::preadv2(
                file,
                &mut bufs,
                offset as u64,
                rustix::io::ReadWriteFlags::NOWAIT
            ),
            Ok(1)
        )
    })
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::unix::fs::FileExt;

    #[test]
    fn a_file_out_of_the_page_cache_does_not_look_resident_and_a_read_one_does() {
        let mut file = tempfile::tempfile().unwrap();
        file.write_all(&vec![7u8; 4 << 20]).unwrap();
        file.sync_all().unwrap();
        // Written back, so the kernel may drop the pages when asked to.
        rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::DontNeed).unwrap();
        if super::looks_resident(&file, 4 << 20) {
            // tmpfs and some file systems keep their pages: nothing to tell apart there.
            eprintln!("skipped: this file system keeps the pages of a written file");
            return;
        }
        let mut all = vec![0u8; 4 << 20];
        file.read_exact_at(&mut all, 0).unwrap();
        assert!(super::looks_resident(&file, all.len()));
    }
}
