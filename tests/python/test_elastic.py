"""Elastic resume through real daemons: an epoch checkpointed on one topology (hosts × ranks ×
workers) and finished on another reads every sample it had not read exactly once (but the
reported drops), as many on every new rank; at the same topology it is the `start=` resume."""

import collections

import pytest
import shardd

from test_exact import exact_config, manifest  # noqa: F401  (the fixture)

SEED, EPOCH = 5, 1


def hosts(make_daemon, fake_gcs, manifest, count, tag):
    return [make_daemon(exact_config(fake_gcs, manifest, h, count), name=f"{tag}{h}")
            for h in range(count)]


def read_job(daemons, world_size, num_workers, **kw):
    """Every stream of the job, read to its end: {(rank, worker): (keys, stream)}."""
    per_host = world_size // len(daemons)
    out = {}
    for h, d in enumerate(daemons):
        with shardd.Client(d.socket) as client:
            for rank in range(h * per_host, (h + 1) * per_host):
                for worker in range(num_workers):
                    s = client.stream("exact", epoch=EPOCH, rank=rank, world_size=world_size,
                                      worker=worker, num_workers=num_workers, seed=SEED, **kw)
                    out[rank, worker] = ([(x["__url__"], x["__key__"]) for x in s], s)
    return out


@pytest.mark.parametrize("new", [(1, 2, 1), (4, 1, 2)], ids=["1x2x1", "4x1x2"])
def test_a_checkpoint_finishes_on_another_topology_exactly_once(make_daemon, fake_gcs, manifest,
                                                                new):
    old = hosts(make_daemon, fake_gcs, manifest, 2, "old")
    full = read_job(old, world_size=4, num_workers=2)
    want = collections.Counter(k for keys, _ in full.values() for k in keys)
    length = len(full[0, 0][0])
    # A synchronous job: every rank's worker w delivered as many samples.
    positions = [length // 3, length // 3 - 2]
    consumed = [k for (rank, w), (keys, _) in full.items() for k in keys[:positions[w]]]
    origin = {"hosts": 2, "world_size": 4, "num_workers": 2, "positions": positions}

    h, ranks, workers = new
    rest = read_job(hosts(make_daemon, fake_gcs, manifest, h, f"new{h}-"), world_size=h * ranks,
                    num_workers=workers, resume_from=origin)
    got = collections.Counter(consumed)
    for keys, _ in rest.values():
        got.update(keys)
    assert max(got.values()) == 1, "a sample was read twice"
    assert not got - want
    missing = sum((want - got).values())
    starts = [s for _, s in rest.values()]
    remainder = sum(len(keys) - p for (r, w), (keys, _) in full.items() for p in [positions[w]])
    assert {s.start_fields["remainder"] for s in starts} == {remainder}
    assert {s.dropped for s in starts} == {missing}
    assert missing < h * ranks, "drops are fewer than the new ranks"
    per_rank = collections.Counter()
    for (rank, _), (keys, s) in rest.items():
        per_rank[rank] += len(keys)
        assert s.samples == len(keys)
    assert len(set(per_rank.values())) == 1, per_rank
    # Every new rank agrees on the plan it is in.
    assert len({s.fingerprint for s in starts}) == 1


def test_the_same_topology_continues_each_stream_as_start_does(make_daemon, fake_gcs, manifest):
    daemons = hosts(make_daemon, fake_gcs, manifest, 2, "h")
    full = read_job(daemons, world_size=4, num_workers=2)
    positions = [9, 4]
    origin = {"hosts": 2, "world_size": 4, "num_workers": 2, "positions": positions}
    rest = read_job(daemons, world_size=4, num_workers=2, resume_from=origin)
    for (rank, w), (keys, _) in full.items():
        assert rest[rank, w][0] == keys[positions[w]:], (rank, w)


def test_an_elastic_stream_resumes_with_start_and_chains(make_daemon, fake_gcs, manifest):
    """A stream of an elastic epoch resumes with `start=` (a reconnect or a checkpoint at the
    new topology), and a checkpoint taken during it resumes elastically again."""
    (d,) = hosts(make_daemon, fake_gcs, manifest, 1, "one")
    origin = {"hosts": 1, "world_size": 2, "num_workers": 2, "positions": [10, 3]}
    kw = dict(epoch=EPOCH, world_size=1, seed=SEED, resume_from=origin)
    with shardd.Client(d.socket) as c:
        whole = [x["__key__"] for x in c.stream("exact", rank=0, **kw)]
        assert len(set(whole)) == len(whole)
        assert [x["__key__"] for x in c.stream("exact", rank=0, start=17, **kw)] == whole[17:]
        # The 1-rank job checkpoints after 17 samples and moves to 2 ranks.
        chained = {"hosts": 1, "world_size": 1, "num_workers": 1, "positions": [17],
                   "from": origin}
        two = [[x["__key__"] for x in c.stream("exact", rank=r, epoch=EPOCH, world_size=2,
                                                seed=SEED, resume_from=chained)]
               for r in range(2)]
    assert len(two[0]) == len(two[1]) == (len(whole) - 17) // 2
    assert len(set(two[0] + two[1])) == 2 * len(two[0])
    assert set(two[0] + two[1]) <= set(whole[17:])


def test_bad_elastic_requests_are_refused_clearly(make_daemon, fake_gcs, manifest):
    (d,) = hosts(make_daemon, fake_gcs, manifest, 1, "one")
    with shardd.Client(d.socket) as c:
        def refused(dataset, origin):
            with pytest.raises(shardd.DaemonError) as e:
                next(iter(c.stream(dataset, epoch=0, rank=0, world_size=1,
                                   resume_from=origin)))
            return e.value
        e = refused("train", {"hosts": 1, "world_size": 1, "num_workers": 1, "positions": [0]})
        assert e.code == "bad_topology" and "needs the dataset's sample counts" in str(e)
        e = refused("exact", {"hosts": 1, "world_size": 1, "num_workers": 2, "positions": [0]})
        assert "1 positions for 2 workers" in str(e)
        e = refused("exact", {"hosts": 1, "world_size": 1, "num_workers": 1,
                              "positions": [10 ** 9]})
        assert "past the end of its old stream" in str(e)
        e = refused("exact", {"hosts": 2, "world_size": 3, "num_workers": 1, "positions": [0]})
        assert "not divisible" in str(e)


# -- shardd.torch and torchdata's StatefulDataLoader ---------------------------------------------

BATCH = 5


def torch_loader(socket, rank, world_size, num_workers, **kw):
    import shardd.torch as st
    from torchdata.stateful_dataloader import StatefulDataLoader

    ds = st.ShardDataset("exact", socket=socket, rank=rank, world_size=world_size, seed=SEED,
                         check_plan=False, **kw)
    if "resume_from" not in kw:
        ds.set_epoch(EPOCH)
    loader = StatefulDataLoader(ds, batch_size=BATCH, num_workers=num_workers,
                                collate_fn=lambda b: [(s["__url__"], s["__key__"]) for s in b])
    return ds, loader


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
@pytest.mark.parametrize("new", [(1, 2, 1), (4, 1, 2)], ids=["1x2x1", "4x1x2"])
def test_a_torch_job_resized_mid_epoch_reads_the_rest_once(make_daemon, fake_gcs, manifest, new):
    """2 hosts × 2 ranks × 2 workers take 6 batches each and checkpoint; the job resumes on
    another topology from rank 0's StatefulDataLoader state alone, reads the rest of the epoch
    exactly once (equal on every rank), checkpoints and resumes again at the new topology, and
    then reads the next epoch as a normal epoch of the new topology."""
    old = hosts(make_daemon, fake_gcs, manifest, 2, "old")
    everything = collections.Counter(k for keys, _ in read_job(old, 4, 2).values() for k in keys)
    consumed, states = [], []
    for rank in range(4):
        _, loader = torch_loader(old[rank // 2].socket, rank, 4, 2)
        it = iter(loader)
        for _ in range(6):
            consumed.extend(next(it))
        states.append(loader.state_dict())
        del it
    h, ranks, workers = new
    daemons = hosts(make_daemon, fake_gcs, manifest, h, f"new{h}-")
    rest, per_rank = [], {}
    for rank in range(h * ranks):
        socket = daemons[rank // ranks].socket
        ds, loader = torch_loader(socket, rank, h * ranks, workers, resume_from=states[0])
        assert ds.epoch == EPOCH
        expected = ds.epoch_length(num_workers=workers)
        it = iter(loader)
        head = [k for _ in range(3) for k in next(it)]
        saved = loader.state_dict()
        del it
        # A checkpoint at the new topology resumes there as usual (a fresh dataset, no
        # resume_from: the state carries it).
        ds2, again = torch_loader(socket, rank, h * ranks, workers)
        again.load_state_dict(saved)
        tail = [k for batch in again for k in batch]
        per_rank[rank] = len(head) + len(tail)
        assert per_rank[rank] == expected
        rest.extend(head + tail)
        # The next epoch is a normal one of the new topology.
        ds2.set_epoch(EPOCH + 1)
        nxt = [k for batch in again for k in batch]
        _, fresh = torch_loader(socket, rank, h * ranks, workers)
        fresh.dataset.set_epoch(EPOCH + 1)
        assert nxt == [k for batch in fresh for k in batch]
    assert len(set(per_rank.values())) == 1, per_rank
    got = collections.Counter(consumed + rest)
    assert max(got.values()) == 1 and not got - everything
    assert sum((everything - got).values()) < h * ranks
