//! What the daemon is doing, for `/status`, `shardd status` and `/readyz`: the open streams
//! (with their position, rates and what they wait on), the datasets, the cache.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::cache::Cache;
use crate::config::Config;

/// How long a readiness verdict is reused (each check asks every store once).
const READY_FOR: Duration = Duration::from_secs(5);

/// The daemon's live state, shared by the server (which registers streams) and the HTTP side.
pub struct Board {
    config: Arc<Config>,
    cache: Cache,
    learned: Arc<crate::serve::learned_host::Learned>,
    streams: Mutex<BTreeMap<u64, Arc<Live>>>,
    next_id: AtomicU64,
    ready: tokio::sync::Mutex<Option<(Instant, Result<(), String>)>>,
}

/// What one open stream is doing; its pump updates the counters.
pub struct Live {
    pub dataset: String,
    pub epoch: u64,
    pub rank: u32,
    pub worker: u32,
    pub peer_pid: Option<i32>,
    pub peer_uid: Option<u32>,
    started: Instant,
    pub samples: AtomicU64,
    pub bytes: AtomicU64,
    position: AtomicU64,
    waiting: AtomicU8,
}

/// What a stream is waiting on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Waiting {
    Nothing = 0,
    /// Shard data (a download, the cache, parsing): the trainer starves.
    Data = 1,
    /// The client to take what is ready: the trainer is the bottleneck.
    Client = 2,
    /// The client took nothing for `server.stall_timeout`: the stream let go of its shards
    /// and waits for the client to read again (a paused trainer).
    Parked = 3,
}

impl Live {
    pub fn waiting(&self, on: Waiting) {
        self.waiting.store(on as u8, Ordering::Relaxed);
    }

    /// Counts a batch sent.
    pub fn sent(&self, samples: u64, bytes: u64) {
        self.samples.fetch_add(samples, Ordering::Relaxed);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        self.position.fetch_add(samples, Ordering::Relaxed);
    }
}

/// Removes a stream from the board when it ends.
pub struct Registered {
    board: Arc<Board>,
    id: u64,
    pub live: Arc<Live>,
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.board.streams.lock().unwrap().remove(&self.id);
    }
}

/// One stream, as `/status` shows it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StreamStatus {
    pub dataset: String,
    pub epoch: u64,
    pub rank: u32,
    pub worker: u32,
    pub position: u64,
    pub samples_per_second: f64,
    pub bytes_per_second: f64,
    pub waiting_on: String,
    pub peer_pid: Option<i32>,
    pub peer_uid: Option<u32>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DatasetStatus {
    pub name: String,
    pub shards: usize,
    /// Samples in all (from the manifest), when there is one.
    pub samples: Option<u64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Status {
    pub version: String,
    pub host_index: u32,
    pub host_count: u32,
    pub uptime_seconds: f64,
    pub datasets: Vec<DatasetStatus>,
    pub cache: crate::cache::Usage,
    pub streams: Vec<StreamStatus>,
    /// How the host's requests to each bucket are paced: a trainer that waits on `data`
    /// while its bucket pushes back waits on the store.
    #[serde(default)]
    pub stores: Vec<StoreStatus>,
}

/// One bucket, as `/status` shows it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StoreStatus {
    /// `gs://bucket`.
    pub bucket: String,
    /// The request rate the host holds itself to; `None`: no limit.
    pub request_rate_limit: Option<f64>,
    /// Requests waiting for the rate, and how many of them a trainer waits for.
    pub requests_waiting: usize,
    pub urgent_requests_waiting: usize,
    /// How the store last pushed back (`throttled`, `unavailable`, `timeout`), if it has...
    pub last_pushback: Option<String>,
    /// ...and how long ago.
    pub last_pushback_seconds_ago: Option<f64>,
}

impl Board {
    pub fn new(
        config: Arc<Config>,
        cache: Cache,
        learned: Arc<crate::serve::learned_host::Learned>,
    ) -> Arc<Board> {
        Arc::new(Board {
            config,
            cache,
            learned,
            streams: Mutex::new(BTreeMap::new()),
            next_id: AtomicU64::new(0),
            ready: tokio::sync::Mutex::new(None),
        })
    }

    pub fn register(
        self: &Arc<Self>,
        dataset: &str,
        epoch: u64,
        rank: u32,
        worker: u32,
        start: u64,
        peer: Option<tokio::net::unix::UCred>,
    ) -> Registered {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let live = Arc::new(Live {
            dataset: dataset.into(),
            epoch,
            rank,
            worker,
            peer_pid: peer.and_then(|p| p.pid()),
            peer_uid: peer.map(|p| p.uid()),
            started: Instant::now(),
            samples: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            position: AtomicU64::new(start),
            waiting: AtomicU8::new(0),
        });
        self.streams.lock().unwrap().insert(id, live.clone());
        Registered {
            board: self.clone(),
            id,
            live,
        }
    }

    pub fn status(&self, uptime: Duration) -> Status {
        let streams = self.streams.lock().unwrap();
        let host = crate::serve::learned_host::current(&self.config, &self.learned);
        Status {
            version: env!("CARGO_PKG_VERSION").into(),
            host_index: host.index,
            host_count: host.count,
            uptime_seconds: uptime.as_secs_f64(),
            datasets: self
                .config
                .datasets
                .values()
                .map(|d| DatasetStatus {
                    name: d.name.clone(),
                    shards: d.shards.len(),
                    samples: d.counts.as_ref().map(|c| c.iter().sum()),
                })
                .collect(),
            cache: self.cache.usage(),
            stores: self
                .cache
                .stores()
                .pacing()
                .into_iter()
                .map(|(bucket, p)| StoreStatus {
                    bucket: bucket.to_string(),
                    request_rate_limit: p.rate,
                    requests_waiting: p.waiting,
                    urgent_requests_waiting: p.urgent_waiting,
                    last_pushback: p.last_pushback.map(|(how, _)| how.label().to_string()),
                    last_pushback_seconds_ago: p.last_pushback.map(|(_, ago)| ago.as_secs_f64()),
                })
                .collect(),
            streams: streams
                .values()
                .map(|s| {
                    let secs = s.started.elapsed().as_secs_f64().max(1e-6);
                    StreamStatus {
                        dataset: s.dataset.clone(),
                        epoch: s.epoch,
                        rank: s.rank,
                        worker: s.worker,
                        position: s.position.load(Ordering::Relaxed),
                        samples_per_second: s.samples.load(Ordering::Relaxed) as f64 / secs,
                        bytes_per_second: s.bytes.load(Ordering::Relaxed) as f64 / secs,
                        waiting_on: match s.waiting.load(Ordering::Relaxed) {
                            1 => "data",
                            2 => "client",
                            3 => "parked",
                            _ => "nothing",
                        }
                        .into(),
                        peer_pid: s.peer_pid,
                        peer_uid: s.peer_uid,
                    }
                })
                .collect(),
        }
    }

    /// Whether the daemon can serve: every store can get its credentials, the cache directory
    /// is usable and every dataset's store answers for its first shard. Checked for real, at
    /// most every few seconds, in a task of its own: a probe that gives up sooner (a kubelet
    /// waits 1 s) must not cancel a check that a paced or throttled store makes slow, or
    /// no check would ever finish.
    pub async fn ready(self: &Arc<Self>) -> Result<(), String> {
        let board = self.clone();
        tokio::spawn(async move { board.ready_now().await })
            .await
            .unwrap_or_else(|e| Err(format!("the readiness check failed: {e}")))
    }

    async fn ready_now(&self) -> Result<(), String> {
        let mut cached = self.ready.lock().await;
        if let Some((at, verdict)) = cached.as_ref()
            && at.elapsed() < READY_FOR
        {
            return verdict.clone();
        }
        let verdict = self.check().await;
        *cached = Some((Instant::now(), verdict.clone()));
        verdict
    }

    async fn check(&self) -> Result<(), String> {
        // Credentials first: a store that lost them (a revoked key, a metadata server gone)
        // says so in one line, rather than as a HEAD that times out.
        let stores = self.cache.stores();
        stores
            .check_credentials()
            .await
            .map_err(|e| e.to_string())?;
        let dir = self.config.cache_dir.join("tmp");
        let usable = tokio::task::spawn_blocking(move || {
            let probe = dir.join(format!(".ready-{}", std::process::id()));
            std::fs::write(&probe, b"").and_then(|()| std::fs::remove_file(&probe))
        })
        .await
        .map_err(|e| e.to_string())?;
        usable.map_err(|e| format!("cache directory not writable: {e}"))?;
        for d in self.config.datasets.values() {
            let first = &d.shards[0];
            match tokio::time::timeout(READY_FOR, self.cache.stores().version(first)).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return Err(format!("dataset {}: {e}", d.name)),
                Err(_) => {
                    return Err(format!(
                        "dataset {}: {first}: no answer within {READY_FOR:?}",
                        d.name
                    ));
                }
            }
        }
        Ok(())
    }
}
