"""Console and progress bars shared by the workflow commands (prepare-dogs, train, report)."""

from __future__ import annotations

from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TaskProgressColumn,
                           TextColumn, TimeElapsedColumn, TimeRemainingColumn, TransferSpeedColumn)

from .progress import console  # one console (stderr) for every command


def counting_progress(**kw) -> Progress:
    """A bar for counted work (images, records): description, bar, n/total, rate, ETA."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                    console=console, **kw)


def bytes_progress(**kw) -> Progress:
    """A bar for bytes (downloads, checksums): description, bar, size, speed, ETA."""
    return Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), DownloadColumn(),
                    TransferSpeedColumn(), TimeRemainingColumn(), console=console, **kw)
