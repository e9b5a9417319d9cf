//! The report as text, for a terminal.

use super::*;

/// The report for a terminal: one line per host, then the spread.
pub fn text(r: &Report) -> String {
    use std::fmt::Write;
    let opt = |v: Option<u64>| v.map_or("-".to_string(), |v| v.to_string());
    let mut out = String::new();
    let _ = writeln!(
        out,
        "dataset {}: {} shards, {} samples, {} bytes; {} hosts × {} ranks × {} workers (world_size {}), seed {}, epoch {}",
        r.dataset,
        r.dataset_shards,
        opt(r.dataset_samples),
        opt(r.dataset_bytes),
        r.hosts,
        r.ranks,
        r.workers,
        r.hosts as u64 * r.ranks as u64,
        r.seed,
        r.epoch
    );
    if let Some(n) = r.samples_per_stream {
        let _ = writeln!(out, "every stream: {n} samples");
    }
    if let Some(z) = &r.sizing {
        let budget = match (z.cache_max_bytes, z.cache_max_share) {
            (Some(b), _) => format!("{b} bytes"),
            (None, Some(share)) => format!("{}% of each host's free space", share * 100.0),
            (None, None) => "-".into(),
        };
        let _ = writeln!(
            out,
            "cache per host: MIN BUDGET = {} streams × (⌈shuffle_buffer {} / samples per shard⌉ + 2) shards × the mean shard size, plus zero copy's maps ({} shards a stream, at most {} of the budget); SHARE = every shard the host reads in any epoch (cached epochs); cache.max_size: {budget}",
            z.streams_per_host, z.shuffle_buffer, z.zero_copy_maps, z.zero_copy_share
        );
    }
    let _ = writeln!(
        out,
        "{:>6} {:>14} {:>10} {:>18} {:>8} {:>18} {:>18}",
        "HOST", "SAMPLES", "SHARDS", "BYTES", "DROPPED", "MIN BUDGET", "SHARE"
    );
    for h in &r.per_host {
        let _ = writeln!(
            out,
            "{:>6} {:>14} {:>10} {:>18} {:>8} {:>18} {:>18}",
            h.host,
            opt(h.samples),
            h.shards,
            opt(h.bytes),
            h.dropped,
            opt(h.working_set.map(|w| w.min_budget)),
            opt(h.share_bytes)
        );
    }
    let s = &r.summary;
    let spread = |what: &str, sp: &Option<Spread>| match sp {
        Some(sp) => format!(
            "{what} min {} max {} (max/min {})",
            sp.min,
            sp.max,
            sp.ratio.map_or("-".into(), |x| format!("{x:.4}"))
        ),
        None => format!("{what} -"),
    };
    let _ = writeln!(
        out,
        "total: {} samples, {} shard reads, {} bytes, {} dropped",
        opt(s.total_samples),
        s.total_shards,
        opt(s.total_bytes),
        s.total_dropped
    );
    let _ = writeln!(
        out,
        "spread between hosts: {}; {}; {}",
        spread("samples", &s.samples),
        spread("shards", &s.shards),
        spread("bytes", &s.bytes)
    );
    if let Some(z) = &r.resize {
        let _ = writeln!(
            out,
            "elastic resume from {} (hosts,ranks,workers) with every old worker at sample {}: {} samples left, {} dropped; per new host (fetch: not in the same host index's old share):",
            z.from, z.position, z.remainder, z.dropped
        );
        for h in &z.per_host {
            let _ = writeln!(
                out,
                "  host {:>5}: {} samples, {} shards, {} bytes; fetch {} shards, {} bytes",
                h.host,
                h.samples,
                h.shards,
                opt(h.bytes),
                h.fetch_shards,
                opt(h.fetch_bytes)
            );
        }
        let _ = writeln!(
            out,
            "elastic resume fetches {:.1}% of what it reads from the store",
            100.0 * z.fetch_fraction
        );
    }
    out
}
