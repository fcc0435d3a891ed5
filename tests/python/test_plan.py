"""`cometctl plan`: the fit predicts a measured run, the JSON document, and bad input as one clear line.

The measured tests run comet_tiny (DummyData input, so no dataset is needed) at batches 32 and 64 and
check batch 128 against a run of its own; every caffe run of this net takes about a second.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import WF_NEEDS_BUILD, WF_REPO as REPO

from cometctl import plan as P
from cometctl.errors import CometError

TINY_SOLVER = REPO / "models" / "comet_tiny" / "solver.prototxt"
TINY_NET = REPO / "models" / "comet_tiny" / "train_val.prototxt"


def _cometctl(*args, cwd=None, timeout=300):
    exe = str(Path(sys.executable).parent / "cometctl")
    return subprocess.run([exe, *args], capture_output=True, text=True, cwd=cwd or REPO, timeout=timeout)


def _solver_with_net(tmp_path: Path, net_text: str, name="net") -> Path:
    net = tmp_path / f"{name}.prototxt"
    net.write_text(net_text)
    solver = tmp_path / f"{name}_solver.prototxt"
    solver.write_text(TINY_SOLVER.read_text().replace('net: "models/comet_tiny/train_val.prototxt"', f'net: "{net}"'))
    return solver


# ------------------------------------------------------------------------------- without caffe

def test_the_log_gives_a_frozen_layers_freed_buffers_their_size():
    """A frozen layer's private buffers are freed after its forward ("release"): the store reports no bytes
    for them, so their size comes from the layer's top, which each of them matches value for value."""
    log = "\n".join([
        "I1206 00:10:48.154937 17339 net.cpp:86] Creating Layer bn_conv1",
        "I1206 00:10:48.154940 17339 net.cpp:408] bn_conv1 <- conv1",
        "I1206 00:10:48.154942 17339 net.cpp:369] bn_conv1 -> conv1 (in-place)",
        "I1206 00:10:48.154961 17339 net.cpp:124] Setting up bn_conv1",
        "I1206 00:10:48.154963 17339 net.cpp:131] Top shape: 32 64 56 56 (6422528)",
        "I1206 00:10:48.240861 17339 store.cpp:342] COMET plan: blob bn_conv1 temp -> release after bn_conv1 forward",
        "I1206 00:10:48.240863 17339 store.cpp:342] COMET plan: blob bn_conv1 x_norm -> release after bn_conv1 forward",
        "I1206 00:10:48.240864 17339 store.cpp:342] COMET plan: blob pool9 argmax -> release after pool9 forward",
    ])
    info = P.read_log(log)
    assert info["plan"] == [("bn_conv1 temp", "release"), ("bn_conv1 x_norm", "release"), ("pool9 argmax", "release")]
    assert info["first_top_counts"]["bn_conv1"] == 6422528  # bn_conv1 x_norm's and temp's size
    assert "pool9" not in info["first_top_counts"]  # no Top shape seen: no size, rather than a wrong one


def test_sizes_read_as_people_write_them():
    assert P.parse_size("8GiB") == P.parse_size("8G") == P.parse_size("8 gib") == 8 * 2**30
    assert P.parse_size("4096MiB") == 4 * 2**30
    assert P.parse_size("500MB") == 500 * 10**6 and P.parse_size("2kB") == 2000
    assert P.parse_size("1.5GiB") == int(1.5 * 2**30) and P.parse_size("123") == 123
    for bad in ("lots", "", "8 gigs", "-1G", "GiB"):
        with pytest.raises(CometError, match="not a size"):
            P.parse_size(bad)


def test_fit_and_the_largest_batch():
    line = P.fit([8, 16, 32], [100 + 3 * 8, 100 + 3 * 16, 100 + 3 * 32])
    assert math.isclose(line.fixed, 100) and math.isclose(line.per_sample, 3)
    assert line.largest_batch(100 + 3 * 50) == 50 and line.largest_batch(100 + 3 * 50 - 0.1) == 49
    assert line.largest_batch(99) == 0  # not even batch 1
    assert P.Line(10, 0).largest_batch(20) is None  # no growth: no limit from the batch
    # least squares through noisy points, not through the first and the last
    noisy = P.fit([1, 2, 3], [1, 3, 2])
    assert math.isclose(noisy.per_sample, 0.5) and math.isclose(noisy.fixed, 1.0)


def test_the_data_source_pages_stop_growing_at_the_database_size():
    fits = {"peak": {"fixed": 100.0, "per_sample": 10.0}, "mapped": {"fixed": 40.0, "per_sample": 4.0}}
    assert P.predict(fits, 5) == 150  # no cap: the line
    assert P.predict(fits, 5, file_cap=100) == 150  # 20 of the 100 read: under the cap
    # the rest (60 + 6 x 100) plus the pages: 40 + 400 read, capped at 40 + 100
    assert P.predict(fits, 100, file_cap=100) == (60 + 600) + (40 + 100)
    # the largest batch under the cap is found on the capped curve, and it is the last one that fits
    n = P.largest_batch(fits, 2000, file_cap=100)
    assert P.predict(fits, n, 100) <= 2000 < P.predict(fits, n + 1, 100)
    assert n > P.Line(**fits["peak"]).largest_batch(2000)
    assert P.largest_batch(fits, 50, file_cap=100) == 0


def test_input_shapes_option():
    assert P.parse_input_shapes(["data=3x227x227", "pair_data=2,28,28"]) == {"data": (3, 227, 227),
                                                                           "pair_data": (2, 28, 28)}
    for bad in ("data", "data=", "=3x4", "data=3xbig", "data=0x2"):
        with pytest.raises(CometError, match="TOP=CxHxW"):
            P.parse_input_shapes([bad])


@WF_NEEDS_BUILD
def test_missing_sources_names_what_a_train_net_cannot_read(wf_pb2, tmp_path):
    from google.protobuf import text_format

    there = tmp_path / "train_lmdb"
    there.mkdir()
    net = text_format.Parse(f"""
        layer {{ name: "d" type: "Data" top: "x" data_param {{ source: "{there}" batch_size: 2 }}
                transform_param {{ mean_file: "{tmp_path}/no_mean.binaryproto" }} include {{ phase: TRAIN }} }}
        layer {{ name: "t" type: "Data" top: "x" data_param {{ source: "{tmp_path}/no_test_lmdb" }}
                include {{ phase: TEST }} }}
        layer {{ name: "h" type: "HDF5Data" top: "y" hdf5_data_param {{ source: "{tmp_path}/no_list.txt" }} }}
        layer {{ name: "m" type: "MemoryData" top: "z" memory_data_param {{ batch_size: 2 }} }}
    """, wf_pb2.NetParameter())
    assert P.missing_sources(net, wf_pb2) == [
        ("d", "mean file", f"{tmp_path}/no_mean.binaryproto"), ("h", "source", f"{tmp_path}/no_list.txt"),
        ("m", "memory", "(fed by pycaffe, not by caffe train)")]


def test_net_at_a_batch_size(wf_pb2, tmp_path):
    from cometctl.caffeproto import read_text_proto

    net = read_text_proto(TINY_NET, wf_pb2.NetParameter())
    assert P.net_batch(net, wf_pb2) == 32
    real = P.net_at_batch(net, wf_pb2, 12, synthetic=False)
    data = [layer for layer in real.layer if layer.type == "Data"]
    assert len(data) == 1 and data[0].data_param.batch_size == 12  # the TRAIN data layer only
    assert not any(layer.include for layer in real.layer)
    notes = []
    dummy = P.net_at_batch(net, wf_pb2, 12, synthetic=True, notes=notes)
    d = [layer for layer in dummy.layer if layer.type == "DummyData"]
    assert len(d) == 1 and not any(layer.type == "Data" for layer in dummy.layer)
    shapes = [list(s.dim) for s in d[0].dummy_data_param.shape]
    if (REPO / "data" / "synthetic" / "train_lmdb").exists():
        assert shapes == [[12, 3, 56, 56], [12]]  # read from the LMDB's first Datum, then cropped
    else:
        assert shapes == [[12, 3, 56, 56], [12]] and notes  # from the crop size, 3 channels assumed
    assert d[0].dummy_data_param.data_filler[1].type == "constant"  # labels 0: valid for any loss
    # no crop and no source: the shape has to be given
    text = TINY_NET.read_text().replace("crop_size: 56", "").replace("data/synthetic/train_lmdb", str(tmp_path / "no"))
    nocrop = wf_pb2.NetParameter()
    from google.protobuf import text_format

    text_format.Merge(text, nocrop)
    with pytest.raises(CometError, match="--input-shape data=CxHxW"):
        P.net_at_batch(nocrop, wf_pb2, 4, synthetic=True)
    given = P.net_at_batch(nocrop, wf_pb2, 4, synthetic=True, shapes={"data": (1, 20, 20)})
    assert [list(s.dim) for s in given.layer[0].dummy_data_param.shape] == [[4, 1, 20, 20], [4]]


# ---------------------------------------------------------------------------------- with caffe

@pytest.fixture(scope="module")
def tiny_plan(tmp_path_factory):
    """One plan of comet_tiny: measured at 32 and 64, checked at 128, with a budget; its JSON."""
    from conftest import WF_BUILT

    if not WF_BUILT:
        pytest.skip("the Caffe build is absent: run `cometctl build` (CI always builds it first)")
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    r = _cometctl("plan", "--solver", str(TINY_SOLVER), "--cpu", "--synthetic-input", "--measure", "32,64",
                  "--batch", "128", "--memory", "256MiB", "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(out.read_text()), r.stdout


def test_the_fit_predicts_a_measured_run(tiny_plan):
    plan, text = tiny_plan
    checks = {c["comet"]: c for c in plan["checks"]}
    assert set(checks) == {"off", "on"} and all(c["batch"] == 128 for c in checks.values())
    fit_runs = {(r["batch"], r["comet"]): r["peak"] for r in plan["runs"]}
    assert set(fit_runs) == {(32, "off"), (32, "on"), (64, "off"), (64, "on")}  # the check is not in the fit
    # measured on the 2-core development machine: off within 0.5%, on +2.6% to +3.3% in three runs (for a
    # net this small, the untracked part of a COMET run grows a little slower than its line)
    tolerance = {"off": 0.03, "on": 0.06}
    for mode, c in checks.items():
        measured, predicted = c["measured_bytes"], c["predicted_bytes"]
        # the check is a run of its own: its peak is RSS measured at batch 128, above the fit's runs
        assert c["run"]["batch"] == 128 and measured == c["run"]["peak"] > fit_runs[(64, mode)]
        assert abs(predicted - measured) / measured < tolerance[mode], (mode, predicted, measured)
        # and the batch matters: a prediction that ignored it (the peak at 32) would miss by far more
        assert (measured - fit_runs[(32, mode)]) / measured > 3 * tolerance[mode], mode
    # COMET stores the activations smaller: it grows less per sample and fits a larger batch
    assert plan["fit"]["on"]["peak"]["per_sample"] < plan["fit"]["off"]["peak"]["per_sample"]
    b = plan["budget"]
    assert b["bytes"] == 256 * 2**20 and b["largest_batch_on"] > b["largest_batch_off"] > 0
    for mode in ("off", "on"):
        n = b[f"largest_batch_{mode}"]
        assert P.predict(plan["fit"][mode], n) <= b["bytes"] < P.predict(plan["fit"][mode], n + 1)
    assert "largest batch in 256MiB" in text and "check at batch 128, COMET on" in text


def test_plan_json_schema(tiny_plan, tmp_path):
    plan, text = tiny_plan
    assert plan["schema"] == "cometctl-plan/1" and plan["device"] == "CPU" and plan["measured"] is True
    assert plan["solver_batch"] == 32 and plan["measure_batches"] == [32, 64] and plan["iters"] == 2
    for mode in ("off", "on"):
        f = plan["fit"][mode]
        for key in ("peak", *P.PARTS, *P.STEP_FIGURES):
            assert set(f[key]) == {"fixed", "per_sample"}, key
        # the parts of the peak add up to it, per run and so in the fit
        for r in (r for r in plan["runs"] if r["comet"] == mode):
            assert math.isclose(sum(r["parts"].values()), r["peak"], rel_tol=1e-9)
        assert math.isclose(sum(f[p]["per_sample"] for p in P.PARTS), f["peak"]["per_sample"], rel_tol=1e-6)
        assert f["max_residual"] < 0.05
    pred = plan["predicted"]
    assert pred["batch"] == 32 and pred["on_bytes"] < pred["off_bytes"]
    layers = plan["layers"]
    assert layers and all(set(row) == {"blob", "layer", "action", "dense_bytes", "stored_bytes", "error_bound"}
                          for row in layers)
    by_blob = {row["blob"]: row for row in layers}
    # comet_tiny's plan: conv1 -> ReLU mask (1 bit of 32), pool1 lossy with a bound, fc5 freed
    assert by_blob["conv1"]["action"] == "mask"
    assert math.isclose(by_blob["conv1"]["dense_bytes"] / by_blob["conv1"]["stored_bytes"], 32, rel_tol=0.01)
    assert math.isclose(by_blob["conv1"]["dense_bytes"], 32 * 16 * 56 * 56 * 4, rel_tol=0.001)
    assert by_blob["pool1"]["action"] == "lossy" and by_blob["pool1"]["error_bound"] > 0
    assert by_blob["fc5"]["action"] == "release" and by_blob["fc5"]["stored_bytes"] == 0
    assert "pool1 argmax" in by_blob and by_blob["pool1 argmax"]["action"] == "argmax"
    assert "per blob at batch 32" in text and "sign mask" in text
    # `cometctl report --plan` draws it
    src = tmp_path / "plan.json"
    src.write_text(json.dumps(plan))
    r = _cometctl("report", "--plan", str(src), "--out", str(tmp_path / "rep"))
    assert r.returncode == 0, r.stderr
    png = tmp_path / "rep" / "plan.png"
    assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"


@WF_NEEDS_BUILD
def test_a_budget_below_the_fixed_part_says_so(tmp_path):
    r = _cometctl("plan", "--solver", str(TINY_SOLVER), "--cpu", "--synthetic-input", "--measure", "8,16",
                  "--iters", "1", "--memory", "20MiB")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    err = r.stderr.strip().splitlines()[-1]
    assert "--memory 20MiB (20.0 MiB) is smaller than" in err and "the weights alone do not fit" in err
    assert "the fixed part is" in err and "MiB with COMET on" in err and "batch 1 needs" in err


@WF_NEEDS_BUILD
def test_a_missing_data_source_suggests_synthetic_input(tmp_path):
    solver = _solver_with_net(tmp_path, TINY_NET.read_text().replace("data/synthetic/train_lmdb",
                                                                     str(tmp_path / "nowhere_lmdb")))
    r = _cometctl("plan", "--solver", str(solver), "--cpu")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "nowhere_lmdb" in r.stderr and "--synthetic-input" in r.stderr
    assert not list(tmp_path.glob("*.log"))  # nothing ran


@WF_NEEDS_BUILD
def test_a_dataset_being_prepared_is_not_planned_on(tmp_path):
    from conftest import held_by_another_process

    lmdb = tmp_path / "data" / "train_lmdb"
    lmdb.mkdir(parents=True)
    solver = _solver_with_net(tmp_path, TINY_NET.read_text().replace("data/synthetic/train_lmdb", str(lmdb)))
    with held_by_another_process(tmp_path / "data"):
        r = _cometctl("plan", "--solver", str(solver), "--cpu")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"reads {lmdb}, and another cometctl command is preparing a dataset in" in r.stderr
    assert "--synthetic-input" in r.stderr
    assert not list(tmp_path.glob("*.log"))  # nothing ran


@WF_NEEDS_BUILD
def test_a_net_that_does_not_run_reports_caffes_error(tmp_path):
    text = TINY_NET.read_text().replace('type: "Pooling"', 'type: "NoSuchPooling"', 1)
    solver = _solver_with_net(tmp_path, text)
    r = _cometctl("plan", "--solver", str(solver), "--cpu", "--synthetic-input", "--measure", "4,8",
                  "--keep", str(tmp_path / "work"))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    err = r.stderr.strip().splitlines()[-1]
    assert "at batch 4 with COMET off" in err and "Unknown layer type: NoSuchPooling" in err
    assert (tmp_path / "work" / "b4_off.log").exists()  # the log it names is there


@WF_NEEDS_BUILD
def test_upstreams_consolidated_lenet_solver_plans(tmp_path):
    """examples/mnist/lenet_consolidated_solver.prototxt names its net inline (net_param) in Caffe's V1
    format (`layers { type: CONVOLUTION }`): plan was refused ('no `net:`'); it now reads the upgraded
    net (upstream's upgrade_net_proto_text) and predicts for the solver's batch of 64."""
    from cometctl.paths import pycaffe_dir

    solver = pycaffe_dir().parent / "examples" / "mnist" / "lenet_consolidated_solver.prototxt"
    assert "layers {" in solver.read_text()
    r = _cometctl("plan", "--solver", str(solver), "--cpu", "--synthetic-input", "--input-shape", "data=1x28x28",
                  "--measure", "4,8", "--iters", "2", "--json", str(tmp_path / "plan.json"))
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert doc["solver_batch"] == 64
    assert {row["blob"] for row in doc["layers"]} >= {"conv1", "pool1", "ip1"}


@WF_NEEDS_BUILD
def test_a_small_net_is_measured_at_larger_batches_until_its_peak_grows(tmp_path):
    """Upstream's CIFAR-10 full net with COMET on grows about 3.5 MiB from batch 8 to 32, about as much as the
    runtime varies between runs: the line from 8, 16, 32 predicted batch 512 12% low. With the default batches
    plan widens them for that mode and predicts 512 within 5% (measured on the 2-core machine: -2.8% and -3.0%
    after widening to 64 and 128; COMET off, not widened, +0.4%)."""
    from cometctl.paths import pycaffe_dir

    src = pycaffe_dir().parent
    r = _cometctl("plan", "--solver", "examples/cifar10/cifar10_full_solver.prototxt", "--cpu", "--synthetic-input",
                  "--input-shape", "data=3x32x32", "--batch", "512", "--json", str(tmp_path / "plan.json"), cwd=src)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert doc["measure_batches"] == [8, 16, 32] and doc["widened"]["off"] == [] and doc["widened"]["on"]
    for mode in ("off", "on"):
        peaks = sorted((run["batch"], run["peak"]) for run in doc["runs"] if run["comet"] == mode)
        grew = peaks[-1][1] - peaks[0][1]
        # the batches stop at the first that grew enough, and only then
        assert grew >= P.WIDEN_GROWTH and (mode == "off" or peaks[-2][1] - peaks[0][1] < P.WIDEN_GROWTH), (mode, peaks)
    for c in doc["checks"]:
        assert c["batch"] == 512 and abs(c["error"]) < 0.05, c
    assert "COMET on also at" in r.stdout and "the peak grew only" in r.stdout


def _plan_of(tmp_path, net: str):
    """`cometctl plan` of a net (text) at batches 4 and 8: its JSON document and its per-blob rows by blob."""
    r = _cometctl("plan", "--solver", str(_solver_with_net(tmp_path, net)), "--cpu", "--measure", "4,8",
                  "--iters", "2", "--json", str(tmp_path / "plan.json"))
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads((tmp_path / "plan.json").read_text())
    return doc, {row["blob"]: row for row in doc["layers"]}


@WF_NEEDS_BUILD
def test_lrn_buffers_count_their_size(tmp_path):
    """LRN's buffers as large as its output: across channels its scale, held until its backward; within a channel
    (upstream's CIFAR-10 full net) its internal layers' outputs (squares, window means, scale), freed after the
    forward on the CPU, where the store computes its backward from the input. The table listed them without bytes."""
    net = """name: "lrns"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 10 dim: 3 dim: 16 dim: 16 } shape { dim: 10 }
    data_filler { type: "gaussian" std: 1 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "norm1" type: "LRN" bottom: "conv1" top: "norm1" lrn_param { local_size: 3 } }
layer { name: "conv2" type: "Convolution" bottom: "norm1" top: "conv2"
  convolution_param { num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "norm2" type: "LRN" bottom: "conv2" top: "norm2" lrn_param { local_size: 3 norm_region: WITHIN_CHANNEL } }
layer { name: "ip" type: "InnerProduct" bottom: "norm2" top: "ip"
  inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""
    doc, by_blob = _plan_of(tmp_path, net)
    maps = 8 * 16 * 16 * 4 * doc["solver_batch"]  # bytes of one LRN output
    row = by_blob["norm1 scale"]
    assert row["action"] == "until-backward" and row["stored_bytes"] == row["dense_bytes"], row
    assert math.isclose(row["dense_bytes"], maps, rel_tol=1e-6), row
    for part in ("squares", "means", "scale"):
        row = by_blob[f"norm2 {part}"]
        assert row["action"] == "release" and row["stored_bytes"] == 0, row
        assert math.isclose(row["dense_bytes"], maps, rel_tol=1e-6), row


@WF_NEEDS_BUILD
def test_swishs_sigmoid_buffers_count_their_size(tmp_path):
    """Swish not in place computes its backward from its input (patch 0038): its sigmoid's input and output, each as
    large as its output, are freed after the forward, and the table gives them their size. In place it works from
    its sigmoid's input, stored lossy, and frees its sigmoid's output."""
    net = """name: "swish"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 10 dim: 3 dim: 16 dim: 16 } shape { dim: 10 }
    data_filler { type: "gaussian" std: 1 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "swish1" type: "Swish" bottom: "conv1" top: "swish1" }
layer { name: "swish2" type: "Swish" bottom: "swish1" top: "swish1" }
layer { name: "ip" type: "InnerProduct" bottom: "swish1" top: "ip"
  inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""
    doc, by_blob = _plan_of(tmp_path, net)
    maps = 8 * 16 * 16 * 4 * doc["solver_batch"]  # bytes of conv1's output
    for part in ("sigmoid_input", "sigmoid_output"):
        row = by_blob[f"swish1 {part}"]
        assert row["action"] == "release" and row["stored_bytes"] == 0, row
        assert math.isclose(row["dense_bytes"], maps, rel_tol=1e-6), row
    assert by_blob["conv1"]["action"] == "lossy" and by_blob["conv1"]["error_bound"] > 0  # Swish reads it
    row = by_blob["swish2 sigmoid_output"]
    assert row["action"] == "release" and row["stored_bytes"] == 0, row
    row = by_blob["swish2 sigmoid_input"]
    assert row["action"] == "lossy" and row["error_bound"] > 0 and 0 < row["stored_bytes"] < row["dense_bytes"], row
    assert math.isclose(row["dense_bytes"], maps, rel_tol=1e-6), row


def test_the_solvers_train_state_chooses_the_layers(wf_pb2):
    """Caffe builds the train net in phase TRAIN plus the net's `state` and the solver's `train_state`
    (level, stages): plan assumed level 0 and no stages, so a net whose layers pick a stage was measured
    with the wrong layers."""
    from google.protobuf import text_format

    from cometctl.caffeproto import train_net_only

    def dummy(name, n, rule):
        return (f'layer {{ name: "{name}" type: "DummyData" top: "data" top: "label" include {{ phase: TRAIN {rule} }} '
                f'dummy_data_param {{ shape {{ dim: {n} dim: 3 dim: 8 dim: 8 }} shape {{ dim: {n} }} }} }}\n')
    net = text_format.Parse(
        dummy("big", 8, 'stage: "big"') + dummy("small", 4, 'not_stage: "big"')
        + 'layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 2 } }\n'
        + 'layer { name: "extra" type: "Silence" bottom: "label" include { min_level: 1 } }\n'
        + 'layer { name: "test_only" type: "Silence" bottom: "ip" include { phase: TEST } }\n', wf_pb2.NetParameter())
    plain = wf_pb2.SolverParameter()
    staged = text_format.Parse('train_state { stage: "big" level: 1 }', wf_pb2.SolverParameter())
    for param, names, batch in ((plain, ["small", "ip"], 4), (staged, ["big", "ip", "extra"], 8)):
        kept = train_net_only(net, param, wf_pb2)
        assert [layer.name for layer in kept.layer] == names
        assert not any(layer.include or layer.exclude for layer in kept.layer)
        assert P.net_batch(kept, wf_pb2) == batch
    net.state.level = 1  # the net's own state counts too
    assert "extra" in [layer.name for layer in train_net_only(net, plain, wf_pb2).layer]


@WF_NEEDS_BUILD
def test_a_net_too_small_for_the_given_input_shape_names_it(tmp_path):
    """caffe's own line for a blob that shrank to nothing is 'Check failed: data_'; the error now says which
    --input-shape the run had, the likely cause."""
    solver = _solver_with_net(tmp_path, TINY_NET.read_text().replace("pad: 2", ""))
    r = _cometctl("plan", "--solver", str(solver), "--cpu", "--synthetic-input", "--input-shape", "data=3x4x4",
                  "--measure", "2,4", "--iters", "1", "--keep", str(tmp_path / "work"))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    err = r.stderr.strip().splitlines()[-1]
    assert "caffe train failed at batch 2" in err and "(with --input-shape data=3x4x4)" in err, err


@WF_NEEDS_BUILD
def test_bad_options_are_one_line(tmp_path):
    for args, says in ((["--memory", "lots"], "not a size"), (["--measure", "16"], "at least two"),
                       (["--verify"], "give --memory too"), (["--cpu", "--gpu", "0"], "contradict")):
        r = _cometctl("plan", "--solver", str(TINY_SOLVER), "--synthetic-input", *args)
        assert r.returncode != 0 and says in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
        assert "measuring" not in r.stdout + r.stderr, (args, r.stdout)  # no bar for a refused request


def test_plan_explains_itself():
    r = _cometctl("plan", "--help")
    assert r.returncode == 0
    for opt in ("--memory", "--batch", "--json", "--synthetic-input", "--gpu", "--cpu", "--measure", "--verify"):
        assert opt in r.stdout, opt


@WF_NEEDS_BUILD
def test_every_zoo_net_gets_its_inputs_at_any_batch(wf_pb2):
    """The nets of scripts/zoo_check (upstream's models and examples, ours): plan replaces their data
    layers by DummyData with the same tops at the batch asked for; where neither a source nor a crop size
    says the image shape, it asks for --input-shape, and with it the net builds."""
    sys.path.insert(0, str(REPO / "scripts"))
    import zoo_check
    from cometctl.caffeproto import read_text_proto

    asked = []
    for net in zoo_check.NETS:
        param = read_text_proto(zoo_check.source_path(net), wf_pb2.NetParameter())
        try:
            built = P.net_at_batch(param, wf_pb2, 3, synthetic=True)
        except CometError as e:
            assert "--input-shape" in str(e), (net.name, e)
            asked.append(net.name)
            shapes = {top: spec[1] for top, spec in net.tops.items() if spec[0] != "label"}
            built = P.net_at_batch(param, wf_pb2, 3, synthetic=True, shapes=shapes)
        made = {}
        for layer in built.layer:
            if layer.type == "DummyData":
                made.update({t: list(s.dim) for t, s in zip(layer.top, layer.dummy_data_param.shape)})
        own = {t for layer in param.layer if layer.type == "DummyData" for t in layer.top}
        assert set(made) == set(net.tops) | own, net.name
        assert all(made[t][0] == 3 for t in own), (net.name, made)  # a net's own DummyData at that batch too
        for top, spec in net.tops.items():
            want = [3] if spec[0] == "label" else [3, *spec[1]]
            if "resnet18_dogs" not in net.source:  # the zoo crops ResNet-18 to 112 to be quick; plan keeps 224
                assert made[top] == want, (net.name, top, made[top])
        assert not any(layer.type in P.SOURCE_PARAM for layer in built.layer), net.name
    # the nets without a crop size (CIFAR-10, MNIST) or an image (HDF5's features) are the ones that need the shape
    assert set(asked) == {"cifar10_quick", "cifar10_quick_prelu", "cifar10_quick_swish",
                          "cifar10_quick_swish_in_place", "cifar10_full",
                          "cifar10_sigmoid",
                          "cifar10_sigmoid_bn", "lenet",
                          "mnist_autoencoder", "siamese", "hdf5_nonlinear"}


FAKE_GPU_CAFFE = r'''
import re, sys
args = sys.argv[1:]
assert args[:2] == ["train", "-solver"] and args[3:] == ["-gpu", "0"], args
solver = open(args[2]).read()
assert "solver_mode: GPU" in solver and "device_id: 0" in solver, solver
stats = re.search(r'stats_file: "([^"]+)"', solver)[1]
net = open(re.search(r'net: "([^"]+)"', solver)[1]).read()
batch = int(re.search(r"dim: (\d+)", net)[1])
on = "compress_type" not in solver  # the observing store of COMET off names compress_type "None"
mb = 2**20
weights, blobs = 10 * mb, (3 if on else 7) * mb * batch
with open(stats, "w") as f:
    f.write("iter,layer,blob,kind,ratio,eb,ms,dense_bytes,stored_bytes,peak_bytes,weights_bytes,"
            "activations_bytes,gradients_bytes,compressed_bytes,scratch_bytes\n")
    f.write(f"0,total,,total,1,,,0,0,{2 * weights + blobs},{weights},{blobs},{weights},0,0\n")
print("I1201 10:00:00.000000 1 solver.cpp:1] Iteration 0, loss = 1")
'''


def test_the_gpu_path_fits_the_stores_device_bytes_and_says_unmeasured(tmp_path, wf_pb2, monkeypatch):
    """No GPU here: a stand-in caffe checks it is asked for GPU 0 and writes the store's figures; the plan
    fits them (weights, their gradients, the solver history and the blobs) and says they are unmeasured."""
    fake = tmp_path / "caffe"
    fake.write_text(f"#!{sys.executable}\n" + FAKE_GPU_CAFFE)
    fake.chmod(0o755)
    monkeypatch.setattr(P, "NVIDIA_SMI", str(tmp_path / "no-nvidia-smi"))  # none, as on a machine without
    plan = P.make_plan(TINY_SOLVER, gpu=0, synthetic=True, measure_batches=(4, 8), check=[(16, ("on",))],
                       memory="1GiB", caffe_bin=fake)
    mb = 2**20
    assert plan["device"] == "GPU 0" and plan["measured"] is False and "unmeasured" in plan["figure"]
    for mode, per in (("off", 7), ("on", 3)):
        f = plan["fit"][mode]["peak"]
        assert math.isclose(f["fixed"], 3 * 10 * mb) and math.isclose(f["per_sample"], per * mb), (mode, f)
    (check,) = plan["checks"]
    assert check["comet"] == "on" and math.isclose(check["measured_bytes"], 30 * mb + 3 * mb * 16)
    assert plan["budget"]["largest_batch_on"] == (1024 - 30) // 3
    text = "\n".join(P.render(plan))
    assert "GPU 0" in text and "unmeasured" in text and "runtime and untracked" not in text


@pytest.mark.parametrize("on_per_sample, widened", [(0.1, [64, 128, 256]), (0.0, [64, 128, 256, 512, 1024])])
def test_default_batches_widen_where_the_peak_grows_too_little(tmp_path, wf_pb2, monkeypatch, on_per_sample,
                                                              widened):
    """With the default batches (8, 16, 32) a mode whose peak grows less than WIDEN_GROWTH over them is
    measured at twice the largest batch, again and again, until it grows that much or reaches
    WIDEN_MAX_BATCH; the other mode is not. Batches the user names with --measure are never widened."""
    fake = tmp_path / "caffe"
    fake.write_text(f"#!{sys.executable}\n" + FAKE_GPU_CAFFE.replace(
        "(3 if on else 7) * mb * batch", f"int(({on_per_sample} if on else 7) * mb * batch)"))
    fake.chmod(0o755)
    monkeypatch.setattr(P, "NVIDIA_SMI", str(tmp_path / "no-nvidia-smi"))
    seen = []
    plan = P.make_plan(TINY_SOLVER, gpu=0, synthetic=True, caffe_bin=fake,
                       progress=lambda text, more=0: seen.append((text, more)))
    assert P.WIDEN_GROWTH == 16 * 2**20 and P.WIDEN_MAX_BATCH == 1024
    assert plan["measure_batches"] == [8, 16, 32] and plan["widened"] == {"off": [], "on": widened}
    runs = {(r["batch"], r["comet"]) for r in plan["runs"]}
    assert runs == {(b, m) for b in (8, 16, 32) for m in ("off", "on")} | {(b, "on") for b in widened}
    assert [t for t, more in seen if more] == [f"batch {b}, COMET on" for b in widened]  # the bar counts them
    f = plan["fit"]["on"]["peak"]
    assert math.isclose(f["fixed"], 30 * 2**20, rel_tol=1e-6)  # int() in the stand-in rounds each run
    assert math.isclose(f["per_sample"], on_per_sample * 2**20, abs_tol=1.0)
    text = "\n".join(P.render(plan))
    assert f"COMET on also at {', '.join(map(str, widened))}" in text and "COMET on: the peak grew only" in text
    # a widened batch that fails stops the widening and says why; the plan stands on the batches that ran
    broken = tmp_path / "caffe-broken"
    broken.write_text(fake.read_text().replace("mb = 2**20\n", "mb = 2**20\nif on and batch > 64:\n"
                                               "    print('F1201 out of device memory'); sys.exit(1)\n", 1))
    broken.chmod(0o755)
    plan = P.make_plan(TINY_SOLVER, gpu=0, synthetic=True, caffe_bin=broken)
    assert plan["widened"] == {"off": [], "on": [64]}
    assert any(n.startswith("COMET on: not measured beyond batch 64: caffe train failed at batch 128")
               for n in plan["notes"]), plan["notes"]
    # named batches stay as named
    plan = P.make_plan(TINY_SOLVER, gpu=0, synthetic=True, caffe_bin=fake, measure_batches=(8, 16, 32))
    assert plan["widened"] == {"off": [], "on": []} and len(plan["runs"]) == 6
    assert "also at" not in "\n".join(P.render(plan))


# nvidia-smi's stand-in: memory.used of GPU 0 is 1000 MiB plus what the stand-in caffe says it holds
# (FAKE_SMI_USED); one answer, or one every 50 ms with -lms until it is killed.
FAKE_NVIDIA_SMI = r'''
import os, sys, time
assert "--query-gpu=memory.used" in sys.argv and sys.argv[sys.argv.index("-i") + 1] == "0", sys.argv
def used():
    try:
        return 1000 + int(open(os.environ["FAKE_SMI_USED"]).read() or 0)
    except (OSError, ValueError):
        return 1000
while True:
    print(used(), flush=True)
    if "-lms" not in sys.argv:
        break
    time.sleep(0.05)
'''


def test_the_gpu_path_fits_nvidia_smis_peaks_when_there_is_one(tmp_path, wf_pb2, monkeypatch):
    """With nvidia-smi, a GPU plan fits the device's measured peak (memory in use above its value before
    the run, sampled while caffe runs) and says so; the store's tracked bytes are a part of it."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!{sys.executable}\n" + FAKE_NVIDIA_SMI)
    smi.chmod(0o755)
    used = tmp_path / "used"
    monkeypatch.setenv("FAKE_SMI_USED", str(used))
    monkeypatch.setattr(P, "NVIDIA_SMI", str(smi))
    # the stand-in caffe holds 500 + (7 or 3) x batch MiB on the device for 0.6 s, then frees it
    fake = tmp_path / "caffe"
    fake.write_text(f"#!{sys.executable}\n" + FAKE_GPU_CAFFE + f"""
import time
open({str(used)!r}, "w").write(str(500 + (3 if on else 7) * batch))
time.sleep(0.6)
open({str(used)!r}, "w").write("0")
""")
    fake.chmod(0o755)
    plan = P.make_plan(TINY_SOLVER, gpu=0, synthetic=True, measure_batches=(4, 8), check=[(16, ("on",))],
                       caffe_bin=fake)
    mb = 2**20
    assert plan["measured"] is True and "nvidia-smi" in plan["figure"], plan["figure"]
    for mode, per in (("off", 7), ("on", 3)):
        f = plan["fit"][mode]["peak"]
        assert math.isclose(f["fixed"], 500 * mb) and math.isclose(f["per_sample"], per * mb), (mode, f)
    (check,) = plan["checks"]
    assert math.isclose(check["measured_bytes"], (500 + 3 * 16) * mb) and abs(check["error"]) < 1e-9
    text = "\n".join(P.render(plan))
    assert "nvidia-smi" in text and "unmeasured" not in text

def test_caffe_children_get_openblas_thread_timeout_unless_the_user_set_one(tmp_path, monkeypatch):
    """Every caffe process cometctl starts (plan, train, the benchmarks: plan.run_caffe and train's
    own Popen use childenv.caffe_env) has OpenBLAS's idle threads sleep at once; a value in the
    user's environment wins."""
    fake = tmp_path / "caffe"
    fake.write_text(f"#!{sys.executable}\nimport os\nprint('timeout=' + os.environ.get('OPENBLAS_THREAD_TIMEOUT', 'unset'))\n")
    fake.chmod(0o755)
    solver = tmp_path / "solver.prototxt"
    solver.write_text('net: "x"\n')
    monkeypatch.delenv("OPENBLAS_THREAD_TIMEOUT", raising=False)
    P.run_caffe(fake, solver, tmp_path / "a.log")
    assert "timeout=4" in (tmp_path / "a.log").read_text()
    monkeypatch.setenv("OPENBLAS_THREAD_TIMEOUT", "12")
    P.run_caffe(fake, solver, tmp_path / "b.log")
    assert "timeout=12" in (tmp_path / "b.log").read_text()


def test_sigterm_while_caffe_runs_kills_it_and_exits_143(tmp_path):
    """`timeout` or a batch system ends a plan with SIGTERM: the caffe it started (in a session of its
    own) goes too, as on Ctrl-C, and the exit status says which signal (128 + 15)."""
    fake = tmp_path / "caffe"
    pidfile = tmp_path / "caffe.pid"
    fake.write_text(f"#!{sys.executable}\nimport os, time\nopen({str(pidfile)!r}, 'w').write(str(os.getpid()))\n"
                    "time.sleep(120)\n")
    fake.chmod(0o755)
    solver = tmp_path / "solver.prototxt"
    solver.write_text('net: "x"\n')
    code = ("import sys; from pathlib import Path; from cometctl import plan as P; "
            f"P.run_caffe(Path({str(fake)!r}), Path({str(solver)!r}), Path({str(tmp_path / 'a.log')!r}))")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=str(REPO))
    import contextlib
    import os
    import signal
    import time
    deadline = time.monotonic() + 60
    while not pidfile.exists() or not pidfile.read_text():
        assert time.monotonic() < deadline and proc.poll() is None, "the fake caffe never started"
        time.sleep(0.05)
    caffe_pid = int(pidfile.read_text())
    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 143
        with pytest.raises(ProcessLookupError):
            for _ in range(100):  # killed and reaped by its launcher's session kill
                os.kill(caffe_pid, 0)
                time.sleep(0.05)
    finally:  # a failure leaves no sleeping fake behind
        with contextlib.suppress(ProcessLookupError):
            os.killpg(os.getpgid(caffe_pid), signal.SIGKILL)
