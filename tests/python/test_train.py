"""train: the adjusted solver copy, the run folder, streaming, exit status, Ctrl-C snapshot and resume."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from cometctl import train as tr
from cometctl.caffelog import parse_file
from cometctl.cli import main
from cometctl.errors import CometError

from conftest import WF_REPO as REPO, WF_NEEDS_BUILD, wf_point_model_at


def test_run_folder_holds_an_adjusted_copy_and_leaves_the_original_alone(tmp_path, wf_pb2, wf_synthetic):
    from cometctl.caffeproto import read_text_proto

    solver = wf_point_model_at(wf_pb2, REPO / "models" / "comet_tiny", wf_synthetic, tmp_path / "m")
    original = solver.read_text()
    run, copy, gpu = tr.prepare_run(solver, cpu=True, iters=7, run_dir=tmp_path / "run")
    assert solver.read_text() == original and not gpu
    p = read_text_proto(copy, wf_pb2.SolverParameter())
    assert p.max_iter == 7 and p.solver_mode == wf_pb2.SolverParameter.CPU and p.snapshot_after_train
    assert p.snapshot_prefix == str(tmp_path / "run" / "snapshots" / "m")
    assert p.net == str(tmp_path / "run" / "train_val.prototxt")
    assert (tmp_path / "run" / "train_val.prototxt").read_text() == (tmp_path / "m" / "train_val.prototxt").read_text()
    _, _, gpu = tr.prepare_run(solver, gpu="0", run_dir=tmp_path / "run2")
    assert gpu


def test_default_run_folder_name(wf_pb2, wf_synthetic, tmp_path, monkeypatch):
    solver = wf_point_model_at(wf_pb2, REPO / "models" / "comet_tiny", wf_synthetic, tmp_path / "comet_tiny")
    monkeypatch.setattr(tr, "REPO_ROOT", tmp_path)
    run, _, _ = tr.prepare_run(solver, cpu=True)
    assert run.parent == tmp_path / "runs" and run.name.endswith("-comet_tiny")
    assert tr.model_name(Path("x/my_solver.prototxt")) == "my_solver"


def test_bad_requests_are_one_line_errors(tmp_path, wf_pb2, monkeypatch):
    with pytest.raises(CometError, match="contradict"):
        tr.prepare_run(REPO / "models/comet_tiny/solver.prototxt", cpu=True, gpu="0", run_dir=tmp_path / "a")
    with pytest.raises(CometError, match="no such file"):
        tr.train(tmp_path / "nope.prototxt")
    # data that prepare-dogs has not made yet: say which command makes it
    solver = tmp_path / "s.prototxt"
    net = (REPO / "models/comet_tiny/train_val.prototxt").read_text().replace("data/synthetic/", str(tmp_path) + "/x/")
    (tmp_path / "n.prototxt").write_text(net)
    solver.write_text(f'net: "{tmp_path}/n.prototxt"\nmax_iter: 1\nbase_lr: 0.1\nlr_policy: "fixed"\n')
    with pytest.raises(CometError, match="needs .*train_lmdb.*prepare-dogs"):
        tr.prepare_run(solver, cpu=True, run_dir=tmp_path / "b")
    with pytest.raises(CometError, match="solverstate"):
        tr.train(solver, snapshot=solver)
    # a GPU solver on a CPU-only build
    from cometctl import paths

    def only_cpu(name, variant=None, override=None):
        if variant == "cuda":
            raise CometError("not built")
        return Path("/bin/true")

    monkeypatch.setattr(paths, "tool_path", only_cpu)
    with pytest.raises(CometError, match="only the CPU build"):
        tr._caffe_binary(uses_gpu=True)
    gpu_solver = tmp_path / "gpu.prototxt"
    gpu_solver.write_text(f'net: "{REPO}/models/comet_tiny/deploy.prototxt"\nmax_iter: 1\nsolver_mode: GPU\n')
    with pytest.raises(CometError, match="pass --cpu"):
        tr.train(gpu_solver, run_dir=tmp_path / "never")
    assert not (tmp_path / "never").exists()  # refused before anything was written
    r = CliRunner().invoke(main, ["train", "--solver", str(tmp_path / "nope.prototxt")])
    assert r.exit_code != 0 and "Traceback" not in r.output and "no such file" in r.output


FAKE_CAFFE = textwrap.dedent("""\
    import sys, time
    print("I1130 10:00:00.000000 1 solver.cpp:218] Iteration 0 (0 iter/s), loss = 2.3", flush=True)
    print("I1130 10:00:00.000000 1 solver.cpp:237]     Train net output #0: loss = 2.3", flush=True)
    print("I1130 10:00:00.000000 1 sgd_solver.cpp:105] Iteration 0, lr = 0.01", flush=True)
    print("I1130 10:00:01.000000 1 comet.cpp:1] COMET total: ratio 9.5x, 100 MB -> 10.5 MB", flush=True)
    print("F1130 10:00:02.000000 1 net.cpp:1] Check failed: something broke", flush=True)
    sys.exit(int(sys.argv[-1]) if sys.argv[-1].isdigit() else 3)
""")


def test_caffe_status_and_log_are_kept(tmp_path, wf_pb2, wf_synthetic, capsys):
    fake = tmp_path / "fake_caffe"
    fake.write_text(f"#!{sys.executable}\n" + FAKE_CAFFE)
    fake.chmod(0o755)
    solver = wf_point_model_at(wf_pb2, REPO / "models" / "comet_tiny", wf_synthetic, tmp_path / "m")
    code = tr.train(solver, cpu=True, run_dir=tmp_path / "run", caffe_bin=fake)
    assert code == 3
    shown = " ".join(capsys.readouterr().err.split())  # rich wraps long lines
    assert "iter 0/" in shown and "loss 2.3" in shown and "lr 0.01" in shown
    assert "COMET total @ 0: ratio 9.5x" in shown and "Check failed: something broke" in shown
    assert "exited with status 3" in shown
    log = (tmp_path / "run" / "caffe.log").read_text()
    assert "COMET total: ratio 9.5x" in log and "Check failed" in log
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert info["exit_status"] == 3 and info["command"][0] == str(fake) and "-sigint_effect" in info["command"]
    assert info["cwd"] == str(REPO)
    with pytest.raises(CometError, match="already holds a run"):
        tr.prepare_run(solver, cpu=True, run_dir=tmp_path / "run")


@WF_NEEDS_BUILD
def test_short_cpu_run_trains_from_the_lmdb_and_loss_falls(wf_short_run):
    log = (wf_short_run / "caffe.log").read_text()
    assert "Opened lmdb" in log and "Optimization Done" in log
    rows = parse_file(wf_short_run / "caffe.log").train_rows()
    losses = [r["loss"] for r in rows]
    assert len(losses) >= 6
    assert sum(losses[-2:]) / 2 < losses[0] - 0.1, losses
    snaps = sorted(p.name for p in (wf_short_run / "snapshots").iterdir())
    # the solver trains with COMET: its statistics and error bounds sit beside the snapshots
    assert snaps == ["model_comet.csv", "model_iter_30.caffemodel", "model_iter_30.cometstate",
                     "model_iter_30.solverstate"]
    assert "COMET total: activations" in log
    assert json.loads((wf_short_run / "run.json").read_text())["exit_status"] == 0


@WF_NEEDS_BUILD
def test_ctrl_c_snapshots_and_snapshot_resumes(tmp_path, wf_pb2, wf_synthetic):
    solver = wf_point_model_at(wf_pb2, REPO / "models" / "comet_tiny", wf_synthetic, tmp_path / "m",
                               display=1, test_interval=100000, test_initialization=False, snapshot=0)
    run = tmp_path / "run"
    proc = subprocess.Popen([str(Path(sys.executable).parent / "cometctl"), "train", "--solver", str(solver), "--cpu",
                             "--iters", "100000", "--run-dir", str(run)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            log = run / "caffe.log"
            if log.exists() and "Iteration 5," in log.read_text():
                break
            time.sleep(0.2)
        else:
            pytest.fail("training did not reach iteration 5")
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "Traceback" not in out
    states = list((run / "snapshots").glob("*.solverstate"))
    assert len(states) == 1, out
    stopped_at = int(states[0].stem.rsplit("_", 1)[1])
    assert 5 <= stopped_at < 100000
    assert json.loads((run / "run.json").read_text())["interrupted"] is True

    code = tr.train(solver, cpu=True, snapshot=states[0], iters=stopped_at + 3, run_dir=tmp_path / "resumed")
    assert code == 0
    log = (tmp_path / "resumed" / "caffe.log").read_text()
    assert f"Resuming from {states[0]}" in log
    iters = [r["NumIters"] for r in parse_file(tmp_path / "resumed" / "caffe.log").train_rows()]
    assert iters[0] == stopped_at, iters  # it went on from the snapshot, not from 0
    assert (tmp_path / "resumed" / "snapshots" / f"m_iter_{stopped_at + 3}.solverstate").exists()


def test_help_explains():
    r = CliRunner().invoke(main, ["train", "--help"])
    assert r.exit_code == 0
    for word in ("--solver", "--gpu", "--cpu", "--snapshot", "--iters", "--run-dir", "Ctrl-C"):
        assert word in r.output
