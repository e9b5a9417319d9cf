"""``__seed__`` (issue 26): a per-sample seed that depends only on (seed, epoch, shard URL,
sample key), so that augmentations seeded from it replay after a resume or a resize. The
function is part of the contract: golden vectors pin it. Its promise in every combination of
mode, delivery, reader and event is checked by the conformance matrix (every reader there asks
for it and every sample's is compared with the function)."""

import hashlib
import struct
import pytest
import shardd
from shardd._seeds import add_seeds

from conftest import TRAIN_SHARDS, reference_samples, write_train_shards

# (seed, epoch, url, key) -> __seed__. A change here is a protocol-level change: a resumed job
# would augment its samples differently from the run it resumes.
GOLDEN = [
    (0, 0, "gs://bucket/train/train-000000.tar", "sample000000", 6660226816643069954),
    ((1 << 64) - 1, 3, "file:///data/a.tar", "x/é", 7803125090528205064),
]


@pytest.mark.parametrize("seed,epoch,url,key,want", GOLDEN)
def test_the_seed_function_is_pinned(seed, epoch, url, key, want):
    assert shardd.sample_seed(seed, epoch, url, key) == want
    # As PROTOCOL.md spells it, from hashlib alone (what another client implements).
    data = struct.pack("<QQ", seed, epoch) + url.encode() + b"\0" + key.encode()
    digest = hashlib.blake2b(data, digest_size=8, person=b"shardd.seed").digest()
    assert int.from_bytes(digest, "little") >> 1 == want


def test_a_batch_gets_what_the_function_gives_each_sample():
    batch = [{"__url__": f"gs://b/t-{i % 3}.tar", "__key__": f"k{i}"} for i in range(50)]
    add_seeds(batch, 7, 2)
    assert all(s["__seed__"] == shardd.sample_seed(7, 2, s["__url__"], s["__key__"]) for s in batch)
    assert len({s["__seed__"] for s in batch}) == 50
    assert all(0 <= s["__seed__"] < 1 << 63 for s in batch)


@pytest.fixture(scope="module")
def exact(tmp_path_factory):
    """A daemon with the train shards as a manifest dataset (`exact`) on one host."""
    from conftest import Daemon, index

    root = tmp_path_factory.mktemp("seeds")
    paths = write_train_shards(root / "train")
    pattern = f"{root}/train/train-{{000000..{TRAIN_SHARDS - 1:06d}}}.tar"
    manifest = index(pattern, root / "m.json")
    d = Daemon(root, "[host]\nindex = 0\ncount = 1\n"
               f'[datasets.exact]\nshards = "{pattern}"\nmanifest = "{manifest}"\nshuffle_buffer = 20\n')
    d.paths = paths
    yield d
    d.stop()


def seeds_of(d, world, epoch, zero_copy=False, seed=5, **kw):
    """{key: __seed__} of every sample every rank of a `world`-rank job reads in `epoch`."""
    out = {}
    with shardd.Client(d.socket, sample_seeds=True, zero_copy=zero_copy) as c:
        for rank in range(world):
            for s in c.stream("exact", epoch=epoch, rank=rank, world_size=world, seed=seed, **kw):
                assert s["__key__"] not in out
                out[s["__key__"]] = s["__seed__"]
    return out


def test_a_samples_seed_is_the_same_whatever_the_topology_delivery_or_resume(exact):
    one = seeds_of(exact, 1, epoch=0)
    assert set(one) == set(reference_samples(exact.paths))
    four = seeds_of(exact, 4, epoch=0, zero_copy=True)
    assert {k: one[k] for k in four} == four, "another seed at another world size or delivery"
    # A resume from the middle carries the same seeds as the uninterrupted stream's rest.
    with shardd.Client(exact.socket, sample_seeds=True) as c:
        whole = [(s["__key__"], s["__seed__"]) for s in c.stream("exact", epoch=0, rank=0, world_size=2, seed=5)]
        rest = [(s["__key__"], s["__seed__"])
                for s in c.stream("exact", epoch=0, rank=0, world_size=2, seed=5, start=7)]
    assert rest == whole[7:]
    # An elastic resume (2 ranks -> 1) reads the rest with the seeds the old ranks would have seen.
    origin = {"hosts": 1, "world_size": 2, "num_workers": 1, "positions": [7]}
    with shardd.Client(exact.socket, sample_seeds=True) as c:
        resized = {s["__key__"]: s["__seed__"]
                   for s in c.stream("exact", epoch=0, rank=0, world_size=1, seed=5, resume_from=origin)}
    assert resized and all(one[k] == v for k, v in resized.items())


def test_seeds_differ_between_epochs_and_job_seeds_and_are_absent_unless_asked(exact):
    e0, e1 = seeds_of(exact, 1, epoch=0), seeds_of(exact, 1, epoch=1)
    assert e0.keys() == e1.keys()
    assert all(e0[k] != e1[k] for k in e0), "a sample kept its seed into the next epoch"
    other = seeds_of(exact, 1, epoch=0, seed=6)
    assert all(e0[k] != other[k] for k in e0), "another job seed gave a sample the same seed"
    assert len(set(e0.values())) == len(e0)
    with shardd.Client(exact.socket) as c:
        assert all("__seed__" not in s for s in c.stream("exact", epoch=0, rank=0, world_size=1))


def test_a_torch_augmentation_seeded_from_it_replays_after_a_restart(exact):
    """The recipe of docs/client.md: a torch.Generator per sample. Two DataLoaders (one
    restarted from a checkpoint after 9 samples) crop every sample at the same place."""
    torch = pytest.importorskip("torch")
    from torchdata.stateful_dataloader import StatefulDataLoader

    import shardd.torch as st

    def crop(sample):
        g = torch.Generator().manual_seed(sample["__seed__"])
        return sample["__key__"], torch.randint(0, 1000, (2,), generator=g).tolist()

    def loader(state=None):
        ds = st.ShardDataset("exact", socket=str(exact.socket), rank=0, world_size=1, seed=5,
                             sample_seeds=True, prefetch_next_epoch=False)
        dl = StatefulDataLoader(ds, batch_size=None, num_workers=2, collate_fn=crop)
        if state is not None:
            dl.load_state_dict(state)
        return dl

    whole = list(loader())
    dl = loader()
    first = []
    for x in dl:
        first.append(x)
        if len(first) == 9:
            state = dl.state_dict()
            break
    del dl
    assert first + list(loader(state)) == whole
