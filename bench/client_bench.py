"""The Python client's own cost: one consumer reading a cached dataset as fast as it can, with
and without read-ahead, the variants interleaved round by round (the machine's load drifts;
interleaving keeps the comparison fair). Prints samples/s and MB/s per variant: best and
median of --rounds. Uses bench/bench.py's shards (--data) and daemon start.

    .venv/bin/python bench/client_bench.py --shardd target/release/shardd
    .venv/bin/python bench/client_bench.py --client /path/to/other/clients/python  # A/B
"""

import argparse
import os
import pathlib
import signal
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(ROOT / "bench" / "data"))
    ap.add_argument("--total-mb", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shardd", default=str(ROOT / "target" / "release" / "shardd"))
    ap.add_argument("--client", action="append", default=[],
                    help="other clients/python directories to compare (label: the path)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    import bench  # noqa: E402  (shard generation and the daemon's start)

    data = pathlib.Path(args.data)
    total = args.total_mb * 1_000_000
    sets = {
        "s10k": bench.generate(data / f"10k-{args.total_mb}", 10_000, total // 2),
        "s100k": bench.generate(data / f"100k-{args.total_mb}", 100_000, total),
    }
    clients = [("this", str(ROOT / "clients" / "python"))] + [(p, p) for p in args.client]
    variants = []
    for label, path in clients:
        for key in [k for k in list(sys.modules) if k == "shardd" or k.startswith("shardd.")]:
            del sys.modules[key]
        sys.path.insert(0, path)
        import shardd  # noqa: E402
        sys.path.remove(path)
        params = shardd.Client.__init__.__code__.co_varnames
        if "readahead" in params:
            variants.append((f"{label} readahead=0", shardd.Client, {"readahead": 0}))
            variants.append((f"{label} readahead (default)", shardd.Client, {}))
        else:
            variants.append((f"{label}", shardd.Client, {}))

    def read(client_cls, kw, sock, name):
        samples = nbytes = 0
        with client_cls(sock, **kw) as c:
            for s in c.stream(name, epoch=0, rank=0, world_size=1):
                samples += 1
                nbytes += len(s["bin"]) + len(s["cls"])
        return samples, nbytes

    with tempfile.TemporaryDirectory() as tmp:
        proc, sock = bench.start_daemon(tmp, sets, args.shardd)
        try:
            results = {}
            for name in sets:
                for _, cls, kw in variants:
                    read(cls, kw, sock, name)  # warm the daemon's cache and the page cache
                for _ in range(args.rounds):
                    for label, cls, kw in variants:
                        t = time.perf_counter()
                        samples, nbytes = read(cls, kw, sock, name)
                        dt = time.perf_counter() - t
                        results.setdefault((name, label), []).append((samples / dt, nbytes / dt / 1e6))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait()
    print(f"\none consumer, {args.rounds} interleaved rounds, daemon {args.shardd}")
    print(f"{'dataset':8} {'client':60} {'best samples/s':>15} {'median':>9} {'best MB/s':>10}")
    for (name, label), rs in results.items():
        print(f"{name:8} {label:60} {max(r[0] for r in rs):15.0f} "
              f"{statistics.median(r[0] for r in rs):9.0f} {max(r[1] for r in rs):10.0f}")


if __name__ == "__main__":
    main()
