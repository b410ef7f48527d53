"""The capture writer: steps handed over by the recorder, written off the training thread.

A step is written whole and flushed, then marked ``complete``; readers ignore incomplete
steps, so a crash loses at most the step in flight. Per-step scalars are appended and
flushed as they come, on their own path: ``submit_scalars`` never waits behind a step being written.

Large tensors are cut into chunks that a thread pool shuffles and deflates (``codec``) while the writer thread
stores them with ``write_direct_chunk``: the same standard gzip + shuffle datasets as h5py writes, at the speed of
several cores. Steps wait in a queue bounded by the bytes of their full tensors; when it is full, ``policy``
says whether ``submit`` waits or drops the step's full tensors (its statistics are kept).
"""

from __future__ import annotations

import collections
import contextlib
import os
import resource
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import h5py
import numpy as np

from .. import _progress as progress
from .. import dtypes
from .._text import first_line
from .._warn import warn as _warn
from ..record import INDEX_DTYPE, ROW_FIELDS
from . import codec
from .format import (
    CHUNK_MIN_BYTES,
    FORMAT_ATTR,
    FORMAT_VERSION,
    LARGE_ATTR,
    META_GROUP,
    SCALAR_DTYPE,
    SCALAR_NAME_LEN,
    attr_value,
    step_group_name,
)
from .rows import StepRows, as_dicts, without_data

#: Environment variables that set the writer's options when the caller does not.
THREADS_ENV = "TENSORDIFF_WRITE_THREADS"
QUEUE_ENV = "TENSORDIFF_WRITE_QUEUE_GB"
POLICY_ENV = "TENSORDIFF_WRITE_POLICY"
COMPRESSION_ENV = "TENSORDIFF_WRITE_COMPRESSION"

DEFAULT_QUEUE_GB = 8.0
#: Kept free on the capture's filesystem beyond a step's size: a step that would leave less is not written.
GUARD_BYTES = 4 << 20
#: Held by a ``.reserve`` file next to the capture and given back when a write fails (or at close), so that HDF5 can
#: still write the metadata of the steps it has (a full disk inside HDF5's flush can crash the process).
RESERVE_BYTES = 8 << 20
POLICIES = ("wait", "drop")
Rows = list[dict[str, Any]] | StepRows  # a step's records, as dicts or packed
COMPRESSIONS = ("gzip", "none")


def default_threads() -> int:
    """min(8, the cores this process may run on): the pool that deflates chunks."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(8, cores))


class CaptureWriter:
    """Writes steps to one HDF5 file, on a background thread by default.

    ``submit`` hands a finished step over and returns at once, unless the full tensors of steps not yet written
    exceed ``queue_gb``: then ``policy='wait'`` blocks until they fit, and ``policy='drop'`` writes the step without
    its full tensors (``has_data`` 0, statistics kept, a warning the first time). A step is always taken when
    nothing else is pending (its tensors are in memory already): the limit bounds the steps queued behind it.
    Statistics-only steps never wait. ``threads`` deflate chunks in parallel; ``compression='none'`` stores them
    raw. Options left ``None`` come from ``TENSORDIFF_WRITE_THREADS`` / ``_QUEUE_GB`` / ``_POLICY`` /
    ``_COMPRESSION``, else the defaults (min(8, cores), 8 GB, 'wait', 'gzip'). ``max_pending`` additionally
    bounds the number of queued steps (None: no bound). Errors on the writer thread never reach the training
    loop: they are reported as a warning and later steps are dropped.
    """

    def __init__(self, path: str, attrs: dict[str, Any], background: bool = True, max_pending: int | None = None, *,
                 durable: bool = False,
                 threads: int | None = None, queue_gb: float | None = None, policy: str | None = None,
                 compression: str | None = None):
        self.path = path
        self.threads = threads if threads is not None else _env_number(THREADS_ENV, int, default_threads(), 1)
        gb = queue_gb if queue_gb is not None else _env_number(QUEUE_ENV, float, DEFAULT_QUEUE_GB, 0.0)
        self.queue_bytes = int(gb * 1e9)
        self.policy = policy if policy is not None else _env_choice(POLICY_ENV, POLICIES)
        self.compression = compression if compression is not None else _env_choice(COMPRESSION_ENV, COMPRESSIONS)
        if self.policy not in POLICIES or self.compression not in COMPRESSIONS or self.threads < 1:
            raise ValueError(f"CaptureWriter: policy must be one of {POLICIES}, compression one of {COMPRESSIONS} "
                             f"and threads >= 1 (got {self.policy!r}, {self.compression!r}, {self.threads})")
        self._file_closed = False
        self._open(attrs)
        self.error: BaseException | None = None
        self.dropped_steps: list[int] = []
        self._closed = False
        self._scalars: h5py.Dataset | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._background = background
        self._max_pending = max_pending
        self.durable = durable  # submit returns once its step is flushed (or capture stopped)
        self._submitted = 0  # steps handed over, and steps written or given up (the writer's thread)
        self._finished = 0
        # the queue: steps (with the bytes of their full tensors) and scalars, guarded by one condition that is
        # never held while writing, so submit_scalars takes it only for an append
        self._cv = threading.Condition()
        self._steps: collections.deque = collections.deque()
        self._scalar_jobs: collections.deque = collections.deque()
        self._pending_bytes = 0  # full tensors of the steps queued and of the one being written
        self._stop = False
        self._on_wait: Any = None  # called (tests) when submit starts waiting for room
        # a signal handler that needs the queue (SIGTERM: finish the file) must not run while the main thread holds
        # it (the writer's thread would wait for it forever): it waits until the main thread lets go (signals.py)
        self._main_holds = 0
        self._deferred: list[Any] = []
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, name="tensordiff-writer", daemon=True)
            self._thread.start()

    @contextlib.contextmanager
    def _holding(self) -> Any:
        """The queue's condition, held by a training thread; deferred signal handlers run once the main thread lets go."""
        main = threading.current_thread() is threading.main_thread()
        with self._cv:
            self._main_holds += main
            try:
                yield
            finally:
                self._main_holds -= main
        while main and self._deferred and not self._main_holds:
            self._deferred.pop(0)()

    def busy(self) -> bool:
        """Whether the main thread holds the queue now (a signal handler runs there: it must be deferred)."""
        return self._main_holds > 0

    def defer(self, handler: Any) -> None:
        """Run ``handler`` in the main thread as soon as it lets go of the queue."""
        self._deferred.append(handler)

    def prepare(self, rows: Rows) -> None:
        """What can be done for a step's rows before their statistics are in (the device may still be computing
        them): ``ProcessWriter`` encodes the text fields of packed rows."""

    def submit(self, step: int, rows: Rows, data: dict[int, Any], attrs: dict[str, Any]) -> None:
        """Hand a step over (its rows as dicts, or packed: ``rows.StepRows``); ``data`` maps a row to its array, or to
        a callable with ``nbytes`` giving it (resolved on the writer's thread, so a copy still on its way to the host
        never holds up training). A ``durable`` writer returns once the step is written (``ProcessWriter``: handed to
        its process)."""
        if self.error is not None or self._closed:
            return
        nbytes = sum(int(a.nbytes) for a in data.values())
        if self._thread is None:
            self._write_guarded((step, rows, data, attrs))
            return
        behind = 0
        with self._holding():
            rows, data, attrs, nbytes, behind = self._admit(step, rows, data, attrs, nbytes)
            if self.error is not None:
                return
            self._enqueue((step, rows, data, attrs, nbytes))
            ticket = self._submitted
            while self.durable and self.error is None and self._finished < ticket:
                self._cv.wait()  # the step is flushed when this returns: a SIGKILL after it cannot lose it
        self._said_dropped(step, behind)

    def _admit(self, step: int, rows: Rows, data: dict[int, Any], attrs: dict[str, Any],
               nbytes: int) -> tuple[Rows, dict[int, Any], dict[str, Any], int, int]:
        """Room in the queue for ``nbytes`` of full tensors (the caller holds the condition): the ``drop`` policy
        takes the tensors out of a step that does not fit (the bytes the writer is behind by, else 0), ``wait``
        waits."""
        behind = 0
        if nbytes and self.policy == "drop" and not self._room(nbytes):
            behind = self._pending_bytes
            rows, data, attrs = _without_tensors(rows, data, attrs)
            nbytes = 0
        while self.error is None and not (self._room(nbytes) and self._count_ok()):
            if self._on_wait is not None:
                self._on_wait()
            self._cv.wait()
        return rows, data, attrs, nbytes, behind

    def _enqueue(self, job: tuple) -> None:
        """A job for the writer's thread (the caller holds the condition): (step, rows, data, attrs, nbytes)."""
        self._steps.append(job)
        self._pending_bytes += job[4]
        self._submitted += 1
        self._cv.notify_all()

    def _said_dropped(self, step: int, behind: int) -> None:
        if behind:
            if not self.dropped_steps:
                _warn(f"tensordiff: writer behind by {behind / 1e9:.1f} GB; full tensors of step {step} dropped, "
                              "statistics kept")
            self.dropped_steps.append(step)

    def _open(self, attrs: dict[str, Any]) -> None:
        """Create the file with its attributes (``ProcessWriter``: start the process that does)."""
        parent = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(parent, exist_ok=True)
        # superblock v0 (low bound "earliest"): no "open for writing" flag, so a killed run's file opens as it is
        self._file = h5py.File(self.path, "w", libver=("earliest", "v110"))
        self._file.attrs[FORMAT_ATTR] = FORMAT_VERSION
        for key, value in attrs.items():
            value = attr_value(value)
            if isinstance(value, str) and len(value.encode("utf-8")) > LARGE_ATTR:  # HDF5 attributes hold 64 KiB
                self._file.require_group(META_GROUP).create_dataset(key, data=value.encode("utf-8"))
            else:
                self._file.attrs[key] = value
        self._file.create_group("steps")
        self._file.flush()
        self._reserve = self._make_reserve()

    def _make_reserve(self) -> str | None:
        path = f"{self.path}.reserve"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                try:
                    os.posix_fallocate(fd, 0, RESERVE_BYTES)
                except OSError:  # a small filesystem: a smaller reserve
                    os.posix_fallocate(fd, 0, RESERVE_BYTES // 8)
            finally:
                os.close(fd)
            return path
        except OSError:  # no room even for that (the guard stops the first step), or no fallocate here
            with contextlib.suppress(OSError):
                os.unlink(path)
            return None

    def _release_reserve(self) -> None:
        path, self._reserve = getattr(self, "_reserve", None), None
        if path:
            with contextlib.suppress(OSError):
                os.unlink(path)

    def _check_room(self, step: int, nbytes: int, nrows: int) -> None:
        """Refuse a step that would fill the filesystem or pass the file-size limit (``ulimit -f``) before HDF5 sees
        either (HDF5 can crash the process when its own flush hits a full disk)."""
        need = nbytes + 256 * nrows + (1 << 20)
        folder = os.path.dirname(os.path.abspath(self.path))
        st = os.statvfs(folder)
        free = st.f_bavail * st.f_frsize
        if free < need + GUARD_BYTES:
            raise StorageFull(f"{folder}: {free / 2**20:.0f} MiB free, step {step} needs ~{need / 2**20:.0f} MiB and "
                              f"{GUARD_BYTES >> 20} MiB stay free")
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY:
            size = os.path.getsize(self.path)
            if size + need + RESERVE_BYTES > limit:
                raise StorageFull(f"the file-size limit (ulimit -f, {limit / 2**20:.0f} MiB) would be passed by step "
                                  f"{step} (file {size / 2**20:.0f} MiB, step ~{need / 2**20:.0f} MiB)")

    def _close_file(self) -> None:
        self._release_reserve()  # room for the metadata written at close
        try:
            self._file.close()
        except Exception as err:  # pragma: no cover - closing a broken file
            _warn(f"tensordiff: closing {self.path} failed: {first_line(err, 200)}")

    def _room(self, nbytes: int) -> bool:
        """Room for a step with ``nbytes`` of full tensors (the caller holds the condition): always for statistics
        only, always when nothing else is pending, else within ``queue_bytes``."""
        return not nbytes or not self._pending_bytes or self._pending_bytes + nbytes <= self.queue_bytes

    def _count_ok(self) -> bool:
        return self._max_pending is None or len(self._steps) < self._max_pending

    def submit_scalars(self, step: int, values: dict[str, float]) -> None:
        """Append per-step scalars (written and flushed off the training thread). Never blocks: they wait in their
        own unbounded line (a few bytes each), which the writer empties between steps."""
        if self.error is not None or self._closed:
            return
        if self._thread is None:
            self._write_guarded(("scalars", step, values))
            return
        with self._holding():
            self._scalar_jobs.append(("scalars", step, values))
            self._cv.notify_all()

    def _drain(self, timeout: float | None) -> None:
        """Wait for the writer thread to write what is queued (``timeout`` seconds at most); a drain of a second or
        more shows the bytes left on a terminal (``_progress``)."""
        assert self._thread is not None
        total = self._pending_bytes
        if not total:
            self._thread.join(timeout)
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        with progress.task(f"tensordiff: writing {os.path.basename(self.path)}", total, "bytes") as shown:
            done = 0
            while self._thread.is_alive():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return
                self._thread.join(0.25 if left is None else min(0.25, left))
                now = max(0, total - self._pending_bytes)
                shown.advance(now - done)
                done = now

    def close(self, timeout: float | None = None) -> bool:
        """Write what was handed over, then close the file; ``timeout``: give up waiting after that many seconds
        (a signal ending the run: the file then keeps the steps completed so far). True when the file is closed.

        A Ctrl-C while it waits does not leave the file open: the close finishes (within 30 s), then the
        KeyboardInterrupt goes on."""
        self._closed = True
        if self._file_closed:
            return True
        interrupted: BaseException | None = None
        if self._thread is not None:
            with self._holding():
                self._stop = True
                self._cv.notify_all()
            try:
                self._drain(timeout)
            except KeyboardInterrupt as err:
                interrupted = err
                self._thread.join(30.0 if timeout is None else timeout)
            if self._thread.is_alive():  # still writing: closing the file under it would damage the step
                if interrupted is not None:
                    raise interrupted
                return False
            self._thread = None
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        self._close_file()
        self._file_closed = True
        if interrupted is not None:
            raise interrupted
        return True

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._steps or self._scalar_jobs or self._stop):
                    self._cv.wait()
                job = self._steps.popleft() if self._steps else None
                stop = self._stop and job is None
                self._cv.notify_all()  # a submit waiting for a place in the queue
            if job is not None:
                self._write_guarded(job[:4])
                with self._cv:
                    self._pending_bytes -= job[4]
                    self._finished += 1
                    self._cv.notify_all()
            while self._scalar_jobs:
                self._write_guarded(self._scalar_jobs.popleft())
            if stop:
                return

    def _write_guarded(self, job: tuple) -> None:
        if self.error is not None:
            return
        try:
            if job[0] == "scalars":
                self._write_scalars(job[1], job[2])
            else:
                self._write(*job)
        except (KeyboardInterrupt, SystemExit):
            # the program is being stopped (a Ctrl-C reached this thread while it wrote): as without tensordiff,
            # the interrupt goes on to the program; the step being written is left out (its group removed: it was
            # never marked complete), the steps before it stay, and the file closes when the capture does
            if job[0] != "scalars":
                with contextlib.suppress(Exception):
                    del self._file[step_group_name(job[0])]
            raise
        except BaseException as err:  # never let storage problems reach training
            self.error = err
            self._release_reserve()  # HDF5 may need room to write what it holds
            with self._cv:
                self._cv.notify_all()  # a submit waiting for room gives up
            what = "scalars" if job[0] == "scalars" else f"step {job[0]}"
            done = "" if job[0] == "scalars" else f"; the file keeps the steps written before step {job[0]}"
            _warn(f"tensordiff: writing {what} to {self.path} failed ({first_line(err, 300)}): capture "
                          f"stopped{done}; training goes on")

    def _write_scalars(self, step: int, values: dict[str, float]) -> None:
        self._check_room(step, 0, len(values))
        if self._scalars is None:
            self._scalars = self._file.create_dataset("scalars", shape=(0,), maxshape=(None,), dtype=SCALAR_DTYPE,
                                                      chunks=(1024,))
        ds = self._scalars
        n = ds.shape[0]
        rows = np.array([(step, _cut(name), value) for name, value in values.items()], dtype=SCALAR_DTYPE)
        ds.resize((n + len(rows),))
        ds[n:] = rows
        if self._thread is None or not (self._steps or self._scalar_jobs):  # else a flush follows soon
            self._file.flush()

    def _write(self, step: int, rows: Rows, data: dict[int, Any], attrs: dict[str, Any]) -> None:
        rows = as_dicts(rows)
        self._check_room(step, sum(int(a.nbytes) for a in data.values()), len(rows))
        grp = self._file.create_group(step_group_name(step))
        index = np.zeros(len(rows), dtype=INDEX_DTYPE)
        for i, row in enumerate(rows):
            index[i] = tuple(row[name] for name in ROW_FIELDS)
        grp.create_dataset("index", data=index)
        dgrp = grp.create_group("data")
        chunked: list[tuple[str, np.ndarray]] = []
        for seq, array in data.items():
            if callable(array):  # a copy still on its way to the host (capturing/recorder.py Deferred)
                array = array()
            raw, _ = dtypes.to_storage(np.ascontiguousarray(array))
            if raw.nbytes < CHUNK_MIN_BYTES or raw.ndim == 0:
                dgrp.create_dataset(str(seq), data=raw)
            elif self.compression == "none":
                dgrp.create_dataset(str(seq), data=raw, chunks=codec.chunk_shape(raw.shape, raw.itemsize))
            elif _direct(raw.dtype):
                chunked.append((str(seq), raw))
            else:  # a dtype the codec does not handle: HDF5 compresses it, on this thread
                dgrp.create_dataset(str(seq), data=raw, chunks=True, compression="gzip", compression_opts=1, shuffle=True)
        if chunked:
            self._write_chunked(dgrp, chunked)
        for key, value in attrs.items():
            grp.attrs[key] = attr_value(value)
        grp.attrs["records"] = len(rows)
        self._file.flush()
        grp.attrs["complete"] = 1
        self._file.flush()

    def _write_chunked(self, dgrp: h5py.Group, tensors: list[tuple[str, np.ndarray]]) -> None:
        """gzip + shuffle datasets whose chunks the pool encodes while this thread stores them, in order."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="tensordiff-deflate")

        def chunks() -> Iterator[tuple[Any, tuple[int, ...], np.ndarray, int, tuple[int, int]]]:
            for name, raw in tensors:  # runs on this thread, between results: h5py calls stay here
                shape = codec.chunk_shape(raw.shape, raw.itemsize)
                ds = dgrp.create_dataset(name, shape=raw.shape, dtype=raw.dtype, chunks=shape, compression="gzip",
                                         compression_opts=1, shuffle=True)
                positions = codec.pipeline(_filters(ds))
                assert positions is not None
                for offset, part in codec.contiguous_chunks(raw, shape):
                    yield ds.id, offset, part, raw.itemsize, positions

        def encode(item: tuple) -> tuple[Any, tuple[int, ...], int, Any]:
            dsid, offset, part, itemsize, positions = item
            mask, stored = codec.encode(part, itemsize, positions)
            return dsid, offset, mask, stored

        for dsid, offset, mask, stored in codec.parallel_map(encode, chunks(), self._pool.submit, 2 * self.threads + 2):
            dsid.write_direct_chunk(offset, stored, filter_mask=mask)


class StorageFull(OSError):
    """No room for the next step on the capture's filesystem (or under its file-size limit)."""


def _direct(dtype: np.dtype) -> bool:
    """Whether the codec writes this storage dtype's chunks (plain numbers in native byte order)."""
    return dtype.kind in "biuf" and dtype.isnative and dtype.itemsize in (1, 2, 4, 8)


def _filters(ds: h5py.Dataset) -> list[int]:
    plist = ds.id.get_create_plist()
    return [plist.get_filter(i)[0] for i in range(plist.get_nfilters())]


def _without_tensors(rows: Rows, data: dict[int, np.ndarray],
                     attrs: dict[str, Any]) -> tuple[Rows, dict[int, np.ndarray], dict[str, Any]]:
    """The step with its full tensors dropped: rows that held one (or linked to one) say ``has_data`` 0."""
    return without_data(rows, data), {}, {**attrs, "tensors_dropped": len(data)}


def _env_number(name: str, kind: type, default: Any, low: float) -> Any:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = kind(text)
        if value < low:
            raise ValueError
        return value
    except ValueError:
        what = "an integer" if kind is int else "a number"
        _warn(f"tensordiff: {name}={text!r} is not {what} >= {low:g}; using {default}")
        return default


def _env_choice(name: str, choices: tuple[str, ...]) -> str:
    text = os.environ.get(name, "").strip().lower()
    if not text:
        return choices[0]
    if text not in choices:
        _warn(f"tensordiff: {name}={text!r} is not one of {', '.join(choices)}; using {choices[0]}")
        return choices[0]
    return text


def _cut(name: str) -> bytes:
    """A scalar's name as UTF-8 in at most SCALAR_NAME_LEN bytes, never cut inside a character."""
    return name.encode()[:SCALAR_NAME_LEN].decode("utf-8", "ignore").encode()
