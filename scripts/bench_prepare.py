#!/usr/bin/env python3
"""Dataset preparation, ours against upstream's tools, side by side in one run.

Makes N synthetic JPEGs of ImageNet's typical sizes (350-500 x 280-375 pixels, photo-like noise, quality
90) in one folder per class, then runs, alternating, R times each:

  upstream  convert_imageset --resize_height=256 --resize_width=256 --shuffle on train.txt, the same on
            val.txt, compute_image_mean on the train LMDB (create_imagenet.sh with RESIZE=true, then
            make_imagenet_mean.sh), single-threaded as they are;
  ours      cometctl prepare-images DIR --jobs J for each J of --jobs: the same two LMDBs, the mean and
            the listings, in one command.

Both read the same images (upstream gets our train.txt/val.txt). Before the runs every image is read
once, so neither pays for a cold disk. Reported per run: wall time, images/s over all N images, the
CPU time (user + system, the process and its children) per image, peak
memory measured, not estimated: the largest resident set of one process (getrusage / VmHWM) and the peak
of the summed proportional set size (PSS, shared pages split between processes) of the whole process
tree, sampled every 0.1 s. Outputs are deleted after each run (N x 200 KB each).

    scripts/bench_prepare --images 10000 --jobs 1 2 --repeat 1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from multiprocessing import get_context
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


# ----------------------------------------------------------------------------------------------- images
def _picture(seed: int) -> bytes:
    import io

    from PIL import Image

    rng = np.random.default_rng(seed)
    w, h = int(rng.integers(350, 501)), int(rng.integers(280, 376))
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.empty((h, w, 3), np.float32)
    for c in range(3):
        a, b = rng.uniform(-1, 1, 2)
        img[..., c] = 128 + 70 * (a * x / w + b * y / h)
        for _ in range(4):
            cx, cy, r = rng.uniform(0, w), rng.uniform(0, h), rng.uniform(20, 90)
            img[..., c] += rng.uniform(-80, 80) * np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * r * r))
    img += rng.normal(0, 9, img.shape).astype(np.float32)  # texture: JPEGs of a photo's size
    buf = io.BytesIO()
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _write(args) -> int:
    path, seed = args
    data = _picture(seed)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return len(data)


def make_images(folder: Path, n: int, classes: int) -> int:
    stamp = folder / ".complete.json"
    want = {"images": n, "classes": classes, "version": 1}
    try:
        if json.loads(stamp.read_text()) == want:
            return sum(p.stat().st_size for p in folder.rglob("*.JPEG"))
    except (OSError, ValueError):
        pass
    if folder.exists():
        shutil.rmtree(folder)
    jobs = []
    for i in range(n):
        cls = f"n{10000000 + i % classes:08d}"
        (folder / cls).mkdir(parents=True, exist_ok=True)
        jobs.append((str(folder / cls / f"{cls}_{i}.JPEG"), i))
    t = time.perf_counter()
    with get_context("fork").Pool(os.cpu_count() or 1) as pool:
        total = sum(pool.imap_unordered(_write, jobs, chunksize=32))
    print(f"made {n:,} JPEGs ({total / 2**20:,.0f} MiB) in {time.perf_counter() - t:.0f} s", flush=True)
    stamp.write_text(json.dumps(want))
    return total


def warm(folder: Path) -> None:
    for p in folder.rglob("*.JPEG"):
        with open(p, "rb") as f:
            while f.read(1 << 20):
                pass


# ---------------------------------------------------------------------------------------------- measure
def _tree(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def _kb(path: str, key: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def run_measured(cmd: list[str], log) -> dict:
    """Run cmd; wall time, the largest process's peak RSS, the process tree's peak summed PSS (MiB)."""
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    peak = {"pss": 0, "hwm": 0}
    done = threading.Event()

    def sample():
        while not done.is_set():
            pids = _tree(proc.pid)
            peak["pss"] = max(peak["pss"], sum(_kb(f"/proc/{p}/smaps_rollup", "Pss:") for p in pids))
            peak["hwm"] = max([peak["hwm"]] + [_kb(f"/proc/{p}/status", "VmHWM:") for p in pids])
            done.wait(0.1)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t
    done.set()
    th.join()
    if proc.returncode:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}; see {log.name}")
    return {"seconds": wall, "cpu_seconds": usage.ru_utime + usage.ru_stime,
            "max_rss_mb": max(usage.ru_maxrss, peak["hwm"]) / 1024, "tree_pss_mb": peak["pss"] / 1024}


def run_upstream(images: Path, listing_dir: Path, out: Path, log) -> dict:
    from cometctl.paths import tool_path

    out.mkdir(parents=True)
    steps = []
    for part in ("train", "val"):
        steps.append(run_measured([str(tool_path("convert_imageset")), "--resize_height=256", "--resize_width=256",
                                   "--shuffle", f"{images}/", str(listing_dir / f"{part}.txt"),
                                   str(out / f"{part}_lmdb")], log))
    steps.append(run_measured([str(tool_path("compute_image_mean")), str(out / "train_lmdb"),
                               str(out / "mean.binaryproto")], log))
    return {"seconds": sum(s["seconds"] for s in steps), "cpu_seconds": sum(s["cpu_seconds"] for s in steps),
            "max_rss_mb": max(s["max_rss_mb"] for s in steps),
            "tree_pss_mb": max(s["tree_pss_mb"] for s in steps),
            "convert_seconds": steps[0]["seconds"] + steps[1]["seconds"], "mean_seconds": steps[2]["seconds"]}


def run_ours(images: Path, out: Path, jobs: int, log) -> dict:
    cometctl = str(Path(sys.executable).parent / "cometctl")
    r = run_measured([cometctl, "prepare-images", str(images), "--data-dir", str(out), "--jobs", str(jobs),
                      "--size", "256"], log)
    manifest = json.loads((out / "prepare.json").read_text())
    r["convert_images_per_second"] = manifest["images_per_second"]
    return r


# ------------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=10000, help="number of JPEGs (default 10,000)")
    ap.add_argument("--classes", type=int, default=100)
    ap.add_argument("--jobs", type=int, nargs="+", default=None, help="our --jobs values (default: 1 and all cores)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "bench_prepare",
                    help="where the images and outputs go (default $TMPDIR/bench_prepare)")
    args = ap.parse_args(argv)
    jobs = args.jobs or sorted({1, os.cpu_count() or 1})
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    images = work / "images"
    n = args.images
    size = make_images(images, n, args.classes)
    need = 2 * n * 200_704 * 1.1
    if shutil.disk_usage(work).free < need:
        raise SystemExit(f"{work}: needs about {need / 1e9:.1f} GB free for two outputs")
    warm(images)
    log = open(work / "bench.log", "w")
    # our listing (the same split for every run) for upstream's convert_imageset
    listing = work / "listing"
    if listing.exists():
        shutil.rmtree(listing)
    run_ours(images, listing, max(jobs), log)
    for f in ("train_lmdb", "val_lmdb"):
        shutil.rmtree(listing / f)
    n_train = sum(1 for _ in open(listing / "train.txt"))
    print(f"{n:,} images ({size / n / 1024:.0f} KiB average JPEG), {n_train:,} train + {n - n_train:,} val, "
          f"256x256; {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}", flush=True)

    results: dict[str, list[dict]] = {}
    for rep in range(args.repeat):
        for name in ["upstream"] + [f"ours --jobs {j}" for j in jobs]:
            out = work / "out"
            if out.exists():
                shutil.rmtree(out)
            if name == "upstream":
                r = run_upstream(images, listing, out, log)
            else:
                r = run_ours(images, out, int(name.rsplit(" ", 1)[1]), log)
            r["images_per_second"] = n / r["seconds"]
            r["load"] = os.getloadavg()[0]
            results.setdefault(name, []).append(r)
            print(f"  {name:16s} run {rep + 1}: {r['seconds']:7.1f} s  {r['images_per_second']:6.0f} img/s  "
                  f"CPU {1000 * r['cpu_seconds'] / n:5.2f} ms/img  "
                  f"peak RSS {r['max_rss_mb']:6.0f} MiB  tree PSS {r['tree_pss_mb']:6.0f} MiB  "
                  f"(load {r['load']:.2f})", flush=True)
            shutil.rmtree(out)

    base = statistics.median(r["images_per_second"] for r in results["upstream"])
    print(f"\nmedian of {args.repeat} run(s), {n:,} images -> train/val LMDBs + mean at 256x256:")
    print(f"{'':18s}{'wall s':>8s}{'img/s':>8s}{'vs upstream':>13s}{'CPU ms/img':>12s}{'peak RSS MiB':>14s}"
          f"{'tree PSS MiB':>14s}")
    for name, rs in results.items():
        med = {k: statistics.median(r[k] for r in rs)
               for k in ("seconds", "images_per_second", "cpu_seconds", "max_rss_mb", "tree_pss_mb")}
        print(f"{name:18s}{med['seconds']:8.1f}{med['images_per_second']:8.0f}{med['images_per_second'] / base:12.2f}x"
              f"{1000 * med['cpu_seconds'] / n:12.2f}{med['max_rss_mb']:14.0f}{med['tree_pss_mb']:14.0f}")
    (work / "results.json").write_text(json.dumps({"images": n, "cores": os.cpu_count(), "runs": results}, indent=1))
    print(f"(all figures: {work / 'results.json'}; logs: {work / 'bench.log'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
