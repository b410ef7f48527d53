"""One pair: read both tensors, bring B into A's layout, compare, and judge against the pair's tolerance.

With both tensors stored the comparison is elementwise (``metrics.compare_arrays``); with
statistics only it is a bound from the float64 statistics, carried through the transforms
where they allow it (``transforms.apply_stats``).
"""

from __future__ import annotations

import dataclasses

from .. import dtypes
from ..store import CaptureFile
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


def compare_pair(ca: CaptureFile, cb: CaptureFile, pair: Pair, tolerances: Tolerances, ulp_k: int,
                 run_dtype: str = "") -> tuple[Metrics | None, float, RowVerdict, str]:
    """(metrics or None, tolerance, verdict, note) of one matched pair."""
    a, b = pair.a, pair.b
    assert a is not None and b is not None
    tol = tolerances.limit(a.dtype, b.dtype, a.key, run_dtype)
    judged = dtypes.coarsest(a.dtype, b.dtype)
    xa = ca.array(a) if a.has_data else None
    try:
        xb = pair.b_tensor(cb.array) if b.has_data else None
    except Exception as err:  # a join or transform that does not fit this tensor
        how = " then ".join(([str(pair.join)] if pair.join is not None else []) + [str(op) for op in pair.ops])
        return None, tol, "shape", f"{how} failed on B {b.shape}: {err}"
    if xa is not None and xb is not None:
        if xa.shape != xb.shape:
            if xa.size == xb.size and not pair.ops and pair.join is None and pair.how != "order":
                note = f"shapes {a.shape} vs {xb.shape}: compared flat"
                xb = xb.reshape(xa.shape)
            else:
                return None, tol, "shape", f"shape {a.shape} vs {tuple(xb.shape)}"
        else:
            note = ""
        metrics = compare_arrays(xa, xb, judged, ulp_k)
    else:
        if not (a.stats_known and all(r.stats_known for r in pair.b_records)):
            return None, tol, "skipped", ("statistics of a data-parallel mean cannot be merged from each rank's "
                                          "statistics; store tensors (--tensors all) to compare this step")
        st = pair.b_stats()
        if st is None:
            return None, tol, "skipped", (f"statistics cannot follow {' '.join(map(str, pair.ops))}; "
                                          "store tensors (--tensors all) to compare this step")
        b = dataclasses.replace(b, numel=st[0], min=st[1], max=st[2], mean=st[3], l2=st[4])
        if a.numel != b.numel:
            return None, tol, "shape", f"{a.numel} vs {b.numel} elements"
        metrics = compare_stats(a, b)
        note = "statistics only"
    verdict: RowVerdict = "ok" if metrics.rel_l2 <= tol and metrics.nonfinite_mismatch == 0 else "diverged"
    return metrics, tol, verdict, note
