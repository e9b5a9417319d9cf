"""End to end: shards in a real GCS endpoint, several daemons (one per simulated host), every
stream read through the real Python client, compared with what webdataset reads."""

import collections
import subprocess
import time

import pytest
import shardd

from conftest import (
    BIG_SHARDS, BUCKET, S3_ENV, SHARDD, TESTDATA, TRAIN_SHARDS, big_payload, gcs_config,
    reference_samples, wait_for,
)


def read_stream(socket, dataset="train", zero_copy=False, **kw):
    with shardd.Client(socket, zero_copy=zero_copy) as client:
        return list(client.stream(dataset, **kw))


def read_epoch(daemons, world_size, num_workers, epoch=0, seed=0, zero_copy=False):
    """Every stream of every rank of every host: {(rank, worker): [samples]}."""
    per_host = world_size // len(daemons)
    streams = {}
    for h, d in enumerate(daemons):
        for rank in range(h * per_host, (h + 1) * per_host):
            for worker in range(num_workers):
                streams[rank, worker] = read_stream(
                    d.socket, epoch=epoch, rank=rank, world_size=world_size,
                    worker=worker, num_workers=num_workers, seed=seed, zero_copy=zero_copy,
                )
    return streams


def as_reference(samples):
    return {s["__key__"]: {k: v for k, v in s.items() if not k.startswith("__")} for s in samples}


def keys(streams):
    return {k: [s["__key__"] for s in v] for k, v in streams.items()}


@pytest.fixture
def two_hosts(make_daemon, fake_gcs):
    return [
        make_daemon(gcs_config(fake_gcs, host_index=h, host_count=2), name=f"host{h}")
        for h in range(2)
    ]


def test_multi_host_epoch_equals_webdataset(two_hosts, train_paths, delivery):
    streams = read_epoch(two_hosts, world_size=4, num_workers=2, zero_copy=delivery)
    samples = [s for ss in streams.values() for s in ss]
    counts = collections.Counter(s["__key__"] for s in samples)
    assert [k for k, n in counts.items() if n != 1] == [], "samples served more than once"

    want = reference_samples(train_paths)
    assert as_reference(samples) == want  # same keys, same fields, same bytes
    assert len(samples) == len(want)
    # __url__ names the object the sample came from.
    shard_of = {}
    for path in train_paths:
        for key in reference_samples([path]):
            shard_of[key] = f"gs://{BUCKET}/train/{path.name}"
    assert all(s["__url__"] == shard_of[s["__key__"]] for s in samples)
    # A stream's samples are shuffled, not in tar order.
    longest = max(streams.values(), key=len)
    assert [s["__key__"] for s in longest] != sorted(s["__key__"] for s in longest)


def test_s3_epoch_equals_webdataset(make_daemon, s3_endpoint, train_paths):
    d = make_daemon(
        f'[s3]\nendpoint = "{s3_endpoint}"\nregion = "us-east-1"\n'
        f'[datasets.train]\nshards = "s3://bkt3/train/train-{{000000..{TRAIN_SHARDS - 1:06d}}}.tar"\n',
        env=S3_ENV,
    )
    samples = [s for ss in read_epoch([d], world_size=2, num_workers=2).values() for s in ss]
    assert len(samples) == len(reference_samples(train_paths))
    assert as_reference(samples) == reference_samples(train_paths)
    assert all(s["__url__"].startswith("s3://bkt3/train/train-") for s in samples)


def test_same_inputs_same_order_other_epoch_other_order(two_hosts, delivery):
    first = keys(read_epoch(two_hosts, world_size=4, num_workers=2, epoch=3, seed=7,
                            zero_copy=delivery))
    again = keys(read_epoch(two_hosts, world_size=4, num_workers=2, epoch=3, seed=7))
    assert first == again
    assert keys(read_epoch(two_hosts, world_size=4, num_workers=2, epoch=4, seed=7)) != first
    assert keys(read_epoch(two_hosts, world_size=4, num_workers=2, epoch=3, seed=8)) != first


def test_host_keeps_its_shards_across_epochs(two_hosts, train_paths):
    def host_urls(epoch):
        streams = read_epoch(two_hosts, world_size=4, num_workers=1, epoch=epoch)
        return [
            {s["__url__"] for r in (2 * h, 2 * h + 1) for s in streams[r, 0]} for h in range(2)
        ]

    first = host_urls(0)
    # 12 shards, 2 hosts, no leftovers: each host reads 6, together every shard once.
    assert [len(urls) for urls in first] == [TRAIN_SHARDS // 2] * 2
    assert first[0] | first[1] == {f"gs://{BUCKET}/train/{p.name}" for p in train_paths}
    assert host_urls(1) == first


@pytest.mark.parametrize("timeout", [None, 60.0], ids=["direct-receive", "buffered"])
def test_large_and_small_fields_both_read_paths(make_daemon, fake_gcs, shard_dir, timeout, delivery):
    d = make_daemon(gcs_config(fake_gcs))
    with shardd.Client(d.socket, timeout=timeout, zero_copy=delivery) as c:
        got = list(c.stream("mixed", epoch=1, rank=0, world_size=1))
    want = reference_samples(sorted((shard_dir / BUCKET / "mixed").glob("*.tar")))
    assert len(got) == len(want) == 36
    assert as_reference(got) == want
    assert max(len(s["big.bin"]) for s in got) == 1_500_000
    assert max(len(s["__key__"]) for s in got) > 70_000


def test_webdataset_project_shards(make_daemon, delivery):
    """The webdataset project's own test shards (a directory member, msgpack, tensors,
    hash-like keys, a gzipped .tgz) read as webdataset reads them."""
    names = ["compressed.tar", "mpdata.tar", "tendata.tar", "testgz.tar", "sample.tgz"]
    body = "".join(
        f'[datasets.d{i}]\nshards = "{TESTDATA / n}"\nshuffle_buffer = 64\n' for i, n in enumerate(names)
    )
    d = make_daemon(body)
    for i, name in enumerate(names):
        got = read_stream(d.socket, dataset=f"d{i}", epoch=0, rank=0, world_size=1,
                          zero_copy=delivery)
        assert as_reference(got) == reference_samples([TESTDATA / name]), name
        assert len(got) == len(reference_samples([TESTDATA / name]))
        assert {s["__url__"] for s in got} == {str(TESTDATA / name)}


def test_cat_prints_key_and_field_sizes(two_hosts, train_paths):
    out = subprocess.run(
        [SHARDD, "cat", "--socket", str(two_hosts[0].socket), "--dataset", "train",
         "--rank", "1", "--world-size", "4", "--epoch", "2", "--limit", "5"],
        capture_output=True, text=True, check=True,
    )
    lines = out.stdout.splitlines()
    want = read_stream(two_hosts[0].socket, epoch=2, rank=1, world_size=4)[:5]
    assert lines == [
        " ".join([s["__key__"]] + [f"{k}={len(v)}" for k, v in s.items() if not k.startswith("__")])
        for s in want
    ]
    assert "5 samples" in out.stderr


class Trickle:
    """A client socket that takes at most ``chunk`` bytes per receive, one receive per
    ``pause`` seconds: a slow reader that never stops taking bytes."""

    def __init__(self, sock, chunk, pause):
        self.sock, self.chunk, self.pause = sock, chunk, pause

    def recv_into(self, buf, nbytes=0, flags=0):
        time.sleep(self.pause)  # the reader's pace under test
        return self.sock.recv_into(memoryview(buf)[: self.chunk])

    def recv(self, n, flags=0):
        time.sleep(self.pause)
        return self.sock.recv(min(n, self.chunk))

    def close(self):
        self.sock.close()


def test_a_slow_steady_reader_is_never_parked(make_daemon, fake_gcs, shard_dir):
    """A reader that takes each 8 MB batch in longer than server.stall_timeout, but keeps
    taking bytes, is served without a park and gets the uninterrupted stream."""
    d = make_daemon(gcs_config(fake_gcs), server='stall_timeout = "2s"')
    want = read_stream(d.socket, dataset="big", epoch=0, rank=0, world_size=1)
    # readahead=0: the test swaps the socket under the stream, which its thread would be reading.
    with shardd.Client(d.socket, readahead=0) as c:
        stream = c.stream("big", epoch=0, rank=0, world_size=1)
        fast = stream._frames.sock
        # 64 KiB per 20 ms (~3 MB/s): an 8 MB batch takes ~2.6 s, more than the stall timeout,
        # while the longest gap between two receives is 20 ms (100 times less than it, so a
        # loaded runner's late wake-ups do not look like a stalled reader).
        stream._frames.sock = Trickle(fast, 64 << 10, 0.02)
        slow = [next(stream), next(stream)]
        stream._frames.sock = fast
        got = slow + list(stream)
    assert [(s["__key__"], s["bin"]) for s in got] == [(s["__key__"], s["bin"]) for s in want]
    assert d.metric("shardd_stream_parks_total") == 0


def test_a_reader_that_pauses_holds_three_shards_then_none_and_goes_on(make_daemon, fake_gcs, shard_dir):
    """A stream whose client stops reading pins only the shard it is sending, the next
    window's (one shard here) and the one loading after it; the prefetcher loads
    prefetch_shards more and stops. After server.stall_timeout without a byte taken the
    stream parks: it holds no shard. Paused for two stall timeouts, then read again, the
    same stream goes on where it was: the samples of an uninterrupted read, in its order."""
    d = make_daemon(
        # 5 s: the last shards' fetches start about when the stream blocks, and must be in
        # before it parks, even from a debug daemon on a busy machine.
        gcs_config(fake_gcs), server='stall_timeout = "5s"', cache="prefetch_shards = 2",
    )
    charge = (shard_dir / BUCKET / "big" / "big-0.tar").stat().st_size + 8192
    # readahead=0: the shards pinned depend on exactly what the client received (a read-ahead
    # thread takes one more batch: test_readahead.py has the pause with read-ahead).
    with shardd.Client(d.socket, readahead=0) as c:
        stream = c.stream("big", epoch=0, rank=0, world_size=1)
        first = next(stream)
        # The daemon is now blocked writing the second shard's sample to a socket nobody
        # reads: shards 1 (sending), 2 (the next window) and 3 (loading next) pinned, and
        # prefetch_shards = 2 ahead of what the stream has received (shards 3 and 4): 5 fetched.
        wait_for(
            lambda: d.metric("shardd_cache_resident_bytes") >= 5 * charge
            and d.metric("shardd_cache_bytes") == d.metric("shardd_cache_resident_bytes")
            and d.metric("shardd_cache_pinned_bytes") == 3 * charge,
            "prefetching to settle",
        )
        assert d.metric("shardd_shard_fetches_total") == 5
        assert d.metric("shardd_cache_resident_bytes") == 5 * charge
        wait_for(lambda: d.metric("shardd_streams_parked") == 1, "the stream to park")
        assert d.metric("shardd_cache_pinned_bytes") == 0
        (parked,) = d.status()["streams"]
        assert parked["waiting_on"] == "parked" and parked["position"] >= 1
        time.sleep(5)  # the pause under test (one more stall timeout), not a synchronisation
        assert d.metric("shardd_streams_parked") == 1
        assert d.metric("shardd_cache_pinned_bytes") == 0
        reads = d.metric("shardd_cache_hits_total") + d.metric("shardd_cache_misses_total")
        rest = list(stream)
        # No manifest, but the stream counted the samples of the shards it read: it goes on
        # from its position (one sample per shard, shuffle_buffer 1) without reading them again.
        resumed = d.metric("shardd_cache_hits_total") + d.metric("shardd_cache_misses_total") - reads
        assert resumed == BIG_SHARDS - parked["position"]
        assert stream.end == {"samples": BIG_SHARDS, "bytes": stream.end["bytes"]}
    assert d.metric("shardd_streams_parked") == 0
    assert d.metric("shardd_stream_parks_total") == 1
    # The same stream read without a pause: the same samples in the same order, byte for byte.
    samples = read_stream(d.socket, dataset="big", epoch=0, rank=0, world_size=1)
    assert [(s["__key__"], s["bin"]) for s in [first] + rest] == [(s["__key__"], s["bin"]) for s in samples]
    assert sorted((s["__key__"], s["bin"]) for s in samples) == [
        (f"big{i}", big_payload(i)) for i in range(BIG_SHARDS)
    ]
    assert d.metric("shardd_shard_fetches_total") == BIG_SHARDS
