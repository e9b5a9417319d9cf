"""The conformance matrix (issue 23): every promise in every combination of dataset mode,
delivery, reader, event and the client's decoder.

A cell reads one epoch of a 2-rank job (1 host) through one reader while one event happens
after its fifth sample. The `outage` event's cells read the same shards from a bucket (the
bucket emulator in front of fake-gcs-server) that answers 503 to everything from then until
the daemon has met it twice and the outage has outlived a token: the daemon's credentials are
a metadata server's tokens, which the bucket takes for 2 s. The other cells read local files. Its oracle is the same cell
read without the event, on a daemon of its own (the same samples, in the same order, on every
rank), and the contract of its mode: byte-equal to webdataset's reading of the same tars,
every sample once per epoch across ranks, equal counts per rank, a mix's ±1 prefix bound and
no sample twice within a pass (per stream: each DataLoader worker's too), resampled streams
of many distinct samples. A combination the daemon refuses (an elastic resume of a dataset
without sample counts) checks the refusal's message.

Every event proves it landed, or its cell fails (`Trigger.check`): a stream of the reader's
was open when it fired; kill -9 and a restart made the reader reconnect (the client's own
warning, counted in every process that read; for `pipe`, the new daemon served shards); a
pause parked a stream; a slow reader was never parked; a deletion removed cache entries and
shards were fetched again; the small budget evicted and its peak stayed under it; the outage
met requests, and no request was refused for its credentials after it. No stream failed, in the daemon or in the one it replaced.

CI runs a covering subset: every pair of axis values (of the cells that apply) at least once,
chosen deterministically, and a seventh of the other cells, chosen by the date: every cell
runs within a week. `SHARDD_MATRIX=full` runs every cell. The run prints the matrix as a
table of cells and results at the end of its output (conftest's pytest_terminal_summary)."""

import collections
import datetime
import gzip
import hashlib
import itertools
import logging
import os
import random
import shutil
import subprocess
import threading
import time

import pytest
import shardd
import webdataset as wds

from bucket_emulator import BucketEmulator, make_token
from conftest import SHARDD, reference_samples, start_fake_gcs, wait_for
from test_credentials import Metadata, no_credentials_env

MODES = ["shards", "manifest", "mix", "resampled", "tgz", "zst"]
DELIVERIES = ["socket", "zero_copy"]
READERS = ["client", "torch", "stateful", "grain", "pipe"]
EVENTS = ["none", "pause", "slow", "kill9", "restart", "resume", "elastic", "budget", "deleted", "outage"]
# The client's batch decoder: the wheel's compiled one, or the pure-Python one of the
# client-only distribution (shardd/_decode.py).
DECODERS = ["compiled", "python"]

SHARDS, PER_SHARD = 24, 20
WORLD, SEED, EPOCH, AT = 2, 3, 0, 5
# The bucket's credentials: a metadata server's tokens, good for TOKEN_TTL seconds.
TOKEN_SECRET, TOKEN_TTL = "matrix-token", 2
MIX_E, RESAMPLED_E = 200, 200
# The mix's weights change from 3:1 to 1:1 at job-wide sample MIX_AT: inside epoch 0, at
# position MIX_AT / (WORLD × streams per rank) of every stream.
MIX_AT = 240
# Samples of about 100 KB, ten to a frame, and streams of 20 MB and more: a stream's rest after
# a pause is more than the socket and the client's read-ahead hold, so a pause parks it and
# cuts a frame of several samples (what a park must re-encode the same).
SHARD_BYTES = PER_SHARD * 100_000


def applies(mode, delivery, reader, event, decoder):
    """Whether a cell means something. An elastic resume is a Client's request (the adapters
    resume at their own topology); only the stateful readers save a state to resume from.
    `pipe` is webdataset reading `pipe:shardd get URL` (whole shards, in tar order): it reads
    plain datasets' shards, always as a descriptor of the cache file (zero copy), and has no
    resume of its own, nor the client's decoder."""
    if reader == "pipe":
        # `shardd get` hands each shard's file over whole, so a pause, a slow reader or a
        # deletion acts on nothing of the daemon's: such cells would cover nothing.
        return (mode in ("shards", "tgz", "zst") and delivery == "zero_copy"
                and event not in ("resume", "elastic", "pause", "slow", "deleted") and decoder == "compiled")
    if event == "elastic" and reader != "client":
        return False
    if event == "resume" and reader == "torch":
        return False
    return True


def covering(axes, valid):
    """A deterministic set of cells holding every pair of values of two axes (that some valid
    cell holds) at least once: greedy, most uncovered pairs first, ties by axis order."""
    cells = [c for c in itertools.product(*axes) if valid(*c)]

    def pairs(cell):
        return {(i, cell[i], j, cell[j]) for i, j in itertools.combinations(range(len(cell)), 2)}

    left = set().union(*map(pairs, cells))
    chosen = []
    while left:
        best = max(cells, key=lambda c: len(pairs(c) & left))
        chosen.append(best)
        left -= pairs(best)
    return chosen


def through_the_client(cells):
    """`cells`, and a cell more for each event that they pair with zero copy only through
    `pipe` (whose descriptors bypass the client): zero copy's own client path (its maps,
    decoder and read-ahead thread) meets every event. Modes taken in turn."""
    met = {c[3] for c in cells if c[1] == "zero_copy" and c[2] != "pipe"}
    extra = []
    for event in EVENTS:
        if event in met:
            continue
        mode = MODES[len(extra) % len(MODES)]
        candidates = [c for c in itertools.product([mode], ["zero_copy"], READERS, [event], DECODERS)
                      if c[2] != "pipe" and applies(*c)]
        extra += candidates[:1]
    return cells + extra


def todays_slice(every, chosen, day):
    """The cells of `every` not in `chosen`, in seven slices: the `day`-th (0-6). Seven days
    run them all."""
    rest = [c for c in every if c not in set(chosen)]
    return rest[day % 7::7]


FULL = os.environ.get("SHARDD_MATRIX") == "full"
AXES = [MODES, DELIVERIES, READERS, EVENTS, DECODERS]
EVERY = [c for c in itertools.product(*AXES) if applies(*c)]
# CI: the covering set, and a seventh of the other cells, chosen by the date (UTC), so that
# each cell runs at least once a week (SHARDD_MATRIX_DAY=0..6 picks a slice).
DAY = int(os.environ.get("SHARDD_MATRIX_DAY", datetime.datetime.now(datetime.timezone.utc).date().toordinal() % 7))
COVERING = through_the_client(covering(AXES, applies))
# SHARDD_MATRIX=covering: the covering set alone (tests/mutation/planted.py).
CELLS = (EVERY if FULL else COVERING if os.environ.get("SHARDD_MATRIX") == "covering"
         else COVERING + todays_slice(EVERY, COVERING, DAY))
RESULTS = {}


# -- data ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The tars (webdataset's TarWriter), gzipped and zstd'ed copies, manifests; the config
    body of every mode's dataset; and webdataset's reading of the tars."""
    root = tmp_path_factory.mktemp("matrix")
    rng = random.Random(77)
    tars = []
    for s in range(SHARDS):
        path = root / f"m-{s:02d}.tar"
        with wds.TarWriter(str(path)) as sink:
            for i in range(PER_SHARD):
                sink.write({"__key__": f"s{s:02d}/{i:02d}", "bin": rng.randbytes(rng.randint(60_000, 140_000)),
                            "cls": str(i % 3).encode()})
        tars.append(path)
        (root / f"m-{s:02d}.tgz").write_bytes(gzip.compress(path.read_bytes(), 1))
        subprocess.run(["zstd", "-q", "-3", str(path), "-o", str(root / f"m-{s:02d}.tar.zst")], check=True)
    for s in range(3):
        with wds.TarWriter(str(root / f"other-{s}.tar")) as sink:
            for i in range(PER_SHARD):
                sink.write({"__key__": f"o{s}/{i:02d}", "bin": rng.randbytes(100_000)})

    def pattern(first, last, ext="tar"):
        return f"{root}/m-{{{first:02d}..{last:02d}}}.{ext}"

    def manifest(name, pat):
        out = root / f"{name}.manifest.json"
        run = subprocess.run([SHARDD, "index", pat, "-o", str(out)], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        return out

    last = SHARDS - 1
    full = manifest("all", pattern(0, last))
    sections = {
        "shards": f'shards = "{pattern(0, last)}"',
        "manifest": f'shards = "{pattern(0, last)}"\nmanifest = "{full}"',
        "web": f'shards = "{pattern(0, 15)}"\nmanifest = "{manifest("web", pattern(0, 15))}"',
        "books": f'shards = "{pattern(16, last)}"\nmanifest = "{manifest("books", pattern(16, last))}"',
        "mix": f"mix = {{ web = 3, books = 1 }}\nsamples_per_epoch = {MIX_E}\n"
               f"schedule = [{{ at = {MIX_AT}, mix = {{ web = 1, books = 1 }} }}]",
        "resampled": f'shards = "{pattern(0, last)}"\nmanifest = "{full}"\nresampled = true\n'
                     f"samples_per_epoch = {RESAMPLED_E}",
        "tgz": f'shards = "{pattern(0, last, "tgz")}"',
        "zst": f'shards = "{pattern(0, last, "tar.zst")}"',
        "other": f'shards = "{root}/other-{{0..2}}.tar"',
    }
    body = "[host]\nindex = 0\ncount = 1\n" + "".join(
        f"[datasets.{name}]\n{text}\n" + ("shuffle_buffer = 15\n" if name != "mix" else "")
        for name, text in sections.items())
    want = {k: digest_fields(v) for k, v in reference_samples(tars).items()}
    web = set(reference_samples(tars[:16]))
    urls = {"shards": tars, "tgz": [root / f"m-{s:02d}.tgz" for s in range(SHARDS)],
            "zst": [root / f"m-{s:02d}.tar.zst" for s in range(SHARDS)]}

    # The same files in a bucket, for the outage cells: fake-gcs-server serves gcs/mbkt/*
    # (hard links), through the bucket emulator, which takes the metadata server's
    # short-lived tokens; manifests indexed from the bucket (fake-gcs-server itself, anonymous).
    bucket = tmp_path_factory.mktemp("matrix-gcs")
    (bucket / "mbkt").mkdir()
    for f in root.iterdir():
        if f.is_file() and not f.name.endswith(".json"):
            os.link(f, bucket / "mbkt" / f.name)
    server = start_fake_gcs(bucket, bucket)
    emulator = BucketEmulator(int(server.endpoint.rsplit(":", 1)[1]), hosts=1, token_secret=TOKEN_SECRET).start()
    metadata = Metadata(token=lambda: (make_token(TOKEN_SECRET, "0", TOKEN_TTL), TOKEN_TTL))
    bucket_env = no_credentials_env(tmp_path_factory.mktemp("matrix-host"), metadata.address)
    gcs = f'[gcs]\nendpoint = "{server.endpoint}"\nanonymous = true\n'
    (bucket / "index.toml").write_text(gcs)
    gcs_sections = {}
    for name, text in sections.items():
        for manifest_path in root.glob("*.manifest.json"):
            if f'"{manifest_path}"' in text:
                pat = text.split('"')[1].replace(f"{root}/", "gs://mbkt/")
                out = bucket / manifest_path.name
                run = subprocess.run([SHARDD, "index", pat, "-o", str(out), "--config", str(bucket / "index.toml")],
                                     capture_output=True, text=True)
                assert run.returncode == 0, run.stderr
                text = text.replace(str(manifest_path), str(out))
        gcs_sections[name] = text.replace(f"{root}/", "gs://mbkt/")
    gcs_body = (f'[gcs]\nendpoint = "{emulator.endpoint(0)}"\n'
                '[store]\nretry_timeout = "60s"\n' + "[host]\nindex = 0\ncount = 1\n" + "".join(
        f"[datasets.{name}]\n{text}\n" + ("shuffle_buffer = 15\n" if name != "mix" else "")
        for name, text in gcs_sections.items()))
    gcs_urls = {mode: [f"gs://mbkt/{u.name}" for u in us] for mode, us in urls.items()}
    yield {"body": body, "want": want, "web": web, "urls": urls,
           "gcs_body": gcs_body, "gcs_urls": gcs_urls, "bucket": emulator, "bucket_env": bucket_env}
    emulator.close()
    metadata.close()
    server.stop()


def digest_fields(fields):
    return tuple(sorted((k, hashlib.md5(bytes(v)).hexdigest()) for k, v in fields.items()
                        if not k.startswith("__")))


def digest(sample, epoch=EPOCH):
    """What a cell compares: key, source (a mix's), and each field's MD5. Runs in the reader's
    process (a DataLoader worker's collate: a zero-copy memoryview never crosses a queue).
    Every reader asks for ``__seed__``: in every cell it must be the pure function of (seed,
    epoch, URL, key), whatever the mode, delivery, reader or event (a resume, a resize)."""
    want = shardd.sample_seed(SEED, epoch, sample["__url__"], sample["__key__"])
    assert sample["__seed__"] == want, f"{sample['__key__']}: __seed__ {sample['__seed__']}, not {want}"
    return (sample["__key__"], sample.get("__source__"), digest_fields(sample))


# -- readers: each reads rank `rank`'s epoch, calling `event(n)` after n samples ------------------


def client_reader(d, mode, zero_copy, rank, event, resume=False, **kw):
    out = []
    with shardd.Client(d.socket, zero_copy=zero_copy, sample_seeds=True) as c:
        s = c.stream(mode, epoch=EPOCH, rank=rank, world_size=WORLD, seed=SEED, **kw)
        for x in s:
            out.append(digest(x))
            event(len(out))
            if resume and len(out) == AT:
                # The trainer is killed; its saved state is the position.
                position = s.position
                s.close()
                s = c.stream(mode, epoch=EPOCH, rank=rank, world_size=WORLD, seed=SEED, start=position, **kw)
                out.extend(digest(y) for y in s)
                break
    return out


def torch_reader(d, mode, zero_copy, rank, event, resume=False, stateful=False):
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    import shardd.torch as st

    def loader(state=None):
        ds = st.ShardDataset(mode, socket=str(d.socket), rank=rank, world_size=WORLD, seed=SEED,
                             epoch=EPOCH, zero_copy=zero_copy, prefetch_next_epoch=False,
                             sample_seeds=True)
        cls = StatefulDataLoader if stateful else torch.utils.data.DataLoader
        dl = cls(ds, batch_size=None, num_workers=2, collate_fn=digest)
        if state is not None:
            dl.load_state_dict(state)
        return dl

    out = []
    dl = loader()
    it = iter(dl)
    for x in it:
        out.append(x)
        event(len(out))
        if resume and len(out) == AT:
            state = dl.state_dict()
            del it, dl  # the trainer dies; a new one loads its checkpoint
            out.extend(loader(state))
            break
    return out


def grain_reader(d, mode, zero_copy, rank, event, resume=False):
    import shardd.grain as sg

    def make():
        return iter(sg.ShardDataset(mode, socket=str(d.socket), rank=rank, world_size=WORLD, seed=SEED,
                                    epoch=EPOCH, zero_copy=zero_copy, num_epochs=1,
                                    sample_seeds=True))

    out = []
    it = make()
    for x in it:
        out.append(digest(x))
        event(len(out))
        if resume and len(out) == AT:
            state = it.get_state()
            it.close()
            it = make()
            it.set_state(state)
            out.extend(digest(y) for y in it)
            break
    it.close()
    return out


def pipe_reader(d, urls, rank, event):
    """webdataset's own `pipe:` reading of this rank's shards (every WORLD-th) through
    `shardd get`: the adoption path of a trainer that read `pipe:gsutil cat`."""
    out = []
    pipes = [f"pipe:{SHARDD} get --socket {d.socket} {u}" for u in urls[rank::WORLD]]
    for x in wds.WebDataset(pipes, shardshuffle=False, empty_check=False):
        out.append((x["__key__"], None, digest_fields(x)))
        event(len(out))
    return out


def read_job(d, data, mode, delivery, reader, event, bucket=False):
    """`bucket`: the daemon reads the bucket's copies (`start_daemon`)."""
    zero_copy = delivery == "zero_copy"
    resume = event == "resume"
    fire = Trigger(d, event, reader, data["bucket"])
    urls = data["gcs_urls" if bucket or from_bucket(event) else "urls"]
    out = {}
    try:
        for rank in range(WORLD):
            if reader == "client":
                out[rank] = client_reader(d, mode, zero_copy, rank, fire, resume)
            elif reader == "grain":
                out[rank] = grain_reader(d, mode, zero_copy, rank, fire, resume)
            elif reader == "pipe":
                out[rank] = pipe_reader(d, urls[mode], rank, fire)
            else:
                out[rank] = torch_reader(d, mode, zero_copy, rank, fire, resume, stateful=reader == "stateful")
    finally:
        fire.close()
    fire.check()
    return out


# What the client logs when it lost the daemon mid-stream and reconnects (_reconnect.py): one
# line per reconnect, in whatever process read (a DataLoader worker too).
RECONNECT = "lost the shardd daemon at"


class Trigger:
    """The event, fired once, after the AT-th sample of rank 0; `check` proves that it landed:
    that it acted on an open stream, and left the trace its kind must leave. A cell whose
    event acted on nothing fails: it would have shown nothing.

    The client's log (every process's: forked DataLoader workers inherit the handler) goes to
    `client.log` beside the daemon's, where `check` counts the reconnects."""

    def __init__(self, d, event, reader, bucket=None):
        self.d, self.event, self.reader, self.fired = d, event, reader, False
        self.slow_left = 0
        self.bucket, self.outage = bucket, None
        self.before, self.open_at_fire, self.deleted = {}, [], 0
        # Streams that failed in daemons this cell killed or stopped (their counters die).
        self.failed_earlier = 0
        self.client_log = d.dir / "client.log"
        self.client_log.write_text("")
        self.handler = logging.FileHandler(self.client_log)
        self.handler.setFormatter(logging.Formatter("%(process)d %(levelname)s %(name)s: %(message)s"))
        self.logger = logging.getLogger("shardd")
        self.level = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self.handler)

    def close(self):
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)
        self.handler.close()

    def __call__(self, n):
        if self.slow_left:
            # A slow, steady reader: takes a sample every 10 ms for 3 s (longer than the stall
            # timeout, 2 s, with room for a descheduled second; a pause it is not: a torch
            # worker's stream gives up a batch every ~20 of the trainer's samples, 0.2 s).
            self.slow_left -= 1
            time.sleep(0.01)
        if self.fired or n != AT:
            return
        self.fired = True
        d = self.d
        scrape = d.metrics()
        self.before = {name: d.metric(name, scrape) for name in (
            "shardd_stream_parks_total", "shardd_shard_fetches_total", "shardd_cache_evictions_total",
            "shardd_gets_total")}
        self.open_at_fire = d.status()["streams"]
        if self.event in ("kill9", "restart"):
            self.failed_earlier = d.metric('shardd_streams_total{outcome="failed"}', scrape)
        if self.event == "pause":
            # An evaluation pass: the daemon parks every stream it cannot send to (or has
            # sent all of them), then the reader reads on.
            try:
                wait_for(lambda: d.metric("shardd_stream_parks_total") > self.before["shardd_stream_parks_total"]
                         and all(s["waiting_on"] == "parked" for s in d.status()["streams"]),
                         "the paused streams to park")
            except TimeoutError as e:
                raise AssertionError(f"{e}: streams {d.status()['streams']}, open when the pause began "
                                     f"{self.open_at_fire}") from None
        elif self.event == "slow":
            self.slow_left = 300
        elif self.event == "kill9":
            d.kill()
            d.start()
        elif self.event == "restart":
            d.stop()
            d.start()
        elif self.event == "budget":
            # Another dataset read during the pause, in a cache of a few shards.
            with shardd.Client(d.socket) as c:
                assert len(list(c.stream("other", epoch=0, rank=0, world_size=1))) == 3 * PER_SHARD
        elif self.event == "outage":
            # Every request answered 503 until the daemon has met it twice (the job still has
            # shards to fetch: 4 ahead of rank 0's reading, and all of rank 1's) and every
            # token handed out before it began has expired; the readers wait meanwhile. A
            # thread ends it, as the readers may be waiting for it to end.
            self.bucket.outage("503")
            began = time.monotonic()

            def end():
                try:
                    wait_for(lambda: self.d.metric('shardd_store_requests_total{outcome="unavailable"}') >= 2
                             and time.monotonic() - began > TOKEN_TTL + 0.5,
                             "the daemon to meet the outage, and the outage to outlive a token")
                finally:
                    self.bucket.outage(None)

            self.outage = threading.Thread(target=end, daemon=True)
            self.outage.start()
        elif self.event == "deleted":
            for f in (d.dir / "cache").rglob("*"):
                if f.is_file():
                    # A download's file may be committed (renamed) or dropped meanwhile.
                    try:
                        f.unlink()
                        self.deleted += f.parent.name == "entries"
                    except FileNotFoundError:
                        pass

    def check(self):
        d = self.d
        scrape = d.metrics()
        # Whatever the event, no stream failed in the daemon (nor in the one it replaced): a
        # failure the client's reconnect hid (a frame a park could not re-encode, say) is a
        # defect all the same.
        failed = self.failed_earlier + d.metric('shardd_streams_total{outcome="failed"}', scrape)
        assert failed == 0, f"{failed:.0f} streams failed in the daemon (see its log: {d.log_path})"
        if self.event in ("none", "elastic", "resume"):
            return
        assert self.fired, "the event never fired"
        grew = {name: d.metric(name, scrape) - self.before[name] for name in self.before}
        if self.reader != "pipe" and self.event not in ("budget", "outage"):
            # A stream of the reader's was open in the daemon: the event met it mid-way.
            assert self.open_at_fire, f"no stream was open when the {self.event} began: it acted on nothing"
        reconnects = self.client_log.read_text().count(RECONNECT)
        if self.event in ("kill9", "restart"):
            if self.reader == "pipe":
                # `shardd get` has no stream to reconnect: the new daemon served the shards after.
                assert d.metric('shardd_gets_total{outcome="served"}', scrape) >= 1, \
                    "no shard was read through the restarted daemon"
            else:
                assert reconnects >= 1, f"the reader never reconnected through the {self.event} ({self.client_log})"
        else:
            assert reconnects == 0, f"the reader reconnected {reconnects} times ({self.client_log})"
        if self.event == "pause":
            assert grew["shardd_stream_parks_total"] >= 1, "the pause parked no stream"
        if self.event == "slow":
            assert self.slow_left == 0, "the stream ended before the slow reading did"
            assert grew["shardd_stream_parks_total"] == 0, "a slow, steady reader was parked"
        if self.event == "deleted":
            assert self.deleted >= 1, "no cache entry was there to delete"
            assert grew["shardd_shard_fetches_total"] >= 1, "nothing was fetched again after the deletion"
        if self.event == "budget":
            assert grew["shardd_cache_evictions_total"] >= 1, "the other dataset evicted nothing"
            assert d.metric("shardd_cache_bytes_max", scrape) <= d.metric("shardd_cache_capacity_bytes", scrape)
        if self.event == "outage":
            self.outage.join()
            assert d.metric('shardd_store_requests_total{outcome="unavailable"}', scrape) >= 2, \
                "the outage never met a request"
            assert d.metric('shardd_store_errors_total{kind="pushback"}', scrape) == 0
            # A retry carries the host's current token, not the one its request was signed with.
            totals = self.bucket.stats()["totals"]
            assert totals["unauthorized"] == 0, f"requests refused for their credentials: {totals}"


def from_bucket(event):
    """Whether a cell reads its shards from the bucket (through the emulator), not files."""
    return event == "outage"


def start_daemon(make_daemon, data, event, tag, bucket=False):
    # Two thirds of the dataset: every epoch evicts. (A compressed shard's load holds its
    # download and its tar at once, and two workers load at once: fewer shards than this can
    # run out of room on the socket path as well.) Written in the smallest blocks
    # (`cache.block_size`): what an operator whose host takes back memory runs.
    cache = (f'max_size = "{16 * SHARD_BYTES}"\nblock_size = "64KiB"\n' if event == "budget"
             else "")
    bucket = bucket or from_bucket(event)
    body = data["gcs_body" if bucket else "body"]
    # A zero-copy stream's frames are small: the rest of a rank's stream fits in the socket
    # buffer, so it can be sent whole before the event: a pause would find nothing to park, a
    # kill nothing to reconnect for, a deletion no open stream. With two maps a connection,
    # the daemon sends the samples of a third shard inline while the reader holds its maps:
    # the socket fills, and the stream is mid-way when the event comes.
    mid_way = event in ("pause", "slow", "kill9", "restart", "deleted")
    server = 'stall_timeout = "2s"\n' + ("zero_copy_maps = 2\n" if mid_way else "")
    return make_daemon(body, name=tag, server=server, cache=cache, env=data["bucket_env"] if bucket else None)


# -- the contract ----------------------------------------------------------------------------


def check_contract(mode, job, data, streams):
    """`streams`: per rank (a DataLoader's 2 workers each read one; with batch_size=None it
    yields their samples in turn, so worker w's stream is every 2nd sample from the w-th)."""
    want, ranks = data["want"], list(job.values())
    each = [r[w::streams] for r in ranks for w in range(streams)]
    for samples in ranks:
        for key, source, fields in samples:
            assert want[key] == fields, f"sample {key} differs from webdataset's reading"
    counts = [len(r) for r in ranks]
    keys = [k for r in ranks for k, _, _ in r]
    if mode in ("shards", "tgz", "zst", "manifest"):
        assert sorted(keys) == sorted(want), "not every sample once per epoch across ranks"
        if mode == "manifest":
            assert len(set(counts)) == 1, f"unequal ranks: {counts}"
    elif mode == "resampled":
        assert counts == [RESAMPLED_E * streams] * WORLD
        # A stream of 200 draws about 10 of the 24 shards, with replacement: samples of many
        # shards, most of them once (not 200 copies of a few). The draw is pinned below: the
        # same on a daemon of its own (the baseline).
        for stream in each:
            distinct = {k for k, _, _ in stream}
            shards = {k.split("/")[0] for k in distinct}
            assert len(shards) >= 4 and len(distinct) >= len(stream) // 2, \
                f"{len(distinct)} distinct samples of {len(shards)} shards in a stream of {len(stream)}"
    elif mode == "mix":
        assert counts == [MIX_E * streams] * WORLD
        # Each source is its own exact dataset, its pass dealt over the job's streams: a
        # stream's share of a pass is the source's samples / streams (web's 16 shards and
        # books' 8 divide evenly), and within a share no sample comes twice. Epoch 0 draws
        # 90 + 40 of web's samples per stream, 30 + 40 of books': with 2 streams no pass ends
        # (shares of 160 and 80), with 4 (a DataLoader's) both do (80 and 40).
        sizes = {"web": len(data["web"]), "books": len(want) - len(data["web"])}
        for stream in each:
            for source, size in sizes.items():
                share = size // (WORLD * streams)
                drawn = [k for k, src, _ in stream if src == source]
                for at in range(0, len(drawn), share):
                    part = drawn[at:at + share]
                    assert len(set(part)) == len(part), f"a sample of {source} read twice in one pass"
        change = MIX_AT // (WORLD * streams)
        for r in each:
            # The ±1 bound in each segment, counted from its start.
            for segment, weights in ((r[:change], (3, 1)), (r[change:], (1, 1))):
                seen = collections.Counter()
                for n, (key, source, _) in enumerate(segment, 1):
                    assert (key in data["web"]) == (source == "web")
                    seen[source] += 1
                    for name, w in zip(("web", "books"), weights):
                        assert abs(seen[name] - w * n / sum(weights)) <= 1, \
                            f"prefix bound broken at {n} of a segment: {seen}"


def elastic_cell(d, mode, delivery, data):
    """A checkpoint at 2 ranks after AT samples each, finished at 1 rank: every sample not yet
    read, once (but the drops START reports); modes without sample counts are refused. A mix
    (the mode with samples_per_epoch) then reads the next epoch with the job's history."""
    zero_copy = delivery == "zero_copy"
    origin = {"hosts": 1, "world_size": WORLD, "num_workers": 1, "positions": [AT]}
    refusals = {
        "shards": "needs the dataset's sample counts",
        "tgz": "needs the dataset's sample counts",
        "zst": "needs the dataset's sample counts",
        "resampled": "a resampled dataset has no remainder to redistribute",
    }
    if mode in refusals:
        with shardd.Client(d.socket, zero_copy=zero_copy, sample_seeds=True) as c:
            with pytest.raises(shardd.DaemonError) as e:
                c.stream(mode, epoch=EPOCH, rank=0, world_size=1, seed=SEED, resume_from=origin)
        assert e.value.code == "bad_topology" and refusals[mode] in str(e.value), str(e.value)
        return "refused"
    full = {r: client_reader(d, mode, zero_copy, r, lambda n: None) for r in range(WORLD)}
    consumed = [k for r in full.values() for k, _, _ in r[:AT]]
    with shardd.Client(d.socket, zero_copy=zero_copy, sample_seeds=True) as c:
        s = c.stream(mode, epoch=EPOCH, rank=0, world_size=1, seed=SEED, resume_from=origin)
        rest = [digest(x) for x in s]
    got = consumed + [k for k, _, _ in rest]
    assert len(set(got)) == len(got), "a sample read twice across the resize"
    every = {k for r in full.values() for k, _, _ in r}
    assert set(got) <= every
    assert len(every - set(got)) == s.dropped, "drops other than the reported ones"
    for key, _, fields in rest:
        assert data["want"][key] == fields
    if mode == "mix":
        # The next epoch, sent with the job's history, finishes each source's pass before it
        # starts the next: no sample of a source read twice while another is unread. (Without
        # the history, the one new stream starts at its own arithmetic's position and reads
        # part of epoch 0's samples again.)
        history = shardd.next_history(None, origin, EPOCH)
        with shardd.Client(d.socket, zero_copy=zero_copy, sample_seeds=True) as c:
            # The next epoch's seeds are the next epoch's: the function of (seed, epoch + 1, ...).
            nxt = [digest(x, EPOCH + 1)[0] for x in c.stream(mode, epoch=EPOCH + 1, rank=0, world_size=1,
                                                             seed=SEED, history=history)]
        reads = collections.Counter(got + nxt)
        for keys in (data["web"], set(data["want"]) - data["web"]):
            counts = [reads[k] for k in keys]
            assert max(counts) - min(counts) <= 1, "a source's pass not finished across the resize"
    return "ok"


# -- the matrix ------------------------------------------------------------------------------


BASELINES = {}


@pytest.mark.parametrize("mode,delivery,reader,event,decoder", CELLS,
                         ids=["-".join(c) for c in CELLS])
def test_cell(make_daemon, data, mode, delivery, reader, event, decoder, monkeypatch):
    cell = (mode, delivery, reader, event, decoder)
    RESULTS[cell] = "FAILED"
    if decoder == "python":  # DataLoader workers fork: they inherit it
        from shardd import _decode

        monkeypatch.setattr(_decode, "_compiled", None)
        monkeypatch.setenv("SHARDD_DECODER", "python")
    d = start_daemon(make_daemon, data, event, "cell")
    if event == "elastic":
        RESULTS[cell] = elastic_cell(d, mode, delivery, data)
        return
    got = read_job(d, data, mode, delivery, reader, event)
    check_contract(mode, got, data, streams=2 if reader in ("torch", "stateful") else 1)
    # The baseline may come from a cell of the other decoder: the same samples either way. A
    # bucket's shards have other URLs than the files (and so other orders): its own baseline.
    # Only a cell without an event makes one, and a daemon of its own reads it (an event-free
    # cell reads twice: the draw and the shuffle are the same on another daemon).
    bucket = from_bucket(event)
    base = BASELINES.get((mode, delivery, reader, bucket))
    if base is None:
        d = start_daemon(make_daemon, data, "none", "base", bucket=bucket)
        base = read_job(d, data, mode, delivery, reader, "none", bucket=bucket)
        BASELINES[mode, delivery, reader, bucket] = base
    assert got == base, "not the samples, or not the order, of the same cell without the event"
    RESULTS[cell] = "ok"


def matrix_table():
    """The matrix as a table, one row per cell run (None when no cell ran): printed at the
    end of the session's output (conftest's pytest_terminal_summary)."""
    if not RESULTS:
        return None
    lines = [f"conformance matrix: {len(RESULTS)} cells ({'full' if FULL else f'every pair of values, and slice {DAY} of 7 of the rest'})",
             "| mode | delivery | reader | event | decoder | result |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {' | '.join(c)} | {r} |" for c, r in sorted(RESULTS.items())]
    text = "\n".join(lines)
    out = os.environ.get("SHARDD_MATRIX_TABLE")
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    return text


@pytest.mark.parametrize("zero_copy", [False, True], ids=["socket", "zero_copy"])
def test_zero_copy_in_a_cache_of_a_few_shards_reads_what_the_socket_path_reads(make_daemon, data, zero_copy):
    """A cache of six shards: a stream reads five samples, pauses while an evaluation reads
    another dataset, then reads on. Zero copy failed with cache_full on its own pins (maps of
    shards it had passed stayed pinned until it needed a new one, and maps had no byte bound);
    now its maps pin at most server.zero_copy_share of the budget (a quarter) and are retired
    as soon as the stream has no sample left of their shard. (The share is what zero copy may
    need beyond the socket path: a map the client still holds stays pinned through a pause.)"""
    budget = 6 * SHARD_BYTES
    d = make_daemon(data["body"], server='stall_timeout = "1s"', cache=f'max_size = "{budget}"\n')
    mapped_peak = 0

    def watch_maps(n):
        nonlocal mapped_peak
        mapped_peak = max(mapped_peak, d.metric("shardd_zero_copy_mapped_bytes"))
        if n == AT:
            for event in ("pause", "budget"):
                trigger = Trigger(d, event, "client")
                trigger(AT)
                trigger.close()

    got = []
    with shardd.Client(d.socket, zero_copy=zero_copy, sample_seeds=True) as c:
        for x in c.stream("manifest", epoch=0, rank=0, world_size=1, seed=SEED):
            got.append(digest(x))
            watch_maps(len(got))
    assert sorted(k for k, _, _ in got) == sorted(data["want"])
    for key, _, fields in got:
        assert data["want"][key] == fields
    assert mapped_peak <= budget // 4
    assert d.metric("shardd_cache_full_total") == 0
