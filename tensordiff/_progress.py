"""Progress of long work (a diff of large captures, rank files opened and merged, a checkpoint converted, a run
resumed by ``locate``, a capture's final drain), said while it runs, on stderr.

The library only says what it is doing: ``with progress.task("comparing", total=n, unit="pairs") as t: ...
t.advance()``. A bar (rich.progress) is drawn only where stderr is a terminal and ``TENSORDIFF_QUIET`` is not set
(``tensordiff --quiet`` sets it, for the programs ``tensordiff capture`` runs too), and only once a task has run
``DELAY`` seconds; it is erased when the task ends, so the output is the same with or without it. A pipe, a file,
CI and ``--json`` output never see one.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from typing import Protocol

ENV_QUIET = "TENSORDIFF_QUIET"
#: seconds of work before a bar is drawn: shorter work shows nothing (TENSORDIFF_PROGRESS_DELAY: another delay)
DELAY = float(os.environ.get("TENSORDIFF_PROGRESS_DELAY", "") or 1.0)


class Task(Protocol):
    def advance(self, n: float = 1) -> None: ...

    def describe(self, label: str) -> None: ...


class _Silent:
    def advance(self, n: float = 1) -> None:
        pass

    def describe(self, label: str) -> None:
        pass


SILENT = _Silent()


def quiet() -> bool:
    """``TENSORDIFF_QUIET`` set (``--quiet``), or stderr not a terminal: no progress is shown."""
    if os.environ.get(ENV_QUIET, "").strip() not in ("", "0"):
        return True
    try:
        return not sys.stderr.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stderr
        return True


@contextlib.contextmanager
def task(label: str, total: float | None = None, unit: str = "") -> Iterator[Task]:
    """One piece of long work: ``advance`` it as it goes (``total`` None: a spinner with the time taken)."""
    if quiet():
        yield SILENT
        return
    try:
        shown = _Bar(label, total, unit)
        t = shown.__enter__()
    except Exception:  # a display that cannot draw never stops the work
        yield SILENT
        return
    try:
        yield t
    finally:
        with contextlib.suppress(Exception):
            shown.__exit__(None, None, None)


class _Bar:
    """rich.progress on stderr, started by a timer after ``DELAY`` seconds (never for shorter work)."""

    def __init__(self, label: str, total: float | None, unit: str):
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            MofNCompleteColumn,
            Progress,
            ProgressColumn,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
            TransferSpeedColumn,
        )

        columns: list[ProgressColumn | str] = [SpinnerColumn(), TextColumn("{task.description}")]
        if total is not None:
            columns.append(BarColumn())
        if unit == "bytes":
            columns += [DownloadColumn(), TransferSpeedColumn()]
        elif total is not None:
            columns += [MofNCompleteColumn(), TextColumn(unit)]
        elif unit:
            columns.append(TextColumn("{task.completed:.0f} " + unit))
        columns.append(TimeElapsedColumn())
        self._progress = Progress(*columns, console=Console(stderr=True, highlight=False), transient=True)
        self._id = self._progress.add_task(label, total=total)
        self._timer = threading.Timer(DELAY, self._progress.start)
        self._timer.daemon = True

    def advance(self, n: float = 1) -> None:
        self._progress.advance(self._id, n)

    def describe(self, label: str) -> None:
        self._progress.update(self._id, description=label)

    def __enter__(self) -> _Bar:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()
        self._timer.join()
        if self._progress.live.is_started:
            self._progress.stop()
