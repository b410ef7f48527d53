"""Stage 4a, why: test the common causes of cross-framework divergence at the first divergence.

Each check rebuilds the diverged tensor from side A's captured tensors under one hypothesis
(B uses the tanh GELU, another norm epsilon, BF16 rounding, a permuted layout, a constant
factor, ...) and measures how much of the A-vs-B gap that explains:

    explained = 1 - rel_l2(hypothesis, B) / rel_l2(A, B)

A check that cannot first reproduce A itself from the same inputs says nothing (its
reconstruction would be guesswork); one with nothing to test on at this site (no 4-D q/k for
RoPE, no stored input, no bias) raises ``NotApplicable(reason)``, and ``run_checks`` returns a
``CheckStatus`` per cause: tested, or not and why. Hints are ranked by ``explained``; only those that
explain at least half of the gap are reported. ``CHECKS`` is the one table of causes: each with its
check, its rank among the others (ties) and what it needs. One module per cause, one page each in
docs/hints/: ``activation``, ``norm``, ``rope``, ``attention`` (the attention scale), ``dtype``, ``layout`` (and a
missing bias), ``dropout``, ``loss`` (loss normalisation), ``aux_loss`` (a router's auxiliary loss in one side's loss
or gradients), ``factor``, ``vocab`` (vocabulary padding), ``tied`` (tied embeddings on one side), ``router_norm``
(top-k router probabilities renormalised on one side only), ``checkpoint`` (and a norm's ``1 + w`` offset), ``update``
(the optimizer step; ``adam``: Adam's update rebuilt), ``parallel`` (a tensor-parallel partial sum), ``pipeline``
(the pipeline stages' handover and tied copies);
``base`` holds the site, the fit they share and ``NotApplicable``. Framework-free: numpy on captured arrays.
README.md here says how to add a cause.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import numpy as np

from ...diff.result import DiffResult, Row
from ...store import CaptureReader, open_capture
from .activation import check_activation
from .attention import check_attention_scale
from .aux_loss import check_aux_loss
from .base import MIN_EXPLAINED, CheckStatus, Hint, NotApplicable, Site, mirrored
from .checkpoint import check_checkpoint
from .dropout import check_dropout
from .dtype import check_dtype
from .factor import check_factor
from .layout import check_layout, check_missing_bias
from .loss import check_loss_normalisation
from .norm import check_norm_epsilon
from .parallel import check_partial_sum
from .pipeline import check_pipeline
from .rope import check_rope
from .router_norm import check_router_norm
from .tied import check_tied
from .update import check_update
from .vocab import check_vocab_padding

__all__ = ["CHECKED", "CHECKS", "MIN_EXPLAINED", "Check", "CheckStatus", "Hint", "NotApplicable", "find_hints",
           "hints_for_row", "run_checks"]

#: What a check needs (``Check.needs``).
SITE = "the site"
"""A's and B's tensors at the pair: always tested; called ``fn(site)``."""
DIFF = "the whole diff"
"""The diff result too (other rows, other steps): called ``fn(site, result)``; without one, not tested ("needs the
whole diff")."""
DIFF_IF_GIVEN = "the whole diff, when given"
"""The diff result where there is one: called ``fn(site, result)``, ``result`` None without it; always tested."""
TP_RANKS = "a side merged from tensor-parallel rank files"
"""Tested only then; written for B merged, mirrored (``base.mirrored``) when A is (the captures given the other
way)."""
PP_STAGES = "a side merged from pipeline stage files"
"""Tested only then."""


@dataclass(frozen=True)
class Check:
    """One cause tested at a diverged pair: its name in words (as the report names it), the check, and what it
    needs."""

    cause: str
    fn: Callable[..., Iterator[Hint]]
    """Yields the hints of this cause; raises ``NotApplicable(reason)`` when it has nothing to test on here."""
    rank: int
    """Its place in the run: a tie in ``explained`` goes to the lower rank, the more specific cause."""
    needs: str = SITE
    """``SITE``, ``DIFF``, ``DIFF_IF_GIVEN``, ``TP_RANKS`` or ``PP_STAGES``."""


#: Every cause, in the order reports name them, each with its check, its rank (the order they run in, most specific
#: first: vocabulary padding and the pipeline's handover before a factor of 0 or a layout, a layout before the
#: checkpoint) and what it needs. A new cause is a new module here, a ``Check`` in this table at its place in the
#: report with its rank among the others, and a page in docs/hints/.
CHECKS: tuple[Check, ...] = (
    Check("activation", check_activation, 5),
    Check("norm epsilon", check_norm_epsilon, 6),
    Check("RoPE", check_rope, 3),
    Check("attention scale", check_attention_scale, 4),
    Check("dtype", check_dtype, 7),
    Check("layout", check_layout, 8),
    Check("bias", check_missing_bias, 9),
    Check("dropout", check_dropout, 2),
    Check("loss normalisation", check_loss_normalisation, 10),
    Check("aux loss", check_aux_loss, 11, needs=DIFF_IF_GIVEN),
    Check("tied embeddings", check_tied, 12),
    Check("router normalisation", check_router_norm, 13),
    Check("constant factor", check_factor, 14),
    Check("vocabulary padding", check_vocab_padding, 0, needs=DIFF),
    Check("partial sum", check_partial_sum, 15, needs=TP_RANKS),
    Check("pipeline stages", check_pipeline, 1, needs=PP_STAGES),
    Check("checkpoint", check_checkpoint, 16, needs=DIFF),
    Check("optimizer step", check_update, 17, needs=DIFF),
)
#: The causes tested at every pair, in words, in the order reports name them (those needing a merged side are
#: tested only where there is one).
CHECKED = tuple(c.cause for c in CHECKS if c.needs not in (TP_RANKS, PP_STAGES))


def _none_ran(reason: str) -> list[CheckStatus]:
    return [CheckStatus(cause, False, reason) for cause in CHECKED]


def _site_problem(site: Site) -> str:
    """Why no check can run at this pair at all, or ''."""
    if not site.ready:
        if site.ca.array(site.a) is None or site.cb.array(site.b) is None:
            return "the tensors are not stored"
        return "A's and B's tensors have other shapes"
    if not site.before > 0:
        return "A and B are equal" if site.before == 0 else "their distance is not finite"
    if not np.all(np.isfinite(site.xa)) or not np.all(np.isfinite(site.xb)):
        return "NaN or Inf in A or B"
    return ""


def _bound(check: Check, ca: CaptureReader, cb: CaptureReader,
           result: DiffResult | None) -> Callable[[Site], Iterator[Hint]] | str | None:
    """``check`` as a function of the site alone; the reason it is not tested; or None where it does not apply
    (no merged side: it is not named)."""
    if check.needs == TP_RANKS:
        merged = [c for c in (cb, ca) if c.tp > 1]  # merged from tensor-parallel rank files
        if not merged:
            return None
        return check.fn if merged[0] is cb else partial(mirrored, check.fn)
    if check.needs == PP_STAGES:
        return check.fn if any(c.pp > 1 for c in (cb, ca)) else None  # merged from pipeline stage files
    if check.needs == DIFF and result is None:
        return "needs the whole diff"
    if check.needs in (DIFF, DIFF_IF_GIVEN):
        return partial(_with_result, check.fn, result)
    return check.fn


def _with_result(fn: Callable[..., Iterator[Hint]], result: DiffResult | None, site: Site) -> Iterator[Hint]:
    return fn(site, result)


def run_checks(row: Row, ca: CaptureReader, cb: CaptureReader,
               result: DiffResult | None = None) -> tuple[list[Hint], list[CheckStatus]]:
    """Every check at one pair: the hints explaining at least MIN_EXPLAINED of the gap, ranked, and whether each
    cause could be tested (in CHECKS order; without ``result`` those needing the whole diff are not tested)."""
    if row.pair.a is None or row.pair.b is None:
        return [], _none_ran("only one side has this tensor")
    site = Site(row, ca, cb)
    problem = _site_problem(site)
    if problem:
        return [], _none_ran(problem)
    found: list[Hint] = []
    status: dict[str, CheckStatus] = {}
    runs: list[tuple[Check, Callable[[Site], Iterator[Hint]]]] = []
    for check in CHECKS:
        fn = _bound(check, ca, cb, result)
        if isinstance(fn, str):
            status[check.cause] = CheckStatus(check.cause, False, fn)
        elif fn is not None:
            runs.append((check, fn))
    for check, fn in sorted(runs, key=lambda run: run[0].rank):
        try:
            found.extend(h for h in list(fn(site)) if h.explained >= MIN_EXPLAINED)
            status[check.cause] = CheckStatus(check.cause, True)
        except NotApplicable as why:
            status[check.cause] = CheckStatus(check.cause, False, why.reason)
        except (ValueError, FloatingPointError, MemoryError) as err:  # a check that fails here says nothing
            status[check.cause] = CheckStatus(check.cause, False, f"it failed here ({type(err).__name__})")
    found.sort(key=lambda h: -round(h.explained, 3))  # ties: the more specific check (the lower rank) first
    if found:  # a hint far behind the best one is a side effect of the same cause
        found = [h for h in found if h.explained >= found[0].explained - 0.2]
    return found, [status[c.cause] for c in CHECKS if c.cause in status]


def hints_for_row(row: Row, ca: CaptureReader, cb: CaptureReader, result: DiffResult | None = None) -> list[Hint]:
    """Every check at one pair, ranked; only hints explaining at least MIN_EXPLAINED of the gap."""
    return run_checks(row, ca, cb, result)[0]


def find_hints(result: DiffResult, ca: CaptureReader | None = None,
               cb: CaptureReader | None = None) -> tuple[list[Hint], str, list[CheckStatus]]:
    """Hints at the first divergence, a note when they cannot run (tensors not stored), and whether each cause
    could be tested there (empty without a first divergence)."""
    first = result.first
    if first is None:
        return [], "", []
    row = next((r for r in result.rows if r.pair.a is not None and r.step == first.step and r.phase == first.phase
                and r.pair.a.label == first.label_a and (r.pair.b is None or r.pair.b.label == first.label_b)), None)
    if row is None or row.pair.b is None:
        return [], "", _none_ran("no matched pair at the first divergence")
    if not (row.pair.a.has_data and row.pair.b.has_data):  # type: ignore[union-attr]
        return [], (f"no hints: step {first.step} holds statistics only; capture with --tensors all "
                    "to test the likely causes there"), _none_ran("statistics only")
    if ca is None or cb is None:
        with open_capture(result.path_a) as ca, open_capture(result.path_b) as cb:
            return find_hints(result, ca, cb)
    with np.errstate(all="ignore"):
        hints, checks = run_checks(row, ca, cb, result)
        return hints, "", checks
