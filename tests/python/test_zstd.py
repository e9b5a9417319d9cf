"""zstd shards (.tar.zst), compressed by the real `zstd` and `pzstd` tools, served through the
daemon and indexed by `shardd index`.

webdataset (1.0, on this Python) cannot read .tar.zst itself: it opens shards with tarfile's
``r|*``, which knows gzip, bz2 and xz only (zstd arrives in Python 3.14). So the reference is
webdataset reading the plain tars the zstd tool compressed; the daemon must give exactly
those samples, byte for byte."""

import json
import subprocess

import pytest
import shardd
import webdataset as wds

from conftest import BUCKET, SHARDD, TRAIN_SHARDS, reference_samples, upload, write_train_shards

# How each shard is compressed: a level, a long window (27: the most the daemon decodes, as
# the zstd tool without --memory), two frames (two files concatenated), pzstd (its frames
# each behind a skippable frame).
VARIANTS = [["-1"], ["-19"], ["--long=27"], "two-frames", "pzstd", ["-3", "--no-check"]]


def zstd(args, data, program="zstd"):
    return subprocess.run([program, "-q", "-c", *args], input=data, capture_output=True, check=True).stdout


def compress(data, variant):
    if variant == "two-frames":
        half = len(data) // 2 + 123
        return zstd([], data[:half]) + zstd(["-9"], data[half:])
    if variant == "pzstd":
        return zstd(["-p", "2"], data, program="pzstd")
    return zstd(variant, data)


@pytest.fixture(scope="module")
def zst_shards(tmp_path_factory):
    """The train shards (written by webdataset), and each compressed by the zstd tools:
    (plain paths, compressed paths). One compressed shard keeps the name `.tar`: what is
    compressed is told by content, not by name."""
    root = tmp_path_factory.mktemp("zstd")
    plain = write_train_shards(root / "plain")
    out = root / "zst"
    out.mkdir()
    compressed = []
    for i, p in enumerate(plain):
        data = compress(p.read_bytes(), VARIANTS[i % len(VARIANTS)])
        assert data[:4] in (b"\x28\xb5\x2f\xfd", b"\x50\x2a\x4d\x18"), data[:4]
        name = p.name if i == 5 else p.name + ".zst"
        (out / name).write_bytes(data)
        compressed.append(out / name)
    return plain, compressed


def as_reference(samples):
    return {s["__key__"]: {k: v for k, v in s.items() if not k.startswith("__")} for s in samples}


def dataset(name, paths, extra=""):
    listed = ", ".join(f'"{p}"' for p in paths)
    return f"[datasets.{name}]\nshards = [{listed}]\nshuffle_buffer = 50\n{extra}"


def test_zstd_shards_read_as_webdataset_reads_the_tars(make_daemon, zst_shards):
    plain, compressed = zst_shards
    d = make_daemon(dataset("zst", compressed), cache='max_size = "16MiB"')
    want = reference_samples(plain)
    with shardd.Client(d.socket) as c:
        got = list(c.stream("zst", epoch=0, rank=0, world_size=1))
    assert len(got) == len(want) > 200
    assert as_reference(got) == want
    url_of = {k: str(c) for p, c in zip(plain, compressed) for k in reference_samples([p])}
    assert {s["__key__"]: s["__url__"] for s in got} == url_of
    # Stored decompressed: the cache holds the plain tars' bytes (8 KiB per record besides).
    # (A budget with room for all: a smaller one may evict shards the stream has read.)
    assert d.metric("shardd_cache_evictions_total") == 0
    resident = d.metric("shardd_cache_resident_bytes")
    assert resident == sum(p.stat().st_size + 8192 for p in plain)


def test_index_counts_zstd_shards_and_an_exact_epoch_reads_them(make_daemon, fake_gcs, zst_shards, tmp_path):
    plain, compressed = zst_shards
    for i, c in enumerate(compressed):
        upload(fake_gcs, f"zstd/shard-{i:02d}.tar.zst", c.read_bytes())
    pattern = f"gs://{BUCKET}/zstd/shard-{{00..{TRAIN_SHARDS - 1:02d}}}.tar.zst"
    store = tmp_path / "store.toml"
    store.write_text(f'[gcs]\nendpoint = "{fake_gcs}"\nanonymous = true\n')
    out = tmp_path / "zstd.manifest.json"
    run = subprocess.run([SHARDD, "index", pattern, "-o", str(out), "--config", str(store)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    m = json.loads(out.read_text())
    counts = [len(reference_samples([p])) for p in plain]
    assert [e["samples"] for e in m["shards"]] == counts
    assert m["total_samples"] == sum(counts)
    # Sizes as stored: the compressed objects'.
    assert [e["size"] for e in m["shards"]] == [c.stat().st_size for c in compressed]
    assert m["total_bytes"] == sum(c.stat().st_size for c in compressed)

    # Served with the manifest: two ranks of one exact epoch hold every sample once (the
    # leftover the START reports aside), byte for byte.
    config = (
        f'[host]\nindex = 0\ncount = 1\n[gcs]\nendpoint = "{fake_gcs}"\nanonymous = true\n'
        f'[datasets.zst]\nshards = "{pattern}"\nmanifest = "{out}"\nshuffle_buffer = 50\n'
    )
    d = make_daemon(config)
    want = reference_samples(plain)
    got = []
    with shardd.Client(d.socket) as c:
        for rank in range(2):
            stream = c.stream("zst", epoch=1, rank=rank, world_size=2, seed=5)
            samples = list(stream)
            assert len(samples) == sum(counts) // 2
            got += samples
    assert len({s["__key__"] for s in got}) == len(got)
    assert all(want[s["__key__"]] == as_reference([s])[s["__key__"]] for s in got)
    assert len(want) - len(got) <= 2


def test_a_zstd_bomb_stops_at_the_budget(make_daemon, tmp_path):
    with wds.TarWriter(str(tmp_path / "zeros.tar")) as sink:
        sink.write({"__key__": "zeros", "bin": bytes(4 << 20)})
    bomb = tmp_path / "bomb.tar.zst"
    bomb.write_bytes(zstd(["-19"], (tmp_path / "zeros.tar").read_bytes()))
    assert bomb.stat().st_size < 4096
    d = make_daemon(dataset("bomb", [bomb]), cache='max_size = "1MiB"')
    with shardd.Client(d.socket) as c:
        with pytest.raises(shardd.DaemonError) as e:
            list(c.stream("bomb", epoch=0, rank=0, world_size=1))
    assert e.value.code == "stream_failed"
    assert str(e.value).startswith(
        f"{bomb}: decompresses to more than the cache can hold (cache.max_size 1048576 bytes; "
    ), str(e.value)
    assert list((d.dir / "cache" / "tmp").iterdir()) == []
    assert d.metric("shardd_cache_bytes") == 0


@pytest.mark.parametrize("damage, message", [
    ("truncated", "decompressing the zstd shard: truncated: the data ends inside a zstd frame"),
    ("corrupt", "decompressing the zstd shard: corrupt zstd data ("),
    ("wide", "decompressing the zstd shard: a zstd frame needs a window larger than 128 MiB"),
])
def test_bad_zstd_fails_its_stream_naming_the_shard(make_daemon, zst_shards, tmp_path, damage, message):
    plain, compressed = zst_shards
    data = plain[0].read_bytes()
    if damage == "truncated":
        bad = zstd([], data)[:-100]
    elif damage == "corrupt":
        bad = bytearray(zstd([], data))
        for i in range(len(bad) // 3, len(bad) // 3 + 64):
            bad[i] ^= 0x5A
        bad = bytes(bad)
    else:
        # A 256 MiB window: zstd writes it for --long=28 when it cannot see the input's size.
        bad = zstd(["--long=28"], data)
    path = tmp_path / f"{damage}.tar.zst"
    path.write_bytes(bad)
    d = make_daemon(dataset("bad", [path]) + dataset("train", compressed[:2]))
    with shardd.Client(d.socket) as c:
        with pytest.raises(shardd.DaemonError) as e:
            list(c.stream("bad", epoch=0, rank=0, world_size=1))
    assert e.value.code == "stream_failed"
    assert str(e.value).startswith(f"{path}: {message}"), str(e.value)
    assert list((d.dir / "cache" / "tmp").iterdir()) == []
    # The daemon goes on serving the other shards.
    with shardd.Client(d.socket) as c:
        got = list(c.stream("train", epoch=0, rank=0, world_size=1))
    assert as_reference(got) == reference_samples(plain[:2])
