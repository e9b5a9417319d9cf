"""The cache, end to end: real fake-gcs-server, real files, the real daemon and client.
A host downloads its share once per job, within a hard disk budget, verified, across
restarts and kill -9; nothing it does not trust is served."""

import concurrent.futures
import itertools
import os
import pathlib
import random
import subprocess
import threading

import pytest
import shardd

from conftest import (
    BIG_SHARDS, BUCKET, bytes_on_disk, S3_CREDENTIALS_BOTO, S3_ENV, SHARDD, TRAIN_SHARDS, big_payload, gcs_config, reference_samples,
    tar_of, upload, wait_for,
)

RECORD = 8192  # bytes charged per entry for its metadata record


def gets(d):
    return d.metric('shardd_store_requests_total{kind="get"}')


def read(d, dataset="train", epoch=0, num_workers=1, **kw):
    """Every stream of one rank (world 1): the whole dataset, as {key: {field: bytes}}."""
    out = {}
    with shardd.Client(d.socket) as c:
        for worker in range(num_workers):
            for s in c.stream(dataset, epoch=epoch, rank=0, world_size=1, worker=worker,
                              num_workers=num_workers, **kw):
                assert s["__key__"] not in out
                out[s["__key__"]] = {k: v for k, v in s.items() if not k.startswith("__")}
    return out


def entries(cache_dir):
    return sorted((pathlib.Path(cache_dir) / "entries").glob("*.meta"))


def test_later_epochs_and_restarts_read_from_disk(make_daemon, fake_gcs, train_paths):
    d = make_daemon(gcs_config(fake_gcs))
    want = reference_samples(train_paths)
    assert read(d, epoch=0, num_workers=2) == want
    assert gets(d) == TRAIN_SHARDS
    assert read(d, epoch=1, num_workers=2) == want
    assert gets(d) == TRAIN_SHARDS, "the second epoch asked the store for bytes"
    d.stop()
    d.start()
    assert read(d, epoch=2) == want
    assert gets(d) == 0, "a restarted daemon asked the store for bytes it had"
    assert d.metric("shardd_cache_verify_failures_total") == 0


def test_the_budget_is_never_exceeded(make_daemon, fake_gcs, train_paths):
    share = sum(p.stat().st_size + RECORD for p in train_paths)
    budget = int(share * 0.4)
    d = make_daemon(gcs_config(fake_gcs), cache=f'max_size = "{budget}"')
    cache_dir = d.dir / "cache"
    peak, done = [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], bytes_on_disk(cache_dir))
            done.wait(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        want = reference_samples(train_paths)
        for epoch in range(2):
            assert read(d, epoch=epoch) == want
    finally:
        done.set()
        sampler.join()
    assert 0 < peak[0] <= budget, f"peak {peak[0]} over the budget {budget}"
    assert d.metric("shardd_cache_evictions_total") > 0
    assert d.metric("shardd_cache_bytes") <= budget
    # The daemon's own high-water mark sees every peak (the sampler only every 2 ms); it
    # counts loads in progress, so at least what the disk ever held.
    assert peak[0] <= d.metric("shardd_cache_bytes_max") <= budget


def test_a_stream_that_cannot_get_space_fails_with_the_numbers(make_daemon, fake_gcs, shard_dir):
    """One 8 MB shard fits in the cache; the next, which the stream loads while its client
    still holds the first batch unread, does not. The failure waits for the batch in flight
    (an ERROR frame only follows a whole frame): the client reads the first sample whole,
    then the error with the numbers."""
    charge = (shard_dir / BUCKET / "big" / "big-0.tar").stat().st_size + RECORD
    d = make_daemon(gcs_config(fake_gcs), cache=f'max_size = "{charge * 3 // 2}"\nspace_timeout = "500ms"')
    with shardd.Client(d.socket) as c:
        stream = c.stream("big", epoch=0, rank=0, world_size=1)
        # Not reading: the first batch fills the socket, the next shard waits for space.
        wait_for(lambda: d.metric("shardd_cache_full_total") == 1, "the wait for space to end")
        first = next(stream)
        with pytest.raises(shardd.DaemonError) as e:
            next(stream)
    assert first["bin"] == big_payload(int(first["__key__"][3:]))
    assert e.value.code == "cache_full"
    message = str(e.value)
    assert message.startswith("cache full: gs://bkt/big/big-"), message
    assert f"needs {charge} bytes but cache.max_size is {charge * 3 // 2} bytes" in message
    assert f"of which {charge} are pinned by open streams and 0 reserved" in message
    wait_for(lambda: d.metric("shardd_cache_pinned_bytes") == 0, "pins to be released")
    assert d.metric("shardd_cache_bytes") <= charge * 3 // 2


def test_kill_9_during_downloads_then_restart(make_daemon, fake_gcs, cutting_proxy, shard_dir):
    slow = cutting_proxy(rate=40 << 20)  # 8 MB shards take ~0.2 s each
    # One download at a time, so the kill lands between a commit and the next download's end.
    d = make_daemon(
        gcs_config(slow.endpoint, extra="[store]\nmax_downloads = 1\n"), cache="prefetch_shards = 5"
    )
    cache_dir = d.dir / "cache"
    with shardd.Client(d.socket) as c:
        stream = c.stream("big", epoch=0, rank=0, world_size=1)
        next(stream)
        wait_for(
            lambda: d.metric("shardd_downloads_active") >= 1 and len(entries(cache_dir)) >= 1,
            "downloads in flight and an entry committed",
        )
        d.kill()
    committed = len(entries(cache_dir))
    partial = list((cache_dir / "tmp").glob("*.part"))
    assert partial, "the kill was meant to land during a download"
    assert committed < BIG_SHARDS

    # Restart (straight to the store): partial files go, complete entries are reused.
    d.config.write_text(d.config.read_text().replace(slow.endpoint, fake_gcs))
    d.start()
    assert list((cache_dir / "tmp").iterdir()) == []
    got = read(d, dataset="big")
    assert got == {f"big{i}": {"bin": big_payload(i)} for i in range(BIG_SHARDS)}
    assert gets(d) == BIG_SHARDS - committed
    assert d.metric("shardd_cache_verify_failures_total") == 0


def test_local_shards_changed_while_served(make_daemon, fake_gcs, train_paths, tmp_path):
    local = tmp_path / "local"
    local.mkdir()
    for i, p in enumerate(train_paths[:3]):
        (local / f"l{i}.tar").write_bytes(p.read_bytes())
    body = gcs_config(fake_gcs) + f'[datasets.local]\nshards = "{local}/l{{0..2}}.tar"\nshuffle_buffer = 1\n'
    d = make_daemon(body, cache='revalidate = "0s"')
    with shardd.Client(d.socket) as c, shardd.Client(d.socket) as other:
        stream = c.stream("local", epoch=0, rank=0, world_size=1)
        got = [next(stream)]
        # One file truncated, another rewritten, while the stream reads them.
        with open(local / "l1.tar", "r+b") as f:
            f.truncate(os.path.getsize(local / "l1.tar") // 2 + 100)
        (local / "l2.tar").write_bytes(train_paths[5].read_bytes())
        try:
            got += list(stream)
        except shardd.DaemonError as e:
            # Caught mid-copy, or copied once truncated: a clear error naming the file, never
            # mixed bytes.
            assert e.code == "stream_failed"
            assert ("changed while it was being read" in str(e) and str(local) in str(e)
                    or str(e) == f"{local}/l1.tar: not a valid tar file: the archive ends inside "
                                 f"a header block"), str(e)
        else:
            # Each shard is served as one version of it, never a mix: the original of the
            # truncated one (copied before the change) and the original or the replacement
            # of the rewritten one.
            by_url = {}
            for s in got:
                by_url.setdefault(s["__url__"], {})[s["__key__"]] = {
                    k: v for k, v in s.items() if not k.startswith("__")
                }
            for i in (0, 1):
                assert by_url[f"{local}/l{i}.tar"] == reference_samples([train_paths[i]])
            assert by_url[f"{local}/l2.tar"] in (
                reference_samples([train_paths[2]]), reference_samples([train_paths[5]])
            )
        # Another stream was unaffected.
        assert len(list(other.stream("train", epoch=0, rank=0, world_size=1))) > 100
    # The next stream sees the files as they are now: the truncated one is a clear error.
    with shardd.Client(d.socket) as c:
        with pytest.raises(shardd.DaemonError) as e:
            list(c.stream("local", epoch=1, rank=0, world_size=1))
    assert e.value.code == "stream_failed"
    assert str(e.value).startswith(f"{local}/l1.tar: "), str(e.value)
    assert d.proc.poll() is None


WEIRD = ["weird/x~1.tar", "weird/50%.tar", "weird/a#b.tar", "weird/[c]=d.tar", "weird/with space.tar"]


def test_object_names_are_taken_verbatim(make_daemon, fake_gcs):
    want = {}
    for i, name in enumerate(WEIRD):
        sample = {"__key__": f"w{i}", "bin": name.encode() * 10}
        upload(fake_gcs, name, tar_of([sample]))
        want[f"w{i}"] = {"bin": sample["bin"]}
    shards = ", ".join(f'"gs://{BUCKET}/{n}"' for n in WEIRD)
    d = make_daemon(gcs_config(fake_gcs, extra=f"[datasets.weird]\nshards = [{shards}]\n"))
    urls = {}
    with shardd.Client(d.socket) as c:
        for s in c.stream("weird", epoch=0, rank=0, world_size=1):
            urls[s["__key__"]] = s["__url__"]
            assert s["bin"] == want[s["__key__"]]["bin"]
    assert urls == {f"w{i}": f"gs://{BUCKET}/{n}" for i, n in enumerate(WEIRD)}


def test_unaddressable_names_are_refused_at_load(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text('[datasets.d]\nshards = "gs://bkt/a//b.tar"\n')
    out = subprocess.run([SHARDD, "check", "--config", str(config)], capture_output=True, text=True)
    assert out.returncode == 1
    assert 'gs://bkt/a//b.tar: the object name "a//b.tar" cannot be addressed as written' in out.stderr


def test_a_replaced_object_is_fetched_again(make_daemon, fake_gcs):
    v1 = {"__key__": "r", "bin": b"one" * 1000}
    v2 = {"__key__": "r", "bin": b"two" * 1000}
    upload(fake_gcs, "mutable/r.tar", tar_of([v1]))
    d = make_daemon(
        gcs_config(fake_gcs, extra=f'[datasets.r]\nshards = "gs://{BUCKET}/mutable/r.tar"\n'),
        cache='revalidate = "0s"',
    )
    assert read(d, dataset="r") == {"r": {"bin": v1["bin"]}}
    assert read(d, dataset="r", epoch=1) == {"r": {"bin": v1["bin"]}}
    assert gets(d) == 1
    upload(fake_gcs, "mutable/r.tar", tar_of([v2]))
    assert read(d, dataset="r", epoch=2) == {"r": {"bin": v2["bin"]}}
    assert gets(d) == 2


@pytest.mark.parametrize("store", ["gcs", "s3"])
def test_an_object_replaced_mid_download_is_never_served_mixed(
    make_daemon, fake_gcs, s3_endpoint, cutting_proxy, store
):
    """The object is replaced between two ranged GETs of one download. Each GET carries
    If-Match with the ETag the download started from: S3 (moto) refuses the next part (412),
    and the daemon starts over on the new version. fake-gcs-server ignores If-Match (checked:
    it answers 200 to a wrong one), so there the second part is the new version's bytes, and
    the CRC-32C check of the whole object (the first part's x-goog-hash) catches the mix.
    Either way the new version
    is served whole, never the first part of one version and the rest of the other."""
    old = {"__key__": "m", "bin": random.Random(1).randbytes(3 << 20)}
    new = {"__key__": "m", "bin": random.Random(2).randbytes(3 << 20)}
    if store == "gcs":
        endpoint, url, env = fake_gcs, f"gs://{BUCKET}/midway/m.tar", None
        replace = lambda sample: upload(fake_gcs, "midway/m.tar", tar_of([sample]))  # noqa: E731
    else:
        import boto3

        s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1", **S3_CREDENTIALS_BOTO)
        endpoint, url, env = s3_endpoint, "s3://bkt3/midway/m.tar", S3_ENV
        replace = lambda sample: s3.put_object(Bucket="bkt3", Key="midway/m.tar", Body=tar_of([sample]))  # noqa: E731
    replace(old)
    # A 1 MiB part takes a second; every GET after the first (the later parts) waits for the
    # test to have replaced the object.
    gets_seen = itertools.count()
    slow = cutting_proxy(rate=1 << 20, upstream=endpoint, hold=lambda target: next(gets_seen) > 0)
    if store == "gcs":
        section = f'[gcs]\nendpoint = "{slow.endpoint}"\nanonymous = true\n'
    else:
        section = f'[s3]\nendpoint = "{slow.endpoint}"\nregion = "us-east-1"\n'
    d = make_daemon(
        section + '[store]\npart_size = "1MiB"\nparts_in_flight = 1\n'
        f'[datasets.m]\nshards = "{url}"\n',
        env=env,
    )
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reading = pool.submit(read, d, dataset="m")
        # The proxy has the whole first part (old) before the daemon gets its first byte, and
        # the second part is asked for only once the first has arrived.
        wait_for(lambda: d.metric("shardd_store_bytes_total") >= 256 << 10, "the first part to arrive")
        replace(new)
        slow.release.set()
        assert reading.result(timeout=60) == {"m": {"bin": new["bin"]}}
    refused = d.metric('shardd_store_errors_total{kind="changed"}')
    mixed = d.metric("shardd_cache_verify_failures_total")
    assert (refused, mixed) == ((1, 0) if store == "s3" else (0, 1))
    # S3: the old version's first part and the refused second, then the new version's parts.
    # GCS: every part of the mixed download, then every part again.
    parts = -(-len(tar_of([new])) // (1 << 20))
    assert gets(d) == (2 + parts if store == "s3" else 2 * parts)


def test_a_corrupted_entry_is_fetched_again_never_served(make_daemon, fake_gcs, train_paths):
    d = make_daemon(gcs_config(fake_gcs))
    want = reference_samples(train_paths)
    assert read(d) == want
    d.stop()
    data = sorted((d.dir / "cache" / "entries").glob("*.tar"))
    assert len(data) == TRAIN_SHARDS
    raw = bytearray(data[3].read_bytes())
    raw[len(raw) // 2] ^= 0x55
    data[3].write_bytes(bytes(raw))
    d.start()
    assert read(d, epoch=1) == want
    assert d.metric("shardd_cache_verify_failures_total") == 1
    assert gets(d) == 1


def test_datasets_sharing_shards_download_each_once(make_daemon, fake_gcs, train_paths):
    again = f'[datasets.again]\nshards = "gs://{BUCKET}/train/train-{{000000..{TRAIN_SHARDS - 1:06d}}}.tar"\n'
    d = make_daemon(gcs_config(fake_gcs, extra=again))
    want = reference_samples(train_paths)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        runs = [pool.submit(read, d, name, epoch) for name in ("train", "again") for epoch in (0, 1)]
        assert all(r.result() == want for r in runs)
    assert gets(d) == TRAIN_SHARDS


def test_warm_fills_the_share_then_the_daemon_asks_for_nothing(make_daemon, fake_gcs, train_paths):
    d = make_daemon(gcs_config(fake_gcs, host_index=1, host_count=2))
    busy = subprocess.run([SHARDD, "warm", "--config", str(d.config), "--dataset", "train"],
                          capture_output=True, text=True)
    assert busy.returncode == 1
    assert "is in use by another shardd" in busy.stderr, busy.stderr
    d.stop()

    warm = [SHARDD, "warm", "--config", str(d.config), "--dataset", "train"]
    out = subprocess.run(warm, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "train: 6/6 shards done" in out.stderr, out.stderr
    again = subprocess.run(warm, capture_output=True, text=True)
    assert again.returncode == 0 and "0.0 MB fetched" in again.stderr, again.stderr

    d.start()
    with shardd.Client(d.socket) as c:
        for rank in (2, 3):
            assert len(list(c.stream("train", epoch=0, rank=rank, world_size=4))) > 0
    assert gets(d) == 0


def test_warm_reports_what_does_not_fit_or_fails(make_daemon, fake_gcs, train_paths):
    budget = int(sum(p.stat().st_size + RECORD for p in train_paths) * 0.4)
    d = make_daemon(gcs_config(fake_gcs), cache=f'max_size = "{budget}"')
    d.stop()
    out = subprocess.run([SHARDD, "warm", "--config", str(d.config), "--dataset", "train"],
                         capture_output=True, text=True)
    assert out.returncode == 1
    assert f"dataset train: this host's share (12 shards) does not fit in cache.max_size ({budget} bytes)" in out.stderr
    out = subprocess.run([SHARDD, "warm", "--config", str(d.config), "--dataset", "missing"],
                         capture_output=True, text=True)
    assert out.returncode == 1
    assert "dataset missing: 1 of 2 shards could not be fetched: gs://bkt/nope/gone.tar: object not found" in out.stderr


def test_warm_at_start(make_daemon, fake_gcs, train_paths):
    body = gcs_config(fake_gcs).replace("shuffle_buffer = 25\n", "shuffle_buffer = 25\nwarm = true\n", 1)
    d = make_daemon(body)
    share = sum(p.stat().st_size + RECORD for p in train_paths)
    wait_for(lambda: d.metric("shardd_cache_resident_bytes") == share, "the share to be warmed")
    assert gets(d) == TRAIN_SHARDS
    assert read(d) == reference_samples(train_paths)
    assert gets(d) == TRAIN_SHARDS
    assert d.metric("shardd_cache_hits_total") == TRAIN_SHARDS


def test_two_daemons_cannot_share_a_cache_dir(make_daemon, fake_gcs, tmp_path):
    first = make_daemon(gcs_config(fake_gcs))
    config = tmp_path / "second.toml"
    config.write_text(
        f'[server]\nsocket = "{tmp_path}/second.sock"\nmetrics_addr = ""\n'
        f'[cache]\ndir = "{first.dir / "cache"}"\n' + gcs_config(fake_gcs)
    )
    out = subprocess.run([SHARDD, "serve", "--config", str(config)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 1
    assert f"the cache directory {first.dir / 'cache'} is in use by another shardd (pid {first.proc.pid})" in out.stderr


def test_warm_fills_the_share_a_manifest_datasets_streams_read(make_daemon, fake_gcs, train_paths, tmp_path):
    """With a manifest a host's share is a run of samples of the share order, not every
    host.count-th shard: `warm` reads the manifest and fills the share the streams read
    (issue 26: it filled the shard-level share, and the streams fetched half of theirs)."""
    pattern = f"gs://{BUCKET}/train/train-{{000000..{TRAIN_SHARDS - 1:06d}}}.tar"
    store = tmp_path / "store.toml"
    store.write_text(gcs_config(fake_gcs))
    manifest = tmp_path / "train.manifest.json"
    run = subprocess.run([SHARDD, "index", pattern, "-o", str(manifest), "--config", str(store)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    exact = f'[datasets.exact]\nshards = "{pattern}"\nmanifest = "{manifest}"\nshuffle_buffer = 25\n'
    d = make_daemon(gcs_config(fake_gcs, host_index=1, host_count=2, extra=exact))
    d.stop()
    out = subprocess.run([SHARDD, "warm", "--config", str(d.config), "--dataset", "exact"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    d.start()
    with shardd.Client(d.socket) as c:
        read_by_host = sum(len(list(c.stream("exact", epoch=e, rank=rank, world_size=4)))
                           for e in (0, 1) for rank in (2, 3))
    assert read_by_host > 0
    assert gets(d) == 0


def test_cache_files_written_in_64_kib_blocks_hold_the_shards(make_daemon, fake_gcs, train_paths):
    """`cache.block_size = "64KiB"` (for hosts that take back free memory, config.example.toml):
    downloads (their parts cut at 64 KiB boundaries) and local copies fill the cache with the
    store's bytes, as in 2 MiB blocks."""
    local = ", ".join(f'"{p}"' for p in train_paths)
    d = make_daemon(gcs_config(fake_gcs, extra=f"[datasets.local]\nshards = [{local}]\n"),
                    cache='block_size = "64KiB"')
    assert read(d) == reference_samples(train_paths)
    assert read(d, "local") == reference_samples(train_paths)
    big = read(d, "big")
    assert {k: v["bin"] for k, v in big.items()} == {f"big{i}": big_payload(i)
                                                     for i in range(BIG_SHARDS)}
    d.stop()
    d.start()  # what was written is what a restarted daemon checks against its CRC-32C
    assert read(d) == reference_samples(train_paths)
    assert gets(d) == 0 and d.metric("shardd_cache_verify_failures_total") == 0
