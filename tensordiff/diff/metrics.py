"""Pairwise metrics of two tensors, computed in chunks (memory bounded by the pair); ``rel_l2`` for small arrays.

Tensors of float32 or narrower are compared in float32 with float64 sums (``CHUNK32`` elements at a time in a few
buffers allocated once per pair); float64 and integer tensors, and pairs holding NaN/Inf, in float64 chunks. No
BLAS call anywhere (``np.dot``, ``np.linalg.norm`` would start OpenBLAS's threads, which spin beside the diff's own
workers): sums are numpy reductions, which release the GIL, so pairs compare in parallel threads."""

from __future__ import annotations

import ctypes
import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .. import _native, dtypes
from ..record import Record

#: Elements per chunk: 4 Mi float64 values = 32 MiB per temporary.
CHUNK = 1 << 22
#: Elements per float32 chunk: 64 Ki values = 256 KiB per buffer (the few buffers stay in the cache).
CHUNK32 = 1 << 16
_NARROW = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")


@dataclass(frozen=True, slots=True)
class Metrics:
    """How far B is from A. ``rel_l2`` is the one the verdict uses."""

    rel_l2: float
    """||a - b|| / max(||a||, ||b||); 0 when both are zero; inf when NaN/Inf do not match."""
    max_abs: float
    """max |a - b|."""
    max_rel: float
    """max |a - b| / |a|, with |a| floored at 1e-3 of a's RMS (no blow-up near zero)."""
    cosine: float
    """cosine similarity of a and b (1.0 when both are zero)."""
    ulp_share: float
    """share of elements within ``ulp_k`` units in the last place of the judged dtype."""
    nonfinite_mismatch: int
    """elements where NaN/Inf appear on one side only (or with another sign)."""
    source: str
    """'tensor' (elementwise) or 'stats' (only statistics were stored)."""

    def as_dict(self) -> dict:
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}


def compare_arrays(a: np.ndarray, b: np.ndarray, judged_dtype: str, ulp_k: int = 4) -> Metrics:
    """Elementwise comparison of two same-shaped arrays (any dtype): float32 work for float32 and narrower
    tensors judged in such a dtype, float64 otherwise (see the module docstring). Complex tensors are compared as
    their (real, imaginary) pairs: the imaginary parts count as much as the real ones."""
    if a.dtype.kind == "c" or b.dtype.kind == "c":
        a, b = _pairs(a), _pairs(b)
        judged_dtype = "float32" if judged_dtype == "complex64" else "float64" if judged_dtype == "complex128" \
            else judged_dtype
    if (dtypes.name_of(a.dtype) in _NARROW and dtypes.name_of(b.dtype) in _NARROW and judged_dtype in _NARROW
            and judged_dtype in dtypes.MANTISSA_BITS):
        with np.errstate(over="ignore", invalid="ignore"):  # an overflowing float32 sum hands over to float64
            fast = _compare_f32(a, b, judged_dtype, ulp_k)
        if fast is not None:
            return fast
    return _compare_f64(a, b, judged_dtype, ulp_k)


def _pairs(x: np.ndarray) -> np.ndarray:
    """A complex array as real numbers, each element's (real, imaginary) in turn; a real array with zero imaginary
    parts."""
    if x.dtype.kind != "c":
        x = x.astype(np.complex128 if x.dtype == np.float64 else np.complex64)
    return np.ascontiguousarray(x).view(x.real.dtype)


class _Buffers:
    """The float32 path's chunk buffers, allocated once per pair: a few ``CHUNK32``-element arrays, reused by every
    chunk (no per-chunk temporaries)."""

    def __init__(self, n: int, widen_a: bool, widen_b: bool):
        size = min(n, CHUNK32)
        self.size = size
        self.d = np.empty(size, np.float32)  # |a - b|
        self.t = np.empty(size, np.float32)  # scratch: squares, |a| floored, the ratios
        self.e = np.empty(size, np.uint32)  # exponent fields, then the ULP threshold (as float32)
        self.e2 = np.empty(size, np.uint32)
        self.ok = np.empty(size, np.bool_)
        self.a = np.empty(size, np.float32) if widen_a else None  # narrow inputs widened to float32
        self.b = np.empty(size, np.float32) if widen_b else None
        self.floor = self.ulp_floor = self.d  # set by ``floors``

    def floors(self, floor: float, ulp_floor: float) -> None:
        """Constant arrays: numpy's binary loops vectorise array-array, not array-scalar (3-4x faster here)."""
        self.floor = np.full(self.size, np.float32(floor))
        self.ulp_floor = np.full(self.size, np.float32(ulp_floor))


def _f32(x: np.ndarray, start: int, stop: int, buf: np.ndarray | None) -> np.ndarray:
    """Elements ``start:stop`` of flat ``x`` as float32: a view of a float32 array, else widened into ``buf``."""
    part = x[start:stop]
    if buf is None:
        return part
    out = buf[:part.size]
    np.copyto(out, part, casting="unsafe")  # exact: every narrow float is a float32
    return out


def _sum_sq(x: np.ndarray, scratch: np.ndarray) -> float:
    """sum(x**2) of a float32 chunk: squares in float32 (exact to 2**-24 each), summed in float64 (no BLAS)."""
    np.multiply(x, x, out=scratch)
    return float(np.add.reduce(scratch, dtype=np.float64))


_EXPONENT = np.uint32(0x7F800000)


def _compare_f32(a: np.ndarray, b: np.ndarray, judged: str, ulp_k: int) -> Metrics | None:
    """The float32 path; None where a sum overflows or NaN/Inf appear (the float64 path then handles the pair).

    Per element: one pass over A for ||a|| (max_rel's floor needs it before the rest), then |a - b|, its square,
    b's square, the ULP threshold from the exponent bits of |a| and |b|, and the floored ratio, all in a few
    preallocated float32 buffers; sums are float64. The cosine comes from the norms and ||a - b||
    (1 - cos = (||a - b||^2 - (||a|| - ||b||)^2) / (2 ||a|| ||b||), which also keeps 1 - cos exact near 1);
    a dot product is summed only when the norms are more than 2x apart, where that identity cancels."""
    fa, fb = a.reshape(-1), b.reshape(-1)
    n = fa.size
    if n == 0:
        return None
    native = _native.lib()
    if native is not None and dtypes.name_of(fa.dtype) in _native.DTYPE_CODES \
            and dtypes.name_of(fb.dtype) in _native.DTYPE_CODES:
        return _compare_native(native, np.ascontiguousarray(fa), np.ascontiguousarray(fb), judged, ulp_k)
    buf = _Buffers(n, fa.dtype != np.float32, fb.dtype != np.float32)
    a_sq = 0.0
    for start in range(0, n, CHUNK32):  # pass 1: ||a||, for max_rel's floor
        xa = _f32(fa, start, start + CHUNK32, buf.a)
        a_sq += _sum_sq(xa, buf.t[:xa.size])
    if not math.isfinite(a_sq):
        return None
    norm_a = math.sqrt(a_sq)
    bits = dtypes.MANTISSA_BITS[judged]
    scale = np.float32(ulp_k * 2.0 ** -bits)  # k ulps of a float32 power of two 2**e: 2**e * k * 2**-bits, exact
    # max_rel's floor of |a| (1e-3 of a's RMS), and k subnormal steps of the judged dtype (the smallest ulp)
    buf.floors(max(1e-3 * norm_a / math.sqrt(n), 1e-30), ulp_k * 2.0 ** (dtypes._MIN_EXP[judged] - bits))
    diff_sq = b_sq = 0.0
    max_abs = max_rel = 0.0
    within = 0
    for start in range(0, n, CHUNK32):
        xa = _f32(fa, start, start + CHUNK32, buf.a)
        xb = _f32(fb, start, start + CHUNK32, buf.b)
        m = xa.size
        d, t, e, e2, ok = buf.d[:m], buf.t[:m], buf.e[:m], buf.e2[:m], buf.ok[:m]
        np.subtract(xa, xb, out=d)
        sums = (_sum_sq(d, t), _sum_sq(xb, t))
        if not (math.isfinite(sums[0]) and math.isfinite(sums[1])):
            return None  # NaN/Inf (or float32 overflow) in this chunk
        diff_sq, b_sq = diff_sq + sums[0], b_sq + sums[1]
        np.abs(d, out=d)
        max_abs = max(max_abs, float(np.maximum.reduce(d)))
        # ULPs: the judged dtype's ulp at max(|a|, |b|) is 2**e * 2**-bits, 2**e read off the larger exponent field
        np.bitwise_and(xa.view(np.uint32), _EXPONENT, out=e)
        np.bitwise_and(xb.view(np.uint32), _EXPONENT, out=e2)
        np.maximum(e, e2, out=e)
        limit = e.view(np.float32)
        np.multiply(limit, scale, out=limit)
        np.maximum(limit, buf.ulp_floor[:m], out=limit)
        np.less_equal(d, limit, out=ok)
        within += int(np.count_nonzero(ok))
        np.abs(xa, out=t)
        np.maximum(t, buf.floor[:m], out=t)
        np.divide(d, t, out=t)
        max_rel = max(max_rel, float(np.maximum.reduce(t)))
    return _f32_metrics(n, norm_a, diff_sq, b_sq, lambda: _dot(fa, fb, buf), max_abs, max_rel, within)


def _f32_metrics(n: int, norm_a: float, diff_sq: float, b_sq: float, dot: Any, max_abs: float, max_rel: float,
                 within: int) -> Metrics:
    """The float32 paths' sums as ``Metrics`` (``dot``: a callable, summed only where the cosine needs it)."""
    norm_b = math.sqrt(b_sq)
    denom = max(norm_a, norm_b)
    rel = math.sqrt(diff_sq) / denom if denom > 0 else (0.0 if diff_sq == 0 else math.inf)
    if norm_a > 0 and norm_b > 0:
        if min(norm_a, norm_b) >= 0.5 * denom:
            cosine = 1.0 - (diff_sq - (norm_a - norm_b) ** 2) / (2.0 * norm_a * norm_b)
        else:
            cosine = dot() / (norm_a * norm_b)
        cosine = min(1.0, max(-1.0, cosine))
    else:
        cosine = 1.0 if norm_a == norm_b else 0.0
    return Metrics(rel_l2=rel, max_abs=max_abs, max_rel=max_rel, cosine=cosine, ulp_share=within / n,
                   nonfinite_mismatch=0, source="tensor")


def _compare_native(native: Any, fa: np.ndarray, fb: np.ndarray, judged: str, ulp_k: int) -> Metrics | None:
    """``_compare_f32`` in two passes of compiled C (``tensordiff._native``): ||a||, then everything else."""
    n = fa.size
    out = (ctypes.c_double * 6)()
    code_a, code_b = _native.DTYPE_CODES[dtypes.name_of(fa.dtype)], _native.DTYPE_CODES[dtypes.name_of(fb.dtype)]
    sumsq = native.td_sumsq_f32 if code_a == 0 else native.td_sumsq_bf16
    if sumsq(fa.ctypes.data, n, out) != 0 or not math.isfinite(out[0]):
        return None  # NaN/Inf: the float64 path
    norm_a = math.sqrt(out[0])
    bits = dtypes.MANTISSA_BITS[judged]
    floor = max(1e-3 * norm_a / math.sqrt(n), 1e-30)
    ulp_floor = ulp_k * 2.0 ** (dtypes._MIN_EXP[judged] - bits)
    compare = getattr(native, f"td_compare_{code_a}_{code_b}")
    if compare(fa.ctypes.data, fb.ctypes.data, n, floor, ulp_floor, ulp_k * 2.0 ** -bits, out) != 0:
        return None
    diff_sq, b_sq, dot, max_abs, max_rel, within = out
    return _f32_metrics(n, norm_a, diff_sq, b_sq, lambda: dot, max_abs, max_rel, int(within))


def _dot(fa: np.ndarray, fb: np.ndarray, buf: _Buffers) -> float:
    """a . b of two flat arrays, float32 products summed in float64 (no BLAS)."""
    total = 0.0
    for start in range(0, fa.size, CHUNK32):
        xa = _f32(fa, start, start + CHUNK32, buf.a)
        xb = _f32(fb, start, start + CHUNK32, buf.b)
        t = buf.t[:xa.size]
        np.multiply(xa, xb, out=t)
        total += float(np.add.reduce(t, dtype=np.float64))
    return total


def _compare_f64(a: np.ndarray, b: np.ndarray, judged_dtype: str, ulp_k: int = 4) -> Metrics:
    """Elementwise comparison in float64 chunks (any dtype, NaN/Inf handled)."""
    fa = a.reshape(-1)
    fb = b.reshape(-1)
    n = fa.size
    diff_sq = a_sq = b_sq = dot = 0.0
    max_abs = 0.0
    within = 0
    bad = 0
    a_abs_max = 0.0
    rel_parts: list[tuple[np.ndarray, np.ndarray]] = []
    for start in range(0, max(n, 1), CHUNK):
        xa = fa[start:start + CHUNK].astype(np.float64)
        xb = fb[start:start + CHUNK].astype(np.float64)
        fin_a = np.isfinite(xa)
        fin_b = np.isfinite(xb)
        both = fin_a & fin_b
        if not both.all():
            same_special = (~fin_a & ~fin_b) & ((np.isnan(xa) & np.isnan(xb)) | (xa == xb))
            bad += int(np.count_nonzero(~both & ~same_special))
            within += int(np.count_nonzero(same_special))
            xa = np.where(both, xa, 0.0)
            xb = np.where(both, xb, 0.0)
        d = np.abs(xa - xb)
        diff_sq += float(np.add.reduce(d * d))  # reductions, not np.dot: BLAS would start its threads
        a_sq += float(np.add.reduce(xa * xa))
        b_sq += float(np.add.reduce(xb * xb))
        dot += float(np.add.reduce(xa * xb))
        if d.size:
            max_abs = max(max_abs, float(d.max()))
            absa = np.abs(xa)
            a_abs_max = max(a_abs_max, float(absa.max()))
            within += int(np.count_nonzero((d <= ulp_k * dtypes.ulp(np.maximum(absa, np.abs(xb)), judged_dtype))[both]))
            rel_parts.append((d, absa))
    norm_a, norm_b = math.sqrt(a_sq), math.sqrt(b_sq)
    denom = max(norm_a, norm_b)
    rel_l2 = math.sqrt(diff_sq) / denom if denom > 0 else (0.0 if diff_sq == 0 else math.inf)
    if bad:
        rel_l2 = math.inf
    floor = 1e-3 * (norm_a / math.sqrt(n)) if n and norm_a > 0 else 1e-30
    max_rel = 0.0
    for d, absa in rel_parts:
        max_rel = max(max_rel, float((d / np.maximum(absa, floor)).max()))
    if norm_a > 0 and norm_b > 0:
        cosine = min(1.0, max(-1.0, dot / (norm_a * norm_b)))
    else:
        cosine = 1.0 if norm_a == norm_b else 0.0
    return Metrics(rel_l2=rel_l2, max_abs=max_abs, max_rel=max_rel, cosine=cosine,
                   ulp_share=within / n if n else 1.0, nonfinite_mismatch=bad, source="tensor")


def compare_stats(a: Record, b: Record) -> Metrics:
    """Best effort when tensors were not stored: compare the float64 statistics.

    ``rel_l2`` is then the relative difference of the L2 norms and means (a lower
    bound of the elementwise error: permutations and sign flips can hide).
    """
    bad = int(a.nan != b.nan) + int(a.inf != b.inf)
    scale = max(abs(a.l2), abs(b.l2))
    if scale == 0:
        rel = 0.0
    else:
        n = max(a.numel, 1)
        rms = scale / math.sqrt(n)
        rel = max(abs(a.l2 - b.l2) / scale, abs(a.mean - b.mean) / rms if rms else 0.0)
    if not all(math.isfinite(v) for v in (a.l2, b.l2)) and a.l2 != b.l2:
        rel = math.inf
    return Metrics(rel_l2=math.inf if bad else rel, max_abs=max(abs(a.max - b.max), abs(a.min - b.min)),
                   max_rel=math.nan, cosine=math.nan, ulp_share=math.nan, nonfinite_mismatch=bad, source="stats")


def rel_l2(x: np.ndarray, y: np.ndarray) -> float:
    """||x - y|| / max(||x||, ||y||) in float64 over the finite elements: 0 when both are zero; inf when the shapes
    differ or NaN/Inf sit in different places (NaN/Inf in the same places, with the same sign, are left out).

    The relative error every verdict uses, for arrays that fit in memory (hints, replay);
    ``compare_arrays`` computes the same in chunks for whole captured tensors."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.shape != y.shape:
        return math.inf
    finite = np.isfinite(x) & np.isfinite(y)
    if not finite.all():
        same = (np.isnan(x) & np.isnan(y)) | (x == y)
        if not (finite | same).all():
            return math.inf
        x, y = x[finite], y[finite]
    x, y = x.reshape(-1), y.reshape(-1)
    d = x - y
    diff = math.sqrt(float(np.add.reduce(d * d)))  # not np.linalg.norm: BLAS would start its threads
    scale = math.sqrt(max(float(np.add.reduce(x * x)), float(np.add.reduce(y * y))))
    return diff / scale if scale > 0 else 0.0
