//! The reading side of a stream: each lane's runs through a shard reader (the cache, the
//! sample index, the parse, a shard or two ahead) and a sample order (the shuffle windows).
//! No socket here: `super` sends what these give out.

use super::*;

/// One lane being read: the run that holds its position, then the runs after it, each
/// through its own shard reader and window order.
pub(super) struct LaneReader<'a> {
    pub(super) ctx: &'a StreamContext,
    pub(super) lane: &'a ResolvedLane<'a>,
    /// The run being read, and its reader and order.
    pub(super) run: usize,
    pub(super) at: u64,
    pub(super) reader: ShardReader<'a>,
    pub(super) order: SampleOrder,
    pub(super) window: VecDeque<Sample>,
    /// Set up again (after a park) inside a window that the stream, unbroken, would have cut
    /// already: until that window is cut, it counts as cut.
    pub(super) window_due: bool,
    pub(super) series: Series,
}

impl<'a> LaneReader<'a> {
    /// Starts `lane` at its position `at` (samples of the lane before it); `opened_at`: its
    /// position when the stream opened.
    pub(super) fn new(
        ctx: &'a StreamContext,
        job: &Job<'a>,
        lane: &'a ResolvedLane<'a>,
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
    pub(super) fn has_window(&self) -> bool {
        !self.window.is_empty() || self.window_due
    }

    /// The lane's next sample, waiting for shards; `None` after its last run.
    pub(super) async fn next_sample(
        &mut self,
        job: &Job<'a>,
    ) -> Result<Option<Sample>, StreamError> {
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
pub(super) fn locate(lane: &ResolvedLane<'_>, mut at: u64) -> (usize, u64) {
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
pub(super) fn open_run<'a>(
    ctx: &'a StreamContext,
    job: &Job<'a>,
    lane: &'a ResolvedLane<'a>,
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

/// The stream's sample order, with no I/O: shards' samples go in, in plan order, and come out
/// as permuted windows of `shuffle_buffer` samples (see `shuffle.rs`).
pub(super) struct SampleOrder {
    pub(super) shuffle: WindowShuffle,
    pub(super) loaded: VecDeque<Sample>,
    /// No more shards will come.
    pub(super) done: bool,
    /// Samples to drop as they come in, before the first window (a resume without counts).
    pub(super) discard: u64,
    /// Samples to drop from the front of the first window (a resume inside it).
    pub(super) skip: usize,
    /// Samples of the stream before the ones the reader brings (cut off unread), plus the
    /// ones it brought: the stream's length once the reader is done.
    pub(super) counted: u64,
    /// Samples still to give out, when the run ends before its stream does.
    pub(super) left: Option<u64>,
}

impl SampleOrder {
    /// Whether another shard's samples are needed before the next window can be cut.
    pub(super) fn wants_more(&self) -> bool {
        !self.done
            && self.left != Some(0)
            && (self.discard > 0 || self.loaded.len() < self.shuffle.next_len())
    }

    /// The next shard's samples, or `None` when the plan has no more shards.
    pub(super) fn push(&mut self, shard: Option<Vec<Sample>>) {
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
    pub(super) fn check_reached(&self, start: u64) -> Result<(), StreamError> {
        match start > self.counted {
            true => Err(StreamError::PastEnd {
                start,
                samples: self.counted,
            }),
            false => Ok(()),
        }
    }

    /// The next window, permuted; `None` at the end of the stream.
    pub(super) fn next_window(&mut self) -> Option<VecDeque<Sample>> {
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
pub(super) struct ShardReader<'a> {
    pub(super) cache: &'a Cache,
    pub(super) indexes: &'a Arc<SampleIndexes>,
    pub(super) dataset: &'a Dataset,
    pub(super) queue: VecDeque<Piece>,
    /// The shard `next` returns, loading.
    pub(super) current: Option<ShardTask>,
    /// The one after it, loading once the current one is ready.
    pub(super) next: Option<ShardTask>,
    pub(super) schedule: ScheduleHandle,
    /// The plan's index of the piece `next` returns.
    pub(super) returned: usize,
    /// Sample counts learnt of pieces the plan has none for, by the plan's index.
    pub(super) counts: &'a mut [Option<u64>],
}

/// A piece's samples, and the shard's sample count when the plan did not know it.
pub(super) type ShardTask = AbortOnDropHandle<Result<(Vec<Sample>, Option<u64>), StreamError>>;

impl<'a> ShardReader<'a> {
    pub(super) fn new(
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
    pub(super) async fn next(&mut self) -> Result<Option<Vec<Sample>>, StreamError> {
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

    pub(super) fn start(&mut self) -> Option<ShardTask> {
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
pub(super) fn skip_counted(pieces: Vec<Piece>, mut n: u64) -> (Vec<Piece>, u64) {
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
