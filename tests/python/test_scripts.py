"""scripts/bench_memory and scripts/grad_error: their --help, and the benchmark reading the store's lines."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_memory  # noqa: E402

TOTAL = ("I20261130 08:21:43.437604 14226 store.cpp:796] COMET total: activations 873.0 MB -> 66.8 MB "
         "(13.1x){buffers}, peak memory 1.12 GB (weights 218.8 MB, activations 434.6 MB, gradients 369.8 MB, "
         "compressed 128.2 MB, scratch 0.0 KB)")


def test_bench_reads_the_total_line_with_and_without_layer_buffers():
    with_buffers = bench_memory.comet_figures(TOTAL.format(buffers=", layer buffers 238.2 MB -> 15.2 MB"))
    assert with_buffers["ratio"] == 13.1
    assert abs(with_buffers["dense"] - 873.0 * 2**20) < 1
    assert abs(with_buffers["stored"] - 66.8 * 2**20) < 1
    assert abs(with_buffers["tracked_peak"] - 1.12 * 2**30) < 1
    assert abs(with_buffers["buffers_dense"] - 238.2 * 2**20) < 1
    assert abs(with_buffers["buffers_stored"] - 15.2 * 2**20) < 1
    without = bench_memory.comet_figures(TOTAL.format(buffers=""))
    assert without["ratio"] == 13.1 and "buffers_dense" not in without
    assert bench_memory.comet_figures("no COMET here") == {}


def test_bench_uses_the_last_total_line():
    text = "\n".join([TOTAL.format(buffers="").replace("(13.1x)", "(7.2x)"), TOTAL.format(buffers="")])
    assert bench_memory.comet_figures(text)["ratio"] == 13.1


def test_scripts_explain_themselves():
    for script in ("bench_memory.py", "grad_error.py"):
        out = subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--help"],
                             capture_output=True, text=True, check=True).stdout
        assert "COMET off" in out and "--batch" in out, script


def test_error_correlation_explains_itself():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "error_correlation.py"), "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "kappa" in out and "--blob NAME=EB" in out
