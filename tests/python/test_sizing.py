"""Sizing the cache: `shardd plan` prints each host's working set (the least cache.max_size
that serves its streams) and its share (what cached epochs need), exactly; `check` and `serve`
warn when cache.max_size is more than its file system or its free space, or below the working
set; the default ("auto") is a share of the free space, so it cannot fill the disk."""

import json
import math
import os
import re
import subprocess

import pytest
import webdataset as wds

from conftest import SHARDD, free_port, gcs_config, wait_for

SHARDS, SAMPLES = 40, 10  # 40 shards of 10 samples each, every shard the same size


@pytest.fixture
def dataset(tmp_path):
    """Uniform local shards and their manifest: (pattern, manifest path, shard size)."""
    d = tmp_path / "shards"
    d.mkdir()
    for i in range(SHARDS):
        with wds.TarWriter(str(d / f"train-{i:02d}.tar")) as sink:
            for j in range(SAMPLES):
                sink.write({"__key__": f"s{i:02d}{j:03d}", "cls": b"1", "bin": bytes([i]) * 9000})
    sizes = {p.stat().st_size for p in d.iterdir()}
    assert len(sizes) == 1, sizes
    pattern = str(d / "train-{00..39}.tar")
    manifest = tmp_path / "train.manifest.json"
    run = subprocess.run([SHARDD, "index", pattern, "-o", str(manifest)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    return pattern, manifest, sizes.pop()


def config(tmp_path, dataset, cache="", server=""):
    pattern, manifest, _ = dataset
    path = tmp_path / "c.toml"
    path.write_text(f'[server]\n{server}\n[cache]\ndir = "{tmp_path / "cache"}"\n{cache}\n'
                    f'[datasets.train]\nshards = "{pattern}"\nmanifest = "{manifest}"\nshuffle_buffer = 25\n')
    return path


def plan(path, hosts, ranks, workers, json_out=True):
    cmd = [SHARDD, "plan", "--config", str(path), "--hosts", str(hosts), "--ranks", str(ranks),
           "--workers", str(workers)] + (["--json"] if json_out else [])
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out


@pytest.mark.parametrize("maps, ranks, workers, budget", [
    # 2 streams × (⌈25 / 10⌉ + 2 = 5 shards) = 10 shards; zero copy's 16 maps a stream (32
    # shards) are capped at a quarter of the budget: B - B/4 >= 10 S.
    (16, 2, 1, lambda s: math.ceil(10 * s / 0.75)),
    # One map a stream: 10 S + 2 S is less than that.
    (1, 2, 1, lambda s: 12 * s),
    # No zero copy: the windows alone.
    (0, 2, 1, lambda s: 10 * s),
    # 8 streams would hold 40 shards, but the host's share is 20: a budget that holds the share
    # holds every window.
    (16, 4, 2, lambda s: 20 * s),
])
def test_plan_prints_each_hosts_working_set_and_share(tmp_path, dataset, maps, ranks, workers, budget):
    size = dataset[2]
    path = config(tmp_path, dataset, cache='max_size = "1GiB"', server=f"zero_copy_maps = {maps}")
    r = json.loads(plan(path, 2, ranks, workers).stdout)
    streams = ranks * workers
    assert r["sizing"] == {"streams_per_host": streams, "shuffle_buffer": 25, "zero_copy_maps": maps,
                           "zero_copy_share": 0.25 if maps else 0.0, "cache_max_bytes": 1 << 30,
                           "cache_max_share": None}
    for h in r["per_host"]:
        assert h["share_bytes"] == 20 * size  # 20 of the 40 shards: every epoch's
        assert h["working_set"] == {
            "streams": streams, "window_shards": 3, "stream_shards": 5, "shard_bytes": size,
            "bytes": min(streams * 5, 20) * size, "min_budget": budget(size),
        }
    text = plan(path, 2, ranks, workers, json_out=False)
    lines = text.stdout.splitlines()
    assert lines[2] == (
        f"cache per host: MIN BUDGET = {streams} streams × (⌈shuffle_buffer 25 / samples per shard⌉ + 2) "
        f"shards × the mean shard size, plus zero copy's maps ({maps} shards a stream, at most "
        f"{0.25 if maps else 0} of the budget); SHARE = every shard the host reads in any epoch (cached "
        f"epochs); cache.max_size: {1 << 30} bytes")
    assert lines[3].split() == ["HOST", "SAMPLES", "SHARDS", "BYTES", "DROPPED", "MIN", "BUDGET", "SHARE"]
    for h in (0, 1):
        assert lines[4 + h] == (f"{h:>6} {200:>14} {20:>10} {20 * size:>18} {0:>8} {budget(size):>18} "
                                f"{20 * size:>18}")
    assert text.stderr == ""


def test_plan_warns_of_a_budget_below_the_working_set(tmp_path, dataset):
    size = dataset[2]
    need = math.ceil(10 * size / 0.75)
    path = config(tmp_path, dataset, cache=f'max_size = "{need - 1}"')
    out = plan(path, 2, 2, 1, json_out=False)
    assert out.stderr == (
        f"warning: cache.max_size ({need - 1} bytes) is below the working set of 2 of 2 hosts (host 0 needs "
        f"{need} bytes: 2 streams × 5 shards of {size} bytes, with zero copy's maps): streams wait for space "
        f"and fail with cache_full\n")
    assert plan(config(tmp_path, dataset, cache=f'max_size = "{need}"'), 2, 2, 1).stderr == ""
    # "auto" is each host's own free space: nothing to compare, the line says so.
    auto = plan(config(tmp_path, dataset), 2, 2, 1, json_out=False)
    assert auto.stdout.splitlines()[2].endswith("cache.max_size: 80% of each host's free space")
    assert auto.stderr == ""


def test_check_says_how_many_streams_the_budget_holds(tmp_path, dataset):
    """One stream: 5 shards (3 of a 25-sample window over 10-sample shards, + 2)."""
    size = dataset[2]
    one = math.ceil(5 * size / 0.75)
    for budget, fits in ((20 * size, 3), (one - 1, 0)):
        out = subprocess.run([SHARDD, "check", "--config", str(config(tmp_path, dataset, cache=f'max_size = "{budget}"'))],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert (f"dataset train: a stream holds 5 shards (3 of its shuffle window of 25 samples, + 2) of {size} "
                f"bytes on average: {5 * size} bytes, {one} with zero copy's maps; cache.max_size ({budget} bytes) "
                f"holds {fits} streams at once (shardd plan sizes a whole job)") in lines, out.stdout
        warning = (f"warning: cache.max_size ({budget} bytes) is below the working set of one stream of dataset "
                   f"train ({one} bytes, with zero copy's maps): streams wait for space and fail with cache_full")
        assert (warning in lines) == (fits == 0), out.stdout


def statvfs(path):
    v = os.statvfs(path)
    return v.f_blocks * v.f_frsize, v.f_bavail * v.f_frsize


def check_offline(path):
    out = subprocess.run([SHARDD, "check", "--no-store", "--config", str(path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return [line for line in out.stdout.splitlines() if line.startswith("warning:")]


def test_check_warns_of_a_budget_larger_than_the_disk(tmp_path, dataset):
    size, _ = statvfs(tmp_path)
    cache = tmp_path / "cache"  # not made yet: its nearest existing parent is measured
    (warning,) = check_offline(config(tmp_path, dataset, cache='max_size = "100PiB"'))
    assert re.fullmatch(
        re.escape(f"warning: cache.max_size ({100 << 50} bytes) is more than the whole file system of cache.dir "
                  f"{cache} (its nearest existing parent {tmp_path}) holds ({size} bytes): the disk fills before "
                  f"the cache does; set max_size = \"auto\" (0.8 of the free space: ") + r"\d+"
        + re.escape(" bytes now) or a size below ") + r"\d+" + re.escape(" bytes"), warning), warning


def test_check_warns_of_a_budget_larger_than_the_free_space(tmp_path, dataset):
    """What the cache directory holds already counts as free for it (a restart with a full
    cache keeps its budget): the warning says both."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "old-entry").write_bytes(os.urandom(1 << 20))
    held = os.stat(cache / "old-entry").st_blocks * 512
    size, free = statvfs(tmp_path)
    assert free + held < size, "the test needs a file system that is not empty"
    (warning,) = check_offline(config(tmp_path, dataset, cache=f'max_size = "{size}"'))
    m = re.fullmatch(
        re.escape(f"warning: cache.max_size ({size} bytes) is more than the free space of cache.dir {cache}: ")
        + r"(\d+)" + re.escape(f" bytes free and {held} held by the cache; the disk fills before the cache does; "
                               "set max_size = \"auto\" (0.8 of the free space: ") + r"(\d+)"
        + re.escape(" bytes now) or a size below ") + r"(\d+)" + re.escape(" bytes"), warning)
    assert m, warning
    free_then, auto, below = map(int, m.groups())
    assert below == free_then + held and auto == int(0.8 * below)
    assert abs(free_then - free) < 0.05 * free  # the same file system, give or take its churn
    # Within the free space, or a share of it: no warning.
    assert check_offline(config(tmp_path, dataset, cache=f'max_size = "{free // 2}"')) == []
    assert check_offline(config(tmp_path, dataset, cache='max_size = "50%"')) == []
    assert check_offline(config(tmp_path, dataset)) == []


@pytest.mark.parametrize("value, error", [
    ("0%", 'cache.max_size "0%" is not a share of the free space between 0% and 100% like "50%"'),
    ("150%", 'cache.max_size "150%" is not a share of the free space between 0% and 100% like "50%"'),
    ("lots", 'cache.max_size "lots" is not a size like "100GiB"'),
])
def test_bad_budgets_are_config_errors(tmp_path, dataset, value, error):
    path = config(tmp_path, dataset, cache=f'max_size = "{value}"')
    out = subprocess.run([SHARDD, "check", "--no-store", "--config", str(path)], capture_output=True, text=True)
    assert out.returncode == 1 and error in out.stderr, out.stderr


def test_serve_warns_and_the_default_budget_is_a_share_of_the_free_space(make_daemon, fake_gcs, tmp_path):
    """The default "auto" is 80% of the free space plus what the cache holds, at start: it
    cannot fill the disk. A budget larger than the disk is served, with a warning."""
    cache = tmp_path / "auto-cache"
    cache.mkdir()
    (cache / "left-over").write_bytes(os.urandom(1 << 20))
    held = os.stat(cache / "left-over").st_blocks * 512
    _, free = statvfs(cache)
    d = make_daemon(gcs_config(fake_gcs), name="auto", cache_dir=cache)
    budget = d.metric("shardd_cache_capacity_bytes")
    assert abs(budget - 0.8 * (free + held)) < 0.01 * free, (budget, free, held)
    assert budget < free
    log = d.log_path.read_text()
    assert re.search(r"cache\.max_size: \d+ bytes \(80% of the \d+ bytes free on the file system of "
                     + re.escape(str(cache)) + r" plus the \d+ bytes the cache holds\)", log), log
    assert "WARN" not in log

    big = make_daemon(gcs_config(fake_gcs), name="big", cache='max_size = "100PiB"')
    log = wait_for(lambda: big.log_path.read_text(), "the log")
    assert "WARN" in log and f"cache.max_size ({100 << 50} bytes) is more than the whole file system of cache.dir" in log


def test_serve_says_at_start_how_many_streams_the_budget_holds(make_daemon, tmp_path, dataset):
    """The line and the warning of `shardd check`, logged by `shardd serve` once the manifest is
    read (issue 24: only check and plan said a budget was below one stream's working set)."""
    pattern, manifest, size = dataset
    body = f'[datasets.train]\nshards = "{pattern}"\nmanifest = "{manifest}"\nshuffle_buffer = 25\n'
    one = math.ceil(5 * size / 0.75)
    for name, budget, fits in (("fits", 20 * size, 3), ("below", one - 1, 0)):
        d = make_daemon(body, name=name, cache=f'max_size = "{budget}"')
        log = d.log_path.read_text()
        assert (f"dataset train: a stream holds 5 shards (3 of its shuffle window of 25 samples, + 2) of {size} "
                f"bytes on average: {5 * size} bytes, {one} with zero copy's maps; cache.max_size ({budget} bytes) "
                f"holds {fits} streams at once") in log, log
        warning = (f"cache.max_size ({budget} bytes) is below the working set of one stream of dataset train "
                   f"({one} bytes, with zero copy's maps): streams wait for space and fail with cache_full")
        assert (warning in log) == (fits == 0), log


@pytest.mark.parametrize("zero_copy", [False, True], ids=["socket", "zero_copy"])
def test_the_streams_plan_sizes_for_read_at_exactly_its_minimum_budget(make_daemon, tmp_path, dataset, zero_copy):
    """The formula's own oracle is a daemon: the streams `plan` sized a host for (2 ranks, one
    host) read their epoch at once in a cache of exactly the MIN BUDGET it printed, every
    sample, with no stream ever failing for space (cache_full) and the cache never past it."""
    import threading

    import shardd

    pattern, manifest, _ = dataset
    maps = 16 if zero_copy else 0
    sized = json.loads(plan(config(tmp_path, dataset, cache='max_size = "1GiB"', server=f"zero_copy_maps = {maps}"),
                            1, 2, 1).stdout)
    budget = sized["per_host"][0]["working_set"]["min_budget"]
    d = make_daemon(f'[datasets.train]\nshards = "{pattern}"\nmanifest = "{manifest}"\nshuffle_buffer = 25\n',
                    server=f"zero_copy_maps = {maps}", cache=f'max_size = "{budget}"\nspace_timeout = "10s"')
    keys, errors = [[], []], []

    def read(rank):
        try:
            with shardd.Client(d.socket, zero_copy=zero_copy) as c:
                keys[rank] = [s["__key__"] for s in c.stream("train", epoch=0, rank=rank, world_size=2)]
        except Exception as e:  # noqa: BLE001 (reported below, with the rank)
            errors.append(f"rank {rank}: {e}")

    readers = [threading.Thread(target=read, args=(r,)) for r in range(2)]
    for t in readers:
        t.start()
    for t in readers:
        t.join(timeout=120)
    assert not errors, errors
    assert sorted(keys[0] + keys[1]) == sorted(f"s{i:02d}{j:03d}" for i in range(SHARDS) for j in range(SAMPLES))
    assert d.metric("shardd_cache_full_total") == 0
    assert d.metric("shardd_cache_bytes_max") <= budget
