"""Reading many rank files at once: each file opened, checked and indexed in a pool of worker processes.

A diff or check of a distributed run first reads, for every rank file, its attributes and the index table of every
step (a few kilobytes per rank and step: names, shapes, statistics). With hundreds or thousands of rank files that
is the part worth spreading, and it is embarrassingly parallel: one task per file, no shared state. It runs on

* the standard library's ``concurrent.futures.ProcessPoolExecutor`` on one host (``--jobs N``), or
* a Dask ``distributed`` cluster across hosts (``--dask ADDRESS``, the optional extra ``tensordiff[dask]``), whose
  ``Client.get_executor()`` is the same ``concurrent.futures`` interface; the rank files must be on a filesystem
  every worker sees.

No scheduler of our own: the executor maps ``_summary`` over the files, and each reader is rebuilt from its
summary (``open_files``), so merging and diffing then run unchanged. The diff hands the tensors' merge and compare
to the same executor (``diff/workers.py``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import Executor, ProcessPoolExecutor
from contextlib import contextmanager
from typing import Any

from .. import _native
from .. import _progress as progress
from ..errors import UsageError
from .reader import CaptureFile

#: Below this many files a pool costs more than it saves (worker start-up is ~0.1 s each).
POOL_MIN_FILES = 16
ENV_JOBS = "TENSORDIFF_JOBS"
ENV_DASK = "TENSORDIFF_DASK"

_settings: dict[str, str | int | None] = {"jobs": None, "dask": None}


def configure(jobs: int | None = None, dask: str | None = None) -> None:
    """What ``--jobs`` and ``--dask`` say, for every rank-file reader opened afterwards in this process."""
    if jobs is not None and jobs < 1:
        raise UsageError(f"--jobs {jobs}: give a number of worker processes, 1 or more")
    _settings["jobs"], _settings["dask"] = jobs, dask


def _jobs(n_files: int) -> int:
    jobs = _settings["jobs"]
    if jobs is None and os.environ.get(ENV_JOBS, "").strip():
        try:
            jobs = int(os.environ[ENV_JOBS])
        except ValueError:
            raise UsageError(f"{ENV_JOBS}={os.environ[ENV_JOBS]!r}: expected a number of worker processes") from None
    if jobs is None:  # automatic: a pool only where it pays
        return min(os.cpu_count() or 1, 8) if n_files >= POOL_MIN_FILES else 1
    return max(1, min(int(jobs), n_files))


@contextmanager
def executor_for(n_files: int) -> Iterator[Executor | None]:
    """The executor to read ``n_files`` rank files with, or None to read them in this process."""
    address = _settings["dask"] or os.environ.get(ENV_DASK, "").strip() or None
    if address:
        try:
            from distributed import Client  # type: ignore[import-not-found,import-untyped,unused-ignore]
        except ImportError:
            raise UsageError(f"--dask {address}: Dask distributed is not installed; pip install 'tensordiff[dask]'") \
                from None
        try:
            client = Client(str(address), timeout=30)
        except OSError as err:
            raise UsageError(f"--dask {address}: no Dask scheduler answers there ({err}); start one with "
                             "`dask scheduler` and workers with `dask worker ADDRESS`") from None
        try:
            yield client.get_executor()
        finally:
            client.close()
        return
    jobs = _jobs(n_files)
    if jobs <= 1:
        yield None
        return
    with ProcessPoolExecutor(max_workers=jobs, initializer=_native.keep_freed_memory) as pool:
        yield pool


def _summary(path: str) -> dict[str, Any]:
    """One rank file opened, checked and indexed (runs in a worker process): ``CaptureFile.summary``."""
    with CaptureFile(path) as cap:
        return cap.summary()


def open_files(paths: list[str]) -> dict[str, CaptureFile]:
    """Readers of ``paths``: with the pool (many files), each file opened, checked and indexed in a worker and its
    reader rebuilt here from that summary, its HDF5 file opened only if a tensor is read here (``CaptureFile.
    unopened``); else each opened here. A file that cannot be read is the worker's CaptureFileError, raised here."""
    out: dict[str, CaptureFile] = {}
    try:
        with executor_for(len(paths)) as executor:
            if executor is None:
                for path in paths:
                    out[path] = CaptureFile(path)
                return out
            chunk = max(1, min(16, len(paths) // (4 * max(1, _jobs(len(paths))))))
            with progress.task(f"opening {len(paths)} rank files", len(paths), "files") as shown:
                for path, summary in zip(paths, executor.map(_summary, paths, chunksize=chunk)):
                    out[path] = CaptureFile.unopened(path, summary)
                    shown.advance()
        return out
    except BaseException:
        for cap in out.values():
            cap.close()
        raise

