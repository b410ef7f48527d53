"""Dtype names, lossless storage of narrow floats, and units in the last place.

Framework-neutral: the adapters hand over numpy arrays; BF16/FP8 arrive as
``ml_dtypes`` arrays and are stored as their raw bits, never upcast. ``ml_dtypes`` (a dependency
of tensordiff) is only needed to read those narrow floats back: without it the rest works and
reading a BF16/FP8 tensor raises one clear error.
"""

from __future__ import annotations

import numpy as np

from .errors import TensordiffError

try:
    import ml_dtypes
except ImportError:  # pragma: no cover - ml_dtypes is a dependency; a bare numpy environment still diffs FP32
    ml_dtypes = None

#: Logical dtype name -> numpy dtype (ml_dtypes for the narrow floats, when installed).
NUMPY_DTYPES: dict[str, np.dtype] = {
    "float64": np.dtype(np.float64),
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    **({"bfloat16": np.dtype(ml_dtypes.bfloat16), "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
        "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2)} if ml_dtypes is not None else {}),
    "int64": np.dtype(np.int64),
    "int32": np.dtype(np.int32),
    "int16": np.dtype(np.int16),
    "int8": np.dtype(np.int8),
    "uint8": np.dtype(np.uint8),
    "bool": np.dtype(np.bool_),
}

#: Narrow floats HDF5 has no type for: stored as unsigned ints of the same width.
_RAW_BITS: dict[str, np.dtype] = {
    "bfloat16": np.dtype(np.uint16),
    "float8_e4m3fn": np.dtype(np.uint8),
    "float8_e5m2": np.dtype(np.uint8),
}

#: Explicit fraction (mantissa) bits of each float format.
MANTISSA_BITS: dict[str, int] = {
    "float64": 52,
    "float32": 23,
    "float16": 10,
    "bfloat16": 7,
    "float8_e4m3fn": 3,
    "float8_e5m2": 2,
}

#: Smallest normal exponent (ulp below it stays constant: subnormals).
_MIN_EXP: dict[str, int] = {
    "float64": -1022,
    "float32": -126,
    "float16": -14,
    "bfloat16": -126,
    "float8_e4m3fn": -6,
    "float8_e5m2": -14,
}


def is_float(name: str) -> bool:
    return name in MANTISSA_BITS


def floats(x: np.ndarray | None) -> np.ndarray | None:
    """``x`` as numpy floats when it holds floating-point values in any format (BF16/FP8, which numpy calls kind
    'V', widened to float32: exact), else None. Every test of what a float tensor *means* (a mask, a RoPE table)
    reads it through this, so that it holds in every dtype users train in."""
    if x is None:
        return None
    if x.dtype.kind == "f":
        return x
    if x.dtype.kind == "V" and is_float(name_of(x.dtype)):
        return x.astype(np.float32)
    return None


def resolution(name: str) -> float:
    """The spacing of ``name``'s values just below 1 (half its unit in the last place at 1): the rounding error of a
    value of magnitude up to 1 stored in it, e.g. 2**-8 for BF16, 2**-24 for FP32; 0 for a non-float."""
    bits = MANTISSA_BITS.get(name)
    return 0.0 if bits is None else 2.0 ** -(bits + 1)


def name_of(dtype: np.dtype) -> str:
    """The logical name of a numpy (or ml_dtypes) dtype."""
    dtype = np.dtype(dtype)
    for name, dt in NUMPY_DTYPES.items():
        if dt == dtype:
            return name
    return str(dtype)


def to_storage(array: np.ndarray) -> tuple[np.ndarray, str]:
    """Return ``(array to write, logical dtype name)``; narrow floats become raw bits."""
    name = name_of(array.dtype)
    raw = _RAW_BITS.get(name)
    return (array.view(raw) if raw is not None else array), name


def from_storage(raw: np.ndarray, name: str) -> np.ndarray:
    """Inverse of :func:`to_storage`."""
    if name in _RAW_BITS:
        if name not in NUMPY_DTYPES:
            raise TensordiffError(f"reading {name} tensors needs the ml_dtypes package, which is not installed: "
                                  "pip install ml_dtypes")
        return raw.view(NUMPY_DTYPES[name])
    return raw


def storage_dtype(name: str) -> np.dtype:
    """The numpy dtype a tensor of logical dtype ``name`` is stored as (narrow floats: their raw bits)."""
    raw = _RAW_BITS.get(name)
    if raw is not None:
        return raw
    known = NUMPY_DTYPES.get(name)
    return known if known is not None else np.dtype(name)


def ulp(magnitude: np.ndarray, name: str) -> np.ndarray:
    """Unit in the last place of ``name`` at each ``|value|`` (float64 in, float64 out)."""
    bits = MANTISSA_BITS.get(name)
    if bits is None:
        return np.zeros_like(magnitude)
    _, exp = np.frexp(magnitude)  # magnitude = m * 2**exp, m in [0.5, 1); frexp(0) gives exp 0
    exp = np.where(magnitude == 0, _MIN_EXP[name], np.maximum(exp - 1, _MIN_EXP[name]))
    return np.ldexp(1.0, exp - bits)


def rounded(x: np.ndarray, name: str) -> np.ndarray:
    """``x`` (float64) rounded to the nearest value with ``name``'s mantissa bits, ties to even (the exponent range
    is not clamped): what storing it in that dtype keeps, computed without ml_dtypes."""
    bits = MANTISSA_BITS.get(name)
    if bits is None:
        return x
    m, e = np.frexp(np.asarray(x, dtype=np.float64))  # m in [0.5, 1): bits + 1 significant bits in all
    return np.ldexp(np.rint(np.ldexp(m, bits + 1)), e - bits - 1)


def coarsest(a: str, b: str) -> str:
    """The dtype with fewer mantissa bits (a BF16 vs FP32 pair is judged as BF16)."""
    if a not in MANTISSA_BITS:
        return b if b in MANTISSA_BITS else a
    if b not in MANTISSA_BITS:
        return a
    return a if MANTISSA_BITS[a] <= MANTISSA_BITS[b] else b
