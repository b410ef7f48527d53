"""Optimizer-step hint: the forward and the gradients of the step before agree, the weights after it do not.

When a capture holds several steps and the first divergence is a parameter at step ``s`` (not the first step),
everything of step ``p`` (the captured step before) was compared and agreed: the same weights, the same
activations, the same gradients. What differs is the update ``W(s) - W(p)`` the optimizer made from them. The check
fits B's update to A's over every parameter both sides recorded:

* ``learning rate``: ``ΔB = r · ΔA`` for every parameter with one ``r`` (Adam's update is linear in the learning
  rate; a learning-rate schedule, warm-up or scaling that differs);
* ``weight decay``: ``ΔB = ΔA - c · W(p)`` where the parameters that differ are decayed by one ``c = lr · Δwd``;
  when only 1-D parameters (norms, biases) differ, B decays the parameters megatron-core exempts (or A does);
* otherwise the update differs in another way (Adam's epsilon or betas, bias correction, clipping, the moments
  themselves): said as such, with the share of parameters whose update differs.

See docs/hints/optimizer-step.md. Framework-free: numpy on captured arrays.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise
from types import SimpleNamespace
from typing import Any

import numpy as np

from ...diff.metrics import rel_l2
from ...diff.result import DiffResult, Row
from .base import Hint, NotApplicable, Site, explained_share

#: a fitted factor or decay must rebuild B's update this closely (relative L2) for every parameter to be named
_FIT = 0.02


def _weights(result: DiffResult, step: int, site: Any) -> dict[str, tuple[Row, np.ndarray, np.ndarray]]:
    """A's label -> (row, A's array, B's array in A's layout) of every compared weight at ``step`` (``site``: anything
    with the two captures as ``ca`` and ``cb``)."""
    out = {}
    for r in result.rows:
        if r.step != step or r.phase != "weights" or r.pair.a is None or r.pair.b is None:
            continue
        xa = r.pair.a_tensor(site.ca.array)
        try:
            xb = r.pair.b_tensor(site.cb.array)
        except Exception:
            xb = None
        if xa is None or xb is None or np.shape(xa) != np.shape(xb) or not np.issubdtype(np.asarray(xa).dtype,
                                                                                          np.floating):
            continue
        out[r.pair.a.label] = (r, np.asarray(xa, np.float64), np.asarray(xb, np.float64))
    return out


def _lr_evidence(site: Site, step: int) -> str:
    """'learning rate at step p: A 1e-3, B 9.3e-4' from the captured per-step scalars, or ''."""
    try:
        la, lb = site.ca.scalars().get("lr", {}), site.cb.scalars().get("lr", {})
    except Exception:
        return ""
    if step in la and step in lb:
        return f"; the captured learning rates of step {step}: A {la[step]:.6g}, B {lb[step]:.6g}"
    return ""


@dataclass
class UpdateFit:
    """Each side's own update from step ``p`` to ``s`` (``ΔA = W_A(s) - W_A(p)``, ``ΔB`` the same on B), fitted as
    ``ΔB = factor · ΔA``: ``worst`` is the largest relative residual over the ``parameters`` that moved. Holds also
    when the runs did not start from the same weights (each side resumed from its own checkpoint)."""

    p: int
    s: int
    factor: float
    worst: float
    parameters: int

    @property
    def one_factor(self) -> bool:
        """The same factor explains every parameter's update to 10% (a learning rate, with drifted states)."""
        return self.parameters > 0 and self.worst <= 0.1 and abs(self.factor - 1) > 1e-6

    def as_dict(self) -> dict[str, Any]:
        return {"from_step": self.p, "to_step": self.s, "factor": self.factor, "worst_residual": self.worst,
                "parameters": self.parameters, "one_factor": self.one_factor}


def fit_updates(result: DiffResult, ca: Any, cb: Any) -> list[UpdateFit]:
    """``ΔB = r · ΔA`` fitted for every pair of consecutive captured steps holding weights on both sides."""
    sides = SimpleNamespace(ca=ca, cb=cb)
    out = []
    steps = result.steps
    for p, s in pairwise(steps):
        before, after = _weights(result, p, sides), _weights(result, s, sides)
        common = [k for k in after if k in before]
        da = {k: after[k][1] - before[k][1] for k in common}
        db = {k: after[k][2] - before[k][2] for k in common}
        moved = [k for k in common if np.any(da[k])]
        den = sum(float(np.vdot(da[k], da[k])) for k in moved)
        if not moved or den <= 0:
            continue
        r = sum(float(np.vdot(da[k], db[k])) for k in moved) / den
        out.append(UpdateFit(p, s, r, max(rel_l2(r * da[k], db[k]) for k in moved), len(moved)))
    return out


def check_update(site: Site, result: DiffResult) -> Iterator[Hint]:
    """The update of the step before the diverged parameter differs: which of learning rate, weight decay or the
    rest of the step reproduces B's update from A's."""
    s = site.a.step
    earlier = [t for t in result.steps if t < s]
    if site.a.phase != "weights" or not earlier:
        return  # ruled out: the weights the divergence was computed from agree, or no update came before them
    p = earlier[-1]
    grads = [r for r in result.rows if r.step == p and r.phase == "param_grad" and r.metrics is not None]
    if not grads:
        raise NotApplicable(f"no parameter gradients compared at step {p}")
    before, after = _weights(result, p, site), _weights(result, s, site)
    common = [k for k in after if k in before]
    if site.a.label not in common:
        raise NotApplicable(f"the parameter is not stored at steps {p} and {s}")
    da = {k: after[k][1] - before[k][1] for k in common}
    db = {k: after[k][2] - before[k][2] for k in common}
    w0 = {k: before[k][1] for k in common}
    differs = [k for k in common if after[k][0].verdict == "diverged"]
    evidence_lr = _lr_evidence(site, p)
    key = site.a.label
    wb = after[key][2]

    def rebuilt(update: dict[str, np.ndarray]) -> float:
        return rel_l2(w0[key] + update[key], wb) if wb.size else float("nan")

    # 1. one factor on every update: the learning rate
    num = sum(float(np.vdot(da[k], db[k])) for k in common)
    den = sum(float(np.vdot(da[k], da[k])) for k in common)
    if den > 0:
        r = num / den
        fits = [rel_l2(r * da[k], db[k]) for k in common if np.any(da[k])]
        if fits and max(fits) <= _FIT and abs(r - 1) > 1e-6:
            after_err = rebuilt({k: r * da[k] for k in common})
            yield Hint("optimizer-step", f"The optimizer step of step {p} differs by one factor: B's update is "
                       f"{r:.6g} × A's for every parameter, as a different learning rate makes it (schedule, "
                       "warm-up, scaling)", explained_share(site.before, after_err), site.before, after_err,
                       f"forward and gradients of step {p} agree; {len(common)} parameters' updates fit ΔB = r·ΔA "
                       f"(worst residual {max(fits):.1e}){evidence_lr}", {"factor": r, "step": p, "fit": "lr"})
            return
    # 2. weight decay on some parameters: ΔB - ΔA = -c · W(p) with one c
    decayed = [k for k in common if rel_l2(da[k], db[k]) > _FIT * 0.5]
    if decayed:
        num = -sum(float(np.vdot(db[k] - da[k], w0[k])) for k in decayed)
        den = sum(float(np.vdot(w0[k], w0[k])) for k in decayed)
        c = num / den if den > 0 else 0.0
        fits = [rel_l2(da[k] - c * w0[k], db[k]) for k in decayed]
        if c != 0 and fits and max(fits) <= _FIT:
            one_d = [k for k in decayed if w0[k].ndim == 1]
            # 1-D parameters left alone that a decay would have moved (a zero bias shows no decay either way)
            others_1d = [k for k in common if w0[k].ndim == 1 and k not in decayed
                         and abs(c) * float(np.linalg.norm(w0[k])) > _FIT * float(np.linalg.norm(da[k]))]
            if len(one_d) == len(decayed) and not others_1d:
                which = ("B also decays the 1-D parameters (norm weights, biases) that A exempts" if c > 0 else
                         "A decays the 1-D parameters (norm weights, biases) that B exempts")
            else:
                which = f"{'B' if c > 0 else 'A'} decays {len(decayed)} of {len(common)} parameters more"
            after_err = rebuilt({k: (da[k] - c * w0[k]) if k in decayed else da[k] for k in common})
            yield Hint("optimizer-step", f"The optimizer step of step {p} differs by weight decay: {which} "
                       f"(ΔB = ΔA - c·W with c = lr·Δwd = {c:.3g})", explained_share(site.before, after_err),
                       site.before, after_err,
                       f"forward and gradients of step {p} agree; {len(decayed)} parameter(s) differ, e.g. "
                       f"{', '.join(decayed[:4])}", {"decay": c, "step": p, "fit": "weight-decay",
                                                     "parameters": decayed})
            return
    # 3. the update differs otherwise: located, not explained
    shown = ", ".join(differs[:4]) + (f" and {len(differs) - 4} more" if len(differs) > 4 else "")
    yield Hint("optimizer-step", f"The optimizer step of step {p} differs: its forward and gradients agree, the "
               f"weights after it do not ({len(differs)} of {len(common)} parameters)", 1.0, site.before, 0.0,
               f"{shown}; neither one learning-rate factor nor weight decay reproduces B's update: compare Adam's "
               f"epsilon and betas, bias correction, clipping and the moments the runs resumed with{evidence_lr}",
               {"step": p, "fit": "none", "parameters": differs})
