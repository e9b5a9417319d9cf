//! What systemd offers a `Type=notify` service, spoken directly (a few lines of protocol):
//! - `NOTIFY_SOCKET`: a datagram socket for `READY=1`, `STATUS=…`, `WATCHDOG=1`,
//!   `STOPPING=1` (an `@` prefix names an abstract socket);
//! - `WATCHDOG_USEC` (and `WATCHDOG_PID`): how often the watchdog must hear from us;
//! - `LISTEN_FDS` / `LISTEN_PID`: a listening socket passed by socket activation, as fd 3.
//!
//! Outside systemd (none of the variables set) everything here is a no-op.

use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::time::Duration;

/// Sends state changes to systemd, if it asked for them.
pub struct Notifier {
    target: Option<(UnixDatagram, SocketAddr)>,
}

impl Notifier {
    pub fn from_env() -> Notifier {
        let target = std::env::var_os("NOTIFY_SOCKET").and_then(|path| {
            let bytes = std::os::unix::ffi::OsStrExt::as_bytes(path.as_os_str()).to_vec();
            let addr = match bytes.strip_prefix(b"@") {
                Some(name) => {
                    use std::os::linux::net::SocketAddrExt;
                    SocketAddr::from_abstract_name(name)
                }
                None => SocketAddr::from_pathname(std::path::Path::new(&path)),
            };
            match (UnixDatagram::unbound(), addr) {
                (Ok(sock), Ok(addr)) => Some((sock, addr)),
                (Err(e), _) | (_, Err(e)) => {
                    tracing::warn!(error = %e, "NOTIFY_SOCKET is set but unusable");
                    None
                }
            }
        });
        Notifier { target }
    }

    /// Sends one notification (newline-separated `KEY=value` lines). Best effort: a missed
    /// notification must not stop the daemon.
    pub fn send(&self, state: &str) {
        if let Some((sock, addr)) = &self.target
            && let Err(e) = sock.send_to_addr(state.as_bytes(), addr)
        {
            tracing::warn!(error = %e, state, "could not notify systemd");
        }
    }

    /// How often to send `WATCHDOG=1` (half the watchdog timeout), when systemd watches us.
    pub fn watchdog_interval(&self) -> Option<Duration> {
        self.target.as_ref()?;
        if let Ok(pid) = std::env::var("WATCHDOG_PID")
            && pid.parse::<u32>().ok() != Some(std::process::id())
        {
            return None;
        }
        let usec: u64 = std::env::var("WATCHDOG_USEC").ok()?.parse().ok()?;
        (usec > 0).then(|| Duration::from_micros(usec / 2))
    }
}

/// The listening socket systemd passed (socket activation), if it passed one to this process.
pub fn activated_listener() -> std::io::Result<Option<std::os::unix::net::UnixListener>> {
    let ours = std::env::var("LISTEN_PID")
        .ok()
        .and_then(|p| p.parse::<u32>().ok())
        == Some(std::process::id());
    let fds: u32 = std::env::var("LISTEN_FDS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    if !ours || fds == 0 {
        return Ok(None);
    }
    if fds > 1 {
        return Err(std::io::Error::other(format!(
            "systemd passed {fds} sockets (LISTEN_FDS); shardd takes one Unix socket"
        )));
    }
    // SAFETY: with LISTEN_PID naming this process, systemd's protocol guarantees that fd 3
    // (SD_LISTEN_FDS_START) is open and handed to us; nothing else in the process owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(3) };
    let listener = std::os::unix::net::UnixListener::from(fd);
    listener.local_addr().map_err(|e| {
        std::io::Error::other(format!(
            "the socket systemd passed is not a Unix socket: {e}"
        ))
    })?;
    listener.set_nonblocking(true)?;
    Ok(Some(listener))
}
