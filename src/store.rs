//! Shard URLs and the object stores behind them.
//!
//! `gs://` and `s3://` shards are read through `object_store` (one store per bucket, built once
//! at start-up so credential problems show up before the first trainer connects). Local shards
//! (`file://` URLs or plain paths) are already on this host's disk: they are read in place, not
//! copied into the cache.
//!
//! Retries are object_store's, not ours: 5xx, 408, 429 and connection errors are retried with
//! exponential backoff (`store.retries` times, within 3 minutes); a body cut mid-way is resumed
//! with a range request. 404 and other 4xx answers fail at once. The whole-request timeout is disabled
//! (shards are large); `store.connect_timeout` and `store.read_timeout` (the longest silence
//! while reading a body) catch stalled connections instead.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use object_store::ObjectStore;
use object_store::path::Path as ObjectPath;

use crate::config::{Config, GcsSection, S3Section};

#[derive(Debug, thiserror::Error)]
pub enum UrlError {
    #[error("{url}: unsupported scheme {scheme:?} (use gs://, s3://, file:// or a local path)")]
    Scheme { url: String, scheme: String },
    #[error("{url}: no bucket name")]
    NoBucket { url: String },
    #[error("{url}: no object path after the bucket")]
    NoObject { url: String },
    #[error("{url}: not a valid file:// URL")]
    FileUrl { url: String },
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot set up the store for {bucket}: {source}")]
    Build {
        bucket: String,
        source: object_store::Error,
    },
}

/// One shard's location. `as_str()` is the URL trainers see as `__url__`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardUrl {
    url: String,
    location: Location,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    Gcs { bucket: String, path: String },
    S3 { bucket: String, path: String },
    Local(PathBuf),
}

impl ShardUrl {
    /// Parses one expanded shard URL. A relative local path is resolved against `base_dir`.
    pub fn parse(url: &str, base_dir: &Path) -> Result<ShardUrl, UrlError> {
        let location = match url.split_once("://") {
            Some(("gs", rest)) => {
                let (bucket, path) = bucket_and_path(url, rest)?;
                Location::Gcs { bucket, path }
            }
            Some(("s3", rest)) => {
                let (bucket, path) = bucket_and_path(url, rest)?;
                Location::S3 { bucket, path }
            }
            Some(("file", _)) => {
                let parsed =
                    url::Url::parse(url).map_err(|_| UrlError::FileUrl { url: url.into() })?;
                Location::Local(
                    parsed
                        .to_file_path()
                        .map_err(|_| UrlError::FileUrl { url: url.into() })?,
                )
            }
            Some((scheme, _)) => {
                return Err(UrlError::Scheme {
                    url: url.into(),
                    scheme: scheme.into(),
                });
            }
            None => {
                let path = base_dir.join(url);
                return Ok(ShardUrl {
                    url: path.to_string_lossy().into_owned(),
                    location: Location::Local(path),
                });
            }
        };
        Ok(ShardUrl {
            url: url.to_string(),
            location,
        })
    }

    pub fn as_str(&self) -> &str {
        &self.url
    }

    pub fn location(&self) -> &Location {
        &self.location
    }
}

impl std::fmt::Display for ShardUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.url)
    }
}

fn bucket_and_path(url: &str, rest: &str) -> Result<(String, String), UrlError> {
    let (bucket, path) = rest.split_once('/').unwrap_or((rest, ""));
    if bucket.is_empty() {
        return Err(UrlError::NoBucket { url: url.into() });
    }
    if path.is_empty() {
        return Err(UrlError::NoObject { url: url.into() });
    }
    Ok((bucket.to_string(), path.to_string()))
}

/// The object stores of every bucket the config names, built once.
pub struct Stores {
    by_bucket: HashMap<(&'static str, String), Arc<dyn ObjectStore>>,
}

/// Where to read a shard from.
pub enum Source {
    Object {
        store: Arc<dyn ObjectStore>,
        path: ObjectPath,
    },
    LocalFile(PathBuf),
}

impl Stores {
    /// Builds one store per (scheme, bucket) used by the config's datasets.
    pub fn from_config(config: &Config) -> Result<Stores, StoreError> {
        let options = object_store::ClientOptions::new()
            .with_timeout_disabled()
            .with_connect_timeout(config.connect_timeout)
            .with_read_timeout(config.read_timeout)
            .with_allow_http(true);
        let retry = object_store::RetryConfig {
            max_retries: config.retries,
            ..Default::default()
        };
        let mut by_bucket = HashMap::new();
        for dataset in config.datasets.values() {
            for shard in &dataset.shards {
                let (scheme, bucket) = match shard.location() {
                    Location::Gcs { bucket, .. } => ("gs", bucket),
                    Location::S3 { bucket, .. } => ("s3", bucket),
                    Location::Local(_) => continue,
                };
                let key = (scheme, bucket.clone());
                if by_bucket.contains_key(&key) {
                    continue;
                }
                let built = match scheme {
                    "gs" => gcs(bucket, config.gcs.as_ref(), options.clone(), retry.clone()),
                    _ => s3(bucket, config.s3.as_ref(), options.clone(), retry.clone()),
                }
                .map_err(|source| StoreError::Build {
                    bucket: format!("{scheme}://{bucket}"),
                    source,
                })?;
                by_bucket.insert(key, built);
            }
        }
        Ok(Stores { by_bucket })
    }

    pub fn source(&self, shard: &ShardUrl) -> Source {
        let (scheme, bucket, path) = match shard.location() {
            Location::Gcs { bucket, path } => ("gs", bucket, path),
            Location::S3 { bucket, path } => ("s3", bucket, path),
            Location::Local(p) => return Source::LocalFile(p.clone()),
        };
        let store = self
            .by_bucket
            .get(&(scheme, bucket.clone()))
            .expect("stores are built for every bucket of the config")
            .clone();
        Source::Object {
            store,
            path: ObjectPath::from(path.as_str()),
        }
    }
}

fn gcs(
    bucket: &str,
    section: Option<&GcsSection>,
    options: object_store::ClientOptions,
    retry: object_store::RetryConfig,
) -> object_store::Result<Arc<dyn ObjectStore>> {
    use object_store::gcp::GoogleCloudStorageBuilder;
    let mut b = match section {
        // `[gcs]` present: only what it says, so a stray env var cannot redirect an emulator run.
        Some(_) => GoogleCloudStorageBuilder::new(),
        None => GoogleCloudStorageBuilder::from_env(),
    }
    .with_bucket_name(bucket)
    .with_client_options(options)
    .with_retry(retry);
    if let Some(s) = section {
        if let Some(endpoint) = &s.endpoint {
            b = b.with_base_url(endpoint.trim_end_matches('/'));
        }
        if s.anonymous {
            b = b.with_skip_signature(true);
        }
    }
    Ok(Arc::new(b.build()?))
}

fn s3(
    bucket: &str,
    section: Option<&S3Section>,
    options: object_store::ClientOptions,
    retry: object_store::RetryConfig,
) -> object_store::Result<Arc<dyn ObjectStore>> {
    use object_store::aws::AmazonS3Builder;
    let mut b = AmazonS3Builder::from_env()
        .with_bucket_name(bucket)
        .with_client_options(options)
        .with_retry(retry);
    if let Some(s) = section {
        if let Some(endpoint) = &s.endpoint {
            b = b.with_endpoint(endpoint).with_allow_http(true);
        }
        if let Some(region) = &s.region {
            b = b.with_region(region);
        }
        if s.anonymous {
            b = b.with_skip_signature(true);
        }
    }
    Ok(Arc::new(b.build()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_schemes() {
        let base = Path::new("/etc/shardd");
        let g = ShardUrl::parse("gs://bkt/a/b-0.tar", base).unwrap();
        assert_eq!(
            g.location(),
            &Location::Gcs {
                bucket: "bkt".into(),
                path: "a/b-0.tar".into()
            }
        );
        let f = ShardUrl::parse("file:///data/x.tar", base).unwrap();
        assert_eq!(f.location(), &Location::Local("/data/x.tar".into()));
        let rel = ShardUrl::parse("data/x.tar", base).unwrap();
        assert_eq!(rel.as_str(), "/etc/shardd/data/x.tar");
        let abs = ShardUrl::parse("/data/x.tar", base).unwrap();
        assert_eq!(abs.as_str(), "/data/x.tar");
    }

    #[test]
    fn rejects_bad_urls() {
        let base = Path::new("/");
        let err = ShardUrl::parse("http://x/y.tar", base)
            .unwrap_err()
            .to_string();
        assert!(err.contains("unsupported scheme \"http\""), "{err}");
        assert!(matches!(
            ShardUrl::parse("gs:///y.tar", base),
            Err(UrlError::NoBucket { .. })
        ));
        assert!(matches!(
            ShardUrl::parse("gs://bkt", base),
            Err(UrlError::NoObject { .. })
        ));
    }
}
