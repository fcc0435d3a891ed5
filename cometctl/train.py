"""`cometctl train`: run the fork's `caffe train`, watch it, keep everything of the run in one folder.

A run folder (default runs/<YYYYmmdd-HHMMSS>-<model>) holds:
  solver.prototxt   the solver as run: snapshot_prefix into this folder, --cpu / --iters applied
  train_val.prototxt the net as run (a copy, so the run stays reproducible when models/ changes); a
                    solver with train_net/test_net (files or inline) gets train_net.prototxt and
                    test_net_<i>.prototxt instead, inline nets written out, all named in the copy
  caffe.log         everything caffe printed
  snapshots/        <model>_iter_N.caffemodel / .solverstate / .cometstate / .resumestate
  run.json          command, start, end, exit status, last iteration, snapshots (and earlier sessions)

caffe runs where the solver's relative paths resolve (paths.caffe_folder): in the current folder when
its net (or an inline net's data) is found from there, as for `caffe train` started there (upstream's
examples from upstream's tree, a project folder); else in the repository root, where the shipped
models' paths start. Ctrl-C asks caffe to stop; with
snapshot_after_train (forced on in the copy) caffe then writes a snapshot that `--snapshot` resumes from.
(caffe's `-sigint_effect snapshot` would snapshot and carry on training, so Ctrl-C would not stop it;
we use `-sigint_effect stop`, and `-sighup_effect snapshot` for a snapshot without stopping: kill -HUP.)
After Ctrl-C the command exits 130 (128 + SIGINT), names the iteration of the snapshot caffe wrote and
prints the command that resumes the run: same solver, device, --iters and run folder. Resumed into its
own run folder (--run-dir RUN --snapshot RUN/snapshots/...), a run goes on in the same caffe.log (after a
marker line that `caffelog` reads) and the same <snapshot_prefix>_comet.csv, so `report` draws one run.

A GPU run is checked before caffe starts (`device.gpu_problem`): no usable GPU is one line that says why
and suggests --cpu. A caffe that stops before its first iteration is an error, with no report to suggest.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import signal
import subprocess
from datetime import datetime
from pathlib import Path

from rich.markup import escape

from .caffelog import LogParser, resume_marker, why_it_stopped
from .childenv import caffe_env
from .errors import CometError
from .paths import REPO_ROOT, from_root, prepare_hint, user_file
from .ui import console, counting_progress


def model_name(solver: Path) -> str:
    """models/comet_tiny/solver.prototxt -> comet_tiny; my_solver.prototxt -> my_solver."""
    stem = solver.name.split(".")[0]
    return solver.parent.name if stem == "solver" else stem


def _check_data(net, net_path: Path, base: Path) -> None:
    """Missing data sources or mean files give one clear line before caffe starts."""
    from .caffeproto import data_files
    from .locks import busy

    for layer, name in data_files(net):
        path = from_root(name, base)
        if not path.exists():
            raise CometError(f"{net_path.name}: layer '{layer}' needs {name}, which does not exist; "
                             f"{prepare_hint(name, base)}")
        if busy(path.parent):  # the folder prepare-* locks: its LMDBs, lists and mean file
            raise CometError(f"{net_path.name}: layer '{layer}' reads {name}, and another cometctl command is "
                             f"preparing a dataset in {path.parent} now; wait for it to finish, then train")


STATE = re.compile(r"^(?P<prefix>.+)_iter_(?P<iter>\d+)\.solverstate(?:\.h5)?$")


def snapshot_iteration(path: str | os.PathLike) -> int | None:
    """runs/x/snapshots/m_iter_293.solverstate -> 293 (caffe's own naming); None for another name."""
    m = STATE.match(Path(path).name)
    return int(m["iter"]) if m else None


def continues_run(run: Path, resume: Path | None) -> bool:
    """Whether resuming from `resume` into the run folder `run` goes on with that run (the snapshot is one
    of its own) rather than starting a new one."""
    if resume is None:
        return False
    try:
        return Path(resume).resolve().parent == (Path(run).resolve() / "snapshots")
    except OSError:
        return False


def prepare_run(solver: str | os.PathLike, cpu: bool = False, gpu: str | None = None, iters: int | None = None,
                run_dir: str | os.PathLike | None = None, before_create=None,
                resume: Path | None = None) -> tuple[Path, Path, bool, Path]:
    """Create the run folder with the adjusted solver and net; returns (run_dir, solver copy, uses_gpu,
    the folder caffe runs in: paths.caffe_folder).

    `before_create(uses_gpu, param)` runs once the solver is read and before the data is checked or
    anything is written (to find caffe and check the device). With `resume` a snapshot inside
    `run_dir/snapshots`, the run folder is the one that made it: the run goes on there, with the same
    snapshot prefix (so the fork's <prefix>_comet.csv goes on too)."""
    from .caffeproto import (caffe_pb2, nets_caffe_builds, read_solver, read_test_nets, write_solver_nets,
                             write_text_proto)

    if cpu and gpu is not None:
        raise CometError("--cpu and --gpu contradict each other; choose one")
    if iters is not None and iters < 1:
        raise CometError(f"--iters {iters}: must be at least 1")
    pb2 = caffe_pb2()
    solver_path, param, net_path, net, base = read_solver(solver, pb2)
    test_nets = read_test_nets(solver_path, param, pb2, base)
    at = snapshot_iteration(resume) if resume else None
    if at is not None and (iters if iters is not None else param.max_iter) <= at:
        # caffe would train nothing and write the same snapshot again
        if iters is not None:
            raise CometError(f"--iters {iters} is not beyond the snapshot's iteration {at}: nothing to train "
                             f"(--iters counts from the start of the run, as max_iter does: --iters {at + iters} "
                             f"trains {iters} more)")
        raise CometError(f"the solver's max_iter {param.max_iter} is not beyond the snapshot's iteration {at}: "
                         f"nothing to train; give --iters N with N > {at}")

    uses_gpu = gpu is not None or (not cpu and param.solver_mode == pb2.SolverParameter.GPU)
    if before_create:  # the device first: no point preparing data for a run that cannot start
        before_create(uses_gpu, param)
    test_paths = [path or solver_path for _, path in test_nets]
    for built, i in nets_caffe_builds(param, net, test_nets, pb2):  # not the layers no state of the run keeps
        _check_data(built, net_path if i is None or i >= len(test_paths) else test_paths[i], base)
    name = model_name(solver_path)
    continuing = False
    if run_dir is None:
        first = REPO_ROOT / "runs" / f"{datetime.now():%Y%m%d-%H%M%S}-{name}"
        first.parent.mkdir(parents=True, exist_ok=True)
        run = first
        n = 1
        while True:  # made here, atomically: runs started in the same second (a sweep) get folders of their own
            try:
                run.mkdir()
                break
            except FileExistsError:
                n += 1
                run = first.with_name(f"{first.name}-{n}")
    else:
        run = Path(run_dir).resolve()
        continuing = continues_run(run, resume)
        if (run / "caffe.log").exists() and not continuing:
            raise CometError(f"{run} already holds a run (caffe.log); choose another --run-dir, or go on with "
                             f"that run with --snapshot {run / 'snapshots'}/<model>_iter_<N>.solverstate")
    (run / "snapshots").mkdir(parents=True, exist_ok=True)

    write_solver_nets(param, run, solver_path, base, test_nets)
    prefix = run / "snapshots" / name
    m = STATE.match(Path(resume).name) if continuing else None
    if m:
        prefix = run / "snapshots" / m["prefix"]
    param.snapshot_prefix = str(prefix)
    param.snapshot_after_train = True
    if cpu:
        param.solver_mode = pb2.SolverParameter.CPU
    if iters is not None:
        param.max_iter = iters
    if param.display <= 0:
        # The progress view, the resume line and `cometctl report` read caffe's display lines; without
        # them a finished run read as one that never started.
        param.display = max(1, param.max_iter // 100)
        console.print(f"the solver has no display interval: the run's copy shows every {param.display} "
                      f"iteration(s)", markup=False)
    copy = run / "solver.prototxt"
    write_text_proto(copy, param)
    return run, copy, uses_gpu, base


def _caffe_binary(uses_gpu: bool, gpu: str | None = None, solver_device: int = 0) -> Path:
    """The caffe to run; for a GPU run, refused with the reason when no GPU is usable (device.py)."""
    from .paths import tool_path

    if not uses_gpu:
        return tool_path("caffe")
    try:
        binary = tool_path("caffe", "cuda")
    except CometError:
        tool_path("caffe")  # nothing built at all: the plain "not built yet" message
        binary = None  # only the CPU-only build
    _check_gpu(binary, gpu, solver_device)
    return binary


def _check_gpu(binary: Path | None, gpu: str | None, solver_device: int = 0) -> None:
    from . import device

    why = device.gpu_problem(binary, gpu, solver_device=solver_device)
    if why:
        asked = f"--gpu {gpu}" if gpu is not None else "the solver (solver_mode: GPU)"
        raise CometError(f"no usable GPU for {asked}: {why}; pass --cpu to train on the CPU")


class _View:
    """The compact progress view: one line per display interval, test results, COMET summaries."""

    def __init__(self, max_iter: int):
        self.max_iter = max_iter
        self.test_at: tuple[int, dict] | None = None
        self.diverged_at: int | None = None  # the first display whose train outputs were NaN or Inf

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
            outputs = {k: v for k, v in row.items() if k not in ("NumIters", "Seconds", "LearningRate")}
            outs = "  ".join(f"{k} {v:.4g}" for k, v in outputs.items())
            console.print(f"iter {ev.iteration:>7}/{self.max_iter}  {outs}  lr {parser.lr:.3g}  "
                          f"{parser.seconds:7.1f} s")
            bad = [k for k, v in outputs.items() if not math.isfinite(v)]
            if bad and self.diverged_at is None:  # once: caffe goes on, as upstream's does
                self.diverged_at = ev.iteration
                console.print(f"[yellow]{', '.join(bad)} not finite at iteration {ev.iteration}: training "
                              f"diverged; caffe goes on (Ctrl-C stops it with a snapshot). A lower base_lr "
                              f"(now {parser.lr:.3g}) or clip_gradients in the solver usually helps; COMET "
                              f"keeps blobs that hold NaN or Inf dense (caffe.log says which)[/]")
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
        elif ev.kind == "warning":
            console.print(f"[yellow]{escape(ev.text)}[/]")
        elif ev.kind == "fatal":
            console.print(f"[red]{escape(ev.text)}[/]")


def resume_command(solver, state: Path, run: Path, max_iter: int, on_cpu: bool, gpu: str | None) -> str:
    """The `cometctl train` line that goes on with this run from `state`: the same solver, device, number
    of iterations and run folder."""
    parts = ["cometctl", "train", "--solver", str(solver)]
    if gpu is not None:
        parts += ["--gpu", str(gpu)]
    elif on_cpu:
        parts.append("--cpu")
    parts += ["--iters", str(max_iter), "--run-dir", str(run), "--snapshot", str(state)]
    return " ".join(shlex.quote(p) for p in parts)


def _latest_state(run: Path, logged: list[str]) -> Path | None:
    """The solver state to resume from: the last one caffe said it wrote in this session, else the
    highest iteration in the run's snapshots/ folder."""
    for p in reversed(logged):
        if ".solverstate" in p and Path(p).exists():
            return Path(p)
    found = [(snapshot_iteration(p), p) for p in (run / "snapshots").glob("*.solverstate*")]
    found = [(i, p) for i, p in found if i is not None]
    return max(found)[1] if found else None


def _signal_words(code: int) -> str:
    """' (killed by SIGBUS: Bus error)' for an exit status of 128+N that names a signal, else ''."""
    if code <= 128:
        return ""
    try:
        sig = signal.Signals(code - 128)
    except ValueError:
        return ""
    return f" (killed by {sig.name}: {signal.strsignal(sig)})"


def _weight_files(weights: str) -> list[Path]:
    """--weights a.caffemodel[,b.caffemodel.h5]: each file there and a model, not a solver state."""
    files = []
    for name in weights.split(","):
        if not name.strip():
            raise CometError(f"--weights {weights}: an empty file name")
        try:
            path = user_file(name.strip())
        except CometError:
            raise CometError(f"--weights: {name.strip()}: no such file") from None
        if ".solverstate" in path.name:
            raise CometError(f"--weights {name.strip()}: a solver state; resume from it with --snapshot "
                             f"(--weights takes .caffemodel files)")
        files.append(path)
    return files


def train(solver, gpu: str | None = None, cpu: bool = False, snapshot=None, iters: int | None = None,
          run_dir=None, caffe_bin: str | os.PathLike | None = None, weights: str | None = None) -> int:
    """Run one training; returns caffe's exit status (128+N when a signal N ended it; 130 after Ctrl-C).
    `weights`: caffe's -weights (comma-separated .caffemodel files to fine-tune from)."""
    resume = None
    if snapshot and weights:
        raise CometError("--snapshot resumes a run and --weights starts one from a model's weights; give one "
                         "of them (caffe refuses both)")
    weight_files = _weight_files(weights) if weights else []
    if snapshot:
        resume = user_file(snapshot)
        if not str(resume).endswith((".solverstate", ".solverstate.h5")):
            raise CometError(f"--snapshot {snapshot}: expected a .solverstate file (caffe resumes from the "
                             f"solver state; a .caffemodel holds only weights)")
    found = {}

    def find_caffe(uses_gpu: bool, param) -> None:
        device_id = param.device_id if param.HasField("device_id") else 0
        if caffe_bin:
            found["binary"] = Path(caffe_bin)
            if uses_gpu:
                _check_gpu(found["binary"], gpu, device_id)
        else:
            found["binary"] = _caffe_binary(uses_gpu, gpu, device_id)

    run, solver_copy, uses_gpu, base = prepare_run(solver, cpu=cpu, gpu=gpu, iters=iters, run_dir=run_dir,
                                             before_create=find_caffe, resume=resume)
    continuing = continues_run(run, resume)
    binary = found["binary"]
    cmd = [str(binary), "train", "-solver", str(solver_copy), "-sigint_effect", "stop",
           "-sighup_effect", "snapshot"]
    if gpu is not None:
        cmd += ["-gpu", str(gpu)]
    if resume:
        cmd += ["-snapshot", str(resume)]
    if weight_files:
        cmd += ["-weights", ",".join(str(w) for w in weight_files)]

    from .caffeproto import caffe_pb2, read_text_proto

    max_iter = read_text_proto(solver_copy, caffe_pb2().SolverParameter()).max_iter
    env = caffe_env(binary, GLOG_logtostderr="1", GLOG_minloglevel="0")  # the view and report need INFO lines
    earlier = []
    if continuing:
        try:
            old = json.loads((run / "run.json").read_text())
            earlier = old.pop("earlier_sessions", []) + [old]
        except (OSError, ValueError):
            pass
    info = {"command": cmd, "cwd": str(base), "solver": str(user_file(solver)),
            "started": datetime.now().isoformat(timespec="seconds"), "mode": "GPU" if uses_gpu else "CPU"}
    if resume:
        info["resumed_from"] = str(resume)
    if earlier:
        info["earlier_sessions"] = earlier
    (run / "run.json").write_text(json.dumps(info, indent=1))
    console.print(f"run folder: {run}" + (" (going on with the run there)" if continuing else ""))
    if base != REPO_ROOT:  # relative paths resolve from where the solver's net was found
        console.print(f"in {base}:", markup=False)
    console.print("$ " + " ".join(cmd), markup=False, soft_wrap=True)

    parser, view = LogParser(), _View(max_iter)
    interrupts = 0
    tail: list[str] = []
    proc = subprocess.Popen(cmd, cwd=base, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
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
        with open(run / "caffe.log", "a" if continuing else "w") as log, \
                counting_progress(transient=True, disable=not console.is_terminal) as prog:
            if continuing:
                marker = resume_marker(resume, snapshot_iteration(resume))
                log.write(marker + "\n")
                parser.feed(marker)
            task = prog.add_task("training", total=max_iter or None, rate="")
            for line in proc.stdout:
                log.write(line)
                log.flush()
                tail = (tail + [line.rstrip("\n")])[-20:]
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
    if code == 0 and interrupts:
        code = 128 + signal.SIGINT  # stopped by Ctrl-C: caffe itself exits 0 after its snapshot
    state = _latest_state(run, parser.snapshots)
    logged = [p for p in parser.snapshots if ".solverstate" in p and Path(p).exists()]
    reached = snapshot_iteration(logged[-1]) if logged else None
    if reached is None:
        reached = parser.iteration
    info.update(ended=datetime.now().isoformat(timespec="seconds"), exit_status=code,
                last_iteration=reached, interrupted=interrupts > 0,
                snapshots=[str(p) for p in sorted((run / "snapshots").iterdir())])
    (run / "run.json").write_text(json.dumps(info, indent=1))
    log_path = run / "caffe.log"

    if not parser.started:
        if code == 0:
            console.print(f"[green]done[/]: nothing to train (already at iteration {reached}); log {log_path}")
            return code
        if interrupts:
            raise CometError(f"interrupted before training started (exit status {code}); full log: {log_path}",
                             exit_code=code)
        raise CometError(f"caffe stopped before training started (exit status {code}): "
                         f"{why_it_stopped(parser, tail)}; full log: {log_path}", exit_code=code)
    if code == 0:
        diverged = "" if view.diverged_at is None else \
            f" [yellow](diverged: outputs not finite since iteration {view.diverged_at})[/]"
        console.print(f"[green]done[/] after iteration {reached}{diverged}; log {log_path}")
    elif interrupts and logged:
        console.print(f"[yellow]stopped[/] at iteration {reached}; snapshot {escape(logged[-1])}")
    else:
        console.print(f"[red]caffe exited with status {code}[/]{_signal_words(code)}; full log: {log_path}")
    if state is not None and (code != 0 or reached < max_iter):
        console.print("resume with: " + resume_command(solver, state, run, max_iter, not uses_gpu, gpu),
                      markup=False, soft_wrap=True)
    console.print(f"plots: cometctl report {run}", markup=False, soft_wrap=True)
    return code
