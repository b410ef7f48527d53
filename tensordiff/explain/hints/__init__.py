"""Stage 4a, why: test the common causes of cross-framework divergence at the first divergence.

Each check rebuilds the diverged tensor from side A's captured tensors under one hypothesis
(B uses the tanh GELU, another norm epsilon, BF16 rounding, a permuted layout, a constant
factor, ...) and measures how much of the A-vs-B gap that explains:

    explained = 1 - rel_l2(hypothesis, B) / rel_l2(A, B)

A check that cannot first reproduce A itself from the same inputs says nothing (its
reconstruction would be guesswork); one with nothing to test on at this site (no 4-D q/k for
RoPE, no stored input, no bias) raises ``NotApplicable(reason)``, and ``run_checks`` returns a
``CheckStatus`` per cause: tested, or not and why. Hints are ranked by ``explained``; only those that
explain at least half of the gap are reported. One module per cause, one page each in
docs/hints/: ``activation``, ``norm``, ``rope``, ``dtype``, ``layout``, ``dropout``, ``loss``
(loss normalisation), ``aux_loss`` (a router's auxiliary loss in one side's loss or gradients), ``factor``,
``vocab`` (vocabulary padding), ``tied`` (tied embeddings on one side), ``router_norm`` (top-k router
probabilities renormalised on one side only), ``checkpoint`` (and a norm's ``1 + w`` offset), ``update`` (the optimizer step);
``base`` holds the site, the fit they share and ``NotApplicable``. Framework-free: numpy on
captured arrays.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
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

__all__ = ["CHECKED", "CHECKS", "MIN_EXPLAINED", "CheckStatus", "Hint", "NotApplicable", "find_hints",
           "hints_for_row", "run_checks"]


#: The checks run at a diverged pair, most specific first (a tie in ``explained`` keeps this order), each with
#: the cause it tests in words. A check raises ``NotApplicable(reason)`` when it has nothing to test on here.
#: A new cause is a new module here, an entry in CHECKS and CHECKED, and a page in docs/hints/.
CHECKS: tuple[tuple[str, Callable[[Site], Iterator[Hint]]], ...] = (
    ("dropout", check_dropout), ("RoPE", check_rope), ("attention scale", check_attention_scale),
    ("activation", check_activation),
    ("norm epsilon", check_norm_epsilon),
    ("dtype", check_dtype), ("layout", check_layout), ("bias", check_missing_bias),
    ("loss normalisation", check_loss_normalisation), ("aux loss", check_aux_loss), ("tied embeddings", check_tied),
    ("router normalisation", check_router_norm), ("constant factor", check_factor),
)
#: Every cause tested, in words, in the order reports name them; ``check_checkpoint`` (it needs the whole diff
#: result) runs first.
CHECKED = ("activation", "norm epsilon", "RoPE", "attention scale", "dtype", "layout", "bias", "dropout",
           "loss normalisation", "aux loss", "tied embeddings", "router normalisation", "constant factor",
           "vocabulary padding", "checkpoint", "optimizer step")


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


def run_checks(row: Row, ca: CaptureReader, cb: CaptureReader,
               result: DiffResult | None = None) -> tuple[list[Hint], list[CheckStatus]]:
    """Every check at one pair: the hints explaining at least MIN_EXPLAINED of the gap, ranked, and whether each
    cause could be tested (in CHECKED order; without ``result`` the checkpoint is not tested)."""
    if row.pair.a is None or row.pair.b is None:
        return [], _none_ran("only one side has this tensor")
    site = Site(row, ca, cb)
    problem = _site_problem(site)
    if problem:
        return [], _none_ran(problem)
    found: list[Hint] = []
    status: dict[str, CheckStatus] = {}
    checks: list[tuple[str, Callable[[Site], Iterator[Hint]]]] = list(CHECKS)
    causes = list(CHECKED)
    merged_tp = [c for c in (cb, ca) if c.tp > 1]
    if merged_tp:  # a side merged from tensor-parallel rank files (B; else A: the captures given the other way)
        checks.append(("partial sum", check_partial_sum if merged_tp[0] is cb else partial(mirrored, check_partial_sum)))
        causes.insert(causes.index("checkpoint"), "partial sum")
    if any(c.pp > 1 for c in (cb, ca)):  # merged from PP stage files
        checks.insert(0, ("pipeline stages", check_pipeline))  # ties: the handover before a factor of 0 or layout
        causes.insert(causes.index("checkpoint"), "pipeline stages")
    if result is not None:
        checks = [(c, (lambda s: check_aux_loss(s, result)) if c == "aux loss" else f) for c, f in checks]
        checks.insert(0, ("vocabulary padding", lambda s: check_vocab_padding(s, result)))
        checks.append(("checkpoint", lambda s: check_checkpoint(s, result)))  # ties: the specific cause (layout) first
        checks.append(("optimizer step", lambda s: check_update(s, result)))
    else:
        for cause in ("vocabulary padding", "checkpoint", "optimizer step"):
            status[cause] = CheckStatus(cause, False, "needs the whole diff")
    for cause, check in checks:
        try:
            found.extend(h for h in list(check(site)) if h.explained >= MIN_EXPLAINED)
            status[cause] = CheckStatus(cause, True)
        except NotApplicable as why:
            status[cause] = CheckStatus(cause, False, why.reason)
        except (ValueError, FloatingPointError, MemoryError) as err:  # a check that fails here says nothing
            status[cause] = CheckStatus(cause, False, f"it failed here ({type(err).__name__})")
    found.sort(key=lambda h: -round(h.explained, 3))  # ties: the more specific check (CHECKS order) first
    if found:  # a hint far behind the best one is a side effect of the same cause
        found = [h for h in found if h.explained >= found[0].explained - 0.2]
    return found, [status[c] for c in causes]


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
