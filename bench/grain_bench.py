"""shardd.grain against the plain client on the same streams (run on demand; asserts nothing).

Generates local shards of ~10 KB and ~100 KB samples (bench/bench.py's generator), serves them
from a release-built daemon, and measures, warm and interleaved (best of --repeat):
  - the plain client reading one stream (rank 0 of world 1, worker 0 of 1);
  - shardd.grain.ShardDataset reading the same stream (num_streams=1: one reader thread);
  - the plain client reading the rank's 2 streams one after the other, and
    shardd.grain with num_streams=2 reading them at once in 2 threads, interleaved;
  - shardd.grain with num_streams=2 under .map(identity).batch(32): Grain's own per-element cost.
Prints samples/s and MB/s and the ratios to the plain client.

    .venv/bin/python bench/grain_bench.py      # builds target/release/shardd first
"""

import argparse
import pathlib
import signal
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "clients" / "python"))
sys.path.insert(0, str(ROOT / "bench"))

import shardd  # noqa: E402
import shardd.grain  # noqa: E402
from bench import generate, start_daemon  # noqa: E402


def size(s):
    return len(s["bin"]) + len(s["cls"])


def client(sock, dataset, streams):
    samples = nbytes = 0
    with shardd.Client(sock) as c:
        for w in range(streams):
            for s in c.stream(dataset, epoch=0, rank=0, world_size=1, worker=w, num_workers=streams):
                samples += 1
                nbytes += size(s)
    return samples, nbytes


def grain_read(sock, dataset, streams, stages=False):
    ds = shardd.grain.ShardDataset(dataset, socket=sock, rank=0, world_size=1,
                                   num_streams=streams)
    samples = nbytes = 0
    if stages:
        for batch in ds.map(lambda s: s).batch(32, batch_fn=list):
            samples += len(batch)
            nbytes += sum(map(size, batch))
        return samples, nbytes
    for s in ds:
        samples += 1
        nbytes += size(s)
    return samples, nbytes


def measure(fn):
    t = time.perf_counter()
    samples, nbytes = fn()
    dt = time.perf_counter() - t
    return samples / dt, nbytes / dt / 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(ROOT / "bench" / "data"), help="where shards are generated (kept)")
    ap.add_argument("--total-mb", type=int, default=400, help="dataset size of the 100 KB set (10 KB: half)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    data = pathlib.Path(args.data)
    total = args.total_mb * 1_000_000
    sets = {"s10k": generate(data / "10k", 10_000, total // 2),
            "s100k": generate(data / "100k", 100_000, total)}
    readers = {
        "client, 1 stream": lambda sock, d: client(sock, d, 1),
        "grain, 1 stream": lambda sock, d: grain_read(sock, d, 1),
        "client, 2 streams": lambda sock, d: client(sock, d, 2),
        "grain, 2 streams": lambda sock, d: grain_read(sock, d, 2),
        "grain, 2 + map/batch": lambda sock, d: grain_read(sock, d, 2, stages=True),
    }
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        proc, sock = start_daemon(tmp, sets)
        try:
            for name in sets:
                client(sock, name, 2)  # the daemon's cache and the page cache, warm
                best = {label: (0.0, 0.0) for label in readers}
                for _ in range(args.repeat):
                    for label, fn in readers.items():
                        r = measure(lambda: fn(sock, name))
                        best[label] = max(best[label], r)
                rows[name] = best
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait()
    print(f"\n{'dataset':8} {'reader':22} {'samples/s':>11} {'MB/s':>8} {'vs client':>10}")
    for name, best in rows.items():
        for label, (sps, mbs) in best.items():
            base = best["client, 2 streams" if "2" in label else "client, 1 stream"][0]
            print(f"{name:8} {label:22} {sps:11.0f} {mbs:8.0f} {sps / base:9.2f}x")


if __name__ == "__main__":
    main()
