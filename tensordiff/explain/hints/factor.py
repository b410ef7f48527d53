"""Factor hints: B = c × A (a loss reduction, DP averaging, gradient accumulation, a loss scale)

See docs/hints/factor.md."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from .base import MIN_EXPLAINED, Hint, NotApplicable, Site, explained_share, make_hint, rel_l2


def check_factor(site: Site) -> Iterator[Hint]:
    """B = c * A: a loss reduction (sum vs mean), DP averaging, gradient accumulation, a loss scale."""
    aa = float(np.vdot(site.xa, site.xa))
    if aa == 0:
        raise NotApplicable("A is all zeros")
    c = float(np.vdot(site.xa, site.xb)) / aa
    after = rel_l2(c * site.xa, site.xb)
    if abs(c - 1.0) < 1e-6 or explained_share(site.before, after) < MIN_EXPLAINED:
        return
    names = []
    for n in (2, 3, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096):
        for value, text in ((n, f"{n}"), (1.0 / n, f"1/{n}")):
            if abs(c - value) <= 0.02 * value:
                names.append(text)
    why = (f"≈ {names[0]}: a sum vs mean over {names[0].split('/')[-1]} (tokens, micro-batches, ranks), "
           "DP averaging, gradient accumulation or a loss scale not undone" if names else
           "a scale applied on one side only (loss scale, learning-rate-like factor, init or checkpoint scaling)")
    yield make_hint("factor", f"B = {c:.6g} × A ({why})", site, after,
                f"the least-squares factor {c:.6g} reproduces B to rel L2 {after:.1e}", factor=c)
