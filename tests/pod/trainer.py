"""A trainer process of a pod host, as one torchrun/XLA replica: reads one rank's stream from
its host's daemon through the Python client and writes what it read, one JSON line per
sample (``[url, key, digest]``, digest: sample_digest below), then ``{"end": position,
"dropped", "fingerprint", "seconds", "first_sample_seconds", "longest_wait_seconds"}``.

Run: ``trainer.py REQUEST`` with REQUEST a JSON object: ``socket``, ``out``, ``dataset``,
``epoch``, ``rank``, ``world_size``, and optionally ``seed``, ``start`` (a same-topology
resume), ``resume_from`` (an elastic one), ``stop_after`` (the samples to read before saving
state and exiting, as a trainer that checkpoints and is stopped)."""

import hashlib
import json
import sys
import time

import shardd


def sample_digest(sample):
    """SHA-1 over a sample's fields (not the ``__`` ones), by name: equal iff the bytes are."""
    h = hashlib.sha1()
    for name in sorted(k for k in sample if not k.startswith("__")):
        value = bytes(sample[name])
        h.update(f"{name}\0{len(value)}\0".encode())
        h.update(value)
    return h.hexdigest()


def main():
    r = json.loads(sys.argv[1])
    started = time.monotonic()
    lines, first, longest = [], None, 0.0
    with shardd.Client(r["socket"]) as client:
        s = client.stream(r["dataset"], epoch=r["epoch"], rank=r["rank"],
                          world_size=r["world_size"], seed=r.get("seed", 0),
                          start=r.get("start", 0), resume_from=r.get("resume_from"))
        stop_after = r.get("stop_after")
        last = time.monotonic()
        for sample in s:
            now = time.monotonic()
            longest = max(longest, now - last)
            if first is None:
                first = now - started
            lines.append(json.dumps([sample["__url__"], sample["__key__"], sample_digest(sample)]))
            last = time.monotonic()
            if stop_after is not None and len(lines) >= stop_after:
                break
        end = {"end": s.position, "dropped": s.dropped, "fingerprint": s.fingerprint,
               "seconds": time.monotonic() - started, "first_sample_seconds": first,
               "longest_wait_seconds": longest}
    with open(r["out"], "w") as f:
        f.write("".join(line + "\n" for line in lines) + json.dumps(end) + "\n")


if __name__ == "__main__":
    main()
