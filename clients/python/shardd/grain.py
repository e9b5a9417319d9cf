"""Grain (JAX) integration: a shardd stream as a ``grain.IterDataset``.

``import shardd`` never imports grain or jax; ``import shardd.grain`` imports grain, and jax
only to find the process's rank (``pip install shardd[grain]``). docs/jax.md has the recipes.

- **Ranks.** ``rank`` and ``world_size`` default to ``jax.process_index()`` and
  ``jax.process_count()``, read when the dataset is made (in the trainer's process, before
  ``mp_prefetch`` starts workers): one rank per JAX process, which on a TPU VM slice is one
  per host, so the daemon's ``host.index = "auto"`` serves exactly its own host's rank.
- **Streams.** ``num_streams`` daemon streams per process (the ``worker``/``num_workers`` of
  the protocol, the analogue of DataLoader workers), each read ahead in a thread of this
  process, and interleaved round-robin: one sample of stream 0, one of stream 1, ..., a
  stream that ended is passed over. Deterministic, whatever the threads' timing.
  ``mp_prefetch(n)`` composes on top: each of its ``n`` worker processes reads its own
  ``num_streams`` streams (``set_slice``), ``n * num_streams`` streams in all.
- **Epochs.** An iterator reads ``num_epochs`` epochs (None: without end) from ``epoch`` on;
  every stream of an epoch ends before the next epoch's streams open.
- **Exact resume.** The iterator's ``get_state()`` is a small JSON-serialisable dict: epoch,
  each stream's position (samples delivered, the client's ``start``) and whether it ended,
  the next stream's turn, and the plan fingerprints. ``set_state()`` reopens each stream at
  its position: the samples that follow are those of an uninterrupted run, in the same order.
  A daemon whose plan changed meanwhile raises ``PlanChangedError``. Grain's orbax
  ``CheckpointHandler`` (``grain.checkpoint.CheckpointSave``/``CheckpointRestore``) saves
  and restores it.
- **Samples** are the client's: webdataset-shaped dicts (``__key__``, ``__url__``, field ->
  bytes); decode and batch them with ``.map``, ``.filter``, ``.batch``.
"""

import collections
import os
import threading

import grain

from .client import (
    FIRST_CONNECT_TIMEOUT,
    RECONNECT_TIMEOUT,
    Client,
    PlanChangedError,
    UnavailableError,
    retold,
)

__all__ = ["ShardDataset", "DEFAULT_SOCKET", "PlanChangedError"]

DEFAULT_SOCKET = "/run/shardd/shardd.sock"
STATE_VERSION = 1
# Decoded BATCH frames (about 1 MiB of payload each) a stream's thread reads ahead.
READ_AHEAD = 4
# How this API takes a socket path, in the errors that name the daemon's server.socket.
POINT_AT = "pass that path as ShardDataset(socket=...) or in $SHARDD_SOCKET"

_END = object()


def _jax_topology():
    import jax

    return jax.process_index(), jax.process_count()


class ShardDataset(grain.IterDataset):
    """One rank's share of a shardd dataset, epoch after epoch, as a ``grain.IterDataset``.

    ``socket``: the daemon's socket (default: ``$SHARDD_SOCKET``, else
    ``/run/shardd/shardd.sock``). ``rank``/``world_size``: this process among all of the job's
    processes (default: ``jax.process_index()``/``jax.process_count()``). ``seed``: the run's
    seed, the same on every rank. ``epoch``: the first epoch; ``num_epochs``: how many an
    iterator reads (None: without end). ``num_streams``: daemon streams this process reads at
    once, each in a thread (more streams: more shards read and parsed in parallel by the
    daemon, a deeper read-ahead). ``timeout``, ``reconnect_timeout``, ``zero_copy``,
    ``sample_seeds`` (each sample's ``__seed__``, for ``random_map``-like augmentation),
    ``first_connect_timeout`` (an iterator whose streams never reached the daemon fails after
    that long, default 5 s, when there is no socket file at ``socket``): as for ``Client``
    (with zero copy, fields over 4 KiB are read-only memoryviews of the daemon's cache files:
    a pipeline's first ``map`` should turn them into arrays).

    Iterators yield webdataset-shaped dicts: ``{"__key__": str, "__url__": str, field: bytes}``.
    """

    def __init__(self, dataset, socket=None, rank=None, world_size=None, seed=0, epoch=0,
                 num_epochs=1, num_streams=1, timeout=None,
                 reconnect_timeout=RECONNECT_TIMEOUT, zero_copy=False, sample_seeds=False,
                 first_connect_timeout=FIRST_CONNECT_TIMEOUT):
        super().__init__()
        if rank is None or world_size is None:
            jax_rank, jax_world = _jax_topology()
            rank = jax_rank if rank is None else rank
            world_size = jax_world if world_size is None else world_size
        if int(num_streams) < 1:
            raise ValueError(f"num_streams must be at least 1, not {num_streams}")
        if num_epochs is not None and int(num_epochs) < 0:
            raise ValueError(f"num_epochs must be None or at least 0, not {num_epochs}")
        self.dataset = str(dataset)
        self.socket = str(socket or os.environ.get("SHARDD_SOCKET") or DEFAULT_SOCKET)
        self.rank, self.world_size = int(rank), int(world_size)
        self.seed, self.epoch = int(seed), int(epoch)
        self.num_epochs = None if num_epochs is None else int(num_epochs)
        self.num_streams = int(num_streams)
        self.timeout = timeout
        self.reconnect_timeout = reconnect_timeout
        self.first_connect_timeout = first_connect_timeout
        self.zero_copy = bool(zero_copy)
        self.sample_seeds = bool(sample_seeds)
        # mp_prefetch's worker slice (set_slice): this process reads the streams whose index
        # is slice_start mod slice_step, of num_streams * slice_step in all.
        self._slice = (0, 1)

    def set_slice(self, sl, sequential_slice=False):
        """Grain's ``mp_prefetch`` calls this in each of its worker processes: worker ``i`` of
        ``n`` reads its own ``num_streams`` of the rank's ``n * num_streams`` streams."""
        start, step = sl.start or 0, sl.step or 1
        if sl.stop is not None:
            raise ValueError(f"shardd.grain.ShardDataset cannot read a bounded slice: {sl}")
        # Slices compose (a slice of a slice), as grain's own sources do.
        base, base_step = self._slice
        self._slice = (base + start * base_step, base_step * step)

    @property
    def workers(self):
        """(the stream indices this process reads, the rank's stream count)."""
        start, step = self._slice
        return [start + step * j for j in range(self.num_streams)], step * self.num_streams

    def __iter__(self):
        return ShardDatasetIterator(self)

    def __str__(self):
        return (f"shardd.grain.ShardDataset({self.dataset!r}, rank={self.rank}, "
                f"world_size={self.world_size}, seed={self.seed}, streams={self.workers[0]} of "
                f"{self.workers[1]})")


class _Reader:
    """One stream, read ahead in a thread: whole decoded BATCH frames, at most ``READ_AHEAD``
    ahead of the consumer. The consumer's side (``next``) counts what it was given."""

    def __init__(self, client, request, start, fingerprint):
        self._client = client
        self._request = request
        self.position = start  # samples of this epoch's stream given to the consumer
        self.fingerprint = fingerprint  # expected (a restored state), then the daemon's
        self._cond = threading.Condition()
        self._chunks = collections.deque()
        self._chunk, self._i = (), 0
        self._stopped = False
        self._stream = None
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"shardd-{request['dataset']}-{request['worker']}")
        self._thread.start()

    def _run(self):
        try:
            r = self._request
            stream = self._client.stream(
                r["dataset"], epoch=r["epoch"], rank=r["rank"], world_size=r["world_size"],
                seed=r["seed"], worker=r["worker"], num_workers=r["num_workers"],
                start=self.position)
            with self._cond:
                if self._stopped:
                    stream.close()
                    return
                self._stream = stream
            if self.fingerprint and stream.fingerprint != self.fingerprint:
                raise PlanChangedError(
                    f"cannot resume epoch {r['epoch']} of dataset {r['dataset']!r} exactly: the "
                    f"state was saved on plan {self.fingerprint}, the daemon now plans "
                    f"{stream.fingerprint} (the shards, manifest, host count or dataset "
                    f"settings changed, or the trainer runs another seed or world size)",
                    self.fingerprint, stream.fingerprint)
            self.fingerprint = stream.fingerprint
            for first in stream:
                # The rest of the frame the client decoded with it, without a next() each.
                chunk = [first]
                chunk += stream.rest_of_batch()
                if not self._put(chunk):
                    return
            self._put(_END)
        except BaseException as e:  # handed to the consumer, after the samples before it
            with self._cond:
                if self._stopped:
                    return
            if isinstance(e, UnavailableError):
                e = retold(e, POINT_AT, "start `shardd serve`, or pass ShardDataset(socket=...) "
                                        "or set SHARDD_SOCKET to its server.socket")
            self._put(e)
        finally:
            if self._stream is not None:
                self._stream.close()

    def _put(self, item):
        with self._cond:
            while len(self._chunks) >= READ_AHEAD and not self._stopped:
                self._cond.wait()
            if self._stopped:
                return False
            self._chunks.append(item)
            self._cond.notify_all()
            return True

    def next(self):
        """The next sample, or ``_END``; raises what the stream raised, in its place."""
        if self._i < len(self._chunk):
            sample = self._chunk[self._i]
            self._i += 1
            self.position += 1
            return sample
        with self._cond:
            while not self._chunks:
                self._cond.wait()
            item = self._chunks.popleft()
            self._cond.notify_all()
        if item is _END:
            return _END
        if isinstance(item, BaseException):
            with self._cond:
                self._chunks.appendleft(item)  # raised again on the next call
            raise item
        self._chunk, self._i = item, 1
        self.position += 1
        return item[0]

    def stop(self):
        """Ends the thread and the stream's connection (the daemon cancels the stream). A
        thread still opening its stream closes it itself once open."""
        with self._cond:
            self._stopped = True
            stream = self._stream
            self._cond.notify_all()
        if stream is None:
            return
        # The cut is ours, not the daemon's: no reconnect, no warning about it; it wakes the
        # thread if it waits in recv.
        stream.interrupt()
        self._thread.join()
        stream.close()


class ShardDatasetIterator(grain.DatasetIterator):
    """The iterator of a ``ShardDataset``; see ``get_state``/``set_state``."""

    def __init__(self, ds):
        super().__init__()
        self._ds = ds
        self._workers, self._num_workers = ds.workers
        self._identity = dict(dataset=ds.dataset, seed=ds.seed, rank=ds.rank,
                              world_size=ds.world_size, num_workers=self._num_workers,
                              workers=list(self._workers))
        self._client = Client(ds.socket, ds.timeout, ds.reconnect_timeout, prefetch_next_epoch=True,
                              zero_copy=ds.zero_copy, sample_seeds=ds.sample_seeds,
                              first_connect_timeout=ds.first_connect_timeout)
        self._end_epoch = None if ds.num_epochs is None else ds.epoch + ds.num_epochs
        self._readers = None
        self._reset(ds.epoch)

    def _reset(self, epoch, positions=None, ended=None, turn=0, fingerprints=None):
        k = len(self._workers)
        self._epoch = epoch
        self._positions = list(positions or [0] * k)
        self._ended = list(ended or [False] * k)
        self._turn = turn
        self._fingerprints = list(fingerprints or [None] * k)

    def _open(self):
        ds = self._ds
        self._readers = []
        for i, worker in enumerate(self._workers):
            if self._ended[i]:
                self._readers.append(None)
                continue
            request = dict(dataset=ds.dataset, epoch=self._epoch, rank=ds.rank,
                           world_size=ds.world_size, seed=ds.seed, worker=worker,
                           num_workers=self._num_workers)
            self._readers.append(_Reader(self._client, request, self._positions[i],
                                         self._fingerprints[i]))

    def _stop(self):
        """Closes the streams, keeping their positions and fingerprints."""
        if self._readers is not None:
            for i, r in enumerate(self._readers):
                if r is not None:
                    r.stop()
                    self._positions[i] = r.position
                    self._fingerprints[i] = r.fingerprint
            self._readers = None

    def __next__(self):
        self._assert_not_closed()
        while True:
            if self._end_epoch is not None and self._epoch >= self._end_epoch:
                raise StopIteration
            if self._readers is None:
                self._open()
            readers = self._readers
            k = len(readers)
            for _ in range(k):
                i = self._turn
                r = readers[i]
                if r is None:
                    self._turn = (i + 1) % k
                    continue
                sample = r.next()
                self._turn = (i + 1) % k
                if sample is _END:
                    self._ended[i] = True
                    self._positions[i] = r.position
                    self._fingerprints[i] = r.fingerprint
                    r.stop()
                    readers[i] = None
                    continue
                return sample
            # Every stream of the epoch ended: the next epoch.
            self._readers = None
            self._reset(self._epoch + 1)

    def get_state(self):
        """Where the iterator is, as a small JSON-serialisable dict."""
        positions, fingerprints = list(self._positions), list(self._fingerprints)
        if self._readers is not None:
            for i, r in enumerate(self._readers):
                if r is not None:
                    positions[i], fingerprints[i] = r.position, r.fingerprint
        return dict(self._identity, shardd=STATE_VERSION, epoch=self._epoch,
                    positions=positions, ended=list(self._ended), turn=self._turn,
                    fingerprints=fingerprints)

    def set_state(self, state):
        """Makes the iterator continue right after the last sample ``state`` counted: every
        stream reopens at its position, and the samples that follow are those an uninterrupted
        iterator yields, in the same order."""
        if not isinstance(state, dict) or state.get("shardd") != STATE_VERSION:
            raise ValueError(f"not a shardd.grain state (version {STATE_VERSION}): {state!r}")
        for key, value in self._identity.items():
            if state.get(key) != value:
                raise ValueError(
                    f"cannot resume exactly: the state is of {_describe(state)}, this iterator "
                    f"reads {_describe(self._identity)} ({key} differs). Restore each process's "
                    f"own state into a dataset with the same num_streams (and mp_prefetch "
                    f"workers)")
        self._stop()
        self._reset(int(state["epoch"]), state["positions"], state["ended"], int(state["turn"]),
                    state["fingerprints"])

    def close(self):
        """Closes the streams (Grain's ``__del__`` calls this too); the iterator then refuses
        to go on."""
        if not self._closed and getattr(self, "_readers", None) is not None:
            self._stop()
        super().close()

    def __str__(self):
        return f"ShardDatasetIterator({self._ds})"


def _describe(s):
    return (f"dataset {s.get('dataset')!r} seed {s.get('seed')} rank {s.get('rank')} of "
            f"{s.get('world_size')}, streams {s.get('workers')} of {s.get('num_workers')}")
