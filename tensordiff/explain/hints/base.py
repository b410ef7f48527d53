"""What every check shares: the hint, the diverged site with A's tensors around it, the fit of both sides, and
how a check says it could not run here.

    explained = 1 - rel_l2(hypothesis, B) / rel_l2(A, B)

A check that cannot first reproduce A itself from the same inputs says nothing (``fit_sides``): it ran, and its
cause does not fit. A check that has nothing to test on at this site (no 4-D q/k for RoPE, no input stored, no
bias) raises ``NotApplicable(reason)`` before it yields anything; the report lists it as not tested, with the
reason.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ... import dtypes
from ...diff.metrics import rel_l2
from ...diff.result import Row
from ...record import Record, is_inside
from ...store import CaptureReader

#: A hint must explain at least this share of the gap to be reported.
MIN_EXPLAINED = 0.5


class NotApplicable(Exception):
    """Raised by a check that cannot test its cause at this site; ``reason`` is a short phrase ("needs a 4-D
    tensor, this one is 2-D") that the report prints after the cause's name."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class CheckStatus:
    """Whether one cause was tested at the first divergence, and if not, why."""

    cause: str
    """The cause in words, as the report names it: activation, norm epsilon, RoPE, ... (``CHECKED``)."""
    ran: bool
    """The check ran on the captured tensors (whether or not its cause fit)."""
    reason: str = ""
    """Why it could not run ('' when it ran)."""

    def as_dict(self) -> dict[str, Any]:
        return {"cause": self.cause, "ran": self.ran, "reason": self.reason or None}


@dataclass
class Hint:
    cause: str
    """Short name: activation, norm-epsilon, rope, dtype, layout, missing-bias, factor, checkpoint."""
    title: str
    """One sentence: what B does differently."""
    explained: float
    """Share of the A-vs-B gap this hypothesis explains (0..1)."""
    before: float
    """rel L2 of A vs B."""
    after: float
    """rel L2 of the hypothesis (built from A's tensors) vs B."""
    evidence: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"cause": self.cause, "title": self.title, "explained": round(self.explained, 6),
                "rel_l2_before": self.before, "rel_l2_after": self.after, "evidence": self.evidence,
                "details": self.details}


def describe(rec: Record) -> str:
    """What kind of tensor ``rec`` is, for a reason: "a parameter", "a gradient", "a forward input", ..."""
    return {"weights": "a parameter", "param_grad": "a parameter gradient", "loss": "the loss",
            "backward": "a gradient"}.get(rec.phase, f"a {rec.phase} {rec.kind}")


def explained_share(before: float, after: float) -> float:
    if not math.isfinite(after) or before <= 0:
        return 0.0
    return max(0.0, min(1.0, 1.0 - after / before))


# ----------------------------------------------------------------------------- the site
#: How far a float64 rebuild of a narrow-dtype computation may be from it and still stand for it, in roundings of
#: that dtype (``Site.reproduces``).
REBUILD_ROUNDINGS = 4


class Site:
    """The diverged pair and what side A captured around it."""

    def __init__(self, row: Row, ca: CaptureReader, cb: CaptureReader):
        self.row = row
        self.a: Record = row.pair.a  # type: ignore[assignment]
        self.b: Record = row.pair.b  # type: ignore[assignment]
        self.ca, self.cb = ca, cb
        self.recs_a = ca.records(self.a.step)
        self.by_seq = {r.seq: r for r in self.recs_a}
        xa = row.pair.a_tensor(ca.array)
        try:
            xb = row.pair.b_tensor(cb.array)
        except Exception:
            xb = None
        #: both tensors were stored, and have one shape once B is in A's layout
        self.ready = xa is not None and xb is not None and xa.shape == xb.shape
        if any(x is not None and x.dtype.kind == "c" for x in (xa, xb)):
            self.ready, xa, xb = False, None, None  # no hint models complex values (the row compares them as pairs)
        self.xa: np.ndarray = np.asarray(xa if xa is not None else (), dtype=np.float64)
        self.xb: np.ndarray = np.asarray(xb if xb is not None else (), dtype=np.float64)
        self.before = rel_l2(self.xa, self.xb) if self.ready else math.nan
        self._weights: dict[str, dict[str, np.ndarray]] = {}
        self._inputs: dict[tuple[str, int], list[tuple[Record, np.ndarray]]] = {}

    def reproduces(self, residual: float, before: float | None = None) -> bool:
        """A rebuild (computed in float64 from A's own tensors) that is ``residual`` (relative L2) away from A stands for
        A's computation: within 5% of the gap, or, where the gap is wide, within ``REBUILD_ROUNDINGS`` roundings of the
        dtype the pair was judged in (a BF16 attention rounds its scores, softmax and output; a float64 rebuild of it
        cannot come closer), and never more than half the gap (``before``: the gap where the rebuild covers part of
        the tensor)."""
        gap = self.before if before is None else before
        floor = REBUILD_ROUNDINGS * dtypes.resolution(self.row.judged or self.a.dtype)
        return residual <= min(0.5 * gap, max(0.05 * gap, floor))

    def array(self, rec: Record) -> np.ndarray | None:
        x = self.ca.array(rec)
        return None if x is None else x.astype(np.float64)

    def weights(self, module: str) -> dict[str, np.ndarray]:
        """A's parameters of ``module`` at this step (read once; several checks ask)."""
        if module not in self._weights:
            self._weights[module] = {r.slot: x for r in self.recs_a if r.phase == "weights" and r.module == module
                                     for x in [self.array(r)] if x is not None}
        return self._weights[module]

    def inputs(self, module: str, call: int) -> list[np.ndarray]:
        """A's floating-point inputs of that call, in record order (read once)."""
        return [x for _, x in self.input_records(module, call)]

    def input_records(self, module: str, call: int) -> list[tuple[Record, np.ndarray]]:
        """A's floating-point inputs of that call with their records, in record order (read once)."""
        if (module, call) not in self._inputs:
            self._inputs[(module, call)] = [
                (r, x) for r in self.recs_a
                if r.phase == "forward" and r.kind == "input" and r.module == module and r.call == call
                for x in [self.array(r)] if x is not None and np.issubdtype(x.dtype, np.floating)]
        return self._inputs[(module, call)]

    def earlier_outputs(self, limit: int = 4) -> Iterator[Record]:
        """A's forward outputs made just before the diverged tensor inside the same parent call, newest first."""
        a = self.a
        parent = a.parent if a.kind == "input" else a.module
        found = 0
        for r in sorted(self.recs_a, key=lambda r: -r.seq):
            if r.seq >= a.seq or r.phase != "forward" or r.kind != "output":
                continue
            if parent and not is_inside(r.module, parent):
                continue
            if r.module == a.module:
                continue
            yield r
            found += 1
            if found >= limit:
                return


def fit_sides(site: Site, outs: dict) -> tuple[Any, Any, float] | None:
    """Of candidate rebuilds, the one closest to A and the one closest to B: (key A, key B, the larger residual), or
    None when no candidate reproduces A (the inputs are not this op's) or A's and B's best are the same."""
    if not outs:
        return None
    key_a = min(outs, key=lambda k: rel_l2(outs[k], site.xa))
    if not site.reproduces(rel_l2(outs[key_a], site.xa)):
        return None
    key_b = min(outs, key=lambda k: rel_l2(outs[k], site.xb))
    if key_b == key_a:
        return None
    # what is left is the larger of the two rebuilds' residuals: the same whichever capture is given first
    return key_a, key_b, max(rel_l2(outs[key_b], site.xb), rel_l2(outs[key_a], site.xa))


def make_hint(cause: str, title: str, site: Site, after: float, evidence: str = "", **details: Any) -> Hint:
    return Hint(cause, title, explained_share(site.before, after), site.before, after, evidence, details)


#: A side's name in a hint's sentence ("B's", "matches A", "reproduces A"), not a letter of a shape ("[B, S, H]")
_SIDE = re.compile(r"(?<!\[)\b([AB])\b(?![,\]])")


def mirrored(check: Callable[[Site], Iterator[Hint]], site: Site) -> Iterator[Hint]:
    """``check``, written for B merged from rank files, with the sides' roles exchanged (A is the merged run and B
    the reference: the captures given the other way): run on the mirrored pair of a same-layout record (no
    transform, join or returned bias), its sentences' A and B swapped back."""
    pair = site.row.pair
    if pair.ops or pair.join is not None or pair.bias_a is not None or pair.bias_b is not None:
        raise NotApplicable("A's record is transformed or joined by the mapping")
    mirror = Site(dataclasses.replace(site.row, pair=dataclasses.replace(pair, a=pair.b, b=pair.a)), site.cb, site.ca)

    def swap(text: str) -> str:
        return _SIDE.sub(lambda m: "B" if m.group(1) == "A" else "A", text)

    for hint in check(mirror):
        yield dataclasses.replace(hint, title=swap(hint.title), evidence=swap(hint.evidence))
