//! `shardd warm`: fills the cache with this host's share ahead of a job, with progress: the
//! shards its streams will read (with a manifest, the host's share in samples, checked against
//! the store as the daemon checks it at start).

use std::sync::Arc;

use crate::cache::{Ensured, FetchError};
use crate::config::Config;
use crate::ops::metrics::Metrics;
use crate::serve::prefetch::{self, Plans};
use anyhow::bail;

use crate::ops::progress::Progress;

pub async fn run(mut config: Config, only: Option<String>) -> anyhow::Result<()> {
    crate::config::host::resolve(&mut config).await?;
    if let Some(name) = &only
        && !config.datasets.contains_key(name)
    {
        let known: Vec<&str> = config.datasets.keys().map(String::as_str).collect();
        bail!(
            "unknown dataset {name:?}; the config has: {}",
            known.join(", ")
        );
    }
    let cache = crate::serve::daemon::open_cache(
        &config,
        Arc::new(Metrics::new()),
        Arc::new(Plans::default()),
    )
    .await?;
    // A manifest makes the share one in samples (what the streams read), not in shards.
    crate::serve::daemon::load_manifests(&mut config, cache.stores()).await?;
    let mut problems = Vec::new();
    for dataset in config.datasets.values() {
        if only.as_ref().is_some_and(|n| *n != dataset.name) {
            continue;
        }
        let share: Vec<_> = crate::plan::warm_shards(dataset.shape(), config.host)
            .into_iter()
            .map(|i| dataset.shards[i].clone())
            .collect();
        let mut progress = Progress::new(&dataset.name, share.len() as u64);
        let mut failed = Vec::new();
        let mut cached = 0usize;
        let complete = prefetch::warm(
            &cache,
            &share,
            config.max_downloads,
            |result| match result {
                Ok(Ensured::Loaded(bytes)) => {
                    cached += 1;
                    progress.add(*bytes)
                }
                Ok(Ensured::Present) => {
                    cached += 1;
                    progress.add(0)
                }
                Err(e) if matches!(e.root(), FetchError::NoRoom { .. }) => {}
                Err(e) => {
                    progress.add(0);
                    failed.push(e.root().to_string());
                }
            },
        )
        .await;
        progress.finish();
        if !failed.is_empty() {
            problems.push(format!(
                "dataset {}: {} of {} shards could not be fetched: {}",
                dataset.name,
                failed.len(),
                share.len(),
                failed.join("; ")
            ));
        } else if !complete {
            problems.push(format!(
                "dataset {}: this host's share ({} shards) does not fit in cache.max_size ({} bytes): {} shards are cached",
                dataset.name,
                share.len(),
                config.cache_max_bytes,
                cached
            ));
        }
    }
    if !problems.is_empty() {
        bail!("{}", problems.join("\n"));
    }
    Ok(())
}
