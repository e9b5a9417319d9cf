"""Running under systemd and on TPU VMs: host auto-discovery (environment, then a metadata
server), sd_notify readiness, and socket activation. There is no systemd here: the tests
play its part (a datagram socket for NOTIFY_SOCKET, a listening socket passed as fd 3)."""

import http.server
import json
import os
import signal
import socket
import struct
import subprocess
import threading

import pytest
import shardd

from conftest import SHARDD, gcs_config, wait_for


def write_config(tmp_path, body, host=""):
    config = tmp_path / "config.toml"
    config.write_text(
        f'[server]\nsocket = "{tmp_path}/shardd.sock"\nmetrics_addr = ""\n'
        f'[cache]\ndir = "{tmp_path}/cache"\n{host}\n' + body
    )
    return config


def no_host_env():
    return {k: v for k, v in os.environ.items() if not k.startswith(("SHARDD_HOST_", "GCE_METADATA_HOST"))}


class MetadataServer:
    """Stands in for the GCE/TPU VM metadata server: answers the two attributes shardd asks
    for, only with the Metadata-Flavor header, like the real one."""

    def __init__(self, worker_number, endpoints):
        answers = {
            "/computeMetadata/v1/instance/attributes/agent-worker-number": worker_number,
            "/computeMetadata/v1/instance/attributes/worker-network-endpoints": endpoints,
        }
        self.asked = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(handler):  # noqa: N805
                self.asked.append(handler.path)
                body = answers.get(handler.path)
                if handler.headers.get("Metadata-Flavor") != "Google" or body is None:
                    handler.send_response(403 if body else 404)
                    handler.end_headers()
                    return
                handler.send_response(200)
                handler.send_header("Content-Length", str(len(body)))
                handler.end_headers()
                handler.wfile.write(body.encode())

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.host = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def serve(config, env, **kw):
    return subprocess.Popen([SHARDD, "serve", "--config", str(config)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def stop(proc):
    proc.terminate()
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    return out


def test_host_auto_from_the_metadata_server(fake_gcs, tmp_path):
    meta = MetadataServer("1", "10.0.0.2:8470,10.0.0.3:8470,10.0.0.4:8470,10.0.0.5:8470")
    try:
        config = write_config(tmp_path, gcs_config(fake_gcs).split("\n", 3)[3],
                              host='[host]\nindex = "auto"\ncount = "auto"')
        proc = serve(config, {**no_host_env(), "GCE_METADATA_HOST": meta.host, "SHARDD_LOG": "info"})
        wait_for(lambda: (tmp_path / "shardd.sock").exists() or proc.poll() is not None, "the socket")
        with shardd.Client(tmp_path / "shardd.sock") as c:
            # Host 1 of 4 serves ranks 2 and 3 of world 8.
            with pytest.raises(shardd.DaemonError, match="host 1 of 4 serves ranks 2..=3"):
                c.stream("train", epoch=0, rank=0, world_size=8)
            # 12 shards over 4 hosts: 3 each (no leftovers); rank 2 is local rank 0 of the
            # host's 2, which takes positions 0 and 2 of the host's epoch order: 2 shards.
            with c.stream("train", epoch=0, rank=2, world_size=8) as stream:
                assert stream.shards == 2
        out = stop(proc)
        plain = out.replace("\x1b[3m", "").replace("\x1b[0m", "").replace("\x1b[2m", "")
        assert ("found this host's place index=1 count=4 from=\"index: the metadata server's agent-worker-number; "
                "count: the metadata server's worker-network-endpoints\"") in plain, out
        assert len(meta.asked) == 2
    finally:
        meta.close()


def test_host_auto_from_the_environment_first(fake_gcs, tmp_path):
    config = write_config(tmp_path, gcs_config(fake_gcs).split("\n", 3)[3],
                          host='[host]\nindex = "auto"\ncount = 2')
    env = {**no_host_env(), "SHARDD_HOST_INDEX": "1", "GCE_METADATA_HOST": "127.0.0.1:9"}
    proc = serve(config, env)
    wait_for(lambda: (tmp_path / "shardd.sock").exists() or proc.poll() is not None, "the socket")
    with shardd.Client(tmp_path / "shardd.sock") as c:
        with pytest.raises(shardd.DaemonError, match="host 1 of 2 serves ranks 1..=1"):
            c.stream("train", epoch=0, rank=0, world_size=2)
    stop(proc)


def test_host_auto_with_nobody_to_ask_is_a_clear_error(fake_gcs, tmp_path):
    config = write_config(tmp_path, gcs_config(fake_gcs).split("\n", 3)[3], host='[host]\nindex = "auto"')
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there
    out = subprocess.run([SHARDD, "serve", "--config", str(config)], capture_output=True, text=True,
                         env={**no_host_env(), "GCE_METADATA_HOST": f"127.0.0.1:{port}"}, timeout=60)
    assert out.returncode == 1
    assert out.stderr.endswith(
        f'host.index = "auto": SHARDD_HOST_INDEX is not set and the metadata server at '
        f"127.0.0.1:{port} (GCE_METADATA_HOST) could not be reached: Connection refused (os error 111)\n"), out.stderr
    bad = write_config(tmp_path, gcs_config(fake_gcs).split("\n", 3)[3], host='[host]\nindex = "first"')
    out = subprocess.run([SHARDD, "check", "--config", str(bad)], capture_output=True, text=True)
    assert out.returncode == 1 and 'host.index "first" is neither a number, "auto" nor "from-clients"' in out.stderr


def test_sd_notify_ready_then_stopping(fake_gcs, tmp_path):
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    notify.settimeout(30)
    config = write_config(tmp_path, gcs_config(fake_gcs))
    proc = serve(config, {**no_host_env(), "NOTIFY_SOCKET": str(tmp_path / "notify.sock"),
                          "WATCHDOG_USEC": "200000"})
    ready = notify.recv(4096).decode()
    assert ready.startswith("READY=1\nSTATUS=serving 7 datasets as host 0 of 1"), ready
    # The socket is bound by the time READY=1 is sent: a client is served at once.
    with shardd.Client(tmp_path / "shardd.sock") as c:
        assert len(list(c.stream("train", epoch=0, rank=0, world_size=1))) > 100
    # The watchdog hears from the daemon (every 100 ms for a 200 ms WATCHDOG_USEC).
    assert notify.recv(4096) == b"WATCHDOG=1"
    proc.terminate()
    while (msg := notify.recv(4096)) == b"WATCHDOG=1":
        pass
    assert msg == b"STOPPING=1\nSTATUS=stopping"
    proc.communicate(timeout=30)
    assert proc.returncode == 0


def test_socket_activation_uses_the_passed_socket_and_leaves_it(fake_gcs, tmp_path):
    path = tmp_path / "activated.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(16)
    fd = listener.fileno()

    def as_systemd_would():
        # In the child, between fork and exec: the socket becomes fd 3, LISTEN_PID our pid.
        os.dup2(fd, 3)
        os.environ["LISTEN_FDS"] = "1"
        os.environ["LISTEN_PID"] = str(os.getpid())

    config = write_config(tmp_path, gcs_config(fake_gcs))  # server.socket names another path
    # close_fds=False: the fd 3 made after fork must survive until exec (dup2 leaves it
    # inheritable; every other descriptor of ours is close-on-exec).
    proc = subprocess.Popen([SHARDD, "serve", "--config", str(config)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, close_fds=False,
                            preexec_fn=as_systemd_would, env=None)
    listener.close()
    with shardd.Client(path) as c:
        assert len(list(c.stream("train", epoch=0, rank=0, world_size=1))) > 100
    assert not (tmp_path / "shardd.sock").exists(), "bound its own socket as well"
    stop(proc)
    assert path.exists(), "removed the socket systemd owns"


def test_sigterm_during_streams_and_downloads(make_daemon, fake_gcs, cutting_proxy, shard_dir):
    from conftest import BIG_SHARDS, big_payload

    # 8 MB shards at 2 MB/s: each download takes ~4 s, a window a loaded runner does not miss
    # (after the first sample the stream waits for the next shard's download: the signal must
    # come while it waits, not once it is writing that 8 MB sample).
    slow = cutting_proxy(rate=2 << 20)
    d = make_daemon(gcs_config(slow.endpoint, extra="[store]\nmax_downloads = 1\n"))
    with shardd.Client(d.socket, reconnect_timeout=0) as c:  # shutdown raised, not waited out
        stream = c.stream("big", epoch=0, rank=0, world_size=1)
        next(stream)
        wait_for(lambda: d.metric("shardd_downloads_active") >= 1, "a download in flight")
        d.proc.terminate()
        # The stream is told why it ends (it was waiting for data, so no frame was cut).
        with pytest.raises(shardd.DaemonError) as e:
            list(stream)
    assert e.value.code == "shutdown" and str(e.value) == "the daemon is shutting down"
    assert d.proc.wait(timeout=30) == 0
    d.proc = None
    d.log.close()
    assert not d.socket.exists()
    # The cache is consistent: a restart (straight to the store) serves everything.
    d.config.write_text(d.config.read_text().replace(slow.endpoint, fake_gcs))
    d.start()
    assert list((d.dir / "cache" / "tmp").iterdir()) == []
    got = sorted((s["__key__"], s["bin"]) for s in shardd.Client(d.socket).stream("big", epoch=0, rank=0, world_size=1))
    assert got == [(f"big{i}", big_payload(i)) for i in range(BIG_SHARDS)]


def test_a_second_signal_exits_at_once(make_daemon, fake_gcs):
    """The first SIGTERM drains: a stream cut mid-frame by a client that reads nothing holds
    the exit up for the frame's write timeout (2 s). A second signal does not wait for it."""
    d = make_daemon(gcs_config(fake_gcs))
    silent = socket.socket(socket.AF_UNIX)
    silent.connect(str(d.socket))
    body = json.dumps({"op": "stream", "dataset": "big", "epoch": 0, "rank": 0, "world_size": 1}).encode()
    silent.sendall(b"SHARDD\x02\x00" + struct.pack("<IB", len(body), 1) + body)

    wait_for(lambda: [s["waiting_on"] for s in d.status()["streams"]] == ["client"],
             "the stream to block on its client")
    d.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: "SIGTERM: shutting down" in d.log_path.read_text(), "the first signal to be seen")
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(timeout=30) == 130
    assert "shardd: second signal: exiting now" in d.log_path.read_text()
    d.proc = None
    d.log.close()
    silent.close()
    # The socket file is left behind; the next start replaces it.
    d.start()


def test_socket_mode_and_group_from_the_start_and_one_winner(fake_gcs, tmp_path):
    import stat

    gid = os.getgid()
    body = gcs_config(fake_gcs)
    configs = []
    for name in ("a", "b"):
        c = tmp_path / f"{name}.toml"
        c.write_text(
            f'[server]\nsocket = "{tmp_path}/shared.sock"\nmetrics_addr = ""\nsocket_mode = "0640"\n'
            f'socket_group = "{gid}"\n[cache]\ndir = "{tmp_path}/cache-{name}"\n' + body
        )
        configs.append(c)
    # Two daemons started at once on one socket path: exactly one serves it.
    procs = [serve(c, no_host_env()) for c in configs]
    wait_for(lambda: any(p.poll() is not None for p in procs), "one of them to give up")
    loser = next(p for p in procs if p.poll() is not None)
    winner = next(p for p in procs if p is not loser)
    out, _ = loser.communicate()
    assert loser.returncode == 1 and f"another shardd is already serving on {tmp_path}/shared.sock" in out, out
    st = (tmp_path / "shared.sock").stat()
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o640 and st.st_gid == gid
    with shardd.Client(tmp_path / "shared.sock") as c:
        assert len(list(c.stream("train", epoch=0, rank=0, world_size=1))) > 100
    # A path that no longer names our socket is not removed on the way out.
    (tmp_path / "shared.sock").unlink()
    (tmp_path / "shared.sock").write_text("someone else's")
    stop(winner)
    assert (tmp_path / "shared.sock").read_text() == "someone else's"


def test_json_logs_carry_the_stream_span(fake_gcs, tmp_path):
    import json

    config = write_config(tmp_path, gcs_config(fake_gcs))
    proc = subprocess.Popen([SHARDD, "--log-format", "json", "serve", "--config", str(config)],
                            env={**no_host_env(), "SHARDD_LOG": "info"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for(lambda: (tmp_path / "shardd.sock").exists(), "the socket")
    with shardd.Client(tmp_path / "shardd.sock") as c:
        list(c.stream("train", epoch=4, rank=0, world_size=1))
    out = stop(proc)
    lines = [json.loads(line) for line in out.splitlines()]
    done = [l for l in lines if l["fields"].get("message") == "stream completed"]
    assert len(done) == 1, out
    assert done[0]["span"]["dataset"] == "train" and done[0]["span"]["epoch"] == 4
    assert done[0]["span"]["peer_pid"] == os.getpid()
