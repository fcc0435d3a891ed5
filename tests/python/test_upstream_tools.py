"""Upstream Caffe's own log and net tools (tools/extra in the patched tree) on the fork's logs
and nets, under Python 3 (patch 0017) and with the classic log prefix (patch 0016)."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import WF_NEEDS_BUILD, WF_REPO


def _tools() -> Path:
    from cometctl.paths import pycaffe_dir

    return pycaffe_dir().parent / "tools" / "extra"


def _env() -> dict:
    from cometctl.paths import pycaffe_dir

    return dict(os.environ, PYTHONPATH=str(pycaffe_dir()), MPLBACKEND="Agg")


@WF_NEEDS_BUILD
def test_parse_log_writes_its_two_csvs_from_a_cometctl_run(wf_short_run, tmp_path):
    log = wf_short_run / "caffe.log"
    assert "COMET" in log.read_text()  # the fork's own lines are in it
    out = subprocess.run([sys.executable, str(_tools() / "parse_log.py"), str(log), str(tmp_path)],
                         capture_output=True, text=True, env=_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    train = list(csv.DictReader(open(tmp_path / "caffe.log.train")))
    test = list(csv.DictReader(open(tmp_path / "caffe.log.test")))
    # 30 iterations displayed every 5, tested every 15 (conftest.wf_short_run)
    assert [int(float(r["NumIters"])) for r in train] == list(range(0, 30, 5))
    assert {"NumIters", "Seconds", "LearningRate", "loss"} <= set(train[0])
    assert all(float(r["loss"]) > 0 for r in train)
    assert [int(float(r["NumIters"])) for r in test] == [0, 15, 30]
    assert "accuracy" in test[0]
    seconds = [float(r["Seconds"]) for r in train]
    assert seconds == sorted(seconds) and seconds[-1] < 3600


@WF_NEEDS_BUILD
def test_extract_seconds_reads_the_fork_log(wf_short_run, tmp_path):
    out_file = tmp_path / "seconds.txt"
    out = subprocess.run([sys.executable, str(_tools() / "extract_seconds.py"),
                          str(wf_short_run / "caffe.log"), str(out_file)],
                         capture_output=True, text=True, env=_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    values = [float(x) for x in out_file.read_text().split()]
    assert len(values) >= 6 and values == sorted(values)


@WF_NEEDS_BUILD
def test_summarize_lists_the_shipped_caffenet():
    out = subprocess.run([sys.executable, str(_tools() / "summarize.py"),
                          str(WF_REPO / "models/bvlc_reference_caffenet/train_val.prototxt")],
                         capture_output=True, text=True, env=_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    for layer in ("conv1", "pool5", "fc8", "loss"):
        assert layer in out.stdout


@WF_NEEDS_BUILD
def test_plot_training_log_draws_a_png(wf_short_run, tmp_path):
    pytest.importorskip("matplotlib")
    script = tmp_path / "plot_training_log.py"
    script.write_text((_tools() / "plot_training_log.py.example").read_text())
    for helper in ("parse_log.sh", "extract_seconds.py"):
        (tmp_path / helper).write_text((_tools() / helper).read_text())
    (tmp_path / "parse_log.sh").chmod(0o755)
    log = tmp_path / "run.log"
    log.write_text((wf_short_run / "caffe.log").read_text())
    png = tmp_path / "loss.png"
    # chart 6: train loss against iterations
    out = subprocess.run([sys.executable, str(script), "6", str(png), str(log)], cwd=tmp_path,
                         capture_output=True, text=True, env=_env(), timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _python_tool(name: str) -> str:
    from cometctl.paths import pycaffe_dir

    return str(pycaffe_dir() / name)


@WF_NEEDS_BUILD
def test_draw_net_draws_the_shipped_caffenet(tmp_path):
    png = tmp_path / "caffenet.png"
    out = subprocess.run([sys.executable, _python_tool("draw_net.py"),
                          str(WF_REPO / "models/bvlc_reference_caffenet/train_val.prototxt"),
                          str(png)], capture_output=True, text=True, env=_env(), timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


@WF_NEEDS_BUILD
def test_classify_runs_a_trained_snapshot_on_an_image(wf_short_run, tmp_path):
    import numpy as np
    from PIL import Image

    image = tmp_path / "dog.jpg"
    rng = np.random.default_rng(7)
    Image.fromarray(rng.integers(0, 255, (80, 80, 3), dtype=np.uint8)).save(image)
    out_file = tmp_path / "prob.npy"
    out = subprocess.run([sys.executable, _python_tool("classify.py"), str(image), str(out_file),
                          "--model_def", str(WF_REPO / "models/comet_tiny/deploy.prototxt"),
                          "--pretrained_model",
                          str(wf_short_run / "snapshots" / "model_iter_30.caffemodel"),
                          "--images_dim", "64,64", "--mean_file", "", "--center_only"],
                         capture_output=True, text=True, env=_env(), timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    prob = np.load(out_file)
    assert prob.shape == (1, 10)
    assert abs(float(prob.sum()) - 1) < 1e-4 and (prob >= 0).all()


def _idx(path: Path, magic: int, dims: tuple[int, ...], data: bytes) -> None:
    """An MNIST file in LeCun's IDX format (big-endian magic and sizes, then the bytes)."""
    import struct

    path.write_bytes(struct.pack(f">{1 + len(dims)}I", magic, *dims) + data)


@WF_NEEDS_BUILD
def test_upstreams_mnist_example_runs_as_in_a_caffe_checkout(tmp_path):
    """Upstream's MNIST example as its README has it, in a copy of upstream's layout: create_mnist.sh
    (which runs ./build/examples/mnist/convert_mnist_data.bin: the build now makes the examples'
    converters, and the patched tree has `build` -> the CMake build), then `cometctl train --solver
    examples/mnist/lenet_solver.prototxt` from that folder (its relative paths resolve there). MNIST
    itself is not downloaded: small IDX files of random digits stand in for get_mnist.sh's."""
    import random

    from cometctl.paths import pycaffe_dir

    tree = pycaffe_dir().parent
    assert (tree / "build" / "tools" / "caffe").exists()  # what upstream's train_*.sh scripts call
    root = tmp_path / "caffe"
    (root / "data" / "mnist").mkdir(parents=True)
    (root / "examples" / "mnist").mkdir(parents=True)
    for name in ("create_mnist.sh", "lenet_solver.prototxt", "lenet_train_test.prototxt"):
        (root / "examples" / "mnist" / name).write_text((tree / "examples" / "mnist" / name).read_text())
    (root / "build").symlink_to((tree / "build").resolve())
    rng = random.Random(7)
    for prefix, n in (("train", 128), ("t10k", 64)):
        _idx(root / "data" / "mnist" / f"{prefix}-images-idx3-ubyte", 2051, (n, 28, 28),
             bytes(rng.randrange(256) for _ in range(n * 28 * 28)))
        _idx(root / "data" / "mnist" / f"{prefix}-labels-idx1-ubyte", 2049, (n,), bytes(rng.randrange(10) for _ in range(n)))
    made = subprocess.run(["sh", "examples/mnist/create_mnist.sh"], cwd=root, capture_output=True, text=True,
                          timeout=120)
    assert made.returncode == 0, made.stdout + made.stderr
    assert (root / "examples" / "mnist" / "mnist_train_lmdb" / "data.mdb").exists()
    exe = str(Path(sys.executable).parent / "cometctl")
    r = subprocess.run([exe, "train", "--solver", "examples/mnist/lenet_solver.prototxt", "--cpu", "--iters", "4",
                        "--run-dir", str(tmp_path / "run")], cwd=root, capture_output=True, text=True, timeout=600)
    log = (tmp_path / "run" / "caffe.log").read_text() if (tmp_path / "run" / "caffe.log").exists() else ""
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:] + log[-2000:]
    assert "Opened lmdb examples/mnist/mnist_train_lmdb" in log and "Optimization Done" in log
    # without the data, the error names upstream's own scripts (and where to run them)
    from cometctl.paths import prepare_hint

    hint = prepare_hint("examples/mnist/mnist_train_lmdb", tree)
    assert f"in {tree}, ./data/mnist/get_mnist.sh then ./examples/mnist/create_mnist.sh" in hint
    assert "./examples/cifar10/create_cifar10.sh" in prepare_hint("examples/cifar10/cifar10_train_lmdb", tree)
