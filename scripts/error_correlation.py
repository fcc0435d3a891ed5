"""How correlated the compressor's errors are, blob by blob: the adaptive weight rule
(docs/comet.md) assumes errors independent from value to value; where neighbouring errors are
correlated, a weight gradient's error sum x (x) dy adds coherently and exceeds the rule's estimate.

Trains the net of --model (bench_memory's nets and inputs: the embedded synthetic images) for a few
steps with COMET off, runs a forward pass, and for each --blob NAME=EB compresses that blob with
sz at the absolute bound EB and prints: max |e| / eb, RMS(e) / eb (0.577 for uniform errors), the
lag-1 correlation of the errors along W, H and C, the plane-sum ratio kappa = E[(sum of e over a
plane)^2] / E[sum of e^2 over a plane] (1 for independent errors), the share of nonzero values and
of positive values below eb.

    scripts/error_correlation [--model googlenet] [--batch 8] [--steps 3]
        [--blob inception_5b/pool=0.5 --blob inception_3a/output=1.0 ...]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from cometctl import paths  # noqa: E402

DEFAULT_BLOBS = {"googlenet": ["inception_5b/pool=0.5", "inception_5a/output=0.4",
                               "inception_3a/output=1.0", "pool2/3x3_s2=1.0"],
                 "resnet": ["res5a=0.2", "res3a=0.1"], "caffenet": ["pool5=0.3", "norm2=0.2"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["caffenet", "resnet", "googlenet"], default="googlenet")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3, help="training steps before the measured pass")
    ap.add_argument("--blob", action="append", default=None, metavar="NAME=EB")
    args = ap.parse_args()
    os.environ.setdefault("GLOG_minloglevel", "2")
    sys.path.insert(0, str(paths.pycaffe_dir(None)))
    sys.path.insert(0, str(ROOT / "sz" / "python"))
    import numpy as np
    import caffe
    import szpy
    from caffe.proto import caffe_pb2 as pb2
    from google.protobuf import text_format
    from bench_memory import make_images, make_net, model_file

    images = make_images(Path(sys.executable).parent / "cometctl")
    net_text = make_net(pb2, text_format, args.batch, images, model_file(args.model, None))
    lib = szpy.Library(str(next((paths.pycaffe_dir(None).parent.parent / "sz").glob("libsz.so.1"))))
    caffe.set_mode_cpu()
    with tempfile.TemporaryDirectory(prefix="comet-corr-") as tmp:
        (Path(tmp) / "net.prototxt").write_text(net_text)
        (Path(tmp) / "solver.prototxt").write_text(
            f'net: "{tmp}/net.prototxt"\nbase_lr: 0.01\nlr_policy: "fixed"\nmomentum: 0.9\n'
            f'max_iter: 100\nsnapshot: 0\nsnapshot_after_train: false\n'
            f'snapshot_prefix: "{tmp}/s"\nrandom_seed: 1701\ndisplay: 0\n')
        solver = caffe.get_solver(str(Path(tmp) / "solver.prototxt"))
        solver.step(args.steps)
        solver.net.forward()

        def corr(a, b) -> float:
            a, b = a.ravel(), b.ravel()
            return float(np.dot(a, b) / np.sqrt(np.dot(a, a) * np.dot(b, b)))

        print(f"{args.model}, batch {args.batch}, after {args.steps} steps:")
        print("| blob | shape | eb | max|e|/eb | RMS(e)/eb | corr W | corr H | corr C | kappa | "
              "nonzero | positives < eb |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for spec in args.blob or DEFAULT_BLOBS[args.model]:
            name, eb = spec.rsplit("=", 1)
            eb = float(eb)
            x = solver.net.blobs[name].data.astype(np.float32).copy()
            y = lib.decompress(lib.compress(x, eb)).reshape(x.shape)
            e = (y - x).astype(np.float64)
            kappa = float((e.sum(axis=(2, 3)) ** 2).mean() / (e ** 2).sum(axis=(2, 3)).mean())
            positives = max(int((x > 0).sum()), 1)
            print(f"| {name} | {'x'.join(map(str, x.shape))} | {eb:g} | {np.abs(e).max() / eb:.2f} | "
                  f"{np.sqrt((e ** 2).mean()) / eb:.3f} | {corr(e[..., :, 1:], e[..., :, :-1]):.2f} | "
                  f"{corr(e[..., 1:, :], e[..., :-1, :]):.2f} | {corr(e[:, 1:], e[:, :-1]):.2f} | "
                  f"{kappa:.1f} | {float((x > 0).mean()):.2f} | "
                  f"{float(((x > 0) & (x < eb)).sum() / positives):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
