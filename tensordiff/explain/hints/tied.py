"""Tied-embedding hint: one side shares its output layer's weight with the embedding (tied), the other keeps two.

A tied weight's gradient is the sum of the embedding's and the output layer's: the embedding gradients of the two
sides then differ by exactly the untied side's output-layer gradient. See docs/hints/tied.md. Framework-free.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from .base import MIN_EXPLAINED, Hint, NotApplicable, Site, explained_share, make_hint, rel_l2


def _other_grads(site: Site, side: str) -> Iterator[tuple[str, np.ndarray]]:
    """The other parameter gradients of one side's step with the diverged tensor's shape: (module, values)."""
    cap, rec = (site.ca, site.a) if side == "A" else (site.cb, site.b)
    for r in cap.records(rec.step):
        if r.phase == "param_grad" and r.kind == "grad" and r.module != rec.module and r.has_data \
                and int(np.prod(r.shape)) == site.xa.size and r.same_as < 0:
            x = cap.array(r)
            if x is not None:
                yield r.module, np.asarray(x, dtype=np.float64).reshape(site.xa.shape)


def check_tied(site: Site) -> Iterator[Hint]:
    """B's embedding gradient = A's + A's output-layer gradient (B tied, A not), or the reverse."""
    if site.a.phase != "param_grad" or site.xa.ndim != 2:
        raise NotApplicable(f"not a parameter gradient of a matrix ({site.a.phase})")
    tried = False
    for side, untied_x, tied_x in (("A", site.xa, site.xb), ("B", site.xb, site.xa)):
        for module, g in _other_grads(site, side):  # the untied side's own output layer
            tried = True
            after = rel_l2(untied_x + g, tied_x)
            if explained_share(site.before, after) >= MIN_EXPLAINED:
                tied = "B" if side == "A" else "A"
                own = site.a.module if side == "A" else site.b.module
                yield make_hint("tied", f"{tied} ties its output layer to this embedding (one weight: both gradients "
                                f"summed), {side} keeps its own ({module}): share_embeddings_and_output_weights / "
                                "tie_word_embeddings differ between the runs", site, after,
                                f"{side}'s {own} gradient + its {module} gradient reproduces {tied}'s to rel L2 "
                                f"{after:.1e}", untied_output=module)
                return
    if not tried:
        raise NotApplicable("no other gradient of this shape on either side (an output layer to tie)")
