"""Distributed hints: B's tensor is one tensor-parallel rank's partial sum (a missing all-reduce over TP)

See docs/hints/parallel.md."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from .base import MIN_EXPLAINED, Hint, NotApplicable, Site, explained_share, make_hint, rel_l2


def check_partial_sum(site: Site) -> Iterator[Hint]:
    """B was merged from tensor-parallel rank files and holds a record that must be replicated (a norm weight's
    gradient under sequence parallelism): if the sum of the ranks' copies reproduces A, each rank holds a partial
    sum and the all-reduce over the TP group is missing."""
    if not site.cb.merged:
        raise NotApplicable("B is not merged from tensor-parallel rank files")
    if site.row.pair.join is not None:
        raise NotApplicable("B's record is joined from several of B's records")
    copies = site.cb.tp_copies(site.b)
    if not copies:
        raise NotApplicable("B's record is split across tensor-parallel ranks, or held by one rank")
    def as_a(x: np.ndarray) -> np.ndarray:
        def read(_rec: object) -> np.ndarray:
            return x
        return np.asarray(site.row.pair.b_tensor(read), dtype=np.float64)

    try:
        total = np.sum([as_a(x) for x in copies], axis=0)
    except Exception as err:
        raise NotApplicable(f"B's rank copies cannot be put in A's layout ({type(err).__name__})") from None
    if total.shape != site.xa.shape:
        raise NotApplicable("B's rank copies have another shape than A")
    after = rel_l2(site.xa, total)
    if explained_share(site.before, after) < MIN_EXPLAINED:
        return
    n = len(copies)
    yield make_hint("tp-partial", f"B holds a partial sum: the sum over its {n} tensor-parallel ranks reproduces A "
                    "(the all-reduce over the TP group is missing)", site, after,
                    f"each TP rank holds a different copy of a record that must be replicated; their sum matches A "
                    f"to rel L2 {after:.1e}. A sequence-parallel parameter's gradient (norm weights, row-parallel "
                    "biases) is a partial sum over the sequence shards until it is all-reduced over the TP group "
                    "(megatron's finalize_model_grads)", ranks=n)
