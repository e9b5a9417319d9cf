//! The cache directory on disk: layout, the lock, atomic commits, checksums.
//!
//! ```text
//! <cache.dir>/lock                 flock()ed by the daemon that owns the directory; holds its pid
//! <cache.dir>/tmp/<run>-<n>.part   downloads and decompression in progress
//! <cache.dir>/entries/<key>-<run>-<n>.tar   an entry's bytes (a plain tar)
//! <cache.dir>/entries/<key>.meta   its metadata record (JSON): the entry exists iff this does
//! ```
//! `<key>` is the MD5 of the shard URL, in hex; `<run>` is random for each run of the daemon
//! (a pid repeats across restarts: in a container the daemon is often pid 1), so a data file
//! name never names two files, even across restarts. An entry is committed in this order: the
//! data is written to `tmp/`, fsynced and renamed into `entries/`; then the metadata record
//! is written to `tmp/`, fsynced and renamed over `<key>.meta`; then the directory is fsynced.
//! The metadata rename is the commit: after a crash (even `kill -9` or power loss) an entry is
//! either whole with its record, or the record is missing and start-up deletes the orphaned
//! data. A commit that fails after its data rename removes the data again (nothing stays on
//! disk uncharged). Start-up deletes only names of these shapes inside `tmp/` and `entries/`
//! (left by an earlier run of the daemon that holds the lock now); anything else is left
//! alone. `tmp/` and `entries/` are created again if someone deleted them under a running
//! daemon.

use std::fs::File;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use md5::Digest;
use serde::{Deserialize, Serialize};

use crate::store::Version;

/// Bytes charged for each entry's metadata record (a record is refused if longer).
pub const META_MAX: u64 = 8192;
/// Layout version written in every record; a record of another version is not reused.
const FORMAT: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error(
        "the cache directory {dir} is in use by another shardd (pid {pid}); two daemons must not share cache.dir"
    )]
    Locked { dir: PathBuf, pid: String },
    #[error("cannot open cache.dir {dir}: {source}{}", hint(source))]
    Io { dir: PathBuf, source: io::Error },
}

/// What to change when the user may not write the directory (a daemon run as a normal user
/// with the defaults, which are root's).
fn hint(e: &io::Error) -> &'static str {
    match e.kind() {
        io::ErrorKind::PermissionDenied
        | io::ErrorKind::ReadOnlyFilesystem
        | io::ErrorKind::NotADirectory
        | io::ErrorKind::AlreadyExists => {
            "; set [cache] dir to a directory this user may write (a relative path is the config file's directory's)"
        }
        _ => "",
    }
}

/// An entry's metadata record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Meta {
    pub format: u32,
    /// The shard URL, as configured.
    pub url: String,
    /// The version of the source the entry was made from.
    pub version: Version,
    /// The data file's name inside `entries/`.
    pub data: String,
    /// Bytes of the data file (a compressed shard's decompressed size).
    pub size: u64,
    /// CRC-32C of the data file: checked before an entry found at start-up is first served.
    pub crc32c: u32,
    /// Whether the source was gzip-compressed (the data file holds the plain tar).
    pub gzip: bool,
    /// Whether the source was zstd-compressed (the data file holds the plain tar). Absent
    /// from records written before zstd shards were read.
    #[serde(default)]
    pub zstd: bool,
}

pub struct Disk {
    dir: PathBuf,
    tmp: PathBuf,
    entries: PathBuf,
    /// Held (and flocked) for as long as the daemon runs.
    _lock: File,
    /// This run's part of every file name (see the module doc).
    run: String,
    next: AtomicU64,
    /// Held around reading-and-unlinking a record and around renaming one into place, so
    /// that removing an entry never unlinks the record of a newer entry for the same URL.
    /// (Only this process writes the directory: it holds the lock.)
    records: Mutex<()>,
    #[cfg(test)]
    test: TestHooks,
}

/// Lets tests interleave a removal with a commit.
#[cfg(test)]
#[derive(Default)]
struct TestHooks {
    /// `remove` signals on the first and waits on the second between reading the record and
    /// unlinking it.
    pause_remove: Mutex<Option<(std::sync::mpsc::Sender<()>, std::sync::mpsc::Receiver<()>)>>,
    /// Times a thread found the record lock held and waited for it.
    contended: AtomicU64,
}

impl Disk {
    /// Locks the directory (creating it), clears what an earlier run left in `tmp/`, and
    /// returns the committed entries found. Blocking.
    pub fn open(dir: &Path) -> Result<(Disk, Vec<Meta>), OpenError> {
        let err = |source| OpenError::Io {
            dir: dir.into(),
            source,
        };
        let (tmp, entries) = (dir.join("tmp"), dir.join("entries"));
        std::fs::create_dir_all(&tmp).map_err(err)?;
        std::fs::create_dir_all(&entries).map_err(err)?;
        let mut lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(dir.join("lock"))
            .map_err(err)?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                let mut pid = String::new();
                let _ = lock.read_to_string(&mut pid);
                return Err(OpenError::Locked {
                    dir: dir.into(),
                    pid: pid.trim().to_string(),
                });
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(err(e)),
        }
        lock.set_len(0).map_err(err)?;
        lock.write_all(std::process::id().to_string().as_bytes())
            .map_err(err)?;

        for path in list(&tmp).map_err(err)? {
            if path.extension().is_some_and(|e| e == "part") {
                std::fs::remove_file(&path).map_err(err)?;
                tracing::info!(path = %path.display(), "removed a partial file left by an earlier run");
            }
        }
        let disk = Disk {
            dir: dir.into(),
            tmp,
            entries,
            _lock: lock,
            run: run_id(),
            next: AtomicU64::new(0),
            records: Mutex::new(()),
            #[cfg(test)]
            test: TestHooks::default(),
        };
        let found = disk.scan().map_err(err)?;
        Ok((disk, found))
    }

    /// Reads every record; removes records that do not parse or whose data file is missing
    /// or of the wrong size, and data files no record names.
    fn scan(&self) -> io::Result<Vec<Meta>> {
        let mut found = Vec::new();
        let mut named = std::collections::HashSet::new();
        let paths = list(&self.entries)?;
        for path in paths.iter().filter(|p| has_ext(p, "meta")) {
            let meta = std::fs::read(path)
                .ok()
                .and_then(|text| serde_json::from_slice::<Meta>(&text).ok())
                .filter(|m| {
                    m.format == FORMAT && file_name(path) == format!("{}.meta", key(&m.url))
                });
            let size = meta
                .as_ref()
                .and_then(|m| std::fs::metadata(self.entries.join(&m.data)).ok())
                .map(|d| d.len());
            match meta {
                Some(m) if size == Some(m.size) => {
                    named.insert(m.data.clone());
                    found.push(m);
                }
                _ => {
                    tracing::warn!(path = %path.display(), "removed an unusable cache record");
                    std::fs::remove_file(path)?;
                }
            }
        }
        for path in paths.iter().filter(|p| has_ext(p, "tar")) {
            if !named.contains(&file_name(path)) {
                tracing::info!(path = %path.display(), "removed cache data no record names");
                std::fs::remove_file(path)?;
            }
        }
        Ok(found)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A new empty file in `tmp/`, removed again when the returned guard drops unless
    /// committed.
    pub fn temp_file(&self) -> io::Result<(TempFile, File)> {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let path = self.tmp.join(format!("{}-{n}.part", self.run));
        // 0600 whatever the umask: a zero-copy client is given descriptors of committed
        // files, and one of another user must not be able to reopen them for writing through
        // /proc/self/fd (truncating a file the daemon maps kills it with SIGBUS).
        let create = || {
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&path)
        };
        let file = in_dir(&self.tmp, create)?;
        Ok((TempFile(Some(path)), file))
    }

    pub fn data_path(&self, meta: &Meta) -> PathBuf {
        self.entries.join(&meta.data)
    }

    /// Commits `data` as the entry for `meta.url` (filling in `meta.data`), atomically.
    pub fn commit(&self, data: TempFile, mut meta: Meta) -> io::Result<Meta> {
        let key = key(&meta.url);
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        meta.data = format!("{key}-{}-{n}.tar", self.run);
        let record = serde_json::to_vec(&meta).map_err(io::Error::other)?;
        if record.len() as u64 > META_MAX {
            return Err(io::Error::other(
                "the cache record is over 8 KiB (URL too long)",
            ));
        }
        File::open(data.path())?.sync_all()?;
        let target = self.entries.join(&meta.data);
        in_dir(&self.entries, || std::fs::rename(data.path(), &target))?;
        data.disarm();
        if let Err(e) = self.write_record(&key, &record) {
            // Not committed: its data must not stay behind, outside the budget.
            if let Err(e) = self.remove(&meta) {
                tracing::warn!(url = %meta.url, error = %e, "could not remove an uncommitted cache file");
            }
            return Err(e);
        }
        Ok(meta)
    }

    /// Writes a record to `tmp/` and renames it over `<key>.meta`: the commit.
    fn write_record(&self, key: &str, record: &[u8]) -> io::Result<()> {
        let (record_tmp, mut file) = self.temp_file()?;
        file.write_all(record)?;
        file.sync_all()?;
        {
            let _records = self.lock_records();
            std::fs::rename(record_tmp.path(), self.entries.join(format!("{key}.meta")))?;
        }
        record_tmp.disarm();
        File::open(&self.entries)?.sync_all()
    }

    fn lock_records(&self) -> MutexGuard<'_, ()> {
        if let Ok(held) = self.records.try_lock() {
            return held;
        }
        #[cfg(test)]
        self.test.contended.fetch_add(1, Ordering::SeqCst);
        self.records.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Removes an entry: its record first (so a crash in between leaves only orphaned data,
    /// which start-up removes), then its data.
    pub fn remove(&self, meta: &Meta) -> io::Result<()> {
        let record = self.entries.join(format!("{}.meta", key(&meta.url)));
        {
            // The record may already name a newer entry for the same URL: only remove ours
            // (the lock keeps a newer one from being renamed in between).
            let _records = self.lock_records();
            let ours = std::fs::read(&record)
                .ok()
                .and_then(|t| serde_json::from_slice::<Meta>(&t).ok())
                .is_some_and(|m| m.data == meta.data);
            #[cfg(test)]
            self.test.pause_remove();
            if ours {
                std::fs::remove_file(&record)?;
            }
        }
        match std::fs::remove_file(self.entries.join(&meta.data)) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
impl TestHooks {
    fn pause_remove(&self) {
        if let Some((paused, resume)) = self.pause_remove.lock().unwrap().take() {
            paused.send(()).unwrap();
            resume.recv().unwrap();
        }
    }
}

/// Runs `op` on a file in `dir`; if it fails with `NotFound`, creates `dir` (deleted under
/// the daemon by an operator or a cleaner) and runs it once more.
fn in_dir<T>(dir: &Path, op: impl Fn() -> io::Result<T>) -> io::Result<T> {
    match op() {
        Err(e) if e.kind() == io::ErrorKind::NotFound && !dir.is_dir() => {
            tracing::warn!(dir = %dir.display(), "a cache directory was deleted: creating it again");
            std::fs::create_dir_all(dir)?;
            op()
        }
        other => other,
    }
}

/// 64 random bits, in hex: this run's part of file names. (`RandomState` is seeded by the
/// OS; the clock and pid are mixed in for good measure.)
fn run_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    h.write_u128(now.map(|d| d.as_nanos()).unwrap_or_default());
    h.write_u32(std::process::id());
    format!("{:016x}", h.finish())
}

/// A file in `tmp/` that is deleted on drop unless disarmed.
pub struct TempFile(Option<PathBuf>);

impl TempFile {
    pub fn path(&self) -> &Path {
        self.0.as_deref().expect("not disarmed")
    }
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// CRC-32C of a file: how an entry found at start-up is checked before it is first served
/// (a download's CRC-32C is computed as it is written, never by reading it back). Blocking.
pub fn checksums(path: &Path) -> io::Result<u32> {
    let mut file = File::open(path)?;
    let mut buf = vec![0u8; 1 << 20];
    let mut crc = 0u32;
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            return Ok(crc);
        }
        crc = crc32c::crc32c_append(crc, &buf[..n]);
    }
}

/// The file name an entry's record has: the URL's MD5 in hex.
fn key(url: &str) -> String {
    hex::encode(md5::Md5::digest(url.as_bytes()))
}

fn list(dir: &Path) -> io::Result<Vec<PathBuf>> {
    std::fs::read_dir(dir)?
        .map(|e| e.map(|e| e.path()))
        .collect()
}

fn has_ext(path: &Path, ext: &str) -> bool {
    path.extension().is_some_and(|e| e == ext)
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEADLINE: std::time::Duration = std::time::Duration::from_secs(20);

    fn meta(url: &str, size: u64) -> Meta {
        Meta {
            format: FORMAT,
            url: url.into(),
            version: Version {
                size,
                e_tag: Some("\"abc\"".into()),
                generation: None,
            },
            data: String::new(),
            size,
            crc32c: 0,
            gzip: false,
            zstd: false,
        }
    }

    fn commit(disk: &Disk, url: &str, bytes: &[u8]) -> Meta {
        let (tmp, mut f) = disk.temp_file().unwrap();
        f.write_all(bytes).unwrap();
        disk.commit(tmp, meta(url, bytes.len() as u64)).unwrap()
    }

    #[test]
    fn entries_survive_a_restart_and_partial_ones_do_not() {
        let dir = tempfile::tempdir().unwrap();
        {
            let (disk, found) = Disk::open(dir.path()).unwrap();
            assert!(found.is_empty());
            commit(&disk, "gs://b/a.tar", b"aaaa");
            let b = commit(&disk, "gs://b/b.tar", b"bbbbbb");
            // A crash mid-download, and one between the data rename and the record rename.
            let (tmp, mut f) = disk.temp_file().unwrap();
            f.write_all(b"partial").unwrap();
            std::mem::forget(tmp);
            std::fs::remove_file(
                dir.path()
                    .join("entries")
                    .join(format!("{}.meta", key(&b.url))),
            )
            .unwrap();
            std::fs::write(dir.path().join("entries/unrelated.txt"), b"x").unwrap();
        }
        let (_disk, found) = Disk::open(dir.path()).unwrap();
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].url, "gs://b/a.tar");
        assert_eq!(
            std::fs::read_dir(dir.path().join("tmp")).unwrap().count(),
            0
        );
        let mut left: Vec<String> = list(&dir.path().join("entries"))
            .unwrap()
            .iter()
            .map(|p| file_name(p))
            .collect();
        left.sort();
        assert_eq!(left.len(), 3, "{left:?}"); // a's data and record, and the unrelated file
        assert!(left.contains(&"unrelated.txt".to_string()));
    }

    #[test]
    fn a_second_daemon_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let _first = Disk::open(dir.path()).unwrap();
        let err = Disk::open(dir.path()).err().unwrap().to_string();
        assert!(
            err.contains(&format!(
                "in use by another shardd (pid {})",
                std::process::id()
            )),
            "{err}"
        );
    }

    #[test]
    fn a_record_with_the_wrong_size_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let data = {
            let (disk, _) = Disk::open(dir.path()).unwrap();
            disk.data_path(&commit(&disk, "gs://b/a.tar", b"aaaa"))
        };
        std::fs::write(&data, b"aa").unwrap();
        let (_disk, found) = Disk::open(dir.path()).unwrap();
        assert!(found.is_empty());
    }

    /// A daemon that restarts with the same pid (pid 1 in a container) must not name a new
    /// entry's data like one a record of the earlier run names: the new data would overwrite
    /// it, and removing the old entry would remove the new one.
    #[test]
    fn data_names_are_unique_across_restarts_with_the_same_pid() {
        let dir = tempfile::tempdir().unwrap();
        let url = "gs://b/a.tar";
        let first = {
            let (disk, _) = Disk::open(dir.path()).unwrap();
            commit(&disk, url, b"first")
        };
        let second = {
            let (disk, found) = Disk::open(dir.path()).unwrap();
            assert_eq!(found, vec![first.clone()]);
            // The new run loads the shard again before the old entry's removal has run.
            let second = commit(&disk, url, b"second");
            disk.remove(&first).unwrap();
            second
        };
        assert_ne!(first.data, second.data);
        let (disk, found) = Disk::open(dir.path()).unwrap();
        assert_eq!(found, vec![second.clone()]);
        assert_eq!(std::fs::read(disk.data_path(&second)).unwrap(), b"second");
    }

    /// `remove` reads the record, finds it is its entry's, and is about to unlink it when a
    /// commit of a newer entry for the same URL renames its record into place: the newer
    /// record must survive.
    #[test]
    fn remove_never_unlinks_a_newer_record() {
        let dir = tempfile::tempdir().unwrap();
        let url = "gs://b/a.tar";
        let (disk, _) = Disk::open(dir.path()).unwrap();
        let disk = std::sync::Arc::new(disk);
        let old = commit(&disk, url, b"old");
        let (paused, remove_paused) = std::sync::mpsc::channel();
        let (resume_remove, resume) = std::sync::mpsc::channel();
        *disk.test.pause_remove.lock().unwrap() = Some((paused, resume));
        let remover = {
            let (disk, old) = (disk.clone(), old.clone());
            std::thread::spawn(move || disk.remove(&old))
        };
        remove_paused.recv_timeout(DEADLINE).unwrap();
        let committer = {
            let disk = disk.clone();
            std::thread::spawn(move || commit(&disk, url, b"new"))
        };
        // Until the commit is done, or waits for the removal to finish.
        let deadline = std::time::Instant::now() + DEADLINE;
        while !committer.is_finished() && disk.test.contended.load(Ordering::SeqCst) == 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "the commit never got going"
            );
            std::thread::yield_now();
        }
        resume_remove.send(()).unwrap();
        remover.join().unwrap().unwrap();
        let new = committer.join().unwrap();
        drop(disk);
        let (disk, found) = Disk::open(dir.path()).unwrap();
        assert_eq!(found, vec![new.clone()]);
        assert_eq!(std::fs::read(disk.data_path(&new)).unwrap(), b"new");
    }

    /// A commit whose record cannot be written (here its name is taken by a directory)
    /// leaves no data file behind in `entries/`: nobody would be charged for it.
    #[test]
    fn a_failed_commit_leaves_no_data_behind() {
        let dir = tempfile::tempdir().unwrap();
        let url = "gs://b/a.tar";
        let (disk, _) = Disk::open(dir.path()).unwrap();
        let record = format!("{}.meta", key(url));
        std::fs::create_dir_all(dir.path().join("entries").join(&record).join("x")).unwrap();
        let (tmp, mut f) = disk.temp_file().unwrap();
        f.write_all(b"data").unwrap();
        let err = disk.commit(tmp, meta(url, 4)).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::IsADirectory, "{err}");
        let names = |d: &str| -> Vec<String> {
            list(&dir.path().join(d))
                .unwrap()
                .iter()
                .map(|p| file_name(p))
                .collect()
        };
        assert_eq!(names("entries"), vec![record]);
        assert_eq!(names("tmp"), Vec::<String>::new());
    }

    /// An operator deletes `tmp/` and `entries/` under a running daemon: they are created
    /// again, and commits go on.
    #[test]
    fn deleted_directories_are_created_again() {
        let dir = tempfile::tempdir().unwrap();
        let (disk, _) = Disk::open(dir.path()).unwrap();
        std::fs::remove_dir_all(dir.path().join("tmp")).unwrap();
        std::fs::remove_dir_all(dir.path().join("entries")).unwrap();
        let m = commit(&disk, "gs://b/a.tar", b"aaaa");
        assert_eq!(std::fs::read(disk.data_path(&m)).unwrap(), b"aaaa");
        drop(disk);
        let (_disk, found) = Disk::open(dir.path()).unwrap();
        assert_eq!(found, vec![m]);
    }

    #[test]
    fn checksums_match_known_values() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x");
        std::fs::write(&p, b"123456789").unwrap();
        assert_eq!(checksums(&p).unwrap(), 0xE306_9283); // the CRC-32C check value
    }
}
