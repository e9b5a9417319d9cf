"""The metrics endpoint, checked by the real promtool."""

import pathlib
import re
import shutil
import subprocess

import shardd

from conftest import gcs_config, wait_for


def test_metrics_pass_promtool_and_count_what_was_served(make_daemon, fake_gcs, train_paths):
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: run scripts/test.sh, which installs Debian's prometheus"
    d = make_daemon(gcs_config(fake_gcs))
    with shardd.Client(d.socket) as c:
        samples = list(c.stream("train", epoch=0, rank=0, world_size=1))
    text = d.metrics()
    check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert check.returncode == 0 and check.stdout == "" and check.stderr == "", check.stdout + check.stderr
    assert d.metric('shardd_samples_sent_total{dataset="train"}') == len(samples)
    assert d.metric('shardd_samples_sent_total{dataset="mixed"}') == 0
    assert d.metric('shardd_bytes_sent_total{dataset="train"}') == sum(
        len(s["__key__"]) + sum(len(v) for k, v in s.items() if not k.startswith("__")) for s in samples
    )
    assert d.metric('shardd_first_sample_seconds_count{dataset="train"}') == 1
    assert d.metric("shardd_stream_wait_seconds_total") > 0  # the first shards had to come
    assert d.metric('shardd_build_info{version="0.1.0"}') == 1
    assert d.metric("shardd_process_open_fds") > 5
    assert d.metric("shardd_process_resident_memory_bytes") > 1 << 20
    assert d.metric('shardd_store_request_seconds_count{kind="get"}') == 12
    assert d.metric("shardd_shard_fetches_total") == 12
    # (The daemon counts a stream's outcome after its END.)
    wait_for(lambda: d.metric('shardd_streams_total{dataset="train",outcome="completed"}') == 1,
             "the stream to be counted completed")
    # Every shard stays cached (with its 8 KiB record allowance), none is pinned any more.
    shard_bytes = sum(p.stat().st_size for p in train_paths)
    wait_for(lambda: d.metric("shardd_downloads_active") == 0, "prefetches to end")
    assert d.metric("shardd_cache_resident_bytes") == shard_bytes + 12 * 8192
    assert d.metric("shardd_cache_bytes") == d.metric("shardd_cache_resident_bytes")
    assert d.metric("shardd_cache_pinned_bytes") == 0
    assert d.metric('shardd_store_requests_total{kind="get"}') == 12
    assert d.metric("shardd_cache_misses_total") + d.metric("shardd_cache_hits_total") == 12


def test_status_shows_open_streams_and_readyz_checks_the_store(make_daemon, fake_gcs, cutting_proxy):
    import json
    import os
    import urllib.error
    import urllib.request

    from conftest import SHARDD

    proxy = cutting_proxy()
    d = make_daemon(gcs_config(proxy.endpoint))
    base = f"http://127.0.0.1:{d.metrics_port}"
    with shardd.Client(d.socket) as c:
        stream = c.stream("big", epoch=3, rank=0, world_size=1)
        next(stream)  # then stop reading: the daemon waits on us

        def waiting_on_client():
            with urllib.request.urlopen(base + "/status", timeout=5) as r:
                s = json.loads(r.read())
            return s if s["streams"] and s["streams"][0]["waiting_on"] == "client" else None

        s = wait_for(waiting_on_client, "the stream to wait on its client")
        (t,) = s["streams"]
        assert (t["dataset"], t["epoch"], t["rank"], t["worker"]) == ("big", 3, 0, 0)
        assert t["position"] >= 1 and t["peer_pid"] == os.getpid() and t["peer_uid"] == os.getuid()
        assert {x["name"]: x["shards"] for x in s["datasets"]}["train"] == 12
        assert s["cache"]["pinned_bytes"] > 0 and s["host_count"] == 1
        table = subprocess.run([SHARDD, "status", "--url", base], capture_output=True, text=True)
        assert table.returncode == 0, table.stderr
        row = [line for line in table.stdout.splitlines() if line.startswith("big ")]
        assert len(row) == 1 and row[0].split()[1:4] == ["3", "0", "0"] and "client" in row[0], table.stdout
        stream.close()
    # /readyz asks the store for real: with the store gone, the daemon is not ready.
    proxy.close()
    def not_ready():
        try:
            urllib.request.urlopen(base + "/readyz", timeout=10)
            return False
        except urllib.error.HTTPError as e:
            return e.code == 503 and b"not ready: dataset " in e.read()
    wait_for(not_ready, "readyz to notice the store is gone")


def test_a_real_prometheus_scrapes_the_daemon(make_daemon, fake_gcs, tmp_path):
    import json
    import urllib.parse
    import urllib.request

    from conftest import Server, free_port

    binary = shutil.which("prometheus")
    assert binary, "prometheus is missing: run scripts/test.sh, which installs Debian's prometheus"
    d = make_daemon(gcs_config(fake_gcs))
    with shardd.Client(d.socket) as c:
        served = len(list(c.stream("train", epoch=0, rank=0, world_size=1)))
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: shardd\n    static_configs: [{{targets: ['127.0.0.1:{d.metrics_port}']}}]\n"
    )
    port = free_port()
    prom = Server("prometheus", [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path}/tsdb",
                                 f"--web.listen-address=127.0.0.1:{port}"], port, "/-/ready", tmp_path)
    try:
        query = urllib.parse.quote('shardd_samples_sent_total{job="shardd",dataset="train"}')

        def result():
            with urllib.request.urlopen(f"{prom.endpoint}/api/v1/query?query={query}", timeout=5) as r:
                data = json.loads(r.read())["data"]["result"]
            return data[0]["value"][1] if data else None

        assert float(wait_for(result, "a scrape")) == served
    finally:
        prom.stop()


def test_every_metric_the_docs_list_is_exported_from_the_start(make_daemon, fake_gcs):
    """docs/operations.md's metrics table, against a daemon that has served nothing yet (a
    fixed host index: shardd_host_index and shardd_hosts too). A histogram is exported as
    its _count; a family whose only label is a mix's schedule entry needs a mix, which this
    config has none of."""
    table = (pathlib.Path(__file__).parents[2] / "docs" / "operations.md").read_text()
    listed = dict(re.findall(r"^\| `(shardd_\w+)` \| (\w+) \|", table, re.M))
    assert len(listed) > 30, "the metrics table was not found"
    d = make_daemon(gcs_config(fake_gcs, host_index=0, host_count=1))
    text = d.metrics()
    exported = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line.startswith("shardd_")}
    missing = [
        name for name, kind in listed.items()
        if (f"{name}_count" if kind == "histogram" else name) not in exported and name != "shardd_mix_schedule_entry"
    ]
    assert missing == [], f"listed in docs/operations.md, not exported: {missing}"
    assert d.metric("shardd_host_index") == 0 and d.metric("shardd_hosts") == 1
