//! One sample stream: the plan's shards, read through the host's cache one shard ahead,
//! parsed, shuffled window by window, and written as batch frames.
//!
//! A stream reads one or more *lanes*: one dataset's stream, or a mix's sources, interleaved
//! by the mix's order (`mix.rs`). A lane is a list of *runs*: its own plan whole, or after an
//! elastic resume, the rests of the old streams (`elastic.rs`), each read exactly as a
//! `start=` resume of that stream reads it and stopped at its end.
//!
//! Downloads are not this module's business: the cache loads (once per host) and the
//! prefetcher runs ahead of every stream, fed by the [`ScheduleHandle`] this stream moves as
//! it goes. Backpressure is end to end: the stream writes only as fast as its client reads,
//! and holds (pins) only the shards of its current shuffle window and the one being parsed
//! next.
//!
//! **Parking.** A client that takes no byte for `server.stall_timeout` (an evaluation pass, a
//! checkpoint upload, a first XLA compile) is not cut off: its stream *parks*. It drops every
//! shard it holds and keeps only its position (samples in whole frames sent, and how much of
//! the frame in flight went out) and, without a manifest, the sample counts of the shards it
//! has read (8 bytes each): a few KB beside the connection. When the client reads again, the
//! stream is set up again at that position exactly as a `start=` resume is (the order is a
//! pure function of the plan), skipping the counted shards unread, re-encodes the frame that
//! was cut and sends only its rest. A slow reader that keeps taking bytes is never parked.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::net::UnixStream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use crate::cache::{Cache, FetchError, ShardBytes};
use crate::config::Dataset;
use crate::ops::metrics::{Active, Metrics};
use crate::plan::request::Run;
use crate::plan::shuffle::WindowShuffle;
use crate::plan::{Piece, StreamPlan};
use crate::protocol::{self, End, Kind, Part};
use crate::serve::prefetch::{Plans, ScheduleHandle, StreamId};
use crate::serve::sink::{SendError, Sink};
use crate::serve::status::{Live, Waiting};
use crate::shard::sample_index::SampleIndexes;
use crate::shard::{Sample, ShardError};

mod read;
use read::{LaneReader, SampleOrder, ShardReader, skip_counted};

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
    /// The daemon is shutting down (the stream stopped at a frame boundary).
    #[error("the daemon is shutting down")]
    Shutdown,
    /// The shard does not hold what the manifest says (the daemon checked sizes and ETags
    /// at start; this is a manifest made from other bytes).
    #[error("{0}")]
    Manifest(String),
    /// A resume without a manifest asked for a position the stream never reaches (found only
    /// once the whole stream is read: without counts its length is not known before).
    #[error("start {start} is past the end of the stream: it has {samples} samples this epoch")]
    PastEnd { start: u64, samples: u64 },
}

/// A planned lane (`plan::request::Lane`) with its dataset's config looked up: what a stream
/// reads of one dataset, runs of its streams in order.
pub struct ResolvedLane<'a> {
    pub dataset: &'a Dataset,
    pub runs: Vec<Run>,
    /// The shards the same stream reads of it next epoch (dataset indices), for the
    /// prefetcher.
    pub next_epoch: Vec<usize>,
}

/// The pieces reading `run` takes: from the shuffle window that holds its first sample to the
/// one that holds its last (what `shardd plan --from` counts a resume fetching).
pub fn run_pieces(run: &Run, window: usize) -> Vec<Piece> {
    resume(run.plan.clone(), window, run.from, run.to).0
}

/// One stream to serve.
pub struct Job<'a> {
    /// One lane, or a mix's sources (interleaved by `mix`).
    pub lanes: Vec<ResolvedLane<'a>>,
    pub mix: Option<crate::plan::request::Interleave>,
    /// Samples get `__source__` (a mix's, even when one source is left to read).
    pub tag_sources: bool,
    /// Stream position to start from (samples an earlier connection delivered).
    pub start: u64,
    /// Who the stream is, for the prefetcher's schedules (each lane under its dataset).
    pub id: StreamId,
    /// Its entry on the status board.
    pub live: &'a Live,
    /// Stops the stream at its next frame boundary.
    pub shutdown: &'a CancellationToken,
    /// Zero-copy delivery (protocol 5): the connection's maps (`mapped.rs`).
    pub zero_copy: Option<&'a crate::serve::mapped::Maps>,
}

impl Job<'_> {
    /// The payload a frame is cut at: a zero-copy frame carries its mapped fields' words, not
    /// their bytes, so it takes more samples.
    fn batch_target(&self) -> usize {
        match self.zero_copy {
            None => protocol::BATCH_TARGET_BYTES,
            Some(_) => protocol::MAPPED_BATCH_TARGET_BYTES,
        }
    }
}

/// The field naming a mixed stream's source, in every sample of a mix.
static SOURCE: std::sync::LazyLock<Arc<str>> = std::sync::LazyLock::new(|| Arc::from("__source__"));

/// What every stream shares.
pub struct StreamContext {
    pub cache: Cache,
    pub indexes: Arc<SampleIndexes>,
    pub plans: Arc<Plans>,
    pub metrics: Arc<Metrics>,
    pub stall_timeout: Duration,
    /// What zero-copy maps may pin, all connections together.
    pub map_budget: Arc<crate::serve::mapped::MapBudget>,
}

/// Serves one stream to `sock` through `sink`, from stream position `job.start` (samples
/// already delivered by an earlier connection), and ends it with the END frame; returns the
/// END summary, or stops at a frame boundary when `job.shutdown` is cancelled.
///
/// A paused client parks the stream (module docs), as often as it pauses; the END frame
/// waits for the client the same way (holding nothing), for as long as it stays connected.
pub async fn pump(
    ctx: &StreamContext,
    job: Job<'_>,
    sock: &UnixStream,
    sink: &mut Sink,
) -> Result<End, StreamError> {
    let mut end = End {
        samples: 0,
        bytes: 0,
    };
    let opened = Instant::now();
    // Sample counts of the pieces read so far, where the plan has none (no manifest): a
    // stream resumed after a park skips them unread, as with a manifest.
    let mut counts = vec![None; job.lanes[0].runs.first().map_or(0, |r| r.plan.pieces.len())];
    while let Leg::Parked = serve_from(ctx, &job, opened, sock, sink, &mut end, &mut counts).await?
    {
        park(ctx, &job, sock).await?;
    }
    let frame = [Part::Inline(Bytes::from(protocol::json_frame(
        Kind::End,
        &end,
    )))];
    loop {
        match sink.send(sock, &frame, ctx.stall_timeout).await {
            Ok(()) => return Ok(end),
            Err(SendError::Stalled(_)) => park(ctx, &job, sock).await?,
            Err(e) => return Err(send_failed(e)),
        }
    }
}

/// How a stretch of serving ended.
enum Leg {
    /// Every sample is sent.
    Done,
    /// The client took nothing for the stall time; the frame in flight may be cut.
    Parked,
}

/// Serves the stream from where it is (`job.start` + the samples of whole frames sent, in
/// `end`) until it is complete or its client pauses. Everything it holds (shards, samples,
/// the schedules) is dropped when it returns.
///
/// Frames are cut from the stream's sample sequence alone (a frame's worth of bytes or
/// samples from its position), so a frame cut by a park is encoded the same again.
async fn serve_from(
    ctx: &StreamContext,
    job: &Job<'_>,
    opened: Instant,
    sock: &UnixStream,
    sink: &mut Sink,
    end: &mut End,
    counts: &mut [Option<u64>],
) -> Result<Leg, StreamError> {
    let position = job.start + end.samples;
    let (positions, cursor) = match &job.mix {
        None => (vec![position], None),
        Some(m) => (
            m.mix.counts_at(m.key, position),
            Some(m.mix.cursor(m.key, position)),
        ),
    };
    // Where each lane stood when the stream opened: a lane set up again after a park inside
    // a window it had cut before must count as having that window (`has_window`).
    let opened_at = match &job.mix {
        None => vec![job.start],
        Some(m) => m.mix.counts_at(m.key, job.start),
    };
    let mut counts = Some(counts);
    let mut lanes: Vec<LaneReader> = job
        .lanes
        .iter()
        .zip(positions.into_iter().zip(opened_at))
        .map(|(lane, (at, opened_at))| {
            let counts = if job.lanes.len() == 1 {
                counts.take()
            } else {
                None
            };
            LaneReader::new(ctx, job, lane, at, opened_at, counts.unwrap_or(&mut []))
        })
        .collect();
    let mut out = Outbox {
        cursor,
        ..Outbox::default()
    };
    loop {
        out.fill(&mut lanes, job).await?;
        if out.samples.is_empty() {
            return Ok(Leg::Done);
        }
        if job.shutdown.is_cancelled() {
            return Err(StreamError::Shutdown);
        }
        let (parts, sent) = match job.zero_copy {
            None => protocol::encode_batch(&mut out.samples).map_err(StreamError::Encode)?,
            Some(maps) => {
                let batch = protocol::take_batch(&mut out.samples, job.batch_target());
                let parts = maps
                    .encode(&ctx.cache, &batch, || live_urls(&lanes, &out.samples))
                    .map_err(StreamError::Encode)?;
                (parts, batch)
            }
        };
        let sending = Instant::now();
        job.live.waiting(Waiting::Client);
        let send = async {
            if let Some(maps) = job.zero_copy {
                maps.flush(sock, ctx.stall_timeout).await?;
            }
            sink.send(sock, &parts, ctx.stall_timeout).await
        };
        let (sent_result, failed) = loading_ahead(send, &mut lanes).await;
        // Time in the send is time the client had data waiting (the socket was full).
        job.live.waiting(Waiting::Nothing);
        let lane0 = &lanes[0].series;
        lane0.client_wait.inc_by(sending.elapsed().as_secs_f64());
        match sent_result {
            Ok(()) => {
                if let Some(maps) = job.zero_copy {
                    maps.sent();
                }
            }
            // A load that failed meanwhile fails again after the resume, if it still does.
            Err(SendError::Stalled(_)) => return Ok(Leg::Parked),
            Err(e) => return Err(send_failed(e)),
        }
        if end.samples == 0 {
            lane0.first_sample.observe(opened.elapsed().as_secs_f64());
        }
        out.count_sent(&sent, &lanes, end, job);
        if let (
            Some(c),
            Some(crate::plan::request::Interleave {
                scheduled: true, ..
            }),
        ) = (&out.cursor, &job.mix)
        {
            ctx.metrics
                .mix_schedule_entry
                .with_label_values(&[&job.id.dataset])
                .set(c.entry() as i64);
        }
        if let Some(e) = failed {
            return Err(e);
        }
    }
}

/// The samples of the next frame, drawn from the lanes in the stream's order.
#[derive(Default)]
struct Outbox {
    samples: VecDeque<Sample>,
    /// The lane of each sample in `samples`, for the per-dataset counters.
    lanes: VecDeque<usize>,
    bytes: usize,
    /// A mix's order (`None`: one dataset, one lane).
    cursor: Option<crate::plan::mix::EpochCursor>,
    /// A mix's next source, drawn but not yet taken.
    pending: Option<usize>,
}

impl Outbox {
    /// Draws samples until a frame's worth, the end of the stream, or a sample whose window
    /// is not cut yet: the client gets what is ready without waiting for more shards. Where
    /// a frame ends is a function of the position alone (`has_window` says what an unbroken
    /// stream would have cut), so a park re-encodes a mix's frame the same too.
    async fn fill<'a>(
        &mut self,
        lanes: &mut [LaneReader<'a>],
        job: &Job<'a>,
    ) -> Result<(), StreamError> {
        while self.samples.len() < protocol::BATCH_MAX_SAMPLES && self.bytes < job.batch_target() {
            let i = match (self.cursor.as_mut(), self.pending) {
                (None, _) => 0,
                (Some(_), Some(i)) => i,
                (Some(c), None) => match c.next() {
                    Some(i) => i,
                    None => break,
                },
            };
            if !self.samples.is_empty() && !lanes[i].has_window() {
                self.pending = Some(i);
                break;
            }
            self.pending = None;
            match lanes[i].next_sample(job).await? {
                Some(sample) => {
                    self.bytes += sample.payload_len();
                    self.samples.push_back(sample);
                    self.lanes.push_back(i);
                }
                None if self.cursor.is_none() => break,
                None => {
                    return Err(StreamError::Internal(format!(
                        "mix source {} ended before its quota",
                        job.lanes[i].dataset.name
                    )));
                }
            }
        }
        Ok(())
    }

    /// Takes a sent frame's samples off the box and counts them: the END summary, and per
    /// dataset (a mix's sources each count their own), once per frame and lane.
    fn count_sent(
        &mut self,
        sent: &[Sample],
        lanes: &[LaneReader<'_>],
        end: &mut End,
        job: &Job<'_>,
    ) {
        let bytes: u64 = sent.iter().map(|s| s.payload_len() as u64).sum();
        self.bytes -= bytes as usize;
        end.samples += sent.len() as u64;
        end.bytes += bytes;
        let mut per_lane = vec![(0u64, 0u64); lanes.len()];
        for (sample, i) in sent.iter().zip(self.lanes.drain(..sent.len())) {
            per_lane[i].0 += 1;
            per_lane[i].1 += sample.payload_len() as u64;
        }
        for (lane, (samples, bytes)) in lanes.iter().zip(per_lane) {
            lane.series.samples_sent.inc_by(samples);
            lane.series.bytes_sent.inc_by(bytes);
        }
        job.live.sent(sent.len() as u64, bytes);
    }
}

/// The shards a stream still has samples of (to send, in windows, loaded): a zero-copy
/// stream's maps of other shards are of no more use.
fn live_urls(lanes: &[LaneReader<'_>], out: &VecDeque<Sample>) -> Vec<Arc<str>> {
    let mut urls: Vec<Arc<str>> = Vec::new();
    let lanes = lanes
        .iter()
        .flat_map(|l| l.window.iter().chain(l.order.loaded.iter()));
    for s in out.iter().chain(lanes) {
        if urls.last() != Some(&s.url) && !urls.contains(&s.url) {
            urls.push(s.url.clone());
        }
    }
    urls
}

/// A stream's per-dataset series, looked up once.
struct Series {
    starving: prometheus::Counter,
    client_wait: prometheus::Counter,
    samples_sent: prometheus::IntCounter,
    bytes_sent: prometheus::IntCounter,
    first_sample: prometheus::Histogram,
}

impl Series {
    fn new(metrics: &Metrics, dataset: &str) -> Series {
        let name = [dataset];
        Series {
            starving: metrics.stream_wait_seconds_total.with_label_values(&name),
            client_wait: metrics.client_wait_seconds_total.with_label_values(&name),
            samples_sent: metrics.samples_sent_total.with_label_values(&name),
            bytes_sent: metrics.bytes_sent_total.with_label_values(&name),
            first_sample: metrics.first_sample_seconds.with_label_values(&name),
        }
    }
}

/// Reads shards until the next window can be cut (or the plan has no more), waiting for data.
async fn fill(
    order: &mut SampleOrder,
    reader: &mut ShardReader<'_>,
    job: &Job<'_>,
    series: &Series,
) -> Result<(), StreamError> {
    while order.wants_more() {
        let waited = Instant::now();
        job.live.waiting(Waiting::Data);
        let next = tokio::select! {
            next = reader.next() => next,
            _ = job.shutdown.cancelled() => return Err(StreamError::Shutdown),
        };
        job.live.waiting(Waiting::Nothing);
        series.starving.inc_by(waited.elapsed().as_secs_f64());
        order.push(next?);
    }
    Ok(())
}

/// Runs `send` (one frame) while loading the lanes' next windows, so that a window boundary
/// costs no wait (only the reading is cancelled if the send ends first, and
/// `ShardReader::next` is cancel-safe). A load that fails lets the frame finish first: the
/// client can only be told why (an ERROR frame) at a frame boundary.
async fn loading_ahead(
    send: impl Future<Output = Result<(), SendError>>,
    lanes: &mut [LaneReader<'_>],
) -> (Result<(), SendError>, Option<StreamError>) {
    let mut send = std::pin::pin!(send);
    for lane in lanes.iter_mut() {
        while lane.order.wants_more() {
            tokio::select! {
                r = &mut send => return (r, None),
                shard = lane.reader.next() => match shard {
                    Ok(shard) => lane.order.push(shard),
                    Err(e) => return (send.await, Some(e)),
                },
            }
        }
    }
    (send.await, None)
}

fn send_failed(e: SendError) -> StreamError {
    match e {
        SendError::Io(e) => StreamError::Client(e),
        SendError::Stalled(_) => unreachable!("a stall parks the stream"),
        SendError::Resent(what) => StreamError::Internal(what),
    }
}

/// Registers the shards the stream is about to read (then its next epoch's) with the
/// prefetcher. A resumed stream registers only what it still reads, so prefetch and
/// eviction do not count on shards it has passed.
fn open_schedule(
    ctx: &StreamContext,
    job: &Job<'_>,
    lane: &ResolvedLane<'_>,
    pieces: impl Iterator<Item = Piece>,
) -> ScheduleHandle {
    let shards = &lane.dataset.shards;
    let upcoming = pieces
        .map(|p| p.shard)
        .chain(lane.next_epoch.iter().copied());
    // A mix's sources are scheduled apart, under the mix's name and theirs.
    let mut id = job.id.clone();
    if lane.dataset.name != id.dataset {
        id.dataset = format!("{}/{}", id.dataset, lane.dataset.name);
    }
    ctx.plans
        .open(id, upcoming.map(|i| shards[i].clone()).collect())
}

/// Waits, holding nothing, until the client can take data again (or the daemon stops).
async fn park(ctx: &StreamContext, job: &Job<'_>, sock: &UnixStream) -> Result<(), StreamError> {
    ctx.metrics.stream_parks_total.inc();
    let _parked = Active::new(&ctx.metrics.streams_parked);
    job.live.waiting(Waiting::Parked);
    let since = Instant::now();
    tracing::info!(
        stall_timeout = ?ctx.stall_timeout,
        "the client took no data for server.stall_timeout: stream parked, its shards released"
    );
    tokio::select! {
        ready = sock.writable() => ready.map_err(StreamError::Client)?,
        _ = job.shutdown.cancelled() => return Err(StreamError::Shutdown),
    }
    job.live.waiting(Waiting::Nothing);
    // Parked time is time the stream waited for its client, like a send's.
    ctx.metrics
        .client_wait_seconds_total
        .with_label_values(&[job.lanes[0].dataset.name.as_str()])
        .inc_by(since.elapsed().as_secs_f64());
    tracing::info!(parked = ?since.elapsed(), "the client reads again: stream resumed");
    Ok(())
}

/// Sets a stream up to start at `start`: the pieces to read from the start of the shuffle
/// window that holds it (pieces whose sample counts are known are cut off unread; from the
/// first one whose count is not, they are read and their samples dropped), and the sample
/// order that skips what comes before `start`. With `to`, it stops there, and no piece past
/// the window that holds `to`'s last sample is read.
fn resume(
    plan: StreamPlan,
    window: usize,
    start: u64,
    to: Option<u64>,
) -> (Vec<Piece>, SampleOrder) {
    let mut shuffle = WindowShuffle::new(plan.stream_key, window);
    let mut pieces = plan.pieces;
    if let Some(to) = to.filter(|&to| to > start) {
        let mut last = shuffle.clone();
        let last_start = last.seek(to - 1);
        pieces = keep_first(pieces, last_start + last.next_len() as u64);
    }
    let window_start = shuffle.seek(start);
    let (pieces, discard) = skip_counted(pieces, window_start);
    let order = SampleOrder {
        shuffle,
        loaded: VecDeque::new(),
        done: false,
        discard,
        skip: (start - window_start) as usize,
        counted: window_start - discard,
        left: to.map(|to| to.saturating_sub(start)),
    };
    (pieces, order)
}

/// The first `n` samples of `pieces`, as far as their lengths are known (all of them when
/// `to` is: runs with an end are manifest plans).
fn keep_first(pieces: Vec<Piece>, mut n: u64) -> Vec<Piece> {
    let mut out = Vec::with_capacity(pieces.len());
    for mut p in pieces {
        if n == 0 {
            break;
        }
        if let Some(end) = p.end {
            let len = end - p.start;
            if len > n {
                p.end = Some(p.start + n);
            }
            n -= len.min(n);
        }
        out.push(p);
    }
    out
}

#[cfg(test)]
mod tests;
