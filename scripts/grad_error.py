"""How far COMET moves a net's weight gradients: one training step, COMET off vs on, side by side.

Two solvers train the shipped CaffeNet or ResNet-18 (resnet_se: with SENet's channel attention on
each residual branch; resnet_depthwise: with MobileNet's depthwise-separable convolutions; both as
scripts/bench_memory's), upstream's GoogLeNet, or upstream's CIFAR-10
net with Sigmoid and BatchNorm or its full net with LRN within channels (--model; 10 outputs) on
the embedded synthetic images at 256x256 (made once, as for scripts/bench_memory; the CIFAR-10 nets
take random 32x32 crops of them). After `--warmup` steps (the adaptive bounds are measured on them)
the COMET solver gets the other's weights, both run forward and backward on the same batch with the
same Dropout masks, and for each layer the relative error of the weight gradient,
||dW_on - dW_off|| / ||dW_off||, is printed next to the error bound its input was stored with. With
ADAPTIVE bounds this error is what `adaptive_target` aims at (docs/comet.md).

The Sigmoid net's Sigmoid outputs are stored lossy at the tighter of their own bound (the
derivative rule: Sigmoid's backward computes y (1 - y) from them) and the next layer's.

ResNet's BatchNorm layers store their normalised output (x_norm_) lossy at the tighter of their own
bound and their Scale's; the table lists those bounds and the weight-gradient error of every layer
with learnable weights (the errors of BatchNorm's input gradients show in the layers below them).

    scripts/grad_error [--model caffenet|resnet|resnet_se|resnet_depthwise|googlenet|cifar10_sigmoid|cifar10_full]
                       [--batch 32]
                       [--target 0.05] [--max-bound 1] [--warmup 2] [--data-gradients] [--dense LAYER ...]
                       [--set "FIELD: VALUE" ...]

--dense keeps what the named layers store lossy dense (`comet_param { compress: false }`: a
Convolution's input, a BatchNorm's x_norm_), so a layer's own input error can be told apart from
the errors that reach its output gradient from the layers above.
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["caffenet", "resnet", "resnet_se", "resnet_depthwise", "googlenet",
                                        "cifar10_sigmoid", "cifar10_full"],
                    default="caffenet")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--target", type=float, default=0.05, help="comet.adaptive_target")
    ap.add_argument("--max-bound", type=float, default=1.0, help="comet.max_error_bound")
    ap.add_argument("--warmup", type=int, default=2, help="steps before the compared one")
    ap.add_argument("--data-gradients", action="store_true",
                    help="also the relative error of every blob's gradient (where errors from above "
                         "arrive: BatchNorm's and LRN's input gradients)")
    ap.add_argument("--dense", nargs="+", default=[], metavar="LAYER",
                    help="layers whose lossy storage stays dense (comet_param { compress: false })")
    ap.add_argument("--set", action="append", default=[], metavar='"FIELD: VALUE"',
                    help="one more setting of the COMET solver's comet { } block (repeatable), e.g. "
                         '"centre_batchnorm_gradients: false"')
    args = ap.parse_args()

    os.environ.setdefault("GLOG_minloglevel", "2")  # caffe's INFO lines would bury the table
    sys.path.insert(0, str(paths.pycaffe_dir(None)))
    import numpy as np
    import caffe
    from caffe.proto import caffe_pb2 as pb2
    from google.protobuf import text_format
    from bench_memory import make_images

    images = make_images(Path(sys.executable).parent / "cometctl")
    net = pb2.NetParameter()
    upstream = paths.pycaffe_dir(None).parent  # upstream's models are in the patched tree
    model = {"caffenet": (ROOT / "models/bvlc_reference_caffenet/train_val.prototxt", ("fc8",),
                          "CaffeNet"),
             "resnet": (ROOT / "models/resnet18_dogs/train_val.prototxt", ("fc120",), "ResNet-18"),
             "resnet_depthwise": (ROOT / "models/resnet18_dogs/train_val.prototxt", ("fc120",),
                                  "ResNet-18 with depthwise-separable convolutions"),
             "resnet_se": (ROOT / "models/resnet18_dogs/train_val.prototxt", ("fc120",),
                           "ResNet-18 with squeeze-and-excitation"),
             "googlenet": (upstream / "models/bvlc_googlenet/train_val.prototxt",
                           ("loss1/classifier", "loss2/classifier", "loss3/classifier"),
                           "GoogLeNet"),
             "cifar10_sigmoid": (upstream / "examples/cifar10/cifar10_full_sigmoid_train_test_bn.prototxt",
                                 ("ip1",), "CIFAR-10 (Sigmoid, BatchNorm)"),
             "cifar10_full": (upstream / "examples/cifar10/cifar10_full_train_test.prototxt", ("ip1",),
                              "CIFAR-10 full (LRN within channels)")}
    net_file, classifiers, title = model[args.model]
    text_format.Merge(net_file.read_text(), net)
    if args.model in ("resnet_se", "resnet_depthwise"):
        from cometctl.caffeproto import add_squeeze_excitation, make_depthwise_separable
        layers = list(net.layer)
        (add_squeeze_excitation if args.model == "resnet_se" else make_depthwise_separable)(layers)
        del net.layer[:]
        net.layer.extend(layers)
    for layer in net.layer:
        if layer.type == "Data":
            train = any(r.phase == pb2.TRAIN for r in layer.include)
            layer.data_param.source = str(images / ("train_lmdb" if train else "val_lmdb"))
            layer.data_param.batch_size = args.batch if train else 50
            layer.data_param.prefetch = 1
            if not layer.transform_param.mean_value:
                layer.transform_param.mean_file = str(images / "mean.binaryproto")
            if args.model.startswith("cifar10"):
                layer.transform_param.crop_size = 32  # CIFAR's size, cut from the 256x256 images
        if layer.name in classifiers:
            layer.inner_product_param.num_output = 10  # the synthetic set has 10 classes
        if layer.name in args.dense:
            layer.comet_param.compress = False
    unknown = set(args.dense) - {layer.name for layer in net.layer}
    if unknown:
        ap.error(f"--dense: no layer {', '.join(sorted(unknown))} in {net_file}")
    caffe.set_mode_cpu()
    with tempfile.TemporaryDirectory(prefix="comet-grad-") as tmp:
        netfile = Path(tmp) / "net.prototxt"
        netfile.write_text(text_format.MessageToString(net))
        common = (f'net: "{netfile}"\nbase_lr: 0.01\nlr_policy: "fixed"\nmomentum: 0.9\n'
                  f'weight_decay: 0.0005\ndisplay: 0\nmax_iter: 100\nsnapshot: 0\n'
                  f'snapshot_after_train: false\nsnapshot_prefix: "{tmp}/s"\nrandom_seed: 1701\n')
        (Path(tmp) / "off.prototxt").write_text(common)
        (Path(tmp) / "on.prototxt").write_text(
            common + f"comet {{ adaptive_target: {args.target} max_error_bound: {args.max_bound} "
                     f"update_interval: 1{' release_diffs: false' if args.data_gradients else ''} "
                     f"{' '.join(args.set)} }}\n")
        off = caffe.get_solver(str(Path(tmp) / "off.prototxt"))
        on = caffe.get_solver(str(Path(tmp) / "on.prototxt"))
        for s in (off, on):
            s.step(args.warmup)
        # The same weights: those COMET trained to, on which its bounds were measured (off's,
        # after warm-up steps of its own, can differ enough to shift the activations' scale).
        for name in off.net.params:
            for a, b in zip(off.net.params[name], on.net.params[name]):
                a.data[...] = b.data
        for s in (off, on):
            for name in s.net.params:
                for p in s.net.params[name]:
                    p.diff[...] = 0
        caffe.set_random_seed(7)
        off.net.forward()
        on.net.blobs["data"].data[...] = off.net.blobs["data"].data  # the same batch
        on.net.blobs["label"].data[...] = off.net.blobs["label"].data
        caffe.set_random_seed(7)  # the same Dropout masks
        on.net.forward(start=list(on.net._layer_names)[1])  # after the data layer
        off.net.backward()
        on.net.backward()
        bounds = on.comet_stats()["bounds"]
        print(f"{title}, batch {args.batch}, adaptive_target {args.target}, max_error_bound "
              f"{args.max_bound}: relative error of each weight gradient, COMET on vs off")
        print("| layer | error bound of its input | relative error of dW |")
        print("|---|---:|---:|")
        for name in off.net.params:
            a, b = off.net.params[name][0].diff, on.net.params[name][0].diff
            if not np.linalg.norm(a):  # BatchNorm's statistics: not learned by gradient
                if name in bounds:
                    print(f"| {name} (x_norm) | {bounds[name]:.3g} | - |")
                continue
            eb = f"{bounds[name]:.3g}" if name in bounds else "exact"
            print(f"| {name} | {eb} | {np.linalg.norm(b - a) / np.linalg.norm(a):.4f} |")
        for name in bounds:  # readers without weights: Sigmoid, TanH, LRN (their own rules)
            if name not in off.net.params:
                print(f"| {name} ({on.net.layer_dict[name].type}) | {bounds[name]:.3g} | - |")
        if args.data_gradients:
            print("\n| blob | relative error of its gradient |\n|---|---:|")
            for name in off.net.blobs:
                a = off.net.blobs[name].diff
                try:
                    b = on.net.blobs[name].diff
                except Exception:  # a diff the store released (kept with --data-gradients)
                    print(f"| {name} | released |")
                    continue
                if a.size and np.linalg.norm(a):
                    print(f"| {name} | {np.linalg.norm(b - a) / np.linalg.norm(a):.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
