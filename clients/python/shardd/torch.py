"""PyTorch integration: a shardd stream as a ``torch.utils.data.IterableDataset``.

``import shardd`` never imports torch; ``import shardd.torch`` does (``pip install
shardd[torch]``). Everything here is a thin layer over ``shardd.Client.stream``:

- **Workers.** Each DataLoader worker opens its own stream, with ``worker`` and
  ``num_workers`` taken from ``torch.utils.data.get_worker_info()`` in that worker, so the
  workers of a rank together read the rank's share exactly once. Nothing is opened before
  ``__iter__`` runs inside the process that iterates; an iterator inherited across ``fork``
  refuses to go on (``ForkedStreamError``) and its copy of the socket is closed in the child.
- **Ranks.** ``rank`` and ``world_size`` default to ``torch.distributed``'s when it is
  initialised, else to PyTorch/XLA's (``torch_xla.runtime.global_ordinal()`` and
  ``world_size()``) in the replicas of ``xmp.spawn`` or ``torch_xla.launch``, else 0 and 1.
  They are read in the trainer's process, before workers exist.
- **Epochs.** ``set_epoch(e)`` before each epoch, on every rank, as with
  ``DistributedSampler``. The epoch lives in shared memory, so persistent workers see it too.
  When ``torch.distributed`` is initialised, ``set_epoch`` checks with one
  ``all_gather_object`` that every rank asked for the same plan (``PlanMismatch`` if not).
- **Exact resume.** ``state_dict()`` / ``load_state_dict()`` (the ``Stateful`` protocol that
  torchdata's ``StatefulDataLoader`` calls in each worker) carry a stream's position; a
  loaded state reopens the stream with ``start=position``. For the plain DataLoader,
  ``skip(batches, batch_size)`` resumes after a number of batches (docs/pytorch.md).
- **Elastic resume.** ``ShardDataset(..., resume_from=STATE)``, where STATE is any old rank's
  ``StatefulDataLoader.state_dict()`` (or the dataset's own state) taken at another topology
  (hosts, world size, workers): the rest of that epoch is read exactly once across the new
  ranks, as many samples on each (the daemon's ``resume_from``, proto/PROTOCOL.md).
- **Daemon restarts.** The client's streams reconnect and resume at their position when the
  daemon restarts (``reconnect_timeout``, default 300 s; proto/PROTOCOL.md, "Reconnecting"),
  so a worker's stream survives a restart without the trainer seeing it. Until a stream of
  the dataset has reached the daemon (in any of its processes), no socket file at ``socket``
  is not a restart: it fails after ``first_connect_timeout`` (default 5 s) with the likely
  causes.
- **Samples** are the client's: webdataset-shaped dicts (``__key__``, ``__url__``, field ->
  bytes); ``compose(*stages)`` applies webdataset pipeline stages inside the worker.
"""

import functools
import os
import sys
import weakref

import torch
import torch.utils.data

from .client import (
    FIRST_CONNECT_TIMEOUT,
    RECONNECT_TIMEOUT,
    Client,
    DaemonError,
    ForkedStreamError,
    PlanChangedError,
    PlanMismatch,
    ProtocolError,
    UnavailableError,
    next_history,
    register_fork_hook,
    retold,
)

__all__ = [
    "ShardDataset",
    "PlanMismatch",
    "PlanChangedError",
    "ForkedStreamError",
    "resume_epoch",
    "elastic_origin",
    "DEFAULT_SOCKET",
]

DEFAULT_SOCKET = "/run/shardd/shardd.sock"
STATE_VERSION = 1


def _distributed():
    """torch.distributed when it is initialised in this process, else None."""
    dist = getattr(torch, "distributed", None)
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist
    return None


def _xla_topology():
    """(global ordinal, world size) from PyTorch/XLA's runtime when this process runs replicas
    of an XLA job (``xmp.spawn``, ``torch_xla.launch``), else None. Never imports torch_xla
    (slow, and nothing to ask if the trainer did not), and never starts its runtime: asked in
    the parent before ``xmp.spawn``, ``world_size()`` would start it there, and spawn would
    then refuse. Not asked in a DataLoader worker: the trainer's process reads it and the
    workers inherit it (a spawned worker would start a runtime of its own, of world size 1)."""
    xla, xr = sys.modules.get("torch_xla"), sys.modules.get("torch_xla.runtime")
    if xr is None or torch.utils.data.get_worker_info() is not None:
        return None
    started = getattr(getattr(xla, "_XLAC", None), "_xla_runtime_is_initialized", None)
    if started is None or not started():
        return None
    world = xr.world_size()
    # One replica says nothing the default does not, and leaves torch.distributed to come.
    return (xr.global_ordinal(), world) if world > 1 else None


# How this API takes a socket path, in the errors that name the daemon's server.socket.
POINT_AT = "pass that path as ShardDataset(socket=...) or in $SHARDD_SOCKET"


def _ask(client, op, dataset, served=None, **kw):
    """``client.stream(dataset, **kw)`` (or ``plan``), saying what to do when no daemon
    listens at the socket. ``served``: the dataset's shared flag, set once the daemon answered
    (so that the clients of later DataLoader workers take a missing socket for a restart)."""
    try:
        got = getattr(client, op)(dataset, **kw)
    except UnavailableError as e:
        raise retold(e, POINT_AT, "start `shardd serve`, or pass ShardDataset(socket=...) or "
                                  "set SHARDD_SOCKET to its server.socket") from e
    if served is not None and not served[0]:
        served[0] = True
    return got


def _worker():
    """(worker index, worker count) of this process: the DataLoader's, or (0, 1)."""
    info = torch.utils.data.get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


class _Cursor:
    """Where one (rank, worker) stream of one epoch is: what ``state_dict`` reports. Holds the
    open ``Stream`` only while its iterator lives (``retire`` closes it), so a dataset that
    remembers its last cursor never keeps a socket open."""

    def __init__(self, fields, start, fingerprint):
        # dataset, seed, rank, world_size, worker, num_workers, epoch (and resume_from in an
        # elastic epoch)
        self.fields = fields
        self.hosts = None  # the daemons' host count, from START: what an elastic resume needs
        self.start = start
        self.fingerprint = fingerprint
        self.stream = None
        self.position = start
        self.ended = False
        self.pid = os.getpid()

    def state(self):
        position = self.stream.position if self.stream is not None else self.position
        return dict(
            self.fields,
            shardd=STATE_VERSION,
            position=position,
            fingerprint=self.fingerprint,
            ended=self.ended,
            hosts=self.hosts,
        )

    def retire(self):
        if self.stream is not None:
            self.position = self.stream.position
            self.stream.close()
            self.stream = None


def _exhausted():
    raise StopIteration


def _failed(what):
    raise ProtocolError(f"this stream failed earlier ({what}); resume from state_dict() in a new "
                        f"iteration")


def _refuse(pid):
    raise ForkedStreamError(
        f"this shardd stream iterator was created in process {pid} and inherited across fork by "
        f"process {os.getpid()}: iterate the ShardDataset inside the process that reads it "
        f"(each DataLoader worker calls iter() on its own copy of the dataset)")


class _ShardIterator:
    """The iterator ``ShardDataset.__iter__`` makes: opens its stream on the first ``next``.
    It holds no reference to itself (no cycle), so dropping it closes the stream at once."""

    def __init__(self, client, cursor, past_end_is_empty, served=None):
        self._client = client
        self._served = served
        self._cursor = cursor
        self._past_end_is_empty = past_end_is_empty
        self._next = _exhausted if cursor.ended else None
        # Closes the stream when the consumer drops the iterator (``break``, a finished
        # fetcher), even though the dataset keeps the cursor for state_dict().
        weakref.finalize(self, cursor.retire)
        register_fork_hook(self, _ShardIterator._inherited)

    def __iter__(self):
        return self

    def __next__(self):
        nxt = self._next
        try:
            if nxt is None:
                return self._open()
            return nxt()
        except StopIteration:
            self._finish()
            raise
        except Exception as e:
            if nxt is not None:  # the stream closed itself; its position stays exact
                self._next = functools.partial(_failed, f"{type(e).__name__}: {e}")
            raise

    def _open(self):
        c = self._cursor
        f = c.fields
        try:
            stream = _ask(
                self._client, "stream", f["dataset"], served=self._served, epoch=f["epoch"],
                rank=f["rank"], world_size=f["world_size"], seed=f["seed"], worker=f["worker"],
                num_workers=f["num_workers"], start=c.start, resume_from=f.get("resume_from"),
                history=f.get("history"))
        except DaemonError as e:
            self._past_end(e)
            raise
        if c.fingerprint and stream.fingerprint != c.fingerprint:
            stream.close()
            raise PlanChangedError(
                f"cannot resume epoch {f['epoch']} of dataset {f['dataset']!r} exactly: the "
                f"state was saved on plan {c.fingerprint}, the daemon now plans "
                f"{stream.fingerprint} (the shards, manifest, host count or dataset settings "
                f"changed, or the trainer runs another seed or world size)",
                c.fingerprint, stream.fingerprint)
        if self._past_end_is_empty and f["num_workers"] > 1 and stream.samples is None:
            stream.close()
            raise ValueError(
                f"skip(batches=...) with {f['num_workers']} DataLoader workers needs streams of "
                f"known, equal length: give dataset {f['dataset']!r} a manifest (`shardd "
                f"index`), or resume with torchdata's StatefulDataLoader or num_workers=0")
        c.fingerprint = stream.fingerprint
        c.hosts = stream.start_fields.get("hosts")
        c.stream = stream
        self._next = stream.__next__
        try:
            return self._next()
        except DaemonError as e:
            # Without a manifest the daemon finds a start past the end only once it has read
            # the stream: the refusal comes in place of the first sample.
            self._past_end(e)
            raise

    def _past_end(self, e):
        """A batch count (``skip``) past a stream's last, partial batch: nothing is left."""
        if self._past_end_is_empty and e.code == "bad_request" and "past the end" in str(e):
            raise StopIteration from None

    def _finish(self):
        self._next = _exhausted
        self._cursor.retire()
        self._cursor.ended = True

    def _inherited(self):
        """In a child after fork: close our copy of the socket (the parent's stays open) and
        refuse to go on: two processes reading one socket would each get part of the bytes."""
        c = self._cursor
        if c.stream is not None:
            c.stream.close()  # this process's file descriptor only
            c.stream = None
        self._next = functools.partial(_refuse, c.pid)

    def close(self):
        """Closes the stream; the iterator then yields nothing more."""
        self._finish()


class ShardDataset(torch.utils.data.IterableDataset):
    """One rank's share of a shardd dataset for one epoch, as an ``IterableDataset``.

    ``socket``: the daemon's socket (default: ``$SHARDD_SOCKET``, else
    ``/run/shardd/shardd.sock``). ``rank``/``world_size``: the trainer process among all of the
    job's processes; what is not given comes from ``torch.distributed`` when it is initialised,
    else from PyTorch/XLA's runtime (``global_ordinal()``, ``world_size()``) in the replicas of
    ``xmp.spawn`` or ``torch_xla.launch`` (make the dataset in the replica's function), else
    0 and 1.
    ``seed``: the run's seed, the same on every rank. ``epoch``: the first epoch
    (``set_epoch`` changes it). ``timeout``: the socket timeout in seconds (None: block).
    ``reconnect_timeout``: how long a stream waits for a daemon that went away (restarted,
    killed) before it raises, in seconds; it then resumes at its position (0: raise at once).
    ``first_connect_timeout`` (default 5 s): how long the dataset's first stream (or plan
    check) waits when there is no socket file at ``socket`` before it raises
    ``UnavailableError`` naming the path, the daemon's ``server.socket`` and the likely causes;
    once a stream has reached the daemon (in any process: the flag is in shared memory, so
    the workers of later epochs know), a missing socket is a restart (``shardd.Client``).
    ``check_plan``: let ``set_epoch`` compare the plan fingerprints of all ranks when
    ``torch.distributed`` is initialised and the dataset spans its whole world: True (over
    the default process group), False, or the process group to use (e.g. a gloo group when
    the default backend cannot gather Python objects). ``resume_from``: a state saved at
    another topology (any old rank's ``StatefulDataLoader.state_dict()``, or the dataset's own
    ``state_dict()``s): the dataset starts at that state's epoch and reads the rest of it,
    split over this job's ranks (see ``elastic_origin``); load no other state with it.
    ``prefetch_next_epoch`` (default True): when a stream has been received to its end, open
    the next epoch's ahead (``shardd.Client``). ``zero_copy`` (default False): fields over
    4 KiB as read-only ``memoryview``s of the daemon's mapped cache files (``shardd.Client``).
    Give the DataLoader a ``collate_fn`` that takes them (``torch.frombuffer``, a decoder):
    torch's default conversion turns a memoryview into a list of ints, and a memoryview cannot
    be pickled from a worker process to the trainer's. ``sample_seeds`` (default False): each
    sample also has ``__seed__``, the same for the same sample in the same epoch whatever the
    topology, resume or resize (``shardd.Client``): seed its augmentations from it.

    Yields webdataset-shaped dicts: ``{"__key__": str, "__url__": str, field: bytes, ...}``.
    There is no ``__len__``: see ``epoch_length``.
    """

    def __init__(self, dataset, socket=None, rank=None, world_size=None, seed=0, epoch=0,
                 timeout=None, check_plan=True, reconnect_timeout=RECONNECT_TIMEOUT,
                 resume_from=None, prefetch_next_epoch=True, zero_copy=False, sample_seeds=False,
                 first_connect_timeout=FIRST_CONNECT_TIMEOUT):
        super().__init__()
        self.first_connect_timeout = first_connect_timeout
        # Shared memory, like the epoch: set once any process's stream reached the daemon, so
        # that the DataLoader workers of the next epochs (new processes, new clients) wait out
        # a restart (reconnect_timeout) instead of failing as for a daemon never seen.
        self._served = torch.zeros(1, dtype=torch.bool).share_memory_()
        self.prefetch_next_epoch = bool(prefetch_next_epoch)
        self.zero_copy = bool(zero_copy)
        self.sample_seeds = bool(sample_seeds)
        self.dataset = str(dataset)
        self.socket = str(socket or os.environ.get("SHARDD_SOCKET") or DEFAULT_SOCKET)
        self.seed = int(seed)
        self.timeout = timeout
        self.reconnect_timeout = reconnect_timeout
        self.check_plan = check_plan
        self._rank = None if rank is None else int(rank)
        self._world_size = None if world_size is None else int(world_size)
        self._resolve_topology()
        # Shared memory: set_epoch in the trainer's process reaches persistent workers (fork:
        # the same pages; spawn/forkserver: torch.multiprocessing shares the storage).
        self._epoch = torch.tensor([int(epoch)], dtype=torch.int64).share_memory_()
        self._stages = []
        self._resume = None  # a pending state or skip, used by the next __iter__ of its epoch
        # An elastic resume: (epoch, the daemon's resume_from) from an old topology's state.
        self._elastic = None if resume_from is None else elastic_origin(resume_from, dataset,
                                                                         self.seed)
        if self._elastic is not None:
            self._epoch[0] = self._elastic[0]
        # The topologies before this one (the daemon's ``history``), from each epoch on.
        self._histories = [] if resume_from is None else _histories(resume_from, self._elastic)
        self._cursor = None  # the cursor of this process's latest iterator

    # -- topology and epochs ---------------------------------------------------------------

    def _resolve_topology(self):
        """Fills the rank/world_size not given from torch.distributed when it is initialised
        here, else from PyTorch/XLA's replicas. Called in the trainer's process (init,
        set_epoch, pickling for spawned workers, main-process iteration), so spawned workers,
        where neither is set up, get the trainer's. xmp.spawn starts XLA's runtime before it
        calls the replica's function, so a dataset made there reads XLA's at init, in the
        replica's thread: on CPU (and TPU v2/v3) the replicas are threads of one process, and
        another thread (MpDeviceLoader's, which iterates the loader) would read ordinal 0."""
        if self._rank is not None and self._world_size is not None:
            return
        dist = _distributed()
        found = (dist.get_rank(), dist.get_world_size()) if dist is not None else _xla_topology()
        if found is not None:
            if self._rank is None:
                self._rank = found[0]
            if self._world_size is None:
                self._world_size = found[1]

    @property
    def rank(self):
        return 0 if self._rank is None else self._rank

    @property
    def world_size(self):
        return 1 if self._world_size is None else self._world_size

    @property
    def epoch(self):
        return int(self._epoch[0])

    def set_epoch(self, epoch):
        """Selects the epoch the next iteration reads (call it on every rank before each
        epoch, before ``iter(loader)``). When ``torch.distributed`` is initialised, checks
        that every rank asked for the same plan (a collective: all ranks must call it)."""
        epoch = int(epoch)
        self._epoch[0] = epoch
        if self._resume is not None and self._resume["epoch"] != epoch:
            self._resume = None
        if torch.utils.data.get_worker_info() is None:
            self._resolve_topology()
            if self.check_plan is not False and self._spans_process_group():
                self.verify_plan()

    def _group(self):
        return None if isinstance(self.check_plan, bool) else self.check_plan

    def _spans_process_group(self):
        dist = _distributed()
        return dist is not None and self.world_size == dist.get_world_size(self._group()) > 1

    def _client(self):
        """This process's client, kept across iterations: with read-ahead, a stream that has
        received its END opens the next epoch's stream ahead, and the next ``__iter__`` after
        ``set_epoch(epoch + 1)`` takes it (persistent workers, or num_workers=0)."""
        cached = self.__dict__.get("_client_of")
        if cached is None or cached[0] != os.getpid():
            cached = (os.getpid(), Client(self.socket, self.timeout, self.reconnect_timeout,
                                          prefetch_next_epoch=self.prefetch_next_epoch,
                                          zero_copy=self.zero_copy,
                                          sample_seeds=self.sample_seeds,
                                          first_connect_timeout=self.first_connect_timeout))
            self._client_of = cached
        client = cached[1]
        if not client.connected and bool(self._served[0]):
            client.connected = True
        return client

    def _probe(self, num_workers=1):
        """The START of the stream of (this rank, worker 0 of ``num_workers``) for the current
        epoch, as a dict (its ``samples`` and ``fingerprint``): a plan request, so the daemon
        registers no schedule for it (a probe stream's would linger and skew its prefetching)."""
        return self._plan(0, num_workers)

    def _plan(self, worker, num_workers):
        return _ask(self._client(), "plan", self.dataset, served=self._served, epoch=self.epoch,
                    rank=self.rank, world_size=self.world_size, seed=self.seed, worker=worker,
                    num_workers=max(1, int(num_workers)), resume_from=self._origin(self.epoch),
                    history=self._history(self.epoch))

    def _history(self, epoch):
        """The daemon's ``history`` for ``epoch``: the topologies the job had before this one
        (set after an elastic resume, so that passes go on across it)."""
        found = [h for e, h in self._histories if e <= epoch]
        return found[-1] if found else None

    def _origin(self, epoch):
        """The daemon's ``resume_from`` for ``epoch``: set only in the epoch of an elastic
        resume."""
        e = self._elastic
        return e[1] if e is not None and e[0] == epoch else None

    def verify_plan(self):
        """Checks, with one ``all_gather_object``, that every rank of the job gets the same
        plan fingerprint for the current epoch, and that no two processes claim one rank;
        raises ``PlanMismatch`` naming the ranks with their epochs and seeds if not. A
        collective: every rank must call it (a rank whose daemon refuses still takes part, so
        that the others raise too instead of hanging). Returns the fingerprint. ``set_epoch``
        calls it when torch.distributed is initialised and the dataset spans its world."""
        epoch = self.epoch
        try:
            fingerprint, error = self._probe()["fingerprint"], None
        except Exception as e:  # every rank must reach the all-gather
            fingerprint, error = None, f"{type(e).__name__}: {e}"
        dist, group = _distributed(), self._group()
        if dist is None or self.world_size != dist.get_world_size(group):
            if error:
                raise PlanMismatch(f"rank {self.rank} could not open its stream: {error}")
            return fingerprint
        mine = (self.rank, epoch, self.seed, self.world_size, self.dataset, fingerprint, error)
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
        failed = [f"rank {e[0]}: {e[6]}" for e in everyone if e[6]]
        if failed:
            raise PlanMismatch(f"ranks could not open their streams of epoch {epoch} of dataset "
                               f"{self.dataset!r}: " + "; ".join(failed))
        ranks = sorted(e[0] for e in everyone)
        if ranks != list(range(len(everyone))):
            raise PlanMismatch(
                f"the processes of this job claim ranks {ranks} of world_size "
                f"{len(everyone)}: each must read its own rank (torch.distributed's, or the "
                f"rank= given to ShardDataset)")
        if len({e[5] for e in everyone}) != 1:
            by_plan = {}
            for rank, ep, seed, world, name, fp, _ in everyone:
                by_plan.setdefault((fp, ep, seed, world, name), []).append(rank)
            detail = "; ".join(
                f"plan {fp} (epoch {ep}, seed {seed}, world_size {world}, dataset {name!r}) on "
                f"rank{'s' if len(who) > 1 else ''} {', '.join(map(str, who))}"
                for (fp, ep, seed, world, name), who in sorted(by_plan.items(), key=lambda x: x[1])
            )
            raise PlanMismatch(
                f"the ranks of this job disagree on what epoch {epoch} reads: {detail}. Every "
                f"rank must call set_epoch with the same epoch and use the same dataset, seed "
                f"and world_size, and every host's daemon the same shards, manifest and "
                f"dataset settings")
        return fingerprint

    def epoch_length(self, num_workers=0, batch_size=None, drop_last=False):
        """How many samples (or, with ``batch_size``, batches) a DataLoader with
        ``num_workers`` workers yields on this rank in the current epoch: exact, and the same
        on every rank, when the dataset has a manifest; None without one. One round trip to
        the daemon (which is why this is not ``__len__``)."""
        k = max(1, int(num_workers))
        # An elastic epoch's workers may differ by a sample: ask for each.
        workers = k if self._origin(self.epoch) is not None else 1
        lengths = [self._plan(w, k)["samples"] for w in range(workers)]
        if None in lengths:
            return None
        lengths = lengths * (k // workers)
        if batch_size is None:
            return sum(lengths)
        return sum(n // batch_size if drop_last else -(-n // batch_size) for n in lengths)

    # -- iteration ---------------------------------------------------------------------------

    def compose(self, *stages):
        """Adds pipeline stages (callables from an iterator to an iterator, like webdataset's
        ``wds.decode()``, ``wds.to_tuple(...)``, ``wds.map(f)``), applied in each worker after
        the stream, in order. Returns the dataset. Resume stays exact through stages that
        take no sample before they yield the previous one (1:1 maps, ``select``); webdataset's
        ``batched()`` reads one sample past each full batch and ``shuffle()`` holds a buffer,
        so a resume after them skips what they held: batch in the DataLoader instead."""
        self._stages.extend(stages)
        return self

    def __iter__(self):
        worker, num_workers = _worker()
        if num_workers == 1:
            self._resolve_topology()  # the trainer's own process
        fields = dict(dataset=self.dataset, seed=self.seed, rank=self.rank,
                      world_size=self.world_size, worker=worker, num_workers=num_workers,
                      epoch=self.epoch)
        origin = self._origin(self.epoch)
        if origin is not None:
            fields["resume_from"] = origin
        if self._history(self.epoch):
            fields["history"] = self._history(self.epoch)
        start, fingerprint, past_end_is_empty = 0, None, False
        resume, self._resume = self._resume, None
        if resume is not None:
            start, fingerprint, past_end_is_empty = self._apply(resume, fields)
        cursor = _Cursor(fields, start, fingerprint)
        if start is None:  # an ended stream: nothing left this epoch
            cursor.start = cursor.position = resume["position"]
            cursor.ended = True
        self._cursor = cursor
        it = _ShardIterator(self._client(), cursor, past_end_is_empty, self._served)
        source = it
        for stage in self._stages:
            source = stage(source)
        return iter(source)

    def _apply(self, resume, fields):
        """Turns a pending resume into (start, expected fingerprint, past_end_is_empty) for the
        stream described by ``fields`` (whose ``worker`` a skip may rotate)."""
        epoch = fields["epoch"]
        if resume.get("kind") == "batches":
            if resume["epoch"] != epoch:
                return 0, None, False
            k, b, n = resume["batches"], resume["batch_size"], fields["num_workers"]
            # The DataLoader deals batch i to worker i mod n, and a new loader starts at worker
            # 0: loader worker j plays stream (j + k) mod n, whose next batch is its
            # ceil((k - w) / n)-th.
            w = (fields["worker"] + k) % n
            fields["worker"] = w
            return max(0, -(-(k - w) // n)) * b, None, True
        if resume["epoch"] != epoch:
            if resume.get("ended"):
                return 0, None, False  # that epoch is done; this is another
            raise ValueError(
                f"this state is in the middle of epoch {resume['epoch']} of dataset "
                f"{resume['dataset']!r} but the dataset is set to epoch {epoch}: call "
                f"set_epoch({resume['epoch']}) before iterating (shardd.torch.resume_epoch("
                f"loader_state) reads it from a StatefulDataLoader state)")
        for key in ("dataset", "seed", "rank", "world_size", "num_workers", "worker"):
            if resume[key] != fields[key]:
                raise ValueError(
                    f"cannot resume exactly: the state is of {_describe(resume)}, this stream is "
                    f"{_describe(fields)} ({key} differs). Load each rank's own state into a "
                    f"loader with as many workers as the one that saved it")
        if resume.get("resume_from") is not None:
            # A state of an elastic epoch: its streams are that resume's.
            fields["resume_from"] = resume["resume_from"]
        if resume.get("history"):
            fields["history"] = resume["history"]
        if resume.get("ended"):
            return None, resume.get("fingerprint"), False
        return int(resume["position"]), resume.get("fingerprint"), False

    # -- state ---------------------------------------------------------------------------------

    def state_dict(self):
        """Where this process's stream is: dataset, seed, rank, world_size, worker,
        num_workers, epoch, position (samples delivered, the resume point), fingerprint,
        ended. In a DataLoader worker it describes that worker's stream (torchdata's
        StatefulDataLoader collects one per worker); in the trainer's process with
        num_workers=0 it is exact after every batch."""
        c = self._cursor
        if c is not None and c.pid == os.getpid():
            return c.state()
        if self._resume is not None and self._resume.get("kind") != "batches":
            return dict(self._resume)
        worker, num_workers = _worker()
        state = dict(shardd=STATE_VERSION, dataset=self.dataset, seed=self.seed, rank=self.rank,
                     world_size=self.world_size, worker=worker, num_workers=num_workers,
                     epoch=self.epoch, position=0, fingerprint=None, ended=False, hosts=None)
        origin = self._origin(self.epoch)
        if origin is not None:
            state["resume_from"] = origin
        if self._history(self.epoch):
            state["history"] = self._history(self.epoch)
        return state

    def load_state_dict(self, state):
        """Makes the next iteration of ``state['epoch']`` continue right after the last sample
        the state counted: the stream is reopened with ``start=state['position']`` and
        yields exactly the rest of that epoch, in the same order. The dataset's epoch must be
        ``state['epoch']`` when it is iterated (``set_epoch``), unless the state had ended."""
        if not isinstance(state, dict) or state.get("shardd") != STATE_VERSION:
            raise ValueError(f"not a shardd.torch state (version {STATE_VERSION}): {state!r}")
        self._resume = dict(state)
        prior = list(state.get("history") or [])
        if state.get("resume_from") is not None:
            # A state of an elastic epoch: the epochs after it carry the topology it resized.
            epoch = int(state["epoch"])
            self._histories = [(epoch, prior),
                               (epoch + 1, next_history(prior, state["resume_from"], epoch))]
        elif prior:
            # The job was resized before: every later epoch carries it too.
            self._histories = [(0, prior)]

    def skip(self, batches, batch_size):
        """Plain-DataLoader resume: the next iteration of the current epoch starts after its
        first ``batches`` batches of ``batch_size``, as the DataLoader ordered them, whatever
        its ``num_workers`` (with more than one worker the dataset needs a manifest). Each
        worker computes its own stream's position; the order of the batches that follow is
        that of an uninterrupted epoch. Call it after ``set_epoch`` and before ``iter``."""
        if batches < 0 or batch_size < 1:
            raise ValueError(f"skip(batches={batches}, batch_size={batch_size})")
        self._resume = dict(kind="batches", epoch=self.epoch, batches=int(batches),
                            batch_size=int(batch_size))

    # -- pickling (spawned workers) --------------------------------------------------------------

    def __getstate__(self):
        self._resolve_topology()  # in the trainer's process, where torch.distributed lives
        state = self.__dict__.copy()
        state["_cursor"] = None
        state.pop("_client_of", None)  # a client is per process (and holds locks)
        return state


def _describe(f):
    return (f"dataset {f['dataset']!r} seed {f['seed']} rank {f['rank']} of {f['world_size']}, "
            f"worker {f['worker']} of {f['num_workers']}")


def _stream_states(state):
    """The shardd stream states inside ``state`` (a loader's, a dataset's, or a list)."""
    found = []

    def walk(x):
        if isinstance(x, dict):
            if x.get("shardd") == STATE_VERSION and "epoch" in x and "position" in x:
                found.append(x)
                return
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(state)
    return found


def elastic_origin(state, dataset=None, seed=None):
    """``(epoch, resume_from)`` for an elastic resume from ``state`` (``resume_from`` None when
    the state had read nothing: the epoch is then read whole at the new topology): one old rank's
    ``StatefulDataLoader.state_dict()``, its dataset's ``state_dict()``, or a list of its
    workers' dataset states. In a synchronous job every rank has taken as many batches at a
    checkpoint, so one rank's worker positions are every rank's, and with the old topology
    (``hosts``, ``world_size``, ``num_workers``) they say what every old stream consumed.
    Raises ``ValueError`` naming what is missing or inconsistent."""
    states = [s for s in _stream_states(state) if s.get("kind") != "batches"]
    if not states:
        raise ValueError(f"resume_from: no shardd.torch stream state in {state!r}")
    first = states[0]
    for key in ("dataset", "seed", "epoch", "world_size", "num_workers", "rank"):
        values = {repr(s[key]) for s in states}
        if len(values) > 1:
            raise ValueError(f"resume_from: the states disagree on {key} ({', '.join(values)}): "
                             f"give one rank's loader state")
    if dataset is not None and first["dataset"] != dataset:
        raise ValueError(f"resume_from: the state is of dataset {first['dataset']!r}, not "
                         f"{dataset!r}")
    if seed is not None and first["seed"] != seed:
        raise ValueError(f"resume_from: the state was saved with seed {first['seed']}, this "
                         f"dataset has seed {seed}: an elastic resume keeps the run's seed")
    hosts = {s.get("hosts") for s in states} - {None}
    if not hosts and all(int(s["position"]) == 0 for s in states):
        return first["epoch"], None  # nothing read yet: the whole epoch, at the new topology
    if len(hosts) != 1:
        raise ValueError("resume_from: the state does not say how many hosts served it (a "
                         "stream must have been opened; states from shardd before elastic "
                         "resume lack it)" if not hosts else
                         f"resume_from: the states disagree on hosts ({sorted(hosts)})")
    k = first["num_workers"]
    positions = {}
    for s in states:
        positions[s["worker"]] = int(s["position"])
    if sorted(positions) != list(range(k)):
        raise ValueError(f"resume_from: the state has workers {sorted(positions)} of {k}: give "
                         f"the whole loader state of one rank (every worker's stream)")
    origin = dict(hosts=hosts.pop(), world_size=first["world_size"], num_workers=k,
                  positions=[positions[w] for w in range(k)])
    if first.get("resume_from") is not None:
        origin["from"] = first["resume_from"]
    return first["epoch"], origin


def _histories(state, elastic):
    """``[(from epoch, history)]`` for a job resumed elastically from ``state`` (``elastic``:
    its ``elastic_origin``): the old job's own history in the resumed epoch, and from the next
    epoch on that and the topology that planned the resumed epoch, whose last epoch it was.
    A state that had read nothing of its epoch (its stream never opened) does not say how many
    hosts served it: the epoch is then read whole at the new topology, with the old history."""
    states = [s for s in _stream_states(state) if s.get("kind") != "batches"]
    prior = list(states[0].get("history") or []) if states else []
    epoch, origin = elastic
    if origin is not None:
        return [(epoch, prior), (epoch + 1, next_history(prior, origin, epoch))]
    return [(epoch, prior)]


def resume_epoch(loader_state):
    """The epoch to ``set_epoch`` before iterating a loader that loaded ``loader_state``.

    For a ``StatefulDataLoader.state_dict()``: the saved epoch, unless the loader had run to
    its end (then the next one). A loader saved after its last batch but before it stopped
    resumes into an empty rest of that epoch, so the saved epoch is right there too. For a
    ``ShardDataset.state_dict()``: the saved epoch, or the next one if its stream had ended.
    None when the state holds no shardd stream."""
    found = _stream_states(loader_state)
    if not found:
        return None
    epoch = max(s["epoch"] for s in found)
    if found[0] is loader_state:  # a dataset's own state
        return epoch + 1 if loader_state.get("ended") else epoch
    return epoch + 1 if loader_state.get("_iterator_finished") is True else epoch
