"""The client side of proto/PROTOCOL.md (version 5): ``Client`` opens streams; ``Stream`` is
one stream's samples. This module is the public one (``shardd.client.X``); the stream's parts
live in modules of their own, by concern:

- ``_frames``: the wire format, and decoding frames into samples (the per-sample code);
- ``_stream``: ``Stream``, the cursor (position, resume point) and START's facts;
- ``_readahead``: the thread that receives the next batches while the trainer works;
- ``_reconnect``: connecting, and reconnecting at the stream's position after an outage;
- ``_zerocopy``: shard files passed as descriptors, mapped, and released;
- ``_fork``: what a forked child must disown; ``_errors``: the exceptions.
"""

import logging
import mmap  # noqa: F401  (``shardd.client.mmap``: where tests patch ``mmap.mmap``)
import os
import threading
import weakref

# Defined in the modules of the stream's parts, public here: ``from shardd.client import X``.
from ._errors import (
    ConnectionLostError,
    DaemonError,
    Error,
    ForkedStreamError,
    PlanChangedError,
    PlanMismatch,
    ProtocolError,
    StreamTimeoutError,
    UnavailableError,
    VersionError,
)
from ._fork import register_fork_hook  # for shardd.torch's iterators
from ._frames import (
    DIRECT_MIN,
    FEATURES,
    KIND_BATCH,
    KIND_END,
    KIND_ERROR,
    KIND_MAP,
    KIND_MAPPED_BATCH,
    KIND_RELEASE,
    KIND_REQUEST,
    KIND_START,
    KIND_UNMAP,
    MAGIC,
    MAX_JSON_FRAME,
    PREAMBLE,
    VERSION,
)
from ._readahead import READAHEAD
from ._reconnect import FIRST_CONNECT_TIMEOUT, RECONNECT_TIMEOUT, RETRY_CODES
from ._reconnect import retold  # for shardd.torch and shardd.grain: their errors' wording
from ._stream import Stream

# The public classes keep the name users know them by (``shardd.client.DaemonError``) in
# tracebacks, reprs and pickles, wherever they are defined.
for _cls in (Stream, Error, DaemonError, ProtocolError, ConnectionLostError, UnavailableError,
             StreamTimeoutError, VersionError, PlanMismatch, PlanChangedError, ForkedStreamError):
    _cls.__module__ = __name__
del _cls

log = logging.getLogger("shardd")


class Client:
    """A connection factory for one daemon socket. Each ``stream()`` opens its own connection,
    so a client can be shared by the DataLoader workers of a process after fork only if each
    worker opens its own streams (it does: streams are never shared).

    ``timeout``: a socket timeout in seconds (None blocks; a timeout turns off the direct
    receive of large fields). ``reconnect_timeout``: how long a stream keeps trying to reach a
    daemon that went away, in seconds (default 300; 0 turns reconnecting off; ``float("inf")``
    never gives up); see ``Stream``.

    ``first_connect_timeout`` (default 5 s, ``FIRST_CONNECT_TIMEOUT``): how long a stream
    opened before any stream of this client reached the daemon keeps trying when there is no
    socket file at ``socket_path``. No daemon was ever seen there (not started, another path,
    died at start-up), so it then raises ``UnavailableError`` naming the path, the daemon's
    ``server.socket`` and the likely causes, instead of waiting ``reconnect_timeout``. A socket
    file that is there (a daemon restarting; systemd's, with socket activation) or a systemd
    ``shardd.service`` that is starting is waited for up to ``reconnect_timeout``, as is a
    socket gone once a stream of this client was served (``connected``: a restart). A socket
    the process may not open (permission denied) raises at once, naming its mode and owners.
    ``reconnect_timeout=0`` raises any of these at once.

    ``readahead``: bytes of batches each stream may receive ahead of the caller (default 4 MiB,
    ``READAHEAD``): a background thread per stream receives and decodes the next batches while
    the trainer works, and stops once this many bytes wait (plus at most one batch: ~1 MiB, or
    one sample when a sample is larger), so a paused trainer's stream is parked by the daemon as
    without it. 0: no thread, the caller's ``next`` reads the socket itself. The thread starts
    at the first batch boundary where the caller spent at least as long since the previous
    batch as that batch took to receive (a trainer: at its second batch); a caller that only
    drains the stream keeps reading it itself, as handing batches between two threads would
    cost it throughput; a zero-copy stream starts it only once its reads mostly wait for the
    daemon (docs/client.md, "Read-ahead"). ``eager_readahead=True`` starts the thread with
    the stream.

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
    over the socket from where it was, with a warning, whatever ``reconnect_timeout``.

    ``sample_seeds``: every sample also has ``__seed__``, an int in [0, 2**63) that depends
    only on the stream's ``seed`` and ``epoch`` and the sample's ``__url__`` and ``__key__``
    (PROTOCOL.md, "Per-sample seeds"): seed a sample's random augmentations from it and they
    replay exactly after a resume, a daemon restart or a resize, on either delivery. The client
    computes it (about a microsecond per sample); nothing changes on the wire."""

    def __init__(self, socket_path, timeout=None, reconnect_timeout=RECONNECT_TIMEOUT,
                 readahead=READAHEAD, prefetch_next_epoch=False, eager_readahead=False,
                 zero_copy=False, sample_seeds=False,
                 first_connect_timeout=FIRST_CONNECT_TIMEOUT):
        self.socket_path = str(socket_path)
        self.sample_seeds = bool(sample_seeds)
        # Protocol 5: each stream asks for its shards' cache files as descriptors; large
        # fields are then read-only memoryviews of a mapping (PROTOCOL.md, "Zero copy").
        self.zero_copy = bool(zero_copy)
        self.timeout = timeout
        self.reconnect_timeout = max(0.0, float(reconnect_timeout))  # inf: wait forever
        self.first_connect_timeout = max(0.0, float(first_connect_timeout))
        # Whether a stream of this client has reached the daemon: a missing socket is then a
        # restart, waited for up to reconnect_timeout. A framework whose processes make clients
        # of their own (shardd.torch's DataLoader workers) sets it from what the others saw.
        self.connected = False
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
               resume_from=None, history=None):
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
        rank; ``start`` then counts samples of the new stream.

        ``history`` (protocol 7) lists the topologies the job had before this one, oldest
        first: ``[{"hosts", "world_size", "num_workers", "last_epoch"}, ...]``, ``last_epoch``
        being the last epoch counted at that topology (the one its elastic resume finished).
        With it, a dataset with ``samples_per_epoch`` (and a mix's sources) goes on with the
        pass that was in progress at each resize, sample for sample; ``next_history`` makes
        the entry. Send the same history with every epoch after the resize."""
        request = _request("stream", dataset, epoch, rank, world_size, seed, worker, num_workers)
        request["start"] = int(start)
        if resume_from is not None:
            request["resume_from"] = _origin(resume_from)
        if history:
            request["history"] = _history(history)
        if self.zero_copy:
            request["zero_copy"] = True
        s = self._claim(request)
        if s is None:
            s = Stream(self.socket_path, request, self.timeout, self._open.discard,
                       self.reconnect_timeout, readahead=self.readahead,
                       prefetch=self._prefetcher(), eager=self.eager_readahead,
                       sample_seeds=self.sample_seeds, first_connect=self._first_connect())
        self.connected = True
        self._open.add(s)
        return s

    def _first_connect(self):
        """The grace a stream's opening gives a missing socket: None once the daemon was seen."""
        return None if self.connected else self.first_connect_timeout

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
        origin = nxt.pop("resume_from", None)  # an elastic resume covers its own epoch only
        if origin is not None:
            # The epochs after it carry the topology it resized (what shardd.torch sends).
            nxt["history"] = next_history(request.get("history"), origin, request["epoch"])
        key = _slot(nxt)
        self._forked()
        with self._spec_lock:
            if key in self._spec:
                return
            generation = self._generation
        try:
            s = Stream(self.socket_path, dict(nxt), self.timeout, self._open.discard,
                       self.reconnect_timeout, readahead=self.readahead,
                       prefetch=self._prefetcher(), speculative=True,
                       sample_seeds=self.sample_seeds)
        except Exception as e:
            log.debug("did not open the next epoch of %s ahead: %s", key, e)
            return
        with self._spec_lock:
            if generation == self._generation and key not in self._spec:
                self._spec[key] = (nxt, s)
                return
        s.close()

    def plan(self, dataset, *, epoch, rank, world_size, seed=0, worker=0, num_workers=1,
             resume_from=None, history=None):
        """The START of the stream ``stream()`` would open with the same arguments, without
        opening it: the daemon registers no schedule and loads nothing (protocol 3, op
        ``plan``). Returns START's fields as a dict: ``dataset``, ``shards``, ``samples``
        (None without a manifest), ``position``, ``dropped``, ``fingerprint``, ... Waits for a
        restarting daemon like ``stream()``; a refused request raises ``DaemonError``."""
        request = _request("plan", dataset, epoch, rank, world_size, seed, worker, num_workers)
        if resume_from is not None:
            request["resume_from"] = _origin(resume_from)
        if history:
            request["history"] = _history(history)
        with Stream(self.socket_path, request, self.timeout, None, self.reconnect_timeout,
                    first_connect=self._first_connect()) as s:
            self.connected = True
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


def _origin(o):
    """A ``resume_from`` dict as the protocol spells it (PROTOCOL.md, "Elastic resume")."""
    out = {"hosts": int(o["hosts"]), "world_size": int(o["world_size"]),
           "num_workers": int(o["num_workers"]), "positions": [int(p) for p in o["positions"]]}
    if o.get("from") is not None:
        out["from"] = _origin(o["from"])
    return out


def _history(hops):
    """A ``history`` list as the protocol spells it (PROTOCOL.md, "Passes across a resize")."""
    return [{"hosts": int(h["hosts"]), "world_size": int(h["world_size"]),
             "num_workers": int(h["num_workers"]), "last_epoch": int(h["last_epoch"])} for h in hops]


def next_history(history, resume_from, epoch):
    """The ``history`` of the epochs after an elastic resume of ``epoch``: ``history`` (the one
    sent with that resume, or None) and the topology that planned the resumed epoch (the
    oldest of ``resume_from``'s chain), whose last epoch it was."""
    base = resume_from
    while base.get("from") is not None:
        base = base["from"]
    return _history(list(history or []) + [dict(
        hosts=base["hosts"], world_size=base["world_size"], num_workers=base["num_workers"],
        last_epoch=epoch)])


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
