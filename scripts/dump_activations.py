"""Dumps the activations COMET stores, as .npy float32 files, from a net run on real photos.

The net of --model (or any --net prototxt) runs one forward pass in TRAIN phase with pycaffe on a
batch of scikit-image's sample photographs (astronaut, coffee, chelsea, ...: real photos, not
synthetic), each resized to the input's size, mean-subtracted per channel (104, 117, 123, Caffe's
ImageNet BGR means) and in BGR order as Caffe's data layers give them. The data layers are replaced
by an Input layer of that batch; the weights are the net's fillers, or --weights (a .caffemodel).
For every layer whose inputs COMET stores lossy by default (Convolution, InnerProduct, LRN), its
bottom blob is written as <out>/<model>_<blob>.npy, N,C,H,W (InnerProduct inputs as N,C,1,1 when
they are two-dimensional). BatchNorm's x_norm_ is not reachable from pycaffe, and an in-place
blob holds its last in-place layer's output after the forward, which is what a later reader sees. `scripts/bench_sz --dump <file>` compresses them.

    scripts/dump_activations [--model caffenet|resnet] [--net train_val.prototxt]
                             [--weights x.caffemodel] [--batch 8] --out folder
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cometctl import paths  # noqa: E402

MODELS = {"caffenet": ROOT / "models/bvlc_reference_caffenet/train_val.prototxt",
          "resnet": ROOT / "models/resnet18_dogs/train_val.prototxt"}
PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "motorcycle_left", "immunohistochemistry",
          "hubble_deep_field", "retina", "cat", "colorwheel")
STORED_TYPES = ("Convolution", "InnerProduct", "LRN")
MEAN_BGR = (104.0, 117.0, 123.0)


def photos(n: int, size: int):
    """n real photos from skimage.data, RGB uint8, resized to size x size (centre square crop)."""
    import numpy as np
    import skimage.data
    from skimage.transform import resize
    out = []
    for name in PHOTOS:
        if len(out) == n:
            break
        fn = getattr(skimage.data, name, None)
        if fn is None:
            continue
        try:
            img = fn()
        except Exception:  # a sample that needs a download (pooch) is skipped: no network here
            continue
        if img.ndim != 3 or img.shape[2] < 3:
            continue
        img = img[:, :, :3]
        h, w = img.shape[:2]
        s = min(h, w)
        img = img[(h - s) // 2:(h - s) // 2 + s, (w - s) // 2:(w - s) // 2 + s]
        out.append((resize(img, (size, size), anti_aliasing=True) * 255).astype(np.float32))
    if not out:
        raise SystemExit("dump_activations: no colour sample photo found in skimage.data")
    while len(out) < n:  # fewer photos than the batch: the same ones again, mirrored
        out.append(out[len(out) % len(out)][:, ::-1].copy())
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="caffenet")
    ap.add_argument("--net", type=Path, default=None, help="a train_val.prototxt instead of --model's")
    ap.add_argument("--weights", type=Path, default=None, help="a .caffemodel (default: the fillers)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--size", type=int, default=None, help="input side (default: the data layer's crop, "
                                                           "else 227)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.batch < 1:
        raise SystemExit("dump_activations: --batch must be >= 1")

    os.environ.setdefault("GLOG_minloglevel", "2")
    sys.path.insert(0, str(paths.pycaffe_dir(None)))
    import numpy as np
    import caffe
    from caffe.proto import caffe_pb2 as pb2
    from google.protobuf import text_format

    net_file = args.net or MODELS[args.model]
    tag = args.net.stem if args.net else args.model
    param = pb2.NetParameter()
    text_format.Merge(net_file.read_text(), param)
    size = args.size
    layers = []
    for layer in param.layer:
        phases = [r.phase for r in layer.include]
        if phases and pb2.TRAIN not in phases:
            continue
        if layer.type in ("Data", "ImageData", "DummyData", "HDF5Data", "Input"):
            size = size or (layer.transform_param.crop_size or 227)
            continue
        if layer.type == "Accuracy":
            continue
        del layer.include[:]
        layers.append(layer)
    size = size or 227
    inp = pb2.LayerParameter(name="data", type="Input", top=["data", "label"])
    inp.input_param.shape.add().dim.extend([args.batch, 3, size, size])
    inp.input_param.shape.add().dim.extend([args.batch])
    del param.layer[:]
    param.layer.extend([inp] + layers)
    param.state.phase = pb2.TRAIN
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = args.out / f".{tag}_net.prototxt"
    tmp.write_text(text_format.MessageToString(param))
    caffe.set_mode_cpu()
    net = caffe.Net(str(tmp), caffe.TRAIN, **({"weights": str(args.weights)} if args.weights else {}))
    tmp.unlink()

    batch = np.stack([p[:, :, ::-1].transpose(2, 0, 1) for p in photos(args.batch, size)])  # BGR, CHW
    batch -= np.array(MEAN_BGR, dtype=np.float32).reshape(1, 3, 1, 1)
    net.blobs["data"].data[...] = batch
    net.blobs["label"].data[...] = 0
    net.forward()
    written = set()
    for name, layer in zip(net._layer_names, net.layers):  # with the Split layers Net inserts
        if layer.type not in STORED_TYPES:
            continue
        for b in net.bottom_names[name]:
            if b in written or b in ("data", "label"):  # the input: never stored, and ours anyway
                continue
            x = np.asarray(net.blobs[b].data, dtype=np.float32)
            memory = net.blobs[b].data.__array_interface__["data"][0]
            if memory in written:  # a Split's top: the same memory as its bottom
                continue
            written.add(memory)
            if x.ndim == 2:
                x = x.reshape(x.shape[0], x.shape[1], 1, 1)
            path = args.out / f"{tag}_{b.replace('/', '_')}.npy"
            np.save(path, x)
            written.add(b)
            print(f"{path}  {tuple(x.shape)}  zeros {np.mean(x == 0):.0%}  range [{x.min():.3g}, {x.max():.3g}]")
    if not written:
        raise SystemExit(f"dump_activations: no input of a {', '.join(STORED_TYPES)} layer in {net_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
