"""cuDNN and NCCL for the CUDA variant: where they are and which version, or why they cannot be used.

`cometctl build --cuda` builds with each of them when it is found (`--no-cudnn`, `--no-nccl` opt
out); `--cudnn` or `--nccl` when it is missing is an error that says what to install, before CMake
runs. What is searched, in order (the first folder holding the header wins, and the library is
taken from the same installation when it has one):

  cuDNN: $CUDNN_ROOT, $CUDNN_HOME, the CUDA toolkit nvcc belongs to, /usr/local/cuda, /usr, /usr/local
  NCCL:  $NCCL_ROOT, $NCCL_HOME, $NCCL_DIR, the same toolkit folders

Each root is looked at as ROOT/include (ROOT/targets/x86_64-linux/include, ROOT/include/x86_64-linux-gnu)
for the header and ROOT/lib64, ROOT/lib, ROOT/targets/x86_64-linux/lib, ROOT/lib/x86_64-linux-gnu for
the library. The port of upstream's cuDNN layers (caffe/patches) uses the cuDNN 8 API: cuDNN 7 or
older is refused; upstream's NCCL code needs NCCL 2.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import CometError

MIN_CUDNN = 8
MIN_NCCL = 2


@dataclass(frozen=True)
class Found:
    name: str                  # "cuDNN" or "NCCL"
    version: tuple[int, int, int]
    include: Path              # the folder holding the header
    library: Path              # the shared library to link

    @property
    def version_str(self) -> str:
        return ".".join(str(v) for v in self.version)

    def describe(self) -> str:
        return f"{self.name} {self.version_str} ({self.include}, {self.library})"


@dataclass(frozen=True)
class Search:
    """What one search found: the usable installation, or why there is none."""
    found: Found | None
    why: str                   # "" when found


def toolkit_root(nvcc: str | None) -> Path | None:
    """The CUDA toolkit folder nvcc belongs to (bin/nvcc -> the folder above bin)."""
    if not nvcc:
        return None
    return Path(nvcc).resolve().parent.parent


def default_roots(env_vars: tuple[str, ...], nvcc: str | None, env=None) -> list[Path]:
    env = os.environ if env is None else env
    roots = [Path(env[v]) for v in env_vars if env.get(v)]
    tk = toolkit_root(nvcc)
    if tk:
        roots.append(tk)
    roots += [Path("/usr/local/cuda"), Path("/usr"), Path("/usr/local")]
    out = []
    for r in roots:
        if r not in out:
            out.append(r)
    return out


def _include_dirs(root: Path) -> list[Path]:
    return [root / "include", root / "targets" / "x86_64-linux" / "include", root / "include" / "x86_64-linux-gnu"]


def _lib_dirs(root: Path) -> list[Path]:
    return [root / "lib64", root / "lib", root / "targets" / "x86_64-linux" / "lib", root / "lib" / "x86_64-linux-gnu"]


def _defines(text: str, *names: str) -> tuple[int, ...] | None:
    vals = []
    for n in names:
        m = re.search(rf"^\s*#\s*define\s+{n}\s+(\d+)", text, re.M)
        if not m:
            return None
        vals.append(int(m.group(1)))
    return tuple(vals)


def _library(roots_first: list[Path], all_roots: list[Path], stem: str, major: int) -> Path | None:
    """libSTEM.so (the development link) or libSTEM.so.MAJOR, from the header's own installation first."""
    for root in roots_first + [r for r in all_roots if r not in roots_first]:
        for d in _lib_dirs(root):
            for name in (f"lib{stem}.so", f"lib{stem}.so.{major}"):
                if (d / name).exists():
                    return d / name
    return None


@dataclass(frozen=True)
class _Wanted:
    """What the search for one library looks for."""
    name: str                      # in messages and in Found
    headers: tuple[str, ...]       # tried in this order in each include folder; the last is the main one
    defines: tuple[str, str, str]  # the version: major, minor, patch
    files: str                     # what the include folder holds, in messages: "headers" or "header"
    stem: str                      # libSTEM.so
    minimum: int                   # the oldest usable major version
    older_than: str                # what a version under it is older than, in messages


_CUDNN = _Wanted("cuDNN", ("cudnn_version.h", "cudnn.h"), ("CUDNN_MAJOR", "CUDNN_MINOR", "CUDNN_PATCHLEVEL"),
                 "headers", "cudnn", MIN_CUDNN,
                 f"the cuDNN {MIN_CUDNN} API that the port of upstream's cuDNN layers uses")
_NCCL = _Wanted("NCCL", ("nccl.h",), ("NCCL_MAJOR", "NCCL_MINOR", "NCCL_PATCH"), "header", "nccl", MIN_NCCL,
                f"NCCL {MIN_NCCL}")


def _search(roots: list[Path], wanted: _Wanted, check) -> Search:
    """Header, version, library: the first header of `wanted` in the include folders of the roots, in order,
    then its version, then the library, from the header's own root first. check(inc, header, version) has
    the last word on a header before the version is compared: None to go on to the next header, a reason
    to refuse it, or "" (usable)."""
    looked = []
    for root in roots:
        for inc in _include_dirs(root):
            looked.append(str(inc))
            for header in wanted.headers:
                h = inc / header
                if not h.is_file():
                    continue
                v = _defines(h.read_text(errors="replace"), *wanted.defines)
                why = check(inc, h, v)
                if why is None:
                    continue
                if why:
                    return Search(None, why)
                version = ".".join(map(str, v))
                if v[0] < wanted.minimum:
                    return Search(None, f"{wanted.name} {version} in {inc} is older than {wanted.older_than}")
                lib = _library([root], roots, wanted.stem, v[0])
                if lib is None:
                    return Search(None, f"{wanted.name} {version} {wanted.files} in {inc}, but no lib{wanted.stem}.so "
                                        f"in {', '.join(str(d) for d in _lib_dirs(root))}")
                return Search(Found(wanted.name, v, inc, lib), "")
    return Search(None, f"no {wanted.headers[-1]} ({wanted.name}) in " + ", ".join(dict.fromkeys(looked)))


def find_cudnn(roots: list[Path]) -> Search:
    """cuDNN 8 or newer: version from cudnn_version.h (cuDNN 8+) or cudnn.h (older), and libcudnn."""
    def check(inc: Path, h: Path, v) -> str | None:
        if v is None:
            return None  # cudnn.h of cuDNN 8+ includes cudnn_version.h for the numbers
        if not (inc / "cudnn.h").is_file():
            return f"{h} has no cudnn.h beside it"
        return ""

    return _search(roots, _CUDNN, check)


def find_nccl(roots: list[Path]) -> Search:
    """NCCL 2: version from nccl.h, and libnccl."""
    def check(inc: Path, h: Path, v) -> str | None:
        return f"{h} does not say its version (NCCL_MAJOR)" if v is None else ""

    return _search(roots, _NCCL, check)


def install_hint(name: str, cuda_major: int | None) -> str:
    cu = str(cuda_major) if cuda_major else "N"
    if name == "cuDNN":
        return (f"install cuDNN 9 for CUDA {cu} (NVIDIA's CUDA repository: apt-get install cudnn9-cuda-{cu}; "
                f"or unpack NVIDIA's cuDNN archive and set CUDNN_ROOT to it), or build with --no-cudnn")
    return (f"install NCCL 2 for CUDA {cu} (NVIDIA's CUDA repository: apt-get install libnccl2 libnccl-dev; "
            f"or set NCCL_ROOT to an NCCL build), or build with --no-nccl")


def choose(want: bool | None, search: Search, name: str, flag: str, cuda_major: int | None) -> Found | None:
    """want True: the library must be there (else CometError naming what to install); None: use it
    when found; False: do not use it."""
    if want is False:
        return None
    if search.found:
        return search.found
    if want:
        raise CometError(f"{flag}: {search.why}; {install_hint(name, cuda_major)}")
    return None
