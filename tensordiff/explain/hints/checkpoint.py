"""Checkpoint hint: the weights already differ before the first step; every differing parameter named (and a norm
weight off by exactly one: the ``1 + w`` convention of Gemma's norms, added or forgotten by a conversion)

See docs/hints/checkpoint.md."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ... import dtypes
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
    offset = _norm_offset(site)
    if offset is not None:
        yield Hint("norm-offset", f"B's {site.b.module}.{site.b.slot} is A's {offset:+g} (as compared): one side keeps "
                   f"a norm weight w where the other keeps {abs(offset):g} + w. A norm that multiplies by "
                   f"({abs(offset):g} + w) (Gemma's RMSNorm) needs a converted weight of {abs(offset):g} + w where "
                   "the other side multiplies by w (megatron-core's RMSNorm without layernorm_zero_centered_gamma): "
                   "the conversion added or forgot the offset", 1.0, site.before, 0.0,
                   f"B - A = {offset:g} in every element (spread {float(np.std(site.xb - site.xa)):.1e}); {shown}",
                   {"offset": offset, "parameters": [n.split(" (")[0] for n in names]})
    yield Hint("checkpoint", f"The runs did not start from the same weights: {len(bad)} parameter(s) differ at step "
               f"{site.a.step}{zeros}", 1.0, site.before, 0.0,
               f"{shown}; compare the checkpoints with tensordiff ckpt diff", {"parameters": [n.split(" (")[0] for n in names]})


def _norm_offset(site: Site) -> float | None:
    """B - A when it is one constant of magnitude 1 (a norm's ``1 + w`` convention) in a 1-D weight, else None."""
    if not site.ready or site.xa.ndim != 1 or site.a.slot != "weight" or site.xa.size < 2:
        return None
    d = site.xb - site.xa
    c = float(np.mean(d))
    scale = max(float(np.max(np.abs(site.xa))), float(np.max(np.abs(site.xb))), 1.0)
    spread = 4 * dtypes.resolution(site.row.judged or site.a.dtype) * scale
    if abs(abs(c) - 1.0) > spread or float(np.max(np.abs(d - c))) > spread:
        return None
    return round(c)
