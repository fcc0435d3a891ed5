"""`cometctl build`: pinned upstream -> verify -> unpack -> patch series -> our files -> CMake -> tools, pycaffe.

The patched tree lives in build/<variant>/src and is updated by content: a file is rewritten only when
its bytes change, so after editing one of our files the next build recompiles only what depends on it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from . import cudalibs, deps, patches, paths, upstream
from .errors import CometError
from .locks import folder_lock
from .ui import console, counter, step

TOOLS = ("caffe", "convert_imageset", "compute_image_mean", "upgrade_net_proto_text", "upgrade_solver_proto_text")
# upstream's examples' converters, which its create_*.sh scripts run as build/examples/<name>/<tool>.bin
EXAMPLE_TOOLS = ("mnist/convert_mnist_data", "cifar10/convert_cifar_data", "siamese/convert_mnist_siamese_data")
DEFAULT_CUDA_ARCHS = "75 80 86 89 90"


@dataclass
class BuildOptions:
    variant: str = "cpu"                 # cpu | cuda
    cudnn: bool | None = None            # CUDA variant: None = when found, True = required, False = off
    nccl: bool | None = None             # the same for NCCL (several GPUs in one `caffe train`)
    jobs: int = os.cpu_count() or 2
    build_dir: str | None = None
    upstream: str | None = None          # local tarball instead of fetching
    install_deps: bool = True
    tests: bool = False                  # also build upstream's gtest binary (test.testbin)
    activate: bool = True                # make this build the one `import caffe` and the tools use
    cuda_archs: str = DEFAULT_CUDA_ARCHS
    extra_cmake: list[str] = field(default_factory=list)


@dataclass
class BuildResult:
    variant: str
    src: Path
    cmake_dir: Path
    compiled: int                        # objects compiled in this run (0 when nothing changed)
    log: Path
    features: tuple[str, ...] = ()       # "cudnn", "nccl": what the CUDA variant was built with


# ---------------------------------------------------------------------------- the patched tree

def overlay_files(caffe_dir: Path = paths.CAFFE_DIR) -> dict[str, Path]:
    """Our own files to lay over the tree: relative path -> file."""
    out = {}
    for sub in paths.OVERLAY_SUBDIRS:
        base = caffe_dir / sub
        if base.is_dir():
            for f in sorted(base.rglob("*")):
                if f.is_file() and "__pycache__" not in f.parts:
                    out[f.relative_to(caffe_dir).as_posix()] = f
    return out


def stage_tree(archive: Path, stage: Path, patches_dir: Path = paths.PATCHES_DIR,
               caffe_dir: Path = paths.CAFFE_DIR) -> tuple[Path, list[str]]:
    """Unpack upstream into stage, apply the series, lay our files over it."""
    if stage.exists():
        shutil.rmtree(stage)
    root = upstream.unpack(archive, stage)
    applied = patches.apply_series(root, patches_dir)
    for rel, f in overlay_files(caffe_dir).items():
        dest = root / rel
        if dest.exists():
            raise CometError(f"our file caffe/{rel} would replace an upstream file; "
                             "change upstream files with a patch (see CONTRIBUTING.md)")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, dest)
    return root, applied


def sync_tree(staged: Path, target: Path) -> int:
    """Make target's content equal staged's, touching only files whose bytes differ (fresh mtimes, so
    make sees them). Files that an earlier sync placed and that are gone now are removed; build
    products in the tree (pycaffe's _caffe.so link, generated protos) are left alone."""
    manifest = target.parent / (target.name + ".manifest")
    before = set(manifest.read_text().split("\n")) if manifest.exists() else set()
    now, changed = set(), 0
    for dirpath, _, filenames in os.walk(staged):
        for name in filenames:
            s = Path(dirpath) / name
            rel = s.relative_to(staged).as_posix()
            now.add(rel)
            t = target / rel
            if s.is_symlink():
                if not t.is_symlink() or os.readlink(t) != os.readlink(s):
                    t.unlink(missing_ok=True)
                    t.parent.mkdir(parents=True, exist_ok=True)
                    os.symlink(os.readlink(s), t)
                    changed += 1
                continue
            data = s.read_bytes()
            if t.is_file() and not t.is_symlink() and t.read_bytes() == data:
                continue
            t.parent.mkdir(parents=True, exist_ok=True)
            t.unlink(missing_ok=True)
            t.write_bytes(data)
            shutil.copymode(s, t)
            changed += 1
    for rel in before - now - {""}:
        (target / rel).unlink(missing_ok=True)
        changed += 1
    manifest.write_text("\n".join(sorted(now)))
    return changed


# ---------------------------------------------------------------------------- CMake

def ccache_launchers(*languages: str) -> list[str]:
    """CMake's compiler-launcher settings that put ccache in front of these languages' compilers."""
    if not shutil.which("ccache"):
        return []
    return [f"-DCMAKE_{lang}_COMPILER_LAUNCHER=ccache" for lang in languages]


def sz_cmake_args(opts: BuildOptions) -> list[str]:
    """Our compressor library, built per variant: the CUDA variant gets the CUDA backend."""
    args = ["-DCMAKE_BUILD_TYPE=Release", "-DSZ_BUILD_TESTS=OFF", "-DSZ_FUZZ=OFF",
            *ccache_launchers("CXX", "C")]
    if opts.variant == "cuda":
        archs = ";".join(opts.cuda_archs.replace(",", " ").split())
        args += ["-DSZ_CUDA=ON", f"-DCMAKE_CUDA_COMPILER={find_nvcc()}",
                 f"-DCMAKE_CUDA_ARCHITECTURES={archs}", *ccache_launchers("CUDA")]
    else:
        args.append("-DSZ_CUDA=OFF")
    return args


def cmake_args(opts: BuildOptions, src: Path, python: str, cudnn: cudalibs.Found | None = None,
               nccl: cudalibs.Found | None = None) -> list[str]:
    args = [
        "-DCMAKE_BUILD_TYPE=Release", "-DBLAS=Open", "-Dpython_version=3",
        f"-DPYTHON_EXECUTABLE={python}", "-DBUILD_docs=OFF", "-DBUILD_matlab=OFF",
        "-DUSE_LEVELDB=ON", "-DUSE_LMDB=ON", "-DUSE_OPENCV=ON", "-DUSE_HDF5=ON",
    ]
    args += ccache_launchers("CXX", "C")
    if opts.variant == "cpu":
        args += ["-DCPU_ONLY=ON", "-DUSE_CUDNN=OFF", "-DUSE_NCCL=OFF"]
    else:
        archs = opts.cuda_archs.replace(",", " ").split()
        args.append("-DCPU_ONLY=OFF")
        # the paths found here are handed to upstream's detect_cuDNN and FindNCCL (cache variables)
        if cudnn:
            args += ["-DUSE_CUDNN=ON", f"-DCUDNN_INCLUDE={cudnn.include}", f"-DCUDNN_LIBRARY={cudnn.library}"]
        else:
            args.append("-DUSE_CUDNN=OFF")
        if nccl:
            args += ["-DUSE_NCCL=ON", f"-DNCCL_INCLUDE_DIR={nccl.include}", f"-DNCCL_LIBRARIES={nccl.library}"]
        else:
            args.append("-DUSE_NCCL=OFF")
        args += [f"-DCUDA_NVCC_EXECUTABLE={nvcc_launcher(src.parent)}",
                 "-DCUDA_ARCH_NAME=Manual", f"-DCUDA_ARCH_BIN={' '.join(archs)}",
                 f"-DCUDA_ARCH_PTX={archs[-1]}"]
    return args + list(opts.extra_cmake)


def nvcc_launcher(variant_root: Path) -> str:
    """upstream's FindCUDA takes one nvcc path and no launcher, so ccache goes in a wrapper script."""
    nvcc = find_nvcc()
    if not shutil.which("ccache"):
        return nvcc
    wrapper = variant_root / "nvcc-ccache"
    wrapper.write_text(f'#!/bin/sh\nexec ccache "{nvcc}" "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def ccache_env(build_root: Path) -> dict:
    """Paths under build_root hashed relative to it, so a fresh clone elsewhere reuses the cache."""
    env = dict(os.environ)
    env.setdefault("CCACHE_DIR", str(Path.home() / ".cache" / "ccache"))
    env["CCACHE_BASEDIR"] = str(build_root)
    env.setdefault("CCACHE_NOHASHDIR", "1")
    return env


def find_nvcc() -> str:
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
    if not nvcc:
        raise CometError("CUDA variant needs nvcc (CUDA 12 or 13): install NVIDIA's CUDA toolkit "
                         "or use the CUDA Docker image (docker/cuda/Dockerfile)")
    major = cuda_major(nvcc)
    if major is None or major < 12:
        raise CometError(f"{nvcc} is not CUDA 12 or 13 (release {major if major else 'unknown'})")
    return nvcc


def cuda_major(nvcc: str) -> int | None:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    return int(m.group(1)) if m else None


def cuda_libraries(opts: BuildOptions, nvcc: str, env=None) -> tuple[cudalibs.Found | None, cudalibs.Found | None]:
    """(cuDNN, NCCL) for the CUDA variant, as opts asks: each when found unless opted out; a required
    one that is missing or too old is a CometError naming what to install (before anything is built)."""
    major = cuda_major(nvcc)
    cudnn = cudalibs.choose(
        opts.cudnn, cudalibs.find_cudnn(cudalibs.default_roots(("CUDNN_ROOT", "CUDNN_HOME"), nvcc, env))
        if opts.cudnn is not False else cudalibs.Search(None, ""), "cuDNN", "--cudnn", major)
    nccl = cudalibs.choose(
        opts.nccl, cudalibs.find_nccl(cudalibs.default_roots(("NCCL_ROOT", "NCCL_HOME", "NCCL_DIR"), nvcc, env))
        if opts.nccl is not False else cudalibs.Search(None, ""), "NCCL", "--nccl", major)
    return cudnn, nccl


# The line caffe/cmake/Comet.cmake prints: what the variant was configured with.
_CONFIGURED = re.compile(r"^-- COMET: (CPU_ONLY \S+, USE_CUDNN .*, USE_NCCL .*)$")


def configure_line(log_path: Path, offset: int) -> str:
    """Comet.cmake's "CPU_ONLY .., USE_CUDNN .., USE_NCCL .." line of the configure run that began at offset."""
    with open(log_path, errors="replace") as f:
        f.seek(offset)
        for line in f:
            m = _CONFIGURED.match(line.rstrip("\n"))
            if m:
                return m.group(1)
    return ""


def check_configured(line: str, cudnn, nccl, log_path: Path) -> None:
    """What CMake configured is what was asked for: upstream's detect_cuDNN can still say no (it then
    builds without cuDNN, silently)."""
    if not line:
        raise CometError(f"CMake's configure did not print its COMET configuration line; see {log_path}")
    m = re.search(r"USE_CUDNN (\S+).*, USE_NCCL (\S+)", line)
    for name, got, want in (("USE_CUDNN", m.group(1), bool(cudnn)), ("USE_NCCL", m.group(2), bool(nccl))):
        if (got == "ON") != want:
            raise CometError(f"CMake configured {name} {got} where {'ON' if want else 'OFF'} was asked for; "
                             f"see {log_path}")


_PCT = re.compile(r"^\[\s*(\d+)%\]")


def run_logged(cmd: list[str], log, cwd: Path | None = None, title: str = "", env=None) -> int:
    """Run cmd with its output appended to log; show a bar driven by make's [NN%] lines.
    Returns the number of objects compiled. On failure print the log's tail and path."""
    log.write(f"\n$ {' '.join(cmd)}\n")
    log.flush()
    compiled = 0
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace", env=env)
    with counter(title, 100) as advance:
        for line in proc.stdout:
            log.write(line)
            m = _PCT.match(line)
            if m:
                advance(0, completed=int(m.group(1)), description=f"{title}: {line[7:].strip()[-60:]}")
            if "Building CXX object" in line or "Building NVCC" in line or "Building C object" in line:
                compiled += 1
        rc = proc.wait()
        if rc == 0:
            advance(0, completed=100, description=title)
    log.flush()
    if rc != 0:
        raise CometError(f"{title} failed (exit {rc}):\n{_tail(Path(log.name))}\nfull log: {log.name}")
    return compiled


def _tail(path: Path, n: int = 40) -> str:
    lines = path.read_text(errors="replace").splitlines()
    errs = [i for i, l in enumerate(lines) if re.search(r"\berror\b|Error \d|FAILED", l)]
    start = max(0, (errs[0] - 5) if errs else len(lines) - n)
    return "\n".join(lines[start:start + n])


# ---------------------------------------------------------------------------- activation

def _venv_site() -> Path | None:
    if sys.prefix == sys.base_prefix:
        return None
    return Path(sysconfig.get_paths()["purelib"])


def link_build_folder(src: Path, cmake_dir: Path) -> None:
    """src/build -> the CMake build: upstream's scripts, run from the patched tree as from a Caffe
    checkout, call ./build/tools/caffe and ./build/examples/<name>/<tool>.bin (examples/mnist/
    create_mnist.sh, train_lenet.sh, examples/cifar10/*.sh)."""
    link = src / "build"
    target = os.path.relpath(cmake_dir, src)
    if link.is_symlink() and os.readlink(link) == target:
        return
    if link.exists() and not link.is_symlink():
        console.print(f"  note: {link} is not ours; upstream's scripts will not find ./build/tools/caffe there")
        return
    link.unlink(missing_ok=True)
    link.symlink_to(target)


def activate(result: BuildResult) -> str:
    """Make this build the one the venv uses: pycaffe on sys.path, the tools in the venv's bin/."""
    site = _venv_site()
    if site is None:
        return (f"not in a venv: use PYTHONPATH={result.src / 'python'} and the tools in "
                f"{result.cmake_dir / 'tools'}")
    (site / "comet-pycaffe.pth").write_text(str(result.src / "python") + "\n")
    bindir = Path(sys.prefix) / "bin"
    for tool in TOOLS:
        link = bindir / tool
        link.unlink(missing_ok=True)
        link.symlink_to(result.cmake_dir / "tools" / tool)
    paths.active_marker().write_text(json.dumps(
        {"variant": result.variant, "features": list(result.features), "src": str(result.src),
         "cmake": str(result.cmake_dir)}))
    return f"`import caffe` and {', '.join(TOOLS)} in {bindir} now use the {result.variant} build"


# ---------------------------------------------------------------------------- the command

def build(opts: BuildOptions) -> BuildResult:
    if opts.variant not in paths.VARIANTS:
        raise CometError(f"unknown variant {opts.variant!r}")
    if opts.variant != "cuda" and (opts.cudnn or opts.nccl):
        raise CometError(f"--{'cudnn' if opts.cudnn else 'nccl'} needs --cuda")
    cudnn = nccl = None
    if opts.variant == "cuda":
        nvcc = find_nvcc()
        cudnn, nccl = cuda_libraries(opts, nvcc)
    features = tuple(f for f, on in (("cudnn", cudnn), ("nccl", nccl)) if on)
    src, cmake_dir = paths.variant_dirs(opts.variant, opts.build_dir, features)
    cmake_dir.mkdir(parents=True, exist_ok=True)
    with folder_lock(cmake_dir.parent, f"building the {opts.variant} variant"):
        return _build(opts, src, cmake_dir, features, cudnn, nccl, nvcc if opts.variant == "cuda" else None)


def _build(opts: BuildOptions, src: Path, cmake_dir: Path, features, cudnn, nccl, nvcc) -> BuildResult:
    log_path = cmake_dir.parent / "build.log"
    with open(log_path, "w") as log:
        with step("check Debian packages"):
            installed = deps.ensure(deps.BUILD_PACKAGES, opts.install_deps, log)
        if installed:
            console.print(f"  installed: {' '.join(installed)}")
        if opts.variant == "cuda":
            console.print(f"  nvcc: {nvcc}")
            for name, flag, found, want in (("cuDNN", "cudnn", cudnn, opts.cudnn), ("NCCL", "nccl", nccl, opts.nccl)):
                if found:
                    console.print(f"  {found.describe()}")
                elif want is False:
                    console.print(f"  {name}: off (--no-{flag})")
                else:
                    console.print(f"  {name}: not found, building without it ({cudalibs.install_hint(name, cuda_major(nvcc))})")
            console.print(f"  build folder: {cmake_dir.parent}")

        pin = upstream.Pin.load()
        archive, origin = upstream.obtain(pin, opts.upstream, log)
        console.print(f"  upstream Caffe {pin.commit[:12]} from {origin}")

        with step("apply patch series and our files"):
            stage = cmake_dir.parent / "stage"
            staged, applied = stage_tree(archive, stage)
            changed = sync_tree(staged, src)
            shutil.rmtree(stage)
        console.print(f"  {len(applied)} patches applied; {changed} files changed in {src}")

        python = sys.executable
        env = ccache_env(src.parent.parent)
        sz_dir = cmake_dir.parent / "sz"
        run_logged(["cmake", "-S", str(paths.SZ_DIR), "-B", str(sz_dir), *sz_cmake_args(opts)],
                   log, title="configure sz (CMake)", env=env)
        compiled = run_logged(["cmake", "--build", str(sz_dir), "-j", str(opts.jobs),
                               "--target", "sz"], log, title=f"build sz ({opts.variant})", env=env)
        log.flush()
        offset = log.tell()
        run_logged(["cmake", "-S", str(src), "-B", str(cmake_dir),
                    *cmake_args(opts, src, python, cudnn, nccl), f"-Dsz_DIR={sz_dir}"],
                   log, title="configure (CMake)", env=env)
        configured = configure_line(log_path, offset)
        console.print(f"  configured: {configured}")
        check_configured(configured, cudnn, nccl, log_path)
        # upstream names the caffe tool target caffe.bin (the library is "caffe")
        targets = ["caffe", "pycaffe", "caffe.bin", *TOOLS[1:], *(t.split("/")[1] for t in EXAMPLE_TOOLS)]
        if opts.tests:
            targets.append("test.testbin")
        compiled += run_logged(["cmake", "--build", str(cmake_dir), "-j", str(opts.jobs),
                               "--target", *targets],
                              log, title=f"build ({opts.variant})", env=env)
    result = BuildResult(opts.variant, src, cmake_dir, compiled, log_path, features)
    missing = [t for t in TOOLS if not (cmake_dir / "tools" / t).exists()]
    missing += [t for t in EXAMPLE_TOOLS if not (cmake_dir / "examples" / f"{t}.bin").exists()]
    if missing:
        raise CometError(f"build finished but {', '.join(missing)} missing; see {log_path}")
    link_build_folder(src, cmake_dir)
    console.print(f"  compiled {compiled} objects; log: {log_path}")
    if opts.activate:
        console.print(f"  {activate(result)}")
    return result
