"""Credentials fail fast: on a machine with no way to get credentials, every command that
reaches a store says so in one line within seconds, naming the store and the ways to give
them, instead of retrying a token fetch per shard for minutes. Nothing here touches a real
network: the metadata server is a closed loopback port or a loopback server of the test's own
(GCE_METADATA_HOST / GCE_METADATA_IP, AWS_METADATA_ENDPOINT point there), and HOME is empty."""

import http.server
import json
import os
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest
import shardd

from conftest import BUCKET, DEADLINE, SHARDD, TRAIN_SHARDS, free_port, gcs_config, reference_samples, wait_for

GCS_HINT = (
    "; give them with GOOGLE_APPLICATION_CREDENTIALS=/path/key.json, [gcs] credentials = "
    '"/path/key.json" in the config, or the metadata server of a GCE or TPU VM (its service '
    "account); a public bucket needs none: [gcs] anonymous = true"
)
GCS_SECTION_HINT = (
    '; give them with [gcs] credentials = "/path/key.json" in the config (with a [gcs] section, '
    "GOOGLE_APPLICATION_CREDENTIALS is not read), or the metadata server of a GCE or TPU VM (its "
    "service account); a public bucket needs none: [gcs] anonymous = true"
)
S3_HINT = (
    "; give them with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_WEB_IDENTITY_TOKEN_FILE "
    "with AWS_ROLE_ARN, a container credentials endpoint (AWS_CONTAINER_CREDENTIALS_RELATIVE_URI), "
    "or the instance metadata service of an EC2 instance (its role); a public bucket needs none: "
    "[s3] anonymous = true"
)
SHARDS = f'"gs://{BUCKET}/train/train-{{000000..{TRAIN_SHARDS - 1:06d}}}.tar"'


class Metadata:
    """A loopback stand-in for a metadata server: answers the token path with ``status``
    (200 with a token that is always about to expire, so every ask fetches anew; ``token``,
    if given, makes it: ``token() -> (access_token, expires_in)``), and never answers at all
    when ``status`` is None."""

    def __init__(self, status=200, token=lambda: ("t", 1)):
        self.status = status
        self.asked = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                outer.asked += 1
                if outer.status is None:
                    outer.release.wait()
                    return
                body = b"{}"
                if outer.status == 200:
                    access, expires_in = token()
                    body = json.dumps({"access_token": access, "expires_in": expires_in,
                                       "token_type": "Bearer"}).encode()
                self.send_response(outer.status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_PUT = do_GET  # the EC2 metadata service's token request

            def log_message(self, *args):
                pass

        self.release = threading.Event()
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def closed_port():
    """A loopback port nobody listens on (connections are refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def no_credentials_env(tmp_path, metadata):
    """The environment of a machine with no credentials: no GOOGLE_* or AWS_* variables, an
    empty HOME (no gcloud application-default file), the metadata servers at ``metadata``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GOOGLE_", "AWS_", "GCE_"))}
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env.update(
        HOME=str(home), GCE_METADATA_HOST=metadata, GCE_METADATA_IP=metadata,
        AWS_METADATA_ENDPOINT=f"http://{metadata}",
    )
    return env


def write_config(tmp_path, body):
    config = tmp_path / "config.toml"
    config.write_text(
        f'[server]\nsocket = "{tmp_path}/shardd.sock"\nmetrics_addr = ""\n'
        f'[cache]\ndir = "{tmp_path}/cache"\n' + body
    )
    return config


def run(args, env, timeout=DEADLINE):
    started = time.monotonic()
    out = subprocess.run([SHARDD, *args], capture_output=True, text=True, env=env, timeout=timeout)
    return out, time.monotonic() - started


def assert_one_line(stderr, store, hint, cause):
    """stderr is exactly the one error line: the store, the cause (containing ``cause``), the
    ways to give credentials."""
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    prefix = f"shardd: error: {store}: no credentials ("
    assert lines[0].startswith(prefix) and lines[0].endswith(")" + hint), lines[0]
    assert cause in lines[0][len(prefix):-len(hint)], lines[0]


@pytest.mark.parametrize("metadata", ["closed", "404", "500"])
def test_check_without_credentials_fails_within_seconds(tmp_path, metadata):
    server = None if metadata == "closed" else Metadata(int(metadata))
    try:
        address = closed_port() if server is None else server.address
        config = write_config(tmp_path, f"[datasets.train]\nshards = {SHARDS}\n")
        out, took = run(["check", "--config", str(config)], no_credentials_env(tmp_path, address))
    finally:
        if server:
            server.close()
    assert out.returncode == 1
    assert took < 30, f"took {took:.1f}s"
    print(f"check without credentials ({metadata}): {took:.2f}s")
    cause = {"closed": "Connection refused", "404": "404 Not Found", "500": "500 Internal Server Error"}[metadata]
    assert_one_line(out.stderr, f"gs://{BUCKET}", GCS_HINT, cause)
    assert out.stdout == f"{config}: ok\n", "no shard was asked for"
    if server:
        # One token request per attempt (metadata host, then metadata IP), not one per shard.
        assert server.asked <= 6, server.asked


def test_the_line_names_both_metadata_addresses_asked(tmp_path):
    """object_store asks GCE_METADATA_HOST, then GCE_METADATA_IP, and reports only the last
    failure: the line names both addresses and where each came from, so an operator who set
    GCE_METADATA_HOST does not read only the default IP."""
    host, ip = closed_port(), closed_port()
    env = no_credentials_env(tmp_path, host)
    env["GCE_METADATA_IP"] = ip
    config = write_config(tmp_path, f"[datasets.train]\nshards = {SHARDS}\n")
    out, took = run(["check", "--config", str(config)], env)
    assert out.returncode == 1 and took < 30, (took, out.stderr)
    assert_one_line(
        out.stderr, f"gs://{BUCKET}", GCS_HINT,
        f"asked the metadata server at {host} (GCE_METADATA_HOST), then at {ip} (GCE_METADATA_IP); "
        f"the last answer: ",
    )
    assert f"http://{ip}/computeMetadata" in out.stderr, out.stderr


def test_a_silent_metadata_server_is_given_up_on_after_credentials_timeout(tmp_path):
    server = Metadata(status=None)
    try:
        config = write_config(
            tmp_path, f'[store]\ncredentials_timeout = "1s"\n[datasets.train]\nshards = {SHARDS}\n'
        )
        out, took = run(["check", "--config", str(config)], no_credentials_env(tmp_path, server.address))
    finally:
        server.close()
    assert out.returncode == 1 and took < 30
    assert_one_line(out.stderr, f"gs://{BUCKET}", GCS_HINT,
                    "the credential source did not answer within 1s (store.credentials_timeout)")


@pytest.mark.parametrize("command", ["warm", "index", "serve"])
def test_every_command_that_reaches_the_store_fails_alike(tmp_path, command):
    env = no_credentials_env(tmp_path, closed_port())
    config = write_config(tmp_path, f"[datasets.train]\nshards = {SHARDS}\n")
    args = {
        "warm": ["warm", "--config", str(config)],
        "index": ["index", f"gs://{BUCKET}/train/train-{{000000..000003}}.tar", "-o", str(tmp_path / "m.json")],
        "serve": ["serve", "--config", str(config)],
    }[command]
    out, took = run(args, env)
    assert out.returncode == 1 and took < 30, (took, out.stderr)
    if command == "serve":
        # The daemon logs its start first; its last word is the one line. It never bound the
        # socket: trainers keep reconnecting until systemd has restarted it with credentials.
        last = out.stderr.splitlines()[-1]
        assert_one_line(last, f"gs://{BUCKET}", GCS_HINT, "Connection refused")
        assert not (tmp_path / "shardd.sock").exists()
    else:
        assert_one_line(out.stderr, f"gs://{BUCKET}", GCS_HINT, "Connection refused")


@pytest.mark.parametrize("key", ["missing", "not-json", "authorized-user"])
def test_a_gcs_key_file_that_is_not_a_key_is_named_by_check_and_serve_alike(tmp_path, key):
    """[gcs] credentials naming a file that is missing, not JSON, or gcloud's user
    credentials: one line naming the store, the config key and the file, and what is wrong,
    the same from `check` as from `serve`, before any request."""
    path = tmp_path / "key.json"
    if key == "not-json":
        path.write_text("-----BEGIN PRIVATE KEY-----\n")
    elif key == "authorized-user":
        path.write_text(json.dumps({"type": "authorized_user", "client_id": "x", "refresh_token": "y"}))
    why = {
        "missing": "cannot be read: No such file or directory (os error 2)",
        "not-json": "is not a service account key (not JSON: invalid number at line 1 column 2)",
        "authorized-user": ("is not a service account key: it has no client_email, private_key, private_key_id (its "
                            "type: authorized_user; create one with `gcloud iam service-accounts keys create`)"),
    }[key]
    config = write_config(tmp_path, f'[gcs]\ncredentials = "{path}"\n[datasets.train]\nshards = {SHARDS}\n')
    env = no_credentials_env(tmp_path, closed_port())
    for command in ("check", "serve"):
        out, took = run([command, "--config", str(config)], env)
        assert out.returncode == 1 and took < 30, (command, took, out.stderr)
        assert out.stderr.splitlines()[-1] == f'shardd: error: gs://{BUCKET}: [gcs] credentials = "{path}" {why}', out.stderr


def test_s3_without_credentials_fails_within_seconds(tmp_path):
    env = no_credentials_env(tmp_path, closed_port())
    config = write_config(tmp_path, '[s3]\nregion = "us-east-1"\n[datasets.train]\nshards = "s3://bkt3/train/a.tar"\n')
    out, took = run(["check", "--config", str(config)], env)
    assert out.returncode == 1 and took < 30, (took, out.stderr)
    assert_one_line(out.stderr, "s3://bkt3", S3_HINT, "Connection refused")


def test_an_emulator_needs_no_credentials(tmp_path, fake_gcs, train_paths):
    """`anonymous = true` (conftest's gcs_config) and a key file with disable_oauth (how
    object_store's own CI points at an emulator, through the new `[gcs] credentials`) both
    work with no credentials anywhere."""
    env = no_credentials_env(tmp_path, closed_port())
    config = write_config(tmp_path, gcs_config(fake_gcs))
    out, took = run(["check", "--config", str(config)], env)
    assert out.returncode == 1, "the config's `missing` dataset names a missing shard"
    assert "gs://bkt/nope/gone.tar: object not found" in out.stdout and "credentials" not in out.stderr
    key = tmp_path / "key.json"
    key.write_text(json.dumps({"gcs_base_url": fake_gcs, "disable_oauth": True,
                               "client_email": "", "private_key": "", "private_key_id": ""}))
    config = write_config(tmp_path, f'[gcs]\ncredentials = "key.json"\n[datasets.train]\nshards = {SHARDS}\n')
    out, took = run(["check", "--config", str(config)], env)
    assert out.returncode == 0, out.stderr
    assert f"dataset train: {TRAIN_SHARDS} shards" in out.stdout


def test_readyz_says_when_credentials_go_away(make_daemon, fake_gcs, train_paths, tmp_path):
    """A daemon whose credentials come from the metadata server serves; when the metadata
    server stops giving tokens, /readyz answers 503 with the one line, and 200 again when it
    is back."""
    metadata = Metadata(200)
    try:
        env = no_credentials_env(tmp_path, metadata.address)
        body = gcs_config(fake_gcs).replace("anonymous = true\n", "")
        d = make_daemon(body, env=env)
        with shardd.Client(d.socket) as c:
            got = {s["__key__"] for s in c.stream("train", epoch=0, rank=0, world_size=1)}
        assert got == set(reference_samples(train_paths))
        metadata.status = 404
        url = f"http://127.0.0.1:{d.metrics_port}/readyz"

        def readyz():
            try:
                with urllib.request.urlopen(url, timeout=DEADLINE) as r:
                    return r.status, r.read().decode()
            except urllib.error.HTTPError as e:
                return e.code, e.read().decode()

        status, text = wait_for(lambda: (r := readyz())[0] == 503 and r, "/readyz to turn 503")
        assert text.startswith(f"not ready: gs://{BUCKET}: no credentials ("), text
        assert text.endswith(")" + GCS_SECTION_HINT + "\n") and "404 Not Found" in text, text
        metadata.status = 200
        wait_for(lambda: readyz()[0] == 200, "/readyz to turn 200 again")
    finally:
        metadata.close()
