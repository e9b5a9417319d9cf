"""The metrics endpoint, checked by the real promtool."""

import shutil
import subprocess

import shardd

from conftest import gcs_config


def test_metrics_pass_promtool_and_count_what_was_served(make_daemon, fake_gcs):
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: run scripts/test.sh, which installs Debian's prometheus"
    d = make_daemon(gcs_config(fake_gcs))
    with shardd.Client(d.socket) as c:
        samples = list(c.stream("train", epoch=0, rank=0, world_size=1))
    text = d.metrics()
    check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert check.returncode == 0 and check.stdout == "" and check.stderr == "", check.stdout + check.stderr
    assert d.metric("shardd_samples_sent_total") == len(samples)
    assert d.metric("shardd_shard_fetches_total") == 12
    assert d.metric('shardd_streams_total{outcome="completed"}') == 1
    assert d.metric("shardd_cache_bytes") == 0  # every shard released after the stream
