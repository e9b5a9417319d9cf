//! The manifest parser (`Manifest::parse`) on arbitrary bytes: a manifest may come from any
//! object URL. Properties: no panic (totals that overflow are an error, not an overflow),
//! every error names the manifest, a manifest that parses serialises back to itself, and
//! checked against exactly the shards it lists it gives its sample counts (or says a shard is
//! listed twice) and finds the versions it lists unchanged.
#![cfg_attr(not(test), no_main)]

use std::collections::HashSet;
use std::path::Path;

#[cfg(not(test))] // tests/fuzz_seeds.rs has its own
use libfuzzer_sys::fuzz_target;
use shardd::config::url::ShardUrl;
use shardd::shard::manifest::Manifest;

const URL: &str = "gs://bucket/train.manifest.json";

fuzz_target!(|data: &[u8]| {
    let m = match Manifest::parse(data, URL) {
        Ok(m) => m,
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.starts_with(&format!("manifest {URL}: ")), "{msg}");
            return;
        }
    };
    let text = serde_json::to_vec(&m).expect("a parsed manifest serialises");
    assert_eq!(Manifest::parse(&text, URL).expect("and parses again"), m);

    // Against the shards it names, as the store would report them now.
    let Ok(shards) = m
        .shards
        .iter()
        .map(|e| ShardUrl::parse(&e.url, Path::new("/")))
        .collect::<Result<Vec<_>, _>>()
    else {
        return;
    };
    if shards
        .iter()
        .zip(&m.shards)
        .any(|(s, e)| s.as_str() != e.url)
    {
        return; // normalised (a relative path): not the manifest's own spelling
    }
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
});
