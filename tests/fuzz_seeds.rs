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

use std::path::{Path, PathBuf};

/// libfuzzer-sys's `fuzz_target!` as a plain function: raw targets take the bytes, structured
/// ones what `arbitrary` builds of them, skipping an input it cannot build one of, as
/// libfuzzer-sys does.
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
                return;
            }
            if let Ok($input) = <$ty>::arbitrary_take_rest(Unstructured::new(data)) {
                $body
            }
        }
    };
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

/// Runs a target's check on each of its seeds; a failure names the seed. `FUZZ_SEEDS=PATH`
/// (a file or a directory: a finding, a corpus) replays that instead, e.g.
/// `FUZZ_SEEDS=fuzz/artifacts/tar/crash-... cargo nextest run --test fuzz_seeds tar`.
fn replay(target: &str, run: fn(&[u8])) {
    let dir = match std::env::var_os("FUZZ_SEEDS") {
        Some(path) => PathBuf::from(path),
        None => fuzz_dir().join("seeds").join(target),
    };
    let mut seeds: Vec<PathBuf> = match std::fs::read_dir(&dir) {
        Ok(entries) => entries.map(|e| e.unwrap().path()).collect(),
        Err(_) => vec![dir.clone()],
    };
    seeds.sort();
    assert!(!seeds.is_empty(), "no seeds in {}", dir.display());
    for seed in seeds {
        let data = std::fs::read(&seed).unwrap_or_else(|e| panic!("{}: {e}", seed.display()));
        if std::panic::catch_unwind(|| run(&data)).is_err() {
            panic!(
                "fuzz target {target} fails on {} (see above)",
                seed.display()
            );
        }
    }
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
