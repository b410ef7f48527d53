"""HDF5's shuffle + deflate filters done in Python, per chunk, off HDF5's lock.

h5py runs every HDF5 call under one process-wide lock, and HDF5 compresses inside that call, so a writer or a
reader spends one core on gzip however many threads it has. The functions here do the same byte shuffle and the
same zlib stream as HDF5's ``shuffle`` and ``deflate`` filters, on numpy arrays, in threads that hold no lock
(numpy's copies and the deflate libraries release the GIL); the writer then stores the bytes with
``write_direct_chunk`` and the reader fetches them with ``read_direct_chunk``. The file stays standard HDF5:
the dataset declares both filters and any HDF5 reader decodes it without plugins.

Deflate is ISA-L's (``isal``, several times faster than zlib at the same ratio) when installed, else zlib's.
"""

from __future__ import annotations

import importlib
import struct
import threading
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .. import _native

_isal: Any
try:
    _isal = importlib.import_module("isal.isal_zlib")
except ImportError:  # isal is optional: zlib writes the same format, slower
    _isal = None

#: HDF5's filter ids (H5Z_FILTER_DEFLATE, H5Z_FILTER_SHUFFLE).
FILTER_DEFLATE = 1
FILTER_SHUFFLE = 2

#: The chunk size (uncompressed) the writer aims at: large enough that HDF5's and Python's per-chunk cost vanish,
#: small enough that one tensor gives several threads work and a chunk's planes stay in cache while they are
#: unshuffled. 1, 2 and 4 MiB cost the same CPU per GB within noise (benchmarks/store_io.py); 8 MiB more.
CHUNK_BYTES = 2 * 2**20

#: A chunk whose deflate saves less than this fraction is stored raw (filter mask set): reading it costs a copy.
MIN_SAVING = 1 / 16

_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}

#: What decoding a damaged chunk raises.
ERRORS: tuple[type[BaseException], ...] = (zlib.error, ValueError) + ((_isal.error,) if _isal is not None else ())


def implementation() -> str:
    """The deflate library in use: 'isal' or 'zlib'."""
    return _impl


_impl = "isal" if _isal is not None else "zlib"


def set_implementation(name: str) -> None:
    """Choose the deflate library ('isal' or 'zlib'; the benchmark compares them). Both write the same format."""
    global _impl
    if name not in ("isal", "zlib") or (name == "isal" and _isal is None):
        raise ValueError(f"deflate implementation {name!r} is not available (have: {available()})")
    _impl = name


def available() -> list[str]:
    return ["isal", "zlib"] if _isal is not None else ["zlib"]


def deflate(data: Any, level: int = 1, raw: bool = False) -> bytes:
    """A zlib stream (what HDF5's deflate filter writes) of ``data``; ``raw``: the bare deflate blocks."""
    wbits = -15 if raw else 15
    if _impl == "isal" and _isal is not None:
        return _isal.compress(data, level, wbits)
    if not raw:
        return zlib.compress(data, level)
    packer = zlib.compressobj(level, zlib.DEFLATED, wbits)  # zlib.compress takes wbits from Python 3.11 on
    return packer.compress(data) + packer.flush()


def adler32(data: Any) -> int:
    return int(_isal.adler32(data) if _isal is not None else zlib.adler32(data))


def deflate_planes(data: np.ndarray, stored: int, level: int = 1) -> bytes:
    """A zlib stream of ``data`` whose first ``stored`` bytes are deflate's *stored* blocks (copied, not
    compressed) and the rest compressed: the shuffled mantissa bytes of floats are noise that deflate cannot
    shrink, and stored blocks are copied by inflate at memory speed (reading such a chunk takes half the time) and
    cost the writer nothing to find matches in. Any zlib inflater reads it (RFC 1950 and 1951: a stored block is a
    header byte, LEN and its complement, then LEN bytes, byte-aligned)."""
    view = memoryview(data.data)
    parts: list[Any] = [b"\x78\x01"]  # zlib header: deflate, 32 KiB window, check bits
    for i in range(0, stored, 65535):
        n = min(65535, stored - i)
        parts.append(struct.pack("<BHH", 0, n, n ^ 0xFFFF))  # BFINAL 0, BTYPE 00 (stored)
        parts.append(view[i:i + n])
    parts.append(deflate(view[stored:], level, raw=True))  # ends with its final block
    parts.append(struct.pack(">I", adler32(view)))
    return b"".join(parts)


def noise_planes(data: np.ndarray, planes: int, probe: int = 8192) -> int:
    """How many leading byte planes of a shuffled chunk deflate would not shrink (by 2%), judged on three
    samples of each (start, middle, end)."""
    rows = data.reshape(planes, -1)
    n = rows.shape[1]
    for k in range(planes):
        row = rows[k]
        sample = row if n <= 3 * probe else np.concatenate([row[:probe], row[n // 2: n // 2 + probe], row[-probe:]])
        if len(deflate(sample, 1, raw=True)) < 0.98 * sample.size:
            return k
    return planes


def inflate(data: Any, size: int) -> bytes:
    """The bytes of a zlib stream, ``size`` of them expected."""
    if _isal is not None:  # ISA-L also inflates faster, whoever wrote the stream
        return _isal.decompress(data, bufsize=max(size, 1))
    return zlib.decompress(data, bufsize=max(size, 1))


_local = threading.local()


def _scratch(slot: str, nbytes: int) -> np.ndarray:
    """A per-thread buffer of at least ``nbytes`` (uint8), reused from chunk to chunk: a fresh multi-MiB array
    per chunk costs its page faults every time."""
    buf = getattr(_local, slot, None)
    if buf is None or buf.size < nbytes:
        buf = np.empty(max(nbytes, 1), np.uint8)
        setattr(_local, slot, buf)
    return buf[:nbytes]


def shuffle(raw: np.ndarray, itemsize: int) -> np.ndarray:
    """HDF5's shuffle of a contiguous chunk: byte 0 of every element, then byte 1, ... (uint8, flat).

    Shifts of the elements as unsigned ints (~3x numpy's transposed copy, and GIL-free). The result lives in a
    per-thread buffer that the next call on this thread overwrites."""
    flat = raw.reshape(-1).view(np.uint8)
    n = flat.size // itemsize
    if itemsize == 1 or n <= 1:
        return flat
    out = _scratch("shuffled", flat.size).reshape(itemsize, n)
    native = _native.lib()
    if native is not None and flat.flags.c_contiguous and n * itemsize == flat.size:
        native.td_shuffle(flat.ctypes.data, n, itemsize, out.ctypes.data)  # one pass, GIL released
        return out.reshape(-1)
    uint = _UINT.get(itemsize)
    if uint is None:
        out[...] = flat.reshape(n, itemsize).T
        return out.reshape(-1)
    words = flat.view(uint)
    tmp = _scratch("words", flat.size).view(uint)
    for j in range(itemsize):
        np.right_shift(words, 8 * j, out=tmp)
        np.copyto(out[j], tmp, casting="unsafe")  # the low byte of each
    return out.reshape(-1)


def unshuffle(data: np.ndarray, itemsize: int, out: np.ndarray | None = None) -> np.ndarray:
    """The inverse of ``shuffle`` (uint8, flat), into ``out`` when given: its first ``out.size // itemsize``
    elements (an edge chunk's valid part). Widen, shift and OR the byte planes (2x numpy's strided copy)."""
    n = data.size // itemsize
    if out is None:
        out = np.empty(data.size, np.uint8)
    if itemsize == 1 or n <= 1:
        out[...] = data[:out.size]
        return out
    planes = data.reshape(itemsize, n)
    m = out.size // itemsize
    native = _native.lib()
    if native is not None and data.flags.c_contiguous and out.flags.c_contiguous:
        native.td_unshuffle(data.ctypes.data, n, itemsize, m, out.ctypes.data)  # one pass, GIL released
        return out
    uint = _UINT.get(itemsize)
    if uint is None:
        lanes = out.reshape(-1, itemsize)
        for j in range(itemsize):
            lanes[:, j] = planes[j, :m]
        return out
    words = out.view(uint)
    tmp = _scratch("words", m * itemsize).view(uint)
    np.copyto(words, planes[0, :m])
    for j in range(1, itemsize):
        np.copyto(tmp, planes[j, :m])
        tmp <<= 8 * j
        words |= tmp
    return out


# ---------------------------------------------------------------------------------------------- chunks
def chunk_shape(shape: tuple[int, ...], itemsize: int, target: int | None = None) -> tuple[int, ...]:
    """Chunks that are contiguous runs of the C-ordered array: ``(1, .., 1, k, full, .., full)`` of about
    ``target`` bytes (``CHUNK_BYTES``), so a chunk is a slice of the flat array (no gather on write, one copy on
    read)."""
    target = target or CHUNK_BYTES
    inner = itemsize
    for d in range(len(shape) - 1, -1, -1):
        if inner * shape[d] > target or d == 0:
            k = max(1, min(shape[d], target // inner))
            return (1,) * d + (k,) + tuple(shape[d + 1:])
        inner *= shape[d]
    return ()  # pragma: no cover - 0-d arrays are never chunked


def grid(shape: tuple[int, ...], chunks: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    """The offsets of every chunk, in C order."""
    counts = [-(-s // c) for s, c in zip(shape, chunks)]
    for index in np.ndindex(*counts):
        yield tuple(i * c for i, c in zip(index, chunks))


def slab_axis(shape: tuple[int, ...], chunks: tuple[int, ...]) -> int | None:
    """The axis ``d`` if every chunk is a contiguous run of the C-ordered array (``chunks[:d]`` all 1,
    ``chunks[d + 1:]`` whole), else None."""
    for d in range(len(chunks)):
        if tuple(chunks[d + 1:]) == tuple(shape[d + 1:]):
            return d if all(c == 1 for c in chunks[:d]) else None
    return None


def contiguous_chunks(array: np.ndarray, chunks: tuple[int, ...]) -> Iterator[tuple[tuple[int, ...], np.ndarray]]:
    """``(offset, flat bytes of one full chunk)`` of a C-contiguous array chunked by ``chunk_shape``; an edge chunk
    is padded with zeros to the full chunk size, as HDF5 stores edge chunks."""
    flat = array.reshape(-1).view(np.uint8)
    itemsize = array.dtype.itemsize
    d = slab_axis(array.shape, chunks)
    if d is None:
        raise ValueError(f"chunks {chunks} are not contiguous runs of an array of shape {array.shape}")
    inner = int(np.prod(array.shape[d + 1:], dtype=np.int64)) * itemsize  # bytes of one index along axis d
    full = chunks[d] * inner
    rows = array.shape[d]
    for outer in np.ndindex(*array.shape[:d]):
        base = int(np.ravel_multi_index(outer, array.shape[:d])) * rows * inner if d else 0
        for r in range(0, rows, chunks[d]):
            part = flat[base + r * inner: base + min(rows, r + chunks[d]) * inner]
            if part.size < full:
                padded = np.zeros(full, np.uint8)
                padded[:part.size] = part
                part = padded
            yield (*outer, r) + (0,) * (len(chunks) - d - 1), part


def pipeline(filters: list[int]) -> tuple[int, int] | None:
    """``(shuffle position, deflate position)`` (-1 where absent) of a filter pipeline this module can decode
    itself: none, shuffle, deflate, or shuffle then deflate; None for anything else."""
    if filters not in ([], [FILTER_SHUFFLE], [FILTER_DEFLATE], [FILTER_SHUFFLE, FILTER_DEFLATE]):
        return None
    return (filters.index(FILTER_SHUFFLE) if FILTER_SHUFFLE in filters else -1,
            filters.index(FILTER_DEFLATE) if FILTER_DEFLATE in filters else -1)


def encode(part: np.ndarray, itemsize: int, positions: tuple[int, int], level: int = 1) -> tuple[int, Any]:
    """``(filter mask, stored bytes)`` of one full chunk (flat uint8) through the pipeline at ``positions``.

    Shuffled byte planes that are noise go into the stream uncompressed (``deflate_planes``); a chunk that
    deflate does not shrink by ``MIN_SAVING`` is stored as it is, both filters skipped."""
    shuf, defl = positions
    data = shuffle(part, itemsize) if shuf >= 0 else part
    if defl < 0:
        return 0, data.copy()
    planes = itemsize if shuf >= 0 else 1
    noise = noise_planes(data, planes)
    if noise < planes:
        packed = deflate_planes(data, noise * (data.size // planes), level) if noise else deflate(data, level)
        if len(packed) <= part.size * (1 - MIN_SAVING):
            return 0, packed
    skip = 1 << defl
    if shuf >= 0:
        skip |= 1 << shuf
    return skip, part


def decode(mask: int, stored: Any, size: int, itemsize: int, positions: tuple[int, int],
           out: np.ndarray | None = None) -> np.ndarray:
    """The bytes (flat uint8) of one chunk of ``size`` bytes from what ``read_direct_chunk`` returned; into ``out``
    (its first ``out.size`` bytes: the valid part of an edge chunk) when given."""
    shuf, defl = positions
    data: Any = stored
    if defl >= 0 and not mask >> defl & 1:
        data = inflate(data, size)
    flat = np.frombuffer(data, np.uint8)
    if flat.size != size:
        raise ValueError(f"a chunk holds {flat.size} bytes, {size} expected")
    if shuf >= 0 and not mask >> shuf & 1:
        return unshuffle(flat, itemsize, out)
    if out is None:
        return flat
    out[...] = flat[:out.size]
    return out


def parallel_map(fn: Callable[[Any], Any], items: Iterator[Any], submit: Callable[..., Any], window: int) -> Iterator[Any]:
    """``fn(item)`` for each item, in order, at most ``window`` in flight on ``submit`` (an executor's)."""
    pending: list[Any] = []
    head = 0
    for item in items:
        pending.append(submit(fn, item))
        if len(pending) - head >= window:
            yield pending[head].result()
            pending[head] = None
            head += 1
    for fut in pending[head:]:
        yield fut.result()
