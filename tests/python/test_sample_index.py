"""Sample indexes (``src/shard/sample_index.rs``): a cached shard's tar is walked once; the samples
of every later read (the next epoch, another rank, a resume) are made from its index, with
the same bytes in the same order, over both delivery paths; ``cache.index_memory = "0"``
keeps none and walks every time."""

import io
import random
import tarfile

import pytest
import shardd

from conftest import as_bytes, reference_samples

SHARDS = 4


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Shards with what the index must describe: ustar-prefixed and GNU long names (keys not
    spelled in one piece in the header), uppercase field names (lowercased), empty, small
    (copied into the index) and large fields (slices of the shard), and a sample whose
    members are not adjacent to the previous one's."""
    root = tmp_path_factory.mktemp("indexed")
    rng = random.Random(3)
    for s in range(SHARDS):
        with tarfile.open(root / f"x-{s}.tar", "w", format=tarfile.GNU_FORMAT if s % 2 else tarfile.USTAR_FORMAT) as tar:
            for i in range(12):
                key = f"{'d' * 90}/{'p' * 20}/x{s}-{i:02d}" if i % 3 == 0 else f"x{s}-{i:02d}"
                fields = {
                    "cls": str(i).encode(),
                    "JSON": b'{"i": %d}' % i,
                    "seg.PNG": rng.randbytes(rng.choice([0, 63, 64, 65, 5000, 70_000])),
                }
                for name, body in fields.items():
                    info = tarfile.TarInfo(f"{key}.{name}")
                    info.size = len(body)
                    tar.addfile(info, io.BytesIO(body))
    return root


def config(data):
    return f'[datasets.x]\nshards = "{data}/x-{{0..{SHARDS - 1}}}.tar"\nshuffle_buffer = 5\n'


def fields(sample):
    return {k: v for k, v in sample.items() if not k.startswith("__")}


def read_epochs(socket_path, zero_copy, epochs, world_size=1):
    out = []
    with shardd.Client(socket_path, zero_copy=zero_copy) as c:
        for epoch in epochs:
            for rank in range(world_size):
                stream = c.stream("x", epoch=epoch, rank=rank, world_size=world_size)
                out.append([as_bytes(s) for s in stream])
    return out


def test_a_shard_is_walked_once_and_read_again_from_its_index(make_daemon, data, delivery):
    indexed = make_daemon(config(data), name="indexed")
    walked = make_daemon(config(data), name="walked", cache='index_memory = "0"')
    got = read_epochs(indexed.socket, delivery, [0, 1, 2, 0])
    assert indexed.metric("shardd_shards_parsed_total") == SHARDS
    assert indexed.metric("shardd_sample_index_bytes") > 0
    want = read_epochs(walked.socket, delivery, [0, 1, 2, 0])
    assert walked.metric("shardd_shards_parsed_total") == 4 * SHARDS
    assert walked.metric("shardd_sample_index_bytes") == 0
    assert got == want
    assert got[0] == got[3], "epoch 0 read again: the same order"
    assert got[0] != got[1], "another epoch: another order"
    reference = reference_samples(sorted(data.glob("x-*.tar")))
    assert len(reference) == 12 * SHARDS
    for epoch in got:
        assert sorted(s["__key__"] for s in epoch) == sorted(reference), "each key once"
        assert {s["__key__"]: fields(s) for s in epoch} == reference


def test_ranks_and_a_resume_read_pieces_of_indexed_shards(make_daemon, data):
    """Two ranks take pieces of the same shards (start..end inside a shard), and a resume
    starts mid-shard: made from the index, they are the samples a fresh walk gives."""
    indexed = make_daemon(config(data), name="indexed")
    walked = make_daemon(config(data), name="walked", cache='index_memory = "0"')
    reference = reference_samples(sorted(data.glob("x-*.tar")))  # webdataset's reading
    read_epochs(indexed.socket, False, [0])  # every shard indexed
    ranks = read_epochs(indexed.socket, False, [1], world_size=3)
    assert ranks == read_epochs(walked.socket, False, [1], world_size=3)
    # The ranks' pieces put together: webdataset's samples, byte for byte, each key once.
    assert sorted(s["__key__"] for r in ranks for s in r) == sorted(reference)
    assert all(fields(s) == reference[s["__key__"]] for r in ranks for s in r)
    (whole,) = read_epochs(walked.socket, False, [2])
    assert sorted(s["__key__"] for s in whole) == sorted(reference)
    assert all(fields(s) == reference[s["__key__"]] for s in whole)
    with shardd.Client(indexed.socket) as a, shardd.Client(walked.socket) as b:
        for start in [1, 13, 30]:
            x = list(a.stream("x", epoch=2, rank=0, world_size=1, start=start))
            y = [s["__key__"] for s in b.stream("x", epoch=2, rank=0, world_size=1, start=start)]
            assert [s["__key__"] for s in x] == y == [s["__key__"] for s in whole[start:]]
            assert all(fields(s) == reference[s["__key__"]] for s in x)
    assert indexed.metric("shardd_shards_parsed_total") == SHARDS
