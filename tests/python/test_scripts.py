"""scripts/bench_memory and scripts/grad_error: their --help, and the benchmark reading the store's CSV."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_memory  # noqa: E402

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


def test_scripts_explain_themselves():
    for script in ("bench_memory.py", "grad_error.py"):
        out = subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--help"],
                             capture_output=True, text=True, check=True).stdout
        assert "COMET off" in out and "--batch" in out, script


def test_error_correlation_explains_itself():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "error_correlation.py"), "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "kappa" in out and "--blob NAME=EB" in out
