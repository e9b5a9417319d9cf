//! `shardd warm`: fills the cache with this host's share ahead of a job, with progress.

use std::io::IsTerminal;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use indicatif::{ProgressBar, ProgressStyle};
use shardd::cache::{Ensured, FetchError};
use shardd::config::Config;
use shardd::metrics::Metrics;
use shardd::prefetch::{self, Plans};

pub async fn run(config: Config, only: Option<String>) -> anyhow::Result<()> {
    if let Some(name) = &only
        && !config.datasets.contains_key(name)
    {
        let known: Vec<&str> = config.datasets.keys().map(String::as_str).collect();
        bail!(
            "unknown dataset {name:?}; the config has: {}",
            known.join(", ")
        );
    }
    let cache = shardd::daemon::open_cache(
        &config,
        Arc::new(Metrics::new()),
        Arc::new(Plans::default()),
    )
    .await
    .context("opening the cache")?;
    let mut problems = Vec::new();
    for dataset in config.datasets.values() {
        if only.as_ref().is_some_and(|n| *n != dataset.name) {
            continue;
        }
        let share: Vec<_> = shardd::plan::warm_shards(dataset.shape(), config.host)
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

/// A progress bar on a terminal; a plain line every few seconds otherwise.
struct Progress {
    name: String,
    bar: Option<ProgressBar>,
    total: u64,
    done: u64,
    bytes: u64,
    started: Instant,
    last_line: Instant,
}

impl Progress {
    fn new(name: &str, total: u64) -> Progress {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::new(total);
            bar.set_style(
                ProgressStyle::with_template(
                    "{prefix} [{bar:30}] {pos}/{len} shards, {msg}, ETA {eta}",
                )
                .expect("a valid template")
                .progress_chars("=> "),
            );
            bar.set_prefix(name.to_string());
            bar
        });
        Progress {
            name: name.into(),
            bar,
            total,
            done: 0,
            bytes: 0,
            started: Instant::now(),
            last_line: Instant::now(),
        }
    }

    fn add(&mut self, bytes: u64) {
        self.done += 1;
        self.bytes += bytes;
        let summary = self.summary();
        match &self.bar {
            Some(bar) => {
                bar.set_message(summary);
                bar.inc(1);
            }
            None if self.last_line.elapsed() >= Duration::from_secs(2) => {
                self.last_line = Instant::now();
                eprintln!(
                    "{}: {}/{} shards, {summary}",
                    self.name, self.done, self.total
                );
            }
            None => {}
        }
    }

    fn summary(&self) -> String {
        let secs = self.started.elapsed().as_secs_f64().max(1e-3);
        format!(
            "{:.1} MB fetched, {:.1} MB/s",
            self.bytes as f64 / 1e6,
            self.bytes as f64 / 1e6 / secs
        )
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish();
        }
        eprintln!(
            "{}: {}/{} shards done, {} in {:.1}s",
            self.name,
            self.done,
            self.total,
            self.summary(),
            self.started.elapsed().as_secs_f64()
        );
    }
}
