"""A TPU pod on one machine (tests/pod/pod.py): 8 hosts, each in its own network namespace,
booted as a TPU VM (its own metadata server, deploy/tpu-vm/startup.sh, the unit's command
line, host.index = "auto"), reading one bucket that checks short-lived tokens
(tests/python/bucket_emulator.py), with one trainer process per rank.

Every scenario is exact: each sample once job-wide, byte-equal to webdataset, and in the
orders single daemons of the same topology give (the oracle: daemons started one at a time
outside the pod, on fake-gcs-server directly). Figures are printed (the pod table), never
asserted as times."""

import collections
import itertools
import json
import os
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

import pod as podlib
from conftest import BUCKET, SHARDD, Daemon, reference_samples, start_fake_gcs, upload, wait_for
from trainer import sample_digest

# bench/pod.py runs the same scenarios with more hosts and shards.
HOSTS = int(os.environ.get("SHARDD_POD_HOSTS", "8"))
RANKS = 2  # trainer processes per host (ranks index*RANKS .. index*RANKS+RANKS-1)
SHARDS = int(os.environ.get("SHARDD_POD_SHARDS", "64"))
SEED = 11
SHUFFLE, MIN_SAMPLES = 16, 8  # the dataset's shuffle_buffer; the fewest samples in a shard
PATTERN = f"gs://{BUCKET}/pod/pod-{{000000..{SHARDS - 1:06d}}}.tar"
MANIFEST = f"gs://{BUCKET}/pod/pod.manifest.json"
CONFIG = f"""[server]
metrics_addr = "0.0.0.0:{podlib.METRICS_PORT}"
[gcs]
endpoint = "ENDPOINT"
# The pod's bucket is plain HTTP at the bridge (the real one is https).
allow_http = true
[datasets.pod]
shards = "{PATTERN}"
manifest = "{MANIFEST}"
shuffle_buffer = {SHUFFLE}
"""

ORACLES = itertools.count()
unavailable = podlib.namespaces_unavailable()
pytestmark = pytest.mark.skipif(unavailable is not None, reason=str(unavailable))


def write_shards(directory):
    """SHARDS shards written by webdataset's TarWriter, 8 to 24 samples of up to 40 KB each."""
    import random

    import webdataset as wds

    rng = random.Random(7)
    directory.mkdir(parents=True)
    n = 0
    for s in range(SHARDS):
        with wds.TarWriter(str(directory / f"pod-{s:06d}.tar")) as sink:
            for _ in range(rng.randint(MIN_SAMPLES, 24)):
                sink.write({"__key__": f"s{s:03d}/{n:06d}", "bin": rng.randbytes(rng.randint(1, 40_000)),
                            "cls": str(n % 10).encode()})
                n += 1
    return sorted(directory.glob("pod-*.tar"))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The bucket's shards (in fake-gcs-server), their manifest, and webdataset's reading."""
    root = tmp_path_factory.mktemp("pod-data")
    paths = write_shards(root / "gcs" / BUCKET / "pod")
    gcs = start_fake_gcs(root / "gcs", root)
    store = root / "store.toml"
    store.write_text(f'[gcs]\nendpoint = "{gcs.endpoint}"\nanonymous = true\n')
    manifest = root / "pod.manifest.json"
    subprocess.run([SHARDD, "index", PATTERN, "-o", str(manifest), "--config", str(store)],
                   check=True, capture_output=True)
    upload(gcs.endpoint, "pod/pod.manifest.json", manifest.read_bytes())
    reference = reference_samples(paths)
    yield {"gcs": gcs, "paths": paths, "manifest": manifest, "root": root,
           "digests": {k: sample_digest(v) for k, v in reference.items()},
           "sizes": {f"{BUCKET}/pod/{p.name}": p.stat().st_size for p in paths}}
    gcs.stop()


@pytest.fixture(scope="module")
def wheel_path(tmp_path_factory):
    given = os.environ.get("SHARDD_WHEEL")
    if given:
        return given
    pytest.skip("the pod boots from the wheel: set SHARDD_WHEEL (scripts/test.sh builds it)")


@pytest.fixture(scope="module")
def pod(data, wheel_path, tmp_path_factory):
    p = podlib.Pod(tmp_path_factory.mktemp("pod"), wheel_path, int(data["gcs"].endpoint.rsplit(":", 1)[1]),
                   HOSTS, CONFIG, token_ttl=30)
    try:
        p.boot()
        yield p
    finally:
        p.close()


@pytest.fixture(autouse=True)
def whole_pod(pod):
    pod.ensure()
    return pod


# ---- reading and checking --------------------------------------------------------------------

def start_trainers(pod, epoch, world_size, hosts=None, tag="", **request):
    """One trainer per rank of each host in ``hosts`` (default: all), started at once;
    ``start`` and ``stop_after`` may be {rank: value} dicts. Returns {rank: process}."""
    per_host = world_size // len(pod.hosts)
    procs = {}
    for h in pod.hosts:
        if hosts is not None and h.index not in hosts:
            continue
        for rank in range(h.index * per_host, (h.index + 1) * per_host):
            r = {k: v[rank] if isinstance(v, dict) and k != "resume_from" else v
                 for k, v in request.items()}
            procs[rank] = h.trainer(f"trainer-e{epoch}{tag}-r{rank}", dataset="pod", epoch=epoch,
                                    rank=rank, world_size=world_size, seed=SEED, **r)
    return procs


def collect(procs):
    """Waits for trainers: {rank: (samples, end)}, samples as [url, key, digest] lists."""
    out = {}
    for rank, p in procs.items():
        if p.wait(timeout=300) != 0:
            raise AssertionError(f"trainer of rank {rank} failed:\n{p.log.read_text()[-3000:]}")
        lines = p.out.read_text().splitlines()
        out[rank] = ([json.loads(x) for x in lines[:-1]], json.loads(lines[-1]))
    return out


def run_trainers(pod, epoch, world_size=None, **request):
    return collect(start_trainers(pod, epoch, world_size or RANKS * len(pod.hosts), **request))


def timed_epoch(pod, epoch, objects=False):
    """An epoch of every rank, with the bucket's stats around it: (read, before, after, took)."""
    before = pod.bucket.stats(objects=objects)
    started = time.monotonic()
    read = run_trainers(pod, epoch)
    took = time.monotonic() - started
    return read, before, pod.bucket.stats(objects=objects), took


def assert_exact(data, tmp_path, read, epoch):
    """Each sample once, webdataset's bytes, in the orders single daemons give."""
    world = RANKS * HOSTS
    got = check_bytes(data, read)
    assert max(got.values()) == 1
    assert {r: keys(s) for r, (s, _) in read.items()} == oracle(data, tmp_path, HOSTS, world, epoch, range(world))


def keys(samples):
    return [(url.rsplit("/", 1)[1], key) for url, key, _ in samples]


def check_bytes(data, read):
    """Every sample read is webdataset's, byte for byte; returns the keys read, counted."""
    got = collections.Counter()
    for samples, _ in read.values():
        for url, key, digest in samples:
            assert data["digests"][key] == digest, f"{key} from {url}: not webdataset's bytes"
            got[key] += 1
    return got


def oracle(data, tmp_path, count, world_size, epoch, ranks, **request):
    """What single daemons of this topology deliver: for each rank in ``ranks``, its host's
    daemon (index rank // (world_size // count) of count) started alone on fake-gcs-server,
    read with the same request. {rank: [(shard, key)]}"""
    per_host = world_size // count
    import shardd

    out = {}
    for host in sorted({r // per_host for r in ranks}):
        d = Daemon(tmp_path, f'[host]\nindex = {host}\ncount = {count}\n'
                   f'[gcs]\nendpoint = "{data["gcs"].endpoint}"\nanonymous = true\n'
                   f'[datasets.pod]\nshards = "{PATTERN}"\nmanifest = "{data["manifest"]}"\nshuffle_buffer = {SHUFFLE}\n',
                   name=f"o{next(ORACLES)}")
        try:
            with shardd.Client(d.socket) as c:
                for rank in [r for r in ranks if r // per_host == host]:
                    r = dict(request)
                    if isinstance(r.get("start"), dict):
                        r["start"] = r["start"][rank]
                    out[rank] = [(x["__url__"].rsplit("/", 1)[1], x["__key__"])
                                 for x in c.stream("pod", epoch=epoch, rank=rank, world_size=world_size,
                                                   seed=SEED, **r)]
        finally:
            d.stop()
    return out


def fetched(before, after):
    """Per host, the shards it downloaded between two stats(objects=True)."""
    out = {}
    for h, (b, a) in enumerate(zip(before["hosts"], after["hosts"])):
        names = {n for n, c in a["gets"].items() if c > b["gets"].get(n, 0) and n.endswith(".tar")}
        if names:
            out[h] = names
    return out


def delta(before, after, key, host=None):
    b = before["totals"] if host is None else before["hosts"][host]
    a = after["totals"] if host is None else after["hosts"][host]
    return a[key] - b[key]


def table(title, pod, read, before, after, seconds):
    """Prints the pod table: per host its first sample, epoch time, longest wait, requests,
    429s and MB; then the pod's slowest host."""
    lines = [f"pod table: {title} ({len(pod.hosts)} hosts, {seconds:.2f} s)",
             "host  first_s  epoch_s  longest_wait_s  requests  429s  401s  MB"]
    per_host = {}
    for rank, (_, end) in read.items():
        per_host.setdefault(rank // RANKS, []).append(end)
    for h in pod.hosts:
        ends = per_host.get(h.index, [])
        if not ends:
            continue
        lines.append(
            f"{h.index:>4}  {max(e['first_sample_seconds'] or 0 for e in ends):7.2f}  "
            f"{max(e['seconds'] for e in ends):7.2f}  {max(e['longest_wait_seconds'] for e in ends):14.2f}  "
            f"{delta(before, after, 'requests', h.index):8}  {delta(before, after, 'throttled', h.index):4}  "
            f"{delta(before, after, 'unauthorized', h.index):4}  {delta(before, after, 'bytes', h.index) / 1e6:6.2f}")
    slowest = max(read.items(), key=lambda kv: kv[1][1]["seconds"])
    lines.append(f"slowest: rank {slowest[0]} at {slowest[1][1]['seconds']:.2f} s; store bytes "
                 f"{delta(before, after, 'bytes') / 1e6:.2f} MB")
    print("\n".join(lines))


# ---- scenarios -------------------------------------------------------------------------------

def test_cold_start_then_a_cached_epoch(pod, data, tmp_path):
    """Every sample once, byte-equal, in the single-daemon orders; each shard fetched by one
    host, the store read 1.00× the dataset; then an epoch from the caches asks the store
    nothing."""
    world = RANKS * HOSTS
    total = sum(data["sizes"].values())
    egress = total / 4  # the pod's share of the network: the epoch's bytes in 4 s at best
    pod.bucket.set_egress(egress)
    try:
        before = pod.bucket.stats(objects=True)
        started = time.monotonic()
        read = run_trainers(pod, epoch=0)
        took = time.monotonic() - started
        after = pod.bucket.stats(objects=True)
    finally:
        pod.bucket.set_egress(None)
    table(f"cold start, egress {egress / 1e6:.1f} MB/s", pod, read, before, after, took)
    bound = delta(before, after, "bytes") / egress
    print(f"cold start: the pod's epoch {took:.2f} s against the egress bound {bound:.2f} s "
          f"({took / bound:.2f}x; trainers start with the epoch)")

    got = check_bytes(data, read)
    assert max(got.values()) == 1 and len(data["digests"]) - len(got) < world
    want = oracle(data, tmp_path, HOSTS, world, 0, range(world))
    assert {r: keys(s) for r, (s, _) in read.items()} == want, "orders differ from single daemons'"
    # Each shard downloaded by the hosts that read it: one, but for the shards whose samples
    # the plan splits across hosts (the rotating leftovers); the store read once more for each
    # extra host.
    readers = collections.defaultdict(set)
    for rank, samples in want.items():
        for shard, _ in samples:
            readers[f"{BUCKET}/pod/{shard}"].add(rank // RANKS)
    downloaders = collections.defaultdict(set)
    for host, names in fetched(before, after).items():
        for n in names:
            downloaders[n].add(host)
    assert downloaders == readers
    shared = {n: len(h) for n, h in readers.items() if len(h) > 1}
    extra = sum(data["sizes"][n] * (k - 1) for n, k in shared.items())
    assert delta(before, after, "bytes") == sum(data["sizes"].values()) + extra
    print(f"store bytes {(sum(data['sizes'].values()) + extra) / sum(data['sizes'].values()):.3f}x the "
          f"dataset: {len(shared)} leftover shards read by {sorted(shared.values())} hosts")
    assert delta(before, after, "unauthorized") == 0

    before = pod.bucket.stats()
    cached = run_trainers(pod, epoch=1)
    after = pod.bucket.stats()
    assert delta(before, after, "requests") == 0, "a cached epoch asked the store"
    got = check_bytes(data, cached)
    assert max(got.values()) == 1 and len(data["digests"]) - len(got) < world


def test_tokens_that_expire_every_few_seconds(pod, data, tmp_path):
    """Each host's metadata server hands out tokens that the bucket takes for 2 s, through a
    cold epoch that the pod's egress stretches over several of them: no request is refused
    for its credentials, and every host renewed its token during the epoch."""
    ttl = 2
    for h in pod.hosts:
        h.set_metadata(h.attributes, token_ttl=ttl)
    pod.restart(wipe=True)
    total = sum(data["sizes"].values())
    pod.bucket.set_egress(total / (4 * ttl))  # an epoch of about 4 token lifetimes
    try:
        issued = [h.tokens_issued() for h in pod.hosts]
        epoch_start = time.time()
        read, before, after, took = timed_epoch(pod, 2)
    finally:
        pod.bucket.set_egress(None)
        for h in pod.hosts:
            h.set_metadata(h.attributes, token_ttl=pod.token_ttl)
    table(f"tokens of {ttl} s", pod, read, before, after, took)
    renewed = [h.tokens_issued() - n for h, n in zip(pod.hosts, issued)]
    print(f"tokens handed out per host during the epoch: {renewed}")
    assert delta(before, after, "unauthorized") == 0, after["totals"]["statuses"]
    # Requests went on after the first tokens expired, and hosts asked for new ones.
    assert after["totals"]["last_request_at"] - epoch_start > ttl, "no request after the first tokens expired"
    assert max(renewed) >= 2, renewed
    assert_exact(data, tmp_path, read, 2)


def test_a_host_replaced_mid_epoch(pod, data, tmp_path):
    """A host is deleted after its trainers saved their state mid-epoch; a new VM with the same
    worker number and an empty cache boots, and its trainers resume: every stream is the one
    single daemons deliver, and only the replaced host's share is fetched again."""
    world, victim, epoch = RANKS * HOSTS, HOSTS // 2 - 1, 3
    want = oracle(data, tmp_path, HOSTS, world, epoch, range(world))
    ranks = range(victim * RANKS, (victim + 1) * RANKS)
    saved = {r: len(want[r]) // 2 for r in ranks}
    share = {f"{BUCKET}/pod/{shard}" for r in ranks for shard, _ in want[r]}
    run_trainers(pod, epoch=epoch - 1)  # every cache warm with its host's share
    before = pod.bucket.stats(objects=True)
    started = time.monotonic()
    others = start_trainers(pod, epoch, world, hosts=[h.index for h in pod.hosts if h.index != victim])
    old = collect(start_trainers(pod, epoch, world, hosts=[victim], tag="-old", stop_after=saved))
    assert {r: old[r][1]["end"] for r in ranks} == saved
    pod.remove(victim)
    (new,) = pod.boot([victim])
    rest = collect(start_trainers(pod, epoch, world, hosts=[victim], tag="-new", start=saved))
    read = collect(others)
    after = pod.bucket.stats(objects=True)
    table(f"host {victim} replaced (boot {new.boot_seconds:.1f} s)", pod, {**read, **rest}, before,
          after, time.monotonic() - started)
    for r in ranks:
        read[r] = (old[r][0] + rest[r][0], rest[r][1])
    got = check_bytes(data, read)
    assert max(got.values()) == 1
    assert {r: keys(s) for r, (s, _) in read.items()} == want
    again = fetched(before, after)
    assert set(again) == {victim}, f"hosts other than {victim} fetched: {again}"
    assert again[victim] <= share, again[victim] - share
    print(f"the new host {victim} fetched {len(again[victim])} of its share's {len(share)} shards")


def test_resize_8_to_4_to_8_mid_epoch(pod, data, tmp_path):
    """8 hosts checkpoint a third into the epoch; 4 of them go on from the trainers' saved
    state (resume_from), checkpoint again half-way, and 8 finish (4 new VMs). The rest of the
    epoch is read exactly once job-wide, in the orders single daemons give; `plan --verify`,
    run before each resize, says the same as what happens; each host fetches only shards it
    lacked."""
    epoch, small = 4, HOSTS // 2
    want8 = oracle(data, tmp_path, HOSTS, RANKS * HOSTS, epoch, range(RANKS * HOSTS))
    k = len(want8[0]) // 3
    origin = {"hosts": HOSTS, "world_size": RANKS * HOSTS, "num_workers": 1, "positions": [k]}
    run_trainers(pod, epoch=epoch - 1)  # caches warm
    had = {h.index: h.holdings() for h in pod.hosts}
    first = run_trainers(pod, epoch, stop_after=k)

    # 8 -> 4: plan --verify first, then the resize (hosts 4.. deleted; 0..3 told by their
    # metadata that the slice has 4 workers, and their daemons restarted).
    verdict = verify(pod.host(0), tmp_path, origin, hosts=small)
    for i in range(small, HOSTS):
        pod.remove(i)
    pod.set_count(small)
    want4 = oracle(data, tmp_path, small, RANKS * small, epoch, range(RANKS * small), resume_from=origin)
    k2 = len(want4[0]) // 2
    assert {len(w) for w in want4.values()} == {verdict["counts"]["rank_min"]} == {verdict["counts"]["rank_max"]}
    before = pod.bucket.stats(objects=True)
    started = time.monotonic()
    second = run_trainers(pod, epoch, RANKS * small, resume_from=origin, stop_after=k2)
    after = pod.bucket.stats(objects=True)
    table(f"resized {HOSTS} -> {small}", pod, second, before, after, time.monotonic() - started)
    report_resize(f"{HOSTS} -> {small}", data, had, fetched(before, after), want4,
                  oracle(data, tmp_path, small, RANKS * small, epoch + 1, range(RANKS * small)))
    ends = [e for _, e in second.values()]
    assert {e["dropped"] for e in ends} == {verdict["planned_dropped"]}
    assert ends[0]["end"] == k2
    assert {r: keys(s) for r, (s, _) in second.items()} == {r: w[:k2] for r, w in want4.items()}

    # 4 -> 8: 4 new VMs boot with empty caches.
    origin2 = {"hosts": small, "world_size": RANKS * small, "num_workers": 1, "positions": [k2],
               "from": origin}
    verdict2 = verify(pod.host(0), tmp_path, origin2, hosts=HOSTS)
    had = {h.index: h.holdings() for h in pod.hosts}
    pod.boot(list(range(small, HOSTS)), count=HOSTS)
    pod.set_count(HOSTS, hosts=range(small))
    want8b = oracle(data, tmp_path, HOSTS, RANKS * HOSTS, epoch, range(RANKS * HOSTS), resume_from=origin2)
    assert {len(w) for w in want8b.values()} == {verdict2["counts"]["rank_min"]}
    before = pod.bucket.stats(objects=True)
    started = time.monotonic()
    third = run_trainers(pod, epoch, resume_from=origin2)
    after = pod.bucket.stats(objects=True)
    table(f"resized {small} -> {HOSTS}", pod, third, before, after, time.monotonic() - started)
    report_resize(f"{small} -> {HOSTS}", data, had, fetched(before, after), want8b,
                  oracle(data, tmp_path, HOSTS, RANKS * HOSTS, epoch + 1, range(RANKS * HOSTS)))
    assert {e["dropped"] for _, e in third.values()} == {verdict2["planned_dropped"]}
    assert {r: keys(s) for r, (s, _) in third.items()} == want8b

    # The epoch, read across both resizes: each sample once, webdataset's bytes, and what the
    # first topology's epoch holds less the drops the certificates planned.
    got = check_bytes(data, {**{("a", r): (s[:k], e) for r, (s, e) in first.items()},
                             **{("b", r): v for r, v in second.items()},
                             **{("c", r): v for r, v in third.items()}})
    assert max(got.values()) == 1
    epoch_keys = {key for w in want8.values() for _, key in w}
    assert set(got) <= epoch_keys
    assert len(epoch_keys) - len(got) == verdict["planned_dropped"] + verdict2["planned_dropped"]


def verify(host, tmp_path, origin, hosts):
    """`shardd plan --verify` of a resize onto ``hosts`` hosts, run on ``host`` with its own
    config and credentials (as an operator would on worker 0)."""
    path = host.root / "origin.json"
    path.write_text(json.dumps(origin))
    out = subprocess.run(host.command([
        str(host.root / "opt/shardd/bin/shardd"), "plan", "--config", str(host.root / "etc/shardd/config.toml"),
        "--dataset", "pod", "--seed", str(SEED), "--epoch", "4", "--verify", "--hosts", str(hosts),
        "--ranks", str(RANKS), "--workers", "1", "--resume-from", str(path), "--json"]),
        # Each retry logged: a failure says what the store answered before it gave up.
        env=host.environment(SHARDD_LOG="warn,shardd::store=debug"), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    v = json.loads(out.stdout)
    assert v["breaches"] == [], v["breaches"]
    return v


def shares(want):
    """Per host, the shards its ranks' streams in ``want`` read."""
    out = collections.defaultdict(set)
    for rank, samples in want.items():
        out[rank // RANKS] |= {f"{BUCKET}/pod/{shard}" for shard, _ in samples}
    return out


def report_resize(title, data, had, fetched_now, want, upcoming):
    """Prints a resize's store bytes against the minimum (each host's shards that its new
    streams read and its cache lacked), and bounds what else a host fetches: the first shards
    of its next epoch (``upcoming``: the next epoch's streams), which the daemon prefetches as
    a stream nears its end; and the shards that filled the shuffle buffers its new streams
    replay (a new stream continues old streams' orders from their checkpoint, so it reads the
    shards of a shuffle window before it, though their samples are another stream's or were
    delivered before the checkpoint): at most a window's shards for each old stream a new one
    continues (two at most: where it starts, and where the next takes over)."""
    need, after = shares(want), shares(upcoming)
    lacked = {h: need[h] - had.get(h, set()) for h in need}
    window = RANKS * 2 * (-(-SHUFFLE // MIN_SAMPLES) + 1)
    replayed = {}
    for h, names in fetched_now.items():
        replayed[h] = names - lacked.get(h, set()) - after[h]
        assert len(replayed[h]) <= window, (
            f"host {h} fetched {sorted(replayed[h])}: more than its streams' shuffle windows")
    size = data["sizes"]
    resize = sum(size[n] for h, names in fetched_now.items() for n in names & lacked.get(h, set()))
    extra = sum(size[n] for names in replayed.values() for n in names)
    ahead = sum(size[n] for h, names in fetched_now.items()
                for n in names - lacked.get(h, set()) - replayed[h])
    minimum = sum(size[n] for names in lacked.values() for n in names)
    print(f"resize {title}: store bytes for the resize {resize / 1e6:.2f} MB against a minimum of "
          f"{minimum / 1e6:.2f} MB, {extra / 1e6:.2f} MB more in "
          f"{sum(map(len, replayed.values()))} shards read to replay shuffle windows, "
          f"{ahead / 1e6:.2f} MB prefetched for the next epoch")


def test_a_straggler_host(pod, data, tmp_path):
    """One host's link at a quarter of the others', through a cold epoch: the pod's epoch is
    exact; the table shows how long the pod waits for the straggler, and what the daemons'
    prefetch absorbed (the trainers' longest wait against their epoch)."""
    slow, epoch = HOSTS - 1, 5
    link = sum(data["sizes"].values()) / HOSTS / 2  # a host's share in about 2 s
    pod.restart(wipe=True)
    for h in pod.hosts:
        pod.bucket.set_host_rate(h.index, link / 4 if h.index == slow else link)
    try:
        read, before, after, took = timed_epoch(pod, epoch)
    finally:
        for h in pod.hosts:
            pod.bucket.set_host_rate(h.index, None)
    table(f"host {slow}'s link at a quarter ({link / 1e6:.2f} MB/s, its at {link / 4e6:.2f})", pod,
          read, before, after, took)
    times = sorted(e["seconds"] for r, (_, e) in read.items() if r // RANKS != slow)
    straggler = max(e["seconds"] for r, (_, e) in read.items() if r // RANKS == slow)
    print(f"straggler: the pod waits {straggler - times[len(times) // 2]:.2f} s for host {slow} "
          f"(its epoch {straggler:.2f} s, the others' median {times[len(times) // 2]:.2f} s)")
    assert_exact(data, tmp_path, read, epoch)


def test_split_index_over_the_pod(pod, data):
    """`shardd index --part i/N` on every host (its own credentials, through the bucket), then
    one `--merge` on worker 0: the manifest is byte-equal to a single host's index; a part
    run again reuses its entries."""
    parts = f"gs://{BUCKET}/pod/parts/pod.{{0..{HOSTS - 1}}}-of-{HOSTS}.json"

    def index(host, *args):
        return host.spawn(f"index-{time.monotonic_ns()}", [
            str(host.root / "opt/shardd/bin/shardd"), "index", PATTERN, *args,
            "--config", str(host.root / "etc/shardd/config.toml")])

    def finished(p):
        assert p.wait(timeout=300) == 0, p.log.read_text()
        return p.log.read_text()

    # Each host's link reads the dataset in 2 s: what splitting the index divides.
    link = sum(data["sizes"].values()) / 2
    for h in pod.hosts:
        pod.bucket.set_host_rate(h.index, link)
    try:
        started = time.monotonic()
        finished(index(pod.host(0), "-o", f"gs://{BUCKET}/pod/single.json"))
        one = time.monotonic() - started
        started = time.monotonic()
        runs = [index(h, "--part", f"{h.index}/{HOSTS}", "-o",
                      f"gs://{BUCKET}/pod/parts/pod.{h.index}-of-{HOSTS}.json") for h in pod.hosts]
        logs = [finished(p) for p in runs]
        split = time.monotonic() - started
    finally:
        for h in pod.hosts:
            pod.bucket.set_host_rate(h.index, None)
    merged = finished(index(pod.host(0), "-o", f"gs://{BUCKET}/pod/merged.json", "--merge", parts))
    assert f"(merged from {HOSTS} parts)" in merged, merged
    with urllib.request.urlopen(f"{data['gcs'].endpoint}/{BUCKET}/pod/merged.json") as r:
        assert r.read() == data["manifest"].read_bytes(), "the merged manifest is not a single host's"
    with urllib.request.urlopen(f"{data['gcs'].endpoint}/{BUCKET}/pod/single.json") as r:
        assert r.read() == data["manifest"].read_bytes()
    counts = [int(log.split(" shards (part ", 1)[0].rsplit(": ", 1)[1]) for log in logs]
    assert sum(counts) == SHARDS and max(counts) - min(counts) <= 1, counts
    again = finished(index(pod.host(HOSTS - 1), "--part", f"{HOSTS - 1}/{HOSTS}", "-o",
                           f"gs://{BUCKET}/pod/parts/pod.{HOSTS - 1}-of-{HOSTS}.json"))
    assert f"({counts[-1]} entries reused)" in again, again
    print(f"index of {SHARDS} shards, each host's link at {link / 1e6:.1f} MB/s: one host {one:.2f} s, "
          f"{HOSTS} hosts {split:.2f} s ({one / split:.2f}x of {HOSTS}x; one 2-core machine runs "
          "every host)")


def test_gke_identity_one_config_for_every_host(pod, data, tmp_path):
    """The same pod with host.index = "from-clients" (GKE: one config for every node, no
    worker number in the metadata): each daemon learns its host from its first stream, and the
    epoch is the one fixed indices give."""
    epoch = 6
    config = CONFIG + f'[host]\nindex = "from-clients"\ncount = {HOSTS}\n'
    try:
        for h in pod.hosts:
            attributes = pod.attributes(h.index, HOSTS, config)
            del attributes["agent-worker-number"]
            h.set_metadata(attributes)
            h.stop_daemon()
            h.run_startup_script()
        pod.restart(wipe=True)
        read = run_trainers(pod, epoch)
        assert [h.metric("shardd_host_index") for h in pod.hosts] == list(range(HOSTS))
    finally:
        for h in pod.hosts:
            h.set_metadata(pod.attributes(h.index, HOSTS))
            h.stop_daemon()
            h.run_startup_script()
        pod.restart()
    assert_exact(data, tmp_path, read, epoch)


def test_prometheus_sees_the_pod_and_the_throttling(pod, data, tmp_path):
    """One Prometheus scrapes every host across the namespaces with the shipped rules: the
    pod's series (the slowest host's stall, store bytes per host) are there, and a cold epoch
    against a bucket at a fraction of the pod's request rate, answering 503 for its first
    2 s, puts ShardStoreThrottled in pending (its `for:` is 10 minutes) while the epoch stays
    exact: the trainers wait through both."""
    epoch = 7
    prometheus = Prometheus(tmp_path, [f"{h.address}:{podlib.METRICS_PORT}" for h in pod.hosts])
    try:
        wait_for(lambda: len(prometheus.query('up{job="shardd"} == 1')) == HOSTS, "every host scraped", 60)
        pod.restart(wipe=True)
        pod.bucket.set_rate_limit(SHARDS / 8)  # the cold epoch's requests over about 8 s
        pod.bucket.outage_for("503", 2)  # and a bucket away as the epoch starts
        try:
            read, before, after, took = timed_epoch(pod, epoch)
        finally:
            pod.bucket.set_rate_limit(None)
        table(f"a bucket at {SHARDS / 8:g} requests/s, 503 for its first 2 s", pod, read, before, after, took)
        assert delta(before, after, "throttled") > 0 and delta(before, after, "unavailable") > 0
        alerts = wait_for(lambda: [a for a in prometheus.get("/api/v1/alerts")["alerts"]
                                   if a["labels"]["alertname"] == "ShardStoreThrottled"],
                          "ShardStoreThrottled pending", 60)
        assert {a["state"] for a in alerts} <= {"pending", "firing"}, alerts
        per_host = wait_for(lambda: prometheus.query("shardd:store_bytes:rate5m > 0"), "bytes per host", 30)
        slowest = wait_for(lambda: prometheus.query("shardd:pod_slowest_stream_wait_seconds:rate5m"),
                           "the slowest host's stall", 30)
        print(f"Prometheus: ShardStoreThrottled {sorted(a['state'] for a in alerts)} on "
              f"{len(alerts)} hosts; store bytes/s per host over 5m: "
              f"{sorted(round(float(s['value'][1])) for s in per_host)}; slowest host's stall: "
              f"{[s['value'][1] for s in slowest]} s/s")
        assert len(per_host) == HOSTS
    finally:
        prometheus.stop()
    assert_exact(data, tmp_path, read, epoch)


class Prometheus:
    """The real Prometheus (Debian's package) on loopback, scraping ``targets`` every second
    with deploy/prometheus/shardd-rules.yml, evaluated every second."""

    def __init__(self, tmp_path, targets):
        import shutil

        from conftest import ROOT, free_port

        directory = tmp_path / "prometheus"
        directory.mkdir()
        shutil.copy(ROOT / "deploy/prometheus/shardd-rules.yml", directory)
        (directory / "prometheus.yml").write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "rule_files:\n  - shardd-rules.yml\n"
            "scrape_configs:\n  - job_name: shardd\n    static_configs:\n"
            f"      - targets: {json.dumps(targets)}\n")
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = open(directory / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [shutil.which("prometheus") or "/usr/bin/prometheus",
             f"--config.file={directory / 'prometheus.yml'}", f"--storage.tsdb.path={directory / 'data'}",
             f"--web.listen-address={self.url[len('http://'):]}"],
            stdout=self.log, stderr=subprocess.STDOUT)
        wait_for(self.ready, "Prometheus to answer", 60)

    def ready(self):
        if self.proc.poll() is not None:
            raise RuntimeError(f"prometheus exited: {open(self.log.name).read()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def get(self, path):
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, promql):
        return self.get("/api/v1/query?query=" + urllib.parse.quote(promql))["result"]

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()
