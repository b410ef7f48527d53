"""Router-normalisation hint: an MoE block whose output differs on every token by that token's own factor, the sum
of its top-k router probabilities: one side renormalises the top-k probabilities to sum to 1 and the other does
not (Hugging Face's ``norm_topk_prob``, Mixtral always; megatron-core's ``moe_router_pre_softmax``, softmax over
every expert then top-k, does not renormalise; softmax over the k does).

The factor is read from dense router scores one side recorded (a Hugging Face gate's logits), through the softmax
over every expert, and the chosen experts (``diff.routing.routers``). See docs/hints/router-norm.md.
Framework-free.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ...diff.routing import routers
from .base import MIN_EXPLAINED, Hint, NotApplicable, Site, explained_share, make_hint, rel_l2


def _probabilities(scores: np.ndarray) -> np.ndarray:
    """Scores as probabilities over every expert: logits through a softmax; rows that already are probabilities
    (non-negative, summing to 1) as they are."""
    if np.all(scores >= 0) and np.allclose(scores.sum(axis=1), 1.0, atol=1e-3):
        return scores
    z = np.exp(scores - scores.max(axis=1, keepdims=True))
    return z / z.sum(axis=1, keepdims=True)


def check_router_norm(site: Site) -> Iterator[Hint]:
    """B = A / s or B = A * s token by token, s the sum of the token's top-k router probabilities."""
    a = site.a
    if a.phase != "forward" or a.kind != "output" or not site.ready or site.xa.ndim != 3:
        raise NotApplicable("not a block's 3-D forward output")
    d0, d1, hidden = site.xa.shape
    found = routers(site.row, site.ca, site.cb, (d0, d1))
    if found is None:
        raise NotApplicable("no router's choice of experts recorded inside this module on both sides")
    # [T]: each token's top-k probability mass, from scores over every expert, else from a side's recorded top-k
    # probabilities that do not sum to 1 (that side does not renormalise)
    masses = [m for m in (found.mass_a, found.mass_b) if m is not None and not np.allclose(m, 1.0, atol=1e-3)]
    if found.scores is not None:
        top = (_probabilities(found.scores) * found.sets_a).sum(axis=1)
    elif masses:
        top = masses[0]
    else:
        raise NotApplicable("neither router's scores over every expert, nor top-k probabilities that do not sum to 1, "
                            "were recorded")
    if np.all(np.abs(top - 1.0) < 1e-3):
        return  # both renormalise already (or k = E): nothing for a renormalisation to change
    # tokens the two routers sent to other experts (a near tie in a narrow dtype) are left out of the fit
    same = np.all(found.sets_a == found.sets_b, axis=1)
    if same.sum() < 0.75 * same.size:
        return
    xa = site.xa.reshape(d0 * d1, hidden)[same]
    xb = site.xb.reshape(d0 * d1, hidden)[same]
    top = top[same]
    fits = {side: rel_l2(xa * f[:, None], xb)
            for side, f in (("A", 1.0 / np.maximum(top, 1e-30)), ("B", top))}
    side = min(fits, key=lambda k: fits[k])
    after, before = fits[side], rel_l2(xa, xb)
    if explained_share(before, after) < MIN_EXPLAINED:
        return
    other = "B" if side == "A" else "A"
    apart = int(same.size - same.sum())
    hint = make_hint(
        "router-norm",
        f"{side}'s MoE output is the other's times each token's sum of its top-k router probabilities (from "
        f"{float(top.min()):.2f} to {float(top.max()):.2f}): {other} renormalises the top-k probabilities to sum to "
        f"1 and {side} does not (Hugging Face's norm_topk_prob; megatron-core's moe_router_pre_softmax = softmax over "
        "every expert then top-k, which does not renormalise)",
        site, after, f"B = A {'/' if side == 'A' else '×'} s token by token reproduces B to rel L2 {after:.1e}"
        + (f" over the {int(same.sum())} tokens both routers sent to the same experts ({apart} routed apart)"
           if apart else ""), not_renormalised=side)
    hint.explained = explained_share(before, after)
    yield hint
