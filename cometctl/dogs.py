"""`cometctl prepare-dogs`: Stanford Dogs (or the embedded synthetic stand-in) to Caffe LMDBs.

This module knows Stanford Dogs' layout (images.tar, lists.tar, the download); the conversion is
imagedb's pipeline, the same for every layout.

Outputs in the data folder (default data/dogs, or data/synthetic with --synthetic):
  train.txt, val.txt     "<class>/<file> <label>" per converted image, as convert_imageset lists read
  synset_words.txt       line i: "<wnid> <breed>" for label i (the ImageNet synset_words.txt layout)
  train_lmdb/, val_lmdb/ Datum LMDBs (BGR, CHW, size x size, shuffled)
  mean.binaryproto       mean of train_lmdb, as compute_image_mean writes it
  skipped.txt            images that could not be decoded, with the reason
  prepare.json           what was prepared from what; a rerun with the same inputs does nothing
  *.done.json            beside each LMDB and the mean: the record of a finished output (plan, count,
                         digest); a rerun after an interruption verifies it and keeps the output
"""

from __future__ import annotations

import io
import os
import tarfile
import time
from pathlib import Path

from . import imagedb
from .errors import CometError
from .paths import REPO_ROOT
from .ui import console

HOME_PAGE = "http://vision.stanford.edu/aditya86/ImageNetDogs/"
# MD5 sums of the files on the dataset's home page, as published by the dataset's users.
ARCHIVES = {
    "images.tar": "1bb1f2a596ae7057f99d7d75860002ef",
    "lists.tar": "edbb9f16854ec66506b5f09b583e0656",
}
FULL_CLASSES = 120  # Stanford Dogs' breeds
DEFAULT_SEED = 1701


Prepared = imagedb.Prepared


def default_data_dir(synthetic: bool) -> Path:
    return REPO_ROOT / "data" / ("synthetic" if synthetic else "dogs")


# ------------------------------------------------------------------------------------------- archives
def fetch_archive(data_dir: Path, name: str, base_url: str | None = None) -> Path:
    """images.tar or lists.tar in data_dir, downloaded (resumably, checksum-checked) when missing."""
    from .download import fetch

    base = (base_url or os.environ.get("COMET_DOGS_URL") or HOME_PAGE).rstrip("/") + "/"
    hint = (f"Without internet access, fetch images.tar and lists.tar from {HOME_PAGE} on another machine "
            f"and run `cometctl prepare-dogs --archive images.tar --lists lists.tar`.")
    return fetch(base + name, data_dir / name, md5=ARCHIVES[name], offline_hint=hint)


def check_published(path: Path, name: str) -> None:
    """An archive on disk that holds the full dataset is compared with the published checksum. A
    difference is only a warning: a re-packed copy of the same images is fine, but the user should know."""
    from .download import verify_md5

    if not path.is_file():
        return
    try:
        verify_md5(path, ARCHIVES[name])
    except CometError:
        console.print(f"[yellow]warning:[/] {path} is not the published {name} (MD5 differs from "
                      f"{ARCHIVES[name]}); going on with its content")


def _strings(obj) -> list[str]:
    """All strings inside a loadmat value (cell arrays of 1-element arrays, nested any way)."""
    import numpy as np

    if isinstance(obj, str):
        return [obj]
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind in "US":
            return [str(s) for s in obj.ravel()]
        out = []
        for item in obj.ravel():
            out.extend(_strings(item))
        return out
    return []


def read_official_split(lists_tar: Path) -> dict[str, list[tuple[str, int | None]]]:
    """{"train": [(name, label0 or None)], "val": [...]} from lists.tar's train_list.mat / test_list.mat."""
    import numpy as np
    from scipy.io import loadmat

    lists_tar = Path(lists_tar)
    if not lists_tar.exists():
        raise CometError(f"{lists_tar}: no such file")
    wanted = {"train_list.mat": "train", "test_list.mat": "val"}
    split: dict[str, list] = {}
    try:
        with tarfile.open(lists_tar, "r:*") as tar:
            for member in tar:
                base = member.name.rsplit("/", 1)[-1]
                if base in wanted and member.isfile():
                    raw = tar.extractfile(member).read()
                    try:
                        mat = loadmat(io.BytesIO(raw))
                    except Exception as e:
                        raise CometError(f"{lists_tar}: {base} is not a readable MATLAB file ({e})") from None
                    if "file_list" not in mat:
                        raise CometError(f"{lists_tar}: {base} has no 'file_list' variable")
                    names = _strings(mat["file_list"])
                    labels = [None] * len(names)
                    if "labels" in mat:
                        lab = np.asarray(mat["labels"]).ravel()
                        if len(lab) == len(names):
                            labels = [int(v) - 1 for v in lab]
                    split[wanted[base]] = list(zip(names, labels))
    except (tarfile.ReadError, EOFError, OSError) as e:
        raise CometError(f"{lists_tar}: not a readable tar archive ({e})") from None
    missing = [m for m in wanted if wanted[m] not in split]
    if missing:
        raise CometError(f"{lists_tar}: does not contain {', '.join(missing)} (is it Stanford Dogs' lists.tar?)")
    return split


seeded_split = imagedb.seeded_split  # (kept under its old name)


def breed(folder: str) -> tuple[str, str]:
    """"n02085620-Chihuahua" -> ("n02085620", "Chihuahua"); underscores become spaces."""
    wnid, _, name = folder.partition("-")
    return wnid, (name or wnid).replace("_", " ")


# ---------------------------------------------------------------------------------------------- prepare
def read_layout(archive: Path, lists: Path | None, seed: int, val_fraction: float,
                synthetic: bool = False) -> imagedb.Layout:
    """Stanford Dogs' layout: Images/<wnid>-<breed>/<file> in images.tar (or its unpacked folder); the
    split from lists.tar when given, else seeded and stratified."""
    from .ui import step

    archive = Path(archive)
    if not archive.exists():
        raise CometError(f"{archive}: no such file (give images.tar from {HOME_PAGE}, or the unpacked folder)")
    with step(f"index {archive}"):
        source = imagedb.open_source(archive)
        if any(n.startswith("Images/") for n in source.names()):
            source = source.view("Images/")
    names = source.names()
    groups, _ = imagedb.by_class(names)
    if len(groups) < 2:
        raise CometError(f"{archive}: found {len(groups)} class folder(s); expected Images/<wnid>-<breed>/*.jpg")
    classes = sorted(groups)
    label_of = {c: i for i, c in enumerate(classes)}
    if not synthetic and len(classes) == FULL_CLASSES:
        check_published(archive, "images.tar")
        if lists:
            check_published(Path(lists), "lists.tar")

    if lists:
        split_mode = "official"
        official = read_official_split(Path(lists))
        known = set(names)
        split = {}
        for part, items in official.items():
            absent = [n for n, _ in items if n not in known]
            if absent:
                raise CometError(f"{lists}: {len(absent)} {part} image(s) listed are not in {archive} "
                                 f"(first: {absent[0]}); are the archives from the same dataset?")
            wrong = [n for n, lab in items if lab is not None and lab != label_of[n.split('/', 1)[0]]]
            if wrong:
                raise CometError(f"{lists}: labels disagree with the class folders (first: {wrong[0]})")
            split[part] = sorted(n for n, _ in items)
    else:
        split_mode = f"seeded stratified (seed {seed}, val fraction {val_fraction})"
        split = seeded_split(groups, val_fraction, seed)

    lists_id = None
    if lists:
        st = Path(lists).stat()
        lists_id = {"path": str(Path(lists).resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    inputs = {"archive": str(archive)}
    if lists:
        inputs["lists"] = str(lists)
    return imagedb.Layout(
        kind="dogs", inputs=inputs,
        parts={part: imagedb.Part(source, imagedb.labelled(split[part], label_of)) for part in imagedb.PARTS},
        classes=classes, words=[" ".join(breed(c)) for c in classes], split=split_mode, identity=[lists_id])


@imagedb.resumable_on_interrupt
def prepare_dogs(data_dir: Path | None = None, archive: Path | None = None, lists: Path | None = None,
                 size: int | None = None, jobs: int | None = None, synthetic: bool = False,
                 seed: int = DEFAULT_SEED, val_fraction: float = 0.2, url: str | None = None,
                 _stop_after: int | None = None) -> Prepared:
    """Prepare the data folder (see the module's docstring); Ctrl-C leaves everything resumable."""
    t0 = time.perf_counter()
    data_dir = Path(data_dir) if data_dir else default_data_dir(synthetic)
    size = size or (64 if synthetic else 256)
    imagedb.check_size(size)
    if not 0 <= val_fraction < 1:
        raise CometError(f"--val-fraction {val_fraction}: must be in [0, 1)")
    if synthetic and (archive or lists):
        raise CometError("--synthetic generates its own archives; drop --archive/--lists")
    from .locks import folder_lock

    with folder_lock(data_dir, "preparing a dataset"):  # the download and the archives too
        return _prepare_dogs(data_dir, archive, lists, size, jobs, synthetic, seed, val_fraction, url,
                             _stop_after, t0)


def _prepare_dogs(data_dir, archive, lists, size, jobs, synthetic, seed, val_fraction, url, _stop_after, t0):
    if synthetic:
        from . import synthetic as synth

        archive, lists = synth.ensure(data_dir)
    elif archive is None:  # nothing on disk: the real dataset from its home page
        archive = fetch_archive(data_dir, "images.tar", url)
        lists = lists or fetch_archive(data_dir, "lists.tar", url)
    layout = read_layout(Path(archive), lists, seed, val_fraction, synthetic)
    return imagedb.prepare(data_dir, layout, size, jobs, seed, stop_after=_stop_after, t0=t0)
