"""Connecting and reconnecting (the slow path). A stream survives a daemon restart (PROTOCOL.md,
"Reconnecting"): when its connection is cut, or the daemon says ``shutdown`` or ``busy``, or
nothing listens at the socket, it connects again with backoff for up to ``reconnect_timeout``
seconds, reopens the stream at its position (``start``) and checks that the plan fingerprint
did not change (``Stream._started``). All of that lives on the failure path: the per-sample
path is untouched.

``Reconnecting`` is the part of ``Stream`` that does this. It owns the connection: the
``FrameReader`` reads from the socket it opens, through ``ZeroCopy`` when the request asks for
zero copy.
"""

import errno
import logging
import random
import socket
import struct
import time

from ._errors import (
    ConnectionLostError,
    DaemonError,
    Error,
    ProtocolError,
    StreamTimeoutError,
    UnavailableError,
    VersionError,
)
from ._frames import KIND_START, MAGIC, PREAMBLE, VERSION, needs, request_frame
from ._zerocopy import ZeroCopyUnusable

# How long a stream waits for a daemon that went away (restart, kill, upgrade) before it
# gives up: a systemd restart with a cold page cache, with room to spare.
RECONNECT_TIMEOUT = 300.0
# Backoff between attempts: doubling from the first to the cap, each delay jittered down to
# half so that the streams of a host do not reconnect in lockstep.
_BACKOFF_FIRST = 0.05
_BACKOFF_CAP = 2.0
# ERROR codes about the daemon's state, not the request: worth another attempt. Every other
# code is about the request itself and is raised at once.
RETRY_CODES = frozenset({"shutdown", "busy"})
# connect() errors that mean "no daemon listens there right now": the socket file is gone
# (a stopped daemon removes it), stale (a killed one leaves it), or the backlog is full.
_RETRY_CONNECT = frozenset({errno.ENOENT, errno.ECONNREFUSED, errno.EAGAIN})

log = logging.getLogger("shardd")


class Reconnecting:
    """``Stream``'s connection: opening it (``_connect``), closing it (``_drop_connection``)
    and, after a failed read, opening it again at the stream's position (``_recover``).
    Attributes: set by ``_init_connection``. Uses the stream's ``_closed``, ``_base``,
    ``_describe``, ``_started`` and ``_nap``."""

    def _init_connection(self, socket_path, request, timeout, reconnect_timeout):
        self._path = socket_path
        self._request = request
        self._timeout = timeout
        self._reconnect_timeout = reconnect_timeout
        self.reconnects = 0
        self.peer_version = None  # the daemon's protocol version, from its preamble

    def _handshake(self):
        """One attempt: connects, sends the request, reads the preamble; returns START."""
        self._drop_connection()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        frames = self._frames
        frames.sock = sock
        sock.settimeout(self._timeout)
        try:
            sock.connect(self._path)
        except socket.timeout:
            raise
        except OSError as e:
            why = e.strerror or str(e)
            raise UnavailableError(f"no shardd daemon at {self._path} ({why})",
                                   retry=e.errno in _RETRY_CONNECT, reason=why) from e
        version, feature = needs(self._request)
        sock.sendall(request_frame(self._request, version))
        zero_copy = bool(self._request.get("zero_copy"))
        # Zero copy: every receive takes descriptors too (a plain recv would drop them).
        if zero_copy:
            self._zero_copy.sock = sock
        frames.attach(sock, self._zero_copy.recv_into if zero_copy else sock.recv_into,
                      self._timeout is None and not zero_copy)
        preamble = frames.take(len(PREAMBLE))
        if preamble[:6] != MAGIC:
            raise ProtocolError(f"{self._path} is not a shardd socket")
        self.peer_version = struct.unpack_from("<H", preamble, 6)[0]
        if self.peer_version < version and zero_copy and self.peer_version >= needs(
                {**self._request, "zero_copy": False})[0]:
            # A daemon older than zero copy: the socket path, from a new connection.
            log.info("the shardd daemon at %s speaks protocol %d, before zero copy (5): reading "
                     "%s over the socket", self._path, self.peer_version, self._describe())
            del self._request["zero_copy"]
            return self._handshake()
        if self.peer_version < version:
            from . import __version__
            raise VersionError(
                f"the shardd daemon at {self._path} speaks protocol {self.peer_version}, too old "
                f"for {feature}, which needs protocol {version} (this client, shardd "
                f"{__version__}, speaks {VERSION}): upgrade the daemon",
                self.peer_version, version, feature)
        kind, length = frames.header()
        if kind != KIND_START:
            frames.unexpected(kind, length)
        start = frames.json(length, "START")
        # This connection is zero-copy (START said so): MAP frames and mapped batches come.
        frames.zero_copy = (self._zero_copy if zero_copy and start.get("zero_copy") is True
                            else None)
        return start

    def _drop_connection(self):
        """Closes the socket (not the stream) and forgets what was buffered from it."""
        self._frames.close()
        if self._request.get("zero_copy"):
            self._zero_copy.forget()

    def _connect(self, lost=None):
        """Connects and reads START. While the failure is one a daemon (re)starting explains,
        tries again with backoff until ``reconnect_timeout`` has passed. ``lost``: why the
        previous connection of this stream ended (None: this is the first)."""
        began = time.monotonic()
        deadline = began + self._reconnect_timeout
        delay = _BACKOFF_FIRST
        attempts = 0
        cause = lost
        while True:
            attempts += 1
            try:
                if self._closed:
                    raise ConnectionLostError(f"the stream of {self._describe()} was closed")
                start = self._handshake()
                if self._closed:  # closed meanwhile (by the caller, the thread being here)
                    raise ConnectionLostError(f"the stream of {self._describe()} was closed")
                break
            except Exception as e:
                self._drop_connection()
                retry, cause, error = self._classify(e)
                if not retry or self._reconnect_timeout <= 0 or self._closed:
                    if error is e:
                        raise
                    raise error from e
                if lost is None and attempts == 1:
                    log.warning("the shardd daemon at %s is not available (%s); retrying for up "
                                "to %g s (reconnect_timeout)", self._path, cause,
                                self._reconnect_timeout)
                now = time.monotonic()
                if now >= deadline:
                    what = (f"lost the shardd daemon at {self._path} at sample {self._base} of "
                            f"{self._describe()} ({lost}) and could not reconnect"
                            if lost is not None else f"no shardd daemon at {self._path}")
                    raise UnavailableError(
                        f"{what} within reconnect_timeout = {self._reconnect_timeout:g} s "
                        f"({now - began:.1f} s, {attempts} attempts); last: {cause}") from e
                self._nap(min(delay * random.uniform(0.5, 1.0), deadline - now))
                delay = min(2 * delay, _BACKOFF_CAP)
        self._started(start)
        if attempts > 1 or lost is not None:
            log.info("%s %s at sample %d on the shardd daemon at %s after %.2f s (%d attempts)",
                     "resumed" if lost is not None else "opened", self._describe(),
                     self._base, self._path, time.monotonic() - began, attempts)

    def _classify(self, e):
        """(whether a daemon (re)starting explains ``e``, a short description of it, the
        ``shardd.Error`` to raise for it)."""
        if isinstance(e, DaemonError):
            return e.code in RETRY_CODES, f"{e.code}: {e}", e
        if isinstance(e, UnavailableError):
            return e.retry, e.reason, e
        if isinstance(e, ConnectionLostError):
            return True, "connection closed by the daemon", e
        if isinstance(e, Error):
            return False, str(e), e
        if isinstance(e, socket.timeout):
            return False, "timed out", StreamTimeoutError(
                f"the shardd daemon at {self._path} sent nothing for {self._timeout:g} s (the "
                f"timeout given to Client) while reading {self._describe()}")
        if isinstance(e, OSError):
            why = e.strerror or str(e)
            return True, why, ConnectionLostError(
                f"the connection to the shardd daemon at {self._path} was lost ({why})")
        return False, str(e), ProtocolError(
            f"malformed data from the daemon at {self._path}: {type(e).__name__}: {e}")

    def _recover(self, e):
        """After a failed read mid-stream: reconnects at ``_base`` or raises a shardd.Error."""
        if isinstance(e, ZeroCopyUnusable):
            # The daemon is fine: the socket path from a new connection at this position, even
            # with reconnect_timeout=0 (which is about waiting for a daemon that went away).
            log.warning("zero copy from the shardd daemon at %s cannot work here (%s): reading "
                        "%s over the socket from sample %d", self._path, e, self._describe(),
                        self._base)
            self._drop_connection()  # first: it forgets the maps of a zero-copy connection
            del self._request["zero_copy"]
            cause = "zero copy unavailable"
        else:
            retry, cause, error = self._classify(e)
            self._drop_connection()
            if not retry or self._reconnect_timeout <= 0:
                if error is e:
                    raise e
                raise error from e
            log.warning("lost the shardd daemon at %s (%s) at sample %d of %s; reconnecting for "
                        "up to %g s (reconnect_timeout)", self._path, cause, self._base,
                        self._describe(), self._reconnect_timeout)
        self._request["start"] = self._base
        self._connect(lost=cause)
        self.reconnects += 1
