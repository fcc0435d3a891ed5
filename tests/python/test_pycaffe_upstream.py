"""Upstream Caffe's own pycaffe test suite (python/caffe/test in the patched tree) against the
fork's pycaffe: as it is (COMET off), and its solver tests again with a comet { } block in the
solver they train (read from the patched tree at run time and edited in a temporary folder)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import WF_NEEDS_BUILD


def _suite() -> tuple[Path, dict]:
    from cometctl.paths import pycaffe_dir

    python = pycaffe_dir()
    env = dict(os.environ, PYTHONPATH=str(python), GLOG_minloglevel="2")
    return python / "caffe" / "test", env


def _pytest(args: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@WF_NEEDS_BUILD
def test_upstream_pycaffe_suite_passes(tmp_path):
    suite, env = _suite()
    out = _pytest([str(suite)], tmp_path, env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert " failed" not in out.stdout and " passed" in out.stdout, out.stdout[-1000:]
    # test_draw draws a net through pydot and graphviz's dot (both installed by the set-up)
    assert "skipped" not in out.stdout.splitlines()[-1], out.stdout[-500:]


@WF_NEEDS_BUILD
def test_upstream_solver_tests_pass_with_a_comet_block(tmp_path):
    suite, env = _suite()
    for name in ("test_solver.py", "test_net.py"):
        shutil.copy(suite / name, tmp_path / name)
    solver_test = tmp_path / "test_solver.py"
    text = solver_test.read_text()
    marker = 'snapshot_prefix: "model" """'
    assert marker in text, "upstream's test_solver.py changed: update this test"
    text = text.replace(marker, 'snapshot_prefix: "model"\n        comet { update_interval: 10 } """')
    # and prove the store is on in every one of its tests
    text = text.replace("    def test_solve(self):",
                        "    def test_comet_store_is_on(self):\n"
                        "        self.assertIsNotNone(self.solver.comet_stats())\n\n"
                        "    def test_solve(self):")
    solver_test.write_text(text)
    out = _pytest(["test_solver.py"], tmp_path, env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "5 passed" in out.stdout, out.stdout[-1000:]
