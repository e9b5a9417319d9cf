"""The Google Cloud write-up's A/B/C experiment, input pipeline only, plus shardd (issue 27).

Run on demand; a benchmark, not a test: it asserts nothing and prints figures and ratios.

The write-up (the project's background notes, "Published results") trained ResNet-50 on ImageNet from
(A) loose local files, (B) local tar shards through webdataset and (C) the shards streamed
from GCS through webdataset ``pipe:`` URLs, and found C as fast as A. This script measures
the part of that which does not need an accelerator: the DataLoader's input pipeline, fed to a
trainer that only takes the batches (no model). Every configuration runs the same per-sample
code in ``--workers`` DataLoader worker processes, batches of 128:

    decode the JPEG (PIL) -> RandomResizedCrop(224) -> horizontal flip (p = 0.5)
    -> normalise (ImageNet mean/std) -> a 3x224x224 float tensor

implemented with PIL + numpy + torch (torchvision's recipe: scale 0.08-1, ratio 3/4-4/3, ten
tries then a centre crop), seeded per sample: from shardd's ``__seed__`` with shardd, else
from the same function of the sample's key and the epoch.

Data: ``--images`` JPEGs of 400-500 px, ~110 KB each (a smooth random colour field plus
grain, quality 90: ImageNet-like sizes), made with Pillow and kept under ``--data``: as loose
files (plus a .cls label each) and as webdataset tars (``webdataset.TarWriter``,
``--per-shard`` images each). The "object store" is fake-gcs-server behind
the bucket emulator (bench/gcs_store.py: 50 ms to the first byte, 100 MB/s per connection:
GCS-like).

Configurations (each run for ``--epochs`` epochs):

  A       loose files, random access: a map-style Dataset over the file paths, shuffled;
  B       the local tars through webdataset (shard shuffle, .shuffle(1000));
  C       the same tars from the store through webdataset ``pipe:curl -s URL`` (as the
          write-up's ``pipe:gsutil cat``): every epoch downloads every shard again;
  D       shardd (a fresh daemon, cold cache, ``[gcs] endpoint`` = the store) through
          ``shardd.torch.ShardDataset`` and torchdata's StatefulDataLoader, socket delivery;
  D-zc    the same with ``zero_copy=True`` (fields are memoryviews of the daemon's cache
          files, decoded in the worker);
  D-pipe  webdataset exactly as in C but with ``pipe:shardd get --socket SOCK gs://...``
          (a fresh daemon again: its first epoch downloads, the next read its cache).

  E       litData: the same images in litData's own chunk format (``litdata.optimize``, chunks
          the size of the tars) in the same store, read through its GCS downloader
          (google-cloud-storage, ``STORAGE_EMULATOR_HOST`` = the store) by ``StreamingDataset``
          and ``StreamingDataLoader`` (shuffled, a fresh cache directory: epoch 1 cold). Run
          when litdata and google-cloud-storage are installed (bench/requirements.txt, which
          scripts/test.sh installs); otherwise skipped with a line that says so.

Per configuration and epoch it prints images/s, CPU-seconds per image of all the processes
that do the work (the trainer, its loader workers and what they spawn - curl, shardd get -
from getrusage, plus the daemon from /proc; the store's processes are not counted), the
store's requests and bytes (the emulator's counters), and the time to the first batch. After the
last epoch it measures the time to the first batch of a mid-epoch resume (half the epoch
done): A drops the first half of the epoch's shuffled index list; B, C and D-pipe skip the
samples already seen (``.slice(n)`` per worker before decoding: what a webdataset user does,
which still reads them); D and D-zc load the StatefulDataLoader state taken mid-epoch (exact), and E its
StreamingDataLoader's state.

    .venv/bin/python bench/blog_experiment.py                 # 4000 images, 2 epochs (3000 took 4 min idle)
    .venv/bin/python bench/blog_experiment.py --quick         # 256 small images, 1 epoch: CI
    .venv/bin/python bench/blog_experiment.py --shardd /path/to/shardd --workers 2
"""

import argparse
import io
import multiprocessing
import os
import pathlib
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import source_client  # noqa: E402  (before shardd: the client of this tree, its decoder)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.utils.data  # noqa: E402
import webdataset as wds  # noqa: E402
from PIL import Image  # noqa: E402

from gcs_store import Store, wait_for  # noqa: E402
import shardd.torch  # noqa: E402
from shardd._seeds import sample_seed  # noqa: E402

BUCKET = "bkt"
PREFIX = "blog"
LITDATA_PREFIX = "blog-litdata"
BATCH = 128
SEED = 0
CROP = 224
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32) * 255
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32) * 255
TICK = os.sysconf("SC_CLK_TCK")


# -- data -------------------------------------------------------------------------------------

def make_jpeg(index, lo, hi):
    """One ImageNet-like JPEG (bytes): lo..hi px a side, a smooth random colour field plus
    luma grain, quality 90 (~110 KB at 400-500 px)."""
    rng = np.random.default_rng(index)
    w, h = (int(x) for x in rng.integers(lo, hi + 1, 2))
    base = Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)).resize((w, h), Image.BICUBIC)
    grain = rng.normal(0, 24, (h, w, 1)).astype(np.int16)
    pixels = np.clip(np.asarray(base, dtype=np.int16) + grain, 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=90)
    return out.getvalue()


def _make_one(job):
    index, lo, hi = job
    return make_jpeg(index, lo, hi)


def generate(data, images, per_shard, lo, hi):
    """Loose files under data/files, tars under data/store/BUCKET/PREFIX (the store's root is
    data/store). Made once per (images, per_shard, sizes); returns (file paths, tar paths)."""
    done = data / "done"
    files_dir, tar_dir = data / "files", data / "store" / BUCKET / PREFIX
    shards = -(-images // per_shard)
    tars = [tar_dir / f"train-{i:06d}.tar" for i in range(shards)]
    files = [files_dir / f"img{i:06d}.jpg" for i in range(images)]
    if done.exists():
        return files, tars
    shutil.rmtree(data, ignore_errors=True)
    files_dir.mkdir(parents=True)
    tar_dir.mkdir(parents=True)
    print(f"generating {images} JPEGs under {data} ...", flush=True)
    sinks = [wds.TarWriter(str(t)) for t in tars]
    with multiprocessing.get_context("fork").Pool(len(os.sched_getaffinity(0))) as pool:
        jobs = [(i, lo, hi) for i in range(images)]
        for i, jpeg in enumerate(pool.imap(_make_one, jobs, chunksize=16)):
            label = str(i % 1000).encode()
            files[i].write_bytes(jpeg)
            files[i].with_suffix(".cls").write_bytes(label)
            sinks[i // per_shard].write({"__key__": files[i].stem, "jpg": jpeg, "cls": label})
    for s in sinks:
        s.close()
    done.write_text("")
    return files, tars


def _litdata_item(path):
    """litdata.optimize's function: one image and its label."""
    return {"key": path.stem, "jpg": path.read_bytes(), "cls": int(path.with_suffix(".cls").read_bytes())}


def make_litdata(data, files, tars):
    """The images in litData's format under the store's root (data/store/BUCKET/LITDATA_PREFIX),
    chunks the mean size of the tars; made once. False when litdata is not installed."""
    try:
        import litdata
        import google.cloud.storage  # noqa: F401  (litData's GCS downloader)
    except ImportError:
        return False
    done = data / "litdata-done"
    if not done.exists():
        out = data / "store" / BUCKET / LITDATA_PREFIX
        shutil.rmtree(out, ignore_errors=True)
        chunk = sum(t.stat().st_size for t in tars) // len(tars)
        # In a child: litdata.optimize makes "spawn" this process's default start method,
        # which the experiment's loaders must not inherit.
        child = multiprocessing.get_context("fork").Process(
            target=litdata.optimize,
            kwargs=dict(fn=_litdata_item, inputs=files, output_dir=str(out), chunk_bytes=chunk,
                        num_workers=1, mode="overwrite", verbose=False))
        child.start()
        child.join()
        if child.exitcode != 0:
            raise RuntimeError(f"litdata.optimize failed (exit code {child.exitcode})")
        done.write_text("")
    return True


# -- the one transform ------------------------------------------------------------------------

def random_resized_crop_box(rng, width, height, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    """torchvision's RandomResizedCrop.get_params: (left, top, right, bottom)."""
    area = width * height
    log_ratio = (np.log(ratio[0]), np.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = np.exp(rng.uniform(*log_ratio))
        w = int(round(np.sqrt(target * aspect)))
        h = int(round(np.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            left = rng.randint(0, width - w)
            top = rng.randint(0, height - h)
            return left, top, left + w, top + h
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        w, h = int(round(height * ratio[1])), height
    else:
        w, h = width, height
    left, top = (width - w) // 2, (height - h) // 2
    return left, top, left + w, top + h


# --no-decode: the pipeline only copies each image's bytes (what delivery alone costs).
DECODE = [True]


def transform(jpeg, seed):
    """JPEG bytes (or a memoryview) -> normalised 3x224x224 float tensor; every configuration
    runs this, in its loader workers (forked: they see DECODE as set before they start)."""
    if not DECODE[0]:
        return torch.tensor(len(bytes(jpeg)))
    rng = random.Random(seed)
    img = Image.open(io.BytesIO(jpeg)).convert("RGB")
    box = random_resized_crop_box(rng, *img.size)
    img = img.resize((CROP, CROP), Image.BILINEAR, box=box)
    if rng.random() < 0.5:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    pixels = (np.asarray(img, dtype=np.float32) - MEAN) / STD
    return torch.from_numpy(pixels.transpose(2, 0, 1).copy())


def key_seed(epoch, key):
    """The seed of a sample outside shardd: shardd's __seed__ function, without a URL."""
    return sample_seed(SEED, epoch, "", key)


def collate(samples):
    images, labels = zip(*samples)
    return torch.stack(images), torch.tensor(labels)


# A: loose files, random access.
class FileDataset(torch.utils.data.Dataset):
    def __init__(self, files, epoch):
        self.files, self.epoch = files, epoch

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        path = self.files[i]
        return (transform(path.read_bytes(), key_seed(self.epoch, path.stem)),
                int(path.with_suffix(".cls").read_bytes()))


class WdsSample:
    """webdataset's map stage (picklable): a sample dict -> (tensor, label)."""

    def __init__(self, epoch):
        self.epoch = epoch

    def __call__(self, s):
        return transform(s["jpg"], key_seed(self.epoch, s["__key__"])), int(s["cls"])


class LitSample:
    """litData's transform (picklable): an item -> (tensor, label)."""

    def __init__(self, epoch):
        self.epoch = epoch

    def __call__(self, s):
        return transform(s["jpg"], key_seed(self.epoch, s["key"])), s["cls"]


def shardd_stage(samples):
    """ShardDataset's stage, in the worker: fields may be memoryviews (zero copy)."""
    for s in samples:
        yield transform(s["jpg"], s["__seed__"]), int(bytes(s["cls"]))


def webdataset_pipeline(urls, epoch, skip_per_worker=0):
    ds = wds.WebDataset(urls, shardshuffle=len(urls), seed=epoch, empty_check=False)
    if skip_per_worker:
        ds = ds.slice(skip_per_worker, None)  # a resume: skip what was seen, undecoded
    return ds.shuffle(1000).map(WdsSample(epoch))


# -- processes: store, daemon -----------------------------------------------------------------

class Daemon:
    """``shardd serve`` with a fresh cache, its dataset ``train`` = the tars in the store."""

    def __init__(self, binary, workdir, store, shards):
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix="shardd-", dir=workdir))
        self.socket = str(self.dir / "shardd.sock")
        pattern = f"gs://{BUCKET}/{PREFIX}/train-{{000000..{shards - 1:06d}}}.tar"
        (self.dir / "config.toml").write_text(
            f'[server]\nsocket = "{self.socket}"\nmetrics_addr = ""\n'
            f'[cache]\ndir = "{self.dir}/cache"\n'
            f'[host]\nindex = 0\ncount = 1\n'
            f'[gcs]\nendpoint = "{store.endpoint}"\nanonymous = true\n'
            f'[datasets.train]\nshards = "{pattern}"\nshuffle_buffer = 1000\n')
        self.log = open(self.dir / "shardd.log", "w")
        self.proc = subprocess.Popen([str(binary), "serve", "--config", str(self.dir / "config.toml")],
                                     stdout=self.log, stderr=subprocess.STDOUT)

        def up():
            if self.proc.poll() is not None:
                raise RuntimeError(f"shardd exited: {(self.dir / 'shardd.log').read_text()[-2000:]}")
            return os.path.exists(self.socket)

        wait_for(up, "shardd to listen")

    def cpu_seconds(self):
        fields = pathlib.Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICK

    def stop(self):
        self.proc.terminate()
        self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def own_cpu_seconds():
    """This process's CPU plus that of its descendants that have ended and been waited for
    (loader workers, and the curl / shardd get processes they ran)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


# -- one epoch --------------------------------------------------------------------------------

def run_epoch(make_loader, store, daemon=None, snapshot_at=None):
    """Iterates one epoch of ``make_loader()``; returns a row (dict) and, with
    ``snapshot_at``, the loader's state_dict() after that many batches."""
    before = store.stats()
    cpu0 = own_cpu_seconds()
    dcpu0 = daemon.cpu_seconds() if daemon else 0.0
    start = time.perf_counter()
    loader = make_loader()
    first = None
    images = batches = 0
    state = None
    for images_batch, _labels in loader:
        if first is None:
            first = time.perf_counter() - start
        images += len(images_batch)
        batches += 1
        if snapshot_at is not None and batches == snapshot_at:
            state = loader.state_dict()
    seconds = time.perf_counter() - start
    del loader  # its workers are joined when the epoch ends; make sure
    dcpu = (daemon.cpu_seconds() - dcpu0) if daemon else 0.0
    cpu = own_cpu_seconds() - cpu0 + dcpu
    after = store.stats()
    row = dict(images=images, seconds=seconds, ips=images / seconds, cpu_per_image=cpu / max(images, 1),
               daemon_cpu=dcpu, requests=after["requests"] - before["requests"], mb=(after["bytes"] - before["bytes"]) / 1e6, first=first)
    return row, state


def first_batch_seconds(make_loader):
    """Time from making the loader to its first batch (a resume)."""
    start = time.perf_counter()
    loader = make_loader()
    it = iter(loader)
    next(it)
    seconds = time.perf_counter() - start
    del it, loader
    return seconds


# -- configurations ---------------------------------------------------------------------------

def loader_kwargs(args):
    return dict(batch_size=BATCH, num_workers=args.workers, collate_fn=collate)


def run_files(args, files, store):
    rows = []
    for epoch in range(args.epochs):
        g = torch.Generator().manual_seed(epoch)
        ds = FileDataset(files, epoch)
        rows.append(run_epoch(lambda: torch.utils.data.DataLoader(ds, shuffle=True, generator=g,
                                                                  **loader_kwargs(args)), store)[0])
    # Resume: the rest of the last epoch's shuffled order, from its middle.
    order = torch.randperm(len(files), generator=torch.Generator().manual_seed(args.epochs - 1)).tolist()
    rest = torch.utils.data.Subset(FileDataset(files, args.epochs - 1), order[len(order) // 2:])
    resume = first_batch_seconds(lambda: torch.utils.data.DataLoader(rest, **loader_kwargs(args)))
    return rows, resume, "drops the first half of the shuffled index list (exact)"


def run_webdataset(args, urls, store, daemon=None):
    rows = []
    for epoch in range(args.epochs):
        ds = webdataset_pipeline(urls, epoch)
        rows.append(run_epoch(lambda: torch.utils.data.DataLoader(ds, **loader_kwargs(args)), store, daemon)[0])
    skip = args.images // 2 // args.workers
    ds = webdataset_pipeline(urls, args.epochs - 1, skip_per_worker=skip)
    resume = first_batch_seconds(lambda: torch.utils.data.DataLoader(ds, **loader_kwargs(args)))
    return rows, resume, f"skips {skip} samples per worker undecoded (.slice), reading them"


def run_shardd(args, daemon, store, zero_copy):
    from torchdata.stateful_dataloader import StatefulDataLoader

    def dataset(epoch):
        ds = shardd.torch.ShardDataset("train", socket=daemon.socket, seed=SEED, epoch=epoch,
                                       zero_copy=zero_copy, sample_seeds=True)
        return ds.compose(shardd_stage)

    rows, state = [], None
    mid = max(1, args.images // BATCH // 2)
    for epoch in range(args.epochs):
        ds = dataset(epoch)
        last = epoch == args.epochs - 1
        row, snap = run_epoch(lambda: StatefulDataLoader(ds, **loader_kwargs(args)), store, daemon,
                              snapshot_at=mid if last else None)
        rows.append(row)
        state = snap or state

    def resumed():
        loader = StatefulDataLoader(dataset(shardd.torch.resume_epoch(state)), **loader_kwargs(args))
        loader.load_state_dict(state)
        return loader

    resume = first_batch_seconds(resumed) if state is not None else float("nan")
    return rows, resume, f"StatefulDataLoader state after batch {mid} (exact)"


def without_obstore(_worker=None):
    """litData's asynchronous downloads (obstore's GCSStore) take no endpoint, so they cannot
    reach an emulator: turned off (here and in each loader worker, however it was started),
    litData downloads every chunk with google-cloud-storage."""
    import litdata.streaming.downloader as downloader

    downloader._OBSTORE_AVAILABLE = False


def run_litdata(args, store, workdir):
    import litdata

    # litData's GCS downloader is google-cloud-storage's client, which talks to an emulator
    # (anonymously) when this names it; the loader workers inherit it.
    os.environ["STORAGE_EMULATOR_HOST"] = store.endpoint
    without_obstore()
    cache = tempfile.mkdtemp(prefix="litdata-cache-", dir=workdir)  # fresh: epoch 1 is cold

    def loader(epoch):
        ds = litdata.StreamingDataset(f"gs://{BUCKET}/{LITDATA_PREFIX}", cache_dir=cache, shuffle=True,
                                      seed=SEED, transform=LitSample(epoch))
        dl = litdata.StreamingDataLoader(ds, worker_init_fn=without_obstore, **loader_kwargs(args))
        dl.current_epoch = epoch  # a fresh loader counts epochs from 1: this one is epoch + 1
        return dl

    rows, state = [], None
    mid = max(1, args.images // BATCH // 2)
    for epoch in range(args.epochs):
        last = epoch == args.epochs - 1
        row, snap = run_epoch(lambda: loader(epoch), store, snapshot_at=mid if last else None)
        rows.append(row)
        state = snap or state

    def resumed():
        dl = loader(args.epochs - 1)
        dl.load_state_dict(state)
        return dl

    resume = first_batch_seconds(resumed) if state is not None else float("nan")
    return rows, resume, f"StreamingDataLoader state after batch {mid}"


# -- main -------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=4000)
    ap.add_argument("--per-shard", type=int, default=1000, help="images per tar shard")
    ap.add_argument("--min-px", type=int, default=400)
    ap.add_argument("--max-px", type=int, default=500)
    ap.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--latency-ms", type=float, default=50.0, help="the store's time to first byte")
    ap.add_argument("--rate-mbs", type=float, default=100.0, help="the store's MB/s per connection")
    ap.add_argument("--data", default=str(ROOT / "bench" / "data"), help="where the images are made (kept)")
    ap.add_argument("--shardd", default=str(ROOT / "target" / "release" / "shardd"), help="the daemon binary")
    ap.add_argument("--only", help="comma-separated configurations to run (A,B,C,D,D-zc,D-pipe,E)")
    ap.add_argument("--no-decode", action="store_true",
                    help="copy each image's bytes instead of decoding it: delivery alone (e.g. "
                         "--only C,D-pipe --workers 8: eight processes reading pipe: URLs)")
    ap.add_argument("--quick", action="store_true",
                    help="CI: --images 256 --per-shard 64 --min-px 200 --max-px 250 --epochs 1")
    args = ap.parse_args()
    DECODE[0] = not args.no_decode
    if args.quick:
        args.images, args.per_shard, args.min_px, args.max_px, args.epochs = 256, 64, 200, 250, 1
    only = set(args.only.split(",")) if args.only else {"A", "B", "C", "D", "D-zc", "D-pipe", "E"}

    data = pathlib.Path(args.data) / f"blog-{args.images}-{args.per_shard}-{args.min_px}-{args.max_px}"
    files, tars = generate(data, args.images, args.per_shard, args.min_px, args.max_px)
    if "E" in only and not make_litdata(data, files, tars):
        only.discard("E")
        print("E (litData) skipped: litdata and google-cloud-storage are not installed "
              "(.venv/bin/pip install --no-deps -r bench/requirements.txt)", flush=True)
    mean_kb = sum(f.stat().st_size for f in files) / len(files) / 1000
    print(f"client decoder: {source_client.decoder()}")
    print(f"{args.images} JPEGs of {args.min_px}-{args.max_px} px, mean {mean_kb:.0f} KB, in {len(tars)} shards; "
          f"{args.workers} workers, batches of {BATCH}, {args.epochs} epoch(s); store: "
          f"{args.latency_ms:g} ms to first byte, {args.rate_mbs:g} MB/s per connection; "
          f"{len(os.sched_getaffinity(0))} cores", flush=True)

    results = []  # (config, rows, resume seconds, how it resumes)
    with tempfile.TemporaryDirectory(prefix="blog-") as tmp:
        tmp = pathlib.Path(tmp)
        store = Store(data / "store", tmp, args.latency_ms, args.rate_mbs)
        try:
            def report(name, outcome):
                results.append((name, *outcome))
                for e, r in enumerate(outcome[0], 1):
                    print(f"  {name} epoch {e}: {r['ips']:.0f} images/s, first batch {r['first']:.2f} s", flush=True)

            if "A" in only:
                report("A files", run_files(args, files, store))
            if "B" in only:
                report("B local tars", run_webdataset(args, [str(t) for t in tars], store))
            if "C" in only:
                report("C store, pipe:curl",
                       run_webdataset(args, [f"pipe:curl -s -f {store.endpoint}/{BUCKET}/{PREFIX}/{t.name}" for t in tars], store))
            for name, zero_copy in (("D", False), ("D-zc", True)):
                if name in only:
                    daemon = Daemon(args.shardd, tmp, store, len(tars))
                    try:
                        label = "D shardd, zero copy" if zero_copy else "D shardd, socket"
                        report(label, run_shardd(args, daemon, store, zero_copy))
                    finally:
                        daemon.stop()
            if "D-pipe" in only:
                daemon = Daemon(args.shardd, tmp, store, len(tars))
                try:
                    urls = [f"pipe:{args.shardd} get --socket {daemon.socket} gs://{BUCKET}/{PREFIX}/{t.name}"
                            for t in tars]
                    report("D-pipe shardd get", run_webdataset(args, urls, store, daemon))
                finally:
                    daemon.stop()
            if "E" in only:
                report("E litData", run_litdata(args, store, tmp))
        finally:
            store.stop()

    print()
    print(f"{'configuration':22} {'epoch':>5} {'images/s':>9} {'CPU-ms/img':>10} {'daemon':>7} "
          f"{'store reqs':>10} {'store MB':>9} {'1st batch s':>11} {'resume 1st s':>12}")
    base = results[0][1][-1]["ips"] if results else 0
    for name, rows, resume, _how in results:
        for e, r in enumerate(rows, 1):
            res = f"{resume:12.2f}" if e == len(rows) else f"{'':12}"
            print(f"{name:22} {e:5} {r['ips']:9.0f} {1000 * r['cpu_per_image']:10.1f} "
                  f"{1000 * r['daemon_cpu'] / max(r['images'], 1):7.2f} {r['requests']:10} "
                  f"{r['mb']:9.1f} {r['first']:11.2f} {res}")
    print("\nCPU-ms/img: trainer + loader workers + their children + daemon, per image; daemon: its part.")
    print("resume 1st s: time to the first batch of a resume half-way through the last epoch:")
    for name, _rows, _resume, how in results:
        print(f"  {name}: {how}")
    if base:
        print(f"\nimages/s of each configuration's last epoch relative to {results[0][0]}'s:")
        for name, rows, _r, _h in results:
            print(f"  {name:22} {rows[-1]['ips'] / base:.2f}x" + (
                f" (epoch 1: {rows[0]['ips'] / base:.2f}x)" if len(rows) > 1 else ""))


if __name__ == "__main__":
    main()
