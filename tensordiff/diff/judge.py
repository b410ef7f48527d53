"""One pair: read both tensors, bring B into A's layout, compare, and judge against the pair's tolerance.

With both tensors stored the comparison is elementwise (``metrics.compare_arrays``); with
statistics only it is a bound from the float64 statistics, carried through the transforms
where they allow it (``transforms.apply_stats``).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

from .. import dtypes
from ..errors import CaptureFileError
from ..record import Record
from ..store import CaptureReader
from ..transforms import apply_mean
from .accounting import compare_masks, maybe_mask
from .align import Pair
from .metrics import Metrics, compare_arrays, compare_stats
from .result import RowVerdict
from .tolerance import Tolerances


def compute_dtype(cap: CaptureReader, step: int) -> str:
    """The narrowest float dtype most of a run's parameters are held in (its compute precision), or ''."""
    counts: dict[str, int] = {}
    for rec in cap.records(step):
        if rec.phase == "weights" and dtypes.is_float(rec.dtype):
            counts[rec.dtype] = counts.get(rec.dtype, 0) + 1
    return max(counts, key=lambda d: counts[d]) if counts else ""


#: What measuring a pair gives: (metrics or None, the verdict when there are none ('shape', 'skipped'), note).
Measured = tuple[Metrics | None, Literal["", "shape", "skipped"], str]


def compare_pair(ca: CaptureReader, cb: CaptureReader, pair: Pair, tolerances: Tolerances, ulp_k: int,
                 run_dtype: str = "", measured: Measured | None = None,
                 first_step: int | None = None) -> tuple[Metrics | None, float, RowVerdict, str]:
    """(metrics or None, tolerance, verdict, note) of one matched pair; ``measured``: ``measure_pair``'s answer for it,
    when already known (computed in a worker, or under another record of the same tensors); ``first_step``: the
    first step either run recorded (its weights are the ones loaded: ``Tolerances.limit``'s ``loaded``)."""
    a, b = pair.a, pair.b
    assert a is not None and b is not None
    # a noise file measured on either side's program (its names): A's key first
    key = a.key if a.key in tolerances.noise or b.key not in tolerances.noise else b.key
    loaded = a.phase == "weights" and a.step == first_step and a.kind == "param"
    tol = tolerances.limit(a.dtype, b.dtype, key, run_dtype, loaded=loaded)
    metrics, failed, note = measured if measured is not None else measure_pair(ca, cb, pair, ulp_k)
    if metrics is None:
        return None, tol, failed or "skipped", note
    verdict: RowVerdict = "ok" if metrics.rel_l2 <= tol and metrics.nonfinite_mismatch == 0 else "diverged"
    return metrics, tol, verdict, note


#: What ``compare_arrays`` gives for two identical finite tensors.
IDENTICAL = Metrics(rel_l2=0.0, max_abs=0.0, max_rel=0.0, cosine=1.0, ulp_share=1.0, nonfinite_mismatch=0,
                    source="tensor")


def _same_bytes(ca: CaptureReader, cb: CaptureReader, pair: Pair) -> bool:
    """A plain pair (no transform, join, bias or mask; no NaN or Inf) whose two tensors are stored as the same bytes:
    identical, without decoding either."""
    a, b = pair.a, pair.b
    assert a is not None and b is not None
    if pair.ops or pair.join is not None or pair.bias_a is not None or pair.bias_b is not None or pair.how == "order":
        return False
    if not (a.has_data and b.has_data and a.dtype == b.dtype and a.shape == b.shape and a.numel > 0):
        return False
    if a.nan or a.inf or b.nan or b.inf or maybe_mask(a):
        return False
    return ca.same_stored(a, cb, b)


def measure_pair(ca: CaptureReader, cb: CaptureReader, pair: Pair, ulp_k: int) -> Measured:
    """Read both tensors (or take the statistics) and compare them: no tolerance, no verdict beyond 'shape' or
    'skipped' when nothing could be compared. Safe to call from several threads at once."""
    a, b = pair.a, pair.b
    assert a is not None and b is not None
    judged = dtypes.coarsest(a.dtype, b.dtype)
    if _same_bytes(ca, cb, pair):
        return IDENTICAL, "", ""
    xa = pair.a_tensor(ca.array) if a.has_data else None
    try:
        xb = pair.b_tensor(cb.array) if b.has_data else None
    except CaptureFileError:  # a damaged file is reported as such, never as a layout that does not fit
        raise
    except Exception as err:  # a join or transform that does not fit this tensor
        how = " then ".join(([str(pair.join)] if pair.join is not None else []) + [str(op) for op in pair.ops])
        return None, "shape", f"{how} failed on B {b.shape}: {err}"
    if xa is not None and xb is not None:
        if maybe_mask(a) and maybe_mask(b) and not (xa.dtype == xb.dtype and xa.shape == xb.shape
                                                    and np.array_equal(xa, xb)):
            meaning = compare_masks(xa, xb)
            if meaning is not None:
                return compare_arrays(meaning[0], meaning[1], "float32", ulp_k), "", meaning[2]
        if xa.shape != xb.shape:
            plain = not pair.ops and pair.join is None and pair.how != "order"
            if xa.size == xb.size and plain:
                note = f"shapes {a.shape} vs {xb.shape}: compared flat"
                xb = xb.reshape(xa.shape)
            elif plain and _broadcasts(xa.shape, xb.shape):  # [1, S, H] positions vs [B, S, H]: repeated
                if a.kind in ("grad_input", "grad_output"):  # the gradient of a repeated tensor is the sum
                    small, big = (xa, xb) if xa.size < xb.size else (xb, xa)
                    dims = tuple(i for i, (x, y) in enumerate(zip(small.shape, big.shape)) if x == 1 and y != 1)
                    summed = big.astype(np.float64).sum(axis=dims, keepdims=True).astype(big.dtype)
                    xa, xb = (small, summed) if xa is small else (summed, small)
                    note = (f"shapes {a.shape} vs {tuple(xb.shape)}: a gradient of a repeated tensor, the larger "
                            "summed along the repeated dims")
                else:
                    note = f"shapes {a.shape} vs {tuple(xb.shape)}: the smaller repeated along its size-1 dims"
                    xa, xb = np.broadcast_arrays(xa, xb)
            else:
                return None, "shape", f"shape {a.shape} vs {tuple(xb.shape)}"
        else:
            note = ""
        return compare_arrays(xa, xb, judged, ulp_k), "", note
    if not (a.stats_known and all(r.stats_known for r in pair.b_records)):
        side = "A" if not a.stats_known else "B"
        if not dtypes.is_float((a if side == "A" else b).dtype):
            return None, "skipped", (f"{side} holds no statistics of these integer or bool tensors (msprobe gives "
                                     "them no mean or norm); store tensors (msprobe: task tensor) to compare them")
        return None, "skipped", (f"{side} holds no statistics of these tensors (a data-parallel mean merged from "
                                 "each rank's statistics has none); store tensors (--tensors all) to compare them")
    if pair.bias_a is not None or pair.bias_b is not None:
        return _stats_with_bias(a, b, pair)
    st = pair.b_stats()
    if st is None:
        follows = apply_mean(pair.ops, b.numel, b.mean) if pair.join is None else None
        if follows is not None and follows[0] == a.numel:  # the sum follows (a gradient summed over repeated heads)
            rms = a.l2 / max(a.numel, 1) ** 0.5
            return (_means(a, b, a.mean, follows[1], rms), "",
                    f"statistics only: the means ({' '.join(map(str, pair.ops))} keeps only the sum)")
        return None, "skipped", (f"statistics cannot follow {' '.join(map(str, pair.ops))}; "
                                 "store tensors (--tensors all) to compare this step")
    b = dataclasses.replace(b, numel=st[0], min=st[1], max=st[2], mean=st[3], l2=st[4])
    if a.numel != b.numel and not pair.ops and pair.join is None and pair.how != "order" \
            and _broadcasts(a.shape, b.shape):
        return _stats_broadcast(a, b)
    if a.numel != b.numel:
        return None, "shape", f"{a.numel} vs {b.numel} elements"
    return compare_stats(a, b), "", "statistics only"


def _broadcasts(sa: tuple[int, ...], sb: tuple[int, ...]) -> bool:
    """One shape is the other with some dims of size 1 (same rank): the smaller repeats along them."""
    if len(sa) != len(sb):
        return False
    return all(x == y for x, y in zip(sa, sb) if x != 1 and y != 1) and (
        all(x <= y for x, y in zip(sa, sb)) or all(x >= y for x, y in zip(sa, sb)))


def _stats_with_bias(a: Record, b: Record, pair: Pair) -> Measured:
    """Statistics of an output one side returned without its bias: only the mean follows the bias (mean(y + b) =
    mean(y) + mean(b)); B's statistics through the pair's transforms where they follow them."""
    st = pair.b_stats()
    if st is None or a.numel != st[0]:
        return None, "skipped", "statistics cannot follow a bias added to one side; store tensors (--tensors all)"
    mean_a = a.mean + (pair.bias_a.mean if pair.bias_a is not None else 0.0)
    mean_b = st[3] + (pair.bias_b.mean if pair.bias_b is not None else 0.0)
    rms = max(a.l2, st[4]) / max(a.numel, 1) ** 0.5
    return _means(a, b, mean_a, mean_b, rms), "", "statistics only: the means, with the bias one side returns apart added"


def _stats_broadcast(a: Record, b: Record) -> Measured:
    """Statistics of a tensor repeated along size-1 dims on one side: a repeat keeps min, max and mean and scales the
    L2 by the square root of the repeat; the gradient of a repeated tensor is the sum of the larger one along the
    repeated dims: its mean is the repeat times the larger one's."""
    small, big = (a, b) if a.numel < b.numel else (b, a)
    k = big.numel // max(small.numel, 1)
    if a.kind in ("grad_input", "grad_output"):
        mean_small, mean_big = small.mean, big.mean * k
        ma, mb = (mean_small, mean_big) if small is a else (mean_big, mean_small)
        rms = small.l2 / max(small.numel, 1) ** 0.5  # the summed gradient's scale
        return _means(a, b, ma, mb, rms), "", "statistics only: the means (a gradient of a repeated tensor)"
    grown = dataclasses.replace(small, numel=big.numel, l2=small.l2 * k ** 0.5)
    ra, rb = (grown, big) if small is a else (big, grown)
    return compare_stats(ra, rb), "", f"statistics only; {small.shape} repeated to {big.shape}"


def _means(a: Record, b: Record, mean_a: float, mean_b: float, rms: float) -> Metrics:
    """A comparison of two means, scaled by the tensors' RMS (what statistics allow when only the mean follows)."""
    rel = abs(mean_a - mean_b) / rms if rms else 0.0
    bad = int(a.nan != b.nan) + int(a.inf != b.inf)
    return Metrics(rel_l2=float("inf") if bad else rel, max_abs=abs(mean_a - mean_b), max_rel=float("nan"),
                   cosine=float("nan"), ulp_share=float("nan"), nonfinite_mismatch=bad, source="stats")


def tensor_key(pair: Pair) -> tuple | None:
    """What ``measure_pair`` depends on, with every record named by the tensor it holds (a link by its source,
    ``same_as``): two pairs with one key measure the same. None where a side has no stored tensor (the statistics
    are compared then: nothing is read)."""
    a, b = pair.a, pair.b
    if a is None or b is None or not a.has_data or not b.has_data:
        return None

    def tensor(r: Record) -> tuple:
        return r.step, r.same_as if r.same_as >= 0 else r.seq, r.dtype, r.shape

    join = (type(pair.join).__name__, tuple(sorted(vars(pair.join).items()))) if pair.join is not None else None
    biases = tuple(tensor(r) if r is not None else None for r in (pair.bias_a, pair.bias_b))
    return (tensor(a), tuple(tensor(r) for r in pair.b_records), b.dtype, b.shape, pair.how == "order", pair.ops, join,
            biases)
