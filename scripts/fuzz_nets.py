"""Random nets, trained COMET off and on, compared: the store's plan checked on topologies nobody wrote.

Each seed makes one train net from Caffe's layer types: a DummyData input (4 images, 3x12x12, labels
0..4), then 4 to 10 random steps, each reading a blob made earlier (most often a recent one, so the net
is deep, sometimes an old one, so blobs fan out through Caffe's Split): Convolution (3x3, 1x1, strided,
dilated, depthwise, frozen with lr_mult 0, with propagate_down: false), activations in place on their
input (ReLU, leaky ReLU, PReLU, ELU, TanH, Sigmoid, Swish, Exp, Dropout, BatchNorm, Scale) or beside it
(the same and AbsVal, BNLL, Power, Clip, MVN, LRN across and within channels, Bias, Softmax, Log, ELU
with a negative alpha, PReLU with one slope), InnerProduct inside the net (through Flatten or not, its
weights transposed, or along axis 2; reshaped back to 4 axes), Tile, Pooling (MAX with and without its
mask top, padded, overlapping, AVE, global), Eltwise SUM/PROD/MAX of two or three blobs, Concat, a
two-bottom Scale or Bias, Slice, a Convolution with two bottoms (one set of weights, two tops),
Deconvolution with a Crop back to an earlier blob's size, and what CNNs use less: SPP, Im2col, an
explicit Split, Silence, a Parameter added to a blob, a 3-D Convolution on 5-axis blobs, LSTM and RNN
(the batch as 2 time steps of 2 streams), Embed of the label, BatchReindex by drawn or constant indices,
ArgMax and Threshold as outputs of the net; side losses (Reduction of each operation, EuclideanLoss,
SigmoidCrossEntropyLoss with a target that takes no gradient, HingeLoss, ContrastiveLoss between two
pooled blobs, MultinomialLogisticLoss after a Softmax, InfogainLoss with its gains as a third bottom, a
Filter that keeps some samples of the batch and their labels for a loss of their own). The head is an
InnerProduct into SoftmaxWithLoss, sometimes with Accuracy in TRAIN and a second weighted head; some nets
have `force_backward: true`, some convolutions a twin that shares their weights, some activations a
`loss_weight` on a top that later layers read; some solvers have `iter_size: 2`, some a TEST net
(`test_interval: 2`), whose outputs after the last test must match too. What a seed makes is a function
of the seed alone (Python's `random.Random`).

Every net is trained 3 steps in its own child process each way (Caffe's random seed set again before
every step, so Dropout draws the same masks), and then pycaffe runs one forward and backward:

  off     no comet block. Its outputs and gradients must be finite, or the seed's net is not a test.
  exact   `compress_type: "None"` (nothing lossy: masks, releases, freed diffs, codes and rebuilt
          buffers only) with a random choice of the store's switches (async, decode_ahead, pool_codes,
          layer_buffers, recompute_lrn, keep_compressed, memory_pool, memory_pool_headroom,
          rebuild_from_batchnorm, max_in_flight_mb). Every output of every step, every weight gradient
          and the input's gradient must be those of `off` bit for bit (where the store computes LRN
          within a channel itself, to float rounding: ROUNDING). After the first step pycaffe reads
          every blob's data: each read either gives `off`'s bits or is refused with a RuntimeError
          that names COMET (a blob the store freed); it never gives other values.
  lossy   `eb_mode: FIXED error_bound: 1e-3` with another random choice of switches. The first
          step's outputs must be `off`'s bit for bit (the store compresses a blob only after its last
          forward reader), every figure finite, and each blob read after the first step either
          refused or within 1e-3 (plus float rounding) of `off`'s; the weight gradients of the last
          pycaffe backward within GRAD_TOL (relative L2) of `off`'s (relative_errors), that
          backward run from `off`'s weights (net.copy_from), so that it measures one step's
          compression error and not three steps of drift. A FIXED bound holds no gradient to a
          target. Measured on seeds 0-299: median 0.0006, the largest 0.032 (seed 246).
  adaptive  `eb_mode: ADAPTIVE error_bound: 1e-3 update_interval: 1` (the default mode, each
          layer's bound set again after every step from its gradient-error estimate, target 5%)
          with a third choice of switches: the same checks as lossy, each read within the largest
          bound of step 1 (solver.comet_stats()'s bounds). Measured on seeds 0-299: median
          0.035, then 0.135 (seed 256; nets of the generator before 2026-12-07's fourth
          session, as the figures up to seed 680's below). Two kinds of net failed (seeds 550-799, 2026-12-07): a
          per-channel scale right before a BatchNorm of 4 values a channel (seed 762, a Scale,
          51%; seed 246, PReLU slopes where a channel's inputs are all negative, 20%), whose
          true gradient BatchNorm projects to about 0 while the error of its input gradient
          (5%, as the rule aims) is not projected: 3.7% and 5.7% since BatchNorm's x_norm_ is
          moved back to its exact moments; and a TanH's input gradient 5% off as its rule aims,
          summed by an InnerProduct below over a batch that BatchReindex made of one sample
          twice, whose true gradients cancel (seed 680, 28%; 9.4% since 2026-12-07's fourth
          session, when derivative rules also bound the weight gradients below them). Seeds
          0-299 of the generator since then: median 0.036, 0.054 at the 90th percentile,
          seed 142 fails (0.31, docs/comet.md).

`tiled_gemm: false` in both: the tiles round differently from OpenBLAS's own split (CometGemmTest).
A child that aborts (a COMET fatal error, a crash) fails its net with the last lines of its stderr.

    scripts/fuzz_nets [--seeds 0-99] [--keep DIR] [--print SEED] [--json FILE] [--export DIR]

Exit status 0 when every net passes, 1 when any fails (each failure printed with its seed: rerun it
with `--seeds N --keep DIR` to get the net, the solvers and the logs), 2 on a usage error.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BATCH, CLASSES = 4, 5
STEPS = 3
ERROR_BOUND = 1e-3
ROUNDING = 1e-4  # relative: where the store computes a backward by other steps than upstream (LRN within)
GRAD_TOL = 0.25  # lossy weight gradients, relative L2 against COMET off
GRAD_FLOOR = 0.05  # ... of at least this fraction of the largest layer's gradient (gradient_floor)
IN_PLACE = ["ReLU", "LeakyReLU", "PReLU", "ELU", "TanH", "Sigmoid", "Swish", "Exp", "Dropout", "BatchNorm",
            "Scale", "BatchNormScale"]
BESIDE = IN_PLACE + ["AbsVal", "BNLL", "Power", "Clip", "MVN", "LRN", "LRNWithin", "Bias", "Softmax", "Log",
                     "ELUNegative", "PReLUShared"]


@dataclass
class Blob:
    name: str
    c: int
    h: int
    w: int
    writable: bool = True  # a layer's top (not the input): an in-place layer may rewrite it
    read: bool = False     # read by a layer beside it: Caffe refuses an in-place layer after that

    @property
    def shape(self):
        return (self.c, self.h, self.w)


class NetMaker:
    """One random net; `text()` is its prototxt."""

    def __init__(self, seed: int):
        self.r = random.Random(seed)
        # Layers added since 2026-12-07's runs draw from a generator of their own, so that a seed's
        # net stays as it was unless one of them is swapped in (the figures of seeds 0-2549 hold).
        self.later = random.Random(f"later {seed}")
        self.layers: list[str] = []
        self.blobs: list[Blob] = [Blob("data", 3, 12, 12, writable=False)]
        self.count = 0
        self.force_backward = self.r.random() < 0.2

    # ------------------------------------------------------------------------------------- helpers
    def name(self, kind: str) -> str:
        self.count += 1
        return f"{kind.lower()}{self.count}"

    def pick(self, pred=lambda b: True) -> Blob | None:
        candidates = [b for b in self.blobs if pred(b)]
        if not candidates:
            return None
        if self.r.random() < 0.7:
            return candidates[-1] if self.r.random() < 0.6 else self.r.choice(candidates[-3:])
        return self.r.choice(candidates)

    def add(self, text: str, *reads: Blob):
        self.layers.append(text)
        for b in reads:
            b.read = True

    def new(self, name, c, h, w) -> Blob:
        b = Blob(name, c, h, w)
        self.blobs.append(b)
        return b

    def as_maps(self, name: str, k: int, dims: str = "dim: 0 dim: -1"):
        """Reshapes blob `name` (N x K, or as `dims` says) back to N x K x 1 x 1 as `name`r, a blob
        the layers after may read."""
        self.add(f'layer {{ name: "{name}r" type: "Reshape" bottom: "{name}" top: "{name}r" '
                 f'reshape_param {{ shape {{ {dims} dim: 1 dim: 1 }} }} }}')
        self.new(f"{name}r", k, 1, 1)

    def propagate_down(self) -> str:
        return "propagate_down: false " if self.r.random() < 0.08 else ""

    # -------------------------------------------------------------------------------------- layers
    def conv(self, src: Blob):
        n = self.name("conv")
        kind = self.r.choice(["3x3", "3x3", "1x1", "stride2", "depthwise", "dilated"])
        cout, group, k, pad, stride, dilation = self.r.choice([4, 6, 8]), 1, 3, 1, 1, 1
        if kind == "1x1":
            k, pad = 1, 0
        elif kind == "dilated":
            pad = dilation = 2
        elif kind == "stride2" and src.h >= 4:
            stride = 2
        elif kind == "depthwise" and src.c > 1:
            cout = group = src.c
        bias = self.r.random() < 0.7
        std = math.sqrt(2.0 / (k * k * src.c / group))
        frozen = self.r.random() < 0.15
        params = ("param { lr_mult: 0 } " * (2 if bias else 1)) if frozen else ""
        # a twin reading another blob of as many channels shares the weights (Siamese nets)
        twins = [b for b in self.blobs if b is not src and b.c == src.c]
        twin = self.r.choice(twins) if twins and self.r.random() < 0.12 else None
        pairs = [b for b in self.blobs if b is not src and b.shape == src.shape]
        if not twin and pairs and self.r.random() < 0.1:  # one layer, two bottoms, two tops
            return self.conv_pair(src, self.r.choice(pairs), n, cout, group, k, pad, stride, dilation, bias, params)
        if twin:
            mult = "lr_mult: 0 " if frozen else ""
            params = f'param {{ name: "{n}_w" {mult}}} ' + (f'param {{ name: "{n}_b" {mult}}} ' if bias else "")
        body = (f'convolution_param {{ num_output: {cout} kernel_size: {k} pad: {pad} stride: {stride} '
                f'dilation: {dilation} group: {group} bias_term: {str(bias).lower()} '
                f'weight_filler {{ type: "gaussian" std: {std:.4f} }} '
                f'bias_filler {{ type: "constant" value: 0.1 }} }} }}')
        for name, bottom in [(n, src)] + ([(n + "t", twin)] if twin else []):
            self.add(f'layer {{ name: "{name}" type: "Convolution" bottom: "{bottom.name}" top: "{name}" {params}'
                     f'{self.propagate_down()}' + body, bottom)
            h = (bottom.h + 2 * pad - dilation * (k - 1) - 1) // stride + 1
            w = (bottom.w + 2 * pad - dilation * (k - 1) - 1) // stride + 1
            self.new(name, cout, h, w)

    def conv_pair(self, a: Blob, b: Blob, n, cout, group, k, pad, stride, dilation, bias, params):
        std = math.sqrt(2.0 / (k * k * a.c / group))
        self.add(f'layer {{ name: "{n}" type: "Convolution" bottom: "{a.name}" bottom: "{b.name}" top: "{n}" '
                 f'top: "{n}b" {params}convolution_param {{ num_output: {cout} kernel_size: {k} pad: {pad} '
                 f'stride: {stride} dilation: {dilation} group: {group} bias_term: {str(bias).lower()} '
                 f'weight_filler {{ type: "gaussian" std: {std:.4f} }} '
                 f'bias_filler {{ type: "constant" value: 0.1 }} }} }}', a, b)
        h = (a.h + 2 * pad - dilation * (k - 1) - 1) // stride + 1
        w = (a.w + 2 * pad - dilation * (k - 1) - 1) // stride + 1
        self.new(n, cout, h, w)
        self.new(n + "b", cout, h, w)

    def activation(self, src: Blob, kind: str, in_place: bool):
        n = self.name(kind)
        top = src.name if in_place else n
        head = f'layer {{ name: "{n}" bottom: "{src.name}" top: "{top}" '
        if kind == "BatchNormScale":  # ResNet's pair: BatchNorm and Scale, both on one blob
            self.add(head + 'type: "BatchNorm" }', *(() if in_place else (src,)))
            self.add(f'layer {{ name: "{n}s" type: "Scale" bottom: "{top}" top: "{top}" scale_param {{ '
                     f'bias_term: true filler {{ type: "constant" value: 1.2 }} '
                     f'bias_filler {{ type: "constant" value: 0.1 }} }} }}')
        else:
            body = {
                "ReLU": 'type: "ReLU"',
                "LeakyReLU": 'type: "ReLU" relu_param { negative_slope: 0.1 }',
                "PReLU": 'type: "PReLU"',
                "ELU": 'type: "ELU"',
                "TanH": 'type: "TanH"',
                "Sigmoid": 'type: "Sigmoid"',
                "Swish": 'type: "Swish"',
                "Exp": 'type: "Exp" exp_param { scale: 0.1 }',
                "Dropout": 'type: "Dropout" dropout_param { dropout_ratio: 0.3 }',
                "BatchNorm": 'type: "BatchNorm"',
                "Scale": 'type: "Scale" scale_param { bias_term: true filler { type: "constant" value: 0.9 } '
                         'bias_filler { type: "constant" value: -0.1 } }',
                "AbsVal": 'type: "AbsVal"',
                "BNLL": 'type: "BNLL"',
                "Power": 'type: "Power" power_param { power: 2 scale: 0.3 shift: 0.2 }',
                "Clip": 'type: "Clip" clip_param { min: -0.8 max: 0.8 }',
                "MVN": f'type: "MVN" mvn_param {{ normalize_variance: {str(self.r.random() < 0.5).lower()} '
                       f'across_channels: {str(self.r.random() < 0.3).lower()} }}',
                "LRN": 'type: "LRN" lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 }',
                "LRNWithin": 'type: "LRN" lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 '
                             'norm_region: WITHIN_CHANNEL }',
                "Bias": 'type: "Bias" bias_param { filler { type: "constant" value: 0.2 } }',
                "Softmax": 'type: "Softmax"',  # over the channels
                "Log": 'type: "Log" log_param { shift: 10 scale: 0.05 }',  # x > -200
                "ELUNegative": 'type: "ELU" elu_param { alpha: -0.5 }',  # asks its input's sign
                "PReLUShared": 'type: "PReLU" prelu_param { channel_shared: true }',
            }[kind]
            # a weighted top that later layers read on (Caffe adds the weight to its diff)
            weight = " loss_weight: 0.001" if not in_place and self.r.random() < 0.06 else ""
            self.add(head + (self.propagate_down() if not in_place else "") + body + weight + " }",
                     *(() if in_place else (src,)))
        if not in_place:
            # a weighted top counts as read (Caffe's Split feeds the loss): nothing in place after it
            self.new(n, src.c, src.h, src.w).read = " loss_weight:" in self.layers[-1]

    def pool(self, src: Blob):
        n = self.name("pool")
        options = [("AVE", 3, 1, 1)]
        if src.h >= 2:
            options += [("MAX", 2, 2, 0), ("MAX", 3, 2, 1), ("MAX", 3, 1, 1), ("AVE", 3, 2, 1), ("MAX", 2, 2, 0)]
        method, k, s, p = self.r.choice(options)
        mask_top = method == "MAX" and self.r.random() < 0.2
        if self.r.random() < 0.1:
            self.add(f'layer {{ name: "{n}" type: "Pooling" bottom: "{src.name}" top: "{n}" '
                     f'pooling_param {{ pool: {method} global_pooling: true }} }}', src)
            self.new(n, src.c, 1, 1)
            return
        tops = f'top: "{n}" ' + (f'top: "{n}_mask" ' if mask_top else "")
        self.add(f'layer {{ name: "{n}" type: "Pooling" bottom: "{src.name}" {tops}'
                 f'pooling_param {{ pool: {method} kernel_size: {k} stride: {s} pad: {p} }} }}', src)
        # Caffe's pooled size rounds up
        h = int(math.ceil((src.h + 2 * p - k) / s)) + 1
        w = int(math.ceil((src.w + 2 * p - k) / s)) + 1
        if p and (h - 1) * s >= src.h + p:
            h -= 1
        if p and (w - 1) * s >= src.w + p:
            w -= 1
        self.new(n, src.c, h, w)

    def join(self, a: Blob) -> bool:
        same = [b for b in self.blobs if b is not a and b.shape == a.shape]
        plane = [b for b in self.blobs if b is not a and (b.h, b.w) == (a.h, a.w)]
        n = self.name("join")
        if same and self.r.random() < 0.7:
            b = self.r.choice(same)
            op = self.r.choice(["SUM", "PROD", "MAX", "SCALE", "BIAS"])
            third = [x for x in same if x is not b]
            if op in ("SUM", "PROD", "MAX") and third and self.r.random() < 0.6:
                c = self.r.choice(third)
                self.add(f'layer {{ name: "{n}" type: "Eltwise" bottom: "{a.name}" bottom: "{b.name}" '
                         f'bottom: "{c.name}" top: "{n}" eltwise_param {{ operation: {op} }} }}', a, b, c)
            elif op == "BIAS":  # a second bottom as the biases
                self.add(f'layer {{ name: "{n}" type: "Bias" bottom: "{a.name}" bottom: "{b.name}" '
                         f'top: "{n}" bias_param {{ axis: 0 }} }}', a, b)
            elif op == "SCALE":  # a second bottom as the factors (squeeze-and-excitation's multiply)
                self.add(f'layer {{ name: "{n}" type: "Scale" bottom: "{a.name}" bottom: "{b.name}" '
                         f'top: "{n}" scale_param {{ axis: 0 }} }}', a, b)
            else:
                coeff = " coeff: 1 coeff: -0.5" if op == "SUM" and self.r.random() < 0.4 else ""
                self.add(f'layer {{ name: "{n}" type: "Eltwise" bottom: "{a.name}" bottom: "{b.name}" '
                         f'top: "{n}" eltwise_param {{ operation: {op}{coeff} }} }}', a, b)
            self.new(n, a.c, a.h, a.w)
            return True
        if plane:
            b = self.r.choice(plane)
            self.add(f'layer {{ name: "{n}" type: "Concat" bottom: "{a.name}" bottom: "{b.name}" top: "{n}" }}', a, b)
            self.new(n, a.c + b.c, a.h, a.w)
            return True
        return False

    def slice(self, src: Blob) -> bool:
        if src.c < 2:
            return False
        n = self.name("slice")
        point = self.r.randint(1, src.c - 1)
        self.add(f'layer {{ name: "{n}" type: "Slice" bottom: "{src.name}" top: "{n}a" top: "{n}b" '
                 f'slice_param {{ axis: 1 slice_point: {point} }} }}', src)
        self.new(f"{n}a", point, src.h, src.w)
        self.new(f"{n}b", src.c - point, src.h, src.w)
        return True

    def deconv(self, src: Blob) -> bool:
        if src.h > 12:
            return False
        n = self.name("deconv")
        cout = self.r.choice([3, 4, 6])
        self.add(f'layer {{ name: "{n}" type: "Deconvolution" bottom: "{src.name}" top: "{n}" '
                 f'convolution_param {{ num_output: {cout} kernel_size: 2 stride: 2 '
                 f'weight_filler {{ type: "gaussian" std: {math.sqrt(1.0 / src.c):.4f} }} }} }}', src)
        up = self.new(n, cout, src.h * 2, src.w * 2)
        smaller = [b for b in self.blobs if b.h < up.h and b.w < up.w]
        if smaller and self.r.random() < 0.6:  # FCN's way back to an earlier size
            ref = self.r.choice(smaller)
            c = self.name("crop")
            self.add(f'layer {{ name: "{c}" type: "Crop" bottom: "{n}" bottom: "{ref.name}" top: "{c}" '
                     f'crop_param {{ axis: 2 offset: {(up.h - ref.h) // 2} }} }}', up, ref)
            self.new(c, cout, ref.h, ref.w)
        return True

    def dense(self, src: Blob):
        """An InnerProduct inside the net (through Flatten or straight), reshaped back to N x K x 1 x 1."""
        n, k = self.name("dense"), self.r.choice([8, 12, 16])
        bottom, kind = src, self.later.choice([None, None, None, "transpose", "rows"])
        if self.r.random() < 0.4:
            self.add(f'layer {{ name: "{n}f" type: "Flatten" bottom: "{src.name}" top: "{n}f" }}', src)
            bottom = Blob(f"{n}f", src.c * src.h * src.w, 1, 1)
            kind = None if kind == "rows" else kind  # two axes: no axis 2
        # transpose: its weights stored features x outputs; rows: axis 2, each sample's channels its rows
        extra = {"transpose": "transpose: true ", "rows": "axis: 2 "}.get(kind, "")
        features = src.h * src.w if kind == "rows" else src.c * src.h * src.w
        std = math.sqrt(2.0 / features)
        self.add(f'layer {{ name: "{n}" type: "InnerProduct" bottom: "{bottom.name}" top: "{n}" '
                 f'inner_product_param {{ num_output: {k} {extra}weight_filler {{ type: "gaussian" std: {std:.4f} }} }} }}',
                 bottom, src)
        self.as_maps(n, k * src.c if kind == "rows" else k)

    def tile(self, src: Blob):
        n = self.name("tile")
        self.add(f'layer {{ name: "{n}" type: "Tile" bottom: "{src.name}" top: "{n}" '
                 f'tile_param {{ axis: 1 tiles: 2 }} }}', src)
        self.new(n, src.c * 2, src.h, src.w)

    def side_loss(self, src: Blob):
        n = self.name("side")
        same = [b for b in self.blobs if b is not src and b.shape == src.shape and b.name != "data"]
        kind = self.r.choice(["Euclidean", "Reduction", "Reduction", "SigmoidCrossEntropy", "Hinge",
                              "Contrastive", "MultinomialLogistic"])
        if kind in ("Euclidean", "SigmoidCrossEntropy") and not same:
            kind = "Reduction"
        # never forced: that would ask for a gradient to the Filter's selector and to Infogain's gains
        if self.later.random() < 0.25 and not self.force_backward:
            kind = self.later.choice(["Filter", "Infogain"])
        if kind == "Euclidean":
            b = self.r.choice(same)
            self.add(f'layer {{ name: "{n}" type: "EuclideanLoss" bottom: "{src.name}" bottom: "{b.name}" '
                     f'top: "{n}" loss_weight: 0.01 }}', src, b)
        elif kind == "SigmoidCrossEntropy":  # an autoencoder's loss: the target takes no gradient
            b = self.r.choice(same)
            self.add(f'layer {{ name: "{n}" type: "SigmoidCrossEntropyLoss" bottom: "{src.name}" bottom: "{b.name}" '
                     f'top: "{n}" propagate_down: true propagate_down: false loss_weight: 0.01 }}', src, b)
        elif kind == "Hinge":
            norm = self.r.choice(["L1", "L2"])
            self.add(f'layer {{ name: "{n}" type: "HingeLoss" bottom: "{src.name}" bottom: "label" top: "{n}" '
                     f'hinge_loss_param {{ norm: {norm} }} loss_weight: 0.01 }}', src)
        elif kind == "Contrastive":  # the Siamese loss between two pooled blobs of as many channels
            pair = [b for b in self.blobs if b is not src and b.c == src.c and b.name != "data"]
            b = self.r.choice(pair) if pair else src
            for x, tag in ((src, "a"), (b, "b")):
                self.add(f'layer {{ name: "{n}{tag}" type: "Pooling" bottom: "{x.name}" top: "{n}{tag}" '
                         f'pooling_param {{ pool: AVE global_pooling: true }} }}', x)
            self.add(f'layer {{ name: "{n}" type: "ContrastiveLoss" bottom: "{n}a" bottom: "{n}b" bottom: "label" '
                     f'top: "{n}" contrastive_loss_param {{ margin: 1 }} loss_weight: 0.01 }}')
        elif kind == "MultinomialLogistic":  # probabilities from a Softmax of their own
            std = math.sqrt(1.0 / (src.c * src.h * src.w))
            self.add(f'layer {{ name: "{n}i" type: "InnerProduct" bottom: "{src.name}" top: "{n}i" '
                     f'inner_product_param {{ num_output: {CLASSES} '
                     f'weight_filler {{ type: "gaussian" std: {std:.4f} }} }} }}', src)
            self.add(f'layer {{ name: "{n}p" type: "Softmax" bottom: "{n}i" top: "{n}p" }}')
            self.add(f'layer {{ name: "{n}" type: "MultinomialLogisticLoss" bottom: "{n}p" bottom: "label" '
                     f'top: "{n}" loss_weight: 0.1 }}')
        elif kind == "Filter":  # a loss on some samples of the batch (their shapes change at the first forward)
            keep = self.later.choice([(1, 1, 0, 0), (1, 0, 0, 1), (0, 1, 1, 1), (0, 0, 1, 0)])
            runs = [[keep[0]]]  # the selector as runs of equal values, concatenated along the batch
            for v in keep[1:]:
                runs[-1].append(v) if v == runs[-1][0] else runs.append([v])
            tops = " ".join(f'top: "{n}s{i}"' for i in range(len(runs)))
            shapes = " ".join(f"shape {{ dim: {len(run)} }}" for run in runs)
            fillers = " ".join(f'data_filler {{ type: "constant" value: {run[0]} }}' for run in runs)
            self.add(f'layer {{ name: "{n}s" type: "DummyData" {tops} dummy_data_param {{ {shapes} {fillers} }} }}')
            self.add(f'layer {{ name: "{n}c" type: "Concat" '
                     + " ".join(f'bottom: "{n}s{i}"' for i in range(len(runs)))
                     + f' top: "{n}c" concat_param {{ axis: 0 }} }}')
            self.add(f'layer {{ name: "{n}f" type: "Filter" bottom: "{src.name}" bottom: "label" bottom: "{n}c" '
                     f'top: "{n}f" top: "{n}l" }}', src)
            std = math.sqrt(1.0 / (src.c * src.h * src.w))
            self.add(f'layer {{ name: "{n}i" type: "InnerProduct" bottom: "{n}f" top: "{n}i" '
                     f'inner_product_param {{ num_output: {CLASSES} '
                     f'weight_filler {{ type: "gaussian" std: {std:.4f} }} }} }}')
            self.add(f'layer {{ name: "{n}" type: "SoftmaxWithLoss" bottom: "{n}i" bottom: "{n}l" '
                     f'top: "{n}" propagate_down: true propagate_down: false loss_weight: 0.1 }}')
        elif kind == "Infogain":  # its gains H a third bottom, drawn again every forward
            std = math.sqrt(1.0 / (src.c * src.h * src.w))
            self.add(f'layer {{ name: "{n}i" type: "InnerProduct" bottom: "{src.name}" top: "{n}i" '
                     f'inner_product_param {{ num_output: {CLASSES} '
                     f'weight_filler {{ type: "gaussian" std: {std:.4f} }} }} }}', src)
            self.add(f'layer {{ name: "{n}h" type: "DummyData" top: "{n}h" dummy_data_param {{ shape {{ dim: 1 '
                     f'dim: 1 dim: {CLASSES} dim: {CLASSES} }} data_filler {{ type: "uniform" min: 0 max: 1 }} }} }}')
            self.add(f'layer {{ name: "{n}" type: "InfogainLoss" bottom: "{n}i" bottom: "label" bottom: "{n}h" '
                     f'top: "{n}" loss_weight: 0.1 }}')
        else:
            op, axis = self.r.choice(["SUMSQ", "SUM", "ASUM", "MEAN"]), self.r.choice([0, 1])
            self.add(f'layer {{ name: "{n}" type: "Reduction" bottom: "{src.name}" top: "{n}" '
                     f'reduction_param {{ operation: {op} axis: {axis} }} loss_weight: 0.0005 }}', src)

    # Layers Caffe has that CNNs use less: each leaves a 4-axis blob (or none) for the layers after.
    def spp(self, src: Blob):
        """Spatial pyramid pooling (two levels), reshaped back to N x K x 1 x 1."""
        if src.h < 2 or src.w < 2:
            return self.pool(src)
        n = self.name("spp")
        self.add(f'layer {{ name: "{n}" type: "SPP" bottom: "{src.name}" top: "{n}" '
                 f'spp_param {{ pyramid_height: 2 pool: {self.r.choice(["MAX", "AVE"])} }} }}', src)
        self.as_maps(n, src.c * 5)

    def im2col(self, src: Blob):
        if src.h < 2 or src.w < 2:
            return self.conv(src)
        n = self.name("im2col")
        self.add(f'layer {{ name: "{n}" type: "Im2col" bottom: "{src.name}" top: "{n}" '
                 f'convolution_param {{ kernel_size: 2 stride: 2 }} }}', src)
        self.new(n, src.c * 4, (src.h - 2) // 2 + 1, (src.w - 2) // 2 + 1)

    def split(self, src: Blob):
        """An explicit Split: its tops share the bottom's memory (nothing may run in place on them)."""
        n = self.name("split")
        self.add(f'layer {{ name: "{n}" type: "Split" bottom: "{src.name}" top: "{n}a" top: "{n}b" }}', src)
        for t in "ab":
            self.new(n + t, src.c, src.h, src.w).writable = False

    def silence(self, src: Blob):
        self.add(f'layer {{ name: "{self.name("silence")}" type: "Silence" bottom: "{src.name}" }}', src)

    def parameter(self, src: Blob):
        """A learned blob of src's shape (its top is the weight's memory), added to src."""
        n = self.name("param")
        self.add(f'layer {{ name: "{n}" type: "Parameter" top: "{n}" parameter_param {{ shape {{ dim: {BATCH} '
                 f'dim: {src.c} dim: {src.h} dim: {src.w} }} }} }}')
        self.add(f'layer {{ name: "{n}s" type: "Eltwise" bottom: "{src.name}" bottom: "{n}" top: "{n}s" }}', src)
        self.new(f"{n}s", src.c, src.h, src.w)

    def recurrent(self, src: Blob):
        """LSTM or RNN over 2 time steps of 2 streams (the batch of 4 reshaped), back to N x 6 x 1 x 1."""
        kind = self.r.choice(["LSTM", "RNN"])
        n = self.name(kind)
        cont = self.r.choice([0, 1])  # 1: each forward goes on from the last one's hidden state
        self.add(f'layer {{ name: "{n}c" type: "DummyData" top: "{n}c" dummy_data_param {{ '
                 f'shape {{ dim: 2 dim: 2 }} data_filler {{ type: "constant" value: {cont} }} }} }}')
        self.add(f'layer {{ name: "{n}x" type: "Reshape" bottom: "{src.name}" top: "{n}x" '
                 f'reshape_param {{ shape {{ dim: 2 dim: 2 dim: -1 }} }} }}', src)
        self.add(f'layer {{ name: "{n}" type: "{kind}" bottom: "{n}x" bottom: "{n}c" top: "{n}" recurrent_param {{ '
                 f'num_output: 6 weight_filler {{ type: "uniform" min: -0.3 max: 0.3 }} '
                 f'bias_filler {{ type: "constant" value: 0.1 }} }} }}')
        self.as_maps(n, 6, f"dim: {BATCH} dim: 6")  # its top is T x streams x 6

    def volume(self, src: Blob):
        """A 3-D Convolution on 5-axis blobs (as video nets have): src's rows as 2 slices of depth, a
        2x3x3 kernel across both, maybe a ReLU or BatchNorm in place on the 5-axis top, back to 4 axes."""
        if src.h < 2 or src.h % 2:
            return self.conv(src)
        n = self.name("volume")
        self.add(f'layer {{ name: "{n}v" type: "Reshape" bottom: "{src.name}" top: "{n}v" '
                 f'reshape_param {{ axis: 2 num_axes: 1 shape {{ dim: 2 dim: -1 }} }} }}', src)
        cout = self.later.choice([4, 6])
        std = math.sqrt(2.0 / (2 * 3 * 3 * src.c))
        self.add(f'layer {{ name: "{n}" type: "Convolution" bottom: "{n}v" top: "{n}" convolution_param {{ '
                 f'num_output: {cout} kernel_size: 2 kernel_size: 3 kernel_size: 3 pad: 0 pad: 1 pad: 1 '
                 f'weight_filler {{ type: "gaussian" std: {std:.4f} }} bias_filler {{ type: "constant" value: 0.1 }} }} }}')
        act = self.later.choice([None, "ReLU", "BatchNorm"])
        if act:
            self.add(f'layer {{ name: "{n}a" type: "{act}" bottom: "{n}" top: "{n}" }}')
        self.add(f'layer {{ name: "{n}r" type: "Reshape" bottom: "{n}" top: "{n}r" '
                 f'reshape_param {{ axis: 2 num_axes: 2 shape {{ dim: -1 }} }} }}')
        self.new(f"{n}r", cout, src.h // 2, src.w)

    def embed(self, src: Blob):
        """The label through an Embed (no gradient to its input, so never with force_backward)."""
        if self.force_backward:
            return self.conv(src)
        n = self.name("embed")
        self.add(f'layer {{ name: "{n}" type: "Embed" bottom: "label" top: "{n}" embed_param {{ '
                 f'input_dim: {CLASSES} num_output: 6 weight_filler {{ type: "gaussian" std: 0.5 }} }} }}')
        self.as_maps(n, 6)

    def reindex(self, src: Blob):
        """BatchReindex by indices a DummyData draws (again every forward, or constant)."""
        if self.force_backward:  # no gradient to the indices
            return self.conv(src)
        n = self.name("reindex")
        filler = self.r.choice([f'type: "uniform" min: 0 max: {BATCH - 0.01}', 'type: "constant" value: 2'])
        self.add(f'layer {{ name: "{n}i" type: "DummyData" top: "{n}i" dummy_data_param {{ '
                 f'shape {{ dim: {BATCH} }} data_filler {{ {filler} }} }} }}')
        self.add(f'layer {{ name: "{n}" type: "BatchReindex" bottom: "{src.name}" bottom: "{n}i" top: "{n}" }}', src)
        self.new(n, src.c, src.h, src.w)

    def leaf(self, src: Blob):
        """A forward-only layer whose top is an output of the net (no backward: never forced)."""
        if self.force_backward:
            return self.silence(src)
        n = self.name("leaf")
        body = self.r.choice(['type: "ArgMax" argmax_param { axis: 1 }',
                              'type: "Threshold" threshold_param { threshold: 0.1 }'])
        self.add(f'layer {{ name: "{n}" bottom: "{src.name}" top: "{n}" {body} }}', src)

    def more(self, src: Blob):
        make = self.r.choice([self.spp, self.im2col, self.split, self.silence, self.parameter, self.recurrent,
                              self.embed, self.reindex, self.leaf])
        (self.volume if self.later.random() < 0.12 else make)(src)

    def head(self, src: Blob, loss_weight: float = 1.0):
        n = self.name("ip")
        std = math.sqrt(1.0 / (src.c * src.h * src.w))
        self.add(f'layer {{ name: "{n}" type: "InnerProduct" bottom: "{src.name}" top: "{n}" '
                 f'inner_product_param {{ num_output: {CLASSES} '
                 f'weight_filler {{ type: "gaussian" std: {std:.4f} }} }} }}', src)
        weight = "" if loss_weight == 1.0 else f" loss_weight: {loss_weight}"
        self.add(f'layer {{ name: "{n}_loss" type: "SoftmaxWithLoss" bottom: "{n}" bottom: "label" '
                 f'top: "{n}_loss"{weight} }}')
        if self.r.random() < 0.3 and not self.force_backward:  # Accuracy has no backward to force
            self.add(f'layer {{ name: "{n}_acc" type: "Accuracy" bottom: "{n}" bottom: "label" top: "{n}_acc" }}')

    # ---------------------------------------------------------------------------------------- net
    def make(self) -> str:
        self.add(f'layer {{ name: "input" type: "DummyData" top: "data" top: "label" dummy_data_param {{ '
                 f'shape {{ dim: {BATCH} dim: 3 dim: 12 dim: 12 }} shape {{ dim: {BATCH} }} '
                 f'data_filler {{ type: "gaussian" std: 1 }} '
                 f'data_filler {{ type: "uniform" min: 0 max: {CLASSES - 0.01} }} }} }}')
        self.conv(self.blobs[0])
        for _ in range(self.r.randint(4, 10)):
            step = self.r.choices(["conv", "inplace", "beside", "pool", "join", "slice", "deconv", "side", "dense",
                                   "tile", "more"], weights=[5, 6, 4, 3, 3, 1, 1, 2, 0.5, 0.5, 3])[0]
            src = self.pick(lambda b: b.name != "data") if step != "conv" else self.pick()
            if step == "conv":
                self.conv(src)
            elif step == "inplace":
                target = self.pick(lambda b: b.writable and not b.read)
                if target is None:
                    self.activation(src, self.r.choice(BESIDE), in_place=False)
                else:
                    self.activation(target, self.r.choice(IN_PLACE), in_place=True)
            elif step == "beside":
                self.activation(src, self.r.choice(BESIDE), in_place=False)
            elif step == "pool":
                self.pool(src)
            elif step == "join":
                self.join(src) or self.conv(src)
            elif step == "slice":
                self.slice(src) or self.conv(src)
            elif step == "deconv":
                self.deconv(src) or self.pool(src)
            elif step == "dense":
                self.dense(src)
            elif step == "tile":
                self.tile(src)
            elif step == "more":
                self.more(src)
            else:
                self.side_loss(src)
        self.head(self.blobs[-1])
        if self.r.random() < 0.2 and len(self.blobs) > 2:
            self.head(self.r.choice(self.blobs[1:-1]), loss_weight=0.5)
        return ('name: "fuzz"\n' + ("force_backward: true\n" if self.force_backward else "")
                + "\n".join(self.layers) + "\n")


def net_text(seed: int) -> str:
    return NetMaker(seed).make()


def switches(r: random.Random) -> str:
    """A random choice of the store's switches that change how, not what, it computes."""
    s = []
    for name in ("async", "pool_codes", "layer_buffers", "recompute_lrn", "keep_compressed", "memory_pool",
                 "rebuild_from_batchnorm"):
        if r.random() < 0.3:
            default = name in ("async", "pool_codes", "layer_buffers", "memory_pool", "rebuild_from_batchnorm")
            s.append(f"{name}: {str(not default).lower()}")
    if r.random() < 0.3:
        s.append(f"decode_ahead: {r.choice([0, 2, 4])}")
    if r.random() < 0.2:
        s.append("memory_pool_headroom: 0.5")
    if r.random() < 0.2:
        s.append("max_in_flight_mb: 0.01")
    return " ".join(s)


def settings(seed: int) -> dict[str, str | None]:
    r = random.Random(f"switches {seed}")
    return {
        "off": None,
        "exact": f'compress_type: "None" update_interval: 1 tiled_gemm: false {switches(r)}'.strip(),
        "lossy": f"eb_mode: FIXED error_bound: {ERROR_BOUND} tiled_gemm: false {switches(r)}".strip(),
        "adaptive": f"eb_mode: ADAPTIVE error_bound: {ERROR_BOUND} update_interval: 1 tiled_gemm: false "
                    f"{switches(r)}".strip(),
    }


# ------------------------------------------------------------------------------ the child process

CHILD = r"""
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import caffe
caffe.set_mode_cpu()
folder, mode = sys.argv[2], sys.argv[3]
solver = caffe.get_solver(folder + "/solver_" + mode + ".prototxt")
net = solver.net
def blob_reads():
    out = {}
    for k, b in net.blobs.items():
        try:
            out[k] = b.data.ravel().tolist()
        except RuntimeError as e:
            out[k] = "refused: " + str(e)
    return out
steps, reads, bounds = [], None, []
for i in range(%(steps)d):
    caffe.set_random_seed(7)
    solver.step(1)
    steps.append({k: net.blobs[k].data.ravel().tolist() for k in net.outputs})
    bounds.append(dict((solver.comet_stats() or {}).get("bounds", {})))
    if i == 0:
        reads = blob_reads()
tests = ({k: solver.test_nets[0].blobs[k].data.ravel().tolist() for k in solver.test_nets[0].outputs}
         if len(solver.test_nets) else {})
stats = solver.comet_stats() or {"layers": []}
if mode == "off":
    net.save(folder + "/off.caffemodel")
elif mode != "exact":  # COMET off's weights: the gradients below differ by this step's compression alone
    net.copy_from(folder + "/off.caffemodel")
caffe.set_random_seed(7)
net.forward()
net.backward()
grads = {k: np.concatenate([p.diff.ravel() for p in v]).tolist() for k, v in net.params.items()}
grads["input"] = net.blobs["data"].diff.ravel().tolist()
json.dump({"steps": steps, "grads": grads, "reads": reads, "tests": tests, "bounds": bounds,
           "kinds": sorted({l["kind"] for l in stats["layers"]})},
          open(folder + "/" + mode + ".json", "w"))
""" % {"steps": STEPS}


def solver_extras(seed: int) -> str:
    """The same in every run of a seed: some solvers accumulate two passes a step (iter_size), some
    test the net in TEST phase (its weights shared with the train net) at iterations 0 and 2."""
    r = random.Random(f"solver {seed}")
    text = "iter_size: 2\n" if r.random() < 0.2 else ""
    return text + ("test_iter: 1\ntest_interval: 2\n" if r.random() < 0.4 else "")


def solver_text(folder: Path, comet: str | None, seed: int) -> str:
    return (f'net: "{folder}/net.prototxt"\nbase_lr: 0.01\nmomentum: 0.9\nlr_policy: "fixed"\nrandom_seed: 5\n'
            f'max_iter: 100\ndisplay: 0\nsnapshot_after_train: false\nsolver_mode: CPU\n'
            + solver_extras(seed) + (f"comet {{ {comet} }}\n" if comet is not None else ""))


def run_child(pycaffe: Path, folder: Path, mode: str) -> tuple[dict | None, str]:
    try:
        r = subprocess.run([sys.executable, "-c", CHILD, str(pycaffe), str(folder), mode], capture_output=True,
                           text=True, timeout=300, env=dict(os.environ, GLOG_minloglevel="1"))
    except subprocess.TimeoutExpired:
        return None, f"{mode}: no result in 300 s (a hang)"
    (folder / f"{mode}.log").write_text(r.stdout + r.stderr)
    if r.returncode != 0:
        tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-8:])
        return None, f"{mode}: exit status {r.returncode}\n{tail}"
    return json.loads((folder / f"{mode}.json").read_text()), ""


# ------------------------------------------------------------------------------------- the checks

def finite(run: dict) -> bool:
    import numpy as np

    return (all(np.isfinite(v).all() for step in run["steps"] for v in step.values())
            and all(np.isfinite(g).all() for g in run["grads"].values()))


def same(a, b, tol: float, floor: float = 0.0) -> bool:
    """Bit for bit (tol 0), or each value within tol of the largest magnitude in its list, or of
    floor where that is larger (lists, or {name: list} compared name by name)."""
    import numpy as np

    if not tol or b is None:
        return a == b
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k], tol, floor) for k in a)
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if x.shape != y.shape:
        return False
    scale = float(np.max(np.abs(x))) if x.size else 0.0
    return bool(np.all(np.abs(x - y) <= tol * max(scale, floor, 1e-30)))


def gradient_floor(grads: dict) -> float:
    """GRAD_FLOOR of the largest gradient of any layer: a Scale or Bias right before BatchNorm has an
    exact gradient of 0 (BatchNorm removes each channel's mean and scale), and what Caffe computes for
    it is rounding (seed 197: 9.5e-7 against conv1's 0.17)."""
    import numpy as np

    return GRAD_FLOOR * max((float(np.max(np.abs(v))) for v in grads.values() if len(v)), default=0.0)


def same_or_both_nan(a: dict, b: dict, tol: float) -> bool:
    """`same`, where the TEST net's outputs may be NaN or infinite (BatchNorm's global statistics
    before any step), equal when both are."""
    import numpy as np

    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = np.asarray(a[k], dtype=np.float64), np.asarray(b[k], dtype=np.float64)
        if x.shape != y.shape or not np.array_equal(np.isfinite(x), np.isfinite(y)):
            return False
        f = np.isfinite(x)
        if not np.array_equal(x[~f], y[~f], equal_nan=True) or not same(x[f].tolist(), y[f].tolist(), tol):
            return False
    return True


def read_problems(off: dict, on: dict, tol: float) -> list[str]:
    """A read after the first step is off's values (within tol) or refused by COMET, never other values."""
    import numpy as np

    problems = []
    for k, want in off["reads"].items():
        got = on["reads"].get(k)
        if isinstance(want, str):
            problems.append(f"blob '{k}': COMET off refused a read ({want})")
        elif isinstance(got, str):
            if "COMET" not in got:
                problems.append(f"blob '{k}': refused without naming COMET: {got}")
        elif tol <= ROUNDING and not same(want, got, tol):
            problems.append(f"blob '{k}': read after step 1 differs from COMET off")
        elif tol > ROUNDING and not np.allclose(got, want, rtol=1e-6, atol=tol):
            d = float(np.max(np.abs(np.asarray(got) - np.asarray(want))))
            problems.append(f"blob '{k}': read after step 1 is {d:.3g} from COMET off (bound {tol})")
    return problems


def relative_errors(off: dict, on: dict) -> dict[str, float]:
    """||g_on - g_off|| / ||g_off|| per layer, where ||g_off|| is at least GRAD_FLOOR times the
    largest layer's (gradient_floor says why)."""
    import numpy as np

    norms = {k: float(np.linalg.norm(v)) for k, v in off["grads"].items()}
    floor = GRAD_FLOOR * max(norms.values(), default=0.0)
    out = {}
    for k, x in off["grads"].items():
        d = float(np.linalg.norm(np.asarray(on["grads"][k]) - np.asarray(x)))
        n = max(norms[k], floor)
        out[k] = d / n if n else d
    return out


def gpu_bitwise(text: str) -> bool:
    """Whether two runs of a net on a GPU give the same bits: Embed's Backward_gpu adds the rows of
    the weight gradient with atomics, in no fixed order."""
    return 'type: "Embed"' not in text


def exact_to_rounding(text: str, exact: str) -> bool:
    """Whether a net's lossless run matches COMET off to float rounding only: the store computes LRN
    within a channel's backward itself (layer_buffers), equal to upstream's chain of five layers to
    rounding (docs/comet.md)."""
    return "WITHIN_CHANNEL" in text and "layer_buffers: false" not in exact


def check(seed: int, pycaffe: Path, folder: Path) -> dict:
    """Runs one seed's net four ways in `folder`; returns {seed, verdict, problems, figures}."""
    folder.mkdir(parents=True, exist_ok=True)
    text, blocks = net_text(seed), settings(seed)
    (folder / "net.prototxt").write_text(text)
    runs, problems = {}, []
    for mode, comet in blocks.items():
        (folder / f"solver_{mode}.prototxt").write_text(solver_text(folder, comet, seed))
        runs[mode], err = run_child(pycaffe, folder, mode)
        if err:
            problems.append(err)
    off, exact = runs["off"], runs["exact"]
    figures = {}
    if off is not None and not finite(off):
        return {"seed": seed, "verdict": "SKIP", "problems": ["COMET off is not finite: not a test"],
                "figures": {}}
    if off is not None and exact is not None:
        rounding = ROUNDING if exact_to_rounding(text, blocks["exact"]) else 0.0
        bad = [i + 1 for i, (a, b) in enumerate(zip(off["steps"], exact["steps"])) if not same(a, b, rounding)]
        if bad:
            problems.append(f"exact: outputs of step(s) {bad} differ from COMET off")
        floor = gradient_floor(off["grads"])
        bad = [k for k in off["grads"] if not same(off["grads"][k], exact["grads"].get(k), rounding, floor)]
        if bad:
            problems.append(f"exact: gradients of {', '.join(bad)} differ from COMET off")
        problems += ["exact: " + p for p in read_problems(off, exact, rounding)]
        if not same_or_both_nan(off["tests"], exact["tests"], rounding):
            problems.append("exact: the TEST net's outputs at iteration 2 differ from COMET off")
        if not exact["kinds"]:
            problems.append("exact: no COMET plan in the store's figures")
    for mode in ("lossy", "adaptive"):
        run = runs[mode]
        if off is None or run is None:
            continue
        if run["steps"][0] != off["steps"][0]:
            problems.append(f"{mode}: the first step's outputs differ from COMET off (a forward read a compressed blob)")
        if not finite(run):
            problems.append(f"{mode}: an output or gradient is not finite")
        # the blobs held after step 1 were stored under the bounds of step 1 (ADAPTIVE: per layer)
        bound = max([ERROR_BOUND] + list(run["bounds"][0].values()))
        problems += [f"{mode}: " + p for p in read_problems(off, run, bound * 1.0001)]
        errors = relative_errors(off, run)
        figures[f"{mode}_grad_errors"] = errors
        worst = max(errors.items(), key=lambda kv: kv[1]) if errors else ("", 0.0)
        figures[f"{mode}_worst_grad_error"] = worst
        if mode == "adaptive":
            figures["adaptive_bounds"] = run["bounds"][-1]
        if worst[1] > GRAD_TOL:
            problems.append(f"{mode}: gradient of {worst[0]} is {worst[1]:.3g} (relative L2) from COMET off, "
                            f"above {GRAD_TOL}")
    return {"seed": seed, "verdict": "FAIL" if problems else "PASS", "problems": problems, "figures": figures}


def export(seeds: list[int], out: Path) -> int:
    """--export: the nets as scripts/gpu_zoo_check.py --exact trains them with `caffe train` alone."""
    out.mkdir(parents=True, exist_ok=True)
    rows = ["# name\tbase_lr\tstart_bound\tcomet { } of the lossless run (scripts/fuzz_nets.py --export)"]
    for seed in seeds:
        text, exact = net_text(seed), settings(seed)["exact"]
        if exact_to_rounding(text, exact) or not gpu_bitwise(text):
            continue
        (out / f"fuzz{seed}.prototxt").write_text(text)
        rows.append(f"fuzz{seed}\t0.01\t-\t{exact}")
    (out / "nets.tsv").write_text("\n".join(rows) + "\n")
    print(f"fuzz_nets: {len(rows) - 1} of {len(seeds)} nets in {out}", file=sys.stderr)
    return 0


def parse_seeds(text: str) -> list[int]:
    seeds = []
    for part in text.split(","):
        if "-" in part:
            a, b = part.split("-", 1)
            seeds.extend(range(int(a), int(b) + 1))
        elif part:
            seeds.append(int(part))
    return seeds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/fuzz_nets", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0-19", help="seeds as 0-19,40,41 (default 0-19)")
    ap.add_argument("--keep", type=Path, metavar="DIR",
                    help="keep each net's folder (net, solvers, logs) under DIR/<seed>")
    ap.add_argument("--print", type=int, metavar="SEED", help="print the net of SEED, its solver lines and the "
                                                             "two comet blocks")
    ap.add_argument("--json", type=Path, metavar="FILE", help="write every result and figure to FILE")
    ap.add_argument("--export", type=Path, metavar="DIR",
                    help="write the seeds' nets and DIR/nets.tsv with each net's lossless comet { } for "
                         "scripts/gpu_zoo_check.py --exact (`caffe train` alone: the GPU check) instead of running "
                         "them; nets whose exactness is float rounding (LRN within a channel) or that a GPU "
                         "does not compute the same way twice (Embed) are left out")
    try:
        args = ap.parse_args(argv)
        seeds = parse_seeds(args.seeds)
    except ValueError:
        print(f"fuzz_nets: bad --seeds '{args.seeds}': numbers and ranges, as 0-19,40,41", file=sys.stderr)
        return 2
    if args.print is not None:
        print(net_text(args.print), end="")
        print("".join(f"# solver: {line}\n" for line in solver_extras(args.print).splitlines()), end="")
        for mode, comet in settings(args.print).items():
            if comet is not None:
                print(f"# {mode}: comet {{ {comet} }}")
        return 0
    if args.export:
        return export(seeds, args.export)
    from cometctl import paths
    from cometctl.errors import CometError

    try:
        pycaffe = paths.pycaffe_dir(None)
    except CometError as e:
        print(f"fuzz_nets: {e}", file=sys.stderr)
        return 2
    results, t0 = [], time.time()
    with tempfile.TemporaryDirectory(prefix="fuzz_nets.") as tmp:
        base = args.keep or Path(tmp)
        for seed in seeds:
            res = check(seed, pycaffe, base / str(seed))
            results.append(res)
            fig = "".join(f"  worst {mode} gradient {w[0]} {w[1]:.2e}" for mode in ("lossy", "adaptive")
                          if (w := res["figures"].get(f"{mode}_worst_grad_error")))
            print(f"seed {seed:4d}  {res['verdict']}{fig}", flush=True)
            for p in res["problems"]:
                print("    " + p.replace("\n", "\n    "), flush=True)
    failed = [r["seed"] for r in results if r["verdict"] == "FAIL"]
    skipped = [r["seed"] for r in results if r["verdict"] == "SKIP"]
    print(f"{len(results) - len(failed) - len(skipped)} passed, {len(failed)} failed, {len(skipped)} skipped "
          f"in {time.time() - t0:.0f} s" + (f"; failed seeds: {','.join(map(str, failed))}" if failed else ""))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
