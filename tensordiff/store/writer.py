"""The capture writer: steps handed over by the recorder, written off the training thread.

A step is written whole and flushed, then marked ``complete``; readers ignore incomplete
steps, so a crash loses at most the step in flight. Per-step scalars are appended and
flushed as they come, on their own path: ``submit_scalars`` never waits behind a step being written.
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import threading
import warnings
from typing import Any

import h5py
import numpy as np

from .. import dtypes
from .format import (
    CHUNK_MIN_BYTES,
    FORMAT_ATTR,
    FORMAT_VERSION,
    INDEX_DTYPE,
    LARGE_ATTR,
    META_GROUP,
    ROW_FIELDS,
    SCALAR_DTYPE,
    SCALAR_NAME_LEN,
    attr_value,
    step_group_name,
)


class CaptureWriter:
    """Writes steps to one HDF5 file, on a background thread by default.

    ``submit`` hands a finished step over and returns at once (blocking only when
    ``max_pending`` steps are already queued). Errors on the writer thread never
    reach the training loop: they are reported as a warning and later steps are dropped.
    """

    def __init__(self, path: str, attrs: dict[str, Any], background: bool = True, max_pending: int = 2):
        self.path = path
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        # superblock v0 (low bound "earliest"): no "open for writing" flag, so a killed run's file opens as it is
        self._file = h5py.File(path, "w", libver=("earliest", "v110"))
        self._file.attrs[FORMAT_ATTR] = FORMAT_VERSION
        for key, value in attrs.items():
            value = attr_value(value)
            if isinstance(value, str) and len(value.encode("utf-8")) > LARGE_ATTR:  # HDF5 attributes hold 64 KiB
                self._file.require_group(META_GROUP).create_dataset(key, data=value.encode("utf-8"))
            else:
                self._file.attrs[key] = value
        self._file.create_group("steps")
        self._file.flush()
        self.error: BaseException | None = None
        self._closed = False
        self._scalars: h5py.Dataset | None = None
        self._queue: queue.Queue | None = None
        self._scalar_jobs: collections.deque = collections.deque()  # appended by the training thread, never full
        self._thread: threading.Thread | None = None
        if background:
            self._queue = queue.Queue(maxsize=max_pending)
            self._thread = threading.Thread(target=self._run, name="tensordiff-writer", daemon=True)
            self._thread.start()

    def submit(self, step: int, rows: list[dict[str, Any]], data: dict[int, Any], attrs: dict[str, Any]) -> None:
        """Hand a step over; ``data`` maps a row to its array, or to a callable giving it (resolved here, off the
        training thread)."""
        if self.error is not None:
            return
        self._enqueue((step, rows, data, attrs))

    def submit_scalars(self, step: int, values: dict[str, float]) -> None:
        """Append per-step scalars (written and flushed off the training thread). Never blocks: they wait in their
        own unbounded line (a few bytes each), which the writer empties between steps."""
        if self.error is not None or self._closed:
            return
        if self._queue is None:
            self._write_guarded(("scalars", step, values))
            return
        self._scalar_jobs.append(("scalars", step, values))
        if self._queue.empty():  # an idle writer wakes up; one with work queued drains them after its next job
            with contextlib.suppress(queue.Full):
                self._queue.put_nowait(("wake",))

    def _enqueue(self, job: tuple) -> None:
        if self._queue is None:
            self._write_guarded(job)
        else:
            self._queue.put(job)

    def close(self) -> None:
        self._closed = True
        if self._queue is not None and self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._queue = None
        try:
            self._file.close()
        except Exception as err:  # pragma: no cover - closing a broken file
            warnings.warn(f"tensordiff: closing {self.path} failed: {err}", RuntimeWarning, stacklevel=2)

    def _run(self) -> None:
        assert self._queue is not None
        while True:
            job = self._queue.get()
            if job is not None and job[0] != "wake":
                self._write_guarded(job)
            while self._scalar_jobs:
                self._write_guarded(self._scalar_jobs.popleft())
            if job is None:
                return

    def _write_guarded(self, job: tuple) -> None:
        if self.error is not None:
            return
        try:
            if job[0] == "scalars":
                self._write_scalars(job[1], job[2])
            else:
                self._write(*job)
        except BaseException as err:  # never let storage problems reach training
            self.error = err
            warnings.warn(
                f"tensordiff: writing {'scalars' if job[0] == 'scalars' else f'step {job[0]}'} to {self.path} "
                f"failed ({err}); "
                "capture stopped, training goes on",
                RuntimeWarning,
                stacklevel=2,
            )

    def _write_scalars(self, step: int, values: dict[str, float]) -> None:
        if self._scalars is None:
            self._scalars = self._file.create_dataset("scalars", shape=(0,), maxshape=(None,), dtype=SCALAR_DTYPE,
                                                      chunks=(1024,))
        ds = self._scalars
        n = ds.shape[0]
        rows = np.array([(step, _cut(name), value) for name, value in values.items()], dtype=SCALAR_DTYPE)
        ds.resize((n + len(rows),))
        ds[n:] = rows
        if self._queue is None or (self._queue.empty() and not self._scalar_jobs):  # else a flush follows soon
            self._file.flush()

    def _write(self, step: int, rows: list[dict[str, Any]], data: dict[int, Any], attrs: dict[str, Any]) -> None:
        grp = self._file.create_group(step_group_name(step))
        index = np.zeros(len(rows), dtype=INDEX_DTYPE)
        for i, row in enumerate(rows):
            index[i] = tuple(row[name] for name in ROW_FIELDS or ())
        grp.create_dataset("index", data=index)
        dgrp = grp.create_group("data")
        for seq, array in data.items():
            if callable(array):  # a copy still on its way to the host (capturing/recorder.py Deferred)
                array = array()
            raw, _ = dtypes.to_storage(np.ascontiguousarray(array))
            if raw.nbytes >= CHUNK_MIN_BYTES and raw.ndim > 0:
                dgrp.create_dataset(str(seq), data=raw, chunks=True, compression="gzip", compression_opts=1, shuffle=True)
            else:
                dgrp.create_dataset(str(seq), data=raw)
        for key, value in attrs.items():
            grp.attrs[key] = attr_value(value)
        grp.attrs["records"] = len(rows)
        self._file.flush()
        grp.attrs["complete"] = 1
        self._file.flush()


def _cut(name: str) -> bytes:
    """A scalar's name as UTF-8 in at most SCALAR_NAME_LEN bytes, never cut inside a character."""
    return name.encode()[:SCALAR_NAME_LEN].decode("utf-8", "ignore").encode()
