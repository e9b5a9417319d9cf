"""deploy/tpu-vm/startup.sh, run offline as far as it can be without a VM: a metadata server on
loopback (GCE_METADATA_HOST, as for the daemon), the wheel fetched by the real gcloud from
fake-gcs-server or by the real pip from a package index on loopback, installed by the real pip,
its config checked by the installed shardd. Only what
would change this machine is stubbed on PATH: systemctl (no systemd runs here), getent,
groupadd and usermod; the script installs under SHARDD_ROOT."""

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


def metadata_server(attributes):
    """The GCE metadata server's instance attributes (and its Metadata-Flavor rule)."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            prefix = "/computeMetadata/v1/instance/attributes/"
            key = self.path[len(prefix):] if self.path.startswith(prefix) else None
            if self.headers.get("Metadata-Flavor") != "Google":
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


@pytest.fixture
def vm(tmp_path, wheel, train_paths):
    """A pretend TPU VM worker: a root directory, stubs, the environment."""
    root = tmp_path / "root"
    root.mkdir()
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    log = tmp_path / "calls.log"
    for name, tail in {"systemctl": "", "groupadd": "", "usermod": "",
                       "getent": "exit 2  # no such group yet"}.items():
        (stubs / name).write_text(STUB.format(log=log, tail=tail))
        (stubs / name).chmod(0o755)
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
    servers = []

    def run(extra_attributes):
        server = metadata_server({**attributes, **extra_attributes})
        servers.append(server)
        env["GCE_METADATA_HOST"] = server.host
        return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True,
                              timeout=300)

    yield run, root, log, env, tmp_path
    for s in servers:
        s.close()


def check_installed(root, log, wheel, out):
    version = wheel.name.split("-")[1]
    binary = root / "opt/shardd/bin/shardd"
    assert f"shardd {version}\n" in out.stdout
    assert subprocess.run([binary, "--version"], capture_output=True, text=True).stdout == f"shardd {version}\n"
    assert (root / "opt/shardd/shardd/grain.py").is_file()  # the Python package came along
    assert os.readlink(root / "usr/local/bin/shardd") == str(binary)
    config = (root / "etc/shardd/config.toml").read_text()
    assert 'index = "auto"' in config and 'count = "auto"' in config and "[datasets.train]" in config
    # `shardd check` ran on that config and read every shard's size.
    assert "dataset train: 12 shards" in out.stdout, out.stdout + out.stderr
    # The units are those built into the installed binary, running it.
    units = root / "etc/systemd/system"
    service = (units / "shardd.service").read_text()
    assert service == (ROOT / "deploy/systemd/shardd.service").read_text().replace(
        "ExecStart=/usr/local/bin/shardd ", f"ExecStart={binary} ")
    assert (units / "shardd.socket").read_text() == (ROOT / "deploy/systemd/shardd.socket").read_text()
    assert log.read_text().splitlines() == [
        "getent group shardd", "groupadd --system shardd", "usermod -aG shardd trainer",
        "systemctl daemon-reload", "systemctl enable --now shardd.socket",
        "systemctl enable shardd.service", "systemctl restart shardd.service",
        "systemctl --no-pager status shardd.service"]


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
    check_installed(root, log, wheel, out)


def test_installs_the_wheel_from_a_package_index(vm, wheel):
    run, root, log, env, tmp_path = vm
    # A PEP 503 "simple" index: a directory listing per project, as http.server makes.
    project = tmp_path / "index" / "simple" / "shardd"
    project.mkdir(parents=True)
    shutil.copy(wheel, project / wheel.name)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=tmp_path / "index")
    handler.log_message = lambda *a: None
    index = Loopback(handler)
    try:
        version = wheel.name.split("-")[1]
        out = run({"shardd-index": f"http://{index.host}/simple/", "shardd-version": version})
    finally:
        index.close()
    assert out.returncode == 0, out.stdout + out.stderr
    check_installed(root, log, wheel, out)


def test_says_what_metadata_is_missing(vm):
    run, root, log, env, tmp_path = vm
    out = run({"shardd-config": ""})
    assert out.returncode == 1
    assert out.stderr == "shardd: metadata shardd-config, and shardd-wheel or shardd-index, are required\n"
    out = run({"shardd-wheel": "gs://b/w.whl", "shardd-index": "http://127.0.0.1:9/simple/"})
    assert out.returncode == 1
    assert out.stderr == "shardd: metadata shardd-wheel and shardd-index are both set; set one\n"
    assert not log.exists() and list(root.iterdir()) == []
