//! One object_store client per bucket, built from the config's `[store]`, `[gcs]` and `[s3]`
//! sections, and beside it a probe of the same client's credentials (see `credentials.rs`).
//!
//! Every store's HTTP client is ours (`http.rs`): it paces the bucket's requests and retries
//! them while the store pushes back, within `store.retry_timeout` of the first failure;
//! object_store's own retries are off. The whole-request timeout is disabled (shards are
//! large); `store.connect_timeout` and `store.read_timeout` (the longest silence while
//! reading a body) catch stalled connections instead.

use std::path::Path;
use std::sync::Arc;

use object_store::aws::{AmazonS3Builder, AwsCredentialProvider};
use object_store::gcp::{GcpCredentialProvider, GoogleCloudStorageBuilder};
use object_store::{ClientOptions, ObjectStore, RetryConfig};

use super::http::Connector;
use super::notice::Notice;
use super::pacing::Pacer;
use super::reported::Kind;
use super::resign::Resigner;
use crate::config::{Config, GcsSection, S3Section};
use crate::ops::metrics::Metrics;

/// One bucket's store, and how to ask it for credentials.
pub(super) struct Bucket {
    /// `gs://bucket` or `s3://bucket`: how messages name it.
    pub name: String,
    pub store: Arc<dyn ObjectStore>,
    pub probe: Probe,
    /// The host's request rate to the bucket, shared by the store and its probe.
    pub pacer: Arc<Pacer>,
}

/// A credential provider built like the store's, but whose token requests give up sooner
/// (within `store.credentials_timeout`): asking it says quickly whether the store can sign
/// its requests.
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
pub(super) fn bucket(
    scheme: &str,
    name: &str,
    config: &Config,
    metrics: &Arc<Metrics>,
) -> object_store::Result<Bucket> {
    let options = ClientOptions::new()
        .with_timeout_disabled()
        .with_connect_timeout(config.connect_timeout)
        .with_read_timeout(config.read_timeout)
        .with_allow_http(true);
    // Retried in our client (`http.rs`), never again by object_store.
    let retry = RetryConfig {
        max_retries: 0,
        ..Default::default()
    };
    let kind = if scheme == "gs" { Kind::Gcs } else { Kind::S3 };
    let pacer = Arc::new(Pacer::new(config.max_requests_per_second));
    let label = format!("{scheme}://{name}");
    metrics
        .store_request_rate_limit
        .with_label_values(&[&label])
        .set(config.max_requests_per_second.unwrap_or(0.0));
    let resign = Resigner::default();
    let notice = Arc::new(Notice::default());
    let connector = |retry_timeout, most_retries, resign| Connector {
        kind,
        bucket: name.to_string(),
        label: label.clone(),
        pacer: pacer.clone(),
        retry_timeout,
        most_retries,
        resign,
        notice: notice.clone(),
        metrics: metrics.clone(),
    };
    // The probe answers within store.credentials_timeout, after two retries at most, in the
    // credential source's own words (a refused connection, a 404).
    let (main, quick) = (
        connector(config.retry_timeout, None, resign.clone()),
        connector(
            config.retry_timeout.min(config.credentials_timeout),
            Some(2),
            Resigner::default(), // it sends no bucket requests
        ),
    );
    let (store, probe): (Arc<dyn ObjectStore>, Probe) = if scheme == "gs" {
        let section = config.gcs.as_ref();
        let store = gcs(name, section, options.clone(), retry.clone(), main).build()?;
        resign.set(store.credentials().clone());
        let probe = match section {
            Some(s) if s.anonymous => Probe::Nothing,
            _ => Probe::Gcs {
                provider: gcs(name, section, options, retry, quick)
                    .build()?
                    .credentials()
                    .clone(),
                section: section.is_some(),
            },
        };
        (Arc::new(store), probe)
    } else {
        let section = config.s3.as_ref();
        let store = s3(name, section, options.clone(), retry.clone(), main).build()?;
        let probe = match section {
            Some(s) if s.anonymous => Probe::Nothing,
            _ => Probe::S3(
                s3(name, section, options, retry, quick)
                    .build()?
                    .credentials()
                    .clone(),
            ),
        };
        (Arc::new(store), probe)
    };
    Ok(Bucket {
        name: label,
        store,
        probe,
        pacer,
    })
}

/// Whether `[gcs] credentials` names a service account key, in words a user can act on
/// (object_store's own error says "Generic GCS error: GCP credential error: Unable to
/// decode service account file", and never names the config key).
pub(super) fn check_key(path: &Path) -> Result<(), String> {
    let text = std::fs::read(path).map_err(|e| format!("cannot be read: {e}"))?;
    let key: serde_json::Value = serde_json::from_slice(&text)
        .map_err(|e| format!("is not a service account key (not JSON: {e})"))?;
    let missing: Vec<&str> = ["client_email", "private_key", "private_key_id"]
        .into_iter()
        .filter(|field| !key.get(field).is_some_and(|v| v.is_string()))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    let kind = key.get("type").and_then(|t| t.as_str()).unwrap_or("none");
    Err(format!(
        "is not a service account key: it has no {} (its type: {kind}; create one with \
         `gcloud iam service-accounts keys create`)",
        missing.join(", ")
    ))
}

fn gcs(
    bucket: &str,
    section: Option<&GcsSection>,
    options: ClientOptions,
    retry: RetryConfig,
    connector: Connector,
) -> GoogleCloudStorageBuilder {
    let mut b = match section {
        // `[gcs]` present: only what it says, so a stray env var cannot redirect an emulator run.
        Some(_) => GoogleCloudStorageBuilder::new(),
        None => GoogleCloudStorageBuilder::from_env(),
    }
    .with_bucket_name(bucket)
    .with_client_options(options)
    .with_retry(retry)
    .with_http_connector(connector);
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
    connector: Connector,
) -> AmazonS3Builder {
    let mut b = AmazonS3Builder::from_env()
        .with_bucket_name(bucket)
        .with_client_options(options)
        .with_retry(retry)
        .with_http_connector(connector);
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
