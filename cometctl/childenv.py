"""The environment of the caffe processes cometctl starts (train, plan, and the benchmarks)."""
from __future__ import annotations

import os
import sysconfig
from pathlib import Path

# After each call OpenBLAS's pthread build keeps its idle threads spinning on sched_yield for
# 2^28 CPU cycles (about 0.1 s) before they sleep. Between Caffe's BLAS calls run layers on one
# thread (BatchNorm, Scale, ReLU, pooling, ...) and COMET's worker; on a machine with few cores
# the spinning threads take those cores. 4 (2^4 cycles, the smallest value OpenBLAS accepts) lets
# them sleep at once. It is read when the library loads, so it has to be in the environment of
# the process; a value the user set wins. Measured in docs/comet.md ("OpenBLAS's idle threads").
OPENBLAS_THREAD_TIMEOUT = "4"


def python_layer_path(caffe_binary: str | os.PathLike | None) -> list[str]:
    """What a net's Python layers need on sys.path inside caffe's embedded interpreter, after the
    user's own PYTHONPATH (where their layer modules are): the pycaffe of the build the binary belongs
    to (`import caffe`; build/<variant>/cmake/tools/caffe -> build/<variant>/src/python) and this
    interpreter's site-packages (numpy, in cometctl's venv). Without them such a net stopped with
    "No module named 'caffe'" (or numpy) and an abort."""
    paths = []
    if caffe_binary is not None:
        pycaffe = Path(caffe_binary).resolve().parent.parent.parent / "src" / "python"
        if (pycaffe / "caffe" / "_caffe.so").exists():
            paths.append(str(pycaffe))
    for key in ("purelib", "platlib"):
        site = sysconfig.get_paths()[key]
        if site not in paths:
            paths.append(site)
    return paths


def caffe_env(caffe_binary: str | os.PathLike | None = None, **settings: str) -> dict[str, str]:
    """os.environ with `settings`, OpenBLAS's thread timeout unless the user set one, and PYTHONPATH
    extended for Python layers (python_layer_path) of the caffe binary given."""
    env = dict(os.environ, **settings)
    env.setdefault("OPENBLAS_THREAD_TIMEOUT", OPENBLAS_THREAD_TIMEOUT)
    own = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(own + [p for p in python_layer_path(caffe_binary) if p not in own])
    return env
