"""Layout hints: B holds A's numbers in another order (interleaved gate/up, per-group QKV, a transpose), or a bias
is added on one side only

See docs/hints/layout.md and docs/hints/missing-bias.md."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial

import numpy as np

from ...transforms import OPS
from .base import MIN_EXPLAINED, Hint, NotApplicable, Site, describe, explained_share, make_hint, rel_l2


def _swap_halves(x: np.ndarray, d: int) -> np.ndarray:
    h = x.shape[d] // 2
    return np.concatenate([np.take(x, range(h, 2 * h), axis=d), np.take(x, range(h), axis=d)], axis=d)


def _layout_ops(shape: tuple[int, ...]) -> Iterator[tuple[str, Callable[[np.ndarray], np.ndarray]]]:
    nd = len(shape)
    if nd >= 2:
        yield "swap01", OPS["swap01"]
    if nd == 2:
        yield "transpose", OPS["transpose"]
    for d in range(nd):
        if shape[d] % 2 == 0 and shape[d] >= 4:
            yield f"interleave(dim={d})", partial(OPS["interleave"], dim=d)
            yield f"deinterleave(dim={d})", partial(OPS["deinterleave"], dim=d)
            yield f"halves swapped (dim={d})", partial(_swap_halves, d=d)
        if shape[d] % 3 == 0:
            for heads in (1, 2, 4, 8, 12, 16, 32):
                if shape[d] % (3 * heads) == 0 and heads < shape[d] // 3:
                    yield f"qkv_grouped(heads={heads}, dim={d})", partial(OPS["qkv_grouped"], heads=heads, dim=d)


def check_layout(site: Site) -> Iterator[Hint]:
    """B holds the same numbers in another order (interleaved gate/up, per-group QKV, a transpose)."""
    ops = list(_layout_ops(site.xb.shape))
    if not ops:
        raise NotApplicable(f"no other order for shape {tuple(site.xb.shape)}")
    best = None
    for label, op in ops:
        try:
            moved = np.asarray(op(site.xa), dtype=np.float64)
        except (ValueError, IndexError):
            continue
        after = rel_l2(moved, site.xb)
        if best is None or after < best[1]:
            best = (label, after)
    if best is not None and explained_share(site.before, best[1]) >= MIN_EXPLAINED:
        seen = (f" (B as the mapping presents it, after {' '.join(map(str, site.row.pair.ops))})"
                if site.row.pair.ops else "")
        yield make_hint("layout", f"B holds A's values in another order: B = {best[0]} of A", site, best[1],
                    f"the permutation {best[0]} of A's tensor reproduces B{seen} to rel L2 {best[1]:.1e}", op=best[0])
        return
    perm = _row_permutation(site.xa, site.xb)
    if perm is not None:
        merged = "merged_from" in site.cb.attrs
        why = (" B was merged from tensor-parallel rank files: its ranks hold other rows than megatron-core's "
               "split (per query group [q_g, k_g, v_g] vs [Q | K | V]; a gated fc1's [gate_r; up_r])" if merged else "")
        yield make_hint("layout", f"B's rows are A's rows in another order ({_blocks(perm)})", site, 0.0,
                        f"every row of B is a row of A, {int(np.sum(perm != np.arange(len(perm))))} of {len(perm)} "
                        f"moved; the statistics of the two tensors are the same.{why}", rows=_blocks(perm))
        return
    if site.xa.size >= 256 and site.xa.size == site.xb.size:
        # the same values, as a multiset, in an arrangement none of the above is: a transpose a framework's
        # backward ignores, a reshape of a permuted view
        sa, sb = np.sort(site.xa, axis=None), np.sort(site.xb, axis=None)
        left = rel_l2(sa, sb)
        # one set of values: sorted, they part by less than one mean spacing of A's values. Two samples of one
        # distribution (two random inits, two dropout streams) part by ~1/sqrt(n) of its width, ~sqrt(n) spacings
        spacing = float(sa[-1] - sa[0]) / (sa.size - 1)
        if (float(np.mean(np.abs(sa - sb))) <= spacing and site.reproduces(left)
                and explained_share(site.before, left) >= MIN_EXPLAINED):
            yield make_hint("layout", "B holds A's values in another arrangement: the same values, moved (a transpose, "
                            "permute or reshape in B's code, or its backward, that A does not make)", site, left,
                            f"A's and B's values sorted agree to rel L2 {left:.1e}, against {site.before:.3g} as laid "
                            "out; no single transpose, interleave, half swap or row permutation of A reproduces B",
                            op="rearranged")


def _row_permutation(xa: np.ndarray, xb: np.ndarray) -> np.ndarray | None:
    """``perm`` with B[i] == A[perm[i]] for every row (dim 0), when B's rows are A's in another order; else None."""
    if xa.shape != xb.shape or xa.ndim < 1 or not 2 <= xa.shape[0] <= 100_000:
        return None
    rows_a: dict[bytes, list[int]] = {}
    for i, row in enumerate(np.ascontiguousarray(xa.reshape(xa.shape[0], -1))):
        rows_a.setdefault(row.tobytes(), []).append(i)
    perm = []
    for row in np.ascontiguousarray(xb.reshape(xb.shape[0], -1)):
        hit = rows_a.get(row.tobytes())
        if not hit:
            return None
        perm.append(hit.pop(0))
    out = np.asarray(perm)
    return None if np.array_equal(out, np.arange(len(out))) else out


def _blocks(perm: np.ndarray, shown: int = 4) -> str:
    """'B rows 0-15 = A rows 0-15, 16-31 = A 64-79, ...': the permutation as runs of consecutive rows."""
    runs, start = [], 0
    for i in range(1, len(perm) + 1):
        if i == len(perm) or perm[i] != perm[i - 1] + 1:
            runs.append((start, i - 1, int(perm[start]), int(perm[i - 1])))
            start = i
    text = ", ".join(f"B {b0}-{b1} = A {a0}-{a1}" for b0, b1, a0, a1 in runs[:shown])
    return text + (f", ... ({len(runs)} blocks)" if len(runs) > shown else "")


def check_missing_bias(site: Site) -> Iterator[Hint]:
    """B adds the module's bias to its output where A leaves it out (megatron's ``skip_bias_add``), or the reverse."""
    a = site.a
    if a.phase != "forward" or a.kind != "output":
        raise NotApplicable(f"not for {describe(a)}")
    bias = site.weights(a.module).get("bias")
    if bias is None:
        stored = any(r.phase == "weights" and r.module == a.module and r.slot == "bias" for r in site.recs_a)
        if stored:
            raise NotApplicable("the module's bias is not stored")
        weight = site.weights(a.module).get("weight")
        if weight is None or weight.ndim != 2 or weight.shape[0] != site.xa.shape[-1]:
            raise NotApplicable("the module has no bias")
        yield from _constant_per_feature(site)  # a linear layer without a bias: does B add one?
        return
    if bias.shape != site.xa.shape[-1:]:
        raise NotApplicable("the module's bias does not fit its output")
    for sign, text in ((1.0, "adds"), (-1.0, "leaves out")):
        after = rel_l2(site.xa + sign * bias, site.xb)
        if explained_share(site.before, after) >= MIN_EXPLAINED:
            yield make_hint("missing-bias", f"B {text} the bias of {a.module} that A "
                        f"{'leaves out' if sign > 0 else 'adds'} here", site, after,
                        f"A {'+' if sign > 0 else '-'} {a.module}.bias reproduces B to rel L2 {after:.1e}")


def _constant_per_feature(site: Site) -> Iterator[Hint]:
    """B = A + b for one vector b over the output features, A's module having no bias: B adds a bias A has not."""
    if not site.ready or site.xa.ndim < 2 or site.xa.shape[-1] < 2:
        raise NotApplicable("the module has no bias, and its output has no feature axis to fit one on")
    d = (site.xb - site.xa).reshape(-1, site.xa.shape[-1])
    if d.shape[0] < 2:
        raise NotApplicable("the module has no bias, and one row cannot tell a bias from a difference")
    b = d.mean(axis=0)
    after = rel_l2(site.xa + b, site.xb)
    if explained_share(site.before, after) >= MIN_EXPLAINED:
        yield make_hint("missing-bias", f"B adds a bias to {site.a.module}'s output that A's module does not have "
                        f"(one constant per output feature, |b| = {float(np.linalg.norm(b)):.3g}): a conversion that "
                        "dropped the bias (megatron-core add_qkv_bias / add_bias_linear off)", site, after,
                        f"A + the mean per feature of B - A reproduces B to rel L2 {after:.1e}")
