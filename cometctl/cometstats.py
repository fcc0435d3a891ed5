"""The store's own statistics file, <snapshot_prefix>_comet.csv (or comet.stats_file).

The fork writes it at every display (caffe/src/caffe/comet/statistics.cpp): one row per stored
entry (layer = the entry's name, kind = what the store did: lossy, mask, argmax, keep, rebuild, ...)
and then a `total` row with the net's blobs dense and stored, the tracked peak and its split by kind,
and the layers' private buffers dense and stored, all in bytes, and the codecs' time per iteration
(encode_ms, decode_ms) with the part the training step waited for (wait_ms). The log's `COMET ...` lines say the
same, rounded for reading; `report`, `plan` and the benchmarks read this file, and the log parser
(caffelog) serves Caffe's own lines and runs whose file is missing.
"""

from __future__ import annotations

import csv
from pathlib import Path

MIB = 2**20
TEXT_COLUMNS = ("layer", "blob", "kind")
# bytes columns of the total row -> the names caffelog gives the same figures in the log (MiB)
TOTAL_AS_LOG = {"dense_bytes": "activations_before_mb", "stored_bytes": "activations_after_mb",
                "buffers_dense_bytes": "layer_buffers_before_mb",
                "buffers_stored_bytes": "layer_buffers_after_mb", "peak_bytes": "peak_memory_mb",
                "weights_bytes": "weights_mb", "activations_bytes": "activations_mb",
                "gradients_bytes": "gradients_mb", "compressed_bytes": "compressed_mb",
                "scratch_bytes": "scratch_mb"}


def read(path: Path) -> list[dict] | None:
    """Every row, numbers as floats (empty cells left out); None when there is no such file."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError:
        return None
    out = []
    for r in rows:
        row = {}
        for k, v in r.items():
            if k is None or v in ("", None):
                continue
            if k in TEXT_COLUMNS:
                row[k] = v
            else:
                try:
                    row[k] = float(v)
                except ValueError:
                    row[k] = v
        out.append(row)
    return out


def last_report(path: Path) -> tuple[dict | None, list[dict]]:
    """The total row and the entry rows of the last display the file holds; (None, []) without one."""
    rows = read(path) or []
    totals = [i for i, r in enumerate(rows) if r.get("layer") == "total"]
    if not totals:
        return None, []
    end = totals[-1]
    start = totals[-2] + 1 if len(totals) > 1 else 0
    return rows[end], rows[start:end]


def figures(total: dict | None) -> dict:
    """A total row as the benchmarks print it, in bytes: dense, stored, ratio, tracked_peak,
    buffers_dense, buffers_stored, and in ms per iteration encode_ms, decode_ms, work_ms (their
    sum) and wait_ms ({} without a row)."""
    if not total:
        return {}
    out = {"dense": total.get("dense_bytes", 0.0), "stored": total.get("stored_bytes", 0.0),
           "ratio": total.get("ratio", 0.0), "tracked_peak": total.get("peak_bytes", 0.0)}
    if "buffers_dense_bytes" in total:
        out["buffers_dense"] = total["buffers_dense_bytes"]
        out["buffers_stored"] = total.get("buffers_stored_bytes", 0.0)
    if "wait_ms" in total:  # per iteration: the codecs' time, and the part the step waited for
        out["encode_ms"] = total.get("encode_ms", 0.0)
        out["decode_ms"] = total.get("decode_ms", 0.0)
        out["work_ms"] = out["encode_ms"] + out["decode_ms"]
        out["wait_ms"] = total["wait_ms"]
    return out


def as_log_rows(rows: list[dict], seconds: dict[int, float] | None = None) -> list[dict]:
    """The rows in the shape caffelog gives the log's COMET lines (NumIters, Seconds, layer, ratio,
    eb, time_ms, sizes in MiB as *_mb), so report draws either source the same way, exactly."""
    seconds = seconds or {}
    out = []
    for r in rows:
        it = int(r.get("iter", 0))
        row = {"NumIters": it, "Seconds": seconds.get(it, float("nan")), "layer": r.get("layer", "")}
        if row["layer"] == "total":
            if "ratio" in r:
                row["ratio"] = r["ratio"]
            for col, name in TOTAL_AS_LOG.items():
                if col in r:
                    row[name] = r[col] / MIB
        else:
            kind = r.get("kind", "")
            if kind in ("lossy", "mask", "argmax", "binary") and "ratio" in r:
                row["ratio"] = r["ratio"]
            if kind == "lossy" and r.get("eb"):
                row["eb"] = r["eb"]
            if kind == "keep":
                row["kept_dense_mb"] = r.get("dense_bytes", 0.0) / MIB
            elif kind in ("rebuild", "scale"):  # a copy rebuilt, a scale recomputed: freed
                row["freed_mb"] = r.get("dense_bytes", 0.0) / MIB
            if "ms" in r:
                row["time_ms"] = r["ms"]
        out.append(row)
    return out


def find(run: Path) -> Path | None:
    """A `cometctl train` run folder's statistics file: snapshots/*_comet.csv, the latest written."""
    found = sorted(Path(run).glob("snapshots/*_comet.csv"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None
