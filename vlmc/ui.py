"""Console output: progress bars and tables on stderr, quiet and verbose levels."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

logger = logging.getLogger(__name__)

# Progress and tables go to stderr so that `--json` output on stdout stays machine-readable.
console = Console(stderr=True, highlight=False)
stdout = Console(highlight=False, soft_wrap=True)

_state = {"quiet": False, "verbose": False}


def configure(quiet: bool = False, verbose: bool = False) -> None:
    """Set the verbosity for this process."""
    _state["quiet"] = quiet
    _state["verbose"] = verbose
    level = logging.DEBUG if verbose else (logging.ERROR if quiet else logging.WARNING)
    logging.basicConfig(
        level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr, force=True
    )


def is_verbose() -> bool:
    return _state["verbose"]


def info(message: str) -> None:
    """Print a status line unless quiet."""
    if not _state["quiet"]:
        console.print(message)


def warn(message: str) -> None:
    """Print a warning line (shown even when quiet is off)."""
    console.print(f"[yellow]warning:[/yellow] {message}")


class _Step:
    def __init__(self, progress: Progress | None, task_id: int | None, notes: bool = False) -> None:
        self._progress = progress
        self._task = task_id
        self._notes = notes  # no bar (stderr is not a terminal): each new description is a note line

    def advance(self, amount: float = 1, description: str | None = None) -> None:
        if self._progress is not None:
            kwargs = {"description": description} if description else {}
            self._progress.update(self._task, advance=amount, **kwargs)

    def describe(self, description: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, description=description)
        elif self._notes:
            console.print(f"{description} ...")


@contextlib.contextmanager
def progress(description: str, total: float | None = None) -> Iterator[_Step]:
    """A progress bar for a long step; a no-op when quiet; when stderr is not a terminal, one note
    line ``<description> ...`` at the start and one per new description (scripts/_measure.py times
    the steps of a build from these lines)."""
    if _state["quiet"] or not console.is_terminal:
        if not _state["quiet"]:
            console.print(f"{description} ...")
        yield _Step(None, None, notes=not _state["quiet"])
        return
    columns = [
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed:.0f}/{task.total:.0f}") if total else TextColumn(""),
        TimeElapsedColumn(),
    ]
    with Progress(*columns, console=console, transient=True) as bar:
        task_id = bar.add_task(description, total=total)
        yield _Step(bar, task_id)


def table(title: str, columns: list[str], rows: list[list[object]]) -> Table:
    """Build a rich table from plain rows."""
    t = Table(title=title, title_justify="left")
    for c in columns:
        t.add_column(c)
    for r in rows:
        t.add_row(*[str(x) for x in r])
    return t


def show(renderable: object) -> None:
    """Print a table or other renderable to stdout unless quiet."""
    if not _state["quiet"]:
        stdout.print(renderable)
