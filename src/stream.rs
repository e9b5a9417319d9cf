//! One sample stream: the plan's shards, fetched a few ahead, parsed, shuffled window by
//! window, and written as batch frames. Backpressure is end to end: the stream writes only as
//! fast as the client reads, and fetches at most `cache.prefetch_shards` shards ahead of what
//! it is sending, so memory is one shuffle window of sample descriptors plus those shards.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use tokio::net::UnixStream;
use tokio_util::task::AbortOnDropHandle;

use crate::cache::{Cache, FetchError};
use crate::config::Dataset;
use crate::metrics::Metrics;
use crate::plan::StreamPlan;
use crate::protocol::{self, End};
use crate::shard::{self, Sample, ShardError};
use crate::shuffle::WindowShuffle;
use crate::sink::Sink;
use crate::store::Stores;

#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    #[error(transparent)]
    Fetch(#[from] FetchError),
    #[error(transparent)]
    Shard(#[from] ShardError),
    #[error("{0}")]
    Encode(String),
    /// A bug (a panic in a task): fails this stream, never the daemon.
    #[error("internal error: {0}")]
    Internal(String),
    /// Writing to the client failed: it is gone, there is nobody to tell.
    #[error("client connection lost: {0}")]
    Client(std::io::Error),
}

/// What every stream shares.
pub struct StreamContext {
    pub cache: Arc<Cache>,
    pub stores: Arc<Stores>,
    pub metrics: Arc<Metrics>,
    pub prefetch_shards: usize,
}

/// Serves one stream to `sock` through `sink`; returns the END summary once every sample is
/// written.
pub async fn pump(
    ctx: &StreamContext,
    dataset: &Dataset,
    plan: StreamPlan,
    sock: &UnixStream,
    sink: &mut Sink,
) -> Result<End, StreamError> {
    let mut loader = ShardLoader {
        ctx,
        dataset,
        queue: plan.shards.into(),
        in_flight: VecDeque::new(),
    };
    let mut shuffle = WindowShuffle::new(plan.stream_key, dataset.shuffle_buffer);
    let mut loaded: VecDeque<Sample> = VecDeque::new();
    let mut end = End {
        samples: 0,
        bytes: 0,
    };
    loop {
        let want = shuffle.next_len();
        while loaded.len() < want {
            let waited = Instant::now();
            let next = loader.next().await;
            ctx.metrics
                .stream_wait_seconds_total
                .inc_by(waited.elapsed().as_secs_f64());
            match next? {
                Some(samples) => loaded.extend(samples),
                None => break,
            }
        }
        if loaded.is_empty() {
            return Ok(end);
        }
        let take = want.min(loaded.len());
        let mut window: Vec<Sample> = loaded.drain(..take).collect();
        shuffle.permute(&mut window);
        let mut window: VecDeque<Sample> = window.into();
        while !window.is_empty() {
            let (parts, sent) = protocol::encode_batch(&mut window).map_err(StreamError::Encode)?;
            sink.send(sock, &parts).await.map_err(StreamError::Client)?;
            let bytes: u64 = sent.iter().map(|s| s.payload_len() as u64).sum();
            end.samples += sent.len() as u64;
            end.bytes += bytes;
            ctx.metrics.samples_sent_total.inc_by(sent.len() as u64);
            ctx.metrics.bytes_sent_total.inc_by(bytes);
        }
    }
}

/// Fetches and parses the plan's shards in order, a few ahead. Dropping it aborts what is
/// still in flight.
struct ShardLoader<'a> {
    ctx: &'a StreamContext,
    dataset: &'a Dataset,
    queue: VecDeque<usize>,
    in_flight: VecDeque<AbortOnDropHandle<Result<Vec<Sample>, StreamError>>>,
}

impl ShardLoader<'_> {
    /// The next shard's samples, or `None` after the last shard.
    async fn next(&mut self) -> Result<Option<Vec<Sample>>, StreamError> {
        self.top_up();
        let Some(task) = self.in_flight.pop_front() else {
            return Ok(None);
        };
        let samples = task
            .await
            .map_err(|e| StreamError::Internal(format!("shard task failed: {e}")))??;
        self.top_up();
        Ok(Some(samples))
    }

    /// Starts fetches until `prefetch_shards` are in flight. The first one is always started
    /// (the stream needs it); further ones only while the cache is under its size limit.
    fn top_up(&mut self) {
        while self.in_flight.len() < self.ctx.prefetch_shards {
            if !self.in_flight.is_empty() && !self.ctx.cache.budget().has_room() {
                return;
            }
            let Some(index) = self.queue.pop_front() else {
                return;
            };
            let shard = &self.dataset.shards[index];
            let source = self.ctx.stores.source(shard);
            let url: Arc<str> = Arc::from(shard.as_str());
            let cache = self.ctx.cache.clone();
            self.in_flight
                .push_back(AbortOnDropHandle::new(tokio::spawn(async move {
                    let bytes = cache.fetch(source, &url).await?;
                    let what = url.clone();
                    tokio::task::spawn_blocking(move || shard::parse(&bytes, &url))
                        .await
                        .map_err(|e| StreamError::Internal(format!("{what}: parsing failed: {e}")))?
                        .map_err(StreamError::from)
                })));
        }
    }
}
