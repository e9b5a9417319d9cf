//! Sizing, found at start too: `cache.max_size = "auto"` (or `"N%"`), a share of the cache
//! file system's free space ([`cache_budget`]), the warnings when a budget does not fit the
//! disk ([`space_warnings`]), and the working set a job needs ([`working_set`]).

use std::path::{Path, PathBuf};

use crate::config::{Config, ConfigError};

/// `cache.max_size = "auto"`: this share of the free space.
pub const AUTO_SHARE: f64 = 0.8;

/// The file system a cache directory is on (the directory, or its nearest existing parent).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Space {
    /// The directory measured.
    pub measured: PathBuf,
    /// The file system's size, and what an unprivileged writer may still use of it.
    pub size: u64,
    pub free: u64,
    /// Disk space the files under the cache directory take now (a restarted daemon's
    /// entries: free for the cache, which replaces them).
    pub cached: u64,
}

impl Space {
    /// What the cache may take: the free space plus what it holds already.
    pub fn available(&self) -> u64 {
        self.free.saturating_add(self.cached)
    }
}

/// Measures the file system of `dir` (statvfs of it or its nearest existing parent) and
/// what the files under `dir` take.
pub fn space(dir: &Path) -> std::io::Result<Space> {
    let mut last = None;
    for at in dir.ancestors() {
        let at = if at.as_os_str().is_empty() {
            Path::new(".")
        } else {
            at
        };
        match rustix::fs::statvfs(at) {
            Ok(v) => {
                return Ok(Space {
                    measured: at.to_path_buf(),
                    size: v.f_blocks.saturating_mul(v.f_frsize),
                    free: v.f_bavail.saturating_mul(v.f_frsize),
                    cached: if at == dir { disk_usage(dir) } else { 0 },
                });
            }
            Err(e) => last = Some(e),
        }
    }
    Err(last.map_or_else(
        || std::io::Error::other("no directory to measure"),
        std::io::Error::from,
    ))
}

/// Bytes of disk the regular files under `dir` take (st_blocks), not following links.
fn disk_usage(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0u64;
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(d) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for entry in entries.flatten() {
            let Ok(m) = entry.metadata() else { continue };
            if m.is_dir() {
                dirs.push(entry.path());
            } else if m.is_file() {
                total = total.saturating_add(m.blocks().saturating_mul(512));
            }
        }
    }
    total
}

/// `cache.max_size`: a size (`"300GiB"`), or `"auto"` (80%) / `"N%"`: that share of what the
/// cache may take of its file system when the config is read (the free space plus what the
/// cache directory holds already, so a restart with a full cache keeps its budget). Returns
/// the bytes and the share.
pub fn cache_budget(spec: &str, dir: &Path) -> Result<(u64, Option<f64>), ConfigError> {
    let text = spec.trim();
    let share = if text.eq_ignore_ascii_case("auto") {
        AUTO_SHARE
    } else if let Some(percent) = text.strip_suffix('%') {
        match percent.trim().parse::<f64>() {
            Ok(p) if p > 0.0 && p <= 100.0 => p / 100.0,
            _ => {
                return Err(ConfigError::Invalid(format!(
                    "cache.max_size {spec:?} is not a share of the free space between 0% and 100% like \"50%\""
                )));
            }
        }
    } else {
        return crate::config::parse_size(text, "cache.max_size").map(|b| (b, None));
    };
    let space = space(dir).map_err(|e| {
        ConfigError::Invalid(format!(
            "cache.max_size {spec:?}: cannot measure the file system of cache.dir {}: {e}",
            dir.display()
        ))
    })?;
    Ok(((space.available() as f64 * share) as u64, Some(share)))
}

/// What `check` and `serve` say about `cache.max_size` against its file system: a budget
/// larger than the file system, or than its free space (plus what the cache holds).
pub fn space_warnings(config: &Config) -> Vec<String> {
    let max = config.cache_max_bytes;
    let space = match space(&config.cache_dir) {
        Ok(s) => s,
        Err(e) => {
            return vec![format!(
                "cannot measure the file system of cache.dir {}: {e}",
                config.cache_dir.display()
            )];
        }
    };
    let on = if space.measured == config.cache_dir {
        format!("{}", space.measured.display())
    } else {
        format!(
            "{} (its nearest existing parent {})",
            config.cache_dir.display(),
            space.measured.display()
        )
    };
    let auto = (AUTO_SHARE * space.available() as f64) as u64;
    let mut out = Vec::new();
    if max > space.size {
        out.push(format!(
            "cache.max_size ({max} bytes) is more than the whole file system of cache.dir {on} holds ({} bytes): the disk fills before the cache does; set max_size = \"auto\" ({AUTO_SHARE} of the free space: {auto} bytes now) or a size below {} bytes",
            space.size,
            space.available()
        ));
    } else if max > space.available() {
        out.push(format!(
            "cache.max_size ({max} bytes) is more than the free space of cache.dir {on}: {} bytes free{}; the disk fills before the cache does; set max_size = \"auto\" ({AUTO_SHARE} of the free space: {auto} bytes now) or a size below {} bytes",
            space.free,
            if space.cached > 0 {
                format!(" and {} held by the cache", space.cached)
            } else {
                String::new()
            },
            space.available()
        ));
    }
    out
}

/// The cache budget in one line, for the daemon's log at start.
pub fn budget_line(config: &Config) -> String {
    let max = config.cache_max_bytes;
    match (config.cache_max_share, space(&config.cache_dir)) {
        (Some(share), Ok(s)) => format!(
            "cache.max_size: {max} bytes ({}% of the {} bytes free on the file system of {} plus the {} bytes the cache holds)",
            share * 100.0,
            s.free,
            s.measured.display(),
            s.cached
        ),
        _ => format!("cache.max_size: {max} bytes"),
    }
}

/// The cache a host needs for `streams` streams of one dataset at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct WorkingSet {
    pub streams: u64,
    /// Shards one shuffle window spans: ⌈shuffle_buffer / samples per shard⌉.
    pub window_shards: u64,
    /// Shards one stream holds: its window's, the one it parses next and one loading (at
    /// most the share's).
    pub stream_shards: u64,
    /// The mean shard size (rounded up).
    pub shard_bytes: u64,
    /// streams × stream_shards × shard_bytes, at most the whole share.
    pub bytes: u64,
    /// The budget under which zero copy's maps (server.zero_copy_maps shards per stream, at
    /// most server.zero_copy_share of the budget) still leave room for `bytes`; at most the
    /// whole share.
    pub min_budget: u64,
}

/// The working set of `streams` streams over a share of `shards` shards holding `samples`
/// samples in `bytes` bytes (for a host: its share; `bytes` caps the result: a budget that
/// holds the share holds every window).
pub fn working_set(
    streams: u64,
    shuffle_buffer: u64,
    shards: u64,
    samples: u64,
    bytes: u64,
    zero_copy_maps: u64,
    zero_copy_share: f64,
) -> WorkingSet {
    let shard_bytes = bytes.div_ceil(shards.max(1));
    // Never more than the share: a window larger than the dataset spans all of it.
    let all = shards.max(1);
    let window_shards = if samples == 0 {
        1
    } else {
        // ⌈shuffle_buffer / (samples / shards)⌉, in integers.
        ((shuffle_buffer as u128 * shards as u128).div_ceil(samples as u128) as u64).clamp(1, all)
    };
    let stream_shards = (window_shards + 2).min(all);
    let held = streams
        .saturating_mul(stream_shards)
        .saturating_mul(shard_bytes)
        .min(bytes);
    let maps = streams
        .saturating_mul(zero_copy_maps)
        .saturating_mul(shard_bytes);
    // B - min(maps, share·B) >= held: B = held + maps, or held / (1 - share) if smaller.
    let with_maps = held.saturating_add(maps);
    let capped = if zero_copy_share < 1.0 {
        (held as f64 / (1.0 - zero_copy_share)).ceil() as u64
    } else {
        u64::MAX
    };
    WorkingSet {
        streams,
        window_shards,
        stream_shards,
        shard_bytes,
        bytes: held,
        min_budget: with_maps.min(capped).min(bytes).max(held),
    }
}

/// How many streams' working sets `budget` holds at once (with zero copy's maps).
pub fn streams_that_fit(budget: u64, one: &WorkingSet, zero_copy_maps: u64, share: f64) -> u64 {
    let per_stream = one.stream_shards.saturating_mul(one.shard_bytes).max(1);
    let maps = zero_copy_maps.saturating_mul(one.shard_bytes);
    let a = budget / per_stream.saturating_add(maps);
    let b = ((budget as f64 * (1.0 - share.clamp(0.0, 1.0))) / per_stream as f64) as u64;
    a.max(b)
}

/// The share of the budget zero copy's maps may pin, from a validated config.
pub fn zero_copy_share(config: &Config) -> f64 {
    if config.zero_copy_maps == 0 {
        0.0
    } else {
        config.zero_copy_share
    }
}

/// How many streams of dataset `d` (whose shards hold `samples` samples in `bytes` bytes)
/// the cache budget holds at once: a line for `shardd check`, and a warning when not even one
/// fits (`shardd check` prints it; `shardd serve` logs it at start).
pub fn streams_line(
    config: &Config,
    d: &crate::config::Dataset,
    samples: u64,
    bytes: u64,
) -> (String, Option<String>) {
    let name = &d.name;
    let (maps, share) = (config.zero_copy_maps as u64, zero_copy_share(config));
    let one = working_set(
        1,
        d.shuffle_buffer as u64,
        d.shards.len() as u64,
        samples,
        bytes,
        maps,
        share,
    );
    let max = config.cache_max_bytes;
    let fits = streams_that_fit(max, &one, maps, share);
    let line = format!(
        "dataset {name}: a stream holds {} shards ({} of its shuffle window of {} samples, + 2{}) of {} bytes on average: {} bytes, {} with zero copy's maps; cache.max_size ({max} bytes) holds {fits} streams at once (shardd plan sizes a whole job)",
        one.stream_shards,
        one.window_shards,
        d.shuffle_buffer,
        if one.stream_shards < one.window_shards + 2 {
            format!(", at most the dataset's {}", d.shards.len())
        } else {
            String::new()
        },
        one.shard_bytes,
        one.bytes,
        one.min_budget
    );
    let warning = (fits == 0).then(|| {
        format!(
            "cache.max_size ({max} bytes) is below the working set of one stream of dataset {name} ({} bytes, with zero copy's maps): streams wait for space and fail with cache_full",
            one.min_budget
        )
    });
    (line, warning)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 10 shards of 100 bytes and 10 samples: a window of 25 samples spans 3 shards, a stream
    /// holds 5.
    #[test]
    fn working_sets() {
        let ws = |streams, maps, share| working_set(streams, 25, 10, 100, 1000, maps, share);
        let two = ws(2, 0, 0.0);
        assert_eq!(
            (two.window_shards, two.stream_shards, two.shard_bytes),
            (3, 5, 100)
        );
        assert_eq!((two.bytes, two.min_budget), (1000, 1000));
        let one = ws(1, 0, 0.0);
        assert_eq!((one.bytes, one.min_budget), (500, 500));
        // Maps: 16 a stream (1600 bytes), at most a quarter of the budget: 500 / 0.75.
        assert_eq!(ws(1, 16, 0.25).min_budget, 667);
        // One map a stream is less than that quarter.
        assert_eq!(ws(1, 1, 0.25).min_budget, 600);
        // Every map may pin the whole budget: the maps all count; but never past the share.
        assert_eq!(ws(1, 1, 1.0).min_budget, 600);
        assert_eq!(ws(1, 16, 1.0).min_budget, 1000);
        // An uneven window: 7 samples over shards of 10/3 samples (3 shards, 10 samples) is
        // ⌈7 · 3 / 10⌉ = 3 shards.
        assert_eq!(working_set(1, 7, 3, 10, 300, 0, 0.0).window_shards, 3);
        // No samples known: one shard a window.
        assert_eq!(working_set(1, 7, 3, 0, 300, 0, 0.0).window_shards, 1);
    }

    #[test]
    fn streams_that_fit_the_budget() {
        let one = working_set(1, 25, 10, 100, 1000, 16, 0.25);
        assert_eq!(streams_that_fit(666, &one, 16, 0.25), 0);
        assert_eq!(streams_that_fit(667, &one, 16, 0.25), 1);
        assert_eq!(streams_that_fit(2000, &one, 16, 0.25), 3);
        assert_eq!(streams_that_fit(2000, &one, 0, 0.0), 4);
    }

    #[test]
    fn budgets_are_sizes_or_shares_of_the_free_space() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("entry"), vec![1u8; 1 << 20]).unwrap();
        let s = space(dir.path()).unwrap();
        assert_eq!(s.measured, dir.path());
        assert!(s.cached >= 1 << 20 && s.size >= s.free, "{s:?}");
        // A directory not made yet: its nearest existing parent, holding nothing of the cache.
        let later = space(&dir.path().join("a/b")).unwrap();
        assert_eq!((later.measured.as_path(), later.cached), (dir.path(), 0));
        assert_eq!(
            cache_budget("300GiB", dir.path()).unwrap(),
            (300 << 30, None)
        );
        let (bytes, share) = cache_budget("auto", dir.path()).unwrap();
        assert_eq!(share, Some(0.8));
        let now = space(dir.path()).unwrap().available() as f64;
        assert!(
            (bytes as f64 - 0.8 * now).abs() < 0.01 * now,
            "{bytes} {now}"
        );
        assert_eq!(cache_budget(" 50 %", dir.path()).unwrap().1, Some(0.5));
        for bad in ["0%", "101%", "x%", "-5%"] {
            let err = cache_budget(bad, dir.path()).unwrap_err().to_string();
            assert!(err.contains("between 0% and 100%"), "{bad}: {err}");
        }
    }
}
