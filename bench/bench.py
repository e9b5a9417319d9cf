"""shardd throughput benchmark (run on demand; not a test, asserts nothing).

Generates local shards of ~100 KB and ~10 KB samples with webdataset's TarWriter, then, warm
(page cache filled, runs interleaved, best of --repeat), measures in one run:
  - webdataset reading the shards in this process (the baseline);
  - the shardd Python client reading the same shards from a release-built daemon
    (one stream: rank 0 of world 1, sample shuffle window 1000);
  - raw Unix-socket bandwidth into this process (recv_into a 1 MiB buffer from a process
    that sends as fast as it can): the ceiling for any socket-based client.
Prints samples/s and MB/s for each and the ratios.

    .venv/bin/python bench/bench.py            # builds target/release/shardd first
"""

import argparse
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "clients" / "python"))

import shardd  # noqa: E402
import webdataset as wds  # noqa: E402

SHARDS = 16


def generate(directory, sample_bytes, total_bytes):
    directory.mkdir(parents=True, exist_ok=True)
    per_shard = max(1, total_bytes // sample_bytes // SHARDS)
    paths = [directory / f"shard-{i:06d}.tar" for i in range(SHARDS)]
    if all(p.exists() for p in paths):
        return paths
    write_shards(paths, per_shard, sample_bytes)
    return paths


def write_shards(paths, per_shard, sample_bytes):
    """Writes each path as a tar of ``per_shard`` samples of ``sample_bytes`` (slices of one
    incompressible blob: cheap to make) with webdataset.TarWriter."""
    blob = random.Random(0).randbytes(sample_bytes * 4)
    n = 0
    for path in paths:
        with wds.TarWriter(str(path)) as sink:
            for _ in range(per_shard):
                off = (n * 7919) % (3 * sample_bytes)
                sink.write({"__key__": f"s{n:08d}", "bin": blob[off : off + sample_bytes], "cls": b"7"})
                n += 1


def measure(fn):
    t = time.perf_counter()
    samples, nbytes = fn()
    dt = time.perf_counter() - t
    return samples / dt, nbytes / dt / 1e6


def read_webdataset(paths):
    samples = nbytes = 0
    for s in wds.WebDataset([str(p) for p in paths], shardshuffle=False, empty_check=False):
        samples += 1
        nbytes += len(s["bin"]) + len(s["cls"])
    return samples, nbytes


def read_shardd(sock, dataset):
    samples = nbytes = 0
    with shardd.Client(sock) as c:
        for s in c.stream(dataset, epoch=0, rank=0, world_size=1):
            samples += 1
            nbytes += len(s["bin"]) + len(s["cls"])
    return samples, nbytes


RAW_SENDER = """
import socket, sys
s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])
chunk = memoryview(bytes(1 << 20)); total = int(sys.argv[2])
while total > 0:
    s.sendall(chunk); total -= len(chunk)
s.close()
"""


def read_raw(tmp, total):
    path = os.path.join(tmp, f"raw-{time.monotonic_ns()}.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(1)
    sender = subprocess.Popen([sys.executable, "-c", RAW_SENDER, path, str(total)])
    conn, _ = srv.accept()
    buf = bytearray(1 << 20)
    got = 0
    while n := conn.recv_into(buf):
        got += n
    conn.close()
    srv.close()
    sender.wait()
    return 0, got


def start_daemon(tmp, datasets):
    binary = ROOT / "target" / "release" / "shardd"
    subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=ROOT, check=True)
    sock = os.path.join(tmp, "shardd.sock")
    config = os.path.join(tmp, "config.toml")
    with open(config, "w") as f:
        f.write(f'[server]\nsocket = "{sock}"\nmetrics_addr = ""\n[cache]\ndir = "{tmp}/cache"\n')
        for name, paths in datasets.items():
            shards = ", ".join(f'"{p}"' for p in paths)
            f.write(f"[datasets.{name}]\nshards = [{shards}]\nshuffle_buffer = 1000\n")
    proc = subprocess.Popen([str(binary), "serve", "--config", config], stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not os.path.exists(sock):
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError("shardd did not start")
        time.sleep(0.01)
    return proc, sock


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(ROOT / "bench" / "data"), help="where shards are generated (kept)")
    ap.add_argument("--total-mb", type=int, default=800, help="dataset size per sample size")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    data = pathlib.Path(args.data)
    total = args.total_mb * 1_000_000
    sets = {
        "s100k": generate(data / "100k", 100_000, total),
        "s10k": generate(data / "10k", 10_000, total // 2),
    }
    with tempfile.TemporaryDirectory() as tmp:
        proc, sock = start_daemon(tmp, sets)
        try:
            rows = []
            raw_best = 0.0
            for name, paths in sets.items():
                read_webdataset(paths)  # warm the page cache
                best = {"webdataset": (0, 0), "shardd": (0, 0)}
                for _ in range(args.repeat):
                    for label, fn in [
                        ("webdataset", lambda: read_webdataset(paths)),
                        ("shardd", lambda: read_shardd(sock, name)),
                    ]:
                        r = measure(fn)
                        best[label] = max(best[label], r, key=lambda x: x[1])
                    raw_best = max(raw_best, measure(lambda: read_raw(tmp, 2_000_000_000))[1])
                rows.append((name, best))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait()

    print(f"\n{'dataset':8} {'reader':11} {'samples/s':>11} {'MB/s':>8}")
    for name, best in rows:
        for label, (sps, mbs) in best.items():
            print(f"{name:8} {label:11} {sps:11.0f} {mbs:8.0f}")
    print(f"{'':8} {'raw socket':11} {'':>11} {raw_best:8.0f}")
    print()
    for name, best in rows:
        w, s = best["webdataset"], best["shardd"]
        print(
            f"{name}: shardd/webdataset = {s[0] / w[0]:.1f}x samples/s, {s[1] / w[1]:.1f}x MB/s; "
            f"shardd/raw socket = {100 * s[1] / raw_best:.0f}%"
        )


if __name__ == "__main__":
    main()
