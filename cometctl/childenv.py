"""The environment of the caffe processes cometctl starts (train, plan, and the benchmarks)."""
from __future__ import annotations

import os

# After each call OpenBLAS's pthread build keeps its idle threads spinning on sched_yield for
# 2^28 CPU cycles (about 0.1 s) before they sleep. Between Caffe's BLAS calls run layers on one
# thread (BatchNorm, Scale, ReLU, pooling, ...) and COMET's worker; on a machine with few cores
# the spinning threads take those cores. 4 (2^4 cycles, the smallest value OpenBLAS accepts) lets
# them sleep at once. It is read when the library loads, so it has to be in the environment of
# the process; a value the user set wins. Measured in docs/comet.md ("OpenBLAS's idle threads").
OPENBLAS_THREAD_TIMEOUT = "4"


def caffe_env(**settings: str) -> dict[str, str]:
    """os.environ with `settings` and OpenBLAS's thread timeout unless the user set one."""
    env = dict(os.environ, **settings)
    env.setdefault("OPENBLAS_THREAD_TIMEOUT", OPENBLAS_THREAD_TIMEOUT)
    return env
