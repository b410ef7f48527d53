"""What the diff produces, as plain data: options, rows, the first divergence, the result.

A leaf of the diff stage (it imports no other diff step but the types it holds), so the
engine, the divergence search, the hints and the report all import it and none imports another
for its types.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from ..errors import UsageError
from ..record import PHASES
from .align import Pair, RenameRules
from .metrics import Metrics
from .tolerance import Tolerances

RowVerdict = Literal["ok", "diverged", "unmatched", "shape", "skipped", "drift"]
#: Every verdict a row can have.
ROW_VERDICTS: tuple[RowVerdict, ...] = get_args(RowVerdict)


@dataclass
class DiffOptions:
    """How to line up and judge two captures."""

    mapping: RenameRules | None = None
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
    reference: str | None = None
    """Three-way mode: an FP32 capture R of the same model, checkpoint and batch (``--reference R.h5``)."""
    reference_mapping: RenameRules | None = None
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
    verdict: RowVerdict = "unmatched"
    """'ok', 'diverged', 'unmatched' (one side only), 'shape' (shapes differ after transforms),
    'skipped' (statistics cannot follow a transform) or 'drift' (weights after an optimizer step
    differ, but nothing computed in that step does)."""
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
    """Everything ``diff()`` found: every row of every common step, and the first divergence."""

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

    def count(self, verdict: RowVerdict) -> int:
        return sum(1 for r in self.rows if r.verdict == verdict)

    def unmatched(self, side: Literal["a", "b"]) -> list[Row]:
        return [r for r in self.rows if r.verdict == "unmatched" and (r.pair.a if side == "a" else r.pair.b) is not None]


@dataclass
class FirstDivergence:
    """Where the runs first part ways, and why (``divergence.find_first_divergence``)."""

    step: int
    phase: str
    module_a: str
    module_b: str
    kind: str
    slot: str
    call: int
    label_a: str
    label_b: str
    rel_l2: float
    tolerance: float
    incoming: float
    introduced: bool
    location: str
    explanation: str
    where: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        def num(v: float) -> float | None:
            return v if math.isfinite(v) else None

        return {
            "step": self.step, "phase": self.phase, "module_a": self.module_a, "module_b": self.module_b,
            "kind": self.kind, "slot": self.slot, "call": self.call, "tensor_a": self.label_a, "tensor_b": self.label_b,
            "rel_l2": num(self.rel_l2), "tolerance": self.tolerance, "incoming_rel_l2": num(self.incoming),
            "introduced": self.introduced, "location": self.location, "explanation": self.explanation,
            "where": self.where,
        }


def phase_rows(result: DiffResult) -> list[tuple[int, str, list[Row]]]:
    """Rows grouped by (step, phase), in execution order."""
    out = []
    for step in result.steps:
        for phase in PHASES:
            rows = [r for r in result.rows if r.step == step and r.phase == phase]
            if rows:
                out.append((step, phase, rows))
    return out
