"""`cometctl report RUN_DIR [--compare OTHER]`: a run's log as CSV tables and PNG plots.

Written into <RUN_DIR>/report/ (or --out):
  train.csv, test.csv   upstream parse_log.py's columns: NumIters, Seconds, LearningRate, <outputs...>
  comet.csv             one row per COMET figure line: NumIters, Seconds, layer, ratio, eb, ... (from the
                        store's exact <prefix>_comet.csv in snapshots/ when there is one, else the log)
  loss.png, accuracy.png, comet_ratio.png, comet_eb.png, comet_memory.png, comet_time.png
Only what the log contains is written: a run without COMET lines gets no comet files, a log without
test outputs no test.csv or accuracy plot. With --compare, the plots show both runs on the same axes.
"""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path

from . import cometstats
from .caffelog import LogParser, parse_file
from .errors import CometError
from .ui import console

CSV_FIRST = ("NumIters", "Seconds", "LearningRate")


def find_log(run: Path) -> Path:
    run = Path(run)
    if run.is_file():
        return run
    if not run.is_dir():
        raise CometError(f"{run}: no such run folder or log file")
    for name in ("caffe.log", "caffe.INFO"):
        if (run / name).exists():
            return run / name
    raise CometError(f"{run}: no caffe.log in this folder (is it a `cometctl train` run folder?)")


def write_csv(path: Path, rows: list[dict], first: tuple = CSV_FIRST) -> bool:
    if not rows:
        return False
    columns = [c for c in first if any(c in r for r in rows)]
    for r in rows:
        columns += [k for k in r if k not in columns]
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, restval="")
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, path)
    return True


def _series(rows: list[dict], key: str):
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if v is not None and not (isinstance(v, float) and math.isnan(v)):
            xs.append(r["NumIters"])
            ys.append(v)
    return xs, ys


def _outputs(rows: list[dict]) -> list[str]:
    seen: list[str] = []
    for r in rows:
        seen += [k for k in r if k not in CSV_FIRST and k not in seen]
    return seen


class _Run:
    def __init__(self, path: Path):
        self.log = find_log(path)
        self.name = (self.log.parent if self.log.name in ("caffe.log", "caffe.INFO") else self.log).name
        self.parser: LogParser = parse_file(self.log)
        self.train = self.parser.train_rows()
        self.test = self.parser.test_rows()
        self.comet = self.parser.comet
        self.comet_source = self.log
        stats = cometstats.find(self.log.parent) if self.log.name in ("caffe.log", "caffe.INFO") else None
        rows = cometstats.read(stats) if stats else None
        if rows:
            # the store's exact figures; the log gives each iteration's time and the lines the file
            # does not hold (the memory pool's counts)
            seconds = {r["NumIters"]: r["Seconds"] for r in self.comet + self.train}
            from_csv = cometstats.as_log_rows(rows, seconds)
            named = {r["layer"] for r in from_csv}
            self.comet = from_csv + [r for r in self.comet if r["layer"] not in named]
            self.comet.sort(key=lambda r: r["NumIters"])
            self.comet_source = stats

    def layers(self) -> list[str]:
        out: list[str] = []
        for r in self.comet:
            if r["layer"] not in out:
                out.append(r["layer"])
        return out


def _figure(title: str, ylabel: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    ax.set_title(title)
    ax.set_xlabel("iteration")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _save(fig, path: Path, written: list[Path]) -> None:
    import matplotlib.pyplot as plt

    handles, _ = fig.axes[0].get_legend_handles_labels()
    if handles:
        fig.axes[0].legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)
    written.append(path)


def _plots(runs: list[_Run], out: Path) -> list[Path]:
    written: list[Path] = []
    styles = ["-", "--"]
    label = (lambda run, what: f"{run.name}: {what}") if len(runs) > 1 else (lambda run, what: what)

    # loss: every train output and every test output whose name contains "loss"
    fig, ax = _figure("loss", "loss")
    drew = False
    for run, ls in zip(runs, styles):
        for part, rows in (("train", run.train), ("test", run.test)):
            for key in _outputs(rows):
                if "loss" in key:
                    xs, ys = _series(rows, key)
                    if xs:
                        ax.plot(xs, ys, ls, marker="." if part == "test" else None, label=label(run, f"{part} {key}"))
                        drew = True
    if drew:
        _save(fig, out / "loss.png", written)

    fig, ax = _figure("accuracy (test)", "accuracy")
    drew = False
    for run, ls in zip(runs, styles):
        for key in _outputs(run.test):
            if "acc" in key:
                xs, ys = _series(run.test, key)
                if xs:
                    ax.plot(xs, ys, ls, marker="o", label=label(run, key))
                    drew = True
    if drew:
        ax.set_ylim(0, 1)
        _save(fig, out / "accuracy.png", written)

    # COMET: one plot per kind of figure, one line per layer (and run)
    def comet_plot(fname, title, ylabel, keys, logy=False):
        fig, ax = _figure(title, ylabel)
        drew = False
        for run, ls in zip(runs, styles):
            for layer in run.layers():
                rows = [r for r in run.comet if r["layer"] == layer]
                for key in keys(rows):
                    xs, ys = _series(rows, key)
                    if xs:
                        short = key.removesuffix("_mb").removesuffix("_ms").replace("_", " ")
                        what = layer if len(keys(rows)) == 1 else f"{layer}: {short}"
                        ax.plot(xs, ys, ls, linewidth=2.5 if layer.lower() == "total" else 1.2,
                                label=label(run, what))
                        drew = True
        if drew:
            if logy:
                ax.set_yscale("log")
            _save(fig, out / fname, written)
        else:
            import matplotlib.pyplot as plt
            plt.close(fig)

    def cols(rows, pred):
        found: list[str] = []
        for r in rows:
            found += [k for k in r if k not in ("NumIters", "Seconds", "layer") and pred(k) and k not in found]
        return found

    if any(run.comet for run in runs):
        comet_plot("comet_ratio.png", "COMET compression ratio per layer", "ratio (x)",
                   lambda rows: cols(rows, lambda k: k == "ratio"))
        comet_plot("comet_eb.png", "COMET error bound per layer", "absolute error bound",
                   lambda rows: cols(rows, lambda k: k in ("eb", "error_bound")), logy=True)
        comet_plot("comet_memory.png", "COMET activation memory", "MiB",
                   lambda rows: cols(rows, lambda k: k.endswith("_mb")))
        comet_plot("comet_time.png", "COMET compression time", "ms",
                   lambda rows: cols(rows, lambda k: k.endswith("_ms")))
    return written


def latest_run(runs_dir: Path | None = None) -> Path:
    """The most recently started run folder under runs/ (the one `cometctl train` made last)."""
    from .paths import REPO_ROOT

    runs_dir = runs_dir or REPO_ROOT / "runs"
    candidates = [p for p in runs_dir.glob("*") if (p / "caffe.log").exists()] if runs_dir.is_dir() else []
    if not candidates:
        raise CometError(f"no runs in {runs_dir}: train first (`cometctl train --solver ...`) or name a run folder")
    return max(candidates, key=lambda p: (p / "caffe.log").stat().st_mtime)


def report(run_dir=None, compare=None, out=None) -> list[Path]:
    """Write the CSVs and plots; returns the files written."""
    run = _Run(Path(run_dir) if run_dir else latest_run())
    if not run.train and not run.test and not run.comet:
        raise CometError(f"{run.log}: no training iterations in this log yet (did caffe start?)")
    base = Path(out) if out else (run.log.parent / "report")
    base.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for fname, rows, first in (("train.csv", run.train, CSV_FIRST), ("test.csv", run.test, CSV_FIRST),
                               ("comet.csv", run.comet, ("NumIters", "Seconds", "layer"))):
        if write_csv(base / fname, rows, first):
            written.append(base / fname)
    runs = [run]
    plot_dir = base
    if compare:
        other = _Run(Path(compare))
        runs.append(other)
        plot_dir = base / f"compare-{other.name}"
        plot_dir.mkdir(exist_ok=True)
    written += _plots(runs, plot_dir)
    console.print(f"report of {run.log}:")
    for p in written:
        console.print(f"  {p}")
    for line in summary(run):
        console.print(line)
    return written


def summary(run: _Run) -> list[str]:
    """A few lines that say how the run went: last loss and accuracy, COMET's last figures per layer."""
    lines = []
    if run.train:
        last = run.train[-1]
        outs = ", ".join(f"{k} {v:.4g}" for k, v in last.items() if k not in CSV_FIRST)
        lines.append(f"last train iteration {last['NumIters']}: {outs}")
    if run.test:
        last = run.test[-1]
        outs = ", ".join(f"{k} {v:.4g}" for k, v in last.items() if k not in CSV_FIRST)
        lines.append(f"last test at iteration {last['NumIters']}: {outs}")
    if run.comet:
        final = {}
        for r in run.comet:
            final[r["layer"]] = r
        lines.append(f"COMET at iteration {max(r['NumIters'] for r in final.values())}:")
        for layer, r in final.items():
            items = []
            if "ratio" in r:
                items.append(f"ratio {r['ratio']:.1f}x")
            if r.get("eb"):
                items.append(f"eb {r['eb']:.2e}")
            if "activations_before_mb" in r and "activations_after_mb" in r:
                items.append(f"activations {r['activations_before_mb']:.1f} -> {r['activations_after_mb']:.2f} MiB")
            if "peak_memory_mb" in r:
                items.append(f"peak {r['peak_memory_mb']:.1f} MiB")
            if "time_ms" in r:
                items.append(f"{r['time_ms']:.1f} ms")
            if not items:  # a line of other figures (the memory pool's counts): as they are
                items = [f"{k} {v:g}" for k, v in r.items()
                         if k not in ("layer", "NumIters", "Seconds") and isinstance(v, (int, float))]
            lines.append(f"  {layer}: {', '.join(items)}")
    return lines


def plan_plot(plan_json, out_png=None) -> Path:
    """`cometctl plan --json` drawn: the predicted peak against the batch size, COMET off and on, with
    the peaks measured for the fit (circles) and by --batch checks (crosses), and the --memory budget."""
    import json

    from .plan import predict

    path = Path(plan_json)
    try:
        plan = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CometError(f"{path}: not a plan written by `cometctl plan --json` ({e})") from None
    if not isinstance(plan, dict) or not str(plan.get("schema", "")).startswith("cometctl-plan/"):
        raise CometError(f"{path}: not a plan written by `cometctl plan --json` (no cometctl-plan schema)")
    gib = 2**30
    batches = [r["batch"] for r in plan["runs"]] + [c["batch"] for c in plan.get("checks", [])]
    budget = plan.get("budget") or {}
    top = max(batches + [plan["solver_batch"]] +
              [b for b in (budget.get("largest_batch_off"), budget.get("largest_batch_on")) if b])
    xs = [1 + (top * 1.1 - 1) * i / 100 for i in range(101)]
    what = ("device, unmeasured" if not plan.get("measured") else
            "device, nvidia-smi" if plan.get("device", "CPU") != "CPU" else "measured RSS")
    fig, ax = _figure(f"predicted peak ({what})",
                      "GiB")
    ax.set_xlabel("batch size")
    for mode, color in (("off", "tab:red"), ("on", "tab:blue")):
        ax.plot(xs, [predict(plan["fit"][mode], x, plan.get("file_cap_bytes")) / gib for x in xs], color=color,
                label=f"COMET {mode}: predicted")
        runs = [r for r in plan["runs"] if r["comet"] == mode]
        ax.plot([r["batch"] for r in runs], [r["peak"] / gib for r in runs], "o", color=color,
                label=f"COMET {mode}: measured (fit)")
        checks = [c for c in plan.get("checks", []) if c["comet"] == mode]
        if checks:
            ax.plot([c["batch"] for c in checks], [c["measured_bytes"] / gib for c in checks], "x", color=color,
                    markersize=10, mew=2, label=f"COMET {mode}: measured (--batch)")
    if budget:
        ax.axhline(budget["bytes"] / gib, color="gray", ls="--", label=f"budget {budget['text']}")
    ax.axvline(plan["solver_batch"], color="gray", ls=":", label=f"solver's batch {plan['solver_batch']}")
    ax.set_ylim(bottom=0)
    out = Path(out_png) if out_png else path.with_suffix(".png")
    out.parent.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    _save(fig, out, written)
    console.print(f"plan plot: {out}")
    return out
