"""Resampled streams (`resampled = true`): every stream draws shards of its host's share with
replacement, exactly `samples_per_epoch` samples, byte-equal to webdataset's reading,
deterministic and resumable with `start=`, other draws every epoch."""

import collections
import subprocess

import shardd

from conftest import SHARDD, reference_samples
from test_exact import exact_config, manifest  # noqa: F401  (the fixture)


def test_resampled_streams_are_exact_deterministic_and_resumable(make_daemon, fake_gcs, manifest,
                                                                 train_paths):
    d = make_daemon(exact_config(fake_gcs, manifest, extra="samples_per_epoch = 300\nresampled = true\n"))
    want = reference_samples(train_paths)
    kw = dict(rank=0, world_size=1, num_workers=2, seed=11)
    with shardd.Client(d.socket) as c:
        def read(epoch, worker, start=0):
            return [(x["__key__"], {k: v for k, v in x.items() if not k.startswith("__")})
                    for x in c.stream("exact", epoch=epoch, worker=worker, start=start, **kw)]
        first = read(0, 0)
        assert len(first) == 300
        for key, fields in first:
            assert fields == want[key]
        # With replacement: 300 draws of whole shards over fewer samples repeat some.
        assert max(collections.Counter(k for k, _ in first).values()) > 1
        assert read(0, 0) == first
        assert read(0, 0, start=123) == first[123:]
        assert read(1, 0) != first
        assert read(0, 1) != first


def test_resampled_without_samples_per_epoch_is_a_config_error(tmp_path, fake_gcs, manifest):
    config = tmp_path / "c.toml"
    config.write_text(exact_config(fake_gcs, manifest, extra="resampled = true\n"))
    run = subprocess.run([SHARDD, "check", "--no-store", "--config", str(config)],
                         capture_output=True, text=True)
    assert run.returncode != 0
    assert 'dataset "exact": resampled = true needs samples_per_epoch' in run.stderr, run.stderr
