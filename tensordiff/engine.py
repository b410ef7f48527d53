"""The diff: align two captures step by step, compare every pair, judge it, find the first divergence.

Reads one tensor pair at a time, so memory is bounded by the largest pair, not the file.
Imports neither torch nor mindspore.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from . import dtypes
from .align import Mapping, Pair, align_step
from .compare import Metrics, compare_arrays, compare_stats
from .divergence import FirstDivergence, find_first_divergence
from .errors import AlignmentError, UsageError
from .record import PHASES, Record
from .store import Capture
from .tolerance import Tolerances, judged_dtype
from .transforms import apply, apply_stats


@dataclass
class DiffOptions:
    """How to line up and judge two captures."""

    mapping: Mapping | None = None
    """Rename rules from B's names to A's (``--mapping FILE``)."""
    tolerances: Tolerances = field(default_factory=Tolerances)
    """Per-dtype limits, an override, or a measured noise floor."""
    order_fallback: bool = True
    """Match leftovers by execution order and shape (``--no-order`` turns it off)."""
    jump: float = 3.0
    """An error counts as introduced when it is this many times what came in."""
    ulp_k: int = 4
    """The ULP column counts elements within this many units in the last place."""
    steps: list[int] | None = None
    """Only these steps (default: all steps both captures have)."""
    hints: bool = True
    """Test the likely causes at the first divergence (``--no-hints`` turns it off)."""
    reference: str | None = None
    """Three-way mode: an FP32 capture R of the same model, checkpoint and batch (``--reference R.h5``)."""
    reference_mapping: Mapping | None = None
    """Rename rules from R's names to A's (default: R is lined up with A by name)."""
    reference_factor: float = 3.0
    """Three-way: B is off when its error against R exceeds this many times A's own error against R."""

    def __post_init__(self) -> None:
        if self.jump <= 1:
            raise UsageError(f"jump={self.jump}: must be above 1 (an error must grow to count as introduced)")
        if self.ulp_k < 0:
            raise UsageError(f"ulp_k={self.ulp_k}: must be 0 or more")


@dataclass
class Row:
    """One line of the report: a pair (or an unmatched record) and its verdict."""

    step: int
    phase: str
    pair: Pair
    metrics: Metrics | None = None
    tol: float = 0.0
    verdict: str = "unmatched"
    """'ok', 'diverged', 'unmatched' (one side only), 'shape' (shapes differ after transforms) or
    'drift' (weights after an optimizer step differ, but nothing computed in that step does)."""
    note: str = ""
    judged: str = ""
    """The dtype whose tolerance judged this pair."""
    ab: Metrics | None = None
    """Three-way mode: A vs B (``metrics`` then holds B vs the reference)."""
    ref_a: float = math.nan
    """Three-way mode: relative L2 of A against the reference."""

    @property
    def err(self) -> float:
        return self.metrics.rel_l2 if self.metrics is not None else math.nan


@dataclass
class DiffResult:
    path_a: str
    path_b: str
    attrs_a: dict
    attrs_b: dict
    rows: list[Row]
    steps: list[int]
    first: FirstDivergence | None
    options: DiffOptions
    only_a_steps: list[int] = field(default_factory=list)
    only_b_steps: list[int] = field(default_factory=list)
    hints: list = field(default_factory=list)
    """Likely causes tested at the first divergence (hints.Hint), best first."""
    hints_note: str = ""

    def count(self, verdict: str) -> int:
        return sum(1 for r in self.rows if r.verdict == verdict)

    def unmatched(self, side: str) -> list[Row]:
        return [r for r in self.rows if r.verdict == "unmatched" and (r.pair.a if side == "a" else r.pair.b) is not None]


def compute_dtype(cap: Capture, step: int) -> str:
    """The narrowest float dtype most of a run's parameters are held in (its compute precision), or ''."""
    counts: dict[str, int] = {}
    for rec in cap.records(step):
        if rec.phase == "weights" and dtypes.is_float(rec.dtype):
            counts[rec.dtype] = counts.get(rec.dtype, 0) + 1
    return max(counts, key=lambda d: counts[d]) if counts else ""


def compare_pair(ca: Capture, cb: Capture, pair: Pair, tolerances: Tolerances, ulp_k: int,
                 run_dtype: str = "") -> tuple[Metrics | None, float, str, str]:
    a, b = pair.a, pair.b
    assert a is not None and b is not None
    tol = tolerances.limit(a.dtype, b.dtype, a.key, run_dtype)
    judged = dtypes.coarsest(a.dtype, b.dtype)
    xa = ca.array(a) if a.has_data else None
    xb = cb.array(b) if b.has_data else None
    if xa is not None and xb is not None:
        if pair.ops:
            try:
                xb = apply(pair.ops, xb)
            except Exception as err:  # a transform that does not fit this tensor
                return None, tol, "shape", f"transform {' '.join(map(str, pair.ops))} failed on B {b.shape}: {err}"
        if xa.shape != xb.shape:
            if xa.size == xb.size and not pair.ops and pair.how != "order":
                note = f"shapes {a.shape} vs {xb.shape}: compared flat"
                xb = xb.reshape(xa.shape)
            else:
                return None, tol, "shape", f"shape {a.shape} vs {tuple(xb.shape)}"
        else:
            note = ""
        metrics = compare_arrays(xa, xb, judged, ulp_k)
    else:
        if pair.ops:
            st = apply_stats(pair.ops, (b.numel, b.min, b.max, b.mean, b.l2))
            if st is None:
                return None, tol, "skipped", (f"statistics cannot follow {' '.join(map(str, pair.ops))}; "
                                              "store tensors (--tensors all) to compare this step")
            b = dataclasses.replace(b, numel=st[0], min=st[1], max=st[2], mean=st[3], l2=st[4])
        if a.numel != b.numel:
            return None, tol, "shape", f"{a.numel} vs {b.numel} elements"
        metrics = compare_stats(a, b)
        note = "statistics only"
    verdict = "ok" if metrics.rel_l2 <= tol and metrics.nonfinite_mismatch == 0 else "diverged"
    return metrics, tol, verdict, note


def measure_noise(path_1: str, path_2: str, mapping: Mapping | None = None) -> dict[tuple, float]:
    """Per-record relative L2 error between two captures of the same run (the noise floor)."""
    out: dict[tuple, float] = {}
    loose = Tolerances(override=math.inf)
    with Capture(path_1) as c1, Capture(path_2) as c2:
        for step in sorted(set(c1.steps) & set(c2.steps)):
            for pair in align_step(c1.records(step), c2.records(step), mapping, order_fallback=False):
                if pair.matched:
                    metrics, _, _, _ = compare_pair(c1, c2, pair, loose, 0)
                    if metrics is not None and math.isfinite(metrics.rel_l2):
                        key = pair.a.key  # type: ignore[union-attr]
                        out[key] = max(out.get(key, 0.0), metrics.rel_l2)
    return out


def diff(path_a: str, path_b: str, options: DiffOptions | None = None) -> DiffResult:
    """Compare two capture files. Raises TensordiffError subclasses on bad input."""
    options = options or DiffOptions()
    with Capture(path_a) as ca, Capture(path_b) as cb:
        common = sorted(set(ca.steps) & set(cb.steps))
        if options.steps is not None:
            missing = [s for s in options.steps if s not in common]
            if missing:
                raise UsageError(f"step(s) {missing} are not in both captures; both have steps {common}")
            common = sorted(options.steps)
        if not common:
            for cap in (ca, cb):
                if not cap.steps:
                    raise AlignmentError(f"{cap.path}: holds no complete step (the run stopped before its first step ended); re-run the capture")
            raise AlignmentError(f"{path_a} (steps {ca.steps}) and {path_b} (steps {cb.steps}) have no step in common")
        rows: list[Row] = []
        matched_by_name = 0
        run_dtype = dtypes.coarsest(compute_dtype(ca, common[0]), compute_dtype(cb, common[0]))
        for step in common:
            pairs = align_step(ca.records(step), cb.records(step), options.mapping, options.order_fallback)
            for pair in pairs:
                rec = pair.a or pair.b
                assert rec is not None
                row = Row(step=step, phase=rec.phase, pair=pair)
                if pair.matched:
                    if pair.how not in ("order", "tensor") and rec.phase != "loss" and rec.module != "":
                        matched_by_name += 1
                    row.metrics, row.tol, row.verdict, row.note = compare_pair(ca, cb, pair, options.tolerances,
                                                                               options.ulp_k, run_dtype)
                    row.judged = judged_dtype(pair.a.dtype, pair.b.dtype, run_dtype)  # type: ignore[union-attr]
                    if pair.how == "order":
                        row.note = (row.note + "; " if row.note else "") + "matched by order"
                rows.append(row)
        if matched_by_name == 0:
            raise AlignmentError(
                f"{path_a} and {path_b} have no module in common ({_sample(ca, common[0])} vs {_sample(cb, common[0])}); "
                "give a mapping file with --mapping (see docs/mapping.md)"
            )
        records_a = {step: ca.records(step) for step in common}
        records_b = {step: cb.records(step) for step in common}
        if options.reference:
            _judge_against_reference(rows, ca, cb, common, options)
        first = find_first_divergence(rows, records_a, options.jump, records_b)
        result = DiffResult(
            path_a=path_a, path_b=path_b, attrs_a=dict(ca.attrs), attrs_b=dict(cb.attrs), rows=rows, steps=common,
            first=first, options=options,
            only_a_steps=sorted(set(ca.steps) - set(cb.steps)), only_b_steps=sorted(set(cb.steps) - set(ca.steps)),
        )
        if first is not None and options.hints:
            from .hints import find_hints

            result.hints, result.hints_note = find_hints(result, ca, cb)
        return result


def _reference_metrics(cap_x: Capture, x: Record, ops_x: tuple, cr: Capture, r: Record, ops_r: tuple,
                       ulp_k: int) -> Metrics | None:
    """One side against the reference, both brought into A's layout."""
    xx = cap_x.array(x) if x.has_data else None
    xr = cr.array(r) if r.has_data else None
    if xx is not None and xr is not None:
        try:
            xx = apply(ops_x, xx) if ops_x else xx
            xr = apply(ops_r, xr) if ops_r else xr
        except Exception:
            return None
        if xx.shape != xr.shape:
            return None
        return compare_arrays(xx, xr, dtypes.coarsest(x.dtype, r.dtype), ulp_k)
    if ops_x or ops_r or x.numel != r.numel:
        return None
    return compare_stats(x, r)


def _judge_against_reference(rows: list[Row], ca: Capture, cb: Capture, common: list[int], options: DiffOptions) -> None:
    """Three-way: judge B by its error against an FP32 reference R, relative to A's own error against R.

    A BF16 kernel on side B is then held to what side A's BF16 kernels do against the same FP32
    reference, not to a fixed tolerance against the other kernel. Each row's ``metrics`` become B-vs-R,
    ``ab`` keeps A-vs-B, ``ref_a`` is A-vs-R and the limit is max(factor x A-vs-R, R's own dtype tolerance).
    """
    with Capture(options.reference) as cr:  # type: ignore[arg-type]
        missing = [s for s in common if s not in cr.steps]
        if missing:
            raise AlignmentError(f"{options.reference}: the reference has steps {cr.steps}, not {missing}; capture "
                                 "it for the same steps")
        for step in common:
            partner: dict[int, tuple[Record, tuple]] = {}
            for pair in align_step(ca.records(step), cr.records(step), options.reference_mapping, order_fallback=False):
                if pair.matched:
                    partner[pair.a.seq] = (pair.b, pair.ops)  # type: ignore[union-attr]
            for row in rows:
                if row.step != step or not row.pair.matched:
                    continue
                a, b = row.pair.a, row.pair.b
                assert a is not None and b is not None
                hit = partner.get(a.seq)
                if hit is None:
                    row.note = (row.note + "; " if row.note else "") + "not in the reference"
                    continue
                r, ops_r = hit
                m_a = _reference_metrics(ca, a, (), cr, r, ops_r, options.ulp_k)
                m_b = _reference_metrics(cb, b, row.pair.ops, cr, r, ops_r, options.ulp_k)
                if m_a is None or m_b is None:
                    continue
                floor = options.tolerances.limit(r.dtype, r.dtype, a.key)
                row.ab, row.ref_a = row.metrics, m_a.rel_l2
                row.metrics = m_b
                row.tol = max(options.reference_factor * m_a.rel_l2, floor)
                row.verdict = "ok" if m_b.rel_l2 <= row.tol and m_b.nonfinite_mismatch == 0 else "diverged"
                if m_a.rel_l2 > max(options.reference_factor * m_b.rel_l2, floor):
                    row.note = (row.note + "; " if row.note else "") + "A is further from the reference than B"


def _sample(cap: Capture, step: int) -> str:
    names = []
    for rec in cap.records(step):
        if rec.phase in ("forward", "weights") and rec.module and rec.module not in names:
            names.append(rec.module)
        if len(names) == 2:
            break
    return f"{cap.framework}: " + ", ".join(names) if names else f"{cap.framework}: no modules"


def phase_rows(result: DiffResult) -> list[tuple[int, str, list[Row]]]:
    """Rows grouped by (step, phase), in execution order."""
    out = []
    for step in result.steps:
        for phase in PHASES:
            rows = [r for r in result.rows if r.step == step and r.phase == phase]
            if rows:
                out.append((step, phase, rows))
    return out
