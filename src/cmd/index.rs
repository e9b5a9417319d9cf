//! `shardd index`: reads every shard of a pattern list and writes a manifest (per shard: URL,
//! size, ETag/generation, CRC-32C, sample count), which makes a dataset's epochs exact.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::config::{DatasetSection, FileConfig};
use crate::ops::metrics::Metrics;
use crate::shard::manifest::{self, Manifest};
use crate::store::{ReadError, Stores};
use anyhow::Context;

use crate::ops::progress::Progress;

pub async fn run(
    patterns: Vec<String>,
    output: String,
    config: Option<PathBuf>,
    parallel: usize,
) -> anyhow::Result<()> {
    let (mut file, base) = match &config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            let file: FileConfig =
                toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
            (file, path.parent().unwrap_or(Path::new(".")).to_path_buf())
        }
        None => (FileConfig::default(), std::env::current_dir()?),
    };
    // One synthetic dataset: the patterns to index, with the output as its manifest, so the
    // stores for both are built from the config's [gcs], [s3] and [store] sections.
    let mut section = toml::Table::new();
    section.insert(
        "shards".into(),
        toml::Value::Array(patterns.into_iter().map(toml::Value::String).collect()),
    );
    section.insert("manifest".into(), toml::Value::String(output));
    let section: DatasetSection = section.try_into()?;
    file.datasets.clear();
    file.datasets.insert("index".into(), section);
    let config = file.validate(&base)?;
    let dataset = &config.datasets["index"];
    let out = dataset.manifest.clone().expect("set above");
    let stores = Stores::from_config(&config, Arc::new(Metrics::new()))?;
    stores.check_credentials().await?;

    let previous = match stores.read_whole(&out).await {
        Ok(text) => Manifest::parse(&text, out.as_str()).ok(),
        Err(ReadError::NotFound { .. }) => None,
        Err(e) => return Err(e.into()),
    };
    let mut progress = Progress::new("index", dataset.shards.len() as u64);
    let mut reused = 0usize;
    let made = manifest::index(
        &stores,
        &dataset.shards,
        previous.as_ref(),
        parallel,
        |_, read| {
            reused += (read == 0) as usize;
            progress.add(read);
        },
    )
    .await;
    progress.finish();
    let made = made?;
    let text = serde_json::to_vec_pretty(&made)?;
    stores.write_whole(&out, text.into()).await?;
    eprintln!(
        "{out}: {} shards, {} samples, {} bytes ({reused} entries reused)",
        made.shards.len(),
        made.total_samples,
        made.total_bytes
    );
    Ok(())
}
