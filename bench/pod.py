"""The pod benchmark: tests/pod's scenarios (tests/pod/test_pod.py) with N hosts, each in its
own network namespace and booted as a TPU VM, and their pod tables. Not a timed test: it
prints figures (per host: first sample, epoch time, longest wait, requests, 429s, MB; the
pod: the slowest host, store bytes against the dataset, resize bytes against the minimum,
index time with 1 and N hosts, what Prometheus showed).

Run as root after scripts/test.sh (it needs the wheel and .venv):
    .venv/bin/python bench/pod.py --hosts 32 [--shards 256] [-k cold]
Every host runs 2 trainer processes; a 2-core machine runs them all, so times are the
machine's, not a pod's: compare hosts with each other and bytes with the bounds."""

import argparse
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHOWN = ("pod table", "host ", "   ", "slowest", "store bytes", "resize", "index of", "straggler",
         "tokens handed", "Prometheus", "the new host", "cold start")
# pytest's progress marks (".", "F", "E", "s") run into the first line a test prints.
MARKS = re.compile(r"^[.FEs]*(?=" + "|".join(SHOWN[:2] + SHOWN[3:]) + ")")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=32)
    ap.add_argument("--shards", type=int, help="default: 8 per host, at least 64")
    ap.add_argument("-k", default="", help="pytest -k: which scenarios (default all)")
    args = ap.parse_args()
    wheels = sorted((ROOT / "target" / "dist").glob("shardd-*.whl"))
    if not wheels:
        sys.exit("no wheel in target/dist: run scripts/test.sh first")
    env = {**os.environ, "SHARDD_POD_HOSTS": str(args.hosts),
           "SHARDD_POD_SHARDS": str(args.shards or max(64, 8 * args.hosts)),
           "SHARDD_WHEEL": str(wheels[-1]),
           "SHARDD_BIN": os.environ.get("SHARDD_BIN", str(ROOT / "target" / "debug" / "shardd"))}
    cmd = [sys.executable, "-m", "pytest", str(ROOT / "tests" / "pod"), "-q", "-s", "-rs",
           "-p", "no:cacheprovider"] + (["-k", args.k] if args.k else [])
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        text = MARKS.sub("", line)
        if text.startswith(SHOWN) or line.startswith(("E ", ">")) or re.match(r"\d+ (passed|failed)", text):
            print(text, end="", flush=True)
    sys.exit(proc.wait())


if __name__ == "__main__":
    main()
