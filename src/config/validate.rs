//! Layer 1 → layer 2: a [`FileConfig`] checked once, at start, into the runtime [`Config`];
//! every refusal names the key and what is wrong.

use std::collections::BTreeMap;
use std::path::Path;

use crate::blocks;

use super::*;

impl FileConfig {
    pub fn validate(self, base_dir: &Path) -> Result<Config, ConfigError> {
        let s = self.server;
        let socket_mode = u32::from_str_radix(s.socket_mode.trim_start_matches("0o"), 8)
            .ok()
            .filter(|m| *m <= 0o777)
            .ok_or_else(|| {
                invalid(format!(
                    "server.socket_mode {:?} is not an octal file mode like \"0660\"",
                    s.socket_mode
                ))
            })?;
        let metrics_addr = if s.metrics_addr.is_empty() {
            None
        } else {
            Some(s.metrics_addr.parse().map_err(|_| {
                invalid(format!(
                    "server.metrics_addr {:?} is not an address like \"127.0.0.1:9464\"",
                    s.metrics_addr
                ))
            })?)
        };
        if s.max_connections == 0 {
            return Err(invalid("server.max_connections must be at least 1"));
        }
        let handshake_timeout = parse_timeout(&s.handshake_timeout, "server.handshake_timeout")?;
        let stall_timeout = parse_timeout(&s.stall_timeout, "server.stall_timeout")?;

        let (host, host_auto) = validate_host(&self.host)?;

        let (cache_max_bytes, cache_max_share) =
            crate::config::space::cache_budget(&self.cache.max_size, &self.cache.dir)?;
        if !(0.0..=1.0).contains(&s.zero_copy_share) {
            return Err(invalid(format!(
                "server.zero_copy_share {} is not a share of cache.max_size between 0 and 1",
                s.zero_copy_share
            )));
        }
        let zero_copy_bytes = (cache_max_bytes as f64 * s.zero_copy_share) as u64;
        if self.cache.prefetch_shards == 0 {
            return Err(invalid("cache.prefetch_shards must be at least 1"));
        }
        if self.store.max_downloads == 0 {
            return Err(invalid("store.max_downloads must be at least 1"));
        }
        let revalidate = parse_duration(&self.cache.revalidate, "cache.revalidate")?;
        let space_timeout = parse_timeout(&self.cache.space_timeout, "cache.space_timeout")?;
        let index_memory = parse_size(&self.cache.index_memory, "cache.index_memory")?;
        let cache_block_size = parse_size(&self.cache.block_size, "cache.block_size")?;
        let (min, max) = (blocks::MIN_BLOCK as u64, blocks::DEFAULT_BLOCK as u64);
        if !cache_block_size.is_power_of_two() || !(min..=max).contains(&cache_block_size) {
            return Err(invalid(format!(
                "cache.block_size must be a power of two from 64KiB to 2MiB, not {:?}",
                self.cache.block_size
            )));
        }
        let part_size = parse_size(&self.store.part_size, "store.part_size")?;
        if part_size < 1 << 20 {
            return Err(invalid("store.part_size must be at least 1MiB"));
        }
        if self.store.parts_in_flight == 0 {
            return Err(invalid("store.parts_in_flight must be at least 1"));
        }
        let connect_timeout = parse_timeout(&self.store.connect_timeout, "store.connect_timeout")?;
        let read_timeout = parse_timeout(&self.store.read_timeout, "store.read_timeout")?;
        let mut retry_timeout = parse_timeout(&self.store.retry_timeout, "store.retry_timeout")?;
        if self.store.retries == 0 {
            retry_timeout = std::time::Duration::ZERO;
        }
        let ceiling = self.store.max_requests_per_second;
        if !ceiling.is_finite() || ceiling < 0.0 {
            return Err(invalid(format!(
                "store.max_requests_per_second must be a number of requests per second, 0 for no ceiling, not {ceiling}"
            )));
        }
        let credentials_timeout =
            parse_timeout(&self.store.credentials_timeout, "store.credentials_timeout")?;
        let verify = validate_verify(&self.store.verify)?;

        let mut gcs = self.gcs;
        if let Some(g) = &mut gcs {
            check_endpoint(g.endpoint.as_deref(), g.allow_http, "gcs")?;
            if g.anonymous && g.credentials.is_some() {
                return Err(invalid(
                    "gcs.credentials and gcs.anonymous = true contradict each other: choose one",
                ));
            }
            g.credentials = g.credentials.as_ref().map(|p| base_dir.join(p));
        }
        if let Some(s) = &self.s3 {
            check_endpoint(s.endpoint.as_deref(), s.allow_http, "s3")?;
        }
        let (datasets, mixes) = validate_datasets(self.datasets, base_dir)?;

        Ok(Config {
            socket: base_dir.join(&s.socket),
            socket_mode,
            socket_group: s.socket_group,
            metrics_addr,
            max_connections: s.max_connections,
            handshake_timeout,
            stall_timeout,
            zero_copy_maps: s.zero_copy_maps,
            zero_copy_bytes,
            zero_copy_share: s.zero_copy_share,
            host,
            host_auto,
            deferred_warm: Vec::new(),
            cache_dir: base_dir.join(&self.cache.dir),
            cache_max_bytes,
            cache_max_share,
            prefetch_shards: self.cache.prefetch_shards,
            revalidate,
            space_timeout,
            index_memory,
            cache_block_size: cache_block_size as usize,
            max_downloads: self.store.max_downloads,
            connect_timeout,
            read_timeout,
            retry_timeout,
            max_requests_per_second: (ceiling > 0.0).then_some(ceiling),
            credentials_timeout,
            part_size,
            parts_in_flight: self.store.parts_in_flight,
            verify,
            gcs,
            s3: self.s3,
            datasets,
            mixes,
        })
    }
}

/// `[host]`: numbers, or `"auto"` (found at start, `host::resolve`), or for the index
/// `"from-clients"` (learned from the streams).
fn validate_host(h: &HostSection) -> Result<(Topology, HostAuto), ConfigError> {
    let auto = |value: &HostValue, key: &str| match value {
        HostValue::Number(n) => Ok(Some(*n)),
        HostValue::Word(w) if w == "auto" => Ok(None),
        HostValue::Word(w) if w == crate::config::host::FROM_CLIENTS && key == "host.index" => {
            Ok(Some(0))
        }
        HostValue::Word(w) if key == "host.index" => Err(invalid(format!(
            "{key} {w:?} is neither a number, \"auto\" nor \"from-clients\""
        ))),
        HostValue::Word(w) => Err(invalid(format!(
            "{key} {w:?} is neither a number nor \"auto\""
        ))),
    };
    let from_clients =
        matches!(&h.index, HostValue::Word(w) if w == crate::config::host::FROM_CLIENTS);
    let (index, count) = (auto(&h.index, "host.index")?, auto(&h.count, "host.count")?);
    let host_auto = HostAuto {
        index: index.is_none(),
        count: count.is_none(),
        from_clients,
    };
    let host = Topology {
        index: index.unwrap_or(0),
        count: count.unwrap_or(1),
    };
    if !host_auto.count {
        host.check().map_err(invalid)?;
    }
    Ok((host, host_auto))
}

/// `store.verify`.
fn validate_verify(text: &str) -> Result<Verify, ConfigError> {
    Ok(match text {
        "auto" => Verify::Auto,
        "size" => Verify::Size,
        "checksum" => Verify::Checksum,
        other => {
            return Err(invalid(format!(
                "store.verify {other:?} is none of \"auto\", \"size\", \"checksum\""
            )));
        }
    })
}

/// The datasets and the mixes of them, by name.
type Datasets = (BTreeMap<String, Dataset>, BTreeMap<String, MixDataset>);

/// The `[datasets.NAME]` sections: datasets first, then the mixes of them.
fn validate_datasets(
    sections: BTreeMap<String, DatasetSection>,
    base_dir: &Path,
) -> Result<Datasets, ConfigError> {
    if sections.is_empty() {
        return Err(invalid("no [datasets.NAME] section: nothing to serve"));
    }
    let mut datasets = BTreeMap::new();
    let mut mix_sections = Vec::new();
    for (name, d) in sections {
        // A mix may give its first weights in its schedule alone (`at = 0`).
        if d.mix.is_some() || (d.shards.is_none() && !d.schedule.is_empty()) {
            mix_sections.push((name, d));
            continue;
        }
        let dataset = validate_dataset(&name, d, base_dir)?;
        datasets.insert(name, dataset);
    }
    let mut mixes = BTreeMap::new();
    for (name, d) in mix_sections {
        let mix = validate_mix(&name, d, &datasets)?;
        mixes.insert(name, mix);
    }
    Ok((datasets, mixes))
}

/// A mix names at least two datasets of this config that have manifests (its streams are
/// exact in samples), with weights ≥ 1, and its `samples_per_epoch`; nothing of its own else.
fn validate_mix(
    name: &str,
    d: DatasetSection,
    datasets: &BTreeMap<String, Dataset>,
) -> Result<MixDataset, ConfigError> {
    if d.shards.is_some() || d.manifest.is_some() || d.resampled || d.warm {
        // (and `schedule` belongs to mixes only: checked in validate_dataset)
        return Err(invalid(format!(
            "dataset {name:?}: a mix has no shards, manifest, resampled or warm of its own: set them on its sources"
        )));
    }
    let (mix, entries) = first_weights(name, d.mix, d.schedule)?;
    if mix.len() < 2 {
        return Err(invalid(format!(
            "dataset {name:?}: mix needs at least two sources, e.g. mix = {{ web = 3, books = 1 }}"
        )));
    }
    let Some(samples_per_epoch) = d.samples_per_epoch.filter(|&n| n > 0) else {
        return Err(invalid(format!(
            "dataset {name:?}: a mix needs samples_per_epoch (at least 1): the samples every stream gets per epoch"
        )));
    };
    for (source, &weight) in &mix {
        let Some(s) = datasets.get(source) else {
            let known: Vec<&str> = datasets.keys().map(String::as_str).collect();
            return Err(invalid(format!(
                "dataset {name:?}: mix source {source:?} is not a dataset of this config (they are: {}); a mix cannot contain a mix",
                known.join(", ")
            )));
        };
        if s.manifest.is_none() {
            return Err(invalid(format!(
                "dataset {name:?}: mix source {source:?} needs a manifest (shardd index): a mix reads its sources in samples"
            )));
        }
        if weight == 0 {
            return Err(invalid(format!(
                "dataset {name:?}: mix weight of {source:?} must be at least 1"
            )));
        }
    }
    let sources: Vec<(String, u64)> = mix.into_iter().collect();
    let weights: Vec<u64> = sources.iter().map(|s| s.1).collect();
    weights_fit(&weights).map_err(|e| invalid(format!("dataset {name:?}: mix: {e}")))?;
    let schedule = validate_schedule(name, &sources, entries)?;
    Ok(MixDataset {
        name: name.to_string(),
        sources,
        samples_per_epoch,
        schedule,
    })
}

/// The most entries a mix's schedule may have: a stream's plan holds the segments of its epoch
/// and finds where each source starts in O(entries · log entries).
const MAX_SCHEDULE: usize = 10_000;

/// A mix's weights from its start: `mix`, or its schedule's `at = 0` entry (taken out of the
/// schedule), not both.
fn first_weights(
    name: &str,
    mix: Option<BTreeMap<String, u64>>,
    mut schedule: Vec<ScheduleEntry>,
) -> Result<(BTreeMap<String, u64>, Vec<ScheduleEntry>), ConfigError> {
    let at_zero = schedule
        .first()
        .is_some_and(|e| e.at == Some(0) && e.epoch.is_none());
    match (mix, at_zero) {
        (Some(mix), false) => Ok((mix, schedule)),
        (None, true) => Ok((schedule.remove(0).mix, schedule)),
        (Some(_), true) => Err(invalid(format!(
            "dataset {name:?}: the weights from the start are given twice, by mix and by the schedule's at = 0 entry: keep one"
        ))),
        (None, false) => Err(invalid(format!(
            "dataset {name:?}: a schedule needs the weights from the start: mix = {{ ... }}, or a first entry at = 0"
        ))),
    }
}

/// The schedule's entries: each starts at an epoch (≥ 1) or at a job-wide sample (≥ 1), all
/// of one kind (which of two kinds comes first depends on the job's size), increasing, and
/// weighs every source of the mix.
fn validate_schedule(
    name: &str,
    sources: &[(String, u64)],
    entries: Vec<ScheduleEntry>,
) -> Result<Vec<(ScheduleFrom, Vec<u64>)>, ConfigError> {
    if entries.len() > MAX_SCHEDULE {
        return Err(invalid(format!(
            "dataset {name:?}: a schedule has at most {MAX_SCHEDULE} entries, this one {}",
            entries.len()
        )));
    }
    let mut schedule: Vec<(ScheduleFrom, Vec<u64>)> = Vec::new();
    for entry in entries {
        let from = match (entry.epoch, entry.at) {
            (Some(epoch), None) => ScheduleFrom::Epoch(epoch),
            (None, Some(at)) => ScheduleFrom::Sample(at),
            _ => {
                return Err(invalid(format!(
                    "dataset {name:?}: a schedule entry starts at an epoch or at a job-wide sample: epoch = N or at = N, one of them"
                )));
            }
        };
        match (schedule.last().map(|(f, _)| *f), from) {
            (None, ScheduleFrom::Epoch(0)) | (None, ScheduleFrom::Sample(0)) => {
                return Err(invalid(format!(
                    "dataset {name:?}: schedule entries start after the mix's first weights: {from} must be at least 1{}",
                    if matches!(from, ScheduleFrom::Sample(_)) {
                        " (at = 0 may come first, in place of mix = { ... })"
                    } else {
                        ""
                    }
                )));
            }
            (Some(ScheduleFrom::Epoch(a)), ScheduleFrom::Epoch(b))
            | (Some(ScheduleFrom::Sample(a)), ScheduleFrom::Sample(b))
                if b <= a =>
            {
                return Err(invalid(format!(
                    "dataset {name:?}: schedule entries must increase ({from} after {})",
                    schedule.last().unwrap().0
                )));
            }
            (Some(ScheduleFrom::Epoch(_)), ScheduleFrom::Sample(_))
            | (Some(ScheduleFrom::Sample(_)), ScheduleFrom::Epoch(_)) => {
                return Err(invalid(format!(
                    "dataset {name:?}: a schedule is keyed by epochs or by samples, not both ({from} after {}): which comes first would depend on the job's size",
                    schedule.last().unwrap().0
                )));
            }
            _ => {}
        }
        let names: Vec<&String> = entry.mix.keys().collect();
        if names != sources.iter().map(|s| &s.0).collect::<Vec<_>>() {
            return Err(invalid(format!(
                "dataset {name:?}: schedule entry {from} must weigh the mix's sources, all of them: {}",
                sources
                    .iter()
                    .map(|s| s.0.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        let w: Vec<u64> = entry.mix.into_values().collect();
        if w.contains(&0) {
            return Err(invalid(format!(
                "dataset {name:?}: schedule weights must be at least 1 ({from})"
            )));
        }
        weights_fit(&w)
            .map_err(|e| invalid(format!("dataset {name:?}: schedule entry {from}: {e}")))?;
        schedule.push((from, w));
    }
    Ok(schedule)
}

/// Why a pattern can never name a shard, as users mistype them: a glob (no store lists, so
/// nothing expands it), a directory, or nothing at all.
fn never_a_shard(pattern: &str) -> Option<&'static str> {
    if pattern.trim().is_empty() {
        Some("is empty")
    } else if pattern.contains(['*', '?']) {
        Some("is a glob, which shardd does not expand (it lists no directory or bucket)")
    } else if pattern.ends_with('/') {
        Some("is a directory, not a shard")
    } else {
        None
    }
}

fn validate_dataset(
    name: &str,
    d: DatasetSection,
    base_dir: &Path,
) -> Result<Dataset, ConfigError> {
    if !d.schedule.is_empty() {
        return Err(invalid(format!(
            "dataset {name:?}: schedule is a mix's curriculum: this dataset has no mix"
        )));
    }
    let Some(shards) = d.shards else {
        return Err(invalid(format!(
            "dataset {name:?}: missing field `shards` (or `mix`, for a mix of other datasets)"
        )));
    };
    let patterns = match shards {
        Patterns::One(p) => vec![p],
        Patterns::Many(ps) => ps,
    };
    if patterns.is_empty() {
        return Err(invalid(format!(
            "dataset {name:?}: shards is an empty list"
        )));
    }
    if d.shuffle_buffer == 0 {
        return Err(invalid(format!(
            "dataset {name:?}: shuffle_buffer must be at least 1 (1 means no sample shuffle)"
        )));
    }
    let mut shards = Vec::new();
    for pattern in &patterns {
        if let Some(why) = never_a_shard(pattern) {
            return Err(invalid(format!(
                "dataset {name:?}: shards {pattern:?} {why}; name the shards with braces, e.g. \"data/train-{{000000..000099}}.tar\" (shardd index writes the manifest for them)"
            )));
        }
        let expanded = braces::expand(pattern)
            .map_err(|e| invalid(format!("dataset {name:?}: pattern {pattern:?}: {e}")))?;
        for url in expanded {
            let shard = ShardUrl::parse(&url, base_dir).map_err(|source| ConfigError::Url {
                dataset: name.to_string(),
                source,
            })?;
            shards.push(shard);
        }
    }
    let manifest = d
        .manifest
        .as_deref()
        .map(|m| ShardUrl::parse(m, base_dir))
        .transpose()
        .map_err(|source| ConfigError::Url {
            dataset: name.to_string(),
            source,
        })?;
    match d.samples_per_epoch {
        Some(0) => {
            return Err(invalid(format!(
                "dataset {name:?}: samples_per_epoch must be at least 1"
            )));
        }
        Some(_) if manifest.is_none() => {
            return Err(invalid(format!(
                "dataset {name:?}: samples_per_epoch needs a manifest (shardd index) to count samples"
            )));
        }
        None if d.resampled => {
            return Err(invalid(format!(
                "dataset {name:?}: resampled = true needs samples_per_epoch (and a manifest): a resampled stream has no end of its own"
            )));
        }
        _ => {}
    }
    let mut seen = rustc_hash::FxHashSet::default();
    seen.reserve(shards.len());
    if let Some(dup) = shards.iter().find(|s| !seen.insert(s.as_str())) {
        return Err(invalid(format!(
            "dataset {name:?}: shard {} is listed twice; every sample must appear once per epoch",
            dup.as_str()
        )));
    }
    Ok(Dataset {
        name: name.to_string(),
        shuffle_buffer: d.shuffle_buffer,
        share_seed: d.share_seed,
        warm: d.warm,
        identity: identity(&shards, None),
        share: Default::default(),
        manifest,
        samples_per_epoch: d.samples_per_epoch,
        resampled: d.resampled,
        counts: None,
        shards: shards.into(),
    })
}

/// Credentials must not travel in clear text by mistake: a plain-http endpoint is accepted
/// only on loopback (an emulator) or when the config says `allow_http = true`.
fn check_endpoint(
    endpoint: Option<&str>,
    allow_http: bool,
    section: &str,
) -> Result<(), ConfigError> {
    let Some(endpoint) = endpoint else {
        return Ok(());
    };
    let url = ::url::Url::parse(endpoint)
        .map_err(|e| invalid(format!("{section}.endpoint {endpoint:?} is not a URL: {e}")))?;
    let loopback = match url.host() {
        Some(::url::Host::Domain(d)) => d == "localhost",
        Some(::url::Host::Ipv4(ip)) => ip.is_loopback(),
        Some(::url::Host::Ipv6(ip)) => ip.is_loopback(),
        None => false,
    };
    if url.scheme() == "http" && !loopback && !allow_http {
        return Err(invalid(format!(
            "{section}.endpoint {endpoint:?} is plain http: credentials would travel in clear text; use https, a loopback address, or set {section}.allow_http = true"
        )));
    }
    Ok(())
}

pub(super) fn identity(shards: &[ShardUrl], counts: Option<&[u64]>) -> [u8; 16] {
    use md5::Digest;
    let mut h = md5::Md5::new();
    for shard in shards {
        h.update(shard.as_str().as_bytes());
        h.update([0]);
    }
    for n in counts.into_iter().flatten() {
        h.update(n.to_le_bytes());
    }
    h.finalize().into()
}

/// What `plan::mix` needs of a mix's weights beyond the checks above (two or more sources,
/// none 0): a sum that fits in a u64. The same message as its `MixError`.
fn weights_fit(weights: &[u64]) -> Result<(), &'static str> {
    weights
        .iter()
        .try_fold(0u64, |sum, &w| sum.checked_add(w))
        .map(|_| ())
        .ok_or("the source weights add up to more than 2^64 - 1")
}
