"""One cometctl command at a time per output folder: a dataset's data folder, a build folder.

Two `prepare-*` commands writing one data folder would interleave their LMDB records and manifests, and
two builds of one variant would run CMake in the same tree. The lock is flock(2) on the folder itself
(no lock file, so a finished folder is left exactly as it was); the kernel drops it when the process
ends, however it ends."""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path

from .errors import CometError


@contextmanager
def folder_lock(folder: Path, doing: str):
    """Hold `folder` (which must exist) for the `with` block; CometError at once when another process (or
    another open of it here) holds it. `doing`: what the holder does there, for the message."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CometError(f"{folder}: another cometctl command is {doing} there; wait for it to finish "
                             f"(two at once would mix their outputs)") from None
        yield
    finally:
        os.close(fd)  # releases the lock
