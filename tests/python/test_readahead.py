"""The client's read-ahead thread and its next-epoch stream opened ahead, against a real daemon
(and, for a daemon that sends nothing, a fake one on a real socket)."""

import functools
import gc
import json
import os
import socket
import struct
import threading
import time
import types
import weakref

import pytest
import shardd
import shardd._readahead
from shardd._readahead import READAHEAD, ZERO_COPY_WAITS, ReadingAhead
from shardd.client import KIND_START, PREAMBLE

from conftest import BIG_SAMPLE, BIG_SHARDS, as_bytes, gcs_config, wait_for

# Every client here reads epoch after epoch, as shardd.torch's and shardd.grain's do.
Client = functools.partial(shardd.Client, prefetch_next_epoch=True)


def fields(samples):
    return [(s["__key__"], s["__url__"], sorted((k, v) for k, v in s.items()
                                               if not k.startswith("__"))) for s in samples]


def read(socket_path, epoch=0, dataset="train", **kw):
    with shardd.Client(socket_path, readahead=0) as c:
        return list(c.stream(dataset, epoch=epoch, rank=0, world_size=1, **kw))


def opened(d, dataset="train"):
    """Streams of ``dataset`` the daemon has sent a first sample on. The series exists from
    the daemon's start (a renamed one fails here rather than reading 0)."""
    return d.metric(f'shardd_first_sample_seconds_count{{dataset="{dataset}"}}')


def ended(d, outcome, dataset="train", scrape=None):
    return d.metric(f'shardd_streams_total{{dataset="{dataset}",outcome="{outcome}"}}', scrape)


def test_read_ahead_yields_the_socket_paths_samples_and_counts_only_what_was_yielded(make_daemon, fake_gcs):
    d = make_daemon(gcs_config(fake_gcs))
    want = read(d.socket, seed=3)
    assert len(want) > 100
    with Client(d.socket, eager_readahead=True) as c:
        s = c.stream("train", epoch=0, rank=0, world_size=1, seed=3)
        got = [next(s)]
        # The thread receives ahead of the caller (here the whole epoch, ~1 MB, and its END);
        # the position counts what was yielded.
        wait_for(lambda: not s._thread.is_alive(), "the thread to receive the whole stream")
        assert s.position == 1
        got += [next(s) for _ in range(9)]
        assert s.position == 10
        got += list(s)
        assert s.position == len(want)
        assert s.end["samples"] == len(want)
    assert fields(got) == fields(want)
    # Resuming at a position taken mid-stream with read-ahead gives exactly the rest.
    with Client(d.socket, eager_readahead=True) as c:
        s = c.stream("train", epoch=0, rank=0, world_size=1, seed=3)
        head = [next(s) for _ in range(37)]
        wait_for(lambda: not s._thread.is_alive(), "the thread to receive the whole stream")
        at = s.position
        s.close()
        rest = list(c.stream("train", epoch=0, rank=0, world_size=1, seed=3, start=at))
    assert at == 37 and fields(head + rest) == fields(want)


def test_the_queue_holds_at_most_its_bound_plus_one_batch(make_daemon, fake_gcs):
    """8 MiB samples, one per batch, a 1-byte bound: the thread holds one batch and stops
    (the daemon ends up blocked on the client) instead of receiving the whole stream."""
    d = make_daemon(gcs_config(fake_gcs))
    with Client(d.socket, readahead=1, eager_readahead=True) as c:
        s = c.stream("big", epoch=0, rank=0, world_size=1)
        first = next(s)
        wait_for(lambda: s.readahead_bytes[0] > 0, "the thread to receive the next batch")
        wait_for(lambda: [x["waiting_on"] for x in d.status()["streams"]] == ["client"],
                 "the daemon to wait for the client")
        queued, peak = s.readahead_bytes
        assert BIG_SAMPLE < queued == peak < 2 * BIG_SAMPLE
        rest = list(s)
        assert s.readahead_bytes[1] == peak
    assert len([first] + rest) == BIG_SHARDS
    # A larger bound: still never more than the bound plus the batch that crossed it.
    with Client(d.socket, readahead=3 * BIG_SAMPLE, eager_readahead=True) as c:
        s = c.stream("big", epoch=0, rank=0, world_size=1)
        next(s)
        wait_for(lambda: s.readahead_bytes[0] >= 3 * BIG_SAMPLE, "the queue to fill")
        wait_for(lambda: [x["waiting_on"] for x in d.status()["streams"]] == ["client"],
                 "the daemon to wait for the client")
        queued, peak = s.readahead_bytes
        assert 3 * BIG_SAMPLE <= peak < 4 * BIG_SAMPLE + (1 << 20)
        assert len(list(s)) == BIG_SHARDS - 1


def test_a_trainer_paused_past_the_stall_timeout_gets_the_same_samples(make_daemon, fake_gcs):
    d = make_daemon(gcs_config(fake_gcs), server='stall_timeout = "1s"')
    want = read(d.socket, dataset="big")
    with Client(d.socket, readahead=1, eager_readahead=True) as c:
        s = c.stream("big", epoch=0, rank=0, world_size=1)
        first = next(s)
        assert s._thread is not None
        wait_for(lambda: d.metric("shardd_streams_parked") == 1, "the stream to park")
        assert s.position == 1
        rest = list(s)
    assert d.metric("shardd_stream_parks_total") >= 1
    assert [(x["__key__"], x["bin"]) for x in [first] + rest] == [(x["__key__"], x["bin"]) for x in want]


class SilentDaemon:
    """Answers a request with a START and then sends nothing (a daemon waiting for data)."""

    def __init__(self, path):
        self.path = path
        self.srv = socket.socket(socket.AF_UNIX)
        self.srv.bind(path)
        self.srv.listen(8)
        self.conns = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.srv.accept()
            except OSError:
                return
            self.conns.append(conn)
            start = json.dumps({"dataset": "train", "shards": 1, "samples": None, "position": 0,
                                "fingerprint": "f"}).encode()
            conn.sendall(PREAMBLE + struct.pack("<IB", len(start), KIND_START) + start)

    def close(self):
        self.srv.close()
        for c in self.conns:
            c.close()


def test_close_while_the_thread_waits_on_the_socket_returns_at_once(tmp_path):
    daemon = SilentDaemon(str(tmp_path / "silent.sock"))
    try:
        c = Client(daemon.path, reconnect_timeout=30, eager_readahead=True)
        s = c.stream("train", epoch=0, rank=0, world_size=1)
        thread = s._thread
        assert thread.is_alive()
        waiter = threading.Thread(target=lambda: next(s, None), daemon=True)
        waiter.start()  # a caller blocked in next() too
        wait_for(lambda: daemon.conns, "the connection")
        began = time.monotonic()
        c.close()
        assert time.monotonic() - began < 4.0  # at once: not the 5 s it would wait for a thread
        assert not thread.is_alive()
        assert s._frames.sock is None
        waiter.join(4.0)
        assert not waiter.is_alive()
        assert next(s, "over") == "over"
    finally:
        daemon.close()


def test_a_dropped_stream_is_collected_and_its_connection_closed(make_daemon, fake_gcs):
    d = make_daemon(gcs_config(fake_gcs))
    c = Client(d.socket, readahead=1, eager_readahead=True)
    s = c.stream("big", epoch=0, rank=0, world_size=1)
    next(s)
    wait_for(lambda: s.readahead_bytes[0] > 0, "the thread to fill its queue")
    thread, ref = s._thread, weakref.ref(s)
    del s
    gc.collect()
    wait_for(lambda: ref() is None, "the stream to be collected")
    thread.join(5)
    assert not thread.is_alive()
    wait_for(lambda: d.metric("shardd_streams_active") == 0, "the daemon to see the stream go")
    assert ended(d, "cancelled", "big") == 1


def streams(d, dataset="big"):
    """Streams of ``dataset`` the daemon has opened: ended (any outcome) or active, from one
    scrape (the daemon counts a stream active from before its START until its outcome is
    counted)."""
    scrape = d.metrics()
    return (ended(d, "completed", dataset, scrape) + ended(d, "cancelled", dataset, scrape)
            + ended(d, "failed", dataset, scrape) + d.metric("shardd_streams_active", scrape))


@pytest.mark.parametrize("eager", [False, True], ids=["drained", "thread"])
def test_the_next_epoch_is_opened_ahead_and_taken_by_stream(make_daemon, fake_gcs, eager):
    """8 MiB samples: the stream opened ahead is not read until it is taken (the daemon fills
    its first window and its socket), so it is either taken or cancelled, never completed on
    its own."""
    d = make_daemon(gcs_config(fake_gcs))
    want = [read(d.socket, epoch=e, dataset="big", seed=5) for e in range(3)]
    assert streams(d) == 3 and fields(want[0]) != fields(want[1])
    with Client(d.socket, readahead=1, eager_readahead=eager) as c:
        for e in range(3):
            s = c.stream("big", epoch=e, rank=0, world_size=1, seed=5)
            got = list(s)
            assert fields(got) == fields(want[e]) and s.position == BIG_SHARDS
            # Once epoch e was received, epoch e + 1 is opened ahead (one stream only).
            wait_for(lambda: d.metric("shardd_streams_active") == 1 and len(c._spec) == 1,
                     f"epoch {e + 1} to be opened ahead")
            assert streams(d) == 3 + e + 2
        assert ended(d, "completed", "big") == 3 + 3
        assert list(c._spec) == [("big", 0, 1, 0, 1, 5)]
    # The unclaimed one (epoch 3) was closed with the client.
    wait_for(lambda: d.metric("shardd_streams_active") == 0, "the stream opened ahead to close")
    assert ended(d, "cancelled", "big") == 1 and streams(d) == 3 + 4


def test_a_next_epoch_opened_ahead_is_not_used_for_another_request(make_daemon, fake_gcs):
    d = make_daemon(gcs_config(fake_gcs))
    want = read(d.socket, epoch=1, dataset="big")
    with Client(d.socket, readahead=1) as c:
        list(c.stream("big", epoch=0, rank=0, world_size=1))
        # Opened ahead (the client holds it, so the daemon counts it) and epoch 0 counted ended.
        wait_for(lambda: d.metric("shardd_streams_active") == 1 and len(c._spec) == 1,
                 "epoch 1 to be opened ahead")
        assert streams(d) == 3
        # Epoch 1 from sample 2 is another request: the stream opened ahead is closed and a
        # new one reads exactly the rest.
        got = list(c.stream("big", epoch=1, rank=0, world_size=1, start=2))
        assert fields(got) == fields(want[2:])
        wait_for(lambda: ended(d, "cancelled", "big") == 1, "the stream opened ahead to be closed")
        wait_for(lambda: d.metric("shardd_streams_active") == 1 and len(c._spec) == 1,
                 "epoch 2 to be opened ahead")
        assert streams(d) == 5
        # Another slot (seed 9) leaves that one alone.
        list(c.stream("big", epoch=0, rank=0, world_size=1, seed=9))
        wait_for(lambda: d.metric("shardd_streams_active") == 2 and len(c._spec) == 2,
                 "epoch 1 of seed 9 to be opened ahead")
        assert sorted(c._spec) == [("big", 0, 1, 0, 1, 0), ("big", 0, 1, 0, 1, 9)]
        assert ended(d, "cancelled", "big") == 1 and streams(d) == 7
    wait_for(lambda: d.metric("shardd_streams_active") == 0, "every stream to close")
    assert ended(d, "cancelled", "big") == 3


def test_without_read_ahead_nothing_runs_in_the_background(make_daemon, fake_gcs):
    d = make_daemon(gcs_config(fake_gcs))
    with Client(d.socket, readahead=0) as c:
        s = c.stream("train", epoch=0, rank=0, world_size=1)
        assert s._thread is None
        n = len(list(s))
    assert opened(d) == 1 and n > 0


def test_the_thread_starts_when_the_caller_works_between_batches(make_daemon, fake_gcs):
    """A caller that spends at least a batch's receive time on a batch gets the thread from
    the next batch, and the same samples as one that drains the stream. (That a draining
    caller keeps reading on its own thread is pinned on a scripted clock below: here a
    preemption between two batches could start the thread.)"""
    d = make_daemon(gcs_config(fake_gcs))
    want = read(d.socket, dataset="big")
    with Client(d.socket) as c:
        s = c.stream("big", epoch=0, rank=0, world_size=1)
        drained = list(s)
        s = c.stream("big", epoch=0, rank=0, world_size=1, seed=0, start=0)
        got = [next(s)]
        assert s._thread is None and s._took > 0
        time.sleep(s._took)  # the trainer's work on the batch (one sample here)
        got.append(next(s))
        assert s._thread is not None and s.position == 2
        got += list(s)
    assert [x["__key__"] for x in drained] == [x["__key__"] for x in want]
    assert fields(got) == fields(want)


def test_the_threads_errors_come_after_the_samples_before_them(tmp_path):
    """A daemon that sends two samples then an ERROR: the caller gets both samples, then the
    DaemonError, with or without the thread."""
    from test_errors import FAKE, PREAMBLE as P2, START, FakeDaemon, batch_frame, json_frame

    def two_then_error(fake_daemon, conn):
        fake_daemon.read_request(conn)
        conn.sendall(P2 + json_frame(2, START) + batch_frame(FAKE[:1]) + batch_frame(FAKE[1:2])
                     + json_frame(5, {"code": "bad_shard", "message": "boom"}))

    f = FakeDaemon(tmp_path / "fake.sock", two_then_error, two_then_error)
    try:
        outcomes = []
        for kw in [dict(readahead=0), dict(eager_readahead=True)]:
            got = []
            s = Client(f.path, reconnect_timeout=0, **kw).stream(
                "fake", epoch=0, rank=0, world_size=1)
            with pytest.raises(shardd.DaemonError) as e:
                for x in s:
                    got.append((x["__key__"], x["bin"]))
            outcomes.append((got, e.value.code, str(e.value), s.position))
        assert outcomes[0] == outcomes[1]
        assert outcomes[0] == ([("k0", FAKE[0][1]["bin"]), ("k1", FAKE[1][1]["bin"])], "bad_shard",
                               "boom", 2)
    finally:
        f.close()


def test_a_timeout_keeps_its_meaning_with_the_thread(tmp_path):
    """Client(timeout=): the daemon sent nothing for that long -> StreamTimeoutError, from the
    thread to the caller."""
    daemon = SilentDaemon(str(tmp_path / "silent.sock"))
    try:
        # 1 s: the handshake is under the same timeout, answered by a thread of this process.
        with Client(daemon.path, timeout=1.0, eager_readahead=True) as c:
            began = time.monotonic()  # the thread's wait starts inside stream()
            s = c.stream("train", epoch=0, rank=0, world_size=1)
            with pytest.raises(shardd.StreamTimeoutError, match="sent nothing for 1 s"):
                next(s)
            assert 1.0 <= time.monotonic() - began < 10
            assert next(s, "over") == "over"
    finally:
        daemon.close()


def test_shardd_torch_takes_the_next_epoch_opened_ahead(make_daemon, fake_gcs):
    """ShardDataset keeps its client: after epoch 0, epoch 1's stream was opened ahead and the
    next iteration takes it (the daemon opens one stream per epoch, and the samples are those
    of a fresh stream)."""
    torch_ds = pytest.importorskip("shardd.torch")
    d = make_daemon(gcs_config(fake_gcs))
    want = [[x["__key__"] for x in read(d.socket, epoch=e, dataset="big")] for e in range(2)]
    ds = torch_ds.ShardDataset("big", socket=d.socket, rank=0, world_size=1)
    got = []
    for e in range(2):
        ds.set_epoch(e)
        got.append([x["__key__"] for x in ds])
        # Held by the dataset's client (so the daemon counts it), and epoch e counted ended.
        wait_for(lambda: d.metric("shardd_streams_active") == 1 and len(ds._client()._spec) == 1,
                 f"epoch {e + 1} opened ahead")
    assert got == want
    assert streams(d) == 2 + 3  # the two reference reads; epochs 0, 1 and 2 (ahead)


class ScriptedReads(ReadingAhead):
    """``ReadingAhead``'s decision on its own: each batch's read takes and waits in the kernel
    the seconds the script says, on a clock the test moves (no real time, no daemon)."""

    def __init__(self, clock, zero_copy, script):
        self._init_readahead(readahead=READAHEAD, prefetch=None, speculative=False)
        self._frames = types.SimpleNamespace(
            zero_copy=types.SimpleNamespace(waited=0.0) if zero_copy else None)
        self.reconnects = 0
        self._clock, self._script, self.threaded_from = clock, iter(script), None

    def _fetch(self):
        took, waited = next(self._script)
        self._clock.now += took
        if self._frames.zero_copy is not None:
            self._frames.zero_copy.waited += waited
        return ["batch"]

    def _start_thread(self):
        self._queue = "started"

    def _take_batch(self):
        return self._fetch()


def thread_from(monkeypatch, zero_copy, work, script):
    """The batch (1-based) from which the stream reads on a thread, or None: the caller works
    ``work`` seconds between batches; ``script`` is each read's (seconds, seconds waited)."""
    clock = types.SimpleNamespace(now=100.0)
    monkeypatch.setattr(shardd._readahead, "time",
                        types.SimpleNamespace(perf_counter=lambda: clock.now))
    s = ScriptedReads(clock, zero_copy, script)
    for n in range(1, len(script) + 1):
        if s._queue is None:
            s._read_here()
            if s._queue is not None:
                return n
        else:
            s._take_batch()
        clock.now += work
    return None


WINDOW = (0.5, 0.5)  # the first read: the daemon fills the stream's shuffle window


def test_a_zero_copy_stream_whose_reads_do_not_wait_keeps_them_on_the_callers_thread(
        monkeypatch):
    """A zero-copy batch is decoded under the GIL, so a thread could only take turns with the
    caller: reads that do not wait for the daemon stay on the caller's thread however long
    the caller works between batches, and the first read (the shuffle window) does not
    count. Reads that mostly wait, ZERO_COPY_WAITS in all, get the thread once the caller
    works as long as a read takes; the socket path needs only the latter."""
    warm = [WINDOW] + [(0.0002, 0.00002)] * 40
    assert thread_from(monkeypatch, True, work=0.01, script=warm) is None
    assert thread_from(monkeypatch, True, work=10.0, script=warm) is None
    waiting = [WINDOW] + [(0.02, 0.019)] * 40  # 57 ms waited after 3 reads
    assert thread_from(monkeypatch, True, work=0.03, script=waiting) == 5
    assert thread_from(monkeypatch, True, work=0.01, script=waiting) is None  # works less
    # More than half waiting is enough; the reads so far decide (a cold stretch after warm
    # reads gets the thread once its waits outweigh them).
    assert thread_from(monkeypatch, True, work=0.2,
                       script=[WINDOW] + [(0.1, 0.06)] * 40) == 3
    assert thread_from(monkeypatch, True, work=0.2,
                       script=[WINDOW] + [(0.1, 0.04)] * 40) is None
    assert thread_from(monkeypatch, True, work=0.05,
                       script=[WINDOW] + [(0.001, 0.0)] * 9 + [(0.04, 0.04)] * 30) == 13
    # A few ms waited while the daemon was descheduled (a busy host), early in the stream
    # where it outweighs the reads so far: not worth a thread for the rest of the stream.
    hiccup = [WINDOW] + [(0.0002, 0.00002)] * 2 + [(0.03, 0.03)] + [(0.0002, 0.00002)] * 37
    assert thread_from(monkeypatch, True, work=0.05, script=hiccup) is None
    assert ZERO_COPY_WAITS == 0.05
    assert thread_from(monkeypatch, False, work=0.0002, script=warm) == 3  # the socket path
    assert thread_from(monkeypatch, False, work=0.0001, script=warm) is None


def test_a_zero_copy_stream_reads_the_same_samples_whichever_thread_reads_it(
        make_daemon, fake_gcs):
    """From a warm cache, with a caller that works between batches: the same samples as a
    plain read, and a thread only if the stream's reads had mostly waited for the daemon (on
    a busy machine a descheduled daemon can make them; the rule itself is pinned above)."""
    d = make_daemon(gcs_config(fake_gcs))
    want = read(d.socket)  # and the cache is warm

    with Client(d.socket, zero_copy=True) as c:
        s = c.stream("train", epoch=0, rank=0, world_size=1)
        got = []
        for x in s:
            got.append(as_bytes(x))  # lets go of its maps, as a trainer's collate does
            time.sleep(0.0005)  # the trainer's work: a batch's is far longer than its read
        assert s._frames.zero_copy is not None
        took, waited = s._reads  # as they were when the thread, if any, took over
        assert s._thread is None or waited >= took / 2, (took, waited)
    assert fields(got) == fields(want)


def test_a_zero_copy_stream_whose_reads_wait_for_the_daemon_gets_the_thread(
        make_daemon, cutting_proxy, fake_gcs):
    """The other side: a cold daemon whose store holds every shard but the stream's first for a
    second, so the stream's second read waits for the daemon; a caller that then works as long
    as that read took gets the thread from its next batch, as on the socket path. (A store
    paced at ~0.2 s a shard was not enough: a debug daemon on a busy machine could still be
    committing the first shard when the second was in, and the second read did not wait; nor
    one that answered one GET and held the rest: the daemon sometimes asks for the stream's
    second shard first.)"""
    # The stream's first shard: the same plan on another daemon (one sample read).
    with shardd.Client(make_daemon(gcs_config(fake_gcs), name="plan").socket) as c:
        first = next(iter(c.stream("big", epoch=0, rank=0, world_size=1)))["__url__"]
    first = first.split("://", 1)[1].split("/", 1)[1].encode()  # big/big-N.tar
    slow = cutting_proxy(hold=lambda target: b"/big/" in target and first not in target)
    # A download slot for every shard: the daemon may ask for the second before the first,
    # and a held download must not keep the first waiting.
    d = make_daemon(gcs_config(slow.endpoint, extra=f"[store]\nmax_downloads = {BIG_SHARDS}\n"))
    opens = threading.Timer(1.0, slow.release.set)  # the store's slowness, not a wait on the test
    with Client(d.socket, zero_copy=True) as c:
        s = c.stream("big", epoch=0, rank=0, world_size=1)
        got = [next(s)["__key__"]]
        opens.start()
        got.append(next(s)["__key__"])
        assert s._frames.zero_copy is not None and s._thread is None
        assert s._took < float("inf")  # the read waited: a thread can overlap that
        time.sleep(s._took)  # the trainer's work on the batch
        got.append(next(s)["__key__"])
        assert s._thread is not None
        got += [x["__key__"] for x in s]
    assert len(set(got)) == len(got) == BIG_SHARDS


def test_zero_copy_read_ahead_counts_the_bytes_it_maps(make_daemon, fake_gcs):
    """A zero-copy batch is a few bytes per field on the socket but hands out whole mapped
    fields (and keeps their shards pinned): read-ahead bounded by frame bytes took in the
    rest of the stream at once. It counts mapped bytes, so it stops at the bound as the
    socket path does: never more than the bound plus the batch that crossed it."""
    d = make_daemon(gcs_config(fake_gcs))
    with Client(d.socket, readahead=3 * BIG_SAMPLE, eager_readahead=True, zero_copy=True) as c:
        s = c.stream("big", epoch=0, rank=0, world_size=1)
        first = next(s)
        assert isinstance(first["bin"], memoryview)
        wait_for(lambda: s.readahead_bytes[0] >= 3 * BIG_SAMPLE, "the queue to fill")
        rest = list(s)
        peak = s.readahead_bytes[1]
    assert 3 * BIG_SAMPLE <= peak < 4 * BIG_SAMPLE + (1 << 20)
    assert len([first] + rest) == BIG_SHARDS
