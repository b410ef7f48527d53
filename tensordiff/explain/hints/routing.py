"""Routing hint: a mixture-of-experts block whose output differs on a few tokens only, those the two routers sent to
other experts because their router scores were a near tie that rounding decides.

Each side's routing is read from what its router recorded inside the block: a boolean routing map ``[T, E]``
(megatron-core's router, its second output), top-k probabilities with k non-zeros per row (its first), or dense
logits ``[T, E]`` (a Hugging Face gate), whose top k are taken. Tokens are lined up through the block's output
layout (``[S, B]`` on one side, ``[B, S]`` on the other). See docs/hints/routing.md. Framework-free.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from ... import dtypes
from ...record import Record
from .base import Hint, NotApplicable, Site, make_hint, rel_l2

#: A token's k-th and (k+1)-th router scores within this many roundings of the dtype (of the token's largest score)
#: are a near tie: the inputs of both routers already differ by a few roundings, so either choice is the same program's.
NEAR_TIE_ROUNDINGS = 8


def _router_records(recs: list[Record], block: str, tokens: int) -> list[Record]:
    """Records inside ``block`` (a module and its children) of shape [tokens, E], E > 1, in the order they ran."""
    return [r for r in recs if r.phase == "forward" and r.kind == "output" and r.has_data and len(r.shape) == 2
            and r.shape[0] == tokens and r.shape[1] > 1 and (r.module == block or r.module.startswith(block + "."))]


def _routing(cap: Any, recs: list[Record], block: str, tokens: int, k: int | None) -> tuple[np.ndarray, np.ndarray | None] | None:
    """(top-k sets as a bool [T, E], dense scores [T, E] or None) of one side's router inside ``block``."""
    sets, scores = None, None
    for r in _router_records(recs, block, tokens):
        x = np.asarray(cap.array(r))
        if x.dtype == bool:
            sets = x if sets is None else sets
        else:
            x = x.astype(np.float64)
            nz = np.count_nonzero(x, axis=1)
            if np.all(nz == nz[0]) and nz[0] < x.shape[1]:
                sets = (x != 0) if sets is None else sets  # top-k probabilities, zero elsewhere
            elif scores is None:
                scores = x
    if sets is None and scores is not None and k:
        top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        sets = np.zeros(scores.shape, dtype=bool)
        np.put_along_axis(sets, top, True, axis=1)
    return None if sets is None else (sets, scores)


def check_routing(site: Site) -> Iterator[Hint]:
    """The block's output differs on the tokens the routers sent to other experts, on near ties only."""
    a, b = site.a, site.b
    if a.phase != "forward" or a.kind != "output" or not site.ready or site.xa.ndim != 3:
        raise NotApplicable("not a block's 3-D forward output")
    s_len, batch, hidden = site.xa.shape  # B in A's layout; A's own layout names the token order
    tokens = s_len * batch
    recs_b = site.cb.records(b.step)
    found_a = _routing(site.ca, site.recs_a, a.module, tokens, None)
    k = int(found_a[0].sum(axis=1).max()) if found_a is not None else None
    found_b = _routing(site.cb, recs_b, b.module, tokens, k)
    if found_a is None or found_b is None:
        raise NotApplicable("no router's choice of experts recorded inside this module on both sides")
    sets_a, scores_a = found_a
    sets_b, scores_b = found_b
    if sets_a.shape != sets_b.shape:
        raise NotApplicable("the two routers choose among different numbers of experts")
    # A's tokens run in A's layout order ([d0, d1] flattened); B's in B's own: try both orders for B's
    flat_b = [sets_b, sets_b.reshape(batch, s_len, -1).transpose(1, 0, 2).reshape(tokens, -1)]
    agree = [int(np.all(sets_a == x, axis=1).sum()) for x in flat_b]
    order = int(np.argmax(agree))
    sets_b = flat_b[order]
    if scores_b is not None and order == 1:
        scores_b = scores_b.reshape(batch, s_len, -1).transpose(1, 0, 2).reshape(tokens, -1)
    flipped = np.flatnonzero(~np.all(sets_a == sets_b, axis=1))
    if flipped.size == 0 or flipped.size > tokens // 4:
        return
    scores = scores_b if scores_b is not None else scores_a
    if scores is None:
        raise NotApplicable("neither router's scores were recorded to tell a near tie")
    res = dtypes.resolution(site.row.judged or a.dtype)
    gaps = []
    for t in flipped:
        top = np.sort(scores[t])[::-1]
        kk = int(sets_a[t].sum())
        gap = float(top[kk - 1] - top[kk])
        gaps.append(gap / max(float(np.max(np.abs(scores[t]))), 1e-30))  # the row's scale: its largest score
    if max(gaps) > NEAR_TIE_ROUNDINGS * res:
        return
    keep = np.ones(tokens, dtype=bool)
    keep[flipped] = False
    rows_a, rows_b = site.xa.reshape(tokens, hidden), site.xb.reshape(tokens, hidden)
    rest = rel_l2(rows_a[keep], rows_b[keep])
    if rest > site.row.tol:
        return  # other tokens differ too: not the routing alone
    where = ", ".join(f"({int(t) % batch}, {int(t) // batch})" for t in flipped[:4]) + (" ..." if flipped.size > 4 else "")
    hint = make_hint("routing", f"the routers sent {flipped.size} of {tokens} tokens (batch, position) {where} to other "
                     f"experts: their k-th and next router scores are within {max(gaps) / res:.1f} roundings of "
                     f"{site.row.judged or a.dtype} of a tie, which the two runs' rounding decides "
                     "differently. Numerical, not a conversion fault: the other tokens agree (rel L2 "
                     f"{rest:.1e}, tolerance {site.row.tol:.1e}); from here on the runs differ by those tokens' "
                     "experts", site, rest, f"{flipped.size} token(s) routed differently, each a near tie",
                     tokens=[int(t) for t in flipped], gap_roundings=max(gaps) / res)
    hint.explained = 1.0
    yield hint
