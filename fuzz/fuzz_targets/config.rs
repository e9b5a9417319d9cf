//! The config parser and validator on arbitrary text. Properties: no panic (absurd sizes and
//! durations are errors, not overflows), every error names what is wrong (never an empty
//! message), and a config that validates holds every invariant the daemon relies on.
#![cfg_attr(not(test), no_main)]

use std::collections::HashSet;
use std::path::Path;
use std::time::Duration;

#[cfg(test)] // tests/fuzz_seeds.rs checks what each seed reached
use crate::reached;
#[cfg(not(test))] // tests/fuzz_seeds.rs has its own
use libfuzzer_sys::fuzz_target;
use shardd::config::braces;
use shardd::config::{Config, FileConfig, Patterns};

/// What a seed reached: recorded by tests/fuzz_seeds.rs, nothing in the fuzz build.
#[cfg(not(test))]
fn reached(_: impl AsRef<str>) {}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return reached("not UTF-8");
    };
    // Right but too slow to check at fuzzing speed: hundreds of thousands of shards.
    if let Ok(file) = toml::from_str::<FileConfig>(text) {
        let shards: u64 = file
            .datasets
            .values()
            .flat_map(|d| match &d.shards {
                Some(Patterns::One(p)) => vec![p.clone()],
                Some(Patterns::Many(ps)) => ps.clone(),
                None => Vec::new(), // a mix
            })
            .map(|p| braces::count(&p).unwrap_or(0))
            .sum();
        if shards > 20_000 {
            return reached("too many shards to check");
        }
    }
    let c = match Config::parse(text, Path::new("/etc/shardd")) {
        Ok(c) => c,
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.starts_with("invalid config"), "{msg}");
            return reached("refused");
        }
    };
    assert!(c.socket_mode <= 0o777);
    assert!(c.max_connections >= 1);
    for timeout in [
        c.handshake_timeout,
        c.stall_timeout,
        c.space_timeout,
        c.connect_timeout,
        c.read_timeout,
    ] {
        assert!(timeout > Duration::ZERO);
    }
    assert!(c.host.count >= 1 && c.host.index < c.host.count);
    assert!(c.prefetch_shards >= 1 && c.max_downloads >= 1 && c.parts_in_flight >= 1);
    assert!(c.part_size >= 1 << 20);
    assert!(!c.datasets.is_empty());
    for (name, d) in &c.datasets {
        assert_eq!(&d.name, name);
        assert!(!d.shards.is_empty());
        assert!(d.shuffle_buffer >= 1);
        let mut seen = HashSet::new();
        assert!(
            d.shards.iter().all(|s| seen.insert(s.as_str())),
            "duplicate shard"
        );
    }
    reached("valid");
});
