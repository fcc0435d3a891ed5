"""scripts/gpu-bundle and scripts/gpu-check without a GPU: the bundle builds under 60 MiB, and in an
empty root (nothing but the unpacked bundle and this machine's CUDA toolkit lib64 standing for the GPU
machine's CUDA runtime) every shipped binary starts under chroot and reports the missing driver or
device instead of failing to load a library. Needs the CUDA build (`cometctl build --cuda --no-cudnn
--no-nccl --tests`, build/cuda); skipped without it. With the cuDNN + NCCL build beside it
(build/cuda-cudnn-nccl) the bundle holds that one too: the root's CUDA lib64 leaves libcudnn and
libnccl out (a GPU machine without them: its steps say "skipped"), and a wheel-like folder in the root
(PyTorch's nvidia/cudnn/lib, nvidia/nccl/lib) brings them for the tests that start the cuDNN binaries.

The root is entered with chroot(8) when this process may (root); otherwise the bundle's loader is run
directly with a cleared environment, which checks less (a library missing from the bundle could still
come from this machine's /lib), and the tests say so in their output.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CUDA_BUILD = ROOT / "build" / "cuda"
CUDNN_BUILD = ROOT / "build" / "cuda-cudnn-nccl"
HAVE_CUDNN_BUILD = (CUDNN_BUILD / "cmake" / "tools" / "caffe").exists() and \
    (CUDNN_BUILD / "cmake" / "test" / "test.testbin").exists()
NEEDS_CUDNN_BUILD = pytest.mark.skipif(not HAVE_CUDNN_BUILD, reason="no cuDNN + NCCL build (build/cuda-cudnn-nccl)")
# where the root keeps cuDNN and NCCL when a test wants them: PyTorch's wheel layout, under a prefix env.sh
# does not search by itself (so the root stays one without cuDNN unless GPU_BUNDLE_CUDA_LIBS names it)
WHEELS_IN_ROOT = "/opt/venv/lib/python3.12/site-packages/nvidia"
CUDA_LIB64 = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "lib64"
LIMIT = 60 * 2**20
BUNDLE_IN_ROOT = "/bundle/gpu-check"
LOAD_FAILURE = re.compile(r"error while loading shared libraries|cannot open shared object|"
                          r"symbol lookup error|version `[^']+' not found|No such file or directory")

pytestmark = pytest.mark.skipif(
    not (CUDA_BUILD / "cmake" / "tools" / "caffe").exists()
    or not (CUDA_BUILD / "cmake" / "test" / "test.testbin").exists()
    or not CUDA_LIB64.is_dir(),
    reason="the CUDA build is absent: run `PATH=/usr/local/cuda/bin:$PATH .venv/bin/cometctl build --cuda "
           "--tests --cuda-arch 90` (scripts/test compiles it after pytest)")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bundle") / "gpu-bundle.tar.xz"
    proc = subprocess.run([str(ROOT / "scripts" / "gpu-bundle"), "--out", str(out), "--build-dir", str(CUDA_BUILD)],
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(proc.stdout.strip().splitlines()[-1])
    return out


def _link_tree(src: Path, dest: Path, needed: set[str], leave_out: tuple[str, ...] = ()) -> None:
    """dest mirrors src (symlinks kept as they are, files hard-linked; nothing writes to them) but for the
    names starting with leave_out; where hard links are refused (another file system), only the needed
    libraries are copied, under their SONAMEs."""
    dest.mkdir(parents=True)
    try:
        for f in src.iterdir():
            if f.name.startswith(leave_out):
                continue
            if f.is_symlink():
                (dest / f.name).symlink_to(os.readlink(f))
            elif f.is_file():
                os.link(f, dest / f.name)
        return
    except OSError:
        shutil.rmtree(dest)
        dest.mkdir(parents=True)
    for name in needed:
        f = src / name
        if f.exists():
            shutil.copy2(f.resolve(), dest / name)


def _info(top: Path, key: str) -> str:
    for line in (top / "BUILDINFO").read_text().splitlines():
        if line.startswith(key + "="):
            return line[len(key) + 1:]
    return ""


@pytest.fixture(scope="module")
def root(bundle, tmp_path_factory) -> Path:
    """An empty root: the bundle at /bundle, the CUDA toolkit's lib64 at /usr/local/cuda/lib64 (without
    libcudnn and libnccl), /tmp."""
    r = tmp_path_factory.mktemp("root")
    (r / "bundle").mkdir()
    subprocess.run(["tar", "-C", str(r / "bundle"), "-xf", str(bundle)], check=True)
    top = r / BUNDLE_IN_ROOT.lstrip("/")
    needed = set(_info(top, "cuda_sonames").split())
    _link_tree(CUDA_LIB64.resolve(), r / "usr" / "local" / "cuda" / "lib64", needed,
               leave_out=("libcudnn", "libnccl"))
    (r / "tmp").mkdir(mode=0o1777)
    (r / "work").mkdir()
    return r


def _run(root: Path, chroot: bool, cmd: list[str], cwd: str = "/work", env: dict | None = None,
         timeout: int = 120) -> subprocess.CompletedProcess:
    """cmd (paths as seen inside the root) with chroot(2) into root and chdir(cwd) there; without
    chroot, the same paths under root on this machine."""
    if chroot:
        def enter():
            os.chroot(root)
            os.chdir(cwd)
        return subprocess.run(cmd, capture_output=True, text=True, env=env or {}, timeout=timeout,
                              preexec_fn=enter)
    cmd = [str(root) + c if c.startswith(("/bundle", "/usr/local/cuda", "/work")) else c for c in cmd]
    return subprocess.run(cmd, capture_output=True, text=True, env=env or {}, timeout=timeout, cwd=str(root) + cwd)


def _can_chroot(r: Path) -> bool:
    try:
        p = _run(r, True, [BUNDLE_IN_ROOT + "/lib/ld-linux-x86-64.so.2", "--version"], cwd="/", timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return p.returncode == 0


@pytest.fixture(scope="module")
def run_in_root(root):
    """run(binary, *args) -> CompletedProcess: libexec/BINARY through the bundle's loader, inside the root,
    with no environment but GLOG_logtostderr=1."""
    chroot = _can_chroot(root) and not os.environ.get("GPU_BUNDLE_TEST_NO_CHROOT")  # the latter: to try the fallback
    print("empty root entered with chroot(2)" if chroot else
          "chroot not permitted: the bundle's loader runs directly with a cleared environment")

    def run(binary: str, *args: str, sz: bool = False, cudnn: bool = False, timeout: int = 120,
            cwd: str = "/work"):
        libs = _libs(sz, cudnn)
        if not chroot:
            libs = [str(root) + d for d in libs]
        exe = f"{BUNDLE_IN_ROOT}/{'cudnn/libexec' if cudnn else 'libexec'}/{binary}"
        cmd = [BUNDLE_IN_ROOT + "/lib/ld-linux-x86-64.so.2", "--library-path", ":".join(libs), exe, *args]
        return _run(root, chroot, cmd, cwd=cwd, env={"GLOG_logtostderr": "1"}, timeout=timeout)

    run.chroot = chroot
    run.root = root
    return run


def _libs(sz: bool = False, cudnn: bool = False) -> list[str]:
    """The library path (inside the root) of the sz binaries, the first build's, or the cuDNN build's
    (whose libcudnn and libnccl come from the wheel folder made by `wheels`)."""
    if sz:
        return [BUNDLE_IN_ROOT + "/lib/sz", BUNDLE_IN_ROOT + "/lib", "/usr/local/cuda/lib64"]
    if cudnn:
        return [BUNDLE_IN_ROOT + "/cudnn/lib", BUNDLE_IN_ROOT + "/lib", "/usr/local/cuda/lib64",
                WHEELS_IN_ROOT + "/cudnn/lib", WHEELS_IN_ROOT + "/nccl/lib"]
    return [BUNDLE_IN_ROOT + "/lib", "/usr/local/cuda/lib64"]


@pytest.fixture(scope="module")
def wheels(root) -> Path:
    """libcudnn*.so.9 and libnccl.so.2 of this machine's CUDA in the root where PyTorch's nvidia-cudnn and
    nvidia-nccl wheels keep them (hard links: several hundred MB that are not copied)."""
    if not HAVE_CUDNN_BUILD:
        pytest.skip("no cuDNN + NCCL build (build/cuda-cudnn-nccl)")
    base = root / WHEELS_IN_ROOT.lstrip("/")
    for sub, pattern in (("cudnn", "libcudnn*.so.9"), ("nccl", "libnccl.so.2")):
        d = base / sub / "lib"
        if d.exists():
            continue
        d.mkdir(parents=True)
        for f in sorted(CUDA_LIB64.glob(pattern)):
            try:
                os.link(f.resolve(), d / f.name)
            except OSError:
                pytest.skip(f"cannot hard-link {f} into the root")
    return base


def _no_load_failure(p: subprocess.CompletedProcess) -> str:
    out = p.stdout + p.stderr
    assert not LOAD_FAILURE.search(out), out[-3000:]
    return out


# ---------------------------------------------------------------------------- the archive

def test_bundle_is_under_60_mib_and_has_what_the_check_runs(bundle):
    size = bundle.stat().st_size
    assert size < LIMIT, f"{size / 2**20:.1f} MiB"
    with tarfile.open(bundle) as t:
        names = set(t.getnames())
    for f in ("run", "env.sh", "BUILDINFO", "bin/caffe", "bin/test.testbin", "bin/sz_test_gpu", "bin/sz_bench",
              "libexec/caffe", "lib/ld-linux-x86-64.so.2", "lib/libc.so.6", "lib/libcaffe.so.1.0.0",
              "lib/libsz.so.1", "lib/sz/libsz.so.1", "models/caffenet/train_val.prototxt",
              "models/resnet18/train_val.prototxt", "testroot/src/caffe/test/test_data/solver_data.h5",
              "python/zoo_check.py", "models/zoo/nets.tsv", "models/zoo/googlenet.prototxt",
              "models/zoo/resnet18_dogs.prototxt"):
        assert "gpu-check/" + f in names, f
    with tarfile.open(bundle) as t:
        assert re.search(r"^zoo=yes \(14 nets\)$", t.extractfile("gpu-check/BUILDINFO").read().decode(), re.M)
    # the driver and the CUDA runtime libraries come from the GPU machine, and so do cuDNN and NCCL
    for n in names:
        assert not re.search(r"/lib(cuda|cudart|cublas|cublasLt|curand|cudnn|nccl)[._]", n), n
    if HAVE_CUDNN_BUILD:
        for f in ("bin/caffe-cudnn", "bin/test.testbin-cudnn", "cudnn/libexec/caffe", "cudnn/libexec/test.testbin",
                  "cudnn/lib/libcaffe.so.1.0.0", "lib/libz.so.1"):
            assert "gpu-check/" + f in names, f
        with tarfile.open(bundle) as t:
            info = t.extractfile("gpu-check/BUILDINFO").read().decode()
        assert "cudnn_build=yes" in info and re.search(r"^optional_sonames=libcudnn\.so\.9 libnccl\.so\.2$", info, re.M)
        assert not re.search(r"^cuda_sonames=.*(cudnn|nccl)", info, re.M), info  # the first build needs neither


def test_every_shipped_elf_resolves_inside_the_root(root, run_in_root, request):
    """`ld.so --list` on every binary and library: each NEEDED is found, in the bundle or the CUDA lib64."""
    top = root / BUNDLE_IN_ROOT.lstrip("/")
    files = [f"libexec/{b}" for b in ("caffe", "test.testbin", "sz_test_gpu", "sz_bench")]
    files += [f"lib/{p.name}" for p in sorted((top / "lib").iterdir())
              if p.is_file() and p.name != "ld-linux-x86-64.so.2"] + ["lib/sz/libsz.so.1"]
    if HAVE_CUDNN_BUILD:
        files += ["cudnn/libexec/caffe", "cudnn/libexec/test.testbin", "cudnn/lib/libcaffe.so.1.0.0"]
        request.getfixturevalue("wheels")
    prefix = "" if run_in_root.chroot else str(root)
    inside = (prefix + BUNDLE_IN_ROOT + "/", prefix + "/usr/local/cuda/lib64/", prefix + WHEELS_IN_ROOT + "/")
    for f in files:
        libs = _libs(sz="sz" in f, cudnn=f.startswith("cudnn/"))
        libs = [prefix + d for d in libs]
        cmd = [BUNDLE_IN_ROOT + "/lib/ld-linux-x86-64.so.2", "--library-path", ":".join(libs), "--list",
               f"{BUNDLE_IN_ROOT}/{f}"]
        p = _run(root, run_in_root.chroot, cmd, cwd="/")
        assert p.returncode == 0 and "not found" not in p.stdout, f"{f}:\n{p.stdout}{p.stderr}"
        for line in p.stdout.splitlines():
            m = re.search(r"=> (\S+)", line)
            if m:
                assert m.group(1).startswith(inside), f"{f}: {line.strip()}"


# ---------------------------------------------------------------------------- each binary starts

def test_caffe_device_query_names_the_missing_driver(run_in_root):
    p = run_in_root("caffe", "device_query", "-gpu", "0")
    out = _no_load_failure(p)
    assert p.returncode != 0
    assert re.search(r"CUDA driver version is insufficient|no CUDA-capable device|cudaSuccess", out), out[-2000:]


def test_testbin_lists_the_comet_and_upstream_gpu_tests(run_in_root):
    p = run_in_root("test.testbin", "--gtest_list_tests")
    out = _no_load_failure(p)
    assert p.returncode == 0, out[-2000:]
    assert "Cuda number of devices: 0" in out
    assert "CometGPUTest." in out and "ConvolutionLayerTest/2." in out and "GPUMathFunctionsTest/0." in out


def test_sz_gpu_tests_start_and_skip_without_a_device(run_in_root):
    p = run_in_root("sz_test_gpu", sz=True)
    out = _no_load_failure(p)
    assert p.returncode == 0, out[-2000:]
    assert "no CUDA device" in out and "PASSED" in out


def test_sz_bench_runs_the_host_backend_and_finds_no_device(run_in_root):
    p = run_in_root("sz_bench", "--mib", "1", "--reps", "1", "--threads", "1", "--gpu", sz=True)
    out = _no_load_failure(p)
    assert p.returncode == 0, out[-2000:]
    assert re.search(r"cpu +1 threads: ratio", out) and "gpu: no device" in out, out


TINY_NET = """name: "tiny"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { data_filler { type: "gaussian" std: 1 } data_filler { type: "uniform" min: 0 max: 3.999 }
                     shape { dim: 4 dim: 3 dim: 16 dim: 16 } shape { dim: 4 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 8 kernel_size: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
  convolution_param { num_output: 8 kernel_size: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }
layer { name: "ip" type: "InnerProduct" bottom: "conv2" top: "ip"
  inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""

SOLVER = """net: "{net}"
base_lr: 0.01
lr_policy: "fixed"
max_iter: {iters}
display: 1
random_seed: 1701
snapshot_after_train: false
snapshot_prefix: "{prefix}"
solver_mode: CPU
comet {{ eb_mode: ADAPTIVE error_bound: 1e-3 adaptive_target: 0.05 update_interval: 1 }}
"""


def _small_copy(text: str) -> str:
    """A bundled net at batch 2: its DummyData label shape and Tile count, and the image count."""
    batch = re.search(r"tiles: (\d+)", text).group(1)
    text = re.sub(r"tiles: \d+", "tiles: 2", text)
    return re.sub(rf"shape {{\s*dim: {batch}\s*}}", "shape {\n      dim: 2\n    }", text)


def test_caffe_trains_with_comet_in_the_root(root, run_in_root):
    """The CUDA build's caffe in CPU mode, COMET on: a tiny net, then the bundled CaffeNet and ResNet-18
    at batch 2 (their structure, the DummyData + Tile inputs and comet_param), two iterations each."""
    (root / "work" / "tiny.prototxt").write_text(TINY_NET)
    top = root / BUNDLE_IN_ROOT.lstrip("/")
    work = "/work" if run_in_root.chroot else f"{root}/work"
    nets = {"tiny": (f"{work}/tiny.prototxt", 3)}
    for key in ("caffenet", "resnet18"):
        text = (top / "models" / key / "train_val.prototxt").read_text()
        (root / "work" / f"{key}.prototxt").write_text(_small_copy(text))
        nets[key] = (f"{work}/{key}.prototxt", 2)
    for name, (net, iters) in nets.items():
        (root / "work" / f"{name}-solver.prototxt").write_text(
            SOLVER.format(net=net, iters=iters, prefix=f"{work}/{name}"))
        p = run_in_root("caffe", "train", "-solver", f"/work/{name}-solver.prototxt", timeout=600)
        out = _no_load_failure(p)
        assert p.returncode == 0, f"{name}:\n{out[-3000:]}"
        assert "Optimization Done" in out and "COMET total:" in out, f"{name}:\n{out[-3000:]}"


def test_wrappers_run_from_a_bare_shell_and_find_cuda(root, run_in_root):
    """bin/* through a shell (dash, run by the bundle's own loader: the root has no libc of its own);
    env.sh finds /usr/local/cuda/lib64 in the root."""
    dash = shutil.which("dash")
    if not dash or not run_in_root.chroot:
        pytest.skip("needs dash and chroot")
    shutil.copy2(dash, root / "bundle" / "sh")
    sh = [BUNDLE_IN_ROOT + "/lib/ld-linux-x86-64.so.2", "--library-path", BUNDLE_IN_ROOT + "/lib", "/bundle/sh"]

    def shell(script: str) -> subprocess.CompletedProcess:
        return _run(root, True, [*sh, "-c", script], cwd="/work", env={"PATH": "/nonexistent"})

    p = shell(f". {BUNDLE_IN_ROOT}/env.sh; echo \"[$GPU_BUNDLE_LIBPATH]\"")
    assert p.stdout.strip() == "[:/usr/local/cuda/lib64]", p.stdout + p.stderr
    # the root has no /bin/sh for the wrappers' #! line: the shell is given them as scripts
    p = _run(root, True, [*sh, f"{BUNDLE_IN_ROOT}/bin/sz_bench", "--mib", "1", "--reps", "1", "--threads", "1",
                          "--gpu"], env={"PATH": "/nonexistent"})
    out = _no_load_failure(p)
    assert p.returncode == 0 and "gpu: no device" in out, out
    p = _run(root, True, [*sh, f"{BUNDLE_IN_ROOT}/bin/caffe", "device_query", "-gpu", "0"],
             env={"PATH": "/nonexistent"})
    out = _no_load_failure(p)
    assert p.returncode != 0 and "CUDA driver version is insufficient" in out, out[-2000:]


@NEEDS_CUDNN_BUILD
def test_cudnn_build_starts_with_cudnn_and_nccl_from_wheel_folders(root, run_in_root, wheels):
    """The cuDNN + NCCL build's caffe and test.testbin load (libcudnn, libnccl from nvidia/*/lib, libz from
    the bundle) and report the missing driver; its gtests list upstream's CuDNN suites and our cuDNN rows,
    and the cuDNN rows that need no GPU pass there."""
    p = run_in_root("caffe", "device_query", "-gpu", "0", cudnn=True)
    out = _no_load_failure(p)
    assert p.returncode != 0
    assert re.search(r"CUDA driver version is insufficient|no CUDA-capable device|cudaSuccess", out), out[-2000:]
    p = run_in_root("test.testbin", "--gtest_list_tests", cudnn=True)
    out = _no_load_failure(p)
    assert p.returncode == 0, out[-2000:]
    for suite in ("CuDNNConvolutionLayerTest/0.", "CuDNNPoolingLayerTest/1.", "CuDNNNeuronLayerTest/0.",
                  "CuDNNSoftmaxLayerTest/0.", "CuDNNLRNLayerTest/0."):
        assert suite in out, suite
    assert "EveryCuDNNRowHoldsOnTheGPU" in out and "CuDNNClassesHaveRowsOfTheirOwn" in out
    p = run_in_root("test.testbin", "--gtest_filter=CometFactsTest.CuDNNClassesHaveRowsOfTheirOwn", cudnn=True,
                    cwd="/work")
    out = _no_load_failure(p)
    assert p.returncode == 0 and "[  PASSED  ] 1 test." in out, out[-3000:]


@NEEDS_CUDNN_BUILD
def test_cudnn_wrapper_says_skipped_without_cudnn_and_runs_with_it(root, run_in_root, wheels):
    """On a GPU machine without cuDNN (the root's CUDA lib64 has none; the wheel folder is where env.sh
    does not look), bin/caffe-cudnn names what is missing and exits 77 instead of a loader error; with
    GPU_BUNDLE_CUDA_LIBS naming the wheel folders it starts and reports the missing driver."""
    dash = shutil.which("dash")
    if not dash or not run_in_root.chroot:
        pytest.skip("needs dash and chroot")
    shutil.copy2(dash, root / "bundle" / "sh")
    sh = [BUNDLE_IN_ROOT + "/lib/ld-linux-x86-64.so.2", "--library-path", BUNDLE_IN_ROOT + "/lib", "/bundle/sh"]
    p = _run(root, True, [*sh, f"{BUNDLE_IN_ROOT}/bin/caffe-cudnn", "device_query", "-gpu", "0"],
             env={"PATH": "/nonexistent"})
    assert p.returncode == 77, p.stdout + p.stderr
    assert "gpu-bundle: skipped: no libcudnn.so.9 found" in p.stderr, p.stderr
    # the first build's caffe is unaffected
    p = _run(root, True, [*sh, f"{BUNDLE_IN_ROOT}/bin/caffe", "device_query", "-gpu", "0"],
             env={"PATH": "/nonexistent"})
    assert "CUDA driver version is insufficient" in _no_load_failure(p)
    libs = f"{WHEELS_IN_ROOT}/cudnn/lib:{WHEELS_IN_ROOT}/nccl/lib"
    p = _run(root, True, [*sh, f"{BUNDLE_IN_ROOT}/bin/caffe-cudnn", "device_query", "-gpu", "0"],
             env={"PATH": "/nonexistent", "GPU_BUNDLE_CUDA_LIBS": libs})
    out = _no_load_failure(p)
    assert p.returncode not in (0, 77) and "CUDA driver version is insufficient" in out, out[-2000:]


def test_env_sh_search_order(root, tmp_path):
    """GPU_BUNDLE_CUDA_LIBS first, then $CUDA_HOME, ..., PyTorch's nvidia/*/lib wheel folders under ~/.local;
    a library found nowhere is named."""
    dash = shutil.which("dash") or shutil.which("sh")
    env_sh = (root / BUNDLE_IN_ROOT.lstrip("/") / "env.sh").read_text()
    env_sh = re.sub(r'^CUDA_SONAMES=".*"$', 'CUDA_SONAMES="libfakecudart.so.99 libfakeblas.so.98"', env_sh,
                    flags=re.M)
    env_sh = re.sub(r'^OPTIONAL_SONAMES=".*"$', 'OPTIONAL_SONAMES="libfakednn.so.9 libfakeccl.so.2"', env_sh,
                    flags=re.M)
    (tmp_path / "env.sh").write_text(env_sh)
    wheel = tmp_path / "home" / ".local" / "lib" / "python3.12" / "site-packages" / "nvidia" / "cu13" / "lib"
    wheel.mkdir(parents=True)
    for d in ("override", "cudahome/lib64"):
        (tmp_path / d).mkdir(parents=True)
    (wheel / "libfakecudart.so.99").touch()
    (wheel / "libfakeblas.so.98").touch()
    dnn = wheel.parent.parent / "cudnn" / "lib"
    dnn.mkdir(parents=True)
    (dnn / "libfakednn.so.9").touch()
    (tmp_path / "cudahome" / "lib64" / "libfakeblas.so.98").touch()
    (tmp_path / "override" / "libfakecudart.so.99").touch()

    def find(**env) -> subprocess.CompletedProcess:
        script = (f". {tmp_path}/env.sh; echo \"[$GPU_BUNDLE_LIBPATH]\"; "
                  f"echo \"[$GPU_BUNDLE_OPTIONAL_LIBPATH][$GPU_BUNDLE_OPTIONAL_MISSING]\"")
        return subprocess.run([dash, "-c", script], capture_output=True, text=True,
                              env={"HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin", **env})

    p = find()
    paths = p.stdout.splitlines()[0].strip("[]").split(":")
    assert str(wheel) in paths, p.stdout + p.stderr
    # cuDNN from its own wheel folder; the NCCL stand-in found nowhere: named, without a message
    assert p.stdout.splitlines()[1] == f"[:{dnn}][libfakeccl.so.2]", p.stdout
    assert "libfakeccl" not in p.stderr and str(dnn) not in paths
    p = find(CUDA_HOME=str(tmp_path / "cudahome"), GPU_BUNDLE_CUDA_LIBS=str(tmp_path / "override"))
    paths = p.stdout.splitlines()[0].strip("[]").split(":")
    assert paths[1:3] == [str(tmp_path / "override"), str(tmp_path / "cudahome" / "lib64")], p.stdout
    (wheel / "libfakeblas.so.98").unlink()
    p = find()
    assert "CUDA libraries not found: libfakeblas.so.98" in p.stderr, p.stderr

    # cuDNN and NCCL: PyTorch's wheel folders before CUDA's ($CUDA_HOME here), and a copy that needs a
    # newer glibc than the bundle's is passed over (the first GPU run: the machine's own libnccl.so.2
    # in /usr/lib/x86_64-linux-gnu asked for GLIBC_2.38 and every cuDNN step stopped at load time)
    (tmp_path / "cudahome" / "lib64" / "libfakednn.so.9").touch()
    (tmp_path / "cudahome" / "lib64" / "libfakeccl.so.2").write_bytes(b"\x7fELF\0GLIBC_2.999\0")
    p = find(CUDA_HOME=str(tmp_path / "cudahome"))
    assert p.stdout.splitlines()[1] == f"[:{dnn}][libfakeccl.so.2]", p.stdout
    (tmp_path / "cudahome" / "lib64" / "libfakeccl.so.2").write_bytes(b"\x7fELF\0GLIBC_2.17\0GLIBC_2.28\0")
    p = find(CUDA_HOME=str(tmp_path / "cudahome"))
    assert p.stdout.splitlines()[1] == f"[:{dnn}:{tmp_path / 'cudahome' / 'lib64'}][]", p.stdout


def test_death_tests_run_again_through_the_wrapper(bundle, tmp_path):
    """gtest's threadsafe death tests execute argv[0] again. The wrappers hand the loader --argv0 (their own
    path), so that child loads the bundle's libraries too. The first GPU run failed five such tests with
    "libcaffe.so.1.0.0: cannot open shared object file": there the build tree's RUNPATH, which hides the
    problem here, points nowhere; so it is blanked in the copy under test."""
    subprocess.run(["tar", "-C", str(tmp_path), "-xf", str(bundle)], check=True)
    top = tmp_path / "gpu-check"
    exe = top / "libexec" / "test.testbin"
    data = exe.read_bytes()
    build = str(ROOT / "build").encode()
    assert build in data or b"RUNPATH" not in data
    exe.write_bytes(data.replace(build, b"/" * len(build)))
    test = "CometStoreTest.CorruptStoredActivationIsDetected"
    p = subprocess.run([str(top / "bin" / "test.testbin"), f"--gtest_filter={test}"], cwd=top / "testroot",
                       capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0 and f"[       OK ] {test}" in out, out[-3000:]
    assert not LOAD_FAILURE.search(out), out[-3000:]


# ---------------------------------------------------------------------------- the check itself

def test_gpu_check_without_a_gpu_names_each_step_and_writes_few_files(bundle, tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), GPU_CHECK_BUDGET="90", GPU_CHECK_SZ_MIB="64")
    p = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check"), str(bundle)], capture_output=True, text=True,
                       env=env, timeout=300)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    files = sorted(f.name for f in out.iterdir())
    assert len(files) <= 8 and "summary.txt" in files, files
    summary = (out / "summary.txt").read_text()
    assert summary.startswith("COMET-Caffe GPU check: FAIL")
    for step in ("device", "gtest-comet", "gtest-every-solver", "gtest-comet-cudnn", "sz-test-gpu", "sz-bench", "train-runtime", "train-caffenet-off",
                 "train-caffenet-on", "train-caffenet-sync", "train-caffenet-cudnn-off", "train-caffenet-cudnn-on", "train-resnet18-off",
                 "train-resnet18-on", "train-resnet18-cudnn-off", "train-resnet18-cudnn-on", "plan-caffenet", "plan-cometctl", "resume-resnet18", "resume-caffenet", "gpu-zoo", "gpu-zoo-cudnn", "gpu-fuzz", "gtest-upstream", "gtest-upstream-gradients", "gtest-comet-rest",
                 "gtest-upstream-double"):
        assert re.search(rf"^{re.escape(step)} +(PASS|FAIL|TIMEOUT|SKIP) ", summary, re.M), (step, summary)
    # no GPU here, so none to spread -gpu all over: not applicable, which alone would not make it INCOMPLETE
    for mode in ("off", "on"):
        assert re.search(rf"^train-caffenet-allgpu-{mode} +N/A .*-gpu all needs two or more", summary, re.M), summary
    assert re.search(r"^device +FAIL .*CUDA driver version is insufficient", summary, re.M), summary
    assert re.search(r"^sz-test-gpu +FAIL .*no CUDA device", summary, re.M), summary
    assert not LOAD_FAILURE.search(summary), summary


def test_gpu_check_skips_the_cudnn_steps_without_libcudnn(bundle, tmp_path):
    """What a GPU machine without cuDNN sees: the bundle's env.sh made to look for a libcudnn that no
    folder has (this machine's CUDA has the real one); every cuDNN step is SKIP and says why, and the
    upstream gtests fall back to the first build."""
    (tmp_path / "b").mkdir()
    subprocess.run(["tar", "-C", str(tmp_path / "b"), "-xf", str(bundle)], check=True)
    top = tmp_path / "b" / "gpu-check"
    if _info(top, "cudnn_build") != "yes":
        pytest.skip("the bundle has no cuDNN build")
    env_sh = top / "env.sh"
    env_sh.write_text(re.sub(r'^OPTIONAL_SONAMES="libcudnn\.so\.9 ', 'OPTIONAL_SONAMES="libcudnn.so.99 ',
                             env_sh.read_text(), flags=re.M))
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), GPU_CHECK_BUDGET="40", GPU_CHECK_SZ_MIB="16")
    p = subprocess.run(["bash", str(top / "run")], capture_output=True, text=True, env=env, timeout=300)
    summary = (out / "summary.txt").read_text()
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    why = "skipped: no libcudnn.so.99 found"
    for step in ("gtest-comet-cudnn", "train-caffenet-cudnn-off", "train-caffenet-cudnn-on",
                 "train-resnet18-cudnn-off", "train-resnet18-cudnn-on", "gpu-zoo-cudnn"):
        assert re.search(rf"^{re.escape(step)} +SKIP .*{re.escape(why)}", summary, re.M), (step, summary)
    assert "cudnn_build\tskipped: no libcudnn.so.99 found" in (out / "results.tsv").read_text()
    assert "no libcudnn.so.99 found" in (out / "device.txt").read_text()


# A stand-in for the bundle's caffe: device_query passes; `train` logs its solver to $FAKE_CAFFE_LOG and
# hangs when the solver's comet block leaves the store's device work on its own stream (no
# `async: false`), as a stream that never completes would; otherwise it prints the log lines the check reads.
FAKE_CAFFE = r'''#!/bin/bash
case "$1" in device_query) echo "Name: stand-in"; exit 0 ;; train) ;; *) exit 1 ;; esac
prev=""; for a in "$@"; do [ "$prev" = -solver ] && solver="$a"; prev="$a"; done
{ echo "== $solver"; cat "$solver"; } >>"$FAKE_CAFFE_LOG"
if grep -q "comet {" "$solver" && ! grep -q "async: false" "$solver"; then
  echo "I1205 stand-in: waiting for the store's stream"; exec sleep 300
fi
for i in 10 20 30; do echo "I1205 solver.cpp:218] Iteration $i (50 iter/s, 0.2s/10 iters), loss = 1.5"; done
grep -q "comet {" "$solver" && echo "I1205 store.cpp:1] COMET total: peak memory 100.0 MB, activations 10 MB -> 1 MB (10x), layer buffers 1 MB" &&
  echo "I1205 statistics.cpp:196] COMET time per iteration: encode 3.9 ms, decode 2.9 ms; the step waited 1.2 ms (83% ran beside it)"
exit 0
'''


def _bundle_with_stand_ins(bundle: Path, tmp_path: Path, testbin: str) -> Path:
    (tmp_path / "b").mkdir()
    subprocess.run(["tar", "-C", str(tmp_path / "b"), "-xf", str(bundle)], check=True)
    top = tmp_path / "b" / "gpu-check"
    for name, text in (("caffe", FAKE_CAFFE), ("caffe-cudnn", FAKE_CAFFE), ("test.testbin", testbin),
                       ("test.testbin-cudnn", testbin)):
        (top / "bin" / name).unlink(missing_ok=True)
        (top / "bin" / name).write_text(text)
        (top / "bin" / name).chmod(0o755)
    return top


def _sections(log: str) -> list[str]:
    return [s for s in log.split("== ")[1:] if "comet {" in s]


def test_gpu_check_runs_later_comet_steps_in_the_step_after_the_stream_hangs(bundle, tmp_path):
    """train-caffenet-on, the first training with the store's device work on its own stream, hangs (a
    stand-in caffe that waits forever unless the solver says `async: false`): it is cut at its limit
    with its last log line, and every later COMET-on run (ResNet-18, cuDNN, the resumes) is given
    `async: false`, so the hang costs one step's limit rather than the budget."""
    top = _bundle_with_stand_ins(bundle, tmp_path, "#!/bin/bash\nexit 0\n")
    out, log = tmp_path / "out", tmp_path / "solvers.log"
    env = dict(os.environ, OUT=str(out), GPU_CHECK_BUDGET="150", GPU_CHECK_SZ_MIB="16", GPU_CHECK_TRAIN_LIMIT="10",
               FAKE_CAFFE_LOG=str(log), PATH="/usr/bin:/bin")   # no nvidia-smi: the steps that need it SKIP
    p = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check"), str(top)], capture_output=True, text=True,
                       env=env, timeout=300)
    summary = (out / "summary.txt").read_text()
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    assert re.search(r"^train-caffenet-on +TIMEOUT .*last line: I1205 stand-in: waiting for the store's stream",
                     summary, re.M), summary
    assert re.search(r"^stream-fallback .*every later COMET-on run has async: false", summary, re.M), summary
    for step in ("train-caffenet-sync", "train-caffenet-cudnn-on", "train-resnet18-on", "train-resnet18-cudnn-on"):
        assert re.search(rf"^{step} +PASS ", summary, re.M), (step, summary)
    for step in ("train-caffenet-cudnn-on", "train-resnet18-on"):
        assert re.search(rf"^{step} +PASS .*\(async: false: train-caffenet-on hung\)", summary, re.M), (step, summary)
    assert "stream_fallback\t" in (out / "results.tsv").read_text()
    # COMET's own time split, for telling the stream's gain from the codec's cost
    assert re.search(r"^train-caffenet-sync +PASS .*; time: encode 3\.9 ms, decode 2\.9 ms; the step waited 1\.2 ms",
                     summary, re.M), summary
    assert "train-caffenet-sync.comet_time\tencode 3.9 ms" in (out / "results.tsv").read_text()
    comet = _sections(log.read_text())
    # caffenet-on (the stream), caffenet-sync, then the fallback's: cudnn-on, resnet18-on, resnet18-cudnn-on,
    # and the resumes' first runs
    assert len(comet) >= 7, log.read_text()
    assert "async: false" not in comet[0] and "caffenet" in comet[0].splitlines()[0], comet[0]
    assert all("async: false" in s for s in comet[1:]), log.read_text()
    assert any("resume-" in s for s in comet[1:]), log.read_text()
    assert any("models/zoo/" in s for s in comet[1:]), log.read_text()  # gpu-zoo's runs too
    assert any("models/fuzz/" in s for s in comet[1:]), log.read_text()  # and gpu-fuzz's


def test_gpu_check_falls_back_from_the_stream_when_the_comet_gtests_are_cut(bundle, tmp_path):
    """Our GPU gtests (their solvers keep `async`) cut at their limit: the fallback starts there, so
    gtest-every-solver's stores already get `async: false`, as do the trainings after it."""
    seen = tmp_path / "every_solver.txt"
    testbin = ('#!/bin/bash\ncase "$*" in\n'
               '  *CometEverySolver*) echo "$COMET_EVERY_SOLVER" > ' + str(seen) + '; '
               'echo "[ RUN      ] SGDSolverTest/2.Update"; echo "[       OK ] SGDSolverTest/2.Update (1 ms)"; '
               'echo "[  PASSED  ] 1 test." ;;\n'
               '  *GPU*) echo "[ RUN      ] CometGPUTest.Hangs"; exit 124 ;;\n'
               'esac\nexit 0\n')
    top = _bundle_with_stand_ins(bundle, tmp_path, testbin)
    out, log = tmp_path / "out", tmp_path / "solvers.log"
    env = dict(os.environ, OUT=str(out), GPU_CHECK_BUDGET="60", GPU_CHECK_SZ_MIB="16", GPU_CHECK_TRAIN_LIMIT="10",
               FAKE_CAFFE_LOG=str(log), PATH="/usr/bin:/bin")
    subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check"), str(top)], capture_output=True, text=True,
                   env=env, timeout=300)
    summary = (out / "summary.txt").read_text()
    assert re.search(r"^gtest-comet +TIMEOUT .*still running: CometGPUTest\.Hangs", summary, re.M), summary
    assert re.search(r"^stream-fallback .*gtest-comet was cut at its limit: every later COMET-on run has async: false",
                     summary, re.M), summary
    assert seen.read_text().strip() == 'compress_type: "None" update_interval: 1 async: false', seen.read_text()
    comet = _sections(log.read_text())
    assert comet and all("async: false" in s for s in comet), log.read_text()


def test_a_gpu_check_killed_from_outside_leaves_the_steps_it_finished(bundle, tmp_path):
    """The lent machine's own limit may kill the whole command: summary.txt and results.tsv are written
    after every step, so what ran comes back, marked as in progress."""
    hang = '#!/bin/bash\ncase "$*" in *GPU*) echo "[ RUN      ] CometGPUTest.Hangs"; exec sleep 300 ;; esac\n'
    top = _bundle_with_stand_ins(bundle, tmp_path, hang)
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), GPU_CHECK_BUDGET="520", FAKE_CAFFE_LOG=str(tmp_path / "solvers.log"),
               PATH="/usr/bin:/bin")
    proc = subprocess.Popen(["bash", str(ROOT / "scripts" / "gpu-check"), str(top)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "summary.txt").exists():  # the first step (device) is recorded
            assert time.monotonic() < deadline and proc.poll() is None, "no summary.txt after the first step"
            time.sleep(0.2)
        time.sleep(1)  # gtest-comet has started and hangs in the stand-in
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    summary = (out / "summary.txt").read_text()
    assert summary.startswith("COMET-Caffe GPU check: IN PROGRESS after "), summary
    assert re.search(r"^device +(PASS|FAIL) ", summary, re.M), summary
    assert "gpus\t" in (out / "results.tsv").read_text()


def test_gpu_check_names_the_test_a_cut_gtest_step_was_in(bundle, tmp_path):
    """A gtest step cut at its limit names the test it was still running (its last RUN line without
    an OK or FAILED): a hang in the GPU gtests says where it hung."""
    hang = ('#!/bin/bash\ncase "$*" in *GPU*) echo "[ RUN      ] CometGPUTest.Quick"; '
            'echo "[       OK ] CometGPUTest.Quick (1 ms)"; echo "[ RUN      ] CometGPUTest.Hangs"; exec sleep 300 ;; esac\n')
    top = _bundle_with_stand_ins(bundle, tmp_path, hang)
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), GPU_CHECK_BUDGET="30", FAKE_CAFFE_LOG=str(tmp_path / "solvers.log"),
               PATH="/usr/bin:/bin")
    p = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check"), str(top)], capture_output=True, text=True,
                       env=env, timeout=300)
    summary = (out / "summary.txt").read_text()
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    assert re.search(r"^gtest-comet +TIMEOUT .*ran 1 tests, 0 failed; still running: CometGPUTest\.Hangs", summary,
                     re.M), summary
