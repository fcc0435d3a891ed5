"""models/: every shipped prototxt parses, points at prepare-dogs' outputs, runs a few iterations on the CPU,
and deploy.prototxt runs a forward pass with pycaffe (with trained weights for comet_tiny)."""

from __future__ import annotations


import numpy as np
import pytest

from cometctl import imagedb
from cometctl.caffeproto import read_text_proto

from conftest import WF_REPO as REPO, WF_NEEDS_BUILD, wf_point_model_at

MODELS = REPO / "models"
PROTOTXTS = sorted(MODELS.glob("*/*.prototxt"))
# the ImageNet variants (imagenet_*.prototxt, written by models/make_imagenet_models.py) are checked in
# test_imagenet.py; here they are only parsed
DEFAULT_PROTOTXTS = [p for p in PROTOTXTS if not p.name.startswith("imagenet_")]
EXPECTED = {"comet_tiny": ("data/synthetic", 10, 56), "bvlc_reference_caffenet": ("data/dogs", 120, 227),
            "resnet18_dogs": ("data/dogs", 120, 224)}
GPU_MODELS = {"bvlc_reference_caffenet", "resnet18_dogs"}  # trained from scratch on a GPU, as COMET was


def test_every_model_has_train_val_solver_and_deploy():
    assert {p.parent.name for p in DEFAULT_PROTOTXTS} == set(EXPECTED)
    for model in EXPECTED:
        assert {p.name for p in DEFAULT_PROTOTXTS if p.parent.name == model} == \
            {"train_val.prototxt", "solver.prototxt", "deploy.prototxt"}


@pytest.mark.parametrize("path", PROTOTXTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_prototxt_parses(path, wf_pb2):
    msg = wf_pb2.SolverParameter() if path.name.endswith("solver.prototxt") else wf_pb2.NetParameter()
    read_text_proto(path, msg)
    assert msg.ListFields()


@pytest.mark.parametrize("model", sorted(EXPECTED))
def test_model_matches_what_prepare_dogs_writes(model, wf_pb2):
    data_dir, classes, crop = EXPECTED[model]
    solver = read_text_proto(MODELS / model / "solver.prototxt", wf_pb2.SolverParameter())
    assert solver.net == f"models/{model}/train_val.prototxt" and (REPO / solver.net).exists()
    assert "comet {" in (MODELS / model / "solver.prototxt").read_text()  # the reserved COMET place
    net = read_text_proto(REPO / solver.net, wf_pb2.NetParameter())
    data = [l for l in net.layer if l.type == "Data"]
    assert sorted(l.data_param.source for l in data) == [f"{data_dir}/train_lmdb", f"{data_dir}/val_lmdb"]
    assert {l.transform_param.mean_file for l in data} == {f"{data_dir}/mean.binaryproto"}
    assert {l.transform_param.crop_size for l in data} == {crop}
    assert all(l.data_param.backend == wf_pb2.DataParameter.LMDB for l in data)
    last_ip = [l for l in net.layer if l.type == "InnerProduct"][-1]
    assert last_ip.inner_product_param.num_output == classes
    deploy = read_text_proto(MODELS / model / "deploy.prototxt", wf_pb2.NetParameter())
    assert list(deploy.layer[0].input_param.shape[0].dim)[1:] == [3, crop, crop]
    assert [l.inner_product_param.num_output for l in deploy.layer if l.type == "InnerProduct"][-1] == classes
    expected_mode = wf_pb2.SolverParameter.GPU if model in GPU_MODELS else wf_pb2.SolverParameter.CPU
    assert solver.solver_mode == expected_mode


@WF_NEEDS_BUILD
def test_comet_tiny_deploy_runs_the_trained_snapshot(wf_short_run, wf_synthetic):
    from cometctl.caffeproto import import_caffe

    caffe = import_caffe()
    caffe.set_mode_cpu()
    weights = wf_short_run / "snapshots" / "model_iter_30.caffemodel"
    net = caffe.Net(str(MODELS / "comet_tiny" / "deploy.prototxt"), caffe.TEST, weights=str(weights))
    blob = caffe.proto.caffe_pb2.BlobProto()
    blob.ParseFromString((wf_synthetic / "mean.binaryproto").read_bytes())
    mean = caffe.io.blobproto_to_array(blob)[0]
    datums = [d for _, d in imagedb.iter_datums(wf_synthetic / "val_lmdb")][:8]
    batch = np.stack([(imagedb.datum_array(d).astype(np.float32) - mean)[:, 4:60, 4:60] / 128 for d in datums])
    net.blobs["data"].reshape(*batch.shape)
    prob = net.forward(data=batch)["prob"]
    assert prob.shape == (8, 10)
    assert np.allclose(prob.sum(axis=1), 1, atol=1e-5)
    # deploy has no fillers: without the snapshot's weights every output would be exactly uniform
    assert np.abs(prob - 0.1).max() > 1e-3
    assert np.array_equal(net.params["conv1"][0].data,
                          caffe.Net(str(wf_short_run / "train_val.prototxt"), caffe.TEST,
                                    weights=str(weights)).params["conv1"][0].data)


@pytest.fixture(scope="module")
def dogs256(wf_pb2, wf_synthetic_archives, tmp_path_factory):
    """prepare-dogs at 256x256 (the real default) on the embedded synthetic archives, once per module."""
    from cometctl.dogs import prepare_dogs

    images, lists = wf_synthetic_archives
    data = tmp_path_factory.mktemp("dogs256") / "dogs"
    prepare_dogs(data, archive=images, lists=lists, size=256, jobs=2)
    return data


def _train_two_iterations_then_deploy(tmp_path, wf_pb2, dogs256, model: str, crop: int) -> str:
    """`cometctl train --cpu` runs the shipped solver (its comet block included) for 2 iterations on
    the 256x256 LMDBs at batch 4; then the deploy net classifies one input into 120 breeds.
    Returns the training log."""
    from cometctl.caffeproto import import_caffe
    from cometctl.train import train

    solver = wf_point_model_at(wf_pb2, MODELS / model, dogs256, tmp_path / model,
                               batch=4, test_iter=1, test_interval=1000, test_initialization=False, display=1,
                               snapshot=0, snapshot_after_train=False)
    code = train(solver, cpu=True, iters=2, run_dir=tmp_path / "run")
    log = (tmp_path / "run" / "caffe.log").read_text()
    assert code == 0, log[-3000:]
    assert "Iteration 1" in log and "Optimization Done" in log
    for f in (tmp_path / "run" / "snapshots").glob("*"):
        f.unlink()  # CaffeNet's weights and state are 2 x 230 MB: not needed here
    caffe = import_caffe()
    caffe.set_mode_cpu()
    net = caffe.Net(str(MODELS / model / "deploy.prototxt"), caffe.TEST)
    net.blobs["data"].reshape(1, 3, crop, crop)
    prob = net.forward(data=np.random.default_rng(0).normal(size=(1, 3, crop, crop)).astype(np.float32))["prob"]
    assert prob.shape == (1, 120) and abs(prob.sum() - 1) < 1e-4
    return log


@WF_NEEDS_BUILD
def test_caffenet_trains_two_iterations_on_256px_lmdbs_and_deploy_runs(tmp_path, wf_pb2, dogs256):
    """The full-size model on the CPU: prepare-dogs at 256x256 (the real default), 2 iterations, batch 4."""
    _train_two_iterations_then_deploy(tmp_path, wf_pb2, dogs256, "bvlc_reference_caffenet", 227)


@pytest.mark.parametrize("model", sorted(EXPECTED))
def test_solvers_train_with_comet(model, wf_pb2):
    from google.protobuf import text_format

    solver = text_format.Parse((MODELS / model / "solver.prototxt").read_text(), wf_pb2.SolverParameter())
    assert solver.HasField("comet") and solver.comet.enabled
    assert solver.comet.eb_mode == wf_pb2.CometParameter.ADAPTIVE and solver.comet.update_interval == 200


def test_resnet18_files_are_what_the_generator_writes():
    import subprocess
    import sys

    subprocess.run([sys.executable, str(MODELS / "resnet18_dogs" / "make_resnet.py"), "--check"], check=True)


def test_resnet18_is_resnet18(wf_pb2):
    """Convolutions without bias, each followed by BatchNorm and Scale with bias in place, SUM shortcuts with
    1x1 stride-2 projections where the shape changes, global average pooling, and the label read by the
    loss and by an Accuracy that runs in TRAIN as well as TEST."""
    net = read_text_proto(MODELS / "resnet18_dogs" / "train_val.prototxt", wf_pb2.NetParameter())
    layers = list(net.layer)
    convs = [i for i, l in enumerate(layers) if l.type == "Convolution"]
    assert len(convs) == 17 + 3  # 17 weighted convolutions of ResNet-18 and 3 projections
    for i in convs:
        conv, bn, scale = layers[i], layers[i + 1], layers[i + 2]
        assert not conv.convolution_param.bias_term
        assert (bn.type, scale.type) == ("BatchNorm", "Scale") and scale.scale_param.bias_term
        assert list(bn.bottom) == list(bn.top) == list(scale.bottom) == list(scale.top) == list(conv.top)
    projections = [layers[i] for i in convs if layers[i].name.endswith("_branch1")]
    assert [(p.convolution_param.kernel_size[0], p.convolution_param.stride[0]) for p in projections] == [(1, 2)] * 3
    sums = [l for l in layers if l.type == "Eltwise"]
    assert len(sums) == 8 and all(l.eltwise_param.operation == wf_pb2.EltwiseParameter.SUM for l in sums)
    pools = [l for l in layers if l.type == "Pooling"]
    assert pools[-1].pooling_param.pool == wf_pb2.PoolingParameter.AVE and pools[-1].pooling_param.global_pooling
    readers = [l for l in layers if "label" in l.bottom]
    assert sorted(l.type for l in readers) == ["Accuracy", "SoftmaxWithLoss"]
    assert all(not l.include and not l.exclude for l in readers)  # both phases


@WF_NEEDS_BUILD
def test_resnet18_trains_two_iterations_with_comet_and_deploy_runs(tmp_path, wf_pb2, dogs256):
    """`cometctl train --cpu` runs the shipped solver (its comet block included) on 256x256 LMDBs, batch 4."""
    log = _train_two_iterations_then_deploy(tmp_path, wf_pb2, dogs256, "resnet18_dogs", 224)
    assert "COMET" in log
