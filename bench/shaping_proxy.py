"""A loopback HTTP/1.1 proxy that shapes responses like a remote object store (stdlib only).

Put it in front of fake-gcs-server (or any plain-HTTP server on loopback) to give every
response what the real thing has and loopback lacks:

  - latency: ``latency`` seconds added before the first byte of each response (after the
    upstream's response head arrived, so it adds to the server's own time to first byte);
  - bandwidth: a token bucket per client connection (``rate`` bytes/s, ``burst`` bytes deep)
    on response bodies. Parallel requests on separate connections each get the full rate, as
    with GCS and S3, whose per-connection throughput is the usual limit.

Requests pass through unchanged except for the Host header, which is rewritten to
``host_header`` (default the upstream's ``127.0.0.1:PORT``): fake-gcs-server answers path-style
object GETs (``GET /bucket/object``) only for its ``-public-host``, so start it with
``-public-host 127.0.0.1:UPSTREAM_PORT`` (with the proxy's address there instead, those GETs
are 404: checked).

Connections are kept alive, like a real client's pool: each client connection gets its own
upstream connection (opened again if the server closed it while idle), and requests and
responses are relayed one at a time on it, framed by parsing Content-Length / chunked
encoding (a response with neither is read to EOF, then both connections are closed). Bodies
are relayed as bytes, so range requests (206) and anything else just pass through. Body bytes
go socket -> one reused buffer -> socket (no per-chunk objects), which keeps the proxy's CPU
cost near the two kernel copies.

It counts requests by method (``requests``), requests with a Range header
(``ranged_requests``), responses by status (``statuses``), response body bytes relayed
(``body_bytes``, counted as they are sent, so a snapshot mid-transfer is exact) and client
connections (``connections``). In-process: ``ShapingProxy(...).start()`` runs it on a thread
and these are plain attributes (``stats()`` snapshots them). As a separate process
(``python shaping_proxy.py --upstream-port P``), it prints its port on stdout and answers
``GET /__shaping_proxy__/stats`` itself (unshaped) with the same snapshot as JSON plus its CPU
time, so a benchmark can tell whether the proxy itself was the bottleneck.
"""

import argparse
import asyncio
import collections
import json
import signal
import socket
import threading
import time

STATS_PATH = "/__shaping_proxy__/stats"
CHUNK = 256 * 1024  # largest piece of a body relayed (and paced) at once
MAX_HEAD = 64 * 1024


class TokenBucket:
    """``rate`` bytes/s, at most ``burst`` bytes at once after idling. ``delay(n)`` takes n
    tokens (going into debt if short) and says how long to wait before sending them."""

    def __init__(self, rate, burst):
        self.rate, self.burst = rate, burst
        self.tokens, self.last = burst, time.monotonic()

    def delay(self, n):
        if not self.rate:
            return 0.0
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate) - n
        self.last = now
        return -self.tokens / self.rate if self.tokens < 0 else 0.0


class Head:
    """A parsed HTTP/1.x request or response head (start line and headers, in order)."""

    def __init__(self, raw):
        lines = raw.decode("latin-1").split("\r\n")
        self.start = lines[0]
        self.headers = [tuple(p.strip() for p in line.split(":", 1)) for line in lines[1:] if ":" in line]

    def get(self, name):
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), None)

    def has_token(self, name, token):
        value = self.get(name)
        return value is not None and token in [t.strip().lower() for t in value.split(",")]

    def encode(self):
        lines = [self.start] + [f"{k}: {v}" for k, v in self.headers]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class Conn:
    """A non-blocking socket with a small read-ahead buffer (heads are read in blocks, so a
    body's first bytes may already be here)."""

    def __init__(self, sock):
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self.pending = bytearray()
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    @classmethod
    async def connect(cls, address):
        sock = socket.socket()
        try:
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, address)
        except BaseException:
            sock.close()
            raise
        return cls(sock)

    async def read_until(self, delim, limit=MAX_HEAD):
        """Bytes up to and including ``delim``; None at EOF before any byte."""
        start = 0
        while (i := self.pending.find(delim, start)) < 0:
            if len(self.pending) > limit:
                raise ConnectionError("head or chunk line too long")
            start = max(0, len(self.pending) - len(delim) + 1)
            data = await self.loop.sock_recv(self.sock, 65536)
            if not data:
                if self.pending:
                    raise ConnectionError("connection closed mid-message")
                return None
            self.pending += data
        out = bytes(self.pending[: i + len(delim)])
        del self.pending[: i + len(delim)]
        return out

    async def read_head(self):
        raw = await self.read_until(b"\r\n\r\n")
        return None if raw is None else Head(raw[:-4])

    async def recv_into(self, view):
        """Fills part of ``view``; returns the byte count (0 at EOF)."""
        if self.pending:
            n = min(len(view), len(self.pending))
            view[:n] = self.pending[:n]
            del self.pending[:n]
            return n
        return await self.loop.sock_recv_into(self.sock, view)

    async def read_exactly(self, n):
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = await self.recv_into(view[got:])
            if not k:
                raise ConnectionError("connection closed mid-message")
            got += k
        return bytes(buf)

    async def send(self, data):
        await self.loop.sock_sendall(self.sock, data)

    def close(self):
        self.sock.close()


class ShapingProxy:
    def __init__(self, upstream_port, *, upstream_host="127.0.0.1", host_header=None,
                 latency=0.05, rate=50e6, burst=256 * 1024, port=0):
        self.upstream = (upstream_host, upstream_port)
        self.host_header = host_header or f"{upstream_host}:{upstream_port}"
        self.latency, self.rate, self.burst = latency, rate, burst
        self.port = port
        # Counters (written only by the event loop's thread).
        self.requests = collections.Counter()  # by method
        self.ranged_requests = 0
        self.statuses = collections.Counter()  # by status code
        self.body_bytes = 0
        self.connections = 0
        self._listener = self._loop = self._thread = None
        self._tasks = set()

    # ---- running ----

    async def serve(self, ready=None):
        """Listens and serves until cancelled; calls ``ready()`` once listening."""
        self._listener = socket.create_server(("127.0.0.1", self.port), backlog=128)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        if ready:
            ready()
        loop = asyncio.get_running_loop()
        try:
            while True:
                client, _ = await loop.sock_accept(self._listener)
                task = loop.create_task(self._serve_client(client))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        finally:
            self._listener.close()
            for task in list(self._tasks):
                task.cancel()

    @property
    def endpoint(self):
        return f"http://127.0.0.1:{self.port}"

    def start(self):
        """Runs the proxy on a daemon thread with its own event loop; returns once it listens."""
        ready = threading.Event()

        def run():
            self._loop = asyncio.new_event_loop()
            self._main = self._loop.create_task(self.serve(ready.set))
            try:
                self._loop.run_until_complete(self._main)
            except asyncio.CancelledError:
                pass

        self._thread = threading.Thread(target=run, name="shaping-proxy", daemon=True)
        self._thread.start()
        ready.wait()
        return self

    def close(self):
        if self._thread is not None:
            self._loop.call_soon_threadsafe(self._main.cancel)
            self._thread.join()
            self._thread = None

    def stats(self):
        return {
            "requests": dict(self.requests),
            "ranged_requests": self.ranged_requests,
            "statuses": {str(k): v for k, v in self.statuses.items()},
            "body_bytes": self.body_bytes,
            "connections": self.connections,
            "cpu_seconds": time.process_time(),
        }

    # ---- one client connection ----

    async def _serve_client(self, client_sock):
        self.connections += 1
        client = Conn(client_sock)
        bucket = TokenBucket(self.rate, self.burst)  # one per connection, across its requests
        buf = memoryview(bytearray(CHUNK))  # the body relay buffer
        upstream = None
        try:
            while True:
                request = await client.read_head()
                if request is None:
                    return
                method, target = (request.start.split(" ") + ["", ""])[:2]
                if target == STATS_PATH:
                    body = json.dumps(self.stats()).encode()
                    await client.send(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                    continue
                self.requests[method] += 1
                self.ranged_requests += request.get("range") is not None
                request.headers = [(k, v) for k, v in request.headers if k.lower() != "host"]
                request.headers.insert(0, ("Host", self.host_header))
                bodiless = request.get("content-length") is None and request.get("transfer-encoding") is None

                response = None
                if upstream is not None and bodiless:
                    # The server may have closed the kept-alive upstream connection while it
                    # was idle: then send the (bodiless, so replayable) request on a new one.
                    try:
                        response = await self._forward(request, client, upstream, buf)
                    except ConnectionError:
                        pass
                    if response is None:
                        upstream.close()
                        upstream = None
                if response is None:
                    if upstream is None:
                        upstream = await Conn.connect(self.upstream)
                    response = await self._forward(request, client, upstream, buf)
                    if response is None:
                        raise ConnectionError("upstream closed the connection without answering")

                await asyncio.sleep(self.latency)  # the shaped time to first byte
                status = int(response.start.split(" ")[1])
                self.statuses[status] += 1
                await client.send(response.encode())
                no_body = method == "HEAD" or status in (204, 304) or 100 <= status < 200
                to_eof = not no_body and await relay_body(response, upstream, client, buf, bucket, self._count)
                if (to_eof or request.has_token("connection", "close")
                        or response.has_token("connection", "close")
                        or request.start.endswith("HTTP/1.0")):
                    return
        except (ConnectionError, asyncio.CancelledError):
            return  # either side went away (or shutdown): drop both, as a real connection would
        finally:
            if upstream is not None:
                upstream.close()
            client.close()

    async def _forward(self, request, client, upstream, buf):
        """Sends ``request`` and its body (from ``client``) upstream; returns the response
        head, or None if the upstream closed the connection without answering."""
        await upstream.send(request.encode())
        await relay_body(request, client, upstream, buf, None, None)
        return await upstream.read_head()

    def _count(self, n):
        self.body_bytes += n


async def relay_body(head, src, dst, buf, bucket, count):
    """Copies the body that follows ``head`` from ``src`` to ``dst`` through ``buf``, pacing
    data through ``bucket`` (if any) and reporting data bytes to ``count`` (if any). A request
    without Content-Length or chunked encoding has no body; such a response runs to EOF (and
    True is returned)."""

    async def send(n):
        if bucket is not None and (wait := bucket.delay(n)) > 0:
            await asyncio.sleep(wait)
        await dst.send(buf[:n])
        if count is not None:
            count(n)

    async def copy(remaining):
        while remaining > 0:
            n = await src.recv_into(buf[: min(remaining, len(buf))])
            if not n:
                raise ConnectionError("connection closed mid-body")
            await send(n)
            remaining -= n

    if head.has_token("transfer-encoding", "chunked"):
        while True:
            line = await src.read_until(b"\r\n")
            if line is None:
                raise ConnectionError("connection closed mid-body")
            await dst.send(line)
            size = int(line.split(b";")[0].strip(), 16)
            if size == 0:  # then trailers, up to an empty line
                while (line := await src.read_until(b"\r\n")) not in (b"\r\n", None):
                    await dst.send(line)
                await dst.send(b"\r\n")
                return False
            await copy(size)
            await dst.send(await src.read_exactly(2))  # the CRLF after the chunk's data
    length = head.get("content-length")
    if length is not None:
        await copy(int(length))
        return False
    if not head.start.startswith("HTTP/"):
        return False
    while n := await src.recv_into(buf):
        await send(n)
    return True


def main():
    ap = argparse.ArgumentParser(description="Shaping HTTP proxy; prints its port on stdout once listening.")
    ap.add_argument("--upstream-port", type=int, required=True)
    ap.add_argument("--upstream-host", default="127.0.0.1")
    ap.add_argument("--host-header", help="Host header sent upstream (default upstream host:port)")
    ap.add_argument("--port", type=int, default=0, help="port to listen on (default: any free one)")
    ap.add_argument("--latency-ms", type=float, default=50.0, help="added before each response's first byte")
    ap.add_argument("--rate-mbs", type=float, default=50.0, help="MB/s per connection (0 = unlimited)")
    ap.add_argument("--burst-kib", type=int, default=256, help="token bucket depth")
    args = ap.parse_args()

    proxy = ShapingProxy(
        args.upstream_port, upstream_host=args.upstream_host, host_header=args.host_header,
        latency=args.latency_ms / 1000, rate=args.rate_mbs * 1e6, burst=args.burst_kib * 1024,
        port=args.port,
    )

    async def run():
        server = asyncio.create_task(proxy.serve(lambda: print(proxy.port, flush=True)))
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, server.cancel)
        try:
            await server
        except asyncio.CancelledError:
            pass

    asyncio.run(run())


if __name__ == "__main__":
    main()
