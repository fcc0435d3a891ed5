"""scripts/zoo_check.py, the model-zoo equivalence check (issue 9): every net of its list trained COMET off
and on; each check of each net is a test of its own. Also: the DummyData substitution gives the shapes and
labels the table says, and the checker fails what it must fail (a destructive error bound, an abort)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import WF_REPO as REPO, WF_NEEDS_BUILD

sys.path.insert(0, str(REPO / "scripts"))
import zoo_check  # noqa: E402

SCRIPT = REPO / "scripts" / "zoo_check.py"
CHECKS = ("iter0", "ran", "freed", "loss", "grad", "stored")
# issue 9, item 4: upstream's models/ and examples/ that the CPU build runs, ours, and the ResNet
ZOO = {"caffenet", "alexnet", "googlenet", "flickr_style", "cifar10_quick", "cifar10_quick_prelu",
       "cifar10_quick_swish", "cifar10_quick_swish_in_place", "cifar10_full",
       "cifar10_sigmoid", "cifar10_sigmoid_bn", "lenet",
       "mnist_autoencoder", "siamese", "comet_tiny", "caffenet_dogs", "resnet18_dogs", "resnet18_frozen",
       "resnet18_depthwise", "hdf5_nonlinear", "pycaffe_linreg"}


def _run(*args, timeout=1200):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


def test_help_explains_the_checks_and_the_tolerances():
    out = _run("--help").stdout
    for word in ("COMET off", "--nets", "--iters", "--json", "--list", "iter0", "freed", "LOSS_TOL", "GRAD_FACTOR",
                 "DummyData"):
        assert word in out, word
    assert f"{zoo_check.LOSS_TOL:.0%}" in out


def test_the_list_covers_the_zoo():
    assert {n.name for n in zoo_check.NETS} == ZOO
    out = _run("--list").stdout
    assert all(name in out for name in ZOO)
    assert _run("--nets", "lenet,nosuchnet").returncode == 2


@pytest.mark.parametrize("net", zoo_check.NETS, ids=lambda n: n.name)
def test_dummy_data_replaces_the_data_layers_with_the_tables_shapes(net, wf_pb2):
    param = zoo_check.train_net(net, wf_pb2)
    types = [l.type for l in param.layer]
    assert not set(types) & set(zoo_check.DATA_TYPES)
    assert all(not l.include and not l.exclude for l in param.layer)
    from cometctl.caffeproto import read_text_proto

    source = read_text_proto(zoo_check.source_path(net), wf_pb2.NetParameter())
    train_names = {l.name for l in source.layer if not l.include or any(r.phase == wf_pb2.TRAIN for r in l.include)}
    test_only = {l.name for l in source.layer if l.include} - train_names
    assert not test_only & {l.name for l in param.layer}  # e.g. TEST-phase accuracy layers
    data_layers = [l for l in source.layer if l.type in zoo_check.DATA_TYPES]
    train_data = [l for l in data_layers if not l.include or any(r.phase == wf_pb2.TRAIN for r in l.include)]
    own_dummies = [l.name for l in source.layer if l.type == "DummyData"]
    dummies = [l for l in param.layer if l.type == "DummyData" and l.name not in own_dummies]
    assert len(train_data) == len(dummies) == (1 if net.tops else 0)
    made = {}
    for layer in dummies:
        for top, shape, filler in zip(layer.top, layer.dummy_data_param.shape, layer.dummy_data_param.data_filler):
            made[top] = (list(shape.dim), filler)
    assert set(made) == set(net.tops)
    for top, spec in net.tops.items():
        dims, filler = made[top]
        if spec[0] == "label":
            assert dims == [net.batch] and filler.type == "uniform"
            assert filler.min == 0 and spec[1] - 1 < filler.max < spec[1]  # truncates to 0..C-1
        else:
            assert dims == [net.batch, *spec[1]]


@WF_NEEDS_BUILD
@pytest.mark.parametrize("net", zoo_check.NETS, ids=lambda n: n.name)
def test_dummy_data_makes_those_blobs_in_caffe(net, wf_pb2, tmp_path):
    """Only the DummyData layers, built by Caffe and run once: the shapes, and labels that are class indices."""
    from cometctl.caffeproto import import_caffe, write_text_proto

    caffe = import_caffe()
    caffe.set_mode_cpu()
    param = zoo_check.train_net(net, wf_pb2)
    data_only = wf_pb2.NetParameter(name=param.name)
    data_only.layer.extend(l for l in param.layer if l.type == "DummyData")
    write_text_proto(tmp_path / "data.prototxt", data_only)
    built = caffe.Net(str(tmp_path / "data.prototxt"), caffe.TRAIN)
    built.forward()
    for top, spec in net.tops.items():
        blob = built.blobs[top].data
        if spec[0] == "label":
            assert blob.shape == (net.batch,)
            classes = blob.astype(np.int64)  # what the losses' static_cast<int> makes of it
            assert classes.min() >= 0 and classes.max() < spec[1]
        else:
            assert blob.shape == (net.batch, *spec[1])
            if spec[0] == "uniform":
                assert blob.min() >= 0 and blob.max() <= spec[2]


def test_the_frozen_net_freezes_what_comes_before_its_cut(wf_pb2):
    net = zoo_check.BY_NAME["resnet18_frozen"]
    param = zoo_check.train_net(net, wf_pb2)
    names = [l.name for l in param.layer]
    cut = names.index(net.freeze_before)
    before = [l for l in param.layer[:cut] if l.param]
    assert {l.type for l in before} == {"Convolution", "BatchNorm", "Scale"}
    assert all(p.lr_mult == 0 for l in before for p in l.param)
    assert all(p.lr_mult != 0 for l in param.layer[cut:] for p in l.param)  # the rest as the model has it


@WF_NEEDS_BUILD
def test_the_depthwise_net_is_resnet18_with_mobilenet_convolutions(wf_pb2, tmp_path):
    """Built by Caffe: each of ResNet-18's sixteen 3x3 convolutions after the stem is a depthwise 3x3 (one filter
    per input channel, the stride of the convolution it replaces) with BatchNorm, Scale and ReLU in place, then a
    1x1 of the same name whose output has the shape the 3x3 had; the stem and the 1x1 projections are unchanged."""
    from cometctl.caffeproto import import_caffe, write_text_proto

    caffe = import_caffe()
    caffe.set_mode_cpu()
    nets = {}
    for name in ("resnet18_depthwise", "resnet18_dogs"):
        write_text_proto(tmp_path / f"{name}.prototxt", zoo_check.train_net(zoo_check.BY_NAME[name], wf_pb2))
        nets[name] = caffe.Net(str(tmp_path / f"{name}.prototxt"), caffe.TRAIN)
    dw, plain = nets["resnet18_depthwise"], nets["resnet18_dogs"]
    split = [n for n in plain.params if plain.params[n][0].data.shape[2:] == (3, 3)]
    assert len(split) == 16 and "conv1" not in split
    layers = dict(zip(dw._layer_names, dw.layers))
    for name in split:
        c = plain.params[name][0].data.shape[1]  # its input channels
        assert dw.params[f"{name}_dw"][0].data.shape == (c, 1, 3, 3)
        assert [layers[f"{name}_dw{s}"].type for s in ("_bn", "_scale", "_relu")] == ["BatchNorm", "Scale", "ReLU"]
        assert dw.params[name][0].data.shape == (plain.params[name][0].data.shape[0], c, 1, 1)
        assert dw.blobs[dw.top_names[name][0]].data.shape == plain.blobs[plain.top_names[name][0]].data.shape
        assert dw.blobs[f"{name}_dw"].data.shape[1] == c
    for name in set(plain.params) - set(split):
        assert [p.data.shape for p in dw.params[name]] == [p.data.shape for p in plain.params[name]], name


def _quick_net_with(name, wf_pb2, neuron):
    """The TRAIN nets of zoo net `name` and of cifar10_quick, after checking that they have the same layers and
    that `name` swaps exactly the three ReLUs for `neuron` layers."""
    a = zoo_check.train_net(zoo_check.BY_NAME[name], wf_pb2)
    b = zoo_check.train_net(zoo_check.BY_NAME["cifar10_quick"], wf_pb2)
    assert [l.name for l in a.layer] == [l.name for l in b.layer]
    swapped = [(x.type, y.type) for x, y in zip(a.layer, b.layer) if x.type != y.type]
    assert swapped == [(neuron, "ReLU")] * 3
    return a, b


def test_the_prelu_net_is_the_quick_net_with_prelus_and_its_own_starting_bound(wf_pb2):
    net, plain = zoo_check.BY_NAME["cifar10_quick_prelu"], zoo_check.BY_NAME["cifar10_quick"]
    a, b = _quick_net_with("cifar10_quick_prelu", wf_pb2, "PReLU")
    assert all(list(x.top) == list(x.bottom) for x in a.layer if x.type == "PReLU")  # in place, as the ReLUs
    assert 0 < net.start_bound < 1e-3 and plain.start_bound == 0


def test_the_swish_net_is_the_quick_net_with_swish_out_of_place(wf_pb2):
    a, b = _quick_net_with("cifar10_quick_swish", wf_pb2, "Swish")
    for i, layer in enumerate(a.layer):
        if layer.type != "Swish":
            continue
        assert list(layer.top) == [layer.name] and list(layer.bottom) == list(b.layer[i].bottom)
        # the next layer reads the Swish's output where it read the ReLU's blob
        assert list(a.layer[i + 1].bottom) == [layer.name] and list(b.layer[i + 1].bottom) == list(b.layer[i].top)


def test_the_in_place_swish_net_swaps_the_relus_types_alone(wf_pb2):
    a, b = _quick_net_with("cifar10_quick_swish_in_place", wf_pb2, "Swish")
    for x, y in zip(a.layer, b.layer):
        assert (x.name, list(x.bottom), list(x.top)) == (y.name, list(y.bottom), list(y.top))  # in place, as the ReLUs


def test_freed_read_lines_are_recognised():
    old = ("W20261201 06:49:28.519017 15901 payload.cpp:428] COMET: the data of blob 'pool1' was freed after its "
           "last use in the training step (comet { release_unused, release_diffs }); it reads as zeros")
    new = ("RuntimeError: COMET: the data of blob 'label' was freed after its last use in the training step, and "
           "layer 'loss' (backward, iteration 3) reads it.")
    mask = "COMET: blob 'conv1' is held only as the signs of its values (a ReLU mask) until the next forward"
    assert all(zoo_check.FREED_READ.search(line) for line in (old, new, mask))
    assert not zoo_check.FREED_READ.search("COMET norm1: scale recomputed, freed 68.3 MB, 242.0 ms")


# ------------------------------------------------------------------------------------ the whole zoo

@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    out = tmp_path_factory.mktemp("zoo") / "zoo.json"
    proc = _run("--json", str(out))
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


@WF_NEEDS_BUILD
@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("net", sorted(ZOO))
def test_zoo(zoo, net, check):
    _, data = zoo
    result = data["nets"][net]["checks"][check]
    shown = {k: v for k, v in result.items() if k not in ("per_layer", "off_trajectory", "on_trajectory")}
    assert result["pass"], f"{net}: {check} FAIL: {json.dumps(shown)[:2000]}"


@WF_NEEDS_BUILD
def test_zoo_exit_status_and_table_agree_with_the_json(zoo):
    proc, data = zoo
    assert proc.returncode == (1 if data["failed"] else 0)
    assert set(data["nets"]) == ZOO
    for net, result in data["nets"].items():
        assert result["verdict"] == ("PASS" if all(c["pass"] for c in result["checks"].values()) else "FAIL")
        assert f"| {net} |" in proc.stdout


# ----------------------------------------------------------------------------- the checker can fail

@WF_NEEDS_BUILD
def test_a_destructive_error_bound_fails_the_gradient_and_loss_checks(tmp_path):
    """FIXED error_bound 1e3 stores LeNet's activations as nothing: the forward is still exact, the
    gradients are not, and the net learns less."""
    out = tmp_path / "broken.json"
    proc = _run("--nets", "lenet", "--comet", "eb_mode: FIXED error_bound: 1e3", "--json", str(out))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    checks = json.loads(out.read_text())["nets"]["lenet"]["checks"]
    assert checks["iter0"]["pass"] and checks["ran"]["pass"] and checks["freed"]["pass"]
    assert not checks["grad"]["pass"] and checks["grad"]["max"] > 10 * checks["grad"]["limit"]
    assert not checks["loss"]["pass"]
    assert "FAIL" in proc.stdout and "lenet: FAIL" in proc.stderr


@WF_NEEDS_BUILD
def test_a_store_that_stores_nothing_fails_the_stored_check(tmp_path):
    """With the store turned off every other check passes (the runs are the same): only `stored` fails."""
    out = tmp_path / "off.json"
    proc = _run("--nets", "lenet", "--iters", "2", "--comet", "enabled: false", "--json", str(out))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    checks = json.loads(out.read_text())["nets"]["lenet"]["checks"]
    assert not checks["stored"]["pass"] and checks["stored"]["ratio"] == 1.0, checks["stored"]
    assert all(checks[c]["pass"] for c in ("iter0", "ran", "freed", "grad")), checks
    assert "[stored]" in proc.stdout


@WF_NEEDS_BUILD
def test_an_abort_is_that_nets_failure_and_the_next_net_still_runs(tmp_path):
    """A comet block that Caffe refuses (CHECK failure: the process aborts) fails each net on its own,
    with the last lines of the run's output; the COMET-off run of the same net is unaffected."""
    out = tmp_path / "abort.json"
    proc = _run("--nets", "lenet,cifar10_quick", "--iters", "2", "--comet", "error_bound: -1", "--json", str(out))
    assert proc.returncode == 1
    nets = json.loads(out.read_text())["nets"]
    for name in ("lenet", "cifar10_quick"):
        ran = nets[name]["checks"]["ran"]
        assert not ran["pass"] and ran["off"]["status"] == "exit status 0" and ran["off"]["steps"] == 2
        assert ran["on"]["status"] != "exit status 0"
        assert any("error_bound" in line for line in ran["on"]["stderr_tail"])
        assert nets[name]["verdict"] == "FAIL"
    assert "last lines of its output" in proc.stdout
