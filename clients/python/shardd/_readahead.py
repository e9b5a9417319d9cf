"""Read-ahead (``Client(readahead=)``, on by default): a thread per stream receives and decodes
the next batches into a queue bounded in bytes while the trainer works, and the stream's
``__next__`` takes them from it. It starts at a batch boundary once the caller has shown that
it works between batches (a caller that only drains the stream is faster reading it itself).
The thread holds the stream only while it receives a batch (a weak reference otherwise), so a
dropped stream is collected and closed. Once the thread has received END it may open the next
epoch's stream ahead (``Client(prefetch_next_epoch=)``).

``ReadingAhead`` is the part of ``Stream`` that does this; it reads batches with the stream's
``_fetch`` and closes connections with its ``_drop_connection``.
"""

import socket
import threading
import time
import weakref
from collections import deque

from ._errors import ProtocolError

# Read-ahead (``Client(readahead=)``): a stream's background thread stops receiving once this
# many bytes of batches wait to be yielded (it may hold one batch more: it checks before a
# batch, whose size it does not know yet). 0 turns the thread off.
READAHEAD = 4 << 20
# A zero-copy stream's read-ahead thread starts only once its reads have waited this many
# seconds for the daemon (and most of their time; ``ReadingAhead._read_here``).
ZERO_COPY_WAITS = 0.05
# How long close() waits for a stream's thread to let go of the socket (it exits at once: the
# socket is shut down under it), before leaving the closing to the thread.
_JOIN_TIMEOUT = 5.0


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


class ReadingAhead:
    """``Stream``'s read-ahead: the thread, its queue, when to start it, and the speculative
    next-epoch stream it may open after END. Attributes: set by ``_init_readahead``."""

    def _init_readahead(self, readahead, prefetch, speculative):
        self._queue = None  # read-ahead: what the thread hands over (None: no thread)
        self._thread = None
        self._prefetch = prefetch  # called with the request once the thread received END
        self._speculative = speculative  # opened ahead by the client; not claimed yet
        self._ended = False  # the thread received END (read-ahead only)
        self._readahead = readahead
        self._handed = None  # perf_counter when the caller got the last batch read here
        self._took = 0.0  # how long reading that batch took
        self._reads = [0.0, 0.0]  # zero copy: seconds its reads took, and waited in the kernel

    def _read_here(self):
        """Reads the next batch on the caller's thread, unless the caller has shown that it
        works between batches at least as long as a batch takes to receive: then the read-ahead
        thread takes over from here. A caller that only drains the stream (a benchmark, a
        copy) keeps reading it itself, which costs no thread handoffs. A zero-copy batch
        counts only if its read mostly waited in the kernel (see below)."""
        now = time.perf_counter()
        if self._handed is not None and self._readahead > 0:
            if now - self._handed >= self._took:
                self._start_thread()
                return self._take_batch()
        zero_copy = self._frames.zero_copy
        waited = zero_copy.waited if zero_copy is not None else 0.0
        outages = self.reconnects
        try:
            batch = self._fetch()
        except StopIteration:
            if self._prefetch is not None and not self._speculative:
                self._drop_connection()  # first: the daemon's slot is free for the next one
                threading.Thread(target=self._prefetch, args=(dict(self._request),),
                                 daemon=True).start()
            raise
        # The first batch waits for the stream's first shuffle window; one read across a
        # reconnect, for the daemon.
        first = self._handed is None or self.reconnects != outages
        self._handed = then = time.perf_counter()
        self._took = then - now
        if zero_copy is not None:
            # A zero-copy batch is a few bytes per field, decoded under the GIL: a thread
            # decoding it would take turns with the caller, not overlap it (a caller copying
            # the fields lost a quarter of its samples/s to that). Only reads that mostly wait
            # for the daemon (shards still being fetched) are worth a thread: over the
            # stream's reads so far, but those above, and waits of ZERO_COPY_WAITS at least.
            # (A thread saves at most the waits; it costs the rest of the stream. A daemon
            # descheduled for a few ms on a busy host is not a daemon fetching shards.)
            if not first:
                self._reads[0] += self._took
                self._reads[1] += zero_copy.waited - waited
            total, waits = self._reads
            if first or waits < total / 2 or waits < ZERO_COPY_WAITS:
                self._took = float("inf")
        return batch

    def _start_thread(self):
        """Hands the socket to a read-ahead thread (at a batch boundary)."""
        r = self._request
        self._queue = q = _Queue(self._readahead)
        self._thread = threading.Thread(
            target=_read_ahead, args=(weakref.ref(self), q), daemon=True,
            name=f"shardd read-ahead {r['dataset']} epoch {r['epoch']}")
        self._thread.start()

    def _receive(self):
        """In the thread: (the next batch, its size in bytes), or (None, 0) at END, or (the
        exception, 0). After END or an error the connection is closed (the daemon's slot
        freed at once)."""
        try:
            return self._fetch(), self._frames.batch_bytes
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
    def readahead_bytes(self):
        """(bytes of batches waiting in the read-ahead queue now, the most it ever held)."""
        q = self._queue
        return (0, 0) if q is None else (q.bytes, q.peak)

    def _stop_reading(self):
        """For ``close()``: stops the thread (the socket is shut down under it, so a blocked
        receive returns at once) and closes the connection, or leaves that to the thread if it
        does not let go of the socket in time."""
        q, t = self._queue, self._thread
        if q is not None:
            with q.cond:
                q.closed = True
                q.items.clear()
                q.bytes = 0
                q.cond.notify_all()
        if t is not None and t.is_alive() and t is not threading.current_thread():
            sock = self._frames.sock
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

    def _forget_thread(self):
        """In a child after fork: the thread did not survive it (and may have held the queue's
        lock), so both are forgotten."""
        self._queue = self._thread = None
