//! The per-host working sets a report adds, and its warnings when the budget does not hold
//! them (`shardd check` and `shardd plan`).

use super::*;

/// The inputs of the per-host working sets ([`size`]).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Sizing {
    pub streams_per_host: u64,
    pub shuffle_buffer: u64,
    pub zero_copy_maps: u64,
    pub zero_copy_share: f64,
    /// cache.max_size in bytes, when the config gives a size (not a share of the free space,
    /// which is each host's own).
    pub cache_max_bytes: Option<u64>,
    /// cache.max_size's share of the free space (`"auto"`, `"N%"`).
    pub cache_max_share: Option<f64>,
}

/// Each host's share (for cached epochs) and the working set of its streams, from the
/// manifest's sizes and counts (nothing without them).
pub fn size(r: &mut Report, shape: Shape, sizes: Option<&[u64]>, sizing: Sizing) {
    if let (Some(sizes), Some(counts)) = (sizes, shape.counts) {
        let per_host = on_threads(r.per_host.len(), threads(), |h| {
            let topo = Topology {
                index: h as u32,
                count: r.hosts,
            };
            let share = plan::warm_shards(shape, topo);
            let bytes: u64 = share.iter().map(|&i| sizes[i]).sum();
            let samples: u64 = share.iter().map(|&i| counts[i]).sum();
            let ws = crate::config::space::working_set(
                sizing.streams_per_host,
                sizing.shuffle_buffer,
                share.len() as u64,
                samples,
                bytes,
                sizing.zero_copy_maps,
                sizing.zero_copy_share,
            );
            (bytes, ws)
        });
        for (host, (bytes, ws)) in r.per_host.iter_mut().zip(per_host) {
            host.share_bytes = Some(bytes);
            host.working_set = Some(ws);
        }
    }
    r.sizing = Some(sizing);
}

/// A budget (a size in the config) below a host's working set, or that holds no host's share.
pub fn budget_warnings(r: &Report) -> Vec<String> {
    let mut out = Vec::new();
    let Some(max) = r.sizing.as_ref().and_then(|s| s.cache_max_bytes) else {
        return out;
    };
    let short: Vec<&HostReport> = r
        .per_host
        .iter()
        .filter(|h| h.working_set.is_some_and(|w| max < w.min_budget))
        .collect();
    let need = |h: &HostReport| h.working_set.map_or(0, |w| w.min_budget);
    // The first host that needs the most.
    let worst = short
        .iter()
        .fold(None, |best: Option<&&HostReport>, h| match best {
            Some(b) if need(b) >= need(h) => Some(b),
            _ => Some(h),
        });
    if let Some(worst) = worst {
        let w = worst.working_set.expect("filtered");
        out.push(format!(
            "cache.max_size ({max} bytes) is below the working set of {} of {} hosts (host {} needs {} bytes: {} streams × {} shards of {} bytes, with zero copy's maps): streams wait for space and fail with cache_full",
            short.len(),
            r.per_host.len(),
            worst.host,
            w.min_budget,
            w.streams,
            w.stream_shards,
            w.shard_bytes
        ));
    }
    out
}

/// `shardd check`: one stream's working set of dataset `d` (from its manifest) and how many
/// streams' cache.max_size holds at once: lines to print, and a warning when not even one.
pub async fn check_working_set(
    config: &Config,
    stores: &Stores,
    d: &crate::config::Dataset,
) -> anyhow::Result<(Vec<String>, Vec<String>)> {
    let name = &d.name;
    // Without a manifest there are no samples per shard to size a shuffle window in shards.
    let Some(source) = &d.manifest else {
        return Ok((vec![], vec![]));
    };
    // In serve's words (`check` is `serve` without serving).
    let (manifest, at) = crate::shard::manifest::load(stores, source, &d.shards)
        .await
        .map_err(|source| crate::serve::daemon::StartError::Manifest {
            dataset: name.clone(),
            source,
        })?;
    let bytes: u64 = at.iter().map(|&i| manifest.size(i)).sum();
    let samples: u64 = at.iter().map(|&i| manifest.samples(i)).sum();
    let (line, warning) = crate::config::space::streams_line(config, d, samples, bytes);
    Ok((vec![line], warning.into_iter().collect()))
}
