"""cometctl build --cuda finds cuDNN and NCCL (cometctl/cudalibs.py): versions, the folders searched,
what a missing or too old one says, the CMake flags, each configuration's own build folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cometctl import build, cudalibs, paths
from cometctl.errors import CometError


def fake_cudnn(root: Path, major=9, minor=19, patch=0, lib=True, version_header=True) -> Path:
    inc = root / "include"
    inc.mkdir(parents=True, exist_ok=True)
    numbers = f"#define CUDNN_MAJOR {major}\n#define CUDNN_MINOR {minor}\n#define CUDNN_PATCHLEVEL {patch}\n"
    if version_header:
        (inc / "cudnn_version.h").write_text(numbers)
        (inc / "cudnn.h").write_text('#include "cudnn_version.h"\n')
    else:
        (inc / "cudnn.h").write_text(numbers)
    if lib:
        (root / "lib64").mkdir(exist_ok=True)
        (root / "lib64" / f"libcudnn.so.{major}").write_bytes(b"")
    return root


def fake_nccl(root: Path, major=2, lib=True) -> Path:
    (root / "include").mkdir(parents=True, exist_ok=True)
    (root / "include" / "nccl.h").write_text(
        f"#define NCCL_MAJOR {major}\n#define NCCL_MINOR 28\n#define NCCL_PATCH 9\n")
    if lib:
        (root / "lib").mkdir(exist_ok=True)
        (root / "lib" / "libnccl.so").write_bytes(b"")
    return root


def test_cudnn_9_is_found_with_its_version_and_library(tmp_path):
    r = fake_cudnn(tmp_path / "cudnn")
    got = cudalibs.find_cudnn([tmp_path / "nothing", r])
    assert got.found and got.why == ""
    assert got.found.version == (9, 19, 0) and got.found.version_str == "9.19.0"
    assert got.found.include == r / "include" and got.found.library == r / "lib64" / "libcudnn.so.9"


def test_cudnn_7_is_refused_as_too_old_for_the_port(tmp_path):
    r = fake_cudnn(tmp_path / "old", major=7, minor=6, patch=5, version_header=False)
    got = cudalibs.find_cudnn([r])
    assert got.found is None and "cuDNN 7.6.5" in got.why and "older than the cuDNN 8" in got.why


def test_cudnn_headers_without_the_library_say_where_they_looked(tmp_path):
    r = fake_cudnn(tmp_path / "hdr", lib=False)
    got = cudalibs.find_cudnn([r])
    assert got.found is None and "no libcudnn.so" in got.why and str(r / "lib64") in got.why


def test_nothing_found_names_the_folders(tmp_path):
    got = cudalibs.find_cudnn([tmp_path / "a"])
    assert got.found is None and str(tmp_path / "a" / "include") in got.why
    got = cudalibs.find_nccl([tmp_path / "a"])
    assert got.found is None and "nccl.h" in got.why


def test_nccl_2_is_found_and_nccl_1_refused(tmp_path):
    got = cudalibs.find_nccl([fake_nccl(tmp_path / "n2")])
    assert got.found and got.found.version == (2, 28, 9) and got.found.library.name == "libnccl.so"
    got = cudalibs.find_nccl([fake_nccl(tmp_path / "n1", major=1)])
    assert got.found is None and "older than NCCL 2" in got.why


def test_env_roots_come_first_then_the_toolkit(tmp_path):
    nvcc = tmp_path / "tk" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.touch()
    roots = cudalibs.default_roots(("CUDNN_ROOT",), str(nvcc), env={"CUDNN_ROOT": str(tmp_path / "mine")})
    assert roots[:2] == [tmp_path / "mine", tmp_path / "tk"]
    assert Path("/usr/local/cuda") in roots and Path("/usr") in roots


def test_choose_when_found_when_missing_and_when_opted_out(tmp_path):
    found = cudalibs.find_cudnn([fake_cudnn(tmp_path / "c")])
    missing = cudalibs.find_cudnn([tmp_path / "none"])
    assert cudalibs.choose(None, found, "cuDNN", "--cudnn", 13) == found.found
    assert cudalibs.choose(True, found, "cuDNN", "--cudnn", 13) == found.found
    assert cudalibs.choose(False, found, "cuDNN", "--cudnn", 13) is None
    assert cudalibs.choose(None, missing, "cuDNN", "--cudnn", 13) is None  # auto: built without it
    with pytest.raises(CometError) as e:
        cudalibs.choose(True, missing, "cuDNN", "--cudnn", 13)
    msg = str(e.value)
    assert msg.startswith("--cudnn: no cudnn.h") and "install cuDNN 9 for CUDA 13" in msg
    assert "cudnn9-cuda-13" in msg and "CUDNN_ROOT" in msg and "--no-cudnn" in msg
    with pytest.raises(CometError, match="install NCCL 2 for CUDA 13.*libnccl-dev.*--no-nccl"):
        cudalibs.choose(True, cudalibs.find_nccl([tmp_path / "none"]), "NCCL", "--nccl", 13)


def test_cmake_flags_hand_the_found_paths_to_upstream(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "find_nvcc", lambda: "/usr/local/cuda/bin/nvcc")
    monkeypatch.setattr(build, "nvcc_launcher", lambda root: "/usr/local/cuda/bin/nvcc")
    cudnn = cudalibs.find_cudnn([fake_cudnn(tmp_path / "c")]).found
    nccl = cudalibs.find_nccl([fake_nccl(tmp_path / "n")]).found
    opts = build.BuildOptions(variant="cuda", cuda_archs="90")
    args = build.cmake_args(opts, tmp_path / "src", sys.executable, cudnn, nccl)
    assert "-DUSE_CUDNN=ON" in args and f"-DCUDNN_INCLUDE={cudnn.include}" in args
    assert f"-DCUDNN_LIBRARY={cudnn.library}" in args
    assert "-DUSE_NCCL=ON" in args and f"-DNCCL_INCLUDE_DIR={nccl.include}" in args
    assert f"-DNCCL_LIBRARIES={nccl.library}" in args
    plain = build.cmake_args(opts, tmp_path / "src", sys.executable)
    assert "-DUSE_CUDNN=OFF" in plain and "-DUSE_NCCL=OFF" in plain
    assert not [a for a in plain if a.startswith(("-DCUDNN_", "-DNCCL_"))]
    cpu = build.cmake_args(build.BuildOptions(), tmp_path / "src", sys.executable)
    assert "-DCPU_ONLY=ON" in cpu and "-DUSE_CUDNN=OFF" in cpu and "-DUSE_NCCL=OFF" in cpu


def test_each_configuration_has_its_own_folder(tmp_path):
    assert paths.variant_dirs("cuda", tmp_path)[1] == tmp_path / "cuda" / "cmake"
    assert paths.variant_dirs("cuda", tmp_path, ("cudnn", "nccl"))[1] == tmp_path / "cuda-cudnn-nccl" / "cmake"
    assert paths.variant_dirs("cpu", tmp_path)[0] == tmp_path / "cpu" / "src"
    # a CUDA tool is looked up in every CUDA configuration, the cuDNN + NCCL one first
    tool = tmp_path / "cuda-cudnn-nccl" / "cmake" / "tools" / "caffe"
    tool.parent.mkdir(parents=True)
    tool.touch()
    assert paths.tool_path("caffe", "cuda", tmp_path) == tool


def test_the_configure_line_is_read_and_checked(tmp_path):
    log = tmp_path / "build.log"
    log.write_text("old run\n-- COMET: CPU_ONLY OFF, USE_CUDNN OFF, USE_NCCL OFF\n")
    offset = log.stat().st_size
    with open(log, "a") as f:
        f.write("-- COMET: sz compressor from /x\n"
                "-- COMET: CPU_ONLY OFF, USE_CUDNN ON (cuDNN 9.19.0, /usr/lib/libcudnn.so), USE_NCCL ON (/l/libnccl.so)\n")
    line = build.configure_line(log, offset)
    assert line.startswith("CPU_ONLY OFF, USE_CUDNN ON (cuDNN 9.19.0")
    found = object()
    build.check_configured(line, found, found, log)
    with pytest.raises(CometError, match="USE_NCCL ON where OFF was asked for"):
        build.check_configured(line, found, None, log)
    with pytest.raises(CometError, match="USE_CUDNN OFF where ON was asked for"):
        build.check_configured(build.configure_line(log, 0), found, None, log)
    with pytest.raises(CometError, match="did not print its COMET configuration line"):
        build.check_configured("", None, None, log)


@pytest.mark.parametrize("flag", ["--cudnn", "--nccl"])
def test_cudnn_and_nccl_need_the_cuda_variant(flag):
    r = subprocess.run([str(Path(sys.executable).parent / "cometctl"), "build", "--cpu-only", flag],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip() == f"cometctl: error: {flag} needs --cuda"


def test_a_required_cudnn_that_is_missing_stops_the_build_before_anything_runs(tmp_path, monkeypatch):
    """build() refuses before touching the build folder: the clear message, no half-configured tree."""
    monkeypatch.setattr(build, "find_nvcc", lambda: "/usr/local/cuda/bin/nvcc")
    monkeypatch.setattr(build, "cuda_major", lambda nvcc: 13)
    monkeypatch.setattr(cudalibs, "default_roots", lambda env_vars, nvcc, env=None: [tmp_path / "none"])
    opts = build.BuildOptions(variant="cuda", cudnn=True, build_dir=str(tmp_path / "b"), install_deps=False)
    with pytest.raises(CometError, match=r"^--cudnn: no cudnn.h .* install cuDNN 9 for CUDA 13"):
        build.build(opts)
    assert not (tmp_path / "b").exists()
