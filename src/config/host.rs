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
        "{key} = \"auto\": {var} is not set and the metadata server at {server} ({server_from}) {why}"
    )]
    NotFound {
        key: &'static str,
        var: &'static str,
        server: String,
        /// Where that address came from: `GCE_METADATA_HOST`, or the default.
        server_from: &'static str,
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
    let mut found = Vec::new(); // where each "auto" value came from, for the log
    if config.host_auto.index {
        let (index, from) = find(
            "host.index",
            "SHARDD_HOST_INDEX",
            "agent-worker-number",
            |text| text.trim().to_string(),
        )
        .await?;
        config.host.index = index;
        found.push(format!("index: {from}"));
    }
    if config.host_auto.count {
        let (count, from) = find(
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
        config.host.count = count;
        found.push(format!("count: {from}"));
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
            from = found.join("; "),
            "found this host's place"
        );
    }
    Ok(())
}

/// The value, and where it came from (the variable, or the metadata server's attribute).
async fn find(
    key: &'static str,
    var: &'static str,
    attribute: &str,
    read: impl Fn(&str) -> String,
) -> Result<(u32, String), HostError> {
    let (source_name, value) = match std::env::var(var) {
        Ok(v) => (var.to_string(), v),
        Err(_) => {
            let (server, server_from) = match std::env::var("GCE_METADATA_HOST") {
                Ok(server) => (server, "GCE_METADATA_HOST"),
                Err(_) => (METADATA.to_string(), "the default"),
            };
            let text = metadata(&server, attribute)
                .await
                .map_err(|why| HostError::NotFound {
                    key,
                    var,
                    server: server.clone(),
                    server_from,
                    why,
                })?;
            (format!("the metadata server's {attribute}"), read(&text))
        }
    };
    match value.trim().parse() {
        Ok(n) => Ok((n, source_name)),
        Err(_) => Err(HostError::NotANumber {
            key,
            source_name,
            value,
        }),
    }
}

/// The attribute's value, or what the server did instead, as the end of a sentence that
/// starts with the server's address ("did not answer within 5s", "answered 404 Not Found
/// for agent-worker-number").
async fn metadata(server: &str, attribute: &str) -> Result<String, String> {
    let url = format!("http://{server}{ATTRIBUTES}/{attribute}");
    let failed = |e: reqwest::Error| {
        if e.is_timeout() {
            format!("did not answer within {TIMEOUT:?}")
        } else {
            // The innermost cause ("Connection refused (os error 111)"): reqwest's outer
            // ones repeat the URL and say only that sending failed.
            let mut cause: &dyn std::error::Error = &e;
            while let Some(inner) = cause.source() {
                cause = inner;
            }
            format!("could not be reached: {cause}")
        }
    };
    let client = reqwest::Client::builder()
        .timeout(TIMEOUT)
        .build()
        .map_err(|e| e.to_string())?;
    let response = client
        .get(&url)
        .header("Metadata-Flavor", "Google")
        .send()
        .await
        .map_err(failed)?;
    if !response.status().is_success() {
        return Err(format!(
            "answered {} for {attribute} (is this a TPU VM?)",
            response.status()
        ));
    }
    response.text().await.map_err(failed)
}
