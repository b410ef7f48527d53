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

#: A flipped token's k-th and (k+1)-th router scores are a near tie when their gap is within this many standard
#: deviations of what the two routers' input difference moves it by: (w_k - w_k+1) . dx for that token's dx, about
#: |w_k - w_k+1| |dx| / sqrt(hidden) for a difference with no preferred direction; or, where the inputs or the
#: router's weight are not recorded, within this many roundings of the dtype of the token's scores (L2).
NEAR_TIE_SIGMAS = 4
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
    dx = _input_difference(site)
    weight = _router_weight(site, sets_a.shape[1], hidden)
    ratios = []  # each flipped token's gap over the largest gap the runs' own difference explains there
    for t in flipped:
        order_t = np.argsort(-scores[t], kind="stable")
        kk = int(sets_a[t].sum())
        e1, e2 = order_t[kk - 1], order_t[kk]
        gap = float(scores[t][e1] - scores[t][e2])
        allowed = NEAR_TIE_ROUNDINGS * res * float(np.linalg.norm(scores[t]))
        if dx is not None and weight is not None:
            sigma = float(np.linalg.norm(weight[e1] - weight[e2]) * np.linalg.norm(dx[t])) / np.sqrt(hidden)
            allowed = max(allowed, NEAR_TIE_SIGMAS * sigma)
        ratios.append(gap / max(allowed, 1e-30))
    if max(ratios) > 1.0:
        return
    keep = np.ones(tokens, dtype=bool)
    keep[flipped] = False
    rows_a, rows_b = site.xa.reshape(tokens, hidden), site.xb.reshape(tokens, hidden)
    rest = rel_l2(rows_a[keep], rows_b[keep])
    if rest > site.row.tol:
        return  # other tokens differ too: not the routing alone
    where = ", ".join(f"({int(t) % batch}, {int(t) // batch})" for t in flipped[:4]) + (" ..." if flipped.size > 4 else "")
    hint = make_hint("routing", f"the routers sent {flipped.size} of {tokens} tokens (batch, position) {where} to other "
                     "experts: their k-th and next router scores are a near tie (the gap at most "
                     f"{max(ratios):.0%} of what the two routers' own input difference moves it by), so rounding "
                     "decided. Numerical, not a conversion fault: the other tokens agree (rel L2 "
                     f"{rest:.1e}, tolerance {site.row.tol:.1e}); from here on the runs differ by those tokens' "
                     "experts", site, rest, f"{flipped.size} token(s) routed differently, each a near tie",
                     tokens=[int(t) for t in flipped], gap_share=max(ratios))
    hint.explained = 1.0
    yield hint


def _input_difference(site: Site) -> np.ndarray | None:
    """B's block input minus A's, per token in A's order ([T, hidden]), or None where either is not stored."""
    def first_input(cap: Any, rec: Record) -> np.ndarray | None:
        for r in cap.records(rec.step):
            if r.phase == "forward" and r.kind == "input" and r.module == rec.module and r.call == rec.call \
                    and r.has_data and len(r.shape) == 3:
                x = cap.array(r)
                return None if x is None else np.asarray(x, dtype=np.float64)
        return None

    xa, xb = first_input(site.ca, site.a), first_input(site.cb, site.b)
    if xa is None or xb is None:
        return None
    if xb.shape != xa.shape and xb.shape == (xa.shape[1], xa.shape[0], *xa.shape[2:]):
        xb = np.swapaxes(xb, 0, 1)
    return (xb - xa).reshape(-1, xa.shape[-1]) if xb.shape == xa.shape else None


def _router_weight(site: Site, experts: int, hidden: int) -> np.ndarray | None:
    """A's router weight inside the block: the [experts, hidden] parameter there."""
    for r in site.recs_a:
        if r.phase == "weights" and r.kind == "param" and tuple(r.shape) == (experts, hidden) and r.has_data \
                and r.module.startswith(site.a.module + "."):
            x = site.ca.array(r)
            return None if x is None else np.asarray(x, dtype=np.float64)
    return None
