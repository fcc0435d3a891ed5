"""bench_sz_choices.py - the design measurements quoted in docs/sz.md ("Choices measured").

    SZ_LIBRARY=... python scripts/bench_sz_choices.py [SECTION ...]   (or through scripts/bench_sz_choices)

1. zero-order entropy of the quantization codes (no prediction, 1-D Lorenzo along W, 2-D
   Lorenzo over H, W) and the ratio an order-0 entropy coder could reach, next to ours;
2. zstd level sweep of the lossless stage (ratio and one-thread compression speed);
3. interleaved vs sectioned payload before zstd (builds scripts/bench_sz_sections.cpp with g++);
4. BatchNorm's x_norm_ after a ReLU (docs/comet.md, "The zeros stored exact"): the ratio as it
   is and less each channel's value of the zeros, as the store encodes it (no zstd).
Same activation-like data as bench_sz.py. SECTION: the numbers of the sections to run (all).
"""
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "sz", "python"))
import szpy  # noqa: E402
from bench_sz import activation_like  # noqa: E402

SHAPE = (16, 64, 56, 56)


def entropy(a):
    _, c = np.unique(a, return_counts=True)
    p = c / c.sum()
    return float(-(p * np.log2(p)).sum())


def code_entropy(lib, data):
    print("1. code entropy (bits/value) and order-0 ratio bound vs ours")
    for zf, x in data.items():
        rng = float(x.max() - x.min())
        for frac in (1e-1, 1e-2):
            eb = frac * rng
            q = np.rint(x / (2 * eb)).astype(np.int64)
            d1 = np.diff(q, axis=3, prepend=0)
            d2 = q.copy()
            d2[:, :, 1:, 1:] = q[:, :, 1:, 1:] - q[:, :, :-1, 1:] - q[:, :, 1:, :-1] + q[:, :, :-1, :-1]
            h = [entropy(q), entropy(d1), entropy(d2)]
            ours = x.nbytes / len(lib.compress(x, eb, "abs", threads=1))
            print("  relu%d eb %g: none %.3f, lorenzo-1d %.3f, lorenzo-2d %.3f -> bounds %.1f / %.1f / %.1f; ours %.2f"
                  % (round(zf * 100), frac, *h, *(32 / v for v in h), ours))


def zstd_levels(lib, data):
    print("2. zstd level of the lossless stage (ratio, one-thread compression GB/s)")
    for zf in (0.5, 0.8, 0.95):
        x = data[zf]
        rng = float(x.max() - x.min())
        for frac in (1e-1, 1e-2, 1e-4):
            row = []
            for lv in (1, 3, 6, 9, -1, -5):
                best, s = 1e9, b""
                for _ in range(3):
                    t = time.perf_counter()
                    s = lib.compress(x, frac * rng, "abs", threads=1, zstd_level=lv)
                    best = min(best, time.perf_counter() - t)
                row.append("L%d %.2f %.2f" % (lv, x.nbytes / len(s), x.nbytes / best / 1e9))
            print("  relu%d eb %g: %s" % (round(zf * 100), frac, " | ".join(row)))


def payload_layout(data):
    print("3. payload layout before zstd")
    root = os.path.join(HERE, "..")
    with tempfile.TemporaryDirectory() as tmp:
        exe = os.path.join(tmp, "sections")
        try:
            subprocess.run(["g++", "-O2", "-std=c++17", "-ffp-contract=off", "-I", os.path.join(root, "sz", "include"),
                            "-I", os.path.join(root, "sz", "src"), os.path.join(HERE, "bench_sz_sections.cpp"),
                            "-lzstd", "-o", exe], check=True)
        except (OSError, subprocess.CalledProcessError) as e:
            print("  skipped: cannot build bench_sz_sections.cpp (%s)" % e)
            return
        for zf, x in data.items():
            path = os.path.join(tmp, "x.f32")
            x.tofile(path)
            print("  relu%d:" % round(zf * 100), flush=True)
            subprocess.run([exe, path, *map(str, SHAPE), "0.1", "0.01", "0.0001"], check=True)


def tie_offsets(lib, data):
    """x_norm_ = (x - mean) / std of a ReLU's output x, per channel, stored plain and less
    t = -mean / std at eb less the store's rounding slack 2^-23 (3 sqrt(n) + eb)."""
    print("4. BatchNorm's x_norm_ after a ReLU: ratio plain / less each channel's value of the zeros")
    for zf in (0.5, 0.8):
        x = data[zf].astype(np.float64)
        mean = x.mean(axis=(0, 2, 3), keepdims=True)
        std = np.sqrt(x.var(axis=(0, 2, 3), keepdims=True) + 1e-5)
        y = ((x - mean) / std).astype(np.float32)
        t = (-mean / std).astype(np.float32)
        n = x.shape[0] * x.shape[2] * x.shape[3]
        row = []
        for eb in (0.25, 0.1, 0.05):
            plain = lib.compress(y, eb, "abs", zstd=False)
            shifted = lib.compress(np.ascontiguousarray(y - t), eb - 2.0 ** -23 * (3 * np.sqrt(n) + eb), "abs",
                                   zstd=False)
            row.append("eb %g %.2f / %.2f" % (eb, y.nbytes / len(plain), y.nbytes / len(shifted)))
        print("  relu%d: %s" % (round(zf * 100), " | ".join(row)))


def main(sections):
    wanted = set(sections) or {"1", "2", "3", "4"}
    lib = szpy.Library(os.environ.get("SZ_LIBRARY"))
    data = {zf: activation_like(SHAPE, zf, 3, seed=int(zf * 1000)) for zf in (0.5, 0.8, 0.95)}
    if "1" in wanted:
        code_entropy(lib, data)
    if "2" in wanted:
        zstd_levels(lib, data)
    if "3" in wanted:
        payload_layout(data)
    if "4" in wanted:
        tie_offsets(lib, data)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
