"""Writes a tiny image-classification dataset as WebDataset shards (with webdataset's own
TarWriter) and indexes it with `shardd index`, for examples/train_resnet_tiny.py.

    python examples/make_tiny_dataset.py /tmp/tiny [--shards 8 --per-shard 40] [--shardd PATH]

Each sample is a 16x16 PNG (`png`) of noise with a coloured square whose colour is the class
(`cls`, 0-3). Prints the `[datasets.tiny]` lines for the daemon's config on stderr and one
line of JSON on stdout: {"shards": pattern, "manifest": path, "samples": n}.
"""

import argparse
import io
import json
import pathlib
import random
import shutil
import subprocess
import sys

import numpy as np
import webdataset as wds
from PIL import Image

CLASSES = 4
COLOURS = [(230, 40, 40), (40, 200, 40), (40, 70, 230), (220, 220, 220)]


def image(rng, cls, size):
    pixels = np.asarray(rng.integers(0, 90, (size, size, 3)), dtype=np.uint8)
    side = int(rng.integers(size // 4, size // 2))
    x, y = (int(v) for v in rng.integers(0, size - side, 2))
    pixels[y:y + side, x:x + side] = COLOURS[cls]
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", type=pathlib.Path)
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--per-shard", type=int, default=40)
    p.add_argument("--size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shardd", default=shutil.which("shardd") or "shardd", help="the shardd binary")
    args = p.parse_args()

    args.dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    labels = random.Random(args.seed)
    n = 0
    for s in range(args.shards):
        with wds.TarWriter(str(args.dir / f"tiny-{s:04d}.tar")) as sink:
            for _ in range(args.per_shard):
                cls = labels.randrange(CLASSES)
                sink.write({"__key__": f"tiny/{n:06d}", "png": image(rng, cls, args.size),
                            "cls": str(cls).encode()})
                n += 1
    pattern = f"{args.dir.resolve()}/tiny-{{0000..{args.shards - 1:04d}}}.tar"
    manifest = args.dir.resolve() / "tiny.manifest.json"
    subprocess.run([args.shardd, "index", pattern, "-o", str(manifest)], check=True)
    print(f'[datasets.tiny]\nshards = "{pattern}"\nmanifest = "{manifest}"', file=sys.stderr)
    print(json.dumps({"shards": pattern, "manifest": str(manifest), "samples": n}))


if __name__ == "__main__":
    main()
