//! `host.index = "auto"` / `host.count = "auto"`: which host of the job this is, found at
//! start so that one config serves every VM of a TPU slice.
//!
//! In order: the environment (`SHARDD_HOST_INDEX`, `SHARDD_HOST_COUNT`: a DaemonSet or a
//! startup script can set them), then the TPU VM metadata server (`agent-worker-number`, and
//! the entries of `worker-network-endpoints`, comma-separated), at `GCE_METADATA_HOST` when
//! set, else `metadata.google.internal`. Neither answering is a clear error.
//!
//! `host.index = "from-clients"` (GKE: one DaemonSet config for every node): the index is
//! learned from the streams instead ([`crate::serve::learned_host`]); here, only
//! `SHARDD_HOST_INDEX` can still fix it, and the datasets' `warm = true` is put off until a
//! stream says which host this is.

use std::time::Duration;

use crate::config::Config;

/// Where this host sits among the hosts of the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Topology {
    pub index: u32,
    pub count: u32,
}

impl Topology {
    pub fn check(&self) -> Result<(), String> {
        if self.count == 0 {
            return Err("host.count must be at least 1".into());
        }
        if self.index >= self.count {
            return Err(format!(
                "host.index {} must be less than host.count {}",
                self.index, self.count
            ));
        }
        Ok(())
    }
}

/// `host.index = "from-clients"`.
pub const FROM_CLIENTS: &str = "from-clients";

const METADATA: &str = "metadata.google.internal";
const ATTRIBUTES: &str = "/computeMetadata/v1/instance/attributes";
const TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum HostError {
    #[error(
        "{key} = \"auto\": {var} is not set and the metadata server at {server} did not answer: {why}"
    )]
    NotFound {
        key: &'static str,
        var: &'static str,
        server: String,
        why: String,
    },
    #[error("{key} = \"auto\": {source_name} says {value:?}, which is not a number")]
    NotANumber {
        key: &'static str,
        source_name: String,
        value: String,
    },
    #[error("{0}")]
    Invalid(String),
}

/// Fills in `config.host` where it is `"auto"`, and checks the result.
pub async fn resolve(config: &mut Config) -> Result<(), HostError> {
    if config.host_auto.from_clients
        && let Ok(value) = std::env::var("SHARDD_HOST_INDEX")
    {
        // Set by whoever knows better (a webhook, a sidecar, a script): a fixed index.
        config.host.index = value.trim().parse().map_err(|_| HostError::NotANumber {
            key: "host.index",
            source_name: "SHARDD_HOST_INDEX".into(),
            value,
        })?;
        config.host_auto.from_clients = false;
    }
    if config.host_auto.index {
        config.host.index = find(
            "host.index",
            "SHARDD_HOST_INDEX",
            "agent-worker-number",
            |text| text.trim().to_string(),
        )
        .await?;
    }
    if config.host_auto.count {
        config.host.count = find(
            "host.count",
            "SHARDD_HOST_COUNT",
            "worker-network-endpoints",
            |text| {
                text.split(',')
                    .filter(|e| !e.trim().is_empty())
                    .count()
                    .to_string()
            },
        )
        .await?;
    }
    config.host.check().map_err(HostError::Invalid)?;
    if config.host_auto.from_clients {
        // Until a stream says which host this is, there is no share to check or warm: the
        // datasets' `warm = true` waits for the first stream (`adopt`).
        let mut warm = Vec::new();
        for d in config.datasets.values_mut() {
            if std::mem::take(&mut d.warm) {
                warm.push(d.name.clone());
            }
        }
        config.deferred_warm = warm;
        tracing::info!(
            count = config.host.count,
            "host.index = \"from-clients\": this host's place is learned from the first stream (rank / (world_size / host.count))"
        );
    } else if config.host_auto != Default::default() {
        tracing::info!(
            index = config.host.index,
            count = config.host.count,
            "found this host's place"
        );
    }
    Ok(())
}

async fn find(
    key: &'static str,
    var: &'static str,
    attribute: &str,
    read: impl Fn(&str) -> String,
) -> Result<u32, HostError> {
    let (source_name, value) = match std::env::var(var) {
        Ok(v) => (var.to_string(), v),
        Err(_) => {
            let server = std::env::var("GCE_METADATA_HOST").unwrap_or_else(|_| METADATA.into());
            let text = metadata(&server, attribute)
                .await
                .map_err(|why| HostError::NotFound {
                    key,
                    var,
                    server: server.clone(),
                    why,
                })?;
            (format!("the metadata server's {attribute}"), read(&text))
        }
    };
    value.trim().parse().map_err(|_| HostError::NotANumber {
        key,
        source_name,
        value,
    })
}

async fn metadata(server: &str, attribute: &str) -> Result<String, String> {
    let url = format!("http://{server}{ATTRIBUTES}/{attribute}");
    let client = reqwest::Client::builder()
        .timeout(TIMEOUT)
        .build()
        .map_err(|e| e.to_string())?;
    let response = client
        .get(&url)
        .header("Metadata-Flavor", "Google")
        .send()
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    if !response.status().is_success() {
        return Err(format!("{url}: HTTP {}", response.status()));
    }
    response.text().await.map_err(|e| format!("{url}: {e}"))
}
