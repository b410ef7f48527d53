"""Stage 4a, why: test the common causes of cross-framework divergence at the first divergence.

Each check rebuilds the diverged tensor from side A's captured tensors under one hypothesis
(B uses the tanh GELU, another norm epsilon, BF16 rounding, a permuted layout, a constant
factor, ...) and measures how much of the A-vs-B gap that explains:

    explained = 1 - rel_l2(hypothesis, B) / rel_l2(A, B)

A check that cannot first reproduce A itself from the same inputs says nothing (its
reconstruction would be guesswork). Hints are ranked by ``explained``; only those that
explain at least half of the gap are reported. One module per cause, one page each in
docs/hints/: ``activation``, ``norm``, ``rope``, ``dtype``, ``layout``, ``factor``,
``checkpoint``; ``base`` holds the site and the fit they share. Framework-free: numpy on
captured arrays.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from ...diff.result import DiffResult, Row
from ...store import CaptureFile
from .activation import check_activation, check_activation_backward
from .base import MIN_EXPLAINED, Hint, Site
from .checkpoint import check_checkpoint
from .dtype import check_dtype
from .factor import check_factor
from .layout import check_layout
from .norm import check_norm_epsilon
from .rope import check_rope, check_rope_table

__all__ = ["CHECKED", "CHECKS", "MIN_EXPLAINED", "Hint", "find_hints", "hints_for_row"]


#: The checks run at a diverged pair, most specific first (a tie in ``explained`` keeps this order).
#: A new cause is a new module here, an entry in CHECKS and a page in docs/hints/.
CHECKS: tuple[Callable[[Site], Iterator[Hint]], ...] = (
    check_rope_table, check_activation, check_activation_backward, check_norm_epsilon, check_rope, check_dtype,
    check_layout, check_factor,
)
#: What the checks test, in words (reports name them when none fires); ``check_checkpoint`` runs first.
CHECKED = ("activation", "norm epsilon", "RoPE", "dtype", "layout", "bias", "constant factor", "checkpoint")


def hints_for_row(row: Row, ca: CaptureFile, cb: CaptureFile, result: DiffResult | None = None) -> list[Hint]:
    """Every check at one pair, ranked; only hints explaining at least MIN_EXPLAINED of the gap."""
    if row.pair.a is None or row.pair.b is None:
        return []
    site = Site(row, ca, cb)
    if not site.ready or not site.before > 0 or not np.all(np.isfinite(site.xa)) or not np.all(np.isfinite(site.xb)):
        return []
    found: list[Hint] = []
    if result is not None:
        found.extend(check_checkpoint(site, result))
    for check in CHECKS:
        try:
            found.extend(h for h in check(site) if h.explained >= MIN_EXPLAINED)
        except (ValueError, FloatingPointError, MemoryError):
            continue  # a check that cannot run on this tensor says nothing
    found.sort(key=lambda h: -round(h.explained, 3))  # ties: the more specific check (CHECKS order) first
    if found:  # a hint far behind the best one is a side effect of the same cause
        found = [h for h in found if h.explained >= found[0].explained - 0.2]
    return found


def find_hints(result: DiffResult, ca: CaptureFile | None = None, cb: CaptureFile | None = None) -> tuple[list[Hint], str]:
    """Hints at the first divergence, and a note when they cannot run (tensors not stored)."""
    first = result.first
    if first is None:
        return [], ""
    row = next((r for r in result.rows if r.pair.a is not None and r.step == first.step and r.phase == first.phase
                and r.pair.a.label == first.label_a), None)
    if row is None or row.pair.b is None:
        return [], ""
    if not (row.pair.a.has_data and row.pair.b.has_data):  # type: ignore[union-attr]
        return [], (f"no hints: step {first.step} holds statistics only; capture with --tensors all "
                    "to test the likely causes there")
    if ca is None or cb is None:
        with CaptureFile(result.path_a) as ca, CaptureFile(result.path_b) as cb:
            return find_hints(result, ca, cb)
    with np.errstate(all="ignore"):
        return hints_for_row(row, ca, cb, result), ""
