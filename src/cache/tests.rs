//! Unit tests of the cache against real files: local shards as the source (copied in, as
//! the daemon does), a real temp cache directory.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::cache::evict::{Foresight, NoForesight};
use crate::config::Config;

struct Fixture {
    _tmp: tempfile::TempDir,
    src: PathBuf,
    cache_dir: PathBuf,
    metrics: Arc<Metrics>,
    config: Config,
}

impl Fixture {
    /// `shards` local files of `size` bytes each (distinct contents), and a config naming them.
    fn new(shards: usize, size: usize) -> Fixture {
        let tmp = tempfile::tempdir().unwrap();
        let src = tmp.path().join("src");
        std::fs::create_dir(&src).unwrap();
        for i in 0..shards {
            std::fs::write(src.join(format!("s{i}.tar")), content(i, size)).unwrap();
        }
        let cache_dir = tmp.path().join("cache");
        let text = format!(
            "[datasets.d]\nshards = \"{}/s{{0..{}}}.tar\"\n",
            src.display(),
            shards - 1
        );
        let config = Config::parse(&text, tmp.path()).unwrap();
        Fixture {
            _tmp: tmp,
            src,
            cache_dir,
            metrics: Arc::new(Metrics::new()),
            config,
        }
    }

    fn open(&self, max_bytes: u64, revalidate: Duration) -> Cache {
        let limits = Limits {
            max_bytes,
            space_timeout: Duration::from_millis(300),
            revalidate,
        };
        self.open_with(limits, Arc::new(NoForesight))
    }

    fn open_with(&self, limits: Limits, foresight: Arc<dyn Foresight>) -> Cache {
        let stores = Arc::new(Stores::from_config(&self.config, self.metrics.clone()).unwrap());
        Cache::open(
            &self.cache_dir,
            limits,
            stores,
            foresight,
            self.metrics.clone(),
        )
        .unwrap()
    }

    /// Replaces shard `i` with `plain` gzipped; returns the compressed size.
    fn gzip(&self, i: usize, plain: &[u8]) -> u64 {
        use std::io::Write;
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(plain).unwrap();
        let gz = gz.finish().unwrap();
        std::fs::write(self.src.join(format!("s{i}.tar")), &gz).unwrap();
        gz.len() as u64
    }

    fn tmp_files(&self) -> usize {
        std::fs::read_dir(self.cache_dir.join("tmp"))
            .unwrap()
            .count()
    }

    fn shard(&self, i: usize) -> ShardUrl {
        self.config.datasets["d"].shards[i].clone()
    }

    fn reads(&self) -> u64 {
        self.metrics.shard_fetches_total.get()
    }

    /// Bytes of every file under the cache directory (what `du --apparent-size` would say).
    fn bytes_on_disk(&self) -> u64 {
        fn walk(p: &Path) -> u64 {
            std::fs::read_dir(p)
                .unwrap()
                .map(|e| {
                    let e = e.unwrap();
                    let m = e.metadata().unwrap();
                    if m.is_dir() { walk(&e.path()) } else { m.len() }
                })
                .sum()
        }
        walk(&self.cache_dir)
    }
}

fn content(i: usize, size: usize) -> Vec<u8> {
    let mut rng = crate::plan::shuffle::SplitMix64::new(i as u64 + 1);
    (0..size).map(|_| rng.next_u64() as u8).collect()
}

const HOUR: Duration = Duration::from_secs(3600);
const MIB: u64 = 1 << 20;
/// How long a test waits for a condition before it fails.
const DEADLINE: Duration = Duration::from_secs(20);

/// A foresight with next uses the test sets, that counts how often it is asked.
#[derive(Default)]
struct Oracle {
    next: std::sync::Mutex<HashMap<String, u64>>,
    asked: std::sync::atomic::AtomicUsize,
}

impl Oracle {
    fn set(&self, shard: &ShardUrl, next_use: u64) {
        let mut next = self.next.lock().unwrap();
        next.insert(shard.as_str().to_string(), next_use);
    }

    fn asked(&self) -> usize {
        self.asked.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Foresight for Oracle {
    fn next_uses(&self, shards: &[&str]) -> Vec<Option<u64>> {
        self.asked.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let next = self.next.lock().unwrap();
        shards.iter().map(|s| next.get(*s).copied()).collect()
    }
}

fn limits(max_bytes: u64, space_timeout: Duration) -> Limits {
    Limits {
        max_bytes,
        space_timeout,
        revalidate: HOUR,
    }
}

/// Polls `condition` until it holds; fails the test after [`DEADLINE`], or as soon as
/// `task` (what should be waiting) has ended.
async fn wait_until<T>(task: &tokio::task::JoinHandle<T>, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + DEADLINE;
    while !condition() {
        assert!(!task.is_finished(), "the task ended instead of waiting");
        assert!(Instant::now() < deadline, "timed out");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_gets_read_the_source_once() {
    let f = Fixture::new(1, 300_000);
    let cache = f.open(10 << 20, HOUR);
    let gets: Vec<_> = (0..8)
        .map(|_| {
            let (c, s) = (cache.clone(), f.shard(0));
            tokio::spawn(async move { c.get(&s).await.unwrap() })
        })
        .collect();
    for g in gets {
        assert!(g.await.unwrap()[..] == content(0, 300_000)[..]);
    }
    assert_eq!(f.reads(), 1);
    assert_eq!(f.metrics.cache_pinned_bytes.get(), 0);
    // Cached bytes are cache-file memory, which the sink may splice.
    assert!(cache.get(&f.shard(0)).await.unwrap().spliceable().is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_that_map_an_entry_at_once_share_one_mapping() {
    // A cached entry no one holds: every reader maps it anew, and all race to. Zero-copy
    // delivery passes a reader's pieces as (file, offset) only if they lie in the mapping
    // the entry records; a reader left with a mapping of its own would send them inline.
    let f = Fixture::new(1, 300_000);
    let cache = f.open(10 << 20, HOUR);
    drop(cache.get(&f.shard(0)).await.unwrap());
    for _ in 0..5 {
        let gets: Vec<_> = (0..16)
            .map(|_| {
                let (c, s) = (cache.clone(), f.shard(0));
                tokio::spawn(async move { c.get(&s).await.unwrap() })
            })
            .collect();
        let mut held = Vec::new();
        for g in gets {
            held.push(g.await.unwrap());
        }
        for bytes in &held {
            assert_eq!(bytes.as_ptr(), held[0].as_ptr(), "one mapping");
            assert!(cache.committed_file(f.shard(0).as_str(), bytes).is_some());
        }
        drop(held);
        // The mappings dropped by the race's losers held no pin of their own.
        assert_eq!(f.metrics.cache_pinned_bytes.get(), 0);
    }
}

#[tokio::test]
async fn the_budget_is_hard_and_pinned_entries_stay() {
    let size = 100_000u64;
    let f = Fixture::new(4, size as usize);
    // Room for two entries and their records, not three.
    let cache = f.open(2 * (size + META_MAX) + 1000, HOUR);
    let a = cache.get(&f.shard(0)).await.unwrap();
    let b = cache.get(&f.shard(1)).await.unwrap();
    assert!(f.bytes_on_disk() <= cache.max_bytes());
    // Both pinned: a third waits for space, then fails with the numbers.
    let err = cache.get(&f.shard(2)).await.unwrap_err().to_string();
    assert!(err.starts_with("cache full: "), "{err}");
    assert!(
        err.contains(&format!("needs {} bytes", size + META_MAX))
            && err.contains(&format!(
                "{} are pinned by open streams",
                2 * (size + META_MAX)
            )),
        "{err}"
    );
    // Release one: the third evicts it, never the pinned one.
    drop(a);
    let c = cache.get(&f.shard(2)).await.unwrap();
    assert!(c[..] == content(2, size as usize)[..]);
    assert!(b[..] == content(1, size as usize)[..]);
    assert_eq!(f.metrics.cache_evictions_total.get(), 1);
    assert!(f.bytes_on_disk() <= cache.max_bytes());
    assert!(cache.is_ready(&f.shard(1)) && !cache.is_ready(&f.shard(0)));
    // A waiting demand is served as soon as a pin is released.
    let waiter = {
        let (cache, s) = (cache.clone(), f.shard(3));
        tokio::spawn(async move { cache.get(&s).await.map(|b| b.len()) })
    };
    tokio::task::yield_now().await;
    drop(b);
    assert_eq!(waiter.await.unwrap().unwrap(), size as usize);
    assert_eq!(f.metrics.cache_bytes.get() as u64, 2 * (size + META_MAX));
    // The high-water mark: the budget was full (two entries) and never more.
    assert_eq!(
        f.metrics.cache_bytes_max.get() as u64,
        2 * (size + META_MAX)
    );
    assert!(f.metrics.cache_bytes_max.get() as u64 <= cache.max_bytes());
}

#[tokio::test]
async fn an_object_larger_than_the_budget_is_refused_before_reading() {
    let f = Fixture::new(1, 50_000);
    let cache = f.open(40_000, HOUR);
    let err = cache.get(&f.shard(0)).await.unwrap_err().to_string();
    assert!(
        err.ends_with("s0.tar: 50000 bytes do not fit in cache.max_size (40000 bytes)"),
        "{err}"
    );
    assert_eq!(f.reads(), 0);
}

#[tokio::test]
async fn entries_survive_a_restart_and_corruption_is_caught() {
    let f = Fixture::new(2, 64_000);
    {
        let cache = f.open(10 << 20, HOUR);
        cache.get(&f.shard(0)).await.unwrap();
        cache.get(&f.shard(1)).await.unwrap();
    }
    assert_eq!(f.reads(), 2);
    // Flip a byte of one entry while the daemon is down.
    let entries = f.cache_dir.join("entries");
    let victim = std::fs::read_dir(&entries)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "tar"))
        .unwrap();
    let mut bytes = std::fs::read(&victim).unwrap();
    bytes[1000] ^= 0xff;
    std::fs::write(&victim, &bytes).unwrap();

    let cache = f.open(10 << 20, HOUR);
    for i in 0..2 {
        assert!(cache.get(&f.shard(i)).await.unwrap()[..] == content(i, 64_000)[..]);
    }
    assert_eq!(f.reads(), 3, "only the corrupted entry is read again");
    assert_eq!(f.metrics.cache_verify_failures_total.get(), 1);
}

/// A committed file (what zero copy passes to clients) is writable by its owner only, even
/// under a umask that lets the group write: a client of another user in the socket's group
/// cannot reopen its descriptor for writing through /proc/self/fd.
#[tokio::test]
async fn committed_files_are_writable_by_their_owner_only() {
    use std::os::unix::fs::PermissionsExt;
    let f = Fixture::new(1, 64_000);
    let old = rustix::process::umask(rustix::fs::Mode::from_raw_mode(0o002));
    let cache = f.open(10 << 20, HOUR);
    cache.get(&f.shard(0)).await.unwrap();
    rustix::process::umask(old);
    let entries = f.cache_dir.join("entries");
    let data = std::fs::read_dir(&entries)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "tar"))
        .unwrap();
    let mode = std::fs::metadata(&data).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "{}", data.display());
}

#[tokio::test]
async fn a_changed_source_is_fetched_again_and_a_cached_copy_survives_truncation() {
    let f = Fixture::new(1, 80_000);
    let cache = f.open(10 << 20, Duration::ZERO);
    let first = cache.get(&f.shard(0)).await.unwrap();
    // The operator truncates the local file while it is being served: our copy is intact.
    let path = f.src.join("s0.tar");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(10)
        .unwrap();
    assert!(first[..] == content(0, 80_000)[..]);
    drop(first);
    // Next use checks the source (revalidate = 0): it changed, so it is read again.
    std::fs::write(&path, content(7, 5000)).unwrap();
    assert!(cache.get(&f.shard(0)).await.unwrap()[..] == content(7, 5000)[..]);
    assert_eq!(f.reads(), 2);
    // Gone from the source: an error naming it, whatever the cache holds.
    std::fs::remove_file(&path).unwrap();
    let err = cache.get(&f.shard(0)).await.unwrap_err().to_string();
    assert_eq!(err, format!("{}: object not found", path.display()));
}

#[tokio::test]
async fn gzip_is_stored_decompressed_within_the_budget() {
    use std::io::Write;
    let f = Fixture::new(2, 10);
    let plain = content(3, 400_000);
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(&plain).unwrap();
    std::fs::write(f.src.join("s0.tar"), gz.finish().unwrap()).unwrap();
    let cache = f.open(2 << 20, HOUR);
    assert!(cache.get(&f.shard(0)).await.unwrap()[..] == plain[..]);
    assert!(f.bytes_on_disk() <= cache.max_bytes());

    // A bomb: 4 MiB of zeros in a few KB must not get past a 1 MiB budget.
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    gz.write_all(&vec![0u8; 4 << 20]).unwrap();
    std::fs::write(f.src.join("s1.tar"), gz.finish().unwrap()).unwrap();
    let small = Fixture {
        cache_dir: f.cache_dir.with_file_name("small"),
        ..f
    };
    let cache = small.open(1 << 20, HOUR);
    let err = cache.get(&small.shard(1)).await.unwrap_err().to_string();
    assert!(
        err.contains("s1.tar: decompresses to more than the cache can hold"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_dir(small.cache_dir.join("tmp"))
            .unwrap()
            .count(),
        0
    );
    assert_eq!(small.metrics.cache_bytes.get(), 0);
}

/// Runs the real `zstd` tool (or `pzstd`) over `input` with `args`; returns its output.
fn zstd_cli(program: &str, args: &[&str], input: &[u8]) -> Vec<u8> {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("running {program} (apt-get install zstd): {e}"));
    let mut stdin = child.stdin.take().unwrap();
    let input = input.to_vec();
    let feed = std::thread::spawn(move || stdin.write_all(&input));
    let out = child.wait_with_output().unwrap();
    feed.join().unwrap().unwrap();
    assert!(out.status.success(), "{program} {args:?} failed");
    out.stdout
}

/// zstd shards as the `zstd` tool writes them: one frame, several frames (two files
/// concatenated), and `pzstd`'s frames each behind a skippable frame; each is stored
/// decompressed, byte for byte, within the budget, and recorded as zstd.
#[tokio::test]
async fn zstd_is_stored_decompressed_within_the_budget() {
    let f = Fixture::new(3, 10);
    let plain = [content(3, 400_000), vec![5u8; 300_000]].concat();
    let one = zstd_cli("zstd", &["-q", "-c", "-3"], &plain);
    assert!(one.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]));
    let two = [
        zstd_cli("zstd", &["-q", "-c"], &plain[..123_457]),
        zstd_cli("zstd", &["-q", "-c", "-19"], &plain[123_457..]),
    ]
    .concat();
    let skippable = zstd_cli("pzstd", &["-q", "-c", "-p", "2"], &plain);
    assert!(skippable.starts_with(&[0x50, 0x2a, 0x4d, 0x18]));
    for (i, z) in [&one, &two, &skippable].into_iter().enumerate() {
        std::fs::write(f.src.join(format!("s{i}.tar")), z).unwrap();
    }
    let max = 2 << 20;
    let cache = f.open(max, HOUR);
    for i in 0..3 {
        assert!(
            cache.get(&f.shard(i)).await.unwrap()[..] == plain[..],
            "shard {i}"
        );
        assert!(f.bytes_on_disk() <= max);
    }
    let records: Vec<Meta> = std::fs::read_dir(f.cache_dir.join("entries"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "meta"))
        .map(|p| serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap())
        .collect();
    assert!(!records.is_empty());
    for m in records {
        assert!(m.zstd && !m.gzip && m.size == plain.len() as u64, "{m:?}");
    }
}

/// A zstd bomb (4 MiB of zeros in a few hundred bytes) stops at a 1 MiB budget, as a gzip
/// one does, and leaves nothing behind.
#[tokio::test]
async fn a_zstd_bomb_stops_at_the_budget() {
    let f = Fixture::new(1, 10);
    let bomb = zstd_cli("zstd", &["-q", "-c", "-19"], &vec![0u8; 4 << 20]);
    assert!(bomb.len() < 4096, "{}", bomb.len());
    std::fs::write(f.src.join("s0.tar"), &bomb).unwrap();
    let cache = f.open(1 << 20, HOUR);
    let err = cache.get(&f.shard(0)).await.unwrap_err().to_string();
    assert!(
        err.starts_with(&format!(
            "{}: decompresses to more than the cache can hold (cache.max_size 1048576 bytes; ",
            f.shard(0)
        )),
        "{err}"
    );
    assert_eq!(f.tmp_files(), 0);
    assert_eq!(f.metrics.cache_bytes.get(), 0);
}

/// Truncated and corrupt zstd, and a frame whose window is over the limit: each an error
/// naming the shard that says what is wrong, nothing left behind, and the other shards
/// still served.
#[tokio::test]
async fn bad_zstd_is_an_error_naming_the_shard() {
    let f = Fixture::new(4, 5000);
    let plain = content(9, 300_000);
    let good = zstd_cli("zstd", &["-q", "-c"], &plain);
    std::fs::write(f.src.join("s0.tar"), &good[..good.len() / 2]).unwrap();
    let mut corrupt = good.clone();
    for b in &mut corrupt[good.len() / 3..good.len() / 3 + 64] {
        *b ^= 0x5a;
    }
    std::fs::write(f.src.join("s1.tar"), &corrupt).unwrap();
    // `--long=28` on input of unknown size: the frame asks for a 256 MiB window.
    let wide = zstd_cli("zstd", &["-q", "-c", "--long=28"], &plain);
    std::fs::write(f.src.join("s2.tar"), &wide).unwrap();
    let cache = f.open(16 << 20, HOUR);
    let err = |i| {
        let cache = cache.clone();
        let shard = f.shard(i);
        async move { cache.get(&shard).await.unwrap_err().to_string() }
    };
    let zstd = |i| format!("{}: decompressing the zstd shard: ", f.shard(i));
    assert_eq!(
        err(0).await,
        zstd(0) + "truncated: the data ends inside a zstd frame"
    );
    let corrupted = err(1).await;
    assert!(
        corrupted.starts_with(&(zstd(1) + "corrupt zstd data (")),
        "{corrupted}"
    );
    assert_eq!(
        err(2).await,
        zstd(2)
            + "a zstd frame needs a window larger than 128 MiB, the most shardd decodes (as the zstd tool without --memory): compress with a smaller one (zstd --long=N with N <= 27)"
    );
    assert_eq!(f.tmp_files(), 0);
    assert_eq!(f.metrics.cache_bytes.get(), 0);
    assert!(cache.get(&f.shard(3)).await.unwrap()[..] == content(3, 5000)[..]);
    // `--long=27` is within the limit.
    std::fs::write(
        f.src.join("s2.tar"),
        zstd_cli("zstd", &["-q", "-c", "--long=27"], &plain),
    )
    .unwrap();
    assert!(cache.get(&f.shard(2)).await.unwrap()[..] == plain[..]);
}

/// A load started while the runtime shuts down: the runtime drops the new task inside
/// `spawn`, and the task's guard takes the state lock, so the load must not be spawned
/// under that lock. The caller gets an error instead of a deadlock.
#[test]
fn a_load_started_during_runtime_shutdown_fails_without_a_deadlock() {
    let f = Fixture::new(1, 1000);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let cache = {
        let _context = rt.enter();
        f.open(10 << 20, HOUR)
    };
    let handle = rt.handle().clone();
    rt.shutdown_background();
    let (done, result) = std::sync::mpsc::channel();
    let (c, s) = (cache.clone(), f.shard(0));
    std::thread::spawn(move || {
        let got = handle.block_on(c.get(&s)).map(|b| b.len());
        let _ = done.send(got.map_err(|e| e.to_string()));
    });
    let got = result
        .recv_timeout(Duration::from_secs(20))
        .expect("the get deadlocked");
    let err = got.unwrap_err();
    assert!(
        err.starts_with(&format!("{}: internal error: task ", f.shard(0)))
            && err.ends_with(" was cancelled"),
        "{err}"
    );
    // The slot was cleared: nothing is left loading.
    assert_eq!(cache.usage().loading, 0);
}

/// A gzipped shard a stream needs, decompressing into space another stream has pinned:
/// it waits for the pin as any demand load waits (before, it failed at once with
/// "decompresses to more than the cache can hold"), then evicts the released entry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gzip_output_waits_for_pinned_space_like_a_demand_load() {
    let f = Fixture::new(2, 2 * MIB as usize);
    let plain = vec![7u8; 3 * MIB as usize];
    let compressed = f.gzip(1, &plain);
    let max = 4 * MIB;
    let cache = f.open_with(limits(max, DEADLINE), Arc::new(NoForesight));
    let pinned = cache.get(&f.shard(0)).await.unwrap();
    let load = {
        let (cache, s) = (cache.clone(), f.shard(1));
        tokio::spawn(async move { cache.get(&s).await.map(|b| b[..] == plain[..]) })
    };
    wait_until(&load, || cache.usage().waiting == 1).await;
    // Waiting mid-decompression: the download and the first MiB of output are reserved.
    let held = f.metrics.cache_bytes.get() as u64 - (2 * MIB + META_MAX);
    assert_eq!(held, compressed + META_MAX + MIB);
    drop(pinned);
    assert!(
        load.await.unwrap().unwrap(),
        "the decompressed bytes differ"
    );
    assert_eq!(f.metrics.cache_evictions_total.get(), 1);
    assert_eq!(f.metrics.cache_bytes.get() as u64, 3 * MIB + META_MAX);
    assert!(f.bytes_on_disk() <= max);
    assert_eq!(f.metrics.cache_full_total.get(), 0);
}

/// The same, with the pin never released: `cache_full` after `cache.space_timeout`, naming
/// what the load needed so far, and nothing of the load is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gzip_output_that_never_finds_space_fails_as_cache_full() {
    let f = Fixture::new(2, 2 * MIB as usize);
    let compressed = f.gzip(1, &vec![7u8; 3 * MIB as usize]);
    let max = 4 * MIB;
    let cache = f.open_with(
        limits(max, Duration::from_millis(300)),
        Arc::new(NoForesight),
    );
    let _pinned = cache.get(&f.shard(0)).await.unwrap();
    let err = cache.get(&f.shard(1)).await.unwrap_err().to_string();
    let need = compressed + META_MAX + 2 * MIB;
    let pinned = 2 * MIB + META_MAX;
    assert!(
        err.starts_with(&format!(
            "cache full: {} needs {need} bytes but cache.max_size is {max} bytes, of which {pinned} are pinned by open streams and {} reserved",
            f.shard(1),
            compressed + META_MAX + MIB
        )),
        "{err}"
    );
    assert_eq!(f.metrics.cache_full_total.get(), 1);
    assert_eq!(f.metrics.cache_bytes.get() as u64, pinned);
    assert_eq!(f.tmp_files(), 0);
}

/// Decompressing evicts only what the load's purpose allows: a warm-up nothing, a prefetch
/// only entries needed later than it (before, both evicted what a stream needs next).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gzip_output_evicts_only_what_the_purpose_allows() {
    let f = Fixture::new(3, MIB as usize);
    let plain = vec![7u8; 2 * MIB as usize];
    let compressed = f.gzip(1, &plain);
    let (needed, spare, gz) = (f.shard(0), f.shard(2), f.shard(1));
    // Room for `needed`, `spare` and the download, not for the output besides.
    let max = (MIB + META_MAX) + (compressed + META_MAX) + 2 * MIB + 4096;
    let oracle = Arc::new(Oracle::default());
    oracle.set(&needed, 0);
    let cache = f.open_with(limits(max, DEADLINE), oracle.clone());
    cache.get(&needed).await.unwrap();
    let spare_pin = cache.get(&spare).await.unwrap();
    let no_room = format!("{gz}: no room to prefetch");

    let warm = cache.ensure(&gz, Purpose::Warm).await.unwrap_err();
    assert_eq!(warm.to_string(), no_room);
    // The prefetch is needed at 3, `needed` at 0, and `spare` is pinned.
    let prefetch = Purpose::Prefetch { distance: 3 };
    let err = cache.ensure(&gz, prefetch).await.unwrap_err();
    assert_eq!(err.to_string(), no_room);
    assert!(cache.is_ready(&needed) && cache.is_ready(&spare));
    assert_eq!(f.metrics.cache_evictions_total.get(), 0);
    assert_eq!(f.tmp_files(), 0);

    // `spare` released (needed by nobody): the prefetch evicts it, never `needed`.
    drop(spare_pin);
    let loaded = cache.ensure(&gz, prefetch).await.unwrap();
    assert_eq!(loaded, Ensured::Loaded(compressed));
    assert!(cache.is_ready(&needed) && !cache.is_ready(&spare));
    assert_eq!(f.metrics.cache_evictions_total.get(), 1);
    assert!(cache.get(&gz).await.unwrap()[..] == plain[..]);
    assert!(f.bytes_on_disk() <= max);
}

/// Decompressing into free space does not ask the foresight at all (before, it rebuilt the
/// whole next-use index for every MiB of output).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gzip_output_asks_the_foresight_only_to_evict() {
    let f = Fixture::new(1, 10);
    let plain = vec![7u8; 8 * MIB as usize];
    f.gzip(0, &plain);
    let oracle = Arc::new(Oracle::default());
    let cache = f.open_with(limits(64 * MIB, DEADLINE), oracle.clone());
    assert!(cache.get(&f.shard(0)).await.unwrap()[..] == plain[..]);
    assert_eq!(oracle.asked(), 0);
}

/// Files deleted under the daemon: an entry's data file, then both directories. Each next
/// get fetches the shard again (before, it failed with "mapping the cache file" for as long
/// as the entry stayed).
#[tokio::test]
async fn deleted_cache_files_are_fetched_again() {
    let f = Fixture::new(2, 70_000);
    let cache = f.open(10 << 20, HOUR);
    for i in 0..2 {
        cache.get(&f.shard(i)).await.unwrap();
    }
    let entries = f.cache_dir.join("entries");
    for e in std::fs::read_dir(&entries).unwrap() {
        let path = e.unwrap().path();
        if path.extension().is_some_and(|e| e == "tar") {
            std::fs::remove_file(path).unwrap();
        }
    }
    assert!(cache.get(&f.shard(0)).await.unwrap()[..] == content(0, 70_000)[..]);
    assert_eq!(f.reads(), 3);
    std::fs::remove_dir_all(&entries).unwrap();
    std::fs::remove_dir_all(f.cache_dir.join("tmp")).unwrap();
    for i in 0..2 {
        assert!(cache.get(&f.shard(i)).await.unwrap()[..] == content(i, 70_000)[..]);
    }
    assert_eq!(f.reads(), 5);
    assert_eq!(f.metrics.cache_bytes.get() as u64, 2 * (70_000 + META_MAX));
    assert_eq!(f.metrics.cache_verify_failures_total.get(), 0);
}

/// A reader that finds an entry's file deleted while another reader pins the entry (pinned,
/// not yet mapped) waits for that pin to go, then fetches the shard again (before, it was
/// served the pinned entry three times and failed with "mapping the cache file": two
/// DataLoader workers on one shard, the conformance matrix's deleted-files event).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_file_pinned_by_another_reader_is_fetched_again_once_it_lets_go() {
    let f = Fixture::new(1, 70_000);
    let cache = f.open(10 << 20, HOUR);
    let shard = f.shard(0);
    drop(cache.get(&shard).await.unwrap());
    let entry = cache.pin(&shard).await.unwrap();
    let held = Pin {
        inner: cache.inner.clone(),
        url: shard.as_str().to_string(),
        entry: entry.clone(),
    };
    std::fs::remove_file(&entry.path).unwrap();
    let get = {
        let (c, s) = (cache.clone(), shard.clone());
        tokio::spawn(async move { c.get(&s).await.map(|b| b.to_vec()) })
    };
    let distrusted = || {
        let st = cache.inner.state.lock().unwrap();
        matches!(st.slots.get(shard.as_str()), Some(Slot::Ready(r)) if !r.verified)
    };
    wait_until(&get, distrusted).await;
    drop(held);
    assert_eq!(get.await.unwrap().unwrap(), content(0, 70_000));
    assert_eq!(f.reads(), 2);
    assert_eq!(f.metrics.cache_pinned_bytes.get(), 0);
}
