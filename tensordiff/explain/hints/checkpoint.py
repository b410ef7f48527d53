"""Checkpoint hint: the weights already differ before the first step; every differing parameter named

See docs/hints/checkpoint.md."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ...diff.result import DiffResult
from .base import Hint, NotApplicable, Site


def check_checkpoint(site: Site, result: DiffResult) -> Iterator[Hint]:
    """Weights already differ before the first step: name every parameter that differs. A first divergence after
    them means they were compared and agree (the cause is tested and ruled out), unless none were captured."""
    first = result.steps[0]
    if site.a.phase != "weights" or site.a.step != first:
        if not any(r.step == first and r.phase == "weights" and r.metrics is not None for r in result.rows):
            raise NotApplicable(f"no weights compared at step {first}")
        return
    bad = [r for r in result.rows if r.step == site.a.step and r.phase == "weights" and r.verdict == "diverged"
           and r.pair.a is not None]
    names = [f"{r.pair.a.module}.{r.pair.a.slot} ({r.err:.1e})" for r in bad]  # type: ignore[union-attr]
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    zeros = ""
    if site.ready and not np.any(site.xb) and np.any(site.xa):
        zeros = (f"; B's {site.b.module or '<model>'}.{site.b.slot} is all zeros: not loaded (or dropped) by B's "
                 "conversion")
    yield Hint("checkpoint", f"The runs did not start from the same weights: {len(bad)} parameter(s) differ at step "
               f"{site.a.step}{zeros}", 1.0, site.before, 0.0,
               f"{shown}; compare the checkpoints with tensordiff ckpt diff", {"parameters": [n.split(" (")[0] for n in names]})
