//! `shardd get URL...`: writes shards' bytes to stdout from the host daemon's cache, for
//! webdataset's `pipe:` URLs (`pipe:shardd get gs://bucket/train-000123.tar` in place of
//! `pipe:gsutil cat ...`). One download per host serves every process that asks, and later
//! epochs are read from local disk.
//!
//! The daemon answers `op: "get"` (protocol 6, PROTOCOL.md "Get") with a read-only descriptor
//! of the shard's committed cache file; this command copies it to stdout in the kernel
//! (`sendfile`; a plain copy where stdout does not take it) and then closes the connection,
//! which unpins the entry. A daemon that is restarting, or busy, is waited for, as the Python
//! client waits: once the descriptor is here, nothing the daemon does can cut the copy.
//!
//! What it does not give: the samples of a shard in tar order, shards in the order the trainer
//! names them. Shuffled, exact, equal-length streams and resumes need `ShardDataset`.

use std::io::{Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::protocol::{self, ErrorFrame, GetRequest, GetStart, HEADER_LEN, Kind, PREAMBLE_LEN};

/// The protocol version `op: "get"` needs.
const GET_VERSION: u16 = 6;

/// Copies each shard to stdout in turn; `wait`: how long to wait for an absent, restarting or
/// busy daemon (per shard).
pub fn run(socket: &Path, urls: &[String], wait: Duration) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout().lock();
    for url in urls {
        let got = fetch(socket, url, wait)?;
        if let Err(e) = copy(&got.file, got.len, &mut stdout) {
            if e.kind() == std::io::ErrorKind::BrokenPipe {
                // The reader closed the pipe early (webdataset stopping mid-shard): end as
                // `cat` or `gsutil cat` would, killed by SIGPIPE, which a shell reports as
                // 141 and webdataset's `pipe:` ignores; no message.
                std::process::exit(141);
            }
            return Err(anyhow::Error::new(e).context(format!("{url}: writing to stdout")));
        }
        // Closing the connection unpins the cache entry: only now that the copy is done.
        drop(got.conn);
    }
    Ok(())
}

/// A shard's cache file from the daemon: a read-only descriptor, its length, and the connection
/// whose lifetime pins the cache entry (the daemon does not evict the file while it is open).
/// The descriptor stays valid whatever the daemon does, so a restart cannot cut the copy.
struct Got {
    file: std::fs::File,
    len: u64,
    conn: UnixStream,
}

/// [`Got`] for `url`, waiting for the daemon up to `wait`.
fn fetch(socket: &Path, url: &str, wait: Duration) -> anyhow::Result<Got> {
    let deadline = Instant::now() + wait;
    let mut warned = false;
    loop {
        match ask(socket, url) {
            Ok(got) => return Ok(got),
            Err(Failure::Refused(e)) => return Err(e),
            Err(Failure::Away(e)) => {
                if Instant::now() >= deadline {
                    return Err(e.context(format!(
                        "the daemon at {} did not serve {url} within {wait:?} (--wait); is \
                         it running, and is that its server.socket? (--socket or \
                         SHARDD_SOCKET name another)",
                        socket.display()
                    )));
                }
                if !warned {
                    eprintln!(
                        "shardd get: waiting for the daemon at {}: {e:#}",
                        socket.display()
                    );
                    warned = true;
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
}

enum Failure {
    /// About this request (an unknown shard, a failed fetch): not retried.
    Refused(anyhow::Error),
    /// The daemon is away, restarting or busy: worth another try.
    Away(anyhow::Error),
}

fn ask(socket: &Path, url: &str) -> Result<Got, Failure> {
    let away = |e: std::io::Error| Failure::Away(e.into());
    let mut conn = UnixStream::connect(socket).map_err(away)?;
    let mut hello = protocol::preamble().to_vec();
    hello[6..].copy_from_slice(&GET_VERSION.to_le_bytes());
    let request = GetRequest {
        op: "get".into(),
        url: url.into(),
    };
    hello.extend(protocol::json_frame(Kind::Request, &request));
    conn.write_all(&hello).map_err(away)?;
    let mut theirs = [0u8; PREAMBLE_LEN];
    conn.read_exact(&mut theirs).map_err(away)?;
    let Some(version) = protocol::parse_preamble(&theirs) else {
        let e = anyhow::anyhow!("{} is not a shardd socket", socket.display());
        return Err(Failure::Refused(e));
    };
    // Read exactly the START frame: the MAP frame after it carries the descriptor, which a
    // read of its first byte without room for it would discard.
    let (kind, body) = read_frame(&mut conn).map_err(away)?;
    if kind == Kind::Error as u8 {
        let error: ErrorFrame = serde_json::from_slice(&body)
            .map_err(|e| Failure::Refused(anyhow::anyhow!("a malformed ERROR frame: {e}")))?;
        let e = anyhow::anyhow!("{} ({})", error.message, error.code);
        return Err(match error.code.as_str() {
            "busy" | "shutdown" => Failure::Away(e),
            _ => Failure::Refused(e),
        });
    }
    if version < GET_VERSION {
        return Err(Failure::Refused(anyhow::anyhow!(
            "the daemon at {} speaks protocol {version}; shardd get needs {GET_VERSION}: \
             upgrade the daemon",
            socket.display()
        )));
    }
    if kind != Kind::Start as u8 {
        return Err(Failure::Refused(anyhow::anyhow!(
            "expected START (kind 2), got kind {kind}"
        )));
    }
    let start: GetStart = serde_json::from_slice(&body)
        .map_err(|e| Failure::Refused(anyhow::anyhow!("a malformed START frame: {e}")))?;
    let (file, len) = receive_map(&conn).map_err(away)?;
    if len != start.bytes {
        let e = anyhow::anyhow!("START said {} bytes, MAP {len}", start.bytes);
        return Err(Failure::Refused(e));
    }
    // END: the daemon has counted the shard as handed over; only then is closing ours to do.
    let (kind, _) = read_frame(&mut conn).map_err(away)?;
    if kind != Kind::End as u8 {
        let e = anyhow::anyhow!("expected END (kind 4), got kind {kind}");
        return Err(Failure::Refused(e));
    }
    Ok(Got {
        file: std::fs::File::from(file),
        len,
        conn,
    })
}

fn read_frame(conn: &mut UnixStream) -> std::io::Result<(u8, Vec<u8>)> {
    let mut header = [0u8; HEADER_LEN];
    conn.read_exact(&mut header)?;
    let len = u32::from_le_bytes(header[..4].try_into().unwrap());
    if len > protocol::MAX_CLIENT_FRAME {
        return Err(std::io::Error::other(format!("a frame of {len} bytes")));
    }
    let mut body = vec![0u8; len as usize];
    conn.read_exact(&mut body)?;
    Ok((header[4], body))
}

/// Receives the MAP frame (17 bytes) and the descriptor attached to its first byte.
fn receive_map(conn: &UnixStream) -> std::io::Result<(OwnedFd, u64)> {
    use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, recvmsg};
    let mut frame = [0u8; HEADER_LEN + 12];
    let mut got = 0;
    let mut fd = None;
    while got < frame.len() {
        let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut anc = RecvAncillaryBuffer::new(&mut space);
        let mut iov = [std::io::IoSliceMut::new(&mut frame[got..])];
        let n = recvmsg(conn, &mut iov, &mut anc, RecvFlags::CMSG_CLOEXEC)?.bytes;
        for message in anc.drain() {
            if let RecvAncillaryMessage::ScmRights(fds) = message {
                for f in fds {
                    fd.get_or_insert(f);
                }
            }
        }
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        got += n;
    }
    if frame[4] != Kind::Map as u8 {
        return Err(std::io::Error::other(format!(
            "expected MAP (kind 6), got kind {}",
            frame[4]
        )));
    }
    let len = u64::from_le_bytes(frame[9..17].try_into().unwrap());
    let fd =
        fd.ok_or_else(|| std::io::Error::other("the MAP frame came without its descriptor"))?;
    Ok((fd, len))
}

/// Copies `len` bytes of `file` to `out`: `sendfile` (in the kernel) where `out` takes it (a
/// pipe, a file, a socket), else through a buffer (e.g. a terminal).
fn copy(file: &std::fs::File, len: u64, out: &mut std::io::StdoutLock) -> std::io::Result<()> {
    out.flush()?;
    let mut offset = 0u64;
    while offset < len {
        let chunk = (len - offset).min(1 << 30) as usize;
        match rustix::fs::sendfile(out.as_fd(), file, Some(&mut offset), chunk) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) | Err(rustix::io::Errno::AGAIN) => {}
            Err(rustix::io::Errno::INVAL) | Err(rustix::io::Errno::NOSYS) if offset == 0 => {
                return buffered(file, len, out);
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

fn buffered(file: &std::fs::File, len: u64, out: &mut std::io::StdoutLock) -> std::io::Result<()> {
    let copied = std::io::copy(&mut std::io::Read::take(file, len), out)?;
    if copied != len {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    out.flush()
}
