"""The CUDA variant with cuDNN and NCCL (build/cuda-cudnn-nccl, made by `cometctl build --cuda` where
both are installed, as in CI): configured with both, linked against both, upstream's CuDNN gtests
built, and what can be checked without a GPU checked: a cuDNN layer instance gets its own row in the
COMET facts registry, and upstream's pycaffe NCCL test passes with the NCCL pycaffe. Skipped when
that build is absent."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "build" / "cuda-cudnn-nccl"
TESTBIN = BUILD / "cmake" / "test" / "test.testbin"

pytestmark = pytest.mark.skipif(
    not TESTBIN.exists(),
    reason="no cuDNN + NCCL build: `PATH=/usr/local/cuda/bin:$PATH .venv/bin/cometctl build --cuda --tests "
           "--cuda-arch 90` where cuDNN 9 and NCCL 2 are installed (scripts/test does)")


def _cache() -> dict[str, str]:
    out = {}
    for line in (BUILD / "cmake" / "CMakeCache.txt").read_text(errors="replace").splitlines():
        m = re.match(r"^([A-Za-z0-9_]+):[A-Z]+=(.*)$", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def test_configured_and_linked_with_cudnn_and_nccl():
    cache = _cache()
    assert cache["USE_CUDNN"] == "ON" and cache["USE_NCCL"] == "ON" and cache["CPU_ONLY"] == "OFF"
    log = (BUILD / "build.log").read_text(errors="replace")
    assert re.search(r"^-- COMET: CPU_ONLY OFF, USE_CUDNN ON \(cuDNN \d+\.\d+\.\d+, .*\), USE_NCCL ON \(", log, re.M)
    lib = next((BUILD / "cmake" / "lib").glob("libcaffe.so.*.*"))
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]",
                        subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True).stdout)
    assert "libcudnn.so.9" in needed and "libnccl.so.2" in needed, needed


def test_upstream_cudnn_gtests_and_our_cudnn_rows_are_built():
    p = subprocess.run([str(TESTBIN), "--gtest_list_tests"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    for suite in ("CuDNNConvolutionLayerTest/0.", "CuDNNConvolutionLayerTest/1.", "CuDNNPoolingLayerTest/0.",
                  "CuDNNNeuronLayerTest/0.", "CuDNNSoftmaxLayerTest/0.", "CuDNNLRNLayerTest/0."):
        assert suite in p.stdout, suite
    for test in ("EveryCuDNNRowHoldsOnTheGPU", "EveryRowHoldsOnTheGPU", "CuDNNClassesHaveRowsOfTheirOwn"):
        assert f"  {test}\n" in p.stdout, test


def test_a_cudnn_layer_gets_its_own_row_without_a_gpu():
    """Runs here although the binary is the CUDA one: the test constructs cuDNN layers and never sets
    them up (no device, no cuDNN handle)."""
    p = subprocess.run([str(TESTBIN), "--gtest_filter=CometFactsTest.CuDNNClassesHaveRowsOfTheirOwn"],
                       capture_output=True, text=True, timeout=120, cwd=BUILD / "src")
    assert p.returncode == 0 and "[  PASSED  ] 1 test." in p.stdout, p.stdout[-3000:] + p.stderr[-2000:]


def test_upstream_pycaffe_nccl_test_passes_with_the_nccl_pycaffe():
    """Upstream's python/caffe/test/test_nccl.py asserts only when caffe.has_nccl(): with this build's
    pycaffe it must be True, so the test checks a real NCCL unique id (bytes on Python 3)."""
    python = BUILD / "src" / "python"
    env = dict(os.environ, PYTHONPATH=str(python), GLOG_minloglevel="2")
    p = subprocess.run([sys.executable, "-c", "import caffe; print(caffe.has_nccl())"], capture_output=True,
                       text=True, env=env, timeout=120)
    assert p.returncode == 0 and p.stdout.strip().splitlines()[-1] == "True", p.stdout + p.stderr[-2000:]
    test = python / "caffe" / "test" / "test_nccl.py"
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test)],
                       capture_output=True, text=True, env=env, timeout=300, cwd=python)
    assert p.returncode == 0 and "1 passed" in p.stdout, p.stdout[-3000:] + p.stderr[-2000:]
