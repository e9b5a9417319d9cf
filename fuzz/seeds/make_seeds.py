"""Writes the committed seed corpora (fuzz/seeds/<target>/). Run from anywhere:
python3 fuzz/seeds/make_seeds.py. The tar seeds include two shards of the webdataset
project's own test data (BSD-style license, see tests/data/webdataset/LICENSE)."""

import gzip
import io
import json
import pathlib
import random
import shutil
import struct
import subprocess
import tarfile

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TESTDATA = ROOT / "tests" / "data" / "webdataset"


def out(target, name, data):
    d = HERE / target
    d.mkdir(exist_ok=True)
    (d / name).write_bytes(data)


def frame(kind, body):
    return struct.pack("<IB", len(body), kind) + body


PREAMBLE = b"SHARDD" + struct.pack("<H", 1)


def frames():
    req = {"op": "stream", "dataset": "train", "epoch": 0, "rank": 3, "world_size": 32,
           "worker": 0, "num_workers": 1, "seed": 0}
    out("frame", "request", PREAMBLE + frame(1, json.dumps(req).encode()))
    out("frame", "request-minimal", PREAMBLE + frame(1, b'{"op":"stream","dataset":"d","epoch":7,"rank":0,"world_size":1}'))
    out("frame", "request-unknown-field", PREAMBLE + frame(1, b'{"op":"stream","dataset":"d","epoch":0,"rank":0,"world_size":1,"x":1}'))
    out("frame", "start", frame(2, b'{"dataset": "train", "shards": 20, "host": 0, "hosts": 4}'))
    out("frame", "error", frame(5, b'{"code":"busy","message":"the daemon already serves"}'))
    out("frame", "not-shardd", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")


def batch_body(samples):
    """samples: [(key, url, [(name, data)])] -> BATCH body per proto/PROTOCOL.md."""
    names, urls, words, payload = [], [], [], b""
    for key, url, fields in samples:
        if url not in urls:
            urls.append(url)
        words += [urls.index(url) | (len(fields) << 16), len(key)]
        payload += key
        for name, data in fields:
            if name not in names:
                names.append(name)
            words += [names.index(name), len(data)]
            payload += data
    tables = b"".join(struct.pack("<I", len(t)) + t for t in names + urls)
    pieces = [len(k) for k, _, _ in samples] + [len(d) for _, _, f in samples for _, d in f]
    offset = 24 + len(tables) + 4 * len(words)
    head = struct.pack("<6I", len(samples), len(words), len(names), len(urls), offset, max(pieces, default=0))
    return head + tables + struct.pack(f"<{len(words)}I", *words) + payload


def batches():
    out("batch_decode", "two-samples", batch_body([
        (b"a", b"gs://b/0.tar", [(b"jpg", b"J" * 10), (b"cls", b"1")]),
        (b"bb", b"gs://b/1.tar", [(b"seg.png", b"P" * 300), (b"json", b"")]),
    ]))
    out("batch_decode", "empty", batch_body([]))
    out("batch_decode", "no-fields", batch_body([(b"k", b"u", [])]))
    # arbitrary's bytes for the target's Input, which no hand-written layout reached (both
    # earlier seeds built empty tables: tests/fuzz_seeds.rs now says what each seed reaches):
    # inputs drawn at random, mostly small bytes, of which these three build samples.
    rng = random.Random(5)
    drawn = []
    for _ in range(74):
        n = rng.choice([64, 128, 256, 512, 1024, 4096])
        drawn.append(bytes(rng.choice([0, 1, 1, 2, 3, rng.randrange(256)]) for _ in range(n)))
    for name, i in (("small", 10), ("medium", 5), ("large", 73)):
        out("batch_roundtrip", name, drawn[i])


def tar_bytes(fmt, members):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as t:
        for name, data, typ in members:
            ti = tarfile.TarInfo(name)
            ti.type = typ
            ti.size = len(data) if typ == tarfile.REGTYPE else 0
            t.addfile(ti, io.BytesIO(data) if typ == tarfile.REGTYPE else None)
    return buf.getvalue()


def tars():
    R, D = tarfile.REGTYPE, tarfile.DIRTYPE
    for name in ["compressed.tar", "sample.tgz"]:
        out("tar", name, b"\0" + (TESTDATA / name).read_bytes())
    plain = gzip.decompress((TESTDATA / "sample.tgz").read_bytes())
    zst = subprocess.run(["zstd", "-19", "-q", "-c"], input=plain, capture_output=True, check=True)
    out("tar", "sample.tar.zst", b"\0" + zst.stdout)
    long = "d" * 120 + "/sample.seg.PNG"
    out("tar", "gnu-longname", b"\0" + tar_bytes(tarfile.GNU_FORMAT, [
        ("dir/", b"", D), (long, b"x" * 600, R), ("d" * 120 + "/sample.cls", b"3", R)]))
    out("tar", "pax", b"\0" + tar_bytes(tarfile.PAX_FORMAT, [
        ("p" * 200 + "/k.txt", b"abc", R), ("__meta__", b"m", R), ("k2.txt", b"", R), ("k2.json", b"{}", R)]))
    out("tar", "ustar-prefix", b"\0" + tar_bytes(tarfile.USTAR_FORMAT, [
        ("a" * 90 + "/" + "b" * 60 + "/s.jpg", b"\xff" * 513, R), ("__index__/x.json", b"i", R)]))
    out("tar", "dup-field", b"\0" + tar_bytes(tarfile.USTAR_FORMAT, [("k.jpg", b"1", R), ("k.JPG", b"2", R)]))
    # A PAX size record, then a GNU long name, then the file (found by this target).
    def raw(name, size, typ):
        ti = tarfile.TarInfo(name)
        ti.size, ti.type = size, typ
        return ti.tobuf(format=tarfile.GNU_FORMAT)[:512]
    pad = lambda b: b + b"\0" * (-len(b) % 512)
    long = b"dir/" + b"n" * 120 + b".jpg\0"
    out("tar", "pax-then-longname", b"\0" + raw("pax", 10, tarfile.XHDTYPE) + pad(b"10 size=5\n")
        + raw("././@LongLink", len(long), tarfile.GNUTYPE_LONGNAME) + pad(long)
        + raw("short.jpg", 999, R) + pad(b"hello") + bytes(1024))
    out("tar", "repair-me", b"\x01" + tar_bytes(tarfile.USTAR_FORMAT, [("k.jpg", b"1", R), ("l.jpg", b"2", R)]))


def braces():
    for i, p in enumerate([
        "gs://bucket/imagenet/train-{000000..000639}.tar", "{train,val}-{0..1}", "x{a,b{1..2}}y",
        r"a\{0..2\}", "{0..10..5}", "{a..e}", "{x}-{0..1}", "{3..1}", "{09..11}",
    ]):
        out("braces", f"raw-{i}", b"\x01" + p.encode())
    out("braces", "structured-a", b"\x00" + bytes(range(64)))
    out("braces", "structured-b", b"\x00\x03\x01\x05\x00\x00\x00\x00\x00\x00\x00\x09\x00\x00\x00\x00\x00\x00\x00\x01\x03" * 3)


def configs():
    example = (ROOT / "config.example.toml").read_bytes()
    out("config", "example", example)
    uncommented = b"\n".join(
        l[1:] if l.startswith(b"#") and not l.startswith((b"# ", b"##")) and l != b"#" else l
        for l in example.split(b"\n"))
    out("config", "example-uncommented", uncommented)
    out("config", "minimal", b'[host]\nindex = 0\ncount = 4\n[datasets.train]\nshards = "gs://bucket/imagenet/train-{000000..000639}.tar"\n')
    out("config", "two-datasets", b'[cache]\nrevalidate = "0s"\nmax_size = "1.5 GiB"\n[datasets.a]\nshards = ["/x/a-{0..3}.tar", "s3://b/c.tar"]\nshuffle_buffer = 1\n[datasets.b]\nshards = "file:///x/b.tgz"\nwarm = true\n')


def manifests():
    def entry(url, size, samples, e_tag='"KhoKeG2qsf/rPOyN0m4CIQ=="', generation="1795361585273474"):
        return {"url": url, "size": size, "e_tag": e_tag, "generation": generation,
                "crc32c": 1580234032, "samples": samples}

    def manifest(shards, **totals):
        m = {"format": 1, "shards": shards,
             "total_samples": sum(e["samples"] for e in shards), "total_bytes": sum(e["size"] for e in shards)}
        return json.dumps({**m, **totals}, indent=2).encode()

    two = [entry("gs://bkt/train/train-000000.tar", 604160, 30),
           entry("/data/train-000001.tar", 1095680, 37, e_tag="local:1234:1700000000000000000", generation=None)]
    out("manifest", "two", manifest(two))
    out("manifest", "empty", manifest([]))
    out("manifest", "twice", manifest([two[0], two[0]]))
    out("manifest", "totals-wrong", manifest(two, total_samples=66))
    out("manifest", "huge-counts", manifest([entry("s3://b/a.tar", 2**63, 2**63), entry("s3://b/b.tar", 2**63, 2**63)],
                                            total_samples=0, total_bytes=0))


def requests():
    """REQUEST bodies for the request target's config (fuzz_targets/request.rs): ordinary
    ones of every dataset mode, elastic resumes, the absurd requests of
    tests/python/test_hostile.py, and resumes at the elastic bound."""
    u32, u64, bound = 2**32 - 1, 2**64 - 1, 2**18  # elastic::MAX_STREAMS

    def req(name, dataset="web", op="stream", epoch=0, rank=0, world_size=1, **more):
        body = dict(op=op, dataset=dataset, epoch=epoch, rank=rank, world_size=world_size, **more)
        data = json.dumps(body, separators=(",", ":")).encode()
        assert len(data) <= 65536, name  # the daemon's frame limit
        out("request", name, data)

    def origin(world_size, num_workers=1, hosts=1, position=0, **more):
        return dict(hosts=hosts, world_size=world_size, num_workers=num_workers,
                    positions=[position] * num_workers, **more)

    req("web", rank=3, world_size=4, worker=1, num_workers=2, seed=7)
    req("files", dataset="files", op="plan", rank=1, world_size=2, num_workers=3, worker=2)
    req("books-wrapping", dataset="books", epoch=5, rank=1, world_size=2)
    req("resampled", dataset="resampled", epoch=1, rank=3, world_size=4, start=50)
    req("mix", dataset="mix", epoch=3, rank=1, world_size=2, num_workers=3, worker=2, start=10)
    req("elastic", rank=3, world_size=4, resume_from=origin(8, 2, hosts=2, position=5000))
    req("elastic-chain", rank=1, world_size=2,
        resume_from=origin(4, 2, hosts=4, position=300, **{"from": origin(2, 3, hosts=2, position=7000)}))
    req("elastic-mix", dataset="mix", epoch=2, rank=5, world_size=6, num_workers=2, worker=1,
        resume_from=origin(4, 2, hosts=2, position=20))
    # test_absurd_requests_are_served_or_refused_clearly_with_bounded_memory
    req("absurd-world", world_size=4_000_000_000)
    req("absurd-last-rank", world_size=4_000_000_000, rank=3_999_999_999)
    req("absurd-u32", world_size=u32, rank=u32 - 1, num_workers=u32, worker=u32 - 1)
    req("absurd-workers", num_workers=1_000_000, worker=999_999)
    req("absurd-epoch-seed", dataset="mix", epoch=u64, seed=u64)
    req("absurd-no-workers", num_workers=0)
    req("absurd-worker", worker=1_000_000, num_workers=1_000_000)
    # test_absurd_elastic_origins_are_refused_at_once_and_the_daemon_serves_on
    req("absurd-origin", resume_from=origin(4_000_000_000))
    req("absurd-origin-40m", resume_from=origin(40_000_000))
    req("absurd-origin-workers", resume_from=origin(1 << 16, num_workers=1 << 4))
    chain = origin(1)
    for _ in range(16):
        chain = origin(1, **{"from": chain})
    req("absurd-origin-chain", resume_from=chain)
    req("absurd-positions", resume_from=origin(2, 2, position=u64))
    # Just inside the bound (elastic::MAX_STREAMS over the new topology and every origin, times
    # a mix's sources: ~0.5 s and ~100 MB in a release build), and just past it.
    req("bound-origin", resume_from=origin(bound - 1))
    req("bound-past", resume_from=origin(bound))
    req("bound-mix", dataset="mix", resume_from=origin(bound // 3 - 1))
    req("bound-pair-past", dataset="pair", resume_from=origin(bound // 2))
    # The quadratic splits (fuzz/README.md, "Found so far"): many old hosts dealt to one new
    # one (709 s before), many new streams cut from one host's rest (26-31 s), a long chain.
    req("bound-old-hosts", resume_from=origin(bound - 1, hosts=bound - 1, position=1))
    req("bound-new-ranks", rank=bound // 2 - 1, world_size=bound // 2,
        resume_from=origin(bound // 2, hosts=2))
    chain = origin(bound // 16 - 1, position=1)
    for _ in range(15):
        chain = origin(bound // 16 - 1, position=1, **{"from": chain})
    req("bound-chain", resume_from=chain)
    # A schedule whose entries cut epoch 0 of the old topology (40,000 streams) into 401
    # segments, replayed for each of 10,000 old workers: the epoch's segments were copied per
    # worker (~1.4 GB).
    req("bound-mix-segments", dataset="timed", op="plan", resume_from=origin(4, num_workers=10_000))
    # Passes across resizes (history): a chain of 16 hops of 16,383 hosts each (just inside
    # the bound on hosts), an elastic resume under a history, a mix's sources, and past it.
    def hops(n, hosts, workers=1):
        return [dict(hosts=hosts, world_size=hosts, num_workers=workers, last_epoch=e) for e in range(n)]
    req("history", dataset="books", epoch=3, rank=1, world_size=2, history=hops(2, 4, 2))
    req("history-elastic", dataset="books", epoch=2, rank=0, world_size=1,
        resume_from=origin(4, 2, hosts=2, position=30), history=hops(2, 3))
    req("history-mix", dataset="mix", epoch=5, rank=1, world_size=3, history=hops(3, 2))
    req("bound-history", dataset="books", epoch=16, rank=0, world_size=1, history=hops(16, bound // 16 - 1))
    req("bound-history-past", dataset="books", epoch=16, rank=0, world_size=1, history=hops(16, bound // 16 + 1))
    # An elastic resume of 2^18 - 1 old hosts under a history: each old stream's plan built the
    # heads of every old host again (found in review; hours). Now once per plan. Without the
    # history, the same resume planned 50 million pieces (2.5 GB: 300 samples per stream over
    # host shares of 3): now refused past elastic's piece budget.
    req("bound-old-hosts-history", dataset="books", epoch=1, resume_from=origin(bound - 1, hosts=bound - 1, position=1),
        history=hops(1, 1))
    req("bound-old-hosts-wrapping", dataset="books", epoch=1, resume_from=origin(bound - 1, hosts=bound - 1, position=1))
    # A mix's origin was split before the request was checked: world_size 0 divided by zero.
    req("mix-world-zero", op="plan", dataset="pair", world_size=0, resume_from=origin(1))

if __name__ == "__main__":
    for d in HERE.iterdir():
        if d.is_dir():
            shutil.rmtree(d)
    frames(); batches(); tars(); braces(); configs(); manifests(); requests()
    for d in sorted(HERE.iterdir()):
        if d.is_dir():
            print(d.name, len(list(d.iterdir())), sum(f.stat().st_size for f in d.iterdir()))
