"""The client side of proto/PROTOCOL.md (version 5).

Speed matters here: the trainer's Python process is where every sample ends up. A whole
batch's descriptors are decoded with a single ``struct.unpack_from``; a batch of small pieces
(keys, labels, 10 KB images) is received as one ``bytes`` object and cut with slices; large
pieces (at least ``DIRECT_MIN`` bytes) are received straight into their own ``bytes`` object
with ``MSG_WAITALL``, so the kernel copies them exactly once. Reads are bounded so the buffer
never runs ahead into a large piece.

Read-ahead (``Client(readahead=)``, on by default): a thread per stream receives and decodes
the next batches into a queue bounded in bytes while the trainer works, and the stream's
``__next__`` takes them from it. It starts at a batch boundary once the caller has shown that
it works between batches (a caller that only drains the stream is faster reading it itself). The thread holds the stream only while it receives a batch
(a weak reference otherwise), so a dropped stream is collected and closed. Once the thread
has received END it may open the next epoch's stream ahead (``Client(prefetch_next_epoch=)``).

A stream survives a daemon restart (PROTOCOL.md, "Reconnecting"): when its connection is cut,
or the daemon says ``shutdown`` or ``busy``, or nothing listens at the socket, it connects
again with backoff for up to ``reconnect_timeout`` seconds, reopens the stream at its position
(``start``) and checks that the plan fingerprint did not change. All of that lives on the
failure path: the per-sample path is untouched.
"""

import array
import collections
import errno
import json
import mmap
import logging
import os
import random
import resource
import socket
import struct
import threading
import time
import weakref
from collections import deque

MAGIC = b"SHARDD"
VERSION = 5
PREAMBLE = MAGIC + struct.pack("<H", VERSION)
# The protocol version each feature a request can use first appeared in. A request is sent
# with the highest version among the features it uses (a daemon serves every version up to
# its own), so an older daemon still serves what it can, and a daemon too old for a feature is
# named as such (``VersionError``) instead of failing with a bare refusal.
FEATURES = {
    "start": (2, "the request field start (stream positions, exact resume)"),
    "plan": (3, 'op "plan" (a stream\'s length and plan fingerprint without opening it)'),
    "resume_from": (4, "the request field resume_from (an elastic resume)"),
    "zero_copy": (5, "zero-copy delivery (shard files passed as descriptors and mapped)"),
}

KIND_REQUEST = 1
KIND_START = 2
KIND_BATCH = 3
KIND_END = 4
KIND_ERROR = 5
KIND_MAP = 6
KIND_MAPPED_BATCH = 7
KIND_UNMAP = 8
KIND_RELEASE = 9

_HEADER = struct.Struct("<IB")
_BATCH_HEADER = struct.Struct("<IIIIII")
_U32 = struct.Struct("<I")

# A stream's receive buffer starts small and doubles when a read needs more (frame heads,
# runs of small pieces): a trainer's DataLoader workers open a stream per epoch, and a large
# zeroed buffer per stream cost more than its samples at 16 short streams per host (fresh
# pages: a fault and a clear each). Below glibc's mmap threshold, so it is reused memory.
_INITIAL_BUFFER = 64 << 10
# Pieces at least this large are received directly into their own bytes object.
DIRECT_MIN = 64 << 10
# START, END and ERROR bodies are small JSON objects; a larger one is not read (a peer that
# is not a shardd daemon, or a broken one, must not make the client allocate gigabytes).
MAX_JSON_FRAME = 1 << 20

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

# Read-ahead (``Client(readahead=)``): a stream's background thread stops receiving once this
# many bytes of batches wait to be yielded (it may hold one batch more: it checks before a
# batch, whose size it does not know yet). 0 turns the thread off.
READAHEAD = 4 << 20
# How long close() waits for a stream's thread to let go of the socket (it exits at once: the
# socket is shut down under it), before leaving the closing to the thread.
_JOIN_TIMEOUT = 5.0

log = logging.getLogger("shardd")


class Error(Exception):
    """Base class of the errors this client raises."""


class DaemonError(Error):
    """An error the daemon reported in an ERROR frame. ``str(e)`` is the daemon's message;
    ``e.code`` is the machine-readable code (see proto/PROTOCOL.md)."""

    def __init__(self, code, message=None):
        # One argument is a message: torch re-raises a worker's exception as ``type(text)``.
        if message is None:
            code, message = "", code
        super().__init__(message)
        self.code = code


class ProtocolError(Error):
    """The peer did not follow the protocol (not a shardd socket, a malformed frame, ...)."""


class ConnectionLostError(ProtocolError, ConnectionError):
    """The connection to the daemon was cut (the daemon was killed, restarted or stopped), and
    the stream could not reconnect: ``reconnect_timeout=0``. (With reconnecting on, a daemon
    that does not come back raises ``UnavailableError``.)"""

    def __init__(self, message):  # one argument: torch re-raises a worker's error as type(text)
        super().__init__(message)


class UnavailableError(Error, ConnectionError):
    """No shardd daemon could be reached at the socket: at once when the path cannot be a
    daemon's socket (not a directory, permission denied) or ``reconnect_timeout=0``, else once
    ``reconnect_timeout`` seconds of attempts have passed. The message names the socket, the
    time waited and the last cause."""

    def __init__(self, message, retry=False, reason=None):
        super().__init__(message)
        self.retry = retry  # whether a daemon (re)starting there would explain it
        self.reason = reason or message  # the cause alone, e.g. "Connection refused"


class StreamTimeoutError(Error, TimeoutError):
    """The daemon sent nothing for the ``timeout`` given to ``Client``. Not retried: the
    timeout is the caller's bound."""

    def __init__(self, message):
        super().__init__(message)


class VersionError(Error):
    """The daemon speaks an older protocol than a feature the request uses (``feature``,
    ``needed``): upgrade the daemon. ``daemon`` is the daemon's protocol version."""

    def __init__(self, message, daemon=None, needed=None, feature=None):
        super().__init__(message)
        self.daemon, self.needed, self.feature = daemon, needed, feature


class PlanMismatch(Error, RuntimeError):
    """Two views of one epoch's plan disagree: ranks of a job (``shardd.torch``'s check at
    ``set_epoch``), or a position and the daemon's plan now (``PlanChangedError``). Reading on
    would repeat and skip samples, or hang a synchronous job. (``shardd.torch.PlanMismatch``
    is this class.)"""

    def __init__(self, message):  # one argument: torch re-raises a worker's error as type(text)
        super().__init__(message)


class PlanChangedError(PlanMismatch):
    """A stream was to continue at a position (after a reconnect, or from a saved state) but
    the daemon now plans another order for it: its config (shards, manifest, host count,
    dataset settings) changed. ``old`` and ``new`` are the two plan fingerprints."""

    def __init__(self, message, old=None, new=None):
        super().__init__(message)
        self.old, self.new = old, new


class _ZeroCopyUnusable(Exception):
    """Zero copy cannot work in this process (a descriptor it cannot map, or one the kernel
    dropped): the stream reopens at its position over the socket. Not a lost daemon, so this is
    done whatever ``reconnect_timeout`` says."""


class ForkedStreamError(Error, RuntimeError):
    """A stream opened in one process was read in another after ``fork``: the two processes
    would share one socket and each get part of the bytes. Open streams after the fork, in the
    process that reads them."""

    def __init__(self, message):  # one argument: torch re-raises a worker's error as type(text)
        super().__init__(message)


# What a forked child must disown: every open stream (and shardd.torch's iterators), each
# with an ``_inherited()`` that closes this process's copy of its socket and refuses to read on.
_LIVE = weakref.WeakSet()


def _after_fork_in_child():
    for s in list(_LIVE):
        s._inherited()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Client:
    """A connection factory for one daemon socket. Each ``stream()`` opens its own connection,
    so a client can be shared by the DataLoader workers of a process after fork only if each
    worker opens its own streams (it does: streams are never shared).

    ``timeout``: a socket timeout in seconds (None blocks; a timeout turns off the direct
    receive of large fields). ``reconnect_timeout``: how long a stream keeps trying to reach a
    daemon that went away, in seconds (default 300; 0 turns reconnecting off; ``float("inf")``
    never gives up); see ``Stream``.

    ``readahead``: bytes of batches each stream may receive ahead of the caller (default 4 MiB,
    ``READAHEAD``): a background thread per stream receives and decodes the next batches while
    the trainer works, and stops once this many bytes wait (plus at most one batch: ~1 MiB, or
    one sample when a sample is larger), so a paused trainer's stream is parked by the daemon as
    without it. 0: no thread, the caller's ``next`` reads the socket itself. The thread starts
    at the first batch boundary where the caller spent at least as long since the previous
    batch as that batch took to receive (a trainer: at its second batch); a caller that only
    drains the stream keeps reading it itself, as handing batches between two threads would
    cost it throughput. ``eager_readahead=True`` starts the thread with the stream.

    ``prefetch_next_epoch`` (default False; with ``readahead`` > 0): for a caller that reads
    epoch after epoch (``shardd.torch`` and ``shardd.grain`` turn it on). When a stream has
    received its END, the client opens the same stream of the next epoch (``start`` 0, no ``resume_from``), so that its
    first shuffle window is ready when ``stream()`` asks for exactly that: ``stream()`` then
    hands over the open stream. It is the same request a fresh ``stream()`` sends (same samples
    in the same order) and the finished stream's connection is closed first, so the daemon
    serves no more connections than the caller would. At most one per stream; an unclaimed one
    is closed by ``close()`` or when ``stream()`` opens another epoch (or ``start``) of that
    (dataset, rank, worker). A refused or failed speculative open is dropped silently.

    ``zero_copy`` (protocol 5, same host): each stream asks the daemon for its shards' cache
    files as read-only descriptors, and fields over 4 KiB are then read-only ``memoryview``s of
    their mappings instead of ``bytes`` (``bytes(view)`` where a copy is needed); smaller ones
    stay ``bytes``. A daemon that does not offer it (older, or ``server.zero_copy_maps = 0``)
    serves the socket path (PROTOCOL.md, "Zero copy"); a stream that cannot map a file, or
    whose process is at its open-file limit (RLIMIT_NOFILE) when a descriptor comes, reads on
    over the socket from where it was, with a warning, whatever ``reconnect_timeout``."""

    def __init__(self, socket_path, timeout=None, reconnect_timeout=RECONNECT_TIMEOUT,
                 readahead=READAHEAD, prefetch_next_epoch=False, eager_readahead=False,
                 zero_copy=False):
        self.socket_path = str(socket_path)
        # Protocol 5: each stream asks for its shards' cache files as descriptors; large
        # fields are then read-only memoryviews of a mapping (PROTOCOL.md, "Zero copy").
        self.zero_copy = bool(zero_copy)
        self.timeout = timeout
        self.reconnect_timeout = max(0.0, float(reconnect_timeout))  # inf: wait forever
        self.readahead = max(0, int(readahead))
        self.prefetch_next_epoch = bool(prefetch_next_epoch)
        self.eager_readahead = bool(eager_readahead)
        # Weak: a stream the caller dropped (``break`` out of the loop) is collected and its
        # socket closed, which frees the daemon's slot; close() still reaches the live ones.
        self._open = weakref.WeakSet()
        # Speculative next-epoch streams, by _slot(request): (request, stream). Strong: nobody
        # else holds them until stream() claims them.
        self._spec = {}
        self._spec_lock = threading.Lock()
        self._generation = 0  # close() counts: a stream opened ahead across one is not kept
        self._pid = os.getpid()

    def stream(self, dataset, *, epoch, rank, world_size, seed=0, worker=0, num_workers=1, start=0,
               resume_from=None):
        """Opens the stream of one (rank, worker) for one epoch and returns it as an iterator
        of sample dicts. Raises ``DaemonError`` at once if the daemon refuses the request.

        ``start`` resumes: the stream skips the first ``start`` samples it would have
        delivered and yields exactly the rest, in the same order (``Stream.position`` counts
        from it).

        ``resume_from`` (protocol 4, datasets with a manifest) is an *elastic* resume: the rest
        of ``epoch`` after a checkpoint taken at another topology, as a dict ``{"hosts",
        "world_size", "num_workers", "positions"}`` (the old job's host count, world size and
        workers per rank, and the samples each worker's stream had delivered, by worker
        index; in a synchronous job every rank's are the same), plus ``"from"``, the old
        streams' own ``resume_from`` when the checkpoint was taken during an elastic epoch.
        The new streams read what the old ones had not, exactly once, as many samples on every
        rank; ``start`` then counts samples of the new stream."""
        request = _request("stream", dataset, epoch, rank, world_size, seed, worker, num_workers)
        request["start"] = int(start)
        if resume_from is not None:
            request["resume_from"] = _origin(resume_from)
        if self.zero_copy:
            request["zero_copy"] = True
        s = self._claim(request)
        if s is None:
            s = Stream(self.socket_path, request, self.timeout, self._open.discard,
                       self.reconnect_timeout, readahead=self.readahead,
                       prefetch=self._prefetcher(), eager=self.eager_readahead)
        self._open.add(s)
        return s

    def _prefetcher(self):
        if not (self.readahead and self.prefetch_next_epoch):
            return None
        # Weak: a stream must not keep its client (and the client's speculative streams) alive.
        method = weakref.WeakMethod(self._prefetch)
        return lambda request: (m := method()) is not None and m(request)

    def _claim(self, request):
        """The speculative stream opened for exactly ``request``, taken out of the client (None
        if there is none); one for another epoch or start of the same slot is closed."""
        self._forked()
        with self._spec_lock:
            held = self._spec.pop(_slot(request), None)
        if held is None:
            return None
        spec_request, s = held
        if spec_request != request or not s._claim():
            s.close()
            return None
        return s

    def _forked(self):
        """In a child after fork, the parent's speculative streams are not this process's (they
        were disowned by ``_after_fork_in_child``) and a parent's thread may have held the lock."""
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._spec_lock = threading.Lock()
            self._spec = {}

    def _prefetch(self, request):
        """In a stream's thread, once it received END: opens the next epoch of ``request``
        and keeps it for ``stream()``. Failures are dropped: the caller opens it as usual."""
        nxt = dict(request, epoch=request["epoch"] + 1, start=0)
        nxt.pop("resume_from", None)  # an elastic resume covers its own epoch only
        key = _slot(nxt)
        self._forked()
        with self._spec_lock:
            if key in self._spec:
                return
            generation = self._generation
        try:
            s = Stream(self.socket_path, dict(nxt), self.timeout, self._open.discard,
                       self.reconnect_timeout, readahead=self.readahead,
                       prefetch=self._prefetcher(), speculative=True)
        except Exception as e:
            log.debug("did not open the next epoch of %s ahead: %s", key, e)
            return
        with self._spec_lock:
            if generation == self._generation and key not in self._spec:
                self._spec[key] = (nxt, s)
                return
        s.close()

    def plan(self, dataset, *, epoch, rank, world_size, seed=0, worker=0, num_workers=1,
             resume_from=None):
        """The START of the stream ``stream()`` would open with the same arguments, without
        opening it: the daemon registers no schedule and loads nothing (protocol 3, op
        ``plan``). Returns START's fields as a dict: ``dataset``, ``shards``, ``samples``
        (None without a manifest), ``position``, ``dropped``, ``fingerprint``, ... Waits for a
        restarting daemon like ``stream()``; a refused request raises ``DaemonError``."""
        request = _request("plan", dataset, epoch, rank, world_size, seed, worker, num_workers)
        if resume_from is not None:
            request["resume_from"] = _origin(resume_from)
        with Stream(self.socket_path, request, self.timeout, None, self.reconnect_timeout) as s:
            for _ in s:
                raise ProtocolError(f"the daemon at {self.socket_path} sent samples for a plan "
                                    f"request (it speaks protocol {s.peer_version}; op plan "
                                    f"needs 3)")
            return dict(s.start_fields)

    def close(self):
        """Closes every stream still open, and the next-epoch streams opened ahead."""
        self._forked()
        with self._spec_lock:
            self._generation += 1
            held, self._spec = list(self._spec.values()), {}
        for _, s in held:
            s.close()
        for s in list(self._open):
            s.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _slot(request):
    """What identifies a stream across epochs: everything but epoch, start and resume_from."""
    return (request["dataset"], request["rank"], request["world_size"], request["worker"],
            request["num_workers"], request["seed"])


def _needs(request):
    """(the protocol version to send with ``request``, the feature that needs it): the lowest
    version that has every feature the request uses."""
    version, feature = 1, "a stream"
    if request.get("start") is not None:
        version, feature = FEATURES["start"]
    if request["op"] == "plan":
        version, feature = FEATURES["plan"]
    if request.get("resume_from") is not None:
        version, feature = FEATURES["resume_from"]
    if request.get("zero_copy"):
        version, feature = FEATURES["zero_copy"]
    return version, feature


def _origin(o):
    """A ``resume_from`` dict as the protocol spells it (PROTOCOL.md, "Elastic resume")."""
    out = {"hosts": int(o["hosts"]), "world_size": int(o["world_size"]),
           "num_workers": int(o["num_workers"]), "positions": [int(p) for p in o["positions"]]}
    if o.get("from") is not None:
        out["from"] = _origin(o["from"])
    return out


def _request(op, dataset, epoch, rank, world_size, seed, worker, num_workers):
    return {
        "op": op,
        "dataset": dataset,
        "epoch": int(epoch),
        "rank": int(rank),
        "world_size": int(world_size),
        "worker": int(worker),
        "num_workers": int(num_workers),
        "seed": int(seed),
    }


def _text_source(samples, names):
    """A mix's samples name their source in the field ``__source__``: a ``str``, like
    ``__key__`` and ``__url__`` (costs nothing in batches without it)."""
    if "__source__" in names:
        for s in samples:
            s["__source__"] = s["__source__"].decode()
    return samples


class _Queue:
    """What a stream's read-ahead thread hands to the caller: batches (lists of samples), then
    None (END) or an exception. Holds no reference to the stream."""

    __slots__ = ("cond", "items", "bytes", "limit", "closed", "peak")

    def __init__(self, limit):
        self.cond = threading.Condition(threading.Lock())
        self.items = deque()  # (batch | None | exception, bytes)
        self.bytes = 0  # the BATCH body bytes of the batches in items
        self.limit = limit
        self.closed = False
        self.peak = 0  # the most bytes items ever held (for tests)


def _read_ahead(ref, q):
    """A stream's read-ahead thread: receives batches while fewer than ``q.limit`` bytes wait.
    It holds the stream only while receiving a batch, so a stream its caller dropped is
    collected (and closed) instead of being kept alive by its thread."""
    cond = q.cond
    try:
        while True:
            with cond:
                while q.bytes >= q.limit and not q.closed:
                    cond.wait()
                if q.closed:
                    return
            s = ref()
            if s is None:
                return
            item, size = s._receive()
            after = s._after_end() if item is None else None
            s = None  # the caller may have dropped the stream meanwhile: let it go
            with cond:
                if not q.closed:
                    q.items.append((item, size))
                    q.bytes += size
                    if q.bytes > q.peak:
                        q.peak = q.bytes
                    cond.notify_all()
            if item.__class__ is not list:
                if after is not None:
                    after()
                return
    finally:
        s = ref()
        if s is not None and s._closed:
            s._drop_connection()  # close() gave up waiting for us, or we are what closed it
        s = None


class Stream:
    """One stream: iterate it for samples. ``shards`` is how many shards it reads (``samples``,
    ``dropped``, ``fingerprint``: see PROTOCOL.md; ``start_fields``: the whole START, as a
    dict); after the last sample, ``end`` holds the daemon's summary of the last connection
    (``samples``, ``bytes``: what that connection sent).

    A daemon that goes away is waited for (``reconnect_timeout`` seconds; 0: not at all): the
    connection is cut, the daemon says ``shutdown`` or ``busy``, or nothing listens at the
    socket. The stream then reopens at ``position`` and goes on with the same samples in the
    same order, provided the daemon's plan fingerprint is the one it had (else
    ``PlanChangedError``). One warning per outage goes to the ``shardd`` logger, and an info
    line when the stream resumed. Opening the stream waits for the daemon the same way, so a
    DataLoader worker that opens an epoch while the daemon restarts goes on too; a wrong
    socket path is named in that first warning. ``reconnects`` counts the outages survived.

    With read-ahead (``readahead`` bytes, > 0) a thread receives the batches and all of the
    above runs in it: its errors reach the caller in order, after the samples received before
    them. ``position`` counts the samples yielded; ``readahead_bytes`` is (bytes queued now,
    the most ever queued)."""

    def __init__(self, socket_path, request, timeout=None, on_close=None,
                 reconnect_timeout=RECONNECT_TIMEOUT, readahead=0, prefetch=None,
                 speculative=False, eager=False):
        self._closed = False
        self._sock = None
        self._lo = 0  # first unread byte
        self._hi = 0  # end of received bytes
        self._on_close = on_close
        self._path = socket_path
        self._request = request
        self._timeout = timeout
        self._reconnect_timeout = reconnect_timeout
        # MSG_WAITALL needs a blocking socket; with a timeout, everything goes through the buffer.
        self._direct = timeout is None
        self._buf = bytearray(_INITIAL_BUFFER)
        self._mv = memoryview(self._buf)
        self._pending = []  # the batch being yielded
        self._pos = 0  # samples of it yielded
        self._given = 0  # samples yielded before it (``start`` included): see ``position``
        self._base = 0  # samples received in whole batches: where a reconnect resumes
        self._batch_bytes = 0  # the BATCH body size of the last batch read
        self._queue = None  # read-ahead: what the thread hands over (None: no thread)
        self._thread = None
        self._prefetch = prefetch  # called with the request once the thread received END
        self._speculative = speculative  # opened ahead by the client; not claimed yet
        self._ended = False  # the thread received END (read-ahead only)
        self._readahead = readahead
        self._handed = None  # perf_counter when the caller got the last batch read here
        self._took = 0.0  # how long reading that batch took
        self.end = None
        self.fingerprint = None  # set by the first START
        self.reconnects = 0
        self.peer_version = None  # the daemon's protocol version, from its preamble
        self._forked_from = None  # the pid that opened the stream, once inherited by a child
        self._recv = None  # how _fill receives: the socket's recv_into, or _recv_fds_into
        self._zc = False  # this connection is zero-copy (START said so)
        self._maps = {}  # map id -> memoryview of its mmap, while batches may refer to it
        self._fds = collections.deque()  # descriptors received, for the MAP frames to come
        self._released = collections.deque()  # (generation, map id), from the finalizers
        self._generation = 0  # which connection a map belongs to
        _LIVE.add(self)
        try:
            if speculative:
                # Opened ahead: a daemon that is busy or away is not waited for.
                self._reconnect_timeout = 0.0
                try:
                    self._connect()
                finally:
                    self._reconnect_timeout = reconnect_timeout
            else:
                self._connect()
            if readahead > 0 and eager:
                self._start_thread()
        except BaseException:
            self.close()
            raise

    def __iter__(self):
        return self

    def __next__(self):
        pending = self._pending
        if self._pos < len(pending):
            sample = pending[self._pos]
            self._pos += 1
            return sample
        return self._next_batch()

    def _next_batch(self):
        """The first sample of the next batch: from the read-ahead queue, or read here."""
        if self._closed:
            if self._forked_from is not None:
                raise ForkedStreamError(
                    f"this shardd stream was opened in process {self._forked_from} and inherited "
                    f"across fork by process {os.getpid()}: open streams in the process that "
                    f"reads them (after the fork)")
            raise StopIteration
        self._given += len(self._pending)
        self._pending, self._pos = [], 0
        try:
            if self._queue is None:
                batch = self._read_here()
            else:
                batch = self._take_batch()
        except BaseException:
            # The end, or a failed read: the byte stream is at an unknown position, never read
            # on. (An error from the thread comes after every sample received before it.)
            self.close()
            raise
        self._pending = batch
        self._pos = 1
        return batch[0]

    def _read_here(self):
        """Reads the next batch on the caller's thread, unless the caller has shown that it
        works between batches at least as long as a batch takes to receive: then the read-ahead
        thread takes over from here. A caller that only drains the stream (a benchmark, a
        copy) keeps reading it itself, which costs no thread handoffs."""
        now = time.perf_counter()
        if self._handed is not None and self._readahead > 0:
            if now - self._handed >= self._took:
                self._start_thread()
                return self._take_batch()
        try:
            batch = self._fetch()
        except StopIteration:
            if self._prefetch is not None and not self._speculative:
                self._drop_connection()  # first: the daemon's slot is free for the next one
                threading.Thread(target=self._prefetch, args=(dict(self._request),),
                                 daemon=True).start()
            raise
        self._handed = then = time.perf_counter()
        self._took = then - now
        return batch

    def _start_thread(self):
        """Hands the socket to a read-ahead thread (at a batch boundary)."""
        r = self._request
        self._queue = q = _Queue(self._readahead)
        self._thread = threading.Thread(
            target=_read_ahead, args=(weakref.ref(self), q), daemon=True,
            name=f"shardd read-ahead {r['dataset']} epoch {r['epoch']}")
        self._thread.start()

    def _fetch(self):
        """Reads the next batch, reconnecting as needed; StopIteration at END."""
        while True:
            try:
                batch = self._read_frames()
            except StopIteration:
                raise
            except Exception as e:
                if self._closed:
                    raise ConnectionLostError(f"the stream of {self._describe()} was closed") from e
                self._recover(e)
                continue
            # Every sample of it will be yielded: a reconnect resumes after it.
            self._base += len(batch)
            return batch

    def _read_frames(self):
        """The next batch (a non-empty list of samples); StopIteration after END."""
        while True:
            kind, length = self._frame_header()
            if kind == KIND_BATCH:
                self._batch_bytes = length
                pending = self._read_batch(length)
                if pending:
                    return pending
            elif KIND_MAP <= kind <= KIND_UNMAP and self._zc:
                self._batch_bytes = length
                pending = self._zero_copy_frame(kind, length)
                if pending:
                    return pending
            elif kind == KIND_END:
                self.end = self._json(length, "END")
                raise StopIteration
            else:
                self._unexpected(kind, length)

    # -- read-ahead (the stream's thread and the caller's side of its queue) ----------------

    def _receive(self):
        """In the thread: (the next batch, its size in bytes), or (None, 0) at END, or (the
        exception, 0). After END or an error the connection is closed (the daemon's slot
        freed at once)."""
        try:
            return self._fetch(), self._batch_bytes
        except StopIteration:
            self._drop_connection()
            return None, 0
        except BaseException as e:
            self._drop_connection()
            return e, 0

    def _after_end(self):
        """In the thread, after END: the call that opens the next epoch ahead, if this stream
        is to (not while it is itself an unclaimed speculative stream)."""
        with self._queue.cond:
            self._ended = True
            if self._speculative or self._prefetch is None:
                return None
        prefetch, request = self._prefetch, dict(self._request)
        return lambda: prefetch(request)

    def _claim(self):
        """``Client.stream()`` takes this speculative stream. False if it cannot be used."""
        if self._closed:
            return False
        if self._queue is None:  # not read yet: nothing to check
            self._speculative = False
            return True
        with self._queue.cond:
            self._speculative = False
            ended = self._ended
        if ended and self._prefetch is not None:
            # Its thread reached END before anyone claimed it (a short epoch): open the next
            # epoch now, in the background as the thread would have.
            threading.Thread(target=self._prefetch, args=(dict(self._request),),
                             daemon=True).start()
        return True

    def _take_batch(self):
        """The caller's side: the next item the thread queued (waits for it)."""
        q = self._queue
        with q.cond:
            while not q.items:
                if q.closed:  # closed from another thread while this one waited
                    raise StopIteration
                if not q.cond.wait(1.0) and not q.items and not self._thread.is_alive():
                    raise ProtocolError(f"the read-ahead thread of {self._describe()} ended "
                                        f"without a word")
            item, size = q.items.popleft()
            q.bytes -= size
            q.cond.notify_all()
        if item.__class__ is list:
            return item
        if item is None:
            raise StopIteration
        raise item

    def _nap(self, seconds):
        """Sleeps between reconnect attempts; a closed stream's thread wakes at once."""
        q = self._queue
        if q is None:
            time.sleep(seconds)
        else:
            with q.cond:
                q.cond.wait_for(lambda: q.closed, seconds)

    @property
    def position(self):
        """Samples of this epoch's stream delivered so far, including the ``start`` skipped:
        what to pass as ``start`` to resume right after the last sample yielded. (Samples the
        read-ahead thread received but the caller was not given are not counted.)"""
        return self._given + self._pos

    @property
    def readahead_bytes(self):
        """(bytes of batches waiting in the read-ahead queue now, the most it ever held)."""
        q = self._queue
        return (0, 0) if q is None else (q.bytes, q.peak)

    def close(self):
        """Stops the stream: its thread (the socket is shut down under it, so a blocked
        receive returns at once) and its connection."""
        if self._closed:
            return
        self._closed = True
        q, t = self._queue, self._thread
        if q is not None:
            with q.cond:
                q.closed = True
                q.items.clear()
                q.bytes = 0
                q.cond.notify_all()
        if t is not None and t.is_alive() and t is not threading.current_thread():
            sock = self._sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            t.join(_JOIN_TIMEOUT)
            if not t.is_alive():
                self._drop_connection()
            # else the thread closes the socket when it gets out of its call
        else:
            self._drop_connection()
        _LIVE.discard(self)
        if self._on_close is not None:
            self._on_close(self)

    def _inherited(self):
        """In a child after fork: close this process's copy of the socket (the parent's
        connection stays open) and refuse to read on. Checked only once the samples already
        decoded are gone, so the per-sample path costs nothing. The read-ahead thread did not
        survive the fork (and may have held the queue's lock): both are forgotten."""
        if not self._closed:
            self._forked_from = os.getppid()
            self._pending, self._pos = [], 0
            self._queue = self._thread = None
            self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()

    # -- connecting and reconnecting (the slow path) ------------------------------------

    def _describe(self):
        r = self._request
        return (f"dataset {r['dataset']!r} epoch {r['epoch']} rank {r['rank']} of "
                f"{r['world_size']}, worker {r['worker']} of {r['num_workers']}")

    def _handshake(self):
        """One attempt: connects, sends the request, reads the preamble; returns START."""
        self._drop_connection()
        self._sock = sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self._timeout)
        try:
            sock.connect(self._path)
        except socket.timeout:
            raise
        except OSError as e:
            why = e.strerror or str(e)
            raise UnavailableError(f"no shardd daemon at {self._path} ({why})",
                                   retry=e.errno in _RETRY_CONNECT, reason=why) from e
        body = json.dumps(self._request).encode()
        version, feature = _needs(self._request)
        sock.sendall(MAGIC + struct.pack("<H", version) + _HEADER.pack(len(body), KIND_REQUEST)
                     + body)
        zero_copy = bool(self._request.get("zero_copy"))
        # Zero copy: every receive takes descriptors too (a plain recv would drop them).
        self._recv = self._recv_fds_into if zero_copy else sock.recv_into
        self._direct = self._timeout is None and not zero_copy
        preamble = self._take(len(PREAMBLE))
        if preamble[:6] != MAGIC:
            raise ProtocolError(f"{self._path} is not a shardd socket")
        self.peer_version = struct.unpack_from("<H", preamble, 6)[0]
        if self.peer_version < version and zero_copy and self.peer_version >= _needs(
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
        kind, length = self._frame_header()
        if kind != KIND_START:
            self._unexpected(kind, length)
        start = self._json(length, "START")
        self._zc = zero_copy and start.get("zero_copy") is True
        return start

    def _drop_connection(self):
        """Closes the socket (not the stream) and forgets what was buffered from it."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._lo = self._hi = 0
        if self._request.get("zero_copy"):
            self._forget_maps()

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

    def _started(self, start):
        """Takes in a START: the stream's facts on the first, a check on a reconnect."""
        try:
            fingerprint = start.get("fingerprint", "")
            samples = start.get("samples")
            position = start.get("position", 0)
            shards, dataset = start["shards"], start["dataset"]
        except (AttributeError, KeyError) as e:
            raise ProtocolError(f"malformed START from the daemon at {self._path}: {start!r}") from e
        if self.fingerprint is None:
            self.shards = shards
            self.dataset = dataset
            # Exact-epoch facts (a dataset with a manifest): the stream's whole length this
            # epoch (None without a manifest), the samples this host leaves out, and the plan's
            # fingerprint, equal on every rank of a job that asked for the same epoch.
            self.samples = samples
            self.dropped = start.get("dropped", 0)
            self.fingerprint = fingerprint
            # Where the stream started (the request's ``start``); see ``position``.
            self._base = self._given = position
            self.start_fields = start
            return
        if (fingerprint, samples) != (self.fingerprint, self.samples):
            length = ("" if samples == self.samples
                      else f"; its length was {self.samples} samples, now {samples}")
            raise PlanChangedError(
                f"the shardd daemon at {self._path} came back with another plan for "
                f"{self._describe()}: plan fingerprint {self.fingerprint} before, {fingerprint} "
                f"now{length}. Its config (shards, manifest, host count or dataset settings) "
                f"changed, so the rest of the stream from sample {self._base} would be another "
                f"order: restore the config, or restart the epoch", self.fingerprint, fingerprint)
        if position != self._base:
            raise ProtocolError(f"the daemon at {self._path} resumed at sample {position}, "
                                f"not {self._base}")

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
        if isinstance(e, _ZeroCopyUnusable):
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

    # -- reading -------------------------------------------------------------------------

    def _fill(self, need, limit):
        """Makes ``need`` unread bytes available in the buffer, receiving at most ``limit``
        unread bytes in all (``limit >= need``), so reads stop where the caller says."""
        if self._hi - self._lo >= need:
            return
        if self._lo + limit > len(self._buf):
            # Move the unread tail to the front, growing the buffer for a large run.
            unread = self._hi - self._lo
            tail = bytes(self._mv[self._lo : self._hi])  # a copy: the ranges may overlap
            if limit > len(self._buf):
                self._mv.release()
                self._buf = bytearray(max(limit, 2 * len(self._buf)))
                self._mv = memoryview(self._buf)
            self._buf[:unread] = tail
            self._lo, self._hi = 0, unread
        recv_into = self._recv
        mv = self._mv
        end = self._lo + limit
        while self._hi - self._lo < need:
            n = recv_into(mv[self._hi : end])
            if n == 0:
                raise self._eof()
            self._hi += n

    def _take(self, n):
        """The next ``n`` bytes of the stream, as bytes."""
        if n >= DIRECT_MIN and self._direct:
            return self._take_direct(n)
        self._fill(n, n)
        lo = self._lo
        self._lo = lo + n
        return self._mv[lo : lo + n].tobytes()

    def _take_direct(self, n):
        """Receives ``n`` bytes into a new bytes object: one kernel copy, no buffer copy."""
        parts = []
        buffered = self._hi - self._lo
        if buffered:  # only after an unusual read pattern; correct either way
            take = min(buffered, n)
            parts.append(self._mv[self._lo : self._lo + take].tobytes())
            self._lo += take
        got = sum(map(len, parts))
        while got < n:
            chunk = self._sock.recv(n - got, socket.MSG_WAITALL)
            if not chunk:
                raise self._eof()
            parts.append(chunk)
            got += len(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _frame_header(self):
        self._fill(_HEADER.size, _HEADER.size)
        length, kind = _HEADER.unpack_from(self._buf, self._lo)
        self._lo += _HEADER.size
        return kind, length

    def _eof(self):
        return ConnectionLostError(
            f"the shardd daemon at {self._path} closed the connection mid-stream")

    def _unexpected(self, kind, length):
        if kind == KIND_ERROR:
            err = self._json(length, "ERROR")
            raise DaemonError(str(err.get("code", "")), str(err.get("message", "")))
        raise ProtocolError(f"unexpected frame kind {kind} from the daemon at {self._path}")

    def _json(self, length, what):
        """A START, END or ERROR body: a JSON object of at most ``MAX_JSON_FRAME`` bytes. A
        larger one is not read (only its beginning, for the message)."""
        frame = f"{'an' if what[0] in 'AEIOU' else 'a'} {what} frame"
        if length > MAX_JSON_FRAME:
            head = self._take(200)
            raise ProtocolError(
                f"the daemon at {self._path} sent {frame} of {length} bytes, over the limit of "
                f"{MAX_JSON_FRAME} bytes for one; it begins {head!r}")
        body = self._take(length)
        try:
            value = json.loads(body)
        except ValueError as e:
            raise ProtocolError(f"the daemon at {self._path} sent {frame} that is not JSON "
                                f"({e}): {body[:200]!r}") from None
        if not isinstance(value, dict):
            raise ProtocolError(f"the daemon at {self._path} sent {frame} that is not a JSON "
                                f"object: {body[:200]!r}")
        return value

    def _batch_head(self, length):
        """Reads a BATCH or MAPPED_BATCH body up to its payload: (samples, field names, URLs,
        descriptor words, payload bytes, max_piece)."""
        self._fill(_BATCH_HEADER.size, _BATCH_HEADER.size)
        n, n_words, n_names, n_urls, payload_offset, max_piece = _BATCH_HEADER.unpack_from(
            self._buf, self._lo
        )
        self._fill(payload_offset, payload_offset)
        buf, mv = self._buf, self._mv
        p = self._lo + _BATCH_HEADER.size
        tables = []
        for _ in range(n_names + n_urls):
            (ln,) = _U32.unpack_from(buf, p)
            p += 4
            tables.append(str(mv[p : p + ln], "utf-8"))
            p += ln
        names, urls = tables[:n_names], tables[n_names:]
        words = struct.unpack_from(f"<{n_words}I", buf, p)
        self._lo += payload_offset
        payload = length - payload_offset
        return n, names, urls, words, payload, max_piece

    def _read_batch(self, length):
        """Reads one BATCH body (``length`` bytes) and returns its samples."""
        n, names, urls, words, payload, max_piece = self._batch_head(length)
        if max_piece >= DIRECT_MIN and self._direct:
            return _text_source(self._read_pieces(n, names, urls, words), names)

        # Fast path: every piece is small. The whole payload as one bytes object (at least
        # DIRECT_MIN bytes: received straight into it), cut with slices: one copy per piece, and
        # no memoryview object per piece.
        data = self._take(payload)
        out = []
        append = out.append
        p = i = 0
        for _ in range(n):
            head = words[i]
            q = p + words[i + 1]
            sample = {"__key__": str(data[p:q], "utf-8"), "__url__": urls[head & 0xFFFF]}
            i += 2
            for _ in range(head >> 16):
                p = q
                q += words[i + 1]
                sample[names[words[i]]] = data[p:q]
                i += 2
            p = q
            append(sample)
        return _text_source(out, names)

    def _read_pieces(self, n, names, urls, words):
        """A batch with large pieces: small ones through the buffer (read in runs that stop at
        the next large piece), large ones received directly."""
        lengths = []
        i = 0
        for _ in range(n):
            f = words[i] >> 16
            lengths.append(words[i + 1])
            lengths.extend(words[i + 3 : i + 2 + 2 * f : 2])
            i += 2 + 2 * f
        # run[k]: bytes from piece k up to the next large piece (what one read may cover).
        run = [0] * (len(lengths) + 1)
        for k in range(len(lengths) - 1, -1, -1):
            run[k] = 0 if lengths[k] >= DIRECT_MIN else lengths[k] + run[k + 1]
        out = []
        i = k = 0
        for _ in range(n):
            head = words[i]
            if lengths[k] >= DIRECT_MIN:
                key = str(self._take_direct(lengths[k]), "utf-8")
            else:
                self._fill(lengths[k], run[k])
                key = str(self._mv[self._lo : self._lo + lengths[k]], "utf-8")
                self._lo += lengths[k]
            k += 1
            sample = {"__key__": key, "__url__": urls[head & 0xFFFF]}
            for j in range(head >> 16):
                ln = lengths[k]
                if ln >= DIRECT_MIN:
                    data = self._take_direct(ln)
                else:
                    self._fill(ln, run[k])
                    data = self._mv[self._lo : self._lo + ln].tobytes()
                    self._lo += ln
                sample[names[words[i + 2 + 2 * j]]] = data
                k += 1
            i += 2 + 2 * (head >> 16)
            out.append(sample)
        return out

    # -- zero copy (protocol 5) ----------------------------------------------------------

    def _recv_fds_into(self, view):
        """``recv_into`` that also takes the descriptors of MAP frames (SCM_RIGHTS), first
        sending the RELEASE of the maps nothing refers to any more."""
        if self._released:
            self._send_releases()
        n, anc, flags, _ = self._sock.recvmsg_into([view], _ANCILLARY, socket.MSG_CMSG_CLOEXEC)
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
                self._fds.extend(fds)
        if flags & socket.MSG_CTRUNC:
            # The kernel dropped the descriptor (this process is at its open-file limit): the
            # MAP frame it came with finds None and the stream falls back to the socket path.
            self._fds.append(None)
        return n

    def _send_releases(self):
        ids = []
        while self._released:
            generation, map_id = self._released.popleft()
            if generation == self._generation:
                ids.append(map_id)
        if ids:
            try:
                self._sock.sendall(_HEADER.pack(4 * len(ids), KIND_RELEASE)
                                   + struct.pack(f"<{len(ids)}I", *ids))
            except (BrokenPipeError, ConnectionResetError):
                # The daemon closed its side: after END (the rest of the stream may still wait
                # in the socket), or it went away (the next receive says so). Either way the
                # connection's maps are freed with it: nothing to release.
                pass

    def _forget_maps(self):
        """A connection ended: its map ids mean nothing to the next (memoryviews handed out
        stay valid: each mapping holds its file)."""
        self._generation += 1
        self._maps.clear()
        self._released.clear()
        while self._fds:
            fd = self._fds.popleft()
            if fd is not None:
                os.close(fd)

    def _zero_copy_frame(self, kind, length):
        """A MAP, UNMAP or MAPPED_BATCH frame; returns the samples of a batch."""
        if kind == KIND_MAPPED_BATCH:
            return self._read_mapped_batch(length)
        body = self._take(length)
        if kind == KIND_UNMAP:
            # No batch refers to these any more: once their memoryviews are gone, they are
            # released (weakref.finalize on each mmap).
            for (map_id,) in struct.iter_unpack("<I", body):
                self._maps.pop(map_id, None)
            return None
        map_id, size = struct.unpack("<IQ", body)
        if not self._fds:
            # Neither a descriptor nor MSG_CTRUNC: the daemon did not send one.
            raise ProtocolError(f"a MAP frame from the daemon at {self._path} came without "
                                f"its descriptor")
        fd = self._fds.popleft()
        if fd is None:
            limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            raise _ZeroCopyUnusable(
                f"the kernel dropped a shard file's descriptor (MSG_CTRUNC): this process is at "
                f"its open-file limit, RLIMIT_NOFILE = {limit} (ulimit -n)")
        try:
            mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        except OSError as e:
            # No mapping (address space, a limit): the socket path (``_recover``).
            raise _ZeroCopyUnusable(f"mapping a shard file failed: {e}") from e
        finally:
            os.close(fd)
        weakref.finalize(mm, self._released.append, (self._generation, map_id))
        self._maps[map_id] = memoryview(mm)
        return None

    def _read_mapped_batch(self, length):
        """A MAPPED_BATCH: as ``_read_batch``, with mapped fields as memoryview slices."""
        n, names, urls, words, payload, _ = self._batch_head(length)
        self._fill(payload, payload)
        buf, mv = self._buf, self._mv
        p = self._lo
        self._lo += payload
        maps = self._maps
        out = []
        i = 0
        mapped = 0
        for _ in range(n):
            head = words[i]
            klen = words[i + 1]
            i += 2
            sample = {"__key__": str(mv[p : p + klen], "utf-8"), "__url__": urls[head & 0xFFFF]}
            p += klen
            for _ in range(head >> 16):
                name, ln = words[i], words[i + 1]
                if name >> 31:
                    mapped += ln
                    off = words[i + 3] | (words[i + 4] << 32)
                    try:
                        sample[names[name & 0x7FFFFFFF]] = maps[words[i + 2]][off : off + ln]
                    except KeyError:
                        raise ProtocolError(f"the daemon at {self._path} referred to map "
                                            f"{words[i + 2]}, which it did not send") from None
                else:
                    sample[names[name]] = mv[p : p + ln].tobytes()
                    p += ln
                i += 5
            out.append(sample)
        # Read-ahead counts what a batch hands out, mapped bytes too: counting its frame (a few
        # bytes per field) let the thread take in, and keep pinned, gigabytes of shards.
        self._batch_bytes = length + mapped
        return _text_source(out, names)


# Room for the descriptors one receive can bring (one per MAP frame; a receive stops after
# the first message that carries any).
_ANCILLARY = socket.CMSG_SPACE(16 * 4)
