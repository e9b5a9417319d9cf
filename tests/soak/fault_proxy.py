"""A loopback HTTP proxy in front of fake-gcs-server that injects the faults a real object
store makes and the emulator never does (stdlib only, one thread per connection).

Each request is forwarded with ``Connection: close`` (and the Host header fake-gcs-server
answers object paths for), its whole response read, then one fault drawn for it from a seeded
generator:

- ``503`` / ``429``: an error answer instead of the upstream's;
- ``reset``: the connection is reset (RST) before any answer;
- ``truncate``: the head and a random part of the body, then the connection closes;
- ``stall``: the head and part of the body, then silence for ``stall`` seconds (longer than
  the daemon's ``store.read_timeout``), then the connection closes;
- ``slow``: the whole answer, after a pause shorter than the read timeout.

``counts`` holds how many of each were injected (and ``ok``), ``bytes`` the body bytes sent.
"""

import random
import socket
import socketserver
import struct
import threading
import time
import urllib.parse

FAULTS = ("503", "429", "reset", "truncate", "stall", "slow")


class FaultProxy:
    def __init__(self, upstream_port, rate, seed, stall=3.0, slow=0.5, match="/bkt/"):
        """``rate``: the share of requests (for paths containing ``match``) that get a fault,
        spread evenly over ``FAULTS``."""
        self.upstream_port, self.rate, self.stall, self.slow = upstream_port, rate, stall, slow
        self.match = match.encode()
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.counts = dict.fromkeys(("ok",) + FAULTS, 0)
        self.bytes = 0
        proxy = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                try:
                    proxy._handle(self.request)
                except ConnectionError:
                    pass  # the daemon went away (killed, or it gave up on a stalled answer)

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _draw(self, target):
        with self.lock:
            fault = "ok"
            if self.match in target and self.rng.random() < self.rate:
                fault = self.rng.choice(FAULTS)
            self.counts[fault] += 1
            return fault, self.rng.random()

    def _handle(self, conn):
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = conn.recv(65536)
            if not chunk:
                return
            head += chunk
        lines = [l for l in head.split(b"\r\n\r\n")[0].split(b"\r\n")
                 if not l.lower().startswith((b"connection:", b"host:"))]
        target = urllib.parse.unquote_to_bytes(lines[0])
        fault, frac = self._draw(target)
        if fault == "reset":
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return  # the handler's close now sends RST
        if fault in ("503", "429"):
            body = b"injected by the soak's fault proxy"
            conn.sendall(f"HTTP/1.1 {fault} Injected\r\nContent-Length: {len(body)}\r\n"
                         f"Connection: close\r\n\r\n".encode() + body)
            return
        host = f"Host: 127.0.0.1:{self.upstream_port}".encode()
        request = b"\r\n".join(lines[:1] + [host, b"Connection: close"] + lines[1:]) + b"\r\n\r\n"
        with socket.create_connection(("127.0.0.1", self.upstream_port)) as up:
            up.sendall(request)
            response = bytearray()
            while chunk := up.recv(1 << 20):
                response += chunk
        body_at = response.index(b"\r\n\r\n") + 4
        body = len(response) - body_at
        if fault in ("truncate", "stall"):
            # Inside the body; inside the head when there is no body (a HEAD request).
            cut = body_at + int(frac * body) if body > 1 else int(frac * body_at)
            conn.sendall(response[:cut])
            self._sent(max(0, cut - body_at))
            if fault == "stall":
                time.sleep(self.stall)  # the fault itself: a store that goes silent mid-body
            return
        if fault == "slow":
            time.sleep(self.slow)  # the fault itself: a slow first byte
        conn.sendall(response)
        self._sent(body)

    def _sent(self, n):
        with self.lock:
            self.bytes += n

    def close(self):
        self.server.shutdown()
        self.server.server_close()
