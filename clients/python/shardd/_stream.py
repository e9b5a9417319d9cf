"""``Stream``: the cursor over one stream's samples (what was yielded, where a reconnect or a
resume goes on) and its state (START's facts, open or closed, forked). The rest is delegated:
decoding to ``_frames.FrameReader``, maps to ``_zerocopy.ZeroCopy``, the connection and its
recovery to ``_reconnect.Reconnecting``, the background thread to ``_readahead.ReadingAhead``.

The per-sample path is ``__next__`` alone: an index into the batch being yielded.
"""

import os
import socket

from ._errors import ConnectionLostError, ForkedStreamError, PlanChangedError, ProtocolError
from ._fork import register_fork_hook, unregister_fork_hook
from ._frames import FrameReader
from ._readahead import ReadingAhead
from ._reconnect import RECONNECT_TIMEOUT, Reconnecting
from ._seeds import add_seeds
from ._zerocopy import ZeroCopy


class Stream(ReadingAhead, Reconnecting):
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
    ``first_connect`` (seconds, or None): given when the client never reached a daemon, an
    opening that finds no socket file is retried that long only, then raises
    ``UnavailableError`` with the likely causes (a socket that is there, or a systemd unit
    that is starting, is waited for as above).

    With read-ahead (``readahead`` bytes, > 0) a thread receives the batches and all of the
    above runs in it: its errors reach the caller in order, after the samples received before
    them. ``position`` counts the samples yielded; ``readahead_bytes`` is (bytes queued now,
    the most ever queued).

    For a consumer that reads the stream in a thread of its own (``shardd.grain``):
    ``rest_of_batch()`` takes the samples decoded with the last one yielded, and
    ``interrupt()`` cuts the connection from another thread."""

    def __init__(self, socket_path, request, timeout=None, on_close=None,
                 reconnect_timeout=RECONNECT_TIMEOUT, readahead=0, prefetch=None,
                 speculative=False, eager=False, sample_seeds=False, first_connect=None):
        self._closed = False
        # ``__seed__`` on every sample (``_seeds``): computed here, never sent.
        self._sample_seeds = sample_seeds
        self._on_close = on_close
        self._frames = FrameReader(socket_path)
        self._zero_copy = ZeroCopy(socket_path)
        self._init_connection(socket_path, request, timeout, reconnect_timeout, first_connect)
        self._init_readahead(readahead, prefetch, speculative)
        self._pending = []  # the batch being yielded
        self._pos = 0  # samples of it yielded
        self._given = 0  # samples yielded before it (``start`` included): see ``position``
        self._base = 0  # samples received in whole batches: where a reconnect resumes
        self.end = None
        self.fingerprint = None  # set by the first START
        self._forked_from = None  # the pid that opened the stream, once inherited by a child
        register_fork_hook(self, Stream._inherited)
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

    def _fetch(self):
        """Reads the next batch, reconnecting as needed; StopIteration at END."""
        while True:
            try:
                batch = self._frames.next_batch()
            except Exception as e:
                if self._closed:
                    raise ConnectionLostError(f"the stream of {self._describe()} was closed") from e
                self._recover(e)
                continue
            if batch is None:
                self.end = self._frames.end
                raise StopIteration
            # Every sample of it will be yielded: a reconnect resumes after it.
            self._base += len(batch)
            if self._sample_seeds:
                add_seeds(batch, self._request["seed"], self._request["epoch"])
            return batch

    @property
    def position(self):
        """Samples of this epoch's stream delivered so far, including the ``start`` skipped:
        what to pass as ``start`` to resume right after the last sample yielded. (Samples the
        read-ahead thread received but the caller was not given are not counted.)"""
        return self._given + self._pos

    def rest_of_batch(self):
        """The samples decoded with the last one yielded that were not yielded yet, as a list,
        now counted as yielded (``position`` moves past them): for a consumer that takes a
        batch at a time, ``[next(stream)] + stream.rest_of_batch()``. Empty if there are
        none; never reads."""
        pending, pos = self._pending, self._pos
        if pos >= len(pending):
            return []
        self._pos = len(pending)
        return pending[pos:]

    def interrupt(self):
        """Cuts the stream's connection from another thread, for good: it does not reconnect,
        and a thread blocked reading it gets the lost connection's error at once. For the
        owner of a thread that reads the stream, to stop it before ``close()``."""
        self._reconnect_timeout = 0
        sock = self._frames.sock
        if sock is not None:
            try:  # wakes the thread if it waits in recv
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self):
        """Stops the stream: its thread (the socket is shut down under it, so a blocked
        receive returns at once) and its connection."""
        if self._closed:
            return
        self._closed = True
        self._stop_reading()
        unregister_fork_hook(self)
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
            self._forget_thread()
            self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()

    def _describe(self):
        r = self._request
        return (f"dataset {r['dataset']!r} epoch {r['epoch']} rank {r['rank']} of "
                f"{r['world_size']}, worker {r['worker']} of {r['num_workers']}")

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
