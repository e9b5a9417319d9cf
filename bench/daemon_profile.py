"""Where the daemon's CPU goes while it serves one consumer from a warm cache (run on demand;
asserts nothing). The recipe behind the figures of the issue "a lean daemon".

Starts a release daemon on bench/bench.py's shards (generated there; --size 10k or 100k),
reads the dataset once to warm both caches, then reads it --epochs more times with the
Python client and prints: samples/s, the daemon's CPU time per sample and per GB (utime +
stime from /proc, all threads) and its context switches per MB served (wake-ups: all threads'
voluntary + involuntary switches from /proc/<pid>/task/*/status).

With --perf it samples the daemon meanwhile with `perf record -e cpu-clock -g` (a software
clock: works in VMs without hardware counters; user and kernel stacks) and prints the top
symbols; `perf report -i <out>` browses the rest. Where even that is refused, --callgrind
runs the daemon under valgrind's callgrind instead (instruction counts: repeatable on a noisy
machine, user space only, ~50x slower: use --epochs 1 and the 10k set), then
`callgrind_annotate <out>` lists the functions.

    .venv/bin/python bench/daemon_profile.py --size 10k                 # figures only
    .venv/bin/python bench/daemon_profile.py --size 10k --perf          # + perf profile
    .venv/bin/python bench/daemon_profile.py --size 10k --callgrind --epochs 1
    .venv/bin/python bench/daemon_profile.py --zero-copy ...            # the zero-copy path
Environment variables are passed to the daemon (e.g. RUST_LOG).
"""

import argparse
import glob
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import bench  # noqa: E402


def switches(pid):
    total = 0
    for path in glob.glob(f"/proc/{pid}/task/*/status"):
        try:
            with open(path) as f:
                total += sum(int(line.split()[1]) for line in f if "ctxt_switches" in line)
        except OSError:
            pass  # a thread that ended meanwhile
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=["10k", "100k"], default="10k")
    ap.add_argument("--total-mb", type=int, default=200, help="as bench/bench.py's (shards shared with it)")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--zero-copy", action="store_true")
    ap.add_argument("--perf", metavar="OUT", nargs="?", const="/tmp/shardd.perf")
    ap.add_argument("--callgrind", metavar="OUT", nargs="?", const="/tmp/shardd.callgrind")
    ap.add_argument("--shardd", help="the daemon binary (default: build target/release/shardd)")
    args = ap.parse_args()

    data = pathlib.Path(ROOT / "bench" / "data")
    total = args.total_mb * 1_000_000
    size = 10_000 if args.size == "10k" else 100_000
    paths = bench.generate(data / f"{args.size}-{args.total_mb}", size, total // 2 if size == 10_000 else total)
    binary = args.shardd
    if binary is None:
        subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=ROOT, check=True)
        binary = str(ROOT / "target" / "release" / "shardd")
    if args.callgrind:
        wrapper = pathlib.Path(tempfile.mkdtemp()) / "shardd"
        wrapper.write_text(f"#!/bin/sh\nexec valgrind --tool=callgrind --callgrind-out-file={args.callgrind} "
                           f"{binary} \"$@\"\n")
        wrapper.chmod(0o755)
        binary = str(wrapper)
    with tempfile.TemporaryDirectory() as tmp:
        proc, sock = bench.start_daemon(tmp, {"d": paths}, binary, timeout=300 if args.callgrind else 30)
        perf = None
        try:
            bench.read_shardd(sock, "d", args.zero_copy)
            if args.perf:
                perf = subprocess.Popen(["perf", "record", "-q", "-e", "cpu-clock", "-F", "2000", "-g",
                                         "--call-graph", "dwarf,16384", "-o", args.perf, "-p", str(proc.pid)])
            cpu0, sw0, t0 = bench.cpu_seconds(proc.pid), switches(proc.pid), time.perf_counter()
            samples = nbytes = 0
            for _ in range(args.epochs):
                n, b = bench.read_shardd(sock, "d", args.zero_copy)
                samples, nbytes = samples + n, nbytes + b
            dt = time.perf_counter() - t0
            cpu, sw = bench.cpu_seconds(proc.pid) - cpu0, switches(proc.pid) - sw0
        finally:
            if perf is not None:
                perf.send_signal(signal.SIGINT)
                perf.wait()
            proc.send_signal(signal.SIGTERM)
            proc.wait()
    print(f"{args.size}{' zero-copy' if args.zero_copy else ''}: {samples} samples in {dt:.2f} s, "
          f"{samples / dt:.0f} samples/s; daemon {1e6 * cpu / samples:.2f} us/sample, "
          f"{cpu / nbytes * 1e9:.3f} CPU-s/GB, {sw / (nbytes / 1e6):.1f} context switches/MB")
    if args.perf:
        out = subprocess.run(["perf", "report", "-i", args.perf, "--no-children", "--stdio", "--sort",
                              "dso,symbol", "-g", "none"], capture_output=True, text=True).stdout
        print("\n".join([line for line in out.splitlines() if "%" in line][:25]))
    if args.callgrind:
        print(f"callgrind_annotate {args.callgrind} | head -40")


if __name__ == "__main__":
    main()
