//! Asking each store once whether it has credentials, before any per-shard request.
//!
//! Without this, a `gs://` dataset on a machine with no credentials (no key, no metadata
//! server) fails late and slowly: object_store fetches the token afresh for every request and
//! retries each fetch for minutes, so `shardd check` printed retry lines for each shard and
//! the daemon failed only when a trainer asked. Asking every store's credential provider once
//! (all at once, each within `store.credentials_timeout`, with few retries) turns that into
//! one line within seconds that names the store and the ways to give it credentials. `check`,
//! `warm`, `index` and `serve` ask before their first request; `/readyz` asks again (a cached
//! token answers at once).

use std::time::Duration;

use super::Stores;
use super::build::Probe;

/// A store that cannot get credentials; one line, naming the store and how to fix it.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{store}: no credentials ({cause}); {hint}")]
pub struct CredentialsError {
    pub store: String,
    cause: String,
    hint: &'static str,
}

const GCS_HINT: &str = "give them with GOOGLE_APPLICATION_CREDENTIALS=/path/key.json, \
    [gcs] credentials = \"/path/key.json\" in the config, or the metadata server of a GCE or \
    TPU VM (its service account); a public bucket needs none: [gcs] anonymous = true";
const GCS_SECTION_HINT: &str = "give them with [gcs] credentials = \"/path/key.json\" in the \
    config (with a [gcs] section, GOOGLE_APPLICATION_CREDENTIALS is not read), or the metadata \
    server of a GCE or TPU VM (its service account); a public bucket needs none: \
    [gcs] anonymous = true";
const S3_HINT: &str = "give them with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, \
    AWS_WEB_IDENTITY_TOKEN_FILE with AWS_ROLE_ARN, a container credentials endpoint \
    (AWS_CONTAINER_CREDENTIALS_RELATIVE_URI), or the instance metadata service of an EC2 \
    instance (its role); a public bucket needs none: [s3] anonymous = true";

impl Stores {
    /// Asks every store that signs its requests for its credentials, all at once, each
    /// within `store.credentials_timeout`. The first store (by name) that has none is the
    /// error.
    pub async fn check_credentials(&self) -> Result<(), CredentialsError> {
        let timeout = self.credentials_timeout;
        let checks = self.buckets.values().map(|b| async move {
            let (asked, hint) = match &b.probe {
                Probe::Nothing => return Ok(()),
                Probe::Gcs { provider, section } => (
                    ask(provider.get_credential(), timeout)
                        .await
                        .map_err(naming_the_metadata_servers),
                    if *section { GCS_SECTION_HINT } else { GCS_HINT },
                ),
                Probe::S3(provider) => (ask(provider.get_credential(), timeout).await, S3_HINT),
            };
            asked.map_err(|cause| CredentialsError {
                store: b.name.clone(),
                cause,
                hint,
            })
        });
        futures::future::join_all(checks)
            .await
            .into_iter()
            .collect()
    }
}

/// The provider's answer within `timeout`, or why there is none (one line).
async fn ask<T>(
    fetch: impl Future<Output = object_store::Result<T>>,
    timeout: Duration,
) -> Result<(), String> {
    match tokio::time::timeout(timeout, fetch).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(one_line(&e)),
        Err(_) => Err(format!(
            "the credential source did not answer within {timeout:?} (store.credentials_timeout)"
        )),
    }
}

/// A GCS cause from the instance provider, with the addresses it asked: object_store asks
/// the metadata host and, when that fails, the metadata IP, and reports only the second
/// failure, so an operator who set `GCE_METADATA_HOST` would read only the default IP.
fn naming_the_metadata_servers(cause: String) -> String {
    if !cause.contains("computeMetadata") {
        return cause; // a key file or gcloud's application-default credentials
    }
    let var = |name: &str| std::env::var(name).ok(); // as object_store reads them
    let (host, host_from) = match (var("GCE_METADATA_HOST"), var("GCE_METADATA_ROOT")) {
        (Some(h), _) => (h, "GCE_METADATA_HOST"),
        (None, Some(h)) => (h, "GCE_METADATA_ROOT"),
        (None, None) => ("metadata.google.internal".into(), "the default"),
    };
    let (ip, ip_from) = match var("GCE_METADATA_IP") {
        Some(ip) => (ip, "GCE_METADATA_IP"),
        None => ("169.254.169.254".into(), "the default"),
    };
    format!(
        "asked the metadata server at {host} ({host_from}), then at {ip} ({ip_from}); \
         the last answer: {cause}"
    )
}

/// An error and its causes on one line (object_store's own message leaves out the cause
/// that matters, e.g. "connection refused"), its whitespace runs made single spaces.
pub(super) fn one_line(e: &(dyn std::error::Error + 'static)) -> String {
    crate::ops::error_line::one_line(e)
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}
