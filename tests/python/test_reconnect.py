"""A daemon restart is invisible to a reader: the client reconnects and resumes at its position
(proto/PROTOCOL.md, "Reconnecting"). Each case reads a whole stream through a restart and
compares it, sample by sample (key and bytes), with the same stream read without one.

The samples are 1 MiB each (48 of them): the daemon's socket send buffer (4 MiB) and the
client's receive buffer hold a few, so a stream of which the test has read 5 samples is still
being sent when the daemon dies, and the client is cut mid-stream for certain."""

import contextlib
import logging
import random
import re
import signal
import subprocess
import threading
import time

import pytest
import shardd
import webdataset as wds

from conftest import DEADLINE, SHARDD, wait_for

SHARDS, PER_SHARD, SAMPLE = 6, 8, 1 << 20
TOTAL = SHARDS * PER_SHARD


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Local shards written by webdataset.TarWriter, and their manifest (`shardd index`)."""
    root = tmp_path_factory.mktemp("reconnect")
    rng = random.Random(5)
    for s in range(SHARDS):
        with wds.TarWriter(str(root / f"r-{s}.tar")) as sink:
            for i in range(PER_SHARD):
                sink.write({"__key__": f"r{s}/{i:02d}", "bin": rng.randbytes(SAMPLE - rng.randint(0, 4096)),
                            "cls": str(i).encode()})
    pattern = f"{root}/r-{{0..{SHARDS - 1}}}.tar"
    manifest = root / "manifest.json"
    run = subprocess.run([SHARDD, "index", pattern, "-o", str(manifest)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return pattern, manifest


def config(data, shuffle_buffer=6):
    pattern, manifest = data
    return (
        "[host]\nindex = 0\ncount = 1\n"
        f'[datasets.exact]\nshards = "{pattern}"\nmanifest = "{manifest}"\nshuffle_buffer = {shuffle_buffer}\n'
        f'[datasets.plain]\nshards = "{pattern}"\nshuffle_buffer = {shuffle_buffer}\n'
    )


@pytest.fixture
def daemon(make_daemon, data):
    return make_daemon(config(data))


def content(sample):
    return sample["__key__"], sample["bin"], sample["cls"]


def uninterrupted(socket, dataset="exact", epoch=0, worker=0, num_workers=1):
    with shardd.Client(socket, reconnect_timeout=0) as c:
        got = [content(s) for s in c.stream(dataset, epoch=epoch, rank=0, world_size=1,
                                            worker=worker, num_workers=num_workers)]
    assert len(got) == TOTAL // num_workers
    return got


@contextlib.contextmanager
def meanwhile(condition, what, action):
    """Runs ``action`` on a thread once ``condition`` holds, while the body (blocked inside the
    client, reconnecting) runs; re-raises the thread's failure."""
    failure = []

    def run():
        try:
            wait_for(condition, what)
            action()
        except BaseException as e:
            failure.append(e)

    t = threading.Thread(target=run)
    t.start()
    try:
        yield
    finally:
        t.join(2 * DEADLINE)
        if failure:
            raise failure[0]


def warned(caplog):
    return lambda: any(r.levelno == logging.WARNING for r in caplog.records)


def shardd_log(caplog):
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "shardd"]


DESCRIBE = "dataset 'exact' epoch 0 rank 0 of 1, worker 0 of 1"


def assert_resumed(caplog, socket, cause, timeout):
    """One warning naming the socket and the cause, one line saying how the stream resumed;
    returns the sample it resumed at."""
    (level, warning), (level2, info) = shardd_log(caplog)
    assert level == "WARNING" and level2 == "INFO"
    m = re.fullmatch(rf"lost the shardd daemon at {re.escape(str(socket))} \({re.escape(cause)}\) at "
                     rf"sample (\d+) of {DESCRIBE}; reconnecting for up to {timeout} s "
                     rf"\(reconnect_timeout\)", warning)
    assert m, warning
    at = int(m[1])
    assert re.fullmatch(rf"resumed {DESCRIBE} at sample {at} on the shardd daemon at "
                        rf"{re.escape(str(socket))} after \d+\.\d\d s \(\d+ attempts\)", info), info
    assert 5 <= at < TOTAL, "the cut was meant to land mid-stream"
    return at


@pytest.mark.parametrize("eager", [False, True], ids=["caller", "read-ahead thread"])
def test_kill_9_and_restart_mid_stream(daemon, caplog, eager):
    """Read by the caller, or by the read-ahead thread (which then reconnects, and resumes
    after the samples it had received: the caller sees the same samples)."""
    want = uninterrupted(daemon.socket)
    caplog.set_level(logging.INFO, logger="shardd")
    with shardd.Client(daemon.socket, reconnect_timeout=30, eager_readahead=eager) as c:
        stream = c.stream("exact", epoch=0, rank=0, world_size=1)
        got = [content(next(stream)) for _ in range(5)]
        daemon.kill()  # leaves its socket file: connects are refused until the restart
        with meanwhile(warned(caplog), "the client to notice", daemon.start):
            got += [content(s) for s in stream]
    assert got == want
    assert stream.reconnects == 1 and stream.position == TOTAL
    assert_resumed(caplog, daemon.socket, "connection closed by the daemon", 30)


@pytest.mark.parametrize("eager", [False, True], ids=["caller", "read-ahead thread"])
def test_sigterm_and_the_daemon_back_later(daemon, caplog, eager):
    """SIGTERM: the stream ends with a `shutdown` ERROR, the socket file goes (connects fail
    with ENOENT) until the daemon is back."""
    want = uninterrupted(daemon.socket)
    caplog.set_level(logging.INFO, logger="shardd")

    def restart():
        assert daemon.proc.wait(timeout=DEADLINE) == 0
        assert not daemon.socket.exists()
        daemon.proc = None
        daemon.log.close()
        daemon.start()

    with shardd.Client(daemon.socket, reconnect_timeout=30, eager_readahead=eager) as c:
        stream = c.stream("exact", epoch=0, rank=0, world_size=1)
        got = [content(next(stream)) for _ in range(5)]
        daemon.proc.send_signal(signal.SIGTERM)
        with meanwhile(warned(caplog), "the client to notice", restart):
            got += [content(s) for s in stream]
    assert got == want
    assert stream.reconnects == 1
    assert_resumed(caplog, daemon.socket, "shutdown: the daemon is shutting down", 30)


def test_a_daemon_back_with_another_plan_is_an_error_naming_both(daemon, data):
    with shardd.Client(daemon.socket, reconnect_timeout=30) as c:
        stream = c.stream("exact", epoch=0, rank=0, world_size=1)
        before = stream.fingerprint
        for _ in range(5):
            next(stream)
        daemon.kill()
        daemon.config.write_text(daemon.config.read_text().replace("shuffle_buffer = 6", "shuffle_buffer = 7"))
        daemon.start()
        with pytest.raises(shardd.PlanChangedError) as e:
            list(stream)
        after = c.stream("exact", epoch=0, rank=0, world_size=1).fingerprint
    assert before != after and (e.value.old, e.value.new) == (before, after)
    at = re.search(r"from sample (\d+)", str(e.value))[1]
    assert str(e.value) == (
        f"the shardd daemon at {daemon.socket} came back with another plan for {DESCRIBE}: plan "
        f"fingerprint {before} before, {after} now. Its config (shards, manifest, host count or "
        f"dataset settings) changed, so the rest of the stream from sample {at} would be another "
        f"order: restore the config, or restart the epoch")
    assert isinstance(e.value, shardd.PlanMismatch) and isinstance(e.value, shardd.Error)


def test_a_request_error_is_raised_at_once(daemon):
    with shardd.Client(daemon.socket, reconnect_timeout=300) as c:
        began = time.monotonic()
        with pytest.raises(shardd.DaemonError) as e:
            c.stream("nope", epoch=0, rank=0, world_size=1)
        assert e.value.code == "unknown_dataset"
        assert str(e.value) == 'unknown dataset "nope"; this daemon serves: exact, plain'
        with pytest.raises(shardd.DaemonError) as e:
            c.stream("exact", epoch=0, rank=0, world_size=1, start=TOTAL + 1)
        assert e.value.code == "bad_request"
        assert time.monotonic() - began < 5  # 300 if retried


def test_reconnect_timeout_0_raises_at_once(daemon, tmp_path):
    with shardd.Client(daemon.socket, reconnect_timeout=0) as c:
        stream = c.stream("exact", epoch=0, rank=0, world_size=1)
        next(stream)
        daemon.kill()
        with pytest.raises(shardd.ConnectionLostError) as e:
            list(stream)
    assert str(e.value) == f"the shardd daemon at {daemon.socket} closed the connection mid-stream"
    assert isinstance(e.value, ConnectionError)
    assert 1 <= stream.position < TOTAL  # exact: a new stream from here resumes
    with pytest.raises(shardd.UnavailableError) as e:
        shardd.Client(daemon.socket, reconnect_timeout=0).stream("exact", epoch=0, rank=0, world_size=1)
    assert str(e.value) == f"no shardd daemon at {daemon.socket} (Connection refused)"


def test_a_daemon_that_never_comes_back_times_out(daemon, caplog):
    with shardd.Client(daemon.socket, reconnect_timeout=1) as c:
        stream = c.stream("exact", epoch=0, rank=0, world_size=1)
        next(stream)
        daemon.kill()
        began = time.monotonic()
        with pytest.raises(shardd.UnavailableError) as e:
            list(stream)
        waited = time.monotonic() - began
    assert 1 <= waited < 10, waited  # the timeout, and then at most an attempt on a busy machine
    m = re.fullmatch(
        rf"lost the shardd daemon at {re.escape(str(daemon.socket))} at sample (\d+) of {DESCRIBE} "
        rf"\(connection closed by the daemon\) and could not reconnect within reconnect_timeout = "
        rf"1 s \((\d+\.\d) s, (\d+) attempts\); last: Connection refused", str(e.value))
    assert m, str(e.value)
    assert 1.0 <= float(m[2]) and int(m[3]) >= 3  # backoff from 50 ms: several attempts within a second
    assert len(shardd_log(caplog)) == 1  # the outage's one warning


def test_opening_waits_for_a_restarting_daemon_and_names_the_socket(daemon, caplog, tmp_path):
    """A DataLoader worker that opens the next epoch's stream while the daemon restarts goes
    on; a wrong socket path is named in a warning at the first failure."""
    want = uninterrupted(daemon.socket)
    caplog.set_level(logging.INFO, logger="shardd")
    daemon.kill()
    with meanwhile(warned(caplog), "the client to warn", daemon.start):
        got = [content(s) for s in shardd.Client(daemon.socket, reconnect_timeout=30)
               .stream("exact", epoch=0, rank=0, world_size=1)]
    assert got == want
    (level, warning), (level2, info) = shardd_log(caplog)
    assert (level, warning) == ("WARNING", f"the shardd daemon at {daemon.socket} is not available "
                                           f"(Connection refused); retrying for up to 30 s (reconnect_timeout)")
    assert re.fullmatch(rf"opened {DESCRIBE} at sample 0 on the shardd daemon at "
                        rf"{re.escape(str(daemon.socket))} after \d+\.\d\d s \(\d+ attempts\)", info), info

    caplog.clear()
    wrong = tmp_path / "wrong.sock"
    with pytest.raises(shardd.UnavailableError) as e:
        shardd.Client(wrong, reconnect_timeout=0.5).stream("exact", epoch=0, rank=0, world_size=1)
    assert shardd_log(caplog) == [("WARNING", f"the shardd daemon at {wrong} is not available (No "
                                              f"such file or directory); retrying for up to 0.5 s "
                                              f"(reconnect_timeout)")]
    # No socket ever seen there: a first connection, which names the causes (the shorter
    # reconnect_timeout bounds it here; test_first_connection.py has first_connect_timeout).
    assert re.match(rf"no shardd daemon at {re.escape(str(wrong))}: no socket file there after "
                    rf"\d+\.\d s \(reconnect_timeout = 0\.5 s, \d+ attempts\)\. Likely causes: ",
                    str(e.value)), str(e.value)
    assert "its config's server.socket: pass that path to shardd.Client" in str(e.value)


def test_busy_is_waited_out(make_daemon, data, caplog):
    d = make_daemon(config(data), server="max_connections = 1")
    want = uninterrupted(d.socket)
    c = shardd.Client(d.socket, reconnect_timeout=30)
    holder = c.stream("exact", epoch=0, rank=0, world_size=1)
    next(holder)
    caplog.clear()  # the holder may have waited for the previous connection's slot
    with meanwhile(warned(caplog), "the client to warn", holder.close):
        got = [content(s) for s in c.stream("exact", epoch=0, rank=0, world_size=1)]
    assert got == want
    assert shardd_log(caplog)[0] == (
        "WARNING", f"the shardd daemon at {d.socket} is not available (busy: the daemon already "
                   f"serves server.max_connections = 1 connections); retrying for up to 30 s "
                   f"(reconnect_timeout)")


# -- under torch's DataLoaders -------------------------------------------------------------------


def collate(batch):
    return [content(s) for s in batch]


def loader_order(per_worker, batch_size):
    """What a DataLoader yields from per-worker streams: batch i from worker i mod K."""
    batches = [[s[i:i + batch_size] for i in range(0, len(s), batch_size)] for s in per_worker]
    return [b[j] for j in range(max(map(len, batches))) for b in batches if j < len(b)]


@pytest.mark.parametrize("stateful", [False, True], ids=["DataLoader", "StatefulDataLoader"])
def test_kill_9_under_a_2_worker_loader(daemon, stateful):
    """Both workers are mid-stream when the daemon dies (each has read at most 4 batches of 2
    of its 24 MiB): each reconnects to the restarted daemon and resumes. With the
    StatefulDataLoader, a state taken after the restart resumes exactly too."""
    torch_data = pytest.importorskip("torch.utils.data")
    import shardd.torch as st
    from torchdata.stateful_dataloader import StatefulDataLoader

    want = loader_order([uninterrupted(daemon.socket, worker=w, num_workers=2) for w in range(2)], 2)
    cls = StatefulDataLoader if stateful else torch_data.DataLoader

    def loader():
        # No next epoch opened ahead: its first frames would count in samples_sent below.
        ds = st.ShardDataset("exact", socket=daemon.socket, reconnect_timeout=30,
                             prefetch_next_epoch=False)
        return cls(ds, batch_size=2, num_workers=2, collate_fn=collate)

    first = loader()
    it = iter(first)
    got = [next(it) for _ in range(3)]
    daemon.kill()
    daemon.start()
    got += [next(it) for _ in range(4)]
    state = first.state_dict() if stateful else None
    got += list(it)
    assert got == want
    # The restarted daemon served the rest of both streams: each worker reconnected once.
    # (The daemon counts a stream's outcome after its END.)
    wait_for(lambda: daemon.metric('shardd_streams_total{dataset="exact",outcome="completed"}') == 2,
             "both streams to be counted completed")
    assert 0 < daemon.metric('shardd_samples_sent_total{dataset="exact"}') <= TOTAL - 6
    if stateful:
        again = loader()
        again.load_state_dict(state)
        assert list(again) == want[7:]
