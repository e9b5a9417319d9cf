"""The command line as users and scripts type it."""

import os
import pathlib
import re
import shutil
import signal
import subprocess
import tempfile

import pytest
import shardd

from conftest import SHARDD, free_port, gcs_config, reference_samples, socket_accepts, wait_for


def test_demo_verifies_an_epoch():
    out = subprocess.run([SHARDD, "demo"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("demo: 16 shards x 250 samples")
    assert lines[1].startswith("epoch 0: 4 ranks x 2 workers, 4000 samples")
    assert "samples/s" in lines[1] and "MB/s" in lines[1]
    assert lines[2:] == [
        "verified: every sample exactly once, every field byte for byte",
        "verified: re-reading epoch 0 gives the same order in every stream",
        "verified: epoch 1 has a different order",
    ]


def test_sigint_stops_cleanly(make_daemon, fake_gcs):
    d = make_daemon(gcs_config(fake_gcs))
    with shardd.Client(d.socket) as c:
        assert len(list(c.stream("train", epoch=0, rank=0, world_size=1))) > 0
    d.stop(signal.SIGINT)  # asserts exit code 0 and the socket file removed


def test_check_shows_its_progress_over_the_shards(fake_gcs, train_paths, tmp_path):
    """`check` asks the store for every shard and says how far it got (a bar on a terminal,
    lines otherwise), then the totals."""
    config = tmp_path / "c.toml"
    config.write_text(
        f'[gcs]\nendpoint = "{fake_gcs}"\nanonymous = true\n'
        f'[datasets.train]\nshards = "gs://bkt/train/train-{{000000..{len(train_paths) - 1:06d}}}.tar"\n'
    )
    out = subprocess.run([SHARDD, "check", "--config", str(config)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    total = sum(p.stat().st_size for p in train_paths)
    largest = max(train_paths, key=lambda p: p.stat().st_size)
    assert out.stdout.splitlines()[-1] == (
        f"dataset train: {total} bytes in the store; the largest shard is gs://bkt/train/{largest.name} "
        f"({largest.stat().st_size} bytes)"
    )
    last = out.stderr.splitlines()[-1]
    assert last.startswith(f"train: {len(train_paths)}/{len(train_paths)} shards done, {total / 1e6:.1f} MB found"), last


UNIT = 10240


def _write_padded_shards(directory, shards, samples):
    """``shards`` tars of ``samples`` samples each; shard i carries UNIT·2^i more bytes than
    a shard without padding, so a sum of shard sizes says which shards it adds up (UNIT is
    a tar record: the padding changes no rounding)."""
    import webdataset as wds

    directory.mkdir()
    paths = []
    for i in range(shards):
        path = directory / f"train-{i:02d}.tar"
        with wds.TarWriter(str(path)) as sink:
            for j in range(samples):
                pad = b"p" * (UNIT * 2**i) if j == 0 else b""
                sink.write({"__key__": f"s{i:02d}{j:03d}", "cls": b"1", "pad": pad})
        paths.append(path)
    return paths


def test_plan_counts_every_shard_once_over_the_hosts(tmp_path):
    """`shardd plan` on an indexed dataset: 8 shards of 12 samples on 2 hosts × 2 ranks × 3
    workers cut at shard edges (48 samples a host, 8 a stream, none dropped). The bytes of
    each host decode to the set of shards it reads: the sets are disjoint and cover all."""
    import json

    paths = _write_padded_shards(tmp_path / "shards", 8, 12)
    pattern = str(tmp_path / "shards" / "train-{00..07}.tar")
    manifest = tmp_path / "train.manifest.json"
    out = subprocess.run([SHARDD, "index", pattern, "-o", str(manifest)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    config = tmp_path / "c.toml"
    config.write_text(f'[datasets.train]\nshards = "{pattern}"\nmanifest = "{manifest}"\n')
    cmd = [SHARDD, "plan", "--config", str(config), "--hosts", "2", "--ranks", "2", "--workers", "3",
           "--seed", "4", "--epoch", "1"]
    out = subprocess.run(cmd + ["--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    sizes = [p.stat().st_size for p in paths]
    base = sizes[0] - UNIT  # what a shard weighs without its padding
    assert all(s == base + UNIT * 2**i for i, s in enumerate(sizes)), sizes
    assert (r["dataset_shards"], r["dataset_samples"], r["dataset_bytes"]) == (8, 96, sum(sizes))
    assert r["samples_per_stream"] == 8
    masks = []
    for h, host in enumerate(r["per_host"]):
        assert (host["host"], host["samples"], host["shards"], host["dropped"]) == (h, 48, 4, 0)
        mask, rest = divmod(host["bytes"] - 4 * base, UNIT)
        assert rest == 0 and bin(mask).count("1") == 4, host
        masks.append(mask)
    assert masks[0] & masks[1] == 0 and masks[0] | masks[1] == 255
    s = r["summary"]
    assert (s["total_samples"], s["total_shards"], s["total_bytes"], s["total_dropped"]) == (96, 8, sum(sizes), 0)
    assert s["bytes"]["min"] == min(h["bytes"] for h in r["per_host"])
    assert s["bytes"]["max"] == max(h["bytes"] for h in r["per_host"])
    assert s["samples"] == {"min": 48, "max": 48, "ratio": 1.0}

    text = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0] == (f"dataset train: 8 shards, 96 samples, {sum(sizes)} bytes; 2 hosts × 2 ranks × 3 workers "
                        f"(world_size 4), seed 4, epoch 1")
    assert lines[1] == "every stream: 8 samples"
    assert lines[-2] == f"total: 96 samples, 8 shard reads, {sum(sizes)} bytes, 0 dropped"
    assert lines[-1].startswith("spread between hosts: samples min 48 max 48 (max/min 1.0000); shards min 4 max 4")

    # --from: a job of 1 host × 2 ranks × 3 workers (6 streams of 16) checkpointed at sample 8
    # of every stream, resumed on these 2 hosts: 48 samples left, 24 per new host; host 0 had
    # every shard in its old share, host 1 is new and fetches all it reads.
    elastic = subprocess.run(cmd + ["--json", "--from", "1,2,3"], capture_output=True, text=True,
                             timeout=60)
    assert elastic.returncode == 0, elastic.stderr
    z = json.loads(elastic.stdout)["resize"]
    assert (z["from"], z["position"], z["remainder"], z["dropped"]) == ("1,2,3", 8, 48, 0)
    h0, h1 = z["per_host"]
    assert (h0["samples"], h1["samples"]) == (24, 24)
    assert (h0["fetch_shards"], h0["fetch_bytes"]) == (0, 0)
    assert (h1["fetch_shards"], h1["fetch_bytes"]) == (h1["shards"], h1["bytes"]) and h1["shards"] > 0
    assert z["fetch_fraction"] == h1["bytes"] / (h0["bytes"] + h1["bytes"])
    text = subprocess.run(cmd + ["--from", "1,2,3", "--position", "16"], capture_output=True,
                          text=True, timeout=60)
    assert "with every old worker at sample 16: 0 samples left" in text.stdout, text.stdout
    plain = tmp_path / "plain.toml"
    plain.write_text(f'[datasets.train]\nshards = "{pattern}"\n')
    no_manifest = subprocess.run([SHARDD, "plan", "--config", str(plain), "--hosts", "1",
                                  "--ranks", "1", "--workers", "1", "--from", "2,1,1"],
                                 capture_output=True, text=True, timeout=60)
    assert no_manifest.returncode != 0 and "needs the dataset's manifest" in no_manifest.stderr


def test_plan_without_a_manifest_counts_shards(tmp_path):
    """Shard-level datasets: no samples nor bytes, every shard on one host."""
    import json

    config = tmp_path / "c.toml"
    config.write_text('[datasets.a]\nshards = "/nowhere/a-{0..9}.tar"\n[datasets.b]\nshards = "/nowhere/b-{0..20}.tar"\n')
    cmd = [SHARDD, "plan", "--config", str(config), "--hosts", "4", "--ranks", "1", "--workers", "2", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "--dataset" in out.stderr, out.stderr
    r = json.loads(subprocess.run(cmd + ["--dataset", "b"], capture_output=True, text=True, timeout=60, check=True).stdout)
    assert sorted(h["shards"] for h in r["per_host"]) == [5, 5, 5, 6]
    assert r["summary"]["total_shards"] == 21
    assert r["summary"]["total_samples"] is None and r["summary"]["bytes"] is None


def uneven_dataset(tmp_path):
    """10 shards of 7 to 16 samples (webdataset's TarWriter) and their manifest: (pattern,
    manifest path)."""
    import webdataset as wds

    shards = tmp_path / "shards"
    shards.mkdir()
    for i in range(10):
        with wds.TarWriter(str(shards / f"train-{i:02d}.tar")) as sink:
            for j in range(7 + i):
                sink.write({"__key__": f"s{i:02d}{j:03d}", "cls": b"1"})
    pattern = str(shards / "train-{00..09}.tar")
    manifest = tmp_path / "train.manifest.json"
    out = subprocess.run([SHARDD, "index", pattern, "-o", str(manifest)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return pattern, manifest


def test_plan_verify_certifies_a_resize_and_refuses_a_bad_checkpoint(tmp_path):
    """`shardd plan --verify` on a real manifest (10 shards of 7 to 16 samples): resizes
    2→4 and 4→2 hosts from mid-epoch positions are certified (every sample the old streams
    had not delivered read once, a drop under the new world size, equal ranks); a checkpoint
    past the old streams' end is refused with the reason and a non-zero exit."""
    import json

    pattern, manifest = uneven_dataset(tmp_path)
    config = tmp_path / "c.toml"
    config.write_text(f'[datasets.train]\nshards = "{pattern}"\nmanifest = "{manifest}"\n'
                      "shuffle_buffer = 5\n")
    plan = [SHARDD, "plan", "--config", str(config), "--seed", "3", "--epoch", "1", "--verify"]

    # 2 hosts × 1 rank × 2 workers (115 samples: streams of 28, 3 dropped) checkpointed with
    # worker 0 at 7 and worker 1 at 5 samples, onto 4 hosts × 1 rank × 2 workers.
    up = subprocess.run(plan + ["--hosts", "4", "--ranks", "1", "--workers", "2", "--from", "2,1,2",
                                "--positions", "7,5", "--json"],
                        capture_output=True, text=True, timeout=60)
    assert up.returncode == 0, up.stderr
    v = json.loads(up.stdout)
    assert v["breaches"] == []
    (s,) = v["sources"]
    assert (s["dataset"], s["epoch"], s["delivered"]) == ("train", 112, 2 * (7 + 5))
    assert (s["duplicates"], s["foreign"]) == (0, 0)
    assert s["delivered"] + s["read"] + s["unread"] == s["epoch"]
    assert s["unread"] == v["planned_dropped"] < 4 and s["drop_allowance"] == 3
    assert v["planned_remainder"] == 112 - 24
    assert v["counts"]["rank_min"] == v["counts"]["rank_max"] == (112 - 24) // 4
    assert all(a == b for a, b in v["counts"]["workers"])

    # 4 → 2 hosts, the checkpoint given as the protocol's resume_from object, text output.
    origin = tmp_path / "origin.json"
    origin.write_text(json.dumps({"hosts": 4, "world_size": 8, "num_workers": 1,
                                  "positions": [9]}))
    down = subprocess.run(plan + ["--hosts", "2", "--ranks", "3", "--workers", "1",
                                  "--resume-from", str(origin)],
                          capture_output=True, text=True, timeout=60)
    assert down.returncode == 0, down.stderr
    lines = down.stdout.splitlines()
    assert lines[0].startswith("verify: train resumed from 4 hosts × 2 ranks × 1 workers at "
                               "positions [9] onto 2 hosts × 3 ranks × 1 workers"), lines
    assert lines[-1].startswith("certified: every sample the old streams had not delivered is read "
                                "exactly once"), lines

    # A resume of that resume (a chain), 2 hosts → 1.
    origin.write_text(json.dumps({"hosts": 2, "world_size": 6, "num_workers": 1, "positions": [4],
                                  "from": {"hosts": 4, "world_size": 8, "num_workers": 1,
                                           "positions": [9]}}))
    chain = subprocess.run(plan + ["--hosts", "1", "--ranks", "1", "--workers", "3",
                                   "--resume-from", str(origin), "--json"],
                           capture_output=True, text=True, timeout=60)
    assert chain.returncode == 0, chain.stderr
    assert json.loads(chain.stdout)["breaches"] == []

    # Positions past the old streams' end (28 samples): refused, saying why.
    past = subprocess.run(plan + ["--hosts", "4", "--ranks", "1", "--workers", "2", "--from", "2,1,2",
                                  "--positions", "7,29"],
                          capture_output=True, text=True, timeout=60)
    assert past.returncode != 0
    assert "position 29 of worker 1 is past the end of its old stream (28 samples)" in past.stderr
    missing = subprocess.run(plan + ["--hosts", "4", "--ranks", "1", "--workers", "2", "--from", "2,1,2"],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode != 0 and "needs the checkpoint's positions" in missing.stderr


def test_relative_paths_in_a_config_are_the_config_files_directorys(tmp_path, train_paths):
    """The README's local path as a newcomer types it: shards in ./data, a manifest written by
    `shardd index` from the same relative pattern, a config with relative shards, manifest,
    cache and socket, `check --config rel.toml` in that directory, then `serve` started from
    another directory (`--config proj/rel.toml`). All of it names the same files."""
    proj = tmp_path / "proj"
    (proj / "data").mkdir(parents=True)
    for p in train_paths:
        shutil.copy(p, proj / "data" / p.name)
    pattern = f"data/train-{{000000..{len(train_paths) - 1:06d}}}.tar"
    run = subprocess.run([SHARDD, "index", pattern, "-o", "data/train.manifest.json"], cwd=proj,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    (proj / "rel.toml").write_text(
        f'[server]\nsocket = "shardd.sock"\nmetrics_addr = "127.0.0.1:{free_port()}"\n'
        '[cache]\ndir = "cache"\n'
        f'[datasets.train]\nshards = "{pattern}"\nmanifest = "data/train.manifest.json"\n'
    )
    check = subprocess.run([SHARDD, "check", "--config", "rel.toml"], cwd=proj,
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "warning" not in (check.stdout + check.stderr).lower(), check.stdout + check.stderr
    with open(tmp_path / "serve.log", "w") as log:
        daemon = subprocess.Popen([SHARDD, "serve", "--config", "proj/rel.toml"], cwd=tmp_path,
                                  stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: daemon.poll() is None and socket_accepts(proj / "shardd.sock"),
                 f"shardd to serve at proj/shardd.sock (log: {tmp_path / 'serve.log'})")
        with shardd.Client(proj / "shardd.sock") as c:
            got = list(c.stream("train", epoch=0, rank=0, world_size=1))
        assert {s["__key__"]: {k: v for k, v in s.items() if not k.startswith("__")} for s in got} \
            == reference_samples(train_paths)
        assert any((proj / "cache").iterdir()), "the cache is the config directory's"
    finally:
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=30) == 0


def test_serve_warns_of_a_dataset_whose_first_shard_is_missing(tmp_path, train_paths):
    """`serve` starts (other datasets may serve), and its log says at once what /readyz says."""
    (tmp_path / "c.toml").write_text(
        f'[server]\nsocket = "s.sock"\nmetrics_addr = "127.0.0.1:{free_port()}"\n[cache]\ndir = "cache"\n'
        f'[datasets.train]\nshards = "{train_paths[0]}"\n'
        '[datasets.typo]\nshards = "data/trian-{000000..000003}.tar"\n'
    )
    log = tmp_path / "serve.log"
    with open(log, "w") as sink:
        daemon = subprocess.Popen([SHARDD, "serve", "--config", str(tmp_path / "c.toml")],
                                  stdout=sink, stderr=subprocess.STDOUT)
    try:
        line = wait_for(lambda: next((l for l in log.read_text().splitlines() if " WARN " in l), None),
                        "the warning")
        assert f"{tmp_path}/data/trian-000000.tar: object not found: streams of this dataset will fail" in line, line
        assert "dataset=typo" in line, line
    finally:
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=30) == 0


def offline_and_serve(config):
    """`check --offline` and `serve` on the same config: each one's exit code and output."""
    check = subprocess.run([SHARDD, "check", "--offline", "--config", str(config)], capture_output=True, text=True,
                           timeout=60)
    serve = subprocess.run([SHARDD, "serve", "--config", str(config)], capture_output=True, text=True, timeout=60)
    return (check.returncode, check.stdout + check.stderr), (serve.returncode, serve.stdout + serve.stderr)


@pytest.mark.parametrize("case", ["manifest of other shards", "cache.dir under a file", "no such socket_group"])
def test_check_offline_refuses_what_stops_serve(tmp_path, train_paths, case):
    """Offline, `check` asks no store, yet refuses every start-up failure that needs none, with
    serve's own words: local shards and manifest are files, the directories serve writes and
    the socket's group are this machine's."""
    (tmp_path / "data").mkdir()
    for p in train_paths[:4]:
        shutil.copy(p, tmp_path / "data" / p.name)
    run = subprocess.run([SHARDD, "index", "data/train-{000000..000002}.tar", "-o", "three.manifest.json"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    server = f'[server]\nsocket = "s.sock"\nmetrics_addr = "127.0.0.1:{free_port()}"\n'
    cache, dataset = '[cache]\ndir = "cache"\n', '[datasets.train]\nshards = "data/train-{000000..000003}.tar"\n'
    if case == "manifest of other shards":
        dataset += 'manifest = "three.manifest.json"\n'
        said = f"manifest {tmp_path}/three.manifest.json does not match the configured shards"
        hint = "run `shardd index` on datasets.train.shards again to rewrite datasets.train.manifest"
    elif case == "cache.dir under a file":
        (tmp_path / "file").write_text("")
        cache = '[cache]\ndir = "file/cache"\n'
        said, hint = f"{tmp_path}/file", "set [cache] dir to a directory this user may write"
    else:
        server += 'socket_group = "no-such-group-shardd"\n'
        said = 'no group "no-such-group-shardd" in /etc/group'
        hint = "server.socket_group"
    (tmp_path / "c.toml").write_text(server + cache + dataset)
    (check_code, check_out), (serve_code, serve_out) = offline_and_serve(tmp_path / "c.toml")
    assert serve_code == 1 and said in serve_out, serve_out
    assert check_code == 1 and said in check_out, check_out
    assert "problems would stop `shardd serve`" in check_out, check_out
    # Both name the key to change, and say each cause once.
    assert hint in serve_out, serve_out
    assert hint in check_out, check_out
    if case == "manifest of other shards":
        assert check_out.count("does not match the configured shards") == 1, check_out


def test_check_offline_finds_a_local_datasets_missing_shards(tmp_path, train_paths):
    (tmp_path / "c.toml").write_text(f'[cache]\ndir = "cache"\n[server]\nsocket = "s.sock"\n'
                                     f'[datasets.train]\nshards = ["{train_paths[0]}", "data/gone.tar"]\n')
    check = subprocess.run([SHARDD, "check", "--offline", "--config", str(tmp_path / "c.toml")],
                           capture_output=True, text=True, timeout=60)
    # As to serve (which starts, and warns): a warning offline, an error when checking the store.
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"dataset train: {tmp_path}/data/gone.tar: object not found" in check.stdout, check.stdout
    assert ("warning: dataset train: 1 shards cannot be read: `serve` starts, and streams of this dataset fail"
            in check.stdout), check.stdout
    online = subprocess.run([SHARDD, "check", "--config", str(tmp_path / "c.toml")], capture_output=True, text=True,
                            timeout=60)
    assert online.returncode == 1 and "1 shards cannot be read (listed above)" in online.stderr, online.stderr


def test_check_offline_as_a_normal_user_says_which_directory_it_may_not_write(tmp_path):
    """The defaults are root's: a normal user's `check` names the key to set (root only: it
    runs the check as `nobody`, with a copy of the binary `nobody` can reach)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run as nobody")
    base = pathlib.Path(tempfile.mkdtemp(prefix="shardd-nobody-"))
    try:
        base.chmod(0o755)
        shutil.copy(SHARDD, base / "shardd")
        (base / "c.toml").write_text('[datasets.train]\nshards = "gs://bkt/train-{000000..000003}.tar"\n')
        check = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", str(base / "shardd"),
                                "check", "--offline", "--config", str(base / "c.toml")],
                               capture_output=True, text=True, timeout=60)
        out = check.stdout + check.stderr
        assert check.returncode == 1, out
        assert re.search(r"cache.dir /var/cache/shardd: /var/cache(/shardd)? is not writable by this user "
                         r"\(uid 65534\): Permission denied", out), out
        assert "set [cache] dir to a directory this user may write" in out, out
        assert re.search(r"server.socket /run/shardd/shardd.sock: /run(/shardd)? is not writable", out), out
    finally:
        shutil.rmtree(base)


def test_a_resize_plan_verify_certifies_reads_so_on_real_daemons(make_daemon, tmp_path):
    """`plan --verify`'s certificate against what daemons deliver (its own replay of the
    planner is no oracle): the old job (2 hosts × 1 rank × 2 workers) reads to its checkpoint
    (workers at 7 and 5 samples) on two daemons, the new one (4 hosts) reads the rest on four.
    What the old streams delivered and the new ones read is webdataset's keys less the drops
    the certificate planned, every sample once."""
    import json

    import webdataset as wds

    pattern, manifest = uneven_dataset(tmp_path)
    every = {s["__key__"] for s in wds.WebDataset(pattern, shardshuffle=False)}
    dataset = f'[datasets.train]\nshards = "{pattern}"\nmanifest = "{manifest}"\nshuffle_buffer = 5\n'
    (tmp_path / "c.toml").write_text(dataset)
    # 115 samples; the old job's epoch (4 streams of 28) drops 3 of them: its streams, read
    # whole, say which.
    origin = {"hosts": 2, "world_size": 2, "num_workers": 2, "positions": [7, 5]}
    v = json.loads(subprocess.run(
        [SHARDD, "plan", "--config", str(tmp_path / "c.toml"), "--seed", "3", "--epoch", "1", "--verify",
         "--hosts", "4", "--ranks", "1", "--workers", "2", "--from", "2,1,2", "--positions", "7,5", "--json"],
        capture_output=True, text=True, timeout=60, check=True).stdout)
    assert v["breaches"] == []

    def host(index, count):
        return make_daemon(f"[host]\nindex = {index}\ncount = {count}\n" + dataset, name=f"h{index}of{count}")

    delivered, old_epoch = [], []
    for rank in range(2):
        d = host(rank, 2)
        with shardd.Client(d.socket) as c:
            for worker, position in enumerate(origin["positions"]):
                keys = [x["__key__"] for x in c.stream("train", epoch=1, rank=rank, world_size=2, seed=3,
                                                       worker=worker, num_workers=2)]
                delivered += keys[:position]
                old_epoch += keys
        d.stop()
    read, counts = [], []
    for rank in range(4):
        d = host(rank, 4)
        with shardd.Client(d.socket) as c:
            for worker in range(2):
                keys = [x["__key__"] for x in c.stream("train", epoch=1, rank=rank, world_size=4, seed=3, worker=worker,
                                                       num_workers=2, resume_from=origin)]
                read += keys
                counts.append(len(keys))
        d.stop()
    (source,) = v["sources"]
    assert len(old_epoch) == len(set(old_epoch)) == source["epoch"] and set(old_epoch) <= every
    assert (len(delivered), len(read)) == (source["delivered"], source["read"])
    got = delivered + read
    assert len(set(got)) == len(got), "a sample read twice across the resize"
    assert set(got) <= set(old_epoch), "a sample the old epoch did not hold"
    assert len(set(old_epoch) - set(got)) == v["planned_dropped"], "drops other than the certificate's"
    ranks = [counts[2 * r] + counts[2 * r + 1] for r in range(4)]
    assert ranks == [v["counts"]["rank_min"]] * 4 and v["counts"]["rank_min"] == v["counts"]["rank_max"], counts
