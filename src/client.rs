//! The Rust client: opens one stream over the real protocol. Used by `shardd cat`, the demo
//! and the tests; the Python client in `clients/python` follows the same `proto/` spec.

use std::path::Path;

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

use crate::protocol::{self, End, ErrorFrame, Kind, ReceivedSample, Request, Start};

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot connect to {path}: {source}")]
    Connect {
        path: String,
        source: std::io::Error,
    },
    #[error("daemon error ({code}): {message}")]
    Daemon { code: String, message: String },
    #[error("protocol error: {0}")]
    Protocol(String),
    #[error("connection lost: {0}")]
    Io(#[from] std::io::Error),
}

/// A stream being read: batches of samples until END.
pub struct SampleStream {
    conn: BufReader<UnixStream>,
    start: Start,
    end: Option<End>,
}

impl SampleStream {
    /// Connects, handshakes and sends the request; returns once the daemon accepted it.
    pub async fn open(socket: &Path, request: &Request) -> Result<SampleStream, ClientError> {
        let stream = UnixStream::connect(socket)
            .await
            .map_err(|source| ClientError::Connect {
                path: socket.display().to_string(),
                source,
            })?;
        let mut conn = BufReader::with_capacity(1 << 20, stream);
        conn.get_mut().write_all(&protocol::preamble()).await?;
        conn.get_mut()
            .write_all(&protocol::json_frame(Kind::Request, request))
            .await?;
        let mut theirs = [0u8; protocol::PREAMBLE_LEN];
        conn.read_exact(&mut theirs).await?;
        protocol::parse_preamble(&theirs).ok_or_else(|| {
            ClientError::Protocol(format!("{} is not a shardd socket", socket.display()))
        })?;
        let (kind, body) = read_frame(&mut conn).await?;
        match kind {
            Kind::Start => Ok(SampleStream {
                conn,
                start: json(&body)?,
                end: None,
            }),
            other => Err(unexpected(other, &body)),
        }
    }

    pub fn start(&self) -> &Start {
        &self.start
    }

    /// The END summary, once the stream is complete.
    pub fn end(&self) -> Option<&End> {
        self.end.as_ref()
    }

    /// The next batch of samples; `None` after END.
    pub async fn next_batch(&mut self) -> Result<Option<Vec<ReceivedSample>>, ClientError> {
        if self.end.is_some() {
            return Ok(None);
        }
        let (kind, body) = read_frame(&mut self.conn).await?;
        match kind {
            Kind::Batch => protocol::decode_batch(body)
                .map(Some)
                .map_err(ClientError::Protocol),
            Kind::End => {
                self.end = Some(json(&body)?);
                Ok(None)
            }
            other => Err(unexpected(other, &body)),
        }
    }
}

async fn read_frame(conn: &mut BufReader<UnixStream>) -> Result<(Kind, Bytes), ClientError> {
    let (kind, body) = protocol::read_frame(conn, u32::MAX).await?;
    let kind = Kind::from_u8(kind)
        .ok_or_else(|| ClientError::Protocol(format!("unknown frame kind {kind}")))?;
    Ok((kind, body))
}

fn json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ClientError> {
    serde_json::from_slice(body).map_err(|e| ClientError::Protocol(e.to_string()))
}

fn unexpected(kind: Kind, body: &[u8]) -> ClientError {
    if kind == Kind::Error {
        match json::<ErrorFrame>(body) {
            Ok(e) => ClientError::Daemon {
                code: e.code,
                message: e.message,
            },
            Err(e) => e,
        }
    } else {
        ClientError::Protocol(format!("unexpected frame {kind:?}"))
    }
}

/// Reads a stream to the end, returning every sample (tests and small tools only: this holds
/// the whole stream in memory).
pub async fn read_all(
    socket: &Path,
    request: &Request,
) -> Result<Vec<ReceivedSample>, ClientError> {
    let mut stream = SampleStream::open(socket, request).await?;
    let mut all = Vec::new();
    while let Some(batch) = stream.next_batch().await? {
        all.extend(batch);
    }
    Ok(all)
}

impl Request {
    /// A stream request with the defaults of the CLI and the Python client.
    pub fn stream(dataset: &str, epoch: u64, rank: u32, world_size: u32) -> Request {
        Request {
            op: "stream".into(),
            dataset: dataset.into(),
            epoch,
            rank,
            world_size,
            worker: 0,
            num_workers: 1,
            seed: 0,
            start: 0,
            resume_from: None,
            zero_copy: false,
            history: Vec::new(),
        }
    }
}
