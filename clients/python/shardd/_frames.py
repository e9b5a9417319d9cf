"""The wire format (proto/PROTOCOL.md) and its decoding: one connection's bytes cut into frames,
and BATCH frames into samples (their descriptor words into samples: ``_decode``). Knows nothing
of streams, positions or reconnects, so the per-sample code stays with the frames.

Speed matters here: the trainer's Python process is where every sample ends up. A whole
batch's descriptor words are taken as one ``bytes`` object and decoded in one call; a batch of
small pieces (keys, labels, 10 KB images) is received as one ``bytes`` object and cut; large
pieces (at least ``DIRECT_MIN`` bytes) are received straight into their own ``bytes`` object
with ``MSG_WAITALL``, so the kernel copies them exactly once. Reads are bounded so the buffer
never runs ahead into a large piece.
"""

import json
import socket
import struct

from ._decode import batch, malformed, mapped_batch
from ._errors import ConnectionLostError, DaemonError, ProtocolError

MAGIC = b"SHARDD"
VERSION = 7
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
    "history": (7, "the request field history (passes that go on across resizes)"),
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

HEADER = struct.Struct("<IB")
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


def needs(request):
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
    if request.get("history"):
        version, feature = FEATURES["history"]
    return version, feature


def request_frame(request, version):
    """The bytes that open a connection: the preamble of ``version`` and the REQUEST frame."""
    body = json.dumps(request).encode()
    return MAGIC + struct.pack("<H", version) + HEADER.pack(len(body), KIND_REQUEST) + body


def _text_source(samples, names):
    """A mix's samples name their source in the field ``__source__``: a ``str``, like
    ``__key__`` and ``__url__`` (costs nothing in batches without it)."""
    if "__source__" in names:
        for s in samples:
            s["__source__"] = s["__source__"].decode()
    return samples


class FrameReader:
    """Reads frames from one connection at a time (``attach``, ``close``), through a buffer
    kept across connections. ``next_batch`` is the stream's whole read path: the samples of
    the next batch, with ``batch_bytes`` its size; None at END, with ``end`` its body.

    ``zero_copy``: the connection's ``ZeroCopy`` when START said the connection is zero-copy
    (MAP, UNMAP and MAPPED_BATCH frames are then expected), else None."""

    def __init__(self, path):
        self.path = path  # the daemon's socket, for messages
        self.sock = None
        self.recv = None  # how fill() receives: the socket's recv_into, or zero copy's
        self.direct = False  # large pieces are received with MSG_WAITALL (a blocking socket)
        self.zero_copy = None
        self.batch_bytes = 0  # the BATCH body size of the last batch read
        self.end = None  # the last END's body
        self._buf = bytearray(_INITIAL_BUFFER)
        self._mv = memoryview(self._buf)
        self._lo = 0  # first unread byte
        self._hi = 0  # end of received bytes

    def attach(self, sock, recv, direct):
        """Reads from ``sock`` from now on, receiving with ``recv`` (a ``recv_into``)."""
        self.sock, self.recv, self.direct = sock, recv, direct

    def close(self):
        """Closes the socket and forgets what was buffered from it."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        self._lo = self._hi = 0

    def next_batch(self):
        """The next batch (a non-empty list of samples); None after END."""
        while True:
            kind, length = self.header()
            if kind == KIND_BATCH:
                self.batch_bytes = length
                pending = self._read_batch(length)
                if pending:
                    return pending
            elif KIND_MAP <= kind <= KIND_UNMAP and self.zero_copy is not None:
                self.batch_bytes = length
                if kind == KIND_MAPPED_BATCH:
                    pending = self._read_mapped_batch(length)
                    if pending:
                        return pending
                else:
                    self.zero_copy.frame(kind, self.take(length))
            elif kind == KIND_END:
                self.end = self.json(length, "END")
                return None
            else:
                self.unexpected(kind, length)

    # -- bytes ---------------------------------------------------------------------------

    def fill(self, need, limit):
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
        recv_into = self.recv
        mv = self._mv
        end = self._lo + limit
        while self._hi - self._lo < need:
            n = recv_into(mv[self._hi : end])
            if n == 0:
                raise self._eof()
            self._hi += n

    def take(self, n):
        """The next ``n`` bytes of the stream, as bytes."""
        if n >= DIRECT_MIN and self.direct:
            return self._take_direct(n)
        self.fill(n, n)
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
            chunk = self.sock.recv(n - got, socket.MSG_WAITALL)
            if not chunk:
                raise self._eof()
            parts.append(chunk)
            got += len(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _eof(self):
        return ConnectionLostError(
            f"the shardd daemon at {self.path} closed the connection mid-stream")

    # -- frames --------------------------------------------------------------------------

    def header(self):
        """The next frame's (kind, body length)."""
        self.fill(HEADER.size, HEADER.size)
        length, kind = HEADER.unpack_from(self._buf, self._lo)
        self._lo += HEADER.size
        return kind, length

    def unexpected(self, kind, length):
        """Raises for a frame that has no place here: the daemon's ERROR, or a protocol error."""
        if kind == KIND_ERROR:
            err = self.json(length, "ERROR")
            raise DaemonError(str(err.get("code", "")), str(err.get("message", "")))
        raise ProtocolError(f"unexpected frame kind {kind} from the daemon at {self.path}")

    def json(self, length, what):
        """A START, END or ERROR body: a JSON object of at most ``MAX_JSON_FRAME`` bytes. A
        larger one is not read (only its beginning, for the message)."""
        frame = f"{'an' if what[0] in 'AEIOU' else 'a'} {what} frame"
        if length > MAX_JSON_FRAME:
            head = self.take(200)
            raise ProtocolError(
                f"the daemon at {self.path} sent {frame} of {length} bytes, over the limit of "
                f"{MAX_JSON_FRAME} bytes for one; it begins {head!r}")
        body = self.take(length)
        try:
            value = json.loads(body)
        except ValueError as e:
            raise ProtocolError(f"the daemon at {self.path} sent {frame} that is not JSON "
                                f"({e}): {body[:200]!r}") from None
        if not isinstance(value, dict):
            raise ProtocolError(f"the daemon at {self.path} sent {frame} that is not a JSON "
                                f"object: {body[:200]!r}")
        return value

    # -- batches -------------------------------------------------------------------------

    def _batch_head(self, length):
        """Reads a BATCH or MAPPED_BATCH body up to its payload: (samples, field names, URLs,
        descriptor words (bytes), payload bytes, max_piece)."""
        self.fill(_BATCH_HEADER.size, _BATCH_HEADER.size)
        n, n_words, n_names, n_urls, payload_offset, max_piece = _BATCH_HEADER.unpack_from(
            self._buf, self._lo
        )
        if not _BATCH_HEADER.size <= payload_offset <= length:
            raise malformed(self.path, f"its payload offset {payload_offset} is outside its "
                                  f"{length} bytes")
        self.fill(payload_offset, payload_offset)
        buf, mv = self._buf, self._mv
        p = self._lo + _BATCH_HEADER.size
        head_end = self._lo + payload_offset
        tables = []
        try:
            for _ in range(n_names + n_urls):
                (ln,) = _U32.unpack_from(buf, p)
                p += 4
                if p + ln > head_end:
                    raise ValueError("its tables run into its payload")
                tables.append(str(mv[p : p + ln], "utf-8"))
                p += ln
        except (ValueError, struct.error) as e:  # UnicodeDecodeError is a ValueError
            raise malformed(self.path, e) from None
        if p + 4 * n_words > head_end:
            raise malformed(self.path, "its descriptor words run into its payload")
        names, urls = tables[:n_names], tables[n_names:]
        words = mv[p : p + 4 * n_words].tobytes()
        self._lo += payload_offset
        payload = length - payload_offset
        return n, names, urls, words, payload, max_piece

    def _read_batch(self, length):
        """Reads one BATCH body (``length`` bytes) and returns its samples."""
        n, names, urls, words, payload, max_piece = self._batch_head(length)
        if max_piece >= DIRECT_MIN and self.direct:
            words = struct.unpack(f"<{len(words) // 4}I", words)
            return _text_source(self._read_pieces(n, names, urls, words, payload), names)

        # Fast path: every piece is small. The whole payload as one bytes object (at least
        # DIRECT_MIN bytes: received straight into it), cut with slices: one copy per piece, and
        # no memoryview object per piece.
        return _text_source(batch(n, names, urls, words, self.take(payload), self.path), names)

    def _read_pieces(self, n, names, urls, words, payload):
        """A batch with large pieces: small ones through the buffer (read in runs that stop at
        the next large piece), large ones received directly."""
        # Every piece's length, checked before anything is read: pieces that did not add up
        # would read into the next frame.
        lengths = []
        i = 0
        for _ in range(n):
            if i + 1 >= len(words):
                raise malformed(self.path, "its samples need more descriptor words than it has")
            head = words[i]
            fields = words[i + 2 : i + 2 + 2 * (head >> 16)]
            if (len(fields) < 2 * (head >> 16) or head & 0xFFFF >= len(urls)
                    or any(name >= len(names) for name in fields[::2])):
                raise malformed(self.path, "its descriptor words do not match its tables")
            lengths.append(words[i + 1])
            lengths.extend(fields[1::2])
            i += 2 + len(fields)
        if sum(lengths) != payload:
            raise malformed(self.path, f"its pieces add up to {sum(lengths)} bytes, its "
                                       f"payload is {payload}")
        try:
            return self._receive_pieces(n, names, urls, words, lengths)
        except UnicodeDecodeError as e:
            raise malformed(self.path, e) from None

    def _receive_pieces(self, n, names, urls, words, lengths):
        """``_read_pieces``' reads, its pieces' ``lengths`` checked."""
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
                self.fill(lengths[k], run[k])
                key = str(self._mv[self._lo : self._lo + lengths[k]], "utf-8")
                self._lo += lengths[k]
            k += 1
            sample = {"__key__": key, "__url__": urls[head & 0xFFFF]}
            for j in range(head >> 16):
                ln = lengths[k]
                if ln >= DIRECT_MIN:
                    data = self._take_direct(ln)
                else:
                    self.fill(ln, run[k])
                    data = self._mv[self._lo : self._lo + ln].tobytes()
                    self._lo += ln
                sample[names[words[i + 2 + 2 * j]]] = data
                k += 1
            i += 2 + 2 * (head >> 16)
            out.append(sample)
        return out

    def _read_mapped_batch(self, length):
        """A MAPPED_BATCH (zero copy): as ``_read_batch``, with mapped fields as memoryview
        slices of the connection's maps (``_decode``)."""
        n, names, urls, words, payload, max_piece = self._batch_head(length)
        self.fill(payload, payload)
        p = self._lo
        self._lo += payload
        out, mapped = mapped_batch(n, names, urls, words, self._mv, p, p + payload, max_piece,
                                   self.zero_copy.maps, self.path)
        # Read-ahead counts what a batch hands out, mapped bytes too: counting its frame (a few
        # bytes per field) let the thread take in, and keep pinned, gigabytes of shards.
        self.batch_bytes = length + mapped
        return _text_source(out, names)
