//! One object_store client per bucket, built from the config's `[store]`, `[gcs]` and `[s3]`
//! sections, and beside it a probe of the same client's credentials (see `credentials.rs`).
//!
//! Retries are object_store's, not ours: 5xx, 408, 429 and connection errors are retried with
//! exponential backoff, `store.retries` times and within `store.retry_timeout` of the first
//! attempt; a body cut mid-way is resumed with a range request. 404 and other 4xx answers fail
//! at once. The whole-request timeout is disabled (shards are large); `store.connect_timeout`
//! and `store.read_timeout` (the longest silence while reading a body) catch stalled
//! connections instead.

use std::sync::Arc;

use object_store::aws::{AmazonS3Builder, AwsCredentialProvider};
use object_store::gcp::{GcpCredentialProvider, GoogleCloudStorageBuilder};
use object_store::{ClientOptions, ObjectStore, RetryConfig};

use super::reported::{self, Kind};
use crate::config::{Config, GcsSection, S3Section};

/// One bucket's store, and how to ask it for credentials.
pub(super) struct Bucket {
    /// `gs://bucket` or `s3://bucket`: how messages name it.
    pub name: String,
    pub store: Arc<dyn ObjectStore>,
    pub probe: Probe,
}

/// A credential provider built like the store's, but whose token requests give up sooner
/// (`store.credentials_timeout`, two retries): asking it says quickly whether the store
/// can sign its requests.
pub(super) enum Probe {
    /// Anonymous: requests are not signed, there is nothing to ask.
    Nothing,
    Gcs {
        provider: GcpCredentialProvider,
        /// Whether the config has a `[gcs]` section (then the environment is not read).
        section: bool,
    },
    S3(AwsCredentialProvider),
}

/// Builds the store of one bucket (`scheme` "gs" or "s3").
pub(super) fn bucket(scheme: &str, name: &str, config: &Config) -> object_store::Result<Bucket> {
    let options = ClientOptions::new()
        .with_timeout_disabled()
        .with_connect_timeout(config.connect_timeout)
        .with_read_timeout(config.read_timeout)
        .with_allow_http(true);
    let retry = RetryConfig {
        max_retries: config.retries,
        retry_timeout: config.retry_timeout,
        ..Default::default()
    };
    let quick = RetryConfig {
        max_retries: config.retries.min(2),
        retry_timeout: config.credentials_timeout,
        ..Default::default()
    };
    let (store, probe): (Arc<dyn ObjectStore>, Probe) = if scheme == "gs" {
        let section = config.gcs.as_ref();
        let store = gcs(name, section, options.clone(), retry).build()?;
        let probe = match section {
            Some(s) if s.anonymous => Probe::Nothing,
            _ => Probe::Gcs {
                provider: gcs(name, section, options, quick)
                    .build()?
                    .credentials()
                    .clone(),
                section: section.is_some(),
            },
        };
        (Arc::new(store), probe)
    } else {
        let section = config.s3.as_ref();
        let store = s3(name, section, options.clone(), retry).build()?;
        let probe = match section {
            Some(s) if s.anonymous => Probe::Nothing,
            _ => Probe::S3(
                s3(name, section, options, quick)
                    .build()?
                    .credentials()
                    .clone(),
            ),
        };
        (Arc::new(store), probe)
    };
    Ok(Bucket {
        name: format!("{scheme}://{name}"),
        store,
        probe,
    })
}

fn gcs(
    bucket: &str,
    section: Option<&GcsSection>,
    options: ClientOptions,
    retry: RetryConfig,
) -> GoogleCloudStorageBuilder {
    let mut b = match section {
        // `[gcs]` present: only what it says, so a stray env var cannot redirect an emulator run.
        Some(_) => GoogleCloudStorageBuilder::new(),
        None => GoogleCloudStorageBuilder::from_env(),
    }
    .with_bucket_name(bucket)
    .with_client_options(options)
    .with_retry(retry)
    .with_http_connector(reported::connector(Kind::Gcs));
    if let Some(s) = section {
        if let Some(endpoint) = &s.endpoint {
            b = b.with_base_url(endpoint.trim_end_matches('/'));
        }
        if let Some(key) = &s.credentials {
            b = b.with_service_account_path(key.to_string_lossy());
        }
        if s.anonymous {
            b = b.with_skip_signature(true);
        }
    }
    b
}

fn s3(
    bucket: &str,
    section: Option<&S3Section>,
    options: ClientOptions,
    retry: RetryConfig,
) -> AmazonS3Builder {
    let mut b = AmazonS3Builder::from_env()
        .with_bucket_name(bucket)
        .with_client_options(options)
        .with_retry(retry)
        .with_http_connector(reported::connector(Kind::S3));
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
    b
}
