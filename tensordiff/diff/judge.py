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
from ..store import CaptureFile
from .accounting import compare_masks, maybe_mask
from .align import Pair
from .metrics import Metrics, compare_arrays, compare_stats
from .result import RowVerdict
from .tolerance import Tolerances


def compute_dtype(cap: CaptureFile, step: int) -> str:
    """The narrowest float dtype most of a run's parameters are held in (its compute precision), or ''."""
    counts: dict[str, int] = {}
    for rec in cap.records(step):
        if rec.phase == "weights" and dtypes.is_float(rec.dtype):
            counts[rec.dtype] = counts.get(rec.dtype, 0) + 1
    return max(counts, key=lambda d: counts[d]) if counts else ""


#: What measuring a pair gives: (metrics or None, the verdict when there are none ('shape', 'skipped'), note).
Measured = tuple[Metrics | None, Literal["", "shape", "skipped"], str]


def compare_pair(ca: CaptureFile, cb: CaptureFile, pair: Pair, tolerances: Tolerances, ulp_k: int,
                 run_dtype: str = "", measured: Measured | None = None) -> tuple[Metrics | None, float, RowVerdict, str]:
    """(metrics or None, tolerance, verdict, note) of one matched pair; ``measured``: ``measure_pair``'s answer for it,
    when already known (computed in a worker, or under another record of the same tensors)."""
    a, b = pair.a, pair.b
    assert a is not None and b is not None
    tol = tolerances.limit(a.dtype, b.dtype, a.key, run_dtype)
    metrics, failed, note = measured if measured is not None else measure_pair(ca, cb, pair, ulp_k)
    if metrics is None:
        return None, tol, failed or "skipped", note
    verdict: RowVerdict = "ok" if metrics.rel_l2 <= tol and metrics.nonfinite_mismatch == 0 else "diverged"
    return metrics, tol, verdict, note


def measure_pair(ca: CaptureFile, cb: CaptureFile, pair: Pair, ulp_k: int) -> Measured:
    """Read both tensors (or take the statistics) and compare them: no tolerance, no verdict beyond 'shape' or
    'skipped' when nothing could be compared. Safe to call from several threads at once."""
    a, b = pair.a, pair.b
    assert a is not None and b is not None
    judged = dtypes.coarsest(a.dtype, b.dtype)
    xa = ca.array(a) if a.has_data else None
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
            if xa.size == xb.size and not pair.ops and pair.join is None and pair.how != "order":
                note = f"shapes {a.shape} vs {xb.shape}: compared flat"
                xb = xb.reshape(xa.shape)
            else:
                return None, "shape", f"shape {a.shape} vs {tuple(xb.shape)}"
        else:
            note = ""
        return compare_arrays(xa, xb, judged, ulp_k), "", note
    if not (a.stats_known and all(r.stats_known for r in pair.b_records)):
        return None, "skipped", ("statistics of a data-parallel mean cannot be merged from each rank's "
                                 "statistics; store tensors (--tensors all) to compare this step")
    st = pair.b_stats()
    if st is None:
        return None, "skipped", (f"statistics cannot follow {' '.join(map(str, pair.ops))}; "
                                 "store tensors (--tensors all) to compare this step")
    b = dataclasses.replace(b, numel=st[0], min=st[1], max=st[2], mean=st[3], l2=st[4])
    if a.numel != b.numel:
        return None, "shape", f"{a.numel} vs {b.numel} elements"
    return compare_stats(a, b), "", "statistics only"


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
    return tensor(a), tuple(tensor(r) for r in pair.b_records), b.dtype, b.shape, pair.how == "order", pair.ops, join
