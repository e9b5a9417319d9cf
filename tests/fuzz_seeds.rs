//! Every committed fuzz seed (`fuzz/seeds/TARGET/*`) through its target's own checks, in the
//! normal test suite. Each target's file (`fuzz/fuzz_targets/TARGET.rs`) is compiled here as
//! a module, with the `fuzz_target!` below in place of libfuzzer-sys's: its body becomes the
//! module's `run(&[u8])`. So a seed fails here as `cargo fuzz run TARGET SEED` fails (but for
//! what only AddressSanitizer or libFuzzer's time and memory limits see), without the sanitizer
//! build (nightly flags, minutes), and the targets cannot rot: they compile with the crate.
//! Fuzzing itself is on demand: `fuzz/run.sh SECONDS`.
//!
//! The `request` target's counting allocator is this binary's global allocator, as it is the
//! fuzz target's.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// libfuzzer-sys's `fuzz_target!` as a plain function: raw targets take the bytes, structured
/// ones what `arbitrary` builds of them. An input `arbitrary` cannot build one of (libFuzzer
/// skips it) reaches "unbuildable", which no committed seed may.
macro_rules! fuzz_target {
    (|$data:ident: &[u8]| $body:expr) => {
        pub fn run($data: &[u8]) {
            $body
        }
    };
    (|$input:ident: $ty:ty| $body:expr) => {
        pub fn run(data: &[u8]) {
            use arbitrary::{Arbitrary, Unstructured};
            if data.len() < <$ty as Arbitrary>::size_hint(0).0 {
                return $crate::reached("unbuildable");
            }
            match <$ty>::arbitrary_take_rest(Unstructured::new(data)) {
                Ok($input) => $body,
                Err(_) => $crate::reached("unbuildable"),
            }
        }
    };
}

thread_local! {
    /// What the seed being replayed reached, in order (`reached`).
    static REACHED: std::cell::RefCell<Vec<String>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Called by a target where a seed's run ends (its property checked, or the reason it was
/// not): the replay compares what each seed reached with `fuzz/seeds/REACHED`. In the fuzz
/// build the targets define it as nothing.
pub fn reached(what: impl AsRef<str>) {
    REACHED.with(|r| r.borrow_mut().push(what.as_ref().to_string()));
}

#[path = "../fuzz/fuzz_targets/batch_decode.rs"]
mod batch_decode;
#[path = "../fuzz/fuzz_targets/batch_roundtrip.rs"]
mod batch_roundtrip;
#[path = "../fuzz/fuzz_targets/braces.rs"]
mod braces;
#[path = "../fuzz/fuzz_targets/config.rs"]
mod config;
#[path = "../fuzz/fuzz_targets/frame.rs"]
mod frame;
#[path = "../fuzz/fuzz_targets/manifest.rs"]
mod manifest;
#[path = "../fuzz/fuzz_targets/request.rs"]
mod request;
#[path = "../fuzz/fuzz_targets/tar.rs"]
mod tar;

/// A test per target, `TARGET`, replaying its seeds; `TARGETS` names them all.
macro_rules! replay_tests {
    ($($target:ident),*) => {
        $(
            #[test]
            fn $target() {
                replay(stringify!($target), $target::run);
            }
        )*
        const TARGETS: &[&str] = &[$(stringify!($target)),*];
    };
}

replay_tests!(
    batch_decode,
    batch_roundtrip,
    braces,
    config,
    frame,
    manifest,
    request,
    tar
);

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz")
}

/// Longest a seed may take (this build is unoptimised: the slowest, `request/bound-*`, take
/// about 2 s): a seed that now runs for minutes is a finding, not a slow test.
const SEED_TIME: Duration = Duration::from_secs(30);

/// Runs a target's check on each of its seeds; a failure names the seed. Each seed must reach
/// what `fuzz/seeds/REACHED` says it reaches (a seed that stops reaching its property, say a
/// renamed request field that makes a `bound-*` seed "not a request", fails the replay), within
/// `SEED_TIME`. `FUZZ_SEEDS=PATH` (a file or a directory: a finding, a corpus) replays that
/// instead, printing what each input reached, e.g.
/// `FUZZ_SEEDS=fuzz/artifacts/tar/crash-... cargo nextest run --test fuzz_seeds tar`.
fn replay(target: &str, run: fn(&[u8])) {
    let given = std::env::var_os("FUZZ_SEEDS");
    let dir = match &given {
        Some(path) => PathBuf::from(path),
        None => fuzz_dir().join("seeds").join(target),
    };
    let mut seeds: Vec<PathBuf> = match std::fs::read_dir(&dir) {
        Ok(entries) => entries.map(|e| e.unwrap().path()).collect(),
        Err(_) => vec![dir.clone()],
    };
    seeds.sort();
    assert!(!seeds.is_empty(), "no seeds in {}", dir.display());
    let expected = expected_reach(target);
    let mut got = BTreeMap::new();
    for seed in seeds {
        let data = std::fs::read(&seed).unwrap_or_else(|e| panic!("{}: {e}", seed.display()));
        REACHED.with(|r| r.borrow_mut().clear());
        let started = Instant::now();
        if std::panic::catch_unwind(|| run(&data)).is_err() {
            panic!(
                "fuzz target {target} fails on {} (see above)",
                seed.display()
            );
        }
        let took = started.elapsed();
        assert!(
            took <= SEED_TIME,
            "fuzz target {target} took {took:?} on {} (at most {SEED_TIME:?})",
            seed.display()
        );
        let name = seed.file_name().unwrap().to_string_lossy().into_owned();
        got.insert(name, REACHED.with(|r| r.borrow().join(", ")));
    }
    if given.is_some() {
        got.iter()
            .for_each(|(seed, what)| println!("{seed}: {what}"));
        return;
    }
    let diff: Vec<String> = expected
        .keys()
        .chain(got.keys())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .filter(|seed| expected.get(*seed) != got.get(*seed))
        .map(|seed| {
            format!(
                "  {target}/{seed}: reached {:?}, fuzz/seeds/REACHED says {:?}",
                got.get(seed).map_or("(no such seed)", String::as_str),
                expected.get(seed).map_or("(nothing)", String::as_str)
            )
        })
        .collect();
    assert!(
        diff.is_empty(),
        "seeds of {target} that do not reach what fuzz/seeds/REACHED says:\n{}",
        diff.join("\n")
    );
}

/// `fuzz/seeds/REACHED`'s lines for `target`: `TARGET/SEED: what, what` (`#` comments). No
/// seed may be one `arbitrary` cannot build: it would test nothing.
fn expected_reach(target: &str) -> BTreeMap<String, String> {
    let text = std::fs::read_to_string(fuzz_dir().join("seeds").join("REACHED")).unwrap();
    assert!(
        !text.contains("unbuildable"),
        "fuzz/seeds/REACHED: a seed that tests nothing"
    );
    text.lines()
        .map(|l| l.split('#').next().unwrap().trim())
        .filter(|l| !l.is_empty())
        .filter_map(|l| {
            let (seed, what) = l.split_once(':').expect("TARGET/SEED: what");
            let (t, seed) = seed.split_once('/').expect("TARGET/SEED");
            (t == target).then(|| (seed.to_string(), what.trim().to_string()))
        })
        .collect()
}

/// Every target of fuzz/Cargo.toml is replayed here, and has seeds.
#[test]
fn targets_and_seeds_are_all_here() {
    let manifest: toml::Table =
        toml::from_str(&std::fs::read_to_string(fuzz_dir().join("Cargo.toml")).unwrap()).unwrap();
    let mut bins: Vec<&str> = manifest["bin"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["name"].as_str().unwrap())
        .collect();
    bins.sort();
    let mut seeded: Vec<String> = std::fs::read_dir(fuzz_dir().join("seeds"))
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.path().is_dir())
        .map(|e| e.file_name().into_string().unwrap())
        .collect();
    seeded.sort();
    assert_eq!(bins, TARGETS, "fuzz/Cargo.toml's targets");
    assert_eq!(seeded, TARGETS, "fuzz/seeds/'s directories");
}
