"""One version for the crate, the binary and the Python package; and a handshake in which each
side says clearly when the other is too old for a feature its request needs."""

import json
import pathlib
import re
import socket
import struct
import subprocess
import threading
import tomllib

import pytest

import shardd
import shardd.client
from conftest import ROOT, SHARDD, error_frame, raw_exchange


def crate_version():
    return tomllib.loads((ROOT / "Cargo.toml").read_text())["package"]["version"]


def test_crate_binary_and_python_package_versions_agree():
    version = crate_version()
    out = subprocess.run([SHARDD, "--version"], capture_output=True, text=True, check=True)
    assert out.stdout == f"shardd {version}\n"
    assert shardd.__version__ == version
    client_only = tomllib.loads((ROOT / "clients/python/pyproject.toml").read_text())
    assert client_only["project"]["version"] == version
    # The wheel takes its version from Cargo.toml (maturin), never from a copy.
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert root["project"]["dynamic"] == ["version"] and "version" not in root["project"]


class OldDaemon:
    """A peer speaking a daemon's side of protocol 2, the version before op "plan": no such
    daemon binary is built here, so this plays its handshake (preamble, then START and END of
    an empty stream, or the ERROR a version-2 daemon sends a client newer than itself)."""

    def __init__(self, path):
        self.path = str(path)
        self.preambles = []
        self.server = socket.socket(socket.AF_UNIX)
        self.server.bind(self.path)
        self.server.listen()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self):
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            with conn:
                try:
                    self.answer(conn)
                except OSError:  # the client hung up first: it read all it needed
                    pass

    def answer(self, conn):
        preamble = conn.recv(8, socket.MSG_WAITALL)
        self.preambles.append(preamble)
        conn.sendall(b"SHARDD" + struct.pack("<H", 2))
        length, kind = struct.unpack("<IB", conn.recv(5, socket.MSG_WAITALL))
        request = json.loads(conn.recv(length, socket.MSG_WAITALL))
        version = struct.unpack_from("<H", preamble, 6)[0]
        if version > 2:
            frames = [(5, {"code": "unsupported_version", "message":
                           f"client speaks protocol {version}; this daemon speaks 1 to 2"})]
        else:
            frames = [(2, {"dataset": request["dataset"], "shards": 0, "host": 0,
                           "hosts": 1, "samples": 0, "position": request["start"],
                           "dropped": 0, "fingerprint": "00ff"}),
                      (4, {"samples": 0, "bytes": 0})]
        for kind, body in frames:
            data = json.dumps(body).encode()
            conn.sendall(struct.pack("<IB", len(data), kind) + data)

    def close(self):
        self.server.close()


@pytest.fixture
def old_daemon(tmp_path):
    d = OldDaemon(tmp_path / "old.sock")
    yield d
    d.close()


def test_client_names_a_daemon_too_old_for_op_plan(old_daemon):
    client = shardd.Client(old_daemon.path)
    with pytest.raises(shardd.VersionError) as e:
        client.plan("train", epoch=0, rank=0, world_size=1)
    assert str(e.value) == (
        f'the shardd daemon at {old_daemon.path} speaks protocol 2, too old for op "plan" (a '
        f"stream's length and plan fingerprint without opening it), which needs protocol 3 "
        f"(this client, shardd {shardd.__version__}, speaks {shardd.client.VERSION}): upgrade "
        f"the daemon")
    assert (e.value.daemon, e.value.needed) == (2, 3)
    assert isinstance(e.value, shardd.Error)
    # Streams need only protocol 2: the same old daemon serves them.
    stream = client.stream("train", epoch=0, rank=0, world_size=1, start=0)
    assert list(stream) == [] and stream.peer_version == 2 and stream.end == {"samples": 0, "bytes": 0}
    # An elastic resume needs protocol 4: named too, before anything is read.
    origin = {"hosts": 1, "world_size": 2, "num_workers": 1, "positions": [5]}
    with pytest.raises(shardd.VersionError, match=r"speaks protocol 2, too old for the request "
                       r"field resume_from \(an elastic resume\), which needs protocol 4"):
        client.stream("train", epoch=0, rank=0, world_size=1, resume_from=origin)
    assert old_daemon.preambles == [b"SHARDD\x03\x00", b"SHARDD\x02\x00", b"SHARDD\x04\x00"]


@pytest.fixture
def daemon(make_daemon, train_paths):
    shards = ", ".join(f'"{p}"' for p in train_paths)
    return make_daemon(f"[datasets.train]\nshards = [{shards}]\n")


def test_daemon_names_a_client_too_old_or_too_new(daemon):
    request = json.dumps({"op": "plan", "dataset": "train", "epoch": 0, "rank": 0,
                          "world_size": 1}).encode()
    frame = struct.pack("<IB", len(request), 1) + request
    err = error_frame(raw_exchange(daemon.socket, b"SHARDD\x02\x00" + frame))
    assert err == {"code": "bad_request",
                   "message": 'op "plan" needs protocol 3; the client said it speaks 2'}
    elastic = json.dumps({"op": "stream", "dataset": "train", "epoch": 0, "rank": 0,
                          "world_size": 1, "resume_from": {"hosts": 1, "world_size": 1,
                                                           "num_workers": 1, "positions": [1]}})
    err = error_frame(raw_exchange(daemon.socket, b"SHARDD\x03\x00" + struct.pack(
        "<IB", len(elastic), 1) + elastic.encode()))
    assert err == {"code": "bad_request",
                   "message": "resume_from needs protocol 4; the client said it speaks 3"}
    get = json.dumps({"op": "get", "url": "/no/such.tar"}).encode()
    err = error_frame(raw_exchange(daemon.socket, b"SHARDD\x05\x00" + struct.pack("<IB", len(get), 1) + get))
    assert err == {"code": "bad_request",
                   "message": 'op "get" needs protocol 6; the client said it speaks 5'}
    resized = json.dumps({"op": "plan", "dataset": "train", "epoch": 1, "rank": 0, "world_size": 1,
                          "history": [{"hosts": 1, "world_size": 2, "num_workers": 1,
                                       "last_epoch": 0}]}).encode()
    err = error_frame(raw_exchange(daemon.socket, b"SHARDD\x06\x00" + struct.pack(
        "<IB", len(resized), 1) + resized))
    assert err == {"code": "bad_request",
                   "message": "history needs protocol 7; the client said it speaks 6"}
    err = error_frame(raw_exchange(daemon.socket, b"SHARDD\x08\x00" + frame))
    assert err == {"code": "unsupported_version", "message":
                   f"client speaks protocol 8; this daemon speaks 1 to 7 (shardd "
                   f"{crate_version()}): upgrade the daemon"}
    # The same plan request at protocol 3 is served.
    with shardd.Client(daemon.socket) as c:
        assert c.plan("train", epoch=0, rank=0, world_size=1)["dataset"] == "train"
