"""Resumable downloads with a progress bar and a checksum check; the one downloader of cometctl (datasets
by the MD5 their users publish, upstream Caffe through cometctl.upstream, which checks its own digests).

A download goes to `<dest>.part`; an interrupted one continues from where it stopped with an HTTP Range
request. Only a file whose checksum matches is renamed to `<dest>`. A file that does not match is kept
as `<dest>.bad-checksum` (nothing is deleted) and the user gets one line saying what to do.
"""

from __future__ import annotations

import hashlib
import json
import os
import urllib.error
import urllib.request
from pathlib import Path

from .errors import CometError
from .ui import bytes_progress

CHUNK = 1 << 20
USER_AGENT = "cometctl/0.1 (+COMET-Caffe)"


def file_digest(path: Path, algorithm: str = "md5", label: str | None = None, bar: bool = True) -> str:
    """Hex digest of a file, with a progress bar for big files unless `bar` is False."""
    h = hashlib.new(algorithm)
    size = Path(path).stat().st_size
    with open(path, "rb") as f:
        if not bar or size < 64 * CHUNK:
            while block := f.read(CHUNK):
                h.update(block)
            return h.hexdigest()
        with bytes_progress(transient=True) as prog:
            task = prog.add_task(label or f"checksum {Path(path).name}", total=size)
            while block := f.read(CHUNK):
                h.update(block)
                prog.advance(task, len(block))
    return h.hexdigest()


def md5_of(path: Path, label: str | None = None) -> str:
    return file_digest(path, "md5", label)


def _stamp(path: Path) -> Path:
    return path.with_name(path.name + ".md5ok")


def verify_md5(path: Path, expected: str) -> None:
    """Raise CometError unless `path` has MD5 `expected`. A stamp file remembers a success (by size and
    modification time) so that a rerun does not hash 750 MB again."""
    st = path.stat()
    key = {"md5": expected, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    stamp = _stamp(path)
    try:
        if json.loads(stamp.read_text()) == key:
            return
    except (OSError, ValueError):
        pass
    got = md5_of(path)
    if got != expected.lower():
        raise CometError(f"{path}: wrong checksum (MD5 {got}, expected {expected}); "
                         f"the file is damaged or not the expected one: delete it and fetch it again")
    stamp.write_text(json.dumps(key))


def _open(url: str, offset: int, timeout: float):
    req = urllib.request.Request(url, headers={"User-Agent": USER_AGENT})
    if offset:
        req.add_header("Range", f"bytes={offset}-")
    return urllib.request.urlopen(req, timeout=timeout)


def fetch(url: str, dest: Path, md5: str | None = None, timeout: float = 60.0, offline_hint: str = "") -> Path:
    """Download `url` to `dest` (resuming `<dest>.part`), check `md5`, return `dest`.

    An existing `dest` with the right checksum is reused without network access."""
    dest = Path(dest)
    if dest.exists():
        if md5:
            verify_md5(dest, md5)
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    offset = part.stat().st_size if part.exists() else 0
    try:
        try:
            resp = _open(url, offset, timeout)
        except urllib.error.HTTPError as e:
            if e.code != 416 or not offset:  # 416: the partial file already holds everything
                raise
            resp = None
        if resp is not None:
            with resp:
                status = getattr(resp, "status", None)
                if offset and status != 206:  # the server ignored Range: start again
                    offset = 0
                length = resp.headers.get("Content-Length")
                total = offset + int(length) if length and length.isdigit() else None
                with open(part, "ab" if offset else "wb") as out, bytes_progress() as prog:
                    task = prog.add_task(f"download {dest.name}", total=total, completed=offset)
                    while block := resp.read(CHUNK):
                        out.write(block)
                        prog.advance(task, len(block))
                written = part.stat().st_size
                if total is not None and written < total:
                    raise CometError(f"download of {url} stopped at {written} of {total} bytes; "
                                     f"run the command again to resume")
    except urllib.error.HTTPError as e:
        raise CometError(f"cannot download {url}: HTTP {e.code} {e.reason}. {offline_hint}".rstrip()) from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise CometError(f"cannot download {url} ({reason}). {offline_hint}".rstrip()) from None
    if md5:
        got = md5_of(part, f"checksum {dest.name}")
        if got != md5.lower():
            bad = dest.with_name(dest.name + ".bad-checksum")
            os.replace(part, bad)
            raise CometError(f"{url}: wrong checksum (MD5 {got}, expected {md5}); the data was kept as {bad}; "
                             f"delete it and run again")
        os.replace(part, dest)
        st = dest.stat()
        _stamp(dest).write_text(json.dumps({"md5": md5, "size": st.st_size, "mtime_ns": st.st_mtime_ns}))
    else:
        os.replace(part, dest)
    return dest
