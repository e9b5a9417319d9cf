"""Passes across a resize (REQUEST `history`, protocol 7), through real daemons and the Python
client: a dataset with `samples_per_epoch` (and a mix's sources) goes on with the pass that was
in progress when the job moved to another topology, sample for sample, so that at every epoch
boundary no sample has been read twice more than another; without the history, the new
topology starts its own passes where its arithmetic says, and the spread grows past one."""

import collections
import random
import subprocess

import pytest
import shardd
import webdataset as wds

from conftest import SHARDD

E = 7  # samples per stream and epoch
SHARDS, PER_SHARD = 6, 20  # 120 samples: equal host shares at 1, 2 and 3 hosts


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("passes")
    rng = random.Random(7)
    for s in range(SHARDS):
        with wds.TarWriter(str(root / f"p-{s}.tar")) as sink:
            for i in range(PER_SHARD):
                sink.write({"__key__": f"p{s}/{i:02d}", "bin": rng.randbytes(200)})
    pattern = f"{root}/p-{{0..{SHARDS - 1}}}.tar"
    manifest = root / "p.manifest.json"
    run = subprocess.run([SHARDD, "index", pattern, "-o", str(manifest)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    keys = [f"p{s}/{i:02d}" for s in range(SHARDS) for i in range(PER_SHARD)]
    body = (f'[datasets.p]\nshards = "{pattern}"\nmanifest = "{manifest}"\nshuffle_buffer = 5\n'
            f"samples_per_epoch = {E}\n")
    return body, keys


def daemons(make_daemon, body, hosts, name):
    return [make_daemon(f"[host]\nindex = {h}\ncount = {hosts}\n" + body, name=f"{name}{h}")
            for h in range(hosts)]


def read_epoch(ds, topo, epoch, history=None, resume_from=None, positions=None):
    """Every stream of an epoch at topology (hosts, ranks, workers), from its hosts' daemons;
    with ``positions``, each worker's stream up to its position only."""
    hosts, ranks, workers = topo
    keys = []
    for h, d in enumerate(ds):
        with shardd.Client(d.socket, prefetch_next_epoch=False) as c:
            for r in range(ranks):
                for w in range(workers):
                    s = c.stream("p", epoch=epoch, rank=h * ranks + r, world_size=hosts * ranks,
                                 worker=w, num_workers=workers, seed=4, history=history,
                                 resume_from=resume_from)
                    got = [x["__key__"] for x in s]
                    keys.extend(got if positions is None else got[:positions[w]])
    return keys


def spread(read, keys):
    counts = [read[k] for k in keys]
    return max(counts) - min(counts)


def run_job(make_daemon, data, with_history, name):
    """2 hosts × 1 rank × 2 workers for epoch 0 and part of epoch 1, checkpointed at 3 samples
    per stream; the rest of epoch 1 on 1 host × 2 ranks × 2 workers (an elastic resume: 16
    samples for 4 new streams, none dropped); epochs 2-5 there. Returns the spread of read
    counts at each epoch boundary."""
    body, keys = data
    old, new = daemons(make_daemon, body, 2, name + "old"), daemons(make_daemon, body, 1, name + "new")
    read = collections.Counter()
    spreads = []
    read.update(read_epoch(old, (2, 1, 2), 0))
    spreads.append(spread(read, keys))
    positions = [3, 3]
    read.update(read_epoch(old, (2, 1, 2), 1, positions=positions))
    origin = {"hosts": 2, "world_size": 2, "num_workers": 2, "positions": positions}
    read.update(read_epoch(new, (1, 2, 2), 1, resume_from=origin))
    spreads.append(spread(read, keys))
    history = shardd.next_history(None, origin, 1) if with_history else None
    for epoch in range(2, 6):
        read.update(read_epoch(new, (1, 2, 2), epoch, history=history))
        spreads.append(spread(read, keys))
    return spreads


def test_a_pass_goes_on_across_an_elastic_resize(make_daemon, data):
    with_history = run_job(make_daemon, data, True, "with")
    assert max(with_history) <= 1, repr(with_history)
    without = run_job(make_daemon, data, False, "without")
    assert max(without) >= 2, f"the job does not tell a history from none: {without}"


def test_the_history_is_in_the_plan_and_checked(make_daemon, data):
    body, _ = data
    d = daemons(make_daemon, body, 1, "one")[0]
    hop = {"hosts": 2, "world_size": 2, "num_workers": 2, "last_epoch": 1}
    with shardd.Client(d.socket) as c:
        plain = c.plan("p", epoch=2, rank=0, world_size=2, num_workers=2)
        resized = c.plan("p", epoch=2, rank=0, world_size=2, num_workers=2, history=[hop])
        assert plain["fingerprint"] != resized["fingerprint"]
        assert resized["samples"] == E
        for bad, message in [
            ([dict(hop, last_epoch=2)], "history: the last hop's last_epoch 2 is not before the requested epoch 2"),
            ([dict(hop, hosts=3)], "history: hop 0: world_size 2 is not divisible by its hosts 3"),
            ([dict(hop, hosts=1 << 19, world_size=1 << 19)], "more than 262144"),
        ]:
            with pytest.raises(shardd.DaemonError) as e:
                c.plan("p", epoch=2, rank=0, world_size=2, num_workers=2, history=bad)
            assert e.value.code == "bad_topology" and message in str(e.value), e.value
        # The daemon serves on.
        assert len(list(c.stream("p", epoch=0, rank=0, world_size=1))) == E


def test_shardd_torch_carries_the_history_after_an_elastic_resume(make_daemon, data):
    """`ShardDataset(resume_from=STATE)`: the resumed epoch, then every later one, with the
    history the daemon needs, saved in the state too; the pass goes on across the resize."""
    import shardd.torch as st

    body, keys = data
    old, new = daemons(make_daemon, body, 2, "told"), daemons(make_daemon, body, 1, "tnew")
    read = collections.Counter()
    spreads = []

    def dataset(d, rank, **kw):
        return st.ShardDataset("p", socket=d.socket, rank=rank, world_size=2, seed=4,
                               check_plan=False, prefetch_next_epoch=False, **kw)

    olds = [dataset(old[h], h) for h in range(2)]
    for ds in olds:
        read.update(s["__key__"] for s in ds)
    spreads.append(spread(read, keys))
    states = []
    for ds in olds:
        ds.set_epoch(1)
        it = iter(ds)
        read.update(next(it)["__key__"] for _ in range(3))
        states.append(ds.state_dict())
        del it
    news = [dataset(new[0], r, resume_from=states[0]) for r in range(2)]
    for ds in news:
        assert ds.epoch == 1
        read.update(s["__key__"] for s in ds)
    spreads.append(spread(read, keys))
    for epoch in range(2, 6):
        for ds in news:
            ds.set_epoch(epoch)
            read.update(s["__key__"] for s in ds)
        spreads.append(spread(read, keys))
    assert max(spreads) <= 1, spreads
    assert news[0].state_dict()["history"] == [
        {"hosts": 2, "world_size": 2, "num_workers": 1, "last_epoch": 1}]


@pytest.fixture(scope="module")
def mix_data(tmp_path_factory):
    """Two datasets of 60 and 40 samples, mixed 3:1, 8 samples per stream and epoch."""
    root = tmp_path_factory.mktemp("mixpasses")
    rng = random.Random(8)
    sections, keys = [], {}
    for name, shards in [("a", 3), ("b", 2)]:
        for s in range(shards):
            with wds.TarWriter(str(root / f"{name}-{s}.tar")) as sink:
                for i in range(PER_SHARD):
                    sink.write({"__key__": f"{name}{s}/{i:02d}", "bin": rng.randbytes(100)})
        pattern = f"{root}/{name}-{{0..{shards - 1}}}.tar"
        manifest = root / f"{name}.manifest.json"
        run = subprocess.run([SHARDD, "index", pattern, "-o", str(manifest)], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        sections.append(f'[datasets.{name}]\nshards = "{pattern}"\nmanifest = "{manifest}"\nshuffle_buffer = 4\n')
        keys[name] = [f"{name}{s}/{i:02d}" for s in range(shards) for i in range(PER_SHARD)]
    body = ("[host]\nindex = 0\ncount = 1\n" + "".join(sections)
            + "[datasets.m]\nmix = { a = 3, b = 1 }\nsamples_per_epoch = 8\n")
    return body, keys


def test_each_source_of_a_mix_goes_on_with_its_pass_across_a_resize(make_daemon, mix_data):
    """1 rank × 2 workers checkpointed in epoch 1 at 3 samples per stream, finished and
    continued by 1 rank without workers (one stream: each source's rest is read whole, none
    dropped): with the history, each source's reads differ by at most one at every epoch
    boundary."""
    body, keys = mix_data
    d = make_daemon(body)

    def read(epoch, world, workers, positions=None, **kw):
        got = collections.defaultdict(list)
        with shardd.Client(d.socket, prefetch_next_epoch=False) as c:
            for r in range(world):
                for w in range(workers):
                    s = list(c.stream("m", epoch=epoch, rank=r, world_size=world, worker=w,
                                      num_workers=workers, seed=9, **kw))
                    for x in (s if positions is None else s[:positions[w]]):
                        got[x["__source__"]].append(x["__key__"])
        return got

    def job(with_history):
        read_counts = {name: collections.Counter() for name in keys}
        spreads = []

        def add(got):
            for name, ks in got.items():
                read_counts[name].update(ks)

        def boundary():
            spreads.append(max(spread(read_counts[n], keys[n]) for n in keys))

        add(read(0, 1, 2))
        boundary()
        origin = {"hosts": 1, "world_size": 1, "num_workers": 2, "positions": [3, 3]}
        add(read(1, 1, 2, positions=[3, 3]))
        add(read(1, 1, 1, resume_from=origin))
        boundary()
        history = shardd.next_history(None, origin, 1) if with_history else None
        for epoch in range(2, 8):
            add(read(epoch, 1, 1, history=history))
            boundary()
        return spreads

    with_history = job(True)
    assert max(with_history) <= 1, repr(with_history)
    without = job(False)
    assert max(without) >= 2, f"the job does not tell a history from none: {without}"


def test_a_restart_inside_the_elastic_epoch_keeps_the_history(make_daemon, data):
    """A checkpoint taken during the elastic epoch, loaded into a fresh dataset after a
    restart: the rest of that epoch is the resume's, and the epochs after it carry the hop."""
    import shardd.torch as st

    body, _ = data
    old, new = daemons(make_daemon, body, 2, "rold"), daemons(make_daemon, body, 1, "rnew")

    def dataset(d, rank, **kw):
        return st.ShardDataset("p", socket=d.socket, rank=rank, world_size=2, seed=4,
                               check_plan=False, prefetch_next_epoch=False, **kw)

    first = dataset(old[0], 0, epoch=1)
    it = iter(first)
    next(it)
    state = first.state_dict()
    del it
    resumed = dataset(new[0], 0, resume_from=state)
    it = iter(resumed)
    next(it)
    mid = resumed.state_dict()
    del it
    assert mid["resume_from"]["hosts"] == 2 and "history" not in mid
    hop = [{"hosts": 2, "world_size": 2, "num_workers": 1, "last_epoch": 1}]
    fresh = dataset(new[0], 0, epoch=1)
    fresh.load_state_dict(mid)
    rest = [s["__key__"] for s in fresh]
    assert len(rest) == len([s for s in dataset(new[0], 0, resume_from=state)]) - 1
    fresh.set_epoch(2)
    with shardd.Client(new[0].socket) as c:
        want = [s["__key__"] for s in c.stream("p", epoch=2, rank=0, world_size=2, seed=4, history=hop)]
        plain = [s["__key__"] for s in c.stream("p", epoch=2, rank=0, world_size=2, seed=4)]
    assert want != plain
    assert [s["__key__"] for s in fresh] == want
    assert fresh.state_dict()["history"] == hop


def test_plan_verify_certifies_a_resize_of_a_job_resized_before(data, tmp_path):
    """`shardd plan --verify --history FILE`: the resize's old streams are planned as the
    daemon plans them after the earlier resize (their sequences start with heads), and the
    resume is certified; a history the daemon refuses is refused with its message."""
    import json

    body, _ = data
    config = tmp_path / "c.toml"
    config.write_text(body)
    history = tmp_path / "history.json"
    history.write_text(json.dumps([{"hosts": 2, "world_size": 2, "num_workers": 2, "last_epoch": 1}]))
    plan = [SHARDD, "plan", "--config", str(config), "--seed", "4", "--epoch", "3", "--verify",
            "--hosts", "2", "--ranks", "1", "--workers", "1", "--from", "1,2,2", "--positions", "3,4",
            "--json"]
    ok = subprocess.run(plan + ["--history", str(history)], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    v = json.loads(ok.stdout)
    assert v["breaches"] == [] and v["sources"][0]["duplicates"] == 0
    history.write_text(json.dumps([{"hosts": 2, "world_size": 2, "num_workers": 2, "last_epoch": 3}]))
    bad = subprocess.run(plan + ["--history", str(history)], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0
    assert "history: the last hop's last_epoch 3 is not before the requested epoch 3" in bad.stderr, bad.stderr
