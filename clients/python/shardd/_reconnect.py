"""Connecting and reconnecting (the slow path). A stream survives a daemon restart (PROTOCOL.md,
"Reconnecting"): when its connection is cut, or the daemon says ``shutdown`` or ``busy``, or
nothing listens at the socket, it connects again with backoff for up to ``reconnect_timeout``
seconds, reopens the stream at its position (``start``) and checks that the plan fingerprint
did not change (``Stream._started``). All of that lives on the failure path: the per-sample
path is untouched.

A client's first connection that finds no socket file at all is not a restart: no daemon was
ever seen there. It is retried for ``first_connect_timeout`` seconds only (a daemon started
with the trainer), then fails with the likely causes, unless a socket appears meanwhile or
systemd says the ``shardd.service`` unit is (re)starting: then ``reconnect_timeout`` again.

``Reconnecting`` is the part of ``Stream`` that does this. It owns the connection: the
``FrameReader`` reads from the socket it opens, through ``ZeroCopy`` when the request asks for
zero copy.
"""

import errno
import grp
import logging
import os
import pwd
import random
import shutil
import socket
import stat
import struct
import subprocess
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
# How long a client's first connection waits for a socket file that is not there (no daemon
# was ever seen at that path: not started, another path, died at start-up): long enough for
# a daemon launched together with the trainer to bind its socket, short enough that a wrong
# path fails while someone is still looking. A socket that exists (a daemon restarting, or
# systemd's, with socket activation) is waited for up to reconnect_timeout.
FIRST_CONNECT_TIMEOUT = 5.0
# The systemd unit asked, when a first connection finds no socket, whether a daemon is
# (re)starting (the shipped deploy/systemd/shardd.service).
UNIT = "shardd.service"
_UNIT_STARTING = frozenset({"activating", "deactivating", "reloading"})
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

    def _init_connection(self, socket_path, request, timeout, reconnect_timeout,
                         first_connect=None):
        self._path = socket_path
        self._request = request
        self._timeout = timeout
        self._reconnect_timeout = reconnect_timeout
        # The grace of a first connection that finds no socket (``_connect``); None: the
        # client reached a daemon before, so no socket is a restart, waited for as one.
        self._first_connect = first_connect
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
            if e.errno == errno.EACCES:
                raise UnavailableError(denied_message(self._path), reason=why,
                                       errno=e.errno) from e
            raise UnavailableError(f"no shardd daemon at {self._path} ({why})",
                                   retry=e.errno in _RETRY_CONNECT, reason=why,
                                   errno=e.errno) from e
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
        previous connection of this stream ended (None: this is the first).

        The client's first connection (``_first_connect``, the grace, is not None) that finds
        no socket file is tried for the grace only, unless a socket shows up meanwhile (a
        daemon is there, restarting) or systemd says the unit is (re)starting."""
        began = time.monotonic()
        deadline = began + self._reconnect_timeout
        # Not None while no daemon has been seen at the path: every attempt found no socket.
        grace = self._first_connect if lost is None else None
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
                now = time.monotonic()
                if grace is not None and not (isinstance(e, UnavailableError)
                                              and e.errno == errno.ENOENT):
                    grace = None  # a socket is there: a daemon (re)starting, or stale
                    if attempts > 1:
                        log.info("the socket %s is there now (%s): waiting for the shardd "
                                 "daemon up to %g s (reconnect_timeout)", self._path, cause,
                                 self._reconnect_timeout)
                short = grace is not None and grace < self._reconnect_timeout
                if lost is None and attempts == 1:
                    log.warning("the shardd daemon at %s is not available (%s); retrying for up "
                                "to %g s (%s)", self._path, cause,
                                grace if short else self._reconnect_timeout,
                                "first_connect_timeout" if short else "reconnect_timeout")
                if short and now >= began + grace:
                    unit = unit_state()
                    if unit is not None and unit[0] in _UNIT_STARTING:
                        log.info("no socket at %s yet, but systemd's %s is %s: waiting for it "
                                 "up to %g s (reconnect_timeout)", self._path, UNIT,
                                 _unit_text(unit), self._reconnect_timeout)
                        grace = None
                    else:
                        raise _absent(self._path, now - began, attempts, grace,
                                      "first_connect_timeout", unit) from e
                if now >= deadline:
                    if grace is not None:
                        raise _absent(self._path, now - began, attempts,
                                      self._reconnect_timeout, "reconnect_timeout",
                                      unit_state()) from e
                    what = (f"lost the shardd daemon at {self._path} at sample {self._base} of "
                            f"{self._describe()} ({lost}) and could not reconnect"
                            if lost is not None else f"no shardd daemon at {self._path}")
                    raise UnavailableError(
                        f"{what} within reconnect_timeout = {self._reconnect_timeout:g} s "
                        f"({now - began:.1f} s, {attempts} attempts); last: {cause}") from e
                end = began + grace if grace is not None and grace < self._reconnect_timeout \
                    else deadline
                self._nap(min(delay * random.uniform(0.5, 1.0), max(0.0, end - now)))
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


# -- what a first connection that finds nothing, and a denied one, say ------------------------

# How a trainer points the client at another socket, by default (shardd.Client's argument).
POINT_CLIENT = "pass that path to shardd.Client"


def absent_message(path, waited, attempts, limit, name, directory, unit, point_at=POINT_CLIENT):
    """The message of a first connection that found no socket file at ``path``: the facts,
    the likely causes and what to change; ``point_at`` says how this API takes a socket path
    (shardd.torch and shardd.grain say theirs)."""
    there = ("no socket file there" if directory is None
             else f"no socket file there, nor the directory {directory},")
    systemd = "" if unit is None else f"; systemd's {UNIT} is {_unit_text(unit)}"
    return (
        f"no shardd daemon at {path}: {there} after {waited:.1f} s ({name} = {limit:g} s, "
        f"{attempts} attempts{systemd}). Likely causes: the daemon is not running, or it died "
        f"at start-up (`systemctl status shardd` and `journalctl -u shardd` say which; without "
        f"systemd, start it with `shardd serve --config CONFIG`), or it listens on another "
        f"socket, its config's server.socket: {point_at}. A daemon that is still starting is "
        f"waited for longer with a larger first_connect_timeout.")


def _absent(path, waited, attempts, limit, name, unit):
    directory = os.path.dirname(os.path.abspath(path))
    facts = dict(path=str(path), waited=waited, attempts=attempts, limit=limit, name=name,
                 directory=None if os.path.isdir(directory) else directory, unit=unit)
    return UnavailableError(absent_message(**facts), retry=True,
                            reason=os.strerror(errno.ENOENT), errno=errno.ENOENT, absent=facts)


def unit_state():
    """(ActiveState, SubState) of systemd's ``UNIT``, e.g. ("activating", "auto-restart"); None
    without systemd, systemctl or such a unit. Asked once per first connection that ran out
    of its grace, so not on any hot path."""
    exe = shutil.which("systemctl")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "show", "-p", "LoadState", "-p", "ActiveState", "-p",
                              "SubState", UNIT], capture_output=True, text=True, timeout=2,
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    fields = dict(line.partition("=")[::2] for line in out.stdout.splitlines())
    if out.returncode != 0 or fields.get("LoadState") != "loaded" or not fields.get("ActiveState"):
        return None
    return fields["ActiveState"], fields.get("SubState", "")


def _unit_text(unit):
    active, sub = unit
    return f"{active} ({sub})" if sub and sub != active else active


def _names(uid, gid):
    """(user name, group name) of ``uid`` and ``gid``, numbers where there is no name."""
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = str(uid)
    try:
        group = grp.getgrgid(gid).gr_name
    except KeyError:
        group = str(gid)
    return user, group


def denied_message(path):
    """Why this process may not connect to ``path`` (EACCES), and what lets it: the socket's
    mode and owners, or the directory on the way that this process may not search."""
    me = _names(os.geteuid(), os.getegid())[0]
    who = f"this process runs as {me} (uid {os.geteuid()})"
    try:
        st = os.stat(path)
    except OSError:
        st = None
    if st is not None and not stat.S_ISSOCK(st.st_mode):
        owner, group = _names(st.st_uid, st.st_gid)
        return (f"permission denied on {path}, which is not a socket but a "
                f"{stat.filemode(st.st_mode)} {owner}:{group} file ({who}): is it the daemon's "
                f"server.socket? Not retried.")
    if st is None:
        # A directory on the way that this user may not search (EACCES from stat, too).
        absolute = os.path.abspath(path)
        blocked = next((d for d in _ancestors(absolute) if not os.access(d, os.X_OK)),
                       os.path.dirname(absolute))
        try:
            d = os.stat(blocked)
            owners = _names(d.st_uid, d.st_gid)
            what = f" ({stat.filemode(d.st_mode)} {owners[0]}:{owners[1]})"
        except OSError:
            what = ""
        return (f"permission denied on the way to the shardd socket {path}: {who} and may not "
                f"enter the directory {blocked}{what}. Let the trainer's user reach it, or have "
                f"the daemon's server.socket name a path in a directory it can enter (the "
                f"shipped units use /run/shardd, mode 0755). Not retried: a restart of the "
                f"daemon does not change it.")
    owner, group = _names(st.st_uid, st.st_gid)
    ways = []
    if st.st_mode & 0o060 == 0o060:
        ways.append(f"add the user to the socket's group {group} (`usermod -aG {group} {me}`, "
                    f"then log in again)")
    ways.append("set the daemon's server.socket_group to a group the user is in (with "
                "server.socket_mode = \"0660\"), or server.socket_mode = \"0666\" (every user "
                "of the host; under systemd, `shardd install-units` carries both into "
                "shardd.socket)")
    return (f"permission denied on the shardd socket {path}: {who}, and the socket is "
            f"{stat.filemode(st.st_mode)} {owner}:{group} (connecting needs write permission). "
            f"Let the trainer's user connect: {', or '.join(ways)}. Not retried: a restart of "
            f"the daemon does not change it.")


def _ancestors(path):
    """The directories from / down to ``path``'s parent."""
    parts = []
    d = os.path.dirname(path)
    while True:
        parts.append(d)
        up = os.path.dirname(d)
        if up == d:
            break
        d = up
    return reversed(parts)


def retold(e, point_at, hint):
    """``e`` (an ``UnavailableError``) as a framework says it: a first connection that found
    no socket names ``point_at`` (how that API takes a socket path); a denied one is said as
    it is; any other gets ``hint`` appended. Returns a new ``UnavailableError``."""
    if e.absent is not None:
        message = absent_message(**e.absent, point_at=point_at)
    elif e.errno == errno.EACCES:
        message = str(e)
    else:
        message = f"{e}: {hint}"
    return UnavailableError(message, e.retry, e.reason, e.errno, e.absent)
