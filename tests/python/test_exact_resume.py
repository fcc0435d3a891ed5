"""Interrupting and resuming gives the same weights as never stopping, bit for bit (issue 15):
beside each snapshot the fork keeps the random generator's state and how many batches each data
layer has handed out (<prefix>_iter_N.resumestate), and a restore replays the batches and restores
the generator. comet_tiny reads the embedded images with random crops and mirrors and has Dropout,
so any difference in data, transformation or mask shows in the weights."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from conftest import WF_NEEDS_BUILD, WF_REPO, wf_point_model_at

TOTAL = 12


def _solver(pb2, data, out: Path, max_iter: int, comet: bool) -> Path:
    from cometctl.caffeproto import read_text_proto, write_text_proto

    path = wf_point_model_at(pb2, WF_REPO / "models" / "comet_tiny", data, out, max_iter=max_iter,
                             snapshot=0, display=4, test_interval=4, test_iter=2,
                             snapshot_prefix=str(out / "s"), solver_mode=pb2.SolverParameter.CPU)
    solver = read_text_proto(path, pb2.SolverParameter())
    if not comet:
        solver.ClearField("comet")
    else:
        solver.comet.update_interval = 3  # the bounds adapt inside the run too
    write_text_proto(path, solver)
    return path


def _train(*args, cwd: Path) -> None:
    from cometctl.paths import tool_path

    out = subprocess.run([str(tool_path("caffe")), "train", *args], cwd=cwd, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stderr


def _weights(pb2, caffemodel: Path) -> list[tuple[str, bytes]]:
    net = pb2.NetParameter()
    net.ParseFromString(caffemodel.read_bytes())
    return [(f"{layer.name}/{k}", bytes(b.SerializeToString()))
            for layer in net.layer for k, b in enumerate(layer.blobs)]


@WF_NEEDS_BUILD
@pytest.mark.parametrize("comet", [False, True], ids=["comet-off", "comet-on"])
def test_resume_is_bit_identical_to_never_stopping(wf_pb2, wf_synthetic, tmp_path, comet):
    whole = tmp_path / "whole"
    _train("-solver", str(_solver(wf_pb2, wf_synthetic, whole, TOTAL, comet)), cwd=tmp_path)
    reference = _weights(wf_pb2, whole / f"s_iter_{TOTAL}.caffemodel")
    for stop in (5, 8):  # 8: a test phase comes right after the snapshot
        part = tmp_path / f"stop{stop}"
        _train("-solver", str(_solver(wf_pb2, wf_synthetic, part, stop, comet)), cwd=tmp_path)
        assert (part / f"s_iter_{stop}.resumestate").exists()
        # resume in the same folder, to the same end, with the whole run's solver length
        resumed = _solver(wf_pb2, wf_synthetic, part, TOTAL, comet)
        log = _train("-solver", str(resumed), "-snapshot", str(part / f"s_iter_{stop}.solverstate"),
                     cwd=tmp_path)
        assert "random generator restored" in log and "data positions restored" in log
        got = _weights(wf_pb2, part / f"s_iter_{TOTAL}.caffemodel")
        assert [n for n, _ in got] == [n for n, _ in reference]
        changed = [n for (n, a), (_, b) in zip(got, reference) if a != b]
        assert not changed, f"stopped at {stop}: {changed} differ from the uninterrupted run"


@WF_NEEDS_BUILD
def test_without_the_resume_state_the_run_differs(wf_pb2, wf_synthetic, tmp_path):
    """The check can fail: upstream's resume (no .resumestate) ends elsewhere."""
    whole = tmp_path / "whole"
    _train("-solver", str(_solver(wf_pb2, wf_synthetic, whole, TOTAL, False)), cwd=tmp_path)
    part = tmp_path / "part"
    _train("-solver", str(_solver(wf_pb2, wf_synthetic, part, 5, False)), cwd=tmp_path)
    (part / "s_iter_5.resumestate").unlink()
    log = _train("-solver", str(_solver(wf_pb2, wf_synthetic, part, TOTAL, False)), "-snapshot",
                 str(part / "s_iter_5.solverstate"), cwd=tmp_path)
    assert "no " in log and ".resumestate beside the snapshot" in log
    assert _weights(wf_pb2, part / f"s_iter_{TOTAL}.caffemodel") != \
        _weights(wf_pb2, whole / f"s_iter_{TOTAL}.caffemodel")


@WF_NEEDS_BUILD
def test_the_resume_state_keeps_curand_and_refuses_a_corrupt_line(wf_pb2, wf_synthetic, tmp_path):
    """The resume state has a `curand SEEDED SEED DRAWN` line (the GPU generator GPU Dropout draws from;
    a CPU run draws nothing from it), and a resume stops at a corrupt one, naming it."""
    part = tmp_path / "part"
    _train("-solver", str(_solver(wf_pb2, wf_synthetic, part, 5, True)), cwd=tmp_path)
    state = part / "s_iter_5.resumestate"
    lines = state.read_text().splitlines()
    (curand,) = [line for line in lines if line.startswith("curand ")]
    seeded, seed, drawn = curand.split()[1:]
    assert seeded in ("0", "1") and seed.isdigit() and drawn == "0", curand
    state.write_text("\n".join("curand 7 x" if line == curand else line for line in lines) + "\n")
    from cometctl.paths import tool_path

    out = subprocess.run([str(tool_path("caffe")), "train", "-solver",
                          str(_solver(wf_pb2, wf_synthetic, part, TOTAL, True)), "-snapshot",
                          str(part / "s_iter_5.solverstate")], cwd=tmp_path, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode != 0 and "has a corrupt curand line: curand 7 x" in out.stderr, out.stderr[-2000:]

@WF_NEEDS_BUILD
def test_a_resume_state_cut_short_is_refused(wf_pb2, wf_synthetic, tmp_path):
    """A state without its data layer's line (the file cut short) would leave the layer at its first
    batch while the log said the positions were restored: the resume stops, naming the layer."""
    part = tmp_path / "part"
    _train("-solver", str(_solver(wf_pb2, wf_synthetic, part, 5, True)), cwd=tmp_path)
    state = part / "s_iter_5.resumestate"
    lines = state.read_text().splitlines()
    assert any(line.startswith("layer ") for line in lines), lines
    state.write_text("\n".join(line for line in lines if not line.startswith("layer ")) + "\n")
    from cometctl.paths import tool_path

    out = subprocess.run([str(tool_path("caffe")), "train", "-solver",
                          str(_solver(wf_pb2, wf_synthetic, part, TOTAL, True)), "-snapshot",
                          str(part / "s_iter_5.solverstate")], cwd=tmp_path, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode != 0 and "has no position for data layer 'data' (cut short" in out.stderr, \
        out.stderr[-2000:]


@WF_NEEDS_BUILD
def test_ctrl_c_inside_a_test_phase_resumes_exactly(wf_pb2, wf_synthetic, tmp_path):
    """SIGINT while the test net runs (a long test at iteration 8): caffe stops, snapshots at 8,
    and the resumed run ends with the uninterrupted run's weights."""
    import signal

    from cometctl.caffeproto import read_text_proto, write_text_proto
    from cometctl.paths import tool_path

    whole = tmp_path / "whole"
    _train("-solver", str(_solver(wf_pb2, wf_synthetic, whole, TOTAL, True)), cwd=tmp_path)
    part = tmp_path / "part"
    path = _solver(wf_pb2, wf_synthetic, part, TOTAL, True)
    solver = read_text_proto(path, wf_pb2.SolverParameter())
    solver.test_interval = 8
    del solver.test_iter[:]
    solver.test_iter.append(400)  # long enough to be interrupted inside it
    solver.test_initialization = False
    write_text_proto(path, solver)
    proc = subprocess.Popen([str(tool_path("caffe")), "train", "-solver", str(path)], cwd=tmp_path,
                            stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if "Iteration 8, Testing net" in line:
            proc.send_signal(signal.SIGINT)
            break
    rest = proc.communicate(timeout=300)[1]
    log = "".join(seen) + rest
    assert proc.returncode == 0, log[-3000:]
    assert "Optimization stopped early" in log, log[-2000:]
    assert (part / "s_iter_8.solverstate").exists() and (part / "s_iter_8.resumestate").exists()
    # resume with the whole run's solver (its tests do not change the weights)
    _train("-solver", str(_solver(wf_pb2, wf_synthetic, part, TOTAL, True)), "-snapshot",
           str(part / "s_iter_8.solverstate"), cwd=tmp_path)
    assert _weights(wf_pb2, part / f"s_iter_{TOTAL}.caffemodel") == \
        _weights(wf_pb2, whole / f"s_iter_{TOTAL}.caffemodel")
