"""The one rule for a record's statistics, and the host function every framework adapter uses (numpy only).

A record stores ``[min, max, sum, l2, nan, inf]`` of its tensor (the index keeps ``mean = sum / numel``):

* ``nan`` and ``inf`` count the NaN and the infinite elements, exactly;
* ``min``, ``max``, ``sum`` and ``l2`` are taken over the **finite** elements only (all 0 when there is none).

So two tensors with the same finite values and NaN/Inf in the same numbers write the same row, whichever framework
or device wrote it (torch on the CPU, torch on CUDA with or without Triton, MindSpore), and a NaN never hides the
rest of a tensor's statistics. Booleans and integers are counted as their float64 values; complex tensors as their
(real, imaginary) pairs (the adapters view them so before calling). Accumulation is float64, in chunks (no BLAS):
one compiled pass for float32 and float64 where ``_native`` is built, numpy's reductions otherwise.
"""

from __future__ import annotations

import ctypes
import math

import numpy as np

from . import _native

#: values per float64 chunk
CHUNK = 1 << 16
#: dtypes the compiled pass takes (the others: numpy's reductions below)
_NATIVE = {np.dtype(np.float32): "td_stats_f32", np.dtype(np.float64): "td_stats_f64"}

Row = tuple[float, float, float, float, float, float]


def host_stats(x: np.ndarray) -> Row:
    """``[min, max, sum, l2, nan, inf]`` of ``x`` by the rule above."""
    a = np.asarray(x).reshape(-1)
    if a.size == 0:
        return (0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    if a.dtype.kind == "c":
        a = a.view(a.real.dtype) if a.flags.c_contiguous else np.stack([a.real, a.imag], -1).reshape(-1)
    if a.dtype.kind in "biu":
        a = a.astype(np.float64)
    native = _native.lib()
    if native is not None and a.dtype in _NATIVE:  # one compiled pass (tensordiff._native), the same rule
        a = np.ascontiguousarray(a)
        out = (ctypes.c_double * 6)()
        getattr(native, _NATIVE[a.dtype])(a.ctypes.data, a.size, out)
        return (out[0], out[1], out[2], math.sqrt(out[3]), out[4], out[5])
    # fmin/fmax skip NaN without a warning (an errstate per call costs more than a small tensor's reduction): a NaN
    # shows in the float64 sum instead, and is counted then
    mn, mx = float(np.fmin.reduce(a)), float(np.fmax.reduce(a))
    nan = inf = 0.0
    if not (math.isfinite(mn) and math.isfinite(mx)):  # rare: count, then keep the finite values only
        bad_nan, bad_inf = np.isnan(a), np.isinf(a)
        nan, inf = float(np.count_nonzero(bad_nan)), float(np.count_nonzero(bad_inf))
        a = a[~(bad_nan | bad_inf)]
        if a.size == 0:
            return (0.0, 0.0, 0.0, 0.0, nan, inf)
        mn, mx = float(np.minimum.reduce(a)), float(np.maximum.reduce(a))
    total, squares = _sums(a)
    if math.isnan(total):  # NaN among finite values (min and max skipped them)
        bad_nan = np.isnan(a)
        nan = float(np.count_nonzero(bad_nan))
        total, squares = _sums(a[~bad_nan])
    return (mn, mx, total, math.sqrt(squares), nan, inf)


def _sums(a: np.ndarray) -> tuple[float, float]:
    """The float64 sum and sum of squares of ``a``, in chunks (no BLAS)."""
    n = a.size
    if n <= CHUNK:
        d = a.astype(np.float64)  # a copy of our own: squared in place
        return float(d.sum()), float(np.multiply(d, d, out=d).sum())
    buf = np.empty(CHUNK, dtype=np.float64)
    total = squares = 0.0
    for start in range(0, n, CHUNK):  # no numpy.dot: no BLAS threads next to the training run's own
        b = buf[: min(CHUNK, n - start)]
        b[...] = a[start:start + CHUNK]
        total += float(b.sum())
        squares += float(np.multiply(b, b, out=b).sum())
    return total, squares
