"""The client side of proto/PROTOCOL.md (version 2).

Speed matters here: the trainer's Python process is where every sample ends up. Small pieces
(keys, labels, 10 KB images) are read in large chunks into one reusable buffer and a whole
batch's descriptors are decoded with a single ``struct.unpack_from``; large pieces (at least
``DIRECT_MIN`` bytes) are received straight into their own ``bytes`` object with
``MSG_WAITALL``, so the kernel copies them exactly once. Reads are bounded so the buffer never
runs ahead into a large piece.
"""

import json
import os
import socket
import struct
import weakref

MAGIC = b"SHARDD"
VERSION = 2
PREAMBLE = MAGIC + struct.pack("<H", VERSION)

KIND_REQUEST = 1
KIND_START = 2
KIND_BATCH = 3
KIND_END = 4
KIND_ERROR = 5

_HEADER = struct.Struct("<IB")
_BATCH_HEADER = struct.Struct("<IIIIII")
_U32 = struct.Struct("<I")

_INITIAL_BUFFER = 4 << 20
# Pieces at least this large are received directly into their own bytes object.
DIRECT_MIN = 64 << 10


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
    """The peer did not follow the protocol (not a shardd socket, a cut connection, ...)."""


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
    worker opens its own streams (it does: streams are never shared)."""

    def __init__(self, socket_path, timeout=None):
        self.socket_path = str(socket_path)
        self.timeout = timeout
        # Weak: a stream the caller dropped (``break`` out of the loop) is collected and its
        # socket closed, which frees the daemon's slot; close() still reaches the live ones.
        self._open = weakref.WeakSet()

    def stream(self, dataset, *, epoch, rank, world_size, seed=0, worker=0, num_workers=1, start=0):
        """Opens the stream of one (rank, worker) for one epoch and returns it as an iterator
        of sample dicts. Raises ``DaemonError`` at once if the daemon refuses the request.

        ``start`` resumes: the stream skips the first ``start`` samples it would have
        delivered and yields exactly the rest, in the same order (``Stream.position`` counts
        from it)."""
        request = {
            "op": "stream",
            "dataset": dataset,
            "epoch": int(epoch),
            "rank": int(rank),
            "world_size": int(world_size),
            "worker": int(worker),
            "num_workers": int(num_workers),
            "seed": int(seed),
            "start": int(start),
        }
        s = Stream(self.socket_path, request, self.timeout, self._open.discard)
        self._open.add(s)
        return s

    def close(self):
        """Closes every stream still open."""
        for s in list(self._open):
            s.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Stream:
    """One stream: iterate it for samples. ``shards`` is how many shards it reads; after the
    last sample, ``end`` holds the daemon's summary (``samples``, ``bytes``)."""

    def __init__(self, socket_path, request, timeout=None, on_close=None):
        self._on_close = on_close
        self._sock = None
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        # MSG_WAITALL needs a blocking socket; with a timeout, everything goes through the buffer.
        self._direct = timeout is None
        self._buf = bytearray(_INITIAL_BUFFER)
        self._mv = memoryview(self._buf)
        self._lo = 0  # first unread byte
        self._hi = 0  # end of received bytes
        self._pending = []
        self._pos = 0
        self._base = 0
        self.end = None
        self._forked_from = None  # the pid that opened the stream, once inherited by a child
        _LIVE.add(self)
        try:
            self._sock.connect(socket_path)
            body = json.dumps(request).encode()
            self._sock.sendall(PREAMBLE + _HEADER.pack(len(body), KIND_REQUEST) + body)
            preamble = self._take(len(PREAMBLE))
            if preamble[:6] != MAGIC:
                raise ProtocolError(f"{socket_path} is not a shardd socket")
            kind, length = self._frame_header()
            if kind != KIND_START:
                self._unexpected(kind, length)
            start = json.loads(self._take(length))
            self.shards = start["shards"]
            self.dataset = start["dataset"]
            # Exact-epoch facts (a dataset with a manifest): the stream's whole length this
            # epoch (None without a manifest), the samples this host leaves out, and the plan's
            # fingerprint, equal on every rank of a job that asked for the same epoch.
            self.samples = start.get("samples")
            self.dropped = start.get("dropped", 0)
            self.fingerprint = start.get("fingerprint", "")
            # Where the stream started (the request's ``start``); see ``position``.
            self._base = start.get("position", 0)
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
        if self.end is not None or self._sock is None:
            if self._forked_from is not None:
                raise ForkedStreamError(
                    f"this shardd stream was opened in process {self._forked_from} and inherited "
                    f"across fork by process {os.getpid()}: open streams in the process that "
                    f"reads them (after the fork)")
            raise StopIteration
        try:
            return self._next_batch()
        except StopIteration:
            raise
        except BaseException:
            # A failed read leaves the byte stream at an unknown position: never read on.
            self.close()
            raise

    def _next_batch(self):
        while True:
            kind, length = self._frame_header()
            if kind == KIND_BATCH:
                self._base += len(self._pending)
                self._pending = pending = self._read_batch(length)
                if pending:
                    self._pos = 1
                    return pending[0]
            elif kind == KIND_END:
                self.end = json.loads(self._take(length))
                self._base += len(self._pending)
                self._pending, self._pos = [], 0
                self.close()
                raise StopIteration
            else:
                self._unexpected(kind, length)

    @property
    def position(self):
        """Samples of this epoch's stream delivered so far, including the ``start`` skipped:
        what to pass as ``start`` to resume right after the last sample yielded."""
        return self._base + self._pos

    def close(self):
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            _LIVE.discard(self)
            if self._on_close is not None:
                self._on_close(self)

    def _inherited(self):
        """In a child after fork: close this process's copy of the socket (the parent's
        connection stays open) and refuse to read on. Checked only once the samples already
        decoded are gone, so the per-sample path costs nothing."""
        if self._sock is not None:
            self._forked_from = os.getppid()
            self._pending, self._pos = [], 0
            self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()

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
        recv_into = self._sock.recv_into
        mv = self._mv
        end = self._lo + limit
        while self._hi - self._lo < need:
            n = recv_into(mv[self._hi : end])
            if n == 0:
                raise ProtocolError("the daemon closed the connection mid-stream")
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
                raise ProtocolError("the daemon closed the connection mid-stream")
            parts.append(chunk)
            got += len(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _frame_header(self):
        self._fill(_HEADER.size, _HEADER.size)
        length, kind = _HEADER.unpack_from(self._buf, self._lo)
        self._lo += _HEADER.size
        return kind, length

    def _unexpected(self, kind, length):
        body = self._take(length) if length < (1 << 20) else b""
        self.close()
        if kind == KIND_ERROR:
            err = json.loads(body)
            raise DaemonError(err.get("code", ""), err.get("message", ""))
        raise ProtocolError(f"unexpected frame kind {kind}")

    def _read_batch(self, length):
        """Reads one BATCH body (``length`` bytes) and returns its samples."""
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
        if max_piece >= DIRECT_MIN and self._direct:
            return self._read_pieces(n, names, urls, words)

        # Fast path: the whole payload through the buffer, one tight loop.
        self._fill(payload, payload)
        buf, mv = self._buf, self._mv
        p = self._lo
        self._lo += payload
        out = []
        append = out.append
        i = 0
        for _ in range(n):
            head = words[i]
            klen = words[i + 1]
            i += 2
            sample = {"__key__": str(mv[p : p + klen], "utf-8"), "__url__": urls[head & 0xFFFF]}
            p += klen
            for _ in range(head >> 16):
                ln = words[i + 1]
                sample[names[words[i]]] = mv[p : p + ln].tobytes()
                p += ln
                i += 2
            append(sample)
        return out

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
