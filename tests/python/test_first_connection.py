"""A first connection that finds no daemon fails fast (issue 35): a client that never reached
a daemon and finds no socket file at its path gives up after ``first_connect_timeout``
(default 5 s) with an error naming the path, the daemon's ``server.socket`` and the likely
causes, instead of waiting ``reconnect_timeout`` (300 s). A socket that is there but refuses
(a daemon restarting, a stale file), a socket gone once the client was served (a restart),
and a systemd unit that is starting keep ``reconnect_timeout``. Permission denied fails at
once, with a message of its own.

Real client, real sockets, the real daemon; the one stand-in is a `systemctl` script for the
systemd case (no systemd here)."""

import errno
import grp
import json
import logging
import os
import pwd
import shutil
import socket
import stat
import tempfile
import threading
import time

import pytest
import shardd
import webdataset as wds

from conftest import DEADLINE, wait_for

GRACE = 1.0
SAMPLES = 8
# How shardd.torch and shardd.grain say where the socket path goes.
FRAMEWORK_POINT_AT = "pass that path as ShardDataset(socket=...) or in $SHARDD_SOCKET"


def margin(grace):
    """What a failure after ``grace`` may take beyond it: the last attempt, on a busy machine."""
    return 1.0 + grace / 2


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("first")
    for s in range(2):
        with wds.TarWriter(str(root / f"f-{s}.tar")) as sink:
            for i in range(SAMPLES // 2):
                sink.write({"__key__": f"f{s}/{i}", "bin": bytes([s, i]) * 100})
    return f"{root}/f-{{0..1}}.tar"


def config(shards):
    return (f'[host]\nindex = 0\ncount = 1\n[datasets.tiny]\nshards = "{shards}"\n'
            f'shuffle_buffer = 2\n')


def read(client, epoch=0):
    return [s["__key__"] for s in client.stream("tiny", epoch=epoch, rank=0, world_size=1)]


def failure(call):
    """(the UnavailableError ``call`` raises, the seconds it took)."""
    began = time.monotonic()
    with pytest.raises(shardd.UnavailableError) as e:
        call()
    return e.value, time.monotonic() - began


def shardd_log(caplog):
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "shardd"]


class Reader:
    """``call`` on a thread (it blocks inside the client, retrying); ``done`` once it returned
    or raised."""

    def __init__(self, call):
        self.result, self.error = None, None
        self.done = threading.Event()
        self.began = time.monotonic()

        def run():
            try:
                self.result = call()
            except BaseException as e:
                self.error = e
            finally:
                self.done.set()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def still_waiting_after(self, seconds):
        """True if the call is still retrying ``seconds`` after it began (returns as soon as
        it ended, whichever comes first)."""
        self.done.wait(max(0.0, self.began + seconds - time.monotonic()))
        return not self.done.is_set()

    def join(self):
        assert self.done.wait(2 * DEADLINE), "the reader never returned"
        if self.error is not None:
            raise self.error
        return self.result


def assert_explains_absence(message, path, grace, point_at="pass that path to shardd.Client"):
    assert message.startswith(f"no shardd daemon at {path}: no socket file there after "), message
    assert f"(first_connect_timeout = {grace:g} s, " in message
    assert "Likely causes: the daemon is not running, or it died at start-up" in message
    assert "`systemctl status shardd`" in message and "`shardd serve --config CONFIG`" in message
    assert f"or it listens on another socket, its config's server.socket: {point_at}." in message
    assert "reconnect_timeout" not in message  # it played no part


# -- no socket file: fails within the grace ----------------------------------------------------


@pytest.mark.parametrize("grace", [GRACE, None], ids=["first_connect_timeout=1", "default"])
def test_no_socket_fails_within_the_grace_naming_the_path_the_key_and_the_causes(
        tmp_path, caplog, grace):
    path = tmp_path / "shardd.sock"
    kw = {} if grace is None else {"first_connect_timeout": grace}
    grace = shardd.client.FIRST_CONNECT_TIMEOUT if grace is None else grace
    assert shardd.client.FIRST_CONNECT_TIMEOUT == 5.0
    with shardd.Client(path, reconnect_timeout=300, **kw) as c:
        e, took = failure(lambda: read(c))
    assert grace <= took < grace + margin(grace), took
    assert_explains_absence(str(e), path, grace)
    assert isinstance(e, ConnectionError) and e.errno == errno.ENOENT
    # One warning, at the first attempt, that says how long it will try.
    assert shardd_log(caplog) == [(
        "WARNING", f"the shardd daemon at {path} is not available (No such file or directory); "
                   f"retrying for up to {grace:g} s (first_connect_timeout)")]


def test_a_missing_directory_is_named_and_plan_fails_fast_too(tmp_path):
    path = tmp_path / "run" / "shardd" / "shardd.sock"
    with shardd.Client(path, first_connect_timeout=0) as c:  # one attempt
        e, took = failure(lambda: c.plan("tiny", epoch=0, rank=0, world_size=1))
    assert took < margin(0), took
    assert str(e).startswith(f"no shardd daemon at {path}: no socket file there, nor the directory "
                             f"{tmp_path}/run/shardd, after "), str(e)
    assert "(first_connect_timeout = 0 s, 1 attempts)" in str(e)


def test_reconnect_timeout_0_still_raises_at_once(tmp_path):
    """Reconnecting off raises the connect error itself, as before (the speculative next-epoch
    opens rely on it)."""
    path = tmp_path / "shardd.sock"
    e, took = failure(lambda: read(shardd.Client(path, reconnect_timeout=0)))
    assert took < 1 and str(e) == f"no shardd daemon at {path} (No such file or directory)"


# -- permission denied: at once, with its own message --------------------------------------------


def nobody():
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        return None


def connect_failures(paths):
    """For each path: (message, errno, seconds) of the UnavailableError opening a stream
    there raises, with reconnect_timeout 300 s."""
    out = []
    for path in paths:
        began = time.monotonic()
        try:
            read(shardd.Client(path, reconnect_timeout=300))
            out.append(None)
        except shardd.UnavailableError as e:
            out.append((str(e), e.errno, time.monotonic() - began))
    return out


def as_user(user, work):
    """``work()`` in a forked child that runs as ``user`` (no supplementary groups), its JSON
    result back through a pipe. The client is imported already: the child needs no files."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(user.pw_gid)
            os.setuid(user.pw_uid)
            with os.fdopen(w, "w") as out:
                json.dump(work(), out)
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as got:
        text = got.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and text, "the child failed"
    return json.loads(text)


def test_permission_denied_fails_at_once_naming_the_mode_owner_and_settings():
    """A listening socket the trainer's user may not open (root's, mode 0660, for user nobody;
    or mode 0000 when the test is not root), and one in a directory it may not enter. As root
    nothing is denied, so the check runs in a child that became nobody."""
    root = os.geteuid() == 0
    user = nobody() if root else pwd.getpwuid(os.geteuid())
    if user is None:
        pytest.skip("running as root, and there is no user nobody to be denied as")
    top = tempfile.mkdtemp(prefix="shardd-denied-")  # /tmp, not pytest's 0700 root: reachable
    listeners = []
    try:
        os.chmod(top, 0o755)
        closed = os.path.join(top, "closed")
        os.mkdir(closed)
        paths = [os.path.join(top, "shardd.sock"), os.path.join(closed, "shardd.sock")]
        for path in paths:
            s = socket.socket(socket.AF_UNIX)
            s.bind(path)
            s.listen()  # a live listener: only the permission stands in the way
            listeners.append(s)
        os.chmod(paths[0], 0o660 if root else 0o000)
        os.chmod(closed, 0o700 if root else 0o000)  # root's, or nobody's to enter
        got = as_user(user, lambda: connect_failures(paths)) if root else connect_failures(paths)
    finally:
        for s in listeners:
            s.close()
        os.chmod(os.path.join(top, "closed"), 0o700)
        shutil.rmtree(top)
    (sock_msg, sock_errno, sock_took), (dir_msg, dir_errno, dir_took) = got
    assert sock_errno == dir_errno == errno.EACCES
    assert sock_took < 1 and dir_took < 1  # not retried
    who = f"this process runs as {user.pw_name} (uid {user.pw_uid})"
    mode = "srw-rw----" if root else "s---------"
    owner = "root:root" if root else f"{user.pw_name}:{grp.getgrgid(os.getegid()).gr_name}"
    assert sock_msg.startswith(f"permission denied on the shardd socket {paths[0]}: {who}, and "
                               f"the socket is {mode} {owner} "), sock_msg
    assert "server.socket_group" in sock_msg and "server.socket_mode" in sock_msg, sock_msg
    assert sock_msg.endswith("Not retried: a restart of the daemon does not change it."), sock_msg
    if root:
        assert "add the user to the socket's group root (`usermod -aG root nobody`" in sock_msg
    assert dir_msg.startswith(f"permission denied on the way to the shardd socket {paths[1]}: "
                              f"{who} and may not enter the directory "
                              f"{os.path.dirname(paths[1])} ("), dir_msg
    assert "server.socket" in dir_msg, dir_msg


# -- a socket that is there, or was: reconnect_timeout ----------------------------------------


def test_a_socket_that_refuses_is_waited_for_beyond_the_grace(shards, make_daemon, tmp_path,
                                                              caplog):
    """The socket file of a listener that closed (as a killed daemon leaves it): connects are
    refused, which a daemon restarting explains, so the first connection waits past the grace
    until the daemon (the real one, on that path) is back."""
    path = tmp_path / "late" / "shardd.sock"  # where make_daemon(name="late") serves
    path.parent.mkdir()
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()  # not unlinked: ECONNREFUSED from now on
    caplog.set_level(logging.INFO, logger="shardd")
    reader = Reader(lambda: read(shardd.Client(path, first_connect_timeout=GRACE,
                                               reconnect_timeout=DEADLINE)))
    assert reader.still_waiting_after(GRACE + margin(GRACE)), reader.error
    make_daemon(config(shards), name="late")  # replaces the stale file
    assert len(reader.join()) == SAMPLES
    (level, warning), (level2, info) = shardd_log(caplog)
    assert (level, warning) == (
        "WARNING", f"the shardd daemon at {path} is not available (Connection refused); retrying "
                   f"for up to {DEADLINE:g} s (reconnect_timeout)")
    assert level2 == "INFO" and info.startswith("opened dataset 'tiny' epoch 0"), info


def test_a_daemon_started_with_the_trainer_is_used(shards, make_daemon, tmp_path):
    """No socket at first, then the daemon binds one within the grace: the stream opens."""
    path = tmp_path / "together" / "shardd.sock"
    reader = Reader(lambda: read(shardd.Client(path, first_connect_timeout=DEADLINE)))
    assert not path.exists() and not reader.done.is_set()
    make_daemon(config(shards), name="together")
    assert len(reader.join()) == SAMPLES


def test_a_socket_gone_after_the_client_was_served_is_a_restart(shards, make_daemon, caplog):
    """SIGTERM removes the socket file; the client had been served, so the next epoch's open
    takes the missing socket for a restart and waits for it past the grace."""
    d = make_daemon(config(shards), name="restart")
    c = shardd.Client(d.socket, first_connect_timeout=GRACE, reconnect_timeout=DEADLINE)
    assert len(read(c)) == SAMPLES and c.connected
    d.stop()  # asserts the socket file is gone
    caplog.set_level(logging.INFO, logger="shardd")
    reader = Reader(lambda: read(c, epoch=1))
    assert reader.still_waiting_after(GRACE + margin(GRACE)), reader.error
    d.start()
    assert len(reader.join()) == SAMPLES
    assert shardd_log(caplog)[0] == (
        "WARNING", f"the shardd daemon at {d.socket} is not available (No such file or "
                   f"directory); retrying for up to {DEADLINE:g} s (reconnect_timeout)")


@pytest.fixture
def systemctl(tmp_path, monkeypatch):
    """A `systemctl` first on PATH that reports shardd.service in the given state (there is
    no systemd here) and records how it was asked."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "systemctl-calls"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    def report(active, sub):
        script = bin_dir / "systemctl"
        script.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n'
                          f'printf "LoadState=loaded\\nActiveState={active}\\nSubState={sub}\\n"\n')
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
        return calls

    return report


def test_a_systemd_unit_that_is_starting_keeps_reconnect_timeout(systemctl, tmp_path):
    calls = systemctl("activating", "auto-restart")
    path = tmp_path / "shardd.sock"
    e, took = failure(lambda: read(shardd.Client(path, first_connect_timeout=0.2,
                                                 reconnect_timeout=2)))
    assert 2 <= took < 2 + margin(2), took
    assert str(e).startswith(f"no shardd daemon at {path} within reconnect_timeout = 2 s ("), str(e)
    assert calls.read_text() == "show -p LoadState -p ActiveState -p SubState shardd.service\n"


def test_a_systemd_unit_that_failed_is_named(systemctl, tmp_path):
    systemctl("failed", "failed")
    path = tmp_path / "shardd.sock"
    e, took = failure(lambda: read(shardd.Client(path, first_connect_timeout=GRACE)))
    assert GRACE <= took < GRACE + margin(GRACE), took
    assert f"attempts; systemd's shardd.service is failed). Likely causes:" in str(e), str(e)


# -- shardd.torch and shardd.grain inherit it --------------------------------------------------


def test_torch_fails_fast_naming_its_own_arguments(tmp_path):
    st = pytest.importorskip("shardd.torch")
    path = tmp_path / "none.sock"
    ds = st.ShardDataset("tiny", socket=path, first_connect_timeout=GRACE)
    e, took = failure(lambda: next(iter(ds)))
    assert GRACE <= took < GRACE + margin(GRACE), took
    assert_explains_absence(str(e), path, GRACE, point_at=FRAMEWORK_POINT_AT)
    assert "start `shardd serve`, or pass" not in str(e)  # the hint for other errors, not twice


def test_torch_workers_of_a_later_epoch_wait_for_a_restart(shards, make_daemon):
    """Workers of epoch 1 are new processes with new clients, but the dataset's streams
    reached the daemon in epoch 0 (a flag in shared memory): a socket missing then is a
    restart, waited for past the grace."""
    torch_data = pytest.importorskip("torch.utils.data")
    import shardd.torch as st

    d = make_daemon(config(shards), name="torch")
    ds = st.ShardDataset("tiny", socket=d.socket, first_connect_timeout=GRACE,
                         reconnect_timeout=DEADLINE, prefetch_next_epoch=False)
    loader = torch_data.DataLoader(ds, batch_size=None, num_workers=1,
                                   collate_fn=lambda s: s["__key__"])
    assert len(list(loader)) == SAMPLES
    d.stop()
    ds.set_epoch(1)
    reader = Reader(lambda: list(loader))
    assert reader.still_waiting_after(GRACE + margin(GRACE)), reader.error
    d.start()
    assert len(reader.join()) == SAMPLES


def test_grain_fails_fast_naming_its_own_arguments(tmp_path):
    sg = pytest.importorskip("shardd.grain")
    path = tmp_path / "none.sock"
    it = iter(sg.ShardDataset("tiny", socket=path, rank=0, world_size=1, num_streams=2,
                              first_connect_timeout=GRACE))
    try:
        e, took = failure(lambda: next(it))
    finally:
        it.close()
    assert GRACE <= took < GRACE + margin(GRACE), took
    assert_explains_absence(str(e), path, GRACE, point_at=FRAMEWORK_POINT_AT)
