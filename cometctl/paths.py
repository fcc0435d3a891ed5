"""Where things live in a checkout: one place, so commands agree."""

from __future__ import annotations

import os
from pathlib import Path

# cometctl is installed editable from the repository, so the package's parent is the checkout.
REPO_ROOT = Path(os.environ.get("COMET_ROOT", Path(__file__).resolve().parent.parent))
CAFFE_DIR = REPO_ROOT / "caffe"
PATCHES_DIR = CAFFE_DIR / "patches"
# Our own files under caffe/ that are laid over the patched tree, mirroring its layout.
OVERLAY_SUBDIRS = ("include", "src", "tools", "python", "cmake")
UPSTREAM_LOCK = CAFFE_DIR / "upstream.lock"
SZ_DIR = REPO_ROOT / "sz"
DEFAULT_BUILD_DIR = REPO_ROOT / "build"
CACHE_DIR = Path(os.environ.get("COMET_CACHE", Path.home() / ".cache" / "comet-caffe"))


def build_dir(override: str | os.PathLike | None = None) -> Path:
    """The build directory: --build-dir, else $COMET_BUILD_DIR, else <repo>/build."""
    if override:
        return Path(override).resolve()
    env = os.environ.get("COMET_BUILD_DIR")
    return Path(env).resolve() if env else DEFAULT_BUILD_DIR


VARIANTS = ("cpu", "cuda")
# The CUDA variant's folders by what it links besides CUDA (cometctl build --cuda uses cuDNN and NCCL
# when it finds them): each configuration has its own folder, so switching never recompiles all.
# Looked up in this order when a CUDA build is asked for and none is active.
CUDA_FEATURE_SETS = (("cudnn", "nccl"), ("cudnn",), ("nccl",), ())


def variant_name(variant: str, features: tuple[str, ...] | list[str] = ()) -> str:
    """build/<name>: cpu, cuda, cuda-cudnn, cuda-nccl, cuda-cudnn-nccl."""
    return "-".join([variant, *features])


def variant_dirs(variant: str, override: str | os.PathLike | None = None,
                 features: tuple[str, ...] | list[str] = ()) -> tuple[Path, Path]:
    """(patched source tree, CMake binary dir) of one build variant and configuration."""
    root = build_dir(override) / variant_name(variant, features)
    return root / "src", root / "cmake"


def _all_variant_dirs(variant: str, override) -> list[tuple[Path, Path]]:
    if variant == "cuda":
        return [variant_dirs("cuda", override, f) for f in CUDA_FEATURE_SETS]
    return [variant_dirs(variant, override)]


def active_marker() -> Path:
    """The file in which build.activate records the build this venv uses."""
    import sys

    return Path(sys.prefix) / "comet-active.json"


def _active() -> dict | None:
    """The build that `cometctl build` last activated in this venv (see build.activate)."""
    import json

    try:
        return json.loads(active_marker().read_text())
    except (OSError, ValueError):
        return None


def _candidates(variant: str | None, override) -> list[tuple[Path, Path]]:
    active = _active()
    out = []
    if active and not override and (variant is None or active.get("variant") == variant):
        out.append((Path(active["src"]), Path(active["cmake"])))
    for v in ([variant] if variant else list(VARIANTS)):
        out += _all_variant_dirs(v, override)
    return out


def tool_path(name: str, variant: str | None = None, override: str | os.PathLike | None = None) -> Path:
    """Path of a built Caffe tool (caffe, convert_imageset, compute_image_mean): the active build's,
    else the CPU build's, else the CUDA build's. Raises CometError when none is built."""
    from .errors import CometError

    for _, cmake in _candidates(variant, override):
        if (cmake / "tools" / name).exists():
            return cmake / "tools" / name
    raise CometError(f"'{name}' is not built yet: run `cometctl build` first")


def pycaffe_dir(variant: str | None = None, override: str | os.PathLike | None = None) -> Path:
    """Directory to put on sys.path for `import caffe` (the patched tree's python/)."""
    from .errors import CometError

    for src, _ in _candidates(variant, override):
        if (src / "python" / "caffe" / "_caffe.so").exists():
            return src / "python"
    raise CometError("pycaffe is not built yet: run `cometctl build` first")


def user_file(path: str | os.PathLike) -> Path:
    """A file the user named: relative to the current folder, else to the repository root."""
    from .errors import CometError

    p = Path(path).expanduser()
    if p.exists():
        return p.resolve()
    q = REPO_ROOT / p
    if not p.is_absolute() and q.exists():
        return q.resolve()
    raise CometError(f"{path}: no such file")


def from_root(path: str, base: Path | None = None) -> Path:
    """A path inside a prototxt: relative ones start at `base`, the folder caffe runs in (caffe_folder;
    default the repository root)."""
    p = Path(path)
    return p if p.is_absolute() else (base or REPO_ROOT) / p


def caffe_folder(names) -> Path:
    """The folder caffe runs in, so that the relative paths of a solver and its net resolve as their
    author meant: the current folder when the first relative name of `names` that exists anywhere
    exists from there (as `caffe train` started there would find it: upstream's examples, a project
    folder of one's own), else the repository root (where the shipped models' paths start)."""
    here = Path.cwd().resolve()
    for name in names:
        p = Path(name)
        if not name or p.is_absolute():
            continue
        if (here / p).exists():
            return here
        if (REPO_ROOT / p).exists():
            return REPO_ROOT
    return REPO_ROOT


def prepare_hint(path: str, base: Path | None = None) -> str:
    """What makes a missing data source or mean file that a prototxt names: the command for our own
    datasets' folders (data/synthetic, data/dogs, data/imagenet), a general one for any other."""
    parts = Path(path).parts
    folder = parts[parts.index("data") + 1] if "data" in parts[:-1] else None
    if folder == "synthetic":
        return "run `cometctl prepare-dogs --synthetic`"
    if folder == "dogs":
        return "run `cometctl prepare-dogs`"
    if folder == "imagenet":
        return "run `cometctl prepare-imagenet` (see `cometctl prepare-imagenet --help`)"
    if len(parts) > 2 and parts[0] == "examples" and base is not None:
        # upstream's examples (run from the patched tree, build/<variant>/src): their own scripts
        creates = sorted((base / "examples" / parts[1]).glob("create_*.sh"))
        gets = sorted((base / "data" / parts[1]).glob("get_*.sh"))
        if creates:
            steps = [f"./data/{parts[1]}/{g.name}" for g in gets[:1]] + [f"./examples/{parts[1]}/{creates[0].name}"]
            return (f"upstream's own scripts make it: in {base}, {' then '.join(steps)}"
                    + (" (the first downloads)" if gets else ""))
    return ("create it first (`cometctl prepare-images DIR` makes train and val LMDBs and a mean file "
            f"from one folder per class), or fix the path: relative paths start at {base or REPO_ROOT}")
