"""What the model generators (make_imagenet_models.py, resnet18_dogs/make_resnet.py) share: the
solver.prototxt text they write, and their command line (write the files, or --check them).

One writer, so that every generated solver has the same shape and the same comet { } block: SGD with
momentum 0.9, a line of output every 20 iterations, GPU mode, snapshots that `cometctl train` moves into
its run folder, and COMET with adaptive error bounds. What differs between the nets (the schedule, the
iteration counts, the weight decay) comes from the caller, as prototxt text. Plain text, no Caffe import.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

COMET_BLOCK = """# ---- COMET (activation compression) -------------------------------------------------------------
# Activations that backward needs are kept compressed between forward and backward, and the
# dense memory is freed (docs/comet.md). Set enabled: false, or delete the block, for plain Caffe.
comet {
  eb_mode: ADAPTIVE      # per-layer error bounds from the weight-gradient error estimate; or FIXED
  error_bound: 1e-3      # FIXED: the bound; ADAPTIVE: where every layer starts
  adaptive_target: 0.05  # estimated weight-gradient error allowed, relative to its RMS
  update_interval: 200   # iterations between bound updates
}
# -------------------------------------------------------------------------------------------------
"""


def solver_text(head: str, net: str, test_iter: int, test_interval: int, base_lr: str,
                schedule: list[str], max_iter: int, weight_decay: str, snapshot: int, snapshot_prefix: str) -> str:
    """head: the comment lines on top, as written; schedule: the learning-rate lines (lr_policy, gamma,
    stepsize or stepvalue). Rates come as text, so that they are written as given (0.0005, not 5e-04)."""
    return (head +
            f'net: "{net}"\n'
            f"test_iter: {test_iter}\n"
            f"test_interval: {test_interval}\n"
            f"base_lr: {base_lr}\n" +
            "".join(f"{line}\n" for line in schedule) +
            "display: 20\n"
            f"max_iter: {max_iter}\n"
            "momentum: 0.9\n"
            f"weight_decay: {weight_decay}\n"
            f"snapshot: {snapshot}\n"
            f'snapshot_prefix: "{snapshot_prefix}"   # `cometctl train` moves snapshots into its run folder\n'
            "solver_mode: GPU\n"
            "\n" + COMET_BLOCK)


def generator_main(doc: str, script: str, default_out: Path, files: dict[str, Callable[[], str]],
                   argv=None) -> int:
    """A generator's command line: writes each of `files` (a path relative to --out, and what makes its
    text) under --out, or with --check writes nothing and returns 1 when one is missing or differs."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=default_out, help=f"folder to write into (default: {default_out})")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file differs")
    args = ap.parse_args(argv)
    stale = []
    for rel, make in files.items():
        path, text = args.out / rel, make()
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(rel)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print(f"out of date (run {script}): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0
