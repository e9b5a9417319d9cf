"""Zero-copy delivery (protocol 5): the daemon passes each shard's committed cache file once
as a descriptor, batches carry (map, offset, length), and the client hands out read-only
memoryviews of its mapping. Same samples, same order, same bytes as the socket path."""

import json
import pickle
import random
import signal
import socket
import struct
import subprocess
import sys
import threading

import pytest
import shardd
import webdataset as wds

from conftest import ROOT, as_bytes, bytes_on_disk, compiled_decoder, error_frame, index, raw_exchange, reference_samples, wait_for
from test_versions import OldDaemon

SHARDS, PER_SHARD, SAMPLE = 6, 8, 100_000


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("zerocopy")
    rng = random.Random(7)
    for s in range(SHARDS):
        with wds.TarWriter(str(root / f"z-{s}.tar")) as sink:
            for i in range(PER_SHARD):
                sink.write({"__key__": f"z{s}/{i:02d}", "bin": rng.randbytes(SAMPLE - rng.randint(0, 4096)),
                            "cls": str(i).encode()})
    return root


@pytest.fixture(scope="module")
def reference(data):
    """webdataset's own reading of the z shards: {key: {field: bytes}}, the oracle."""
    return reference_samples(sorted(data.glob("z-*.tar")))


def assert_webdataset_samples(samples, reference, whole=True):
    """Every sample byte-equal to webdataset's (memoryviews compared by their bytes) and, for
    a whole epoch of the one-rank stream, every key of the shards exactly once."""
    keys = [s["__key__"] for s in samples]
    if whole:
        assert sorted(keys) == sorted(reference), "not webdataset's key set, each key once"
    for s in samples:
        assert {k: bytes(v) for k, v in s.items() if not k.startswith("__")} == reference[s["__key__"]], s["__key__"]


def config(data, train_paths, shuffle_buffer=4):
    shards = ", ".join(f'"{p}"' for p in train_paths)
    return (
        f'[datasets.z]\nshards = "{data}/z-{{0..{SHARDS - 1}}}.tar"\nshuffle_buffer = {shuffle_buffer}\n'
        f"[datasets.train]\nshards = [{shards}]\nshuffle_buffer = 20\n"
    )


@pytest.fixture
def daemon(make_daemon, data, train_paths):
    return make_daemon(config(data, train_paths))


def read(socket_path, dataset, zero_copy, **kw):
    with shardd.Client(socket_path, zero_copy=zero_copy) as c:
        stream = c.stream(dataset, epoch=kw.pop("epoch", 0), rank=0, world_size=1, **kw)
        return list(stream), stream


def test_same_samples_as_the_socket_path_and_webdataset(daemon, data, train_paths):
    for dataset, paths in [("z", sorted(data.glob("z-*.tar"))), ("train", train_paths)]:
        plain, s1 = read(daemon.socket, dataset, False)
        mapped, s2 = read(daemon.socket, dataset, True)
        assert s1.start_fields.get("zero_copy") is None
        assert s2.start_fields["zero_copy"] is True
        assert [s["__key__"] for s in mapped] == [s["__key__"] for s in plain]
        for a, b in zip(plain, mapped):
            assert a.keys() == b.keys()
            for k in a:
                assert bytes(b[k]) == a[k] if isinstance(b[k], memoryview) else b[k] == a[k]
        views = [v for s in mapped for v in s.values() if isinstance(v, memoryview)]
        assert views, "large fields come as memoryviews"
        assert all(v.readonly for v in views)
        assert all(len(v) > 4096 for v in views), "small fields stay bytes"
        want = reference_samples(paths)
        got = {s["__key__"]: {k: bytes(v) for k, v in s.items() if not k.startswith("__")}
               for s in mapped}
        assert got == want


@pytest.mark.parametrize("zero_copy", [False, True], ids=["socket", "zero_copy"])
def test_the_compiled_and_the_python_decoder_read_the_same_stream(daemon, zero_copy, monkeypatch):
    """The wheel's client decodes with the compiled decoder; without it (the client-only
    distribution) the client decodes in Python: the same samples, of the same types."""
    from shardd import _decode

    for dataset in ("z", "train"):
        with monkeypatch.context() as m:
            m.setattr(_decode, "_compiled", _decode._load(compiled_decoder()))
            compiled, _ = read(daemon.socket, dataset, zero_copy)
        with monkeypatch.context() as m:
            m.setattr(_decode, "_compiled", None)
            python, _ = read(daemon.socket, dataset, zero_copy)
        assert len(python) == len(compiled) > 0
        for a, b in zip(compiled, python):
            assert {k: type(v) for k, v in a.items()} == {k: type(v) for k, v in b.items()}
            assert as_bytes(a) == as_bytes(b)


def batches(socket_path, dataset, zero_copy):
    """One epoch's samples as the frames they came in (``rest_of_batch``)."""
    with shardd.Client(socket_path, zero_copy=zero_copy, readahead=0) as c:
        stream = c.stream(dataset, epoch=0, rank=0, world_size=1)
        out = []
        for first in stream:
            out.append([first] + stream.rest_of_batch())
        return out


def test_a_zero_copy_frame_takes_up_to_4_mib_of_samples_a_socket_frame_1_mib(make_daemon, data,
                                                                            train_paths):
    """A MAPPED_BATCH carries a few words per mapped field, so the daemon cuts it at 4 MiB of
    payload: 100 KB samples were 10 to a frame, each frame a receive and a decode. (Frames
    also end where the next sample's shuffle window is not loaded yet.)"""
    daemon = make_daemon(config(data, train_paths, shuffle_buffer=SHARDS * PER_SHARD))

    def payload(batch):
        return sum(len(s["__key__"].encode()) + sum(len(v) for k, v in s.items()
                                                    if not k.startswith("__")) for s in batch)

    plain, mapped = batches(daemon.socket, "z", False), batches(daemon.socket, "z", True)
    assert [s["__key__"] for b in mapped for s in b] == [s["__key__"] for b in plain for s in b]
    assert max(payload(b) for b in plain) <= 1 << 20
    assert 1 << 20 < max(payload(b) for b in mapped) <= 4 << 20
    assert len(mapped) < len(plain)


@pytest.fixture
def held_open(make_daemon, data, train_paths):
    """A daemon whose zero-copy streams cannot run ahead to their end: with 2 maps, a reader
    that holds its samples gets the later shards inline, which fill the socket. (With maps
    to spare a stream is a few KB of descriptors: the daemon sends all of it, END, and frees
    its maps at once, before a test could see them held.)"""
    return make_daemon(config(data, train_paths), server="zero_copy_maps = 2")


def test_release_frees_maps_and_the_stream_end_frees_all(held_open, reference):
    """With 2 maps, a third shard can be mapped only after a RELEASE freed a map: a daemon
    that ignored RELEASE would map the first 2 shards and send every later one inline."""
    daemon = held_open
    with shardd.Client(daemon.socket, zero_copy=True, readahead=0) as c:
        stream = c.stream("z", epoch=0, rank=0, world_size=1)
        # Every view held until a sample comes inline: a third shard found both maps taken.
        held = [next(stream)]
        while isinstance(held[-1]["bin"], memoryview):
            held.append(next(stream))
        mapped = {s["__url__"] for s in held if isinstance(s["bin"], memoryview)}
        assert len(mapped) == 2
        wait_for(lambda: daemon.metric("shardd_zero_copy_maps") == 2, "both maps held")
        got = [as_bytes(s) for s in held]
        del held
        # Read on, each sample dropped at once: the client RELEASEs the retired maps, and the
        # samples the daemon decides after that (all but about two batches') are mapped again.
        for s in stream:
            mapped |= {s["__url__"]} if isinstance(s["bin"], memoryview) else set()
            got.append(as_bytes(s))
            del s
            assert daemon.metric("shardd_zero_copy_maps") <= 2
        assert stream.reconnects == 0
    assert len(mapped) > 2, f"only {sorted(mapped)} mapped: no map was released and reused"
    assert_webdataset_samples(got, reference)
    wait_for(lambda: daemon.metric("shardd_zero_copy_maps") == 0, "every map freed")


HOLDER = """
import sys, shardd
c = shardd.Client(sys.argv[1], zero_copy=True, readahead=0)
s = c.stream("z", epoch=0, rank=0, world_size=1)
held = [next(s) for _ in range(20)]
print(sum(isinstance(v, memoryview) for x in held for v in x.values()), flush=True)
sys.stdin.read()
"""


def test_a_client_killed_while_holding_maps_frees_them(held_open):
    daemon = held_open
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(daemon.socket)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={"PYTHONPATH": str(ROOT / "clients" / "python")})
    try:
        assert int(proc.stdout.readline()) > 0
        wait_for(lambda: daemon.metric("shardd_zero_copy_maps") >= 1, "maps held")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        wait_for(lambda: daemon.metric("shardd_zero_copy_maps") == 0, "the maps freed")
        wait_for(lambda: daemon.metric("shardd_cache_pinned_bytes") == 0, "no pins")
    finally:
        proc.kill()
        proc.wait()


def test_maps_are_bounded_and_the_budget_kept_while_a_reader_holds_everything(make_daemon, data, train_paths,
                                                                              reference):
    # Room for 6 shards: 2 maps and the stream's working set; never more on disk.
    budget = 6 * (PER_SHARD * SAMPLE + 20_000)
    d = make_daemon(config(data, train_paths, shuffle_buffer=2), server="zero_copy_maps = 2",
                    cache=f"max_size = \"{budget}\"\nprefetch_shards = 1")
    plain, _ = read(d.socket, "z", False)
    held = []
    with shardd.Client(d.socket, zero_copy=True) as c:
        for s in c.stream("z", epoch=0, rank=0, world_size=1):
            held.append(s)  # never released while the stream runs
            assert d.metric("shardd_zero_copy_maps") <= 2
            assert bytes_on_disk(d.dir / "cache") <= budget
    assert [s["__key__"] for s in held] == [s["__key__"] for s in plain]
    assert_webdataset_samples(held, reference)
    kinds = {type(s["bin"]) for s in held}
    assert kinds == {memoryview, bytes}, "mapped while maps were free, then inline"


def test_kill_9_and_restart_mid_stream(daemon, reference):
    want, _ = read(daemon.socket, "z", False)
    with shardd.Client(daemon.socket, zero_copy=True, reconnect_timeout=30) as c:
        stream = c.stream("z", epoch=0, rank=0, world_size=1)
        got = [next(stream) for _ in range(5)]
        daemon.kill()
        daemon.start()
        got += list(stream)
    assert stream.reconnects == 1
    assert [s["__key__"] for s in got] == [s["__key__"] for s in want]
    # Memoryviews of the first connection stay valid: their mappings hold the files.
    assert [bytes(s["bin"]) for s in got] == [s["bin"] for s in want]
    assert_webdataset_samples(got, reference)


def raw_zero_copy_stream(daemon, after):
    """A zero-copy stream request on a plain socket, followed at once by the bytes `after`
    (in the socket before the stream starts: the daemon reads them while it serves)."""
    request = json.dumps({"op": "stream", "dataset": "z", "epoch": 0, "rank": 0,
                          "world_size": 1, "zero_copy": True}).encode()
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(30)
    s.connect(str(daemon.socket))
    s.sendall(b"SHARDD\x05\x00" + struct.pack("<IB", len(request), 1) + request + after)
    return s


def read_until_closed(s):
    try:
        while s.recv(65536):
            pass
    except ConnectionResetError:
        pass  # closed with our bytes unread: closed all the same


def test_a_hostile_release_closes_only_its_connection(daemon):
    ok = []
    other = threading.Thread(target=lambda: ok.append(len(read(daemon.socket, "z", True)[0])))
    # A RELEASE of a map it never got: its connection is closed.
    with raw_zero_copy_stream(daemon, struct.pack("<IBI", 4, 9, 12345)) as s:
        other.start()
        assert s.recv(8, socket.MSG_WAITALL) == b"SHARDD\x07\x00"  # the daemon's version
        read_until_closed(s)
        other.join(60)
        assert ok == [SHARDS * PER_SHARD]
    wait_for(lambda: "RELEASE of map 12345, which this connection does not hold" in daemon.log_path.read_text(),
             "the daemon to log why it closed the connection")
    wait_for(lambda: daemon.metric("shardd_zero_copy_maps") == 0, "every map freed")


def test_garbage_after_the_request_closes_the_connection(daemon):
    with raw_zero_copy_stream(daemon, b"GET / HTTP/1.1\r\n\r\n") as s:
        read_until_closed(s)
    wait_for(lambda: "zero-copy client broke the protocol" in daemon.log_path.read_text(),
             "the daemon to log why it closed the connection")


def test_zero_copy_off_in_the_config_is_the_socket_path(make_daemon, data, train_paths, reference):
    d = make_daemon(config(data, train_paths), server="zero_copy_maps = 0")
    got, stream = read(d.socket, "z", True)
    assert stream.start_fields["zero_copy"] is False
    assert all(isinstance(s["bin"], bytes) for s in got)
    plain, _ = read(d.socket, "z", False)
    assert [(s["__key__"], s["bin"]) for s in got] == [(s["__key__"], s["bin"]) for s in plain]
    assert_webdataset_samples(got, reference)


def test_an_older_daemon_gets_the_socket_path(tmp_path):
    old = OldDaemon(tmp_path / "old.sock")
    try:
        with shardd.Client(old.path, zero_copy=True) as c:
            stream = c.stream("train", epoch=0, rank=0, world_size=1)
            assert list(stream) == [] and stream.peer_version == 2
        assert old.preambles == [b"SHARDD\x05\x00", b"SHARDD\x02\x00"]
    finally:
        old.close()


def test_a_forked_child_cannot_read_a_zero_copy_stream(daemon):
    import os

    with shardd.Client(daemon.socket, zero_copy=True) as c:
        stream = c.stream("z", epoch=0, rank=0, world_size=1)
        first = next(stream)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                for _ in range(PER_SHARD * SHARDS):
                    next(stream)
            except shardd.ForkedStreamError:
                code = 0 if len(first["bin"]) > 0 else 2
            except BaseException:
                code = 3
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        rest = list(stream)
    assert len(rest) == SHARDS * PER_SHARD - 1


def test_a_failed_mmap_falls_back_to_the_socket_path(daemon, monkeypatch, reference):
    want, _ = read(daemon.socket, "z", False)
    calls = []

    def refuse(*a, **kw):
        calls.append(a)
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(shardd.client.mmap, "mmap", refuse)
    got, stream = read(daemon.socket, "z", True)
    assert calls and stream.reconnects == 1
    assert all(isinstance(s["bin"], bytes) for s in got)
    assert [(s["__key__"], s["bin"]) for s in got] == [(s["__key__"], s["bin"]) for s in want]
    assert_webdataset_samples(got, reference)


def test_the_daemon_refuses_zero_copy_below_protocol_5(daemon):
    request = json.dumps({"op": "stream", "dataset": "z", "epoch": 0, "rank": 0,
                          "world_size": 1, "zero_copy": True}).encode()
    err = error_frame(raw_exchange(daemon.socket, b"SHARDD\x04\x00"
                                   + struct.pack("<IB", len(request), 1) + request))
    assert err == {"code": "bad_request",
                   "message": "zero_copy needs protocol 5; the client said it speaks 4"}


def test_a_mix_zero_copy_equals_its_socket_path(make_daemon, data, train_paths, reference):
    pattern = f"{data}/z-{{0..{SHARDS - 1}}}.tar"
    m = index(pattern, data / "z.manifest.json")
    sources = "".join(f'[datasets.{n}]\nshards = "{pattern}"\nmanifest = "{m}"\nshuffle_buffer = 5\n'
                      for n in ["za", "zb"])
    d = make_daemon(sources + "[datasets.both]\nmix = { za = 3, zb = 1 }\nsamples_per_epoch = 40\n")
    plain, _ = read(d.socket, "both", False)
    mapped, s = read(d.socket, "both", True)
    assert s.start_fields["zero_copy"] is True and len(mapped) == 40
    assert [x["__source__"] for x in mapped] == [x["__source__"] for x in plain]
    assert all(isinstance(x["__source__"], str) for x in mapped)
    assert [as_bytes(x) for x in mapped] == plain
    assert {x["__source__"] for x in mapped} == {"za", "zb"}
    assert_webdataset_samples(mapped, reference, whole=False)  # 40 of the 48, from both sources


def test_a_paused_zero_copy_reader_is_parked_and_goes_on(make_daemon, data, train_paths, reference):
    # One map: most pieces go inline, so the socket fills and the paused reader is parked
    # mid-frame; the cut frame is sent again byte for byte (same map ids) after the pause.
    d = make_daemon(config(data, train_paths, shuffle_buffer=2),
                    server='stall_timeout = "1s"\nzero_copy_maps = 1')
    want, _ = read(d.socket, "z", False)
    with shardd.Client(d.socket, zero_copy=True) as c:
        stream = c.stream("z", epoch=0, rank=0, world_size=1)
        got = [next(stream)]
        wait_for(lambda: d.metric("shardd_stream_parks_total") >= 1, "the stream to park")
        got += list(stream)
    assert [(s["__key__"], bytes(s["bin"])) for s in got] == [(s["__key__"], s["bin"]) for s in want]
    assert {type(s["bin"]) for s in got} == {memoryview, bytes}
    assert_webdataset_samples(got, reference)


def test_releases_after_the_daemon_finished_sending_cost_no_reconnect(daemon, reference, caplog):
    """Descriptors are small: the daemon sends a whole zero-copy stream, END and closes while
    the reader is still early in it. The reader's RELEASEs then meet a closed socket (EPIPE):
    the stream reads on what is buffered, with no reconnect (and no warning)."""
    want = [s["__key__"] for s in read(daemon.socket, "z", False)[0]]
    with shardd.Client(daemon.socket, zero_copy=True) as c:
        stream = c.stream("z", epoch=0, rank=0, world_size=1)
        # The daemon counts a stream when it has sent its END, and its connections gauge
        # falls once it has closed the socket (both after START, which stream() waited for).
        wait_for(lambda: daemon.metric('shardd_streams_total{dataset="z",outcome="completed"}') == 2
                 and daemon.metric("shardd_connections_active") == 0,
                 "the daemon to finish sending and close")
        got = []
        for s in stream:  # each sample dropped: its maps released
            got.append(as_bytes(s))
    assert [s["__key__"] for s in got] == want
    assert_webdataset_samples(got, reference)
    assert stream.reconnects == 0 and not [r for r in caplog.records if r.levelname == "WARNING"]


def test_a_failed_mmap_falls_back_even_with_reconnecting_off(daemon, monkeypatch, reference):
    """The fallback is not a reconnect to a lost daemon: reconnect_timeout=0 does not stop it.
    The first shard maps, the second does not: the stream goes on over the socket from there."""
    want, _ = read(daemon.socket, "z", False)
    real, calls = shardd.client.mmap.mmap, []

    def second_refused(*a, **kw):
        calls.append(a)
        if len(calls) > 1:
            raise OSError(12, "Cannot allocate memory")
        return real(*a, **kw)

    monkeypatch.setattr(shardd.client.mmap, "mmap", second_refused)
    with shardd.Client(daemon.socket, zero_copy=True, reconnect_timeout=0) as c:
        stream = c.stream("z", epoch=0, rank=0, world_size=1)
        got = list(stream)
    assert len(calls) == 2 and stream.start_fields["zero_copy"] is True
    kinds = [type(s["bin"]) for s in got]
    assert kinds[0] is memoryview and kinds[-1] is bytes, "mapped, then over the socket"
    assert [(s["__key__"], bytes(s["bin"])) for s in got] == [(s["__key__"], s["bin"]) for s in want]
    assert_webdataset_samples(got, reference)


AT_THE_FD_LIMIT = """
import logging, os, pickle, resource, sys, shardd
logging.basicConfig(stream=sys.stderr, level=logging.WARNING)

def still_open(fd):
    try:
        return os.fstat(fd) is not None
    except OSError:
        return False  # the listing's own descriptor, closed since

fds = [int(f) for f in os.listdir("/proc/self/fd")]
fds = sorted(f for f in fds if still_open(f))
assert fds == list(range(len(fds))), fds
# Room for the stream's socket (descriptor len(fds)) and nothing more: the kernel cannot
# install the MAP frame's descriptor, drops it and sets MSG_CTRUNC.
resource.setrlimit(resource.RLIMIT_NOFILE, (len(fds) + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
c = shardd.Client(sys.argv[1], zero_copy=True, reconnect_timeout=0)
s = c.stream("z", epoch=0, rank=0, world_size=1)
got = [{k: bytes(v) if isinstance(v, memoryview) else v for k, v in x.items()} for x in s]
c.close()
pickle.dump((s.start_fields["zero_copy"], got), sys.stdout.buffer)
"""


def test_a_descriptor_dropped_at_the_fd_limit_falls_back_to_the_socket_path(daemon, reference):
    """A trainer at its RLIMIT_NOFILE: the kernel drops the MAP frame's descriptor (MSG_CTRUNC).
    The stream reads on over the socket, with a warning naming the limit. In a subprocess, so
    that this process's limit is untouched."""
    want, _ = read(daemon.socket, "z", False)
    proc = subprocess.run([sys.executable, "-c", AT_THE_FD_LIMIT, str(daemon.socket)],
                          capture_output=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT / "clients" / "python")})
    err = proc.stderr.decode()
    assert proc.returncode == 0, err
    zero_copy, got = pickle.loads(proc.stdout)
    assert zero_copy is True, "START said zero copy: the descriptor was dropped"
    assert "RLIMIT_NOFILE" in err and "MSG_CTRUNC" in err, err
    assert [(s["__key__"], s["bin"]) for s in got] == [(s["__key__"], s["bin"]) for s in want]
    assert_webdataset_samples(got, reference)


def test_a_map_frame_without_a_descriptor_is_a_protocol_error(tmp_path):
    """No descriptor and no MSG_CTRUNC: the daemon broke the protocol (not a fallback)."""
    path = str(tmp_path / "nofd.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen()

    def serve():
        conn, _ = server.accept()
        with conn:
            conn.recv(8, socket.MSG_WAITALL)
            length, _ = struct.unpack("<IB", conn.recv(5, socket.MSG_WAITALL))
            conn.recv(length, socket.MSG_WAITALL)
            start = json.dumps({"dataset": "z", "shards": 1, "host": 0, "hosts": 1, "samples": None,
                                "position": 0, "dropped": 0, "fingerprint": "00ff",
                                "zero_copy": True}).encode()
            conn.sendall(b"SHARDD\x05\x00" + struct.pack("<IB", len(start), 2) + start
                         + struct.pack("<IBIQ", 12, 6, 1, 4096))  # a MAP, no SCM_RIGHTS
            conn.recv(1)  # until the client hangs up

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        with shardd.Client(path, zero_copy=True, reconnect_timeout=30) as c:
            stream = c.stream("z", epoch=0, rank=0, world_size=1)
            with pytest.raises(shardd.ProtocolError, match="without its descriptor"):
                next(stream)
        t.join(30)
        assert not t.is_alive()
    finally:
        server.close()
