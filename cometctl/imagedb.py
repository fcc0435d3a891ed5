"""Images in, Caffe LMDBs out: the one pipeline behind prepare-dogs, prepare-imagenet and prepare-images.

A layout reader (dogs.py, imagenet.py, folders.py) knows where a dataset keeps its images and labels; it
hands `prepare` a `Layout`: for each of "train" and "val" a source and its (name, label) list, the class
names and synset_words.txt. Everything else happens here, the same way for every layout:

* Sources are read in place, nothing is unpacked: an uncompressed tar (`TarSource`, each image read at
  its byte offset), a tar of per-class tars (`NestedTarSource`, ILSVRC-2012's train archive: the inner
  tars are read through the outer one, so an inner image is also one read at an offset), a zip
  (`ZipSource`) or a folder tree (`DirSource`).
* Each image is decoded by content with Pillow (a PNG named .JPEG is a PNG; a truncated file is an
  error, not a grey-filled picture), turned upright by its EXIF orientation (as OpenCV's imread in
  convert_imageset does), converted to RGB (greyscale, CMYK, palette, 16-bit too), resized to
  size x size with OpenCV's INTER_LINEAR, as convert_imageset's -resize_height/-resize_width (aspect
  ratio not kept; a JPEG at least twice the size is first decoded at 1/2, 1/4 or 1/8 scale), and
  stored as a Datum: channels=3, height, width, data = BGR bytes in CHW order, label, encoded=false
  (the fields convert_imageset sets). Keys are "%08d_<name>" in the shuffled order, as
  convert_imageset writes them, so Caffe's Data layer (which reads keys in sorted order) sees the
  shuffled order.
* Decoding runs in a pool of processes with a bounded number of images in flight; the main process
  writes the LMDB in key order and, as it goes, hashes what it writes and sums the train images for the
  mean. Memory therefore does not grow with the number of images, apart from the list of names.
* An LMDB is built under "<name>.partial" and renamed to "<name>" only when complete. After each committed
  batch a sidecar "<name>.partial.json" records how far the ordered list is done and which images were
  skipped; a rerun with the same plan continues from there (and the result is byte-identical to an
  uninterrupted run). An image that does not decode is skipped, counted and listed, never fatal.
* A finished LMDB gets "<name>.done.json" beside it: the plan it was built for, its entry count and a
  SHA-256 digest of its content (every key and value's digest, in key order). A rerun with the same plan verifies
  count and digest and keeps the LMDB as it is; one that does not verify is rebuilt, with a message.
* The mean image is what compute_image_mean computes from the finished LMDB: float32 sums of the uint8
  bytes in key order, divided by the count, written as a BlobProto with num=1, channels, height, width.
  Its "<mean>.done.json" names the digest of the LMDB it came from, so an unchanged LMDB keeps its mean.
"""

from __future__ import annotations

import hashlib
import io
import functools
import itertools
import json
import multiprocessing
import os
import random
import re
import shutil
import tarfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import CometError
from .upstream import sha256_file
from .ui import console, counting_progress

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".pgm", ".tif", ".tiff", ".webp")
BATCH = 64  # images per LMDB transaction (and per resume checkpoint)
FORMAT_VERSION = 1  # of the outputs' layout (names, keys, listing files)
# 2: EXIF orientation applied, OpenCV's INTER_LINEAR resize (was Pillow's), 16-bit images scaled to 8 bits,
#    Datum.encoded written as convert_imageset does
DECODER_VERSION = 2
CHUNK = 8  # images per task sent to a decoding process
IN_FLIGHT_PER_JOB = 4  # tasks queued per decoding process: bounds the images held in memory
REOPEN_EVERY = 2048  # images between two re-openings of the LMDB being written (see build_lmdb)
POOL_MIN = 64  # fewer images than this are decoded in the main process (starting a pool costs more)


def _hidden(name: str) -> bool:
    """Hidden ('.x', '._x' of macOS) or in a __MACOSX folder: never part of a dataset."""
    return any(p.startswith(".") or p == "__MACOSX" for p in name.split("/"))


def is_other_file(name: str) -> bool:
    """A file beside the images: not one by its extension, not hidden, not in a __MACOSX folder."""
    return not _hidden(name) and not name.lower().endswith(IMAGE_EXTENSIONS)


def is_image_name(name: str) -> bool:
    """An image file by its extension, not hidden ('.x', '._x' of macOS) nor in a __MACOSX folder."""
    return not _hidden(name) and name.lower().endswith(IMAGE_EXTENSIONS)


# ---------------------------------------------------------------------------------------------- sources
class Source:
    """Images addressed by a name ("<class>/<file>" for most layouts).

    names(): sorted; job(name): what a decoding process needs to read it (picklable); identity(): what
    says the input is unchanged (part of the plan); where: the path for messages."""

    where: str = ""

    def names(self) -> list[str]:
        raise NotImplementedError

    def job(self, name: str):
        raise NotImplementedError

    def identity(self) -> dict:
        raise NotImplementedError

    def view(self, prefix: str) -> "View":
        """The images below `prefix` ("train/"), named without it."""
        return View(self, prefix)

    def other_files(self) -> list[str]:
        """Files that are not images by their extension (hidden ones and macOS' __MACOSX aside): what a
        dataset holds beside its images, for a note (a .gif that no Caffe reader decodes)."""
        return []


class View(Source):
    def __init__(self, base: Source, prefix: str):
        self.base, self.prefix = base, prefix
        self.where = f"{base.where}:{prefix}"

    def names(self) -> list[str]:
        n = len(self.prefix)
        return [name[n:] for name in self.base.names() if name.startswith(self.prefix)]

    def job(self, name: str):
        return self.base.job(self.prefix + name)

    def identity(self) -> dict:
        return {"view": self.prefix, "of": self.base.identity()}

    def other_files(self) -> list[str]:
        n = len(self.prefix)
        return [name[n:] for name in self.base.other_files() if name.startswith(self.prefix)]


def _file_identity(kind: str, path: Path) -> dict:
    st = path.stat()
    return {"kind": kind, "path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _compressed_hint(path: Path, error: Exception) -> str:
    if "compress" in str(error).lower() or path.suffix.lower() in (".gz", ".tgz", ".bz2", ".xz", ".zst"):
        return (" (a compressed archive cannot be read in place: give the uncompressed .tar, e.g. after "
                "`gunzip`, or the unpacked folder)")
    return ""


def _tar_members(path: Path, fileobj=None, region: int | None = None, what: str | None = None):
    """Members of an uncompressed tar, checked to be complete: Python's tarfile stops silently when an
    archive is cut off between members (or meets garbage there), so its end marker must be present.
    `fileobj`/`region`: a tar inside another one (its file object and size)."""
    what = what or str(path)
    members = []
    last_end = 0
    try:
        with tarfile.open(path if fileobj is None else None, "r:", fileobj=fileobj) as tar:
            for m in tar:
                last_end = max(last_end, m.offset_data + ((m.size + 511) // 512) * 512)
                members.append(m)
    except tarfile.ReadError as e:
        raise CometError(f"{what}: not a readable tar archive: {e}{_compressed_hint(Path(path), e)}") from None
    size = path.stat().st_size if region is None else region
    if fileobj is None:
        with open(path, "rb") as f:
            f.seek(last_end)
            trailer = f.read(1024)
    else:
        fileobj.seek(last_end)
        trailer = fileobj.read(1024)
    if last_end > size or len(trailer) < 1024 or trailer.count(0) != 1024:
        raise CometError(f"{what}: archive is truncated or damaged (it ends at byte {size} without tar's end "
                         f"marker); fetch it again")
    return members


def _tar_images(members):
    """(name, member) for each image file among a tar's members, named without a leading "./"."""
    for m in members:
        name = m.name[2:] if m.name.startswith("./") else m.name
        if m.isfile() and is_image_name(name):
            yield name, m


class _TarFileSource(Source):
    """What both tar sources share: each image is (offset, size) in the file, in `_members` by name."""

    kind = ""  # for identity()

    def __init__(self, path: Path):
        self.path = Path(path)
        self.where = str(self.path)
        if not self.path.exists():
            raise CometError(f"{self.path}: no such file")
        self._members: dict[str, tuple[int, int]] = {}

    def identity(self) -> dict:
        return _file_identity(self.kind, self.path)

    def names(self) -> list[str]:
        return sorted(self._members)

    def job(self, name: str):
        offset, size = self._members[name]
        return ("tar", str(self.path), offset, size)


class TarSource(_TarFileSource):
    """Images inside an uncompressed tar, named by their path in it."""

    kind = "tar"

    def __init__(self, path: Path):
        super().__init__(path)
        members = _tar_members(self.path)  # read once: a large archive's headers span all of it
        for name, m in _tar_images(members):
            self._members[name] = (m.offset_data, m.size)
        self._files = [m.name for m in members if m.isfile()]

    def other_members(self) -> list[str]:
        """Names of the members that are not images (to explain what an archive holds instead)."""
        return [name for name in self._files if name not in self._members]

    def other_files(self) -> list[str]:
        return sorted(n for n in (name[2:] if name.startswith("./") else name for name in self._files)
                      if is_other_file(n))


class NestedTarSource(_TarFileSource):
    """A tar of per-class tars (ILSVRC-2012's train archive: nXXXXXXXX.tar, one per WordNet ID). An image
    is named "<inner tar's stem>/<its name in the inner tar>"; the inner tars are read through the outer
    file (tarfile on the outer member's file object), never extracted, and each image is addressed by its
    absolute offset in the outer file."""

    kind = "nested-tar"

    def __init__(self, path: Path, check=None):
        """`check(inner_tar_names, other_names)` may refuse the archive (CometError) before the slow part."""
        super().__init__(path)
        outer = [m for m in _tar_members(self.path) if m.isfile()]
        inner = [m for m in outer if m.name.lower().endswith(".tar")]
        if check:
            check([m.name for m in inner], [m.name for m in outer if not m.name.lower().endswith(".tar")])
        self.classes: list[str] = []
        with open(self.path, "rb") as f, counting_progress(transient=True) as prog:
            task = prog.add_task(f"index {self.path.name}", total=len(inner), rate="")
            for m in inner:
                stem = m.name.rsplit("/", 1)[-1][: -len(".tar")]
                self.classes.append(stem)
                region = _Region(f, m.offset_data, m.size)
                members = _tar_members(self.path, region, m.size, what=f"{self.path}: {m.name}")
                for name, im in _tar_images(members):
                    self._members[f"{stem}/{name}"] = (m.offset_data + im.offset_data, im.size)
                prog.advance(task)


class _Region(io.RawIOBase):
    """A window [start, start+size) of an open file, seekable: what tarfile reads an inner tar through
    (tarfile's own extractfile object does the same; this one also reports the region's size)."""

    def __init__(self, f, start: int, size: int):
        self.f, self.start, self.size, self.pos = f, start, size, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, pos, whence=0):
        self.pos = {0: pos, 1: self.pos + pos, 2: self.size + pos}[whence]
        return self.pos

    def tell(self):
        return self.pos

    def readinto(self, b):
        n = max(0, min(len(b), self.size - self.pos))
        data = os.pread(self.f.fileno(), n, self.start + self.pos) if n else b""
        b[: len(data)] = data
        self.pos += len(data)
        return len(data)


class ZipSource(Source):
    """Images inside a zip archive (stored or deflated: each member is read and inflated on its own)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.where = str(self.path)
        try:
            with zipfile.ZipFile(self.path) as z:
                files = [i.filename for i in z.infolist() if not i.is_dir()]
                self._names = sorted(f for f in files if is_image_name(f))
                self._others = sorted(f for f in files if is_other_file(f))
        except (zipfile.BadZipFile, OSError) as e:
            raise CometError(f"{self.path}: not a readable zip archive ({e})") from None

    def identity(self) -> dict:
        return _file_identity("zip", self.path)

    def other_files(self) -> list[str]:
        return list(self._others)

    def names(self) -> list[str]:
        return list(self._names)

    def job(self, name: str):
        return ("zip", str(self.path), name, 0)


class DirSource(Source):
    """Images in a folder tree, named by their path below it (symbolic links followed, each folder once)."""

    def __init__(self, path: Path):
        self.root = Path(path)
        self.where = str(self.root)
        if not self.root.is_dir():
            raise CometError(f"{self.root}: no such folder")
        names, others = [], []
        seen = set()
        for top, dirs, files in os.walk(self.root, followlinks=True):
            st = os.stat(top)
            if (st.st_dev, st.st_ino) in seen:  # a link back up the tree
                dirs[:] = []
                continue
            seen.add((st.st_dev, st.st_ino))
            dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__MACOSX"]
            rel = os.path.relpath(top, self.root)
            prefix = "" if rel == "." else rel.replace(os.sep, "/") + "/"
            names += [prefix + f for f in files if is_image_name(f)]
            others += [prefix + f for f in files if is_other_file(f)]
        self._names = sorted(names)
        self._others = sorted(others)

    def identity(self) -> dict:
        digest = hashlib.sha256("\n".join(self._names).encode()).hexdigest()
        return {"kind": "dir", "path": str(self.root.resolve()), "files": digest}

    def names(self) -> list[str]:
        return list(self._names)

    def other_files(self) -> list[str]:
        return list(self._others)

    def job(self, name: str):
        return ("file", str(self.root / name), 0, -1)


def open_source(path: Path) -> Source:
    """A folder, a zip or an uncompressed tar, by what it is."""
    path = Path(path)
    if path.is_dir():
        return DirSource(path)
    if not path.exists():
        raise CometError(f"{path}: no such file or folder")
    if zipfile.is_zipfile(path):
        return ZipSource(path)
    return TarSource(path)


# ----------------------------------------------------------------------------------------------- decode
def decode_image(data: bytes, size: int) -> np.ndarray:
    """Image bytes (any format Pillow reads, by content) -> uint8 array (3, size, size), BGR as Caffe stores it."""
    return np.frombuffer(decode_to_datum_bytes(data, size), dtype=np.uint8).reshape(3, size, size)


def decode_to_datum_bytes(data: bytes, size: int) -> bytes:
    """Image bytes -> Datum.data: the size x size image's B, G and R planes, one after the other (CHW)."""
    from PIL import Image, ImageOps

    im = Image.open(io.BytesIO(data))
    if im.format == "JPEG":
        im.draft("RGB", (size, size))  # let libjpeg decode at a reduced scale: much faster for big images
    try:
        orientation = im.getexif().get(0x0112, 1)
    except Exception:  # unreadable EXIF: the image as stored
        orientation = 1
    if orientation in (2, 3, 4, 5, 6, 7, 8):
        im = ImageOps.exif_transpose(im)
    if im.mode in ("I", "I;16", "I;16B", "I;16L", "I;16N", "F"):  # 16-bit PNG/TIFF: the top 8 bits, as OpenCV
        a = np.asarray(im)
        a = np.clip(a, 0, 255) if im.mode == "F" else np.clip(a.astype(np.int64) >> 8, 0, 255)
        im = Image.fromarray(a.astype(np.uint8), "L")
    if im.mode == "CMYK":  # OpenCV's CMYK -> RGB (R = K' - C * K' / 256 with K' = 255 - K), not Pillow's
        cmyk = np.asarray(im).astype(np.int32)
        k = 255 - cmyk[:, :, 3:]
        im = Image.fromarray((k - ((cmyk[:, :, :3] * k) >> 8)).astype(np.uint8), "RGB")
    elif im.mode != "RGB":
        im = im.convert("RGB")
    if im.size == (size, size):
        r, g, b = im.split()
        return b.tobytes() + g.tobytes() + r.tobytes()
    # the resize convert_imageset does: OpenCV's cv::resize, INTER_LINEAR (bilinear between the four
    # nearest pixels, pixel centres aligned), so that our pixels are upstream's
    rgb = _cv2().resize(np.asarray(im), (size, size), interpolation=_cv2().INTER_LINEAR)
    return rgb[:, :, 2].tobytes() + rgb[:, :, 1].tobytes() + rgb[:, :, 0].tobytes()


_cv2_module = None


def _cv2():
    global _cv2_module
    if _cv2_module is None:
        import cv2

        cv2.setNumThreads(1)  # one image per process: the parallelism is the pool's
        _cv2_module = cv2
    return _cv2_module


_handles: dict[str, object] = {}


def _close_handles() -> None:
    for h in _handles.values():
        try:
            h.close()
        except Exception:
            pass
    _handles.clear()


def _read(job) -> bytes:
    kind, path, a, b = job
    if kind == "file":
        with open(path, "rb") as f:
            return f.read()
    h = _handles.get(path)
    if h is None:
        h = _handles[path] = zipfile.ZipFile(path) if kind == "zip" else open(path, "rb")
    if kind == "zip":
        return h.read(a)
    data = os.pread(h.fileno(), b, a)  # no shared file position: safe in any process
    if len(data) != b:
        raise OSError("archive ends inside this image")
    return data


def _worker_init() -> None:
    import signal
    import warnings

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's business
    warnings.simplefilter("ignore")  # Pillow's warnings about odd files: the skip list says what failed
    _handles.clear()  # the parent's open archives are the parent's: open our own


def datum_value(chw: bytes, size: int, label: int) -> tuple[bytes, int]:
    """The serialized Datum convert_imageset writes (channels, height, width, data, label, encoded=false)
    and the offset of `data` in it."""
    from .caffeproto import caffe_pb2

    value = caffe_pb2().Datum(channels=3, height=size, width=size, data=chw, label=label,
                              encoded=False).SerializeToString()
    offset = value.find(chw[:64])  # the data field follows the three small fields: found in the first bytes
    if offset < 0 or value[offset:offset + len(chw)] != chw:
        raise AssertionError("data not found in its serialized Datum")
    return value, offset


def _work(item):
    """(index, job, size, label) -> (index, serialized Datum or None, its SHA-256, offset of its data or
    the error text). Decoding, serializing and hashing happen here, in parallel; the writer only writes."""
    index, job, size, label = item
    try:
        chw = decode_to_datum_bytes(_read(job), size)
    except Exception as e:  # any decoder failure means: skip this image, say why
        return index, None, b"", f"{type(e).__name__}: {e}".replace("\n", " ").replace("\t", " ")
    value, offset = datum_value(chw, size, label)
    return index, value, hashlib.sha256(value).digest(), offset


def _work_chunk(items):
    return [_work(item) for item in items]


def _worker_loop(tasks, results) -> None:
    """A decoding process: chunks of items in, their results out, until None or the pipe closes."""
    _worker_init()
    while True:
        try:
            chunk = tasks.recv()
        except EOFError:
            return
        if chunk is None:
            return
        results.send(_work_chunk(chunk))


class _decoded:
    """_work over `items`, results in order: in this process, or in `jobs` processes with at most
    IN_FLIGHT_PER_JOB tasks of CHUNK images queued per process (memory stays flat however many images).

    Each process has its own pair of pipes and gets the chunks in turn, so the results come back in order
    without any lock shared between processes (multiprocessing.Pool's shared queue can leave its
    terminate() waiting for ever when Ctrl-C lands at the wrong moment). The processes start here, before
    the caller starts any thread (a progress bar's); close() ends them."""

    def __init__(self, items, jobs: int, n: int):
        self.items = iter(items)
        self.workers = []
        if jobs > 1 and n > POOL_MIN:
            ctx = multiprocessing.get_context("fork")
            for _ in range(jobs):
                task_r, task_w = ctx.Pipe(duplex=False)
                result_r, result_w = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_worker_loop, args=(task_r, result_w), daemon=True)
                p.start()
                task_r.close()
                result_w.close()
                self.workers.append((p, task_w, result_r))

    def __iter__(self):
        if not self.workers:
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for item in self.items:
                    yield _work(item)
            return
        sent = received = 0

        def submit() -> bool:
            nonlocal sent
            chunk = list(itertools.islice(self.items, CHUNK))
            if not chunk:
                return False
            self.workers[sent % len(self.workers)][1].send(chunk)
            sent += 1
            return True

        more = True
        for _ in range(len(self.workers) * IN_FLIGHT_PER_JOB):
            more = more and submit()
        while received < sent:
            p, _, results = self.workers[received % len(self.workers)]
            try:
                done = results.recv()
            except EOFError:
                raise CometError(f"a decoding process ended unexpectedly (exit code {p.exitcode})") from None
            received += 1
            more = more and submit()
            yield from done

    def close(self) -> None:
        for p, tasks, results in self.workers:
            try:
                tasks.send(None)
            except OSError:
                pass
        for p, tasks, results in self.workers:
            p.join(timeout=0.2)
            if p.is_alive():  # still busy (an interruption): it holds no lock of ours, stop it
                p.terminate()
                p.join()
            tasks.close()
            results.close()
        self.workers = []


# ------------------------------------------------------------------------------------------ bookkeeping
@dataclass
class ConvertResult:
    path: Path
    written: int
    skipped: list[tuple[str, str]] = field(default_factory=list)
    resumed_from: int = 0
    kept: bool = False  # a finished LMDB of the same plan was verified and kept as it was
    digest: str = ""
    mean_sum: np.ndarray | None = None  # float32 sums for the mean (when asked for), in key order


def _atomic_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def plan_digest(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def order_digest(entries) -> str:
    """SHA-256 of a (name, label) list, streamed (ImageNet's 1.28 million entries are not one string)."""
    h = hashlib.sha256()
    for name, label in entries:
        h.update(f"{name}\t{label}\n".encode())
    return h.hexdigest()


def done_stamp(dest: Path) -> Path:
    """The record written beside a finished output: <dest>.done.json."""
    dest = Path(dest)
    return dest.with_name(dest.name + ".done.json")


def _read_json(path: Path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


class _ContentHash:
    """The LMDB content digest: SHA-256 over every entry in key order, an entry being the key's length
    (4 bytes), the key, the value's length (8 bytes) and the value's own SHA-256 (so the values can be
    hashed in parallel, each where it was made)."""

    def __init__(self):
        self.h = hashlib.sha256()

    def add(self, key, value) -> None:
        self.add_digest(key, len(value), hashlib.sha256(value).digest())

    def add_digest(self, key, length: int, digest: bytes) -> None:
        self.h.update(len(key).to_bytes(4, "little") + bytes(key) + length.to_bytes(8, "little") + digest)

    def hexdigest(self) -> str:
        return self.h.hexdigest()


class MeanAccumulator:
    """compute_image_mean's arithmetic: a float32 sum per element, added image by image in key order
    (so it equals the tool's result bit for bit at any dataset size), divided by the count in float32."""

    def __init__(self):
        self.sum: np.ndarray | None = None
        self.count = 0

    def add(self, chw: np.ndarray) -> None:
        if self.sum is None:
            self.sum = np.zeros(chw.shape, dtype=np.float32)
        self.sum += chw  # uint8 -> float32, rounded to float32 per element, as `float += uint8`
        self.count += 1

    def mean(self) -> np.ndarray:
        return self.sum / np.float32(self.count)


def lmdb_digest(path: Path) -> tuple[int, str]:
    """(entries, SHA-256 of every key and value in key order) of an LMDB: what it holds, not how its
    pages happen to be laid out."""
    import lmdb

    h = _ContentHash()
    n = 0
    env = lmdb.open(str(path), readonly=True, lock=False, subdir=True)
    try:
        with env.begin(buffers=True) as txn:
            for key, value in txn.cursor():
                h.add(key, value)
                n += 1
    finally:
        env.close()
    return n, h.hexdigest()


def verify_finished(dest: Path, plan: str) -> tuple[dict | None, str]:
    """(its record, "") when `dest` is a finished LMDB of `plan` that still holds what was recorded when it
    was finished; else (None, why it is rebuilt), why "" when there is nothing of this plan to keep."""
    import lmdb

    dest = Path(dest)
    if not dest.exists():
        return None, ""
    stamp = _read_json(done_stamp(dest))
    if not isinstance(stamp, dict) or "sha256" not in stamp or "entries" not in stamp:
        return None, f"{dest} has no record of being finished ({done_stamp(dest).name}); rebuilding it"
    if stamp.get("plan") != plan:
        return None, ""  # made from other inputs or options: replaced, as before
    try:
        env = lmdb.open(str(dest), readonly=True, lock=False, subdir=True)
        try:
            entries = env.stat()["entries"]
        finally:
            env.close()
        if entries != stamp["entries"]:
            return None, (f"{dest} holds {entries} entries, but {stamp['entries']} were written when it was "
                          f"finished; rebuilding it")
        _, digest = lmdb_digest(dest)
    except lmdb.Error as e:
        return None, f"{dest} is not a readable LMDB ({e}); rebuilding it"
    if digest != stamp["sha256"]:
        return None, f"{dest} has changed since it was finished (its content digest differs); rebuilding it"
    return stamp, ""


def lmdb_bytes_per_image(size: int) -> int:
    """Disk space of one size x size Datum in an LMDB (an overflow run of 4 KiB pages)."""
    return ((3 * size * size + 64) // 4096 + 1) * 4096


def _check_space(folder: Path, images: int, size: int, label: str) -> None:
    need = images * lmdb_bytes_per_image(size)
    free = shutil.disk_usage(folder).free
    if need > free:
        raise CometError(f"{label}: {images:,} images at {size}x{size} need about {need / 1e9:,.1f} GB in "
                         f"{folder}, but only {free / 1e9:,.1f} GB are free; free some space or choose "
                         f"another --data-dir")


# ---------------------------------------------------------------------------------------------- convert
def build_lmdb(source, entries: list[tuple[str, int]], dest: Path, size: int, jobs: int, label: str,
               plan: str, stop_after: int | None = None, mean: bool = False) -> ConvertResult:
    """Write `entries` ((name, label) in final order) as Datums into the LMDB `dest`.

    `plan` identifies the work; a "<dest>.partial" with the same plan is continued, any other is discarded.
    `mean`: also return the float32 sums of the images (for compute_image_mean's mean), in key order.
    `stop_after` (tests) raises KeyboardInterrupt after that many committed images, as a user's Ctrl-C would.
    """
    import lmdb

    from .caffeproto import caffe_pb2

    pb2 = caffe_pb2()
    dest = Path(dest)
    if len(entries) >= 10 ** 8:
        raise CometError(f"{label}: {len(entries):,} images is more than 8-digit keys can keep in order")
    partial = dest.with_name(dest.name + ".partial")
    sidecar = dest.with_name(dest.name + ".partial.json")
    finished, why = verify_finished(dest, plan)
    if finished:
        if partial.exists():  # a conversion for other options, abandoned: this one stays
            shutil.rmtree(partial)
        sidecar.unlink(missing_ok=True)
        console.print(f"{label}: kept {dest} (finished earlier; {finished['entries']} entries, digest verified)")
        return ConvertResult(dest, finished["written"], [tuple(s) for s in finished.get("skipped", [])],
                             len(entries), kept=True, digest=finished["sha256"])
    if why:
        console.print(f"[yellow]{label}:[/] {why}")
    state = {"plan": plan, "done": 0, "written": 0, "skipped": []}
    if partial.exists():
        old = _read_json(sidecar)
        if isinstance(old, dict) and old.get("plan") == plan:
            state = old
        else:
            shutil.rmtree(partial)
    start = state["done"]
    _check_space(dest.parent, len(entries) - start, size, label)

    map_size = max(64 << 20, 2 * len(entries) * lmdb_bytes_per_image(size))

    def open_partial():
        # no fsync per commit (a commit is then a write into the page cache): an interrupted or killed
        # run loses nothing; after a crash of the machine a damaged partial LMDB is started afresh below.
        # The finished LMDB is synced to disk once, before it is renamed.
        return lmdb.open(str(partial), map_size=map_size, subdir=True, meminit=False, map_async=False,
                         sync=False)

    content = _ContentHash()
    acc = MeanAccumulator() if mean else None
    env = None
    if start:
        # what the interrupted run committed is the first part of the result: drop anything past the
        # recorded point (a crash between a commit and its record), then hash (and sum) what is kept
        console.print(f"{label}: resuming at image {start} of {len(entries)}")
        try:
            env = open_partial()
            with env.begin(write=True) as txn:
                cur = txn.cursor()
                beyond = list(cur.iternext(values=False)) if cur.set_range(f"{start:08d}".encode()) else []
                for key in beyond:
                    txn.delete(key)
            with env.begin(buffers=True) as txn:
                for key, value in txn.cursor():
                    content.add(key, value)
                    if acc is not None:
                        d = pb2.Datum()
                        d.ParseFromString(bytes(value))
                        acc.add(datum_array(d))
            kept = env.stat()["entries"]
            problem = "" if kept == state["written"] else \
                f"it holds {kept} entries where {state['written']} were recorded"
        except lmdb.Error as e:
            problem = f"it is not a readable LMDB: {e}"
        if problem:
            console.print(f"[yellow]{label}:[/] {partial} cannot be continued ({problem}); starting it afresh")
            if env is not None:
                env.close()
                env = None
            shutil.rmtree(partial)
            state = {"plan": plan, "done": 0, "written": 0, "skipped": []}
            start = 0
            content = _ContentHash()
            acc = MeanAccumulator() if mean else None
    if env is None:
        env = open_partial()
    _atomic_json(sidecar, state)
    _close_handles()

    items = ((i, source.job(entries[i][0]), size, entries[i][1]) for i in range(start, len(entries)))
    results = _decoded(items, jobs, len(entries) - start)
    committed = 0
    txn = None
    try:
        with counting_progress() as prog:
            task = prog.add_task(label, total=len(entries), completed=start, rate="")
            written, new_skips = 0, []  # since the last commit
            txn = env.begin(write=True)

            def commit(upto: int) -> None:
                # the images go into the open transaction as they come (LMDB holds its pages until the
                # commit: BATCH images); the record follows the commit
                nonlocal txn, env, written, new_skips, committed
                txn.commit()
                txn = None
                state["done"] = upto
                state["written"] += written
                state["skipped"] += new_skips
                _atomic_json(sidecar, state)
                committed += written
                if committed // REOPEN_EVERY != (committed - written) // REOPEN_EVERY:
                    # the kernel maps the page cache around the pages LMDB reads into our address space
                    # (about 9 KB per image written): closing the map now and then keeps memory flat
                    env.close()
                    env = open_partial()
                written, new_skips = 0, []
                txn = env.begin(write=True)

            last_shown = 0.0
            for index, value, digest, offset in results:
                name = entries[index][0]
                if value is None:
                    new_skips.append((name, offset))  # offset: the error text
                else:
                    key = f"{index:08d}_{name}".encode()
                    content.add_digest(key, len(value), digest)
                    if acc is not None:
                        acc.add(np.frombuffer(value, np.uint8, 3 * size * size, offset).reshape(3, size, size))
                    txn.put(key, value, append=True)  # keys arrive in order
                    written += 1
                prog.advance(task)
                now = time.monotonic()
                if now - last_shown > 0.5:
                    speed = prog.tasks[0].speed
                    prog.update(task, rate=f"{speed:.0f} img/s" if speed else "")
                    last_shown = now
                if written + len(new_skips) >= BATCH:
                    commit(index + 1)
                    if stop_after is not None and committed >= stop_after:
                        raise KeyboardInterrupt
            commit(len(entries))
            txn.abort()
            txn = None
        env.sync(True)  # the finished LMDB on disk before it is renamed and recorded as finished
        count = env.stat()["entries"]
    finally:
        if txn is not None:
            txn.abort()  # an interrupted batch: not recorded, so not kept
        results.close()  # stops the decoding processes, also on Ctrl-C
        env.close()
        _close_handles()

    if state["written"] == 0:
        raise CometError(f"{label}: none of the {len(entries)} images could be read "
                         f"(first error: {state['skipped'][0][1] if state['skipped'] else '?'})")
    if count != state["written"]:
        raise CometError(f"{label}: {partial} holds {count} entries after writing {state['written']}; "
                         f"remove it and run again")
    digest = content.hexdigest()
    stamp = done_stamp(dest)
    stamp.unlink(missing_ok=True)  # from here on an older record would describe the wrong content
    if dest.exists():  # an older, different conversion: replace it only now that the new one is complete
        old = dest.with_name(dest.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        os.replace(dest, old)
        os.replace(partial, dest)
        shutil.rmtree(old)
    else:
        os.replace(partial, dest)
    _atomic_json(stamp, {"plan": plan, "entries": count, "sha256": digest, "written": state["written"],
                         "skipped": state["skipped"]})
    sidecar.unlink()
    return ConvertResult(dest, state["written"], [tuple(s) for s in state["skipped"]], start, digest=digest,
                         mean_sum=acc.sum if acc is not None else None)


# ------------------------------------------------------------------------------------------------- read
def iter_datums(path: Path):
    """(key, Datum) of an LMDB in key order, as Caffe's Data layer reads it."""
    import lmdb

    from .caffeproto import caffe_pb2

    pb2 = caffe_pb2()
    env = lmdb.open(str(path), readonly=True, lock=False, subdir=True)
    try:
        with env.begin() as txn:
            for key, value in txn.cursor():
                d = pb2.Datum()
                d.ParseFromString(value)
                yield key.decode(), d
    finally:
        env.close()


def lmdb_count(path: Path) -> int:
    import lmdb

    env = lmdb.open(str(path), readonly=True, lock=False, subdir=True)
    try:
        return env.stat()["entries"]
    finally:
        env.close()


def datum_array(d) -> np.ndarray:
    return np.frombuffer(d.data, dtype=np.uint8).reshape(d.channels, d.height, d.width)


# ------------------------------------------------------------------------------------------------- mean
def mean_is_current(lmdb_path: Path, dest: Path) -> bool:
    """Whether `dest` is the mean that was written from the LMDB as it is now (both records agree
    and the mean file is unchanged). The LMDB's own record must have been verified by the caller."""
    source, mine = _read_json(done_stamp(lmdb_path)), _read_json(done_stamp(dest))
    if not (isinstance(source, dict) and isinstance(mine, dict) and Path(dest).is_file()):
        return False
    return mine.get("source_sha256") == source.get("sha256") and mine.get("sha256") == sha256_file(dest)


def write_mean(dest: Path, mean: np.ndarray, source: Path | None = None, source_sha256: str | None = None) -> None:
    """Write a (C, H, W) mean as compute_image_mean writes it (BlobProto num=1, C, H, W, float data), with
    a done record naming the LMDB's digest when that is known."""
    from .caffeproto import caffe_pb2

    dest = Path(dest)
    stamp = done_stamp(dest)
    stamp.unlink(missing_ok=True)
    c, h, w = mean.shape
    blob = caffe_pb2().BlobProto(num=1, channels=c, height=h, width=w)
    blob.data.extend(mean.astype(np.float32).ravel().tolist())
    tmp = dest.with_name(dest.name + ".tmp")
    tmp.write_bytes(blob.SerializeToString())
    os.replace(tmp, dest)
    if source_sha256:
        _atomic_json(stamp, {"source": str(source), "source_sha256": source_sha256, "sha256": sha256_file(dest)})


def compute_mean(lmdb_path: Path, dest: Path) -> np.ndarray:
    """Mean image of an LMDB read back from disk, written as compute_image_mean writes it; returns it as
    (C, H, W) float32. When the LMDB has a done record, the mean gets one too, naming the LMDB's digest."""
    done_stamp(dest).unlink(missing_ok=True)
    acc = MeanAccumulator()
    n = lmdb_count(lmdb_path)
    with counting_progress() as prog:
        task = prog.add_task("mean image", total=n, rate="")
        for _, d in iter_datums(lmdb_path):
            acc.add(datum_array(d))
            prog.advance(task)
    if not acc.count:
        raise CometError(f"{lmdb_path}: empty LMDB, no mean image")
    mean = acc.mean()
    source = _read_json(done_stamp(lmdb_path))
    write_mean(dest, mean, lmdb_path, source.get("sha256") if isinstance(source, dict) else None)
    return mean


# ---------------------------------------------------------------------------------------------- layouts
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


@dataclass
class Part:
    """One LMDB's input: where its images are, and (name, label) for each, sorted by name."""
    source: Source
    entries: list[tuple[str, int]]


@dataclass
class Layout:
    """What a layout reader found: everything the pipeline needs, nothing about how it was found."""
    kind: str  # "dogs", "imagenet", "images"
    inputs: dict[str, str]  # what was read, for the manifest ("train": path, ...)
    parts: dict[str, Part]  # "train" and "val"
    classes: list[str]  # the class of label i
    words: list[str]  # synset_words.txt: line i describes label i
    split: str  # how train and val were decided
    extra: dict[str, list[str]] = field(default_factory=dict)  # more listing files (file name -> lines)
    identity: list = field(default_factory=list)  # more inputs that decide the outputs (a lists file ...)


@dataclass
class Prepared:
    data_dir: Path
    classes: int
    train: int
    val: int
    skipped: list[tuple[str, str]] = field(default_factory=list)
    split: str = ""
    up_to_date: bool = False
    seconds: float = 0.0
    images_per_second: float = 0.0
    resumed_from: dict = field(default_factory=dict)  # split -> index a resumed conversion went on from
    kept: list[str] = field(default_factory=list)  # finished outputs verified and kept from an earlier run


PARTS = ("train", "val")


def write_lines(path: Path, lines) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        for line in lines:
            f.write(line + "\n")
    os.replace(tmp, path)


def resumable_on_interrupt(fn):
    """Ctrl-C in fn becomes a CometError (exit 130) that says how to resume; fn keeps its signature."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt:
            raise CometError("interrupted; nothing finished was lost: run the same command again to "
                             "resume", exit_code=130) from None
    return wrapper


@resumable_on_interrupt
def prepare(data_dir: Path, layout: Layout, size: int, jobs: int | None, seed: int,
            stop_after: int | None = None, t0: float | None = None) -> Prepared:
    """Turn a layout into the data folder: train_lmdb/, val_lmdb/, mean.binaryproto, train.txt, val.txt,
    synset_words.txt (and the layout's extra listings), skipped.txt, prepare.json. Resumable and
    idempotent (see the module's docstring). Ctrl-C becomes a CometError that says how to resume."""
    from .locks import folder_lock

    data_dir = Path(data_dir)
    with folder_lock(data_dir, "preparing a dataset"):
        return _prepare(data_dir, layout, size, jobs, seed, stop_after, t0)


def check_size(size: int) -> None:
    if size < 8 or size > 4096:
        raise CometError(f"--size {size}: choose between 8 and 4096 pixels")


def _prepare(data_dir: Path, layout: Layout, size: int, jobs: int | None, seed: int,
             stop_after: int | None, t0: float | None) -> Prepared:
    t0 = time.perf_counter() if t0 is None else t0
    check_size(size)
    jobs = max(1, jobs or os.cpu_count() or 1)
    for part in PARTS:
        if not layout.parts[part].entries:
            where = layout.inputs.get(part) or ", ".join(layout.inputs.values())
            hint = "a --val-fraction above 0, or a val/ folder" if part == "val" else "images in class folders"
            raise CometError(f"{where}: no {part} images (expected {hint})")
    orders: dict[str, list[tuple[str, int]]] = {}
    plans: dict[str, str] = {}
    for part in PARTS:
        order = list(layout.parts[part].entries)
        random.Random(f"{seed}/{part}").shuffle(order)  # Caffe reads keys in order: store them shuffled
        orders[part] = order
        plans[part] = plan_digest(FORMAT_VERSION, DECODER_VERSION, size, layout.parts[part].source.identity(),
                                  order_digest(order))
    fingerprint = plan_digest(layout.kind, plans, layout.identity, layout.split, layout.words, layout.extra)

    data_dir.mkdir(parents=True, exist_ok=True)
    manifest_path = data_dir / "prepare.json"
    outputs = [data_dir / f for f in ("train_lmdb", "val_lmdb", "mean.binaryproto", "train.txt", "val.txt",
                                      "synset_words.txt", *layout.extra)]
    manifest = _read_json(manifest_path) or {}
    if manifest.get("fingerprint") == fingerprint and all(p.exists() for p in outputs):
        console.print(f"{data_dir}: already prepared from {', '.join(layout.inputs.values())} (nothing to do)")
        return Prepared(data_dir, len(layout.classes), manifest["train"], manifest["val"],
                        [tuple(s) for s in manifest.get("skipped", [])], layout.split, up_to_date=True)
    if manifest_path.exists():
        manifest_path.unlink()  # the outputs are about to change: they are not "prepared" until the end

    n_images = sum(len(o) for o in orders.values())
    console.print(f"{n_images:,} images in {len(layout.classes):,} classes; split: {layout.split}; "
                  f"{len(orders['train']):,} train, {len(orders['val']):,} val; {size}x{size}; {jobs} job(s)")
    results: dict[str, ConvertResult] = {}
    converted = 0
    t_conv = time.perf_counter()
    mean_path = data_dir / "mean.binaryproto"
    for part in PARTS:
        res = build_lmdb(layout.parts[part].source, orders[part], data_dir / f"{part}_lmdb", size, jobs,
                         f"{part} LMDB", plans[part], stop_after=stop_after, mean=(part == "train"))
        results[part] = res
        converted += len(orders[part]) - res.resumed_from
    conv_seconds = time.perf_counter() - t_conv
    kept = [f"{part}_lmdb" for part, res in results.items() if res.kept]
    train = results["train"]
    if train.mean_sum is not None:  # the mean, from the sums taken while writing: no second pass
        write_mean(mean_path, train.mean_sum / np.float32(train.written), data_dir / "train_lmdb", train.digest)
    elif mean_is_current(data_dir / "train_lmdb", mean_path):
        console.print(f"mean image: kept {mean_path} (computed from this train LMDB earlier)")
        kept.append(mean_path.name)
    else:  # a train LMDB kept from an earlier run, without its mean: read it back
        compute_mean(data_dir / "train_lmdb", mean_path)

    skipped = results["train"].skipped + results["val"].skipped
    bad = {n for n, _ in skipped}
    for part in PARTS:
        write_lines(data_dir / f"{part}.txt", (f"{n} {lab}" for n, lab in layout.parts[part].entries if n not in bad))
    write_lines(data_dir / "synset_words.txt", layout.words)
    for fname, lines in layout.extra.items():
        write_lines(data_dir / fname, lines)
    write_lines(data_dir / "skipped.txt", (f"{n}\t{why}" for n, why in skipped))
    seconds = time.perf_counter() - t0
    rate = converted / conv_seconds if conv_seconds > 0 else 0.0
    manifest = {"fingerprint": fingerprint, "layout": layout.kind, "inputs": layout.inputs, "size": size,
                "seed": seed, "split": layout.split, "classes": len(layout.classes),
                "train": results["train"].written, "val": results["val"].written, "skipped": skipped,
                "seconds": round(seconds, 2), "images_per_second": round(rate, 1), "jobs": jobs}
    for k, v in layout.inputs.items():  # the old top-level names (prepare-dogs: archive, lists)
        manifest.setdefault(k, v)
    _atomic_json(manifest_path, manifest)

    console.print(f"[green]prepared[/] {data_dir}: {results['train'].written:,} train, {results['val'].written:,} "
                  f"val images, {len(layout.classes):,} classes, "
                  + (f"{rate:.0f} images/s, " if converted or not kept else f"kept {', '.join(kept)}, ")
                  + f"{seconds:.1f} s in all")
    if skipped:
        console.print(f"[yellow]skipped {len(skipped)} unreadable image(s)[/], listed in {data_dir / 'skipped.txt'}:")
        for n, why in skipped[:10]:
            console.print(f"  {n}: {why}")
        if len(skipped) > 10:
            console.print(f"  ... and {len(skipped) - 10} more")
    return Prepared(data_dir, len(layout.classes), results["train"].written, results["val"].written, skipped,
                    layout.split, seconds=seconds, images_per_second=rate,
                    resumed_from={k: v.resumed_from for k, v in results.items()}, kept=kept)


# ------------------------------------------------------------------------------------ folder-per-class
def class_of(name: str) -> str | None:
    """The class folder of "<class>/.../<file>"; None for an image outside any folder."""
    return name.split("/", 1)[0] if "/" in name else None


def by_class(names) -> tuple[dict[str, list[str]], list[str]]:
    """({class: names}, names outside a class folder)."""
    classes: dict[str, list[str]] = {}
    loose = []
    for n in names:
        c = class_of(n)
        if c is None:
            loose.append(n)
        else:
            classes.setdefault(c, []).append(n)
    return classes, loose


def labelled(names, label_of: dict[str, int]) -> list[tuple[str, int]]:
    return [(n, label_of[class_of(n)]) for n in sorted(names)]


_WNID = re.compile(r"n\d{8}")


def is_wnid(text: str) -> bool:
    return bool(_WNID.fullmatch(text))
