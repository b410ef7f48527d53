"""Dropout hint: a dropout is active on one side (p > 0 in training mode) and passes its input through on the other.

At a forward output whose module is a dropout (by class name) or has no parameters, each side's output is compared
with A's input of that call (which both sides received: the inputs agree at a first divergence). A dropping side
zeroes a share ``p`` of the elements and scales the rest by ``1/(1-p)``: its output is ``input × keep-mask / (1-p)``
exactly. The check measures both (the zeros share, the scale of the kept elements) and rebuilds B's output as A's
output × B's keep-mask / (1-p) (or, where A drops, as A's input): what explains the gap.

See docs/hints/dropout.md. Framework-free: numpy on captured arrays.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from .base import Hint, NotApplicable, Site, make_hint, rel_l2

#: a side drops out when input × its keep-mask × one scale rebuilds its output this closely (relative L2)
_FIT = 1e-4


@dataclass
class _Drop:
    """How one side's output relates to the input: the share of zeroed elements and the scale of the kept ones."""

    zeros: float
    scale: float
    keep: np.ndarray

    @property
    def p(self) -> float:
        """The dropout probability the scale says (1 - 1/scale)."""
        return 1.0 - 1.0 / self.scale if self.scale > 0 else float("nan")


def _drop(x: np.ndarray, y: np.ndarray) -> _Drop | None:
    """``y = x × keep / (1-p)`` with some elements dropped, or None (``y`` is not a dropout of ``x``)."""
    live = x != 0
    if not live.any():
        return None
    keep = y != 0
    zeros = float((~keep & live).sum()) / float(live.sum())
    kept = keep & live
    if zeros <= 0 or zeros >= 0.99 or not kept.any() or (keep & ~live).any():
        return None
    scale = float(np.median(y[kept] / x[kept]))
    if not scale > 1.0 or rel_l2(x * keep * scale, y) > _FIT:
        return None
    return _Drop(zeros, scale, keep)


def check_dropout(site: Site) -> Iterator[Hint]:
    """A dropout active on one side: its output is the input with a share p zeroed and the rest × 1/(1-p)."""
    a = site.a
    if a.phase != "forward" or a.kind != "output":
        return  # ruled out: a dropout shows first in a forward output
    classes = f"{a.module_class} {site.b.module_class}".lower()
    named = "dropout" in classes
    if not named and site.weights(a.module):
        return  # a module with parameters and not named like a dropout
    ins = [x for x in site.inputs(a.module, a.call) if x.shape == site.xa.shape]
    if not ins:
        if named:
            raise NotApplicable("the dropout's input is not stored")
        return
    x = ins[0]
    drop_a, drop_b = _drop(x, site.xa), _drop(x, site.xb)
    if drop_b is None and drop_a is None:
        return
    module = a.module or "<model>"
    kind_a = f"{module} ({a.module_class or '?'})"
    kind_b = f"{site.b.module or '<model>'} ({site.b.module_class or '?'})"

    def said(d: _Drop) -> str:
        return (f"{d.zeros:.1%} of its elements zeroed, the rest scaled by {d.scale:.6g} = 1/(1-{d.p:.3g})")

    if drop_b is not None and drop_a is None and rel_l2(x, site.xa) <= _FIT:
        hyp = site.xa * drop_b.keep * drop_b.scale
        title = (f"B's {kind_b} drops out ({said(drop_b)}); A's passes its input through: dropout is active on B "
                 "(p > 0 in training mode); set its probability to 0 (or evaluate) to compare")
        side, d = "B", drop_b
    elif drop_a is not None and drop_b is None and rel_l2(x, site.xb) <= _FIT:
        hyp = x
        title = (f"A's {kind_a} drops out ({said(drop_a)}); B's passes its input through: dropout is active on A "
                 "(p > 0 in training mode); set its probability to 0 (or evaluate) to compare")
        side, d = "A", drop_a
    elif drop_a is not None and drop_b is not None:
        hyp = x * drop_b.keep * drop_b.scale
        both = kind_a if kind_a == kind_b else f"{kind_a} and {kind_b}"
        title = (f"Both sides' {both} drop out, with other masks (A: {said(drop_a)}; B: {said(drop_b)}): their "
                 "random streams differ; set the probability to 0 on both to compare")
        side, d = "both", drop_b
    else:
        return
    after = rel_l2(hyp, site.xb)
    yield make_hint("dropout", title, site, after,
                    f"{side}'s output = the input × its keep-mask × {d.scale:.6g}; A's output × B's keep-mask / "
                    f"(1-p) reproduces B to rel L2 {after:.1e}",
                    module=module, module_b=site.b.module, side=side, p=d.p, zeros=d.zeros, scale=d.scale)
