"""deploy/: the systemd units pass systemd-analyze (there is no running systemd here: verify
and the security score work offline), and the TPU VM startup script is valid shell."""

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
