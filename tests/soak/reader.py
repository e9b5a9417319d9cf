"""One trainer stream of the soak, as its own process (so the soak can kill -9 it): reads
epoch after epoch of one (dataset, rank, worker) through the real Python client and appends
``key<TAB>digest`` per sample to ``OUT/<dataset>-r<rank>-w<worker>-e<epoch>.log``, then
``END<TAB>samples`` when the epoch's stream ended.

Started again after a kill of the reader, it resumes where its file stops (a partial last line
is cut off): it asks for ``start`` = the lines on disk, so the file must come out exactly as one
uninterrupted read. A daemon that went away (killed, restarting) is the client's business: its
own reconnect resumes the stream (``reconnect_timeout``), and the reader only records the
client's warnings. Now and then the reader pauses (a trainer's evaluation pass), some pauses
longer than the daemon's ``stall_timeout``; the pauses are drawn from ``--pause-seed`` (the
soak derives it from its own seed). With ``--park-first`` its first pause comes right after
the first sample of its first epoch and lasts until the daemon's ``/status`` shows the
stream parked (a park the soak can count on, even in a short run). Daemon errors, the
client's reconnect warnings, the pauses, the park, resumes (a start past 0) and the
memoryviews a zero-copy epoch received are appended to ``<name>.errors``; daemon errors are
retried a few times; the soak reports them all.
"""

import argparse
import hashlib
import json
import logging
import os
import pathlib
import random
import sys
import time
import urllib.request

import shardd

# A daemon's start checks the manifest through the faulty store: it can take minutes.
RECONNECT_TIMEOUT = 180.0
MAX_ERRORS_PER_EPOCH = 5
# --park-first: how long the reader waits for the daemon to park its stream.
PARK_DEADLINE = 120.0


# The client's warning when it lost the daemon mid-stream (_reconnect.py): one per outage of
# one stream. Its other warnings (a first connection's retry, zero copy's fallback) are no
# reconnect through a daemon's death.
RECONNECT = "lost the shardd daemon at "


class Recorder(logging.Handler):
    """Writes the client's warnings to the ``.errors`` file: RECONNECT for a reconnect,
    WARNING for the others."""

    def __init__(self, errors):
        super().__init__(logging.WARNING)
        self.errors, self.epoch = errors, None

    def emit(self, record):
        message = record.getMessage()
        kind = "RECONNECT" if message.startswith(RECONNECT) else "WARNING"
        self.errors.write(f"{kind}\t{self.epoch}\t{message}\n")
        self.errors.flush()


def digest(sample):
    """What identifies a sample's content: every field (not ``__key__``/``__url__``)."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(k for k in sample if not k.startswith("__")):
        value = sample[name]
        h.update(b"%s\0%d\0" % (name.encode(), len(value)))
        h.update(value)
    return h.hexdigest()


def lines_on_disk(path):
    """Complete lines in ``path`` (cutting off a partial last one) and whether it ended."""
    if not path.exists():
        return 0, False
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1
    if keep < len(data):
        with open(path, "r+b") as f:
            f.truncate(keep)
    lines = data[:keep].splitlines()
    if lines and lines[-1].startswith(b"END\t"):
        return len(lines) - 1, True
    return len(lines), False


def read_epoch(args, epoch, path, errors, pauses):
    """Reads (the rest of) one epoch into ``path``; returns once it ended."""
    failures = 0
    while True:
        position, ended = lines_on_disk(path)
        if ended:
            return
        try:
            with shardd.Client(args.socket, reconnect_timeout=RECONNECT_TIMEOUT,
                               zero_copy=args.zero_copy) as client, \
                    open(path, "a") as out:
                stream = client.stream(args.dataset, epoch=epoch, rank=args.rank,
                                       world_size=args.world_size, worker=args.worker,
                                       num_workers=args.workers, seed=args.seed, start=position)
                assert stream.position == position, (stream.position, position)
                if position:
                    errors.write(f"RESUME\t{epoch}\t{position}\n")
                    errors.flush()
                n, views = position, 0
                for sample in stream:
                    out.write(f"{sample['__key__']}\t{digest(sample)}\n")
                    n += 1
                    views += sum(isinstance(v, memoryview) for v in sample.values())
                    if pauses.park is not None:
                        out.flush()
                        pauses.until_parked(errors, epoch, args)
                    elif time.monotonic() >= pauses.due:
                        out.flush()
                        pauses.pause(errors, epoch)
                if stream.samples is not None and n != stream.samples:
                    raise AssertionError(f"{path.name}: {n} samples, START said {stream.samples}")
                out.write(f"END\t{n}\n")
            if args.zero_copy:
                errors.write(f"VIEWS\t{epoch}\t{views}\n")
                errors.flush()
            return
        except shardd.DaemonError as e:
            # About the data (e.g. a shard the faulty store failed too often): resume by hand.
            errors.write(f"ERROR\t{epoch}\t{e.code}\t{e}\n")
            errors.flush()
            failures += 1
            if failures > MAX_ERRORS_PER_EPOCH:
                raise


class Pauses:
    """When the reader stops reading next, and for how long: every ``every`` seconds on
    average, for 0.1 to ``longest`` seconds (the soak makes that longer than the daemons'
    stall_timeout, so some paused streams are parked by the daemon)."""

    def __init__(self, every, longest, seed, park=None):
        self.every, self.longest = every, longest
        self.rng = random.Random(seed)
        self.due = self._next()
        self.park = park  # the /status URL, for the pause until parked (--park-first)

    def _next(self):
        if self.every <= 0:
            return float("inf")
        return time.monotonic() + self.rng.expovariate(1 / self.every)

    def pause(self, errors, epoch):
        seconds = self.rng.uniform(0.1, self.longest)
        errors.write(f"PAUSE\t{epoch}\t{seconds:.2f}\n")
        errors.flush()
        time.sleep(seconds)  # the pause under test: a trainer that stops reading
        self.due = self._next()

    def until_parked(self, errors, epoch, args):
        """Stops reading until the daemon says this process's stream is parked (PARKED), or
        is gone from its streams (NOPARK: it sent everything into the socket first) or the
        deadline passed (NOPARK)."""
        url, self.park = self.park, None
        began = time.monotonic()
        outcome = "NOPARK\tdeadline"
        while time.monotonic() - began < PARK_DEADLINE:
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    streams = [s for s in json.load(r)["streams"]
                               if s["peer_pid"] == os.getpid() and s["dataset"] == args.dataset]
            except OSError:
                streams = None  # the daemon is restarting: ask again
            if streams == []:
                outcome = "NOPARK\tthe daemon finished sending the stream first"
                break
            if streams and streams[0]["waiting_on"] == "parked":
                outcome = "PARKED"
                break
            time.sleep(0.1)  # polling the daemon's /status
        errors.write(f"{outcome}\t{epoch}\t{time.monotonic() - began:.2f}\n")
        errors.flush()


def main():
    p = argparse.ArgumentParser()
    for name in ("socket", "dataset", "out"):
        p.add_argument(f"--{name}", required=True)
    for name in ("rank", "world-size", "worker", "workers", "seed"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--until", type=float, required=True, help="start no epoch after this time")
    p.add_argument("--pause-every", type=float, default=0, help="mean seconds between pauses")
    p.add_argument("--pause-max", type=float, default=0, help="longest pause, seconds")
    p.add_argument("--zero-copy", action="store_true", help="Client(zero_copy=True)")
    p.add_argument("--pause-seed", required=True, help="seeds the pauses (a string)")
    p.add_argument("--park-first", metavar="STATUS_URL",
                   help="pause after the first sample until the daemon (its /status) parks the stream")
    args = p.parse_args()
    out = pathlib.Path(args.out)
    name = f"{args.dataset}-r{args.rank}-w{args.worker}"
    with open(out / f"{name}.errors", "a") as errors:
        recorder = Recorder(errors)
        logging.getLogger("shardd").addHandler(recorder)
        pauses = Pauses(args.pause_every, args.pause_max, args.pause_seed, args.park_first)
        epoch = 0
        while True:
            path = out / f"{name}-e{epoch:03d}.log"
            if not lines_on_disk(path)[1]:
                if time.time() > args.until and not path.exists():
                    return 0  # an epoch already started is finished
                recorder.epoch = epoch
                read_epoch(args, epoch, path, errors, pauses)
            epoch += 1


if __name__ == "__main__":
    sys.exit(main())
