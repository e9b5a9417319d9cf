"""A bucket that pushes back, as a pod's hosts meet it: throttling (429 past a bucket-wide
request rate), outages (503, and a store that accepts requests and never answers), and a
host's own ceiling. Several daemons, each host i of the pod with its own port on the bucket
emulator (tests/python/bucket_emulator.py, in front of fake-gcs-server), each trainer reading
its rank through the Python client.

What must hold (docs/data-contract.md, "A store that pushes back"): no trainer dies of a 429,
a 503 or a timeout while the store comes back within ``store.retry_timeout``; every sample
arrives once, byte-equal to webdataset; a store still down after it fails the stream with a
message that names the cause and the time waited, and the next request tries again. Each
test first shows that its event landed while a stream was open.
"""

import re
import subprocess
import threading
import time

import pytest
import shardd

from bucket_emulator import make_token
from conftest import BUCKET, SHARDD, TRAIN_SHARDS, gcs_config, reference_samples, wait_for
from test_credentials import SHARDS, Metadata, no_credentials_env, write_config

HOSTS = 4


def start_pod(make_daemon, emu, hosts=HOSTS, store=""):
    """One daemon per host of the pod, each on its own port of the bucket."""
    return [
        make_daemon(
            gcs_config(emu.endpoint(i), host_index=i, host_count=hosts, extra=f"[store]\n{store}\n"),
            name=f"host{i}",
        )
        for i in range(hosts)
    ]


class Trainers:
    """One trainer thread per host reading its rank of epoch 0; what each read, or the error
    that ended it."""

    def __init__(self, daemons):
        self.samples = [[] for _ in daemons]
        self.errors = [None] * len(daemons)
        self.threads = [
            threading.Thread(target=self.read, args=(i, d), daemon=True) for i, d in enumerate(daemons)
        ]
        for t in self.threads:
            t.start()

    def read(self, rank, daemon):
        try:
            with shardd.Client(daemon.socket) as c:
                for s in c.stream("train", epoch=0, rank=rank, world_size=len(self.samples)):
                    self.samples[rank].append(s)
        except Exception as e:  # the test asserts there was none, naming it
            self.errors[rank] = e

    def join(self, timeout=120):
        for t in self.threads:
            t.join(timeout)
            assert not t.is_alive(), "a trainer is still reading"
        return self


def assert_every_sample_once(trainers, train_paths):
    assert trainers.errors == [None] * len(trainers.errors), "a trainer died of the data path"
    got = [s for rank in trainers.samples for s in rank]
    keys = [s["__key__"] for s in got]
    assert len(keys) == len(set(keys)), "a sample arrived twice"
    want = reference_samples(train_paths)
    assert {s["__key__"]: {k: v for k, v in s.items() if not k.startswith("__")} for s in got} == want


def outcomes(d, scrape=None):
    return {
        o: d.metric(f'shardd_store_requests_total{{outcome="{o}"}}', scrape)
        for o in ("ok", "throttled", "unavailable", "timeout", "error")
    }


def streams_open(d):
    return d.metric("shardd_streams_active") >= 1


def test_a_throttling_bucket_slows_the_pod_down_and_kills_no_trainer(make_daemon, bucket_emulator, train_paths):
    emu = bucket_emulator(hosts=HOSTS, latency=0.02)
    daemons = start_pod(make_daemon, emu)
    # The pod's cold start asks for every host's share at once: far past 8 requests/s.
    emu.set_rate_limit(8, burst=1)
    trainers = Trainers(daemons).join()
    assert_every_sample_once(trainers, train_paths)

    stats = emu.stats()
    assert stats["totals"]["throttled"] > 0, "the bucket throttled the pod"
    # Each daemon counts what its port of the bucket answered, request by request.
    for i, d in enumerate(daemons):
        host = stats["hosts"][i]
        wait_for(
            lambda: (outcomes(d)["ok"], outcomes(d)["throttled"]) == (host["ok"], host["throttled"]),
            f"host {i}'s counts to match the bucket's {host}",
        )
    throttled_hosts = [d for d in daemons if outcomes(d)["throttled"] > 0]
    # A host that was throttled holds itself to a rate now, and retried: it did not fail.
    for d in throttled_hosts:
        assert d.metric("shardd_store_request_rate_limit") > 0
        assert d.metric('shardd_store_errors_total{kind="pushback"}') == 0
    # No retry storm: before pacing, a bucket at a quarter of the demand answered 3.7 429s
    # for each request it served; a host that slows down sends far fewer.
    assert stats["totals"]["throttled"] <= stats["totals"]["ok"], stats["totals"]


def test_a_hosts_ceiling_bounds_its_request_rate(make_daemon, bucket_emulator, train_paths):
    emu = bucket_emulator(hosts=2)
    daemons = start_pod(make_daemon, emu, hosts=2, store="max_requests_per_second = 5")
    trainers = Trainers(daemons).join()
    assert_every_sample_once(trainers, train_paths)
    stats = emu.stats()
    for i, d in enumerate(daemons):
        host = stats["hosts"][i]
        sent = host["requests"]
        span = host["last_request_at"] - host["first_request_at"]
        # A token bucket of 5 requests/s holds at most one token at a time: in any span, at
        # most one request more than the rate allows (whatever the machine's load).
        assert sent <= 5 * span + 1, (sent, span)
        assert sent > 1
        assert d.metric("shardd_store_request_rate_limit") == 5


def test_an_outage_shorter_than_retry_timeout_is_invisible_to_the_trainers(make_daemon, bucket_emulator, train_paths):
    emu = bucket_emulator(hosts=HOSTS)
    daemons = start_pod(make_daemon, emu, store='retry_timeout = "60s"')
    emu.outage("503")
    trainers = Trainers(daemons)
    # The outage lands: every host's stream is open and waits while its requests get 503s.
    for i, d in enumerate(daemons):
        wait_for(lambda: streams_open(d) and outcomes(d)["unavailable"] >= 2, f"host {i} to meet the outage")
        status = d.status()
        [store] = status["stores"]
        assert store["last_pushback"] == "unavailable", store
        assert [s["waiting_on"] for s in status["streams"]] == ["data"], status["streams"]
    assert all(t.is_alive() for t in trainers.threads), trainers.errors
    emu.outage(None)
    trainers.join()
    assert_every_sample_once(trainers, train_paths)
    for d in daemons:
        assert d.metric('shardd_store_wait_seconds_total{reason="backoff"}') > 0
        assert d.metric('shardd_store_errors_total{kind="pushback"}') == 0


def test_an_outage_that_outlives_the_hosts_token_is_invisible_too(make_daemon, bucket_emulator, train_paths, tmp_path):
    """The host's credentials are the metadata server's tokens, which the bucket takes for
    2 s; the bucket is down (503) for longer. A retry carries a token that is still good, not
    the one its request was signed with: when the bucket is back no request is refused for
    its credentials, and the trainer reads its whole stream."""
    ttl, secret = 2, "pushback-token"
    emu = bucket_emulator(hosts=1, token_secret=secret)
    metadata = Metadata(200, token=lambda: (make_token(secret, "0", ttl), ttl))
    try:
        body = gcs_config(emu.endpoint(0), extra='[store]\nretry_timeout = "60s"\n')
        d = make_daemon(body.replace("anonymous = true\n", ""), env=no_credentials_env(tmp_path, metadata.address))
        emu.outage("503")
        began = time.monotonic()
        trainers = Trainers([d])
        # The outage lands, and outlives the token the stream's first request carried (every
        # token handed out before the outage began has expired too).
        wait_for(lambda: streams_open(d) and outcomes(d)["unavailable"] >= 2
                 and time.monotonic() - began > ttl + 0.5, "the outage to outlive a token")
        assert trainers.threads[0].is_alive(), trainers.errors
        emu.outage(None)
        trainers.join()
        assert_every_sample_once(trainers, train_paths)
        assert emu.stats()["totals"]["unauthorized"] == 0, emu.stats()["totals"]
        assert outcomes(d)["error"] == 0
    finally:
        metadata.close()


def test_a_command_that_meets_pushback_says_so_at_once_and_waits_it_out(bucket_emulator, tmp_path):
    """`shardd check` against a bucket that is down: a warning names the bucket and what it
    answered within seconds (not silence for `store.retry_timeout`), and once the bucket is
    back the check goes on and passes."""
    emu = bucket_emulator(hosts=1)
    config = write_config(tmp_path, f'[gcs]\nendpoint = "{emu.endpoint(0)}"\nanonymous = true\n'
                                    f'[store]\nretry_timeout = "60s"\n[datasets.train]\nshards = {SHARDS}\n')
    emu.outage("503")
    log = tmp_path / "check.log"
    with open(log, "w") as sink:
        check = subprocess.Popen([SHARDD, "check", "--config", str(config)], stdout=sink, stderr=subprocess.STDOUT)
    try:
        line = wait_for(lambda: next((l for l in log.read_text().splitlines() if " WARN " in l), None),
                        "the warning", timeout=10)
        assert line.endswith(f"gs://{BUCKET} answered 503 Service Unavailable: retrying for up to "
                             "store.retry_timeout = 60s"), line
        assert check.poll() is None, log.read_text()
        emu.outage(None)
        assert check.wait(timeout=60) == 0, log.read_text()
    finally:
        check.kill()
        check.wait()
    assert f"dataset train: {TRAIN_SHARDS} shards" in log.read_text()


def test_a_store_that_never_answers_is_waited_out_too(make_daemon, bucket_emulator, train_paths):
    emu = bucket_emulator(hosts=2)
    daemons = start_pod(make_daemon, emu, hosts=2, store='read_timeout = "1s"\nretry_timeout = "60s"')
    emu.outage("hang")
    trainers = Trainers(daemons)
    for i, d in enumerate(daemons):
        wait_for(lambda: streams_open(d) and outcomes(d)["timeout"] >= 1, f"host {i} to time out")
    emu.outage(None)
    trainers.join()
    assert_every_sample_once(trainers, train_paths)


def test_a_store_down_longer_than_retry_timeout_fails_the_stream_naming_why_and_the_next_request_tries_again(
    make_daemon, bucket_emulator, train_paths
):
    emu = bucket_emulator(hosts=1)
    [d] = start_pod(make_daemon, emu, hosts=1, store='retry_timeout = "2s"')
    emu.outage("503")
    with shardd.Client(d.socket) as c:
        with pytest.raises(shardd.DaemonError) as e:
            list(c.stream("train", epoch=0, rank=0, world_size=1))
    assert e.value.code == "stream_failed"
    message = str(e.value)
    assert re.fullmatch(
        r"gs://bkt/train/train-\d{6}\.tar: download failed: the store answered 503 Service Unavailable "
        r"for 2\.\ds \(\d+ attempts; store\.retry_timeout = 2s\)",
        message,
    ), message
    attempts = int(re.search(r"\((\d+) attempts", message).group(1))
    assert attempts >= 3, "retried with backoff until the time ran out"
    assert d.metric('shardd_store_errors_total{kind="pushback"}') >= 1
    # Nothing was cached of the failed shards; once the store is back, the same request reads
    # everything.
    emu.outage(None)
    trainers = Trainers([d]).join()
    assert_every_sample_once(trainers, train_paths)


def test_a_cold_epoch_asks_the_bucket_once_per_shard(make_daemon, bucket_emulator, train_paths):
    """No HEAD before the GETs: the first part's answer carries the version (size, ETag,
    generation). Each of these shards is one part, so one request each. (Each dataset's
    first shard is also asked for by /readyz and the start-up check, at times of their own:
    left out.)"""
    emu = bucket_emulator(hosts=1)
    [d] = start_pod(make_daemon, emu, hosts=1)
    before = emu.stats(objects=True)["hosts"][0]["objects"]
    trainers = Trainers([d]).join()
    assert_every_sample_once(trainers, train_paths)
    after = emu.stats(objects=True)["hosts"][0]["objects"]
    asked = {name: n - before.get(name, 0) for name, n in after.items()
             if name.startswith("bkt/train/") and not name.endswith("-000000.tar")}
    assert asked == {f"bkt/train/{p.name}": 1 for p in train_paths[1:]}
