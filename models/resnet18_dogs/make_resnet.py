"""Writes ResNet-18 for Stanford Dogs: train_val.prototxt, deploy.prototxt and solver.prototxt beside this file.

ResNet-18 (He et al., "Deep Residual Learning for Image Recognition", 2016): a 7x7 stride-2 convolution and
3x3 max pooling, four stages of two basic blocks (two 3x3 convolutions each) at 64, 128, 256 and 512
channels, an identity shortcut where the shape stays and a 1x1 stride-2 projection where it changes (first
block of stages 3, 4 and 5), global average pooling and one InnerProduct for the 120 breeds. Every
convolution has no bias and is followed by BatchNorm and Scale (with bias), in place, as Caffe expresses
batch normalization. The data layers follow models/bvlc_reference_caffenet/train_val.prototxt (the LMDBs and
mean of `cometctl prepare-dogs`, 256x256 images), with 224x224 crops. Accuracy runs in TRAIN and TEST, so
the label has two readers (the loss and the accuracy) in both phases.

    .venv/bin/python models/resnet18_dogs/make_resnet.py           # rewrite the three files
    .venv/bin/python models/resnet18_dogs/make_resnet.py --check   # exit 1 when a file differs

Plain text, no Caffe import: it runs without a build.
"""

from __future__ import annotations

import sys
from pathlib import Path

# models/solver_text.py, one folder up, writes the solver (make_imagenet_models.py uses it too)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from solver_text import generator_main, solver_text  # noqa: E402

HERE = Path(__file__).resolve().parent
CLASSES = 120
CROP = 224
# (stage number as in the layer names, channels, stride of its first block); two blocks per stage
STAGES = ((2, 64, 1), (3, 128, 2), (4, 256, 2), (5, 512, 2))
BLOCKS_PER_STAGE = 2
TRAIN_BATCH = 64
TEST_BATCH = 50


def _layer(name: str, type_: str, bottoms=(), tops=(), body: str = "") -> str:
    lines = [f'  name: "{name}"', f'  type: "{type_}"']
    lines += [f'  bottom: "{b}"' for b in bottoms]
    lines += [f'  top: "{t}"' for t in tops]
    if body:
        lines += ["  " + line for line in body.strip("\n").split("\n")]
    return "layer {\n" + "\n".join(lines) + "\n}\n"


def _conv(name: str, bottom: str, num: int, kernel: int, stride: int, pad: int, deploy: bool) -> str:
    filler = "" if deploy else '\n  weight_filler { type: "msra" }'
    param = "" if deploy else "param { lr_mult: 1 decay_mult: 1 }\n"
    body = (f"{param}convolution_param {{\n  num_output: {num}\n  kernel_size: {kernel}\n  stride: {stride}\n"
            f"  pad: {pad}\n  bias_term: false{filler}\n}}")
    return _layer(name, "Convolution", [bottom], [name], body)


def _bn_scale(suffix: str, blob: str, deploy: bool) -> str:
    """BatchNorm (statistics: Caffe sets their lr_mult to 0 itself) and Scale with bias, both in place."""
    scale_params = "" if deploy else "param { lr_mult: 1 decay_mult: 0 }\nparam { lr_mult: 1 decay_mult: 0 }\n"
    return (_layer(f"bn{suffix}", "BatchNorm", [blob], [blob]) +
            _layer(f"scale{suffix}", "Scale", [blob], [blob], scale_params + "scale_param { bias_term: true }"))


def _relu(name: str, blob: str) -> str:
    return f'layer {{ name: "{name}" type: "ReLU" bottom: "{blob}" top: "{blob}" }}\n'


def _block(stage: int, letter: str, bottom: str, in_ch: int, out_ch: int, stride: int,
           deploy: bool) -> tuple[str, str]:
    """One basic block; returns (its layers, its output blob)."""
    tag = f"{stage}{letter}"
    text = ""
    a, b = f"res{tag}_branch2a", f"res{tag}_branch2b"
    text += _conv(a, bottom, out_ch, 3, stride, 1, deploy) + _bn_scale(f"{tag}_branch2a", a, deploy)
    text += _relu(f"{a}_relu", a)
    text += _conv(b, a, out_ch, 3, 1, 1, deploy) + _bn_scale(f"{tag}_branch2b", b, deploy)
    shortcut = bottom
    if stride != 1 or in_ch != out_ch:  # the shape changes: a 1x1 projection
        shortcut = f"res{tag}_branch1"
        text += _conv(shortcut, bottom, out_ch, 1, stride, 0, deploy) + _bn_scale(f"{tag}_branch1", shortcut, deploy)
    out = f"res{tag}"
    text += _layer(out, "Eltwise", [shortcut, b], [out], "eltwise_param { operation: SUM }")
    text += _relu(f"{out}_relu", out)
    return text, out


def body(deploy: bool) -> str:
    """Everything between the input and the classifier's output blob 'fc120'."""
    text = _conv("conv1", "data", 64, 7, 2, 3, deploy) + _bn_scale("_conv1", "conv1", deploy)
    text += _relu("conv1_relu", "conv1")
    text += _layer("pool1", "Pooling", ["conv1"], ["pool1"],
                   "pooling_param { pool: MAX kernel_size: 3 stride: 2 }")
    blob, channels = "pool1", 64
    for stage, out_ch, stride in STAGES:
        for i in range(BLOCKS_PER_STAGE):
            block, blob = _block(stage, "abcdefgh"[i], blob, channels, out_ch, stride if i == 0 else 1, deploy)
            text += block
            channels = out_ch
    text += _layer("pool5", "Pooling", [blob], ["pool5"], "pooling_param { pool: AVE global_pooling: true }")
    fillers = "" if deploy else ('\n  weight_filler { type: "msra" }\n  bias_filler { type: "constant" value: 0 }')
    params = "" if deploy else "param { lr_mult: 1 decay_mult: 1 }\nparam { lr_mult: 2 decay_mult: 0 }\n"
    text += _layer("fc120", "InnerProduct", ["pool5"], ["fc120"],
                   f"{params}inner_product_param {{\n  num_output: {CLASSES}{fillers}\n}}")
    return text


def _data(phase: str) -> str:
    train = phase == "TRAIN"
    return _layer("data", "Data", [], ["data", "label"], f"""
include {{ phase: {phase} }}
transform_param {{
  mirror: {"true" if train else "false"}
  crop_size: {CROP}
  mean_file: "data/dogs/mean.binaryproto"
}}
data_param {{
  source: "data/dogs/{"train" if train else "val"}_lmdb"
  batch_size: {TRAIN_BATCH if train else TEST_BATCH}
  backend: LMDB
}}""")


def train_val() -> str:
    head = f"""# ResNet-18 for Stanford Dogs: {CLASSES} breeds. Written by make_resnet.py (edit that, not this file).
# Data from `cometctl prepare-dogs`: data/dogs/{{train,val}}_lmdb (256x256, shuffled) and
# data/dogs/mean.binaryproto; random {CROP}x{CROP} crops and mirroring in training, centre crops in testing.
# Convolution (no bias) + BatchNorm + Scale + ReLU, Eltwise SUM shortcuts, 1x1 stride-2 projections,
# global average pooling. Accuracy runs in both phases, so the label has two readers.
# Paths are relative to the repository root (`cometctl train` runs caffe from there).
name: "ResNet18-StanfordDogs"
"""
    tail = (_layer("loss", "SoftmaxWithLoss", ["fc120", "label"], ["loss"]) +
            _layer("accuracy", "Accuracy", ["fc120", "label"], ["accuracy"]))
    return head + _data("TRAIN") + _data("TEST") + body(deploy=False) + tail


def deploy() -> str:
    head = f"""# ResNet-18 for Stanford Dogs, for inference (written by make_resnet.py): {CROP}x{CROP} mean-subtracted BGR
# crops in, {CLASSES} breed probabilities out (label i is line i of data/dogs/synset_words.txt). BatchNorm
# uses its stored statistics in the TEST phase.
name: "ResNet18-StanfordDogs"
layer {{
  name: "data"
  type: "Input"
  top: "data"
  input_param {{ shape: {{ dim: 10 dim: 3 dim: {CROP} dim: {CROP} }} }}
}}
"""
    return head + body(deploy=True) + _layer("prob", "Softmax", ["fc120"], ["prob"])


def solver() -> str:
    head = f"""# Solver for ResNet-18 on Stanford Dogs (written by make_resnet.py). 12,000 training images: ~188
# iterations of {TRAIN_BATCH} per epoch, 64 epochs; 8,580 test images: 172 test iterations of {TEST_BATCH}.
# Trains from scratch on a GPU; `cometctl train --cpu` switches a copy of this file to the CPU.
"""
    return solver_text(head, net="models/resnet18_dogs/train_val.prototxt", test_iter=172, test_interval=500,
                       base_lr="0.1", schedule=['lr_policy: "multistep"', "gamma: 0.1", "stepvalue: 6000",
                                                "stepvalue: 10000"],
                       max_iter=12000, weight_decay="0.0001", snapshot=4000,
                       snapshot_prefix="models/resnet18_dogs/resnet18_dogs")


FILES = {"train_val.prototxt": train_val, "deploy.prototxt": deploy, "solver.prototxt": solver}


def main(argv=None) -> int:
    return generator_main(__doc__, Path(__file__).name, HERE, FILES, argv)


if __name__ == "__main__":
    sys.exit(main())
