"""Zero copy (protocol 5, PROTOCOL.md "Zero copy"): the daemon passes its shards' cache files
as read-only descriptors (SCM_RIGHTS, one per MAP frame) and MAPPED_BATCH frames refer to
ranges of them, which the client hands out as memoryviews of the mappings. This module keeps
a stream's maps and descriptors, and tells the daemon which maps nothing refers to any more
(RELEASE). Decoding the frames is ``_frames``'s; falling back to the socket path is the
stream's (``ZeroCopyUnusable``).
"""

import array
import collections
import mmap
import os
import resource
import socket
import struct
import time
import weakref

from ._errors import ProtocolError
from ._frames import HEADER, KIND_RELEASE, KIND_UNMAP

# Room for the descriptors one receive can bring (one per MAP frame; a receive stops after
# the first message that carries any).
_ANCILLARY = socket.CMSG_SPACE(16 * 4)
# As a plain int: ``&`` with the enum member costs a Python call per receive.
_MSG_CTRUNC = int(socket.MSG_CTRUNC)


class ZeroCopyUnusable(Exception):
    """Zero copy cannot work in this process (a descriptor it cannot map, or one the kernel
    dropped): the stream reopens at its position over the socket. Not a lost daemon, so this is
    done whatever ``reconnect_timeout`` says."""


class ZeroCopy:
    """One stream's maps, across its connections. ``recv_into`` is how a zero-copy connection
    receives (descriptors too); ``frame`` takes in MAP and UNMAP bodies; ``maps`` is what
    MAPPED_BATCH frames refer to; ``forget`` when a connection ends.

    Holds no reference to the stream: the finalizer of each mapping appends to ``_released``
    only, so a stream its caller dropped is still collected."""

    def __init__(self, path):
        self.path = path  # the daemon's socket, for messages
        self.sock = None  # the connection's socket
        self.maps = {}  # map id -> memoryview of its mmap, while batches may refer to it
        self._fds = collections.deque()  # descriptors received, for the MAP frames to come
        self._released = collections.deque()  # (generation, map id), from the finalizers
        self._generation = 0  # which connection a map belongs to
        self.waited = 0.0  # seconds spent in recvmsg, for read-ahead's decision (``_readahead``)

    def recv_into(self, view):
        """``recv_into`` that also takes the descriptors of MAP frames (SCM_RIGHTS), first
        sending the RELEASE of the maps nothing refers to any more."""
        if self._released:
            self._send_releases()
        began = time.perf_counter()
        try:
            n, anc, flags, _ = self.sock.recvmsg_into([view], _ANCILLARY, socket.MSG_CMSG_CLOEXEC)
        finally:
            self.waited += time.perf_counter() - began
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
                self._fds.extend(fds)
        if flags & _MSG_CTRUNC:
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
                self.sock.sendall(HEADER.pack(4 * len(ids), KIND_RELEASE)
                                  + struct.pack(f"<{len(ids)}I", *ids))
            except (BrokenPipeError, ConnectionResetError):
                # The daemon closed its side: after END (the rest of the stream may still wait
                # in the socket), or it went away (the next receive says so). Either way the
                # connection's maps are freed with it: nothing to release.
                pass

    def forget(self):
        """A connection ended: its map ids mean nothing to the next (memoryviews handed out
        stay valid: each mapping holds its file)."""
        self._generation += 1
        self.maps.clear()
        self._released.clear()
        while self._fds:
            fd = self._fds.popleft()
            if fd is not None:
                os.close(fd)

    def frame(self, kind, body):
        """Takes in the body of a MAP or UNMAP frame."""
        if kind == KIND_UNMAP:
            # No batch refers to these any more: once their memoryviews are gone, they are
            # released (weakref.finalize on each mmap).
            for (map_id,) in struct.iter_unpack("<I", body):
                self.maps.pop(map_id, None)
            return
        map_id, size = struct.unpack("<IQ", body)
        if not self._fds:
            # Neither a descriptor nor MSG_CTRUNC: the daemon did not send one.
            raise ProtocolError(f"a MAP frame from the daemon at {self.path} came without "
                                f"its descriptor")
        fd = self._fds.popleft()
        if fd is None:
            limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            raise ZeroCopyUnusable(
                f"the kernel dropped a shard file's descriptor (MSG_CTRUNC): this process is at "
                f"its open-file limit, RLIMIT_NOFILE = {limit} (ulimit -n)")
        try:
            mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        except OSError as e:
            # No mapping (address space, a limit): the socket path (the stream's recover).
            raise ZeroCopyUnusable(f"mapping a shard file failed: {e}") from e
        finally:
            os.close(fd)
        weakref.finalize(mm, self._released.append, (self._generation, map_id))
        self.maps[map_id] = memoryview(mm)
