"""Exact epochs: a manifest made by `shardd index`, equal streams on every rank and worker of
every host, rotating drops, exact resume, plan fingerprints, protocol 1 clients still served."""

import collections
import json
import random
import re
import struct
import subprocess

import pytest
import shardd
import shardd.client

from conftest import BUCKET, SHARDD, TRAIN_SHARDS, gcs_config, raw_exchange, reference_samples

TRAIN = f"gs://{BUCKET}/train/train-{{000000..{TRAIN_SHARDS - 1:06d}}}.tar"


@pytest.fixture
def manifest(fake_gcs, tmp_path):
    """`shardd index` of the train shards, through the real GCS endpoint."""
    config = tmp_path / "store.toml"
    config.write_text(f'[gcs]\nendpoint = "{fake_gcs}"\nanonymous = true\n')
    out = tmp_path / "train.manifest.json"
    run = subprocess.run([SHARDD, "index", TRAIN, "-o", str(out), "--config", str(config)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert f"{TRAIN_SHARDS} shards" in run.stderr and "(0 entries reused)" in run.stderr, run.stderr
    again = subprocess.run([SHARDD, "index", TRAIN, "-o", str(out), "--config", str(config)],
                           capture_output=True, text=True)
    assert again.returncode == 0 and f"({TRAIN_SHARDS} entries reused)" in again.stderr, again.stderr
    return out


def exact_config(fake_gcs, manifest, host_index=0, host_count=1, extra=""):
    return gcs_config(fake_gcs, host_index, host_count) + (
        f'[datasets.exact]\nshards = "{TRAIN}"\nmanifest = "{manifest}"\nshuffle_buffer = 20\n{extra}'
    )


def open_all(daemons, world_size, num_workers, epoch, dataset="exact", seed=3, zero_copy=False):
    per_host = world_size // len(daemons)
    streams = {}
    for h, d in enumerate(daemons):
        client = shardd.Client(d.socket, zero_copy=zero_copy)
        for rank in range(h * per_host, (h + 1) * per_host):
            for worker in range(num_workers):
                streams[rank, worker] = client.stream(
                    dataset, epoch=epoch, rank=rank, world_size=world_size,
                    worker=worker, num_workers=num_workers, seed=seed)
    return streams


def test_manifest_counts_match_webdataset(manifest, train_paths):
    m = json.loads(manifest.read_text())
    want = reference_samples(train_paths)
    assert m["total_samples"] == len(want)
    assert [e["samples"] for e in m["shards"]] == [len(reference_samples([p])) for p in train_paths]
    assert [e["size"] for e in m["shards"]] == [p.stat().st_size for p in train_paths]


def test_every_stream_of_every_host_gets_as_many_samples(make_daemon, fake_gcs, manifest, train_paths,
                                                         delivery):
    hosts = [make_daemon(exact_config(fake_gcs, manifest, h, 2), name=f"host{h}") for h in range(2)]
    want = reference_samples(train_paths)
    dropped_by_epoch = []
    for epoch in range(3):
        streams = open_all(hosts, world_size=4, num_workers=3, epoch=epoch, zero_copy=delivery)
        counts = {s.samples for s in streams.values()}
        assert len(counts) == 1, counts
        per_stream = counts.pop()
        assert {s.fingerprint for s in streams.values()} != {""}
        assert len({s.fingerprint for s in streams.values()}) == 1, "ranks disagree on the plan"
        got = {k: list(s) for k, s in streams.items()}
        assert all(len(v) == per_stream for v in got.values())
        keys = [x["__key__"] for v in got.values() for x in v]
        assert len(keys) == len(set(keys)), "a sample twice in one epoch"
        for v in got.values():
            for x in v:
                assert {k: b for k, b in x.items() if not k.startswith("__")} == want[x["__key__"]]
        dropped = set(want) - set(keys)
        reported = streams[0, 0].dropped + streams[2, 0].dropped
        assert len(dropped) == reported < 2 * (2 * 3 + 1)
        dropped_by_epoch.append(dropped)
        # The next epoch has another fingerprint.
        if epoch:
            assert streams[0, 0].fingerprint != previous
        previous = streams[0, 0].fingerprint
    assert len({frozenset(d) for d in dropped_by_epoch}) > 1, "the same samples dropped every epoch"


@pytest.mark.parametrize("with_manifest", [True, False], ids=["manifest", "shards"])
def test_resume_anywhere_continues_exactly(make_daemon, fake_gcs, manifest, with_manifest, delivery):
    dataset = "exact" if with_manifest else "train"
    d = make_daemon(exact_config(fake_gcs, manifest))
    client = shardd.Client(d.socket, zero_copy=delivery)
    kw = dict(epoch=2, rank=1, world_size=2, worker=1, num_workers=2, seed=9)
    full = [s["__key__"] for s in client.stream(dataset, **kw)]
    assert len(full) > 40
    rng = random.Random(5)
    positions = sorted({0, 1, 19, 20, 21, len(full) // 2, len(full) - 1, len(full)}
                       | {rng.randrange(len(full)) for _ in range(4)})
    for p in positions:
        first = client.stream(dataset, **kw)
        head = [next(first)["__key__"] for _ in range(p)]
        assert first.position == p
        first.close()
        rest = client.stream(dataset, start=p, **kw)
        assert rest.position == p
        tail = [s["__key__"] for s in rest]
        assert head + tail == full, f"resume at {p}"
        assert rest.position == len(full)


def test_a_late_resume_reads_about_one_window(make_daemon, fake_gcs, manifest):
    d = make_daemon(exact_config(fake_gcs, manifest))
    # No next epoch opened ahead: its first window's shard reads would count as the resume's.
    client = shardd.Client(d.socket, prefetch_next_epoch=False)
    kw = dict(epoch=0, rank=0, world_size=1, seed=1)
    def shards_read():
        return d.metric("shardd_cache_hits_total") + d.metric("shardd_cache_misses_total")

    full = list(client.stream("exact", **kw))
    whole = shards_read()
    sent_before = d.metric("shardd_samples_sent_total")
    tail = list(client.stream("exact", start=len(full) * 9 // 10, **kw))
    assert [s["__key__"] for s in tail] == [s["__key__"] for s in full[len(full) * 9 // 10:]]
    assert d.metric("shardd_samples_sent_total") - sent_before == len(tail)
    # The stream spans all 12 shards (one of them in two pieces, where the pass's rotation
    # wraps); a resume at 90 % reads only the shards of the last window or two
    # (shuffle_buffer 20; shards of 15-40 samples), not the epoch's prefix.
    resumed = shards_read() - whole
    assert whole >= TRAIN_SHARDS and resumed <= 3, (whole, resumed)
    print(f"resume at 90%: {resumed:.0f} shard reads, the whole epoch: {whole:.0f}")


def test_samples_per_epoch_is_exact(make_daemon, fake_gcs, manifest):
    d = make_daemon(exact_config(fake_gcs, manifest, extra="samples_per_epoch = 250\n"))
    seen = collections.Counter()
    for epoch in range(2):
        for worker in range(2):
            s = shardd.Client(d.socket).stream("exact", epoch=epoch, rank=0, world_size=1,
                                                worker=worker, num_workers=2)
            keys = [x["__key__"] for x in s]
            assert len(keys) == s.samples == 250
            seen.update(keys)
    assert sum(seen.values()) == 1000


@pytest.mark.parametrize("with_manifest", [True, False], ids=["manifest", "shards"])
def test_start_past_the_end_is_refused(make_daemon, fake_gcs, manifest, with_manifest):
    """With a manifest the request is refused at once; without one the stream's length is
    known only once it is read, so the refusal comes in place of the END. A start at the end
    is an empty rest, not an error."""
    dataset = "exact" if with_manifest else "train"
    d = make_daemon(exact_config(fake_gcs, manifest))
    kw = dict(epoch=0, rank=0, world_size=1)
    with shardd.Client(d.socket) as c:
        n = len(list(c.stream(dataset, **kw)))
        at_end = c.stream(dataset, start=n, **kw)
        assert list(at_end) == [] and at_end.end == {"samples": 0, "bytes": 0}
        with pytest.raises(shardd.DaemonError) as e:
            list(c.stream(dataset, start=n + 1, **kw))
    assert e.value.code == "bad_request"
    assert str(e.value) == f"start {n + 1} is past the end of the stream: it has {n} samples this epoch"


def plan_exchange(d, **fields):
    """A raw ``plan`` request (protocol 3): the daemon's preamble, START, END; JSON of both."""
    body = json.dumps({"op": "plan", "dataset": "exact", "epoch": 0, "rank": 0, "world_size": 1,
                       **fields}).encode()
    reply = raw_exchange(d.socket, b"SHARDD\x03\x00" + struct.pack("<IB", len(body), 1) + body)
    assert reply[:8] == b"SHARDD\x07\x00"  # the daemon says its own version
    frames, at = [], 8
    while at < len(reply):
        length, kind = struct.unpack_from("<IB", reply, at)
        frames.append((kind, json.loads(reply[at + 5 : at + 5 + length])))
        at += 5 + length
    assert [k for k, _ in frames] == [2, 4], frames  # START, END
    assert frames[1][1] == {"samples": 0, "bytes": 0}
    return frames[0][1]


def test_a_plan_request_answers_the_start_and_loads_nothing(make_daemon, fake_gcs, manifest):
    """op "plan" gets the START a stream would get (length, drops, fingerprint) and an empty
    END; it opens no stream and fetches nothing."""
    d = make_daemon(exact_config(fake_gcs, manifest))
    kw = dict(epoch=3, rank=0, world_size=1, worker=1, num_workers=2, seed=4)
    planned = plan_exchange(d, **kw)
    assert d.metric("shardd_shard_fetches_total") == 0
    assert d.metric('shardd_streams_total{dataset="exact",outcome="completed"}') == 0
    with shardd.Client(d.socket) as c:
        stream = c.stream("exact", **kw)
        keys = [s["__key__"] for s in stream]
    assert planned["samples"] == stream.samples == len(keys)
    assert planned["fingerprint"] == stream.fingerprint
    assert planned == {"dataset": "exact", "shards": stream.shards, "host": 0, "hosts": 1,
                       "samples": len(keys), "position": 0, "dropped": stream.dropped,
                       "fingerprint": stream.fingerprint}


def test_a_stale_manifest_stops_the_daemon_naming_the_shard(fake_gcs, manifest, tmp_path):
    m = json.loads(manifest.read_text())
    m["shards"][4]["size"] += 1
    m["total_bytes"] += 1
    stale = tmp_path / "stale.json"
    stale.write_text(json.dumps(m))
    config = tmp_path / "c.toml"
    config.write_text(
        f'[server]\nsocket = "{tmp_path}/s.sock"\nmetrics_addr = ""\n[cache]\ndir = "{tmp_path}/cache"\n'
        + exact_config(fake_gcs, stale)
    )
    out = subprocess.run([SHARDD, "serve", "--config", str(config)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert (f'dataset "exact": manifest {stale} does not match the configured shards: '
            f"gs://{BUCKET}/train/train-000004.tar changed since it was indexed") in out.stderr, out.stderr


def test_each_host_checks_only_its_share_against_the_store(make_daemon, fake_gcs, manifest, tmp_path):
    """The hosts of a job check every shard against the store once between them (each its
    own share), not every shard each: a shard changed since indexing stops the host that
    reads it, and only that one."""
    hosts = [make_daemon(exact_config(fake_gcs, manifest, h, 2), name=f"host{h}") for h in range(2)]
    checked = []
    for d in hosts:
        line = next(l for l in d.log_path.read_text().splitlines() if "manifest checked" in l)
        checked.append(int(re.search(r"checked_shards=(\d+)", line).group(1)))
    # Sample-level shares are cut by samples: a shard may be split between the two hosts.
    assert TRAIN_SHARDS <= sum(checked) <= TRAIN_SHARDS + 1, checked
    streams = open_all(hosts, world_size=2, num_workers=1, epoch=0)
    urls = [{s["__url__"] for s in streams[h, 0]} for h in range(2)]
    assert [len(u) for u in urls] == checked
    for d in hosts:
        d.stop()

    changed = sorted(urls[1] - urls[0])[0]
    m = json.loads(manifest.read_text())
    entry = next(e for e in m["shards"] if e["url"] == changed)
    entry["size"] += 1
    m["total_bytes"] += 1
    stale = tmp_path / "stale.json"
    stale.write_text(json.dumps(m))
    make_daemon(exact_config(fake_gcs, stale, 0, 2), name="host0-again")  # serves
    with pytest.raises(RuntimeError) as e:
        make_daemon(exact_config(fake_gcs, stale, 1, 2), name="host1-again")
    assert (f'dataset "exact": manifest {stale} does not match the configured shards: '
            f"{changed} changed since it was indexed") in str(e.value)


def test_protocol_1_clients_are_still_served(make_daemon, fake_gcs, manifest, monkeypatch):
    d = make_daemon(exact_config(fake_gcs, manifest))
    monkeypatch.setattr(shardd.client, "PREAMBLE", shardd.client.MAGIC + struct.pack("<H", 1))
    request = {"op": "stream", "dataset": "train", "epoch": 0, "rank": 0, "world_size": 1}
    v1 = [s["__key__"] for s in shardd.client.Stream(str(d.socket), request)]
    monkeypatch.undo()
    assert v1 == [s["__key__"] for s in shardd.Client(d.socket).stream("train", epoch=0, rank=0, world_size=1)]
