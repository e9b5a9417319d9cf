"""Weighted mixing (`[datasets.NAME] mix = {...}`) through the real daemon: every prefix of a
mixed stream holds each source within ±1 of its weight, in a deterministic order that is not a
fixed pattern; each source is read as its own exact stream; samples are webdataset's bytes and
say their source; `start=` resumes exactly; per-source metrics; config errors."""

import collections
import subprocess

import pytest
import shardd

from conftest import SHARDD, reference_samples, wait_for

E = 100  # samples per stream per epoch: quotas web 75, books 25
WEIGHTS = {"books": 1, "web": 3}


@pytest.fixture(scope="module")
def mix_config(train_paths, tmp_path_factory):
    """web: train shards 0-7, books: 8-11, each with a manifest; `both` mixes them 3:1."""
    root = tmp_path_factory.mktemp("mix")
    d = train_paths[0].parent
    sections = []
    for name, pattern in [("web", "train-{000000..000007}.tar"), ("books", "train-{000008..000011}.tar")]:
        manifest = root / f"{name}.manifest.json"
        run = subprocess.run([SHARDD, "index", f"{d}/{pattern}", "-o", str(manifest)],
                             capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        sections.append(f'[datasets.{name}]\nshards = "{d}/{pattern}"\nmanifest = "{manifest}"\n'
                        f"shuffle_buffer = 10\n")
    return ("[host]\nindex = 0\ncount = 1\n" + "".join(sections)
            + f"[datasets.both]\nmix = {{ web = 3, books = 1 }}\nsamples_per_epoch = {E}\n")


def read(d, start=0, **kw):
    args = dict(epoch=0, rank=0, world_size=1, worker=0, num_workers=1, seed=2)
    args.update(kw)
    with shardd.Client(d.socket) as c:
        s = c.stream("both", start=start, **args)
        return [dict(x) for x in s], s


def test_mixed_streams_keep_their_proportions_in_every_prefix(make_daemon, mix_config,
                                                              train_paths):
    d = make_daemon(mix_config)
    want = reference_samples(train_paths)
    web = {k for k in reference_samples(train_paths[:8])}
    samples, stream = read(d)
    assert len(samples) == stream.samples == E
    sources = [s["__source__"] for s in samples]
    for s in samples:
        assert {k: v for k, v in s.items() if not k.startswith("__")} == want[s["__key__"]]
        assert (s["__key__"] in web) == (s["__source__"] == "web")
    total = sum(WEIGHTS.values())
    count = collections.Counter()
    for n, source in enumerate(sources, 1):
        count[source] += 1
        for name, w in WEIGHTS.items():
            assert abs(count[name] - w * n / total) <= 1, (n, count)
    quotas = {s["dataset"]: s["samples"] for s in stream.start_fields["sources"]}
    assert quotas == {"web": 75, "books": 25} == dict(count)
    # Not a fixed pattern: another stream (worker) interleaves differently, the same one again
    # identically.
    other = [s["__source__"] for s in read(d, worker=1, num_workers=2)[0]]
    assert other != sources[:len(other)]
    assert [s["__source__"] for s in read(d)[0]] == sources


def test_each_source_is_read_as_its_own_exact_stream(make_daemon, mix_config, train_paths):
    """Stream s of epoch e reads source i's samples (e·S + s)·A_i onwards of the source's
    endless sequence (pass 0, pass 1, ...): read in that order, the first pass holds every
    sample of the source once, and the next pass starts only then."""
    d = make_daemon(mix_config)
    size = {"web": len(reference_samples(train_paths[:8])),
            "books": len(reference_samples(train_paths[8:]))}
    seq = collections.defaultdict(list)
    for epoch in range(4):
        for worker in range(2):
            samples, stream = read(d, epoch=epoch, worker=worker, num_workers=2)
            by_source = collections.defaultdict(list)
            for s in samples:
                by_source[s["__source__"]].append(s["__key__"])
            for name, keys in by_source.items():
                # A window shuffle reorders within the stream: compare as sets per chunk.
                seq[name].append(keys)
    for name, n in size.items():
        flat = [k for chunk in seq[name] for k in chunk]
        assert len(flat) > n, f"the test wants {name} to wrap into its next pass"
        # Chunks that lie wholly in the first pass hold distinct samples; together with the
        # chunk that crosses into pass 1, every sample of the source appears.
        first, at = [], 0
        for chunk in seq[name]:
            if at + len(chunk) > n:
                break
            first.extend(chunk)
            at += len(chunk)
        assert len(set(first)) == len(first), name
        assert len(set(flat)) == n, name
    passes = {s["dataset"]: s["pass"] for s in read(d, epoch=3, worker=1, num_workers=2)[1]
              .start_fields["sources"]}
    assert passes["books"] == (7 * 25) // size["books"]
    assert passes["web"] == (7 * 75) // size["web"]


def test_a_mixed_stream_resumes_exactly_and_counts_per_source(make_daemon, mix_config):
    d = make_daemon(mix_config)
    full, _ = read(d, epoch=3)
    for start in (0, 1, 37, 71, E - 1, E):
        assert [s["__key__"] for s in read(d, start=start, epoch=3)[0]] == \
            [s["__key__"] for s in full[start:]]
    sent = {name: d.metric(f'shardd_samples_sent_total{{dataset="{name}"}}') for name in WEIGHTS}
    assert sent["web"] > 0 and sent["books"] > 0
    assert sum(sent.values()) == sum(E - s for s in (0, 0, 1, 37, 71, E - 1, E))


@pytest.mark.parametrize("section, message", [
    ('[datasets.bad]\nmix = { web = 3, nope = 1 }\nsamples_per_epoch = 5\n',
     'mix source "nope" is not a dataset of this config'),
    ('[datasets.bad]\nmix = { web = 3, books = 0 }\nsamples_per_epoch = 5\n',
     'mix weight of "books" must be at least 1'),
    ('[datasets.bad]\nmix = { web = 3, books = 1 }\n', "a mix needs samples_per_epoch"),
    ('[datasets.bad]\nmix = { web = 3 }\nsamples_per_epoch = 5\n', "at least two sources"),
    ('[datasets.plain]\nshards = "/nonexistent/x.tar"\n'
     '[datasets.bad]\nmix = { web = 3, plain = 1 }\nsamples_per_epoch = 5\n',
     'mix source "plain" needs a manifest'),
    ('[datasets.bad]\nmix = { web = 3, books = 1 }\nsamples_per_epoch = 5\n'
     'schedule = [{ epoch = 2, mix = { web = 1 } }]\n',
     "schedule entry epoch = 2 must weigh the mix's sources, all of them: books, web"),
    ('[datasets.bad]\nmix = { web = 3, books = 1 }\nsamples_per_epoch = 5\n'
     'schedule = [{ epoch = 2, mix = { web = 1, books = 1 } }, { epoch = 2, mix = { web = 1, books = 2 } }]\n',
     "schedule entries must increase (epoch = 2 after epoch = 2)"),
    ('[datasets.bad]\nmix = { web = 3, books = 1 }\nsamples_per_epoch = 5\n'
     'schedule = [{ at = 10, mix = { web = 1, books = 1 } }, { epoch = 2, mix = { web = 1, books = 2 } }]\n',
     "a schedule is keyed by epochs or by samples, not both (epoch = 2 after at = 10)"),
    ('[datasets.bad]\nmix = { web = 3, books = 1 }\nsamples_per_epoch = 5\n'
     'schedule = [{ at = 0, mix = { web = 1, books = 1 } }]\n',
     "the weights from the start are given twice, by mix and by the schedule's at = 0 entry"),
    ('[datasets.bad]\nsamples_per_epoch = 5\nschedule = [{ at = 10, mix = { web = 1, books = 1 } }]\n',
     "a schedule needs the weights from the start: mix = { ... }, or a first entry at = 0"),
    ('[datasets.bad]\nmix = { web = 3, books = 1 }\nsamples_per_epoch = 5\n'
     'schedule = [{ at = 10, epoch = 1, mix = { web = 1, books = 1 } }]\n',
     "a schedule entry starts at an epoch or at a job-wide sample: epoch = N or at = N, one of them"),
    ('[datasets.bad]\nmix = { web = 3, books = 1 }\nsamples_per_epoch = 5\nschedule = ['
     + ", ".join(f"{{ at = {n}, mix = {{ web = 1, books = 1 }} }}" for n in range(1, 10_002)) + "]\n",
     "a schedule has at most 10000 entries, this one 10001"),
], ids=["unknown", "zero-weight", "no-length", "one-source", "no-manifest", "schedule-sources",
        "schedule-order", "schedule-kinds", "schedule-twice", "schedule-no-start", "schedule-both-keys",
        "schedule-too-long"])
def test_bad_mixes_are_config_errors(mix_config, tmp_path, section, message):
    config = tmp_path / "c.toml"
    config.write_text(mix_config + section)
    run = subprocess.run([SHARDD, "check", "--no-store", "--config", str(config)],
                         capture_output=True, text=True)
    assert run.returncode != 0 and message in run.stderr, run.stderr


@pytest.mark.parametrize("schedule", [
    "",
    # At the old 4 streams, step 127: position 27 of epoch 1, between the two workers'
    # checkpoint positions.
    "schedule = [{ at = 508, mix = { books = 1, web = 1 } }]\n",
], ids=["plain", "across-a-schedule-change"])
def test_a_mix_resumes_on_another_topology(make_daemon, mix_config, schedule):
    """2 hosts × 1 rank × 2 workers checkpointed mid-epoch, finished on 1 host × 3 ranks: per
    source, what was taken plus what is read is the epoch's samples once each, but the
    reported drops, as many on every new rank. With a schedule change inside the epoch, one
    old worker checkpointed before it and the other after."""
    header = "[host]\nindex = 0\ncount = 1\n"
    mix_config += schedule
    body = mix_config[len(header):]
    old = [make_daemon(f"[host]\nindex = {h}\ncount = 2\n" + body, name=f"old{h}") for h in range(2)]
    want, got = collections.Counter(), collections.Counter()
    positions = [30, 25]
    for h, d in enumerate(old):
        for w in range(2):
            samples, stream = read(d, epoch=1, rank=h, world_size=2, worker=w, num_workers=2)
            assert len(stream.start_fields["segments"]) == (2 if schedule else 1)
            keys = [(s["__source__"], s["__key__"]) for s in samples]
            want.update(keys)
            got.update(keys[:positions[w]])
    new = make_daemon(mix_config, name="new")
    origin = {"hosts": 2, "world_size": 2, "num_workers": 2, "positions": positions}
    per_rank, dropped = {}, set()
    for rank in range(3):
        samples, stream = read(new, epoch=1, rank=rank, world_size=3, resume_from=origin)
        per_rank[rank] = collections.Counter(s["__source__"] for s in samples)
        got.update((s["__source__"], s["__key__"]) for s in samples)
        dropped.add(stream.dropped)
        assert stream.samples == len(samples)
    assert not got - want, "a sample read more often than the epoch has it"
    assert len({tuple(sorted(c.items())) for c in per_rank.values()}) == 1, per_rank
    assert dropped == {sum((want - got).values())} and dropped.pop() < 2 * 3


def test_a_mix_resumes_through_the_stateful_dataloader(make_daemon, mix_config):
    import shardd.torch as st
    from torchdata.stateful_dataloader import StatefulDataLoader

    d = make_daemon(mix_config)

    def loader():
        ds = st.ShardDataset("both", socket=d.socket, seed=2, check_plan=False)
        ds.set_epoch(4)
        return StatefulDataLoader(ds, batch_size=6, num_workers=2,
                                  collate_fn=lambda b: [(s["__source__"], s["__key__"]) for s in b])

    full = list(loader())
    first = loader()
    it = iter(first)
    head = [next(it) for _ in range(9)]
    state = first.state_dict()
    del it
    again = loader()
    again.load_state_dict(state)
    assert head + list(again) == full


def test_a_curriculum_changes_the_weights_and_each_source_continues(make_daemon, mix_config,
                                                                    train_paths):
    """`schedule = [{ epoch = 2, mix = {...} }]`: from epoch 2 the quotas follow the new
    weights, and each source goes on from where epochs 0-1 left it in its sequence (books,
    read faster from epoch 2, still reads every sample of its first pass once before any
    twice)."""
    d = make_daemon(mix_config + "schedule = [{ epoch = 2, mix = { books = 1, web = 1 } }]\n")
    books = len(reference_samples(train_paths[8:]))
    chunks = []
    for epoch in range(4):
        for worker in range(2):
            samples, stream = read(d, epoch=epoch, worker=worker, num_workers=2)
            quotas = {s["dataset"]: s["samples"] for s in stream.start_fields["sources"]}
            assert quotas == ({"web": 75, "books": 25} if epoch < 2 else {"web": 50, "books": 50})
            chunks.append([s["__key__"] for s in samples if s["__source__"] == "books"])
    flat = [k for c in chunks for k in c]
    assert len(flat) == 2 * 25 * 2 + 2 * 50 * 2 > books
    # Read back to back, the chunks are samples 0..len(flat) of the source's endless sequence
    # of passes: every sample `full` or `full + 1` times, `extra` of them once more. A jump
    # at the weight change would leave part of a pass unread and read others more often.
    full, extra = divmod(len(flat), books)
    times = collections.Counter(collections.Counter(flat).values())
    assert times == ({full: books - extra, full + 1: extra} if extra else {full: books}), times


# One job-wide sample index for the schedule tests: at 1 host × 1 rank × 2 workers (2 streams),
# `at = 260` is step 130: position 30 of epoch 1.
AT = 260
SCHEDULE = f"schedule = [{{ at = {AT}, mix = {{ books = 1, web = 1 }} }}]\n"


def check_segments(samples, segments):
    """Each segment (START's) holds each source within ±1 of its weights in every prefix
    counted from its start; returns each segment's counts."""
    out = []
    for j, seg in enumerate(segments):
        end = segments[j + 1]["position"] if j + 1 < len(segments) else len(samples)
        total = sum(seg["mix"].values())
        count = collections.Counter()
        for n, s in enumerate(samples[seg["position"]:end], 1):
            count[s["__source__"]] += 1
            for name, w in seg["mix"].items():
                assert abs(count[name] - w * n / total) <= 1, (j, n, count)
        out.append(count)
    return out


def test_a_schedule_changes_the_weights_inside_an_epoch(make_daemon, mix_config, train_paths):
    """`schedule = [{ at = N, mix = {...} }]` keyed by the job-wide sample: the weights change at
    the first step where the job has read N samples, inside an epoch. START lists the epoch's
    segments; the ±1 bound holds in each from its start; each source's samples continue its
    passes exactly across the change; `start=` resumes across it are exact; the metric says
    which entry the streams are in."""
    d = make_daemon(mix_config + SCHEDULE)
    first, second = {"books": 1, "web": 3}, {"books": 1, "web": 1}
    want_segments = {
        0: [{"position": 0, "entry": 0, "mix": first}],
        1: [{"position": 0, "entry": 0, "mix": first}, {"position": 30, "entry": 1, "mix": second}],
        2: [{"position": 0, "entry": 1, "mix": second}],
    }
    books = len(reference_samples(train_paths[8:]))
    chunks = []
    for epoch in range(4):
        for worker in range(2):
            samples, stream = read(d, epoch=epoch, worker=worker, num_workers=2)
            segments = stream.start_fields["segments"]
            assert segments == want_segments.get(epoch, want_segments[2])
            counts = check_segments(samples, segments)
            quotas = {s["dataset"]: s["samples"] for s in stream.start_fields["sources"]}
            assert quotas == dict(sum(counts, collections.Counter()))
            if epoch == 1:
                # 30 positions at 3:1 (books 7.5 rounds up), then 70 at 1:1.
                assert counts == [{"books": 8, "web": 22}, {"books": 35, "web": 35}]
                assert d.metric('shardd_mix_schedule_entry{dataset="both"}') == 1
            chunks.append([s["__key__"] for s in samples if s["__source__"] == "books"])
    # Read back to back, books' chunks are samples 0.. of its endless sequence of passes:
    # every sample `full` or `full + 1` times (no jump at the change).
    flat = [k for c in chunks for k in c]
    full, extra = divmod(len(flat), books)
    assert full >= 1
    times = collections.Counter(collections.Counter(flat).values())
    assert times == ({full: books - extra, full + 1: extra} if extra else {full: books}), times
    # `start=` resumes on either side of the change read what the unbroken stream read.
    whole, _ = read(d, epoch=1, worker=1, num_workers=2)
    for start in (29, 30, 31, 77):
        rest, stream = read(d, start=start, epoch=1, worker=1, num_workers=2)
        assert [s["__key__"] for s in rest] == [s["__key__"] for s in whole[start:]]
        assert stream.start_fields["segment"] == (0 if start < 30 else 1)


def test_shardd_plan_says_where_a_schedule_changes_the_weights(mix_config, tmp_path):
    """`shardd plan --dataset MIX`: where each entry lands at the job's topology (the same
    `at` is another position at another job size), and the epoch's segments with their
    quotas, which are the daemon's (test above)."""
    config = tmp_path / "c.toml"
    config.write_text(mix_config + SCHEDULE)

    def plan(workers, *extra):
        run = subprocess.run([SHARDD, "plan", "--config", str(config), "--hosts", "1", "--ranks", "1",
                              "--workers", str(workers), "--dataset", "both", *extra],
                             capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        return run.stdout

    text = plan(2, "--epoch", "1")
    assert "entry 1 (at = 260, { books = 1, web = 1 }): from step 130, epoch 1 position 30, " \
           "after 260 samples job-wide" in text, text
    assert "from position 0 under entry 0: books 8, web 22 per stream" in text
    assert "from position 30 under entry 1: books 35, web 35 per stream" in text
    import json
    wide = json.loads(plan(4, "--json"))
    assert wide["streams"] == 4
    assert [(e["entry"], e["epoch"], e["position"], e["job_samples"]) for e in wide["entries"]] == \
        [(0, 0, 0, 0), (1, 0, 65, 260)]
    assert [(s["position"], s["entry"]) for s in wide["segments"]] == [(0, 0), (65, 1)]


def test_a_schedule_is_part_of_the_plan_and_later_entries_may_change(make_daemon, mix_config):
    """The epoch's segments are in its plan fingerprint: an entry moved inside an epoch changes
    that epoch's fingerprint (a resume of it is refused as a changed plan); an entry added for a
    later epoch changes nothing of the epochs before it."""
    def fingerprints(schedule, name):
        d = make_daemon(mix_config + schedule, name=name)
        out = []
        for epoch in range(3):
            with shardd.Client(d.socket) as c:
                out.append(c.stream("both", epoch=epoch, rank=0, world_size=1, worker=0,
                                    num_workers=2, seed=2).fingerprint)
        return out

    base = fingerprints(SCHEDULE, "base")
    moved = fingerprints(SCHEDULE.replace(str(AT), str(AT + 20)), "moved")
    later = fingerprints(SCHEDULE.replace("]\n", ", { at = 500, mix = { books = 3, web = 1 } }]\n"),
                         "later")
    assert moved[0] == base[0] and moved[1] != base[1]
    assert later[:2] == base[:2] and later[2] != base[2]


@pytest.fixture(scope="module")
def big_mix(tmp_path_factory):
    """A 3:1 mix of two datasets of ~100 KB samples (so frames fill the socket and a pause
    past the stall timeout cuts one), each with a manifest."""
    import random

    import webdataset as wds

    root = tmp_path_factory.mktemp("bigmix")
    rng = random.Random(23)
    sections = []
    for name, shards in [("web", 12), ("books", 6)]:
        for s in range(shards):
            with wds.TarWriter(str(root / f"{name}-{s:02d}.tar")) as sink:
                for i in range(40):
                    sink.write({"__key__": f"{name}{s}/{i:03d}", "bin": rng.randbytes(rng.randint(60_000, 140_000)),
                                "cls": str(i % 5).encode()})
        pattern = f"{root}/{name}-{{00..{shards - 1:02d}}}.tar"
        manifest = root / f"{name}.manifest.json"
        run = subprocess.run([SHARDD, "index", pattern, "-o", str(manifest)], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        sections.append(f'[datasets.{name}]\nshards = "{pattern}"\nmanifest = "{manifest}"\nshuffle_buffer = 12\n')
    return ("[host]\nindex = 0\ncount = 1\n" + "".join(sections)
            + "[datasets.both]\nmix = { web = 3, books = 1 }\nsamples_per_epoch = 600\n")


def pause(d, at):
    """A trainer's pause (an evaluation pass): until the daemon parks the stream (or has it
    parked still), or has sent all of it (zero copy's frames are mostly descriptors: the
    rest of a stream can fit in the socket)."""
    parks = d.metric("shardd_stream_parks_total")
    wait_for(lambda: (d.metric("shardd_stream_parks_total") > parks or d.metric("shardd_streams_parked") == 1
                      or d.metric("shardd_samples_sent_total") == 1200), f"a park after sample {at}")


def test_a_mix_paused_past_the_stall_timeout_is_not_cut(make_daemon, big_mix, delivery):
    """A park re-encodes the frame it cut from the stream's position. A mix's frame ended where
    a lane had no window cut yet, and after a park every lane starts with none, so the frame
    ended elsewhere and the daemon closed the connection mid-stream (3 of 3 pauses). Paused
    three times past `stall_timeout`, with reconnecting off, the mix reads on unbroken: the
    same samples in the same order as without a pause."""
    d = make_daemon(big_mix, server='stall_timeout = "1s"')
    args = dict(epoch=0, rank=0, world_size=1, seed=4)
    with shardd.Client(d.socket, zero_copy=delivery) as c:
        want = [(x["__key__"], bytes(x["bin"])) for x in c.stream("both", **args)]
    assert len(want) == 600
    got = []
    with shardd.Client(d.socket, zero_copy=delivery, reconnect_timeout=0, readahead=0) as c:
        s = c.stream("both", **args)
        for n, x in enumerate(s):
            got.append((x["__key__"], bytes(x["bin"])))
            if n + 1 in (7, 150, 300):
                pause(d, n + 1)
    assert got == want
    parks = d.metric("shardd_stream_parks_total")
    assert parks == 3 if not delivery else 1 <= parks <= 3
    # The daemon counts a stream's outcome after its END: both may have reached the client first.
    wait_for(lambda: d.metric('shardd_streams_total{dataset="both",outcome="completed"}') == 2,
             "both streams to be counted completed")
