"""Images in, Caffe LMDBs out: the conversion `convert_imageset` does, made resumable and parallel.

* Sources: an uncompressed tar archive (read in place by member offset, nothing is unpacked) or a folder.
* Each image is decoded, converted to RGB, resized to size x size (like convert_imageset's
  -resize_height/-resize_width, aspect ratio not kept) and stored as a Datum: channels=3, height, width,
  data = BGR bytes in CHW order, label. Keys are "%08d_<path>" in the shuffled order, as convert_imageset
  writes them, so Caffe's Data layer (which reads keys in sorted order) sees the shuffled order.
* An LMDB is built under "<name>.partial" and renamed to "<name>" only when complete. After each committed
  batch a sidecar "<name>.partial.json" records how far the ordered list is done and which images were
  skipped; a rerun with the same plan continues from there. An image that does not decode is skipped,
  counted and listed, never fatal.
* A finished LMDB gets "<name>.done.json" beside it: the plan it was built for, its entry count and a
  SHA-256 digest of its content (every key and value in key order). A rerun with the same plan verifies
  count and digest and keeps the LMDB as it is; one that does not verify is rebuilt, with a message.
* The mean image is computed from the finished LMDB as compute_image_mean computes it (float sums of the
  uint8 bytes divided by the count) and written as a BlobProto with num=1, channels, height, width. Its
  "<mean>.done.json" names the digest of the LMDB it came from, so an unchanged LMDB keeps its mean.
"""

from __future__ import annotations

import hashlib
import io
import json
import multiprocessing
import os
import shutil
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import CometError
from .upstream import sha256_file
from .ui import console, counting_progress

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".ppm")
BATCH = 256  # images per LMDB transaction (and per resume checkpoint)


# ---------------------------------------------------------------------------------------------- sources
class TarSource:
    """Images inside an uncompressed tar, addressed by their path below the top folder (e.g. "Images/")."""

    def __init__(self, path: Path, strip: str = "Images/"):
        self.path = Path(path)
        self.strip = strip
        self._members: dict[str, tuple[int, int]] = {}
        self._index()

    def identity(self) -> dict:
        st = self.path.stat()
        return {"kind": "tar", "path": str(self.path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}

    def _index(self) -> None:
        if not self.path.exists():
            raise CometError(f"{self.path}: no such file")
        file_size = self.path.stat().st_size
        last_end = 0
        try:
            with tarfile.open(self.path, "r:") as tar:
                for m in tar:
                    last_end = max(last_end, m.offset_data + ((m.size + 511) // 512) * 512)
                    if not m.isfile() or not m.name.lower().endswith(IMAGE_EXTENSIONS):
                        continue
                    name = m.name[len(self.strip):] if m.name.startswith(self.strip) else m.name
                    self._members[name] = (m.offset_data, m.size)
        except tarfile.ReadError as e:
            hint = " (a compressed archive? give the uncompressed .tar)" if "compress" in str(e).lower() or \
                self.path.suffix in (".gz", ".tgz", ".bz2", ".xz") else ""
            raise CometError(f"{self.path}: not a readable tar archive: {e}{hint}") from None
        # Python's tarfile stops silently when an archive is cut off between members: check the end.
        with open(self.path, "rb") as f:
            f.seek(last_end)
            trailer = f.read(1024)
        if last_end > file_size or len(trailer) < 1024 or trailer.count(0) != 1024:
            raise CometError(f"{self.path}: archive is truncated or damaged (it ends at byte {file_size} "
                             f"without tar's end marker); fetch it again")

    def names(self) -> list[str]:
        return sorted(self._members)

    def job(self, name: str):
        offset, size = self._members[name]
        return ("tar", str(self.path), offset, size)


class DirSource:
    """Images in a folder tree (an unpacked images.tar: <root>/Images/<class>/<file> or <root>/<class>/<file>)."""

    def __init__(self, path: Path):
        path = Path(path)
        if not path.is_dir():
            raise CometError(f"{path}: no such folder")
        self.root = path / "Images" if (path / "Images").is_dir() else path
        self._names = sorted(str(p.relative_to(self.root)) for p in self.root.rglob("*")
                             if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)

    def identity(self) -> dict:
        digest = hashlib.sha256("\n".join(self._names).encode()).hexdigest()
        return {"kind": "dir", "path": str(self.root.resolve()), "files": digest}

    def names(self) -> list[str]:
        return list(self._names)

    def job(self, name: str):
        return ("file", str(self.root / name), 0, -1)


def open_source(path: Path):
    path = Path(path)
    if path.is_dir():
        return DirSource(path)
    return TarSource(path)


# ----------------------------------------------------------------------------------------------- decode
def decode_image(data: bytes, size: int) -> np.ndarray:
    """JPEG/PNG bytes -> uint8 array (3, size, size), BGR channel order as Caffe stores it."""
    from PIL import Image

    im = Image.open(io.BytesIO(data))
    if im.format == "JPEG":
        im.draft("RGB", (size, size))  # let libjpeg decode at a reduced scale: much faster for big images
    im = im.convert("RGB").resize((size, size), Image.BILINEAR)
    return np.ascontiguousarray(np.asarray(im)[:, :, ::-1].transpose(2, 0, 1))


_handles: dict[str, object] = {}


def _read(job) -> bytes:
    kind, path, offset, size = job
    if kind == "file":
        with open(path, "rb") as f:
            return f.read()
    f = _handles.get(path)
    if f is None:
        f = _handles[path] = open(path, "rb")
    f.seek(offset)
    data = f.read(size)
    if len(data) != size:
        raise OSError("archive ends inside this image")
    return data


def _worker_init() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's business


def _work(item):
    """(index, job, size) -> (index, CHW bytes or None, error text)."""
    index, job, size = item
    try:
        return index, decode_image(_read(job), size).tobytes(), ""
    except Exception as e:  # any decoder failure means: skip this image, say why
        return index, None, f"{type(e).__name__}: {e}".replace("\n", " ")


# ---------------------------------------------------------------------------------------------- convert
@dataclass
class ConvertResult:
    path: Path
    written: int
    skipped: list[tuple[str, str]] = field(default_factory=list)
    resumed_from: int = 0
    kept: bool = False  # a finished LMDB of the same plan was verified and kept as it was


def _atomic_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def plan_digest(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def done_stamp(dest: Path) -> Path:
    """The record written beside a finished output: <dest>.done.json."""
    dest = Path(dest)
    return dest.with_name(dest.name + ".done.json")


def _read_json(path: Path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def lmdb_digest(path: Path) -> tuple[int, str]:
    """(entries, SHA-256 of every key and value in key order) of an LMDB: what it holds, not how its
    pages happen to be laid out."""
    import lmdb

    h = hashlib.sha256()
    n = 0
    env = lmdb.open(str(path), readonly=True, lock=False, subdir=True)
    try:
        with env.begin(buffers=True) as txn:
            for key, value in txn.cursor():
                h.update(len(key).to_bytes(4, "little"))
                h.update(key)
                h.update(len(value).to_bytes(8, "little"))
                h.update(value)
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


def build_lmdb(source, entries: list[tuple[str, int]], dest: Path, size: int, jobs: int, label: str,
               plan: str, stop_after: int | None = None) -> ConvertResult:
    """Write `entries` ((name, label) in final order) as Datums into the LMDB `dest`.

    `plan` identifies the work; a "<dest>.partial" with the same plan is continued, any other is discarded.
    `stop_after` (tests) raises KeyboardInterrupt after that many committed images, as a user's Ctrl-C would.
    """
    import lmdb

    from .caffeproto import caffe_pb2

    pb2 = caffe_pb2()
    dest = Path(dest)
    partial = dest.with_name(dest.name + ".partial")
    sidecar = dest.with_name(dest.name + ".partial.json")
    finished, why = verify_finished(dest, plan)
    if finished:
        if partial.exists():  # a conversion for other options, abandoned: this one stays
            shutil.rmtree(partial)
        sidecar.unlink(missing_ok=True)
        console.print(f"{label}: kept {dest} (finished earlier; {finished['entries']} entries, digest verified)")
        return ConvertResult(dest, finished["written"], [tuple(s) for s in finished.get("skipped", [])],
                             len(entries), kept=True)
    if why:
        console.print(f"[yellow]{label}:[/] {why}")
    state = {"plan": plan, "done": 0, "written": 0, "skipped": []}
    if partial.exists():
        try:
            old = json.loads(sidecar.read_text())
        except (OSError, ValueError):
            old = None
        if old and old.get("plan") == plan:
            state = old
        else:
            shutil.rmtree(partial)
    start = state["done"]
    if start:
        console.print(f"{label}: resuming at image {start} of {len(entries)}")

    per_image = ((3 * size * size + 256) // 4096 + 2) * 4096
    map_size = max(64 << 20, 2 * len(entries) * per_image)
    env = lmdb.open(str(partial), map_size=map_size, subdir=True, meminit=False, map_async=False)
    _atomic_json(sidecar, state)

    items = ((i, source.job(entries[i][0]), size) for i in range(start, len(entries)))
    pool = None
    if jobs > 1 and len(entries) - start > 64:
        pool = multiprocessing.get_context("fork").Pool(jobs, initializer=_worker_init)
        results = pool.imap(_work, items, chunksize=8)
    else:
        results = map(_work, items)
    committed = 0
    try:
        with counting_progress() as prog:
            task = prog.add_task(label, total=len(entries), completed=start, rate="")
            pending: list[tuple[bytes, bytes]] = []
            new_skips: list[tuple[str, str]] = []

            def commit(upto: int) -> None:
                nonlocal pending, new_skips, committed
                with env.begin(write=True) as txn:
                    for k, v in pending:
                        txn.put(k, v)
                state["done"] = upto
                state["written"] += len(pending)
                state["skipped"] += new_skips
                _atomic_json(sidecar, state)
                committed += len(pending)
                pending, new_skips = [], []

            for index, chw, error in results:
                name, lab = entries[index]
                if chw is None:
                    new_skips.append((name, error))
                else:
                    d = pb2.Datum(channels=3, height=size, width=size, data=chw, label=lab)
                    pending.append((f"{index:08d}_{name}".encode(), d.SerializeToString()))
                speed = prog.tasks[0].speed
                prog.update(task, advance=1, rate=f"{speed:.0f} img/s" if speed else "")
                if len(pending) + len(new_skips) >= BATCH:
                    commit(index + 1)
                    if stop_after is not None and committed >= stop_after:
                        raise KeyboardInterrupt
            commit(len(entries))
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        env.close()

    if state["written"] == 0:
        raise CometError(f"{label}: none of the {len(entries)} images could be read "
                         f"(first error: {state['skipped'][0][1] if state['skipped'] else '?'})")
    count, digest = lmdb_digest(partial)
    if count != state["written"]:
        raise CometError(f"{label}: {partial} holds {count} entries after writing {state['written']}; "
                         f"remove it and run again")
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
    return ConvertResult(dest, state["written"], [tuple(s) for s in state["skipped"]], start)


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


def mean_is_current(lmdb_path: Path, dest: Path) -> bool:
    """Whether `dest` is the mean that compute_mean wrote from the LMDB as it is now (both records agree
    and the mean file is unchanged). The LMDB's own record must have been verified by the caller."""
    source, mine = _read_json(done_stamp(lmdb_path)), _read_json(done_stamp(dest))
    if not (isinstance(source, dict) and isinstance(mine, dict) and Path(dest).is_file()):
        return False
    return mine.get("source_sha256") == source.get("sha256") and mine.get("sha256") == sha256_file(dest)


def compute_mean(lmdb_path: Path, dest: Path) -> np.ndarray:
    """Mean image of an LMDB written as compute_image_mean writes it; returns it as (C, H, W) float32.
    When the LMDB has a done record, the mean gets one too, naming the LMDB's digest."""
    from .caffeproto import caffe_pb2

    stamp = done_stamp(dest)
    stamp.unlink(missing_ok=True)

    total = None
    count = 0
    shape = None
    n = lmdb_count(lmdb_path)
    with counting_progress() as prog:
        task = prog.add_task("mean image", total=n, rate="")
        for _, d in iter_datums(lmdb_path):
            a = datum_array(d)
            if total is None:
                shape = a.shape
                total = np.zeros(shape, dtype=np.int64)
            total += a
            count += 1
            prog.advance(task)
    if not count:
        raise CometError(f"{lmdb_path}: empty LMDB, no mean image")
    # compute_image_mean sums in float (exact for these integers) and divides each sum by the count in float
    mean = total.astype(np.float32) / np.float32(count)
    blob = caffe_pb2().BlobProto(num=1, channels=shape[0], height=shape[1], width=shape[2])
    blob.data.extend(mean.ravel().tolist())
    tmp = dest.with_name(dest.name + ".tmp")
    tmp.write_bytes(blob.SerializeToString())
    os.replace(tmp, dest)
    source = _read_json(done_stamp(lmdb_path))
    if isinstance(source, dict) and "sha256" in source:
        _atomic_json(stamp, {"source": str(lmdb_path), "source_sha256": source["sha256"],
                             "sha256": sha256_file(dest)})
    return mean
