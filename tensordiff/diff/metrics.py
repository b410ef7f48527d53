"""Pairwise metrics of two tensors, computed in chunks (memory bounded by the pair); ``rel_l2`` for small arrays.

Tensors of float32 or narrower are compared in float32 with float64 sums (one chunk of ``CHUNK32`` elements at a
time, reduced without BLAS, so no hidden threads); float64 and integer tensors, and any chunk holding NaN/Inf, in
float64."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from .. import dtypes
from ..record import Record

#: Elements per chunk: 4 Mi float64 values = 32 MiB per temporary.
CHUNK = 1 << 22
#: Elements per float32 chunk: 256 Ki values = 1 MiB per temporary (stays in cache).
CHUNK32 = 1 << 18
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
    tensors judged in such a dtype, float64 otherwise (see the module docstring)."""
    if (dtypes.name_of(a.dtype) in _NARROW and dtypes.name_of(b.dtype) in _NARROW and judged_dtype in _NARROW
            and judged_dtype in dtypes.MANTISSA_BITS):
        fast = _compare_f32(a, b, judged_dtype, ulp_k)
        if fast is not None:
            return fast
    return _compare_f64(a, b, judged_dtype, ulp_k)


def _sum_sq(x: np.ndarray) -> float:
    return float(np.add.reduce(x * x, dtype=np.float64))


def _ulp32(m: np.ndarray, name: str) -> np.ndarray:
    """``dtypes.ulp`` in float32 for a format no wider than float32: float32's spacing scaled to ``name``'s
    mantissa, floored at its subnormal step."""
    bits = dtypes.MANTISSA_BITS[name]
    u = np.spacing(m)  # float32 spacing at |value|: 2**(exponent - 23), 2**-149 at and below the subnormals
    if bits != 23:
        u *= np.float32(2.0 ** (23 - bits))
    floor = np.float32(2.0 ** (dtypes._MIN_EXP[name] - bits))
    return np.maximum(u, floor, out=u)


def _compare_f32(a: np.ndarray, b: np.ndarray, judged: str, ulp_k: int) -> Metrics | None:
    """The float32 path; None where a chunk holds NaN/Inf (the float64 path then handles the pair)."""
    fa, fb = a.reshape(-1), b.reshape(-1)
    n = fa.size
    if n == 0:
        return None
    a_sq = 0.0
    for start in range(0, n, CHUNK32):  # pass 1: ||a||, for max_rel's floor
        a_sq += _sum_sq(fa[start:start + CHUNK32].astype(np.float32, copy=False))
    if not math.isfinite(a_sq):
        return None
    norm_a = math.sqrt(a_sq)
    floor = np.float32(max(1e-3 * norm_a / math.sqrt(n), 1e-30))
    k = np.float32(ulp_k)
    diff_sq = b_sq = dot = 0.0
    max_abs = max_rel = 0.0
    within = 0
    for start in range(0, n, CHUNK32):
        xa = fa[start:start + CHUNK32].astype(np.float32, copy=False)
        xb = fb[start:start + CHUNK32].astype(np.float32, copy=False)
        d = xa - xb
        sums = (_sum_sq(d), _sum_sq(xb), float(np.add.reduce(xa * xb, dtype=np.float64)))
        if not all(math.isfinite(v) for v in sums):
            return None  # NaN/Inf (or float32 overflow) in this chunk
        diff_sq, b_sq, dot = diff_sq + sums[0], b_sq + sums[1], dot + sums[2]
        np.abs(d, out=d)
        max_abs = max(max_abs, float(d.max()))
        absa = np.abs(xa)
        m = np.maximum(absa, np.abs(xb))
        within += int(np.count_nonzero(d <= k * _ulp32(m, judged)))
        np.maximum(absa, floor, out=absa)
        max_rel = max(max_rel, float((d / absa).max()))
    norm_b = math.sqrt(b_sq)
    denom = max(norm_a, norm_b)
    rel = math.sqrt(diff_sq) / denom if denom > 0 else (0.0 if diff_sq == 0 else math.inf)
    if norm_a > 0 and norm_b > 0:
        cosine = min(1.0, max(-1.0, dot / (norm_a * norm_b)))
    else:
        cosine = 1.0 if norm_a == norm_b else 0.0
    return Metrics(rel_l2=rel, max_abs=max_abs, max_rel=max_rel, cosine=cosine, ulp_share=within / n,
                   nonfinite_mismatch=0, source="tensor")


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
        diff_sq += float(np.dot(d, d))
        a_sq += float(np.dot(xa, xa))
        b_sq += float(np.dot(xb, xb))
        dot += float(np.dot(xa, xb))
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
    diff = float(np.linalg.norm(x - y))
    scale = max(float(np.linalg.norm(x)), float(np.linalg.norm(y)))
    return diff / scale if scale > 0 else 0.0
