"""What the size of a cache file's writes costs (run on demand; asserts nothing): writes a new
file of --mb MB in writes of each size, then maps it whole (``MADV_POPULATE_READ``, what a
reader's page faults do), and prints the CPU seconds per GB of the writing (this process's
user + system time) and the time and faults per GB of the mapping.

The page cache keeps a buffered write in folios no larger than the write (Linux 6.x, ext4
from 6.16): the daemon writes cache files in 2 MiB blocks (src/blocks.rs), and this is
the measurement behind that choice (docs/benchmarks.md, "2 MiB cache blocks"). Each file is
kept until the end, so every write takes memory the run has not used before.

    .venv/bin/python bench/cache_blocks.py --dir /var/cache/shardd   # a directory on the cache's disk
"""

import argparse
import mmap
import os
import resource
import tempfile
import time

SIZES = (64 << 10, 256 << 10, 512 << 10, 2 << 20)
MADV_POPULATE_READ = 22


def write_then_map(directory, size, total):
    block = memoryview(os.urandom(2 << 20))
    fd, path = tempfile.mkstemp(dir=directory, prefix="cache-blocks-")
    try:
        before = resource.getrusage(resource.RUSAGE_SELF)
        for at in range(0, total, size):
            os.pwrite(fd, block[at % len(block):at % len(block) + size], at)
        after = resource.getrusage(resource.RUSAGE_SELF)
        writing = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        with mmap.mmap(fd, total, prot=mmap.PROT_READ) as m:
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t = time.perf_counter()
            m.madvise(MADV_POPULATE_READ)
            mapping = time.perf_counter() - t
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        return path, writing, mapping, faults
    finally:
        os.close(fd)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=".", help="where to write (the cache's file system)")
    ap.add_argument("--mb", type=int, default=256, help="MB per file")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    total = args.mb << 20
    gb = total / (1 << 30)
    paths = []
    try:
        print(f"{'writes':>9} {'writing CPU-s/GB':>17} {'mapping ms/GB':>14} {'faults/GB':>10}")
        for _ in range(args.rounds):
            for size in SIZES:
                path, writing, mapping, faults = write_then_map(args.dir, size, total)
                paths.append(path)
                print(f"{size >> 10:>5} KiB {writing / gb:17.2f} {1e3 * mapping / gb:14.1f} {faults / gb:10.0f}")
    finally:
        for p in paths:
            os.unlink(p)


if __name__ == "__main__":
    main()
