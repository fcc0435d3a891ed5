"""device: why a GPU run could not start, found before caffe starts (issue 15, 8). No GPU is needed: the
/dev folder and the driver are injected."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from cometctl import device


class FakeDriver:
    def __init__(self, init=0, count=1, version=13000, count_rc=0):
        self._init, self._count, self._version, self._count_rc = init, count, version, count_rc

    def init(self):
        return self._init

    def device_count(self):
        return self._count_rc, self._count

    def version(self):
        return self._version

    def error_name(self, code):
        return {3: "CUDA_ERROR_NOT_INITIALIZED", 999: "CUDA_ERROR_UNKNOWN"}.get(code, f"CUDA error {code}")


def _no_driver():
    raise OSError("libcuda.so.1: cannot open shared object file")


def _build(tmp_path: Path, cpu_only: bool, cuda: str | None = "13.0") -> Path:
    cmake = tmp_path / ("cpu" if cpu_only else "cuda") / "cmake"
    (cmake / "tools").mkdir(parents=True)
    text = f"CPU_ONLY:BOOL={'ON' if cpu_only else 'OFF'}\n"
    if cuda:
        text += f"CUDA_VERSION:STRING={cuda}\n"
    (cmake / "CMakeCache.txt").write_text(text)
    (cmake / "tools" / "caffe").write_bytes(b"")
    return cmake / "tools" / "caffe"


@pytest.fixture
def dev(tmp_path):
    d = tmp_path / "dev"
    d.mkdir()
    (d / "null").write_bytes(b"")
    return d


def _nvidia_files(dev: Path) -> None:
    for name in ("nvidia0", "nvidiactl", "nvidia-uvm"):
        (dev / name).write_bytes(b"")


def test_a_cpu_only_build(tmp_path, dev):
    caffe = _build(tmp_path, cpu_only=True, cuda=None)
    assert device.build_facts(caffe) == {"cpu_only": True, "nccl": False}
    why = device.gpu_problem(caffe, dev_dir=dev, driver_loader=lambda: FakeDriver())
    assert "CPU-only build" in why and "cometctl build --cuda" in why
    why = device.gpu_problem(None, dev_dir=dev, driver_loader=lambda: FakeDriver())
    assert why.startswith("only the CPU-only build of caffe exists")
    # and no driver either: building the CUDA variant would not help, so it is not suggested
    why = device.gpu_problem(None, dev_dir=dev, driver_loader=_no_driver)
    assert "no NVIDIA driver" in why and "cometctl build" not in why


def test_no_driver_names_what_is_missing(tmp_path, dev):
    caffe = _build(tmp_path, cpu_only=False)
    why = device.gpu_problem(caffe, dev_dir=dev, driver_loader=_no_driver)
    assert why == f"no NVIDIA driver (no {dev}/nvidia* device files and no libcuda.so.1)"
    _nvidia_files(dev)  # the kernel side is there, the library is not: a container without the driver
    why = device.gpu_problem(caffe, dev_dir=dev, driver_loader=_no_driver)
    assert "nvidia0, nvidiactl" in why and "libcuda.so.1" in why and "--gpus all" in why


def test_driver_without_devices_or_failing(tmp_path, dev):
    caffe = _build(tmp_path, cpu_only=False)
    _nvidia_files(dev)
    assert "no CUDA device" in device.gpu_problem(caffe, dev_dir=dev,
                                                  driver_loader=lambda: FakeDriver(init=100))
    assert "no CUDA device" in device.gpu_problem(caffe, dev_dir=dev, driver_loader=lambda: FakeDriver(count=0))
    why = device.gpu_problem(caffe, dev_dir=dev, driver_loader=lambda: FakeDriver(init=999))
    assert "does not start" in why and "CUDA_ERROR_UNKNOWN" in why


def test_driver_older_than_the_build(tmp_path, dev):
    caffe = _build(tmp_path, cpu_only=False, cuda="13.0")
    why = device.gpu_problem(caffe, dev_dir=dev, driver_loader=lambda: FakeDriver(version=12040))
    assert "supports CUDA up to 12.4" in why and "built with CUDA 13.0" in why
    # CUDA's minor version compatibility: a 13.0 build runs on any 13.x driver
    assert device.gpu_problem(caffe, dev_dir=dev, driver_loader=lambda: FakeDriver(version=13020)) is None


def test_device_ids(tmp_path, dev):
    caffe = _build(tmp_path, cpu_only=False)
    two = lambda: FakeDriver(count=2)  # noqa: E731
    one = lambda: FakeDriver(count=1)  # noqa: E731
    for ok in ("0", "1", None):
        assert device.gpu_problem(caffe, ok, dev_dir=dev, driver_loader=two) is None, ok
    assert device.gpu_problem(caffe, "all", dev_dir=dev, driver_loader=one) is None  # all = the one GPU
    # several GPUs need caffe's NCCL build: refused before caffe starts, unless the cache says USE_NCCL
    for several in ("0,1", "all"):
        why = device.gpu_problem(caffe, several, dev_dir=dev, driver_loader=two)
        assert why and "needs caffe built with NCCL" in why and "--gpu 0" in why, several
    cache = caffe.parent.parent / "CMakeCache.txt"
    cache.write_text(cache.read_text() + "USE_NCCL:BOOL=ON\n")
    for ok in ("0,1", "all"):
        assert device.gpu_problem(caffe, ok, dev_dir=dev, driver_loader=two) is None, ok
    assert "no GPU 2: the driver has 2 CUDA devices (ids 0-1)" in device.gpu_problem(
        caffe, "0,2", dev_dir=dev, driver_loader=two)
    assert "not a GPU id" in device.gpu_problem(caffe, "first", dev_dir=dev, driver_loader=two)
    assert "device_id" in device.gpu_problem(caffe, None, dev_dir=dev, driver_loader=two, solver_device=5)


def test_an_unknown_caffe_is_asked_about_the_driver_only(tmp_path, dev):
    """A caffe without a CMake cache beside it (e.g. a system one): no build facts, so only the driver."""
    caffe = tmp_path / "caffe"
    caffe.write_bytes(b"")
    assert device.build_facts(caffe) == {}
    assert device.gpu_problem(caffe, dev_dir=dev, driver_loader=lambda: FakeDriver()) is None
    assert "no NVIDIA driver" in device.gpu_problem(caffe, dev_dir=dev, driver_loader=_no_driver)


def test_the_real_driver_wrapper_speaks_the_driver_api():
    """Driver over a stand-in for libcuda: the calls and their by-reference results."""
    class Lib:
        def cuInit(self, flags):
            assert flags.value == 0
            return 0

        def cuDeviceGetCount(self, ref):
            ctypes.cast(ref, ctypes.POINTER(ctypes.c_int))[0] = 3
            return 0

        def cuDriverGetVersion(self, ref):
            ctypes.cast(ref, ctypes.POINTER(ctypes.c_int))[0] = 13000
            return 0

        def cuGetErrorName(self, code, ref):
            return 1  # not known

    d = device.Driver(Lib())
    assert (d.init(), d.device_count(), d.version(), d.error_name(100)) == (0, (0, 3), 13000, "CUDA_ERROR_NO_DEVICE")


STUBS = [p for p in ("/usr/local/cuda/lib64/stubs/libcuda.so", "/usr/local/cuda/lib/stubs/libcuda.so")
         if Path(p).exists()]


@pytest.mark.skipif(not STUBS, reason="no CUDA toolkit stub libcuda.so here")
def test_the_toolkit_stub_is_not_a_driver(tmp_path, dev):
    """The real ctypes calls, against the CUDA toolkit's stub library (every call fails with
    CUDA_ERROR_STUB_LIBRARY): what a machine with the toolkit and without the driver can be made to load."""
    stub = device.Driver(ctypes.CDLL(STUBS[0]))
    assert stub.init() == device.CUDA_ERROR_STUB_LIBRARY
    why = device.gpu_problem(_build(tmp_path, cpu_only=False), dev_dir=dev, driver_loader=lambda: stub)
    assert why.startswith("no NVIDIA driver") and "stub" in why


def test_this_machine(tmp_path):
    """The defaults on the machine the tests run on: without /dev/nvidia* and libcuda.so.1 (CI, this
    development machine) the answer is 'no NVIDIA driver'; with a GPU, a CUDA build is usable."""
    caffe = _build(tmp_path, cpu_only=False)
    has_files = any(p.name.startswith("nvidia") for p in Path("/dev").iterdir())
    try:
        device.load_driver()
        has_driver = True
    except OSError:
        has_driver = False
    why = device.gpu_problem(caffe)
    if not has_driver:
        assert why.startswith("no NVIDIA driver")
    elif has_files:
        assert why is None or "no CUDA device" in why or "supports CUDA up to" in why


def test_the_built_caffe_says_what_it_is():
    from conftest import WF_BUILT

    if not WF_BUILT:
        pytest.skip("the Caffe build is absent")
    from cometctl.paths import tool_path

    facts = device.build_facts(tool_path("caffe"))
    assert isinstance(facts.get("cpu_only"), bool), facts
