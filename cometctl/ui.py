"""Console and progress display shared by every command: one stderr console, a spinner with elapsed time
for steps, bars for counted work and for bytes."""

from __future__ import annotations

import contextlib
import sys
import time

from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress, SpinnerColumn,
                           TaskProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn,
                           TransferSpeedColumn)

console = Console(stderr=True, highlight=False)


@contextlib.contextmanager
def step(title: str):
    """Show `title` with a spinner while the body runs, then a check mark and the time it took."""
    t0 = time.monotonic()
    if console.is_terminal:
        with console.status(f"{title} ..."):
            yield
    else:
        console.print(f"{title} ...")
        sys.stderr.flush()
        yield
    console.print(f"[green]✓[/] {title} ({time.monotonic() - t0:.1f} s)")


@contextlib.contextmanager
def counter(title: str, total: int | None):
    """A bar for a known number of work items (compiled objects, converted images)."""
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                  console=console, transient=False) as prog:
        task = prog.add_task(title, total=total)
        yield lambda n=1, **kw: prog.update(task, advance=n, **kw)


def counting_progress(**kw) -> Progress:
    """A bar for counted work (images, records): description, bar, n/total, rate, ETA."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                    console=console, **kw)


def bytes_progress(**kw) -> Progress:
    """A bar for bytes (downloads, checksums): description, bar, size, speed, ETA."""
    return Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), DownloadColumn(),
                    TransferSpeedColumn(), TimeRemainingColumn(), console=console, **kw)
