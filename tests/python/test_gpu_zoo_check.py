"""scripts/gpu_zoo_check.py, the zoo check through `caffe train` alone (gpu-check's gpu-zoo step), run here
with the CPU build on nets that `scripts/zoo_check.py --export` writes: correct runs pass, a destroyed
store fails, and its caffemodel reader agrees with protobuf's."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import WF_NEEDS_BUILD, WF_REPO as REPO

sys.path.insert(0, str(REPO / "scripts"))
import gpu_zoo_check  # noqa: E402

pytestmark = WF_NEEDS_BUILD
NETS = "lenet,siamese,cifar10_sigmoid_bn,mnist_autoencoder,cifar10_quick_prelu"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("zoo")
    p = subprocess.run([sys.executable, str(REPO / "scripts" / "zoo_check.py"), "--export", str(out),
                        "--nets", NETS + ",pycaffe_linreg"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "leaves out pycaffe_linreg" in p.stderr
    rows = [line.split("\t") for line in (out / "nets.tsv").read_text().splitlines() if not line.startswith("#")]
    assert [r[0] for r in rows] == NETS.split(","), rows
    return out


def _check(exported, tmp_path, *extra, caffe=None):
    from cometctl.paths import tool_path

    env = {k: v for k, v in os.environ.items() if not k.startswith("GLOG_")}  # the script sets what it needs
    return subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_zoo_check.py"),
                           "--caffe", str(caffe or tool_path("caffe")),
                           "--cpu", "--nets-dir", str(exported), "--work", str(tmp_path / "work"), *extra],
                          capture_output=True, text=True, timeout=600, env=env)


def test_correct_runs_pass_every_check(exported, tmp_path):
    p = _check(exported, tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    for name in NETS.split(","):
        assert re.search(rf"gpu-zoo: {name}: PASS in [0-9.]+ s: stored .* \(\d+\.\dx\), step 1", p.stdout), p.stdout
    assert "gpu-zoo: 5 of 5 nets PASS" in p.stdout, p.stdout
    # the PReLU net's COMET run starts at its own bound, as zoo_check's does (nets.tsv's third column)
    on = (tmp_path / "work" / "cifar10_quick_prelu" / "solver_on.prototxt").read_text()
    assert re.search(r"[^_]error_bound: 0.0001[ }]", on) and "max_error_bound" not in on, on
    # the snapshots go once a net is checked; the logs stay for reading
    assert not list((tmp_path / "work").rglob("*.caffemodel"))
    assert (tmp_path / "work" / "lenet" / "on.log").exists()


def test_a_destroyed_store_fails_the_weight_checks(exported, tmp_path):
    p = _check(exported, tmp_path, "--nets", "lenet,siamese", "--comet", "eb_mode: FIXED error_bound: 1e3")
    assert p.returncode == 1, p.stdout + p.stderr[-3000:]
    for name in ("lenet", "siamese"):
        line = next(l for l in p.stdout.splitlines() if l.startswith(f"gpu-zoo: {name}:"))
        assert ": FAIL " in line and "grad: step 1 weight change error" in line and "steps: step 5" in line, line
    assert "FAIL: lenet, siamese" in p.stdout


def test_a_run_that_fails_names_it(exported, tmp_path):
    bad = tmp_path / "caffe"
    bad.write_text("#!/bin/sh\necho 'F1205 10:00:00.000000 1 store.cpp:1] Check failed: something'\nexit 134\n")
    bad.chmod(0o755)
    p = _check(exported, tmp_path, "--nets", "lenet", caffe=bad)
    assert p.returncode == 1
    assert "gpu-zoo: lenet: FAIL" in p.stdout and "ran: w0: exit status 134: F1205" in p.stdout, p.stdout
    assert _check(exported, tmp_path, "--nets", "nosuchnet").returncode == 2


def test_the_caffemodel_reader_agrees_with_protobuf(exported, tmp_path, wf_pb2):
    """read_weights (a wire-format reader, for a GPU machine without a protobuf runtime) against
    caffe_pb2's own parse of a snapshot the CPU build wrote."""
    from cometctl.paths import tool_path

    d = tmp_path / "siamese"
    d.mkdir()
    s = d / "solver.prototxt"
    s.write_text(gpu_zoo_check.solver_text(exported / "siamese.prototxt", d / "w", "0.01", 0, "cpu", None))
    assert gpu_zoo_check.run_caffe(str(tool_path("caffe")), s, "cpu", d / "w.log", 120) == ""
    model = d / "w_iter_0.caffemodel"
    ours = gpu_zoo_check.read_weights(model)
    net = wf_pb2.NetParameter()
    net.ParseFromString(model.read_bytes())
    theirs = {layer.name: [np.array(b.data, dtype=np.float32) for b in layer.blobs] for layer in net.layer if layer.blobs}
    assert ours.keys() == theirs.keys() and len(ours) >= 4, (sorted(ours), sorted(theirs))
    for name, blobs in theirs.items():
        assert len(ours[name]) == len(blobs)
        for a, b in zip(ours[name], blobs):
            assert np.array_equal(np.asarray(a, dtype=np.float32), b), name
    # shared weights (the Siamese twins' _p layers) are stored under each layer's own name
    assert any(n.endswith("_p") for n in ours)


def test_a_start_bound_replaces_the_error_bound_only():
    c = "eb_mode: ADAPTIVE error_bound: 1e-3 max_error_bound: 1 min_error_bound: 1e-5"
    assert gpu_zoo_check.with_start_bound(c, "-") == c
    assert gpu_zoo_check.with_start_bound(c, "0.0001") == \
        "eb_mode: ADAPTIVE error_bound: 0.0001 max_error_bound: 1 min_error_bound: 1e-5"
    assert gpu_zoo_check.with_start_bound("eb_mode: ADAPTIVE", "0.0001") == "eb_mode: ADAPTIVE error_bound: 0.0001"


def test_iteration_0_is_read_from_the_display_lines(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("I1205 solver.cpp:218] Iteration 0 (0 iter/s, 0.01s/1 iters), loss = 2.30259\n"
                   "I1205 solver.cpp:237]     Train net output #0: loss = 2.30259 (* 1 = 2.30259 loss)\n"
                   "I1205 sgd_solver.cpp:105] Iteration 0, lr = 0.01\n"
                   "I1205 solver.cpp:218] Iteration 1 (90 iter/s, 0.01s/1 iters), loss = nan\n"
                   "I1205 solver.cpp:237]     Train net output #0: loss = nan (* 1 = nan loss)\n"
                   "I1205 solver.cpp:447] Iteration 2, loss = 1.9\n")
    losses, first = gpu_zoo_check.displayed(log)
    assert losses == [(0, "2.30259"), (1, "nan"), (2, "1.9")]
    assert first == ["loss = 2.30259 (* 1 = 2.30259 loss)"]
    assert not gpu_zoo_check._finite("nan") and gpu_zoo_check._finite("2.3")


def test_the_error_is_the_same_without_numpy(monkeypatch):
    """The GPU machine's Python may lack numpy: the pure-Python sums give the same figure."""
    import array

    w0 = [array.array("f", [0.0, 1.0, 2.0]), array.array("d", [1.0])]
    off = [array.array("f", [0.5, 1.5, 2.0]), array.array("d", [2.0])]
    on = [array.array("f", [0.5, 1.25, 2.0]), array.array("d", [2.5])]
    want = ((0.25 ** 2 + 0.5 ** 2) / (0.5 ** 2 + 0.5 ** 2 + 1.0)) ** 0.5
    assert gpu_zoo_check._relative_error(w0, off, on) == pytest.approx(want, rel=1e-12)
    monkeypatch.setitem(sys.modules, "numpy", None)  # `import numpy` raises ImportError
    assert gpu_zoo_check._relative_error(w0, off, on) == pytest.approx(want, rel=1e-12)
    assert gpu_zoo_check._relative_error(w0, w0, w0) == 0.0
    assert gpu_zoo_check._relative_error(w0, w0, on) == float("inf")


def test_iteration_0_within_a_tolerance_for_the_cudnn_build():
    same = gpu_zoo_check._same_iteration_0
    off = ([(0, "2.30259")], ["loss = 2.30259 (* 1 = 2.30259 loss)"])
    close = ([(0, "2.3026")], ["loss = 2.3026 (* 1 = 2.3026 loss)"])
    far = ([(0, "2.31")], ["loss = 2.31 (* 1 = 2.31 loss)"])
    assert same(*off, *off, 0) and not same(*off, *close, 0)
    assert same(*off, *close, 1e-4) and not same(*off, *far, 1e-4)
    assert not same(*off, [(0, "nan")], ["loss = nan (* 1 = nan loss)"], 1e-4)


def test_a_store_that_stores_nothing_fails(exported, tmp_path):
    """With the store off, the weights agree exactly: the check must still fail, on what was stored."""
    p = _check(exported, tmp_path, "--nets", "lenet", "--comet", "enabled: false")
    assert p.returncode == 1, p.stdout
    assert "stored: no 'COMET total' line in COMET on's log" in p.stdout, p.stdout
    assert "step 1 error at most 0.00e+00" in p.stdout, p.stdout


def test_solver_text_adds_tiled_gemm_off_on_the_cpu_only_when_comet_does_not_set_it(tmp_path):
    def comet_line(device, comet):
        text = gpu_zoo_check.solver_text(tmp_path / "n.prototxt", tmp_path / "p", "0.01", 5, device, comet)
        return [line for line in text.splitlines() if line.startswith("comet {")]

    assert comet_line("cpu", "eb_mode: FIXED") == ["comet { eb_mode: FIXED tiled_gemm: false }"]
    assert comet_line("gpu", "eb_mode: FIXED") == ["comet { eb_mode: FIXED }"]
    # a field twice is a parse error in caffe: --comet's own setting is the only one
    assert comet_line("cpu", "tiled_gemm: true") == ["comet { tiled_gemm: true }"]
    assert comet_line("cpu", None) == []


def test_the_export_leaves_out_the_nets_a_gpu_does_not_compute_the_same_way_twice(tmp_path):
    """gpu-fuzz compares two GPU runs bit for bit: nets with an Embed (its Backward_gpu adds with
    atomics) or LRN within a channel under layer_buffers (exact to rounding only) are not exported."""
    sys.path.insert(0, str(REPO / "scripts"))
    import fuzz_nets

    p = subprocess.run([sys.executable, str(REPO / "scripts" / "fuzz_nets.py"), "--export", str(tmp_path),
                        "--seeds", "0-59"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    exported = {line.split("\t")[0] for line in (tmp_path / "nets.tsv").read_text().splitlines()
                if not line.startswith("#")}
    embed = {f"fuzz{s}" for s in range(60) if 'type: "Embed"' in fuzz_nets.net_text(s)}
    within = {f"fuzz{s}" for s in range(60)
              if fuzz_nets.exact_to_rounding(fuzz_nets.net_text(s), fuzz_nets.settings(s)["exact"])}
    assert embed and within, (embed, within)  # both kinds occur in these seeds
    assert not exported & (embed | within), exported & (embed | within)
    assert exported == {f"fuzz{s}" for s in range(60)} - embed - within
    assert all('type: "Embed"' not in (tmp_path / f"{n}.prototxt").read_text() for n in exported)


def test_exact_random_nets_match_bit_for_bit_and_a_lossy_store_does_not(tmp_path):
    """gpu-fuzz's check: the random nets of `scripts/fuzz_nets.py --export` with their own lossless
    blocks give COMET off's weights at every step; the same nets under a lossy block (--no-own) fail."""
    nets = tmp_path / "fuzz"
    p = subprocess.run([sys.executable, str(REPO / "scripts" / "fuzz_nets.py"), "--export", str(nets),
                        "--seeds", "0-5"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    rows = [line.split("\t") for line in (nets / "nets.tsv").read_text().splitlines() if not line.startswith("#")]
    assert len(rows) >= 4 and all(len(r) == 4 and 'compress_type: "None"' in r[3] for r in rows), rows
    p = _check(nets, tmp_path, "--exact", "--steps", "3")
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    assert f"gpu-zoo: {len(rows)} of {len(rows)} nets PASS" in p.stdout, p.stdout
    assert re.search(r"gpu-zoo: fuzz0: PASS .* \d+ weights over 3 steps the same bit for bit", p.stdout), p.stdout
    on = (tmp_path / "work" / rows[0][0] / "solver_on.prototxt").read_text()
    assert rows[0][3] in on, on  # the net's own block
    p = _check(nets, tmp_path, "--exact", "--steps", "3", "--no-own", "--comet", "eb_mode: FIXED error_bound: 0.01")
    assert p.returncode == 1, p.stdout + p.stderr[-3000:]
    assert re.search(r"gpu-zoo: fuzz0: FAIL .*exact: step 1: the weights of .* differ from COMET off's", p.stdout), p.stdout
