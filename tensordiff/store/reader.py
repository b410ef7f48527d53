"""The capture reader: a streaming view of one capture file (one tensor in memory at a time).

Tensors stored with gzip + shuffle (or no filter) are read as raw chunks under h5py's lock and decoded outside it
(``codec``), so several threads reading records decompress on several cores; anything else is read by h5py."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import h5py
import numpy as np

from .. import _watchdog as watchdog
from .. import dtypes
from .._text import first_line
from ..errors import CaptureFileError
from ..record import Record
from . import codec, validate
from .base import CaptureReader, ReaderBase
from .format import FORMAT_ATTR, FORMAT_VERSION, META_GROUP, step_group_name
from .plan import FilePlan

#: What h5py and the codec raise on a damaged file (HDF5's own checks surface as any of these, anywhere).
_DAMAGED: tuple[type[BaseException], ...] = (OSError, RuntimeError, KeyError, ValueError, MemoryError, *codec.ERRORS)


@contextlib.contextmanager
def _reading(path: str, where: str) -> Iterator[None]:
    """Errors of HDF5 on a damaged file become one CaptureFileError naming the file and what was being read."""
    try:
        with watchdog.section(path, where):
            yield
    except _DAMAGED as err:
        raise validate.damaged(path, where, f"HDF5 cannot read it ({first_line(err, 160, default=type(err).__name__)})") \
            from None


def _open_h5(path: str) -> h5py.File:
    """``path`` opened for reading, or a CaptureFileError naming why not."""
    try:
        with watchdog.section(path, "the file's superblock"):
            return h5py.File(path, "r")
    except OSError as err:
        if "unable to lock file" in str(err):
            raise CaptureFileError(f"{path}: still open for writing (a capture in progress holds its lock); "
                                   "read it once that run has ended or closed the capture") from None
        if "already open for write" in str(err):
            raise CaptureFileError(f"{path}: written by a run that did not close it, with an older tensordiff "
                                   "(HDF5 consistency flag set); clear it with `h5clear -s FILE` and retry") from None
        if not os.path.exists(path):
            raise CaptureFileError(f"{path}: no such file (it was there when the command started); check the path") \
                from None
        reason = str(err).split("(")[0].strip().rstrip(":") or "unreadable"
        raise CaptureFileError(
            f"{path}: not a readable HDF5 file ({reason}); the file is truncated or of another kind, re-run the capture"
        ) from None


#: Tensors up to this size are read in one low-level call (``CaptureFile._small``).
SMALL_BYTES = 1 << 20


class CaptureFile(ReaderBase):
    """Read access to a capture file. Tensors are read one at a time (streaming)."""

    def __init__(self, path: str):
        super().__init__(path)
        if not os.path.exists(path):
            raise CaptureFileError(f"{path}: no such file; check the path (captures are written by `tensordiff capture -o FILE`)")
        if os.path.isdir(path):
            raise CaptureFileError(f"{path}: is a directory, not a capture file; pass the .h5 file written by `tensordiff "
                                   "capture`")
        self._h5: h5py.File | None = _open_h5(path)
        try:
            with _reading(path, "the file's attributes and steps"):
                self._open(path)
        except BaseException:
            self._h5.close()
            raise
        self._cache: dict[int, list[Record]] = {}
        self._groups: dict[int, Any] = {}  # each step's data group (_data_group)
        self._step_attrs: dict[int, dict[str, Any]] = {}

    @classmethod
    def unopened(cls, path: str, summary: dict[str, Any] | None = None) -> CaptureFile:
        """A reader of ``path`` whose attributes, steps, records and step attributes are ``summary`` (``summary()``
        of a reader of the same file, made in a worker process), or empty (a worker that only reads tensors): its
        HDF5 file is opened the first time something else is read, a tensor say. Opening and closing thousands of
        HDF5 files costs a few milliseconds each in one process (the library walks every open object), so a
        command reading many rank files has them opened by its workers."""
        self = cls.__new__(cls)
        ReaderBase.__init__(self, path)
        self._h5 = None
        summary = summary or {}
        self.attrs = dict(summary.get("attrs") or {})
        self.steps = list(summary.get("steps") or [])
        self.incomplete_steps = list(summary.get("incomplete_steps") or [])
        self._cache = dict(summary.get("records") or {})
        self._groups = {}
        self._step_attrs = dict(summary.get("step_attrs") or {})
        return self

    def summary(self) -> dict[str, Any]:
        """What ``unopened`` rebuilds a reader from: attributes, steps, every complete step's records and attributes."""
        return {"attrs": self.attrs, "steps": self.steps, "incomplete_steps": self.incomplete_steps,
                "records": {step: self.records(step) for step in self.steps},
                "step_attrs": {step: self.step_attrs(step) for step in self.steps}}

    @property
    def _file(self) -> h5py.File:
        if self._h5 is None:
            self._h5 = _open_h5(self.path)
        return self._h5

    def _open(self, path: str) -> None:
        if FORMAT_ATTR not in self._file.attrs:
            raise CaptureFileError(
                f"{path}: an HDF5 file but not a tensordiff capture (no '{FORMAT_ATTR}' attribute); write captures with "
                "`tensordiff capture` or tensordiff.capture()"
            )
        version = validate.format_version(path, self._file.attrs[FORMAT_ATTR])
        if version > FORMAT_VERSION:
            raise CaptureFileError(f"{path}: capture format {version} is newer than this tensordiff reads "
                                   f"({FORMAT_VERSION}); upgrade tensordiff")
        self.attrs = validate.file_attrs(path, self._file.attrs, self._file.get(META_GROUP))
        self.steps = []
        self.incomplete_steps = []
        steps = self._file.get("steps")
        if steps is not None and not isinstance(steps, h5py.Group):
            raise validate.damaged(path, "'/steps'", "expected the group of steps, found a dataset")
        for name in sorted(steps.keys() if steps is not None else ()):
            group = steps[name]  # type: ignore[index]
            step = validate.step_number(path, name, group)
            try:
                raw = group.attrs.get("complete", 0)
            except (KeyError, OSError):
                raw = 0
            (self.steps if validate.complete_flag(path, name, raw) else self.incomplete_steps).append(step)

    def close(self) -> None:
        if self._h5 is not None:
            self._h5.close()

    # reading ---------------------------------------------------------------
    def step_attrs(self, step: int) -> dict[str, Any]:
        known = self._step_attrs.get(step)
        if known is None:  # a file read is never written meanwhile (a capture in progress holds its lock)
            with _reading(self.path, f"step {step} attributes"):
                attrs = self._file[step_group_name(step)].attrs
                known = self._step_attrs[step] = {
                    k: (validate.text(self.path, f"step {step} attribute {k!r}", v) if isinstance(v, bytes) else v)
                    for k, v in attrs.items()}
        return dict(known)

    def scalars(self) -> dict[str, dict[int, float]]:
        """Per-step scalars of the run: name -> {step: value} (a later value of a step wins)."""
        out: dict[str, dict[int, float]] = {}
        with _reading(self.path, "'/scalars'"):
            rows = validate.scalars_table(self.path, self._file.get("scalars"))
        for row in rows if rows is not None else ():
            name = validate.text(self.path, "'/scalars' name", row["name"])
            out.setdefault(name, {})[int(row["step"])] = float(row["value"])
        return out

    def records(self, step: int) -> list[Record]:
        cached = self._cache.get(step)
        if cached is not None:
            return cached
        try:
            index = self._file[step_group_name(step)]["index"]
        except (KeyError, OSError) as err:
            raise CaptureFileError(f"{self.path}: step {step} is damaged ({err}); re-run the capture") from None
        with _reading(self.path, f"step {step} index"):
            rows = validate.index_rows(self.path, step, index)
            data = self._file[step_group_name(step)].get("data")
            stored = set(data.keys()) if isinstance(data, h5py.Group) else None
        out = validate.records(self.path, step, rows, stored)
        self._cache[step] = out
        return out

    def array(self, record: Record) -> np.ndarray | None:
        """The stored tensor of ``record`` in its own dtype, or None (statistics only)."""
        seq = record.seq
        if record.same_as >= 0:
            seq = record.same_as
        try:
            if not record.has_data:
                return None
            small = self._small(record, seq)  # most tensors of a rank file: one low-level read
            if small is not None:
                return dtypes.from_storage(small, record.dtype).reshape(record.shape)
            ds = self._data_group(record.step).get(str(seq))
            if ds is None:
                raise validate.damaged(self.path, f"step {record.step} tensor {record.label}", f"data/{seq} is missing")
            validate.check_data(self.path, record, ds)
            with watchdog.section(self.path, f"step {record.step} tensor {record.label}"):
                raw = read_dataset(ds)
        except _DAMAGED as err:
            raise CaptureFileError(f"{self.path}: tensor {record.label} of step {record.step} is damaged "
                                   f"({first_line(err, 160, default=type(err).__name__)}); re-run the capture") from None
        return dtypes.from_storage(np.asarray(raw), record.dtype).reshape(record.shape)

    def forget(self, step: int) -> None:
        self._cache.pop(step, None)

    def plan(self, record: Record) -> FilePlan:
        """How ``record``'s tensor is read, as plain data a worker process can follow (``plan.read_plan``)."""
        return FilePlan(self.path, record)

    def _small(self, record: Record, seq: int) -> np.ndarray | None:
        """A tensor of at most ``SMALL_BYTES`` read through h5py's low-level API (~4x less time than the dataset
        objects for a few kilobytes), or None to read it the usual way (larger, or anything unexpected: that path
        checks and names the damage)."""
        try:
            storage = dtypes.storage_dtype(record.dtype)
            if record.numel * storage.itemsize > SMALL_BYTES:
                return None
            dsid = h5py.h5d.open(self._data_group(record.step).id, str(seq).encode())
            space = dsid.get_space()
            if dsid.dtype != storage or space.get_simple_extent_npoints() != record.numel:
                return None
            out = np.empty(space.shape, storage)
            with watchdog.section(self.path, f"step {record.step} tensor {record.label}"):
                dsid.read(h5py.h5s.ALL, h5py.h5s.ALL, out)
            return out
        except (KeyError, ValueError, TypeError, OSError, RuntimeError):
            return None

    def nbytes(self) -> int:
        return os.path.getsize(self.path)

    def same_stored(self, record: Record, other: CaptureReader, other_record: Record) -> bool:
        """Whether ``record``'s tensor here and ``other_record``'s in ``other`` are stored as the same bytes: the same
        dtype, shape, chunks and filters, and every stored chunk byte for byte the same (compressed chunks are compared
        as they are, never decoded: a pair written by the same program twice compares at the speed of the disk).
        False when they differ or when it cannot tell cheaply (then the tensors are read and compared)."""
        if not (record.has_data and other_record.has_data and isinstance(other, CaptureFile)):
            return False
        try:
            ds_a = self._dataset(record)
            ds_b = other._dataset(other_record)
            if ds_a is None or ds_b is None or ds_a.dtype != ds_b.dtype or ds_a.shape != ds_b.shape:
                return False
            if ds_a.chunks is None or ds_a.chunks != ds_b.chunks:
                return ds_a.size * ds_a.dtype.itemsize <= (1 << 20) and \
                    np.asarray(ds_a[()]).tobytes() == np.asarray(ds_b[()]).tobytes()  # small contiguous data
            pa, pb = ds_a.id.get_create_plist(), ds_b.id.get_create_plist()
            if [pa.get_filter(i)[0] for i in range(pa.get_nfilters())] != \
                    [pb.get_filter(i)[0] for i in range(pb.get_nfilters())]:
                return False
            ida, idb = ds_a.id, ds_b.id
            for offset in codec.grid(ds_a.shape, ds_a.chunks):
                if ida.read_direct_chunk(offset) != idb.read_direct_chunk(offset):  # (filter mask, bytes)
                    return False
            return True
        except Exception:  # anything unusual (unwritten chunks, another layout): read and compare as usual
            return False

    def _dataset(self, record: Record) -> h5py.Dataset | None:
        return self._data_group(record.step).get(str(record.same_as if record.same_as >= 0 else record.seq))

    def _data_group(self, step: int) -> h5py.Group:
        """A step's data group, looked up once (h5py's lookups cost ~40 µs each)."""
        group = self._groups.get(step)
        if group is None:
            group = self._groups[step] = self._file[step_group_name(step)]["data"]
        return group


def read_dataset(ds: h5py.Dataset) -> np.ndarray:
    """The whole of ``ds``, as ``ds[()]`` reads it; chunks that the codec can decode are inflated without holding
    h5py's lock (only ``read_direct_chunk`` runs under it)."""
    positions = _decodable(ds)
    if positions is None:
        dtype = ds.dtype
        if ds.chunks is None and dtype.kind in "biuf" and ds.shape and ds.size:  # contiguous numbers: one plain read
            out = np.empty(ds.shape, dtype)
            ds.id.read(h5py.h5s.ALL, h5py.h5s.ALL, out)
            return out
        return np.asarray(ds[()])
    shape, chunks, dtype = ds.shape, ds.chunks, ds.dtype
    size = int(np.prod(chunks, dtype=np.int64)) * dtype.itemsize
    out = np.empty(shape, dtype)
    flat = out.reshape(-1).view(np.uint8)
    d = codec.slab_axis(shape, chunks)  # chunks that are runs of the array (this writer's) decode in place
    inner = int(np.prod(shape[d + 1:], dtype=np.int64)) * dtype.itemsize if d is not None else 0
    dsid = ds.id
    for offset in codec.grid(shape, chunks):
        try:
            mask, stored = dsid.read_direct_chunk(offset)
        except (OSError, ValueError, KeyError, RuntimeError):  # h5py says "not allocated" with a RuntimeError
            if _allocated(dsid, offset):
                raise
            return np.asarray(ds[()])  # a chunk never written: HDF5 knows its fill value
        if d is not None:
            start = int(np.ravel_multi_index(offset[:d + 1], shape[:d + 1])) * inner
            stop = start + (min(offset[d] + chunks[d], shape[d]) - offset[d]) * inner
            codec.decode(mask, stored, size, dtype.itemsize, positions, flat[start:stop])
            continue
        block = codec.decode(mask, stored, size, dtype.itemsize, positions).view(dtype).reshape(chunks)
        region = tuple(slice(o, min(o + c, s)) for o, c, s in zip(offset, chunks, shape))
        out[region] = block[tuple(slice(0, r.stop - r.start) for r in region)]  # an edge chunk is stored whole
    return out


def _decodable(ds: h5py.Dataset) -> tuple[int, int] | None:
    """The codec's ``(shuffle, deflate)`` positions for a chunked dataset of plain numbers whose filters it
    decodes, else None (h5py reads it)."""
    dtype = ds.dtype
    if ds.chunks is None or ds.size == 0 or dtype.kind not in "biuf" or not dtype.isnative or \
            dtype.itemsize not in (1, 2, 4, 8):
        return None
    plist = ds.id.get_create_plist()
    return codec.pipeline([plist.get_filter(i)[0] for i in range(plist.get_nfilters())])


def _allocated(dsid: Any, offset: tuple[int, ...]) -> bool:
    try:
        return dsid.get_chunk_info_by_coord(offset).byte_offset is not None
    except (OSError, ValueError, KeyError, RuntimeError):
        return False
