"""The embedded default dataset: a small, learnable stand-in for Stanford Dogs, generated on the spot.

It has the real dataset's layout, so it goes through exactly the same code path: an `images.tar` with
`Images/<wnid>-<breed>/<wnid>_<n>.jpg` (the first ten Stanford Dogs folder names) and a `lists.tar` with
`file_list.mat`, `train_list.mat` and `test_list.mat` (MATLAB files with file_list, annotation_list and
1-based labels, as in the original).

Each class is one (shape, colour family) pair: five shapes (disc, square, triangle, cross, ring) times two
colour families (warm, cool). Every image varies position, size, rotation, hue within the family,
background gradient, noise and distractor lines, so a net must learn shape and colour together; chance
is 10%.
"""

from __future__ import annotations

import io
import os
import tarfile
import time
from pathlib import Path

import numpy as np

from .ui import counting_progress

CLASSES = [
    "n02085620-Chihuahua", "n02085782-Japanese_spaniel", "n02085936-Maltese_dog", "n02086079-Pekinese",
    "n02086240-Shih-Tzu", "n02086646-Blenheim_spaniel", "n02086910-papillon", "n02087046-toy_terrier",
    "n02087394-Rhodesian_ridgeback", "n02088094-Afghan_hound",
]
SHAPES = ("disc", "square", "triangle", "cross", "ring")
FAMILIES = ((0.0, 0.12), (0.5, 0.68))  # hue ranges (0..1): warm reds/oranges, cool cyans/blues


def _shape_points(shape: str, cx: float, cy: float, r: float, angle: float):
    def rot(pts):
        c, s = np.cos(angle), np.sin(angle)
        return [(cx + x * c - y * s, cy + x * s + y * c) for x, y in pts]

    if shape == "square":
        return rot([(-r, -r), (r, -r), (r, r), (-r, r)])
    if shape == "triangle":
        return rot([(0, -1.15 * r), (1.05 * r, 0.8 * r), (-1.05 * r, 0.8 * r)])
    if shape == "cross":
        a, b = r, 0.38 * r
        return rot([(-b, -a), (b, -a), (b, -b), (a, -b), (a, b), (b, b), (b, a), (-b, a), (-b, b),
                    (-a, b), (-a, -b), (-b, -b)])
    raise ValueError(shape)


def render(label: int, rng: np.random.Generator, size: int = 64):
    """One image of class `label` as a PIL image."""
    import colorsys

    from PIL import Image, ImageDraw

    shape = SHAPES[label % len(SHAPES)]
    lo, hi = FAMILIES[label // len(SHAPES)]
    # background: a random two-colour gradient in any hue, plus noise
    c0, c1 = rng.integers(40, 215, size=(2, 3))
    t = np.linspace(0, 1, size)[:, None, None]
    bg = c0 * (1 - t) + c1 * t
    bg = np.repeat(bg, size, axis=1) if rng.random() < 0.5 else np.repeat(bg, size, axis=1).transpose(1, 0, 2)
    im = Image.fromarray(np.clip(bg + rng.normal(0, 12, bg.shape), 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(im)
    for _ in range(int(rng.integers(1, 4))):  # distractor lines in random colours
        draw.line([tuple(rng.uniform(0, size, 2)), tuple(rng.uniform(0, size, 2))],
                  fill=tuple(int(v) for v in rng.integers(0, 256, 3)), width=int(rng.integers(1, 3)))
    hue = rng.uniform(lo, hi) % 1.0
    rgb = colorsys.hsv_to_rgb(hue, rng.uniform(0.65, 1.0), rng.uniform(0.7, 1.0))
    fill = tuple(int(255 * v) for v in rgb)
    r = rng.uniform(0.17, 0.3) * size
    cx, cy = rng.uniform(r + 2, size - r - 2, 2)
    if shape == "disc":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "ring":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], outline=fill, width=max(3, int(r * 0.35)))
    else:
        draw.polygon(_shape_points(shape, cx, cy, r, rng.uniform(0, np.pi)), fill=fill)
    arr = np.asarray(im).astype(np.float32) + rng.normal(0, 6, (size, size, 3))
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))


def _add(tar: tarfile.TarFile, name: str, data: bytes, mtime: float) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = int(mtime)
    tar.addfile(info, io.BytesIO(data))


def _mat_bytes(names: list[str], labels: list[int]) -> bytes:
    from scipy.io import savemat

    files = np.empty((len(names), 1), dtype=object)
    annotations = np.empty((len(names), 1), dtype=object)
    for i, n in enumerate(names):
        files[i, 0] = np.array([n])
        annotations[i, 0] = np.array([n.rsplit(".", 1)[0]])
    buf = io.BytesIO()
    savemat(buf, {"file_list": files, "annotation_list": annotations,
                  "labels": np.array(labels, dtype=np.float64).reshape(-1, 1)})
    # the 116-byte text header carries a creation time: make it fixed so the archive is reproducible
    header = b"MATLAB 5.0 MAT-file, written by cometctl (synthetic Stanford Dogs lists)".ljust(116)
    return header + buf.getvalue()[116:]


def generate(out_dir: Path, per_class: int = 60, train_per_class: int = 40, size: int = 64,
             seed: int = 1, classes: int = len(CLASSES)) -> tuple[Path, Path]:
    """Write `images.tar` and `lists.tar` into `out_dir` (each via a temporary name); returns their paths.

    Deterministic: the same arguments give byte-identical archives."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    images, lists = out_dir / "images.tar", out_dir / "lists.tar"
    rng = np.random.default_rng(seed)
    mtime = 1_300_000_000  # fixed, so the archives are reproducible
    train, test, everything = [], [], []
    tmp_images = images.with_name("images.tar.tmp")
    with tarfile.open(tmp_images, "w", format=tarfile.USTAR_FORMAT) as tar, counting_progress() as prog:
        task = prog.add_task("generate synthetic images", total=classes * per_class, rate="")
        for label, folder in enumerate(CLASSES[:classes]):
            wnid = folder.split("-", 1)[0]
            for i in range(per_class):
                name = f"{folder}/{wnid}_{1000 + i}.jpg"
                buf = io.BytesIO()
                render(label, rng, size).save(buf, format="JPEG", quality=90)
                _add(tar, "Images/" + name, buf.getvalue(), mtime)
                (train if i < train_per_class else test).append((name, label + 1))
                everything.append((name, label + 1))
                prog.advance(task)
    tmp_lists = lists.with_name("lists.tar.tmp")
    with tarfile.open(tmp_lists, "w", format=tarfile.USTAR_FORMAT) as tar:
        for fname, items in (("file_list.mat", everything), ("train_list.mat", train), ("test_list.mat", test)):
            _add(tar, fname, _mat_bytes([n for n, _ in items], [lab for _, lab in items]), mtime)
    os.replace(tmp_images, images)
    os.replace(tmp_lists, lists)
    return images, lists


def ensure(out_dir: Path, **kw) -> tuple[Path, Path]:
    """The synthetic archives in `out_dir`, generated only when missing."""
    images, lists = Path(out_dir) / "images.tar", Path(out_dir) / "lists.tar"
    if images.exists() and lists.exists():
        return images, lists
    t = time.perf_counter()
    paths = generate(out_dir, **kw)
    from .ui import console
    console.print(f"generated the synthetic Stanford-Dogs-like archives in {out_dir} "
                  f"({time.perf_counter() - t:.1f} s)")
    return paths
