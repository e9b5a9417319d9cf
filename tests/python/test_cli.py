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
