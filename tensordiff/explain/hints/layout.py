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


def check_missing_bias(site: Site) -> Iterator[Hint]:
    """B adds the module's bias to its output where A leaves it out (megatron's ``skip_bias_add``), or the reverse."""
    a = site.a
    if a.phase != "forward" or a.kind != "output":
        raise NotApplicable(f"not for {describe(a)}")
    bias = site.weights(a.module).get("bias")
    if bias is None:
        stored = any(r.phase == "weights" and r.module == a.module and r.slot == "bias" for r in site.recs_a)
        raise NotApplicable("the module's bias is not stored" if stored else "the module has no bias")
    if bias.shape != site.xa.shape[-1:]:
        raise NotApplicable("the module's bias does not fit its output")
    for sign, text in ((1.0, "adds"), (-1.0, "leaves out")):
        after = rel_l2(site.xa + sign * bias, site.xb)
        if explained_share(site.before, after) >= MIN_EXPLAINED:
            yield make_hint("missing-bias", f"B {text} the bias of {a.module} that A "
                        f"{'leaves out' if sign > 0 else 'adds'} here", site, after,
                        f"A {'+' if sign > 0 else '-'} {a.module}.bias reproduces B to rel L2 {after:.1e}")
