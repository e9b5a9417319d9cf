//! One sample stream: the plan's shards, read through the host's cache one shard ahead,
//! parsed, shuffled window by window, and written as batch frames.
//!
//! Downloads are not this module's business: the cache loads (once per host) and the
//! prefetcher runs ahead of every stream, fed by the [`ScheduleHandle`] this stream moves as
//! it goes. Backpressure is end to end: the stream writes only as fast as its client reads,
//! and holds (pins) only the shards of its current shuffle window and the one being parsed
//! next. A client that accepts nothing for `server.stall_timeout` ends the stream, which
//! releases its pins.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::UnixStream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use crate::cache::{Cache, FetchError};
use crate::config::Dataset;
use crate::metrics::Metrics;
use crate::plan::{Piece, StreamPlan};
use crate::prefetch::{Plans, ScheduleHandle};
use crate::protocol::{self, End};
use crate::shard::{self, Sample, ShardError};
use crate::shuffle::WindowShuffle;
use crate::sink::Sink;
use crate::status::{Live, Waiting};

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
    #[error("the client accepted no data for server.stall_timeout ({0:?})")]
    Stalled(Duration),
    /// The daemon is shutting down (the stream stopped at a frame boundary).
    #[error("the daemon is shutting down")]
    Shutdown,
    /// The shard does not hold what the manifest says (the daemon checked sizes and ETags
    /// at start; this is a manifest made from other bytes).
    #[error("{0}")]
    Manifest(String),
}

/// One stream to serve.
pub struct Job<'a> {
    pub dataset: &'a Dataset,
    pub plan: StreamPlan,
    /// Stream position to start from (samples an earlier connection delivered).
    pub start: u64,
    /// The stream's registration with the prefetcher.
    pub schedule: ScheduleHandle,
    /// Its entry on the status board.
    pub live: &'a Live,
    /// Stops the stream at its next frame boundary.
    pub shutdown: &'a CancellationToken,
}

/// What every stream shares.
pub struct StreamContext {
    pub cache: Cache,
    pub plans: Arc<Plans>,
    pub metrics: Arc<Metrics>,
    pub stall_timeout: Duration,
}

/// Serves one stream to `sock` through `sink`, from stream position `job.start` (samples
/// already delivered by an earlier connection); returns the END summary once every sample is
/// written, or stops at a frame boundary when `job.shutdown` is cancelled.
///
/// A resume reads from the start of the shuffle window that holds `start`: with a manifest
/// the pieces before it are cut off without reading them; without one, the shards before it
/// are read and their samples dropped (their counts are not known otherwise).
pub async fn pump(
    ctx: &StreamContext,
    job: Job<'_>,
    sock: &UnixStream,
    sink: &mut Sink,
) -> Result<End, StreamError> {
    let Job {
        dataset,
        plan,
        start,
        schedule,
        live,
        shutdown,
    } = job;
    let (pieces, mut order) = resume(plan, dataset.shuffle_buffer, start);
    let mut reader = ShardReader {
        cache: &ctx.cache,
        dataset,
        queue: pieces.into(),
        current: None,
        next: None,
        schedule,
    };
    let mut end = End {
        samples: 0,
        bytes: 0,
    };
    let opened = Instant::now();
    let name = [dataset.name.as_str()];
    let starving = ctx
        .metrics
        .stream_wait_seconds_total
        .with_label_values(&name);
    let waiting_on_client = ctx
        .metrics
        .client_wait_seconds_total
        .with_label_values(&name);
    let samples_sent = ctx.metrics.samples_sent_total.with_label_values(&name);
    let bytes_sent = ctx.metrics.bytes_sent_total.with_label_values(&name);
    loop {
        while order.wants_more() {
            let waited = Instant::now();
            live.waiting(Waiting::Data);
            let next = tokio::select! {
                next = reader.next() => next,
                _ = shutdown.cancelled() => return Err(StreamError::Shutdown),
            };
            live.waiting(Waiting::Nothing);
            starving.inc_by(waited.elapsed().as_secs_f64());
            order.push(next?);
        }
        let Some(mut window) = order.next_window() else {
            return Ok(end);
        };
        while !window.is_empty() {
            if shutdown.is_cancelled() {
                return Err(StreamError::Shutdown);
            }
            let (parts, sent) = protocol::encode_batch(&mut window).map_err(StreamError::Encode)?;
            let sending = Instant::now();
            live.waiting(Waiting::Client);
            let send = tokio::time::timeout(ctx.stall_timeout, sink.send(sock, &parts));
            let mut send = std::pin::pin!(send);
            // While the client takes this batch, load the next window's shards, so that a
            // window boundary costs no wait (only the reading is cancelled if the send ends
            // first, and `ShardReader::next` is cancel-safe).
            let mut failed = None;
            let sent_result = loop {
                if !order.wants_more() {
                    break send.await;
                }
                tokio::select! {
                    r = &mut send => break r,
                    shard = reader.next() => match shard {
                        Ok(shard) => order.push(shard),
                        // Finish this frame first: the client can only be told why (an
                        // ERROR frame) at a frame boundary.
                        Err(e) => {
                            failed = Some(e);
                            break send.await;
                        }
                    },
                }
            };
            // Time in the send is time the client had data waiting (the socket was full).
            live.waiting(Waiting::Nothing);
            waiting_on_client.inc_by(sending.elapsed().as_secs_f64());
            sent_result
                .map_err(|_| StreamError::Stalled(ctx.stall_timeout))?
                .map_err(StreamError::Client)?;
            if end.samples == 0 {
                ctx.metrics
                    .first_sample_seconds
                    .with_label_values(&name)
                    .observe(opened.elapsed().as_secs_f64());
            }
            let bytes: u64 = sent.iter().map(|s| s.payload_len() as u64).sum();
            end.samples += sent.len() as u64;
            end.bytes += bytes;
            samples_sent.inc_by(sent.len() as u64);
            bytes_sent.inc_by(bytes);
            live.sent(sent.len() as u64, bytes);
            if let Some(e) = failed {
                return Err(e);
            }
        }
    }
}

/// Sets a stream up to start at `start`: the pieces to read from the start of the shuffle
/// window that holds it (with sample counts, the pieces before it are cut off unread;
/// without, they are read and their samples dropped), and the sample order that skips what
/// comes before `start`.
fn resume(plan: StreamPlan, window: usize, start: u64) -> (Vec<Piece>, SampleOrder) {
    let mut shuffle = WindowShuffle::new(plan.stream_key, window);
    let window_start = shuffle.seek(start);
    let (pieces, discard) = match plan.samples {
        Some(_) => (skip_samples(plan.pieces, window_start), 0),
        None => (plan.pieces, window_start),
    };
    let order = SampleOrder {
        shuffle,
        loaded: VecDeque::new(),
        done: false,
        discard,
        skip: (start - window_start) as usize,
    };
    (pieces, order)
}

/// The stream's sample order, with no I/O: shards' samples go in, in plan order, and come out
/// as permuted windows of `shuffle_buffer` samples (see `shuffle.rs`).
struct SampleOrder {
    shuffle: WindowShuffle,
    loaded: VecDeque<Sample>,
    /// No more shards will come.
    done: bool,
    /// Samples to drop as they come in, before the first window (a resume without counts).
    discard: u64,
    /// Samples to drop from the front of the first window (a resume inside it).
    skip: usize,
}

impl SampleOrder {
    /// Whether another shard's samples are needed before the next window can be cut.
    fn wants_more(&self) -> bool {
        !self.done && (self.discard > 0 || self.loaded.len() < self.shuffle.next_len())
    }

    /// The next shard's samples, or `None` when the plan has no more shards.
    fn push(&mut self, shard: Option<Vec<Sample>>) {
        match shard {
            Some(samples) => {
                let drop = (self.discard.min(samples.len() as u64)) as usize;
                self.discard -= drop as u64;
                self.loaded.extend(samples.into_iter().skip(drop));
            }
            None => self.done = true,
        }
    }

    /// The next window, permuted; `None` at the end of the stream.
    fn next_window(&mut self) -> Option<VecDeque<Sample>> {
        if self.loaded.is_empty() {
            return None;
        }
        let take = self.shuffle.next_len().min(self.loaded.len());
        let mut window: Vec<Sample> = self.loaded.drain(..take).collect();
        self.shuffle.permute(&mut window);
        let mut window: VecDeque<Sample> = window.into();
        window.drain(..std::mem::take(&mut self.skip).min(window.len()));
        Some(window)
    }
}

/// Reads the plan's shards in order through the cache, the next one pinned and parsed while
/// the current one is sent. Dropping it aborts what is in flight and releases its pins.
///
/// The next shard starts loading only once the current one is ready: started together, the
/// next could take the cache space the current one needs, and a stream would wait (or fail
/// with `cache_full`) for a shard it does not need yet. The prefetcher loads further ahead
/// without taking space from anyone.
struct ShardReader<'a> {
    cache: &'a Cache,
    dataset: &'a Dataset,
    queue: VecDeque<Piece>,
    /// The shard `next` returns, loading.
    current: Option<ShardTask>,
    /// The one after it, loading once the current one is ready.
    next: Option<ShardTask>,
    schedule: ScheduleHandle,
}

type ShardTask = AbortOnDropHandle<Result<Vec<Sample>, StreamError>>;

impl ShardReader<'_> {
    /// The next shard's samples, or `None` after the last shard. Cancel-safe: a call dropped
    /// while waiting leaves the shard to the next call.
    async fn next(&mut self) -> Result<Option<Vec<Sample>>, StreamError> {
        if self.current.is_none() {
            self.current = self.next.take().or_else(|| self.start());
        }
        let Some(current) = self.current.as_mut() else {
            return Ok(None);
        };
        let done = current.await;
        self.current = None;
        let samples =
            done.map_err(|e| StreamError::Internal(format!("shard task failed: {e}")))??;
        self.next = self.start();
        // Only now is the shard behind this stream: until its bytes are pinned (held by its
        // samples) the schedule keeps it at distance 0, safe from eviction.
        self.schedule.advance();
        Ok(Some(samples))
    }

    fn start(&mut self) -> Option<ShardTask> {
        let piece = self.queue.pop_front()?;
        let shard = self.dataset.shards[piece.shard].clone();
        let cache = self.cache.clone();
        Some(AbortOnDropHandle::new(tokio::spawn(async move {
            let bytes = cache.get(&shard).await?;
            let url: Arc<str> = Arc::from(shard.as_str());
            let mut samples = tokio::task::spawn_blocking(move || shard::parse(&bytes, &url))
                .await
                .map_err(|e| StreamError::Internal(format!("{shard}: parsing failed: {e}")))??;
            let end = piece.end.unwrap_or(samples.len() as u64);
            if end > samples.len() as u64 {
                return Err(StreamError::Manifest(format!(
                    "{shard}: the manifest counts at least {end} samples, the shard has {}",
                    samples.len()
                )));
            }
            samples.truncate(end as usize);
            samples.drain(..piece.start as usize);
            Ok(samples)
        })))
    }
}

/// Cuts the first `n` samples off a list of bounded pieces.
fn skip_samples(pieces: Vec<Piece>, mut n: u64) -> Vec<Piece> {
    let mut out = Vec::with_capacity(pieces.len());
    for mut p in pieces {
        let len = p.end.map_or(u64::MAX, |e| e - p.start);
        if n >= len {
            n -= len;
            continue;
        }
        p.start += n;
        n = 0;
        out.push(p);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Topology;
    use crate::plan::{Shape, StreamRequest, plan_stream};
    use crate::shuffle::SplitMix64;

    /// What a stream delivers from `start`, as the pump orders it, with the reader replaced
    /// by samples named after their (shard, index).
    fn deliver(plan: &StreamPlan, counts: &[u64], window: usize, start: u64) -> Vec<String> {
        let (pieces, mut order) = resume(plan.clone(), window, start);
        let url: Arc<str> = Arc::from("u");
        let mut queue: VecDeque<Piece> = pieces.into();
        let mut out = Vec::new();
        loop {
            while order.wants_more() {
                order.push(queue.pop_front().map(|p| {
                    (p.start..p.end.unwrap_or(counts[p.shard]))
                        .map(|i| Sample {
                            key: format!("s{}-{i}", p.shard),
                            url: url.clone(),
                            fields: Vec::new(),
                        })
                        .collect()
                }));
            }
            match order.next_window() {
                Some(w) => out.extend(w.into_iter().map(|s| s.key)),
                None => return out,
            }
        }
    }

    /// Resume anywhere (0, inside windows, at window and shard edges, the end) gives exactly
    /// the rest of the uninterrupted stream, in both plan modes, for random topologies.
    #[test]
    fn resume_at_any_position_continues_exactly() {
        let mut rng = SplitMix64::new(77);
        for case in 0..60 {
            let shards = 1 + rng.below(12) as usize;
            let counts: Vec<u64> = (0..shards).map(|_| rng.below(30)).collect();
            let hosts = 1 + rng.below(3) as u32;
            let per_host = 1 + rng.below(3) as u32;
            let workers = 1 + rng.below(3) as u32;
            let window = 1 + rng.below(25) as usize;
            let host = Topology {
                index: rng.below(hosts as u64) as u32,
                count: hosts,
            };
            let req = StreamRequest {
                seed: rng.next_u64(),
                epoch: rng.below(5),
                rank: host.index * per_host + rng.below(per_host as u64) as u32,
                world_size: hosts * per_host,
                worker: rng.below(workers as u64) as u32,
                num_workers: workers,
            };
            for exact in [true, false] {
                let shape = Shape {
                    counts: exact.then_some(&counts[..]),
                    ..Shape::shards(shards)
                };
                let plan = plan_stream(shape, host, &req).unwrap();
                let full = deliver(&plan, &counts, window, 0);
                if let Some(n) = plan.samples {
                    assert_eq!(full.len() as u64, n, "case {case}");
                }
                for start in 0..=full.len() {
                    assert_eq!(
                        deliver(&plan, &counts, window, start as u64),
                        full[start..],
                        "case {case} exact {exact} start {start}"
                    );
                }
            }
        }
    }
}
