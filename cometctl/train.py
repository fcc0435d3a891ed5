"""`cometctl train`: run the fork's `caffe train`, watch it, keep everything of the run in one folder.

A run folder (default runs/<YYYYmmdd-HHMMSS>-<model>) holds:
  solver.prototxt   the solver as run: snapshot_prefix into this folder, --cpu / --iters applied
  train_val.prototxt the net as run (a copy, so the run stays reproducible when models/ changes)
  caffe.log         everything caffe printed
  snapshots/        <model>_iter_N.caffemodel / .solverstate
  run.json          command, start, end, exit status, last iteration, snapshots

caffe runs with the repository root as its working directory, so relative paths in solvers and nets
resolve as they do for `caffe train` started there. Ctrl-C asks caffe to stop; with
snapshot_after_train (forced on in the copy) caffe then writes a snapshot that `--snapshot` resumes from.
(caffe's `-sigint_effect snapshot` would snapshot and carry on training, so Ctrl-C would not stop it;
we use `-sigint_effect stop`, and `-sighup_effect snapshot` for a snapshot without stopping: kill -HUP.)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from datetime import datetime
from pathlib import Path

from .caffelog import LogParser
from .errors import CometError
from .paths import REPO_ROOT
from .ui import console, counting_progress


def _resolve_input(path: str | os.PathLike) -> Path:
    """A file the user named: relative to the current folder, else to the repository root."""
    p = Path(path).expanduser()
    if p.exists():
        return p.resolve()
    q = REPO_ROOT / p
    if not p.is_absolute() and q.exists():
        return q.resolve()
    raise CometError(f"{path}: no such file")


def _from_root(path: str) -> Path:
    p = Path(path)
    return p if p.is_absolute() else REPO_ROOT / p


def model_name(solver: Path) -> str:
    """models/comet_tiny/solver.prototxt -> comet_tiny; my_solver.prototxt -> my_solver."""
    stem = solver.name.split(".")[0]
    return solver.parent.name if stem == "solver" else stem


def _check_data(net, net_path: Path) -> None:
    """Missing data sources or mean files give one clear line before caffe starts."""
    for layer in net.layer:
        missing = []
        if layer.type == "Data" and layer.data_param.source:
            missing.append(layer.data_param.source)
        if layer.HasField("transform_param") and layer.transform_param.mean_file:
            missing.append(layer.transform_param.mean_file)
        for m in missing:
            if not _from_root(m).exists():
                hint = ("run `cometctl prepare-dogs --synthetic`" if "synthetic" in m
                        else "run `cometctl prepare-dogs`")
                raise CometError(f"{net_path.name}: layer '{layer.name}' needs {m}, which does not exist; {hint}")


def prepare_run(solver: str | os.PathLike, cpu: bool = False, gpu: str | None = None, iters: int | None = None,
                run_dir: str | os.PathLike | None = None, before_create=None) -> tuple[Path, Path, bool]:
    """Create the run folder with the adjusted solver and net; returns (run_dir, solver copy, uses_gpu).

    `before_create(uses_gpu)` runs after every check and before anything is written (to find caffe)."""
    from .caffeproto import caffe_pb2, read_text_proto, write_text_proto

    if cpu and gpu is not None:
        raise CometError("--cpu and --gpu contradict each other; choose one")
    if iters is not None and iters < 1:
        raise CometError(f"--iters {iters}: must be at least 1")
    pb2 = caffe_pb2()
    solver_path = _resolve_input(solver)
    param = read_text_proto(solver_path, pb2.SolverParameter())
    if not param.net:
        raise CometError(f"{solver_path}: the solver has no `net:` (train_net/net_param are not supported here)")
    net_path = _from_root(param.net)
    if not net_path.exists():
        raise CometError(f"{solver_path}: net {param.net} not found (relative paths start at {REPO_ROOT})")
    net = read_text_proto(net_path, pb2.NetParameter())
    _check_data(net, net_path)

    uses_gpu = gpu is not None or (not cpu and param.solver_mode == pb2.SolverParameter.GPU)
    if before_create:
        before_create(uses_gpu)
    name = model_name(solver_path)
    if run_dir is None:
        base = REPO_ROOT / "runs" / f"{datetime.now():%Y%m%d-%H%M%S}-{name}"
        run = base
        n = 1
        while run.exists():
            n += 1
            run = base.with_name(f"{base.name}-{n}")
    else:
        run = Path(run_dir).resolve()
        if (run / "caffe.log").exists():
            raise CometError(f"{run} already holds a run (caffe.log); choose another --run-dir")
    (run / "snapshots").mkdir(parents=True, exist_ok=True)

    shutil.copyfile(net_path, run / "train_val.prototxt")
    param.net = str(run / "train_val.prototxt")
    param.snapshot_prefix = str(run / "snapshots" / name)
    param.snapshot_after_train = True
    if cpu:
        param.solver_mode = pb2.SolverParameter.CPU
    if iters is not None:
        param.max_iter = iters
    copy = run / "solver.prototxt"
    write_text_proto(copy, param)
    return run, copy, uses_gpu


def _caffe_binary(uses_gpu: bool) -> Path:
    from .paths import tool_path

    if not uses_gpu:
        return tool_path("caffe")
    try:
        return tool_path("caffe", "cuda")
    except CometError:
        tool_path("caffe")  # nothing built at all: the plain "not built yet" message
        raise CometError("the solver asks for the GPU (solver_mode: GPU or --gpu) but only the CPU build "
                         "exists; pass --cpu, or build the CUDA variant with `cometctl build --cuda`") from None


class _View:
    """The compact progress view: one line per display interval, test results, COMET summaries."""

    def __init__(self, max_iter: int):
        self.max_iter = max_iter
        self.test_at: tuple[int, dict] | None = None

    def flush(self) -> None:
        if self.test_at is not None:
            it, values = self.test_at
            self.test_at = None
            console.print(f"[cyan]test @ {it}: " + "  ".join(f"{k} {v:.4g}" for k, v in values.items()) + "[/]")

    def show(self, ev, parser: LogParser) -> None:
        if ev.kind != "test":
            self.flush()
        if ev.kind == "lr":  # caffe prints the learning rate after the train outputs of a display step
            row = parser.train.get(ev.iteration, {})
            outs = "  ".join(f"{k} {v:.4g}" for k, v in row.items()
                             if k not in ("NumIters", "Seconds", "LearningRate"))
            console.print(f"iter {ev.iteration:>7}/{self.max_iter}  {outs}  lr {parser.lr:.3g}  "
                          f"{parser.seconds:7.1f} s")
        elif ev.kind == "test":  # outputs arrive one per line: gather them into one line
            if self.test_at is not None and self.test_at[0] != ev.iteration:
                self.flush()
            if self.test_at is None:
                self.test_at = (ev.iteration, {})
            self.test_at[1].update(ev.values)
            return
        elif ev.kind == "comet":
            if ev.text.lower() == "total":
                v = ev.values
                parts = []
                if "ratio" in v:
                    parts.append(f"ratio {v['ratio']:.1f}x")
                if "activations_before_mb" in v and "activations_after_mb" in v:
                    parts.append(f"activations {v['activations_before_mb']:.1f} -> "
                                 f"{v['activations_after_mb']:.1f} MiB")
                if "peak_memory_mb" in v:
                    parts.append(f"peak {v['peak_memory_mb']:.1f} MiB")
                if not parts:
                    parts = [f"{k} {x:.3g}" for k, x in v.items()]
                console.print(f"[magenta]COMET total @ {ev.iteration}: {', '.join(parts)}[/]")
        elif ev.kind == "snapshot":
            console.print(f"[green]snapshot[/] {ev.text}")
        elif ev.kind == "fatal":
            console.print(f"[red]{ev.text}[/]")


def train(solver, gpu: str | None = None, cpu: bool = False, snapshot=None, iters: int | None = None,
          run_dir=None, caffe_bin: str | os.PathLike | None = None) -> int:
    """Run one training; returns caffe's exit status (128+N when a signal N ended it)."""
    resume = None
    if snapshot:
        resume = _resolve_input(snapshot)
        if not str(resume).endswith((".solverstate", ".solverstate.h5")):
            raise CometError(f"--snapshot {snapshot}: expected a .solverstate file (caffe resumes from the "
                             f"solver state; a .caffemodel holds only weights)")
    found = {}

    def find_caffe(uses_gpu: bool) -> None:
        found["binary"] = Path(caffe_bin) if caffe_bin else _caffe_binary(uses_gpu)

    run, solver_copy, uses_gpu = prepare_run(solver, cpu=cpu, gpu=gpu, iters=iters, run_dir=run_dir,
                                             before_create=find_caffe)
    binary = found["binary"]
    cmd = [str(binary), "train", "-solver", str(solver_copy), "-sigint_effect", "stop",
           "-sighup_effect", "snapshot"]
    if gpu is not None:
        cmd += ["-gpu", str(gpu)]
    if resume:
        cmd += ["-snapshot", str(resume)]

    from .caffeproto import caffe_pb2, read_text_proto

    max_iter = read_text_proto(solver_copy, caffe_pb2().SolverParameter()).max_iter
    env = dict(os.environ, GLOG_logtostderr="1", GLOG_minloglevel="0")  # the view and report need INFO lines
    info = {"command": cmd, "cwd": str(REPO_ROOT), "solver": str(_resolve_input(solver)),
            "started": datetime.now().isoformat(timespec="seconds"), "mode": "GPU" if uses_gpu else "CPU"}
    (run / "run.json").write_text(json.dumps(info, indent=1))
    console.print(f"run folder: {run}")
    console.print("$ " + " ".join(cmd))

    parser, view = LogParser(), _View(max_iter)
    interrupts = 0
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1, errors="replace", start_new_session=True)

    def forward(signum, _frame):
        nonlocal interrupts
        if signum == signal.SIGINT:
            interrupts += 1
            if interrupts == 1:
                console.print("[yellow]stopping: caffe writes a snapshot first (Ctrl-C twice more to kill)[/]")
            elif interrupts >= 3:
                proc.kill()
                return
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            pass

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        with open(run / "caffe.log", "w") as log, \
                counting_progress(transient=True, disable=not console.is_terminal) as prog:
            task = prog.add_task("training", total=max_iter or None, rate="")
            for line in proc.stdout:
                log.write(line)
                log.flush()
                for ev in parser.feed(line):
                    view.show(ev, parser)
                if parser.iteration >= 0:
                    prog.update(task, completed=parser.iteration)
        view.flush()
        status = proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    code = status if status >= 0 else 128 - status
    states = sorted((run / "snapshots").glob("*.solverstate*"), key=lambda p: p.stat().st_mtime)
    info.update(ended=datetime.now().isoformat(timespec="seconds"), exit_status=code,
                last_iteration=parser.iteration, interrupted=interrupts > 0,
                snapshots=[str(p) for p in sorted((run / "snapshots").iterdir())])
    (run / "run.json").write_text(json.dumps(info, indent=1))

    if code == 0:
        console.print(f"[green]done[/] after iteration {parser.iteration}; log {run / 'caffe.log'}")
    else:
        console.print(f"[red]caffe exited with status {code}[/]; full log: {run / 'caffe.log'}")
    if states:
        console.print(f"resume with: cometctl train --solver {solver} --snapshot {states[-1]}")
    console.print(f"plots: cometctl report {run}")
    return code
