"""safetensors files as ``dict[str, np.ndarray]``: every dtype safetensors stores, BF16 and FP8 as ``ml_dtypes`` arrays
with their original bits (``safetensors.numpy`` cannot read those), names in natural order."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from .. import dtypes
from .._text import first_line
from ..errors import CheckpointError
from .plan import Checkpoint

#: safetensors dtype codes -> numpy (ml_dtypes for the narrow floats, which safetensors.numpy cannot read).
_ST_DTYPES: dict[str, Any] = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
    **{code: dtypes.NUMPY_DTYPES[name] for code, name in (("BF16", "bfloat16"), ("F8_E4M3", "float8_e4m3fn"),
                                                          ("F8_E5M2", "float8_e5m2")) if name in dtypes.NUMPY_DTYPES},
}


def load_safetensors(path: str) -> tuple[Checkpoint, dict[str, str]]:
    import safetensors

    try:
        with open(path, "rb") as fh:
            items = safetensors.deserialize(fh.read())
    except Exception as err:  # safetensors raises its own error types for a bad header
        raise CheckpointError(f"{path}: not a readable safetensors file ({first_line(err)}); is it truncated?") from None
    out: Checkpoint = {}
    for name, info in sorted(items, key=lambda item: _natural(item[0])):  # the file keeps no order of its own
        dtype = _ST_DTYPES.get(info["dtype"])
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {info['dtype']}, which tensordiff cannot read; "
                                  f"readable: {', '.join(_ST_DTYPES)}")
        out[name] = np.frombuffer(info["data"], dtype=dtype).reshape(info["shape"])
    return out, {}


def _natural(name: str) -> list:
    """'layers.10' after 'layers.9'."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def save_safetensors(tensors: Checkpoint, tmp: str) -> None:
    from safetensors.numpy import save_file

    save_file(tensors, tmp)
