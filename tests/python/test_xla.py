"""shardd.torch under PyTorch/XLA: replicas started by xmp.spawn that pass no rank take theirs
from torch_xla's runtime (issue 23: they got world size 1 and each read the whole epoch).
Real torch_xla on CPU (PJRT_DEVICE=CPU; scripts/test.sh installs it from
tests/requirements-torch.txt), in a process of its own (xmp.spawn), against the real
daemon; the shards are written by webdataset and indexed by `shardd index`."""

import json
import os
import subprocess
import sys

import pytest
import webdataset as wds

import shardd
from conftest import index

REPLICAS = 4  # CPU_NUM_DEVICES: on CPU, xmp.spawn runs one replica per device
WORKERS = 1  # a DataLoader worker per replica: it must read the rank of its trainer
SHARDS, PER_SHARD = 8, 12  # 96 samples: 24 for each replica's stream, none dropped


REPLICA_SCRIPT = r"""
import json, pathlib, sys
import torch, torch.utils.data
import shardd.torch as st


def indices(samples):  # a stage, in the DataLoader workers: "xla/00042" -> 42
    for s in samples:
        yield int(s["__key__"].rsplit("/", 1)[1])


def replica(index, socket, out):
    import torch_xla
    import torch_xla.distributed.parallel_loader as pl
    import torch_xla.runtime as xr

    ds = st.ShardDataset("xla", socket=socket, seed=3).compose(indices)  # no rank given
    topology = [ds.rank, ds.world_size]  # as made, before set_epoch could fill it in
    ds.set_epoch(1)
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=int(sys.argv[3]))
    device = torch_xla.device()
    samples = []
    for batch in pl.MpDeviceLoader(loader, device):
        assert batch.device == device, (batch.device, device)
        samples += batch.cpu().tolist()
    pathlib.Path(out, f"replica-{index}.json").write_text(json.dumps(dict(
        index=index, xla=[xr.global_ordinal(), xr.world_size()], topology=topology,
        samples=samples)))


if __name__ == "__main__":  # xmp.spawn's process and the DataLoader's spawned workers import this
    import torch_xla.distributed.xla_multiprocessing as xmp

    # Made before the spawn, where torch_xla is imported but its runtime not started: asking it
    # would start it, and xmp.spawn would then refuse ("Runtime is already initialized").
    early = st.ShardDataset("xla", socket=sys.argv[1])
    assert (early.rank, early.world_size) == (0, 1)
    xmp.spawn(replica, args=(sys.argv[1], sys.argv[2]))
"""


@pytest.fixture
def xla_daemon(make_daemon, tmp_path):
    shards = tmp_path / "xla"
    shards.mkdir()
    for s in range(SHARDS):
        with wds.TarWriter(str(shards / f"xla-{s}.tar")) as sink:
            for i in range(s * PER_SHARD, (s + 1) * PER_SHARD):
                sink.write({"__key__": f"xla/{i:05d}", "cls": str(i % 7).encode()})
    pattern = f"{shards}/xla-{{0..{SHARDS - 1}}}.tar"
    manifest = index(pattern, tmp_path / "xla.manifest.json")
    return make_daemon("[host]\nindex = 0\ncount = 1\n"
                       f'[datasets.xla]\nshards = "{pattern}"\nmanifest = "{manifest}"\n'
                       "shuffle_buffer = 10\n")


def test_xmp_spawn_replicas_take_their_rank_from_torch_xla(xla_daemon, tmp_path):
    script = tmp_path / "replicas.py"
    script.write_text(REPLICA_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(REPLICAS)}
    run = subprocess.run([sys.executable, str(script), str(xla_daemon.socket), str(out),
                          str(WORKERS)], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-5000:]
    reports = [json.loads((out / f"replica-{r}.json").read_text()) for r in range(REPLICAS)]

    total = SHARDS * PER_SHARD
    read = [set(r["samples"]) for r in reports]
    counts = [len(r["samples"]) for r in reports]
    assert sum(counts) == total, (
        f"the {REPLICAS} replicas read {' + '.join(map(str, counts))} samples of an epoch of "
        f"{total}; ranks (rank, world_size) as made: {[r['topology'] for r in reports]}")
    assert counts == [total // REPLICAS] * REPLICAS, counts
    assert all(len(s) == n for s, n in zip(read, counts)), "a replica read a sample twice"
    # 96 distinct samples in 96 reads: the replicas' sets are disjoint.
    assert set().union(*read) == set(range(total)), "every sample of the epoch, once"

    for r, report in enumerate(reports):
        ordinal, world = report["xla"]
        assert (report["index"], ordinal, world) == (r, r, REPLICAS)
        assert report["topology"] == [ordinal, world], "the rank is torch_xla's, when made"
        # And it is the daemon's plan for that rank: its streams, split over the workers.
        with shardd.Client(xla_daemon.socket) as c:
            want = [s["__key__"] for w in range(WORKERS)
                    for s in c.stream("xla", epoch=1, rank=r, world_size=REPLICAS, seed=3,
                                      worker=w, num_workers=WORKERS)]
        assert sorted(report["samples"]) == sorted(int(k.rsplit("/", 1)[1]) for k in want)
