"""Shared fixtures. Workflow fixtures (prepare-dogs, train, report, models) are prefixed wf_."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

WF_REPO = Path(__file__).resolve().parents[2]


def _built() -> bool:
    from cometctl.errors import CometError
    from cometctl.paths import pycaffe_dir, tool_path

    try:
        tool_path("caffe")
        pycaffe_dir()
        return True
    except CometError:
        return False


WF_BUILT = _built()
WF_NEEDS_BUILD = pytest.mark.skipif(not WF_BUILT, reason="the Caffe build is absent: run `cometctl build` "
                                                         "(CI always builds it first)")


@pytest.fixture(scope="session")
def wf_pb2():
    """caffe_pb2 of the built fork (or COMET_CAFFE_PB2 during development); skips without either."""
    if not WF_BUILT and not os.environ.get("COMET_CAFFE_PB2"):
        pytest.skip("the Caffe build is absent: run `cometctl build` (CI always builds it first)")
    from cometctl.caffeproto import caffe_pb2

    return caffe_pb2()


@pytest.fixture(scope="session")
def wf_synthetic_archives(tmp_path_factory):
    """The embedded default archives (images.tar, lists.tar), generated once per session."""
    from cometctl import synthetic

    d = tmp_path_factory.mktemp("wf_synthetic_archives")
    return synthetic.generate(d)


@pytest.fixture(scope="session")
def wf_synthetic(wf_pb2, wf_synthetic_archives, tmp_path_factory):
    """A prepared synthetic data folder (64x64 LMDBs, mean, lists), made once per session."""
    from cometctl.dogs import prepare_dogs

    d = tmp_path_factory.mktemp("wf_synthetic")
    for f in wf_synthetic_archives:
        shutil.copy(f, d / f.name)
    prepare_dogs(d, archive=d / "images.tar", lists=d / "lists.tar", size=64, jobs=2)
    return d


def wf_point_model_at(pb2, model_dir: Path, data_dir: Path, out_dir: Path, solver_name: str = "solver.prototxt",
                      **solver_changes) -> Path:
    """Copy a shipped model's solver (solver_name) and net into out_dir with the data paths pointed at data_dir
    (the shipped files name data/dogs, data/imagenet or data/synthetic in the repository). Returns the solver copy."""
    from cometctl.caffeproto import read_text_proto, write_text_proto

    out_dir.mkdir(parents=True, exist_ok=True)
    solver = read_text_proto(model_dir / solver_name, pb2.SolverParameter())
    net = read_text_proto(WF_REPO / solver.net, pb2.NetParameter())
    batch = solver_changes.pop("batch", None)
    for layer in net.layer:
        if layer.type == "Data":
            layer.data_param.source = str(data_dir / Path(layer.data_param.source).name)
            layer.transform_param.mean_file = str(data_dir / "mean.binaryproto")
            if batch:
                layer.data_param.batch_size = batch
    write_text_proto(out_dir / "train_val.prototxt", net)
    solver.net = str(out_dir / "train_val.prototxt")
    for k, v in solver_changes.items():
        if k == "test_iter":
            del solver.test_iter[:]
            solver.test_iter.append(v)
        else:
            setattr(solver, k, v)
    write_text_proto(out_dir / "solver.prototxt", solver)
    return out_dir / "solver.prototxt"


@pytest.fixture(scope="session")
def wf_short_run(wf_pb2, wf_synthetic, tmp_path_factory):
    """comet_tiny trained for 30 iterations on the synthetic set by `cometctl train --cpu`."""
    if not WF_BUILT:
        pytest.skip("the Caffe build is absent: run `cometctl build` (CI always builds it first)")
    from cometctl.train import train

    base = tmp_path_factory.mktemp("wf_short_run")
    solver = wf_point_model_at(wf_pb2, WF_REPO / "models" / "comet_tiny", wf_synthetic, base / "model",
                               test_interval=15, display=5, snapshot=0)
    code = train(solver, cpu=True, iters=30, run_dir=base / "run")
    assert code == 0, (base / "run" / "caffe.log").read_text()[-3000:]
    return base / "run"


# ---- small image datasets in real layouts (prepare-imagenet, prepare-images, prepare-dogs) ------------
def wf_picture(seed: int, width: int = 300, height: int = 240):
    """A smooth RGB picture (gradients and soft blobs), so that resampling filters barely differ on it."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    img = np.zeros((height, width, 3), np.float32)
    for c in range(3):
        a, b, d = rng.uniform(-1, 1, 3)
        img[..., c] = 128 + 60 * (a * x / width + b * y / height) + 20 * d
        for _ in range(3):
            cx, cy, r = rng.uniform(0, width), rng.uniform(0, height), rng.uniform(25, 70)
            img[..., c] += rng.uniform(-60, 60) * np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * r * r))
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))


def wf_encode(im, fmt: str = "JPEG", **kw) -> bytes:
    import io

    buf = io.BytesIO()
    im.save(buf, format=fmt, **({"quality": 92} if fmt == "JPEG" else {}), **kw)
    return buf.getvalue()


def wf_odd_image(kind: str, seed: int, size=(280, 210)) -> bytes:
    """An image file of `kind`: "rgb" (a plain JPEG) or one that is odd but readable, as real datasets hold
    them: "gray" and "cmyk" JPEGs, "png" (a PNG, whatever name it is stored under), "exif" (a photo that
    EXIF says to turn, as cameras write them), PNGs of "rgba" and "palette" pixels, "bmp", "tiff"."""
    im = wf_picture(seed, *size)
    if kind == "exif":
        from PIL import Image

        exif = Image.Exif()
        exif[0x0112] = 6  # stored turned: shown rotated 90 degrees clockwise
        return wf_encode(im, exif=exif)
    mode, fmt = {"rgb": ("RGB", "JPEG"), "gray": ("L", "JPEG"), "cmyk": ("CMYK", "JPEG"), "png": ("RGB", "PNG"),
                 "rgba": ("RGBA", "PNG"), "palette": ("P", "PNG"), "bmp": ("RGB", "BMP"),
                 "tiff": ("RGB", "TIFF")}[kind]
    return wf_encode(im if mode == "RGB" else im.convert(mode), fmt)


def wf_unreadable(kind: str, image: bytes = b"", keep: int = 0) -> bytes:
    """A file named as an image that no decoder reads: "empty", "text" (no image at all), or "cut" (the first
    `keep` bytes of `image`: a download or a copy that stopped short)."""
    if kind == "empty":
        return b""
    if kind == "text":
        return b"not an image at all"
    if kind == "cut":
        assert 0 < keep < len(image), (keep, len(image))  # else it is no cut, or the whole image
        return image[:keep]
    raise ValueError(kind)


def wf_datums(lmdb_dir: Path) -> list:
    """An LMDB's (key, serialized Datum) pairs in key order: what two runs must agree on, byte for byte."""
    from cometctl import imagedb

    return [(k, d.SerializeToString()) for k, d in imagedb.iter_datums(lmdb_dir)]


def wf_tar(path: Path, members: dict, mode: str = "w") -> Path:
    """A tar of {name: bytes}, in that order; uncompressed unless mode says ("w:gz")."""
    import io
    import tarfile

    with tarfile.open(path, mode, format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 1_300_000_000
            tar.addfile(info, io.BytesIO(data))
    return path


HOLD_FOLDER = """import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(120)
"""


@contextlib.contextmanager
def held_by_another_process(folder: Path):
    """Another process holds `folder`'s lock (cometctl.locks) for the `with` block."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD_FOLDER, str(folder)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        yield
    finally:
        proc.kill()
        proc.wait()
