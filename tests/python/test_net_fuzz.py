"""Random nets (scripts/fuzz_nets.py): COMET off against a lossless store and two lossy ones (FIXED and
ADAPTIVE bounds) on topologies that nobody wrote by hand. The first CI_SEEDS seeds run here;
`scripts/fuzz_nets --seeds 0-399` runs more.
Each seed found what it found: out-of-place ELU's input held as a ReLU mask that ELU's backward read
(a fatal error on every such net), LRN's recomputed forward restoring a ReLU mask outside a step.
`fuzz_nets.gpu_bitwise` and the export's choice of nets are tested in test_gpu_zoo_check.py."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from cometctl import paths
from cometctl.errors import CometError

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import fuzz_nets  # noqa: E402

CI_SEEDS = 64

try:
    PYCAFFE = paths.pycaffe_dir()
except CometError as e:  # the test command always builds first; this only helps a bare `pytest`
    pytest.skip(f"fork not built: {e}", allow_module_level=True)


@pytest.mark.parametrize("seed", range(CI_SEEDS))
def test_a_random_net_trains_as_comet_off(tmp_path, seed):
    res = fuzz_nets.check(seed, PYCAFFE, tmp_path)
    assert res["verdict"] != "SKIP", f"seed {seed}: {res['problems']} (make the generator avoid it)"
    assert res["verdict"] == "PASS", f"seed {seed} (scripts/fuzz_nets --print {seed}):\n" + "\n".join(res["problems"])


def first_seed_with(text: str) -> int:
    return next(s for s in range(CI_SEEDS, CI_SEEDS + 1000) if text in fuzz_nets.net_text(s))


@pytest.mark.parametrize("text", ['type: "Filter"', "axis: 2 weight_filler"])
def test_a_random_net_with_a_rarer_layer_trains_as_comet_off(tmp_path, text):
    """What the CI seeds do not draw: the first seed after them whose net has it. A Filter's tops
    change their batch at the first forward, and its Reshape reads the selector's data; an
    InnerProduct along axis 2 has each sample's channels as its rows."""
    seed = first_seed_with(text)
    res = fuzz_nets.check(seed, PYCAFFE, tmp_path)
    assert res["verdict"] == "PASS", f"seed {seed} (scripts/fuzz_nets --print {seed}):\n" + "\n".join(res["problems"])


def test_the_seeds_cover_what_the_generator_claims():
    """The CI seeds together use every layer type and every switch the docstring names (but Filter
    and an InnerProduct along axis 2, each tested on a seed of its own above)."""
    texts = [fuzz_nets.net_text(s) for s in range(CI_SEEDS)]
    types = set()
    for t in texts:
        types |= set(re.findall(r'type: "([A-Za-z0-9]+)"', t))
    want = {"Convolution", "ReLU", "PReLU", "ELU", "TanH", "Sigmoid", "Swish", "Exp", "Dropout", "BatchNorm",
            "Scale", "AbsVal", "BNLL", "Power", "Clip", "MVN", "LRN", "Bias", "Pooling", "Eltwise", "Concat",
            "Slice", "Deconvolution", "InnerProduct", "SoftmaxWithLoss", "Softmax", "Log", "Tile", "Flatten",
            "Reshape", "SPP", "Im2col", "Split", "Silence", "Parameter", "LSTM", "RNN", "Embed", "BatchReindex",
            "ArgMax", "Threshold", "EuclideanLoss", "SigmoidCrossEntropyLoss", "HingeLoss", "ContrastiveLoss",
            "MultinomialLogisticLoss", "Reduction", "Accuracy", "Crop", "InfogainLoss"}
    assert want <= types, f"never generated in {CI_SEEDS} seeds: {sorted(want - types)}"
    joined = "\n".join(texts)
    for feature in ("WITHIN_CHANNEL", "lr_mult: 0", "propagate_down: false", "force_backward: true",
                    "global_pooling: true", "operation: PROD", "operation: MAX",
                    "operation: MEAN", "pool: MAX", "pool: AVE", "dilation: 2", "_mask", '_w" ',
                    "loss_weight: 0.001", "alpha: -0.5", "channel_shared: true", "bias_param { axis: 0 }",
                    "propagate_down: true propagate_down: false", 'type: "uniform" min: 0 max: 3.99',
                    "transpose: true", "kernel_size: 2 kernel_size: 3"):
        assert feature in joined, f"never generated in {CI_SEEDS} seeds: {feature}"
    assert any(re.search(r'bottom: "(\w+)" top: "\1"', t) for t in texts), "no layer in place"
    assert any(re.search(r'type: "Convolution" bottom: "\w+" bottom:', t) for t in texts), "no two-bottom conv"
    assert any(re.search(r'type: "Eltwise"( bottom: "\w+"){3}', t) for t in texts), "no three-bottom Eltwise"
    solvers = "".join(fuzz_nets.solver_extras(s) for s in range(CI_SEEDS))
    assert "iter_size: 2" in solvers and "test_interval" in solvers, solvers
    blocks = " ".join(fuzz_nets.settings(s)["exact"] for s in range(CI_SEEDS))
    for switch in ("async: false", "pool_codes: false", "layer_buffers: false", "recompute_lrn: true",
                   "keep_compressed: true", "memory_pool: false", "rebuild_from_batchnorm: false",
                   "decode_ahead", "memory_pool_headroom", "max_in_flight_mb"):
        assert switch in blocks, f"the exact runs of {CI_SEEDS} seeds never set {switch}"


@pytest.mark.parametrize("slot, block, reported", [
    ("exact", "eb_mode: FIXED error_bound: 0.01 tiled_gemm: false", "exact: gradients of"),
    ("adaptive", "eb_mode: ADAPTIVE error_bound: 0.5 min_error_bound: 0.5 update_interval: 1 tiled_gemm: false",
     "adaptive: gradient of"),
])
def test_the_comparison_catches_a_store_that_breaks_its_promise(tmp_path, monkeypatch, slot, block, reported):
    """The harness itself can fail: a lossy block in the place of the lossless one, and ADAPTIVE bounds
    held at 0.5 or more, are reported, each by its own run's checks alone."""
    real = fuzz_nets.settings
    monkeypatch.setattr(fuzz_nets, "settings", lambda seed: {**real(seed), slot: block})
    res = fuzz_nets.check(0, PYCAFFE, tmp_path)
    assert res["verdict"] == "FAIL"
    assert any(p.startswith(reported) for p in res["problems"]), res["problems"]
    assert all(p.startswith(slot + ":") for p in res["problems"]), res["problems"]


def test_fuzz_nets_explains_itself_and_refuses_bad_seeds():
    script = ROOT / "scripts" / "fuzz_nets.py"
    out = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, check=True).stdout
    assert "bit for bit" in out and "--seeds" in out and "--export DIR" in out, out
    p = subprocess.run([sys.executable, str(script), "--seeds", "1-x"], capture_output=True, text=True)
    assert p.returncode == 2 and "bad --seeds '1-x'" in p.stderr, p.stderr
    printed = subprocess.run([sys.executable, str(script), "--print", "3"], capture_output=True, text=True,
                             check=True).stdout
    assert printed.startswith(fuzz_nets.net_text(3)), printed
    assert "# exact: comet {" in printed and "# adaptive: comet { eb_mode: ADAPTIVE" in printed, printed
