//! `shardd index`: reads every shard of a pattern list and writes a manifest (per shard: URL,
//! size, ETag/generation, CRC-32C, sample count), which makes a dataset's epochs exact.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::config::url::ShardUrl;
use crate::config::{DatasetSection, FileConfig};
use crate::ops::metrics::Metrics;
use crate::shard::manifest::parts::Part;
use crate::shard::manifest::{self, Manifest};
use crate::store::{ReadError, Stores};
use anyhow::Context;

use crate::ops::progress::Progress;

/// What `shardd index` is asked.
pub struct Args {
    pub patterns: Vec<String>,
    pub output: String,
    pub parallel: usize,
    /// Index only this part of the patterns' shards.
    pub part: Option<Part>,
    /// Merge these parts' manifests (brace patterns) instead of reading shards.
    pub merge: Vec<String>,
}

pub async fn run(args: Args, config: Option<PathBuf>) -> anyhow::Result<()> {
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
    // Synthetic datasets: the patterns to index, with the output as its manifest (and the
    // parts to merge), so the stores for all of them are built from the config's [gcs], [s3]
    // and [store] sections.
    let section = |urls: &[String], manifest: Option<&str>| -> anyhow::Result<DatasetSection> {
        let mut section = toml::Table::new();
        section.insert(
            "shards".into(),
            toml::Value::Array(urls.iter().cloned().map(toml::Value::String).collect()),
        );
        if let Some(m) = manifest {
            section.insert("manifest".into(), toml::Value::String(m.into()));
        }
        Ok(section.try_into()?)
    };
    file.datasets.clear();
    file.datasets
        .insert("index".into(), section(&args.patterns, Some(&args.output))?);
    if !args.merge.is_empty() {
        file.datasets
            .insert("parts".into(), section(&args.merge, None)?);
    }
    let config = file.validate(&base)?;
    let dataset = &config.datasets["index"];
    let out = dataset.manifest.clone().expect("set above");
    let stores = Stores::from_config(&config, Arc::new(Metrics::new()))?;
    stores.check_credentials().await?;
    if let Some(parts) = config.datasets.get("parts") {
        return merge(&stores, &dataset.shards, &parts.shards, &out).await;
    }
    let shards = match args.part {
        Some(part) => part.shards(&dataset.shards),
        None => dataset.shards.to_vec(),
    };

    let previous = match stores.read_whole(&out).await {
        Ok(text) => Manifest::parse(&text, out.as_str()).ok(),
        Err(ReadError::NotFound { .. }) => None,
        Err(e) => return Err(e.into()),
    };
    let mut progress = Progress::new("index", shards.len() as u64);
    let mut reused = 0usize;
    let made = manifest::index(
        &stores,
        &shards,
        previous.as_ref(),
        args.parallel,
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
    let part = args
        .part
        .map(|p| format!(" (part {p} of {} shards)", dataset.shards.len()))
        .unwrap_or_default();
    eprintln!(
        "{out}: {} shards{part}, {} samples, {} bytes ({reused} entries reused)",
        made.shards.len(),
        made.total_samples,
        made.total_bytes
    );
    Ok(())
}

/// Reads the parts' manifests and writes the patterns' one, if they cover it exactly once.
async fn merge(
    stores: &Stores,
    shards: &[ShardUrl],
    parts: &[ShardUrl],
    out: &ShardUrl,
) -> anyhow::Result<()> {
    let mut read = Vec::with_capacity(parts.len());
    for part in parts {
        let text = stores
            .read_whole(part)
            .await
            .with_context(|| format!("--merge {part}"))?;
        let manifest = Manifest::parse(&text, part.as_str())?;
        read.push((part.to_string(), manifest));
    }
    let made =
        manifest::parts::merge(shards, &read).map_err(|e| anyhow::anyhow!("--merge: {e}"))?;
    let text = serde_json::to_vec_pretty(&made)?;
    stores.write_whole(out, text.into()).await?;
    eprintln!(
        "{out}: {} shards, {} samples, {} bytes (merged from {} parts)",
        made.shards.len(),
        made.total_samples,
        made.total_bytes,
        parts.len()
    );
    Ok(())
}
