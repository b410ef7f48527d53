"""The HDF5 capture file: a writer that works off the training thread and a streaming reader.

Layout (see docs/format.md)::

    /                    attrs: tensordiff_format=1, framework, versions, rank, ...
    /steps/000000        attrs: complete=1, loss, records, wall_time
        index            compound dataset, one row per record (metadata + float64 stats)
        data/<seq>       the tensor, in its own dtype (BF16 as raw uint16 bits), chunked+gzip
    /scalars             compound dataset (step, name, value): per-step scalars of the whole run
                         (loss, grad_norm, lr, val_loss, ...), appended and flushed as they come

A step is written whole and flushed, then marked ``complete``; readers ignore
incomplete steps, so a crash loses at most the step in flight.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import warnings
from typing import Any, Iterable

import h5py
import numpy as np

from . import dtypes
from .errors import CaptureFileError
from .record import Record

FORMAT_VERSION = 1
FORMAT_ATTR = "tensordiff_format"

_STR = h5py.string_dtype("utf-8")
INDEX_DTYPE = np.dtype(
    [
        ("seq", np.int64),
        ("phase", _STR),
        ("module", _STR),
        ("call", np.int32),
        ("kind", _STR),
        ("slot", _STR),
        ("module_class", _STR),
        ("dtype", _STR),
        ("shape", _STR),
        ("min", np.float64),
        ("max", np.float64),
        ("mean", np.float64),
        ("l2", np.float64),
        ("nan", np.int64),
        ("inf", np.int64),
        ("numel", np.int64),
        ("has_data", np.int8),
        ("same_as", np.int64),
        ("grad_of", np.int64),
        ("enter", np.int64),
        ("parent", _STR),
    ]
)
_ROW_FIELDS = INDEX_DTYPE.names
SCALAR_NAME_LEN = 48
SCALAR_DTYPE = np.dtype([("step", "<i8"), ("name", f"S{SCALAR_NAME_LEN}"), ("value", "<f8")])

#: Tensors smaller than this are stored contiguous (chunking small data only costs space).
_CHUNK_MIN_BYTES = 64 * 1024


def step_group_name(step: int) -> str:
    return f"steps/{step:06d}"


def _attr_value(value: Any) -> Any:
    if isinstance(value, str):
        return str(value)  # plain str: h5py rejects str subclasses such as torch's version string
    if isinstance(value, (bool, int, float, np.integer, np.floating)):
        return value
    return json.dumps(value, default=str)


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
            self._file.attrs[key] = _attr_value(value)
        self._file.create_group("steps")
        self._file.flush()
        self.error: BaseException | None = None
        self._closed = False
        self._scalars: h5py.Dataset | None = None
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._queue = queue.Queue(maxsize=max_pending)
            self._thread = threading.Thread(target=self._run, name="tensordiff-writer", daemon=True)
            self._thread.start()

    def submit(self, step: int, rows: list[dict[str, Any]], data: dict[int, np.ndarray], attrs: dict[str, Any]) -> None:
        if self.error is not None:
            return
        self._enqueue((step, rows, data, attrs))

    def submit_scalars(self, step: int, values: dict[str, float]) -> None:
        """Append per-step scalars (written and flushed off the training thread)."""
        if self.error is not None or self._closed:
            return
        self._enqueue(("scalars", step, values))

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
            if job is None:
                return
            self._write_guarded(job)

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
        rows = np.array([(step, name.encode()[:SCALAR_NAME_LEN], value) for name, value in values.items()],
                        dtype=SCALAR_DTYPE)
        ds.resize((n + len(rows),))
        ds[n:] = rows
        if self._queue is None or self._queue.empty():  # else the job behind it (a step: flushed) is on its way
            self._file.flush()

    def _write(self, step: int, rows: list[dict[str, Any]], data: dict[int, np.ndarray], attrs: dict[str, Any]) -> None:
        grp = self._file.create_group(step_group_name(step))
        index = np.zeros(len(rows), dtype=INDEX_DTYPE)
        for i, row in enumerate(rows):
            index[i] = tuple(row[name] for name in _ROW_FIELDS)
        grp.create_dataset("index", data=index)
        dgrp = grp.create_group("data")
        for seq, array in data.items():
            raw, _ = dtypes.to_storage(np.ascontiguousarray(array))
            if raw.nbytes >= _CHUNK_MIN_BYTES and raw.ndim > 0:
                dgrp.create_dataset(str(seq), data=raw, chunks=True, compression="gzip", compression_opts=1, shuffle=True)
            else:
                dgrp.create_dataset(str(seq), data=raw)
        for key, value in attrs.items():
            grp.attrs[key] = _attr_value(value)
        grp.attrs["records"] = len(rows)
        self._file.flush()
        grp.attrs["complete"] = 1
        self._file.flush()


def _decode(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


class Capture:
    """Read access to a capture file. Tensors are read one at a time (streaming)."""

    def __init__(self, path: str):
        self.path = path
        if not os.path.exists(path):
            raise CaptureFileError(f"{path}: no such file; check the path (captures are written by `tensordiff capture -o FILE`)")
        if os.path.isdir(path):
            raise CaptureFileError(f"{path}: is a directory, not a capture file; pass the .h5 file written by `tensordiff capture`")
        try:
            self._file = h5py.File(path, "r")
        except OSError as err:
            if "unable to lock file" in str(err):
                raise CaptureFileError(f"{path}: still open for writing (a capture in progress holds its lock); "
                                       "read it once that run has ended or closed the capture") from None
            if "already open for write" in str(err):
                raise CaptureFileError(f"{path}: written by a run that did not close it, with an older tensordiff "
                                       "(HDF5 consistency flag set); clear it with `h5clear -s FILE` and retry") from None
            reason = str(err).split("(")[0].strip().rstrip(":") or "unreadable"
            raise CaptureFileError(
                f"{path}: not a readable HDF5 file ({reason}); the file is truncated or of another kind, re-run the capture"
            ) from None
        if FORMAT_ATTR not in self._file.attrs:
            self._file.close()
            raise CaptureFileError(
                f"{path}: an HDF5 file but not a tensordiff capture (no '{FORMAT_ATTR}' attribute); write captures with `tensordiff capture` or tensordiff.capture()"
            )
        version = int(self._file.attrs[FORMAT_ATTR])
        if version > FORMAT_VERSION:
            self._file.close()
            raise CaptureFileError(
                f"{path}: capture format {version} is newer than this tensordiff reads ({FORMAT_VERSION}); upgrade tensordiff"
            )
        self.attrs: dict[str, Any] = {k: (_decode(v) if isinstance(v, (bytes, str)) else v) for k, v in self._file.attrs.items()}
        self.steps: list[int] = []
        self.incomplete_steps: list[int] = []
        steps = self._file.get("steps")
        if steps is not None:
            for name in sorted(steps.keys()):
                try:
                    complete = bool(steps[name].attrs.get("complete", 0))
                except (KeyError, OSError):
                    complete = False
                (self.steps if complete else self.incomplete_steps).append(int(name))
        self._cache: dict[int, list[Record]] = {}

    # context manager -------------------------------------------------------
    def __enter__(self) -> "Capture":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()

    # reading ---------------------------------------------------------------
    @property
    def framework(self) -> str:
        return str(self.attrs.get("framework", "?"))

    def step_attrs(self, step: int) -> dict[str, Any]:
        return {k: (_decode(v) if isinstance(v, bytes) else v) for k, v in self._file[step_group_name(step)].attrs.items()}

    def scalars(self) -> dict[str, dict[int, float]]:
        """Per-step scalars of the run: name -> {step: value} (a later value of a step wins)."""
        out: dict[str, dict[int, float]] = {}
        ds = self._file.get("scalars")
        if not isinstance(ds, h5py.Dataset) or ds.dtype.names is None or \
                not {"step", "name", "value"} <= set(ds.dtype.names):
            return out
        for row in ds[()]:
            out.setdefault(_decode(row["name"]), {})[int(row["step"])] = float(row["value"])
        return out

    def records(self, step: int) -> list[Record]:
        cached = self._cache.get(step)
        if cached is not None:
            return cached
        try:
            index = self._file[step_group_name(step)]["index"][()]
        except (KeyError, OSError) as err:
            raise CaptureFileError(f"{self.path}: step {step} is damaged ({err}); re-run the capture") from None
        out = []
        for row in index:
            shape_text = _decode(row["shape"])
            shape = tuple(int(s) for s in shape_text.split(",") if s) if shape_text else ()
            out.append(
                Record(
                    step=step,
                    seq=int(row["seq"]),
                    phase=_decode(row["phase"]),
                    module=_decode(row["module"]),
                    call=int(row["call"]),
                    kind=_decode(row["kind"]),
                    slot=_decode(row["slot"]),
                    module_class=_decode(row["module_class"]),
                    dtype=_decode(row["dtype"]),
                    shape=shape,
                    min=float(row["min"]),
                    max=float(row["max"]),
                    mean=float(row["mean"]),
                    l2=float(row["l2"]),
                    nan=int(row["nan"]),
                    inf=int(row["inf"]),
                    numel=int(row["numel"]),
                    has_data=bool(row["has_data"]),
                    same_as=int(row["same_as"]),
                    grad_of=int(row["grad_of"]),
                    enter=int(row["enter"]),
                    parent=_decode(row["parent"]),
                )
            )
        self._cache[step] = out
        return out

    def iter_records(self) -> Iterable[Record]:
        for step in self.steps:
            yield from self.records(step)

    def array(self, record: Record) -> np.ndarray | None:
        """The stored tensor of ``record`` in its own dtype, or None (statistics only)."""
        seq = record.seq
        if record.same_as >= 0:
            seq = record.same_as
        try:
            ds = self._file[step_group_name(record.step)]["data"].get(str(seq))
            if ds is None:
                return None
            raw = ds[()]
        except OSError as err:
            raise CaptureFileError(f"{self.path}: tensor {record.label} of step {record.step} is damaged ({err}); re-run the capture") from None
        return dtypes.from_storage(np.asarray(raw), record.dtype).reshape(record.shape)

    def nbytes(self) -> int:
        return os.path.getsize(self.path)


def shape_text(shape: Iterable[int]) -> str:
    return ",".join(str(int(s)) for s in shape)
