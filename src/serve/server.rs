//! The Unix-socket server: accepts connections (bounded by `server.max_connections`), runs the
//! handshake under a time limit, and serves one stream per connection.
//!
//! `run` is handed an already-bound listener and a shutdown token, so tests (and `demo`) run
//! the real server on a temp socket in-process. Every failure a client can cause or meet ends
//! in an ERROR frame with a clear message, and only that connection is affected.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::cache::FetchError;
use crate::config::Config;
use crate::ops::metrics::Active;
use crate::plan::{self, StreamRequest};
use crate::protocol::{self, End, ErrorFrame, Kind, Request, Start};
use crate::serve::prefetch::StreamId;
use crate::serve::sink::Sink;
use crate::serve::stream::{self, StreamContext, StreamError};

/// How long shutdown waits for connections to say goodbye.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);
/// Upper bound on writing an ERROR frame to a client that may not be reading.
const ERROR_WRITE_TIMEOUT: Duration = Duration::from_secs(2);
/// Connections refused as `busy` that may linger at once (reading what their client sends,
/// so it can read the refusal); beyond that they are closed at once.
const BUSY_LINGERING: usize = 256;

/// Everything a connection needs.
pub struct Daemon {
    pub config: Config,
    pub streams: StreamContext,
    /// Open streams, for `/status`.
    pub board: Arc<crate::serve::status::Board>,
    /// `host.index = "from-clients"`: the host learned from the streams.
    pub learned: Arc<crate::serve::learned_host::Learned>,
}

pub async fn run(listener: UnixListener, daemon: Arc<Daemon>, shutdown: CancellationToken) {
    let permits = Arc::new(Semaphore::new(daemon.config.max_connections));
    let lingering = Arc::new(Semaphore::new(BUSY_LINGERING));
    let tracker = TaskTracker::new();
    let metrics = daemon.streams.metrics.clone();
    loop {
        let accepted = tokio::select! {
            _ = shutdown.cancelled() => break,
            r = listener.accept() => r,
        };
        let socket = match accepted {
            Ok((socket, _)) => socket,
            Err(e) => {
                // Typically EMFILE: back off instead of spinning; existing streams go on.
                tracing::warn!(error = %e, "accept failed");
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tokio::time::sleep(Duration::from_millis(100)) => continue,
                }
            }
        };
        match permits.clone().try_acquire_owned() {
            Ok(permit) => {
                metrics.connections_total.inc();
                tracker.spawn(handle(socket, daemon.clone(), shutdown.clone(), permit));
            }
            Err(_) => {
                metrics.connections_rejected_total.inc();
                let mut reply = protocol::preamble().to_vec();
                reply.extend(protocol::json_frame(
                    Kind::Error,
                    &ErrorFrame {
                        code: "busy".into(),
                        message: format!(
                            "the daemon already serves server.max_connections = {} connections",
                            daemon.config.max_connections
                        ),
                    },
                ));
                match lingering.clone().try_acquire_owned() {
                    Ok(permit) => {
                        tracker.spawn(async move {
                            let (mut rd, mut wr) = socket.into_split();
                            send_and_close(&mut rd, &mut wr, &reply).await;
                            drop(permit);
                        });
                    }
                    Err(_) => {
                        // A fresh socket's buffer takes this small reply without blocking.
                        let _ = socket.try_write(&reply);
                    }
                }
            }
        }
    }
    tracker.close();
    if tokio::time::timeout(DRAIN_TIMEOUT, tracker.wait())
        .await
        .is_err()
    {
        tracing::warn!("connections still open after the drain timeout; closing them");
    }
}

/// Why a connection ends with an ERROR frame.
pub(crate) struct Refusal {
    pub(crate) code: &'static str,
    pub(crate) message: String,
}

pub(crate) fn refuse(code: &'static str, message: impl Into<String>) -> Refusal {
    Refusal {
        code,
        message: message.into(),
    }
}

async fn handle(
    socket: UnixStream,
    daemon: Arc<Daemon>,
    shutdown: CancellationToken,
    _permit: OwnedSemaphorePermit,
) {
    let metrics = &daemon.streams.metrics;
    let _active = Active::new(&metrics.connections_active);
    set_send_buffer(&socket, SEND_BUFFER);
    // Who is on the other end, for the stream's log lines.
    let peer = socket.peer_cred().ok();
    let (mut rd, mut wr) = socket.into_split();
    let mut preamble_sent = false;
    let outcome = serve(
        &mut rd,
        &mut wr,
        &daemon,
        &shutdown,
        peer,
        &mut preamble_sent,
    )
    .await;
    if let Err(r) = outcome {
        // Every answer starts with our preamble (PROTOCOL.md), even a handshake timeout's
        // before the client's 8 bytes came: so the client can tell "refused" from "not shardd".
        let mut reply = match preamble_sent {
            true => Vec::new(),
            false => protocol::preamble().to_vec(),
        };
        reply.extend(protocol::json_frame(
            Kind::Error,
            &ErrorFrame {
                code: r.code.into(),
                message: r.message,
            },
        ));
        send_and_close(&mut rd, &mut wr, &reply).await;
    }
}

/// Lingering close: closing a socket with unread input resets the connection, and a client
/// still sending then fails (EPIPE) before it reads our reply. So send the reply, shut our
/// side, and discard what the client still sends (bounded in time and bytes).
async fn send_and_close(
    rd: &mut tokio::net::unix::OwnedReadHalf,
    wr: &mut tokio::net::unix::OwnedWriteHalf,
    reply: &[u8],
) {
    let _ = tokio::time::timeout(ERROR_WRITE_TIMEOUT, async {
        wr.write_all(reply).await?;
        wr.shutdown().await?;
        // 17 reads of up to 4 KiB: at least a whole handshake (8 + 5 + 64 KiB) if it comes.
        let mut sink = [0u8; 4096];
        for _ in 0..17 {
            if rd.read(&mut sink).await? == 0 {
                break;
            }
        }
        std::io::Result::Ok(())
    })
    .await;
}

async fn serve(
    rd: &mut tokio::net::unix::OwnedReadHalf,
    wr: &mut tokio::net::unix::OwnedWriteHalf,
    daemon: &Arc<Daemon>,
    shutdown: &CancellationToken,
    peer: Option<tokio::net::unix::UCred>,
    preamble_sent: &mut bool,
) -> Result<(), Refusal> {
    let timeout = daemon.config.handshake_timeout;
    let incoming = match tokio::time::timeout(timeout, handshake(rd, wr, preamble_sent)).await {
        Ok(r) => r?,
        Err(_) => {
            return Err(refuse(
                "bad_handshake",
                format!("no complete request within server.handshake_timeout ({timeout:?})"),
            ));
        }
    };
    let req = match incoming {
        Incoming::Stream(req) => req,
        Incoming::Get(get) => {
            return crate::serve::get::serve(rd, wr, daemon, shutdown, &get).await;
        }
    };
    // host.index = "from-clients": the daemon of the host this request's rank is on.
    let bound = crate::serve::learned_host::bind(daemon, &req, peer)
        .map_err(|r| refuse(r.code, r.message))?;
    let daemon = &bound.daemon;
    let mut planned = plan_request(daemon, &req).await?;
    // Zero copy (protocol 5) is on unless the config turns it off.
    let zero_copy = req.zero_copy && req.op == "stream" && daemon.config.zero_copy_maps > 0;
    if req.zero_copy {
        planned.start.zero_copy = Some(zero_copy);
    }
    // Counted from before its START until after its outcome: a client that has START, or
    // END, finds its stream in `streams_active` or in `streams_total`, never in neither.
    let _active = (req.op != "plan").then(|| Active::new(&daemon.streams.metrics.streams_active));
    protocol::write_json(wr, Kind::Start, &planned.start)
        .await
        .map_err(|e| refuse("client_gone", e.to_string()))?;
    if req.op == "plan" {
        // Nothing registered, nothing loaded: the START was the answer.
        let end = End {
            samples: 0,
            bytes: 0,
        };
        let _ = tokio::time::timeout(
            ERROR_WRITE_TIMEOUT,
            protocol::write_json(wr, Kind::End, &end),
        )
        .await;
        return Ok(());
    }
    let span = tracing::info_span!(
        "stream",
        dataset = %req.dataset,
        epoch = req.epoch,
        rank = req.rank,
        worker = req.worker,
        shards = planned.start.shards,
        elastic = req.resume_from.is_some(),
        peer_pid = peer.and_then(|p| p.pid()),
        peer_uid = peer.map(|p| p.uid()),
    );
    let conn = Connection {
        rd,
        wr,
        peer,
        shutdown,
    };
    let outcome = run_stream(conn, daemon, &req, planned, &span).await;
    report(&daemon.streams.metrics, &req.dataset, &span, outcome)
}

/// An accepted request: its plan and the START frame that says so.
struct Planned {
    lanes: Vec<crate::plan::request::Lane>,
    mix: Option<crate::plan::request::Interleave>,
    tag_sources: bool,
    start: Start,
}

/// Checks a request against the config and plans it; a refusal names what is wrong.
async fn plan_request(daemon: &Arc<Daemon>, req: &Request) -> Result<Planned, Refusal> {
    let config = &daemon.config;
    if !config.datasets.contains_key(&req.dataset) && !config.mixes.contains_key(&req.dataset) {
        let known: Vec<&str> = config
            .datasets
            .keys()
            .chain(config.mixes.keys())
            .map(String::as_str)
            .collect();
        return Err(refuse(
            "unknown_dataset",
            format!(
                "unknown dataset {:?}; this daemon serves: {}",
                req.dataset,
                known.join(", ")
            ),
        ));
    }
    let stream_req = req.stream_request();
    let planned = plan_off_runtime(
        daemon,
        &req.dataset,
        stream_req,
        req.resume_from.clone(),
        req.history.clone(),
        req.op == "stream",
    )
    .await
    .map_err(|e| refuse("bad_topology", format!("dataset {:?}: {e}", req.dataset)))?;
    if let Some(samples) = planned.samples
        && req.start > samples
    {
        return Err(refuse(
            "bad_request",
            stream::StreamError::PastEnd {
                start: req.start,
                samples,
            }
            .to_string(),
        ));
    }
    let start = Start {
        dataset: req.dataset.clone(),
        shards: planned
            .lanes
            .iter()
            .flat_map(|l| &l.runs)
            .map(|r| r.plan.pieces.len())
            .sum(),
        host: config.host.index,
        hosts: config.host.count,
        samples: planned.samples,
        position: req.start,
        dropped: planned.dropped,
        fingerprint: planned.fingerprint.clone(),
        remainder: planned.remainder,
        sources: planned.sources.as_ref().map(|sources| {
            sources
                .iter()
                .map(|s| protocol::SourceStart {
                    dataset: s.dataset.clone(),
                    weight: s.weight,
                    samples: s.samples,
                    pass: s.pass,
                })
                .collect()
        }),
        zero_copy: None,
        segments: planned.segments.as_ref().map(|segments| {
            segments
                .iter()
                .map(|s| protocol::SegmentStart {
                    position: s.position,
                    entry: s.entry,
                    mix: (planned.sources.iter().flatten())
                        .map(|source| source.dataset.clone())
                        .zip(s.weights.iter().copied())
                        .collect(),
                })
                .collect()
        }),
        segment: planned
            .segments
            .as_ref()
            .map(|s| s.partition_point(|s| s.position <= req.start).max(1) - 1),
    };
    Ok(Planned {
        lanes: planned.lanes,
        mix: planned.mix,
        tag_sources: planned.tag_sources,
        start,
    })
}

/// How a stream ended, for the metrics, the log and the client.
enum Outcome {
    /// Every sample and the END frame were sent.
    Completed(End),
    /// The client closed its socket (or broke the protocol by sending more).
    ClientLeft,
    /// The daemon is stopping. `torn`: a frame is cut off, so only closing is safe.
    ShutDown {
        torn: bool,
    },
    Failed {
        error: StreamError,
        torn: bool,
    },
}

/// A client's connection once its request is accepted: the socket's halves, who the client
/// is, and the daemon's shutdown.
struct Connection<'a> {
    rd: &'a mut tokio::net::unix::OwnedReadHalf,
    wr: &'a mut tokio::net::unix::OwnedWriteHalf,
    peer: Option<tokio::net::unix::UCred>,
    shutdown: &'a CancellationToken,
}

/// Serves an accepted stream until it completes, fails, its client leaves or the daemon
/// stops.
async fn run_stream(
    conn: Connection<'_>,
    daemon: &Arc<Daemon>,
    req: &Request,
    planned: Planned,
    span: &tracing::Span,
) -> Outcome {
    let Connection {
        rd,
        wr,
        peer,
        shutdown,
    } = conn;
    let config = &daemon.config;
    let registered = daemon.board.register(
        &req.dataset,
        req.epoch,
        req.rank,
        req.worker,
        req.start,
        peer,
    );
    let mut sink = Sink::new();
    let maps = (req.zero_copy && planned.start.zero_copy == Some(true)).then(|| {
        set_send_buffer(wr.as_ref(), crate::serve::mapped::SEND_BUFFER);
        crate::serve::mapped::Maps::new(
            config.zero_copy_maps,
            daemon.streams.metrics.zero_copy_maps.clone(),
            daemon.streams.map_budget.clone(),
        )
    });
    let job = stream::Job {
        lanes: planned
            .lanes
            .into_iter()
            .map(|l| stream::ResolvedLane {
                dataset: &config.datasets[&l.dataset],
                runs: l.runs,
                next_epoch: l.next_epoch,
            })
            .collect(),
        mix: planned.mix,
        tag_sources: planned.tag_sources,
        start: req.start,
        id: StreamId {
            dataset: req.dataset.clone(),
            seed: req.seed,
            rank: req.rank,
            world_size: req.world_size,
            worker: req.worker,
            num_workers: req.num_workers,
        },
        live: &registered.live,
        shutdown,
        zero_copy: maps.as_ref(),
    };
    let pump = stream::pump(&daemon.streams, job, wr.as_ref(), &mut sink).instrument(span.clone());
    let mut pump = Box::pin(pump);
    let ended = tokio::select! {
        r = &mut pump => r,
        end = async {
            match maps.as_ref() {
                // Zero copy: the client sends RELEASE frames; anything else ends it.
                Some(maps) => maps.read_releases(rd).await,
                None => {
                    client_gone(rd).await;
                    crate::serve::mapped::ReaderEnd::Left
                }
            }
        } => {
            if let crate::serve::mapped::ReaderEnd::Violation(why) = end {
                tracing::warn!(parent: span, "zero-copy client broke the protocol: {why}; closing its connection");
            }
            return Outcome::ClientLeft;
        }
        // The stream stops at its next frame boundary (it watches the token too), so the
        // client can be told why; one that does not take its frame in time is closed.
        _ = shutdown.cancelled() => tokio::time::timeout(ERROR_WRITE_TIMEOUT, &mut pump)
            .await
            .unwrap_or(Err(StreamError::Shutdown)),
    };
    drop(pump);
    let torn = sink.torn();
    match ended {
        Ok(end) => Outcome::Completed(end),
        Err(StreamError::Shutdown) => Outcome::ShutDown { torn },
        Err(StreamError::Client(_)) => Outcome::ClientLeft,
        Err(error) => Outcome::Failed { error, torn },
    }
}

/// Counts and logs how a stream ended, and says what the client is still told.
fn report(
    metrics: &crate::ops::metrics::Metrics,
    dataset: &str,
    span: &tracing::Span,
    outcome: Outcome,
) -> Result<(), Refusal> {
    let label = match &outcome {
        Outcome::Completed(_) => "completed",
        Outcome::ClientLeft | Outcome::ShutDown { .. } => "cancelled",
        Outcome::Failed { .. } => "failed",
    };
    metrics
        .streams_total
        .with_label_values(&[dataset, label])
        .inc();
    match outcome {
        Outcome::Completed(end) => {
            // The per-epoch summary an operator reads: this stream, and the cache so far.
            tracing::info!(
                parent: span,
                samples = end.samples,
                bytes = end.bytes,
                cache_hits = metrics.cache_hits_total.get(),
                cache_misses = metrics.cache_misses_total.get(),
                cache_evictions = metrics.cache_evictions_total.get(),
                cache_resident_bytes = metrics.cache_resident_bytes.get(),
                store_gets = metrics.store_gets(),
                store_bytes = metrics.store_bytes_total.get(),
                "stream completed"
            );
            Ok(())
        }
        Outcome::ClientLeft => {
            tracing::debug!(parent: span, "client left mid-stream");
            Ok(())
        }
        // A frame cut off mid-way cannot be followed by an ERROR frame: just close.
        Outcome::ShutDown { torn: true } => Ok(()),
        Outcome::ShutDown { torn: false } => Err(refuse("shutdown", "the daemon is shutting down")),
        Outcome::Failed { error, torn } => {
            tracing::warn!(parent: span, error = %error, "stream failed");
            if torn {
                // Errors are reported at frame boundaries, so this is a guard: an ERROR
                // frame here would be read as the rest of a batch.
                return Ok(());
            }
            let code = match &error {
                StreamError::Fetch(f) if matches!(f.root(), FetchError::CacheFull { .. }) => {
                    "cache_full"
                }
                StreamError::PastEnd { .. } => "bad_request",
                _ => "stream_failed",
            };
            Err(refuse(code, error.to_string()))
        }
    }
}

/// Plans the stream's epoch (or, with `resume_from`, the rest of it after a checkpoint at
/// another topology: runs of the old streams; for a mix, each source's stream) and, for the
/// prefetcher, the shards of the same stream's next epoch (none past the last epoch or when
/// it cannot be planned). Planning walks the host's share, O(shards), so it runs on the
/// blocking pool: a client asking for a large dataset must not hold up the runtime threads
/// every other stream is served from.
async fn plan_off_runtime(
    daemon: &Arc<Daemon>,
    dataset: &str,
    req: StreamRequest,
    resume_from: Option<crate::plan::elastic::Origin>,
    history: Vec<crate::plan::passes::Hop>,
    with_next: bool,
) -> Result<crate::plan::request::Plan, plan::PlanError> {
    // An elastic resume costs up to elastic::MAX_STREAMS of work, and a history one pass order
    // per old host and hop: two are planned at a time, so that many at once (a job's every
    // stream resuming, or a hostile client) cannot add up.
    static ELASTIC_PLANS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(2);
    let _elastic = if resume_from.is_some() || !history.is_empty() {
        Some(ELASTIC_PLANS.acquire().await.expect("never closed"))
    } else {
        None
    };
    let daemon = Arc::clone(daemon);
    let dataset = dataset.to_owned();
    let work = move || {
        crate::plan::request::plan(
            &daemon.config,
            &dataset,
            req,
            resume_from.as_ref(),
            &history,
            with_next,
        )
    };
    tokio::task::spawn_blocking(work)
        .await
        .expect("planning does not panic")
}

/// Reads the client's preamble and REQUEST, answering with ours in between.
async fn handshake(
    rd: &mut tokio::net::unix::OwnedReadHalf,
    wr: &mut tokio::net::unix::OwnedWriteHalf,
    preamble_sent: &mut bool,
) -> Result<Incoming, Refusal> {
    let io = |e: std::io::Error| refuse("bad_handshake", format!("reading the handshake: {e}"));
    let mut theirs = [0u8; protocol::PREAMBLE_LEN];
    rd.read_exact(&mut theirs).await.map_err(io)?;
    // Set first: 8 bytes on a fresh socket are written at once, and a preamble must never be
    // sent twice even if the timeout strikes mid-write.
    *preamble_sent = true;
    wr.write_all(&protocol::preamble()).await.map_err(io)?;
    let version = protocol::parse_preamble(&theirs).ok_or_else(|| {
        refuse(
            "bad_handshake",
            "not a shardd client: a connection must start with \"SHARDD\" and a protocol version (see proto/PROTOCOL.md)",
        )
    })?;
    if !(protocol::OLDEST_VERSION..=protocol::VERSION).contains(&version) {
        let upgrade = if version > protocol::VERSION {
            "upgrade the daemon"
        } else {
            "upgrade the client"
        };
        return Err(refuse(
            "unsupported_version",
            format!(
                "client speaks protocol {version}; this daemon speaks {} to {} (shardd {}): {upgrade}",
                protocol::OLDEST_VERSION,
                protocol::VERSION,
                env!("CARGO_PKG_VERSION"),
            ),
        ));
    }
    let (kind, body) = protocol::read_frame(rd, protocol::MAX_CLIENT_FRAME)
        .await
        .map_err(|e| refuse("bad_request", format!("reading the request: {e}")))?;
    if kind != Kind::Request as u8 {
        return Err(refuse(
            "bad_request",
            format!("expected a REQUEST frame (kind 1), got kind {kind}"),
        ));
    }
    if protocol::op_of(&body).as_deref() == Some("get") {
        if version < 6 {
            return Err(refuse(
                "bad_request",
                format!("op \"get\" needs protocol 6; the client said it speaks {version}"),
            ));
        }
        let req = serde_json::from_slice(&body)
            .map_err(|e| refuse("bad_request", format!("invalid request: {e}")))?;
        return Ok(Incoming::Get(req));
    }
    let req: Request = serde_json::from_slice(&body)
        .map_err(|e| refuse("bad_request", format!("invalid request: {e}")))?;
    if req.op == "plan" && version < 3 {
        return Err(refuse(
            "bad_request",
            format!("op \"plan\" needs protocol 3; the client said it speaks {version}"),
        ));
    }
    if req.resume_from.is_some() && version < 4 {
        return Err(refuse(
            "bad_request",
            format!("resume_from needs protocol 4; the client said it speaks {version}"),
        ));
    }
    if req.zero_copy && version < 5 {
        return Err(refuse(
            "bad_request",
            format!("zero_copy needs protocol 5; the client said it speaks {version}"),
        ));
    }
    if !req.history.is_empty() && version < 7 {
        return Err(refuse(
            "bad_request",
            format!("history needs protocol 7; the client said it speaks {version}"),
        ));
    }
    if req.op != "stream" && req.op != "plan" {
        return Err(refuse(
            "bad_request",
            format!(
                "unknown op {:?}; protocol {} has \"stream\", \"plan\" and \"get\"",
                req.op,
                protocol::VERSION
            ),
        ));
    }
    Ok(Incoming::Stream(req))
}

/// A request as the handshake read it: a stream (or its plan), or one shard's bytes.
enum Incoming {
    Stream(Request),
    Get(protocol::GetRequest),
}

/// Resolves when the client closes its side or sends anything after its request (which
/// protocol 1 does not allow): either way the stream has no reader left to serve.
pub(crate) async fn client_gone(rd: &mut tokio::net::unix::OwnedReadHalf) {
    let mut buf = [0u8; 64];
    let _ = rd.read(&mut buf).await;
}

/// Socket send buffer asked for each connection (the kernel caps it at net.core.wmem_max).
/// A larger buffer means fewer, larger socket buffers per batch and fewer wake-ups of the
/// trainer: measurably more throughput for 100 KB samples.
const SEND_BUFFER: usize = 4 << 20;

fn set_send_buffer(socket: &UnixStream, bytes: usize) {
    if let Err(e) = rustix::net::sockopt::set_socket_send_buffer_size(socket, bytes) {
        tracing::debug!(error = %e, "SO_SNDBUF not set");
    }
}
