"""deploy/gke/: every manifest against the Kubernetes schemas (offline), the hostPath
directories made the pod's user's, and the GKE config's host identity: a daemon with
host.index = "from-clients" learns its host from the first stream and refuses another host's."""

import os
import pathlib
import re
import shutil
import stat
import subprocess
import tempfile

import pytest
import shardd
import yaml

from conftest import BIG_SHARDS, BUCKET, ROOT, SHARDD, TRAIN_SHARDS, free_port, wait_for

GKE = ROOT / "deploy" / "gke"
TRAIN = f"gs://{BUCKET}/train/train-{{000000..{TRAIN_SHARDS - 1:06d}}}.tar"
# Kubernetes versions the manifests must hold for: an old one GKE still runs, and the newest
# kubernetes-validate knows.
K8S_VERSIONS = ["1.30.0", "1.33.0", "1.37.0"]

# PodMonitoring is Google Cloud Managed Service for Prometheus' custom resource: no schema in
# kubernetes-validate. The parts of its CRD (monitoring.googleapis.com/v1) that the manifest
# uses, with the CRD's required fields.
POD_MONITORING = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.googleapis.com/v1"},
        "kind": {"const": "PodMonitoring"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["endpoints", "selector"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"matchLabels": {"type": "object",
                                                   "additionalProperties": {"type": "string"}}},
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["port"],
                        "properties": {
                            "port": {"type": ["integer", "string"]},
                            "interval": {"type": "string", "pattern": r"^(\d+(ms|s|m|h))+$"},
                            "path": {"type": "string"},
                        },
                        "additionalProperties": False,
                    },
                },
            },
        },
    },
}


def manifests():
    """(file name, document) of every manifest in deploy/gke."""
    docs = []
    for path in sorted(GKE.glob("*.yaml")):
        docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def validate(doc, version):
    """Raises if ``doc`` does not hold to its schema (strict: unknown fields are errors)."""
    import jsonschema
    import kubernetes_validate

    if doc["kind"] == "PodMonitoring":
        jsonschema.validate(doc, POD_MONITORING)
    else:
        kubernetes_validate.validate(doc, version, strict=True)


def docs_by_kind():
    return {d["kind"]: d for _, d in manifests()}


def test_every_manifest_holds_to_the_kubernetes_schemas():
    docs = manifests()
    kinds = sorted(d["kind"] for _, d in docs)
    assert kinds == ["ConfigMap", "DaemonSet", "Job", "PodMonitoring", "Service"], kinds
    for version in K8S_VERSIONS:
        for name, doc in docs:
            validate(doc, version)
    # The check is real: a misspelt field, a wrong type and a missing required field fail.
    import copy

    import jsonschema
    import kubernetes_validate

    by_kind = docs_by_kind()
    broken = copy.deepcopy(by_kind["DaemonSet"])
    broken["spec"]["template"]["spec"]["initContainers"][0]["securityContext"]["runAsUsr"] = 0
    with pytest.raises(kubernetes_validate.ValidationError, match="runAsUsr"):
        validate(broken, "1.37.0")
    broken = copy.deepcopy(by_kind["DaemonSet"])
    broken["spec"]["template"]["spec"]["volumes"][1]["hostPath"]["path"] = 5
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(broken, "1.37.0")
    broken = copy.deepcopy(by_kind["PodMonitoring"])
    del broken["spec"]["endpoints"][0]["port"]
    with pytest.raises(jsonschema.ValidationError, match="'port' is a required property"):
        validate(broken, "1.37.0")


def test_the_trainer_example_mounts_the_daemons_socket():
    by_kind = docs_by_kind()
    daemon = by_kind["DaemonSet"]["spec"]["template"]["spec"]
    trainer = by_kind["Job"]["spec"]["template"]["spec"]
    # The same nodes, the same hostPath directory, the daemon's group.
    assert trainer["nodeSelector"] == daemon["nodeSelector"]
    socket_dir = {v["name"]: v for v in daemon["volumes"]}["socket"]["hostPath"]["path"]
    (volume,) = [v for v in trainer["volumes"] if "hostPath" in v]
    assert volume["hostPath"] == {"path": socket_dir, "type": "Directory"}
    (c,) = trainer["containers"]
    (mount,) = c["volumeMounts"]
    assert mount["name"] == volume["name"] and mount["mountPath"] == socket_dir
    env = {e["name"]: e["value"] for e in c["env"]}
    config = by_kind["ConfigMap"]["data"]["config.toml"]
    assert f'socket = "{env["SHARDD_SOCKET"]}"' in config
    assert pathlib.PurePath(env["SHARDD_SOCKET"]).parent == pathlib.PurePath(socket_dir)
    assert daemon["securityContext"]["runAsGroup"] in trainer["securityContext"]["supplementalGroups"]
    assert trainer["securityContext"]["runAsUser"] != daemon["securityContext"]["runAsUser"]
    # One pod per node of the slice: as many as the config's host.count.
    count = int(re.search(r"^count = (\d+)$", config, re.M).group(1))
    assert by_kind["Job"]["spec"]["completions"] == count
    assert 'index = "from-clients"' in config


def gke_config(workdir, fake_gcs, manifest, metrics_port, index=None, count=None):
    """The DaemonSet's config.toml as the ConfigMap has it, with the node's paths moved into
    ``workdir`` and its dataset pointed at the test bucket (the [host] and [cache] sections,
    and everything else, as they are)."""
    text = docs_by_kind()["ConfigMap"]["data"]["config.toml"]
    text = text.replace('"/run/shardd/shardd.sock"', f'"{workdir}/run-shardd/shardd.sock"')
    text = text.replace('dir = "/cache"', f'dir = "{workdir}/cache"')
    text = text.replace('"0.0.0.0:9464"', f'"127.0.0.1:{metrics_port}"')
    if index is not None:
        text = text.replace('index = "from-clients"', f"index = {index}")
    if count is not None:
        text = re.sub(r"^count = \d+$", f"count = {count}", text, flags=re.M)
    head, dataset = text.split("[datasets.train]\n")
    dataset = re.sub(r'^shards = .*$', f'shards = "{TRAIN}"', dataset, flags=re.M)
    dataset = re.sub(r'^manifest = .*$', f'manifest = "{manifest}"', dataset, flags=re.M)
    # And shards of one 8 MiB sample, more than the socket buffers: a stream that stays open.
    big = f'[datasets.big]\nshards = "gs://{BUCKET}/big/big-{{0..{BIG_SHARDS - 1}}}.tar"\nshuffle_buffer = 1\n'
    return (head + f'[gcs]\nendpoint = "{fake_gcs}"\nanonymous = true\n'
            + "[datasets.train]\n" + dataset + "shuffle_buffer = 20\n" + big)


class Node:
    """A `shardd serve` of the GKE config, as the DaemonSet runs it (optionally as uid/gid
    10001, in directories the initContainer prepared)."""

    def __init__(self, workdir, config_text, user=None, env=None, binary=SHARDD):
        self.dir = pathlib.Path(workdir)
        self.config = self.dir / "config.toml"
        self.config.write_text(config_text)
        os.chmod(self.config, 0o644)
        self.socket = pathlib.Path(re.search(r'^socket = "(.*)"$', config_text, re.M).group(1))
        port = re.search(r'^metrics_addr = "127.0.0.1:(\d+)"$', config_text, re.M).group(1)
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = self.dir / "shardd.log"
        self.log = open(self.log_path, "w")
        ids = {"user": user, "group": user, "extra_groups": []} if user is not None else {}
        self.proc = subprocess.Popen(
            [binary, "serve", "--config", str(self.config)], stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, "SHARDD_LOG": "info", **(env or {})}, **ids)
        wait_for(self.ready, f"shardd to serve (log: {self.log_path})")

    def ready(self):
        if self.proc.poll() is not None:
            raise RuntimeError(f"shardd exited with {self.proc.returncode}: {self.log_path.read_text()}")
        try:
            import urllib.request

            with urllib.request.urlopen(self.url + "/readyz", timeout=1) as r:
                return r.status == 200 and self.socket.exists()
        except OSError:
            return False

    def get(self, path):
        import urllib.request

        with urllib.request.urlopen(self.url + path, timeout=5) as r:
            return r.read().decode()

    def status(self):
        import json

        return json.loads(self.get("/status"))

    def metric(self, name):
        lines = [line for line in self.get("/metrics").splitlines() if line.startswith(name + " ")]
        return float(lines[0].split()[1]) if lines else None

    def stop(self):
        self.proc.terminate()
        code = self.proc.wait(timeout=30)
        self.log.close()
        assert code == 0, self.log_path.read_text()


@pytest.fixture
def nodes():
    started = []
    yield started
    for n in started:
        if n.proc.poll() is None:
            n.stop()


@pytest.fixture
def manifest(fake_gcs, tmp_path):
    config = tmp_path / "store.toml"
    config.write_text(f'[gcs]\nendpoint = "{fake_gcs}"\nanonymous = true\n')
    out = tmp_path / "train.manifest.json"
    run = subprocess.run([SHARDD, "index", TRAIN, "-o", str(out), "--config", str(config)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return out


def world_dir():
    """A directory other users can reach (pytest's tmp_path is root's 0700)."""
    d = pathlib.Path(tempfile.mkdtemp(prefix="shardd-gke-"))
    d.chmod(0o755)
    return d


def init_container_command(run_shardd, cache):
    """The DaemonSet initContainer's shell command, with the container's mount points moved."""
    pod = docs_by_kind()["DaemonSet"]["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    assert mounts == {"socket": "/run/shardd", "cache": "/cache"}
    assert init["securityContext"]["runAsUser"] == 0
    assert set(init["securityContext"]["capabilities"]["add"]) == {"CHOWN", "FOWNER"}
    assert init["image"] == pod["containers"][0]["image"]
    sh, flag, script = init["command"]
    assert (sh, flag) == ("sh", "-c")
    # Longest first: /run/shardd before a bare /cache could match inside another path.
    return script.replace("/run/shardd", str(run_shardd)).replace("/cache", str(cache))


@pytest.mark.skipif(os.geteuid() != 0, reason="chown and running as other users need root (CI runs as root)")
def test_hostpath_dirs_are_the_pods_users_after_the_init_container(fake_gcs, manifest, nodes):
    """As the kubelet makes them (DirectoryOrCreate: root:root 0755), the daemon running as
    uid 10001 cannot create its socket; after the initContainer's command it serves, a trainer
    in group 10001 (another uid) reads, and a trainer outside the group is refused."""
    pod = docs_by_kind()["DaemonSet"]["spec"]["template"]["spec"]
    uid = pod["securityContext"]["runAsUser"]
    assert pod["securityContext"]["runAsGroup"] == uid == 10001
    top = world_dir()
    try:
        run_shardd, cache = top / "run-shardd", top / "cache"
        for d in (run_shardd, cache):
            d.mkdir(mode=0o755)
        shutil.copy(manifest, top / "train.manifest.json")
        os.chmod(top / "train.manifest.json", 0o644)
        text = gke_config(top, fake_gcs, top / "train.manifest.json", free_port())
        before = top / "before"
        before.mkdir()
        (before / "config.toml").write_text(text)
        os.chmod(before / "config.toml", 0o644)
        # The binary where every user may run it (the checkout may be in root's home).
        binary = top / "shardd"
        shutil.copy(SHARDD, binary)
        os.chmod(binary, 0o755)
        out = subprocess.run([binary, "serve", "--config", str(before / "config.toml")], user=uid, group=uid,
                             extra_groups=[], capture_output=True, text=True, timeout=60)
        assert out.returncode == 1
        assert "Permission denied" in out.stderr, out.stderr

        script = init_container_command(run_shardd, cache)
        done = subprocess.run(["sh", "-c", script], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        for d, mode in ((run_shardd, 0o750), (cache, 0o700)):
            st = d.stat()
            assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (uid, uid, mode), d
        # Idempotent: a restarted pod runs it again over its own directories.
        assert subprocess.run(["sh", "-c", script]).returncode == 0

        node_dir = top / "node"
        node_dir.mkdir(mode=0o755)
        node = Node(node_dir, text, user=uid, binary=binary)
        nodes.append(node)
        st = node.socket.stat()
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (uid, uid, 0o660)
        # A trainer: another uid, in the daemon's group (supplementalGroups), with the Rust
        # client of `shardd cat` (the Python of this checkout may be in root's home).
        reader = [binary, "cat", "--socket", str(node.socket), "--dataset", "train", "--world-size", "4"]
        ok = subprocess.run(reader, user=1000, group=1000, extra_groups=[uid], capture_output=True, text=True,
                            timeout=60)
        assert ok.returncode == 0 and ok.stdout.count("\n") > 0, ok.stderr
        assert ok.stderr.strip().endswith(f"{ok.stdout.count(chr(10))} samples"), ok.stderr
        refused = subprocess.run(reader, user=1001, group=1001, extra_groups=[], capture_output=True, text=True,
                                 timeout=60)
        assert refused.returncode != 0 and "Permission denied" in refused.stderr, refused.stderr
        # The cache is on the hostPath, written by the daemon's user.
        files = [p for p in cache.rglob("*") if p.is_file()]
        assert files and all(p.stat().st_uid == uid for p in files)
        node.stop()
    finally:
        shutil.rmtree(top, ignore_errors=True)


def read_all(socket, ranks, world_size, num_workers, epoch=0, seed=7):
    c = shardd.Client(socket)
    out = {}
    for rank in ranks:
        for worker in range(num_workers):
            s = c.stream("train", epoch=epoch, rank=rank, world_size=world_size, worker=worker,
                         num_workers=num_workers, seed=seed)
            out[rank, worker] = [x["__key__"] for x in s]
    c.close()
    return out


def test_from_clients_learns_the_host_from_the_first_stream(fake_gcs, manifest, tmp_path, nodes):
    """The GKE config on a node whose trainers are host 2 of 4 (ranks 8..11 of 16): the daemon
    serves host 2's share exactly as a daemon configured with index = 2 does, says so in
    /metrics and /status, warms host 2's share (not host 0's), and refuses a rank of host 0
    while a stream of host 2 is open, naming both. Once no stream is open, another job's
    placement teaches it another host."""
    (tmp_path / "gke").mkdir()
    (tmp_path / "fixed").mkdir()
    node = Node(tmp_path / "gke", gke_config(tmp_path / "gke", fake_gcs, manifest, free_port()))
    nodes.append(node)
    fixed = Node(tmp_path / "fixed", gke_config(tmp_path / "fixed", fake_gcs, manifest, free_port(), index=2))
    nodes.append(fixed)

    # Before any stream: no host, nothing warmed (host 0's share would be the wrong one).
    assert node.metric("shardd_host_index") is None
    assert node.metric("shardd_cache_resident_bytes") == 0
    assert "host.index = \"from-clients\"" in node.log_path.read_text()
    wait_for(lambda: "warmed the cache" in fixed.log_path.read_text(), "the fixed host to warm")

    ranks = range(8, 12)
    got = read_all(node.socket, ranks, 16, 2)
    want = read_all(fixed.socket, ranks, 16, 2)
    assert got == want and all(got.values())
    assert node.metric("shardd_host_index") == 2 and node.metric("shardd_hosts") == 4
    s = node.status()
    assert (s["host_index"], s["host_count"]) == (2, 4)
    status = subprocess.run([SHARDD, "status", "--url", node.url], capture_output=True, text=True)
    assert status.stdout.splitlines()[0].split(", ")[1] == "host 2 of 4", status.stdout

    # The learned host's share is checked against the manifest and warmed: the same bytes
    # as the daemon configured as host 2.
    log = wait_for(lambda: "warmed the cache with the learned host's share" in node.log_path.read_text()
                   and node.log_path.read_text(), "the learned share to warm")
    assert "manifest checked for the learned host's share" in log
    want_shards = re.search(r"warmed the cache.* shards=(\d+)", fixed.log_path.read_text()).group(1)
    assert re.search(r"warmed the cache with the learned host's share.* shards=(\d+)", log).group(1) == want_shards
    wait_for(lambda: node.metric("shardd_cache_resident_bytes") == fixed.metric("shardd_cache_resident_bytes"),
             "the same share in both caches")

    # Another host's rank while a stream of host 2 is open (one the client does not read:
    # the daemon waits to send its 8 MiB sample): refused, naming both.
    c = shardd.Client(node.socket, readahead=0)
    # (world_size 4: host 2 has one rank, 2, and reads all of its share.)
    held = c.stream("big", epoch=0, rank=2, world_size=4)
    wait_for(lambda: [t["rank"] for t in node.status()["streams"]] == [2], "the held stream")
    with pytest.raises(shardd.DaemonError) as refused:
        next(iter(shardd.Client(node.socket).stream("train", epoch=1, rank=3, world_size=16, seed=7)))
    assert refused.value.code == "bad_topology"
    message = str(refused.value)
    assert "this daemon serves host 2 of 4, learned from the stream of rank 8 of world_size 16 (pid " in message
    assert "rank 3 of world_size 16 (pid " in message and "is on host 0 of 4" in message
    assert "is host.count (4) the number of nodes the job runs on" in message
    # A world size that host.count does not divide is refused as for any daemon.
    with pytest.raises(shardd.DaemonError, match="world_size 6 is not divisible by the host count 4"):
        next(iter(shardd.Client(node.socket).stream("train", epoch=1, rank=5, world_size=6)))
    assert node.status()["host_index"] == 2
    held.close()
    c.close()

    # No stream open: a new job placed host 0's trainers on this node.
    # Its connection closed too: the learned host is let go only when the connection ends.
    wait_for(lambda: not node.status()["streams"] and node.metric("shardd_connections_active") == 0,
             "the held stream to end")
    got0 = read_all(node.socket, [0], 16, 1)
    fixed.stop()
    (tmp_path / "fixed0").mkdir()
    fixed0 = Node(tmp_path / "fixed0", gke_config(tmp_path / "fixed0", fake_gcs, manifest, free_port(), index=0))
    nodes.append(fixed0)
    assert got0 == read_all(fixed0.socket, [0], 16, 1)
    assert node.metric("shardd_host_index") == 0 and node.status()["host_index"] == 0
    assert "this host's place changed" in node.log_path.read_text()


def test_from_clients_with_one_trainer_process_per_node(fake_gcs, manifest, tmp_path, nodes):
    """JAX on a TPU slice: one process per host, so rank = host index (world_size = count)."""
    node = Node(tmp_path, gke_config(tmp_path, fake_gcs, manifest, free_port()))
    nodes.append(node)
    keys = read_all(node.socket, [3], 4, 1)
    assert keys[3, 0] and node.status()["host_index"] == 3


def test_a_fixed_index_in_the_environment_wins(fake_gcs, manifest, tmp_path, nodes):
    """SHARDD_HOST_INDEX (a webhook or a script that knows) fixes the index: known at start."""
    node = Node(tmp_path, gke_config(tmp_path, fake_gcs, manifest, free_port()), env={"SHARDD_HOST_INDEX": "1"})
    nodes.append(node)
    assert node.status()["host_index"] == 1
    with pytest.raises(shardd.DaemonError, match="host 1"):
        next(iter(shardd.Client(node.socket).stream("train", epoch=0, rank=0, world_size=4)))


@pytest.mark.parametrize("host, error", [
    ('index = "from-client"\ncount = 4',
     'host.index "from-client" is neither a number, "auto" nor "from-clients"'),
    ('index = 0\ncount = "from-clients"', 'host.count "from-clients" is neither a number nor "auto"'),
    ('index = "from-clients"\ncount = 0', "host.count must be at least 1"),
])
def test_host_values_are_checked(tmp_path, host, error):
    config = tmp_path / "c.toml"
    config.write_text(f'[host]\n{host}\n[datasets.d]\nshards = "/x/{{0..3}}.tar"\n')
    out = subprocess.run([SHARDD, "check", "--no-store", "--config", str(config)], capture_output=True, text=True)
    assert out.returncode == 1 and error in out.stderr, out.stderr
