"""The bucket emulator (tests/python/bucket_emulator.py) itself: it relays fake-gcs-server's
exact bytes through every host's port and counts them on that host, and it pushes back as
promised: 429s past the bucket-wide request rate, 503 and hang outages that end, and rates and
latency that make transfers take at least as long as they should (lower bounds only: a busy
machine may always be slower)."""

import http.client
import json
import subprocess
import sys
import threading
import time
import urllib.parse

import pytest

from bucket_emulator import CHUNK
from conftest import BUCKET, ROOT, wait_for


def media(name):
    """The JSON API media URL of an object, its name percent-encoded as object_store sends it."""
    return f"/storage/v1/b/{BUCKET}/o/{urllib.parse.quote(name, safe='')}?alt=media"


def metadata(name):
    return f"/storage/v1/b/{BUCKET}/o/{urllib.parse.quote(name, safe='')}"


def connect(endpoint, timeout=10):
    host, port = endpoint.rsplit("/", 1)[1].split(":")
    return http.client.HTTPConnection(host, int(port), timeout=timeout)


def request(conn, path, method="GET", headers=None):
    """One request on a kept-alive connection: (status, headers, body)."""
    conn.request(method, path, headers=headers or {})
    r = conn.getresponse()
    return r.status, r.headers, r.read()


def fetch(endpoint, path, headers=None):
    conn = connect(endpoint)
    try:
        return request(conn, path, headers=headers)
    finally:
        conn.close()


@pytest.fixture
def big_path(shard_dir):
    """An 8 MiB shard that fake-gcs-server serves as gs://bkt/big/big-0.tar."""
    return shard_dir / BUCKET / "big" / "big-0.tar"


def test_exact_bytes_counted_per_host(bucket_emulator, train_paths):
    emu = bucket_emulator(hosts=4)
    names = [f"train/{p.name}" for p in train_paths[:3]]
    body_bytes = [0] * 4
    for host, (name, path) in enumerate(zip(names, train_paths)):
        conn = connect(emu.endpoint(host))  # one kept-alive connection per host
        status, headers, body = request(conn, metadata(name))
        assert status == 200 and json.loads(body)["name"] == name
        body_bytes[host] += len(body)
        status, _, body = request(conn, media(name))
        assert status == 200 and body == path.read_bytes()
        body_bytes[host] += len(body)
        status, _, body = request(conn, media(name), headers={"Range": "bytes=100-1099"})
        assert status == 206 and body == path.read_bytes()[100:1100]
        body_bytes[host] += len(body)
        conn.close()
    # Path-style, '/' escaped: the Host header is rewritten, or fake-gcs-server answers 404.
    status, _, body = fetch(emu.endpoint(2), f"/{BUCKET}/{urllib.parse.quote(names[2], safe='')}")
    assert status == 200 and body == train_paths[2].read_bytes()
    body_bytes[2] += len(body)

    stats = emu.stats(objects=True)
    for host in range(3):
        s = stats["hosts"][host]
        requests = 4 if host == 2 else 3
        assert s["port"] == emu.ports[host]
        assert (s["requests"], s["ok"], s["ranged"]) == (requests, requests, 1), s
        assert s["methods"] == {"GET": requests}
        assert s["statuses"] == ({"200": requests - 1, "206": 1})
        assert (s["throttled"], s["unavailable"], s["hung"]) == (0, 0, 0)
        assert s["bytes"] == body_bytes[host]
        assert s["connections"] == (2 if host == 2 else 1)
        assert s["objects"] == {f"{BUCKET}/{names[host]}": requests}, "names decoded"
        assert s["first_request_at"] <= s["last_request_at"]
    idle = stats["hosts"][3]
    assert (idle["requests"], idle["bytes"], idle["first_request_at"]) == (0, 0, None)
    totals = stats["totals"]
    assert totals["requests"] == 10 and totals["bytes"] == sum(body_bytes)
    assert totals["statuses"] == {"200": 7, "206": 3}
    assert totals["first_request_at"] == stats["hosts"][0]["first_request_at"]
    json.dumps(stats)


def test_rate_limit_answers_429_past_the_bucket_rate(bucket_emulator, train_paths):
    rate, burst = 100, 10
    emu = bucket_emulator(hosts=4, rate_limit=rate, rate_burst=burst)
    name = f"train/{train_paths[0].name}"
    statuses = [[] for _ in range(4)]
    throttles = []
    window = 0.5

    def hammer(host, end):
        conn = connect(emu.endpoint(host))  # kept alive through its 429s
        while time.monotonic() < end:
            status, headers, body = request(conn, metadata(name))
            statuses[host].append(status)
            if status == 429:
                throttles.append((headers, body))
        conn.close()

    start = time.monotonic()
    threads = [threading.Thread(target=hammer, args=(h, start + window)) for h in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start

    ok = sum(s.count(200) for s in statuses)
    throttled = sum(s.count(429) for s in statuses)
    assert ok + throttled == sum(map(len, statuses)), "only 200s and 429s"
    assert throttled > 0
    # All hosts share one bucket: a full burst, then `rate` a second.
    assert 0.7 * (burst + rate * window) <= ok <= burst + rate * elapsed + 1, (ok, elapsed)

    headers, body = throttles[0]
    assert headers["Content-Type"].startswith("application/json")
    assert int(headers["Content-Length"]) == len(body)
    error = json.loads(body)["error"]
    assert error["code"] == 429
    assert error["errors"][0]["reason"] == "rateLimitExceeded"
    assert error["errors"][0]["domain"] == "usageLimits"
    assert f"{BUCKET}/{name}" in error["message"]

    stats = emu.stats()
    for host in range(4):
        s = stats["hosts"][host]
        assert (s["ok"], s["throttled"]) == (statuses[host].count(200), statuses[host].count(429))
        assert s["connections"] == 1
    assert stats["totals"]["throttled"] == throttled

    emu.set_rate_limit(None)
    conn = connect(emu.endpoint(0))
    assert [request(conn, metadata(name))[0] for _ in range(3 * burst)] == [200] * 3 * burst


def test_503_outage_then_recovery(bucket_emulator, train_paths):
    emu = bucket_emulator(hosts=2)
    name, data = f"train/{train_paths[1].name}", train_paths[1].read_bytes()
    conn = connect(emu.endpoint(1))
    emu.outage("503")
    for _ in range(2):  # answered in full: the connection stays usable
        status, headers, body = request(conn, media(name))
        assert status == 503 and headers["Content-Type"].startswith("application/json")
        error = json.loads(body)["error"]
        assert error["code"] == 503 and error["errors"][0]["reason"] == "backendError"
    emu.outage(None)
    assert request(conn, media(name))[::2] == (200, data)
    s = emu.stats()["hosts"][1]
    assert (s["requests"], s["unavailable"], s["ok"], s["connections"]) == (3, 2, 1, 1)

    emu.outage_for("503", 0.2)  # ends by itself
    assert request(conn, media(name))[0] == 503
    wait_for(lambda: request(conn, media(name))[0] == 200, "the scheduled outage to end")
    assert emu.stats()["outage"] is None


def test_hang_outage_holds_requests_until_it_ends(bucket_emulator, train_paths):
    emu = bucket_emulator(hosts=2)
    name, data = f"train/{train_paths[2].name}", train_paths[2].read_bytes()
    emu.outage("hang")
    client = connect(emu.endpoint(0), timeout=1)
    with pytest.raises(TimeoutError):
        request(client, media(name))
    client.close()
    held = connect(emu.endpoint(1), timeout=10)
    held.request("GET", media(name))
    wait_for(lambda: emu.stats()["totals"]["hung"] == 2, "both requests to hang")

    emu.outage(None)  # closes the connection it held: the request fails, it does not hang on
    with pytest.raises(http.client.RemoteDisconnected):
        held.getresponse()
    assert fetch(emu.endpoint(1), media(name))[::2] == (200, data)
    stats = emu.stats()
    assert [s["hung"] for s in stats["hosts"]] == [1, 1]
    assert stats["totals"]["statuses"] == {"200": 1}


def test_hang_freezes_a_response_in_progress_then_cuts_it(bucket_emulator, big_path):
    emu = bucket_emulator(hosts=1, conn_rate=1e6)  # 8 MiB would take 8 s
    conn = connect(emu.endpoint(0))
    conn.request("GET", media("big/big-0.tar"))
    r = conn.getresponse()
    assert r.status == 200
    first = r.read(300_000)
    emu.outage("hang")
    wait_for(lambda: emu.stats()["totals"]["hung"] == 1, "the response to freeze")
    emu.outage(None)
    with pytest.raises(http.client.IncompleteRead) as cut:
        r.read()
    got = first + cut.value.partial
    assert len(got) < big_path.stat().st_size
    assert got == big_path.read_bytes()[: len(got)]


def test_connection_rate_and_shared_egress_are_lower_bounds(bucket_emulator, big_path):
    size = 1_000_000
    data = big_path.read_bytes()
    emu = bucket_emulator(hosts=1, conn_rate=4e6)
    start = time.monotonic()
    status, _, body = fetch(emu.endpoint(0), media("big/big-0.tar"), {"Range": f"bytes=0-{size - 1}"})
    elapsed = time.monotonic() - start
    assert status == 206 and body == data[:size]
    assert elapsed >= (size - CHUNK) / 4e6, elapsed

    # Two hosts share 8 MB/s: 2 MB each takes them 0.5 s together, in turns, so neither is done
    # at the 0.25 s that it would be if one went first.
    size, egress = 2_000_000, 8e6
    emu = bucket_emulator(hosts=2, egress=egress)
    done = {}

    def get(host):
        status, _, body = fetch(emu.endpoint(host), media("big/big-0.tar"), {"Range": f"bytes=0-{size - 1}"})
        done[host] = (status, body == data[:size], time.monotonic() - start)

    start = time.monotonic()
    threads = [threading.Thread(target=get, args=(h,)) for h in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [done[h][:2] for h in range(2)] == [(206, True)] * 2
    assert max(done[h][2] for h in range(2)) >= (2 * size - CHUNK) / egress, done
    assert min(done[h][2] for h in range(2)) >= 0.6 * 2 * size / egress, done
    assert [s["bytes"] for s in emu.stats()["hosts"]] == [size, size]


def test_latency_before_first_byte(bucket_emulator, train_paths):
    emu = bucket_emulator(hosts=1, latency=0.2)
    start = time.monotonic()
    assert fetch(emu.endpoint(0), metadata(f"train/{train_paths[0].name}"))[0] == 200
    assert time.monotonic() - start >= 0.2


def test_cli_is_driven_over_http(fake_gcs, train_paths):
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "python" / "bucket_emulator.py"),
         "--upstream-port", fake_gcs.rsplit(":", 1)[1], "--hosts", "2", "--rate-limit", "1000"],
        stdout=subprocess.PIPE, text=True)
    try:
        endpoints = json.loads(proc.stdout.readline())["endpoints"]
        assert len(endpoints) == 2
        name, data = f"train/{train_paths[3].name}", train_paths[3].read_bytes()
        conn = connect(endpoints[1])
        assert request(conn, media(name))[::2] == (200, data)
        assert request(conn, "/__bucket__/outage?kind=503", "POST")[0] == 200
        assert request(conn, media(name))[0] == 503
        assert request(conn, "/__bucket__/outage?kind=none", "POST")[0] == 200
        assert request(conn, "/__bucket__/rate?limit=none", "POST")[0] == 200
        assert request(conn, "/__bucket__/outage?kind=flood", "POST")[0] == 400
        status, _, body = request(connect(endpoints[0]), "/__bucket__/stats?objects=1")
        stats = json.loads(body)
        assert status == 200 and stats["rate_limit"] is None and stats["outage"] is None
        host = stats["hosts"][1]
        assert (host["requests"], host["ok"], host["unavailable"]) == (2, 1, 1), "control is uncounted"
        assert host["objects"] == {f"{BUCKET}/{name}": 2}
        assert stats["hosts"][0]["requests"] == 0
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0


def test_hosts_told_apart_by_address_on_one_port(bucket_emulator, train_paths):
    """``peers``: one port for the pod, each host known by its address (here 127.0.0.2 and
    127.0.0.3, both loopback); a connection from an address not in the pod is closed."""
    emu = bucket_emulator(hosts=2, peers=["127.0.0.2", "127.0.0.3"])
    assert emu.endpoint(0) == emu.endpoint(1)
    host, port = emu.endpoint(0).rsplit("/", 1)[1].split(":")
    name = f"train/{train_paths[0].name}"
    for source, times in (("127.0.0.3", 2), ("127.0.0.2", 1)):
        for _ in range(times):
            conn = http.client.HTTPConnection(host, int(port), timeout=10, source_address=(source, 0))
            status, _, body = request(conn, media(name))
            conn.close()
            assert status == 200 and body == train_paths[0].read_bytes()
    stranger = http.client.HTTPConnection(host, int(port), timeout=10)  # from 127.0.0.1
    with pytest.raises((ConnectionError, http.client.RemoteDisconnected)):
        request(stranger, media(name))
    stats = emu.stats(objects=True)
    assert [h["requests"] for h in stats["hosts"]] == [1, 2]
    assert [h["bytes"] for h in stats["hosts"]] == [train_paths[0].stat().st_size * n for n in (1, 2)]


def test_tokens_admit_until_they_expire(bucket_emulator, train_paths):
    """``token_secret``: a token make_token made admits a request until it expires; an expired
    one, one made with another secret, a missing header: 401 with GCS's authError."""
    from bucket_emulator import make_token

    emu = bucket_emulator(hosts=1, token_secret="s3cret")
    name = f"train/{train_paths[0].name}"

    def status(authorization):
        headers = {} if authorization is None else {"Authorization": authorization}
        code, _, body = fetch(emu.endpoint(0), media(name), headers)
        return code, body

    code, body = status(f"Bearer {make_token('s3cret', 0, 60)}")
    assert code == 200 and body == train_paths[0].read_bytes()
    for authorization, why in [
        (f"Bearer {make_token('s3cret', 0, -1)}", "the token expired 1."),
        (f"Bearer {make_token('other', 0, 60)}", "a token this bucket did not issue"),
        (None, "no Authorization header"),
    ]:
        code, body = status(authorization)
        error = json.loads(body)["error"]
        assert code == 401 and error["errors"][0]["reason"] == "authError", body
        assert error["message"].startswith(f"Invalid Credentials: {why}"), error["message"]
    assert emu.stats()["totals"]["unauthorized"] == 3
