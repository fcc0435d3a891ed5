"""`cometctl prepare-dogs`: Stanford Dogs (or the embedded synthetic stand-in) to Caffe LMDBs.

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
import json
import os
import random
import tarfile
import time
from dataclasses import dataclass, field
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
FORMAT_VERSION = 1
FULL_CLASSES = 120  # Stanford Dogs' breeds
DEFAULT_SEED = 1701


@dataclass
class Prepared:
    data_dir: Path
    classes: int
    train: int
    val: int
    skipped: list[tuple[str, str]] = field(default_factory=list)
    split: str = "official"
    up_to_date: bool = False
    seconds: float = 0.0
    images_per_second: float = 0.0
    resumed_from: dict = field(default_factory=dict)  # split -> index a resumed conversion went on from
    kept: list[str] = field(default_factory=list)  # finished outputs verified and kept from an earlier run


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


def seeded_split(by_class: dict[str, list[str]], val_fraction: float, seed: int) -> dict[str, list[str]]:
    """Deterministic stratified split: in each class, a seeded shuffle, then the first share goes to val."""
    train, val = [], []
    for cls in sorted(by_class):
        names = sorted(by_class[cls])
        random.Random(f"{seed}/{cls}").shuffle(names)
        n_val = int(round(len(names) * val_fraction)) if len(names) > 1 else 0
        n_val = min(max(n_val, 1 if val_fraction > 0 and len(names) > 1 else 0), len(names) - 1)
        val += names[:n_val]
        train += names[n_val:]
    return {"train": sorted(train), "val": sorted(val)}


def breed(folder: str) -> tuple[str, str]:
    """"n02085620-Chihuahua" -> ("n02085620", "Chihuahua"); underscores become spaces."""
    wnid, _, name = folder.partition("-")
    return wnid, (name or wnid).replace("_", " ")


def _write_text(path: Path, lines: list[str]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in lines))
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------- prepare
def prepare_dogs(*args, **kwargs) -> Prepared:
    """Prepare the data folder (see the module's docstring); Ctrl-C leaves everything resumable."""
    try:
        return _prepare(*args, **kwargs)
    except KeyboardInterrupt:
        raise CometError("interrupted; nothing finished was lost: run the same command again to resume",
                         exit_code=130) from None


def _prepare(data_dir: Path | None = None, archive: Path | None = None, lists: Path | None = None,
             size: int | None = None, jobs: int | None = None, synthetic: bool = False,
             seed: int = DEFAULT_SEED, val_fraction: float = 0.2, url: str | None = None,
             _stop_after: int | None = None) -> Prepared:
    t0 = time.perf_counter()
    data_dir = Path(data_dir) if data_dir else default_data_dir(synthetic)
    size = size or (64 if synthetic else 256)
    if size < 8 or size > 4096:
        raise CometError(f"--size {size}: choose between 8 and 4096 pixels")
    if not 0 <= val_fraction < 1:
        raise CometError(f"--val-fraction {val_fraction}: must be in [0, 1)")
    jobs = max(1, jobs or os.cpu_count() or 1)

    if synthetic:
        if archive or lists:
            raise CometError("--synthetic generates its own archives; drop --archive/--lists")
        from . import synthetic as synth

        archive, lists = synth.ensure(data_dir)
    elif archive is None:  # nothing on disk: the real dataset from its home page
        archive = fetch_archive(data_dir, "images.tar", url)
        lists = lists or fetch_archive(data_dir, "lists.tar", url)
    archive = Path(archive)
    if not archive.exists():
        raise CometError(f"{archive}: no such file (give images.tar from {HOME_PAGE}, or the unpacked folder)")

    from .progress import step

    with step(f"index {archive}"):
        source = imagedb.open_source(archive)
    names = source.names()
    by_class: dict[str, list[str]] = {}
    for n in names:
        if "/" not in n:
            continue  # images must sit in a per-class folder
        by_class.setdefault(n.split("/", 1)[0], []).append(n)
    if len(by_class) < 2:
        raise CometError(f"{archive}: found {len(by_class)} class folder(s); expected Images/<wnid>-<breed>/*.jpg")
    classes = sorted(by_class)
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
        split = seeded_split(by_class, val_fraction, seed)

    orders = {}
    for part in ("train", "val"):
        order = list(split[part])
        random.Random(f"{seed}/{part}").shuffle(order)  # Caffe reads keys in order: store them shuffled
        orders[part] = [(n, label_of[n.split("/", 1)[0]]) for n in order]

    lists_id = None
    if lists:
        st = Path(lists).stat()
        lists_id = {"path": str(Path(lists).resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    fingerprint = imagedb.plan_digest(FORMAT_VERSION, source.identity(), lists_id, size, seed,
                                      split_mode, orders)
    data_dir.mkdir(parents=True, exist_ok=True)
    manifest_path = data_dir / "prepare.json"
    outputs = [data_dir / f for f in ("train_lmdb", "val_lmdb", "mean.binaryproto", "train.txt", "val.txt",
                                      "synset_words.txt")]
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        manifest = {}
    if manifest.get("fingerprint") == fingerprint and all(p.exists() for p in outputs):
        console.print(f"{data_dir}: already prepared from {archive} (nothing to do)")
        return Prepared(data_dir, len(classes), manifest["train"], manifest["val"],
                        [tuple(s) for s in manifest.get("skipped", [])], split_mode, up_to_date=True)
    if manifest_path.exists():
        manifest_path.unlink()  # the outputs are about to change: they are not "prepared" until the end

    console.print(f"{len(names)} images in {len(classes)} classes; split: {split_mode}; "
                  f"{len(orders['train'])} train, {len(orders['val'])} val; {size}x{size}; {jobs} job(s)")
    results = {}
    converted = 0
    t_conv = time.perf_counter()
    for part in ("train", "val"):
        plan = imagedb.plan_digest(fingerprint, part)
        res = imagedb.build_lmdb(source, orders[part], data_dir / f"{part}_lmdb", size, jobs,
                                 f"{part} LMDB", plan, stop_after=_stop_after)
        results[part] = res
        converted += len(orders[part]) - res.resumed_from
    conv_seconds = time.perf_counter() - t_conv
    kept = [f"{part}_lmdb" for part, res in results.items() if res.kept]
    mean_path = data_dir / "mean.binaryproto"
    if results["train"].kept and imagedb.mean_is_current(data_dir / "train_lmdb", mean_path):
        console.print(f"mean image: kept {mean_path} (computed from this train LMDB earlier)")
        kept.append(mean_path.name)
    else:
        imagedb.compute_mean(data_dir / "train_lmdb", mean_path)

    skipped = results["train"].skipped + results["val"].skipped
    bad = {n for n, _ in skipped}
    for part, fname in (("train", "train.txt"), ("val", "val.txt")):
        _write_text(data_dir / fname, [f"{n} {lab}" for n, lab in sorted(orders[part]) if n not in bad])
    _write_text(data_dir / "synset_words.txt", [" ".join(breed(c)) for c in classes])
    _write_text(data_dir / "skipped.txt", [f"{n}\t{why}" for n, why in skipped])
    seconds = time.perf_counter() - t0
    rate = converted / conv_seconds if conv_seconds > 0 else 0.0
    manifest = {"fingerprint": fingerprint, "archive": str(archive), "lists": str(lists) if lists else None,
                "size": size, "seed": seed, "split": split_mode, "classes": len(classes),
                "train": results["train"].written, "val": results["val"].written, "skipped": skipped,
                "seconds": round(seconds, 2), "images_per_second": round(rate, 1), "jobs": jobs}
    tmp = manifest_path.with_name("prepare.json.tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, manifest_path)

    console.print(f"[green]prepared[/] {data_dir}: {results['train'].written} train, {results['val'].written} "
                  f"val images, {len(classes)} classes, "
                  + (f"{rate:.0f} images/s, " if converted or not kept else f"kept {', '.join(kept)}, ")
                  + f"{seconds:.1f} s in all")
    if skipped:
        console.print(f"[yellow]skipped {len(skipped)} unreadable image(s)[/], listed in {data_dir / 'skipped.txt'}:")
        for n, why in skipped[:10]:
            console.print(f"  {n}: {why}")
        if len(skipped) > 10:
            console.print(f"  ... and {len(skipped) - 10} more")
    return Prepared(data_dir, len(classes), results["train"].written, results["val"].written, skipped,
                    split_mode, seconds=seconds, images_per_second=rate,
                    resumed_from={k: v.resumed_from for k, v in results.items()}, kept=kept)
