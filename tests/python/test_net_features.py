"""Upstream Net features that decide what a backward pass reads, trained with the store on: a layer's
`propagate_down: false`, `loss_weight` on a top that another layer also reads (Caffe inserts a Split
and keeps the weight in that top's diff), a Reduction used as a loss, Sigmoid and in-place TanH feeding
Eltwise PROD and MAX, Accuracy, ArgMax and Silence in TRAIN, Deconvolution and Crop into a Euclidean
loss, BatchNorm with an in-place Scale and a Bias layer, PReLU, ELU, AbsVal, Power, BNLL, Clip and Swish
into a weighted Eltwise SUM, Slice/Concat/Flatten/Reshape, average, padded max and pyramid pooling, two
losses (SigmoidCrossEntropy on a Threshold of the label, Hinge), an LSTM (a class without a fact row:
its blobs stay dense) between an InnerProduct and a loss; each also with `force_backward: true`
and pycaffe's `net.backward()` for the gradient of the input (saliency maps).

Each net trains 3 steps COMET off, with a lossless store (`compress_type: "None"`: every blob the
plan keeps, frees or masks must give the same bits) and with a lossy one (FIXED 1e-3), then pycaffe
runs one forward and backward. Lossless: every output of every step and every weight gradient (and
the input gradient) bit for bit those of COMET off. Lossy: outputs within 1e-3 and gradients within
1% (relative L2) of COMET off; a store that froze, zeroed or dropped a blob misses both by far. And
the store's own figures for the last step (`Solver.comet_stats()`) show a plan, and the lossy store
holding its blobs smaller than dense: a store that did nothing would pass every comparison."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cometctl import paths
from cometctl.errors import CometError

try:
    PYCAFFE = paths.pycaffe_dir()
except CometError as e:  # the test command always builds first; this only helps a bare `pytest`
    pytest.skip(f"fork not built: {e}", allow_module_level=True)

DATA = ('layer { name: "data" type: "DummyData" top: "data" top: "label" dummy_data_param { '
        'shape { dim: 4 dim: 3 dim: 12 dim: 12 } shape { dim: 4 } data_filler { type: "gaussian" std: 1 } '
        'data_filler { type: "uniform" min: 0 max: 4.99 } } }\n')
LOSS = 'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "out" bottom: "label" top: "loss" }\n'


def conv(name, bottom, extra=""):
    return (f'layer {{ name: "{name}" type: "Convolution" bottom: "{bottom}" top: "{name}" {extra} '
            f'convolution_param {{ num_output: 8 kernel_size: 3 pad: 1 weight_filler {{ type: "gaussian" std: 0.2 }} '
            f'bias_filler {{ type: "constant" value: 0.1 }} }} }}\n')


def relu(name, blob, top=None):
    return f'layer {{ name: "{name}" type: "ReLU" bottom: "{blob}" top: "{top or blob}" }}\n'


def ip(name, bottom, n=5, extra="", param=""):
    return (f'layer {{ name: "{name}" type: "InnerProduct" bottom: "{bottom}" top: "{name}" {extra} '
            f'inner_product_param {{ num_output: {n} {param} weight_filler {{ type: "gaussian" std: 0.1 }} }} }}\n')


NETS = {
    "propagate_down_false": DATA + conv("c1", "data") + relu("r1", "c1")
    + conv("c2", "c1", "propagate_down: false") + relu("r2", "c2") + conv("c3", "c2") + relu("r3", "c3")
    + ip("out", "c3") + LOSS,
    "loss_weight_on_a_top_read_on": DATA + conv("c1", "data") + relu("r1", "c1")
    + ip("f1", "c1", 16, "loss_weight: 0.01") + relu("rf", "f1", "f1r") + ip("out", "f1r") + LOSS,
    "reduction_as_a_loss": DATA + conv("c1", "data") + relu("r1", "c1") + conv("c2", "c1")
    + 'layer { name: "l2" type: "Reduction" bottom: "c2" top: "l2" reduction_param { operation: SUMSQ } '
      'loss_weight: 0.001 }\n' + ip("out", "c1") + LOSS,
    "sigmoid_tanh_eltwise_prod_max": DATA + conv("c1", "data")
    + 'layer { name: "s" type: "Sigmoid" bottom: "c1" top: "s" }\n' + conv("c2", "data")
    + 'layer { name: "t" type: "TanH" bottom: "c2" top: "c2" }\n'
    + 'layer { name: "p" type: "Eltwise" bottom: "s" bottom: "c2" top: "p" eltwise_param { operation: PROD } }\n'
    + 'layer { name: "m" type: "Eltwise" bottom: "p" bottom: "c1" top: "m" eltwise_param { operation: MAX } }\n'
    + ip("out", "m") + LOSS,
    "accuracy_argmax_silence_in_train": DATA + conv("c1", "data") + relu("r1", "c1") + ip("out", "c1")
    + 'layer { name: "acc" type: "Accuracy" bottom: "out" bottom: "label" top: "acc" }\n'
    + 'layer { name: "am" type: "ArgMax" bottom: "out" top: "am" propagate_down: false }\n'
    + 'layer { name: "sil" type: "Silence" bottom: "am" }\n' + LOSS,
    "deconvolution_crop_euclidean": DATA + conv("c1", "data") + relu("r1", "c1")
    + 'layer { name: "pool" type: "Pooling" bottom: "c1" top: "pool" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }\n'
    + 'layer { name: "up" type: "Deconvolution" bottom: "pool" top: "up" convolution_param { num_output: 3 '
      'kernel_size: 4 stride: 2 weight_filler { type: "gaussian" std: 0.1 } } }\n'
    + 'layer { name: "crop" type: "Crop" bottom: "up" bottom: "data" top: "crop" crop_param { axis: 2 offset: 1 } }\n'
    + 'layer { name: "rec" type: "EuclideanLoss" bottom: "crop" bottom: "data" top: "rec" }\n'
    + 'layer { name: "sil" type: "Silence" bottom: "label" }\n',
    "batchnorm_scale_bias": DATA + conv("c1", "data")
    + 'layer { name: "bn" type: "BatchNorm" bottom: "c1" top: "c1" }\n'
    + 'layer { name: "sc" type: "Scale" bottom: "c1" top: "c1" scale_param { bias_term: true '
      'filler { type: "constant" value: 1.5 } bias_filler { type: "constant" value: 0.2 } } }\n'
    + relu("r1", "c1") + conv("c2", "c1")
    + 'layer { name: "b" type: "Bias" bottom: "c2" top: "c2b" bias_param { filler { type: "constant" value: 0.3 } } }\n'
    + ip("out", "c2b") + LOSS,
    "elementwise_activations": DATA + conv("c1", "data")
    + 'layer { name: "pr" type: "PReLU" bottom: "c1" top: "c1" }\n' + conv("c2", "c1")
    + 'layer { name: "elu" type: "ELU" bottom: "c2" top: "c2" }\n'
    + 'layer { name: "abs" type: "AbsVal" bottom: "c2" top: "abs" }\n'
    + 'layer { name: "pow" type: "Power" bottom: "abs" top: "pow" power_param { power: 2 scale: 0.5 shift: 1 } }\n'
    + 'layer { name: "bnll" type: "BNLL" bottom: "c2" top: "bnll" }\n'
    + 'layer { name: "clip" type: "Clip" bottom: "c1" top: "clip" clip_param { min: -0.5 max: 0.5 } }\n'
    + 'layer { name: "sw" type: "Swish" bottom: "clip" top: "sw" }\n'
    + 'layer { name: "sum" type: "Eltwise" bottom: "pow" bottom: "bnll" bottom: "sw" top: "sum" '
      'eltwise_param { operation: SUM coeff: 1 coeff: -1 coeff: 2 } }\n' + ip("out", "sum") + LOSS,
    "slice_concat_flatten_reshape": DATA + conv("c1", "data") + relu("r1", "c1")
    + 'layer { name: "sl" type: "Slice" bottom: "c1" top: "a" top: "b" slice_param { axis: 1 slice_point: 3 } }\n'
    + 'layer { name: "cat" type: "Concat" bottom: "b" bottom: "a" top: "cat" }\n'
    + 'layer { name: "fl" type: "Flatten" bottom: "cat" top: "fl" }\n'
    + 'layer { name: "rs" type: "Reshape" bottom: "fl" top: "rs" reshape_param { shape { dim: 0 dim: 8 dim: -1 } } }\n'
    + ip("out", "rs") + LOSS,
    "average_padded_max_and_pyramid_pooling": DATA + conv("c1", "data") + relu("r1", "c1")
    + 'layer { name: "ave" type: "Pooling" bottom: "c1" top: "ave" pooling_param { pool: AVE kernel_size: 3 stride: 1 } }\n'
    + conv("c2", "ave") + relu("r2", "c2")
    + 'layer { name: "mx" type: "Pooling" bottom: "c2" top: "mx" pooling_param { pool: MAX kernel_size: 3 stride: 2 pad: 1 } }\n'
    + 'layer { name: "spp" type: "SPP" bottom: "mx" top: "spp" spp_param { pyramid_height: 2 } }\n'
    + ip("out", "spp") + LOSS,
    "two_losses_sigmoid_cross_entropy_and_hinge": DATA + conv("c1", "data") + relu("r1", "c1") + ip("out", "c1")
    + ip("logit", "c1", 1)
    + 'layer { name: "pos" type: "Threshold" bottom: "label" top: "pos" threshold_param { threshold: 2.5 } }\n'
    + 'layer { name: "sce" type: "SigmoidCrossEntropyLoss" bottom: "logit" bottom: "pos" top: "sce" loss_weight: 0.5 }\n'
    + 'layer { name: "hinge" type: "HingeLoss" bottom: "out" bottom: "label" top: "hinge" }\n',
    "lstm_without_a_fact_row": 'layer { name: "seq" type: "DummyData" top: "x" top: "cont" dummy_data_param { '
      'shape { dim: 3 dim: 2 dim: 4 } shape { dim: 3 dim: 2 } data_filler { type: "gaussian" std: 1 } '
      'data_filler { type: "constant" value: 1 } } }\n'
    + ip("emb", "x", 6, param="axis: 2")
    + relu("re", "emb")
    + 'layer { name: "lstm" type: "LSTM" bottom: "emb" bottom: "cont" top: "h" recurrent_param { num_output: 5 '
      'weight_filler { type: "uniform" min: -0.3 max: 0.3 } } }\n'
    + 'layer { name: "l2" type: "Reduction" bottom: "h" top: "l2" reduction_param { operation: SUMSQ } }\n'
    + 'layer { name: "pw" type: "Power" bottom: "l2" top: "pw" power_param { scale: -1 } loss_weight: 1 }\n',
}

NO_FORCED_BACKWARD = {"accuracy_argmax_silence_in_train": "ArgMax", "two_losses_sigmoid_cross_entropy_and_hinge": "Threshold"}

CHILD = r"""
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import caffe
caffe.set_mode_cpu()
folder, comet = sys.argv[2], sys.argv[3]
with open(folder + "/solver.prototxt", "w") as f:
    f.write('net: "%s/net.prototxt"\nbase_lr: 0.01\nmomentum: 0.9\nlr_policy: "fixed"\nrandom_seed: 5\n'
            'max_iter: 100\ndisplay: 1\nsnapshot_after_train: false\nsolver_mode: CPU\n' % folder
            + ("comet { %s }\n" % comet if comet != "off" else ""))
solver = caffe.get_solver(folder + "/solver.prototxt")
steps = []
for _ in range(3):
    caffe.set_random_seed(7)
    solver.step(1)
    steps.append({k: solver.net.blobs[k].data.ravel().tolist() for k in solver.net.outputs})
stats = solver.comet_stats() or {"layers": []}  # the last step's, as the store planned and measured it
stored = {"dense_bytes": sum(l["dense_bytes"] for l in stats["layers"]),
          "stored_bytes": sum(l["stored_bytes"] for l in stats["layers"]),
          "kinds": sorted({l["kind"] for l in stats["layers"]})}
caffe.set_random_seed(7)
solver.net.forward()
solver.net.backward()
grads = {k: np.concatenate([p.diff.ravel() for p in v]).tolist() for k, v in solver.net.params.items()}
grads["input"] = solver.net.blobs["data" if "data" in solver.net.blobs else "x"].diff.ravel().tolist()
json.dump({"steps": steps, "grads": grads, "stored": stored}, open(folder + "/" + sys.argv[4] + ".json", "w"))
"""


def _train(folder, comet: str, name: str) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD, str(PYCAFFE), str(folder), comet, name], capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, GLOG_minloglevel="2"))
    assert r.returncode == 0, (name, r.stderr[-3000:])
    return json.loads((folder / f"{name}.json").read_text())


@pytest.mark.parametrize("force_backward", [False, True], ids=["", "force_backward"])
@pytest.mark.parametrize("net", sorted(NETS))
def test_the_store_keeps_what_each_backward_reads(tmp_path, net, force_backward):
    import numpy as np

    if force_backward and net in NO_FORCED_BACKWARD:
        pytest.skip(f"upstream's {NO_FORCED_BACKWARD[net]} has no backward; force_backward makes Caffe call it")
    (tmp_path / "net.prototxt").write_text(("force_backward: true\n" if force_backward else "") + NETS[net])
    off = _train(tmp_path, "off", "off")
    exact = _train(tmp_path, 'compress_type: "None" update_interval: 1', "exact")
    lossy = _train(tmp_path, "eb_mode: FIXED error_bound: 1e-3", "lossy")
    assert all(np.isfinite(v).all() for step in off["steps"] for v in step.values())
    assert all(np.isfinite(g).all() for g in off["grads"].values())
    assert exact["steps"] == off["steps"]
    assert exact["grads"] == off["grads"]
    for a, b in zip(off["steps"], lossy["steps"]):
        for k in a:
            assert np.allclose(a[k], b[k], rtol=1e-3, atol=1e-3), (k, a[k], b[k])
    compared = 0
    for k in off["grads"]:
        x, y = np.asarray(off["grads"][k]), np.asarray(lossy["grads"][k])
        if not np.linalg.norm(x):  # below propagate_down: false; the data without force_backward
            assert not np.linalg.norm(y), k
            continue
        assert np.linalg.norm(y - x) <= 0.01 * np.linalg.norm(x), (k, np.linalg.norm(y - x) / np.linalg.norm(x))
        compared += 1
    assert compared >= 2
    # and the store did something: a store that kept every blob dense would pass all of the above
    for run in (exact, lossy):
        assert run["stored"]["kinds"], "no COMET plan in the last step's figures: the store did nothing"
    if net == "lstm_without_a_fact_row":
        assert lossy["stored"]["dense_bytes"] == 0, lossy["stored"]  # the LSTM's blobs stay dense
    else:
        assert 0 < lossy["stored"]["stored_bytes"] < lossy["stored"]["dense_bytes"], lossy["stored"]
    assert bool(np.linalg.norm(off["grads"]["input"])) == force_backward  # as Caffe computes it
    if net == "propagate_down_false" and not force_backward:  # force_backward overrides it in Caffe
        assert not np.linalg.norm(off["grads"]["c1"])  # nothing reaches below c2
