"""Defects of the cache's read path, end to end: the real daemon, fake-gcs-server, real files."""

import shutil

import shardd

from conftest import BIG_SHARDS, TRAIN_SHARDS, big_payload, gcs_config, reference_samples


def gets(d):
    return d.metric('shardd_store_requests_total{kind="get"}')


def read(d, dataset, epoch, pause=None):
    """One stream over a whole dataset, as {key: {field: bytes}}; ``pause`` runs after the
    first sample, while the stream is open."""
    out = {}
    with shardd.Client(d.socket) as c:
        for s in c.stream(dataset, epoch=epoch, rank=0, world_size=1):
            assert s["__key__"] not in out
            out[s["__key__"]] = {k: v for k, v in s.items() if not k.startswith("__")}
            if pause is not None:
                pause()
                pause = None
    return out


def test_cache_files_deleted_under_the_daemon_are_fetched_again(make_daemon, fake_gcs, train_paths, tmp_path):
    """An operator (or a cleaner) deletes the cache's files, or its directories, while the
    daemon runs: the next reads fetch those shards again, byte for byte, and fail nothing.
    (Before, every stream failed on them with "mapping the cache file: No such file", for as
    long as the daemon ran.)"""
    d = make_daemon(gcs_config(fake_gcs))
    cache = d.dir / "cache"
    train = reference_samples(train_paths)
    assert read(d, "train", epoch=0) == train
    assert gets(d) == TRAIN_SHARDS

    # Every file in entries/ (data and records), between two streams.
    for path in (cache / "entries").iterdir():
        path.unlink()
    assert read(d, "train", epoch=1) == train
    assert gets(d) == 2 * TRAIN_SHARDS

    # The directories themselves, in the middle of a stream of 8 MB samples (the daemon is
    # blocked on the socket with most shards still to read). Moved away, then deleted: an
    # `rm -rf` can race with a commit and fail on a non-empty directory.
    big = {f"big{i}": {"bin": big_payload(i)} for i in range(BIG_SHARDS)}
    assert read(d, "big", epoch=0) == big
    fetched = 2 * TRAIN_SHARDS + BIG_SHARDS
    assert gets(d) == fetched

    def remove_dirs():
        for name in ("tmp", "entries"):  # tmp first: no download is cut
            trash = tmp_path / f"trash-{name}"
            (cache / name).rename(trash)
            shutil.rmtree(trash)

    assert read(d, "big", epoch=1, pause=remove_dirs) == big
    # What the stream had mapped was read from its unlinked files; the next stream fetches
    # those: each shard once in all.
    assert fetched <= gets(d) <= fetched + BIG_SHARDS
    assert read(d, "big", epoch=2) == big
    assert gets(d) == fetched + BIG_SHARDS
    assert len(list((cache / "entries").glob("*.meta"))) == BIG_SHARDS

    # What was fetched again is committed like anything else: a restart fetches nothing.
    d.stop()
    d.start()
    assert read(d, "big", epoch=3) == big
    assert gets(d) == 0
    assert d.metric("shardd_cache_verify_failures_total") == 0
