//! `host.index = "from-clients"` (GKE: one DaemonSet config for every node, where neither
//! is set): the index is learned from the streams ([`bind`]). Every REQUEST carries the
//! trainer's global `rank` and `world_size`, and host `i` of `count` serves ranks
//! `i·L .. i·L+L-1` with `L = world_size / count`, so the first stream says which host this
//! node is: `rank / L`. The daemon then serves that host's share; a stream of another host's
//! rank is refused (`bad_topology`, naming both) while a stream of the learned host is open.
//! Once no stream is open the next one may teach another index (a new job placed its
//! trainers differently): logged, and the cache keeps what it holds until eviction.
//! `SHARDD_HOST_INDEX`, when set, still fixes the index (`config::host::resolve`).

use std::sync::{Arc, Mutex};

use crate::config::Config;
use crate::plan::Topology;
use crate::protocol::Request;
use crate::serve::server::Daemon;

/// What the streams taught a `"from-clients"` daemon (shared by the daemon and every copy of
/// it serving as the learned host).
pub struct Learned {
    state: Mutex<State>,
}

impl Learned {
    /// `warm`: the datasets with `warm = true`, warmed once the host is known.
    pub fn new(warm: Vec<String>) -> Learned {
        Learned {
            state: Mutex::new(State {
                warm,
                ..Default::default()
            }),
        }
    }
}

impl std::fmt::Debug for Learned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Learned")
    }
}

#[derive(Default)]
struct State {
    bound: Option<Binding>,
    /// Streams (and plan requests) of the bound host in progress.
    open: usize,
    /// Datasets with `warm = true`: warmed once the host is known.
    warm: Vec<String>,
    /// The host whose share was last checked and warmed.
    adopted: Option<Topology>,
    adopting: Option<tokio::task::AbortHandle>,
    /// `shardd_host_index` (-1 until learned) and `shardd_hosts`.
    gauges: Option<(prometheus::IntGauge, prometheus::IntGauge)>,
}

struct Binding {
    host: Topology,
    /// Who taught it, for the refusal of a stream that disagrees.
    by: String,
    /// The daemon with `config.host` set to it, while a connection holds it (weak: it holds
    /// this state).
    daemon: std::sync::Weak<Daemon>,
}

/// The daemon a connection is served by (with this host's place filled in), held for the
/// connection's life.
pub struct Bound {
    pub daemon: Arc<Daemon>,
    _open: Option<Open>,
}

/// Counts an open stream of the bound host.
struct Open(Arc<Learned>);

impl Drop for Open {
    fn drop(&mut self) {
        let mut state = self.0.state.lock().unwrap();
        state.open = state.open.saturating_sub(1);
    }
}

/// Why a request cannot be served by this daemon's host (an ERROR frame's code and message).
#[derive(Debug)]
pub struct Refused {
    pub code: &'static str,
    pub message: String,
}

/// This host's place as the daemon serves it now: with `"from-clients"`, the host learned
/// from the streams (index 0 until the first one).
pub fn current(config: &Config, learned: &Learned) -> Topology {
    if !config.host_auto.from_clients {
        return config.host;
    }
    let state = learned.state.lock().unwrap();
    state.bound.as_ref().map_or(config.host, |b| b.host)
}

/// The daemon that serves `req`: `daemon` itself when its host is fixed; with
/// `host.index = "from-clients"`, the daemon of the host that `req`'s rank is on, learned
/// from the first request (and again from the first one after every stream has ended). A
/// request of another host while a stream of the learned one is open is refused.
pub fn bind(
    daemon: &Arc<Daemon>,
    req: &Request,
    peer: Option<tokio::net::unix::UCred>,
) -> Result<Bound, Refused> {
    let config = &daemon.config;
    let unbound = || Bound {
        daemon: daemon.clone(),
        _open: None,
    };
    if !config.host_auto.from_clients {
        return Ok(unbound());
    }
    let count = config.host.count;
    if req.world_size == 0 || req.rank >= req.world_size || !req.world_size.is_multiple_of(count) {
        // No host to learn: the plan refuses it with the usual message.
        return Ok(unbound());
    }
    let host = Topology {
        index: req.rank / (req.world_size / count),
        count,
    };
    let learned = daemon.learned.clone();
    let mut state = learned.state.lock().unwrap();
    let (index_gauge, count_gauge) = state
        .gauges
        .get_or_insert_with(|| gauges(&daemon.streams.metrics.registry))
        .clone();
    let who = format!(
        "rank {} of world_size {}{}",
        req.rank,
        req.world_size,
        peer.and_then(|p| p.pid())
            .map(|pid| format!(" (pid {pid})"))
            .unwrap_or_default()
    );
    match &state.bound {
        Some(b) if b.host == host => {}
        Some(b) if state.open > 0 => {
            return Err(Refused {
                code: "bad_topology",
                message: format!(
                    "host.index = \"from-clients\": this daemon serves host {} of {count}, learned from the stream of {}; {who} is on host {} of {count}. Every trainer process on a node must be of one host of the job: is host.count ({count}) the number of nodes the job runs on, and does no other job's trainer share this node? (The daemon learns its host again once none of its streams is open.)",
                    b.host.index, b.by, host.index
                ),
            });
        }
        previous => {
            match previous {
                Some(b) => tracing::warn!(
                    from = b.host.index,
                    to = host.index,
                    count,
                    by = %who,
                    "this host's place changed: no stream was open, and a stream of another host came (a new job placed its trainers differently); the cache keeps the old share until it is evicted"
                ),
                None => tracing::info!(
                    index = host.index,
                    count,
                    by = %who,
                    "learned this host's place from the first stream"
                ),
            }
            let bound = as_host(daemon, host);
            if state.adopted != Some(host) {
                if let Some(task) = state.adopting.take() {
                    task.abort();
                }
                let task = tokio::spawn(adopt(bound.clone(), state.warm.clone()));
                state.adopting = Some(task.abort_handle());
                state.adopted = Some(host);
            }
            index_gauge.set(host.index as i64);
            count_gauge.set(count as i64);
            state.bound = Some(Binding {
                host,
                by: who,
                daemon: Arc::downgrade(&bound),
            });
        }
    }
    state.open += 1;
    let binding = state.bound.as_mut().expect("bound above");
    let bound = binding.daemon.upgrade().unwrap_or_else(|| {
        let bound = as_host(daemon, host);
        binding.daemon = Arc::downgrade(&bound);
        bound
    });
    drop(state);
    Ok(Bound {
        daemon: bound,
        _open: Some(Open(learned)),
    })
}

/// `daemon` serving as `host`: the same cache, streams and board.
fn as_host(daemon: &Daemon, host: Topology) -> Arc<Daemon> {
    let mut config = daemon.config.clone();
    config.host = host;
    config.host_auto.from_clients = false;
    let s = &daemon.streams;
    Arc::new(Daemon {
        config,
        streams: crate::serve::stream::StreamContext {
            cache: s.cache.clone(),
            indexes: s.indexes.clone(),
            plans: s.plans.clone(),
            metrics: s.metrics.clone(),
            stall_timeout: s.stall_timeout,
            map_budget: s.map_budget.clone(),
        },
        board: daemon.board.clone(),
        learned: daemon.learned.clone(),
    })
}

/// A host whose place is fixed at start (`host.index` a number, or `"auto"` from the
/// environment or the metadata server) exports it from the start, as a host that learns it
/// from its streams does once it has.
pub fn export_fixed(config: &Config, registry: &prometheus::Registry) {
    if config.host_auto.from_clients {
        return;
    }
    let (index, count) = gauges(registry);
    index.set(config.host.index as i64);
    count.set(config.host.count as i64);
}

fn gauges(registry: &prometheus::Registry) -> (prometheus::IntGauge, prometheus::IntGauge) {
    let gauge = |name: &str, help: &str| {
        let g = prometheus::IntGauge::new(name, help).expect("a valid metric");
        // Registered once per daemon (the state holds them).
        let _ = registry.register(Box::new(g.clone()));
        g
    };
    let index = gauge(
        "host_index",
        "This host's index among the job's hosts (with host.index = \"from-clients\", learned from the streams: -1 until the first).",
    );
    index.set(-1);
    (index, gauge("hosts", "host.count: the hosts of the job."))
}

/// What a daemon does at start for its host's share, done once the host is learned: checks
/// that the share is unchanged since each manifest was written (and learns its CRC-32Cs),
/// then warms the datasets that ask for it. In the background: the first stream does not wait.
async fn adopt(daemon: Arc<Daemon>, warm: Vec<String>) {
    let config = &daemon.config;
    let cache = &daemon.streams.cache;
    let stores = cache.stores();
    for dataset in config.datasets.values() {
        let Some(source) = dataset.manifest.clone() else {
            continue;
        };
        let checked = async {
            let (manifest, at) =
                crate::shard::manifest::load(stores, &source, &dataset.shards).await?;
            let share = crate::plan::warm_shards(dataset.shape(), config.host);
            let share_at: Vec<usize> = share.iter().map(|&i| at[i]).collect();
            crate::serve::daemon::know_crc32c(
                stores,
                &manifest,
                &dataset.shards,
                &share,
                &share_at,
            );
            let urls: Vec<_> = share.iter().map(|&i| dataset.shards[i].clone()).collect();
            crate::shard::manifest::check_unchanged(
                stores,
                &manifest,
                &source,
                &urls,
                &share_at,
                config.max_downloads,
            )
            .await?;
            Ok::<usize, crate::shard::manifest::ManifestError>(urls.len())
        };
        match checked.await {
            Ok(n) => tracing::info!(
                dataset = %dataset.name,
                host = config.host.index,
                checked_shards = n,
                "manifest checked for the learned host's share"
            ),
            Err(e) => tracing::error!(
                dataset = %dataset.name,
                host = config.host.index,
                error = %e,
                "the learned host's share does not match the manifest: re-index the dataset (shardd index)"
            ),
        }
    }
    for name in &warm {
        let Some(dataset) = config.datasets.get(name) else {
            continue;
        };
        let share: Vec<_> = crate::plan::warm_shards(dataset.shape(), config.host)
            .into_iter()
            .map(|i| dataset.shards[i].clone())
            .collect();
        let (mut loaded, mut failed) = (0u64, 0usize);
        let complete =
            crate::serve::prefetch::warm(cache, &share, config.max_downloads, |r| match r {
                Ok(crate::cache::Ensured::Loaded(n)) => loaded += n,
                Ok(_) => {}
                Err(_) => failed += 1,
            })
            .await;
        tracing::info!(
            dataset = %name,
            host = config.host.index,
            shards = share.len(),
            loaded_bytes = loaded,
            failed,
            complete,
            "warmed the cache with the learned host's share"
        );
    }
}
