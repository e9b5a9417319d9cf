"""shardd.torch end to end: real torch (CPU) DataLoaders and torchdata's StatefulDataLoader over
the real daemon binary, shards written by webdataset, a manifest made by `shardd index`.
Orders are asserted exactly: a DataLoader with K workers deals batch i to worker i mod K, so
the expected order is built from the daemon's own streams, read with shardd.Client."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import types

import pytest
import shardd
import torch
import torch.utils.data
import webdataset as wds
from torchdata.stateful_dataloader import StatefulDataLoader

import shardd.torch as st
from conftest import DEADLINE, Daemon, reference_samples, serve_train_and_tiny, wait_for

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
BATCH = 7  # divides no stream length here: every stream ends with a partial batch



@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One daemon for the module: the train shards (webdataset-written, local files) as
    `exact` (with a manifest) and `plain` (without), and the example's tiny image dataset."""
    root = tmp_path_factory.mktemp("torch")
    daemon, paths, config = serve_train_and_tiny(root)
    yield types.SimpleNamespace(socket=str(daemon.socket), paths=paths, daemon=daemon,
                                reference=reference_samples(paths), config=config)
    daemon.stop()


def streams(socket, dataset, epoch, num_workers, rank=0, world_size=1, seed=0):
    """The daemon's streams of one rank, read directly: keys per worker."""
    with shardd.Client(socket) as c:
        return [[s["__key__"] for s in c.stream(dataset, epoch=epoch, rank=rank,
                                                world_size=world_size, seed=seed, worker=w,
                                                num_workers=num_workers)]
                for w in range(num_workers)]


def loader_order(per_worker, batch_size):
    """What a DataLoader yields from per-worker streams: batch i from worker i mod K, workers
    that ran out skipped (their last batch partial)."""
    batches = [[keys[i:i + batch_size] for i in range(0, len(keys), batch_size)] for keys in per_worker]
    return [b[j] for j in range(max(map(len, batches))) for b in batches if j < len(b)]


def keys_of(batch):
    return [s["__key__"] for s in batch]


def make_loader(ds, num_workers=0, stateful=False, batch_size=BATCH, **kw):
    cls = StatefulDataLoader if stateful else torch.utils.data.DataLoader
    return cls(ds, batch_size=batch_size, num_workers=num_workers, collate_fn=keys_of, **kw)


def flat(batches):
    return [k for b in batches for k in b]


# -- workers, ranks, epochs -------------------------------------------------------------------


@pytest.mark.parametrize("dataset", ["exact", "plain"])
@pytest.mark.parametrize("num_workers", [0, 2, 3])
def test_a_loader_reads_the_rank_once_in_the_daemons_order(served, dataset, num_workers):
    ds = st.ShardDataset(dataset, socket=served.socket, seed=4)
    ds.set_epoch(2)
    got = list(make_loader(ds, num_workers))
    per_worker = streams(served.socket, dataset, 2, max(1, num_workers), seed=4)
    assert got == loader_order(per_worker, BATCH)
    keys = flat(got)
    assert len(keys) == len(set(keys)), "a sample twice"
    if dataset == "plain":
        assert set(keys) == set(served.reference)  # shard mode, one rank: every sample
    else:
        assert len({len(k) for k in per_worker}) == 1, "manifest streams are equal"
        assert set(keys) <= set(served.reference)
        assert len(served.reference) - len(keys) < max(1, num_workers) + 1  # the drop bound


def test_samples_are_webdataset_shaped_and_byte_exact(served):
    ds = st.ShardDataset("plain", socket=served.socket)
    samples = list(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2))
    assert len(samples) == len(served.reference)
    for s in samples:
        assert s["__url__"] in {str(p) for p in served.paths}
        assert {k: v for k, v in s.items() if not k.startswith("__")} == served.reference[s["__key__"]]


def test_zero_copy_samples_are_byte_exact(served):
    """ShardDataset(zero_copy=True): the same samples, large fields as read-only memoryviews
    (in the loader's own process: a memoryview cannot be pickled to it from a worker)."""
    ds = st.ShardDataset("plain", socket=served.socket, zero_copy=True)
    # torch's default conversion takes a memoryview for a sequence (a list of ints): the
    # trainer's own collate_fn must take the views (here: as they are).
    samples = list(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0,
                                               collate_fn=lambda s: s))
    assert len(samples) == len(served.reference)
    views = 0
    for s in samples:
        fields = {k: v for k, v in s.items() if not k.startswith("__")}
        views += sum(isinstance(v, memoryview) for v in fields.values())
        assert {k: bytes(v) for k, v in fields.items()} == served.reference[s["__key__"]]
    assert views == sum(len(v) > 4096 for r in served.reference.values() for v in r.values())

def test_set_epoch_reaches_persistent_workers(served):
    ds = st.ShardDataset("exact", socket=served.socket, seed=1)
    loader = make_loader(ds, 2, persistent_workers=True)
    got = {}
    for epoch in (0, 1, 5, 1):
        ds.set_epoch(epoch)
        got.setdefault(epoch, []).append(list(loader))
        # What a fresh read of that epoch's streams gives: the epoch reached the workers.
        assert got[epoch][-1] == loader_order(streams(served.socket, "exact", epoch, 2, seed=1), BATCH)
    # Each epoch its own order (a daemon or worker that ignored the epoch would read one
    # order three times), and epoch 1 read again is epoch 1 (determinism).
    orders = [flat(got[epoch][0]) for epoch in (0, 1, 5)]
    assert all(sorted(o) == sorted(orders[0]) for o in orders), "every epoch the same samples"
    assert len({tuple(o) for o in orders}) == 3, "two epochs in the same order"
    assert got[1][0] == got[1][1]


def test_epoch_length_is_exact_with_a_manifest(served):
    ds = st.ShardDataset("exact", socket=served.socket)
    for k in (0, 2, 3):
        for drop_last in (False, True):
            got = list(make_loader(ds, k, drop_last=drop_last))
            assert ds.epoch_length(k, BATCH, drop_last) == len(got)
        assert ds.epoch_length(k) == sum(map(len, streams(served.socket, "exact", 0, max(1, k))))
    assert st.ShardDataset("plain", socket=served.socket).epoch_length(2, BATCH) is None


def test_plan_checks_and_lengths_open_no_stream(served, tmp_path):
    """epoch_length and verify_plan (set_epoch's check) ask with plan requests: the daemon
    registers no schedule and loads nothing for them (a probe stream's schedule would linger
    for minutes and skew prefetching), and they get the START the real stream gets."""
    d = Daemon(tmp_path, served.config)
    try:
        ds = st.ShardDataset("exact", socket=str(d.socket), seed=2)
        ds.set_epoch(3)
        length = ds.epoch_length(2)
        fingerprint = ds.verify_plan()
        planned = shardd.Client(d.socket).plan("exact", epoch=3, rank=0, world_size=1, seed=2,
                                               worker=1, num_workers=2)
        # Positive events first, then the "nothing" checks. (1) The daemon has ended every
        # connection the checks opened: a stream among them would be counted by then. (2) A
        # stream opened after them, of another dataset (tiny: other shards), was read to its
        # END and counted: a schedule the checks registered would have had that whole run to
        # get its first shards loaded (the prefetcher walks every schedule round-robin).
        wait_for(lambda: d.metric("shardd_connections_active") == 0, "the checks' connections to end")
        assert d.metric("shardd_streams_total") == 0
        with shardd.Client(d.socket) as c:
            tiny = c.stream("tiny", epoch=0, rank=0, world_size=1)
            samples = list(tiny)
            assert len(samples) == tiny.samples > 0
        wait_for(lambda: d.metric('shardd_streams_total{dataset="tiny",outcome="completed"}') == 1
                 and d.metric("shardd_downloads_active") == 0, "the tiny stream to be counted")
        # The tiny shards, no more.
        assert d.metric("shardd_shard_fetches_total") == len({s["__url__"] for s in samples})
        assert d.metric("shardd_streams_total") == 1
        with shardd.Client(d.socket) as c:
            whole = c.stream("exact", epoch=3, rank=0, world_size=1, seed=2)
            one_of_two = c.stream("exact", epoch=3, rank=0, world_size=1, seed=2, worker=1, num_workers=2)
            assert fingerprint == whole.fingerprint
            assert length == 2 * one_of_two.samples == 2 * len(list(one_of_two))
            assert planned == {"dataset": "exact", "shards": one_of_two.shards, "host": 0, "hosts": 1,
                               "samples": one_of_two.samples, "position": 0,
                               "dropped": one_of_two.dropped, "fingerprint": one_of_two.fingerprint}
    finally:
        d.stop()


DIST_SCRIPT = r"""
import json, sys
import torch, torch.distributed as dist, torch.utils.data
import shardd.torch as st


def main():
    rank, store, socket = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
    out = {}
    ds = st.ShardDataset("exact", socket=socket, seed=7)
    out["topology"] = [ds.rank, ds.world_size]
    # Spawned workers: torch.distributed is not initialised in them; the rank comes with the
    # pickled dataset, the epoch through shared memory (persistent workers).
    # (One worker per rank: each spawned process imports torch again, on 2 cores.)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=1,
                                         multiprocessing_context="spawn", persistent_workers=True)
    out["keys"] = {}
    for epoch in (1, 2):
        ds.set_epoch(epoch)
        out["keys"][epoch] = [s["__key__"] for s in loader]
    # A rank that runs another seed: set_epoch's all-gather catches it on every rank.
    bad = st.ShardDataset("exact", socket=socket, seed=7 + rank)
    try:
        bad.set_epoch(1)
    except st.PlanMismatch as e:
        out["error"] = str(e)
    # Two processes that claim one rank.
    try:
        st.ShardDataset("exact", socket=socket, rank=0, world_size=2).set_epoch(1)
    except st.PlanMismatch as e:
        out["duplicate"] = str(e)
    # A rank whose daemon refuses: the other rank does not hang in the all-gather.
    try:
        st.ShardDataset("exact" if rank == 0 else "nope", socket=socket).set_epoch(1)
    except st.PlanMismatch as e:
        out["refused"] = str(e)
    print(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":  # spawned workers import this file
    main()
"""


def test_ranks_come_from_torch_distributed_even_in_spawned_workers_and_plans_are_compared(served, tmp_path):
    script = tmp_path / "dist.py"
    script.write_text(DIST_SCRIPT)
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(tmp_path / "store"), served.socket],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    keys = {1: [], 2: []}
    for rank, out in enumerate(outs):
        assert out["topology"] == [rank, 2]
        for epoch in (1, 2):
            want = streams(served.socket, "exact", epoch, 1, rank=rank, world_size=2, seed=7)
            assert out["keys"][str(epoch)] == want[0], (rank, epoch)
            keys[epoch] += out["keys"][str(epoch)]
        assert out["error"].startswith("the ranks of this job disagree on what epoch 1 reads: plan "), out["error"]
        assert "(epoch 1, seed 7, world_size 2, dataset 'exact') on rank 0;" in out["error"]
        assert "(epoch 1, seed 8, world_size 2, dataset 'exact') on rank 1." in out["error"]
        assert out["duplicate"].startswith(
            "the processes of this job claim ranks [0, 0] of world_size 2: each must read its own rank")
        assert out["refused"].startswith(
            "ranks could not open their streams of epoch 1 of dataset ")
        assert "rank 1: DaemonError: unknown dataset \"nope\"" in out["refused"], out["refused"]
    for epoch_keys in keys.values():  # the two ranks split the epoch (a few drops)
        assert len(epoch_keys) == len(set(epoch_keys)) and len(served.reference) - len(epoch_keys) < 5
    assert keys[1] != keys[2]


# -- exact resume ----------------------------------------------------------------------------


def take(it, n):
    return [next(it) for _ in range(n)]


@pytest.mark.parametrize("cut", [0, 1, 6, 13, 40, "last", "end"])
@pytest.mark.parametrize("options", [
    {"num_workers": 2},
    {"num_workers": 2, "persistent_workers": True, "snapshot_every_n_steps": 4},
    {"num_workers": 0},
], ids=["2-workers", "2-persistent-snapshot4", "main-process"])
def test_stateful_dataloader_resumes_exactly(served, cut, options):
    def loader(epoch):
        ds = st.ShardDataset("exact", socket=served.socket, seed=3)
        ds.set_epoch(epoch)
        return ds, make_loader(ds, stateful=True, **options)

    def order(epoch):
        return loader_order(streams(served.socket, "exact", epoch, max(1, options["num_workers"]), seed=3), BATCH)

    full = list(loader(1)[1])
    assert full == order(1) and len(full) > 40
    cut = {"last": len(full) - 1, "end": len(full)}.get(cut, cut)
    ds, first = loader(1)
    it = iter(first)
    head = take(it, cut)
    state = first.state_dict()
    del it, first

    # What a new process does: the epoch from the state, then the state. (Saved after the
    # last batch but before the loader stopped, the rest of epoch 1 is empty.)
    assert st.resume_epoch(state) == 1
    ds, second = loader(1)
    second.load_state_dict(state)
    assert head + list(second) == full
    ds.set_epoch(2)  # the same loader goes on to the next epoch from its start
    assert list(second) == order(2)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_state_saved_after_the_epoch_resumes_into_the_next(served, num_workers):
    ds = st.ShardDataset("exact", socket=served.socket)
    loader = make_loader(ds, num_workers, stateful=True)
    list(loader)
    state = loader.state_dict()
    assert st.resume_epoch(state) == 1

    ds2 = st.ShardDataset("exact", socket=served.socket)
    loader2 = make_loader(ds2, num_workers, stateful=True)
    loader2.load_state_dict(state)
    ds2.set_epoch(st.resume_epoch(state))
    assert list(loader2) == loader_order(streams(served.socket, "exact", 1, max(1, num_workers)), BATCH)


@pytest.mark.parametrize("dataset", ["exact", "plain"])
def test_plain_dataloader_without_workers_resumes_from_state_dict(served, dataset):
    ds = st.ShardDataset(dataset, socket=served.socket, seed=5)
    full = list(make_loader(ds, 0))
    for cut in (0, 3, len(full) - 1, len(full)):
        ds = st.ShardDataset(dataset, socket=served.socket, seed=5)
        it = iter(make_loader(ds, 0))
        head = take(it, cut)
        state = ds.state_dict()
        assert state["position"] == len(flat(head))
        assert st.resume_epoch(state) == (1 if cut == len(full) else 0)  # the last batch is partial
        del it
        ds = st.ShardDataset(dataset, socket=served.socket, seed=5)
        ds.load_state_dict(json.loads(json.dumps(state)))  # a state survives JSON
        assert head + list(make_loader(ds, 0)) == full, cut


@pytest.mark.parametrize("num_workers", [0, 2, 3])
def test_plain_dataloader_resumes_exactly_after_a_batch_count(served, num_workers):
    def dataset():
        ds = st.ShardDataset("exact", socket=served.socket, seed=6)
        ds.set_epoch(4)
        return ds

    full = list(make_loader(dataset(), num_workers))
    for cut in sorted({0, 1, 5, 10, len(full) - 2, len(full) - 1, len(full)}):
        ds = dataset()
        ds.skip(batches=cut, batch_size=BATCH)
        assert full[:cut] + list(make_loader(ds, num_workers)) == full, cut


def test_errors_name_what_is_wrong(served, tmp_path):
    # Reconnecting off: at once (test_reconnect.py has the wait for a restarting daemon).
    ds = st.ShardDataset("exact", socket=tmp_path / "none.sock", reconnect_timeout=0)
    with pytest.raises(shardd.UnavailableError) as e:
        next(iter(ds))
    assert str(e.value) == (
        f"no shardd daemon at {tmp_path}/none.sock (No such file or directory): start `shardd "
        f"serve`, or pass ShardDataset(socket=...) or set SHARDD_SOCKET to its server.socket")
    assert isinstance(e.value, ConnectionError)
    with pytest.raises(shardd.DaemonError, match='unknown dataset "nope"'):
        next(iter(st.ShardDataset("nope", socket=served.socket)))
    # From a worker, torch re-raises the exception type with the worker's traceback as its
    # message (DaemonError takes a lone message for that; the code does not travel).
    with pytest.raises(shardd.DaemonError, match='unknown dataset "nope"'):
        list(make_loader(st.ShardDataset("nope", socket=served.socket), 2))
    # PlanMismatch (here its PlanChangedError) comes back as itself.
    ds = st.ShardDataset("exact", socket=served.socket)
    ds.load_state_dict(dict(ds.state_dict(), position=3, fingerprint="0123456789abcdef"))
    with pytest.raises(st.PlanChangedError, match="cannot resume epoch 0 .* saved on plan 0123456789abcdef"):
        list(make_loader(ds, 1))
    assert st.PlanMismatch is shardd.PlanMismatch and issubclass(st.PlanMismatch, shardd.Error)


def test_skip_past_the_last_partial_batch_is_empty_without_a_manifest(served):
    """Without a manifest the daemon refuses a start past the end only after reading the
    stream; a batch count at or past the last, partial batch is still an empty epoch."""
    full = list(make_loader(st.ShardDataset("plain", socket=served.socket), 0))
    for cut in (len(full), len(full) + 1):
        ds = st.ShardDataset("plain", socket=served.socket)
        ds.skip(batches=cut, batch_size=BATCH)
        assert list(make_loader(ds, 0)) == [], cut


def test_skip_with_workers_needs_a_manifest(served):
    ds = st.ShardDataset("plain", socket=served.socket)
    ds.skip(batches=3, batch_size=BATCH)
    with pytest.raises(ValueError, match=r"skip\(batches=...\) with 2 DataLoader workers needs streams of known, equal length"):
        list(make_loader(ds, 2))


def test_a_state_for_another_stream_or_epoch_is_refused(served):
    ds = st.ShardDataset("exact", socket=served.socket)
    loader = make_loader(ds, 2, stateful=True)
    it = iter(loader)
    take(it, 3)
    worker_state = next(_shardd_states(loader.state_dict()))
    del it, loader

    other = st.ShardDataset("exact", socket=served.socket)
    other.load_state_dict(worker_state)
    with pytest.raises(ValueError, match=r"worker 0 of 2.*this stream is dataset 'exact' seed 0 rank 0 of 1, worker 0 of 1 \(num_workers differs\)"):
        next(iter(other))

    other = st.ShardDataset("exact", socket=served.socket, epoch=3)
    other.load_state_dict(worker_state)
    with pytest.raises(ValueError, match=r"in the middle of epoch 0 .* set to epoch 3: call set_epoch\(0\)"):
        next(iter(other))

    changed = dict(worker_state, fingerprint="0123456789abcdef", num_workers=1, worker=0)
    other = st.ShardDataset("exact", socket=served.socket)
    other.load_state_dict(changed)
    with pytest.raises(st.PlanMismatch, match="cannot resume epoch 0 of dataset 'exact' exactly: the state was saved on plan 0123456789abcdef"):
        next(iter(other))


def _shardd_states(x):
    if isinstance(x, dict):
        if x.get("shardd") == 1:
            yield x
        else:
            for v in x.values():
                yield from _shardd_states(v)


# -- fork ----------------------------------------------------------------------------------------


def test_an_iterator_inherited_across_fork_refuses(served):
    import multiprocessing

    ds = st.ShardDataset("plain", socket=served.socket)
    it = iter(ds)
    first = [next(it)["__key__"] for _ in range(3)]
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()

    def child():
        try:
            next(it)
            queue.put("read a sample")
        except st.ForkedStreamError as e:
            queue.put(str(e))

    p = ctx.Process(target=child)
    p.start()
    message = queue.get(timeout=DEADLINE)
    p.join(DEADLINE)
    assert message.startswith(f"this shardd stream iterator was created in process {os.getpid()} "
                              f"and inherited across fork by process {p.pid}: iterate"), message
    # DataLoader workers forked now inherit the open stream too; each opens its own.
    assert list(make_loader(ds, 2)) == loader_order(streams(served.socket, "plain", 0, 2), BATCH)
    # The parent's stream is untouched by the children closing their copies of the socket.
    rest = [s["__key__"] for s in it]
    assert first + rest == streams(served.socket, "plain", 0, 1)[0]


# -- webdataset stages ---------------------------------------------------------------------------


def wds_reference(paths, *stages):
    """webdataset's own pipeline over the same tars: {key: output}."""
    pipeline = wds.DataPipeline(wds.SimpleShardList([str(p) for p in paths]), wds.tarfile_to_samples(),
                                *stages)
    return {out[0]: out[1:] for out in pipeline}


def test_webdataset_stages_run_on_top(served):
    stages = (wds.decode(), wds.to_tuple("__key__", "cls", "seg.png", "json;cls"))
    want = wds_reference(served.paths, *stages)
    # As webdataset's DataPipeline source, in DataLoader workers, batched by webdataset.
    ds = st.ShardDataset("plain", socket=served.socket)
    pipeline = wds.DataPipeline(ds, *stages, wds.batched(5))
    batches = list(torch.utils.data.DataLoader(pipeline, batch_size=None, num_workers=2))
    got = {}
    for keys, classes, segs, extra in batches:
        assert len(keys) <= 5
        for k, c, s, e in zip(keys, classes, segs, extra):
            got[k] = (int(c), s, e)
    assert got == {k: (v[0], v[1], v[2]) for k, v in want.items()}
    # The same order as the raw stream.
    assert [list(b[0]) for b in batches] == loader_order(streams(served.socket, "plain", 0, 2), 5)


def test_composed_stages_resume_exactly_with_stateful_dataloader(served):
    """1:1 stages (decode, to_tuple, map) keep the resume exact; batching stays in the loader
    (webdataset's batched() reads one sample past each full batch, see docs/pytorch.md)."""
    def loader():
        ds = st.ShardDataset("exact", socket=served.socket, seed=8).compose(
            wds.decode(), wds.to_tuple("__key__", "cls"), wds.map_tuple(None, lambda c: c * 10))
        return StatefulDataLoader(ds, batch_size=4, num_workers=2)

    def batches(it):
        out = []
        for keys, classes in it:
            assert [int(c) for c in classes] == [int(served.reference[k]["cls"]) * 10 for k in keys]
            out.append(list(keys))
        return out

    full = batches(loader())
    assert full == loader_order(streams(served.socket, "exact", 0, 2, seed=8), 4)
    first = loader()
    it = iter(first)
    head = batches(take(it, 9))
    state = first.state_dict()
    del it, first
    second = loader()
    second.load_state_dict(state)
    assert head + batches(second) == full


# -- the example ---------------------------------------------------------------------------------


def example(served, workdir, *extra, loader="stateful"):
    """Starts the example in its own session, so that a kill takes its DataLoader workers with
    it, like a preempted machine."""
    workdir.mkdir(exist_ok=True)
    argv = [sys.executable, str(EXAMPLES / "train_resnet_tiny.py"), "--socket", served.socket,
            "--dataset", "tiny", "--epochs", "2", "--batch-size", "16", "--workers", "2",
            "--loader", loader, "--checkpoint-every", "5",
            "--checkpoint", str(workdir / "ckpt.pt"), "--log", str(workdir / "samples.log"),
            "--final", str(workdir / "final.pt"), *extra]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def finish(proc):
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


def test_example_killed_mid_epoch_resumes_into_the_same_run(served, tmp_path):
    """Uninterrupted, and killed (SIGKILL to the trainer and its workers) 3 steps after its
    checkpoint at step 25 (epoch 1, step 5), then run again: the same samples in the same
    order, and bit-identical weights, with either loader. The runs overlap (2 cores)."""
    whole = example(served, tmp_path / "whole")
    killed = {loader: example(served, tmp_path / loader, "--kill-at-step", "28", loader=loader)
              for loader in ("stateful", "plain")}
    code, out, err = finish(whole)
    assert code == 0, err
    log = (tmp_path / "whole" / "samples.log").read_text().splitlines()
    assert len(log) == 2 * 320  # two epochs of the tiny dataset's 320 samples, none dropped
    assert [l.split()[2] for l in log[:320]] != [l.split()[2] for l in log[320:]]
    weights = torch.load(tmp_path / "whole" / "final.pt")
    for loader, proc in killed.items():
        code, out, err = finish(proc)
        assert code == -signal.SIGKILL, err
        assert not (tmp_path / loader / "final.pt").exists()
    resumed = {loader: example(served, tmp_path / loader, loader=loader) for loader in killed}
    for loader, proc in resumed.items():
        code, out, err = finish(proc)
        assert code == 0, err
        assert "resuming at epoch 1, step 5" in out, out
        assert (tmp_path / loader / "samples.log").read_text().splitlines() == log, loader
        got = torch.load(tmp_path / loader / "final.pt")
        assert got.keys() == weights.keys()
        assert all(torch.equal(got[k], weights[k]) for k in got), f"{loader}: other weights"
