"""scripts/bench_memory, grad_error, dump_activations and quickstart: their --help, the benchmark reading
the store's CSV, the activation dumps, and quickstart run twice."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_memory  # noqa: E402
from conftest import WF_BUILT  # noqa: E402

HEADER = ("iter,layer,blob,kind,ratio,eb,ms,dense_bytes,stored_bytes,peak_bytes,weights_bytes,"
          "activations_bytes,gradients_bytes,compressed_bytes,scratch_bytes,buffers_dense_bytes,"
          "buffers_stored_bytes\n")


def _total(it: int, ratio: float, buffers: str = ",249761383,15938355") -> str:
    return (f"{it},conv2,pool1,lossy,5.1,0.01,3.5,1605632,314830,,,,,,,,\n"
            f"{it},total,,total,{ratio},,,915406848,70045286,1202590843,229428838,455715226,"
            f"387762585,134427443,0{buffers}\n")


def test_bench_reads_the_stores_total_row_with_and_without_layer_buffers(tmp_path):
    (tmp_path / "net_on_comet.csv").write_text(HEADER + _total(1, 13.0686))
    fig = bench_memory.comet_figures(tmp_path, "net_on")
    assert fig == {"dense": 915406848, "stored": 70045286, "ratio": 13.0686, "tracked_peak": 1202590843,
                   "buffers_dense": 249761383, "buffers_stored": 15938355}
    # a file of an older fork (no buffer columns), and no file at all (COMET off)
    (tmp_path / "old_comet.csv").write_text(HEADER.replace(",buffers_dense_bytes,buffers_stored_bytes", "")
                                            + _total(1, 13.0686, buffers=""))
    old = bench_memory.comet_figures(tmp_path, "old")
    assert old["ratio"] == 13.0686 and "buffers_dense" not in old
    assert bench_memory.comet_figures(tmp_path, "net_off") == {}


def test_bench_uses_the_last_total_row(tmp_path):
    (tmp_path / "n_comet.csv").write_text(HEADER + _total(0, 7.2) + _total(1, 13.1))
    assert bench_memory.comet_figures(tmp_path, "n")["ratio"] == 13.1


@pytest.mark.skipif(not WF_BUILT, reason="the Caffe build is absent: run `cometctl build` first")
def test_bench_settings_replace_the_blocks_own_fields_and_unknown_ones_stop_it():
    """--also "error_bound: 0.01" used to add a second error_bound to the block, which caffe refused
    ("Non-repeated field ... specified multiple times") after the COMET-off run had taken its time."""
    from google.protobuf import text_format

    from cometctl.caffeproto import caffe_pb2

    pb2 = caffe_pb2()
    block = bench_memory.comet_block(pb2, text_format, ["error_bound: 0.01", "async: false"])
    solver = pb2.SolverParameter()
    text_format.Parse(block, solver)  # strict, as caffe reads it: each field once
    assert solver.comet.error_bound == pytest.approx(0.01)
    assert getattr(solver.comet, "async") is False
    assert solver.comet.adaptive_target == pytest.approx(0.05)  # the block's own, kept
    assert solver.comet.eb_mode == pb2.CometParameter.ADAPTIVE
    with pytest.raises(SystemExit, match="'no_such_field: 1' is not a comet"):
        bench_memory.comet_block(pb2, text_format, ["no_such_field: 1"])


def test_scripts_explain_themselves():
    for script in ("bench_memory.py", "grad_error.py"):
        out = subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--help"],
                             capture_output=True, text=True, check=True).stdout
        assert "COMET off" in out and "--batch" in out, script
        if script == "bench_memory.py":  # the block the COMET runs start from, as the code has it
            assert f"comet {{ {bench_memory.COMET_SETTINGS} }}" in out


def test_error_correlation_explains_itself():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "error_correlation.py"), "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "kappa" in out and "--blob NAME=EB" in out


def test_bench_reads_the_codec_time_and_the_steps_wait(tmp_path):
    """A total row with the time columns: the codecs' ms per iteration and the part waited for."""
    header = HEADER.rstrip("\n") + ",encode_ms,decode_ms,wait_ms\n"
    rows = _total(3, 15.2).splitlines()
    rows = [rows[0] + ",,,,12.5,9.25,1.5", rows[1] + ",158.4,152.7,69.5"]
    (tmp_path / "a_comet.csv").write_text(header + "\n".join(rows) + "\n")
    fig = bench_memory.comet_figures(tmp_path, "a")
    assert fig["encode_ms"] == 158.4 and fig["decode_ms"] == 152.7 and fig["wait_ms"] == 69.5
    assert abs(fig["work_ms"] - 311.1) < 1e-9
    # older files have no time columns: no time figures, rather than zeros
    (tmp_path / "b_comet.csv").write_text(HEADER + _total(3, 15.2))
    assert "wait_ms" not in bench_memory.comet_figures(tmp_path, "b")


@pytest.mark.skipif(not WF_BUILT, reason="the Caffe build is absent: run `cometctl build` first")
def test_dump_activations_writes_the_inputs_comet_stores_from_real_photos(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "dump_activations.py"),
                          "--model", "caffenet", "--batch", "2", "--out", str(tmp_path)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    import numpy as np
    files = {p.name: np.load(p) for p in tmp_path.glob("*.npy")}
    # the inputs of CaffeNet's Convolution, LRN and InnerProduct layers, never the data itself
    assert set(files) == {f"caffenet_{b}.npy" for b in
                          ("pool1", "norm1", "pool2", "norm2", "conv3", "conv4", "pool5", "fc6", "fc7")}
    assert files["caffenet_pool1.npy"].shape == (2, 96, 27, 27)
    assert files["caffenet_fc7.npy"].shape == (2, 4096, 1, 1)
    pool1 = files["caffenet_pool1.npy"]
    assert pool1.dtype == np.float32 and pool1.min() >= 0 and pool1.max() > 0  # after ReLU, not zeros
    assert not np.array_equal(pool1[0], pool1[1])  # two different photos


@pytest.mark.skipif(not (ROOT / "build" / "cpu" / "cmake" / "lib" / "libcaffe.so").exists(),
                    reason="scripts/bench_loops needs the CPU build (CI always builds it first)")
def test_bench_loops_times_every_loop_and_checks_its_results():
    # A small blob (2x8x16x40: not a multiple of 32 per plane), one run of each loop. The program
    # exits 1 when a loop's result is wrong (the fill against upstream's products, the rebuild
    # against the bound).
    run = subprocess.run([str(ROOT / "scripts" / "bench_loops"), "2", "8", "16", "40", "1"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    rows = [line for line in run.stdout.splitlines() if line.startswith("| worker") or line.startswith("| step")]
    assert len(rows) == 14, run.stdout
    for row in rows:
        ms = float(row.split("|")[3])
        assert ms >= 0, row
    assert "blob 2x8x16x40" in run.stdout


@pytest.mark.skipif(not (ROOT / "build" / "cpu" / "cmake" / "lib" / "libcaffe.so").exists(),
                    reason="scripts/bench_weight_rule needs the CPU build (CI always builds it first)")
def test_bench_weight_rule_times_each_layer_and_samples_grouped_layers_over_groups():
    # Batch 4, one run: the program exits 1 when a ladder error is not positive and finite, or falls by half.
    run = subprocess.run([str(ROOT / "scripts" / "bench_weight_rule"), "4", "1"], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    rows = {r.split("|")[1].strip(): r.split("|") for r in run.stdout.splitlines() if r.startswith("| ") and "---" not in r}
    rows.pop("layer input")
    assert len(rows) == 9, run.stdout
    for name, row in rows.items():
        channels, images = (int(v) for v in row[4].split("x"))
        assert float(row[6]) >= 0 and 1 <= images <= 4, row
        if name.startswith("depthwise"):
            assert channels >= 8, row  # one channel per group in at least 8 groups, not the middle one alone


FAKE_COMETCTL = """#!/usr/bin/env bash
# stands in for cometctl: train refuses a run folder that holds a run, as the real one does
echo "cometctl $*" >> calls.log
if [ "$1" = train ]; then
  while [ $# -gt 0 ]; do [ "$1" = --run-dir ] && dir="$2"; shift; done
  [ -e "$dir/caffe.log" ] && { echo "cometctl: error: $dir already holds a run" >&2; exit 1; }
  mkdir -p "$dir" && echo "trained" > "$dir/caffe.log"
fi
"""


def test_quickstart_runs_again_and_keeps_the_earlier_run(tmp_path):
    """The README's first command, run a second time, stopped at `train` ('runs/quickstart already holds a
    run'); the earlier run is now kept under runs/quickstart-<time of its log>. The script's own logic, with
    stand-ins for bootstrap and cometctl."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "quickstart").write_text((ROOT / "scripts" / "quickstart").read_text())
    (tmp_path / "scripts" / "bootstrap").write_text("true\n")
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    fake = tmp_path / ".venv" / "bin" / "cometctl"
    fake.write_text(FAKE_COMETCTL)
    fake.chmod(0o755)
    for _ in range(2):
        r = subprocess.run(["bash", str(tmp_path / "scripts" / "quickstart")], cwd=tmp_path, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
    kept = [p.name for p in (tmp_path / "runs").iterdir() if p.name != "quickstart"]
    assert len(kept) == 1 and kept[0].startswith("quickstart-"), kept
    assert "earlier quickstart run is now in runs/" + kept[0] in r.stdout
    assert (tmp_path / "runs" / "quickstart" / "caffe.log").exists()
    assert (tmp_path / "calls.log").read_text().count("cometctl train") == 2


@pytest.mark.skipif(not WF_BUILT, reason="the Caffe build is absent: run `cometctl build` first")
def test_bench_freeze_before_and_bn_global_stats_change_what_they_say():
    """--freeze-before: the fine-tuning case, where the store frees the frozen layers' buffers too. A
    BatchNorm without ParamSpecs learns in Caffe's Net (lr_mult 1 assumed), so it gets all three."""
    from google.protobuf import text_format

    from cometctl import caffeproto
    from cometctl.caffeproto import caffe_pb2

    pb2 = caffe_pb2()
    model = ROOT / "models" / "resnet18_dogs" / "train_val.prototxt"
    net = pb2.NetParameter()
    text_format.Merge(bench_memory.make_net(pb2, text_format, 2, None, model, "res4a_branch2a"), net)
    names = [layer.name for layer in net.layer]
    cut = names.index("res4a_branch2a")
    learnable = 0
    for i, layer in enumerate(net.layer):
        n = caffeproto.learnable_blobs(layer)
        learnable += n > 0
        if i < cut:
            assert len(layer.param) >= n and all(p.lr_mult == 0 for p in layer.param[:n]), layer.name
        else:
            assert not layer.param or any(p.lr_mult > 0 for p in layer.param), layer.name
    assert [caffeproto.learnable_blobs(net.layer[names.index(n)]) for n in ("conv1", "bn_conv1", "scale_conv1")] \
        == [1, 3, 2]  # conv1 without bias, BatchNorm, Scale with bias
    assert learnable > 40
    with pytest.raises(SystemExit, match="no layer res9 in the net"):
        bench_memory.make_net(pb2, text_format, 2, None, model, "res9")
    # --bn-global-stats: every BatchNorm with its statistics frozen, nothing else changed
    plain, frozen_stats = pb2.NetParameter(), pb2.NetParameter()
    text_format.Merge(bench_memory.make_net(pb2, text_format, 2, None, model), plain)
    text_format.Merge(bench_memory.make_net(pb2, text_format, 2, None, model, bn_global_stats=True), frozen_stats)
    bns = [layer for layer in frozen_stats.layer if layer.type == "BatchNorm"]
    assert len(bns) == 20 and all(layer.batch_norm_param.use_global_stats for layer in bns)
    for layer in frozen_stats.layer:
        layer.ClearField("batch_norm_param")
    for layer in plain.layer:
        layer.ClearField("batch_norm_param")
    assert frozen_stats == plain


@pytest.mark.skipif(not WF_BUILT, reason="the Caffe build is absent: run `cometctl build` first")
def test_bench_neuron_models_replace_the_quick_nets_relus():
    """cifar10_prelu makes CIFAR-10 quick's in-place ReLUs PReLUs in place and cifar10_swish_in_place Swish in
    place; cifar10_swish makes them Swish out of place, and the layers after each read its output."""
    from google.protobuf import text_format

    from cometctl.caffeproto import caffe_pb2

    pb2 = caffe_pb2()
    nets = {}
    for model in ("cifar10_prelu", "cifar10_swish", "cifar10_swish_in_place"):
        net = pb2.NetParameter()
        text_format.Merge(bench_memory.make_net(pb2, text_format, 2, None, bench_memory.model_file(model, "cpu"),
                                                crop=32, neuron=bench_memory.NEURON[model],
                                                out_of_place=model in bench_memory.OUT_OF_PLACE), net)
        nets[model] = {layer.name: layer for layer in net.layer}
    relus = [n for n, layer in nets["cifar10_prelu"].items() if layer.type == "PReLU"]
    assert relus == ["relu1", "relu2", "relu3"]
    for name in relus:
        prelu, swish = nets["cifar10_prelu"][name], nets["cifar10_swish"][name]
        in_place = nets["cifar10_swish_in_place"][name]
        assert list(prelu.top) == list(prelu.bottom)  # in place, as the ReLU was
        assert in_place.type == "Swish" and list(in_place.top) == list(in_place.bottom) == list(prelu.bottom)
        assert swish.type == "Swish" and list(swish.top) == [name] and list(swish.bottom) == list(prelu.bottom)
        readers = [layer for layer in nets["cifar10_swish"].values() if name in layer.bottom]
        assert readers and all(prelu.bottom[0] not in layer.bottom for layer in readers)
    # nothing reads a ReLU's old in-place blob after the Swish that replaced it
    order = list(nets["cifar10_swish"])
    for name in relus:
        old = nets["cifar10_prelu"][name].bottom[0]
        later = order[order.index(name) + 1:]
        assert all(old not in nets["cifar10_swish"][n].bottom for n in later), (name, old)


@pytest.mark.skipif(not WF_BUILT, reason="the Caffe build is absent: run `cometctl build` first")
def test_bench_resnet_se_gates_every_residual_branch():
    """resnet_se: each of ResNet-18's eight residual branches (`*_branch2b`) goes through SENet's gate (global
    average, InnerProduct to C/16, ReLU, InnerProduct to C, Sigmoid) and a Scale by it (axis 0) before its Eltwise;
    the shortcuts are untouched."""
    from google.protobuf import text_format

    from cometctl.caffeproto import caffe_pb2

    pb2 = caffe_pb2()
    model = bench_memory.model_file("resnet_se", "cpu")
    se, plain = pb2.NetParameter(), pb2.NetParameter()
    text_format.Merge(bench_memory.make_net(pb2, text_format, 2, None, model, squeeze_excitation=True), se)
    text_format.Merge(bench_memory.make_net(pb2, text_format, 2, None, model), plain)
    layers = {layer.name: layer for layer in se.layer}
    convs = {layer.top[0]: layer.convolution_param.num_output for layer in se.layer if layer.type == "Convolution"}
    eltwise = [layer for layer in se.layer if layer.type == "Eltwise"]
    assert len(eltwise) == 8
    for layer in eltwise:
        plain_bottoms = list(next(p for p in plain.layer if p.name == layer.name).bottom)
        branch = next(b for b in plain_bottoms if b.endswith("_branch2b"))
        scale = layers[branch[:-len("_branch2b")] + "_se"]
        assert list(layer.bottom) == [scale.name if b == branch else b for b in plain_bottoms]
        assert scale.type == "Scale" and scale.scale_param.axis == 0 and scale.bottom[0] == branch
        gate = scale.bottom[1]
        down, up = layers[scale.name + "_down"], layers[scale.name + "_up"]
        assert up.top[0] == gate and layers[scale.name + "_gate"].type == "Sigmoid"
        assert (down.inner_product_param.num_output, up.inner_product_param.num_output) == \
            (convs[branch] // 16, convs[branch])
        squeeze = layers[scale.name + "_squeeze"]
        assert squeeze.pooling_param.global_pooling and list(squeeze.bottom) == [branch]
    assert len(se.layer) == len(plain.layer) + 8 * 6
