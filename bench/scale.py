"""shardd at scale: one host of a large job (run on demand; not a test, asserts nothing).

Generates a manifest of --shards shards (default 1,000,000; the data need not exist) and a
config whose dataset is a local directory, then measures a release daemon that is host
--host of --hosts (default 17 of 256), for world_size hosts × --ranks (4) and --workers (4):

  - start-up to READY (sd_notify's READY=1, received on a datagram socket: the moment the
    socket is bound, the cache open and the manifest loaded and checked), and its RSS then;
  - the time to plan one stream (op "plan", which answers START without reading data), to
    plan a `start=` resume (op "plan" with `start`), and to open a `start=` resume (op
    "stream" up to its START frame: that op also plans the next epoch for the prefetcher),
    each the median of --repeat, from the Python client;
  - the time to plan an elastic resume onto this topology from twice the hosts, half read;
  - RSS after planning (and the peak, VmHWM);
  - `shardd plan` (every stream of every host) on the same config, timed;
  - `shardd plan --from` for 2→1, 2→4 and 64→32 hosts: what each new host must fetch.

Prints the figures. What the daemon checks at start: with a manifest it stats (a HEAD on a
bucket) every shard of its own host's share, ~shards/hosts of them, and refuses to start if
one is missing or changed. So this script creates exactly that share as sparse files (their
size as the manifest says, no blocks), computing the share as `plan/mod.rs` does (SplitMix64,
Fisher-Yates, cut by samples); every other shard is absent. A wrong share would stop the
daemon, naming the first missing shard: the stat of the share is measured, not skipped.

    cargo build --release
    PYTHONPATH=clients/python .venv/bin/python bench/scale.py [--shards N] [--dir DIR]
"""

import argparse
import json
import os
import pathlib
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "clients" / "python"))

import shardd  # noqa: E402
from shardd.client import Stream  # noqa: E402

M64 = (1 << 64) - 1


def finalize(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def key(words):
    h = 0x6A09E667F3BCC908
    for w in words:
        h = finalize(h ^ finalize((w + h) & M64))
    return h


def share_order(n, share_seed):
    """plan/mod.rs's share_order: Fisher-Yates of 0..n with SplitMix64 keyed by (HOST_SHARE, seed)."""
    state = key([1, share_seed])
    order = list(range(n))
    for i in range(n - 1, 0, -1):
        bound = i + 1
        threshold = ((1 << 64) - bound) % bound
        while True:
            state = (state + 0x9E3779B97F4A7C15) & M64
            m = finalize(state) * bound
            if m & M64 >= threshold:
                j = m >> 64
                break
        order[i], order[j] = order[j], order[i]
    return order


def host_share(counts, share_seed, index, hosts):
    """plan/mod.rs's host_pieces: the shards whose samples fall in this host's range."""
    total = sum(counts)
    lo, hi = total * index // hosts, total * (index + 1) // hosts
    at, mine = 0, []
    for s in share_order(len(counts), share_seed):
        a, b = at, at + counts[s]
        at = b
        if max(a, lo) < min(b, hi):
            mine.append(s)
    return mine


def generate(d, n, index, hosts):
    """Writes the manifest (and the sparse files of this host's share); returns the config."""
    rng = random.Random(13)
    counts = [rng.randint(800, 1200) for _ in range(n)]
    sizes = [rng.randint(100_000_000, 200_000_000) for _ in range(n)]
    shards = d / "shards"
    shards.mkdir(parents=True, exist_ok=True)
    digits = len(str(n - 1))
    name = f"train-{{:0{digits}d}}.tar"
    t = time.perf_counter()
    share = host_share(counts, 0, index, hosts)
    print(f"generate: host {index}'s share is {len(share)} shards (computed in "
          f"{time.perf_counter() - t:.1f} s); creating them as sparse files", flush=True)
    tags = {}
    for s in share:
        p = shards / name.format(s)
        with open(p, "wb") as f:
            f.truncate(sizes[s])
        st = os.stat(p)
        tags[s] = f"local:{st.st_ino}:{st.st_mtime_ns // 10**9}:{st.st_mtime_ns % 10**9}"
    pattern = str(shards / f"train-{{{0:0{digits}d}..{n - 1:0{digits}d}}}.tar")
    manifest = d / "train.manifest.json"
    # What a GCS manifest holds: an ETag and a generation per object. The share gets the
    # local files' "ETags" (checked at start), the rest GCS-like ones of the same length.
    with open(manifest, "w") as f:
        f.write('{"format":1,"shards":[')
        for s in range(n):
            tag = tags.get(s) or f"CJ{s:014d}ZxEAE="
            f.write(("," if s else "") + json.dumps({
                "url": str(shards / name.format(s)), "size": sizes[s], "e_tag": tag,
                "generation": f"17{s:014d}", "crc32c": (s * 2654435761) & 0xFFFFFFFF,
                "samples": counts[s]}))
        f.write(f'],"total_samples":{sum(counts)},"total_bytes":{sum(sizes)}}}')
    print(f"generate: {manifest.name}: {manifest.stat().st_size / 1e6:.0f} MB, "
          f"{sum(counts)} samples, {sum(sizes) / 1e12:.1f} TB", flush=True)
    config = d / "shardd.toml"
    config.write_text(
        f'[server]\nsocket = "{d / "shardd.sock"}"\nmetrics_addr = "127.0.0.1:0"\n'
        f'[host]\nindex = {index}\ncount = {hosts}\n'
        f'[cache]\ndir = "{d / "cache"}"\nmax_size = "1GiB"\nprefetch_shards = 1\n'
        f'[datasets.train]\nshards = "{pattern}"\nmanifest = "{manifest}"\n'
    )
    return config


def rss(pid):
    fields = {}
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        fields[k] = v.strip()
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def start_daemon(binary, config, logpath):
    """Starts the daemon and returns (process, seconds to READY=1), waiting on sd_notify."""
    notify_path = config.parent / "notify.sock"
    notify_path.unlink(missing_ok=True)
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(notify_path))
    log = open(logpath, "w")
    t = time.perf_counter()
    proc = subprocess.Popen([binary, "serve", "--config", str(config)], stdout=log,
                            stderr=subprocess.STDOUT,
                            env={**os.environ, "NOTIFY_SOCKET": str(notify_path)})
    # A timeout only to notice a daemon that exited without READY.
    notify.settimeout(1)
    while True:
        try:
            msg = notify.recv(4096).decode()
        except TimeoutError:
            if proc.poll() is not None:
                raise SystemExit(f"shardd exited with {proc.returncode}: "
                                 f"{pathlib.Path(logpath).read_text()[-2000:]}")
            continue
        if "READY=1" in msg:
            return proc, time.perf_counter() - t


def timed(fn, repeat):
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), min(times), max(times)


def open_until_start(sock, fields):
    """Opens a stream (op "stream", or "plan") and returns its START fields; closes it."""
    s = Stream(str(sock), fields, timeout=600, reconnect_timeout=0)
    try:
        return dict(s.start_fields)
    finally:
        s.close()


def elastic_resume(sock, request, samples, args):
    """The plan of an elastic resume onto this topology from one with twice the hosts,
    checkpointed half-way through every old stream: (median, min, max) seconds."""
    old_world = 2 * args.hosts * args.ranks
    old_samples = samples // 2  # twice the hosts: each old stream had half as many
    origin = {"hosts": 2 * args.hosts, "world_size": old_world, "num_workers": args.workers,
              "positions": [old_samples // 2] * args.workers}
    fields = dict(request("plan", 1), resume_from=origin)
    return timed(lambda: open_until_start(sock, fields), args.repeat)


def locality(binary, config, args):
    """`shardd plan --from` for 2→1, 2→4 and 64→32 hosts (the rest of a half-read epoch):
    how much of what the new hosts read each must fetch from the store."""
    for old, new in [(2, 1), (2, 4), (64, 32)]:
        cmd = [binary, "plan", "--config", str(config), "--hosts", str(new), "--ranks",
               str(args.ranks), "--workers", str(args.workers), "--from",
               f"{old},{args.ranks},{args.workers}", "--json"]
        t = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True)
        took = time.perf_counter() - t
        if out.returncode != 0:
            print(f"  {old:>3} → {new:<3} hosts     failed: {out.stderr.strip()}")
            continue
        z = json.loads(out.stdout)["resize"]
        per = ", ".join(f"{h['fetch_bytes'] / max(1, h['bytes']):.0%}" for h in z["per_host"][:4])
        print(f"  {old:>3} → {new:<3} hosts     fetch {z['fetch_fraction']:.1%} of the bytes read "
              f"(hosts 0..: {per}{', ...' if len(z['per_host']) > 4 else ''}); {took:.1f} s")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shards", type=int, default=1_000_000)
    ap.add_argument("--hosts", type=int, default=256)
    ap.add_argument("--host", type=int, default=17)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--dir", help="keep the generated files here (reused if present)")
    ap.add_argument("--binary", default=str(ROOT / "target" / "release" / "shardd"))
    ap.add_argument("--skip-plan-cli", action="store_true")
    args = ap.parse_args()

    d = pathlib.Path(args.dir or tempfile.mkdtemp(prefix="shardd-scale-"))
    d.mkdir(parents=True, exist_ok=True)
    config = d / "shardd.toml"
    if not config.exists():
        config = generate(d, args.shards, args.host, args.hosts)
    sock = d / "shardd.sock"
    world = args.hosts * args.ranks
    print(f"\nshardd at scale: {args.shards} shards, {args.hosts} hosts × {args.ranks} ranks × "
          f"{args.workers} workers (world_size {world}), this daemon is host {args.host}")
    proc, ready = start_daemon(args.binary, config, d / "shardd.log")
    try:
        now, peak = rss(proc.pid)
        print(f"  start-up to READY      {ready:8.2f} s")
        print(f"  RSS at READY           {now:8.0f} MB (peak {peak:.0f} MB)")
        rank = args.host * args.ranks + 1

        def request(op, worker=0, start=0):
            return {"op": op, "dataset": "train", "epoch": 3, "rank": rank, "world_size": world,
                    "seed": 7, "worker": worker, "num_workers": args.workers, "start": start}

        first = open_until_start(sock, request("plan"))
        samples = first["samples"]
        print(f"  one stream             {samples} samples in {first['shards']} pieces")
        runs = [
            ("plan one stream", lambda: open_until_start(sock, request("plan"))),
            ("plan a start= resume", lambda: open_until_start(sock, request("plan", 2, samples * 9 // 10))),
            ("open a start= resume", lambda: open_until_start(sock, request("stream", 3, samples * 9 // 10))),
        ]
        for label, fn in runs:
            med, lo, hi = timed(fn, args.repeat)
            print(f"  {label:<22} {med * 1e3:8.1f} ms median of {args.repeat} "
                  f"(min {lo * 1e3:.1f}, max {hi * 1e3:.1f})")
        med, lo, hi = elastic_resume(sock, request, samples, args)
        print(f"  {'plan an elastic resume':<22} {med * 1e3:8.1f} ms median of {args.repeat} "
              f"(min {lo * 1e3:.1f}, max {hi * 1e3:.1f}; from {2 * args.hosts} hosts, half read)")
        now, peak = rss(proc.pid)
        print(f"  RSS after planning     {now:8.0f} MB (peak {peak:.0f} MB)")
    finally:
        proc.terminate()
        proc.wait()
    if not args.skip_plan_cli:
        cmd = [args.binary, "plan", "--config", str(config), "--hosts", str(args.hosts),
               "--ranks", str(args.ranks), "--workers", str(args.workers), "--json"]
        t = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True)
        took = time.perf_counter() - t
        if out.returncode != 0:
            print(f"  shardd plan            failed: {out.stderr.strip()}")
        else:
            summary = json.loads(out.stdout)["summary"]
            print(f"  shardd plan            {took:8.2f} s for every stream of {args.hosts} hosts; "
                  f"bytes per host min {summary['bytes']['min'] / 1e9:.1f} GB, "
                  f"max {summary['bytes']['max'] / 1e9:.1f} GB")
    if not args.skip_plan_cli:
        print("elastic resume locality (shardd plan --from; a host index names a machine):")
        locality(args.binary, config, args)
    print(f"  (files in {d})")


if __name__ == "__main__":
    main()
