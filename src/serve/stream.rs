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

use crate::plan::request::Run;
use tokio_util::task::AbortOnDropHandle;

use crate::cache::{Cache, FetchError, ShardBytes};
use crate::config::Dataset;
use crate::ops::metrics::{Active, Metrics};
use crate::plan::shuffle::WindowShuffle;
use crate::plan::{Piece, StreamPlan};
use crate::protocol::{self, End, Kind, Part};
use crate::serve::prefetch::{Plans, ScheduleHandle, StreamId};
use crate::serve::sink::{SendError, Sink};
use crate::serve::status::{Live, Waiting};
use crate::shard::sample_index::SampleIndexes;
use crate::shard::{Sample, ShardError};

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

/// What a stream reads of one dataset: runs of its streams, in order.
pub struct Lane<'a> {
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
    pub lanes: Vec<Lane<'a>>,
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
    let (positions, mut cursor) = match &job.mix {
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
    let mut out: VecDeque<Sample> = VecDeque::new();
    // The lane of each sample in `out`, for the per-dataset counters.
    let mut out_lanes: VecDeque<usize> = VecDeque::new();
    let mut out_bytes = 0usize;
    // A mix's next source, drawn but not yet taken.
    let mut pending: Option<usize> = None;
    loop {
        while out.len() < protocol::BATCH_MAX_SAMPLES && out_bytes < protocol::BATCH_TARGET_BYTES {
            let i = match (cursor.as_mut(), pending) {
                (None, _) => 0,
                (Some(_), Some(i)) => i,
                (Some(c), None) => match c.next() {
                    Some(i) => i,
                    None => break,
                },
            };
            // A frame ends where the next sample's window is not cut yet: the client gets
            // what is ready without waiting for more shards. Where a frame ends is a function
            // of the position alone (`has_window` says what an unbroken stream would have
            // cut), so a park re-encodes a mix's frame the same too.
            if !out.is_empty() && !lanes[i].has_window() {
                pending = Some(i);
                break;
            }
            pending = None;
            match lanes[i].next_sample(job).await? {
                Some(sample) => {
                    out_bytes += sample.payload_len();
                    out.push_back(sample);
                    out_lanes.push_back(i);
                }
                None if cursor.is_none() => break,
                None => {
                    return Err(StreamError::Internal(format!(
                        "mix source {} ended before its quota",
                        job.lanes[i].dataset.name
                    )));
                }
            }
        }
        if out.is_empty() {
            return Ok(Leg::Done);
        }
        if job.shutdown.is_cancelled() {
            return Err(StreamError::Shutdown);
        }
        let (parts, sent) = match job.zero_copy {
            None => protocol::encode_batch(&mut out).map_err(StreamError::Encode)?,
            Some(maps) => {
                let batch = protocol::take_batch(&mut out);
                let parts = maps
                    .encode(&ctx.cache, &batch, || live_urls(&lanes, &out))
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
        let bytes: u64 = sent.iter().map(|s| s.payload_len() as u64).sum();
        out_bytes -= bytes as usize;
        end.samples += sent.len() as u64;
        end.bytes += bytes;
        // Per dataset (a mix's sources each count their own), once per frame and lane.
        let mut per_lane = vec![(0u64, 0u64); lanes.len()];
        for (sample, i) in sent.iter().zip(out_lanes.drain(..sent.len())) {
            per_lane[i].0 += 1;
            per_lane[i].1 += sample.payload_len() as u64;
        }
        for (lane, (samples, bytes)) in lanes.iter().zip(per_lane) {
            lane.series.samples_sent.inc_by(samples);
            lane.series.bytes_sent.inc_by(bytes);
        }
        job.live.sent(sent.len() as u64, bytes);
        if let Some(e) = failed {
            return Err(e);
        }
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

/// One lane being read: the run that holds its position, then the runs after it, each
/// through its own shard reader and window order.
struct LaneReader<'a> {
    ctx: &'a StreamContext,
    lane: &'a Lane<'a>,
    /// The run being read, and its reader and order.
    run: usize,
    at: u64,
    reader: ShardReader<'a>,
    order: SampleOrder,
    window: VecDeque<Sample>,
    /// Set up again (after a park) inside a window that the stream, unbroken, would have cut
    /// already: until that window is cut, it counts as cut.
    window_due: bool,
    series: Series,
}

impl<'a> LaneReader<'a> {
    /// Starts `lane` at its position `at` (samples of the lane before it); `opened_at`: its
    /// position when the stream opened.
    fn new(
        ctx: &'a StreamContext,
        job: &Job<'a>,
        lane: &'a Lane<'a>,
        at: u64,
        opened_at: u64,
        counts: &'a mut [Option<u64>],
    ) -> LaneReader<'a> {
        let (run, from) = locate(lane, at);
        let (reader, order) = open_run(ctx, job, lane, run, from, counts);
        // An unbroken stream starts each run without a window (where it opened, or at the
        // run's start), then has one at every position but a window's first.
        let began = match locate(lane, opened_at) {
            (first, opened) if first == run => opened,
            _ => lane.runs.get(run).map_or(0, |r| r.from),
        };
        LaneReader {
            ctx,
            lane,
            run,
            at: from,
            reader,
            window_due: from != began && order.skip > 0,
            order,
            window: VecDeque::new(),
            series: Series::new(&ctx.metrics, &lane.dataset.name),
        }
    }

    /// Whether the stream, read unbroken, would have the window of the lane's next sample
    /// cut already (whether a frame may take it without waiting for more shards).
    fn has_window(&self) -> bool {
        !self.window.is_empty() || self.window_due
    }

    /// The lane's next sample, waiting for shards; `None` after its last run.
    async fn next_sample(&mut self, job: &Job<'a>) -> Result<Option<Sample>, StreamError> {
        loop {
            if let Some(mut sample) = self.window.pop_front() {
                if job.tag_sources {
                    // A mix's samples say which source they are (webdataset-style metadata).
                    let name = Bytes::copy_from_slice(self.lane.dataset.name.as_bytes());
                    sample.fields.push((SOURCE.clone(), ShardBytes::heap(name)));
                }
                return Ok(Some(sample));
            }
            fill(&mut self.order, &mut self.reader, job, &self.series).await?;
            if let Some(window) = self.order.next_window() {
                self.window = window;
                self.window_due = false;
                continue;
            }
            let Some(run) = self.lane.runs.get(self.run) else {
                return Ok(None);
            };
            if run.to.is_none() {
                self.order.check_reached(self.at)?;
            }
            self.run += 1;
            let Some(next) = self.lane.runs.get(self.run) else {
                return Ok(None);
            };
            (self.reader, self.order) =
                open_run(self.ctx, job, self.lane, self.run, next.from, &mut []);
            self.at = next.from;
        }
    }
}

/// The run of `lane` that holds lane position `at`, and the base position there.
fn locate(lane: &Lane<'_>, mut at: u64) -> (usize, u64) {
    let mut run = 0;
    while let Some(len) = lane.runs.get(run).and_then(Run::len)
        && at >= len
        && run + 1 < lane.runs.len()
    {
        at -= len;
        run += 1;
    }
    (run, lane.runs.get(run).map_or(0, |r| r.from) + at)
}

/// A reader and an order for run `k` of `lane` from its base position `from`, with the
/// prefetch schedule of everything the lane reads from there.
fn open_run<'a>(
    ctx: &'a StreamContext,
    job: &Job<'a>,
    lane: &'a Lane<'a>,
    k: usize,
    from: u64,
    counts: &'a mut [Option<u64>],
) -> (ShardReader<'a>, SampleOrder) {
    let window = lane.dataset.shuffle_buffer;
    let Some(run) = lane.runs.get(k) else {
        // A lane with no run (an empty stream): nothing to read.
        let order = resume(
            crate::plan::StreamPlan {
                pieces: Vec::new(),
                stream_key: 0,
                samples: Some(0),
                dropped: 0,
                pass: 0,
            },
            window,
            0,
            None,
        )
        .1;
        let schedule = open_schedule(ctx, job, lane, std::iter::empty());
        return (
            ShardReader::new(ctx, lane.dataset, Vec::new(), 0, schedule, counts),
            order,
        );
    };
    let mut plan = run.plan.clone();
    for (piece, count) in plan.pieces.iter_mut().zip(counts.iter()) {
        piece.end = piece.end.or(*count);
    }
    let total = plan.pieces.len();
    let (pieces, order) = resume(plan, window, from, run.to);
    let upcoming = lane.runs[k + 1..]
        .iter()
        .flat_map(|r| resume(r.plan.clone(), window, r.from, r.to).0);
    let schedule = open_schedule(ctx, job, lane, pieces.iter().copied().chain(upcoming));
    let returned = total - pieces.len();
    let reader = ShardReader::new(ctx, lane.dataset, pieces, returned, schedule, counts);
    (reader, order)
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
    lane: &Lane<'_>,
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
    /// Samples of the stream before the ones the reader brings (cut off unread), plus the
    /// ones it brought: the stream's length once the reader is done.
    counted: u64,
    /// Samples still to give out, when the run ends before its stream does.
    left: Option<u64>,
}

impl SampleOrder {
    /// Whether another shard's samples are needed before the next window can be cut.
    fn wants_more(&self) -> bool {
        !self.done
            && self.left != Some(0)
            && (self.discard > 0 || self.loaded.len() < self.shuffle.next_len())
    }

    /// The next shard's samples, or `None` when the plan has no more shards.
    fn push(&mut self, shard: Option<Vec<Sample>>) {
        match shard {
            Some(samples) => {
                self.counted += samples.len() as u64;
                let drop = (self.discard.min(samples.len() as u64)) as usize;
                self.discard -= drop as u64;
                self.loaded.extend(samples.into_iter().skip(drop));
            }
            None => self.done = true,
        }
    }

    /// At the end of the stream: whether it reached `start`. Without a manifest, a `start`
    /// past the end is found only here.
    fn check_reached(&self, start: u64) -> Result<(), StreamError> {
        match start > self.counted {
            true => Err(StreamError::PastEnd {
                start,
                samples: self.counted,
            }),
            false => Ok(()),
        }
    }

    /// The next window, permuted; `None` at the end of the stream.
    fn next_window(&mut self) -> Option<VecDeque<Sample>> {
        if self.loaded.is_empty() || self.left == Some(0) {
            return None;
        }
        let take = self.shuffle.next_len().min(self.loaded.len());
        let mut window: Vec<Sample> = self.loaded.drain(..take).collect();
        self.shuffle.permute(&mut window);
        let mut window: VecDeque<Sample> = window.into();
        window.drain(..std::mem::take(&mut self.skip).min(window.len()));
        if let Some(left) = self.left.as_mut() {
            window.truncate((*left).min(window.len() as u64) as usize);
            *left -= window.len() as u64;
        }
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
    indexes: &'a Arc<SampleIndexes>,
    dataset: &'a Dataset,
    queue: VecDeque<Piece>,
    /// The shard `next` returns, loading.
    current: Option<ShardTask>,
    /// The one after it, loading once the current one is ready.
    next: Option<ShardTask>,
    schedule: ScheduleHandle,
    /// The plan's index of the piece `next` returns.
    returned: usize,
    /// Sample counts learnt of pieces the plan has none for, by the plan's index.
    counts: &'a mut [Option<u64>],
}

/// A piece's samples, and the shard's sample count when the plan did not know it.
type ShardTask = AbortOnDropHandle<Result<(Vec<Sample>, Option<u64>), StreamError>>;

impl<'a> ShardReader<'a> {
    fn new(
        ctx: &'a StreamContext,
        dataset: &'a Dataset,
        pieces: Vec<Piece>,
        returned: usize,
        schedule: ScheduleHandle,
        counts: &'a mut [Option<u64>],
    ) -> ShardReader<'a> {
        ShardReader {
            cache: &ctx.cache,
            indexes: &ctx.indexes,
            dataset,
            queue: pieces.into(),
            current: None,
            next: None,
            schedule,
            returned,
            counts,
        }
    }

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
        let (samples, count) =
            done.map_err(|e| StreamError::Internal(format!("shard task failed: {e}")))??;
        if let Some(slot) = self.counts.get_mut(self.returned) {
            *slot = slot.or(count);
        }
        self.returned += 1;
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
        let indexes = self.indexes.clone();
        Some(AbortOnDropHandle::new(tokio::spawn(async move {
            let (bytes, id) = cache.get_identified(&shard).await?;
            let url: Arc<str> = Arc::from(shard.as_str());
            let (samples, len) = tokio::task::spawn_blocking(move || {
                indexes.samples(id, &bytes, &url, piece.start, piece.end)
            })
            .await
            .map_err(|e| StreamError::Internal(format!("{shard}: parsing failed: {e}")))??;
            if let Some(end) = piece.end.filter(|&end| end > len) {
                return Err(StreamError::Manifest(format!(
                    "{shard}: the manifest counts at least {end} samples, the shard has {len}"
                )));
            }
            Ok((samples, piece.end.is_none().then_some(len)))
        })))
    }
}

/// Cuts the first `n` samples off `pieces` as far as their lengths are known (all of them
/// with a manifest; those read before a park without one), up to the first piece of unknown
/// length. Returns the pieces left (a suffix of `pieces`, the first perhaps cut) and how many
/// of the `n` samples are still to be read and dropped.
fn skip_counted(pieces: Vec<Piece>, mut n: u64) -> (Vec<Piece>, u64) {
    let mut out = Vec::with_capacity(pieces.len());
    for mut p in pieces {
        if out.is_empty()
            && let Some(end) = p.end
        {
            let len = end - p.start;
            if n >= len {
                n -= len;
                continue;
            }
            p.start += n;
            n = 0;
        }
        out.push(p);
    }
    (out, n)
}

#[cfg(test)]
mod tests;
