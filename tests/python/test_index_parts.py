"""`shardd index` split over a pod: each host indexes its part (`--part i/N`), one merges
(`--merge`): the merged manifest is byte-equal to one host's index of the same shards, and a
merge refuses parts that miss a shard or hold one twice, naming it."""

import subprocess

import webdataset as wds

from conftest import SHARDD

SHARDS, PARTS = 13, 3


def index(*args, cwd):
    return subprocess.run([SHARDD, "index", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_parts_indexed_apart_merge_into_one_hosts_manifest(tmp_path):
    (tmp_path / "data").mkdir()
    for s in range(SHARDS):
        with wds.TarWriter(str(tmp_path / "data" / f"train-{s:02d}.tar")) as sink:
            for i in range(3 + s % 4):
                sink.write({"__key__": f"s{s:02d}-{i}", "txt": b"x" * (100 + 37 * s + i)})
    pattern = f"data/train-{{00..{SHARDS - 1:02d}}}.tar"
    whole = index(pattern, "-o", "whole.json", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr

    # The parts at once, as the hosts of a pod run them.
    runs = [subprocess.Popen([SHARDD, "index", pattern, "--part", f"{p}/{PARTS}", "-o", f"part-{p}.json"],
                             cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for p in range(PARTS)]
    for p, run in enumerate(runs):
        _, err = run.communicate(timeout=120)
        assert run.returncode == 0, err
        mine = len(range(p, SHARDS, PARTS))
        assert f"part-{p}.json: {mine} shards (part {p}/{PARTS} of {SHARDS} shards)" in err, err
    merged = index(pattern, "-o", "merged.json", "--merge", f"part-{{0..{PARTS - 1}}}.json", cwd=tmp_path)
    assert merged.returncode == 0, merged.stderr
    assert f"merged from {PARTS} parts" in merged.stderr
    assert (tmp_path / "merged.json").read_bytes() == (tmp_path / "whole.json").read_bytes()

    # A part run again reads nothing it has indexed.
    again = index(pattern, "--part", f"1/{PARTS}", "-o", "part-1.json", cwd=tmp_path)
    assert again.returncode == 0 and "(4 entries reused)" in again.stderr, again.stderr

    gap = index(pattern, "-o", "merged.json", "--merge", "part-0.json", "--merge", "part-2.json", cwd=tmp_path)
    assert gap.returncode == 1
    assert (f"--merge: 4 of the {SHARDS} shards are in no part, the first {tmp_path}/data/train-01.tar (number 1 "
            "of the patterns") in gap.stderr, gap.stderr
    (tmp_path / "copy.json").write_bytes((tmp_path / "part-0.json").read_bytes())
    twice = index(pattern, "-o", "merged.json", "--merge", "part-{0..2}.json", "--merge", "copy.json", cwd=tmp_path)
    assert twice.returncode == 1
    assert (f"--merge: {tmp_path}/data/train-00.tar is in two parts, {tmp_path}/part-0.json and "
            f"{tmp_path}/copy.json") in twice.stderr, twice.stderr
    assert (tmp_path / "merged.json").read_bytes() == (tmp_path / "whole.json").read_bytes(), "a refused merge wrote"
    bad = index(pattern, "--part", "3/3", "-o", "x.json", cwd=tmp_path)
    assert bad.returncode != 0 and "give it as i/N" in bad.stderr, bad.stderr
