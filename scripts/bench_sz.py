"""bench_sz.py - ours (libsz) vs SZ3 (PyPI pysz) vs ZFP (PyPI zfpy), side by side, one run.

Same absolute error bounds for all (fractions of each tensor's value range), on
activation-like NCHW data (spatially correlated fields, ReLU'd to 50/80/95% zeros) and on
any real activation dumps given with --dump (.npy float32, or raw .f32 with --dump-shape).
Reports compression ratio, max |x - x'| (checked against the bound) and throughput in GB/s
of uncompressed data, best of --repeat runs. Run through scripts/bench_sz.
"""
import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "sz", "python"))
import szpy  # noqa: E402

try:
    from pysz import sz as _sz3, szConfig, szErrorBoundMode
except Exception as e:  # pragma: no cover - reported in the table
    _sz3 = None
    _sz3_err = str(e)
try:
    import zfpy
except Exception as e:  # pragma: no cover
    zfpy = None
    _zfp_err = str(e)


def activation_like(shape, zero_frac, smooth, seed):
    """Conv-like activation: a Gaussian random field smoothed over H, W (box filter of
    width `smooth`, applied twice), per-channel scale and bias, ReLU at the quantile that
    leaves zero_frac exact zeros."""
    rng = np.random.default_rng(seed)
    n, c, h, w = shape
    x = rng.standard_normal(shape, dtype=np.float32)
    for axis in (2, 3):
        for _ in range(2):
            k = smooth
            cs = np.cumsum(np.concatenate([np.zeros_like(x.take([0], axis=axis)), x], axis=axis), axis=axis)
            size = x.shape[axis]
            hi = np.minimum(np.arange(size) + k // 2 + 1, size)
            lo = np.maximum(np.arange(size) - k // 2, 0)
            x = (cs.take(hi, axis=axis) - cs.take(lo, axis=axis)) / (hi - lo).reshape(
                [-1 if a == axis else 1 for a in range(4)]).astype(np.float32)
    x /= x.std(axis=(0, 2, 3), keepdims=True) + 1e-12
    scale = rng.uniform(0.5, 2.0, size=(1, c, 1, 1)).astype(np.float32)
    x = x * scale
    thr = np.quantile(x, zero_frac)
    return np.maximum(x - thr, 0).astype(np.float32)


CLOCK = time.perf_counter  # --clock thread: CPU time of the calling thread


def best_time(fn, repeat):
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = CLOCK()
        out = fn()
        best = min(best, CLOCK() - t0)
    return best, out


def run_ours(lib, x, eb, repeat, threads, zstd=True):
    ct, s = best_time(lambda: lib.compress(x, eb, "abs", zstd=zstd, threads=threads), repeat)
    out = np.empty_like(x)
    dt, y = best_time(lambda: lib.decompress(s, out=out, threads=threads), repeat)
    return len(s), ct, dt, y


def run_sz3(x, eb, repeat):
    conf = szConfig(x.shape)
    conf.errorBoundMode = szErrorBoundMode.ABS
    conf.absErrorBound = eb
    conf.openmp = False
    ct, (c, _) = best_time(lambda: _sz3.compress(x, conf), repeat)
    dt, (y, _) = best_time(lambda: _sz3.decompress(c, np.float32, x.shape), repeat)
    return c.nbytes, ct, dt, y


def run_zfp(x, eb, repeat):
    ct, c = best_time(lambda: zfpy.compress_numpy(x, tolerance=eb), repeat)
    dt, y = best_time(lambda: zfpy.decompress_numpy(c), repeat)
    return len(c), ct, dt, y


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", default=os.environ.get("SZ_LIBRARY"), help="path to libsz.so")
    ap.add_argument("--shape", default="16,64,56,56", help="N,C,H,W of generated data")
    ap.add_argument("--sparsity", default="0.5,0.8,0.95", help="zero fractions to generate")
    ap.add_argument("--smooth", type=int, default=3, help="box-filter width of the generated fields")
    ap.add_argument("--bounds", default="1e-1,1e-2,1e-3,1e-4", help="eb as fractions of the value range")
    ap.add_argument("--dump", action="extend", nargs="+", default=[],
                    help="real activation dumps (.npy or raw .f32), one or more per --dump")
    ap.add_argument("--dump-shape", default=None, help="N,C,H,W of raw .f32 dumps")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="threads for 'ours (all cores)'; 0 = all")
    ap.add_argument("--markdown", default=None, help="also write the table to this file")
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall",
                    help="wall time, or CPU time of the calling thread (robust on a shared machine; "
                         "single-thread rows only)")
    a = ap.parse_args()
    global CLOCK
    CLOCK = time.perf_counter if a.clock == "wall" else time.thread_time

    lib = szpy.Library(a.lib)
    data = []
    shape = tuple(int(v) for v in a.shape.split(","))
    for zf in (float(v) for v in a.sparsity.split(",") if v):  # --sparsity "": dumps only
        data.append(("relu%d %s" % (round(zf * 100), "x".join(map(str, shape))),
                     activation_like(shape, zf, a.smooth, seed=int(zf * 1000))))
    for path in a.dump:
        if path.endswith(".npy"):
            arr = np.load(path).astype(np.float32)
        else:
            arr = np.fromfile(path, dtype=np.float32).reshape([int(v) for v in a.dump_shape.split(",")])
        data.append((os.path.basename(path) + " " + "x".join(map(str, arr.shape)), arr))

    ncores = os.cpu_count()
    comps = [("ours 1 thread", lambda x, eb: run_ours(lib, x, eb, a.repeat, 1))]
    if a.clock == "wall":
        comps.append(("ours %s threads" % (a.threads or ncores),
                      lambda x, eb: run_ours(lib, x, eb, a.repeat, a.threads)))
    comps.append(("ours 1 thread, no zstd", lambda x, eb: run_ours(lib, x, eb, a.repeat, 1, zstd=False)))
    comps.append(("SZ3 (pysz) 1 thread", (lambda x, eb: run_sz3(x, eb, a.repeat)) if _sz3 else None))
    comps.append(("ZFP (zfpy) 1 thread", (lambda x, eb: run_zfp(x, eb, a.repeat)) if zfpy else None))

    lines = []
    hdr = "| data | eb/range | compressor | ratio | max error / eb | compress GB/s | decompress GB/s |"
    lines += [hdr, "|---|---|---|---:|---:|---:|---:|"]
    print(hdr, flush=True)
    ok = True
    summary = {}  # compressor -> (ratios, compress GB/s, decompress GB/s) over every row
    for name, x in data:
        fin = np.isfinite(x)
        rng = float(x[fin].max() - x[fin].min()) if fin.any() else 0.0
        gb = x.nbytes / 1e9
        for frac in (float(v) for v in a.bounds.split(",")):
            eb = frac * rng if rng > 0 else frac
            for cname, fn in comps:
                if fn is None:
                    row = "| %s | %g | %s | n/a | n/a | n/a | n/a |" % (name, frac, cname)
                else:
                    size, ct, dt, y = fn(x, eb)
                    err = float(np.max(np.abs(x[fin].astype(np.float64) - y.reshape(x.shape)[fin])))
                    flag = "" if err <= eb else " (VIOLATED)"
                    if cname.startswith("ours") and err > eb:
                        ok = False
                    row = "| %s | %g | %s | %.2f | %.3f%s | %.3f | %.3f |" % (
                        name, frac, cname, x.nbytes / size, err / eb, flag, gb / ct, gb / dt)
                    got = summary.setdefault(cname, ([], [], []))
                    got[0].append(x.nbytes / size)
                    got[1].append(gb / ct)
                    got[2].append(gb / dt)
                print(row, flush=True)
                lines.append(row)
    # Over all rows: geometric-mean ratio and median speeds, each against SZ3's where it ran.
    sz3 = summary.get("SZ3 (pysz) 1 thread")
    lines += ["", "| compressor | ratio (geomean) | compress GB/s (median) | decompress GB/s (median) |",
              "|---|---:|---:|---:|"]
    for cname, (ratios, cs, ds) in summary.items():
        g = float(np.exp(np.mean(np.log(ratios))))
        c, d = float(np.median(cs)), float(np.median(ds))
        vs = ""
        if sz3 and cname != "SZ3 (pysz) 1 thread":
            g3 = float(np.exp(np.mean(np.log(sz3[0]))))
            vs = " (%.2fx SZ3's ratio, %.2fx / %.2fx its speeds)" % (
                g / g3, c / float(np.median(sz3[1])), d / float(np.median(sz3[2])))
        lines.append("| %s%s | %.2f | %.3f | %.3f |" % (cname, vs, g, c, d))
    print("\n".join(lines[-len(summary) - 2:]))
    env = "cores: %d; clock: %s; pysz %s; zfpy %s" % (
        ncores, a.clock, "ok" if _sz3 else "missing (%s)" % _sz3_err, "ok" if zfpy else "missing (%s)" % _zfp_err)
    print(env)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write("\n".join(lines) + "\n\n" + env + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
