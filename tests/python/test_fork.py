"""The built fork: the build is idempotent, and a smoke run trains a small CNN on an LMDB that the
test writes itself, then pycaffe loads the snapshot and runs a forward pass."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cometctl import paths
from cometctl.errors import CometError

try:
    CAFFE = paths.tool_path("caffe")
    PYCAFFE = paths.pycaffe_dir()
except CometError as e:  # the test command always builds first; this only helps a bare `pytest`
    pytest.skip(f"fork not built: {e}", allow_module_level=True)

COMETCTL = Path(sys.executable).parent / "cometctl"


def test_second_build_compiles_nothing():
    r = subprocess.run([str(COMETCTL), "build", "--cpu-only"], capture_output=True, text=True,
                       cwd=paths.REPO_ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "compiled 0 objects" in r.stderr, r.stderr[-2000:]
    assert "; 0 files changed" in r.stderr, r.stderr[-2000:]


def _pb2():
    sys.path.insert(0, str(PYCAFFE))
    from caffe.proto import caffe_pb2
    return caffe_pb2


def write_lmdb(path: Path, n: int, seed: int) -> None:
    """Four classes of 3x16x16 images: a bright stripe whose orientation and position is the class."""
    import lmdb

    caffe_pb2 = _pb2()
    rng = np.random.default_rng(seed)
    env = lmdb.open(str(path), map_size=1 << 26)
    with env.begin(write=True) as txn:
        for i in range(n):
            label = int(rng.integers(4))
            img = rng.integers(0, 60, size=(3, 16, 16)).astype(np.uint8)
            k = 3 + 6 * (label % 2)
            if label < 2:
                img[:, k:k + 4, :] += 150
            else:
                img[:, :, k:k + 4] += 150
            d = caffe_pb2.Datum(channels=3, height=16, width=16, data=img.tobytes(), label=label)
            txn.put(f"{i:08d}".encode(), d.SerializeToString())
    env.close()


NET = """
name: "smoke"
layer {{ name: "data" type: "Data" top: "data" top: "label" include {{ phase: TRAIN }}
  transform_param {{ scale: 0.00390625 }}
  data_param {{ source: "{db}" batch_size: 32 backend: LMDB }} }}
layer {{ name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param {{ num_output: 8 kernel_size: 3 pad: 1 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }}
layer {{ name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
  pooling_param {{ pool: MAX kernel_size: 2 stride: 2 }} }}
layer {{ name: "ip1" type: "InnerProduct" bottom: "pool1" top: "ip1"
  inner_product_param {{ num_output: 4 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip1" bottom: "label" top: "loss" }}
"""

DEPLOY = """
name: "smoke"
input: "data"
input_shape { dim: 5 dim: 3 dim: 16 dim: 16 }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 8 kernel_size: 3 pad: 1 } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip1" type: "InnerProduct" bottom: "pool1" top: "ip1" inner_product_param { num_output: 4 } }
layer { name: "prob" type: "Softmax" bottom: "ip1" top: "prob" }
"""

SOLVER = """
net: "{net}"
base_lr: 0.05
momentum: 0.9
lr_policy: "fixed"
display: 1
max_iter: 30
snapshot: 30
snapshot_prefix: "{prefix}"
solver_mode: CPU
random_seed: 1
"""


def test_smoke_train_30_iterations_then_pycaffe_forward(tmp_path):
    db = tmp_path / "train_lmdb"
    write_lmdb(db, 512, seed=0)
    (tmp_path / "net.prototxt").write_text(NET.format(db=db))
    (tmp_path / "deploy.prototxt").write_text(DEPLOY)
    (tmp_path / "solver.prototxt").write_text(
        SOLVER.format(net=tmp_path / "net.prototxt", prefix=tmp_path / "smoke"))
    r = subprocess.run([str(CAFFE), "train", "-solver", str(tmp_path / "solver.prototxt")],
                       capture_output=True, text=True, cwd=tmp_path, timeout=600,
                       env=dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"Iteration \d+ \(.*?\), loss = ([\d.eE+-]+)", r.stderr)]
    assert len(losses) >= 30, r.stderr[-2000:]
    first, last = np.mean(losses[:5]), np.mean(losses[-5:])
    assert last < 0.7 * first, f"loss did not fall: first {first:.3f}, last {last:.3f}"
    model = tmp_path / "smoke_iter_30.caffemodel"
    assert model.exists() and (tmp_path / "smoke_iter_30.solverstate").exists()

    code = f"""
import sys, numpy as np
sys.path.insert(0, {str(PYCAFFE)!r})
import caffe
caffe.set_mode_cpu()
net = caffe.Net({str(tmp_path / 'deploy.prototxt')!r}, {str(model)!r}, caffe.TEST)
assert np.abs(net.params['conv1'][0].data).sum() > 0
net.blobs['data'].data[...] = np.random.default_rng(1).random((5, 3, 16, 16))
prob = net.forward()['prob']
assert prob.shape == (5, 4), prob.shape
assert np.allclose(prob.sum(axis=1), 1, atol=1e-5), prob
print('forward ok', prob.argmax(axis=1))
"""
    f = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert f.returncode == 0 and "forward ok" in f.stdout, f.stderr[-3000:]


COMET_NET = """name: "cometstats"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 8 dim: 3 dim: 31 dim: 31 } shape { dim: 8 }
    data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 1 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 16 kernel_size: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
  pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
layer { name: "norm1" type: "LRN" bottom: "pool1" top: "norm1" lrn_param { local_size: 5 } }
layer { name: "fc1" type: "InnerProduct" bottom: "norm1" top: "fc1"
  inner_product_param { num_output: 32 weight_filler { type: "gaussian" std: 0.05 } } }
layer { name: "drop1" type: "Dropout" bottom: "fc1" top: "fc1" }
layer { name: "fc2" type: "InnerProduct" bottom: "fc1" top: "fc2"
  inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.05 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc2" bottom: "label" top: "loss" }
"""


def test_pycaffe_comet_stats_name_every_kind_of_stored_buffer(tmp_path):
    (tmp_path / "net.prototxt").write_text(COMET_NET)
    (tmp_path / "solver.prototxt").write_text(
        f'net: "{tmp_path / "net.prototxt"}"\nbase_lr: 0.01\nlr_policy: "fixed"\ndisplay: 1\n'
        f'max_iter: 10\nsnapshot_prefix: "{tmp_path / "s"}"\nsolver_mode: CPU\n'
        "comet { eb_mode: FIXED error_bound: 1e-2 }\n")
    code = f"""
import json, sys
sys.path.insert(0, {str(PYCAFFE)!r})
import caffe
caffe.set_mode_cpu()
solver = caffe.get_solver({str(tmp_path / 'solver.prototxt')!r})
solver.step(3)
print(json.dumps(solver.comet_stats()))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, GLOG_minloglevel="2"))
    assert r.returncode == 0, r.stderr[-3000:]
    stats = json.loads(r.stdout.strip().splitlines()[-1])
    kinds = {e["blob"]: e["kind"] for e in stats["layers"]}
    assert kinds["conv1"] == "mask"            # only ReLU reads it: 1 bit per value
    assert kinds["pool1 argmax"] == "argmax"   # max pooling's private argmax, as window offsets
    assert kinds["drop1 mask"] == "binary"     # Dropout's mask
    assert kinds["norm1 scale"] == "scale"     # LRN's scale: freed after LRN's backward
    assert kinds["norm1"] == "lossy" and kinds["pool1"] == "lossy"
    by_blob = {e["blob"]: e for e in stats["layers"]}
    assert by_blob["pool1 argmax"]["ratio"] == pytest.approx(8.0, rel=0.05)
    assert by_blob["conv1"]["ratio"] == pytest.approx(32.0, rel=0.05)
    assert stats["bounds"]["fc1"] == pytest.approx(1e-2)
    assert stats["memory"]["peak_total"] > 0
    assert set(stats["pool"]) == {"reused", "allocated", "returned", "cached", "in_use", "peak_in_use", "peak_held"}
    assert stats["pool"]["in_use"] + stats["pool"]["cached"] <= stats["pool"]["peak_in_use"]
    assert stats["pool"]["peak_in_use"] <= stats["pool"]["peak_held"] <= stats["pool"]["peak_in_use"] * 1.001


@pytest.mark.parametrize("comet", ["comet { eb_mode: FIXED error_bound: 1e-2 }", ""], ids=["comet-on", "comet-off"])
def test_pycaffe_net_outlives_its_solver(tmp_path, comet):
    """`net = solver.net; del solver` keeps a plain Caffe net: its next forward used to crash (signal 11)
    in callbacks that the solver's COMET store and resume counter had left on it, COMET on or off."""
    (tmp_path / "net.prototxt").write_text(COMET_NET)
    (tmp_path / "solver.prototxt").write_text(
        f'net: "{tmp_path / "net.prototxt"}"\nbase_lr: 0.01\nlr_policy: "fixed"\nmax_iter: 10\n'
        f'solver_mode: CPU\nrandom_seed: 3\n{comet}\n')
    code = f"""
import sys, numpy as np
sys.path.insert(0, {str(PYCAFFE)!r})
import caffe
caffe.set_mode_cpu()
solver = caffe.get_solver({str(tmp_path / 'solver.prototxt')!r})
solver.step(2)
net = solver.net
del solver
plain = caffe.Net({str(tmp_path / 'net.prototxt')!r}, caffe.TRAIN)
for name in plain.params:
    for a, b in zip(net.params[name], plain.params[name]):
        b.data[...] = a.data
for round in range(2):
    losses = []
    for n in (net, plain):
        caffe.set_random_seed(11 + round)
        losses.append(float(n.forward()['loss']))
        n.backward()
    assert losses[0] == losses[1], losses
    for name in plain.blobs:
        assert np.array_equal(net.blobs[name].data, plain.blobs[name].data), name
print('outlived ok', losses[0])
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, GLOG_minloglevel="2"))
    assert r.returncode == 0 and "outlived ok" in r.stdout, (r.returncode, r.stderr[-3000:])


def test_a_step_that_raises_gives_the_float_mode_back(tmp_path):
    """A Python layer raising inside solver.step() left the thread flushing denormals to zero (the COMET
    step's mode, given back only at the end of a step that completes): the user's own numpy code in
    that thread then turned 1e-39 into 0 until the next good step."""
    (tmp_path / "flaky.py").write_text(
        "import caffe\n"
        "class Flaky(caffe.Layer):\n"
        "    calls = 0\n"
        "    def setup(self, bottom, top): pass\n"
        "    def reshape(self, bottom, top): top[0].reshape(*bottom[0].data.shape)\n"
        "    def forward(self, bottom, top):\n"
        "        Flaky.calls += 1\n"
        "        if Flaky.calls == 2: raise ValueError('flaky forward')\n"
        "        top[0].data[...] = bottom[0].data\n"
        "    def backward(self, top, propagate_down, bottom):\n"
        "        bottom[0].diff[...] = top[0].diff\n")
    (tmp_path / "net.prototxt").write_text(COMET_NET.replace(
        'layer { name: "fc2"',
        'layer { name: "flaky" type: "Python" bottom: "fc1" top: "fc1b" python_param { module: "flaky" '
        'layer: "Flaky" } }\nlayer { name: "fc2"').replace('bottom: "fc1" top: "fc2"', 'bottom: "fc1b" top: "fc2"'))
    (tmp_path / "solver.prototxt").write_text(
        f'net: "{tmp_path / "net.prototxt"}"\nbase_lr: 0.01\nlr_policy: "fixed"\nmax_iter: 10\n'
        "solver_mode: CPU\ncomet { eb_mode: FIXED error_bound: 1e-2 }\n")
    code = f"""
import sys, numpy as np
sys.path.insert(0, {str(PYCAFFE)!r}); sys.path.insert(0, {str(tmp_path)!r})
import caffe
caffe.set_mode_cpu()
keeps = lambda: float((np.array([1e-39], dtype=np.float32) * np.float32(1))[0]) != 0
assert keeps()
solver = caffe.get_solver({str(tmp_path / 'solver.prototxt')!r})
solver.step(1)
assert keeps()
try:
    solver.step(1)
    raise SystemExit('the layer did not raise')
except ValueError:
    pass
print('after the exception, denormals kept:', keeps())
solver.step(1)
assert keeps()
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, GLOG_minloglevel="2"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "after the exception, denormals kept: True" in r.stdout, (r.stdout, r.stderr[-2000:])
