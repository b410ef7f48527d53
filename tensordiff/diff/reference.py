"""Three-way judging: B against an FP32 reference R, next to A's own error against R (``--reference``).

A BF16 kernel on side B is then held to what side A's BF16 kernels do against the same FP32
reference, not to a fixed tolerance against the other kernel.
"""

from __future__ import annotations

from .. import dtypes
from ..errors import AlignmentError
from ..store import CaptureReader, open_capture
from .align import Pair, align_step
from .metrics import Metrics, compare_arrays, compare_stats
from .result import DiffOptions, Row


def _reference_metrics(cap_x: CaptureReader, px: Pair, cr: CaptureReader, pr: Pair, ulp_k: int) -> Metrics | None:
    """One side (``px.b``) against the reference (``pr.b``), both brought into A's layout."""
    x, r = px.b, pr.b
    assert x is not None and r is not None
    try:
        xx = px.b_tensor(cap_x.array) if x.has_data else None
        xr = pr.b_tensor(cr.array) if r.has_data else None
    except Exception:
        return None
    if xx is not None and xr is not None:
        if xx.shape != xr.shape:
            return None
        return compare_arrays(xx, xr, dtypes.coarsest(x.dtype, r.dtype), ulp_k)
    if px.ops or pr.ops or px.join is not None or pr.join is not None or x.numel != r.numel:
        return None
    return compare_stats(x, r)


def judge_against_reference(rows: list[Row], ca: CaptureReader, cb: CaptureReader, common: list[int],
                            options: DiffOptions) -> None:
    """Three-way: judge B by its error against an FP32 reference R, relative to A's own error against R.

    A BF16 kernel on side B is then held to what side A's BF16 kernels do against the same FP32
    reference, not to a fixed tolerance against the other kernel. Each row's ``metrics`` become B-vs-R,
    ``ab`` keeps A-vs-B, ``ref_a`` is A-vs-R and the limit is max(factor x A-vs-R, R's own dtype tolerance).
    """
    with open_capture(options.reference) as cr:  # type: ignore[arg-type]
        missing = [s for s in common if s not in cr.steps]
        if missing:
            raise AlignmentError(f"{options.reference}: the reference has steps {cr.steps}, not {missing}; capture "
                                 "it for the same steps")
        for step in common:
            partner: dict[int, Pair] = {}
            for pair in align_step(ca.records(step), cr.records(step), options.reference_mapping, order_fallback=False):
                if pair.a is not None and pair.b is not None:
                    partner[pair.a.seq] = pair
            for row in rows:
                if row.step != step or not row.pair.matched:
                    continue
                a, b = row.pair.a, row.pair.b
                assert a is not None and b is not None
                hit = partner.get(a.seq)
                if hit is None:
                    row.note = (row.note + "; " if row.note else "") + "not in the reference"
                    continue
                r = hit.b
                assert r is not None
                m_a = _reference_metrics(ca, Pair(None, a), cr, hit, options.ulp_k)
                m_b = _reference_metrics(cb, row.pair, cr, hit, options.ulp_k)
                if m_a is None or m_b is None:
                    continue
                floor = options.tolerances.limit(r.dtype, r.dtype, a.key)
                row.ab, row.ref_a = row.metrics, m_a.rel_l2
                row.metrics = m_b
                row.tol = max(options.reference_factor * m_a.rel_l2, floor)
                row.verdict = "ok" if m_b.rel_l2 <= row.tol and m_b.nonfinite_mismatch == 0 else "diverged"
                if m_a.rel_l2 > max(options.reference_factor * m_b.rel_l2, floor):
                    row.note = (row.note + "; " if row.note else "") + "A is further from the reference than B"
