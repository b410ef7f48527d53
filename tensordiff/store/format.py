"""The capture file format: names, the scalar row type, and how values are stored (a record's index row:
``record.INDEX_DTYPE``).

See docs/format.md. Shared by the writer (capture side) and the reader (diff side)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import numpy as np

FORMAT_VERSION = 1
FORMAT_ATTR = "tensordiff_format"

SCALAR_NAME_LEN = 48
SCALAR_DTYPE = np.dtype([("step", "<i8"), ("name", f"S{SCALAR_NAME_LEN}"), ("value", "<f8")])

#: Tensors smaller than this are stored contiguous (chunking small data only costs space).
CHUNK_MIN_BYTES = 64 * 1024


def step_group_name(step: int) -> str:
    return f"steps/{step:06d}"



#: File attributes longer than this (bytes) are stored as datasets under ``META_GROUP`` (an HDF5 attribute holds at
#: most 64 KiB); the reader merges them back into ``attrs``.
LARGE_ATTR = 32000
META_GROUP = "meta"


def attr_value(value: Any) -> Any:
    """An HDF5-storable attribute: str/number as is, anything else as JSON."""
    if isinstance(value, str):
        return str(value)  # plain str: h5py rejects str subclasses such as torch's version string
    if isinstance(value, (bool, int, float, np.integer, np.floating)):
        return value
    return json.dumps(value, default=str)


def decode(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def shape_text(shape: Iterable[int]) -> str:
    """The index's shape column: '4,8' ('' for a scalar)."""
    return ",".join(map(str, map(int, shape)))

