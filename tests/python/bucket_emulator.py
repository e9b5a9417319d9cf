"""A shared GCS bucket as the hosts of a TPU pod see it: a loopback HTTP/1.1 proxy in front of
fake-gcs-server that pushes back the way the real store does (stdlib only).

fake-gcs-server answers every request at once, at loopback speed, from any number of clients.
A real bucket does not, and the daemon's behaviour under those limits is what a pod run
depends on:

  - request rate: a bucket starts near 5,000 object reads/s and ramps up only slowly (GCS's
    request-rate guidelines); past that it answers ``429 Too Many Requests`` with a JSON error
    (reason ``rateLimitExceeded``), and clients are expected to retry with exponential backoff.
    Every host's requests count against the same bucket (a ranged GET per part of each
    shard, and every retry), so a pod of daemons starting
    together meets this limit first;
  - outages: stretches of ``503`` (reason ``backendError``), or a store that accepts
    requests and never answers (only a client's own timeouts get it out);
  - bandwidth and latency: a per-connection rate (GCS's per-stream throughput), an egress
    rate shared by all hosts (the pod's share of the network), and time to first byte.

``BucketEmulator(upstream_port, hosts=N, ...)`` listens on N loopback ports, one per host,
and counts everything per host, so a test or benchmark can tell which host asked what and
what each was answered. Options (fixed for the emulator's life, but for the request rate):

  - ``rate_limit``: requests/s across all hosts (None: unlimited), a token bucket ``rate_burst``
    requests deep (default: a tenth of a second's worth, at least 1: a bucket that has been
    idle lets a short burst through, not a second's worth at once). A request past it is
    answered at once with GCS's 429 JSON error; it takes no token. Changed at run time by
    ``set_rate_limit()``.
  - ``egress``: response body bytes/s across all hosts (None: unlimited). A token bucket that
    goes into debt: each piece of a body books the next slot, so connections sending at once
    take turns piece by piece; pieces are then filled to ``CHUNK`` bytes (the last of a body
    excepted), so that the turns are equal in bytes, not in reads.
  - ``conn_rate``: response body bytes/s per client connection (None: unlimited). Both byte
    buckets are ``burst_bytes`` deep. A piece waits for its connection's bucket, then for the
    shared one (booking the shared one first would waste its slots on a connection that is
    not ready to send).
  - ``latency``: seconds added before the first byte of each response relayed from the store
    (after its head arrived from fake-gcs-server). 429s, 503s and control answers come at once.
  - ``host_rate``: response body bytes/s per host, as ``{host: rate}`` (a host's link: all its
    connections share it, before the shared egress); hosts not named are unlimited.
  - ``listen`` and ``peers``: by default each host has its own port on 127.0.0.1. With
    ``peers`` (one address per host), there is one port on ``listen``, and a connection's
    host is the one whose address it comes from (a pod's hosts in their own network
    namespaces, all with the same config); a connection from any other address is closed.
  - ``token_secret``: the bucket checks credentials. A request needs ``Authorization: Bearer``
    with a token ``make_token(token_secret, ...)`` made that has not expired (a pod's metadata
    servers make them); any other is answered ``401`` with GCS's JSON error (reason
    ``authError``), counted as ``unauthorized``.

Outages (``outage(kind)``, ``outage_for(kind, seconds)``, ``outage(None)`` to end one):

  - ``"503"``: every request that arrives is answered 503 with GCS's JSON error; responses
    already being sent go on.
  - ``"hang"``: requests are read and never answered (no byte); responses in progress are
    frozen too (no byte more is sent, the connection stays open). When the outage ends, every
    connection it holds is closed, so a frozen response is cut short: a client sees its
    request fail, as after a network blackhole, and must retry on a new connection.

Requests pass through unchanged except for XML API uploads (``PUT /bucket/object``, which
fake-gcs-server does not take: sent on as JSON API media uploads and answered as GCS answers
the PUT, with the object's ETag and generation), and the Host header, rewritten to the upstream's
``127.0.0.1:PORT``: fake-gcs-server answers path-style GETs (``/bkt/name``) only for its
``-public-host``. Object names arrive percent-encoded (``/storage/v1/b/bkt/o/train%2Fx.tar``)
and are decoded to name them in counts and error messages.

The benchmarks' store is this emulator too (bench/gcs_store.py, with ``latency`` and
``conn_rate`` only). The relay: one event loop, keep-alive connections each with its own upstream connection,
messages framed by Content-Length or chunked encoding, and body bytes going socket -> one
reused buffer per connection -> socket, so its CPU cost stays near the kernel's copies (a
2-core machine runs it beside 8 daemons).

``stats()`` is a JSON-able snapshot: ``{"hosts": [per host], "totals": {...}, "outage",
"rate_limit", "rate_burst", "egress", "conn_rate", "latency", "cpu_seconds"}``, where each
host (and ``totals``) has ``requests`` (all counted ones), ``methods`` and ``statuses`` (counts
by method and by answered status), ``ok`` (2xx), ``throttled`` (429), ``unavailable`` (503),
``unauthorized`` (401), ``hung`` (requests a hang outage held, unanswered or frozen mid-response), ``ranged``
(requests with a Range header), ``bytes`` (response body bytes relayed from the store),
``connections``, and ``first_request_at`` / ``last_request_at`` (Unix times, None before the
first); a host also has its ``port``. ``stats(objects=True)`` adds ``objects``: requests by
decoded ``bucket/object`` name, and ``gets``: the GETs among them (downloads and metadata
reads, not HEADs).

As a process (``python bucket_emulator.py --upstream-port P --hosts N [--rate-limit R]
[--egress BPS] [--conn-rate BPS] [--latency S]``) it prints one JSON line
(``{"endpoints": [...], "ports": [...]}``) once listening and runs until SIGTERM or SIGINT.
Every host port also answers, unshaped and uncounted, ``GET /__bucket__/stats[?objects=1]``,
``POST /__bucket__/outage?kind=503|hang|none[&seconds=S]`` and
``POST /__bucket__/rate?limit=R|none[&burst=B]``, so a benchmark in another process drives it.
"""

import argparse
import asyncio
import collections
import concurrent.futures
import hashlib
import hmac
import json
import re
import signal
import socket
import threading
import time
import urllib.parse

CONTROL = "/__bucket__/"
CHUNK = 256 * 1024  # largest piece of a body relayed (and paced) at once
MAX_HEAD = 64 * 1024
OUTAGES = ("503", "hang")
# JSON API paths (media, metadata, uploads, lists): /storage/v1/b/BUCKET/o[/OBJECT].
JSON_API = re.compile(r"^(?:/download|/upload)?/storage/v1/b/([^/]+)(?:/o(?:/(.*))?)?$")


class TokenBucket:
    """``rate`` units/s (None or 0: unlimited), at most ``burst`` at once after idling."""

    def __init__(self, rate, burst):
        self.rate, self.burst = rate, burst
        self.tokens, self.last = burst, time.monotonic()

    def _refill(self):
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now

    def delay(self, n):
        """Takes ``n`` tokens, going into debt if short; returns how long to wait before
        using them (debt books later slots, so callers are served in turn)."""
        if not self.rate:
            return 0.0
        self._refill()
        self.tokens -= n
        return -self.tokens / self.rate if self.tokens < 0 else 0.0

    def take(self):
        """Takes one token if there is one (no debt: a refused caller costs nothing)."""
        if not self.rate:
            return True
        self._refill()
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True

    def set_rate(self, rate, burst):
        if self.rate:
            self._refill()
        else:
            self.tokens, self.last = burst, time.monotonic()
        self.rate, self.burst = rate, burst
        if rate:
            self.tokens = min(self.tokens, burst)


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


class Discard:
    """A destination for the bodies of requests answered here, not sent on."""

    async def send(self, data):
        pass


DISCARD = Discard()


class Collect:
    """A destination that keeps a (small) body."""

    def __init__(self):
        self.data = bytearray()

    async def send(self, data):
        self.data += data


async def relay_body(head, src, dst, buf, pace=None, count=None, fill=False):
    """Copies the body that follows ``head`` from ``src`` to ``dst`` through ``buf``; data
    pieces wait on ``pace(n)`` (if any) before going out and are reported to ``count`` (if
    any) after. With ``fill``, each piece of a framed body is as large as ``buf`` allows
    (else it is what one read brought). A request without Content-Length or chunked encoding
    has no body; such a response runs to EOF (and True is returned)."""

    async def send(n):
        if pace is not None:
            await pace(n)
        await dst.send(buf[:n])
        if count is not None:
            count(n)

    async def copy(remaining):
        while remaining > 0:
            want, n = min(remaining, len(buf)), 0
            while n < want and (fill or not n):
                got = await src.recv_into(buf[n:want])
                if not got:
                    raise ConnectionError("connection closed mid-body")
                n += got
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


def object_name(target):
    """``bucket/object`` (percent-decoded) that a JSON API or path-style request names, or
    None (bucket lists, other paths)."""
    path, _, query = target.partition("?")
    api = JSON_API.match(path)
    if api:
        name = api.group(2)
        if name is None:  # an upload names its object in the query
            name = urllib.parse.parse_qs(query).get("name", [None])[0]
            return None if name is None else f"{urllib.parse.unquote(api.group(1))}/{name}"
        return urllib.parse.unquote(f"{api.group(1)}/{name}")
    if path.startswith("/storage/") or path.count("/") < 2:
        return None
    return urllib.parse.unquote(path[1:])


def gcs_error(code, domain, reason, message):
    """GCS's JSON API error body."""
    errors = [{"message": message, "domain": domain, "reason": reason}]
    return {"error": {"code": code, "message": message, "errors": errors}}


def response(status, reason, obj):
    """A complete JSON response (kept alive: HTTP/1.1's default)."""
    body = json.dumps(obj).encode()
    return (b"HTTP/1.1 %d %s\r\nContent-Type: application/json; charset=UTF-8\r\nContent-Length: %d\r\n\r\n%s"
            % (status, reason.encode(), len(body), body))


def make_token(secret, host, ttl, now=None):
    """An access token for ``host`` that the bucket takes for ``ttl`` seconds: the host, its
    expiry and an HMAC of both under ``secret`` (what a pod's metadata servers hand out)."""
    expiry = int(((time.time() if now is None else now) + ttl) * 1000)
    body = f"pod.{host}.{expiry}"
    mac = hmac.new(secret.encode(), body.encode(), hashlib.sha256).hexdigest()[:32]
    return f"{body}.{mac}"


def token_error(secret, authorization, now=None):
    """Why an ``Authorization`` header does not admit a request, or None if it does."""
    if authorization is None:
        return "no Authorization header"
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return f"not a bearer token: {scheme!r}"
    body, _, mac = token.strip().rpartition(".")
    want = hmac.new(secret.encode(), body.encode(), hashlib.sha256).hexdigest()[:32]
    if not hmac.compare_digest(mac, want):
        return "a token this bucket did not issue"
    expiry = int(body.rsplit(".", 1)[1]) / 1000
    late = (time.time() if now is None else now) - expiry
    return f"the token expired {late:.3f} s ago" if late >= 0 else None


def default_burst(rate_limit):
    """A tenth of a second's worth of requests, at least one: an idle bucket lets a short
    burst through, not a second's worth at once."""
    return None if rate_limit is None else max(1.0, rate_limit / 10)


class HostStats:
    """One host port's counters (written only by the event loop's thread)."""

    def __init__(self, port):
        self.port = port
        self.methods = collections.Counter()
        self.statuses = collections.Counter()
        self.objects = collections.Counter()
        self.gets = collections.Counter()
        self.hung = self.ranged = self.bytes = self.connections = 0
        self.first_request_at = self.last_request_at = None

    def count(self, method, request, name):
        now = time.time()
        self.methods[method] += 1
        self.ranged += request.get("range") is not None
        if name is not None:
            self.objects[name] += 1
            self.gets[name] += method == "GET"
        if self.first_request_at is None:
            self.first_request_at = now
        self.last_request_at = now

    def add_bytes(self, n):
        self.bytes += n


def summarize(parts, objects):
    """The stats of one host, or of several added up."""
    methods, statuses, names = collections.Counter(), collections.Counter(), collections.Counter()
    gets = collections.Counter()
    for p in parts:
        methods.update(p.methods)
        statuses.update(p.statuses)
        names.update(p.objects)
        gets.update(p.gets)
    firsts = [p.first_request_at for p in parts if p.first_request_at is not None]
    lasts = [p.last_request_at for p in parts if p.last_request_at is not None]
    out = {
        "requests": sum(methods.values()),
        "methods": dict(methods),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "ok": sum(v for k, v in statuses.items() if 200 <= k < 300),
        "throttled": statuses[429],
        "unauthorized": statuses[401],
        "unavailable": statuses[503],
        "hung": sum(p.hung for p in parts),
        "ranged": sum(p.ranged for p in parts),
        "bytes": sum(p.bytes for p in parts),
        "connections": sum(p.connections for p in parts),
        "first_request_at": min(firsts, default=None),
        "last_request_at": max(lasts, default=None),
    }
    if objects:
        out["objects"] = dict(sorted(names.items()))
        out["gets"] = {k: v for k, v in sorted(gets.items()) if v}
    return out


class BucketEmulator:
    """One shared bucket in front of fake-gcs-server at ``upstream_port``, with ``hosts`` ports
    (host i's is ``endpoint(i)``); the options are the module docstring's."""

    def __init__(self, upstream_port, hosts=1, *, rate_limit=None, rate_burst=None, egress=None,
                 conn_rate=None, latency=0.0, burst_bytes=CHUNK, upstream_host="127.0.0.1",
                 host_rate=None, listen="127.0.0.1", peers=None, token_secret=None):
        if peers is not None and len(peers) != hosts:
            raise ValueError(f"{len(peers)} peer addresses for {hosts} hosts")
        self.upstream = (upstream_host, upstream_port)
        self.listen, self.peers, self.token_secret = listen, peers, token_secret
        self._host_rates = {h: TokenBucket(r, burst_bytes) for h, r in (host_rate or {}).items()}
        self.host_header = f"{upstream_host}:{upstream_port}"
        self.hosts = hosts
        self.conn_rate, self.burst_bytes, self.latency = conn_rate, burst_bytes, latency
        self._requests = TokenBucket(rate_limit, rate_burst or default_burst(rate_limit))
        self._egress = TokenBucket(egress, burst_bytes)
        self._outage = None
        self._outage_timer = None
        self._thaw = None  # set when a hang outage ends: what hung connections wait on
        self._stats = []
        self._tasks = set()
        self._loop = self._thread = self._main = None

    # ---- running ----

    def start(self):
        """Runs the emulator on a daemon thread with its own event loop; returns once every
        host port listens."""
        ready = threading.Event()
        failure = []

        def run():
            self._loop = asyncio.new_event_loop()
            self._main = self._loop.create_task(self._serve(ready.set))
            try:
                self._loop.run_until_complete(self._main)
            except asyncio.CancelledError:
                pass
            except BaseException as e:  # e.g. no port to listen on: start() raises it
                failure.append(e)
                ready.set()
            finally:
                self._loop.close()

        self._thread = threading.Thread(target=run, name="bucket-emulator", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            self._thread.join()
            self._thread = None
            raise failure[0]
        return self

    def close(self):
        """Stops serving and closes every connection."""
        if self._thread is not None:
            self._loop.call_soon_threadsafe(self._main.cancel)
            self._thread.join()
            self._thread = None

    @property
    def ports(self):
        return [s.port for s in self._stats]

    def endpoint(self, host):
        return f"http://{self.listen}:{self._stats[host].port}"

    @property
    def endpoints(self):
        return [self.endpoint(i) for i in range(self.hosts)]

    # ---- run-time controls (from any thread) ----

    def stats(self, objects=False):
        """A JSON-able snapshot of the counters (the module docstring says what is in it);
        ``objects`` adds each host's requests by object name."""
        return self._on_loop(self._snapshot, objects)

    def outage(self, kind):
        """Starts an outage (``"503"`` or ``"hang"``) now, until the next call; None ends it
        (closing the connections a hang holds)."""
        self.outage_for(kind, None)

    def outage_for(self, kind, seconds):
        """An outage now that ends by itself after ``seconds`` (None: at the next call),
        unless replaced first."""
        if self._thread is None:
            raise RuntimeError("the emulator is not running: start() it first")
        self._on_loop(self._set_outage, kind, seconds)

    def set_rate_limit(self, limit, burst=None):
        """The bucket-wide request rate from now on (None: unlimited); ``burst`` defaults as
        the constructor's ``rate_burst`` does."""
        self._on_loop(self._requests.set_rate, limit, burst or default_burst(limit))

    def set_egress(self, rate):
        """The shared egress from now on, body bytes/s (None: unlimited)."""
        self._on_loop(self._egress.set_rate, rate, self.burst_bytes)

    def set_host_rate(self, host, rate):
        """Host ``host``'s link from now on, body bytes/s (None: unlimited)."""
        def set_rate():
            self._host_rates[host] = TokenBucket(rate, self.burst_bytes)
        self._on_loop(set_rate)

    def _on_loop(self, fn, *args):
        """Runs ``fn`` on the event loop's thread (the one that writes the state it reads)."""
        if self._thread is None or threading.current_thread() is self._thread:
            return fn(*args)
        done = concurrent.futures.Future()

        def call():
            try:
                done.set_result(fn(*args))
            except BaseException as e:
                done.set_exception(e)

        self._loop.call_soon_threadsafe(call)
        return done.result()

    def _snapshot(self, objects):
        return {
            "hosts": [{"port": s.port, **summarize([s], objects)} for s in self._stats],
            "totals": summarize(self._stats, objects),
            "outage": self._outage,
            "rate_limit": self._requests.rate,
            "rate_burst": self._requests.burst,
            "egress": self._egress.rate,
            "conn_rate": self.conn_rate,
            "latency": self.latency,
            "cpu_seconds": time.process_time(),
        }

    def _set_outage(self, kind, seconds):
        if kind not in OUTAGES + (None,):
            raise ValueError(f"outage kind {kind!r}: one of {OUTAGES} or None")
        if self._outage_timer is not None:
            self._outage_timer.cancel()
            self._outage_timer = None
        if self._outage == "hang" and kind != "hang":
            self._thaw.set()
            self._thaw = asyncio.Event()
        self._outage = kind
        if kind is not None and seconds is not None:
            self._outage_timer = self._loop.call_later(seconds, self._set_outage, None, None)

    # ---- serving ----

    async def _serve(self, ready):
        self._thaw = asyncio.Event()
        listeners = []
        try:
            for _ in range(self.hosts if self.peers is None else 1):
                listeners.append(socket.create_server((self.listen, 0), backlog=1024))
                listeners[-1].setblocking(False)
            ports = [s.getsockname()[1] for s in listeners]
            self._stats = [HostStats(ports[i if self.peers is None else 0]) for i in range(self.hosts)]
            ready()
            await asyncio.gather(*(self._accept(i, s) for i, s in enumerate(listeners)))
        finally:
            for s in listeners:
                s.close()
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _accept(self, host, listener):
        loop = asyncio.get_running_loop()
        while True:
            client, peer = await loop.sock_accept(listener)
            if self.peers is not None:
                if peer[0] not in self.peers:
                    client.close()  # not a host of this pod
                    continue
                host = self.peers.index(peer[0])
            task = loop.create_task(self._serve_client(host, client))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _hang(self, stats):
        """Holds a request (or a response in progress) until the hang outage ends, then drops
        its connection."""
        stats.hung += 1
        await self._thaw.wait()
        raise ConnectionError("hang outage ended")

    def _refusal(self, name, request):
        """The answer to a request that the store turns away now, or None to serve it."""
        if self.token_secret is not None:
            why = token_error(self.token_secret, request.get("authorization"))
            if why is not None:
                message = f"Invalid Credentials: {why}"
                return 401, response(401, "Unauthorized", gcs_error(401, "global", "authError", message))
        if self._outage == "503":
            message = "We encountered an internal error. Please try again."
            error = gcs_error(503, "global", "backendError", message)
            return 503, response(503, "Service Unavailable", error)
        if not self._requests.take():
            message = (f"The rate of requests to the object {name or 'bucket'} exceeds the rate limit "
                       f"({self._requests.rate:g} requests/s). Please reduce the rate of requests and "
                       "retry with exponential backoff.")
            error = gcs_error(429, "usageLimits", "rateLimitExceeded", message)
            return 429, response(429, "Too Many Requests", error)
        return None

    async def _serve_client(self, host, client_sock):
        stats = self._stats[host]
        stats.connections += 1
        client = Conn(client_sock)
        bucket = TokenBucket(self.conn_rate, self.burst_bytes)  # this connection's, across its requests
        buf = memoryview(bytearray(CHUNK))  # the body relay buffer

        async def pace(n):
            if (wait := bucket.delay(n)) > 0:
                await asyncio.sleep(wait)
            link = self._host_rates.get(host)  # this host's link, as it is now
            if link is not None and (wait := link.delay(n)) > 0:
                await asyncio.sleep(wait)
            if (wait := self._egress.delay(n)) > 0:
                await asyncio.sleep(wait)
            if self._outage == "hang":
                await self._hang(stats)

        upstream = None
        try:
            while True:
                request = await client.read_head()
                if request is None:
                    return
                method, target = (request.start.split(" ") + ["", ""])[:2]
                keep_alive = not (request.has_token("connection", "close")
                                  or request.start.endswith("HTTP/1.0"))
                if target.startswith(CONTROL):
                    await relay_body(request, client, DISCARD, buf)
                    await client.send(self._control(method, target))
                    if not keep_alive:
                        return
                    continue

                name = object_name(target)
                stats.count(method, request, name)
                if self._outage == "hang":
                    await self._hang(stats)
                refusal = self._refusal(name, request)
                if refusal is not None:
                    status, answer = refusal
                    await relay_body(request, client, DISCARD, buf)
                    stats.statuses[status] += 1
                    await client.send(answer if method != "HEAD" else answer[: answer.index(b"\r\n\r\n") + 4])
                    if not keep_alive:
                        return
                    continue

                xml_put = method == "PUT" and name is not None and not target.startswith("/storage/")
                if xml_put:
                    # An XML API upload (object_store's put, path-style), which fake-gcs-server
                    # does not take: sent on as the JSON API's media upload, answered below as
                    # GCS answers the XML PUT.
                    bucket, _, obj = name.partition("/")
                    request.start = (f"POST /upload/storage/v1/b/{bucket}/o?uploadType=media&name="
                                     f"{urllib.parse.quote(obj, safe='')} HTTP/1.1")
                request.headers = [(k, v) for k, v in request.headers if k.lower() != "host"]
                request.headers.insert(0, ("Host", self.host_header))
                bodiless = request.get("content-length") is None and request.get("transfer-encoding") is None
                answer = None
                if upstream is not None and bodiless:
                    # The server may have closed the kept-alive upstream connection while it
                    # was idle: then send the (bodiless, so replayable) request on a new one.
                    try:
                        answer = await self._forward(request, client, upstream, buf)
                    except ConnectionError:
                        pass
                    if answer is None:
                        upstream.close()
                        upstream = None
                if answer is None:
                    if upstream is None:
                        upstream = await Conn.connect(self.upstream)
                    answer = await self._forward(request, client, upstream, buf)
                    if answer is None:
                        raise ConnectionError("upstream closed the connection without answering")

                if self.latency:
                    await asyncio.sleep(self.latency)  # the store's time to first byte
                if self._outage == "hang":
                    await self._hang(stats)
                status = int(answer.start.split(" ")[1])
                stats.statuses[status] += 1
                if xml_put and 200 <= status < 300:
                    created = Collect()
                    await relay_body(answer, upstream, created, buf)
                    meta = json.loads(created.data)
                    await client.send(
                        f'HTTP/1.1 200 OK\r\nETag: "{meta["etag"]}"\r\nx-goog-generation: '
                        f'{meta["generation"]}\r\nContent-Length: 0\r\n\r\n'.encode())
                    if not keep_alive:
                        return
                    continue
                await client.send(answer.encode())
                no_body = method == "HEAD" or status in (204, 304) or 100 <= status < 200
                to_eof = not no_body and await relay_body(
                    answer, upstream, client, buf, pace, stats.add_bytes, fill=self._egress.rate is not None)
                if to_eof or not keep_alive or answer.has_token("connection", "close"):
                    return
        except (ConnectionError, asyncio.CancelledError):
            return  # either side went away (or shutdown, or a hang ended): drop both
        finally:
            if upstream is not None:
                upstream.close()
            client.close()

    async def _forward(self, request, client, upstream, buf):
        """Sends ``request`` and its body (from ``client``) upstream; returns the response
        head, or None if the upstream closed the connection without answering."""
        await upstream.send(request.encode())
        await relay_body(request, client, upstream, buf)
        return await upstream.read_head()

    def _control(self, method, target):
        """Answers a ``/__bucket__/`` request (another process's way to read and drive this)."""
        url = urllib.parse.urlsplit(target)
        query = {k: v[-1] for k, v in urllib.parse.parse_qs(url.query).items()}
        action = url.path[len(CONTROL):]
        try:
            if action == "stats" and method == "GET":
                return response(200, "OK", self._snapshot(query.get("objects") in ("1", "true")))
            if action == "outage" and method == "POST":
                kind = None if query.get("kind", "none") == "none" else query["kind"]
                seconds = float(query["seconds"]) if "seconds" in query else None
                self._set_outage(kind, seconds)
                return response(200, "OK", {"outage": kind, "seconds": seconds})
            if action == "rate" and method == "POST":
                limit = None if query.get("limit", "none") == "none" else float(query["limit"])
                burst = float(query["burst"]) if "burst" in query else default_burst(limit)
                self._requests.set_rate(limit, burst)
                return response(200, "OK", {"rate_limit": limit, "rate_burst": burst})
        except ValueError as e:
            return response(400, "Bad Request", {"error": str(e)})
        return response(404, "Not Found", {"error": f"{method} {url.path}: no such control"})


def main():
    ap = argparse.ArgumentParser(
        description="A shared GCS bucket in front of fake-gcs-server, one port per host; prints "
                    "its endpoints as one JSON line once listening.")
    ap.add_argument("--upstream-port", type=int, required=True, help="fake-gcs-server's port")
    ap.add_argument("--upstream-host", default="127.0.0.1")
    ap.add_argument("--hosts", type=int, default=1, help="host ports to listen on")
    ap.add_argument("--rate-limit", type=float, help="requests/s across all hosts (default unlimited)")
    ap.add_argument("--rate-burst", type=float,
                    help="requests let through at once (default rate/10, at least 1)")
    ap.add_argument("--egress", type=float, help="body bytes/s across all hosts (default unlimited)")
    ap.add_argument("--conn-rate", type=float, help="body bytes/s per connection (default unlimited)")
    ap.add_argument("--burst-bytes", type=int, default=CHUNK, help="depth of both byte buckets")
    ap.add_argument("--latency", type=float, default=0.0, help="seconds before each response's first byte")
    args = ap.parse_args()

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    emu = BucketEmulator(
        args.upstream_port, args.hosts, rate_limit=args.rate_limit, rate_burst=args.rate_burst,
        egress=args.egress, conn_rate=args.conn_rate, latency=args.latency,
        burst_bytes=args.burst_bytes, upstream_host=args.upstream_host,
    ).start()
    print(json.dumps({"endpoints": emu.endpoints, "ports": emu.ports}), flush=True)
    stop.wait()
    emu.close()


if __name__ == "__main__":
    main()
