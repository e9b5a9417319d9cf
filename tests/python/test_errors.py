"""Bad input gets a clear error, and the daemon keeps serving everyone else."""

import json
import struct
import subprocess

import pytest
import shardd

from conftest import SHARDD, TESTDATA, error_frame, gcs_config, raw_exchange, reference_samples, wait_for


@pytest.fixture
def daemon(make_daemon, fake_gcs):
    return make_daemon(gcs_config(fake_gcs))


def still_serves(d):
    with shardd.Client(d.socket) as c:
        assert len(list(c.stream("train", epoch=0, rank=0, world_size=1))) > 100


@pytest.mark.parametrize(
    "dataset, kw, code, message",
    [
        ("trian", dict(rank=0, world_size=1), "unknown_dataset",
         'unknown dataset "trian"; this daemon serves: big, empty, missing, mixed, notatar, train, truncated'),
        ("train", dict(rank=4, world_size=4), "bad_topology",
         'dataset "train": rank 4 must be less than world_size 4'),
        ("train", dict(rank=0, world_size=2, worker=2, num_workers=2), "bad_topology",
         'dataset "train": worker 2 must be less than num_workers 2'),
    ],
)
def test_refused_requests(daemon, dataset, kw, code, message):
    with shardd.Client(daemon.socket) as c:
        with pytest.raises(shardd.DaemonError) as e:
            c.stream(dataset, epoch=0, **kw)
    assert e.value.code == code
    assert str(e.value) == message
    still_serves(daemon)


def test_rank_on_another_host(make_daemon, fake_gcs):
    d = make_daemon(gcs_config(fake_gcs, host_index=1, host_count=2))
    with shardd.Client(d.socket) as c:
        with pytest.raises(shardd.DaemonError, match=r"rank 0 is not on this host: host 1 of 2 serves ranks 4..=7"):
            c.stream("train", epoch=0, rank=0, world_size=8)
        with pytest.raises(shardd.DaemonError) as e:
            c.stream("train", epoch=0, rank=2, world_size=8)
        assert str(e.value).endswith("; rank 2 is host 0's: each host's daemon needs its own host.index "
                                     '("auto" on a TPU VM)'), str(e.value)
        with pytest.raises(shardd.DaemonError, match="world_size 3 is not divisible by the host count 2"):
            c.stream("train", epoch=0, rank=0, world_size=3)


@pytest.mark.parametrize(
    "dataset, message",
    [
        ("missing", "gs://bkt/nope/gone.tar: object not found"),
        ("notatar", "gs://bkt/bad/notatar.tar: not a valid tar file"),
        ("truncated", "gs://bkt/bad/truncated.tar: truncated: member \"big.bin\""),
        ("empty", "gs://bkt/bad/empty.tar: empty file, not a tar"),
    ],
)
def test_bad_shards_name_the_url(daemon, dataset, message):
    with shardd.Client(daemon.socket) as c:
        stream = c.stream(dataset, epoch=0, rank=0, world_size=1)
        with pytest.raises(shardd.DaemonError) as e:
            list(stream)
    assert e.value.code == "stream_failed"
    assert message in str(e.value)
    still_serves(daemon)


def test_a_cut_download_is_resumed_byte_exact(make_daemon, cutting_proxy, train_paths):
    proxy = cutting_proxy("train-000003.tar", cuts=2)
    d = make_daemon(gcs_config(proxy.endpoint, extra="[store]\nretries = 3\n"))
    with shardd.Client(d.socket) as c:
        got = list(c.stream("train", epoch=0, rank=0, world_size=1))
    assert proxy.cuts_left == 0, "the fault was injected"
    want = reference_samples(train_paths)
    assert {s["__key__"]: {k: v for k, v in s.items() if not k.startswith("__")} for s in got} == want


def test_a_cut_download_without_retries_fails_naming_the_shard(make_daemon, cutting_proxy):
    # Every download of the shard is cut (a prefetch and the stream's own load both fail).
    proxy = cutting_proxy("train-000003.tar", cuts=1000)
    d = make_daemon(gcs_config(proxy.endpoint, extra="[store]\nretries = 0\n"))
    with shardd.Client(d.socket) as c:
        with pytest.raises(shardd.DaemonError) as e:
            list(c.stream("train", epoch=0, rank=0, world_size=1))
    assert e.value.code == "stream_failed"
    assert str(e.value).startswith("gs://bkt/train/train-000003.tar: download failed:"), str(e.value)
    # Prefetches of other shards may still be running: once they end, nothing partial is left.
    wait_for(lambda: list((d.dir / "cache" / "tmp").iterdir()) == [], "partial files to go")
    proxy.cuts_left = 0
    still_serves(d)


@pytest.fixture
def small_disk(tmp_path):
    """A 64 KiB tmpfs: a disk that fills up for real."""
    mnt = tmp_path / "small-disk"
    mnt.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_full_disk_is_an_error_naming_the_shard(make_daemon, fake_gcs, small_disk):
    # A local shard small enough for the 64 KiB disk (local shards are copied into the cache).
    local = f'[datasets.local]\nshards = "{TESTDATA / "compressed.tar"}"\n'
    # A budget larger than the disk (the default, "auto", would fit the disk and refuse the
    # shard before writing): what a full disk does, not what the budget does.
    d = make_daemon(gcs_config(fake_gcs, extra=local), cache_dir=small_disk, cache='max_size = "100GiB"')
    with shardd.Client(d.socket) as c:
        with pytest.raises(shardd.DaemonError) as e:
            list(c.stream("train", epoch=0, rank=0, world_size=1))
    assert e.value.code == "stream_failed"
    assert "writing to the cache: No space left on device" in str(e.value)
    assert "gs://bkt/train/train-0000" in str(e.value)
    # Failed downloads leave no file behind, and other streams are served.
    wait_for(lambda: list((small_disk / "tmp").iterdir()) == [], "partial files to go")
    with shardd.Client(d.socket) as c:
        got = list(c.stream("local", epoch=0, rank=0, world_size=1))
    assert len(got) == len(reference_samples([TESTDATA / "compressed.tar"])) > 0


def test_gzip_bomb_is_refused(make_daemon, tmp_path):
    import gzip
    import io
    import tarfile

    plain = io.BytesIO()
    with tarfile.open(fileobj=plain, mode="w") as t:
        info = tarfile.TarInfo("zeros.bin")
        info.size = 4 << 20
        t.addfile(info, io.BytesIO(bytes(info.size)))
    bomb = tmp_path / "bomb.tgz"
    bomb.write_bytes(gzip.compress(plain.getvalue()))
    d = make_daemon(f'[datasets.bomb]\nshards = "{bomb}"\n', cache='max_size = "1MiB"')
    with shardd.Client(d.socket) as c:
        with pytest.raises(shardd.DaemonError) as e:
            list(c.stream("bomb", epoch=0, rank=0, world_size=1))
    assert str(e.value).startswith(
        f"{bomb}: decompresses to more than the cache can hold (cache.max_size 1048576 bytes; "
    ), str(e.value)
    assert list((d.dir / "cache" / "tmp").iterdir()) == []
    assert d.metric("shardd_cache_bytes") == 0


@pytest.mark.parametrize(
    "data, code, message",
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "bad_handshake", "not a shardd client"),
        (b"SHARDD\x08\x00", "unsupported_version", "client speaks protocol 8; this daemon speaks 1 to 7"),
        (b"SHARDD\x01\x00" + struct.pack("<IB", 1 << 30, 1), "bad_request", "over the limit of 65536"),
        (b"SHARDD\x01\x00" + struct.pack("<IB", 5, 1) + b"hello", "bad_request", "invalid request"),
        (b"SHARDD\x01\x00" + struct.pack("<IB", 2, 3) + b"{}", "bad_request", "expected a REQUEST frame"),
    ],
)
def test_garbage_gets_an_error_frame(daemon, data, code, message):
    err = error_frame(raw_exchange(daemon.socket, data))
    assert err["code"] == code
    assert message in err["message"]
    still_serves(daemon)


def test_client_vanishing_mid_stream(daemon):
    with shardd.Client(daemon.socket) as c:
        stream = c.stream("train", epoch=0, rank=0, world_size=1)
        next(stream)
        stream.close()
    wait_for(lambda: daemon.metric("shardd_streams_active") == 0, "the stream to end")
    assert daemon.metric('shardd_streams_total{dataset="train",outcome="cancelled"}') >= 1
    still_serves(daemon)


def test_abandoned_streams_free_their_slots(daemon):
    client = shardd.Client(daemon.socket)
    for _ in range(3):
        for _ in client.stream("train", epoch=0, rank=0, world_size=1):
            break  # no close(): dropping the stream must be enough
    wait_for(lambda: daemon.metric("shardd_streams_active") == 0, "abandoned streams to end")
    wait_for(lambda: daemon.metric("shardd_connections_active") == 0, "their connections to close")


def test_killed_daemon_is_an_error_then_restart_serves(daemon):
    # Reconnecting off: the cut itself is the error (tests/python/test_reconnect.py: on).
    with shardd.Client(daemon.socket, reconnect_timeout=0) as c:
        stream = c.stream("train", epoch=0, rank=0, world_size=1)
        next(stream)
        daemon.kill()
        with pytest.raises(shardd.ConnectionLostError) as e:
            list(stream)
    assert str(e.value) == f"the shardd daemon at {daemon.socket} closed the connection mid-stream"
    assert isinstance(e.value, shardd.ProtocolError) and isinstance(e.value, ConnectionError)
    daemon.start()  # replaces the stale socket file left by the killed process
    still_serves(daemon)


def test_check_lists_shards_and_rejects_bad_configs(tmp_path, fake_gcs, train_paths):
    good = tmp_path / "good.toml"
    good.write_text(gcs_config(fake_gcs))
    out = subprocess.run([SHARDD, "check", "--config", str(good)], capture_output=True, text=True)
    assert (
        "dataset train: 12 shards, first gs://bkt/train/train-000000.tar, "
        "last gs://bkt/train/train-000011.tar, shuffle_buffer 25"
    ) in out.stdout
    # check asks the store about every shard: sizes, the largest, and what is missing.
    sizes = {p.name: p.stat().st_size for p in train_paths}
    name, size = max(sizes.items(), key=lambda kv: (kv[1], -int(kv[0][6:12])))
    assert (f"dataset train: {sum(sizes.values())} bytes in the store; the largest shard is "
            f"gs://bkt/train/{name} ({size} bytes)") in out.stdout, out.stdout
    assert "dataset missing: gs://bkt/nope/gone.tar: object not found" in out.stdout
    assert "dataset missing: 1 of 2 shards cannot be read" in out.stdout
    assert out.returncode == 1 and "1 shards cannot be read (listed above)" in out.stderr
    offline = subprocess.run([SHARDD, "check", "--no-store", "--config", str(good)], capture_output=True, text=True)
    assert offline.returncode == 0, offline.stderr

    for body, message in [
        (gcs_config(fake_gcs) + "[server]\nsokcet = \"/x\"\n", "unknown field `sokcet`"),
        ('[datasets.d]\nshards = "http://x/a.tar"\n', 'unsupported scheme "http"'),
        ('[datasets.d]\nshards = "gs://b/a-{0..3.tar"\n', "unbalanced braces"),
        ("[host]\nindex = 3\ncount = 2\n[datasets.d]\nshards = \"/a.tar\"\n", "host.index 3 must be less than host.count 2"),
    ]:
        bad = tmp_path / "bad.toml"
        bad.write_text(body)
        out = subprocess.run([SHARDD, "check", "--config", str(bad)], capture_output=True, text=True)
        assert out.returncode == 1
        assert message in out.stderr, out.stderr
        assert out.stderr.startswith("shardd: error:"), out.stderr
        assert "backtrace" not in out.stderr.lower() and "panicked" not in out.stderr


def test_credentials_never_leave_the_daemon(make_daemon, s3_endpoint):
    """Secrets reach the store and nothing else: not the logs (at debug level), the error
    frames, /metrics or /status."""
    import urllib.request

    secret, key_id = "SeCrEt-do-not-log-7f3a9c", "AKIDLEAKCHECK42"
    d = make_daemon(
        f'[s3]\nendpoint = "{s3_endpoint}"\nregion = "us-east-1"\n'
        f'[datasets.gone]\nshards = ["s3://bkt3/train/train-000000.tar", "s3://bkt3/nope/missing.tar"]\n',
        env={"AWS_ACCESS_KEY_ID": key_id, "AWS_SECRET_ACCESS_KEY": secret},
    )
    with shardd.Client(d.socket) as c:
        with pytest.raises(shardd.DaemonError) as e:
            list(c.stream("gone", epoch=0, rank=0, world_size=1))
    assert "s3://bkt3/nope/missing.tar" in str(e.value)
    with urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/status", timeout=10) as r:
        status = r.read().decode()
    seen = {"error": str(e.value), "metrics": d.metrics(), "status": status, "log": d.log_path.read_text()}
    assert "GET" in seen["log"] or "stream" in seen["log"]  # the log is not empty
    for where, text in seen.items():
        assert secret not in text and key_id not in text, f"a credential in the {where}"


# -- client side: what the client raises for faults the real daemon never makes --------------


class FakeDaemon:
    """A Unix socket that plays one scripted function per accepted connection (given the
    connection), for peers that misbehave in ways the real daemon does not. ``requests``:
    the REQUEST bodies the functions read."""

    def __init__(self, path, *script):
        import socket
        import threading

        self.path, self.requests, self.failures = str(path), [], []
        self.listener = socket.socket(socket.AF_UNIX)
        self.listener.bind(self.path)
        self.listener.listen(8)
        self.thread = threading.Thread(target=self._serve, args=(script,), daemon=True)
        self.thread.start()

    def _serve(self, script):
        for play in script:
            conn, _ = self.listener.accept()
            try:
                play(self, conn)
            except OSError:
                pass  # the client went away: what the script provokes
            except BaseException as e:
                self.failures.append(e)
            finally:
                conn.close()

    def read_request(self, conn):
        head = b""
        while len(head) < 13:
            head += conn.recv(13 - len(head))
        length = struct.unpack_from("<I", head, 8)[0]
        body = b""
        while len(body) < length:
            body += conn.recv(length - len(body))
        self.requests.append(json.loads(body))

    def close(self):
        self.thread.join(10)
        self.listener.close()
        assert not self.failures, self.failures


def frame(kind, body):
    return struct.pack("<IB", len(body), kind) + body


def json_frame(kind, value):
    return frame(kind, json.dumps(value).encode())


def batch_frame(samples, url="file:///fake.tar"):
    """A BATCH body per PROTOCOL.md: ``samples`` is [(key, {field: bytes})]."""
    names = sorted({f for _, fields in samples for f in fields})
    tables = b"".join(struct.pack("<I", len(x)) + x for x in [n.encode() for n in names] + [url.encode()])
    words, payload = [], b""
    for key, fields in samples:
        words += [len(fields) << 16, len(key)]
        payload += key.encode()
        for name, data in fields.items():
            words += [names.index(name), len(data)]
            payload += data
    pieces = [len(k) for k, _ in samples] + [len(d) for _, f in samples for d in f.values()]
    offset = 24 + len(tables) + 4 * len(words)
    header = struct.pack("<6I", len(samples), len(words), len(names), 1, offset, max(pieces))
    return frame(3, header + tables + struct.pack(f"<{len(words)}I", *words) + payload)


PREAMBLE = b"SHARDD\x02\x00"
START = {"dataset": "fake", "shards": 1, "host": 0, "hosts": 1, "samples": 3, "position": 0,
         "dropped": 0, "fingerprint": "00000000000000aa"}
FAKE = [(f"k{i}", {"bin": bytes([i]) * 100, "cls": b"%d" % i}) for i in range(3)]


@pytest.fixture
def fake(tmp_path):
    made = []

    def make(*script):
        made.append(FakeDaemon(tmp_path / "fake.sock", *script))
        return made[-1]

    yield make
    for f in made:
        f.close()


def reset_after_one_sample(fake_daemon, conn):
    # The request is left unread (only waited for): closing a Unix socket with unread data
    # resets the peer.
    import socket

    conn.recv(1, socket.MSG_PEEK)
    conn.sendall(PREAMBLE + json_frame(2, START) + batch_frame(FAKE[:1]) + batch_frame(FAKE[1:])[:30])
    fake_daemon.requests.append(None)


def the_rest(fake_daemon, conn):
    fake_daemon.read_request(conn)
    conn.sendall(PREAMBLE + json_frame(2, dict(START, position=1)) + batch_frame(FAKE[1:])
                 + json_frame(4, {"samples": 2, "bytes": 206}))


def test_a_connection_reset_mid_stream_is_resumed(fake, caplog):
    f = fake(reset_after_one_sample, the_rest)
    got = list(shardd.Client(f.path).stream("fake", epoch=0, rank=0, world_size=1))
    assert [(s["__key__"], s["bin"], s["cls"]) for s in got] == [(k, v["bin"], v["cls"]) for k, v in FAKE]
    assert f.requests[1]["start"] == 1
    assert f"lost the shardd daemon at {f.path} (Connection reset by peer) at sample 1 of" in caplog.text


def test_a_connection_reset_is_a_shardd_error(fake):
    f = fake(reset_after_one_sample)
    stream = shardd.Client(f.path, reconnect_timeout=0).stream("fake", epoch=0, rank=0, world_size=1)
    assert next(stream)["__key__"] == "k0"
    with pytest.raises(shardd.ConnectionLostError) as e:
        next(stream)
    assert str(e.value) == f"the connection to the shardd daemon at {f.path} was lost (Connection reset by peer)"
    assert isinstance(e.value, ConnectionError) and stream.position == 1


def test_a_socket_path_that_cannot_be_one_is_a_shardd_error_at_once(tmp_path):
    (tmp_path / "file").write_text("")
    path = tmp_path / "file" / "shardd.sock"
    with pytest.raises(shardd.UnavailableError) as e:
        shardd.Client(path).stream("train", epoch=0, rank=0, world_size=1)  # not retried
    assert str(e.value) == f"no shardd daemon at {path} (Not a directory)"
    assert isinstance(e.value, ConnectionError)


def test_a_timeout_is_a_shardd_error(fake):
    def silent_after_start(fake_daemon, conn):
        fake_daemon.read_request(conn)
        conn.sendall(PREAMBLE + json_frame(2, START))
        conn.recv(1)  # until the client leaves

    f = fake(silent_after_start)
    # 1 s: the handshake is under the same timeout, answered by a thread of this process.
    stream = shardd.Client(f.path, timeout=1.0).stream("fake", epoch=0, rank=0, world_size=1)
    with pytest.raises(shardd.StreamTimeoutError) as e:
        next(stream)
    assert str(e.value) == (f"the shardd daemon at {f.path} sent nothing for 1 s (the timeout "
                            f"given to Client) while reading dataset 'fake' epoch 0 rank 0 of 1, "
                            f"worker 0 of 1")
    assert isinstance(e.value, TimeoutError)


@pytest.mark.parametrize("body, message", [
    (json.dumps({"code": "stream_failed", "message": "x" * (2 << 20)}).encode(),
     "sent an ERROR frame of 2097192 bytes, over the limit of 1048576 bytes for one; it begins "
     "b'{\"code\": \"stream_failed\", \"message\": \"" + "x" * 162 + "'"),
    (b"<html>oops</html>",
     "sent an ERROR frame that is not JSON (Expecting value: line 1 column 1 (char 0)): b'<html>oops</html>'"),
], ids=["2MiB", "not-json"])
def test_a_bad_error_frame_says_what_happened(fake, body, message):
    def error(fake_daemon, conn):
        fake_daemon.read_request(conn)
        conn.sendall(PREAMBLE + frame(5, body))

    f = fake(error)
    with pytest.raises(shardd.ProtocolError) as e:
        shardd.Client(f.path).stream("fake", epoch=0, rank=0, world_size=1)
    assert str(e.value) == f"the daemon at {f.path} {message}"


def broken_batch(how):
    """A BATCH frame of FAKE (one of its samples' fields made large, for the client's path of
    large pieces, with ``direct``) broken as ``how`` says."""
    samples = FAKE if how != "direct" else [("k0", {"bin": bytes(70_000), "cls": b"0"})]
    body = bytearray(batch_frame(samples)[5:])
    n, n_words, n_names, n_urls, offset, _ = struct.unpack_from("<6I", body)
    words_at = offset - 4 * n_words
    if how == "name":  # the first field's name index, past the names table
        struct.pack_into("<I", body, words_at + 8, 7)
    elif how == "url":  # the first sample's URL index, past the URLs table
        struct.pack_into("<I", body, words_at, 2 << 16 | 3)
    elif how == "table":  # a name that is not UTF-8
        body[28] = 0xFF
    elif how == "offset":  # the payload offset past the frame
        struct.pack_into("<I", body, 16, len(body) + 1)
    elif how == "key":  # the first key not UTF-8
        body[offset] = 0xFF
    elif how == "direct":  # a piece longer than the payload holds
        struct.pack_into("<I", body, words_at + 12, 70_001)
    return frame(3, bytes(body))


@pytest.mark.parametrize("how, why", [
    ("name", "a batch names a field or URL its tables do not have"),  # either decoder
    ("url", "a batch names a field or URL its tables do not have"),
    ("table", "'utf-8' codec can't decode byte 0xff in position 0"),
    ("offset", "its payload offset 440 is outside its 439 bytes"),
    ("key", "'utf-8' codec can't decode byte 0xff in position 0"),
    ("direct", "its pieces add up to 70004 bytes, its payload is 70003"),
])
def test_a_batch_that_does_not_add_up_is_a_protocol_error(fake, how, why):
    """Whatever a broken batch gets wrong, the trainer gets a ProtocolError that says so, not
    an IndexError or a UnicodeDecodeError from inside the client (both decoders:
    test_decode.py)."""
    def send(fake_daemon, conn):
        import socket

        fake_daemon.read_request(conn)
        conn.sendall(PREAMBLE + json_frame(2, START) + broken_batch(how)
                     + json_frame(4, {"samples": 3, "bytes": 0}))
        # Nothing more: a client that read past the frame gets to the end, not a wait.
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)  # until the client leaves

    f = fake(send)
    stream = shardd.Client(f.path, reconnect_timeout=0).stream("fake", epoch=0, rank=0,
                                                               world_size=1)
    with pytest.raises(shardd.ProtocolError) as e:
        next(stream)
    assert str(e.value).startswith(f"the daemon at {f.path} sent a malformed batch: ")
    assert why in str(e.value)
    stream.close()
