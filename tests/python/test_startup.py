"""deploy/tpu-vm/startup.sh, run offline as far as it can be without a VM: a metadata server on
loopback (GCE_METADATA_HOST, as for the daemon), the wheel fetched by the real gcloud from
fake-gcs-server or by the real pip from a package index on loopback, installed by the real pip,
its config merged and checked by the installed shardd. Only what would change this machine is
stubbed on PATH: systemctl (no systemd runs here; the stub records its calls), and getent,
groupadd, useradd and usermod, which keep a small passwd and group of their own and fail as the
real tools do (usermod exits 6 with "user 'x' does not exist" for an unknown user); the script
installs under SHARDD_ROOT.

The first boot must end with the units installed and started, or say why: a trainer user that
does not exist yet, a metadata server that is not ready, a store without credentials yet, a
missing shard, cache keys from the metadata and a cache on another disk each end with the
daemon started, and the script's output says what was wrong."""

import functools
import http.server
import os
import shutil
import subprocess
import sys
import threading

import pytest

from conftest import ROOT, free_port, start_fake_gcs

SCRIPT = ROOT / "deploy" / "tpu-vm" / "startup.sh"


class Loopback:
    """An HTTP server on loopback in a thread: ``handler`` answers GETs."""

    def __init__(self, handler_class):
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), handler_class)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.host = f"127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def metadata_server(attributes, ready_after=0.0):
    """The GCE metadata server's instance attributes (and its Metadata-Flavor rule). Until
    ``ready_after`` seconds have passed it answers 503, as a server that is not ready yet.
    Anything else (a service account's token) is 404: no credentials from this one."""
    import time

    ready_at = time.monotonic() + ready_after

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            prefix = "/computeMetadata/v1/instance/attributes/"
            key = self.path[len(prefix):] if self.path.startswith(prefix) else None
            if time.monotonic() < ready_at:
                self.send_error(503)
            elif self.headers.get("Metadata-Flavor") != "Google":
                self.send_error(403)
            elif key not in attributes:
                self.send_error(404)
            else:
                body = attributes[key].encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        def log_message(self, *args):
            pass

    return Loopback(Handler)


STUB = """#!/bin/sh
echo "$(basename "$0") $*" >> "{log}"
{tail}
"""

# getent, groupadd, useradd and usermod over db/passwd and db/group, with the messages and exit
# codes of glibc's getent and shadow-utils 4.13 (checked against the real tools): getent 2 for
# an unknown key; groupadd/useradd 9 for a name that exists; usermod and useradd 6 for an
# unknown group, usermod 6 for an unknown user (the group is checked first, as usermod does).
ACCOUNTS = r'''#!{python}
import os
import sys

name, args = os.path.basename(sys.argv[0]), sys.argv[1:]
with open({log!r}, "a") as f:
    f.write(" ".join([name, *args]) + "\n")
db = {db!r}


def entries(kind):
    with open(os.path.join(db, kind)) as f:
        return [line.split(":") for line in f.read().splitlines()]


def find(kind, key):
    return next((e for e in entries(kind) if e[0] == key), None)


def add(kind, fields):
    with open(os.path.join(db, kind), "a") as f:
        f.write(":".join(fields) + "\n")


def fail(code, message):
    print(f"{{name}}: {{message}}", file=sys.stderr)
    sys.exit(code)


if name == "getent":
    kind, key = args
    e = find(kind, key)
    if e is None:
        sys.exit(2)
    print(":".join(e))
elif name == "groupadd":
    group = args[-1]
    if find("group", group):
        fail(9, f"group '{{group}}' already exists")
    add("group", [group, "x", str(900 + len(entries("group"))), ""])
elif name == "useradd":
    user = args[-1]
    gid = args[args.index("--gid") + 1] if "--gid" in args else user
    if find("passwd", user):
        fail(9, f"user '{{user}}' already exists")
    g = find("group", gid)
    if g is None:
        fail(6, f"group '{{gid}}' does not exist")
    add("passwd", [user, "x", str(900 + len(entries("passwd"))), g[2], "", "/nonexistent",
                   "/usr/sbin/nologin"])
elif name == "usermod":
    user, group = args[-1], args[args.index("-aG") + 1]
    if find("group", group) is None:
        fail(6, f"group '{{group}}' does not exist")
    if find("passwd", user) is None:
        fail(6, f"user '{{user}}' does not exist")
    lines = []
    for e in entries("group"):
        if e[0] == group:
            members = [m for m in e[3].split(",") if m]
            e[3] = ",".join(members + [user] if user not in members else members)
        lines.append(":".join(e))
    with open(os.path.join(db, "group"), "w") as f:
        f.write("\n".join(lines) + "\n")
'''


@pytest.fixture
def vm(tmp_path, wheel, train_paths):
    """A pretend TPU VM worker: a root directory, stubs, the environment. Its accounts hold
    root and the trainer user ("trainer"); a test may take the trainer out (db/passwd)."""
    root = tmp_path / "root"
    root.mkdir()
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    log = tmp_path / "calls.log"
    db = tmp_path / "db"
    db.mkdir()
    (db / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n"
                               "trainer:x:1000:1000::/home/trainer:/bin/bash\n")
    (db / "group").write_text("root:x:0:\ntrainer:x:1000:\n")
    (stubs / "systemctl").write_text(STUB.format(log=log, tail=""))
    (stubs / "systemctl").chmod(0o755)
    accounts = stubs / "accounts.py"
    accounts.write_text(ACCOUNTS.format(python=sys.executable, log=str(log), db=str(db)))
    accounts.chmod(0o755)
    for name in ("getent", "groupadd", "useradd", "usermod"):
        (stubs / name).symlink_to(accounts)
    # pip3 is the real pip of the test's Python (a TPU VM image has its own).
    (stubs / "pip3").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m pip "$@"\n')
    (stubs / "pip3").chmod(0o755)
    shards = ", ".join(f'"{p}"' for p in train_paths)
    attributes = {"shardd-config": f"[datasets.train]\nshards = [{shards}]\n",
                  "shardd-user": "trainer"}
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "SHARDD_ROOT": str(root),
           "PIP_DISABLE_PIP_VERSION_CHECK": "1", "CLOUDSDK_CONFIG": str(tmp_path / "gcloud"),
           "CLOUDSDK_CORE_DISABLE_USAGE_REPORTING": "true",
           "CLOUDSDK_COMPONENT_MANAGER_DISABLE_UPDATE_CHECK": "true"}
    env.pop("PIP_INDEX_URL", None)
    env.pop("GOOGLE_APPLICATION_CREDENTIALS", None)
    servers = []

    def run(extra_attributes, ready_after=0.0):
        server = metadata_server({**attributes, **extra_attributes}, ready_after)
        servers.append(server)
        env["GCE_METADATA_HOST"] = server.host
        return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True,
                              timeout=300)

    yield run, root, log, env, tmp_path
    for s in servers:
        s.close()


@pytest.fixture
def index(wheel, tmp_path):
    """A PEP 503 "simple" index on loopback holding the wheel: the metadata that installs from
    it."""
    project = tmp_path / "index" / "simple" / "shardd"
    project.mkdir(parents=True)
    shutil.copy(wheel, project / wheel.name)
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = Loopback(functools.partial(Quiet, directory=tmp_path / "index"))
    yield {"shardd-index": f"http://{server.host}/simple/"}
    server.close()


UNITS_STARTED = [
    "systemctl daemon-reload", "systemctl enable --now shardd.socket",
    "systemctl enable shardd.service", "systemctl restart shardd.service",
    "systemctl --no-pager status shardd.service"]
ACCOUNTS_MADE = [
    "getent group shardd", "groupadd --system shardd", "getent passwd shardd",
    "useradd --system --gid shardd --no-create-home --home-dir /nonexistent"
    " --shell /usr/sbin/nologin shardd"]


def check_installed(root, log, wheel, out, dataset_line="dataset train: 12 shards"):
    """The wheel, the config, the units of the installed binary: installed and started."""
    assert out.returncode == 0, out.stdout + out.stderr
    version = wheel.name.split("-")[1]
    binary = root / "opt/shardd/bin/shardd"
    assert f"shardd {version}\n" in out.stdout
    assert subprocess.run([binary, "--version"], capture_output=True, text=True).stdout == f"shardd {version}\n"
    assert (root / "opt/shardd/shardd/grain.py").is_file()  # the Python package came along
    assert os.readlink(root / "usr/local/bin/shardd") == str(binary)
    config = (root / "etc/shardd/config.toml").read_text()
    assert 'index = "auto"' in config and 'count = "auto"' in config and "[datasets.train]" in config
    # The installed shardd checked that config (offline: before the units are installed, the
    # store is not asked).
    assert dataset_line in out.stdout, out.stdout + out.stderr
    # The units are those built into the installed binary, running it.
    units = root / "etc/systemd/system"
    service = (units / "shardd.service").read_text()
    assert service == (ROOT / "deploy/systemd/shardd.service").read_text().replace(
        "ExecStart=/usr/local/bin/shardd ", f"ExecStart={binary} ")
    assert (units / "shardd.socket").read_text() == (ROOT / "deploy/systemd/shardd.socket").read_text()
    calls = log.read_text().splitlines()
    assert calls[-len(UNITS_STARTED):] == UNITS_STARTED, calls
    return calls


def warnings(out):
    return [line for line in out.stderr.splitlines() if line.startswith("shardd: warning:")]


def test_installs_the_wheel_from_cloud_storage(vm, wheel):
    run, root, log, env, tmp_path = vm
    data = tmp_path / "gcs"
    (data / "bkt" / "bin").mkdir(parents=True)
    shutil.copy(wheel, data / "bkt" / "bin" / wheel.name)
    gcs = start_fake_gcs(data, tmp_path)
    try:
        # The real gcloud, pointed at fake-gcs-server; any token does there.
        env["CLOUDSDK_API_ENDPOINT_OVERRIDES_STORAGE"] = f"{gcs.endpoint}/storage/v1/"
        env["CLOUDSDK_AUTH_ACCESS_TOKEN"] = "test"
        env["CLOUDSDK_CORE_PROJECT"] = "test"
        out = run({"shardd-wheel": f"gs://bkt/bin/{wheel.name}"})
    finally:
        gcs.stop()
    assert out.returncode == 0, out.stdout + out.stderr
    calls = check_installed(root, log, wheel, out)
    assert calls == ACCOUNTS_MADE + ["usermod -aG shardd trainer"] + UNITS_STARTED
    # Every shard was found, after the units started.
    assert "dataset train: 12 shards" in out.stdout and warnings(out) == [], out.stderr
    assert out.stderr.endswith("shardd: installed and started\n"), out.stderr


def test_installs_the_wheel_from_a_package_index(vm, wheel, index):
    run, root, log, env, tmp_path = vm
    version = wheel.name.split("-")[1]
    out = run({**index, "shardd-version": version})
    assert out.returncode == 0, out.stdout + out.stderr
    calls = check_installed(root, log, wheel, out)
    assert calls == ACCOUNTS_MADE + ["usermod -aG shardd trainer"] + UNITS_STARTED
    assert warnings(out) == [], out.stderr
    # Run again (an upgrade, a reboot): the accounts are there, the same units are started.
    log.unlink()
    out = run({**index, "shardd-version": version})
    calls = check_installed(root, log, wheel, out)
    assert calls == ["getent group shardd", "getent passwd shardd",
                     "usermod -aG shardd trainer"] + UNITS_STARTED
    assert warnings(out) == [], out.stderr


def test_says_what_metadata_is_missing(vm):
    run, root, log, env, tmp_path = vm
    out = run({"shardd-config": ""})
    assert out.returncode == 1
    assert out.stderr == "shardd: metadata shardd-config, and shardd-wheel or shardd-index, are required\n"
    out = run({"shardd-wheel": "gs://b/w.whl", "shardd-index": "http://127.0.0.1:9/simple/"})
    assert out.returncode == 1
    assert out.stderr == "shardd: metadata shardd-wheel and shardd-index are both set; set one\n"
    assert not log.exists() and list(root.iterdir()) == []


def test_a_trainer_user_that_does_not_exist_yet_is_a_warning(vm, wheel, index):
    """On first boot the SSH user is usually not there yet (the guest agent makes it at the
    first `gcloud ... ssh`), and an OS Login user is not in /etc/passwd: usermod fails (6)."""
    run, root, log, env, tmp_path = vm
    db = tmp_path / "db"
    (db / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    out = run(index)
    calls = check_installed(root, log, wheel, out)
    assert calls == ACCOUNTS_MADE + ["usermod -aG shardd trainer"] + UNITS_STARTED
    assert "usermod: user 'trainer' does not exist" in out.stderr
    (warning,) = warnings(out)
    assert "trainer was not added to group shardd" in warning, warning
    assert "deploy/tpu-vm/README.md" in warning
    assert out.stderr.endswith("shardd: installed and started, with 1 warning above\n")


def test_waits_for_a_metadata_server_that_is_not_ready_yet(vm, wheel, index):
    """A metadata server that answers 503 for a while (before this, every key read as unset:
    "shardd-config ... required")."""
    run, root, log, env, tmp_path = vm
    out = run(index, ready_after=1.5)
    check_installed(root, log, wheel, out)
    assert "shardd: waiting for the metadata server" in out.stderr, out.stderr
    assert warnings(out) == [], out.stderr


def test_a_store_without_credentials_yet_does_not_stop_the_install(vm, wheel, index):
    """The metadata server answers the attributes but gives no token (a service account not
    ready, or none): the units are installed and started, and the daemon's own retry waits
    for the credentials (systemd starts it again every RestartSec)."""
    run, root, log, env, tmp_path = vm
    config = ('[gcs]\nendpoint = "http://127.0.0.1:9"\n'
              '[datasets.train]\nshards = "gs://bkt/train/train-{000000..000011}.tar"\n')
    out = run({**index, "shardd-config": config})
    check_installed(root, log, wheel, out)
    (warning,) = warnings(out)
    assert "the store check failed" in warning and "journalctl -u shardd" in warning, warning
    assert "no credentials" in out.stdout + out.stderr, out.stdout + out.stderr


def test_a_missing_shard_is_reported_after_the_units_start(vm, wheel, index, train_paths):
    run, root, log, env, tmp_path = vm
    shards = tmp_path / "shards"
    shards.mkdir()
    for p in train_paths:
        shutil.copy(p, shards / p.name)
    (shards / train_paths[5].name).unlink()
    listed = ", ".join(f'"{shards / p.name}"' for p in train_paths)
    out = run({**index, "shardd-config": f"[datasets.train]\nshards = [{listed}]\n"})
    check_installed(root, log, wheel, out)
    assert "dataset train: 1 of 12 shards cannot be read" in out.stdout, out.stdout
    (warning,) = warnings(out)
    assert "the store check failed" in warning, warning


def test_any_config_key_from_metadata_merges_over_the_defaults(vm, wheel, index, train_paths):
    """[cache] and [server] keys in shardd-config (once a TOML duplicate-key error): merged
    into the defaults table by table, the metadata's keys winning; the socket's mode goes into
    the socket unit (socket activation: systemd makes the socket)."""
    import tomllib

    run, root, log, env, tmp_path = vm
    shards = ", ".join(f'"{p}"' for p in train_paths)
    config = ('[server]\nmetrics_addr = "0.0.0.0:9464"\nsocket_mode = "0666"\n'
              '[cache]\nmax_size = "1GiB"\n'
              f"[datasets.train]\nshards = [{shards}]\n")
    out = run({**index, "shardd-config": config})
    check_installed(root, log, wheel, out)
    assert warnings(out) == [], out.stderr
    merged = tomllib.loads((root / "etc/shardd/config.toml").read_text())
    assert merged["server"] == {"socket": "/run/shardd/shardd.sock", "socket_mode": "0666",
                                "metrics_addr": "0.0.0.0:9464"}
    assert merged["cache"] == {"dir": "/var/cache/shardd", "max_size": "1GiB"}
    assert merged["host"] == {"index": "auto", "count": "auto"}
    assert merged["datasets"]["train"]["shards"] == [str(p) for p in train_paths]
    dropin = root / "etc/systemd/system/shardd.socket.d/install-units.conf"
    assert "\nSocketMode=0666\n" in dropin.read_text()
    assert not (root / "etc/systemd/system/shardd.service.d").exists()


def test_a_cache_on_another_disk_is_made_writable_for_the_service(vm, wheel, index, train_paths):
    """ProtectSystem=strict leaves only CacheDirectory= (/var/cache/shardd) writable:
    install-units reads cache.dir from the config and writes a drop-in for it."""
    run, root, log, env, tmp_path = vm
    shards = ", ".join(f'"{p}"' for p in train_paths)
    config = f'[cache]\ndir = "/mnt/disks/ssd/shardd"\n[datasets.train]\nshards = [{shards}]\n'
    out = run({**index, "shardd-config": config})
    check_installed(root, log, wheel, out)
    dropin = root / "etc/systemd/system/shardd.service.d/install-units.conf"
    text = dropin.read_text()
    assert "\nReadWritePaths=/mnt/disks/ssd/shardd\n" in text
    assert "\nRequiresMountsFor=/mnt/disks/ssd/shardd\n" in text
    assert ("\nExecStartPre=+/usr/bin/install -d -o shardd -g shardd -m 0700"
            " /mnt/disks/ssd/shardd\n") in text
    assert str(dropin) in out.stdout and "cache.dir /mnt/disks/ssd/shardd" in out.stderr
    assert warnings(out) == [], out.stderr
    # Back on the boot disk: the drop-in goes.
    out = run({**index})
    check_installed(root, log, wheel, out)
    assert not dropin.exists()
