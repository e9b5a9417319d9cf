"""shardd.grain end to end: real Grain pipelines (and mp_prefetch's worker processes) over the
real daemon binary, shards written by webdataset, a manifest made by `shardd index`. Orders are
asserted exactly: the expected order is built from the daemon's own streams, read with
shardd.Client, interleaved round-robin."""

import json
import pathlib
import signal
import subprocess
import sys
import types

import grain
import numpy as np
import pytest

import shardd
import shardd.grain as sg
from conftest import reference_samples, serve_train_and_tiny

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One daemon for the module: the train shards as `exact` (with a manifest) and `plain`
    (without: streams of unequal lengths), and the example's tiny image dataset."""
    root = tmp_path_factory.mktemp("grain")
    daemon, paths, _ = serve_train_and_tiny(root)
    yield types.SimpleNamespace(socket=str(daemon.socket), paths=paths, daemon=daemon,
                                reference=reference_samples(paths))
    daemon.stop()


def client_streams(socket, dataset, epoch, workers, num_workers, rank=0, world_size=1, seed=0):
    """The daemon's streams, read with the plain client: whole samples, per stream."""
    with shardd.Client(socket) as c:
        return [list(c.stream(dataset, epoch=epoch, rank=rank, world_size=world_size, seed=seed,
                              worker=w, num_workers=num_workers))
                for w in workers]


def round_robin(streams):
    """One of stream 0, one of stream 1, ...; a stream that ended is passed over."""
    return [s[j] for j in range(max(map(len, streams), default=0)) for s in streams if j < len(s)]


def expected(served, dataset, epochs, num_streams, seed=0, rank=0, world_size=1):
    return [sample for epoch in epochs for sample in round_robin(client_streams(
        served.socket, dataset, epoch, range(num_streams), num_streams, rank, world_size, seed))]


def keys(samples):
    return [s["__key__"] for s in samples]


@pytest.mark.parametrize("dataset", ["exact", "plain"])
@pytest.mark.parametrize("num_streams", [1, 3])
def test_full_read_equals_the_plain_clients_streams(served, dataset, num_streams):
    ds = sg.ShardDataset(dataset, socket=served.socket, rank=0, world_size=1, seed=5,
                         num_epochs=2, num_streams=num_streams)
    got = list(ds)
    want = expected(served, dataset, [0, 1], num_streams, seed=5)
    assert got == want  # whole samples: keys, URLs and every field's bytes
    # Each epoch: every sample once (less the few a manifest's equal streams drop), byte for
    # byte as webdataset reads it.
    epoch0 = expected(served, dataset, [0], num_streams, seed=5)
    assert len(set(keys(epoch0))) == len(epoch0) > len(served.reference) - num_streams - 1
    if dataset == "plain":
        assert sorted(keys(epoch0)) == sorted(served.reference)
    for s in got:
        assert {k: v for k, v in s.items() if not k.startswith("__")} == served.reference[s["__key__"]]
    # The same again: deterministic whatever the threads' timing.
    assert keys(ds) == keys(want)


def take(it, n):
    return [next(it) for _ in range(n)]


@pytest.mark.parametrize("dataset", ["exact", "plain"])
def test_resume_at_any_cut_is_exact_through_json(served, dataset, caplog):
    def make():
        return sg.ShardDataset(dataset, socket=served.socket, rank=0, world_size=1, seed=2,
                               epoch=3, num_epochs=2, num_streams=3)

    full = keys(make())
    epoch_len = len(keys(sg.ShardDataset(dataset, socket=served.socket, rank=0, world_size=1,
                                         seed=2, epoch=3, num_epochs=1, num_streams=3)))
    assert 0 < epoch_len < len(full)
    for cut in sorted({0, 1, 2, 37, epoch_len - 1, epoch_len, epoch_len + 1, epoch_len + 40,
                       len(full) - 1, len(full)}):
        it = iter(make())
        head = keys(take(it, cut))
        state = json.loads(json.dumps(it.get_state()))
        assert len(json.dumps(state)) < 1000, state  # small: positions, not samples
        it.close()
        resumed = iter(make())
        resumed.set_state(state)
        assert head + keys(resumed) == full, f"cut {cut}"
        assert resumed.get_state()["epoch"] == 5  # past the last epoch: nothing more
        assert list(resumed) == []
    # Closing an iterator mid-stream cuts its connections quietly: no reconnect, no warning.
    assert [r for r in caplog.records if r.name == "shardd"] == []


def test_state_of_another_stream_layout_is_refused(served):
    it = iter(sg.ShardDataset("exact", socket=served.socket, rank=0, world_size=1, num_streams=2))
    next(it)
    state = it.get_state()
    other = iter(sg.ShardDataset("exact", socket=served.socket, rank=0, world_size=1, num_streams=3))
    with pytest.raises(ValueError, match=r"cannot resume exactly: .*\(num_workers differs\)"):
        other.set_state(state)
    with pytest.raises(ValueError, match="not a shardd.grain state"):
        other.set_state({"position": 3})


JAX_TOPOLOGY = """
import sys, jax, shardd.grain as sg
ds = sg.ShardDataset("exact", socket=sys.argv[1])
print(ds.rank, ds.world_size, jax.process_index(), jax.process_count())
"""


def test_rank_and_world_size_default_to_jax(served):
    # In a process of its own: JAX's runtime threads must not live in pytest's process, which
    # forks after this test (JAX warns that a fork may deadlock) and once aborted at exit.
    run = subprocess.run([sys.executable, "-c", JAX_TOPOLOGY, served.socket], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1].split() == ["0", "1", "0", "1"]


def test_grain_stages_compose_and_resume_exactly(served):
    """map, filter and batch on top; the state of the batched iterator resumes at batch
    boundaries (batch takes no sample past its own)."""
    def pipeline():
        ds = sg.ShardDataset("plain", socket=served.socket, rank=0, world_size=1, num_streams=2)
        return (ds.filter(lambda s: "json" not in s)
                  .map(lambda s: {"key": np.asarray(s["__key__"].encode()),
                                  "cls": np.int32(int(s["cls"]))})
                  .batch(6))

    want = [s for s in expected(served, "plain", [0], 2) if "json" not in s]
    batches = list(pipeline())
    assert [k.decode() for b in batches for k in b["key"]] == keys(want)
    assert [int(c) for b in batches for c in b["cls"]] == [int(s["cls"]) for s in want]
    it = iter(pipeline())
    head = take(it, 7)
    state = json.loads(json.dumps(it.get_state()))
    resumed = iter(pipeline())
    resumed.set_state(state)
    rest = list(resumed)
    assert [k for b in head + rest for k in b["key"]] == [k for b in batches for k in b["key"]]


def test_mp_prefetch_workers_each_read_their_own_streams(served):
    """Each of mp_prefetch's worker processes reads its own streams of the rank (set_slice):
    2 workers x 2 streams = 4 streams, each sample once, in an order fixed by grain's
    round-robin over the workers and ours over each worker's streams; and its state resumes."""
    from absl import flags

    # Grain reads absl flags in mp_prefetch; a program not started by absl.app parses none.
    flags.FLAGS.mark_as_parsed()
    options = grain.MultiprocessingOptions(num_workers=2, per_worker_buffer_size=4)

    def make():
        ds = sg.ShardDataset("exact", socket=served.socket, rank=0, world_size=1, seed=1,
                             num_streams=2)
        return ds.mp_prefetch(options)

    streams = client_streams(served.socket, "exact", 0, range(4), 4, seed=1)
    per_worker = [round_robin([streams[w], streams[w + 2]]) for w in range(2)]
    it = iter(make())
    got = keys(it)
    it.close()
    assert got == keys(round_robin(per_worker))
    it = iter(make())
    head = keys(take(it, 45))
    state = json.loads(json.dumps(it.get_state()))
    it.close()
    resumed = iter(make())
    resumed.set_state(state)
    rest = keys(resumed)
    resumed.close()
    assert head + rest == got


# -- the example ---------------------------------------------------------------------------------


def example(served, workdir, *extra):
    workdir.mkdir(exist_ok=True)
    argv = [sys.executable, str(EXAMPLES / "train_jax_tiny.py"), "--socket", served.socket,
            "--dataset", "tiny", "--epochs", "2", "--batch-size", "16", "--streams", "2",
            "--checkpoint-every", "5", "--checkpoint", str(workdir / "ckpt"),
            "--log", str(workdir / "samples.log"), "--final", str(workdir / "final.npz"), *extra]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc):
    out, err = proc.communicate(timeout=600)
    return proc.returncode, out, err


def test_example_killed_mid_epoch_resumes_into_the_same_run(served, tmp_path):
    """Uninterrupted, and killed 3 steps after its orbax checkpoint at step 25 (epoch 1, step
    5 of 20), then run again: the same samples in the same order, and bit-identical final
    parameters. The two first runs overlap (2 cores)."""
    whole = example(served, tmp_path / "whole")
    killed = example(served, tmp_path / "killed", "--kill-at-step", "28")
    code, out, err = finish(whole)
    assert code == 0, err
    log = (tmp_path / "whole" / "samples.log").read_text().splitlines()
    assert len(log) == 2 * 320  # two epochs of the tiny dataset's 320 samples, none dropped
    epoch0, epoch1 = [l.split()[1] for l in log[:320]], [l.split()[1] for l in log[320:]]
    assert sorted(epoch0) == sorted(epoch1) and epoch0 != epoch1
    assert [int(l.split()[0]) for l in log] == [i // 16 for i in range(640)]
    code, out, err = finish(killed)
    assert code == -signal.SIGKILL, err
    assert not (tmp_path / "killed" / "final.npz").exists()
    assert len((tmp_path / "killed" / "samples.log").read_text().splitlines()) == 28 * 16
    code, out, err = finish(example(served, tmp_path / "killed"))
    assert code == 0, err
    assert "resuming at step 25" in out, out
    assert (tmp_path / "killed" / "samples.log").read_text().splitlines() == log
    want, got = np.load(tmp_path / "whole" / "final.npz"), np.load(tmp_path / "killed" / "final.npz")
    assert sorted(want.files) == sorted(got.files) == ["b1", "b2", "w1", "w2"]
    for name in want.files:
        assert want[name].tobytes() == got[name].tobytes(), name
    # Grain's orbax handler wrote this process's iterator state as JSON, the shardd state.
    saved = sorted((tmp_path / "killed" / "ckpt").glob("*/data/process_0-of-1.json"))
    state = json.loads(saved[-1].read_text())
    assert state["shardd"] == 1 and state["dataset"] == "tiny" and len(state["positions"]) == 2


def test_errors_come_from_next_in_their_place(served, tmp_path):
    it = iter(sg.ShardDataset("nope", socket=served.socket, rank=0, world_size=1, num_streams=2))
    with pytest.raises(shardd.DaemonError, match='unknown dataset "nope"') as e:
        next(it)
    assert e.value.code == "unknown_dataset"
    it.close()
    it = iter(sg.ShardDataset("exact", socket=tmp_path / "none.sock", rank=0, world_size=1,
                              reconnect_timeout=0))
    with pytest.raises(shardd.UnavailableError, match=r"no shardd daemon at .*none.sock .*: "
                       r"start `shardd serve`, or pass ShardDataset\(socket=\.\.\.\)"):
        next(it)
    it.close()
