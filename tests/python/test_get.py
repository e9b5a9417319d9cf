"""`shardd get` (issue 26): webdataset's own `pipe:` reading through the host daemon's cache,
byte-equal to the shards, one store GET per shard however many processes ask, within the
cache's budget; unknown shards refused; a restarting daemon waited for."""

import json
import struct
import subprocess
import threading

import webdataset as wds

from conftest import (
    BUCKET, SHARDD, TRAIN_SHARDS, bytes_on_disk, error_frame, gcs_config, raw_exchange,
    reference_samples, wait_for,
)

RECORD = 4096  # the cache's per-entry allowance (test_cache.py)


def url(i):
    return f"gs://{BUCKET}/train/train-{i:06d}.tar"


def gets(d):
    return d.metric('shardd_store_requests_total{kind="get"}')


def get(d, *urls, stdout=subprocess.PIPE):
    return subprocess.run([SHARDD, "get", "--socket", str(d.socket), *urls], stdout=stdout,
                          stderr=subprocess.PIPE, timeout=60)


def test_webdataset_pipe_reads_exactly_the_shards(make_daemon, fake_gcs, train_paths):
    d = make_daemon(gcs_config(fake_gcs))
    pipes = [f"pipe:{SHARDD} get --socket {d.socket} {url(i)}" for i in range(TRAIN_SHARDS)]
    got = [(s["__key__"], {k: v for k, v in s.items() if not k.startswith("__")})
           for s in wds.WebDataset(pipes, shardshuffle=False, empty_check=False)]
    want = reference_samples(train_paths)
    assert [k for k, _ in got] == list(want), "not webdataset's samples in tar order"
    assert dict(got) == want
    # Byte-equal, to a pipe and to a file (sendfile into each), several shards in one call.
    out = get(d, url(0), url(3))
    assert out.returncode == 0, out.stderr
    assert out.stdout == train_paths[0].read_bytes() + train_paths[3].read_bytes()
    with open(d.dir / "copy.tar", "wb") as f:
        assert get(d, url(5), stdout=f).returncode == 0
    assert (d.dir / "copy.tar").read_bytes() == train_paths[5].read_bytes()
    assert gets(d) == TRAIN_SHARDS, "a shard fetched twice"


def test_eight_processes_on_one_host_cost_one_store_get_per_shard(make_daemon, fake_gcs, train_paths):
    d = make_daemon(gcs_config(fake_gcs))
    urls = [url(i) for i in range(TRAIN_SHARDS)]
    procs = [subprocess.Popen([SHARDD, "get", "--socket", str(d.socket), *urls],
                              stdout=open(d.dir / f"out{p}", "wb"), stderr=subprocess.PIPE)
             for p in range(8)]
    for p in procs:
        assert p.wait(timeout=60) == 0, p.stderr.read()
    whole = b"".join(p.read_bytes() for p in train_paths)
    for p in range(8):
        assert (d.dir / f"out{p}").read_bytes() == whole
    assert gets(d) == TRAIN_SHARDS
    # A later epoch reads the local disk only.
    assert get(d, *urls).stdout == whole
    assert gets(d) == TRAIN_SHARDS
    # Counted when the descriptor is handed over, before the END the command reads.
    assert d.metric('shardd_gets_total{outcome="served"}') == 9 * TRAIN_SHARDS
    assert d.metric("shardd_get_bytes_total") == 9 * len(whole)


def test_the_cache_stays_within_its_budget(make_daemon, fake_gcs, train_paths):
    share = sum(p.stat().st_size + RECORD for p in train_paths)
    budget = int(share * 0.4)
    d = make_daemon(gcs_config(fake_gcs), cache=f'max_size = "{budget}"')
    peak, done = [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], bytes_on_disk(d.dir / "cache"))
            done.wait(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        for _ in range(2):
            out = get(d, *[url(i) for i in range(TRAIN_SHARDS)])
            assert out.returncode == 0, out.stderr
            assert out.stdout == b"".join(p.read_bytes() for p in train_paths)
    finally:
        done.set()
        sampler.join()
    assert 0 < peak[0] <= budget, (peak[0], budget)


def test_only_configured_shards_are_served(make_daemon, fake_gcs, train_paths):
    d = make_daemon(gcs_config(fake_gcs))
    for bad in [f"gs://{BUCKET}/train/secret.tar", "/etc/passwd", "gs://bkt/train/train-000000.tar.gz"]:
        out = get(d, bad)
        assert out.returncode == 1 and out.stdout == b""
        assert out.stderr.decode().splitlines() == [
            f'shardd: error: "{bad}" is not a shard of any dataset this daemon serves '
            "(big, empty, missing, mixed, notatar, train, truncated): shardd get serves only the "
            "shards of configured datasets, named as their `shards` expand (unknown_shard)"
        ], out.stderr
    # A shard the store cannot give is that shard's error, and the daemon serves on.
    out = get(d, f"gs://{BUCKET}/nope/gone.tar")
    assert out.returncode == 1 and "gone.tar" in out.stderr.decode() and "(stream_failed)" in out.stderr.decode()
    before = gets(d)
    assert get(d, url(1)).stdout == train_paths[1].read_bytes()
    assert gets(d) == before + 1
    assert d.metric('shardd_gets_total{outcome="served"}') == 1
    assert d.metric('shardd_gets_total{outcome="refused"}') == 4


def test_a_daemon_that_is_away_is_waited_for(make_daemon, fake_gcs, train_paths):
    d = make_daemon(gcs_config(fake_gcs))
    d.stop()
    p = subprocess.Popen([SHARDD, "get", "--socket", str(d.socket), url(2)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    err = p.stderr.readline().decode()
    assert err.startswith(f"shardd get: waiting for the daemon at {d.socket}: "), err
    d.start()
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 0 and out == train_paths[2].read_bytes()
    # Without a daemon, --wait bounds the wait.
    d.stop()
    out = subprocess.run([SHARDD, "get", "--socket", str(d.socket), "--wait", "0.5", url(2)],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 1
    assert (f"the daemon at {d.socket} did not serve {url(2)} within 500ms (--wait); is it running, "
            "and is that its server.socket? (--socket or SHARDD_SOCKET name another)") in out.stderr, out.stderr


def test_a_malformed_get_is_refused_and_the_daemon_serves_on(make_daemon, fake_gcs, train_paths):
    d = make_daemon(gcs_config(fake_gcs))
    cases = [
        ({"op": "get"}, "invalid request: missing field `url`"),
        ({"op": "get", "url": url(0), "dataset": "train"}, "invalid request: unknown field `dataset`"),
        ({"op": "get", "url": 7}, "invalid request: invalid type: integer `7`"),
    ]
    for body, message in cases:
        raw = json.dumps(body).encode()
        err = error_frame(raw_exchange(d.socket, b"SHARDD\x06\x00" + struct.pack("<IB", len(raw), 1) + raw))
        assert err["code"] == "bad_request" and err["message"].startswith(message), err
    assert get(d, url(4)).stdout == train_paths[4].read_bytes()


def test_the_shard_stays_pinned_until_its_copy_is_done(make_daemon, fake_gcs, shard_dir):
    """A consumer that has not read the shard yet (a webdataset pipe is read as the tar is
    parsed) keeps it pinned: the daemon does not evict a file that is still being copied,
    so its blocks never sit on disk beside the budget."""
    d = make_daemon(gcs_config(fake_gcs))
    big = shard_dir / BUCKET / "big" / "big-0.tar"  # 8 MiB: far more than a pipe holds
    p = subprocess.Popen([SHARDD, "get", "--socket", str(d.socket), f"gs://{BUCKET}/big/big-0.tar"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: d.metric("shardd_cache_pinned_bytes") > 0, "the shard to be pinned")
        first = p.stdout.read(1 << 16)  # the copy is under way, stuck on the full pipe
        assert d.metric("shardd_cache_pinned_bytes") >= big.stat().st_size
        rest = p.stdout.read()
        assert p.wait(timeout=60) == 0, p.stderr.read()
    finally:
        p.kill()
    assert first + rest == big.read_bytes()
    wait_for(lambda: d.metric("shardd_cache_pinned_bytes") == 0, "the pin to go once the copy is done")


def test_a_reader_that_stops_early_ends_it_as_sigpipe_would(make_daemon, fake_gcs, shard_dir):
    """webdataset closing a pipe mid-shard: `shardd get` exits 141 (what a shell reports for
    a command killed by SIGPIPE, as cat or gsutil cat are), which webdataset's pipe: ignores,
    and says nothing."""
    d = make_daemon(gcs_config(fake_gcs))
    p = subprocess.Popen([SHARDD, "get", "--socket", str(d.socket), f"gs://{BUCKET}/big/big-0.tar"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert len(p.stdout.read(1000)) == 1000
    p.stdout.close()
    assert p.wait(timeout=60) == 141
    assert p.stderr.read() == b""
    wait_for(lambda: d.metric("shardd_cache_pinned_bytes") == 0, "the pin to go")
