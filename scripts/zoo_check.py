"""Model-zoo equivalence check: every net in the list trained COMET off and COMET on, compared.

Each net's train_val prototxt is read at run time (upstream's from the patched tree of the CPU build,
build/cpu/src/{models,examples}; ours from models/). Only the TRAIN net is kept (layers that Caffe would
leave out of phase TRAIN are dropped), and every data layer (Data, ImageData, HDF5Data, WindowData,
MemoryData, Input) is replaced by a DummyData layer with the same tops, at the small batch and input
shape of the table (`--list`; see "Inputs" below), labels uniform in [0, C - 0.001], which Caffe
truncates to the class indices 0..C-1.
Caffe's random seed is set again before every step, so every step sees the same batch (and the same
Dropout masks): the net fits that batch and its loss falls, which a COMET that breaks learning cannot
hide.

For each net two child processes (one per setting, so that an abort is that net's failure, reported
with the last lines of its stderr) build a solver (random_seed 1701, lr_policy fixed, momentum 0.9,
weight_decay 0.0005, the table's base_lr), run one forward+backward from the initial weights, keep the
outputs and every layer's weight gradient, then train --iters steps and record every net output per
step. COMET off has no comet block; COMET on has

    comet { eb_mode: ADAPTIVE error_bound: 1e-3 adaptive_target: 0.05 update_interval: 1
            tiled_gemm: false }

(--comet replaces what is inside the braces; tiled_gemm: false because the tiles' products differ in
rounding from OpenBLAS's own, which iter0's bitwise comparison would report; the tiles have tests of
their own, CometGemmTest). Checks, per net:

  iter0    the outputs of the first forward are bitwise identical, off and on, and so are those of the
           first training step (the store compresses a blob only after its last forward reader, so a
           forward pass never sees compressed data). The off run must also repeat its own first forward
           bitwise in its first step, or the harness itself is not deterministic.
  ran      both runs exit cleanly and every output of every step is finite.
  freed    the COMET run's output holds no read of memory the store freed (`COMET ... freed after its
           last use`, `reads as zeros`, `held only as the signs`): a warning in older stores, where such
           a read computed on zeros, a fatal error (and so also a failed run) in newer ones.
  loss     the total loss (outputs weighted by their loss weights), averaged over the last 3 steps,
           differs between on and off by at most LOSS_TOL = 1% of the off value plus LOSS_ABS = 0.001.
  stored   the COMET run's last step held its activations at least 2x smaller than dense (the store's
           own figures, Solver.comet_stats()): a store that kept everything dense would pass every
           other check. pycaffe_linreg stores nothing, by design, and must not.
  grad     the relative error of each learnable layer's weight gradient after the first
           forward+backward, ||dW_on - dW_off|| / ||dW_off|| (all of a layer's parameter blobs
           together), is at most GRAD_FACTOR = 1 times adaptive_target (0.05 by default).

Why these tolerances (measured with this script, --iters 10, on a build whose store handles every net of
the list, and with destructive settings through --comet):

  loss     correct runs differ by at most 0.08% (cifar10_quick; all others 0.03% or less), so 1% leaves
           a 12x margin. FIXED error_bound 0.1 (gradient errors up to 1.4) moves the loss by 1.8-2.4% on
           cifar10_quick, cifar10_full and siamese; FIXED 1e3 (every stored activation destroyed) by 4% to
           142% on all nets but the autoencoder (0.8%: the biases learn the mean image without any stored
           activation); logits read as zeros keep the loss at ln(C). The trajectory is insensitive to
           moderate gradient errors, which is what the grad check is for; base_lr of each net is chosen so
           that COMET off's loss falls by 17% to 69% in 10 steps without reaching 0 (two nets at 0 would
           agree whatever COMET did).
  grad     the first step stores activations at the starting bound 1e-3; correct runs reach at most 0.019
           (siamese feat) and 0.017 (cifar10_quick and _full, ip1: these nets' small initial weights
           make the activations themselves about 1e-3), the other nets about 0.004 or less. The adaptive rule
           then aims every layer at the target, so the first step must not exceed it: factor 1 leaves a
           2.6x margin over the largest measured error, while a blob read as zeros gives about 1 and
           FIXED 1e3 gives 0.85 to 1 on every net but cifar10_full (0.046; its one lossy input, average
           pooled noise, is nearly constant; its loss check fails instead).

Inputs: images are Gaussian noise of std 50 (mean-subtracted 0..255 pixels; 0.4 for comet_tiny, which
scales by 1/128), MNIST nets uniform in [0, 0.26] (mean 0.13, that of MNIST; uniform [0, 1] would make
the autoencoder's best answer the constant 0.5, the same as logits read as zeros), hdf5_nonlinear's four
features standard normal. pycaffe_linreg keeps its own DummyData and imports its Python loss layer from
upstream's examples/pycaffe/layers (PYTHONPATH of the child); that layer has no COMET fact row, so its
inputs stay dense and the net checks that a Python layer trains unchanged beside the store.

The verdict of a net is PASS when all checks pass; the exit status is 1 when any net fails, 2 on a usage
error. `--json FILE` writes every figure (per-step outputs, per-layer gradient errors, stderr tails).

    scripts/zoo_check [--nets a,b] [--iters N] [--json FILE] [--comet TEXT] [--keep DIR] [--list]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cometctl.caffeproto import DATA_LAYER_TYPES, in_train_phase  # noqa: E402

SEED = 1701
DEFAULT_ITERS = 10
DEFAULT_COMET = "eb_mode: ADAPTIVE error_bound: 1e-3 adaptive_target: 0.05 update_interval: 1 tiled_gemm: false"
LOSS_TOL = 0.01      # relative difference of the mean total loss over the last LAST_STEPS steps
LOSS_ABS = 1e-3      # ... plus this much absolute
LAST_STEPS = 3
GRAD_FACTOR = 1.0    # first-step weight-gradient error allowed, as a fraction of adaptive_target
MIN_STORED_RATIO = 2.0  # the last step's activations held at least this many times smaller (stored)
DATA_TYPES = DATA_LAYER_TYPES  # replaced by DummyData
FREED_READ = re.compile(r"COMET.*(reads as zeros|freed after its last use|held only as the signs)")
TAIL_LINES = 12


@dataclass(frozen=True)
class ZooNet:
    """One net of the check. tops: a data top's name -> ("gauss", (C, H, W), std) for mean-subtracted
    images, ("uniform", (C, H, W), high) for images scaled into [0, high], ("label", classes) for class
    indices."""

    name: str
    source: str      # "upstream:<path in the patched tree>" or "repo:<path in this checkout>"
    batch: int
    tops: dict
    base_lr: float = 0.01
    note: str = ""
    pythonpath: str = ""  # where its Python layers' modules are, as source says ("upstream:<folder>")
    # the stored check: the last step's activations held at least MIN_STORED_RATIO times smaller;
    # False: the store keeps everything dense by design, and must (a Python loss layer has no fact row)
    stores: bool = True
    # fine-tuning: every layer before this one frozen (lr_mult 0; caffeproto.freeze_layers_before)
    freeze_before: str = ""
    # every ReLU made a PReLU (in place where the ReLU was), the activation of Caffe's face nets
    prelu: bool = False
    # every ReLU made a Swish, out of place (EfficientNet's activation): the layers after it read its output
    swish: bool = False
    # every ReLU made a Swish in place (a ReLU's type swapped): its backward works from its sigmoid's input
    swish_in_place: bool = False
    # MobileNet's convolutions: each 3x3 but the stem a depthwise one (a group per channel) and a 1x1
    depthwise: bool = False
    # the COMET run's starting bound (error_bound) when not the check's: where the first step,
    # whose bounds no rule has measured yet, needs a smaller one to stay under the target
    start_bound: float = 0.0

    def input_text(self) -> str:
        if not self.tops:
            return "the net's own DummyData"
        parts = []
        for top, spec in self.tops.items():
            if spec[0] == "label":
                parts.append(f"{top}: {self.batch} in [0,{spec[1]})")
            else:
                parts.append(f"{top}: {self.batch}x{'x'.join(map(str, spec[1]))}")
        return ", ".join(parts)


def _image(c, h, w, std=50.0):
    """Mean-subtracted pixels (0..255 minus the mean: std about 50), or scaled by the net's transform."""
    return ("gauss", (c, h, w), std)


# MNIST scaled to [0, 1] has mean intensity 0.13 (mostly black): uniform in [0, 0.26] has that mean. With
# uniform [0, 1] targets the autoencoder's best answer is the constant 0.5, i.e. its logits at 0, which is
# also what a store that reads its blobs as zeros gives.
MNIST_HIGH = 0.26
MNIST = ("uniform", (1, 28, 28), MNIST_HIGH)


NETS = [
    ZooNet("caffenet", "upstream:models/bvlc_reference_caffenet/train_val.prototxt", 4,
           {"data": _image(3, 227, 227), "label": ("label", 1000)}, base_lr=2e-5),
    ZooNet("alexnet", "upstream:models/bvlc_alexnet/train_val.prototxt", 2,
           {"data": _image(3, 227, 227), "label": ("label", 1000)}, base_lr=3e-4),
    ZooNet("googlenet", "upstream:models/bvlc_googlenet/train_val.prototxt", 2,
           {"data": _image(3, 224, 224), "label": ("label", 1000)}, base_lr=2e-5,
           note="three losses read the label; Concat of four branches"),
    ZooNet("flickr_style", "upstream:models/finetune_flickr_style/train_val.prototxt", 4,
           {"data": _image(3, 227, 227), "label": ("label", 20)}, base_lr=2e-6,
           note="ImageData; CaffeNet with a 20-way fc8_flickr at lr_mult 10"),
    ZooNet("cifar10_quick", "upstream:examples/cifar10/cifar10_quick_train_test.prototxt", 8,
           {"data": _image(3, 32, 32), "label": ("label", 10)}, base_lr=0.003),
    ZooNet("cifar10_quick_prelu", "upstream:examples/cifar10/cifar10_quick_train_test.prototxt", 8,
           {"data": _image(3, 32, 32), "label": ("label", 10)}, base_lr=0.003, prelu=True,
           start_bound=1e-4,
           note="its ReLUs made PReLUs, in place: each PReLU's copy of its input stored lossy with "
                "exact signs. Starting bound 1e-4: at the first step, before PReLU's rule has "
                "measured, its slope's gradient errs by about the bound over its input's RMS "
                "(upstream's initial weights leave conv3's output near 1e-2: 10% at 1e-3; the rule "
                "then picks 7e-4 to 6e-3 for relu2 and relu3, 6e-5 for relu1)"),
    ZooNet("cifar10_quick_swish", "upstream:examples/cifar10/cifar10_quick_train_test.prototxt", 8,
           {"data": _image(3, 32, 32), "label": ("label", 10)}, base_lr=0.003, swish=True,
           note="its ReLUs made Swish, out of place: each Swish's input stored lossy under the "
                "derivative rule, its sigmoid's buffers freed after the forward"),
    ZooNet("cifar10_quick_swish_in_place", "upstream:examples/cifar10/cifar10_quick_train_test.prototxt", 8,
           {"data": _image(3, 32, 32), "label": ("label", 10)}, base_lr=0.003, swish_in_place=True,
           note="its ReLUs made Swish in place: each Swish's sigmoid input (beta x) stored lossy under the "
                "derivative rule, its sigmoid's output freed after the forward"),
    ZooNet("cifar10_full", "upstream:examples/cifar10/cifar10_full_train_test.prototxt", 8,
           {"data": _image(3, 32, 32), "label": ("label", 10)}, base_lr=0.02,
           note="LRN WITHIN_CHANNEL, average pooling"),
    ZooNet("cifar10_sigmoid", "upstream:examples/cifar10/cifar10_full_sigmoid_train_test.prototxt", 8,
           {"data": _image(3, 32, 32), "label": ("label", 10)}, base_lr=0.001,
           note="Sigmoid without BatchNorm: each output read by its own backward and the next "
                "convolution, under the tighter of the derivative rule and the weight rule"),
    ZooNet("cifar10_sigmoid_bn", "upstream:examples/cifar10/cifar10_full_sigmoid_train_test_bn.prototxt", 8,
           {"data": _image(3, 32, 32), "label": ("label", 10)}, base_lr=0.001,
           note="BatchNorm without Scale, not in place; Sigmoid; max then average pooling"),
    ZooNet("lenet", "upstream:examples/mnist/lenet_train_test.prototxt", 8,
           {"data": MNIST, "label": ("label", 10)}, base_lr=0.03),
    ZooNet("mnist_autoencoder", "upstream:examples/mnist/mnist_autoencoder.prototxt", 8, {"data": MNIST},
           base_lr=0.01, note="Sigmoid; SigmoidCrossEntropy and Euclidean losses read the flattened input"),
    ZooNet("siamese", "upstream:examples/siamese/mnist_siamese_train_test.prototxt", 8,
           {"pair_data": ("uniform", (2, 28, 28), MNIST_HIGH), "sim": ("label", 2)}, base_lr=0.01,
           note="Slice, shared weights, ContrastiveLoss"),
    ZooNet("comet_tiny", "repo:models/comet_tiny/train_val.prototxt", 8,
           {"data": _image(3, 56, 56, 0.4), "label": ("label", 10)}, base_lr=0.003),
    ZooNet("caffenet_dogs", "repo:models/bvlc_reference_caffenet/train_val.prototxt", 4,
           {"data": _image(3, 227, 227), "label": ("label", 120)}, base_lr=2e-5),
    ZooNet("resnet18_dogs", "repo:models/resnet18_dogs/train_val.prototxt", 4,
           {"data": _image(3, 112, 112), "label": ("label", 120)}, base_lr=1e-4,
           note="crop 112 instead of 224; BatchNorm+Scale, Eltwise SUM, Accuracy in TRAIN"),
    ZooNet("resnet18_frozen", "repo:models/resnet18_dogs/train_val.prototxt", 4,
           {"data": _image(3, 112, 112), "label": ("label", 120)}, base_lr=1e-4, freeze_before="res4a_branch2a",
           note="fine-tuning: conv1 to res3 frozen (lr_mult 0, BatchNorm's three too); their blobs and "
                "buffers freed after their forward"),
    ZooNet("resnet18_depthwise", "repo:models/resnet18_dogs/train_val.prototxt", 4,
           {"data": _image(3, 112, 112), "label": ("label", 120)}, base_lr=1e-4, depthwise=True,
           note="MobileNet's convolutions: each 3x3 but the stem split into a depthwise 3x3 (a group per "
                "channel) with BatchNorm, Scale and ReLU, and a 1x1"),
    ZooNet("hdf5_nonlinear", "upstream:examples/hdf5_classification/nonlinear_auto_train.prototxt", 10,
           {"data": ("gauss", (4,), 1.0), "label": ("label", 2)}, base_lr=0.01,
           note="HDF5Data; InnerProduct only; Accuracy in TRAIN reads the loss's input"),
    ZooNet("pycaffe_linreg", "upstream:examples/pycaffe/linreg.prototxt", 10, {}, base_lr=0.01,
           pythonpath="upstream:examples/pycaffe/layers", stores=False,
           note="a Python loss layer (pyloss.EuclideanLossLayer); DummyData of its own"),
]
BY_NAME = {n.name: n for n in NETS}


# ---------------------------------------------------------------------------------------- the nets

def source_path(net: ZooNet, source: str | None = None) -> Path:
    kind, rel = (source or net.source).split(":", 1)
    if kind == "repo":
        return ROOT / rel
    from cometctl import paths

    return paths.pycaffe_dir(None).parent / rel  # the patched upstream tree beside pycaffe


in_train = in_train_phase  # the TRAIN net's layers (cometctl.caffeproto)


def dummy_layer(name: str, tops, net: ZooNet, pb2):
    """A DummyData layer named `name` producing `tops` as the table says."""
    layer = pb2.LayerParameter(name=name, type="DummyData")
    for top in tops:
        if top not in net.tops:
            raise ValueError(f"{net.name}: the data top '{top}' is not in the table (known: {', '.join(net.tops)})")
        spec = net.tops[top]
        layer.top.append(top)
        filler = layer.dummy_data_param.data_filler.add()
        shape = layer.dummy_data_param.shape.add()
        if spec[0] == "label":
            shape.dim.extend([net.batch])  # as Data layers make it: one value per image
            filler.type, filler.min, filler.max = "uniform", 0.0, spec[1] - 1e-3
        elif spec[0] == "uniform":
            shape.dim.extend([net.batch, *spec[1]])
            filler.type, filler.min, filler.max = "uniform", 0.0, spec[2]
        else:
            shape.dim.extend([net.batch, *spec[1]])
            filler.type, filler.mean, filler.std = "gaussian", 0.0, spec[2]
    return layer


def train_net(net: ZooNet, pb2):
    """The TRAIN net of `net`, its data layers replaced by DummyData: a NetParameter."""
    from cometctl.caffeproto import make_depthwise_separable, read_text_proto, replace_relus

    src = read_text_proto(source_path(net), pb2.NetParameter())
    out = pb2.NetParameter()
    out.CopyFrom(src)
    del out.layer[:]
    out.ClearField("input")
    out.ClearField("input_shape")
    out.ClearField("input_dim")
    if src.input:  # the legacy net-level inputs: one DummyData for all
        out.layer.append(dummy_layer("input", list(src.input), net, pb2))
    replaced = []
    for layer in src.layer:
        if not in_train(layer, pb2):
            continue
        if layer.type in DATA_TYPES:
            out.layer.append(dummy_layer(layer.name, list(layer.top), net, pb2))
            replaced.extend(layer.top)
            continue
        kept = out.layer.add()
        kept.CopyFrom(layer)
        kept.ClearField("include")
        kept.ClearField("exclude")
    if net.prelu:
        replace_relus(out.layer, "PReLU")
    if net.swish or net.swish_in_place:
        replace_relus(out.layer, "Swish", out_of_place=net.swish)
    if net.depthwise:
        layers = list(out.layer)
        make_depthwise_separable(layers)
        del out.layer[:]
        out.layer.extend(layers)
    missing = set(net.tops) - set(replaced) - set(src.input)
    if missing:
        raise ValueError(f"{net.name}: no data layer makes {', '.join(sorted(missing))}")
    if net.freeze_before:
        from cometctl.caffeproto import freeze_layers_before

        freeze_layers_before(out.layer, net.freeze_before)
    return out


def solver_text(netfile: Path, prefix: Path, base_lr: float, comet: str | None) -> str:
    text = (f'net: "{netfile}"\nbase_lr: {base_lr}\nlr_policy: "fixed"\nmomentum: 0.9\nweight_decay: 0.0005\n'
            f'display: 1\nmax_iter: 1000000\nsnapshot: 0\nsnapshot_after_train: false\n'
            f'snapshot_prefix: "{prefix}"\nrandom_seed: {SEED}\nsolver_mode: CPU\n')
    return text + (f"comet {{ {comet} }}\n" if comet is not None else "")


# ------------------------------------------------------------------------------ the child process

def child(mode: str, workdir: Path, iters: int) -> int:
    """One setting of one net: writes <mode>.json and <mode>_grads.npz into workdir."""
    import numpy as np
    from cometctl import paths

    sys.path.insert(0, str(paths.pycaffe_dir(None)))
    import caffe

    caffe.set_mode_cpu()
    t0 = time.time()
    solver = caffe.get_solver(str(workdir / f"solver_{mode}.prototxt"))
    net = solver.net
    weights = net.blob_loss_weights
    outputs = list(net.outputs)

    def snapshot_outputs():
        vals = {o: net.blobs[o].data.astype(np.float64).ravel().tolist() for o in outputs}
        total = sum(weights.get(o, 0.0) * sum(v) for o, v in vals.items())
        return {"outputs": vals, "loss": total}

    result = {"mode": mode, "outputs": outputs, "loss_weights": {o: weights.get(o, 0.0) for o in outputs}}
    # one forward+backward from the initial weights: the outputs and every weight gradient
    for name in net.params:
        for p in net.params[name]:
            p.diff[...] = 0
    caffe.set_random_seed(SEED)
    net.forward()
    result["first"] = snapshot_outputs()
    net.backward()
    layers = [name for name in net.params if len(net.params[name])]
    np.savez(workdir / f"{mode}_grads.npz",
             **{f"g{i}": np.concatenate([p.diff.ravel() for p in net.params[name]]) for i, name in enumerate(layers)})
    result["grad_layers"] = layers
    (workdir / f"{mode}.json").write_text(json.dumps(result))
    # training: the same batch every step
    result["steps"] = []
    for _ in range(iters):
        caffe.set_random_seed(SEED)
        solver.step(1)
        result["steps"].append(snapshot_outputs())
        (workdir / f"{mode}.json").write_text(json.dumps(result))
    if mode == "on":
        try:
            stats = solver.comet_stats() or {}  # the last step's (display: 1)
            result["bounds"] = {k: float(v) for k, v in dict(stats.get("bounds", {})).items()}
            layers = list(stats.get("layers", []))
            result["stored"] = {"dense_bytes": sum(int(l["dense_bytes"]) for l in layers),
                                "stored_bytes": sum(int(l["stored_bytes"]) for l in layers)}
        except Exception as e:  # figures only; never a failure of the check
            result["bounds_error"] = str(e)
    result["seconds"] = time.time() - t0
    (workdir / f"{mode}.json").write_text(json.dumps(result))
    return 0


# ----------------------------------------------------------------------------- the parent process

@dataclass
class Run:
    mode: str
    rc: int | None = None
    seconds: float = 0.0
    result: dict = field(default_factory=dict)
    tail: list = field(default_factory=list)
    freed_reads: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.rc == 0 and "steps" in self.result


def _rc_text(rc: int | None) -> str:
    if rc is None:
        return "timed out"
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit status {rc}"


def run_child(mode: str, workdir: Path, iters: int, timeout: float, argv=None, pythonpath: Path | None = None) -> Run:
    """Run one setting in a child process; its stderr goes to workdir/<mode>.log."""
    env = dict(os.environ, GLOG_minloglevel="1", GLOG_logtostderr="1")  # warnings: the freed reads
    if pythonpath:  # the net's Python layers, imported by Caffe in the child
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH", "")]))
    argv = argv or [sys.executable, str(Path(__file__).resolve()), "--child", mode,
                    "--workdir", str(workdir), "--iters", str(iters)]
    log = workdir / f"{mode}.log"
    run = Run(mode)
    t0 = time.time()
    with open(log, "w") as err:
        try:
            run.rc = subprocess.run(argv, stdout=err, stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            run.rc = None
    run.seconds = time.time() - t0
    lines = log.read_text(errors="replace").splitlines()
    run.tail = lines[-TAIL_LINES:]
    run.freed_reads = [line for line in lines if FREED_READ.search(line)]
    try:
        run.result = json.loads((workdir / f"{mode}.json").read_text())
    except (OSError, ValueError):
        run.result = {}
    return run


def _finite(run: Run) -> bool:
    snaps = ([run.result["first"]] if "first" in run.result else []) + run.result.get("steps", [])
    return all(math.isfinite(x) for s in snaps for v in s["outputs"].values() for x in v) and \
        all(math.isfinite(s["loss"]) for s in snaps)


def grad_errors(workdir: Path, off: Run, on: Run) -> dict:
    """Layer -> ||dW_on - dW_off|| / ||dW_off|| (None where neither has a gradient; inf where only on has)."""
    import numpy as np

    if off.result.get("grad_layers") != on.result.get("grad_layers"):
        return {}
    out = {}
    with np.load(workdir / "off_grads.npz") as a, np.load(workdir / "on_grads.npz") as b:
        for i, name in enumerate(off.result["grad_layers"]):
            x, y = a[f"g{i}"].astype(np.float64), b[f"g{i}"].astype(np.float64)
            ref, diff = float(np.linalg.norm(x)), float(np.linalg.norm(y - x))
            if ref == 0:
                out[name] = None if float(np.linalg.norm(y)) == 0 else math.inf
            else:
                out[name] = diff / ref
    return out


def _tail_mean(run: Run) -> float | None:
    steps = run.result.get("steps", [])[-LAST_STEPS:]
    return sum(s["loss"] for s in steps) / len(steps) if steps else None


def compare(net: ZooNet, workdir: Path, off: Run, on: Run, target: float) -> dict:
    """Every check of one net: {check: {"pass": bool, ...figures}}."""
    checks = {}
    # iter0
    if "first" in off.result and "first" in on.result:
        same_first = off.result["first"]["outputs"] == on.result["first"]["outputs"]
        steps_off, steps_on = off.result.get("steps", []), on.result.get("steps", [])
        same_step = bool(steps_off and steps_on) and steps_off[0]["outputs"] == steps_on[0]["outputs"]
        repeat = bool(steps_off) and steps_off[0]["outputs"] == off.result["first"]["outputs"]
        diffs = [abs(a - b) for o in off.result["first"]["outputs"]
                 for a, b in zip(off.result["first"]["outputs"][o], on.result["first"]["outputs"].get(o, []))]
        checks["iter0"] = {"pass": same_first and same_step and repeat, "first_forward_identical": same_first,
                           "first_step_identical": same_step, "off_repeats_itself": repeat,
                           "loss_off": off.result["first"]["loss"], "loss_on": on.result["first"]["loss"],
                           "max_abs_diff": max(diffs) if diffs else None}
    else:
        checks["iter0"] = {"pass": False, "why": "a run stopped before its first forward"}
    # ran
    ran = {"pass": off.ok and on.ok and _finite(off) and _finite(on)}
    for r in (off, on):
        ran[r.mode] = {"status": _rc_text(r.rc), "finite": _finite(r), "steps": len(r.result.get("steps", [])),
                       "seconds": round(r.seconds, 1)}
        if not r.ok:
            ran[r.mode]["stderr_tail"] = r.tail
    checks["ran"] = ran
    # freed
    checks["freed"] = {"pass": not on.freed_reads, "count": len(on.freed_reads),
                       "first": on.freed_reads[:3]}
    # loss
    a, b = _tail_mean(off), _tail_mean(on)
    n_off, n_on = len(off.result.get("steps", [])), len(on.result.get("steps", []))
    if a is not None and b is not None and n_off == n_on and math.isfinite(a) and math.isfinite(b):
        rel = abs(b - a) / max(abs(a), 1e-12)
        checks["loss"] = {"pass": abs(b - a) <= LOSS_TOL * abs(a) + LOSS_ABS, "off": a, "on": b,
                          "rel_diff": rel, "tolerance": f"|on-off| <= {LOSS_TOL} |off| + {LOSS_ABS}",
                          "off_trajectory": [s["loss"] for s in off.result["steps"]],
                          "on_trajectory": [s["loss"] for s in on.result["steps"]]}
    else:
        checks["loss"] = {"pass": False, "off": a, "on": b, "why": "no complete, finite trajectory to compare"}
    # grad
    errs = grad_errors(workdir, off, on) if (workdir / "off_grads.npz").exists() and \
        (workdir / "on_grads.npz").exists() else {}
    measured = {k: v for k, v in errs.items() if v is not None}
    limit = GRAD_FACTOR * target
    if measured:
        worst = max(measured, key=lambda k: measured[k])
        checks["grad"] = {"pass": measured[worst] <= limit, "max": measured[worst], "layer": worst,
                          "limit": limit, "per_layer": errs}
    else:
        checks["grad"] = {"pass": False, "limit": limit, "why": "no gradients to compare", "per_layer": errs}
    # stored
    st = on.result.get("stored")
    if st is None:
        checks["stored"] = {"pass": False, "why": "no COMET statistics from the COMET run (no store?)"}
    else:
        ratio = st["dense_bytes"] / st["stored_bytes"] if st["stored_bytes"] else (math.inf if st["dense_bytes"] else 1.0)
        ok = ratio >= MIN_STORED_RATIO if net.stores else st["dense_bytes"] == 0
        checks["stored"] = {"pass": ok, "ratio": ratio, "limit": MIN_STORED_RATIO if net.stores else "nothing stored",
                            **st}
    return checks


def check_net(net: ZooNet, iters: int, comet: str, target: float, base: Path, timeout: float, pb2) -> dict:
    from cometctl.caffeproto import write_text_proto

    workdir = base / net.name
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    netfile = workdir / "net.prototxt"
    write_text_proto(netfile, train_net(net, pb2))
    if net.start_bound:
        from google.protobuf import text_format

        block = pb2.CometParameter()
        text_format.Merge(comet, block)
        block.error_bound = net.start_bound
        comet = text_format.MessageToString(block, as_one_line=True)
    for mode, block in (("off", None), ("on", comet)):
        (workdir / f"solver_{mode}.prototxt").write_text(
            solver_text(netfile, workdir / f"snap_{mode}", net.base_lr, block))
    pythonpath = source_path(net, net.pythonpath) if net.pythonpath else None
    off = run_child("off", workdir, iters, timeout, pythonpath=pythonpath)
    on = run_child("on", workdir, iters, timeout, pythonpath=pythonpath)
    checks = compare(net, workdir, off, on, target)
    for f in workdir.glob("*_grads.npz"):
        f.unlink()  # up to 250 MB each (AlexNet)
    return {"source": net.source, "input": net.input_text(), "iters": iters, "base_lr": net.base_lr,
            "checks": checks, "verdict": "PASS" if all(c["pass"] for c in checks.values()) else "FAIL",
            "loss_weights": off.result.get("loss_weights") or on.result.get("loss_weights"),
            "first_forward": {r.mode: r.result.get("first") for r in (off, on)},
            "steps": {r.mode: r.result.get("steps", []) for r in (off, on)},
            "bounds_after": on.result.get("bounds"), "seconds": round(time.time() - t0, 1)}


def _fmt(x, spec=".4g") -> str:
    return "-" if x is None else format(x, spec)


def table(results: dict) -> str:
    rows = ["| net | input | iter-0 identical | loss off -> on (last 3) | rel diff | max dW error (layer) "
            "| stored | freed reads | verdict |", "|---|---|---|---|---:|---|---:|---:|---|"]
    for name, r in results.items():
        c = r["checks"]
        i0 = c["iter0"]
        if "first_forward_identical" in i0:
            i0_text = "yes" if i0["pass"] else (
                f"NO ({_fmt(i0['loss_off'])} vs {_fmt(i0['loss_on'])})" if not i0["first_forward_identical"]
                else "NO (first step)" if not i0["first_step_identical"] else "NO (off not repeatable)")
        else:
            i0_text = "-"
        loss = c["loss"]
        g = c["grad"]
        grad_text = f"{_fmt(g['max'], '.2e')} ({g['layer']})" if "max" in g else "-"
        verdict = r["verdict"]
        if not c["ran"]["pass"]:
            bad = [f"{m}: {c['ran'][m]['status']}" + ("" if c["ran"][m]["finite"] else ", not finite")
                   for m in ("off", "on") if c["ran"][m]["status"] != "exit status 0" or not c["ran"][m]["finite"]
                   or c["ran"][m]["steps"] < r["iters"]]
            verdict += " (" + "; ".join(bad) + ")"
        failed = [k for k, v in c.items() if not v["pass"]]
        if failed:
            verdict += " [" + ",".join(failed) + "]"
        stored_text = f"{c['stored']['ratio']:.1f}x" if "ratio" in c["stored"] else "-"
        rows.append(f"| {name} | {r['input']} | {i0_text} | {_fmt(loss.get('off'))} -> {_fmt(loss.get('on'))} | "
                    f"{_fmt(loss.get('rel_diff'), '.2%')} | {grad_text} | {stored_text} | {c['freed']['count']} | {verdict} |")
    return "\n".join(rows)


def export(names: list[str], out: Path, pb2) -> int:
    """--export: the nets as `caffe train` alone can run them (scripts/gpu_zoo_check.py on the GPU
    machine, which has no pycaffe)."""
    from cometctl.caffeproto import write_text_proto

    out.mkdir(parents=True, exist_ok=True)
    rows = ["# name\tbase_lr\tstart_bound: the COMET run's error_bound where not the check's, else - "
            "(scripts/zoo_check.py --export)"]
    for name in names:
        net = BY_NAME[name]
        if net.pythonpath:
            print(f"zoo_check: --export leaves out {name} (a Python layer: pycaffe)", file=sys.stderr)
            continue
        write_text_proto(out / f"{name}.prototxt", train_net(net, pb2))
        start = repr(net.start_bound) if net.start_bound else "-"
        rows.append(f"{name}\t{net.base_lr!r}\t{start}")
    (out / "nets.tsv").write_text("\n".join(rows) + "\n")
    print(f"zoo_check: {len(rows) - 1} nets in {out}", file=sys.stderr)
    return 0


def _target(comet: str, pb2) -> float:
    from google.protobuf import text_format

    msg = pb2.CometParameter()
    text_format.Merge(comet, msg)
    return msg.adaptive_target


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nets", help="comma-separated names (default: all; see --list)")
    ap.add_argument("--list", action="store_true", help="list the nets, their sources and inputs, and exit")
    ap.add_argument("--iters", type=int, help=f"training steps per run (default {DEFAULT_ITERS})")
    ap.add_argument("--json", type=Path, help="write every figure to this file")
    ap.add_argument("--comet", default=DEFAULT_COMET,
                    help=f'inside of the COMET run\'s comet {{ }} block (default "{DEFAULT_COMET}")')
    ap.add_argument("--keep", type=Path, help="keep the prototxts and logs in this folder")
    ap.add_argument("--timeout", type=float, default=900, help="seconds allowed per run (default 900)")
    ap.add_argument("--export", type=Path, metavar="DIR",
                    help="write each net's TRAIN net with DummyData (DIR/NAME.prototxt) and DIR/nets.tsv (name, "
                         "base_lr) for scripts/gpu_zoo_check.py, and exit; nets with Python layers are left out")
    ap.add_argument("--child", choices=("off", "on"), help=argparse.SUPPRESS)
    ap.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child:
        return child(args.child, args.workdir, args.iters)
    if args.list:
        for n in NETS:
            print(f"{n.name:18} {n.source}\n{'':18} batch {n.batch}, base_lr {n.base_lr}: "
                  f"{n.input_text()}" + (f"\n{'':18} {n.note}" if n.note else ""))
        return 0
    names = [s for s in (args.nets or "").split(",") if s] or [n.name for n in NETS]
    unknown = [s for s in names if s not in BY_NAME]
    if unknown:
        print(f"zoo_check: unknown net(s) {', '.join(unknown)}; --list shows them", file=sys.stderr)
        return 2
    if args.iters is not None and args.iters < 1:
        print("zoo_check: --iters must be at least 1", file=sys.stderr)
        return 2
    from cometctl.caffeproto import caffe_pb2
    from cometctl.errors import CometError

    try:
        pb2 = caffe_pb2()
        target = _target(args.comet, pb2)
    except CometError as e:
        print(f"zoo_check: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a --comet that does not parse
        print(f"zoo_check: --comet: {e}", file=sys.stderr)
        return 2

    if args.export:
        return export(names, args.export, pb2)

    t0 = time.time()
    base = args.keep or Path(tempfile.mkdtemp(prefix="zoo-check-"))
    base.mkdir(parents=True, exist_ok=True)
    results = {}
    try:
        for name in names:
            net = BY_NAME[name]
            iters = args.iters if args.iters is not None else DEFAULT_ITERS
            try:
                results[name] = check_net(net, iters, args.comet, target, base, args.timeout, pb2)
            except (CometError, ValueError) as e:  # the prototxt is missing or does not fit the table
                results[name] = {"source": net.source, "input": net.input_text(), "iters": iters,
                                 "verdict": "FAIL", "error": str(e), "checks": {}}
            r = results[name]
            print(f"{name}: {r['verdict']}" + (f" ({r['error']})" if "error" in r else f" in {r['seconds']} s"),
                  file=sys.stderr, flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    seconds = time.time() - t0
    shown = {k: v for k, v in results.items() if v["checks"]}
    print(f"COMET off vs on ({{ {args.comet} }}), {len(results)} nets, seed {SEED}:")
    print(table(shown))
    for name, r in results.items():
        if "error" in r:
            print(f"\n{name}: FAIL: {r['error']}")
        for mode in ("off", "on"):
            tail = r["checks"].get("ran", {}).get(mode, {}).get("stderr_tail")
            if tail:
                print(f"\n{name}, COMET {mode}: {r['checks']['ran'][mode]['status']}; last lines of its output:")
                print("\n".join("    " + line for line in tail))
        freed = r["checks"].get("freed", {})
        if freed.get("count"):
            print(f"\n{name}, COMET on: {freed['count']} read(s) of freed memory, e.g.\n    {freed['first'][0]}")
    failed = [k for k, v in results.items() if v["verdict"] != "PASS"]
    print(f"\n{len(results) - len(failed)} of {len(results)} nets PASS in {seconds:.0f} s"
          + (f"; FAIL: {', '.join(failed)}" if failed else ""))
    if args.json:
        args.json.write_text(json.dumps({"comet": args.comet, "seed": SEED, "seconds": seconds,
                                         "tolerances": {"loss_rel": LOSS_TOL, "loss_abs": LOSS_ABS,
                                                        "last_steps": LAST_STEPS, "grad_factor": GRAD_FACTOR,
                                                        "grad_limit": GRAD_FACTOR * target},
                                         "nets": results, "failed": failed}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
