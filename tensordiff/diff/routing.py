"""Near-tie routing: a mixture-of-experts block whose two routers sent a few tokens to other experts because their
router scores were a near tie that rounding decided, and what that accounts for (the ``routing`` rule).

In BF16 two correct MoE programs route almost every token alike; a token whose k-th and (k+1)-th router scores are
closer than the runs' own rounding difference can move them goes to another expert on one side. That token's
output of the block differs by a whole expert's contribution, and through it a few of the step's other records do:
not a fault, and not to be passed over in silence either. At a step where a block's forward output diverged:

1. **The flip** (``near_tie_flips``): each side's routing is read from what its router recorded inside the block: a
   boolean routing map ``[T, E]`` (megatron-core's router, its second output), top-k probabilities with k non-zeros
   per row (its first), or dense logits ``[T, E]`` (a Hugging Face gate), whose top k are taken. Tokens are lined up
   through the block's output layout (``[S, B]`` on one side, ``[B, S]`` on the other). Every token routed apart must
   be a near tie: its k-th and (k+1)-th scores closer than ``NEAR_TIE_SIGMAS`` standard deviations of what the two
   routers' input difference moves their gap by (``|w_k - w_k+1| |dx| / sqrt(hidden)``), or, where inputs or the
   router's weight are not recorded, ``NEAR_TIE_ROUNDINGS`` roundings of the scores' dtype; at most a quarter of the
   tokens; and every other token of the block's output must agree at the row's tolerance.
2. **What it accounts for** (``account_routing``), each diverged record of that step, by one of three checks, and
   only these: a record with a token axis (forward after the block, backward) agrees once the flipped tokens are left
   out; a parameter gradient agrees once the flipped tokens' share is taken out of it on both sides, rebuilt from the
   module's own recorded input and output gradient (a linear's ``G^T X``, a norm's ``sum g * x_hat``, a bias's
   ``sum g``) where that rebuild reproduces the recorded gradient; the router of a block with flipped tokens, whose
   gradient runs through the chosen experts' scores (megatron-core does not record their gradient), is accounted by
   that structure. Such a record gets the verdict ``routed``: compared, named in the report with its check, and no
   divergence. Anything else that differs stays ``diverged``: the first divergence is then the first thing the
   routing does not explain.

Framework-free: numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import dtypes
from ..record import Record, is_inside
from ..store import CaptureReader
from .metrics import rel_l2
from .result import Row

#: A flipped token's k-th and (k+1)-th router scores are a near tie when their gap is within this many standard
#: deviations of what the two routers' input difference moves it by: (w_k - w_k+1) . dx for that token's dx, about
#: |w_k - w_k+1| |dx| / sqrt(hidden) for a difference with no preferred direction; or, where the inputs or the
#: router's weight are not recorded, within this many roundings of the dtype of the token's scores (L2).
NEAR_TIE_SIGMAS = 4
NEAR_TIE_ROUNDINGS = 8
#: A gradient rebuilt from a module's recorded input and output gradient stands for the recorded one within this many
#: roundings of the gradient's dtype (at least ``REBUILD_FLOOR``): float64 sums of the same rounded factors.
REBUILD_ROUNDINGS = 8
REBUILD_FLOOR = 1e-5


@dataclass
class Flip:
    """One MoE block's near-tie routing at one step: the tokens its two routers sent to other experts."""

    step: int
    module_a: str
    module_b: str
    tokens: list[int]
    """The tokens routed apart, as indices into A's ``[d0, d1]`` token grid flattened (``grid_a``)."""
    tokens_total: int
    grid_a: tuple[int, int]
    grid_b: tuple[int, int]
    b_transposed: bool
    """B's grid is A's with its two dims swapped (``[B, S]`` against ``[S, B]``)."""
    gap_share: float
    """The largest flipped token's score gap over what the runs' own difference explains there (at most 1)."""
    rest: float
    """Relative L2 of the block's output over the other tokens."""
    tol: float
    output_seq: int
    """A's block output record (records of the forward before it cannot be reached by the flip)."""
    accounted: list[str] = field(default_factory=list)
    """The records this flip's step accounted for, as labels."""

    def where(self, limit: int = 4) -> str:
        """The flipped tokens as (d0, d1) coordinates of A's token grid."""
        d1 = self.grid_a[1]
        out = ", ".join(f"({t // d1}, {t % d1})" for t in self.tokens[:limit])
        return out + (" ..." if len(self.tokens) > limit else "")

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "module_a": self.module_a, "module_b": self.module_b, "tokens": self.tokens,
                "tokens_total": self.tokens_total, "grid_a": list(self.grid_a), "gap_share": self.gap_share,
                "rest_rel_l2": self.rest, "tolerance": self.tol, "accounted": self.accounted}


# ----------------------------------------------------------------------------- reading the routers

def _router_records(recs: list[Record], block: str, tokens: int) -> list[Record]:
    """Outputs inside ``block`` (a module and its children) of shape [tokens, E or k], more than one column, in the
    order they ran."""
    return [r for r in recs if r.phase == "forward" and r.kind == "output" and r.has_data and len(r.shape) == 2
            and r.shape[0] == tokens and r.shape[1] > 1 and (r.module == block or is_inside(r.module, block))]


def _routing(cap: CaptureReader, recs: list[Record], block: str, tokens: int, k: int | None, experts: int | None = None) \
        -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None] | None:
    """(top-k sets as a bool [T, E], dense scores [T, E] or None, each token's top-k probability mass [T] or None) of
    one side's router inside ``block``; ``experts``: E, for a router that returns the chosen experts' indices
    [T, k] (DeepSeek-V3's) rather than anything [T, E]."""
    sets, scores, mass, indices = None, None, None, None
    for r in _router_records(recs, block, tokens):
        x = np.asarray(cap.array(r))
        if x.dtype.kind in "iu":
            indices = x if indices is None else indices  # the chosen experts' indices [T, k]
            continue
        if x.dtype == bool:
            sets = x if sets is None else sets
        else:
            x = x.astype(np.float64)
            nz = np.count_nonzero(x, axis=1)
            if np.all(nz == nz[0]) and nz[0] < x.shape[1]:
                sets = (x != 0) if sets is None else sets  # top-k probabilities, zero elsewhere
                mass = x.sum(axis=1) if mass is None and np.all(x >= 0) else mass
            elif scores is None:
                scores = x
    if sets is None and indices is not None and experts and indices.size and indices.min() >= 0 \
            and indices.max() < experts:
        sets = np.zeros((tokens, experts), dtype=bool)
        np.put_along_axis(sets, indices.astype(np.int64), True, axis=1)
    if sets is not None and scores is not None and scores.shape != sets.shape:
        scores = None  # a [T, k] tensor of the chosen experts' weights, not scores over every expert
    if sets is None and scores is not None and k:
        top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        sets = np.zeros(scores.shape, dtype=bool)
        np.put_along_axis(sets, top, True, axis=1)
    return None if sets is None else (sets, scores, mass)


def _first_input(cap: CaptureReader, rec: Record) -> np.ndarray | None:
    for r in cap.records(rec.step):
        if r.phase == "forward" and r.kind == "input" and r.module == rec.module and r.call == rec.call \
                and r.has_data and len(r.shape) == 3:
            x = cap.array(r)
            return None if x is None else np.asarray(x, dtype=np.float64)
    return None


def _input_difference(row: Row, ca: CaptureReader, cb: CaptureReader) -> np.ndarray | None:
    """B's block input minus A's, per token in A's order ([T, hidden]), or None where either is not stored."""
    a, b = row.pair.a, row.pair.b
    assert a is not None and b is not None
    xa, xb = _first_input(ca, a), _first_input(cb, b)
    if xa is None or xb is None:
        return None
    if xb.shape != xa.shape and xb.shape == (xa.shape[1], xa.shape[0], *xa.shape[2:]):
        xb = np.swapaxes(xb, 0, 1)
    return (xb - xa).reshape(-1, xa.shape[-1]) if xb.shape == xa.shape else None


def _router_weight(recs: list[Record], cap: CaptureReader, block: str, experts: int, hidden: int) -> np.ndarray | None:
    """A router weight inside the block: the [experts, hidden] parameter there."""
    for r in recs:
        if r.phase == "weights" and r.kind == "param" and tuple(r.shape) == (experts, hidden) and r.has_data \
                and is_inside(r.module, block):
            x = cap.array(r)
            return None if x is None else np.asarray(x, dtype=np.float64)
    return None


@dataclass
class Routers:
    """Both routers of one MoE block at one step, tokens in A's grid order."""

    sets_a: np.ndarray
    """A's choice: bool [T, E]."""
    sets_b: np.ndarray
    """B's choice, its tokens reordered to A's grid."""
    scores: np.ndarray | None
    """Dense router scores [T, E] (logits or probabilities over every expert; B's where it recorded them, else A's),
    in A's order; None where neither side recorded them (megatron-core's router records only the top k)."""
    transposed: bool
    """B's token grid is A's with its two dims swapped."""
    mass_a: np.ndarray | None = None
    """Each token's top-k probability mass where A's router recorded its top-k probabilities [T] (1: renormalised)."""
    mass_b: np.ndarray | None = None
    """The same of B's, in A's order."""


def routers(row: Row, ca: CaptureReader, cb: CaptureReader, grid: tuple[int, int]) -> Routers | None:
    """The two routers recorded inside a block's output row (A's module and B's), or None where either side recorded
    no router there, or they choose among different numbers of experts."""
    a, b = row.pair.a, row.pair.b
    if a is None or b is None:
        return None
    d0, d1 = grid
    tokens = d0 * d1
    found_a = _routing(ca, ca.records(a.step), a.module, tokens, None, _experts(ca.records(a.step), a.module))
    k = int(found_a[0].sum(axis=1).max()) if found_a is not None else None
    found_b = _routing(cb, cb.records(b.step), b.module, tokens, k, _experts(cb.records(b.step), b.module))
    if found_a is None or found_b is None:
        return None
    sets_a, scores_a, mass_a = found_a
    sets_b, scores_b, mass_b = found_b
    if sets_a.shape != sets_b.shape:
        return None
    # A's tokens run in A's grid order ([d0, d1] flattened); B's in B's own: try both orders for B's
    flat_b = [sets_b, sets_b.reshape(d1, d0, -1).transpose(1, 0, 2).reshape(tokens, -1)]
    agree = [int(np.all(sets_a == x, axis=1).sum()) for x in flat_b]
    order = int(np.argmax(agree))
    if order == 1:
        scores_b = None if scores_b is None else scores_b.reshape(d1, d0, -1).transpose(1, 0, 2).reshape(tokens, -1)
        mass_b = None if mass_b is None else mass_b.reshape(d1, d0).T.reshape(tokens)
    return Routers(sets_a, flat_b[order], scores_b if scores_b is not None else scores_a, order == 1, mass_a, mass_b)


def _experts(recs: list[Record], block: str) -> int | None:
    """E, the number of experts numbered inside the block (``experts.0`` ... ``experts.{E-1}``), for a side whose
    router returns only the chosen experts' indices."""
    numbers = {int(seg) for r in recs if r.phase == "weights" and is_inside(r.module, block)
               for seg in r.module[len(block) + 1:].split(".") if seg.isdigit()}
    return max(numbers) + 1 if numbers and numbers == set(range(max(numbers) + 1)) else None


def near_tie_flips(row: Row, ca: CaptureReader, cb: CaptureReader, xa: np.ndarray, xb: np.ndarray) -> Flip | None:
    """The near-tie flip at a block's diverged 3-D forward output (``xa``, ``xb``: its two tensors in A's layout), or
    None: no router recorded inside it on both sides, no token routed apart, one routed apart on no near tie, too many
    routed apart, or other tokens that differ too."""
    a, b = row.pair.a, row.pair.b
    if a is None or b is None or a.phase != "forward" or a.kind != "output" or xa.ndim != 3 or xa.shape != xb.shape:
        return None
    d0, d1, hidden = xa.shape
    tokens = d0 * d1
    found = routers(row, ca, cb, (d0, d1))
    if found is None:
        return None
    sets_a, sets_b, scores = found.sets_a, found.sets_b, found.scores
    flipped = np.flatnonzero(~np.all(sets_a == sets_b, axis=1))
    if flipped.size == 0 or flipped.size > tokens // 4 or scores is None:
        return None
    res = dtypes.resolution(row.judged or a.dtype)
    dx = _input_difference(row, ca, cb)
    weight = _router_weight(ca.records(a.step), ca, a.module, sets_a.shape[1], hidden)
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
        return None
    keep = np.ones(tokens, dtype=bool)
    keep[flipped] = False
    rest = rel_l2(xa.reshape(tokens, hidden)[keep], xb.reshape(tokens, hidden)[keep])
    if rest > row.tol:
        return None
    return Flip(step=a.step, module_a=a.module, module_b=b.module, tokens=[int(t) for t in flipped],
                tokens_total=tokens, grid_a=(d0, d1), grid_b=tuple(b.shape[:2]),  # type: ignore[arg-type]
                b_transposed=found.transposed, gap_share=max(ratios), rest=rest, tol=row.tol, output_seq=a.seq)


# ----------------------------------------------------------------------------- what a flip accounts for

class _Side:
    """One side of the step: its capture, records, token grid, and how its tokens map onto A's grid."""

    def __init__(self, cap: CaptureReader, step: int, grid: tuple[int, int], transposed: bool):
        self.cap = cap
        self.recs = cap.records(step)
        self.grid = grid
        self.transposed = transposed
        self.tokens = grid[0] * grid[1]

    def to_a(self, t: np.ndarray) -> np.ndarray:
        """This side's token indices (its grid flattened) as indices into A's grid."""
        if not self.transposed:
            return t
        e0, e1 = self.grid
        return (t % e1) * e0 + t // e1  # B's (j0, j1) is A's (j1, j0); A's grid is (e1, e0)

    def first(self, module: str, phase: str, kind: str) -> Record | None:
        """The module's first call's slot-0 record of that phase and kind, if stored; None where called twice."""
        found = [r for r in self.recs if r.module == module and r.phase == phase and r.kind == kind
                 and r.slot in ("0", "") and r.has_data]
        if not found or any(r.call != 0 for r in found):
            return None
        return found[0]

    def array(self, rec: Record) -> np.ndarray | None:
        x = self.cap.array(rec)
        return None if x is None else np.asarray(x, dtype=np.float64)

    def row_tokens(self, module: str, rows: np.ndarray, lead: tuple[int, ...]) -> np.ndarray | None:
        """The token (index into A's grid) of each row of ``module``'s input ``rows`` [n, features] (``lead``: the
        input's shape before its rows were flattened): by layout where the rows are the token grid (this side's, its
        transpose, or flattened); else (an expert's share of the tokens) by finding the rows of its or an enclosing
        module's input, exactly, among the rows of the input of the nearest enclosing module that takes the whole
        token grid (the MoE block)."""
        n = rows.shape[0]
        if len(lead) == 2 and lead == self.grid[::-1] and self.grid[0] != self.grid[1]:
            return self.to_a(np.arange(n).reshape(self.grid).T.reshape(-1))
        if n == self.tokens:
            return self.to_a(np.arange(n))
        chain = []  # the module and its ancestors, up to the first that takes every token
        mod, x_blk = module, None
        while mod:
            rec = self.first(mod, "forward", "input")
            x = self.array(rec) if rec is not None else None
            if x is not None and x.ndim >= 2 and x.size // x.shape[-1] == self.tokens and mod != module:
                x_blk = x.reshape(self.tokens, -1)
                break
            chain.append(x)
            mod = mod.rpartition(".")[0]
        if x_blk is None:
            return None
        where: dict[bytes, int] = {}
        for t in range(self.tokens):
            where.setdefault(x_blk[t].tobytes(), t)  # a repeated row (the same token in two sequences) holds one value
        for y in chain:
            if y is not None and y.ndim == 2 and y.shape == (n, x_blk.shape[1]):
                found = [where.get(y[i].tobytes()) for i in range(n)]
                if all(t is not None for t in found):
                    return self.to_a(np.asarray(found, dtype=np.int64))
        return None


def _rebuild(p: np.ndarray, x: np.ndarray, g: np.ndarray, keep: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """(the gradient over all rows, over the kept rows) of a parameter shaped like ``p`` for each form its module may
    compute it in: a linear's ``G^T X`` (or ``X^T G``), a bias's ``sum g``, an RMSNorm's or a LayerNorm's
    ``sum g * x_hat``."""
    out = []
    if p.ndim == 2 and p.shape == (g.shape[1], x.shape[1]):
        out.append((g.T @ x, g[keep].T @ x[keep]))
    elif p.ndim == 2 and p.shape == (x.shape[1], g.shape[1]):
        out.append((x.T @ g, x[keep].T @ g[keep]))
    elif p.ndim == 1 and p.shape[0] == g.shape[1]:
        out.append((g.sum(axis=0), g[keep].sum(axis=0)))
        if x.shape == g.shape:
            rms = x / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + 1e-6)
            centred = x - x.mean(axis=1, keepdims=True)
            ln = centred / np.sqrt(np.mean(centred * centred, axis=1, keepdims=True) + 1e-5)
            for xhat in (rms, ln):
                out.append(((g * xhat).sum(axis=0), (g[keep] * xhat[keep]).sum(axis=0)))
    return out


def _rest_of_grad(side: _Side, grad: Record, flipped: np.ndarray) -> np.ndarray | None:
    """The parameter gradient ``grad`` without the flipped tokens' share, rebuilt from its module's recorded input and
    output gradient, where a rebuild reproduces the recorded gradient; else None. An embedding's input is its token
    ids: its gradient is the output gradient's rows added up by id."""
    rec_x = side.first(grad.module, "forward", "input")
    rec_g = side.first(grad.module, "backward", "grad_output")
    recorded = side.array(grad) if grad.has_data else None
    if rec_x is None or rec_g is None or recorded is None:
        return None
    x, g = side.array(rec_x), side.array(rec_g)
    if x is None or g is None or g.ndim < 2:
        return None
    limit = max(REBUILD_ROUNDINGS * dtypes.resolution(grad.dtype), REBUILD_FLOOR)
    if rec_x.dtype in ("int64", "int32") and recorded.ndim == 2 and x.shape == g.shape[:-1] \
            and g.shape[-1] == recorded.shape[1]:  # an embedding: rows added up by token id
        ids, g2 = x.reshape(-1).astype(np.int64), g.reshape(-1, g.shape[-1])
        tokens = side.row_tokens(grad.module, g2, tuple(x.shape))
        if tokens is None or ids.min() < 0 or ids.max() >= recorded.shape[0]:
            return None
        keep = ~np.isin(tokens, flipped)
        full, rest = np.zeros_like(recorded), np.zeros_like(recorded)
        np.add.at(full, ids, g2)
        np.add.at(rest, ids[keep], g2[keep])
        return rest if rel_l2(full, recorded) <= limit else None
    if x.ndim < 2:
        return None
    lead = tuple(x.shape[:-1])
    x, g = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    if x.shape[0] != g.shape[0]:
        return None
    tokens = side.row_tokens(grad.module, x, lead)
    if tokens is None:
        return None
    keep = ~np.isin(tokens, flipped)
    for full, rest in _rebuild(recorded, x, g, keep):
        if rel_l2(full, recorded) <= limit:
            return rest
    return None


def _without_tokens(xa: np.ndarray, xb: np.ndarray, grid: tuple[int, int], flipped: np.ndarray) -> float | None:
    """Relative L2 of a record with a token axis (A's grid as its first two dims, or its tokens flattened first) over
    the tokens not routed apart; None where it has no such axis."""
    tokens = grid[0] * grid[1]
    if xa.shape != xb.shape or xa.ndim < 2:
        return None
    if tuple(xa.shape[:2]) == grid[::-1] and grid[0] != grid[1]:  # [B, S, ...] against an [S, B] grid
        xa, xb = np.swapaxes(xa, 0, 1), np.swapaxes(xb, 0, 1)
    if tuple(xa.shape[:2]) == grid:
        xa, xb = xa.reshape(tokens, -1), xb.reshape(tokens, -1)
    elif xa.shape[0] != tokens:
        return None
    keep = np.ones(tokens, dtype=bool)
    keep[flipped] = False
    return rel_l2(xa[keep], xb[keep])


class _Tensors:
    """Each row's two tensors in A's layout (float64), read once."""

    def __init__(self, ca: CaptureReader, cb: CaptureReader):
        self.ca, self.cb = ca, cb
        self._seen: dict[int, tuple[np.ndarray, np.ndarray] | None] = {}

    def __call__(self, row: Row) -> tuple[np.ndarray, np.ndarray] | None:
        if id(row) not in self._seen:
            try:
                xa, xb = row.pair.a_tensor(self.ca.array), row.pair.b_tensor(self.cb.array)
            except Exception:
                xa = xb = None
            self._seen[id(row)] = None if xa is None or xb is None else \
                (np.asarray(xa, dtype=np.float64), np.asarray(xb, dtype=np.float64))
        return self._seen[id(row)]


def _batch(cap: CaptureReader, step: int) -> tuple[np.ndarray | None, tuple]:
    """The step's token ids, the first 2-D integer forward input (``input_ids`` [B, S]) a side recorded (None where
    only its statistics were stored), and what tells two steps' batches apart: their shape and statistics (a step
    holding statistics only has no more)."""
    for r in cap.records(step):
        if r.phase == "forward" and r.kind == "input" and len(r.shape) == 2 and r.dtype in ("int64", "int32"):
            x = cap.array(r) if r.has_data else None
            ids = None if x is None else np.asarray(x)
            return ids, (r.shape, r.min, r.max, r.mean, r.l2)
    return None, ()


def _sequences(grid: tuple[int, int], batch: np.ndarray | None, tokens: np.ndarray) -> np.ndarray | None:
    """Every token of the sequences holding ``tokens`` (A's grid order): with causal attention a token routed apart
    reaches the later tokens of its sequence in forward and the earlier ones in backward. None where the grid's
    batch dim is not known (no token ids recorded, or a square grid)."""
    if batch is None or batch.ndim != 2 or grid[0] == grid[1]:
        return None
    if grid == tuple(batch.shape):
        seq_dim = 0
    elif grid == tuple(batch.shape[::-1]):
        seq_dim = 1
    else:
        return None
    idx = np.arange(grid[0] * grid[1]).reshape(grid)
    rows = {int(t) // grid[1] if seq_dim == 0 else int(t) % grid[1] for t in tokens}
    return np.concatenate([idx[r, :] if seq_dim == 0 else idx[:, r] for r in sorted(rows)])


def account_routing(rows: list[Row], ca: CaptureReader, cb: CaptureReader) -> list[Flip]:
    """Find the near-tie flips of every step whose MoE block outputs diverged, and mark the records of that step they
    account for ``routed`` (see the module's docstring). A later step on the same batch carries the tokens routed
    apart before (the update their gradients moved reaches them again). Returns the flips, for the report."""
    by_step: dict[int, list[Row]] = {}
    for row in rows:
        if row.verdict == "diverged" and row.pair.a is not None and row.pair.b is not None:
            by_step.setdefault(row.step, []).append(row)
    flips: list[Flip] = []
    carried: list[Flip] = []  # flips of earlier steps on the same batch
    last: tuple = ()
    for step, diverged in sorted(by_step.items()):
        tensors = _Tensors(ca, cb)
        # modules that returned something [tokens, E] (a router's choice): only a block holding one can route apart
        routers_at = {r.module for r in ca.records(step) if r.phase == "forward" and r.kind == "output"
                      and r.has_data and len(r.shape) == 2 and r.shape[1] > 1}
        batch, seen = _batch(ca, step)
        if not seen or seen != last:
            carried = []
        last = seen
        found = []
        for row in diverged:
            a = row.pair.a
            block = a is not None and row.phase == "forward" and a.kind == "output" and len(a.shape) == 3 and any(
                m == a.module or is_inside(m, a.module) for m in routers_at)
            got = tensors(row) if block else None
            flip = near_tie_flips(row, ca, cb, *got) if got is not None else None
            if flip is not None:
                found.append(flip)
        active = carried + found
        if not active or len({f.grid_a for f in active}) > 1:
            carried = []
            continue
        grid = active[0].grid_a
        flipped = np.asarray(sorted({t for f in active for t in f.tokens}), dtype=np.int64)
        check = _Check(tensors, grid, flipped, _sequences(grid, batch, flipped),
                       min((f.output_seq for f in found), default=-1), _Side(ca, step, grid, False),
                       _Side(cb, step, active[0].grid_b, active[0].b_transposed), active)
        first = min(f.step for f in active)
        for row in diverged:
            why = check(row)
            if why:
                row.verdict = "routed"
                row.note = why
                (found or active)[0].accounted.append(f"step {step}: {row.pair.a.label}")  # type: ignore[union-attr]
            elif row.metrics is not None and row.metrics.source == "stats" and (row.phase != "forward" or first < step):
                row.verdict = "uncertain"  # not a divergence, not agreement: said as inconclusive
                row.note = (f"differs after tokens were routed to other experts on a near tie (step {first}); with "
                            "statistics only, whether it differs only through them cannot be checked: capture with "
                            "--tensors all")
        flips += found
        carried = active
    return flips


class _Check:
    """Why the tokens routed apart account for a diverged row of one step (one of the three checks), or ''."""

    def __init__(self, tensors: _Tensors, grid: tuple[int, int], flipped: np.ndarray, sequences: np.ndarray | None,
                 earliest: int, side_a: _Side, side_b: _Side, flips: list[Flip]):
        self.tensors, self.grid, self.flipped, self.earliest = tensors, grid, flipped, earliest
        self.side_a, self.side_b, self.flips = side_a, side_b, flips
        tokens = grid[0] * grid[1]
        # the flipped tokens, then (where the batch dim is known) the whole sequences holding them, if half is left
        self.sets: list[tuple[np.ndarray, str]] = [(flipped, f"the {flipped.size} token(s) routed to other experts "
                                                   "on a near tie")]
        if sequences is not None and sequences.size > flipped.size and sequences.size <= tokens // 2:
            self.sets.append((sequences, f"the sequence(s) holding the {flipped.size} token(s) routed to other "
                              f"experts on a near tie ({sequences.size} of {tokens} tokens: causal attention "
                              "carries a token's difference along its sequence)"))

    def __call__(self, row: Row) -> str:
        a = row.pair.a
        assert a is not None
        if row.phase in ("forward", "backward"):
            if row.phase == "forward" and self.earliest >= 0 and a.seq < self.earliest and not self.flips[0].step < a.step:
                return ""  # before the first block that routed apart, in this step's forward: nothing reaches it
            got = self.tensors(row)
            for left_out, what in self.sets:
                rest = _without_tokens(*got, self.grid, left_out) if got is not None else None
                if rest is not None and rest <= row.tol:
                    return f"differs only on {what}: the other tokens agree (rel L2 {rest:.1e} <= {row.tol:.1e})"
            return ""
        if row.phase != "param_grad":
            return ""
        for left_out, what in self.sets:
            rest = self._rest(row, left_out)
            if rest is not None and rest <= row.tol:
                return (f"without {what}, the gradient agrees: rel L2 {rest:.1e} <= {row.tol:.1e}, rebuilt on each "
                        "side from the module's recorded input and output gradient")
        flip = next((f for f in self.flips if is_inside(a.module, f.module_a)), None)
        if flip is not None and _is_router(self.side_a, a, flip):
            return (f"the router of {flip.module_a}, which sent {len(flip.tokens)} token(s) to other experts on a near "
                    f"tie at step {flip.step}: its gradient runs through the scores of the experts each token chose "
                    "(not recorded on every side), so it is accounted by that structure, not rebuilt")
        return ""

    def _rest(self, row: Row, left_out: np.ndarray) -> float | None:
        """Relative L2 of a parameter gradient with ``left_out``'s share taken out on both sides, or None."""
        rest_a = _rest_of_grad(self.side_a, row.pair.a, left_out)  # type: ignore[arg-type]
        if rest_a is None:
            return None
        rests = {r.seq: _rest_of_grad(self.side_b, r, left_out) for r in row.pair.b_records}
        if not all(v is not None for v in rests.values()):
            return None
        try:
            rest_b = row.pair.b_tensor(lambda r: rests.get(r.seq))
        except Exception:
            return None
        return None if rest_b is None else rel_l2(rest_a, np.asarray(rest_b, dtype=np.float64))


def _is_router(side: _Side, grad: Record, flip: Flip) -> bool:
    """``grad`` is the gradient of a router weight inside the flipped block: an [experts, hidden] parameter whose module
    produced the block's [tokens, experts] routing."""
    if len(grad.shape) != 2:
        return False
    experts = grad.shape[0]
    return any(r.module == grad.module for r in _router_records(side.recs, flip.module_a, flip.tokens_total)
               if r.shape[1] == experts)
