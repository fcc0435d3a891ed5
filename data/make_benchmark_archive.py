#!/usr/bin/env python3
"""Generate a larger Stanford-Dogs-shaped archive of big JPEGs to measure `prepare-dogs` throughput.

    .venv/bin/python data/make_benchmark_archive.py OUT_DIR [--per-class 200] [--size 400]

writes OUT_DIR/images.tar and OUT_DIR/lists.tar (10 classes, 70% train / 30% test per class) with the
same generator as `prepare-dogs --synthetic`, at SIZE x SIZE pixels. Then, for example:

    cometctl prepare-dogs --archive OUT_DIR/images.tar --lists OUT_DIR/lists.tar --data-dir OUT_DIR/out
"""

import argparse
import time

from cometctl import synthetic

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("out_dir")
ap.add_argument("--per-class", type=int, default=200)
ap.add_argument("--size", type=int, default=400)
args = ap.parse_args()
t = time.perf_counter()
images, lists = synthetic.generate(args.out_dir, per_class=args.per_class,
                                   train_per_class=int(args.per_class * 0.7), size=args.size)
print(f"{images} ({images.stat().st_size / 2**20:.1f} MiB), {lists} in {time.perf_counter() - t:.1f} s")
