"""shardd throughput benchmark (run on demand; not a test, asserts nothing).

Generates local shards of ~100 KB and ~10 KB samples with webdataset's TarWriter (kept under
--data), then, warm (page cache and daemon cache filled, runs interleaved), measures in one run:

1. One consumer, per sample size:
   - webdataset reading the shards in this process (the baseline);
   - litData reading the same samples from its own chunk format (made once with
     ``litdata.optimize``, kept under --data): the strongest peer here;
   - the shardd Python client reading the same shards from a release-built daemon (one
     stream: rank 0 of world 1, sample shuffle window 1000), over the socket path and, where
     the daemon and client offer it, the zero-copy path (``Client(zero_copy=True)``);
   - raw Unix-socket bandwidth into this process (recv_into a 1 MiB buffer from a process that
     sends as fast as it can): the ceiling for any socket-based client;
   - "bound: the loop alone": this script's consumer loop over one zero-copy stream's samples
     decoded beforehand into a list (mapped pages, the same order): the ceiling for any
     client, compiled or not, that hands this loop dicts of fields.
   Each reader runs twice: taking only each field's length (delivery), and reading every
   byte of each field (copied into a preallocated buffer, as a collate copies into a tensor:
   "touched"), as a trainer does; ratios compare readers that read alike.
   Prints samples/s and MB/s (best of --repeat), the ratios, and the daemon's own CPU time
   (utime + stime from /proc/<pid>/stat, all threads) per sample and per GB served: over all
   --repeat runs of each path (/proc counts 10 ms ticks: bench/daemon_profile.py reads many
   epochs for a precise figure).

2. --consumers processes at once (default 16: 8 ranks x 2 DataLoader-style workers) on the
   same cores: webdataset with each process reading its share of the shards, litData with each
   its share of the chunks (a chunk per shard), against shardd
   with each process reading its own stream (both paths); each delivering only, then touching
   every byte, as in part 1. Total samples/s and MB/s from the
   first start to the last end, best of --repeat. Each shardd consumer's stream is short
   (1/16 of the set), so opening it (a few ms: connect, fill the first shuffle window) is a
   large part of one epoch here, unlike in training: each is measured reading one epoch, and
   with every consumer (webdataset too) reading for --many-seconds, epoch after epoch, as
   a trainer does: the rate the host sustains, epoch boundaries included.

    .venv/bin/python bench/bench.py            # builds target/release/shardd first; ~6 min
    .venv/bin/python bench/bench.py --quick    # 200 MB per size, one repeat: ~1 min
"""

import argparse
import itertools
import multiprocessing
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
sys.path.insert(0, str(ROOT / "bench"))

import source_client  # noqa: E402  (before shardd: the client of this tree, its decoder)
import shardd  # noqa: E402
import webdataset as wds  # noqa: E402

SHARDS = 16
TICK = os.sysconf("SC_CLK_TCK")
# The cores this process may run on (its CPU affinity, which os.cpu_count() ignores).
CORES = len(os.sched_getaffinity(0))


def generate(directory, sample_bytes, total_bytes):
    directory.mkdir(parents=True, exist_ok=True)
    per_shard = max(1, total_bytes // sample_bytes // SHARDS)
    paths = [directory / f"shard-{i:06d}.tar" for i in range(SHARDS)]
    if all(p.exists() for p in paths) and (directory / "per_shard").exists() and int(
            (directory / "per_shard").read_text()) == per_shard:
        return paths
    write_shards(paths, per_shard, sample_bytes)
    (directory / "per_shard").write_text(str(per_shard))
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


# What a touching consumer copies each field into (as a collate copies into a tensor).
SINK = [memoryview(bytearray(1 << 20))]


def touch_bytes(field):
    """Reads every byte of ``field``: copies it into the preallocated buffer (grown if needed)."""
    if len(field) > len(SINK[0]):
        SINK[0] = memoryview(bytearray(len(field)))
    SINK[0][:len(field)] = field


def count(passes, until=None, touch=False):
    """Counts the samples and field bytes of the first of ``passes`` (sample iterables), or
    with ``until`` (a time.monotonic() deadline) of pass after pass, until then. With
    ``touch``, every byte of each field is read too (copied into a preallocated buffer), as a
    trainer reads them: a zero-copy view's pages are faulted in here, not in the daemon."""
    samples = nbytes = 0
    for one_pass in passes:
        for s in one_pass:
            if until is not None and time.monotonic() > until:
                return samples, nbytes
            samples += 1
            b, c = s["bin"], s["cls"]
            if touch:
                touch_bytes(b)
                touch_bytes(c)
            nbytes += len(b) + len(c)
        if until is None:
            return samples, nbytes


def read_webdataset(paths, until=None, touch=False):
    """Reads ``paths`` once, or pass after pass until ``until`` (see ``count``)."""
    names = [str(p) for p in paths]
    return count((wds.WebDataset(names, shardshuffle=False, empty_check=False)
                  for _ in itertools.count()), until, touch)


def read_shardd(sock, dataset, zero_copy=False, rank=0, world_size=1, worker=0, num_workers=1,
                until=None, touch=False):
    """Reads epoch 0 of one stream, or epoch after epoch until ``until`` (the next opened
    ahead, as shardd.torch does; see ``count``)."""
    opts = {"zero_copy": True} if zero_copy else {}
    with shardd.Client(sock, prefetch_next_epoch=until is not None, **opts) as c:
        return count((c.stream(dataset, epoch=epoch, rank=rank, world_size=world_size,
                               worker=worker, num_workers=num_workers)
                      for epoch in itertools.count()), until, touch)


def prebuilt_samples(sock, dataset):
    """Epoch 0 of one zero-copy stream as a list (its fields stay mapped while it lives)."""
    with shardd.Client(sock, zero_copy=True) as c:
        return list(c.stream(dataset, epoch=0, rank=0, world_size=1))


def zero_copy_offered():
    """Whether this client has the zero-copy path (older ones do not: it is then skipped)."""
    import inspect

    return "zero_copy" in inspect.signature(shardd.Client).parameters


# -- litData ------------------------------------------------------------------------------

def _litdata_item(path):
    """litdata.optimize's function: one shard's samples, as dicts of bytes."""
    for s in wds.WebDataset([path], shardshuffle=False, empty_check=False):
        yield {"key": s["__key__"], "bin": s["bin"], "cls": s["cls"]}


def litdata_dir(paths, directory):
    """The shards in litData's format, made once (kept beside the shards): a chunk per shard
    (chunk_bytes the shards' size), so that part 2's consumers each have chunks to read."""
    done = directory / "done"
    if not done.exists():
        import litdata

        chunk = sum(p.stat().st_size for p in paths) // len(paths)
        litdata.optimize(fn=_litdata_item, inputs=[str(p) for p in paths], output_dir=str(directory),
                         chunk_bytes=chunk, num_workers=1, mode="overwrite", verbose=False)
        done.write_text("")
    return directory


def read_litdata(directory, rank=0, world_size=1, until=None, touch=False):
    """litData's StreamingDataset over ``directory``, one pass (or pass after pass until
    ``until``; see ``count``): as rank ``rank`` of ``world_size`` processes, each reading its
    share of the chunks (litData's own split, told the world it cannot detect here)."""
    import litdata
    from litdata.utilities.env import _DistributedEnv

    def one_pass():
        ds = litdata.StreamingDataset(str(directory))
        ds.distributed_env = _DistributedEnv(world_size, rank, 1)
        return ds

    return count((one_pass() for _ in itertools.count()), until, touch)


# -- the daemon ---------------------------------------------------------------------------

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


def start_daemon(tmp, datasets, binary=None, timeout=30):
    if binary is None:
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
    deadline = time.monotonic() + timeout
    while not os.path.exists(sock):
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError("shardd did not start")
        time.sleep(0.01)
    return proc, sock


def cpu_seconds(pid):
    """A process's CPU time so far (all its threads, those ended included)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


# -- many consumers -----------------------------------------------------------------------

def _consume(fn, args, kwargs, seconds, ready, go, out):
    ready.release()
    go.wait()
    t = time.perf_counter()
    samples, nbytes = fn(*args, **kwargs, **({"until": time.monotonic() + seconds} if seconds else {}))
    out.put((samples, nbytes, t, time.perf_counter()))


def measure_many(jobs, seconds=None):
    """Runs ``jobs`` ((fn, args, kwargs)) in as many processes at once (forked, started
    together); returns total samples/s and MB/s from the first start to the last end, and that
    time: of one pass each, or with ``seconds``, of what each read in that long (pass after
    pass)."""
    ctx = multiprocessing.get_context("fork")
    ready, go, out = ctx.Semaphore(0), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_consume, args=(fn, args, kwargs, seconds, ready, go, out))
             for fn, args, kwargs in jobs]
    for p in procs:
        p.start()
    for _ in procs:
        ready.acquire()
    go.set()
    results = [out.get() for _ in procs]
    for p in procs:
        p.join()
    samples = sum(r[0] for r in results)
    nbytes = sum(r[1] for r in results)
    dt = max(r[3] for r in results) - min(r[2] for r in results)
    return samples / dt, nbytes / dt / 1e6, dt


# -- main ---------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(ROOT / "bench" / "data"), help="where shards are generated (kept)")
    ap.add_argument("--total-mb", type=int, default=800, help="dataset size at ~100 KB (half that at ~10 KB)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--consumers", type=int, default=16, help="processes of part 2 (even; 0 skips it)")
    ap.add_argument("--many-seconds", type=float, default=3.0,
                    help="part 2 also runs every consumer this long, epoch after epoch (0: not)")
    ap.add_argument("--no-litdata", action="store_true", help="skip litData (not installed, say)")
    ap.add_argument("--shardd", help="the daemon binary (default: build target/release/shardd)")
    ap.add_argument("--quick", action="store_true", help="--total-mb 200 --repeat 1")
    args = ap.parse_args()
    if args.quick:
        args.total_mb, args.repeat = 200, 1

    data = pathlib.Path(args.data)
    total = args.total_mb * 1_000_000
    sets = {
        "s10k": generate(data / f"10k-{args.total_mb}", 10_000, total // 2),
        "s100k": generate(data / f"100k-{args.total_mb}", 100_000, total),
    }
    lit = {} if args.no_litdata else {
        name: litdata_dir(paths, data / f"litdata-{paths[0].parent.name}-{SHARDS}-chunks")
        for name, paths in sets.items()}
    paths_zc = [False] + ([True] if zero_copy_offered() else [])
    with tempfile.TemporaryDirectory() as tmp:
        proc, sock = start_daemon(tmp, sets, args.shardd)
        try:
            rows, cpu, many = {}, {}, {}
            raw_best = 0.0
            for name, paths in sets.items():
                read_webdataset(paths)  # warm the page cache
                for zc in paths_zc:
                    read_shardd(sock, name, zc)  # and the daemon's cache
                readers = []
                # The bound on any client in this process: the consumer's loop alone, over the
                # samples of one zero-copy stream decoded beforehand (mapped pages, same order).
                prebuilt = prebuilt_samples(sock, name) if True in paths_zc else None
                for touch in (False, True):
                    t = ", touched" if touch else ""
                    readers.append((f"webdataset{t}", lambda touch=touch: read_webdataset(paths, touch=touch)))
                    if name in lit:
                        readers.append((f"litdata{t}", lambda touch=touch: read_litdata(lit[name], touch=touch)))
                    for zc in paths_zc:
                        readers.append((("shardd zero-copy" if zc else "shardd") + t,
                                        lambda zc=zc, touch=touch: read_shardd(sock, name, zc, touch=touch)))
                    if prebuilt:
                        readers.append((f"bound: the loop alone{t}",
                                        lambda touch=touch: count([prebuilt], touch=touch)))
                best = {label: (0, 0) for label, _ in readers}
                for _ in range(args.repeat):
                    for label, fn in readers:
                        before = cpu_seconds(proc.pid)
                        holder = {}
                        r = measure(lambda: holder.setdefault("n", fn()))
                        used = cpu_seconds(proc.pid) - before
                        if label.startswith("shardd"):
                            samples, nbytes = holder["n"]
                            cpu.setdefault((name, label), []).append((used, samples, nbytes))
                        best[label] = max(best[label], r, key=lambda x: x[1])
                    raw_best = max(raw_best, measure(lambda: read_raw(tmp, 2_000_000_000))[1])
                rows[name] = best
                if args.consumers:
                    n = args.consumers
                    runs = []
                    # Every reader delivering only (len()), then touching every byte; each one
                    # epoch, then (--many-seconds) for that long. Labels end with what the run
                    # did, and a row's ratio is against webdataset's run that did the same.
                    for seconds in [None] + ([args.many_seconds] if args.many_seconds else []):
                        for touch in (False, True):
                            how = (f", {seconds:g} s" if seconds else "") + (", touched" if touch else "")
                            kw = {"touch": touch}
                            runs.append((f"webdataset{how}", [(read_webdataset, (paths[i::n],), kw)
                                                              for i in range(n)], seconds))
                            if name in lit:
                                runs.append((f"litdata{how}", [(read_litdata, (lit[name], i, n), kw)
                                                               for i in range(n)], seconds))
                            runs += [(("shardd zero-copy" if zc else "shardd") + how,
                                      [(read_shardd, (sock, name, zc, i // 2, n // 2, i % 2, 2), kw)
                                       for i in range(n)], seconds) for zc in paths_zc]
                    many[name] = {label: (0, 0, 0) for label, _, _ in runs}
                    for _ in range(args.repeat):
                        for label, jobs, seconds in runs:
                            before = cpu_seconds(proc.pid)
                            sps, mbs, dt = measure_many(jobs, seconds)
                            # The daemon's share of the cores while they all read (an upper bound:
                            # its CPU counts the streams' start-up and teardown, dt does not).
                            share = (cpu_seconds(proc.pid) - before) / dt / CORES
                            many[name][label] = max(many[name][label], (sps, mbs, share),
                                                    key=lambda x: x[1])
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait()

    print(f"client decoder: {source_client.decoder()}")
    print(f"\n1. one consumer (best of {args.repeat}; daemon CPU: over all {args.repeat} runs)")
    print(f"{'dataset':8} {'reader':26} {'samples/s':>11} {'MB/s':>8} {'daemon us/sample':>17} {'daemon CPU-s/GB':>16}")
    for name, best in rows.items():
        for label, (sps, mbs) in best.items():
            c = cpu.get((name, label))
            # /proc counts in ticks (10 ms): a fast path's run is a few of them, so the figure is
            # the runs' total CPU over their total samples, with its tick count.
            used, samples, nbytes = (sum(x[i] for x in c) for i in range(3)) if c else (0, 1, 1)
            us = f"{1e6 * used / samples:17.2f}" if c else f"{'':17}"
            gb = f"{used / nbytes * 1e9:16.3f} ({round(used * TICK)} ticks)" if c else ""
            print(f"{name:8} {label:26} {sps:11.0f} {mbs:8.0f} {us} {gb}")
    print(f"{'':8} {'raw socket':26} {'':>11} {raw_best:8.0f}")
    print()
    for name, best in rows.items():
        for label, s in best.items():
            if not label.startswith("shardd"):
                continue
            # Against the baseline that reads the same way (touched or not).
            t = ", touched" if label.endswith(", touched") else ""
            w = best["webdataset" + t]
            line = f"{name}: {label}/webdataset{t} = {s[0] / w[0]:.1f}x samples/s, {s[1] / w[1]:.1f}x MB/s"
            if "litdata" + t in best:
                line += f"; /litdata{t} = {s[0] / best['litdata' + t][0]:.2f}x samples/s"
            print(f"{line}; /raw socket = {100 * s[1] / raw_best:.0f}%")
    if many:
        print(f"\n2. {args.consumers} consumers at once (shardd: {args.consumers // 2} ranks x 2 workers; best of {args.repeat})")
        for name, r in many.items():
            print(f"{name}:")
            for label, s in r.items():
                how = label.partition(", ")[2]
                suffix = f", {how}" if how else ""
                w, lit_run = r["webdataset" + suffix], r.get("litdata" + suffix)
                ratio = ""
                if not label.startswith("webdataset"):
                    ratio = f" = {s[0] / w[0]:5.1f}x webdataset"
                if label.startswith("shardd"):
                    if lit_run:
                        ratio += f", {s[0] / lit_run[0]:4.2f}x litData"
                    ratio += f"; daemon CPU {100 * s[2]:3.0f}% of the {CORES} cores"
                print(f"    {label:36} {s[0]:8.0f} samples/s {s[1]:6.0f} MB/s{ratio}")


if __name__ == "__main__":
    main()
