"""`cometctl prepare-images`: any dataset kept as one folder per class, to Caffe LMDBs.

PATH is a folder, an uncompressed tar or a zip holding

    <class>/<image>                      a seeded, stratified split (--val-fraction of each class to val)
    train/<class>/<image>, val/<class>/<image>   that split as it is ("valid" or "validation" for val too)

Images may sit deeper inside their class folder (<class>/a/b.jpg is of <class>). A single folder around
it all (flowers/<class>/...) is looked through. Hidden files and macOS's __MACOSX folders are ignored.
Labels are the class folders in sorted order (label i: line i of synset_words.txt). The names in
train.txt and val.txt are relative to the split's root (PATH, or PATH/train and PATH/val), so upstream's
convert_imageset reads the same lists from an unpacked copy. Outputs as for prepare-dogs.
"""

from __future__ import annotations

import time
from pathlib import Path

from . import imagedb
from .errors import CometError
from .paths import REPO_ROOT
from .ui import console, step

DEFAULT_SEED = 1701
VAL_FOLDERS = ("val", "valid", "validation")
EXPECTED = "one folder per class (<class>/<image>), optionally inside train/ and val/"


def default_data_dir(path: Path) -> Path:
    name = Path(path).name
    for suffix in (".tar", ".zip"):
        if name.lower().endswith(suffix):
            name = name[: -len(suffix)]
    return REPO_ROOT / "data" / (name or "images")


def _look_through(source: imagedb.Source) -> imagedb.Source:
    """Look inside a single folder that holds everything (flowers/<class>/...), as long as there are at
    least two folders inside it (one class alone would not be a dataset)."""
    while True:
        names = source.names()
        tops = {n.split("/", 1)[0] for n in names}
        if len(tops) != 1 or next(iter(tops)) in ("train", *VAL_FOLDERS):
            return source
        top = next(iter(tops))
        inside = {n.split("/", 2)[1] for n in names if n.count("/") >= 2}
        if len(inside) < 2:
            return source
        source = source.view(top + "/")


def read_layout(path: Path, seed: int = DEFAULT_SEED, val_fraction: float = 0.2) -> imagedb.Layout:
    path = Path(path)
    if not path.exists():
        raise CometError(f"{path}: no such file or folder (expected {EXPECTED})")
    if not 0 <= val_fraction < 1:
        raise CometError(f"--val-fraction {val_fraction}: must be in [0, 1)")
    with step(f"index {path}"):
        source = _look_through(imagedb.open_source(path))
    names = source.names()
    if not names:
        raise CometError(f"{path}: no images found (looked for {', '.join(imagedb.IMAGE_EXTENSIONS)} files); "
                         f"expected {EXPECTED}")
    tops = {n.split("/", 1)[0] for n in names if "/" in n}
    val_top = next((v for v in VAL_FOLDERS if v in tops), None)
    notes = []
    if "train" in tops:
        train_src = source.view("train/")
        train_groups, loose = imagedb.by_class(train_src.names())
        if val_top:
            val_src = source.view(val_top + "/")
            val_groups, val_loose = imagedb.by_class(val_src.names())
            loose += val_loose
            split = f"the train/ and {val_top}/ folders"
        else:
            val_src = train_src
            val_groups = {}
            split = None
        others = sorted(tops - {"train", *VAL_FOLDERS})
        if others:
            notes.append(f"ignored folder(s) beside train/: {', '.join(others[:5])}")
    elif val_top:
        raise CometError(f"{path}: has a {val_top}/ folder but no train/ folder; expected {EXPECTED}")
    else:
        train_src = val_src = source
        train_groups, loose = imagedb.by_class(names)
        val_groups, split = {}, None
    if loose:
        notes.append(f"ignored {len(loose)} image(s) outside a class folder (first: {loose[0]})")
    others = [n for n in source.other_files() if "/" in n]  # in a folder: a class's, not a README
    if others:
        kinds = ", ".join(e.lstrip(".") for e in imagedb.IMAGE_EXTENSIONS)
        notes.append(f"ignored {len(others)} file(s) in class folders that are not images Caffe reads "
                     f"({kinds}; first: {others[0]})")
    if len(train_groups) < 2:
        found = f"found {len(train_groups)} class folder{'s' if len(train_groups) != 1 else ''}"
        raise CometError(f"{path}: {found} with images; expected at least two classes, {EXPECTED}")
    classes = sorted(train_groups)
    stray = sorted(set(val_groups) - set(classes))
    if stray:
        raise CometError(f"{path}: {val_top}/{stray[0]} is a class without train images (train/{stray[0]} "
                         f"missing or empty)")
    label_of = {c: i for i, c in enumerate(classes)}
    if split is None:
        split = f"seeded stratified (seed {seed}, val fraction {val_fraction})"
        parts = imagedb.seeded_split(train_groups, val_fraction, seed)
        train_names, val_names = parts["train"], parts["val"]
    else:
        train_names = [n for v in train_groups.values() for n in v]
        val_names = [n for v in val_groups.values() for n in v]
    from .ui import console

    for note in notes:
        console.print(f"[yellow]note:[/] {note}")
    return imagedb.Layout(
        kind="images", inputs={"images": str(path)},
        parts={"train": imagedb.Part(train_src, imagedb.labelled(train_names, label_of)),
               "val": imagedb.Part(val_src, imagedb.labelled(val_names, label_of))},
        classes=classes, words=classes, split=split)


def prepare_images(path: Path, data_dir: Path | None = None, size: int = 256, jobs: int | None = None,
                   seed: int = DEFAULT_SEED, val_fraction: float = 0.2, _stop_after: int | None = None):
    """Prepare data/<name> (or data_dir) from a folder-per-class dataset; see the module's docstring."""
    t0 = time.perf_counter()
    imagedb.check_size(size)
    layout = read_layout(Path(path), seed, val_fraction)
    out = Path(data_dir) if data_dir else default_data_dir(path)
    prepared = imagedb.prepare(out, layout, size, jobs, seed, stop_after=_stop_after, t0=t0)
    _next_step(out, len(layout.classes))
    return prepared


def _next_step(out: Path, classes: int) -> None:
    """What a net needs to train on the folder: no shipped model points at it."""
    here = Path.cwd().resolve()
    shown = out.resolve()
    if shown.is_relative_to(here):
        shown = shown.relative_to(here)
    console.print(f"next: in a copy of a train_val.prototxt (e.g. models/bvlc_reference_caffenet's), point the "
                  f"Data layers at {shown}/train_lmdb and {shown}/val_lmdb, their mean_file at "
                  f"{shown}/mean.binaryproto, and give the last InnerProduct num_output: {classes}", markup=False)
