"""train: the adjusted solver copy, the run folder, streaming, exit status, Ctrl-C snapshot and resume."""

from __future__ import annotations

import csv
import json
import os
import shlex
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

from conftest import WF_REPO as REPO, WF_NEEDS_BUILD, held_by_another_process, wf_point_model_at


def test_run_folder_holds_an_adjusted_copy_and_leaves_the_original_alone(tmp_path, wf_pb2, wf_synthetic):
    from cometctl.caffeproto import read_text_proto

    solver = wf_point_model_at(wf_pb2, REPO / "models" / "comet_tiny", wf_synthetic, tmp_path / "m")
    original = solver.read_text()
    run, copy, gpu, _ = tr.prepare_run(solver, cpu=True, iters=7, run_dir=tmp_path / "run")
    assert solver.read_text() == original and not gpu
    p = read_text_proto(copy, wf_pb2.SolverParameter())
    assert p.max_iter == 7 and p.solver_mode == wf_pb2.SolverParameter.CPU and p.snapshot_after_train
    assert p.snapshot_prefix == str(tmp_path / "run" / "snapshots" / "m")
    assert p.net == str(tmp_path / "run" / "train_val.prototxt")
    assert (tmp_path / "run" / "train_val.prototxt").read_text() == (tmp_path / "m" / "train_val.prototxt").read_text()
    _, _, gpu, _ = tr.prepare_run(solver, gpu="0", run_dir=tmp_path / "run2")
    assert gpu


def test_default_run_folder_name(wf_pb2, wf_synthetic, tmp_path, monkeypatch):
    solver = wf_point_model_at(wf_pb2, REPO / "models" / "comet_tiny", wf_synthetic, tmp_path / "comet_tiny")
    monkeypatch.setattr(tr, "REPO_ROOT", tmp_path)
    run, _, _, _ = tr.prepare_run(solver, cpu=True)
    assert run.parent == tmp_path / "runs" and run.name.endswith("-comet_tiny")
    assert tr.model_name(Path("x/my_solver.prototxt")) == "my_solver"
    # runs started in the same second (a sweep started with `&`) each get a folder of their own
    from concurrent.futures import ThreadPoolExecutor
    from datetime import datetime

    class Frozen(datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime(2026, 12, 5, 12, 0, 0)

    monkeypatch.setattr(tr, "datetime", Frozen)
    with ThreadPoolExecutor(4) as pool:
        runs = list(pool.map(lambda _: tr.prepare_run(solver, cpu=True)[0], range(6)))
    assert len(set(runs)) == 6 and {r.name for r in runs} == {"20261205-120000-comet_tiny"} | {
        f"20261205-120000-comet_tiny-{n}" for n in range(2, 7)}
    # the race itself: another run makes the folder after this one looked (exists() said no)
    real_exists = Path.exists
    monkeypatch.setattr(Path, "exists", lambda p: False if p.parent == tmp_path / "runs" else real_exists(p))
    assert tr.prepare_run(solver, cpu=True)[0].name == "20261205-120000-comet_tiny-7"


def test_only_the_data_of_layers_caffe_builds_is_checked(tmp_path, wf_pb2, wf_synthetic):
    """A TEST-phase data layer is read only when the solver tests (test_iter), a staged one only in the
    stages the solver names: a missing source elsewhere does not stop the run, as it would not stop caffe."""
    lmdb = wf_synthetic / "train_lmdb"

    def data(name, source, rule=""):
        return (f'layer {{ name: "{name}" type: "Data" top: "data" top: "label" {rule} '
                f'data_param {{ source: "{source}" batch_size: 2 backend: LMDB }} }}\n')

    (tmp_path / "net.prototxt").write_text(
        data("train", lmdb, "include { phase: TRAIN }") + data("test", tmp_path / "no_test_lmdb", "include { phase: TEST }")
        + data("extra", tmp_path / "no_extra_lmdb", 'include { phase: TRAIN stage: "extra" }')
        + 'layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 2 } }\n'
        + 'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }\n')
    base = f'net: "{tmp_path}/net.prototxt"\nmax_iter: 1\nbase_lr: 0.1\nlr_policy: "fixed"\n'
    cases = {  # solver text -> the layer whose missing source stops it (None: the run folder is made)
        "": None,
        "test_iter: 1\ntest_interval: 1\n": "test",
        'train_state { stage: "extra" }\n': "extra",
        'test_iter: 1\ntest_interval: 1\ntest_state { stage: "x" }\n': "test",
    }
    for i, (extra, layer) in enumerate(cases.items()):
        solver = tmp_path / f"solver{i}.prototxt"
        solver.write_text(base + extra)
        if layer is None:
            run, _, _, _ = tr.prepare_run(solver, cpu=True, run_dir=tmp_path / f"run{i}")
            assert (run / "train_val.prototxt").exists()
        else:
            with pytest.raises(CometError, match=f"layer '{layer}' needs .*no_{layer}_lmdb"):
                tr.prepare_run(solver, cpu=True, run_dir=tmp_path / f"run{i}")
            assert not (tmp_path / f"run{i}").exists()
    # a dataset that a prepare-* command is writing now is not read half written
    with held_by_another_process(wf_synthetic):
        with pytest.raises(CometError, match=f"reads {lmdb}, and another cometctl command is preparing a dataset"):
            tr.prepare_run(tmp_path / "solver0.prototxt", cpu=True, run_dir=tmp_path / "busy")
    assert not (tmp_path / "busy").exists()


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
    with pytest.raises(CometError, match="needs .*train_lmdb.*prepare-images"):
        tr.prepare_run(solver, cpu=True, run_dir=tmp_path / "b")
    # every data layer's source is checked, not only Data's (an ImageData list here)
    (tmp_path / "img.prototxt").write_text(
        'layer { name: "images" type: "ImageData" top: "data" top: "label" '
        'image_data_param { source: "lists/none.txt" batch_size: 2 } }\n')
    (tmp_path / "img_solver.prototxt").write_text(f'net: "{tmp_path}/img.prototxt"\nmax_iter: 1\nbase_lr: 0.1\n')
    with pytest.raises(CometError, match="layer 'images' needs lists/none.txt, which does not exist"):
        tr.prepare_run(tmp_path / "img_solver.prototxt", cpu=True, run_dir=tmp_path / "c")
    # our own datasets' folders name the command that makes them
    from cometctl.paths import prepare_hint

    assert "prepare-dogs --synthetic" in prepare_hint("data/synthetic/train_lmdb")
    assert "prepare-dogs`" in prepare_hint("/elsewhere/data/dogs/mean.binaryproto")
    assert "prepare-imagenet" in prepare_hint("data/imagenet/val_lmdb")
    assert "prepare-images" in prepare_hint("examples/mnist/mnist_train_lmdb")
    with pytest.raises(CometError, match="solverstate"):
        tr.train(solver, snapshot=solver)
    # a GPU solver on a CPU-only build (and, here, no driver either)
    from cometctl import device, paths

    def only_cpu(name, variant=None, override=None):
        if variant == "cuda":
            raise CometError("not built")
        return Path("/bin/true")

    monkeypatch.setattr(paths, "tool_path", only_cpu)
    monkeypatch.setattr(device, "DEV_DIR", tmp_path / "no-dev")
    monkeypatch.setattr(device, "load_driver", _no_driver)
    with pytest.raises(CometError, match="only the CPU-only build"):
        tr._caffe_binary(uses_gpu=True)
    gpu_solver = tmp_path / "gpu.prototxt"
    gpu_solver.write_text(f'net: "{REPO}/models/comet_tiny/deploy.prototxt"\nmax_iter: 1\nsolver_mode: GPU\n')
    with pytest.raises(CometError, match="pass --cpu"):
        tr.train(gpu_solver, run_dir=tmp_path / "never")
    assert not (tmp_path / "never").exists()  # refused before anything was written
    r = CliRunner().invoke(main, ["train", "--solver", str(tmp_path / "nope.prototxt")])
    assert r.exit_code != 0 and "Traceback" not in r.output and "no such file" in r.output


def _no_driver():
    raise OSError("libcuda.so.1: cannot open shared object file: No such file or directory")


FAKE_CAFFE = textwrap.dedent("""\
    import os, sys, time
    print("env OPENBLAS_THREAD_TIMEOUT=" + os.environ.get("OPENBLAS_THREAD_TIMEOUT", "unset"), flush=True)
    print("I1130 10:00:00.000000 1 solver.cpp:218] Iteration 0 (0 iter/s), loss = 2.3", flush=True)
    print("I1130 10:00:00.000000 1 solver.cpp:237]     Train net output #0: loss = 2.3", flush=True)
    print("I1130 10:00:00.000000 1 sgd_solver.cpp:105] Iteration 0, lr = 0.01", flush=True)
    print("I1130 10:00:01.000000 1 comet.cpp:1] COMET total: ratio 9.5x, 100 MB -> 10.5 MB", flush=True)
    print("F1130 10:00:02.000000 1 net.cpp:1] Check failed: something broke", flush=True)
    sys.exit(int(sys.argv[-1]) if sys.argv[-1].isdigit() else 3)
""")


def test_caffe_status_and_log_are_kept(tmp_path, wf_pb2, wf_synthetic, capsys, monkeypatch):
    monkeypatch.delenv("OPENBLAS_THREAD_TIMEOUT", raising=False)
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
    assert "env OPENBLAS_THREAD_TIMEOUT=4" in log  # OpenBLAS's idle threads sleep at once (childenv)
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert info["exit_status"] == 3 and info["command"][0] == str(fake) and "-sigint_effect" in info["command"]
    assert info["cwd"] == str(REPO)
    with pytest.raises(CometError, match="already holds a run"):
        tr.prepare_run(solver, cpu=True, run_dir=tmp_path / "run")


def test_a_python_error_is_named_where_caffe_printed_no_fatal_line(tmp_path, wf_pb2, wf_synthetic):
    """A Python layer whose import fails aborts caffe through boost::python: the error is the Python one,
    not the last line of the stack trace that follows it."""
    fake = tmp_path / "fake_caffe"
    fake.write_text(f"#!{sys.executable}\n" + textwrap.dedent("""\
        import os
        print("Traceback (most recent call last):", flush=True)
        print('  File "/work/layers.py", line 1, in <module>', flush=True)
        print("ModuleNotFoundError: No module named 'caffe'", flush=True)
        print("terminate called after throwing an instance of 'boost::python::error_already_set'", flush=True)
        print("*** Aborted at 1796435510 (unix time) try date -d @1796435510 if you are using GNU date ***",
              flush=True)
        print("PC: @                0x0 (unknown)", flush=True)
        print("    @     0x5625c6034241 _start", flush=True)
        os.abort()
    """))
    fake.chmod(0o755)
    solver = wf_point_model_at(wf_pb2, REPO / "models" / "comet_tiny", wf_synthetic, tmp_path / "m")
    with pytest.raises(CometError, match=r"before training started \(exit status 134\): ModuleNotFoundError: "
                                         r"No module named 'caffe'; full log"):
        tr.train(solver, cpu=True, run_dir=tmp_path / "run", caffe_bin=fake)


def test_python_layers_find_pycaffe_and_numpy_after_the_users_own_path(tmp_path, monkeypatch):
    from cometctl.childenv import caffe_env

    cmake = tmp_path / "build" / "cpu" / "cmake"
    (cmake / "tools").mkdir(parents=True)
    (cmake / "tools" / "caffe").write_text("")
    pycaffe = tmp_path / "build" / "cpu" / "src" / "python"
    (pycaffe / "caffe").mkdir(parents=True)
    (pycaffe / "caffe" / "_caffe.so").write_text("")
    monkeypatch.setenv("PYTHONPATH", "/my/layers")
    parts = caffe_env(cmake / "tools" / "caffe")["PYTHONPATH"].split(os.pathsep)
    import numpy
    import sysconfig

    assert parts[0] == "/my/layers" and parts[1] == str(pycaffe)
    assert sysconfig.get_paths()["purelib"] in parts
    assert any(Path(numpy.__file__).is_relative_to(p) for p in parts[2:])


@WF_NEEDS_BUILD
def test_a_net_with_a_python_layer_trains_and_a_solver_without_display_still_reports(tmp_path, monkeypatch):
    """`caffe`'s embedded Python imports the user's layer (PYTHONPATH), pycaffe and numpy; a solver without
    `display` gets one in the run's copy, so the finished run reads as one (it said 'nothing to train')."""
    (tmp_path / "layers").mkdir()
    (tmp_path / "layers" / "twice.py").write_text(textwrap.dedent("""\
        import caffe, numpy as np
        class Twice(caffe.Layer):
            def setup(self, bottom, top): pass
            def reshape(self, bottom, top): top[0].reshape(*bottom[0].data.shape)
            def forward(self, bottom, top): top[0].data[...] = 2 * np.asarray(bottom[0].data)
            def backward(self, top, propagate_down, bottom):
                if propagate_down[0]: bottom[0].diff[...] = 2 * top[0].diff
    """))
    (tmp_path / "net.prototxt").write_text(textwrap.dedent("""\
        layer { name: "data" type: "DummyData" top: "data" top: "label"
          dummy_data_param { shape { dim: 4 dim: 3 dim: 8 dim: 8 } shape { dim: 4 }
            data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 1 } } }
        layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
          convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "gaussian" std: 0.1 } } }
        layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
        layer { name: "twice" type: "Python" bottom: "conv1" top: "twice" python_param { module: "twice" layer: "Twice" } }
        layer { name: "ip" type: "InnerProduct" bottom: "twice" top: "ip" inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.1 } } }
        layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
    """))
    (tmp_path / "solver.prototxt").write_text(
        f'net: "{tmp_path / "net.prototxt"}"\nbase_lr: 0.01\nlr_policy: "fixed"\nmax_iter: 4\n'
        "solver_mode: CPU\ncomet { eb_mode: FIXED error_bound: 1e-3 }\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "layers"))
    r = CliRunner().invoke(main, ["train", "--solver", str(tmp_path / "solver.prototxt"), "--cpu",
                                  "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == 0, (r.output, (tmp_path / "run" / "caffe.log").read_text()[-3000:])
    out = " ".join(r.output.split())
    assert "no display interval: the run's copy shows every 1 iteration(s)" in out
    assert "done after iteration 4" in out and "iter 3/4" in out


def test_the_stores_warnings_are_shown_with_the_progress(tmp_path):
    """A fixed error bound the first step estimates far off (a Convolution before a BatchNorm, its
    inputs of spread 0.01 under a bound of 0.02: fuzz seed 800's case) is a COMET warning in
    caffe.log; the view shows it too, once, where the progress lines would hide the log."""
    (tmp_path / "net.prototxt").write_text(textwrap.dedent("""\
        layer { name: "data" type: "DummyData" top: "data" top: "label"
          dummy_data_param { shape { dim: 4 dim: 3 dim: 8 dim: 8 } shape { dim: 4 }
            data_filler { type: "gaussian" std: 1 } data_filler { type: "uniform" min: 0 max: 3.99 } } }
        layer { name: "narrow" type: "Power" bottom: "data" top: "narrow" power_param { scale: 0.01 shift: 3 } }
        layer { name: "conv1" type: "Convolution" bottom: "narrow" top: "conv1"
          convolution_param { num_output: 8 kernel_size: 3 weight_filler { type: "gaussian" std: 0.2 } } }
        layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "bn1" }
        layer { name: "ip" type: "InnerProduct" bottom: "bn1" top: "ip" inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.1 } } }
        layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
    """))
    (tmp_path / "solver.prototxt").write_text(
        f'net: "{tmp_path / "net.prototxt"}"\nbase_lr: 0.01\nlr_policy: "fixed"\nmax_iter: 3\ndisplay: 1\n'
        "solver_mode: CPU\ncomet { eb_mode: FIXED error_bound: 0.02 }\n")
    r = CliRunner().invoke(main, ["train", "--solver", str(tmp_path / "solver.prototxt"), "--cpu",
                                  "--run-dir", str(tmp_path / "run")])
    log = (tmp_path / "run" / "caffe.log").read_text()
    assert r.exit_code == 0, (r.output, log[-3000:])
    warned = [line for line in log.splitlines() if line.startswith("W") and "conv1's fixed error bound" in line]
    assert len(warned) == 1, log[-3000:]
    out = " ".join(r.output.split())  # rich wraps long lines
    assert out.count("COMET: layer conv1's fixed error bound 0.02 puts its weight gradient an estimated") == 1, out
    assert "eb_mode: ADAPTIVE would pick" in out, out
    assert "bn1's fixed error bound" not in out, "an INFO line (bn1's estimate is small) stays in the log"


def _solver_naming_nets(pb2, wf_synthetic, folder: Path, how: str) -> Path:
    """comet_tiny's solver with its nets named the other ways Caffe allows: `inline` (net_param), or
    `split` (train_net file, then two test nets: one test_net_param inline and one test_net file)."""
    from cometctl.caffeproto import read_text_proto, write_text_proto

    solver = wf_point_model_at(pb2, REPO / "models" / "comet_tiny", wf_synthetic, folder, test_interval=2,
                               test_iter=1, display=1, snapshot=0)
    param = read_text_proto(solver, pb2.SolverParameter())
    net = read_text_proto(param.net, pb2.NetParameter())
    param.ClearField("net")
    if how == "inline":
        param.net_param.CopyFrom(net)
    else:
        param.train_net = str(folder / "train_val.prototxt")
        param.test_net_param.add().CopyFrom(net)
        param.test_net.append(str(folder / "train_val.prototxt"))
        param.test_iter.append(1)
    write_text_proto(solver, param)
    return solver


@WF_NEEDS_BUILD
@pytest.mark.parametrize("how", ["inline", "split"])
def test_solvers_that_name_their_nets_as_caffe_allows_train(tmp_path, wf_pb2, wf_synthetic, how):
    """net_param, train_net(_param) and test_net(_param) (upstream's lenet_consolidated_solver and the
    LeNet notebook's solver name nets so) were refused as 'not supported'; the run's folder now keeps each
    net as a file, the copy of the solver names them, and caffe tests on every test net."""
    from cometctl.caffeproto import read_text_proto

    solver = _solver_naming_nets(wf_pb2, wf_synthetic, tmp_path / "m", how)
    original = solver.read_text()
    run = tmp_path / "run"
    assert tr.train(solver, cpu=True, iters=4, run_dir=run) == 0, (run / "caffe.log").read_text()[-3000:]
    assert solver.read_text() == original
    copy = read_text_proto(run / "solver.prototxt", wf_pb2.SolverParameter())
    assert not copy.HasField("net_param") and not copy.HasField("train_net_param") and not copy.test_net_param
    log = (run / "caffe.log").read_text()
    assert "Optimization Done" in log
    if how == "inline":
        assert copy.net == str(run / "train_val.prototxt") and not copy.train_net
        assert "Testing net (#0)" in log and "Testing net (#1)" not in log
    else:
        assert copy.train_net == str(run / "train_net.prototxt") and not copy.net
        assert list(copy.test_net) == [str(run / "test_net_0.prototxt"), str(run / "test_net_1.prototxt")]
        assert (run / "test_net_1.prototxt").read_text() == (tmp_path / "m" / "train_val.prototxt").read_text()
        inline = read_text_proto(run / "test_net_0.prototxt", wf_pb2.NetParameter())
        assert [layer.name for layer in inline.layer][:2] == ["data", "data"]  # TRAIN's and TEST's
        assert "Testing net (#1)" in log and "Test net output #0: accuracy" in log
        tested = parse_file(run / "caffe.log").test_rows()
        assert tested and {"accuracy", "accuracy #1"} <= set(tested[-1]) and "accuracy #2" not in tested[-1]
    assert tr.train(solver, cpu=True, iters=4, run_dir=tmp_path / "run-again") == 0  # the copy is not needed


@WF_NEEDS_BUILD
def test_a_project_folders_relative_paths_resolve_as_caffe_train_started_there(tmp_path, wf_synthetic,
                                                                              monkeypatch, capsys):
    """A solver in one's own folder names `net: "net.prototxt"` and `data/train_lmdb`, as for `caffe train`
    started there (upstream's examples are written so for upstream's tree): train and plan looked for them
    under the repository root only ('net.prototxt not found'). caffe now runs in the current folder when
    the solver's net is found from there."""
    proj = tmp_path / "proj"
    (proj / "data").mkdir(parents=True)
    for name in ("train_lmdb", "val_lmdb", "mean.binaryproto"):
        (proj / "data" / name).symlink_to(wf_synthetic / name)
    net = (REPO / "models/comet_tiny/train_val.prototxt").read_text().replace("data/synthetic/", "data/")
    (proj / "net.prototxt").write_text(net)
    solver = (REPO / "models/comet_tiny/solver.prototxt").read_text().replace(
        '"models/comet_tiny/train_val.prototxt"', '"net.prototxt"').replace("test_interval: 100", "test_interval: 1000")
    (proj / "solver.prototxt").write_text(solver)
    monkeypatch.chdir(proj)
    run = tmp_path / "run"
    assert tr.train("solver.prototxt", cpu=True, iters=2, run_dir=run) == 0, (run / "caffe.log").read_text()[-3000:]
    assert json.loads((run / "run.json").read_text())["cwd"] == str(proj)
    assert f"in {proj}:" in capsys.readouterr().err  # said before the command line
    assert "Opened lmdb data/train_lmdb" in (run / "caffe.log").read_text()
    r = subprocess.run([_cometctl(), "plan", "--solver", "solver.prototxt", "--cpu", "--measure", "4,8",
                        "--iters", "1"], capture_output=True, text=True, cwd=proj, timeout=600)
    assert r.returncode == 0 and "predicted peak at the solver's batch" in r.stdout, r.stdout + r.stderr
    # a net named by its absolute path: its own relative data paths decide
    from cometctl.caffeproto import caffe_pb2, read_solver

    (proj / "abs_solver.prototxt").write_text(solver.replace('"net.prototxt"', f'"{proj / "net.prototxt"}"'))
    assert read_solver("abs_solver.prototxt", caffe_pb2())[4] == proj
    # from elsewhere, the same solver's net is not found, and the message says where it looked
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CometError, match=rf"net net.prototxt not found \(relative paths start at .*{tmp_path.name}"):
        tr.prepare_run(proj / "solver.prototxt", cpu=True, run_dir=tmp_path / "elsewhere")


def test_resuming_with_no_iterations_left_is_refused_before_anything_runs(tmp_path, wf_pb2, wf_synthetic):
    """--iters counts from the start of the run (caffe's max_iter): resuming at 20 with --iters 10 trained
    nothing, wrote the snapshot of iteration 20 again and said 'done'."""
    solver = wf_point_model_at(wf_pb2, REPO / "models" / "comet_tiny", wf_synthetic, tmp_path / "m", max_iter=15)
    state = tmp_path / "old" / "m_iter_20.solverstate"
    state.parent.mkdir()
    state.write_bytes(b"")
    with pytest.raises(CometError, match=r"--iters 10 is not beyond the snapshot's iteration 20.*--iters 30 "
                                         r"trains 10 more"):
        tr.prepare_run(solver, cpu=True, iters=10, run_dir=tmp_path / "a", resume=state)
    with pytest.raises(CometError, match=r"max_iter 15 is not beyond the snapshot's iteration 20.*N > 20"):
        tr.prepare_run(solver, cpu=True, run_dir=tmp_path / "b", resume=state)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    run, copy, _, _ = tr.prepare_run(solver, cpu=True, iters=21, run_dir=tmp_path / "c", resume=state)
    assert "max_iter: 21" in copy.read_text()


def test_solvers_that_name_no_train_net_or_two_are_refused(tmp_path, wf_pb2):
    net = REPO / "models/comet_tiny/train_val.prototxt"
    cases = {"": "names no train net", f'net: "{net}"\ntrain_net: "{net}"': "more than once \\(net, train_net\\)",
             'train_net: "nowhere/n.prototxt"': "train_net nowhere/n.prototxt not found",
             f'net: "{net}"\ntest_net: "nowhere/t.prototxt"\ntest_iter: 1': "test_net nowhere/t.prototxt not found"}
    for i, (text, why) in enumerate(cases.items()):
        solver = tmp_path / f"s{i}.prototxt"
        solver.write_text(text + '\nbase_lr: 0.1\nlr_policy: "fixed"\n')
        with pytest.raises(CometError, match=why):
            tr.prepare_run(solver, cpu=True, run_dir=tmp_path / f"r{i}")
        assert not (tmp_path / f"r{i}").exists()


def test_a_run_killed_by_a_signal_names_it(tmp_path, wf_pb2, wf_synthetic, capsys):
    """A bus error (a damaged memory-mapped file) or a segfault ends caffe without a fatal line of its own."""
    fake = tmp_path / "fake_caffe"
    fake.write_text(f"#!{sys.executable}\n" + textwrap.dedent("""\
        import os, signal
        print("I1130 10:00:00.000000 1 solver.cpp:218] Iteration 0 (0 iter/s), loss = 2.3", flush=True)
        signal.signal(signal.SIGBUS, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGBUS)
    """))
    fake.chmod(0o755)
    solver = wf_point_model_at(wf_pb2, REPO / "models" / "comet_tiny", wf_synthetic, tmp_path / "m")
    assert tr.train(solver, cpu=True, run_dir=tmp_path / "run", caffe_bin=fake) == 128 + signal.SIGBUS
    shown = " ".join(capsys.readouterr().err.split())
    assert "exited with status 135 (killed by SIGBUS: Bus error)" in shown


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
                     "model_iter_30.resumestate", "model_iter_30.solverstate"]
    assert "COMET total: activations" in log
    assert json.loads((wf_short_run / "run.json").read_text())["exit_status"] == 0


@WF_NEEDS_BUILD
def test_weights_fine_tune_from_a_caffemodel(wf_short_run, wf_pb2, wf_synthetic, tmp_path):
    """--weights is caffe's -weights (upstream's finetune_flickr_style starts so): the first loss starts
    where the trained model left off, not at a fresh net's."""
    solver = wf_point_model_at(wf_pb2, REPO / "models" / "comet_tiny", wf_synthetic, tmp_path / "m",
                               display=1, test_initialization=False, snapshot=0)
    weights = wf_short_run / "snapshots" / "model_iter_30.caffemodel"
    first = {}
    for name, extra in (("tuned", ["--weights", str(weights)]), ("fresh", [])):
        r = CliRunner().invoke(main, ["train", "--solver", str(solver), "--cpu", "--iters", "1",
                                      "--run-dir", str(tmp_path / name), *extra])
        assert r.exit_code == 0, (r.output, (tmp_path / name / "caffe.log").read_text()[-3000:])
        first[name] = parse_file(tmp_path / name / "caffe.log").train_rows()[0]["loss"]
    assert first["tuned"] < first["fresh"] - 0.1, first
    info = json.loads((tmp_path / "tuned" / "run.json").read_text())
    assert info["command"][info["command"].index("-weights") + 1] == str(weights)
    assert "Finetuning from" in (tmp_path / "tuned" / "caffe.log").read_text()
    for args, says in ((["--weights", str(weights), "--snapshot", str(weights)], "give one of them"),
                       (["--weights", str(tmp_path / "none.caffemodel")], "none.caffemodel: no such file"),
                       (["--weights", f"{weights},"], "an empty file name")):
        r = CliRunner().invoke(main, ["train", "--solver", str(solver), "--cpu", *args])
        assert r.exit_code != 0 and says in r.output and "Traceback" not in r.output, (args, r.output)
    state = next((wf_short_run / "snapshots").glob("*.solverstate"))
    r = CliRunner().invoke(main, ["train", "--solver", str(solver), "--cpu", "--weights", str(state)])
    assert r.exit_code != 0 and "resume from it with --snapshot" in r.output


def _cometctl() -> str:
    return str(Path(sys.executable).parent / "cometctl")


@WF_NEEDS_BUILD
def test_ctrl_c_exits_130_names_the_snapshot_and_its_resume_line_goes_on_in_the_same_folder(
        tmp_path, wf_pb2, wf_synthetic):
    """Issue 15, 3: Ctrl-C is status 130 and names the iteration of the snapshot caffe wrote; the printed
    line resumes on the same device, to the same --iters, in the same run folder, whose caffe.log and
    COMET statistics go on so that report sees one run."""
    from cometctl.report import report

    solver = wf_point_model_at(wf_pb2, REPO / "models" / "comet_tiny", wf_synthetic, tmp_path / "m",
                               display=1, test_interval=100000, test_initialization=False, snapshot=0)
    run, iters = tmp_path / "run", 60
    proc = subprocess.Popen([_cometctl(), "train", "--solver", str(solver), "--cpu", "--iters", str(iters),
                             "--run-dir", str(run)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            log = run / "caffe.log"
            if log.exists() and "Iteration 5," in log.read_text():
                break
            time.sleep(0.1)
        else:
            pytest.fail("training did not reach iteration 5")
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out
    assert "Traceback" not in out
    states = list((run / "snapshots").glob("*.solverstate"))
    assert len(states) == 1, out
    stopped_at = tr.snapshot_iteration(states[0])
    assert 5 <= stopped_at < iters, out
    assert f"stopped at iteration {stopped_at};" in " ".join(out.split()), out
    info = json.loads((run / "run.json").read_text())
    assert info["interrupted"] is True and info["exit_status"] == 130 and info["last_iteration"] == stopped_at

    resume = [line for line in out.splitlines() if line.startswith("resume with: ")]
    assert len(resume) == 1, out
    argv = shlex.split(resume[0][len("resume with: "):])
    assert argv[:4] == ["cometctl", "train", "--solver", str(solver)], argv
    assert "--cpu" in argv and argv[argv.index("--iters") + 1] == str(iters)
    assert argv[argv.index("--run-dir") + 1] == str(run) and argv[argv.index("--snapshot") + 1] == str(states[0])

    first = (run / "caffe.log").read_text()
    r = subprocess.run([_cometctl(), *argv[1:]], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    log = (run / "caffe.log").read_text()
    assert log.startswith(first), "the resumed session must append to the run's caffe.log"
    assert f"Resuming from {states[0]}" in log and log.count("Starting Optimization") == 2
    assert log.count("Optimization stopped early") == 1 and log.rstrip().endswith("Optimization Done.")
    assert f"done after iteration {iters}" in " ".join(r.stderr.split())
    assert (run / "snapshots" / f"m_iter_{iters}.solverstate").exists()
    # one continuous run: every iteration once, in order, across both sessions
    assert [row["NumIters"] for row in parse_file(run / "caffe.log").train_rows()] == list(range(iters))
    report(run)
    with open(run / "report" / "train.csv") as f:
        assert [int(row["NumIters"]) for row in csv.DictReader(f)] == list(range(iters))
    # the fork's statistics file goes on in the same series
    with open(run / "snapshots" / "m_comet.csv") as f:
        rows = list(csv.DictReader(f))
    assert sum(1 for line in (run / "snapshots" / "m_comet.csv").read_text().splitlines()
               if line.startswith("iter,")) == 1
    totals = [int(row["iter"]) for row in rows if row["layer"] == "total"]
    assert totals == sorted(set(totals)) and totals[0] < stopped_at <= totals[-1], totals
    info = json.loads((run / "run.json").read_text())
    assert info["exit_status"] == 0 and info["resumed_from"] == str(states[0])
    assert [s["exit_status"] for s in info["earlier_sessions"]] == [130]

    # a snapshot can also start a new run folder, which goes on from the snapshot's iteration
    code = tr.train(solver, cpu=True, snapshot=states[0], iters=stopped_at + 2, run_dir=tmp_path / "other")
    assert code == 0
    rows = parse_file(tmp_path / "other" / "caffe.log").train_rows()
    assert [row["NumIters"] for row in rows] == [stopped_at, stopped_at + 1]
    assert (tmp_path / "other" / "snapshots" / f"m_iter_{stopped_at + 2}.solverstate").exists()
    assert (tmp_path / "other" / "snapshots" / "m_comet.csv").exists()


def test_a_run_folder_that_holds_a_run_takes_only_its_own_snapshots(tmp_path, wf_pb2, wf_synthetic):
    solver = wf_point_model_at(wf_pb2, REPO / "models" / "comet_tiny", wf_synthetic, tmp_path / "m")
    run, _, _, _ = tr.prepare_run(solver, cpu=True, iters=7, run_dir=tmp_path / "run")
    (run / "caffe.log").write_text("")
    state = run / "snapshots" / "m_iter_3.solverstate"
    state.write_bytes(b"")
    foreign = tmp_path / "elsewhere" / "m_iter_3.solverstate"
    foreign.parent.mkdir()
    foreign.write_bytes(b"")
    with pytest.raises(CometError, match="already holds a run.*--snapshot"):
        tr.prepare_run(solver, cpu=True, iters=9, run_dir=run)
    with pytest.raises(CometError, match="already holds a run"):
        tr.prepare_run(solver, cpu=True, iters=9, run_dir=run, resume=foreign)
    _, copy, _, _ = tr.prepare_run(solver, cpu=True, iters=9, run_dir=run, resume=state)
    from cometctl.caffeproto import read_text_proto

    p = read_text_proto(copy, wf_pb2.SolverParameter())
    assert p.max_iter == 9 and p.snapshot_prefix == str(run / "snapshots" / "m")
    # the run's own solver copy, given again to go on with the run: its net is the run's own file
    _, again, _, _ = tr.prepare_run(copy, cpu=True, iters=11, run_dir=run, resume=state)
    p = read_text_proto(again, wf_pb2.SolverParameter())
    assert p.max_iter == 11 and p.net == str(run / "train_val.prototxt")
    assert "layer" in (run / "train_val.prototxt").read_text()


def test_resume_line_reproduces_device_iterations_and_folder(tmp_path):
    state = tmp_path / "run dir" / "snapshots" / "m_iter_293.solverstate"
    line = tr.resume_command("models/x/solver.prototxt", state, tmp_path / "run dir", 500, True, None)
    assert shlex.split(line) == ["cometctl", "train", "--solver", "models/x/solver.prototxt", "--cpu",
                                 "--iters", "500", "--run-dir", str(tmp_path / "run dir"),
                                 "--snapshot", str(state)]
    line = tr.resume_command("s.prototxt", state, tmp_path, 500, False, "0,1")
    assert shlex.split(line)[3:6] == ["s.prototxt", "--gpu", "0,1"] and "--cpu" not in line
    assert tr.snapshot_iteration(state) == 293 and tr.snapshot_iteration("m_iter_7.solverstate.h5") == 7
    assert tr.snapshot_iteration("weights.caffemodel") is None


def test_a_resumed_log_reads_as_one_run():
    """The marker `cometctl train` writes before a resumed session: what the earlier session logged from
    the resume point on is replaced by the new session, and time does not count the pause."""
    from cometctl.caffelog import LogParser, resume_marker

    def step(it, sec, loss):
        return [f"I1130 10:00:{sec:02d}.000000 1 solver.cpp:218] Iteration {it} (1 iter/s), loss = {loss}",
                f"I1130 10:00:{sec:02d}.000000 1 solver.cpp:237]     Train net output #0: loss = {loss}",
                f"I1130 10:00:{sec:02d}.000000 1 sgd_solver.cpp:105] Iteration {it}, lr = 0.01",
                f"I1130 10:00:{sec:02d}.100000 1 store.cpp:1] COMET total: ratio 9.5x"]

    lines = [line for it in range(8) for line in step(it, it, 2.0)]  # the first session went on to 7
    lines.append(resume_marker("/r/snapshots/m_iter_5.solverstate", 5))  # resumed from an earlier snapshot
    lines += [line.replace("10:00:", "11:00:") for it in range(5, 10) for line in step(it, it, 1.0)]
    p = LogParser()
    for line in lines:
        p.feed(line)
    rows = p.train_rows()
    assert [r["NumIters"] for r in rows] == list(range(10))
    assert [r["loss"] for r in rows] == [2.0] * 5 + [1.0] * 5
    assert [r["NumIters"] for r in p.comet] == list(range(10))
    seconds = [r["Seconds"] for r in rows]
    assert seconds == sorted(seconds) and seconds[-1] < 20, seconds  # not the hour in between
    assert p.started


FAILS_TO_START = textwrap.dedent("""\
    import os, sys
    print("I1201 10:00:00.000000 1 caffe.cpp:204] Using GPUs 0", flush=True)
    print("F1201 10:00:00.100000 1 common.cpp:152] Check failed: error == cudaSuccess (35 vs. 0)  CUDA "
          "driver version is insufficient for CUDA runtime version", flush=True)
    print("*** Check failure stack trace: ***", flush=True)
    print("    @     0x7f2a1c0b2b03  google::LogMessage::Fail()", flush=True)
    os.abort()
""")


def test_a_run_that_fails_to_start_is_one_error_without_a_report_hint(tmp_path, wf_pb2, wf_synthetic, capsys):
    fake = tmp_path / "fake_caffe"
    fake.write_text(f"#!{sys.executable}\n" + FAILS_TO_START)
    fake.chmod(0o755)
    solver = wf_point_model_at(wf_pb2, REPO / "models" / "comet_tiny", wf_synthetic, tmp_path / "m")
    with pytest.raises(CometError, match=r"before training started \(exit status 134\): Check failed: error == "
                                         r"cudaSuccess.*full log") as e:
        tr.train(solver, cpu=True, run_dir=tmp_path / "run", caffe_bin=fake)
    assert e.value.exit_code == 134
    shown = capsys.readouterr().err
    assert "cometctl report" not in shown and "resume with" not in shown
    assert json.loads((tmp_path / "run" / "run.json").read_text())["exit_status"] == 134
    assert "stack trace" in (tmp_path / "run" / "caffe.log").read_text()  # all of it is in the log


DIVERGES = textwrap.dedent("""\
    for it, loss in ((0, "2.3"), (10, "1.9"), (20, "nan"), (30, "-nan"), (40, "inf")):
        print(f"I1205 10:00:{it:02d}.000000 1 solver.cpp:218] Iteration {it} (1 iter/s), loss = {loss}")
        print(f"I1205 10:00:{it:02d}.000000 1 solver.cpp:237]     Train net output #0: loss = {loss}")
        print(f"I1205 10:00:{it:02d}.000000 1 sgd_solver.cpp:105] Iteration {it}, lr = 0.5")
    print("I1205 10:00:50.000000 1 solver.cpp:464] Optimization Done.")
""")


def test_a_diverging_run_says_so_once_and_at_the_end(tmp_path, wf_pb2, wf_synthetic, capsys):
    """Caffe trains on after its loss turns NaN, as upstream's does; the view says once where it
    diverged and what usually helps, and the closing line repeats it."""
    fake = tmp_path / "fake_caffe"
    fake.write_text(f"#!{sys.executable}\n" + DIVERGES)
    fake.chmod(0o755)
    solver = wf_point_model_at(wf_pb2, REPO / "models" / "comet_tiny", wf_synthetic, tmp_path / "m")
    assert tr.train(solver, cpu=True, run_dir=tmp_path / "run", caffe_bin=fake) == 0
    shown = " ".join(capsys.readouterr().err.split())  # rich wraps long lines
    assert shown.count("training diverged") == 1, shown
    assert "loss not finite at iteration 20: training diverged" in shown, shown
    assert "A lower base_lr (now 0.5)" in shown, shown
    assert "(diverged: outputs not finite since iteration 20)" in shown, shown


def _fake_cuda_build(tmp_path: Path, cuda: str = "13.0") -> Path:
    cmake = tmp_path / "cuda-build" / "cmake"
    (cmake / "tools").mkdir(parents=True)
    (cmake / "CMakeCache.txt").write_text(f"CPU_ONLY:BOOL=OFF\nCUDA_VERSION:STRING={cuda}\n")
    (cmake / "tools" / "caffe").write_text("#!/bin/sh\nexit 99\n")
    (cmake / "tools" / "caffe").chmod(0o755)
    return cmake / "tools" / "caffe"


@pytest.mark.parametrize("builds", ["cuda", "cpu-only"])
def test_gpu_solver_without_a_gpu_is_one_line_that_suggests_cpu(tmp_path, wf_pb2, monkeypatch, builds):
    """Issue 15, 8: the shipped CaffeNet solver (solver_mode: GPU) on a machine without a GPU, before
    anything starts (and before its data would be asked for)."""
    from cometctl import device, paths

    cuda_caffe = _fake_cuda_build(tmp_path)

    def tools(name, variant=None, override=None):
        if variant == "cuda" and builds != "cuda":
            raise CometError("'caffe' is not built yet")
        return cuda_caffe if variant == "cuda" else Path("/bin/true")  # /bin/true: the CPU-only build

    monkeypatch.setattr(paths, "tool_path", tools)
    monkeypatch.setattr(device, "DEV_DIR", tmp_path / "dev")  # an empty /dev: no nvidia* files
    (tmp_path / "dev").mkdir()
    monkeypatch.setattr(device, "load_driver", _no_driver)
    r = CliRunner().invoke(main, ["train", "--solver", "models/bvlc_reference_caffenet/solver.prototxt",
                                  "--run-dir", str(tmp_path / "never")])
    assert r.exit_code == 1, r.output
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("cometctl: error: no usable GPU"), r.output
    assert "no NVIDIA driver" in lines[0] and "pass --cpu" in lines[0]
    if builds == "cpu-only":
        assert "only the CPU-only build" in lines[0]
    assert "report" not in r.output and "Traceback" not in r.output
    assert not (tmp_path / "never").exists()


def test_gpu_problems_stop_before_caffe_starts(tmp_path, wf_pb2, wf_synthetic, monkeypatch, capsys):
    """With the data ready and a CUDA build, the driver decides; a usable GPU lets caffe start."""
    from cometctl import device
    from test_device import FakeDriver

    solver = wf_point_model_at(wf_pb2, REPO / "models" / "comet_tiny", wf_synthetic, tmp_path / "m",
                               solver_mode=wf_pb2.SolverParameter.GPU)
    fake = _fake_cuda_build(tmp_path)  # exits 99 at once if it is started
    monkeypatch.setattr(device, "load_driver", lambda: FakeDriver(init=device.CUDA_ERROR_NO_DEVICE))
    with pytest.raises(CometError, match=r"no usable GPU for the solver \(solver_mode: GPU\): .*no CUDA device.*"
                                         r"pass --cpu"):
        tr.train(solver, run_dir=tmp_path / "a", caffe_bin=fake)
    monkeypatch.setattr(device, "load_driver", lambda: FakeDriver(count=1))
    with pytest.raises(CometError, match="no usable GPU for --gpu 1: there is no GPU 1"):
        tr.train(solver, gpu="1", run_dir=tmp_path / "b", caffe_bin=fake)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    capsys.readouterr()
    with pytest.raises(CometError, match=r"before training started \(exit status 99\)") as e:
        tr.train(solver, gpu="0", run_dir=tmp_path / "c", caffe_bin=fake)
    assert e.value.exit_code == 99 and "cometctl report" not in capsys.readouterr().err
    # --cpu needs no GPU: nothing is asked of the driver
    monkeypatch.setattr(device, "load_driver", _no_driver)
    with pytest.raises(CometError, match="exit status 99"):
        tr.train(solver, cpu=True, run_dir=tmp_path / "d", caffe_bin=fake)


def test_help_explains():
    r = CliRunner().invoke(main, ["train", "--help"])
    assert r.exit_code == 0
    for word in ("--solver", "--gpu", "--cpu", "--snapshot", "--iters", "--run-dir", "Ctrl-C"):
        assert word in r.output
