"""README.md's "Try it locally", run as written by a newcomer: its shell block (shards,
`shardd index`, the config with relative paths, `check` and `serve`), then its Python block,
two exact epochs.

Run by root (CI), the newcomer is a fresh user account, not root: a home of its own, the
binary copied into `~/bin`, and a venv it makes itself with `pip install webdataset
clients/python` (PyPI), as the README says. Run by anyone else, the newcomer is the suite's
user with the suite's venv, and the test's output says so. Either way only `shardd` and
`python3` are found on PATH, as a newcomer's shell finds them.
"""

import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from conftest import ROOT, SHARDD, socket_accepts, wait_for

WEBDATASET = next(line for line in (ROOT / "tests" / "requirements.txt").read_text().splitlines()
                  if line.startswith("webdataset=="))


def section_blocks(title):
    text = (ROOT / "README.md").read_text()
    section = text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(\w+)\n(.*?)```", section, re.S)


class Newcomer:
    """Who follows the README: `prefix` runs a command as them, `home` is where they start,
    `bin` holds `shardd` and `python3`."""

    def __init__(self, prefix, home, bin_dirs, python, who):
        self.prefix, self.home, self.bin_dirs, self.python, self.who = prefix, home, bin_dirs, python, who

    def env(self):
        env = {key: value for key, value in os.environ.items() if not key.startswith(("SHARDD_", "VIRTUAL_ENV"))}
        env.update(PATH=":".join([*map(str, self.bin_dirs), "/usr/bin", "/bin"]), HOME=str(self.home))
        return env


@pytest.fixture
def newcomer(tmp_path):
    if os.geteuid() != 0 or not shutil.which("useradd") or not shutil.which("setpriv"):
        yield Newcomer([], tmp_path, [pathlib.Path(SHARDD).parent, pathlib.Path(sys.executable).parent],
                       sys.executable, f"the suite's user (uid {os.geteuid()}) and venv: not root, no account made")
        return
    name = f"shardd-try-{os.getpid()}"
    base = pathlib.Path(tempfile.mkdtemp(prefix="shardd-newcomer-"))
    base.chmod(0o755)
    home = base / name
    subprocess.run(["useradd", "--create-home", "--home-dir", str(home), "--shell", "/bin/bash", "--user-group", name],
                   check=True, capture_output=True)
    try:
        uid = int(subprocess.run(["id", "-u", name], check=True, capture_output=True, text=True).stdout)
        # What a newcomer has after `cargo build --release` and a clone: the binary and the client's source.
        (home / "bin").mkdir()
        shutil.copy(SHARDD, home / "bin" / "shardd")
        shutil.copytree(ROOT / "clients" / "python", home / "shardd" / "clients" / "python",
                        ignore=shutil.ignore_patterns("*.egg-info", "__pycache__", "build"))
        subprocess.run(["chown", "-R", f"{name}:{name}", str(home)], check=True)
        prefix = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--init-groups"]
        who = Newcomer(prefix, home, [home / "bin", home / "venv" / "bin"], str(home / "venv" / "bin" / "python3"),
                       f"a fresh account {name} (uid {uid}) with its own venv")
        started = time.monotonic()
        setup = subprocess.run([*prefix, "bash", "-e", "-c",
                                f"python3 -m venv ~/venv && ~/venv/bin/pip install -q --disable-pip-version-check "
                                f"{WEBDATASET} ~/shardd/clients/python"],
                               cwd=home, env=who.env(), capture_output=True, text=True, timeout=600)
        assert setup.returncode == 0, f"the newcomer's venv: {setup.stderr}"
        print(f"the newcomer's venv (pip install {WEBDATASET} clients/python) took {time.monotonic() - started:.0f} s")
        yield who
    finally:
        subprocess.run(["pkill", "-KILL", "-u", name], capture_output=True)
        subprocess.run(["userdel", "--remove", name], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


def test_the_readmes_local_path_runs_as_written(newcomer):
    blocks = section_blocks("Try it locally")
    assert [lang for lang, _ in blocks] == ["sh", "python"]
    (_, shell), (_, python) = blocks
    env = newcomer.env()
    print(f"the README's local path runs as {newcomer.who}")
    # Its own session: `serve &` outlives the shell, and the test stops the whole group.
    log = newcomer.home / "shell.log"
    with open(log, "w") as sink:
        started = time.monotonic()
        shell_run = subprocess.Popen([*newcomer.prefix, "bash", "-e", "-c", shell], cwd=newcomer.home, env=env,
                                     start_new_session=True, stdout=sink, stderr=subprocess.STDOUT)
    try:
        code = shell_run.wait(timeout=120)
        assert code == 0, log.read_text()
        try_dir = newcomer.home / "try"
        wait_for(lambda: socket_accepts(try_dir / "shardd.sock"), f"the daemon to serve (log: {log})")
        # `check` said nothing is wrong, and the daemon started without a warning.
        out = log.read_text()
        assert not re.search(r"^(warning|error):| WARN | ERROR ", out, re.M), out
        run = subprocess.run([*newcomer.prefix, newcomer.python, "-c", python], cwd=try_dir, env=env,
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        print(f"shards, index, check, serve and two epochs took {time.monotonic() - started:.1f} s")
        lines = run.stdout.splitlines()
        assert [line.split(" ", 2)[:2] for line in lines] == [["0", "400"], ["1", "400"]], run.stdout
        assert lines[0].split(" ", 2)[2] != lines[1].split(" ", 2)[2], "the same order both epochs"
    finally:
        try:
            os.killpg(shell_run.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
