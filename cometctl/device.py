"""Is there a GPU that `caffe train` can use? Asked before caffe starts, so the answer is one line.

Without this, a GPU solver on a machine without one ends in a glog fatal with a stack trace
(`Check failed: error == cudaSuccess (35 vs. 0) CUDA driver version is insufficient ...` from a CUDA
build, `Cannot use GPU in CPU-only Caffe` from a CPU-only one). `gpu_problem` names the reason instead:

* the caffe build is CPU-only (or only the CPU-only variant is built);
* no NVIDIA driver: neither the device files /dev/nvidia* nor the driver library libcuda.so.1 (only the
  driver installs it; the CUDA toolkit's stubs/libcuda.so is not it);
* the driver is there but reports no device (or an error), or the driver is older than the CUDA major
  version the build was compiled with;
* a `--gpu` id that the driver does not have.

Everything the check reads is a parameter (the /dev folder, the function that opens the driver), so the
tests can show each case on a machine without a GPU.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

DEV_DIR = Path("/dev")
DRIVER_LIBRARY = "libcuda.so.1"
CUDA_SUCCESS = 0
CUDA_ERROR_STUB_LIBRARY = 34
CUDA_ERROR_NO_DEVICE = 100
# names of the CUresult codes that matter here (cuda.h), for when cuGetErrorName cannot say
ERROR_NAMES = {3: "CUDA_ERROR_NOT_INITIALIZED", 34: "CUDA_ERROR_STUB_LIBRARY", 46: "CUDA_ERROR_DEVICE_UNAVAILABLE",
               100: "CUDA_ERROR_NO_DEVICE", 101: "CUDA_ERROR_INVALID_DEVICE", 304: "CUDA_ERROR_OPERATING_SYSTEM",
               802: "CUDA_ERROR_SYSTEM_NOT_READY", 803: "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
               804: "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE", 999: "CUDA_ERROR_UNKNOWN"}


class Driver:
    """The few calls of the CUDA driver API the check needs, over ctypes."""

    def __init__(self, lib):
        self._lib = lib

    def init(self) -> int:
        return int(self._lib.cuInit(ctypes.c_uint(0)))

    def device_count(self) -> tuple[int, int]:
        n = ctypes.c_int(0)
        rc = int(self._lib.cuDeviceGetCount(ctypes.byref(n)))
        return rc, n.value

    def version(self) -> int:
        """The CUDA version the driver supports, as 1000 * major + 10 * minor (12040 = 12.4); 0 unknown."""
        v = ctypes.c_int(0)
        return v.value if int(self._lib.cuDriverGetVersion(ctypes.byref(v))) == CUDA_SUCCESS else 0

    def error_name(self, code: int) -> str:
        s = ctypes.c_char_p()
        try:
            if int(self._lib.cuGetErrorName(int(code), ctypes.byref(s))) == CUDA_SUCCESS and s.value:
                return s.value.decode(errors="replace")
        except AttributeError:
            pass
        return ERROR_NAMES.get(code, f"CUDA error {code}")


def load_driver() -> Driver:
    """The installed NVIDIA driver's API; OSError when the driver library is not installed."""
    return Driver(ctypes.CDLL(DRIVER_LIBRARY))


def build_facts(binary: Path | None) -> dict:
    """What the CMake cache of the build that made `binary` (<cmake dir>/tools/caffe) says:
    {"cpu_only": bool, "cuda_version": "13.0", "nccl": bool}; {} when there is no cache beside it (an
    unknown caffe)."""
    if binary is None:
        return {}
    binary = Path(binary)
    try:
        binary = binary.resolve()
    except OSError:
        pass
    for d in (binary.parent.parent, binary.parent):
        cache = d / "CMakeCache.txt"
        try:
            text = cache.read_text(errors="replace")
        except OSError:
            continue
        facts = {}
        m = re.search(r"^CPU_ONLY:BOOL=(\S+)", text, re.M)
        if m:
            facts["cpu_only"] = m[1].upper() in ("ON", "1", "TRUE", "YES")
        m = re.search(r"^CUDA_VERSION(?::STRING)?=(\d+(?:\.\d+)?)", text, re.M)
        if m:
            facts["cuda_version"] = m[1]
        m = re.search(r"^USE_NCCL:BOOL=(\S+)", text, re.M)
        facts["nccl"] = bool(m) and m[1].upper() in ("ON", "1", "TRUE", "YES")
        return facts
    return {}


def _device_files(dev_dir: Path) -> list[str]:
    try:
        return sorted(p.name for p in Path(dev_dir).iterdir() if re.fullmatch(r"nvidia(\d+|ctl)", p.name))
    except OSError:
        return []


def _requested_ids(gpu: str | None) -> list[str]:
    """--gpu 0 / 0,1 / all -> the ids it names ([] for all)."""
    if gpu is None or gpu.strip().lower() == "all":
        return []
    return [part.strip() for part in gpu.split(",") if part.strip()]


def gpu_problem(binary: Path | None, gpu: str | None = None, *, cpu_only_build: bool | None = None,
                dev_dir: Path | None = None, driver_loader=None, solver_device: int = 0) -> str | None:
    """Why `caffe train` could not use a GPU, in a few words; None when it can.

    `binary` is the caffe that would run (None: there is only a CPU-only build). `gpu` is --gpu as the
    user gave it (None: the solver's `device_id`, `solver_device`). `driver_loader` returns a `Driver`
    or raises OSError (default: `load_driver`); `dev_dir` is where the device files are (default /dev)."""
    loader = driver_loader or load_driver
    dev_dir = Path(dev_dir) if dev_dir is not None else DEV_DIR
    facts = build_facts(binary)
    if cpu_only_build is None:
        cpu_only_build = binary is None or facts.get("cpu_only", False)

    files = _device_files(dev_dir)
    driver = None
    driver_missing = ""
    try:
        driver = loader()
    except OSError:
        where = f"no {dev_dir}/nvidia* device files" if not files else f"{', '.join(files)} in {dev_dir}"
        driver_missing = (f"no NVIDIA driver ({where} and no {DRIVER_LIBRARY}"
                          + (": the driver's libraries are not installed here; in a container, start it "
                             "with the GPUs, e.g. docker run --gpus all)" if files else ")"))

    if cpu_only_build:
        why = "this caffe is a CPU-only build"
        if binary is None:
            why = "only the CPU-only build of caffe exists"
        if driver_missing:
            return f"{why}, and there is {driver_missing}"
        return f"{why} (build the CUDA variant with `cometctl build --cuda`)"
    if driver_missing:
        return driver_missing
    try:
        return _ask_driver(driver, facts, gpu, solver_device)
    except (OSError, AttributeError) as e:  # a libcuda.so.1 without the driver API: not a driver
        return f"{DRIVER_LIBRARY} does not answer as the NVIDIA driver does ({e})"


def _ask_driver(driver, facts: dict, gpu: str | None, solver_device: int) -> str | None:
    rc = driver.init()
    if rc == CUDA_ERROR_NO_DEVICE:
        return "the NVIDIA driver finds no CUDA device (CUDA_ERROR_NO_DEVICE)"
    if rc == CUDA_ERROR_STUB_LIBRARY:
        return (f"no NVIDIA driver: the {DRIVER_LIBRARY} found is the CUDA toolkit's stub "
                f"(CUDA_ERROR_STUB_LIBRARY), not the driver's")
    if rc != CUDA_SUCCESS:
        return f"the NVIDIA driver does not start ({driver.error_name(rc)} from cuInit)"
    rc, count = driver.device_count()
    if rc != CUDA_SUCCESS:
        return f"the NVIDIA driver cannot count its devices ({driver.error_name(rc)})"
    if count == 0:
        return "the NVIDIA driver finds no CUDA device"
    built = facts.get("cuda_version")
    have = driver.version()
    if built and have:
        want_major = int(built.split(".")[0])
        if have // 1000 < want_major:
            return (f"the NVIDIA driver supports CUDA up to {have // 1000}.{have % 1000 // 10}, but this caffe "
                    f"was built with CUDA {built}: update the driver")
    if gpu is not None:
        wanted = _requested_ids(gpu)
        odd = [i for i in wanted if not i.isdigit()]
        if odd:
            return f"'{odd[0]}' is not a GPU id (give 0, 0,1 or all)"
        bad = [i for i in wanted if int(i) >= count]
        name = "GPU " + ", ".join(bad)
    else:
        bad = [str(solver_device)] if not 0 <= solver_device < count else []
        name = f"GPU {solver_device} (the solver's device_id)"
    if bad:
        known = "id 0" if count == 1 else f"ids 0-{count - 1}"
        return f"there is no {name}: the driver has {count} CUDA device{'s' if count != 1 else ''} ({known})"
    several = gpu is not None and (len(wanted) > 1 or (not wanted and count > 1))
    if several and facts and not facts.get("nccl"):
        # caffe itself would stop at its first step with "rebuild with USE_NCCL"
        return (f"--gpu {gpu} trains on several GPUs, which needs caffe built with NCCL; this build has "
                f"none yet: give one GPU id (e.g. --gpu 0)")
    return None
