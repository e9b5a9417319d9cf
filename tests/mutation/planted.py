"""Defects planted by hand in the stream paths, one at a time, and the tests that catch each
(issue 36; the table is in docs/testing.md, "Planted defects"). The client's frame decoding,
cursor, read-ahead, reconnect and seeds, and the daemon's resume and park: the places where
a wrong sample, a sample twice or one missing would reach a trainer unseen.

    .venv/bin/python tests/mutation/planted.py [NAME ...]

Each defect is one exact text replacement; the file is restored after its run, even on an
interrupt (a daemon defect rebuilds target/debug/shardd, before and after). It runs the
stream tests and the conformance matrix's covering set against each defect and prints, per
defect, the tests that failed: a defect no test fails is a survivor, and the script exits 1.
"""

import os
import pathlib
import re
import signal
import subprocess
import sys

# A defect the tests cannot finish against (a stream that waits forever) is caught too: CI
# would not end. Past this, the run is stopped and the defect reported as hanging the suite.
SUITE_TIMEOUT = 1200

ROOT = pathlib.Path(__file__).resolve().parents[2]
CLIENT = "clients/python/shardd"
TESTS = ["tests/python/test_streams.py", "tests/python/test_reconnect.py", "tests/python/test_zerocopy.py",
         "tests/python/test_decode.py", "tests/python/test_seeds.py", "tests/python/test_readahead.py",
         "tests/python/test_conformance.py"]

# name: (file, what it replaces, with what, what the defect does)
DEFECTS = {
    "decode-field-short": (f"{CLIENT}/_decode.py",
                           "            sample[names[words[i]]] = data[p:q]\n",
                           "            sample[names[words[i]]] = data[p:q - (q > p)]\n",
                           "the pure-Python decoder drops a field's last byte (any batch)"),
    "cursor-base-early": (f"{CLIENT}/_stream.py",
                          "            self._base += len(batch)\n",
                          "            self._base += len(batch) - (len(batch) > 1)\n",
                          "a reconnect resumes one sample early (a sample twice)"),
    "position-ahead": (f"{CLIENT}/_stream.py",
                       "        return self._given + self._pos\n",
                       "        return self._given + self._pos + (self._pos > 0)\n",
                       "Stream.position counts one sample more (a resume skips one)"),
    "readahead-drops-batch": (f"{CLIENT}/_readahead.py",
                              "                    q.items.append((item, size))\n",
                              "                    q.items.append((item, size)) if len(q.items) != 1 else None\n",
                              "the read-ahead thread loses a batch when one is already waiting"),
    "seed-epoch": (f"{CLIENT}/_seeds.py",
                   '    prefix = struct.pack("<QQ", seed, epoch)\n',
                   '    prefix = struct.pack("<QQ", seed, epoch + 1)\n',
                   "__seed__ hashes the next epoch"),
    "daemon-park-late": ("src/serve/stream.rs",
                         "    let position = job.start + end.samples;\n",
                         "    let position = job.start + end.samples + u64::from(end.samples > 0);\n",
                         "a parked stream resumes one sample late (one lost)"),
    "daemon-resume-skip": ("src/serve/stream.rs",
                           "        skip: (start - window_start) as usize,\n",
                           "        skip: (start - window_start) as usize + usize::from(start > window_start),\n",
                           "a start= resume inside a shuffle window skips one sample too many"),
}


def build():
    subprocess.run(["cargo", "build", "--bins", "--quiet"], cwd=ROOT, check=True)


def run_tests():
    """The ids of the tests that failed."""
    env = {**os.environ, "SHARDD_BIN": str(ROOT / "target" / "debug" / "shardd"), "SHARDD_MATRIX": "covering"}
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", *TESTS],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=SUITE_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # pytest and the daemons it started
        proc.communicate()
        return [f"(the suite hung: not done after {SUITE_TIMEOUT} s)"]
    return sorted(set(re.findall(r"^FAILED (\S+)", out, re.M)))


def write(file, text):
    """Replaces ``file``'s text at once (a rename), so an interrupt leaves the old or the new."""
    tmp = file.with_name(file.name + ".planted")
    tmp.write_text(text)
    os.replace(tmp, file)


def main(names):
    survivors = []
    for name in names or DEFECTS:
        path, old, new, what = DEFECTS[name]
        file = ROOT / path
        text = file.read_text()
        assert text.count(old) == 1, f"{name}: the text to replace is not in {path} once"
        rust = path.endswith(".rs")
        try:
            write(file, text.replace(old, new))
            if rust:
                build()
            failed = run_tests()
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second ^C must not stop the restore
            write(file, text)
            if rust:
                build()
            signal.signal(signal.SIGINT, signal.default_int_handler)
        print(f"{name}: {what}: {'caught by ' + str(len(failed)) + ' tests' if failed else 'SURVIVED'}", flush=True)
        for test in failed:
            print(f"    {test}", flush=True)
        if not failed:
            survivors.append(name)
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
