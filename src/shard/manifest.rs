//! A dataset's manifest: every shard's URL, size, ETag/generation, CRC-32C and sample count,
//! made by `shardd index`. With it the plan works in samples, not shards (exact, equal
//! epochs; `plan/mod.rs`), so the daemon checks at start that the manifest still describes the
//! configured shards exactly: the same URLs, and for the shards of its host's share, the sizes
//! and ETags the store reports now.

use std::collections::HashMap;
use std::sync::Arc;

use futures::{StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};

use crate::cache::ShardBytes;
use crate::cache::decompress::Compression;
use crate::config::url::ShardUrl;
use crate::store::{ReadError, Stores, Version};

mod compact;
pub mod parts;

pub use compact::Loaded;

const FORMAT: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    #[error("manifest {url}: {what}")]
    Invalid { url: String, what: String },
    #[error("manifest {url} does not match the configured shards: {what}")]
    Mismatch { url: String, what: String },
    #[error(transparent)]
    Read(#[from] ReadError),
    #[error("{url}: {what}")]
    Shard { url: String, what: String },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: u32,
    pub shards: Vec<Entry>,
    pub total_samples: u64,
    pub total_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub url: String,
    #[serde(flatten)]
    pub version: Version,
    /// CRC-32C of the object's bytes as stored.
    pub crc32c: u32,
    pub samples: u64,
}

impl Manifest {
    pub fn new(shards: Vec<Entry>) -> Manifest {
        Manifest {
            format: FORMAT,
            total_samples: shards.iter().map(|e| e.samples).sum(),
            total_bytes: shards.iter().map(|e| e.version.size).sum(),
            shards,
        }
    }

    pub fn parse(text: &[u8], url: &str) -> Result<Manifest, ManifestError> {
        let invalid = |what: String| ManifestError::Invalid {
            url: url.into(),
            what,
        };
        let m: Manifest = serde_json::from_slice(text).map_err(|e| invalid(e.to_string()))?;
        check_totals(
            url,
            m.format,
            (m.total_samples, m.total_bytes),
            m.shards.iter().map(|e| e.samples),
            m.shards.iter().map(|e| e.version.size),
        )?;
        Ok(m)
    }

    /// The sample count of each configured shard, in config order, after checking that the
    /// manifest names exactly these shards.
    pub fn counts(&self, url: &str, shards: &[ShardUrl]) -> Result<Vec<u64>, ManifestError> {
        Ok(self
            .positions(url, shards)?
            .into_iter()
            .map(|i| self.shards[i].samples)
            .collect())
    }

    /// Where each configured shard is in the manifest (`positions[i]` is the index in
    /// `self.shards` of `shards[i]`), after checking that the manifest names exactly these
    /// shards.
    pub fn positions(&self, url: &str, shards: &[ShardUrl]) -> Result<Vec<usize>, ManifestError> {
        positions_of(self.shards.len(), |i| &self.shards[i].url, url, shards)
    }

    /// Checks that `shards` (all in the manifest: see [`Manifest::counts`]) are the objects it
    /// describes: `current` is what the store reports now, in the same order. Size, and ETag
    /// and generation where both sides know one.
    pub fn unchanged(
        &self,
        url: &str,
        shards: &[ShardUrl],
        current: &[Version],
    ) -> Result<(), ManifestError> {
        let by_url = self.by_url();
        let at: Vec<usize> = shards
            .iter()
            .map(|shard| {
                *by_url
                    .get(shard.as_str())
                    .unwrap_or_else(|| panic!("{shard} was checked to be in the manifest"))
            })
            .collect();
        self.unchanged_at(url, shards, &at, current)
    }

    /// [`Manifest::unchanged`], with the manifest index of each of `shards` known (`at[i]`
    /// describes `shards[i]`, from [`Manifest::positions`]): no lookup by URL.
    pub fn unchanged_at(
        &self,
        url: &str,
        shards: &[ShardUrl],
        at: &[usize],
        current: &[Version],
    ) -> Result<(), ManifestError> {
        unchanged_at(url, shards, at, current, |i| self.shards[i].version.clone())
    }

    fn by_url(&self) -> rustc_hash::FxHashMap<&str, usize> {
        self.shards
            .iter()
            .enumerate()
            .map(|(i, e)| (e.url.as_str(), i))
            .collect()
    }
}

/// The checks after parsing: the format, and that the totals are the sums of the entries.
fn check_totals(
    url: &str,
    format: u32,
    (total_samples, total_bytes): (u64, u64),
    samples: impl Iterator<Item = u64>,
    sizes: impl Iterator<Item = u64>,
) -> Result<(), ManifestError> {
    let invalid = |what: String| ManifestError::Invalid {
        url: url.into(),
        what,
    };
    if format != FORMAT {
        return Err(invalid(format!(
            "format {format} (this daemon reads {FORMAT})"
        )));
    }
    // Summed wide: a manifest comes from anywhere, and totals past u64 are just wrong.
    let sum = |n: &mut dyn Iterator<Item = u64>| n.map(u128::from).sum::<u128>();
    if sum(&mut { samples }) != u128::from(total_samples)
        || sum(&mut { sizes }) != u128::from(total_bytes)
    {
        return Err(invalid("its totals do not add up".into()));
    }
    Ok(())
}

/// Where each configured shard is among the `n` URLs of a manifest (`url(i)`: the `i`th),
/// after checking that the manifest names exactly these shards.
fn positions_of<'a>(
    n: usize,
    url_at: impl Fn(usize) -> &'a str,
    url: &str,
    shards: &'a [ShardUrl],
) -> Result<Vec<usize>, ManifestError> {
    let mismatch = |what: String| ManifestError::Mismatch {
        url: url.into(),
        what,
    };
    // `shardd index` writes the shards in config order: then no lookup table is needed,
    // only a check for a shard listed twice (a validated config has none). At a million
    // shards, SipHashing every URL several times was most of the daemon's start-up.
    if n == shards.len() && (0..n).all(|i| url_at(i) == shards[i].as_str()) {
        let mut seen = rustc_hash::FxHashSet::default();
        seen.reserve(n);
        if !(0..n).all(|i| seen.insert(url_at(i))) {
            return Err(mismatch("it lists a shard twice".into()));
        }
        return Ok((0..n).collect());
    }
    let by_url: rustc_hash::FxHashMap<&str, usize> = (0..n).map(|i| (url_at(i), i)).collect();
    if by_url.len() != n {
        return Err(mismatch("it lists a shard twice".into()));
    }
    let mut positions = Vec::with_capacity(shards.len());
    for shard in shards {
        let Some(&i) = by_url.get(shard.as_str()) else {
            return Err(mismatch(format!("{shard} is not in it")));
        };
        positions.push(i);
    }
    if n != shards.len() {
        let configured: std::collections::HashSet<&str> =
            shards.iter().map(ShardUrl::as_str).collect();
        let extra = (0..n)
            .map(&url_at)
            .find(|u| !configured.contains(u))
            .map(str::to_owned)
            .unwrap_or_default();
        return Err(mismatch(format!(
            "it lists {extra}, which the config does not"
        )));
    }
    Ok(positions)
}

/// Checks that each of `shards` is the object the manifest describes (`then(at[i])`, the
/// version recorded at its manifest index) given what the store reports now (`current`, in
/// the same order): both forms of a manifest check through this.
fn unchanged_at(
    url: &str,
    shards: &[ShardUrl],
    at: &[usize],
    current: &[Version],
    then: impl Fn(usize) -> Version,
) -> Result<(), ManifestError> {
    for ((shard, &i), now) in shards.iter().zip(at).zip(current) {
        let then = then(i);
        if !same_object(&then, now) {
            return Err(changed(url, shard, &then, now));
        }
    }
    Ok(())
}

/// The error for a shard whose object is no longer the one the manifest describes.
fn changed(url: &str, shard: &ShardUrl, then: &Version, now: &Version) -> ManifestError {
    let known = |v: &Option<String>| v.clone().unwrap_or_else(|| "unknown".into());
    let mut differs = Vec::new();
    if then.size != now.size {
        differs.push(format!("size {} → {}", then.size, now.size));
    }
    for (name, a, b) in [
        ("ETag", &then.e_tag, &now.e_tag),
        ("generation", &then.generation, &now.generation),
    ] {
        if a.is_some() && b.is_some() && a != b {
            differs.push(format!("{name} {} → {}", known(a), known(b)));
        }
    }
    ManifestError::Mismatch {
        url: url.into(),
        // Only what differs: a rewritten object of the same size and bytes shows only a new
        // generation (an ETag is the bytes' MD5), which the message once hid behind two equal
        // sizes and ETags.
        what: format!(
            "{shard} changed since it was indexed ({})",
            differs.join(", ")
        ),
    }
}

/// Whether a manifest entry still describes the object: same size, and same ETag and
/// generation where both sides know one (a local file's "ETag" includes its mtime, so a
/// copied dataset is not the same object).
fn same_object(then: &Version, now: &Version) -> bool {
    let agree = |a: &Option<String>, b: &Option<String>| match (a, b) {
        (Some(a), Some(b)) => a == b,
        _ => true,
    };
    then.size == now.size
        && agree(&then.e_tag, &now.e_tag)
        && agree(&then.generation, &now.generation)
}

/// The current versions of `shards`, `parallel` HEADs (or stats) at a time, in order.
pub async fn versions(
    stores: &Stores,
    shards: &[ShardUrl],
    parallel: usize,
) -> Result<Vec<Version>, ReadError> {
    // Owned URLs in the futures: a borrowed one makes the future not `Send` for tokio::spawn
    // (a known limit of higher-ranked closures).
    futures::stream::iter(shards.iter().cloned())
        .map(|s| async move { stores.version(&s).await })
        .buffered(parallel.max(1))
        .try_collect()
        .await
}

/// Reads a manifest from a local path or an object URL, in the daemon's compact form;
/// returns it with the index in it of each of `shards` (which it must name exactly, see
/// [`Manifest::positions`]).
pub async fn load(
    stores: &Stores,
    source: &ShardUrl,
    shards: &[ShardUrl],
) -> Result<(Loaded, Vec<usize>), ManifestError> {
    let text = stores.read_whole(source).await?;
    let manifest = Loaded::parse(&text, source.as_str(), shards)?;
    // The text is the largest thing at start (~180 MB at a million shards): gone before the
    // positions' table is built.
    drop(text);
    let positions = manifest.positions(source.as_str(), shards)?;
    Ok((manifest, positions))
}

/// Asks the store for the current version of each of `shards` (one HEAD or stat each,
/// `parallel` at a time) and checks it is the one `manifest` describes (`at[i]`: the index
/// in the manifest of `shards[i]`).
pub async fn check_unchanged(
    stores: &Stores,
    manifest: &Loaded,
    source: &ShardUrl,
    shards: &[ShardUrl],
    at: &[usize],
    parallel: usize,
) -> Result<(), ManifestError> {
    let current = versions(stores, shards, parallel).await?;
    manifest.unchanged_at(source.as_str(), shards, at, &current)
}

/// Indexes `shards`, `parallel` at a time: reads each one (reusing the entry of `previous`
/// when the object is unchanged), counts its samples and checksums it. Calls `progress`
/// with each finished entry and the bytes read for it (0 when reused).
pub async fn index(
    stores: &Stores,
    shards: &[ShardUrl],
    previous: Option<&Manifest>,
    parallel: usize,
    mut progress: impl FnMut(&Entry, u64),
) -> Result<Manifest, ManifestError> {
    let known: HashMap<&str, &Entry> = previous
        .map(|m| m.shards.iter().map(|e| (e.url.as_str(), e)).collect())
        .unwrap_or_default();
    let mut entries = futures::stream::iter(shards)
        .map(|shard| {
            let known = known.get(shard.as_str()).copied();
            async move {
                let version = stores.version(shard).await?;
                if let Some(e) = known.filter(|e| e.version == version) {
                    return Ok((e.clone(), 0));
                }
                index_one(stores, shard, version).await
            }
        })
        .buffered(parallel.max(1));
    let mut out = Vec::with_capacity(shards.len());
    while let Some(entry) = entries.next().await {
        let (entry, read) = entry?;
        progress(&entry, read);
        out.push(entry);
    }
    Ok(Manifest::new(out))
}

async fn index_one(
    stores: &Stores,
    shard: &ShardUrl,
    version: Version,
) -> Result<(Entry, u64), ManifestError> {
    let file = tempfile::tempfile().map_err(|e| shard_error(shard, e.to_string()))?;
    let copy = file
        .try_clone()
        .map_err(|e| shard_error(shard, e.to_string()))?;
    // Verified against what the store vouches for, and checksummed as it was written.
    let opened = Stores::open_at(version.clone());
    let crc32c = stores.read_into(shard, opened, copy).await?.crc32c;
    let url: Arc<str> = Arc::from(shard.as_str());
    let samples = tokio::task::spawn_blocking(move || count(file, &url))
        .await
        .map_err(|e| shard_error(shard, e.to_string()))??;
    let size = version.size;
    Ok((
        Entry {
            url: shard.to_string(),
            version,
            crc32c,
            samples,
        },
        size,
    ))
}

/// A shard's sample count (a gzip or zstd shard, told by its first bytes, is counted
/// decompressed, streaming from the file). Blocking.
fn count(mut file: std::fs::File, url: &Arc<str>) -> Result<u64, ManifestError> {
    use std::io::{Read, Seek};
    let err = |e: std::io::Error| shard_error_str(url, e.to_string());
    file.rewind().map_err(err)?;
    let mut head = Vec::with_capacity(4);
    (&mut file).take(4).read_to_end(&mut head).map_err(err)?;
    file.rewind().map_err(err)?;
    let mut plain = Vec::new();
    match Compression::detect(&head) {
        Some(compression) => compression
            .decoder(std::io::BufReader::new(file))
            .and_then(|mut d| d.read_to_end(&mut plain)),
        None => file.read_to_end(&mut plain),
    }
    .map_err(err)?;
    let samples = crate::shard::parse(&ShardBytes::heap(plain.into()), url)
        .map_err(|e| shard_error_str(url, e.to_string()))?
        .len() as u64;
    Ok(samples)
}

fn shard_error(shard: &ShardUrl, what: String) -> ManifestError {
    ManifestError::Shard {
        url: shard.to_string(),
        what,
    }
}

fn shard_error_str(url: &str, what: String) -> ManifestError {
    ManifestError::Shard {
        url: url.into(),
        what,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(url: &str, size: u64, tag: &str, samples: u64) -> Entry {
        Entry {
            url: url.into(),
            version: Version {
                size,
                e_tag: Some(tag.into()),
                generation: None,
            },
            crc32c: 0,
            samples,
        }
    }

    fn urls(names: &[&str]) -> Vec<ShardUrl> {
        names
            .iter()
            .map(|n| ShardUrl::parse(n, std::path::Path::new("/")).unwrap())
            .collect()
    }

    #[test]
    fn counts_follow_the_config_order_and_mismatches_name_the_shard() {
        let m = Manifest::new(vec![
            entry("gs://b/a.tar", 10, "x", 3),
            entry("gs://b/b.tar", 20, "y", 5),
        ]);
        let text = serde_json::to_vec(&m).unwrap();
        assert_eq!(Manifest::parse(&text, "m.json").unwrap(), m);
        let shards = urls(&["gs://b/b.tar", "gs://b/a.tar"]);
        assert_eq!(m.counts("m.json", &shards).unwrap(), vec![5, 3]);

        let err = |r: Result<_, ManifestError>| r.unwrap_err().to_string();
        let e = err(m.counts("m.json", &urls(&["gs://b/a.tar", "gs://b/c.tar"])));
        assert!(e.ends_with("gs://b/c.tar is not in it"), "{e}");
        let e = err(m.counts("m.json", &urls(&["gs://b/a.tar"])));
        assert!(
            e.ends_with("it lists gs://b/b.tar, which the config does not"),
            "{e}"
        );
        let twice = Manifest::new(vec![m.shards[0].clone(), m.shards[0].clone()]);
        let e = err(twice.counts("m.json", &urls(&["gs://b/a.tar", "gs://b/a.tar"])));
        assert!(e.ends_with("it lists a shard twice"), "{e}");
    }

    #[test]
    fn only_the_shards_asked_about_are_compared_with_the_store() {
        let m = Manifest::new(vec![
            entry("gs://b/a.tar", 10, "x", 3),
            entry("gs://b/b.tar", 20, "y", 5),
        ]);
        let now = |size: u64, tag: &str| entry("", size, tag, 0).version;
        // b.tar changed, but only a.tar (this host's share) is checked.
        m.unchanged("m.json", &urls(&["gs://b/a.tar"]), &[now(10, "x")])
            .unwrap();
        let e = m
            .unchanged("m.json", &urls(&["gs://b/b.tar"]), &[now(21, "y")])
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("manifest m.json does not match the configured shards: gs://b/b.tar changed since it was indexed (size 20 → 21"), "{e}");
        let e = m
            .unchanged("m.json", &urls(&["gs://b/a.tar"]), &[now(10, "z")])
            .unwrap_err()
            .to_string();
        assert!(
            e.ends_with("gs://b/a.tar changed since it was indexed (ETag x → z)"),
            "{e}"
        );
        // Rewritten with the same bytes: only the generation says so, and only it is named.
        let generation = |g: &str| Version {
            generation: Some(g.into()),
            ..entry("", 10, "x", 0).version
        };
        let m = Manifest::new(vec![Entry {
            version: generation("1"),
            ..entry("gs://b/a.tar", 10, "x", 3)
        }]);
        let e = m
            .unchanged("m.json", &urls(&["gs://b/a.tar"]), &[generation("2")])
            .unwrap_err()
            .to_string();
        assert!(
            e.ends_with("gs://b/a.tar changed since it was indexed (generation 1 → 2)"),
            "{e}"
        );
    }

    /// The store's current version of each shard asked about, in the order asked, however
    /// many are asked at a time.
    #[tokio::test]
    async fn versions_are_the_stores_in_the_order_asked() {
        let tmp = tempfile::tempdir().unwrap();
        for (i, len) in [3, 5, 1].into_iter().enumerate() {
            std::fs::write(tmp.path().join(format!("s{i}.tar")), vec![0u8; len]).unwrap();
        }
        let text = format!(
            "[datasets.d]\nshards = \"{}/s{{0..2}}.tar\"\n",
            tmp.path().display()
        );
        let config = crate::config::Config::parse(&text, tmp.path()).unwrap();
        let stores = Stores::from_config(&config, Default::default()).unwrap();
        let shards: Vec<ShardUrl> = config.datasets["d"].shards.iter().rev().cloned().collect();
        for parallel in [0, 1, 4] {
            let got = versions(&stores, &shards, parallel).await.unwrap();
            assert_eq!(got.iter().map(|v| v.size).collect::<Vec<_>>(), [1, 5, 3]);
            for (shard, v) in shards.iter().zip(&got) {
                assert_eq!(*v, stores.version(shard).await.unwrap(), "{shard}");
            }
        }
    }

    #[test]
    fn totals_must_add_up() {
        let mut m = Manifest::new(vec![entry("gs://b/a.tar", 10, "x", 3)]);
        m.total_samples = 4;
        let err = Manifest::parse(&serde_json::to_vec(&m).unwrap(), "m.json")
            .unwrap_err()
            .to_string();
        assert_eq!(err, "manifest m.json: its totals do not add up");
    }
}
