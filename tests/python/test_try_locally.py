"""README.md's "Try it locally", run as written: its shell block (shards, `shardd index`, the
config with relative paths, `check` and `serve`), then its Python block, two exact epochs.

Only `shardd` and `python3` are found on PATH (the built binary's directory and the test's
venv), as a newcomer's shell would find them. Run by root (CI), it runs as `nobody` in a
directory `nobody` owns, when `nobody` can reach the binary and the venv (a checkout under
/root cannot be); else as the suite's user, which says so in the test's output.
"""

import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys

from conftest import ROOT, SHARDD, socket_accepts, wait_for


def section_blocks(title):
    text = (ROOT / "README.md").read_text()
    section = text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(\w+)\n(.*?)```", section, re.S)


NOBODY = 65534


def as_a_normal_user(env):
    """The command prefix that runs as `nobody` (root only, and only where `nobody` can run
    the binary and the venv's Python), else none."""
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        return []
    prefix = [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    probe = subprocess.run([*prefix, "sh", "-c", f'"{SHARDD}" --version && "{sys.executable}" -c "import shardd, webdataset"'],
                           env=env, capture_output=True, text=True)
    return prefix if probe.returncode == 0 else []


def test_the_readmes_local_path_runs_as_written(tmp_path):
    blocks = section_blocks("Try it locally")
    assert [lang for lang, _ in blocks] == ["sh", "python"]
    (_, shell), (_, python) = blocks
    env = {**os.environ, "PATH": f"{pathlib.Path(SHARDD).parent}:{pathlib.Path(sys.executable).parent}:/usr/bin:/bin",
           "HOME": str(tmp_path)}
    env.pop("SHARDD_SOCKET", None)
    user = as_a_normal_user(env)
    if user:
        os.chown(tmp_path, NOBODY, NOBODY)
    print(f"the README's local path runs as {'nobody' if user else 'the suite user (uid %d)' % os.geteuid()}")
    # Its own session: `serve &` outlives the shell, and the test stops the whole group.
    log = tmp_path / "shell.log"
    with open(log, "w") as sink:
        shell_run = subprocess.Popen([*user, "bash", "-e", "-c", shell], cwd=tmp_path, env=env, start_new_session=True,
                                     stdout=sink, stderr=subprocess.STDOUT)
    try:
        code = shell_run.wait(timeout=120)
        assert code == 0, log.read_text()
        try_dir = tmp_path / "try"
        wait_for(lambda: socket_accepts(try_dir / "shardd.sock"), f"the daemon to serve (log: {log})")
        # `check` said nothing is wrong, and the daemon started without a warning.
        out = log.read_text()
        assert not re.search(r"^(warning|error):| WARN | ERROR ", out, re.M), out
        run = subprocess.run([*user, sys.executable, "-c", python], cwd=try_dir, env=env, capture_output=True,
                             text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        lines = run.stdout.splitlines()
        assert [line.split(" ", 2)[:2] for line in lines] == [["0", "400"], ["1", "400"]], run.stdout
        assert lines[0].split(" ", 2)[2] != lines[1].split(" ", 2)[2], "the same order both epochs"
    finally:
        try:
            os.killpg(shell_run.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
