"""Verification that costs little and covers every object: a download's CRC-32C is computed as
it is written and checked against the store's own (GCS reports one for every object, composite
ones included), or the manifest's; an S3 ETag is used as an MD5 only where S3 says it is one.

The faults the real servers never make (a flipped byte, a composite object's headers, the
non-MD5 ETag S3 gives an object under SSE-KMS) come from a loopback proxy that edits answers
of fake-gcs-server and moto; the checksums the tests expect come from those servers."""

import json
import os
import random
import socket
import socketserver
import subprocess
import threading
import urllib.parse
import urllib.request

import pytest
import shardd

from conftest import BUCKET, S3_CREDENTIALS_BOTO, S3_ENV, SHARDD, recv_head, tar_of, upload


class EditingProxy:
    """A loopback HTTP proxy in front of fake-gcs-server or moto that edits the answers for
    object paths containing ``match``: flips one byte in the body of the first ``flips`` GETs
    (-1: all), replaces the ETag with ``etag`` (and maps it back in If-Match, so the real
    server still matches), drops the MD5 from x-goog-hash (``drop_md5``)."""

    def __init__(self, upstream, match, flips=0, etag=None, drop_md5=False):
        upstream_port = int(upstream.rsplit(":", 1)[1])
        self.match, self.flips_left, self.etag, self.drop_md5 = match.encode(), flips, etag, drop_md5
        self.real_etag = None
        self.flipped = 0
        self.lock = threading.Lock()
        proxy = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                head = recv_head(self.request)
                if head is None:
                    return
                request_head, rest = head.split(b"\r\n\r\n", 1)
                lines = [
                    l for l in request_head.split(b"\r\n")
                    if not l.lower().startswith((b"connection:", b"host:"))
                ]
                target = urllib.parse.unquote_to_bytes(lines[0])
                ours = proxy.match in target
                if ours and proxy.etag and proxy.real_etag:
                    lines = [
                        l.replace(proxy.etag.encode(), proxy.real_etag) if l.lower().startswith(b"if-match:") else l
                        for l in lines
                    ]
                host = f"Host: 127.0.0.1:{upstream_port}".encode()
                request = b"\r\n".join(lines[:1] + [host, b"Connection: close"] + lines[1:]) + b"\r\n\r\n" + rest
                with socket.create_connection(("127.0.0.1", upstream_port)) as up:
                    up.sendall(request)
                    response = b""
                    while chunk := up.recv(1 << 20):
                        response += chunk
                if ours:
                    response = proxy.edit(target, response)
                self.request.sendall(response)

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def edit(self, target, response):
        head, body = response.split(b"\r\n\r\n", 1)
        lines = head.split(b"\r\n")
        out = [lines[0]]
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            if name.lower() == b"etag" and self.etag:
                with self.lock:
                    self.real_etag = self.real_etag or value.strip()
                line = b"ETag: " + self.etag.encode()
            if name.lower() == b"x-goog-hash" and self.drop_md5:
                kept = [v for v in value.strip().split(b",") if not v.startswith(b"md5=")]
                line = b"X-Goog-Hash: " + b",".join(kept)
            out.append(line)
        status = lines[0].split(b" ")[1]
        if target.startswith(b"GET") and status in (b"200", b"206") and body:
            with self.lock:
                flip = self.flips_left != 0
                self.flips_left -= flip and self.flips_left > 0
                self.flipped += flip
            if flip:
                body = bytearray(body)
                body[len(body) // 2] ^= 0x01
                body = bytes(body)
        return b"\r\n".join(out) + b"\r\n\r\n" + body

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def editing_proxy():
    proxies = []

    def make(upstream, match, **kw):
        p = EditingProxy(upstream, match, **kw)
        proxies.append(p)
        return p

    yield make
    for p in proxies:
        p.close()


def sample(name, size=200_000):
    return {"__key__": name, "bin": random.Random(name).randbytes(size)}


def read_all(d, dataset):
    with shardd.Client(d.socket) as c:
        return [s for s in c.stream(dataset, epoch=0, rank=0, world_size=1)]


def gcs_crc32c(endpoint, name):
    """The CRC-32C fake-gcs-server reports for an object (JSON API, base64 as GCS writes it)."""
    url = f"{endpoint}/storage/v1/b/{BUCKET}/o/{urllib.parse.quote(name, safe='')}"
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)["crc32c"]


def flipped(data):
    """``data`` with the byte the proxy flips (the middle of a one-part body) flipped."""
    raw = bytearray(data)
    raw[len(raw) // 2] ^= 0x01
    return bytes(raw)


def daemon_for(make_daemon, section, url, extra="", env=None, name="shardd", dataset=""):
    return make_daemon(
        section + extra + f'[datasets.v]\nshards = "{url}"\nshuffle_buffer = 1\n{dataset}', env=env, name=name
    )


def gcs_section(proxy):
    return f'[gcs]\nendpoint = "{proxy.endpoint}"\nanonymous = true\n'


def test_a_corrupted_download_is_refused_and_fetched_again(make_daemon, fake_gcs, editing_proxy):
    s = sample("c1")
    upload(fake_gcs, "verify/c1.tar", tar_of([s]))
    proxy = editing_proxy(fake_gcs, "verify/c1.tar", flips=1)
    d = daemon_for(make_daemon, gcs_section(proxy), f"gs://{BUCKET}/verify/c1.tar")
    got = read_all(d, "v")
    assert [x["bin"] for x in got] == [s["bin"]]
    assert proxy.flipped == 1
    assert d.metric("shardd_cache_verify_failures_total") == 1
    assert d.metric('shardd_store_requests_total{kind="get"}') == 2


def test_a_download_that_never_matches_fails_naming_the_shard_and_both_checksums(
    make_daemon, fake_gcs, editing_proxy
):
    data = tar_of([sample("c2")])
    upload(fake_gcs, "verify/c2.tar", data)
    upload(fake_gcs, "verify/c2-flipped.tar", flipped(data))  # the server computes its CRC-32C
    want, got = gcs_crc32c(fake_gcs, "verify/c2.tar"), gcs_crc32c(fake_gcs, "verify/c2-flipped.tar")
    proxy = editing_proxy(fake_gcs, "verify/c2.tar", flips=-1)
    d = daemon_for(make_daemon, gcs_section(proxy), f"gs://{BUCKET}/verify/c2.tar")
    with pytest.raises(shardd.DaemonError) as e:
        read_all(d, "v")
    assert str(e.value) == (
        f"gs://{BUCKET}/verify/c2.tar: checksum mismatch: the store says CRC-32C {want}, "
        f"the {len(data)} bytes received have CRC-32C {got}"
    )
    assert proxy.flipped == 2, "refused, fetched once more, refused again"
    assert d.metric("shardd_cache_verify_failures_total") == 2
    assert list((d.dir / "cache" / "entries").iterdir()) == [], "nothing unverified kept"


def test_a_composite_object_without_an_md5_is_verified_by_crc32c(make_daemon, fake_gcs, editing_proxy):
    """A composite object (fake-gcs-server's compose) as real GCS presents one: x-goog-hash
    with a CRC-32C only, and an ETag that is no MD5. Its corrupted first download is refused
    (the previous build checked only its size and served the corrupted bytes)."""
    parts = [sample("p0"), sample("p1")]
    whole = tar_of(parts)
    cut = len(whole) // 2
    upload(fake_gcs, "verify/part-0", whole[:cut])
    upload(fake_gcs, "verify/part-1", whole[cut:])
    compose = urllib.request.Request(
        f"{fake_gcs}/storage/v1/b/{BUCKET}/o/{urllib.parse.quote('verify/composite.tar', safe='')}/compose",
        data=json.dumps({"sourceObjects": [{"name": "verify/part-0"}, {"name": "verify/part-1"}]}).encode(),
        method="POST", headers={"Content-Type": "application/json"},
    )
    urllib.request.urlopen(compose, timeout=10).close()
    proxy = editing_proxy(fake_gcs, "verify/composite.tar", flips=1, etag='"CPjlmrqS2uoCEAE="', drop_md5=True)
    d = daemon_for(make_daemon, gcs_section(proxy), f"gs://{BUCKET}/verify/composite.tar",
                   extra='[store]\npart_size = "1MiB"\n')
    got = read_all(d, "v")
    assert sorted(x["bin"] for x in got) == sorted(p["bin"] for p in parts)
    assert proxy.flipped == 1
    assert d.metric("shardd_cache_verify_failures_total") == 1


@pytest.fixture
def s3(s3_endpoint):
    import boto3

    return boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1", **S3_CREDENTIALS_BOTO)


FAKE_ETAG = '"0f343b0931126a20f133d67c2b018a3b"'  # 32 hex digits, and no MD5 of these bytes


def s3_section(proxy, verify=None):
    store = f'verify = "{verify}"\n' if verify else ""
    return f'[s3]\nendpoint = "{proxy.endpoint}"\nregion = "us-east-1"\n[store]\n{store}'


def test_an_s3_object_under_sse_kms_is_readable(make_daemon, s3_endpoint, s3, editing_proxy):
    """Under SSE-KMS, S3 gives an object a 32-hex ETag that is not its MD5 (moto keeps the
    MD5, so the proxy puts such an ETag in its answers, as S3 does; moto's own answers carry
    x-amz-server-side-encryption: aws:kms). The previous build took it for an MD5, refused
    every download twice and could not read the dataset."""
    s = sample("kms")
    s3.put_object(Bucket="bkt3", Key="verify/kms.tar", Body=tar_of([s]),
                  ServerSideEncryption="aws:kms", SSEKMSKeyId="alias/shardd-test")
    proxy = editing_proxy(s3_endpoint, "verify/kms.tar", etag=FAKE_ETAG)
    d = daemon_for(make_daemon, s3_section(proxy), "s3://bkt3/verify/kms.tar", env=S3_ENV)
    assert [x["bin"] for x in read_all(d, "v")] == [s["bin"]]
    assert d.metric("shardd_cache_verify_failures_total") == 0
    # verify = "checksum": nothing vouches for these bytes, so they are refused.
    d2 = daemon_for(make_daemon, s3_section(proxy, "checksum"), "s3://bkt3/verify/kms.tar",
                    env=S3_ENV, name="strict")
    with pytest.raises(shardd.DaemonError) as e:
        read_all(d2, "v")
    assert str(e.value) == (
        's3://bkt3/verify/kms.tar: no checksum to verify the download against (store.verify = '
        '"checksum"): the store reports none for this object and no manifest records one'
    )


def test_an_s3_etag_that_is_an_md5_is_checked(make_daemon, s3_endpoint, s3, editing_proxy):
    """Without SSE-KMS or SSE-C, a one-part upload's ETag is its MD5, and the daemon holds
    the bytes to it: the same lying ETag is refused, naming both MD5s; verify = "size" reads
    it."""
    import hashlib

    data = tar_of([sample("plain")])
    s3.put_object(Bucket="bkt3", Key="verify/plain.tar", Body=data)
    proxy = editing_proxy(s3_endpoint, "verify/plain.tar", etag=FAKE_ETAG)
    d = daemon_for(make_daemon, s3_section(proxy), "s3://bkt3/verify/plain.tar", env=S3_ENV)
    with pytest.raises(shardd.DaemonError) as e:
        read_all(d, "v")
    assert str(e.value) == (
        f"s3://bkt3/verify/plain.tar: checksum mismatch: the store says MD5 {FAKE_ETAG.strip(chr(34))}, "
        f"the {len(data)} bytes received hash to {hashlib.md5(data).hexdigest()}"
    )
    assert d.metric("shardd_cache_verify_failures_total") == 2
    d2 = daemon_for(make_daemon, s3_section(proxy, "size"), "s3://bkt3/verify/plain.tar",
                    env=S3_ENV, name="size")
    assert len(read_all(d2, "v")) == 1


def test_a_multipart_s3_upload_is_verified_by_the_manifest(make_daemon, s3_endpoint, s3, editing_proxy, tmp_path):
    """A multipart upload (ETag `…-2`) has no MD5; `shardd index` recorded its CRC-32C, which
    a download of the same version is checked against."""
    from boto3.s3.transfer import TransferConfig

    samples = [sample(f"mp{i}", 3_000_000) for i in range(3)]
    src = tmp_path / "mp.tar"
    src.write_bytes(tar_of(samples))
    s3.upload_file(str(src), "bkt3", "verify/mp.tar",
                   Config=TransferConfig(multipart_threshold=5 << 20, multipart_chunksize=5 << 20))
    assert s3.head_object(Bucket="bkt3", Key="verify/mp.tar")["ETag"].endswith('-2"')
    manifest = tmp_path / "mp.manifest.json"
    config = tmp_path / "index.toml"
    config.write_text(f'[s3]\nendpoint = "{s3_endpoint}"\nregion = "us-east-1"\n')
    env = {**os.environ, **S3_ENV}
    out = subprocess.run([SHARDD, "index", "s3://bkt3/verify/mp.tar", "-o", str(manifest), "--config", str(config)],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    proxy = editing_proxy(s3_endpoint, "verify/mp.tar", flips=1)
    d = daemon_for(make_daemon, s3_section(proxy), "s3://bkt3/verify/mp.tar",
                   extra='part_size = "4MiB"\n', env=S3_ENV, dataset=f'manifest = "{manifest}"\n')
    got = read_all(d, "v")
    assert sorted(x["bin"] for x in got) == sorted(s["bin"] for s in samples)
    assert proxy.flipped == 1
    assert d.metric("shardd_cache_verify_failures_total") == 1
