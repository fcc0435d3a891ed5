"""Writes the ImageNet (ILSVRC-2012, 1,000 classes) variants of CaffeNet and AlexNet:

    models/bvlc_reference_caffenet/imagenet_{train_val,solver,deploy}.prototxt
    models/bvlc_alexnet/imagenet_{train_val,solver,deploy}.prototxt

Both nets are the 8-layer network of Krizhevsky et al. (2012) as the BVLC reference models define it: five
convolutions (96 11x11 stride 4; 256 5x5 pad 2 in two groups; 384 3x3; 384 3x3 in two groups; 256 3x3 in
two groups), ReLU after each, 3x3 stride-2 max pooling after conv1, conv2 and conv5, local response
normalization (5 channels, alpha 1e-4, beta 0.75) after the first two stages, then fc6 and fc7 (4,096,
ReLU, dropout 0.5) and fc8 with 1,000 outputs. They differ in two facts: CaffeNet pools before it
normalizes, AlexNet normalizes before it pools; and AlexNet starts its biases at 0.1 where CaffeNet starts
them at 1 (conv2, conv4, conv5, fc6, fc7). Data: the LMDBs and mean of `cometctl prepare-imagenet`
(data/imagenet, 256x256), random 227x227 crops and mirroring in training, centre crops in testing; test
batches of 50 x 1,000 iterations = the 50,000 val images. Solver: SGD, momentum 0.9, weight decay 5e-4,
base_lr 0.01 divided by 10 every 100,000 iterations, 450,000 iterations of 256, and the comet { } block.
Labels are the sorted WordNet IDs (data/imagenet/synset_words.txt), as in upstream's model zoo.

    .venv/bin/python models/make_imagenet_models.py           # rewrite the six files
    .venv/bin/python models/make_imagenet_models.py --check   # exit 1 when a file differs

Plain text, no Caffe import: it runs without a build.
"""

from __future__ import annotations

import sys
from pathlib import Path

from solver_text import generator_main, solver_text

MODELS = Path(__file__).resolve().parent
CLASSES = 1000
CROP = 227
TRAIN_BATCH = 256
TEST_BATCH = 50
TEST_ITER = 1000  # 50,000 val images
DATA = "data/imagenet"

NETS = {
    # folder: (title, name in the net, normalize before pooling, bias of the layers that do not start at 0)
    "bvlc_reference_caffenet": ("CaffeNet", "CaffeNet-ImageNet", False, "1"),
    "bvlc_alexnet": ("AlexNet", "AlexNet-ImageNet", True, "0.1"),
}
# name, outputs, kernel, stride, pad, group, bias starts at 0 (else at the net's other value)
CONVS = (("conv1", 96, 11, 4, 0, 1, True), ("conv2", 256, 5, 1, 2, 2, False), ("conv3", 384, 3, 1, 1, 1, True),
         ("conv4", 384, 3, 1, 1, 2, False), ("conv5", 256, 3, 1, 1, 2, False))


def _block(lines: list[str]) -> str:
    return "layer {\n" + "".join(f"  {line}\n" for line in lines) + "}\n"


def _params(deploy: bool) -> list[str]:
    return [] if deploy else ["param { lr_mult: 1 decay_mult: 1 }", "param { lr_mult: 2 decay_mult: 0 }"]


def _conv(name, bottom, num, kernel, stride, pad, group, bias, deploy) -> str:
    body = [f"num_output: {num}", f"kernel_size: {kernel}"]
    body += [f"stride: {stride}"] if stride != 1 else []
    body += [f"pad: {pad}"] if pad else []
    body += [f"group: {group}"] if group != 1 else []
    if not deploy:
        body += ['weight_filler { type: "gaussian" std: 0.01 }', f'bias_filler {{ type: "constant" value: {bias} }}']
    return _block([f'name: "{name}"', 'type: "Convolution"', f'bottom: "{bottom}"', f'top: "{name}"',
                   *_params(deploy), "convolution_param {", *[f"  {b}" for b in body], "}"])


def _ip(name, bottom, num, std, bias, deploy) -> str:
    body = [f"num_output: {num}"]
    if not deploy:
        body += [f'weight_filler {{ type: "gaussian" std: {std} }}', f'bias_filler {{ type: "constant" value: {bias} }}']
    return _block([f'name: "{name}"', 'type: "InnerProduct"', f'bottom: "{bottom}"', f'top: "{name}"',
                   *_params(deploy), "inner_product_param {", *[f"  {b}" for b in body], "}"])


def _relu(name, blob) -> str:
    return f'layer {{ name: "{name}" type: "ReLU" bottom: "{blob}" top: "{blob}" }}\n'


def _pool(name, bottom) -> str:
    return _block([f'name: "{name}"', 'type: "Pooling"', f'bottom: "{bottom}"', f'top: "{name}"',
                   "pooling_param { pool: MAX kernel_size: 3 stride: 2 }"])


def _lrn(name, bottom) -> str:
    return _block([f'name: "{name}"', 'type: "LRN"', f'bottom: "{bottom}"', f'top: "{name}"',
                   "lrn_param { local_size: 5 alpha: 0.0001 beta: 0.75 }"])


def _dropout(name, blob) -> str:
    return _block([f'name: "{name}"', 'type: "Dropout"', f'bottom: "{blob}"', f'top: "{blob}"',
                   "dropout_param { dropout_ratio: 0.5 }"])


def body(model: str, deploy: bool) -> str:
    """From 'data' to 'fc8'."""
    _, _, norm_first, bias = NETS[model]
    text, blob = "", "data"
    for i, (name, num, kernel, stride, pad, group, zero_bias) in enumerate(CONVS, 1):
        text += _conv(name, blob, num, kernel, stride, pad, group, "0" if zero_bias else bias, deploy)
        text += _relu(f"relu{i}", name)
        blob = name
        if i in (1, 2):  # pooling and normalization, in the net's order
            stages = [("norm", _lrn), ("pool", _pool)] if norm_first else [("pool", _pool), ("norm", _lrn)]
            for prefix, make in stages:
                text += make(f"{prefix}{i}", blob)
                blob = f"{prefix}{i}"
        elif i == 5:
            text += _pool("pool5", blob)
            blob = "pool5"
    for i, bottom in ((6, "pool5"), (7, "fc6")):
        text += _ip(f"fc{i}", bottom, 4096, 0.005, bias, deploy) + _relu(f"relu{i}", f"fc{i}")
        text += _dropout(f"drop{i}", f"fc{i}")
    return text + _ip("fc8", "fc7", CLASSES, 0.01, "0", deploy)


def _data(phase: str) -> str:
    train = phase == "TRAIN"
    return _block(['name: "data"', 'type: "Data"', 'top: "data"', 'top: "label"', f"include {{ phase: {phase} }}",
                   "transform_param {", f"  mirror: {'true' if train else 'false'}", f"  crop_size: {CROP}",
                   f'  mean_file: "{DATA}/mean.binaryproto"', "}", "data_param {",
                   f'  source: "{DATA}/{"train" if train else "val"}_lmdb"',
                   f"  batch_size: {TRAIN_BATCH if train else TEST_BATCH}", "  backend: LMDB", "}"])


def train_val(model: str) -> str:
    title, name, *_ = NETS[model]
    head = (f"# {title} for ImageNet (ILSVRC-2012): {CLASSES} classes. Written by models/make_imagenet_models.py\n"
            f"# (edit that, not this file). Data from `cometctl prepare-imagenet`: {DATA}/{{train,val}}_lmdb\n"
            f"# (256x256, shuffled; label i = the i-th WordNet ID in sorted order) and {DATA}/mean.binaryproto;\n"
            f"# random {CROP}x{CROP} crops and mirroring in training, centre crops in testing.\n"
            f"# Paths are relative to the repository root (`cometctl train` runs caffe from there).\n"
            f'name: "{name}"\n')
    tail = (_block(['name: "accuracy"', 'type: "Accuracy"', 'bottom: "fc8"', 'bottom: "label"', 'top: "accuracy"',
                    "include { phase: TEST }"]) +
            _block(['name: "accuracy_top5"', 'type: "Accuracy"', 'bottom: "fc8"', 'bottom: "label"',
                    'top: "accuracy_top5"', "include { phase: TEST }", "accuracy_param { top_k: 5 }"]) +
            _block(['name: "loss"', 'type: "SoftmaxWithLoss"', 'bottom: "fc8"', 'bottom: "label"', 'top: "loss"']))
    return head + _data("TRAIN") + _data("TEST") + body(model, deploy=False) + tail


def deploy(model: str) -> str:
    title, name, *_ = NETS[model]
    head = (f"# {title} for ImageNet, for inference (written by models/make_imagenet_models.py): {CROP}x{CROP}\n"
            f"# mean-subtracted BGR crops in, {CLASSES} class probabilities out (label i is line i of\n"
            f"# {DATA}/synset_words.txt).\n"
            f'name: "{name}"\n')
    data = _block(['name: "data"', 'type: "Input"', 'top: "data"',
                   f"input_param {{ shape: {{ dim: 10 dim: 3 dim: {CROP} dim: {CROP} }} }}"])
    return head + data + body(model, deploy=True) + _block(['name: "prob"', 'type: "Softmax"', 'bottom: "fc8"',
                                                             'top: "prob"'])


def solver(model: str) -> str:
    title = NETS[model][0]
    head = f"""# Solver for {title} on ImageNet (written by models/make_imagenet_models.py). 1,281,167 training
# images: ~5,000 iterations of {TRAIN_BATCH} per epoch, 90 epochs; 50,000 val images: {TEST_ITER} test
# iterations of {TEST_BATCH}. Trains on a GPU; `cometctl train --cpu` switches a copy of this file to the CPU.
"""
    return solver_text(head, net=f"models/{model}/imagenet_train_val.prototxt", test_iter=TEST_ITER,
                       test_interval=1000, base_lr="0.01",
                       schedule=['lr_policy: "step"', "gamma: 0.1", "stepsize: 100000"], max_iter=450000,
                       weight_decay="0.0005", snapshot=10000, snapshot_prefix=f"models/{model}/{model}_imagenet")


FILES = {"imagenet_train_val.prototxt": train_val, "imagenet_solver.prototxt": solver,
         "imagenet_deploy.prototxt": deploy}


def main(argv=None) -> int:
    files = {f"{model}/{fname}": (lambda model=model, make=make: make(model))
             for model in NETS for fname, make in FILES.items()}
    return generator_main(__doc__, Path(__file__).name, MODELS, files, argv)


if __name__ == "__main__":
    sys.exit(main())
