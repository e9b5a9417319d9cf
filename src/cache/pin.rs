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

    /// Waits until no reader pins `entry` (or it is no longer the shard's entry). A pinned
    /// entry is served as it is, so a reader that found its file missing and pinned it again
    /// while another reader still held it (pinned, not yet mapped: it finds the file missing
    /// too and lets go at once) was served the missing file again, and its stream failed
    /// with "mapping the cache file" (two DataLoader workers reading the same shard).
    pub(super) async fn until_unpinned(&self, entry: &Arc<Entry>) {
        loop {
            let released = self.space.notified();
            tokio::pin!(released);
            released.as_mut().enable();
            {
                let st = self.state.lock().unwrap();
                match st.slots.get(&entry.meta.url) {
                    Some(Slot::Ready(r)) if Arc::ptr_eq(&r.entry, entry) && r.pins > 0 => {}
                    _ => return,
                }
            }
            released.await;
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
    if residency(&file, map.len()) != Some(true) {
        let _ = map.advise(memmap2::Advice::WillNeed);
    }
    Ok(Some(map))
}

/// Whether a file's pages look to be in the page cache: a one-byte read that must not wait
/// for the disk (`RWF_NOWAIT`) at a random page of each sixteenth of the file (a read marks
/// its page used, so fixed probes would keep their own pages cached and a mostly evicted
/// file would look resident). `None` when the kernel or file system cannot say (tmpfs,
/// kernels before 4.14).
fn residency(file: &std::fs::File, len: usize) -> Option<bool> {
    use std::hash::BuildHasher;
    const PROBES: usize = 16;
    // Randomly keyed per call (std's hasher keys), which is all a probe needs.
    let random = std::collections::hash_map::RandomState::new();
    let page_size = rustix::param::page_size();
    let pages = len.div_ceil(page_size);
    let mut byte = [0u8; 1];
    for i in 0..PROBES {
        // Small files have fewer pages than probes: each page is probed once.
        let (first, end) = (pages * i / PROBES, pages * (i + 1) / PROBES);
        if first == end {
            continue;
        }
        let page = first + (random.hash_one(i) % (end - first) as u64) as usize;
        let mut bufs = [std::io::IoSliceMut::new(&mut byte)];
        let flags = rustix::io::ReadWriteFlags::NOWAIT;
        match rustix::io::preadv2(file, &mut bufs, (page * page_size) as u64, flags) {
            Ok(1) => {}
            Err(rustix::io::Errno::AGAIN) => return Some(false),
            _ => return None,
        }
    }
    Some(true)
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::unix::fs::FileExt;

    /// A new unnamed file beside the test binary (in the build's target directory): these
    /// tests need a disk file system, which drops clean pages when asked and answers
    /// `RWF_NOWAIT` (ext4, xfs, btrfs: what a cache directory is on). `/tmp` may be a tmpfs,
    /// which does neither. The capability is checked, not assumed: a file system that cannot
    /// say fails the test with its name, rather than passing it unrun.
    fn disk_file() -> std::fs::File {
        let exe = std::env::current_exe().unwrap();
        let dir = exe.parent().unwrap();
        let file = tempfile::tempfile_in(dir).unwrap();
        let mut byte = [0u8];
        let mut bufs = [std::io::IoSliceMut::new(&mut byte)];
        let nowait = rustix::io::preadv2(&file, &mut bufs, 0, rustix::io::ReadWriteFlags::NOWAIT);
        let kind = rustix::fs::fstatfs(&file).map(|s| s.f_type);
        assert!(
            nowait == Ok(0),
            "{} (file system type {kind:#x?}) cannot say whether a page is cached \
             (RWF_NOWAIT: {nowait:?}); build in a directory on ext4, xfs or btrfs",
            dir.display()
        );
        file
    }

    #[test]
    fn a_file_out_of_the_page_cache_does_not_look_resident_and_a_read_one_does() {
        let mut file = disk_file();
        file.write_all(&vec![7u8; 4 << 20]).unwrap();
        file.sync_all().unwrap();
        // Written back, so the kernel drops the (clean) pages when asked to. DONTNEED is
        // advice and may leave some for a moment (a fresh-clone CI rehearsal saw the file
        // still resident once): ask until none is left, a bounded number of times.
        let dropped = (0..100).any(|_| {
            rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::DontNeed).unwrap();
            super::residency(&file, 4 << 20) == Some(false)
        });
        assert!(
            dropped,
            "the kernel kept the file's pages in 100 DONTNEED calls"
        );
        let mut all = vec![0u8; 4 << 20];
        file.read_exact_at(&mut all, 0).unwrap();
        // Every page is cached now, so every random choice of probes finds it so.
        for _ in 0..8 {
            assert_eq!(super::residency(&file, all.len()), Some(true));
        }
    }

    #[test]
    fn files_of_fewer_pages_than_probes_are_probed_within_their_length() {
        let written = |len: usize| {
            let mut file = disk_file();
            file.write_all(&vec![7u8; len]).unwrap();
            file
        };
        // A probe past the end would read nothing and answer None for these cached files.
        for len in [1, 4096, 3 * 4096 + 5, 17 * 4096, 100_001] {
            let file = written(len);
            for _ in 0..32 {
                assert_eq!(super::residency(&file, len), Some(true), "{len} bytes");
            }
        }
    }
}
