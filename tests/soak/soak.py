"""The fault soak (issue 8): several daemons as the hosts of one job, many trainer streams over
many epochs, a store that fails, and kill -9 of daemons and trainers, for a bounded time.

    .venv/bin/python tests/soak/soak.py [--minutes 10]      (tests/soak/run.sh sets it up)

What runs: fake-gcs-server holding shards written by webdataset, the fault proxy
(fault_proxy.py: 5xx, 429, resets, stalls, truncations) in front of it, one release
`shardd serve` per host reaching the store only through the proxy, each with a cache budget
below its share of the data, and one reader process (reader.py, the real Python client) per
(host, dataset, rank, worker) reading epoch after epoch, every other one on the zero-copy
path (`Client(zero_copy=True)`: shard files passed as descriptors, memoryviews of their maps). Two datasets over the same shards:
`plain` (planned by shards) and `exact` (with a manifest: sample-level plans). Every few
seconds a random reader or daemon is killed with SIGKILL and started again: a killed reader
resumes with `start` where its output stops; a killed daemon is the client's own business
(its reconnect resumes every stream). Readers pause now and then, some for longer than the
daemons' `stall_timeout` (the daemon parks those streams and resumes them). Everything random
is drawn from `--seed` (printed; pauses from seeds derived from it), and so that a short run
(CI: half a minute) exercises all of it, the first kills come early and deterministically (a
reader that has read something at 3 s, a daemon of another host than the parking reader at
6 s), and one reader's first pause lasts until its daemon has parked its stream.

What it asserts, in a one-screen report (exit 1 on any failure):
- every completed stream is byte-equal to webdataset's reading of the same samples, and in
  exactly the order a fault-free daemon (no proxy, no kills, no cache limit) serves it;
- the `exact` streams of an epoch, over all hosts, hold every sample once but the dropped;
- no daemon dies other than by the soak's kills, no reader fails (a reader fails on any error
  the client raises but a daemon error, retried a few times: a daemon restart must be
  invisible to it), and some readers paused longer than `stall_timeout`;
- what it exercises happened, as the daemons, the kernel and the client saw it (not as the
  soak meant it): at least one daemon and one reader died of SIGKILL (their wait status), a
  killed reader resumed with `start` past 0, a client reconnected through a daemon's death,
  the daemons counted parked streams (`shardd_stream_parks_total`, sampled every second and
  summed over their restarts), the proxy injected every kind of fault and the daemons logged
  retrying the store, zero-copy readers received memoryviews, and at least one `exact` epoch
  was checked whole;
- each cache directory never holds more than its budget (sampled every 50 ms);
- open fds, threads and RSS of each daemon stay bounded, with no growth from the first third
  of the run to the last.
"""

import argparse
import collections
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE), str(ROOT / "tests" / "python")]

import webdataset as wds  # noqa: E402

from conftest import bytes_on_disk, free_port, socket_accepts, start_fake_gcs, wait_for  # noqa: E402
from fault_proxy import FAULTS, FaultProxy  # noqa: E402
from reader import digest  # noqa: E402

import shardd  # noqa: E402

BUCKET = "bkt"
DATASETS = ("plain", "exact")
START_DEADLINE = 180.0  # a daemon's start checks the manifest through the faulty store
GRACE = 300.0  # after --minutes: for the epochs already started to end
FD_BOUND = 512
THREAD_BOUND = 64
MiB = 1 << 20
# The daemons' counters the soak samples every second (each counts since its daemon's start).
COUNTERS = ("shardd_stream_parks_total",)


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- data ----------------------------------------------------------------------------------------


def write_shards(directory, n, rng):
    """``n`` shards by webdataset.TarWriter, 20-40 samples each, fields from 200 B to 64 KB
    (log-uniform) and a few of 300 KB. Returns {key: (digest, bytes)} as webdataset reads them
    back."""
    directory.mkdir(parents=True)
    for i in range(n):
        with wds.TarWriter(str(directory / f"shard-{i:04d}.tar")) as sink:
            for j in range(rng.randint(20, 40)):
                size = 300_000 if rng.random() < 0.02 else int(200 * 320 ** rng.random())
                sink.write({"__key__": f"s{i:04d}/{j:03d}", "bin": rng.randbytes(size),
                            "cls": str(rng.randint(0, 999)).encode()})
    urls = sorted(str(p) for p in directory.glob("*.tar"))
    return {s["__key__"]: (digest(s), sum(len(v) for k, v in s.items() if not k.startswith("__")))
            for s in wds.WebDataset(urls, shardshuffle=False, empty_check=False)}


def config(socket_path, cache_dir, endpoint, host, hosts, budget, manifest, shards, metrics_port,
           stall_timeout):
    pattern = f"gs://{BUCKET}/soak/shard-{{0000..{shards - 1:04d}}}.tar"
    return f"""
[server]
socket = "{socket_path}"
metrics_addr = "127.0.0.1:{metrics_port}"
stall_timeout = "{stall_timeout}s"
[host]
index = {host}
count = {hosts}
[cache]
dir = "{cache_dir}"
max_size = "{budget}"
prefetch_shards = 2
space_timeout = "60s"
[store]
max_downloads = 6
connect_timeout = "2s"
read_timeout = "2s"
part_size = "1MiB"
parts_in_flight = 2
[gcs]
endpoint = "{endpoint}"
anonymous = true
[datasets.plain]
shards = "{pattern}"
shuffle_buffer = 40
[datasets.exact]
shards = "{pattern}"
shuffle_buffer = 40
manifest = "{manifest}"
"""


# -- processes -----------------------------------------------------------------------------------


class Daemon:
    """One host's `shardd serve`; started again after the soak kills it."""

    def __init__(self, shardd_bin, directory, config_text, metrics_port):
        self.bin, self.dir, self.metrics_port = shardd_bin, directory, metrics_port
        directory.mkdir(parents=True, exist_ok=True)
        self.socket = str(directory / "shardd.sock")
        self.config = directory / "config.toml"
        self.config.write_text(config_text)
        self.cache = directory / "cache"
        self.proc = None
        self.starts = 0
        self.restarting = None  # the thread starting it again after a kill
        self.start_errors = []
        self.cpu = {}
        self.start()

    def start(self):
        with open(self.dir / "shardd.log", "a") as logf:
            self.proc = subprocess.Popen([self.bin, "serve", "--config", str(self.config)],
                                         stdout=logf, stderr=subprocess.STDOUT,
                                         env={**os.environ, "SHARDD_LOG": "info,shardd::store=debug"})
        self.starts += 1

        def serving():
            if self.proc.poll() is not None:
                raise RuntimeError(f"shardd exited with {self.proc.returncode} at start: "
                                   f"{self.log_tail()}")
            return socket_accepts(self.socket)

        wait_for(serving, f"shardd to serve ({self.dir / 'shardd.log'})", START_DEADLINE)

    def kill_and_restart(self):
        """SIGKILL, then start again on a thread: a start checks the manifest through the
        faulty store, which takes seconds, and the soak goes on sampling meanwhile. Returns
        the killed process's wait status (-SIGKILL when the kill is what ended it)."""
        self.proc.send_signal(signal.SIGKILL)
        code = self.proc.wait()
        self.restart()
        return code

    def restart(self):
        def start():
            try:
                self.start()
            except Exception as e:  # reported by the soak; the next check restarts it again
                self.start_errors.append(str(e))

        self.restarting = threading.Thread(target=start)
        self.restarting.start()

    def busy(self):
        """Still starting again after a kill."""
        if self.restarting is not None and not self.restarting.is_alive():
            self.restarting.join()
            self.restarting = None
        return self.restarting is not None

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)

    def counters(self, names):
        """The sums of these counter families now (they count from this daemon's last start),
        or None when it does not answer (killed, restarting)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
                text = r.read().decode()
        except OSError:
            return None
        out = dict.fromkeys(names, 0.0)
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in out:
                out[name] += float(line.rsplit(" ", 1)[1])
        return out

    def log_tail(self, lines=8):
        text = (self.dir / "shardd.log").read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def resources(self):
        """(rss bytes, open fds, threads) of the running daemon, or None. Also notes its CPU
        seconds so far (``cpu``: pid -> seconds; a killed daemon keeps its last sample)."""
        pid = self.proc.pid
        try:
            stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
            ticks = sum(int(x) for x in stat.rsplit(")", 1)[1].split()[11:13])  # utime, stime
            self.cpu[pid] = ticks / os.sysconf("SC_CLK_TCK")
            status = pathlib.Path(f"/proc/{pid}/status").read_text()
            fds = len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            return None
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields.get("State", "").strip().startswith("Z"):
            return None
        return int(fields["VmRSS"].split()[0]) * 1024, fds, int(fields["Threads"])


class Reader:
    def __init__(self, daemon, dataset, rank, world, worker, workers, seed, out, until, pauses,
                 zero_copy=False, park=False):
        self.daemon, self.dataset, self.rank, self.worker = daemon, dataset, rank, worker
        self.name = f"{dataset}-r{rank}-w{worker}"
        self.seed = seed
        self.argv = [sys.executable, str(HERE / "reader.py"), "--socket", daemon.socket,
                     "--dataset", dataset, "--rank", str(rank), "--world-size", str(world),
                     "--worker", str(worker), "--workers", str(workers), "--seed", str(seed),
                     "--out", str(out), "--until", str(until), "--pause-every", str(pauses[0]),
                     "--pause-max", str(pauses[1])] + (["--zero-copy"] if zero_copy else [])
        self.park = f"http://127.0.0.1:{daemon.metrics_port}/status" if park else None
        self.log = out / f"{self.name}.stderr"
        self.errors = out / f"{self.name}.errors"
        self.out = out
        self.starts = 0
        self.proc = None
        self.start()

    def start(self):
        # Each start its own pauses, drawn from the soak's seed (a restart does not replay
        # the pauses of the killed process); only the first start parks on purpose.
        argv = self.argv + ["--pause-seed", f"{self.seed}-{self.name}-{self.starts}"]
        if self.park and self.starts == 0:
            argv += ["--park-first", self.park]
        self.starts += 1
        with open(self.log, "a") as logf:
            self.proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT)

    def records(self, kind):
        """The lines of kind ``kind`` in its ``.errors`` file, split at tabs."""
        if not self.errors.exists():
            return []
        return [line.split("\t") for line in self.errors.read_text().splitlines()
                if line.startswith(kind + "\t")]

    def park_done(self):
        """Whether its pause until parked is over (or it never had one)."""
        return not self.park or bool(self.records("PARKED") or self.records("NOPARK"))

    def has_read(self):
        """Whether a sample of its current epoch is on disk (a kill now makes it resume)."""
        logs = sorted(self.out.glob(f"{self.name}-e*.log"))
        if not logs:
            return False
        data = logs[-1].read_bytes()
        lines = data[: data.rfind(b"\n") + 1].splitlines()
        return bool(lines) and not lines[-1].startswith(b"END\t")


# -- checks --------------------------------------------------------------------------------------


def read_log(path):
    """(keys, digests, ended) of a reader's epoch file."""
    keys, digests, ended = [], [], False
    for line in path.read_text().splitlines():
        a, b = line.split("\t")
        if a == "END":
            ended = int(b) == len(keys)
            break
        keys.append(a)
        digests.append(b)
    return keys, digests, ended


def reference_stream(ref_daemon, dataset, epoch, rank, world, worker, workers, seed):
    """(keys, dropped) of a stream as a fault-free daemon serves it."""
    with shardd.Client(ref_daemon.socket) as c:
        s = c.stream(dataset, epoch=epoch, rank=rank, world_size=world, worker=worker,
                     num_workers=workers, seed=seed)
        return [x["__key__"] for x in s], s.dropped


# -- the run -------------------------------------------------------------------------------------


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--hosts", type=int, default=3)
    p.add_argument("--ranks-per-host", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--shards", type=int, default=240)
    p.add_argument("--fault-rate", type=float, default=0.1, help="share of store requests failed")
    p.add_argument("--kill-every", type=float, default=8.0, help="mean seconds between kill -9s")
    p.add_argument("--budget", type=float, default=0.6, help="cache budget / one host's share")
    p.add_argument("--stall-timeout", type=float, default=2.0, help="the daemons' stall_timeout, s")
    p.add_argument("--pause-every", type=float, default=15.0,
                   help="mean seconds between a reader's pauses (0: none)")
    p.add_argument("--pause-max", type=float, default=None,
                   help="longest pause, s (default 2.5 x stall-timeout; pauses are uniform from 0.1 s)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--shardd", default=str(ROOT / "target" / "release" / "shardd"))
    p.add_argument("--workdir", help="keep everything here (default: a temporary directory, "
                   "kept when the soak fails)")
    args = p.parse_args()

    work = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="shardd-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    log(f"seed {args.seed} (--seed N to change it): data, faults, kills and pauses")
    rng = random.Random(args.seed)
    failures = []
    H, L, W = args.hosts, args.ranks_per_host, args.workers
    world = H * L

    log(f"writing {args.shards} shards with webdataset into {work}")
    reference = write_shards(work / "data" / BUCKET / "soak", args.shards, rng)
    data_bytes = sum(f.stat().st_size for f in (work / "data" / BUCKET / "soak").iterdir())
    share = data_bytes / H
    budget = int(share * args.budget)
    gcs = start_fake_gcs(work / "data", work)
    proxy = FaultProxy(int(gcs.endpoint.rsplit(":", 1)[1]), args.fault_rate, args.seed)

    def host_config(name, host, endpoint, max_size):
        d = work / name / f"host{host}"
        port = free_port()
        return d, config(d / "shardd.sock", d / "cache", endpoint, host, H, max_size,
                         work / "manifest.json", args.shards, port, args.stall_timeout), port

    # The manifest, written straight from the store (it is the job's input, not under test).
    d, text, _ = host_config("index", 0, gcs.endpoint, "1GiB")
    d.mkdir(parents=True)
    (d / "config.toml").write_text(text)
    pattern = f"gs://{BUCKET}/soak/shard-{{0000..{args.shards - 1:04d}}}.tar"
    subprocess.run([args.shardd, "index", pattern, "-o", str(work / "manifest.json"),
                    "--config", str(d / "config.toml")], check=True, capture_output=True)

    log(f"starting {H} daemons behind the fault proxy ({args.fault_rate:.0%} of requests fail)")
    daemons = [Daemon(args.shardd, *host_config("soak", h, proxy.endpoint, budget)) for h in range(H)]
    until = time.time() + args.minutes * 60
    out = work / "streams"
    out.mkdir()
    pause_max = args.pause_max if args.pause_max is not None else 2.5 * args.stall_timeout
    # The first reader (host 0, plain, rank 0, worker 0: the socket path) parks on purpose.
    readers = [Reader(daemons[h], ds, h * L + r, world, w, W, args.seed, out, until,
                      (args.pause_every, pause_max), zero_copy=(h * L + r + w) % 2 == 1,
                      park=(h, ds, r, w) == (0, DATASETS[0], 0, 0))
               for h in range(H) for ds in DATASETS for r in range(L) for w in range(W)]
    parker = readers[0]
    log(f"{len(readers)} readers until {time.strftime('%H:%M:%S', time.localtime(until))}")

    kills = collections.Counter()
    cache_peak = [0] * H
    over = [0] * H  # samples of a cache directory over its budget
    samples = [[] for _ in range(H)]  # (time, rss, fds, threads)
    counted = {}  # (host, pid) -> the daemon's counters when last sampled
    t0 = time.monotonic()
    # The first two kills come early and deterministically (a short run must have both);
    # then one every kill_every seconds on average.
    first_kills = {"reader": t0 + 3.0, "daemon": t0 + 6.0}
    next_kill = first_kills["daemon"] + rng.expovariate(1 / args.kill_every)
    next_sample = t0

    def sample_counters():
        for h, dm in enumerate(daemons):
            c = dm.counters(COUNTERS)
            if c is not None:
                counted[h, dm.proc.pid] = c

    def kill_reader(rd):
        rd.proc.send_signal(signal.SIGKILL)
        code = rd.proc.wait()
        if code == -signal.SIGKILL:
            kills["reader"] += 1
        elif code != 0:  # 0: it had just finished its last epoch
            failures.append(f"reader {rd.name} exited with {code}: {rd.log.read_text()[-400:]}")
        rd.start()

    def kill_daemon(dm):
        code = dm.kill_and_restart()
        if code == -signal.SIGKILL:
            kills["daemon"] += 1
        else:
            failures.append(f"daemon {dm.dir.name} had exited with {code} before its kill")
    hard_end = time.time() + args.minutes * 60 + GRACE
    running = list(readers)
    while running:
        now = time.monotonic()
        for h, dm in enumerate(daemons):
            used = bytes_on_disk(dm.cache)
            cache_peak[h] = max(cache_peak[h], used)
            if used > budget:
                over[h] += 1
            if not dm.busy() and dm.proc.poll() is not None:
                failures.append(f"host {h}: daemon exited with {dm.proc.returncode}: {dm.log_tail()}")
                dm.restart()
        if now >= next_sample:
            next_sample = now + 1.0
            for h, dm in enumerate(daemons):
                r = dm.resources()
                if r:
                    samples[h].append((now - t0, *r))
            sample_counters()
        for rd in list(running):
            code = rd.proc.poll()
            if code is not None:
                running.remove(rd)
                if code != 0:
                    failures.append(f"reader {rd.dataset} r{rd.rank} w{rd.worker} exited with "
                                    f"{code}: {rd.log.read_text()[-400:]}")
        # Neither the parking reader nor its daemon is killed before its park is over.
        parking = not parker.park_done()
        spared_reader = [parker] if parking else []
        spared_daemon = [parker.daemon] if parking else []
        if time.time() < until and not kills["reader"] and now >= first_kills["reader"]:
            ready = [rd for rd in running if rd not in spared_reader and rd.has_read()]
            if ready:
                kill_reader(rng.choice(ready))
        # A daemon is killed only while a reader of its own is reading: its streams are open.
        idle = [dm for dm in daemons if not dm.busy() and dm not in spared_daemon
                and any(rd.daemon is dm and rd.has_read() for rd in running)]
        if time.time() < until and not kills["daemon"] and now >= first_kills["daemon"]:
            if idle:
                kill_daemon(rng.choice(idle))
        if time.time() < until and now >= next_kill:
            next_kill = now + rng.expovariate(1 / args.kill_every)
            victims = [rd for rd in running if rd not in spared_reader]
            if rng.random() < 0.3 and idle:
                kill_daemon(rng.choice(idle))
            elif victims:
                kill_reader(rng.choice(victims))
        if time.time() > hard_end:
            failures.append(f"{len(running)} readers still running {GRACE:.0f}s after the end")
            for rd in running:
                rd.proc.kill()
            break
        time.sleep(0.05)  # the sampling period
    elapsed = time.monotonic() - t0
    for h, dm in enumerate(daemons):
        if dm.busy():
            dm.restarting.join()
        failures.extend(f"host {h}: {e}" for e in dm.start_errors)
    for dm in daemons:
        dm.resources()  # the last CPU figures
    sample_counters()  # the last counts (each daemon's since its last start)
    parks = sum(c["shardd_stream_parks_total"] for c in counted.values())
    # The store's faults as the daemons met them: their retries (src/store/http.rs and
    # download.rs log each one at debug; the logs are appended to across restarts).
    retries = sum(text.count("the store pushed back: retrying") + text.count("a body was cut: resuming it")
                  for text in ((dm.dir / "shardd.log").read_text(errors="replace") for dm in daemons))
    cpu = sum(sum(dm.cpu.values()) for dm in daemons)
    for h, dm in enumerate(daemons):
        code = dm.stop()
        if code != 0:
            failures.append(f"host {h}: daemon exited with {code} on SIGTERM: {dm.log_tail()}")
    proxy.close()
    for h in range(H):
        if over[h]:
            failures.append(f"host {h}: cache over its budget of {budget} bytes in {over[h]} "
                            f"samples (peak {cache_peak[h]})")

    log("checking every completed stream against webdataset and a fault-free daemon")
    refs = [Daemon(args.shardd, *host_config("reference", h, gcs.endpoint, "10GiB")) for h in range(H)]
    completed = byte_equal = in_order = 0
    total_samples = total_bytes = 0
    per_epoch = collections.defaultdict(list)  # (dataset, epoch) -> [(keys, dropped, host)]
    for path in sorted(out.glob("*.log")):
        dataset, r, w, e = path.stem.split("-")
        rank, worker, epoch = int(r[1:]), int(w[1:]), int(e[1:])
        keys, digests, ended = read_log(path)
        if not ended:
            continue
        completed += 1
        total_samples += len(keys)
        bad = [k for k, dg in zip(keys, digests) if reference.get(k, ("",))[0] != dg]
        total_bytes += sum(reference[k][1] for k in keys if k in reference)
        if bad:
            failures.append(f"{path.name}: {len(bad)} samples differ from webdataset's, e.g. {bad[0]}")
        else:
            byte_equal += 1
        host = rank // L
        want, dropped = reference_stream(refs[host], dataset, epoch, rank, world, worker, W, args.seed)
        if keys != want:
            at = next((i for i, (a, b) in enumerate(zip(keys, want)) if a != b), min(len(keys), len(want)))
            failures.append(f"{path.name}: order differs from a fault-free daemon's at sample {at} "
                            f"({len(keys)} vs {len(want)} samples)")
        else:
            in_order += 1
        per_epoch[(dataset, epoch)].append((keys, dropped, host))
    idle = [f"{rd.dataset}-r{rd.rank}-w{rd.worker}" for rd in readers
            if not any(read_log(p)[2] for p in out.glob(f"{rd.dataset}-r{rd.rank}-w{rd.worker}-e*.log"))]
    if idle:
        failures.append(f"{len(idle)} readers completed no epoch, e.g. {idle[0]}")
    exact_epochs = exact_ok = 0
    for (dataset, epoch), streams in sorted(per_epoch.items()):
        if dataset != "exact" or len(streams) != world * W:
            continue
        exact_epochs += 1
        union = [k for keys, _, _ in streams for k in keys]
        dropped = sum({h: d for _, d, h in streams}.values())
        if len(set(union)) == len(union) and len(union) + dropped == len(reference):
            exact_ok += 1
        else:
            failures.append(f"exact epoch {epoch}: {len(union)} samples ({len(set(union))} distinct) "
                            f"+ {dropped} dropped != {len(reference)}")
    for dm in refs:
        dm.stop()
    gcs.stop()
    log(f"checked {completed} streams in {time.monotonic() - t0 - elapsed:.0f}s")

    reconnects = 0
    pauses, long_pauses = 0, 0
    resumes = views = 0
    error_kinds = collections.Counter()
    for f in out.glob("*.errors"):
        for line in f.read_text().splitlines():
            kind = line.split("\t")
            if kind[0] == "RECONNECT":  # the client's warning: one per outage of one stream
                reconnects += 1
            elif kind[0] == "PAUSE":
                pauses += 1
                long_pauses += float(kind[2]) > args.stall_timeout
            elif kind[0] == "RESUME":  # a restarted reader's stream, accepted at start > 0
                resumes += 1
            elif kind[0] == "VIEWS":  # memoryviews a zero-copy epoch received
                views += int(kind[2])
            elif kind[0] == "ERROR":
                error_kinds[kind[2]] += 1
    if error_kinds:
        failures.append(f"daemon errors in streams: {dict(error_kinds)}")
    if args.pause_every > 0 and pause_max > args.stall_timeout and not long_pauses:
        failures.append(f"no reader paused longer than stall_timeout ({args.stall_timeout:g} s)")
    # What the soak exercises, as it really happened (not as the soak meant it).
    if not kills["daemon"] or not kills["reader"]:
        failures.append(f"SIGKILL ended {kills['daemon']} daemons and {kills['reader']} readers: "
                        f"the soak exercises at least one of each")
    if kills["reader"] and not resumes:
        failures.append("no killed reader resumed its stream with start past 0")
    if kills["daemon"] and not reconnects:
        failures.append("no client reconnected through a daemon's death")
    parked = parker.records("PARKED")
    if not parked:
        failures.append(f"{parker.name} did not see its stream parked: "
                        f"{parker.records('NOPARK') or 'no record'}")
    if not parks:
        failures.append("the daemons counted no parked stream (shardd_stream_parks_total)")
    missing = [k for k in FAULTS if not proxy.counts[k]]
    if args.fault_rate > 0 and missing:
        failures.append(f"the proxy injected no {', '.join(missing)}")
    if args.fault_rate > 0 and not retries:
        failures.append("the daemons logged no store retry: no fault reached them")
    if not views:
        failures.append("the zero-copy readers received no memoryview")
    if not exact_epochs:
        failures.append("no exact epoch completed on every stream: none was checked whole")

    growth = []
    for h, s in enumerate(samples):
        if not s:
            failures.append(f"host {h}: no resource samples")
            continue
        third = elapsed / 3
        first = [x for x in s if x[0] < third] or s
        last = [x for x in s if x[0] >= 2 * third] or s
        peak = lambda xs, i: max(x[i] for x in xs)  # noqa: E731
        growth.append((h, peak(first, 1), peak(last, 1), peak(first, 2), peak(last, 2),
                       peak(first, 3), peak(last, 3)))
        if peak(s, 2) > FD_BOUND or peak(s, 3) > THREAD_BOUND:
            failures.append(f"host {h}: {peak(s, 2)} fds / {peak(s, 3)} threads, over "
                            f"{FD_BOUND} / {THREAD_BOUND}")
        if peak(last, 1) > 1.5 * peak(first, 1) + 32 * MiB:
            failures.append(f"host {h}: RSS grew from {peak(first, 1) / MiB:.0f} MiB (first third) "
                            f"to {peak(last, 1) / MiB:.0f} MiB (last third)")
        if peak(last, 2) > peak(first, 2) + 16:
            failures.append(f"host {h}: fds grew from {peak(first, 2)} to {peak(last, 2)}")

    requests = sum(proxy.counts.values())
    injected = requests - proxy.counts["ok"]
    print()
    print(f"shardd soak: {elapsed / 60:.1f} min; {H} hosts x {L} ranks x {W} workers x "
          f"{len(DATASETS)} datasets = {len(readers)} streams at once")
    print(f"  data      {args.shards} shards, {len(reference)} samples, {data_bytes / MiB:.1f} MiB "
          f"(webdataset TarWriter); cache budget {budget / MiB:.1f} MiB per host "
          f"({args.budget:.0%} of a {share / MiB:.1f} MiB share)")
    print(f"  store     {requests} requests through the proxy, {injected} faults "
          f"({injected / max(requests, 1):.1%}): "
          + ", ".join(f"{k} {proxy.counts[k]}" for k in FAULTS)
          + f"; {proxy.bytes / MiB:.0f} MiB of bodies; {retries} retries in the daemons' logs")
    print(f"  seed      {args.seed}")
    print(f"  kills     {kills['daemon']} daemons, {kills['reader']} readers (ended by SIGKILL); "
          f"{resumes} reader restarts resumed past 0; {reconnects} stream outages the client "
          f"reconnected through; daemon errors {dict(error_kinds) or 'none'}")
    print(f"  pauses    {pauses} reader pauses of 0.1-{pause_max:g} s, {long_pauses} longer than "
          f"stall_timeout {args.stall_timeout:g} s, and {parker.name}'s pause until parked "
          f"({parked[0][2] if parked else '-'} s); {parks:.0f} streams parked (the daemons' "
          f"counters, sampled every second, summed over restarts)")
    print(f"  zero copy {views} fields received as memoryviews")
    print(f"  served    {total_samples} samples, {total_bytes / 2**30:.1f} GiB in completed streams; "
          f"daemons' CPU {cpu:.0f} s ({cpu / max(total_bytes / 1e9, 1e-9):.2f} s per GB; the killed "
          f"ones' last second not counted)")
    print(f"  streams   {completed} completed: {byte_equal} byte-equal to webdataset, "
          f"{in_order} in the fault-free daemon's order; exact epochs {exact_ok}/{exact_epochs} "
          f"hold every sample once but the dropped")
    print("  cache     peak " + ", ".join(f"host {h} {c / MiB:.1f}" for h, c in enumerate(cache_peak))
          + f" MiB of {budget / MiB:.1f} (sampled every 50 ms)")
    print("  daemons   first third -> last third peaks: "
          + "; ".join(f"host {h} RSS {a / MiB:.0f}->{b / MiB:.0f} MiB, fds {c}->{d}, "
                      f"threads {e}->{f}" for h, a, b, c, d, e, f in growth))
    for f in failures[:12]:
        print(f"  FAIL      {f}")
    if len(failures) > 12:
        print(f"  FAIL      ... and {len(failures) - 12} more")
    print(f"  result    {'FAIL' if failures else 'PASS'}"
          + (f" (everything is in {work})" if failures or args.workdir else ""))
    if not failures and not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
