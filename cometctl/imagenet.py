"""`cometctl prepare-imagenet`: ILSVRC-2012 (ImageNet's 1,000-class classification set) to Caffe LMDBs.

The layout as published, read in place (nothing is unpacked):

* ILSVRC2012_img_train.tar: a tar of 1,000 tars, nXXXXXXXX.tar (a WordNet ID each), each holding that
  class's JPEGs (nXXXXXXXX_NNNN.JPEG). Images are named "nXXXXXXXX/nXXXXXXXX_NNNN.JPEG", the names of
  Caffe's train.txt (relative to an unpacked train/ folder). An unpacked train folder (one folder per
  WordNet ID) is read as well.
* ILSVRC2012_img_val.tar: 50,000 JPEGs in one flat folder, ILSVRC2012_val_00000001.JPEG ...; an unpacked
  folder too, and a val tree already sorted into nXXXXXXXX/ folders (labels from the folders).
* Labels of the flat val images, from either
  - the devkit (ILSVRC2012_devkit_t12.tar.gz, or its unpacked folder): data/ILSVRC2012_validation_ground_truth.txt
    holds one 1-based ILSVRC2012_ID per val image, in order; data/meta.mat (MATLAB v5, read with scipy)
    maps ILSVRC2012_ID to WNID and words for the 1,000 leaf synsets; or
  - Caffe's val.txt ("ILSVRC2012_val_00000001.JPEG 65", 0-based labels in sorted-WNID order), with
    optionally synsets.txt or synset_words.txt (line i: the WNID of label i, then words).

Label i is the i-th WordNet ID in sorted order, as in upstream Caffe's synsets.txt, so models and deploy
files trained with upstream's ImageNet LMDBs agree with ours. Outputs (default data/imagenet):
train_lmdb/, val_lmdb/ (256x256 Datums by default, as create_imagenet.sh with RESIZE=true),
mean.binaryproto, train.txt, val.txt, synsets.txt, synset_words.txt, skipped.txt, prepare.json.
"""

from __future__ import annotations

import io
import re
import tarfile
import time
from pathlib import Path

from . import imagedb
from .errors import CometError
from .paths import REPO_ROOT
from .ui import step

DEFAULT_SEED = 1701
YEAR = "2012"
VAL_NAME = re.compile(r"ILSVRC2012_val_(\d{8})\.jpe?g", re.IGNORECASE)
GROUND_TRUTH = re.compile(r"ILSVRC(\d{4})_(?:\w+_)?validation_ground_truth\.txt")
TRAIN_EXPECTED = ("ILSVRC2012_img_train.tar: a tar of 1,000 per-class tars named after WordNet IDs "
                  "(n01440764.tar, ...)")
LABELS_HINT = ("give --devkit ILSVRC2012_devkit_t12.tar.gz (its data/ILSVRC2012_validation_ground_truth.txt "
               "and data/meta.mat), or --val-labels val.txt [--synsets synsets.txt] (Caffe's "
               "get_ilsvrc_aux.sh files)")


def default_data_dir() -> Path:
    return REPO_ROOT / "data" / "imagenet"


# ------------------------------------------------------------------------------------------------ train
def _check_train(path: Path):
    """The check NestedTarSource runs on the outer archive's member names before it reads any inner tar."""

    def check(inner: list[str], others: list[str]) -> None:
        images = [n for n in others if imagedb.is_image_name(n)]
        if not inner:
            what = (f"{len(images):,} images directly and no per-class tars (is it the val archive? a folder "
                    f"of class folders goes to `cometctl prepare-images`)" if images else "no per-class tars")
            raise CometError(f"{path}: holds {what}; expected {TRAIN_EXPECTED}")
        bad = [n for n in inner if not imagedb.is_wnid(n.rsplit("/", 1)[-1][: -len(".tar")])]
        if bad:
            raise CometError(f"{path}: {len(bad)} of its {len(inner)} inner tars are not named after a WordNet ID "
                             f"(first: {bad[0]!r}); expected {TRAIN_EXPECTED}")
        stems = [n.rsplit("/", 1)[-1] for n in inner]
        if len(set(stems)) != len(stems):
            raise CometError(f"{path}: a class tar appears twice; expected {TRAIN_EXPECTED}")

    return check


def open_train(path: Path) -> imagedb.Source:
    path = Path(path)
    if path.is_dir():
        source = imagedb.DirSource(path)
        groups, _ = imagedb.by_class(source.names())
        bad = [c for c in groups if not imagedb.is_wnid(c)]
        if not groups or bad:
            raise CometError(f"{path}: expected one folder per WordNet ID (n01440764/...)"
                             + (f"; {bad[0]!r} is not one" if bad else "; found no images in such folders"))
        return source
    if not path.exists():
        raise CometError(f"{path}: no such file (expected {TRAIN_EXPECTED})")
    return imagedb.NestedTarSource(path, check=_check_train(path))


# -------------------------------------------------------------------------------------------------- val
def open_val(path: Path) -> imagedb.Source:
    path = Path(path)
    if not path.exists():
        raise CometError(f"{path}: no such file (expected ILSVRC2012_img_val.tar: the 50,000 "
                         f"ILSVRC2012_val_*.JPEG images)")
    with step(f"index {path}"):
        source = imagedb.open_source(path)
    names = source.names()
    if not names:
        others = source.other_members() if isinstance(source, imagedb.TarSource) else []
        tars = [n for n in others if n.lower().endswith(".tar")]
        hint = " (it holds tars: is it the train archive?)" if tars else ""
        raise CometError(f"{path}: holds no images{hint}; expected ILSVRC2012_img_val.tar with "
                         f"ILSVRC2012_val_00000001.JPEG ...")
    tops = {n.split("/", 1)[0] for n in names if "/" in n}
    if len(tops) == 1 and all(n.startswith(next(iter(tops)) + "/") for n in names) and \
            not imagedb.is_wnid(next(iter(tops))):
        source = source.view(next(iter(tops)) + "/")  # a top folder ("val/"): look inside it
    return source


def _val_index(name: str) -> int | None:
    m = VAL_NAME.fullmatch(name)
    return int(m.group(1)) if m else None


# ----------------------------------------------------------------------------------------------- devkit
def _devkit_files(path: Path) -> dict[str, bytes]:
    """{base name: content} of the devkit's small text and .mat files (tar, tar.gz or folder)."""
    wanted = lambda base: base.endswith((".mat", ".txt"))  # noqa: E731
    files: dict[str, bytes] = {}
    if path.is_dir():
        for p in sorted(path.rglob("*")):
            if p.is_file() and wanted(p.name) and p.stat().st_size < 64 << 20:
                files.setdefault(p.name, p.read_bytes())
        return files
    if not path.exists():
        raise CometError(f"{path}: no such file (expected ILSVRC2012_devkit_t12.tar.gz)")
    try:
        with tarfile.open(path, "r:*") as tar:
            for m in tar:
                base = m.name.rsplit("/", 1)[-1]
                if m.isfile() and wanted(base) and m.size < 64 << 20:
                    files.setdefault(base, tar.extractfile(m).read())
    except (tarfile.TarError, EOFError, OSError) as e:
        raise CometError(f"{path}: not a readable devkit archive ({e}); expected ILSVRC2012_devkit_t12.tar.gz") from None
    return files


def _mat_value(x):
    import numpy as np

    a = np.asarray(x)
    while a.dtype == object and a.size == 1:
        a = np.asarray(a.ravel()[0])
    return a


def _mat_str(x) -> str:
    a = _mat_value(x)
    if a.dtype.kind in "US":
        return "".join(str(s) for s in a.ravel())
    return str(a)


def read_meta(data: bytes, where: str) -> dict[int, tuple[str, str]]:
    """{ILSVRC2012_ID: (WNID, words)} of the leaf synsets (num_children 0) in the devkit's meta.mat."""
    from scipy.io import loadmat

    try:
        mat = loadmat(io.BytesIO(data))
    except Exception as e:
        raise CometError(f"{where}: data/meta.mat is not a readable MATLAB file ({e})") from None
    synsets = mat.get("synsets")
    fields = getattr(getattr(synsets, "dtype", None), "names", None) or ()
    if "ILSVRC2012_ID" not in fields or "WNID" not in fields:
        other = next((f for f in fields if re.fullmatch(r"ILSVRC\d{4}_ID", f)), None)
        raise CometError(f"{where}: meta.mat has no ILSVRC2012_ID/WNID table"
                         + (f" (it has {other}: the devkit of another year)" if other else "")
                         + "; expected ILSVRC2012_devkit_t12")
    out: dict[int, tuple[str, str]] = {}
    for row in synsets.ravel():
        children = int(_mat_value(row["num_children"]).ravel()[0]) if "num_children" in fields else 0
        ident = int(_mat_value(row["ILSVRC2012_ID"]).ravel()[0])
        if children == 0:
            out[ident] = (_mat_str(row["WNID"]).strip(), _mat_str(row["words"]).strip() if "words" in fields else "")
    if not out:
        raise CometError(f"{where}: meta.mat lists no leaf synsets")
    return out


def read_devkit(path: Path) -> tuple[list[int], dict[int, tuple[str, str]]]:
    """(ILSVRC2012_ID of val image 1, 2, ...; {ILSVRC2012_ID: (WNID, words)}) from the devkit."""
    path = Path(path)
    files = _devkit_files(path)
    gt_name = f"ILSVRC{YEAR}_validation_ground_truth.txt"
    if gt_name not in files:
        others = sorted(n for n in files if GROUND_TRUTH.fullmatch(n))
        if others:
            year = GROUND_TRUTH.fullmatch(others[0]).group(1)
            raise CometError(f"{path}: this is the devkit of ILSVRC{year} ({others[0]}); expected the "
                             f"ILSVRC2012 devkit (ILSVRC2012_devkit_t12.tar.gz, with data/{gt_name})")
        raise CometError(f"{path}: has no data/{gt_name}; expected ILSVRC2012_devkit_t12.tar.gz")
    if "meta.mat" not in files:
        raise CometError(f"{path}: has no data/meta.mat; expected ILSVRC2012_devkit_t12.tar.gz")
    ids = []
    for i, line in enumerate(files[gt_name].decode(errors="replace").splitlines(), 1):
        if line.strip():
            try:
                ids.append(int(line))
            except ValueError:
                raise CometError(f"{path}: {gt_name} line {i}: {line.strip()[:40]!r} is not an ILSVRC2012_ID") from None
    meta = read_meta(files["meta.mat"], str(path))
    unknown = sorted(set(ids) - set(meta))
    if unknown:
        raise CometError(f"{path}: {gt_name} uses ILSVRC2012_ID {unknown[0]}, which meta.mat does not list "
                         f"as a leaf synset")
    return ids, meta


def read_synsets(path: Path) -> list[tuple[str, str]]:
    """(WNID, words) per line of synsets.txt or synset_words.txt."""
    path = Path(path)
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as e:
        raise CometError(f"{path}: cannot be read ({e.strerror or e})") from None
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        wnid, _, words = line.strip().partition(" ")
        if not imagedb.is_wnid(wnid):
            raise CometError(f"{path} line {i}: {wnid[:40]!r} is not a WordNet ID; expected synsets.txt "
                             f"(n01440764 ...) or synset_words.txt (n01440764 tench, Tinca tinca)")
        out.append((wnid, words.strip()))
    if not out:
        raise CometError(f"{path}: empty; expected one WordNet ID per line")
    return out


def read_val_txt(path: Path) -> dict[str, int]:
    """{file name: label} of Caffe's val.txt ("ILSVRC2012_val_00000001.JPEG 65")."""
    path = Path(path)
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as e:
        raise CometError(f"{path}: cannot be read ({e.strerror or e})") from None
    out = {}
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[1].isdigit():
            raise CometError(f"{path} line {i}: {line.strip()[:60]!r}; expected '<file> <label>' as in "
                             f"Caffe's val.txt (ILSVRC2012_val_00000001.JPEG 65)")
        out[parts[0]] = int(parts[1])
    if not out:
        raise CometError(f"{path}: empty; expected Caffe's val.txt (ILSVRC2012_val_00000001.JPEG 65)")
    return out


# ----------------------------------------------------------------------------------------------- layout
def read_layout(train: Path, val: Path, devkit: Path | None = None, val_labels: Path | None = None,
                synsets: Path | None = None) -> imagedb.Layout:
    train, val = Path(train), Path(val)
    if devkit and (val_labels or synsets):
        raise CometError("give either --devkit or --val-labels/--synsets, not both")
    if synsets and not val_labels:
        raise CometError("--synsets goes with --val-labels (the devkit names the synsets itself)")
    # the cheap inputs first, so that a mistake there does not wait for the train archive's index
    gt = meta = listed = synset_list = None
    if devkit:
        with step(f"read {devkit}"):
            gt, meta = read_devkit(Path(devkit))
    if val_labels:
        listed = read_val_txt(Path(val_labels))
        if synsets:
            synset_list = read_synsets(Path(synsets))
    val_source = open_val(val)
    val_names = val_source.names()
    val_groups, val_loose = imagedb.by_class(val_names)
    sorted_val = bool(val_groups) and not val_loose and all(imagedb.is_wnid(c) for c in val_groups)
    if not sorted_val:
        bad = [n for n in val_names if _val_index(n) is None]
        if bad:
            raise CometError(f"{val}: {bad[0]!r} is not an ILSVRC2012 val image name; expected "
                             f"ILSVRC2012_img_val.tar (ILSVRC2012_val_00000001.JPEG ..., flat) or a val "
                             f"folder sorted into nXXXXXXXX/ class folders")
        if gt is None and listed is None:
            raise CometError(f"{val}: the val images carry no labels (flat ILSVRC2012_val_*.JPEG); {LABELS_HINT}")

    train_source = open_train(train)
    groups, _ = imagedb.by_class(train_source.names())
    classes = sorted(groups)
    if not classes:
        raise CometError(f"{train}: its class tars hold no images; expected {TRAIN_EXPECTED}")
    label_of = {c: i for i, c in enumerate(classes)}
    words = {c: "" for c in classes}

    if sorted_val:
        stray = sorted(set(val_groups) - set(classes))
        if stray:
            raise CometError(f"{val}: class folder {stray[0]} is not a class of {train}")
        val_entries = imagedb.labelled(val_names, label_of)
        how = "folders"
    elif gt is not None:
        leaves = {wnid for wnid, _ in meta.values()}
        if leaves != set(classes):
            extra, missing = sorted(leaves - set(classes)), sorted(set(classes) - leaves)
            raise CometError(f"{devkit}: its {len(leaves):,} synsets and the {len(classes):,} classes of {train} "
                             f"differ (" + (f"{extra[0]} has no train images" if extra else
                                            f"{missing[0]} is not in meta.mat") + "); are they both ILSVRC2012?")
        words = {wnid: w for wnid, w in meta.values()}
        val_entries = []
        for n in val_names:
            i = _val_index(n)
            if i > len(gt):
                raise CometError(f"{devkit}: the ground truth lists {len(gt):,} val images, but {val} holds {n}")
            val_entries.append((n, label_of[meta[gt[i - 1]][0]]))
        how = "devkit"
    else:
        if synset_list:
            names_of_label = [wnid for wnid, _ in synset_list]
            stray = sorted(set(names_of_label) - set(classes))
            if stray:
                raise CometError(f"{synsets}: {stray[0]} is not a class of {train}")
            words.update({wnid: w for wnid, w in synset_list})
        else:
            names_of_label = classes  # Caffe's val.txt: labels index the sorted WNIDs
        base = {n.rsplit("/", 1)[-1]: n for n in val_names}
        missing = [n for n in base if n not in listed]
        if missing:
            raise CometError(f"{val_labels}: has no label for {len(missing):,} val image(s) of {val} "
                             f"(first: {missing[0]})")
        val_entries = []
        for short, n in sorted(base.items(), key=lambda kv: kv[1]):
            lab = listed[short]
            if lab >= len(names_of_label):
                raise CometError(f"{val_labels}: label {lab} of {short} is beyond the "
                                 f"{len(names_of_label):,} classes" + (f" of {synsets}" if synsets else f" of {train}"))
            val_entries.append((n, label_of[names_of_label[lab]]))
        how = "val.txt"

    inputs = {"train": str(train), "val": str(val)}
    ident = []
    for key, p in (("devkit", devkit), ("val_labels", val_labels), ("synsets", synsets)):
        if p:
            inputs[key] = str(p)
            st = Path(p).stat()
            ident.append({key: str(Path(p).resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    train_entries = imagedb.labelled(train_source.names(), label_of)
    return imagedb.Layout(
        kind="imagenet", inputs=inputs,
        parts={"train": imagedb.Part(train_source, train_entries), "val": imagedb.Part(val_source, val_entries)},
        classes=classes, words=[f"{c} {words[c]}".rstrip() for c in classes],
        split=f"ILSVRC2012 train/val (val labels from the {how})", extra={"synsets.txt": classes}, identity=ident)


def prepare_imagenet(train: Path, val: Path, data_dir: Path | None = None, devkit: Path | None = None,
                     val_labels: Path | None = None, synsets: Path | None = None, size: int = 256,
                     jobs: int | None = None, seed: int = DEFAULT_SEED, _stop_after: int | None = None):
    """Prepare data/imagenet (or data_dir) from the ILSVRC-2012 archives; see the module's docstring."""
    t0 = time.perf_counter()
    imagedb.check_size(size)
    try:
        layout = read_layout(train, val, devkit, val_labels, synsets)
    except KeyboardInterrupt:
        raise CometError("interrupted while reading the archives; nothing was written", exit_code=130) from None
    return imagedb.prepare(Path(data_dir) if data_dir else default_data_dir(), layout, size, jobs, seed,
                           stop_after=_stop_after, t0=t0)
