//! The manifest parser (`Manifest::parse`) on arbitrary bytes: a manifest may come from any
//! object URL. Properties: no panic (totals that overflow are an error, not an overflow),
//! every error names the manifest, a manifest that parses serialises back to itself, and
//! checked against exactly the shards it lists it gives its sample counts (or says a shard is
//! listed twice) and finds the versions it lists unchanged. The daemon's parser
//! (`Loaded::parse`, a stream into columns) takes the same inputs, fails with the same
//! message, and reads the same entries and positions.
#![cfg_attr(not(test), no_main)]

use std::collections::HashSet;
use std::path::Path;

#[cfg(test)] // tests/fuzz_seeds.rs checks what each seed reached
use crate::reached;
#[cfg(not(test))] // tests/fuzz_seeds.rs has its own
use libfuzzer_sys::fuzz_target;
use shardd::config::url::ShardUrl;
use shardd::shard::manifest::{Loaded, Manifest};

/// What a seed reached: recorded by tests/fuzz_seeds.rs, nothing in the fuzz build.
#[cfg(not(test))]
fn reached(_: impl AsRef<str>) {}

const URL: &str = "gs://bucket/train.manifest.json";

fuzz_target!(|data: &[u8]| {
    let m = match Manifest::parse(data, URL) {
        Ok(m) => m,
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.starts_with(&format!("manifest {URL}: ")), "{msg}");
            let loaded = Loaded::parse(data, URL, &[]).expect_err("the derived parser failed");
            assert_eq!(loaded.to_string(), msg);
            return reached("refused");
        }
    };
    same_as_loaded(&m, data, &[]);
    let text = serde_json::to_vec(&m).expect("a parsed manifest serialises");
    assert_eq!(Manifest::parse(&text, URL).expect("and parses again"), m);

    // Against the shards it names, as the store would report them now.
    let Ok(shards) = m
        .shards
        .iter()
        .map(|e| ShardUrl::parse(&e.url, Path::new("/")))
        .collect::<Result<Vec<_>, _>>()
    else {
        return reached("parsed, names no shard");
    };
    if shards
        .iter()
        .zip(&m.shards)
        .any(|(s, e)| s.as_str() != e.url)
    {
        // normalised (a relative path): not the manifest's own spelling
        return reached("parsed, names relative paths");
    }
    same_as_loaded(&m, data, &shards);
    let unique = m
        .shards
        .iter()
        .map(|e| &e.url)
        .collect::<HashSet<_>>()
        .len()
        == m.shards.len();
    match m.counts(URL, &shards) {
        Ok(counts) => {
            assert!(unique);
            assert_eq!(
                counts,
                m.shards.iter().map(|e| e.samples).collect::<Vec<_>>()
            );
            let current: Vec<_> = m.shards.iter().map(|e| e.version.clone()).collect();
            m.unchanged(URL, &shards, &current)
                .expect("the versions it lists are unchanged");
        }
        Err(e) => assert!(!unique && e.to_string().contains("twice"), "{e}"),
    }
    reached(if unique {
        "checked"
    } else {
        "checked, a shard twice"
    });
});

/// `Loaded::parse` of `data` for the configured `shards` reads what `m` holds.
fn same_as_loaded(m: &Manifest, data: &[u8], shards: &[ShardUrl]) {
    let l = Loaded::parse(data, URL, shards).expect("the derived parser took it");
    assert_eq!(l.len(), m.shards.len());
    assert_eq!(
        (l.total_samples, l.total_bytes),
        (m.total_samples, m.total_bytes)
    );
    for (i, e) in m.shards.iter().enumerate() {
        assert_eq!(l.version(i), e.version);
        assert_eq!((l.samples(i), l.crc32c(i)), (e.samples, e.crc32c));
    }
    let err = |e: shardd::shard::manifest::ManifestError| e.to_string();
    assert_eq!(
        l.positions(URL, shards).map_err(err),
        m.positions(URL, shards).map_err(err)
    );
}
