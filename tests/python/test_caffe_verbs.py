"""The caffe tool's other verbs on the fork, as Caffe users run them: fine-tuning from a
.caffemodel with COMET on (`caffe train -weights`, as upstream's finetune_flickr_style does),
`caffe test` and `caffe time` (no solver, so no store: COMET applies to training)."""

from __future__ import annotations

import re
import subprocess

from conftest import WF_NEEDS_BUILD


def _caffe(*args: str, cwd) -> subprocess.CompletedProcess:
    from cometctl.paths import tool_path

    return subprocess.run([str(tool_path("caffe")), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=600)


def _first_loss(log: str) -> float:
    m = re.search(r"Iteration 0 .*loss = ([\d.eE+-]+)", log)
    assert m, log[-2000:]
    return float(m[1])


def _solver(run, tmp_path, name: str) -> str:
    text = (run / "solver.prototxt").read_text()
    text = re.sub(r"max_iter: \d+", "max_iter: 5", text)
    text = re.sub(r'snapshot_prefix: "[^"]*"', f'snapshot_prefix: "{tmp_path / name}"', text)
    text = text.replace("test_initialization: true", "test_initialization: false")
    path = tmp_path / f"{name}_solver.prototxt"
    path.write_text(text)
    return str(path)


@WF_NEEDS_BUILD
def test_train_with_weights_fine_tunes_with_comet(wf_short_run, tmp_path):
    weights = wf_short_run / "snapshots" / "model_iter_30.caffemodel"
    tuned = _caffe("train", "-solver", _solver(wf_short_run, tmp_path, "tuned"),
                   "-weights", str(weights), cwd=tmp_path)
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    assert "COMET: activation store on" in tuned.stderr and "COMET total" in tuned.stderr
    fresh = _caffe("train", "-solver", _solver(wf_short_run, tmp_path, "fresh"), cwd=tmp_path)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    # the weights trained for 30 iterations start lower than a fresh initialisation
    assert _first_loss(tuned.stderr) < _first_loss(fresh.stderr)


@WF_NEEDS_BUILD
def test_test_scores_a_snapshot(wf_short_run, tmp_path):
    out = _caffe("test", "-model", str(wf_short_run / "train_val.prototxt"), "-weights",
                 str(wf_short_run / "snapshots" / "model_iter_30.caffemodel"), "-iterations", "2",
                 cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    accuracy = re.search(r"\] accuracy = ([\d.]+)", out.stderr)
    assert accuracy and 0 <= float(accuracy[1]) <= 1, out.stderr[-2000:]


@WF_NEEDS_BUILD
def test_time_benchmarks_the_net(wf_short_run, tmp_path):
    out = _caffe("time", "-model", str(wf_short_run / "train_val.prototxt"), "-iterations", "2",
                 cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    m = re.search(r"Average Forward-Backward: ([\d.]+) ms", out.stderr)
    assert m and float(m[1]) > 0, out.stderr[-2000:]
