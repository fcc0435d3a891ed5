"""Progress display shared by the commands: a spinner with elapsed time for steps, a bar for downloads."""

from __future__ import annotations

import contextlib
import sys
import time

from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, Progress, SpinnerColumn, TextColumn,
                           TimeElapsedColumn, TransferSpeedColumn)

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
def download_progress(title: str, total: int | None):
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), console=console, transient=True) as prog:
        task = prog.add_task(title, total=total)
        yield lambda n: prog.advance(task, n)


@contextlib.contextmanager
def counter(title: str, total: int | None):
    """A bar for a known number of work items (compiled objects, converted images)."""
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                  console=console, transient=False) as prog:
        task = prog.add_task(title, total=total)
        yield lambda n=1, **kw: prog.update(task, advance=n, **kw)
