"""One cometctl command at a time per output folder: a dataset's data folder, a build folder.

Two `prepare-*` commands writing one data folder would interleave their LMDB records and manifests, and
two builds of one variant would run CMake in the same tree; a run that started on a dataset still being
written would read half an LMDB (`busy` lets `train` refuse that). The lock is flock(2) on the folder itself
(no lock file, so a finished folder is left exactly as it was); the kernel drops it when the process
ends, however it ends."""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path

from .errors import CometError


def _flock(fd: int, op: int) -> bool:
    """flock(2) without waiting: False when another process holds the folder; True when taken, or on a
    file system without flock (some network ones: ENOLCK), where nothing can be held and work goes on
    unguarded, as before locks."""
    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:  # no flock on this file system
        pass
    return True


_held: set[Path] = set()  # folders this process holds: a nested folder_lock of one of them passes


@contextmanager
def folder_lock(folder: Path, doing: str):
    """Hold `folder` (made when missing, and removed again if left empty) for the `with` block; CometError
    at once when another process holds it. `doing`: what the holder does there, for the message."""
    folder = Path(folder)
    made = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    key = folder.resolve()
    if key in _held:
        yield
        return
    fd = os.open(key, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if not _flock(fd, fcntl.LOCK_EX):
            raise CometError(f"{folder}: another cometctl command is {doing} there; wait for it to finish "
                             f"(two at once would mix their outputs)")
        _held.add(key)
        try:
            yield
        finally:
            _held.discard(key)
    finally:
        os.close(fd)  # releases the lock
        if made and not any(folder.iterdir()):  # refused or failed before writing: leave no trace
            folder.rmdir()


def busy(folder: Path) -> bool:
    """Whether another process holds `folder` with folder_lock now (a `prepare-*` writing there)."""
    try:
        key = Path(folder).resolve()
        if key in _held:
            return False
        fd = os.open(key, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:  # missing or not a folder: nobody prepares there
        return False
    try:
        return not _flock(fd, fcntl.LOCK_SH)
    finally:
        os.close(fd)
