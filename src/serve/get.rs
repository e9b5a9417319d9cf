//! `op: "get"` (protocol 6): one shard's whole bytes from the host's cache, for `shardd get`,
//! so that webdataset's `pipe:shardd get gs://...` replaces `pipe:gsutil cat gs://...` with no
//! other change to a trainer (PROTOCOL.md, "Get").
//!
//! The shard is loaded through the cache as a stream's would be (one download however many
//! processes ask at once, verified, within the budget; later epochs read it from local disk).
//! The answer is a START with the shard's length, then one MAP frame carrying a read-only
//! descriptor of its committed cache file, then END: the client copies the file to its stdout
//! in the kernel (`sendfile`), and no byte of the shard passes through the daemon. The entry
//! stays pinned (counted in the budget, never evicted) until the client closes the
//! connection, so the file it reads is never deleted under it while the daemon counts it.
//!
//! Only shards of configured datasets are served: a local client cannot make the daemon
//! fetch, or read from disk, anything else.

use std::sync::Arc;

use tokio::io::Interest;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio_util::sync::CancellationToken;

use crate::cache::FetchError;
use crate::config::Config;
use crate::config::url::ShardUrl;
use crate::protocol::{self, End, GetRequest, GetStart, HEADER_LEN, Kind};
use crate::serve::server::{Daemon, Refusal, client_gone, refuse};

/// Serves one `get`: refusals (an unknown URL, a failed fetch) are the caller's ERROR frame.
/// Counted in `shardd_gets_total` as `served` once the descriptor is handed over, else
/// `refused`.
pub(crate) async fn serve(
    rd: &mut OwnedReadHalf,
    wr: &mut OwnedWriteHalf,
    daemon: &Arc<Daemon>,
    shutdown: &CancellationToken,
    req: &GetRequest,
) -> Result<(), Refusal> {
    let served = hand_over(rd, wr, daemon, shutdown, req).await;
    if served.is_err() {
        let gets = &daemon.streams.metrics.gets_total;
        gets.with_label_values(&["refused"]).inc();
    }
    served
}

async fn hand_over(
    rd: &mut OwnedReadHalf,
    wr: &mut OwnedWriteHalf,
    daemon: &Arc<Daemon>,
    shutdown: &CancellationToken,
    req: &GetRequest,
) -> Result<(), Refusal> {
    let shard = {
        let config = daemon.clone();
        let url = req.url.clone();
        // A linear scan of every dataset's shards (a string comparison each): off the runtime.
        tokio::task::spawn_blocking(move || configured_shard(&config.config, &url))
            .await
            .expect("a scan does not panic")?
    };
    let cache = &daemon.streams.cache;
    let bytes = cache.get(&shard).await.map_err(|e| {
        let code = match e.root() {
            FetchError::CacheFull { .. } => "cache_full",
            _ => "stream_failed",
        };
        refuse(code, e.to_string())
    })?;
    let Some((file, _, len)) = cache.committed_file(shard.as_str(), &bytes) else {
        return Err(refuse(
            "stream_failed",
            format!("{}: its cache file could not be opened", shard.as_str()),
        ));
    };
    let gone = |e: std::io::Error| refuse("client_gone", e.to_string());
    let start = GetStart {
        url: shard.as_str().to_string(),
        bytes: len as u64,
    };
    protocol::write_json(wr, Kind::Start, &start)
        .await
        .map_err(gone)?;
    let mut map = Vec::with_capacity(HEADER_LEN + 12);
    map.extend_from_slice(&12u32.to_le_bytes());
    map.push(Kind::Map as u8);
    map.extend_from_slice(&1u32.to_le_bytes());
    map.extend_from_slice(&(len as u64).to_le_bytes());
    send_all_with_fd(wr, &map, &file.into())
        .await
        .map_err(gone)?;
    let metrics = &daemon.streams.metrics;
    metrics.gets_total.with_label_values(&["served"]).inc();
    metrics.get_bytes_total.inc_by(len as u64);
    let end = End {
        samples: 0,
        bytes: len as u64,
    };
    // The client has the file: a client gone before END is not an error of its request.
    let _ = protocol::write_json(wr, Kind::End, &end).await;
    // Pinned (`bytes`) until the client has copied the file and closed, or the daemon stops
    // (the client's descriptor still reads the file then).
    tokio::select! {
        _ = client_gone(rd) => {}
        _ = shutdown.cancelled() => {}
    }
    drop(bytes);
    Ok(())
}

/// The configured shard whose URL is `url`, or why there is none.
fn configured_shard(config: &Config, url: &str) -> Result<ShardUrl, Refusal> {
    for dataset in config.datasets.values() {
        if let Some(s) = dataset.shards.iter().find(|s| s.as_str() == url) {
            return Ok(s.clone());
        }
    }
    let mut names: Vec<&str> = config.datasets.keys().map(String::as_str).collect();
    names.sort_unstable();
    Err(refuse(
        "unknown_shard",
        format!(
            "{url:?} is not a shard of any dataset this daemon serves ({}): shardd get serves \
             only the shards of configured datasets, named as their `shards` expand",
            names.join(", ")
        ),
    ))
}

/// Writes a small frame with a descriptor attached to its first byte.
async fn send_all_with_fd(
    wr: &OwnedWriteHalf,
    frame: &[u8],
    fd: &std::os::fd::OwnedFd,
) -> std::io::Result<()> {
    let sock = wr.as_ref();
    let mut done = 0;
    while done < frame.len() {
        let attach = (done == 0).then_some(fd);
        match sock.try_io(Interest::WRITABLE, || {
            crate::serve::mapped::send_with_fd(sock, &frame[done..], attach)
        }) {
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => sock.writable().await?,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
