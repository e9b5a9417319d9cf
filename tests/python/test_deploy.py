"""deploy/: the systemd units pass systemd-analyze (there is no running systemd here: verify
and the security score work offline), and the TPU VM startup script is valid shell."""

import os
import shutil
import subprocess

from conftest import ROOT, SHARDD

SYSTEMD = ROOT / "deploy" / "systemd"


def analyze(*args):
    tool = shutil.which("systemd-analyze")
    assert tool, "systemd-analyze is missing: run scripts/test.sh, which installs Debian's systemd"
    return subprocess.run([tool, *args], capture_output=True, text=True)


def test_units_verify_clean(tmp_path):
    # A root holding the units, the binary where ExecStart says, and systemd's own units.
    (tmp_path / "usr/local/bin").mkdir(parents=True)
    shutil.copy(SHARDD, tmp_path / "usr/local/bin/shardd")
    shutil.copytree("/usr/lib/systemd/system", tmp_path / "usr/lib/systemd/system", symlinks=True)
    units = tmp_path / "etc/systemd/system"
    units.mkdir(parents=True)
    for unit in ("shardd.service", "shardd.socket"):
        shutil.copy(SYSTEMD / unit, units / unit)
    out = analyze("verify", f"--root={tmp_path}", "/etc/systemd/system/shardd.service",
                  "/etc/systemd/system/shardd.socket")
    assert out.returncode == 0 and out.stdout + out.stderr == "", out.stdout + out.stderr
    # The check can fail: an unknown key is reported.
    bad = units / "shardd.service"
    bad.write_text(bad.read_text().replace("WatchdogSec=", "WatchdogSecs="))
    out = analyze("verify", f"--root={tmp_path}", "/etc/systemd/system/shardd.service")
    assert "Unknown key 'WatchdogSecs'" in out.stderr


def test_dropins_for_a_cache_on_another_disk_and_the_socket_mode_verify_clean(tmp_path):
    """`install-units --config` writes drop-ins for a cache.dir outside CacheDirectory= and for
    the socket's mode; systemd-analyze reads them with the units and finds nothing wrong."""
    (tmp_path / "usr/local/bin").mkdir(parents=True)
    shutil.copy(SHARDD, tmp_path / "usr/local/bin/shardd")
    (tmp_path / "usr/bin").mkdir(parents=True)
    shutil.copy("/usr/bin/install", tmp_path / "usr/bin/install")  # the drop-in's ExecStartPre
    shutil.copytree("/usr/lib/systemd/system", tmp_path / "usr/lib/systemd/system", symlinks=True)
    units = tmp_path / "etc/systemd/system"
    units.mkdir(parents=True)
    for unit in ("shardd.service", "shardd.socket"):
        shutil.copy(SYSTEMD / unit, units / unit)
    config = tmp_path / "config.toml"
    config.write_text('[server]\nsocket_mode = "0666"\n[cache]\ndir = "/mnt/disks/ssd/shardd"\n'
                      '[datasets.train]\nshards = "/data/train-{0..3}.tar"\n')
    written = tmp_path / "written"
    written.mkdir()
    out = subprocess.run([SHARDD, "install-units", "--dir", str(written), "--config", str(config)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-2:] == [
        f"{written}/shardd.service.d/install-units.conf", f"{written}/shardd.socket.d/install-units.conf"]
    assert "cache.dir /mnt/disks/ssd/shardd is outside /var/cache/shardd" in out.stderr
    for d in ("shardd.service.d", "shardd.socket.d"):
        shutil.copytree(written / d, units / d)
    names = ["/etc/systemd/system/shardd.service", "/etc/systemd/system/shardd.socket"]
    out = analyze("verify", f"--root={tmp_path}", *names)
    assert out.returncode == 0 and out.stdout + out.stderr == "", out.stdout + out.stderr
    # The drop-ins are read: a wrong key in one of them is reported.
    dropin = units / "shardd.service.d/install-units.conf"
    dropin.write_text(dropin.read_text().replace("ReadWritePaths=", "ReadWritePath="))
    out = analyze("verify", f"--root={tmp_path}", *names)
    assert "Unknown key 'ReadWritePath'" in out.stderr, out.stderr
    # A cache the service could not see is refused, and nothing is written.
    config.write_text('[cache]\ndir = "/home/me/cache"\n[datasets.train]\nshards = "/d/{0..3}.tar"\n')
    empty = tmp_path / "empty"
    empty.mkdir()
    out = subprocess.run([SHARDD, "install-units", "--dir", str(empty), "--config", str(config)],
                         capture_output=True, text=True)
    assert out.returncode == 1 and "ProtectHome=yes" in out.stderr, out.stderr
    assert list(empty.iterdir()) == []


def test_check_offline_asks_no_store_and_no_metadata_server(tmp_path):
    """What the TPU VM start-up script runs before the units exist: a gs:// dataset whose
    store has no credentials and a host found at start ("auto"), with no metadata server and
    no store answering, validate and list the datasets, and exit 0."""
    config = tmp_path / "config.toml"
    config.write_text('[host]\nindex = "auto"\ncount = "auto"\n[gcs]\nendpoint = "http://127.0.0.1:9"\n'
                      '[datasets.train]\nshards = "gs://bkt/train/train-{000000..000011}.tar"\n')
    env = {**os.environ, "GCE_METADATA_HOST": "127.0.0.1:9"}
    env.pop("GOOGLE_APPLICATION_CREDENTIALS", None)
    for flag in ("--offline", "--no-store"):
        out = subprocess.run([SHARDD, "check", flag, "--config", str(config)], env=env,
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        assert f"{config}: ok\n" in out.stdout
        assert "dataset train: 12 shards, first gs://bkt/train/train-000000.tar" in out.stdout
    # Asking the store is what fails here (no credentials).
    out = subprocess.run([SHARDD, "check", "--config", str(config)], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 1 and "no credentials" in out.stderr, out.stderr


def test_merge_config_lays_one_file_over_another(tmp_path):
    (tmp_path / "defaults.toml").write_text(
        '[server]\nsocket = "/run/shardd/shardd.sock"\nmetrics_addr = "127.0.0.1:9464"\n'
        '[cache]\ndir = "/var/cache/shardd"\n')
    (tmp_path / "metadata.toml").write_text(
        '[cache]\nmax_size = "1GiB"\n[datasets.train]\nshards = "/d/{0..3}.tar"\n')
    out = subprocess.run([SHARDD, "merge-config", tmp_path / "defaults.toml",
                          tmp_path / "metadata.toml"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    import tomllib

    merged = tomllib.loads(out.stdout)
    assert merged["cache"] == {"dir": "/var/cache/shardd", "max_size": "1GiB"}
    assert merged["server"]["metrics_addr"] == "127.0.0.1:9464"
    # Appending the two (what the start-up script did) is a duplicate key; an invalid merge
    # writes nothing and names the files.
    (tmp_path / "bad.toml").write_text('[cache]\nmax_size = "lots"\n')
    out = subprocess.run([SHARDD, "merge-config", tmp_path / "defaults.toml", tmp_path / "bad.toml",
                          "-o", tmp_path / "config.toml"], capture_output=True, text=True)
    assert out.returncode == 1 and "bad.toml is invalid" in out.stderr, out.stderr
    assert "cache.max_size" in out.stderr and not (tmp_path / "config.toml").exists()


def test_service_hardening_score():
    out = analyze("security", "--offline=true", str(SYSTEMD / "shardd.service"))
    last = [line for line in out.stdout.splitlines() if "Overall exposure level" in line]
    assert last, out.stdout + out.stderr
    score = float(last[0].split(":")[1].split()[0])
    print(last[0])
    assert score < 2.0, last[0]


def test_tpu_vm_startup_script_is_valid_shell():
    script = ROOT / "deploy" / "tpu-vm" / "startup.sh"
    out = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    text = script.read_text()
    # One config for every worker of the slice: the host index is found at start.
    assert 'index = "auto"' in text and 'count = "auto"' in text


PROMETHEUS = ROOT / "deploy" / "prometheus"


def test_alert_rules_check_and_their_unit_tests_pass():
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: run scripts/test.sh"
    for args in (["check", "rules", "shardd-rules.yml"], ["test", "rules", "shardd-rules-test.yml"],
                 ["check", "config", "scrape.yml"]):
        out = subprocess.run([promtool, *args], cwd=PROMETHEUS, capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr


def test_dashboard_and_rules_query_only_metrics_the_daemon_exports(make_daemon, fake_gcs):
    import json
    import re

    from conftest import gcs_config

    d = make_daemon(gcs_config(fake_gcs))
    exported = set(re.findall(r"^# TYPE (shardd_\w+)", d.metrics(), re.M))
    queried = set()
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "shardd.json").read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            queried |= set(re.findall(r"shardd_\w+", target["expr"]))
    queried |= set(re.findall(r"shardd_\w+", (PROMETHEUS / "shardd-rules.yml").read_text()))
    queried = {re.sub(r"_(bucket|count|sum)$", "", q) for q in queried}
    assert queried and queried <= exported, sorted(queried - exported)


def test_gke_manifests_are_well_formed():
    """No Kubernetes API server or kubectl here: a structural check of what kubectl's
    client-side dry run would look at, and of what the DaemonSet must carry."""
    import yaml

    gke = ROOT / "deploy" / "gke"
    docs = list(yaml.safe_load_all((gke / "daemonset.yaml").read_text()))
    docs += list(yaml.safe_load_all((gke / "podmonitoring.yaml").read_text()))
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"ConfigMap", "DaemonSet", "PodMonitoring"}
    for d in docs:
        assert d["apiVersion"] and d["metadata"]["name"] and d["metadata"]["namespace"] == "shardd"
    ds = kinds["DaemonSet"]["spec"]
    assert ds["selector"]["matchLabels"] == ds["template"]["metadata"]["labels"]
    pod = ds["template"]["spec"]
    (c,) = pod["containers"]
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["resources"]["requests"] and c["resources"]["limits"]
    assert pod["securityContext"]["runAsNonRoot"] and pod["nodeSelector"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["socket"]["hostPath"]["path"] == "/run/shardd"
    # The config in the ConfigMap is a valid shardd config whose socket is in that volume.
    config = kinds["ConfigMap"]["data"]["config.toml"]
    out = subprocess.run([SHARDD, "check", "--no-store", "--config", "/dev/stdin"], input=config,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert 'socket = "/run/shardd/shardd.sock"' in config
    mon = kinds["PodMonitoring"]["spec"]
    assert mon["selector"]["matchLabels"] == ds["selector"]["matchLabels"]
    assert mon["endpoints"][0]["port"] == c["ports"][0]["name"]
    dockerfile = (gke / "Dockerfile").read_text()
    assert dockerfile.count("FROM ") == 3 and "USER 10001" in dockerfile
    # The image runs the binary of the wheel built from this repository (pyproject.toml).
    assert "pip wheel --no-build-isolation --no-deps -w /dist ." in dockerfile
    assert "FROM scratch AS wheel" in dockerfile
    assert "COPY --from=build /shardd /usr/local/bin/shardd" in dockerfile
