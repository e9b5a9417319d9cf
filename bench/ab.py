"""A/B of one consumer reading one stream: two (or more) Python clients, or daemon builds, on
the same shards, in interleaved rounds (run on demand; not a test, asserts nothing).

This VM moves a build's samples/s by ±20 % between runs, so a change is judged by rounds of
every variant in turn, each round a fresh process reading ``--epochs`` epochs (best kept),
and by the client's CPU time, which the noise moves less. Uses bench.py's shards (--data) and
its consumer (``count``: ``len()`` of each field, or with --touch a copy of every byte).

    # the client at another commit against this one, zero copy, 10 KB samples, touched:
    git worktree add /tmp/before HEAD~1
    .venv/bin/python bench/ab.py --size 10k --zero-copy --touch \\
        --client before=/tmp/before/clients/python --client after=clients/python
    # two daemon builds:
    .venv/bin/python bench/ab.py --size 100k --zero-copy --touch \\
        --shardd before=/tmp/shardd-before --shardd after=target/release/shardd
    # the client's two decoders (SHARDD_DECODER: "python", or the compiled one's path):
    .venv/bin/python bench/ab.py --size 10k --zero-copy --touch --decoder python=python \\
        --decoder compiled=$(ls -t target/release/build/shardd-*/out/libshardd_decode.so | head -1)

Prints, per variant, microseconds per sample (wall: best and median of the rounds) and the
client's CPU microseconds per sample (``time.process_time``).
"""

import argparse
import itertools
import os
import pathlib
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent

# One round: a fresh process that imports the client from argv[1] and reads the stream.
ROUND = """
import sys, time
sys.path.insert(0, sys.argv[1]); sys.path.insert(1, sys.argv[2])
import shardd, bench
assert shardd.__file__.startswith(sys.argv[1]), shardd.__file__
sock, zc, touch, epochs = sys.argv[3], sys.argv[4] == "1", sys.argv[5] == "1", int(sys.argv[6])
bench.read_shardd(sock, "d", zc, touch=touch)  # warm
wall = cpu = float("inf")
for _ in range(epochs):
    t, c = time.perf_counter(), time.process_time()
    n, _ = bench.read_shardd(sock, "d", zc, touch=touch)
    wall = min(wall, (time.perf_counter() - t) / n * 1e6)
    cpu = min(cpu, (time.process_time() - c) / n * 1e6)
print(wall, cpu)
"""


def variants(flag, default):
    """``NAME=VALUE`` arguments as a dict (the default alone if none)."""
    return dict(v.split("=", 1) for v in flag) if flag else {"": default}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(HERE / "data"), help="bench.py's --data")
    ap.add_argument("--total-mb", type=int, default=400, help="bench.py's --total-mb (its shards)")
    ap.add_argument("--size", choices=["10k", "100k"], default="10k")
    ap.add_argument("--zero-copy", action="store_true")
    ap.add_argument("--touch", action="store_true", help="copy every byte of each field")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=3, help="epochs per round (best kept)")
    ap.add_argument("--client", action="append", metavar="NAME=DIR", help="a client's source dir")
    ap.add_argument("--shardd", action="append", metavar="NAME=BINARY", help="a daemon build")
    ap.add_argument("--decoder", action="append", metavar="NAME=SHARDD_DECODER",
                    help="the client's decoder: python, or the compiled one's path")
    args = ap.parse_args()

    sys.path.insert(0, str(HERE))
    import bench  # imports source_client: SHARDD_DECODER, the compiled decoder by default

    paths = sorted(pathlib.Path(args.data, f"{args.size}-{args.total_mb}").glob("shard-*.tar"))
    if not paths:
        sys.exit(f"no shards under {args.data}/{args.size}-{args.total_mb}: run bench/bench.py "
                 f"--total-mb {args.total_mb} first")
    clients = {k: str(pathlib.Path(v).resolve())
               for k, v in variants(args.client, ROOT / "clients" / "python").items()}
    binaries = variants(args.shardd, str(ROOT / "target" / "release" / "shardd"))
    decoders = variants(args.decoder, os.environ.get("SHARDD_DECODER", ""))
    with tempfile.TemporaryDirectory() as tmp:
        daemons = {}
        try:
            for name, binary in binaries.items():
                d = pathlib.Path(tmp, name or "daemon")
                d.mkdir()
                daemons[name] = bench.start_daemon(str(d), {"d": paths}, binary=binary)
            runs = {v: [] for v in itertools.product(clients, binaries, decoders)}
            for i in range(args.rounds):
                # Each round in the other order: what runs first may find the machine otherwise.
                for c, b, d in list(runs)[:: 1 if i % 2 == 0 else -1]:
                    run = subprocess.run(
                        [sys.executable, "-c", ROUND, clients[c], str(HERE), daemons[b][1],
                         str(int(args.zero_copy)), str(int(args.touch)), str(args.epochs)],
                        capture_output=True, text=True,
                        env={**os.environ, "SHARDD_DECODER": decoders[d]})
                    if run.returncode:
                        sys.exit(f"the round of {c or '-'} {b or '-'} {d or '-'} failed:\n"
                                 f"{run.stderr}")
                    runs[c, b, d].append(tuple(map(float, run.stdout.split())))
        finally:
            for proc, _ in daemons.values():
                proc.kill()
                proc.wait()
    how = f"{args.size}, {'zero copy' if args.zero_copy else 'socket'}, {'touched' if args.touch else 'len()'}"
    print(f"{how}: {args.rounds} rounds of {args.epochs} epochs, µs per sample")
    for (c, b, d), rounds in runs.items():
        wall = sorted(r[0] for r in rounds)
        cpu = sorted(r[1] for r in rounds)
        label = " ".join(x for x in (c, b, d) if x) or "-"
        print(f"  {label:24s} wall best {wall[0]:7.2f} median {wall[len(wall) // 2]:7.2f} "
              f"({1e3 / wall[0]:7.1f} k/s)   client CPU best {cpu[0]:7.2f} median "
              f"{cpu[len(cpu) // 2]:7.2f}")


if __name__ == "__main__":
    main()
