"""One trainer stream of the soak, as its own process (so the soak can kill -9 it): reads
epoch after epoch of one (dataset, rank, worker) through the real Python client and appends
``key<TAB>digest`` per sample to ``OUT/<dataset>-r<rank>-w<worker>-e<epoch>.log``, then
``END<TAB>samples`` when the epoch's stream ended.

Started again after a kill, it resumes where its file stops (a partial last line is cut off):
it asks for ``start`` = the lines on disk, so the file must come out exactly as one
uninterrupted read. A daemon that went away (killed, restarting) is waited for and the stream
resumed the same way. Daemon errors are appended to ``<name>.errors`` and retried a few
times; the soak reports them.
"""

import argparse
import hashlib
import pathlib
import sys
import time

import shardd

RECONNECT_DEADLINE = 180.0
MAX_ERRORS_PER_EPOCH = 5


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


def read_epoch(args, epoch, path, errors):
    """Reads (the rest of) one epoch into ``path``; returns once it ended."""
    failures = 0
    while True:
        position, ended = lines_on_disk(path)
        if ended:
            return
        try:
            with shardd.Client(args.socket) as client, open(path, "a") as out:
                stream = client.stream(args.dataset, epoch=epoch, rank=args.rank,
                                       world_size=args.world_size, worker=args.worker,
                                       num_workers=args.workers, seed=args.seed, start=position)
                assert stream.position == position, (stream.position, position)
                n = position
                for sample in stream:
                    out.write(f"{sample['__key__']}\t{digest(sample)}\n")
                    n += 1
                if stream.samples is not None and n != stream.samples:
                    raise AssertionError(f"{path.name}: {n} samples, START said {stream.samples}")
                out.write(f"END\t{n}\n")
            return
        except (shardd.ProtocolError, ConnectionError, FileNotFoundError) as e:
            # The daemon went away (the soak killed it): wait for it and resume.
            errors.write(f"RECONNECT\t{epoch}\t{type(e).__name__}: {e}\n")
            errors.flush()
            wait_for_socket(args.socket)
        except shardd.DaemonError as e:
            errors.write(f"ERROR\t{epoch}\t{e.code}\t{e}\n")
            errors.flush()
            if e.code == "shutdown":
                wait_for_socket(args.socket)
                continue
            failures += 1
            if failures > MAX_ERRORS_PER_EPOCH:
                raise


def wait_for_socket(path):
    """Until a connection to the daemon's socket succeeds (it may be restarting). Not
    conftest's wait_for: importing conftest (webdataset, which imports torch) costs 24 readers
    seconds of CPU each."""
    import socket

    end = time.monotonic() + RECONNECT_DEADLINE
    while True:
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(path)
                return
        except OSError:
            if time.monotonic() > end:
                raise TimeoutError(f"no daemon at {path} for {RECONNECT_DEADLINE}s")
            time.sleep(0.05)


def main():
    p = argparse.ArgumentParser()
    for name in ("socket", "dataset", "out"):
        p.add_argument(f"--{name}", required=True)
    for name in ("rank", "world-size", "worker", "workers", "seed"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--until", type=float, required=True, help="start no epoch after this time")
    args = p.parse_args()
    out = pathlib.Path(args.out)
    name = f"{args.dataset}-r{args.rank}-w{args.worker}"
    with open(out / f"{name}.errors", "a") as errors:
        epoch = 0
        while True:
            path = out / f"{name}-e{epoch:03d}.log"
            if not lines_on_disk(path)[1]:
                if time.time() > args.until and not path.exists():
                    return 0  # an epoch already started is finished
                read_epoch(args, epoch, path, errors)
            epoch += 1


if __name__ == "__main__":
    sys.exit(main())
