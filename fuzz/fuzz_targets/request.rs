//! Whole REQUEST bodies (JSON, as a client sends them) planned against a fixed config: a
//! shard-level dataset, two with manifests (one with `samples_per_epoch`), a resampled one, a
//! mix of three with a curriculum, a mix of two and one whose schedule has 1,000 entries
//! inside epochs, as one host and as host 1 of 2. Planning
//! is `plan::request::plan`, what the daemon runs on its blocking pool for every request it
//! accepts, with any `resume_from` origin chain (elastic resume) a client can write.
//!
//! Properties: planning returns a plan or an error, never panics, and costs bounded memory
//! whatever the numbers say (world sizes, workers, epochs, positions, origins): a counting
//! allocator tracks the peak of the bytes live during the call, which must stay under
//! `MAX_PEAK`. Bodies over the daemon's frame limit (64 KiB) never reach the planner.
#![cfg_attr(not(test), no_main)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::Path;
use std::sync::LazyLock;
use std::time::Instant;

#[cfg(test)] // tests/fuzz_seeds.rs checks what each seed reached
use crate::reached;
#[cfg(not(test))] // tests/fuzz_seeds.rs has its own
use libfuzzer_sys::fuzz_target;
use shardd::config::Config;
use shardd::plan::request;
use shardd::protocol::{MAX_CLIENT_FRAME, Request};

/// What a seed reached: recorded by tests/fuzz_seeds.rs, nothing in the fuzz build.
#[cfg(not(test))]
fn reached(_: impl AsRef<str>) {}

/// Live bytes a plan may peak at: a plan costs the shard count and the streams of the
/// request, bounded by `elastic::MAX_STREAMS`, never what its numbers say. The worst measured
/// (this config, 2026-11-25) are elastic resumes at that bound: 92-100 MB for one new stream
/// resuming 2^18 - 1 old ones (seeds `bound-origin`, `bound-mix`), 200 MB when each old
/// stream was a host of its own (`bound-old-hosts`). 512 MiB leaves ~2.5x.
const MAX_PEAK: usize = 512 << 20;

const CONFIG: &str = r#"
[host]
index = HOST_INDEX
count = HOST_COUNT
[datasets.files]
shards = "/data/files-{00..23}.tar"
shuffle_buffer = 7
[datasets.web]
shards = "/data/web-{00..31}.tar"
manifest = "/data/web.manifest.json"
shuffle_buffer = 50
[datasets.books]
shards = "/data/books-{0..8}.tar"
manifest = "/data/books.manifest.json"
samples_per_epoch = 300
[datasets.resampled]
shards = "/data/resampled-{0..4}.tar"
manifest = "/data/resampled.manifest.json"
samples_per_epoch = 200
resampled = true
[datasets.mix]
mix = { web = 3, books = 1, resampled = 1 }
samples_per_epoch = 120
schedule = [{ epoch = 2, mix = { web = 1, books = 2, resampled = 5 } }]
[datasets.pair]
mix = { web = 1, books = 1 }
samples_per_epoch = 100
"#;

/// A mix whose schedule has 1,000 entries keyed by job-wide samples: the more streams a job
/// has, the more of them fall in epoch 0 (401 segments at 40,000: seed `bound-mix-segments`).
fn timed_mix() -> String {
    let entries: Vec<String> = (1..=1000)
        .map(|i| {
            format!(
                "{{ at = {}, mix = {{ web = {}, books = 1 }} }}",
                i * 10_000_000u64,
                1 + i % 3
            )
        })
        .collect();
    format!(
        "[datasets.timed]\nmix = {{ web = 1, books = 1 }}\nsamples_per_epoch = 100000\nschedule = [{}]\n",
        entries.join(", ")
    )
}

/// The config as host 0 of 1 and as host 1 of 2, with manifests' counts as the daemon sets
/// them at start: up to 200,000 samples a shard (enough for every stream at the elastic
/// bound to have some), the first shard of each dataset empty.
static CONFIGS: LazyLock<Vec<Config>> = LazyLock::new(|| {
    [(0, 1), (1, 2)]
        .into_iter()
        .map(|(index, count)| {
            let text = CONFIG
                .replace("HOST_INDEX", &index.to_string())
                .replace("HOST_COUNT", &count.to_string())
                + &timed_mix();
            let mut config = Config::parse(&text, Path::new("/")).expect("the config is valid");
            for d in config.datasets.values_mut() {
                if d.manifest.is_some() {
                    d.set_counts(
                        (0..d.shards.len() as u64)
                            .map(|i| i * 7919 % 200_000)
                            .collect(),
                    );
                }
            }
            config
        })
        .collect()
});

fuzz_target!(|data: &[u8]| {
    if data.len() > MAX_CLIENT_FRAME as usize {
        return reached("over the frame limit");
    }
    // What the daemon refuses before planning: not a request, an unknown op or dataset.
    let Ok(req) = serde_json::from_slice::<Request>(data) else {
        return reached("not a request");
    };
    let known =
        |c: &Config| c.datasets.contains_key(&req.dataset) || c.mixes.contains_key(&req.dataset);
    if req.op != "stream" && req.op != "plan" || !known(&CONFIGS[0]) {
        return reached("unknown op or dataset");
    }
    let stream = req.stream_request();
    for config in CONFIGS.iter() {
        let started = Instant::now();
        let (peak, planned) = peak_of(|| {
            request::plan(
                config,
                &req.dataset,
                stream,
                req.resume_from.as_ref(),
                &req.history,
                req.op == "stream",
            )
        });
        if std::env::var_os("FUZZ_PRINT").is_some() {
            // triage, and the figures of fuzz/README.md
            let outcome = planned.as_ref().map(|_| "planned");
            let time = started.elapsed();
            eprintln!(
                "{:?}: {peak} bytes at most, {time:?}: {outcome:?}",
                config.host
            );
        }
        assert!(peak <= MAX_PEAK, "planning peaked at {peak} bytes");
        reached(match &planned {
            Ok(_) => "planned".to_string(),
            // The error's kind: a refusal at a bound is not a refusal at the door.
            Err(e) => format!(
                "refused ({})",
                format!("{e:?}").split(['(', ' ']).next().unwrap()
            ),
        });
    }
});

/// `f`'s result and the peak of the bytes it had allocated and not yet freed.
fn peak_of<T>(f: impl FnOnce() -> T) -> (usize, T) {
    let before = LIVE.get();
    PEAK.set(before);
    let result = f();
    ((PEAK.get() - before) as usize, result)
}

thread_local! {
    /// Bytes allocated on this thread minus those freed on it (planning runs on one thread;
    /// per thread, so that tests running at once do not add up), and their highest value
    /// since `peak_of` began.
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn count(grown: isize) {
    let live = LIVE.get() + grown;
    LIVE.set(live);
    PEAK.set(PEAK.get().max(live));
}

/// The system allocator, counting.
struct Counting;

// SAFETY: every call goes to the system allocator unchanged; the counting touches only
// const-initialised thread-locals without destructors, which never allocate.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract for `alloc` is passed on as is.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            count(layout.size() as isize);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as above.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            count(layout.size() as isize);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        count(-(layout.size() as isize));
        // SAFETY: `ptr` came from System through this allocator, with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as for dealloc; the caller's contract for `realloc` is passed on.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            count(new_size as isize - layout.size() as isize);
        }
        p
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;
