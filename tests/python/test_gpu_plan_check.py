"""gpu-check's plan-cometctl step without a GPU: the bundle's python/ folder (scripts/gpu-bundle's
stage_python: cometctl, the build's caffe_pb2, protobuf's pure-Python runtime, plan_check.py) runs
cometctl's planner under a Python that sees nothing else (`python3 -S`, no site-packages), against
stand-ins for caffe and nvidia-smi; it passes when the stand-in's memory is linear in the batch and
fails, naming the miss, when it is not."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_plan import FAKE_GPU_CAFFE, FAKE_NVIDIA_SMI, TINY_SOLVER

ROOT = Path(__file__).resolve().parents[2]
PB2_DIR = ROOT / "build" / "cpu" / "cmake" / "include" / "caffe" / "proto"
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")

pytestmark = [
    pytest.mark.skipif(not (PB2_DIR / "caffe_pb2.py").exists(), reason="the Caffe build is absent: run `cometctl build`"),
    pytest.mark.skipif(SYSTEM_PYTHON is None, reason="no /usr/bin/python3"),
]


def gpu_bundle_module():
    loader = importlib.machinery.SourceFileLoader("gpu_bundle", str(ROOT / "scripts" / "gpu-bundle"))
    spec = importlib.util.spec_from_loader("gpu_bundle", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def staged(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("bundle") / "python"
    said = gpu_bundle_module().stage_python(dest, PB2_DIR)
    assert said.startswith("yes (protobuf "), said
    assert not list(dest.rglob("*.so")), "the C extension is for this machine's Python only"
    return dest


def run_check(staged: Path, tmp_path: Path, per_sample: str, fail: str = "") -> subprocess.CompletedProcess:
    """plan_check.py with a stand-in caffe that holds 500 + per_sample(batch) MiB while it runs (or, with
    `fail`, prints that line and exits 1)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!{sys.executable}\n" + FAKE_NVIDIA_SMI)
    smi.chmod(0o755)
    used = tmp_path / "used"
    caffe = tmp_path / "caffe"
    caffe.write_text(f"#!{sys.executable}\n" + FAKE_GPU_CAFFE + f"""
import time
if {fail!r}:
    print({fail!r}, file=sys.stderr)
    sys.exit(1)
per = {per_sample}
open({str(used)!r}, "w").write(str(int(500 + per(batch))))
time.sleep(0.6)
open({str(used)!r}, "w").write("0")
""")
    caffe.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "FAKE_SMI_USED": str(used),
           "PYTHONPATH": str(staged), "COMET_CAFFE_PB2": str(staged),
           "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"}
    solver = tmp_path / "solver.prototxt"  # as gpu-check writes it: the net by its absolute path
    solver.write_text(TINY_SOLVER.read_text().replace('net: "models/', f'net: "{ROOT}/models/'))
    return subprocess.run([SYSTEM_PYTHON, "-S", str(staged / "plan_check.py"), "--solver", str(solver),
                           "--caffe", str(caffe), "--gpu", "0", "--measure", "4,8", "--batch", "32",
                           "--synthetic-input"], env=env, capture_output=True, text=True, timeout=300)


def test_the_bundles_planner_runs_on_a_bare_python_and_checks_its_prediction(staged, tmp_path):
    proc = run_check(staged, tmp_path, "lambda b: (3 if on else 7) * b")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for mode, mib in (("off", 500 + 7 * 32), ("on", 500 + 3 * 32)):
        assert f"plan-cometctl: COMET {mode} at batch 32: predicted {mib} MiB, measured {mib} MiB (+0.0%)" in out, out
    assert "nvidia-smi" in out  # render()'s figure line: the peaks were measured


def test_a_prediction_that_misses_by_more_than_five_percent_fails(staged, tmp_path):
    # memory that grows faster than linearly: fitted at 4 and 8, batch 32 comes out far below
    proc = run_check(staged, tmp_path, "lambda b: b * b")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "OUT OF TOLERANCE" in out and "plan-cometctl: COMET on at batch 32" in out, out


def test_without_cometctls_package_it_says_so(tmp_path):
    bare = tmp_path / "python"
    bare.mkdir()
    shutil.copy2(ROOT / "scripts" / "gpu_plan_check.py", bare / "plan_check.py")
    proc = subprocess.run([SYSTEM_PYTHON, "-S", str(bare / "plan_check.py"), "--solver", "s", "--caffe", "c",
                           "--batch", "8"], env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(bare)},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "plan-cometctl: error: cannot import cometctl's planner" in proc.stdout, \
        proc.stdout + proc.stderr


def test_a_caffe_that_fails_is_named_by_its_own_line_on_a_bare_python(staged, tmp_path):
    """The planner names caffe's own fatal line when a run fails; on the GPU machine's bare Python it
    used to fail importing `rich` (through cometctl.train) and name that instead."""
    line = "F1206 20:23:21.726027  1240 syncedmem.cpp:71] Check failed: error == cudaSuccess (2 vs. 0)  out of memory"
    proc = run_check(staged, tmp_path, "lambda b: b", fail=line)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Check failed: error == cudaSuccess (2 vs. 0)  out of memory" in out, out
    assert "rich" not in out and "ModuleNotFoundError" not in out, out
