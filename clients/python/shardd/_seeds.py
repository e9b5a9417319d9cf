"""``__seed__``: a per-sample random seed that a resume reproduces (PROTOCOL.md, "Per-sample
seeds"). It depends only on the job's seed, the epoch, the shard's URL and the sample's key,
so the same sample in the same epoch gets the same seed whatever the topology, delivery,
resume or resize, and another one in another epoch: random augmentations seeded from it
replay exactly after a restart.

The function is part of the data contract (golden vectors in tests/python/test_seeds.py):

    BLAKE2b, 8-byte digest, personalisation b"shardd.seed", over
    u64le(seed) || u64le(epoch) || UTF-8(__url__) || 0x00 || UTF-8(__key__),
    read as a little-endian u64 and shifted right by one bit (0 <= __seed__ < 2**63, so it
    fits every signed 64-bit seed API: torch.Generator.manual_seed, numpy, JAX).

It is computed by the client, not sent: nothing changes on the wire, and it costs about a
microsecond per sample only for a client that asks for it (``Client(sample_seeds=True)``).
"""

import hashlib
import struct

PERSON = b"shardd.seed"


def sample_seed(seed, epoch, url, key):
    """The ``__seed__`` of one sample (see the module's docstring)."""
    data = struct.pack("<QQ", seed, epoch) + url.encode() + b"\0" + key.encode()
    digest = hashlib.blake2b(data, digest_size=8, person=PERSON).digest()
    return int.from_bytes(digest, "little") >> 1


def add_seeds(batch, seed, epoch):
    """Sets ``__seed__`` on every sample of a decoded batch. The hash of (seed, epoch, URL)
    is computed once per URL of the batch and copied for each key (4x faster than hashing
    each sample whole)."""
    prefix = struct.pack("<QQ", seed, epoch)
    by_url = {}
    from_bytes = int.from_bytes
    for s in batch:
        url = s["__url__"]
        base = by_url.get(url)
        if base is None:
            base = by_url[url] = hashlib.blake2b(
                prefix + url.encode() + b"\0", digest_size=8, person=PERSON)
        h = base.copy()
        h.update(s["__key__"].encode())
        s["__seed__"] = from_bytes(h.digest(), "little") >> 1
