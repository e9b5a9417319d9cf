"""bench/blog_experiment.py --quick runs (issue 27): the write-up's A/B/C experiment plus
shardd's configurations and litData's (E), a few hundred small images, one epoch each. A benchmark, so nothing
here checks a figure: only that the script finishes and prints a table row per configuration.
"""

import os
import subprocess
import sys

from conftest import ROOT, SHARDD

CONFIGURATIONS = ["A files", "B local tars", "C store, pipe:curl", "D shardd, socket",
                  "D shardd, zero copy", "D-pipe shardd get", "E litData"]


def test_blog_experiment_quick(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "clients" / "python"))
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "blog_experiment.py"), "--quick", "--shardd", SHARDD,
         "--data", str(tmp_path / "data")],
        capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    table = run.stdout.split("configuration", 1)[-1]
    rows = [line for line in table.splitlines() if line[:22].strip() in CONFIGURATIONS]
    assert sorted({r[:22].strip() for r in rows}) == sorted(CONFIGURATIONS), run.stdout
