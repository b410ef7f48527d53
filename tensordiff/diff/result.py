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
from ..mapping import RenameRules
from ..record import PHASES
from .align import Pair
from .metrics import Metrics
from .tolerance import Tolerances

RowVerdict = Literal["ok", "diverged", "unmatched", "shape", "skipped", "drift", "uncertain", "routed"]
#: Every verdict a row can have.
ROW_VERDICTS: tuple[RowVerdict, ...] = get_args(RowVerdict)
#: Rows whose two tensors were compared and judged (the rest count against coverage).
COMPARED: frozenset[str] = frozenset({"ok", "diverged", "drift", "routed"})

Outcome = Literal["agree", "diverged", "inconclusive"]
#: ``tensordiff diff``'s exit code for each outcome (2 is bad input).
EXIT_CODES: dict[str, int] = {"agree": 0, "diverged": 1, "inconclusive": 3}


#: An error counts as introduced when it is this many times what came in (``--jump``).
DEFAULT_JUMP = 3.0
#: Three-way: B is off when its error against R exceeds this many times A's (``--reference-factor``).
DEFAULT_REFERENCE_FACTOR = 3.0


@dataclass
class DiffOptions:
    """How to line up and judge two captures."""

    mapping: RenameRules | None = None
    """Rename rules from B's names to A's (``--mapping FILE``)."""
    tolerances: Tolerances = field(default_factory=Tolerances)
    """Per-dtype limits, an override, or a measured noise floor."""
    order_fallback: bool = True
    """Match leftovers by execution order and shape (``--no-order`` turns it off)."""
    jump: float = DEFAULT_JUMP
    """An error counts as introduced when it is this many times what came in."""
    ulp_k: int = 4
    """The ULP column counts elements within this many units in the last place."""
    steps: list[int] | None = None
    """Only these steps (default: all steps both captures have)."""
    reference: str | None = None
    """Three-way mode: an FP32 capture R of the same model, checkpoint and batch (``--reference R.h5``)."""
    reference_mapping: RenameRules | None = None
    """Rename rules from R's names to A's (default: R is lined up with A by name)."""
    reference_factor: float = DEFAULT_REFERENCE_FACTOR
    """Three-way: B is off when its error against R exceeds this many times A's own error against R."""
    exact: bool = True
    """Same-stack exactness (``diff.exactness``): on one bitwise reproducible stack, a difference of any size where a
    module's inputs are bitwise identical is a divergence (``--no-exact`` turns it off)."""
    auto_mapping: bool = True
    """Without ``mapping``, pick the built-in mapping that fits the two captures (``--no-auto-mapping`` turns it off)."""
    jobs: int | None = None
    """Threads comparing tensor pairs (``--jobs``; default: env ``TENSORDIFF_JOBS``, else the usable cores, at most 8).
    The report is the same for any number."""

    def __post_init__(self) -> None:
        if self.jump <= 1:
            raise UsageError(f"jump={self.jump}: must be above 1 (an error must grow to count as introduced)")
        if self.ulp_k < 0:
            raise UsageError(f"ulp_k={self.ulp_k}: must be 0 or more")
        if self.jobs is not None and self.jobs < 1:
            raise UsageError(f"--jobs {self.jobs}: give a number of threads, 1 or more")


@dataclass(frozen=True)
class Accounted:
    """Why a record with no counterpart is accounted for (``diff.accounting``): the rule and its reason, in words."""

    rule: str
    why: str

    def as_dict(self) -> dict[str, str]:
        return {"rule": self.rule, "why": self.why}


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
    'skipped' (statistics cannot follow a transform), 'drift' (weights after an optimizer step
    differ, but nothing computed in that step does), 'uncertain' (paired by order and shape only,
    across modules whose names and classes disagree, and the values differ: never a divergence on its own) or
    'routed' (differs only through tokens two MoE routers sent to other experts on a near tie: ``diff.routing``)."""
    note: str = ""
    judged: str = ""
    """The dtype whose tolerance judged this pair."""
    ab: Metrics | None = None
    """Three-way mode: A vs B (``metrics`` then holds B vs the reference)."""
    ref_a: float = math.nan
    """Three-way mode: relative L2 of A against the reference."""
    linked: bool = False
    """An unmatched record whose tensor was compared under another record of its side (set by ``coverage``)."""
    not_recorded: bool = False
    """An unmatched record of a kind the other side never records (its ``not_recorded``; set by ``coverage``)."""
    exact: bool = False
    """Within tolerance, but diverged by same-stack exactness (``diff.exactness``): bitwise identical inputs on one
    bitwise reproducible stack, and an output that is not."""
    accounted: Accounted | None = None
    """An unmatched record accounted for by a rule of structure and value (``diff.accounting``): why."""

    @property
    def err(self) -> float:
        return self.metrics.rel_l2 if self.metrics is not None else math.nan


@dataclass
class PhaseCoverage:
    """How much of one phase was compared: records on each side, and those whose two tensors were judged."""

    phase: str
    recorded_a: int = 0
    recorded_b: int = 0
    compared_a: int = 0
    """A's records whose tensor was compared: in a pair judged ok, diverged or drift, or under another record
    of A holding the same tensor (``linked_a``)."""
    compared_b: int = 0
    linked_a: int = 0
    linked_b: int = 0
    only_a: int = 0
    """A's records with no counterpart whose tensor was not compared anywhere."""
    only_b: int = 0
    not_recorded_a: int = 0
    """A's records with no counterpart of a kind B says it never records (``not_recorded``: a graph-mode capture's
    cell inputs): accounted for, and said in the report."""
    not_recorded_b: int = 0
    accounted_a: int = 0
    """A's records with no counterpart accounted for by a rule of structure and value (``diff.accounting``)."""
    accounted_b: int = 0
    shape: int = 0
    """Pairs found but not compared: their shapes differ once B is in A's layout."""
    stats_only: int = 0
    """Pairs found but not compared: only statistics were stored, and they cannot follow the pair's transform."""
    uncertain: int = 0
    """Pairs made by order and shape only whose values differ."""

    @property
    def compared(self) -> int:
        """Pairs compared and judged."""
        return self.compared_a - self.linked_a

    @property
    def share_a(self) -> float:
        return self.compared_a / self.recorded_a if self.recorded_a else 1.0

    @property
    def share_b(self) -> float:
        return self.compared_b / self.recorded_b if self.recorded_b else 1.0

    def as_dict(self) -> dict[str, Any]:
        return {"recorded_a": self.recorded_a, "recorded_b": self.recorded_b, "compared": self.compared,
                "compared_a": self.compared_a, "compared_b": self.compared_b, "linked_a": self.linked_a,
                "linked_b": self.linked_b,
                "share_a": round(self.share_a, 6), "share_b": round(self.share_b, 6), "only_a": self.only_a,
                "only_b": self.only_b, "accounted_a": self.accounted_a, "accounted_b": self.accounted_b,
                "not_recorded_a": self.not_recorded_a, "not_recorded_b": self.not_recorded_b, "shape": self.shape,
                "stats_only": self.stats_only, "uncertain": self.uncertain}


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
    coverage: dict[str, PhaseCoverage] = field(default_factory=dict)
    """Per phase (in execution order): what was recorded and what was compared."""
    outcome: Outcome = "agree"
    """'diverged' (a first divergence), 'agree' (every recorded tensor compared or ignored on purpose by the
    mapping, all within tolerance) or 'inconclusive' (no divergence found, but not everything was compared)."""
    reasons: list[str] = field(default_factory=list)
    """Why the outcome is 'inconclusive', one sentence each."""
    mapping_note: str = ""
    """Which mapping lined the captures up, when it was picked automatically (or why none was)."""
    swapped: bool = False
    """The captures were given in the other order: ``path_a`` is the second path given, so that A is the mapping's
    first side (``autoselect.orient``); every row, verdict and hint is the one the other order gives."""
    rank_inconsistencies: list[str] = field(default_factory=list)
    interrupted: list[str] = field(default_factory=list)
    nonfinite: dict[str, str | None] = field(default_factory=dict)
    """Per side ('A', 'B'): the first record holding a NaN or an Inf, in execution order (None: none)."""
    exact: str = ""
    """Same-stack exactness held (``diff.exactness``): the stack and the evidence, in words ('' when it did not)."""
    findings: list[str] = field(default_factory=list)
    """Differences seen outside the pairs (an active dropout on one side): never passed over."""
    routing: list = field(default_factory=list)
    """Near-tie routing flips (``diff.routing.Flip``): MoE tokens two routers sent to other experts where rounding
    decided, and the records they account for (verdict 'routed')."""
    """Compared steps that a run's exception cut short: 'B step 0: RuntimeError: ...'."""
    """Records a side's rank files must hold identically (replicated, reduced) but do not: 'B: <label>: TP ranks 0/1
    differ'. The merged view reads the first rank's copy, so these are never passed over."""

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.outcome]

    def count(self, verdict: RowVerdict) -> int:
        return sum(1 for r in self.rows if r.verdict == verdict)

    def unmatched(self, side: Literal["a", "b"]) -> list[Row]:
        """Rows of ``side``'s records with no counterpart, whatever became of them (compared under another name,
        accounted for by a rule, of a kind the other side never records, or none of these: ``only_in``)."""
        return [r for r in self.rows if r.verdict == "unmatched" and (r.pair.a if side == "a" else r.pair.b) is not None]

    def only_in(self, side: Literal["a", "b"]) -> int:
        """``side``'s records with no counterpart that were compared nowhere and no rule accounts for: what makes a
        diff inconclusive (the text's and the JSON's 'only in A/B')."""
        if not self.coverage:
            return len(self.unmatched(side))
        return sum(getattr(c, f"only_{side}") for c in self.coverage.values())

    def linked(self, side: Literal["a", "b"]) -> int:
        """``side``'s records with no pair of their own whose tensor was compared under another of its names."""
        return sum(getattr(c, f"linked_{side}") for c in self.coverage.values())


@dataclass
class FirstDivergence:
    """Where the runs first part ways (``divergence.find_first_divergence``): the place and, as data, what
    ``explain.place`` turns into the sentence that says why (``tensordiff.explain.diagnose(...).explanation``)."""

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
    """The place in words: "in model.layers.0.mlp", "in the data-parallel gradient reduction", ..."""
    case: str = ""
    """Which kind of place ``location`` is (``divergence._locate``'s cases: "checkpoint", "optimizer_update",
    "module", "attention_core", "loss_grad", ...): what ``explain.place`` says about it."""
    where: dict[str, Any] = field(default_factory=dict)
    """The place as data (``module``, ``param``, ``between``, ...), as written to the JSON report."""
    facts: dict[str, Any] = field(default_factory=dict)
    """What else the explanation needs (a module's class, the dtype judged, where an origin's error grew to)."""
    uncompared: list[str] = field(default_factory=list)
    """Records that came into the diverged tensor but were not compared (unmatched, other shape, uncertain pair)."""

    def as_dict(self) -> dict[str, Any]:
        def num(v: float) -> float | None:
            return v if math.isfinite(v) else None

        return {
            "step": self.step, "phase": self.phase, "module_a": self.module_a, "module_b": self.module_b,
            "kind": self.kind, "slot": self.slot, "call": self.call, "tensor_a": self.label_a, "tensor_b": self.label_b,
            "rel_l2": num(self.rel_l2), "tolerance": self.tolerance, "incoming_rel_l2": num(self.incoming),
            "introduced": self.introduced, "location": self.location,
            "where": self.where, "uncompared_incoming": self.uncompared,
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
