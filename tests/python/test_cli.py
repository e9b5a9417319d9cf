"""The command line as users and scripts type it."""

import signal
import subprocess

import shardd

from conftest import SHARDD, gcs_config


def test_demo_verifies_an_epoch():
    out = subprocess.run([SHARDD, "demo"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("demo: 16 shards x 250 samples")
    assert lines[1].startswith("epoch 0: 4 ranks x 2 workers, 4000 samples")
    assert "samples/s" in lines[1] and "MB/s" in lines[1]
    assert lines[2:] == [
        "verified: every sample exactly once, every field byte for byte",
        "verified: re-reading epoch 0 gives the same order in every stream",
        "verified: epoch 1 has a different order",
    ]


def test_sigint_stops_cleanly(make_daemon, fake_gcs):
    d = make_daemon(gcs_config(fake_gcs))
    with shardd.Client(d.socket) as c:
        assert len(list(c.stream("train", epoch=0, rank=0, world_size=1))) > 0
    d.stop(signal.SIGINT)  # asserts exit code 0 and the socket file removed


def test_check_shows_its_progress_over_the_shards(fake_gcs, train_paths, tmp_path):
    """`check` asks the store for every shard and says how far it got (a bar on a terminal,
    lines otherwise), then the totals."""
    config = tmp_path / "c.toml"
    config.write_text(
        f'[gcs]\nendpoint = "{fake_gcs}"\nanonymous = true\n'
        f'[datasets.train]\nshards = "gs://bkt/train/train-{{000000..{len(train_paths) - 1:06d}}}.tar"\n'
    )
    out = subprocess.run([SHARDD, "check", "--config", str(config)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    total = sum(p.stat().st_size for p in train_paths)
    largest = max(train_paths, key=lambda p: p.stat().st_size)
    assert out.stdout.splitlines()[-1] == (
        f"dataset train: {total} bytes in the store; the largest shard is gs://bkt/train/{largest.name} "
        f"({largest.stat().st_size} bytes)"
    )
    last = out.stderr.splitlines()[-1]
    assert last.startswith(f"train: {len(train_paths)}/{len(train_paths)} shards done, {total / 1e6:.1f} MB found"), last
