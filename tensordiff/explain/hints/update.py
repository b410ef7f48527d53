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

import math
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise
from types import SimpleNamespace
from typing import Any

import numpy as np

from ...diff.metrics import rel_l2
from ...diff.result import DiffResult, Row
from ...store import CaptureReader
from .adam import AdamSetting, adam_update, bias_correction_factor, describe, fit_adam
from .base import Hint, NotApplicable, Site, explained_share

#: a fitted factor or decay must rebuild B's update this closely (relative L2) for every parameter to be named
_FIT = 0.02
#: Adam (``adam.fit_adam``) must rebuild each side's whole update this closely to name its settings
_ADAM_FIT = 1e-3
_NAMES = {"beta1": "β1", "beta2": "β2", "eps": "epsilon", "clip": "gradient clip"}


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
    """'; the captured settings of step p: lr A 0.001, B 0.0009; adam_eps A 1e-08, B 0.0001' from the per-step
    scalars the captures recorded at the optimizer's step (the learning rate always, Adam's betas and epsilon and
    the weight decay where they differ), or ''."""
    try:
        sa, sb = site.ca.scalars(), site.cb.scalars()
    except Exception:
        return ""
    shown = []
    for name in ("lr", "adam_beta1", "adam_beta2", "adam_eps", "weight_decay"):
        a, b = sa.get(name, {}), sb.get(name, {})
        if step in a and step in b and (name == "lr" or a[step] != b[step]):
            shown.append(f"{name} A {a[step]:.6g}, B {b[step]:.6g}")
    return f"; the captured settings of step {step}: {'; '.join(shown)}" if shown else ""


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


def fit_updates(result: DiffResult, ca: CaptureReader, cb: CaptureReader) -> list[UpdateFit]:
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


def _grads(site: Site, result: DiffResult, p: int) -> tuple[dict[str, list[dict[tuple[str, str], np.ndarray]]], int] | None:
    """Each side's parameter gradients (B's in A's layout, keyed by A's module and slot) of every captured step up
    to ``p``, oldest first, and the first step: when the capture holds every step from its first on with the
    gradients stored; else None."""
    steps = [t for t in result.steps if t <= p]
    if not steps or steps != list(range(steps[0], p + 1)):
        return None
    out: dict[str, list[dict[tuple[str, str], np.ndarray]]] = {"A": [], "B": []}
    for t in steps:
        a: dict[tuple[str, str], np.ndarray] = {}
        b: dict[tuple[str, str], np.ndarray] = {}
        for r in result.rows:
            if r.step != t or r.phase != "param_grad" or r.pair.a is None or r.pair.b is None or r.pair.a.kind != "grad":
                continue
            try:
                xa, xb = r.pair.a_tensor(site.ca.array), r.pair.b_tensor(site.cb.array)
            except Exception:
                continue
            if xa is not None and xb is not None and np.shape(xa) == np.shape(xb):
                a[(r.pair.a.module, r.pair.a.slot)] = np.asarray(xa, np.float64)
                b[(r.pair.a.module, r.pair.a.slot)] = np.asarray(xb, np.float64)
        if not a:
            return None
        out["A"].append(a)
        out["B"].append(b)
    return out, steps[0]


def _adam_hint(site: Site, result: DiffResult, p: int, common: list[str], before: dict, after: dict,
               da: dict[str, np.ndarray], db: dict[str, np.ndarray], rebuilt: Any) -> Hint | None:
    """Adam rebuilt from a fresh start and A's gradients: the betas or epsilon that differ, or bias correction
    (B's Adam term scaled, its weight decay not); None when Adam from a fresh start does not reproduce both
    updates (moments resumed, clipping, another optimizer) or the sides share a setting (the simpler fits
    name the learning rate or the weight decay)."""
    got = _grads(site, result, p)
    if got is None:
        return None
    grads, first = got
    where = {k: (before[k][0].pair.a.module, before[k][0].pair.a.slot) for k in common}
    keys = [k for k in common if all(where[k] in g for g in grads["A"]) and np.any(da[k])]
    if not keys or site.a.label not in keys:
        return None
    keys = [k for k in keys if all(where[k] in g for g in grads["B"])]
    g_by = {side: [{k: g[where[k]] for k in keys} for g in grads[side]] for side in grads}
    w0 = {k: before[k][1] for k in keys}
    # each step's global gradient norm, over every parameter gradient the side recorded (what a clip measures)
    norms = {side: [math.sqrt(sum(float(np.vdot(x, x)) for x in g.values())) for g in grads[side]] for side in grads}
    fits = fit_adam({"A": (g_by["A"], w0, {k: da[k] for k in keys}),
                     "B": (g_by["B"], {k: before[k][2] for k in keys}, {k: db[k] for k in keys})}, norms)
    fa, fb = fits["A"], fits["B"]
    if fa.best_residual > _ADAM_FIT or fb.best_residual > _ADAM_FIT:
        return None
    sa, sb = fa.consistent(), fb.consistent()
    key, k = site.a.label, fa.k
    source = (f"Adam from fresh moments at step {first} and each side's gradients of steps {first}..{p} (Adam's step k = "
              f"{k})")
    (lr_a, d2a, d1a), (lr_b, d2b, d1b) = fa.coefficients[fa.best], fb.coefficients[fb.best]
    r = lr_b / lr_a if lr_a else float("nan")
    floor = 1e-4 * abs(lr_a)  # a decay fitted below this is no decay (rounding)
    decay_same = all(abs(x - y) <= 2e-3 * max(abs(x), abs(y)) + floor for x, y in ((d2a, d2b), (d1a, d1b)))
    decays = any(abs(x) > floor for x in (d2a, d2b, d1a, d1b))
    bc = bias_correction_factor(r, k) if abs(r - 1) > 1e-3 else None
    if decays and decay_same and bc is not None:  # Adam's term scaled, the decay not: bias correction
        side = "B" if bc[2] else "A"
        after_err = rebuilt({key: adam_update([g[key] for g in g_by["B"]], before[key][2], fb.best,
                                              fb.coefficients[fb.best], norms["B"])})
        return Hint("optimizer-step", f"The optimizer step of step {p} differs by bias correction: {side} runs Adam "
                    f"without it (B's Adam term is {r:.6g} × A's, its weight decay is A's; (1-β1^k)/√(1-β2^k) = "
                    f"{r if bc[2] else 1 / r:.6g} for betas ({bc[0]:g}, {bc[1]:g}) at Adam's step k = {k})",
                    explained_share(site.before, after_err), site.before, after_err,
                    f"{source} reproduces A's update with {describe(sa)}, lr {lr_a:.6g}, lr·wd {d2a:.3g} (residual "
                    f"{fa.best_residual:.1e}) and B's with {describe(sb)}, lr {lr_b:.6g}, lr·wd {d2b:.3g} (residual "
                    f"{fb.best_residual:.1e}){_lr_evidence(site, p)}",
                    {"step": p, "fit": "bias-correction", "adam_step": k, "side": side, "factor": r,
                     "betas": [bc[0], bc[1]], "consistent": {"A": describe(sa), "B": describe(sb)}})
    if sa & sb:
        return None  # one setting reproduces both: the learning-rate and weight-decay fits say the rest
    named = [(c, sorted({getattr(x, c) for x in sa}, key=_order), sorted({getattr(x, c) for x in sb}, key=_order))
             for c in ("beta1", "beta2", "eps", "clip")]
    disjoint = [n for n in named if set(n[1]).isdisjoint(n[2])]
    if not disjoint:  # only a combination differs: the best settings' components
        disjoint = [(c, [getattr(fa.best, c)], [getattr(fb.best, c)]) for c in ("beta1", "beta2", "eps", "clip")
                    if getattr(fa.best, c) != getattr(fb.best, c)]

    def values(v: list[Any], c: str) -> str:
        if c == "clip":
            return " or ".join("none" if x is None else f"{x:g}" for x in v)
        shown = sorted({float(f"{x:.2g}") for x in v} if c == "eps" else v)  # ε refined between the grid's values
        return f"{shown[0]:g}" if len(shown) == 1 else f"{shown[0]:g}..{shown[-1]:g}"

    what = "; ".join(f"B's {_NAMES[c]} is {values(vb, c)} where A's is {values(va, c)}" for c, va, vb in disjoint)
    after_err = rebuilt({key: adam_update([g[key] for g in g_by["B"]], before[key][2], fb.best,
                                          fb.coefficients[fb.best], norms["B"])})
    return Hint("optimizer-step", f"The optimizer step of step {p} differs in Adam's settings: {what}",
                explained_share(site.before, after_err), site.before, after_err,
                f"{source} reproduces A's update with {describe(sa)} (residual {fa.best_residual:.1e}) and B's "
                f"with {describe(sb)} (residual {fb.best_residual:.1e}); no setting reproduces both"
                f"{_lr_evidence(site, p)}",
                {"step": p, "fit": "adam", "adam_step": k,
                 "differs": {c: {"A": va, "B": vb} for c, va, vb in disjoint},
                 "a": _setting(fa.best), "b": _setting(fb.best), "consistent": {"A": describe(sa), "B": describe(sb)},
                 "residual": {"A": fa.best_residual, "B": fb.best_residual}})


def _setting(x: AdamSetting) -> dict[str, float | None]:
    return {"beta1": x.beta1, "beta2": x.beta2, "eps": x.eps, "clip": x.clip}


def _order(x: float | None) -> tuple[bool, float]:
    return x is not None, x or 0.0


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

    adam = _adam_hint(site, result, p, common, before, after, da, db, rebuilt)
    if adam is not None:
        yield adam
        return
    # 1. one factor on every update: the learning rate
    num = sum(float(np.vdot(da[k], db[k])) for k in common)
    den = sum(float(np.vdot(da[k], da[k])) for k in common)
    if den > 0:
        r = num / den
        fits = [rel_l2(r * da[k], db[k]) for k in common if np.any(da[k])]
        after_err = rebuilt({k: r * da[k] for k in common}) if fits else math.nan
        if fits and max(fits) <= _FIT and abs(r - 1) > 1e-6 and explained_share(site.before, after_err) >= 0.5:
            k = p - result.steps[0] + 1  # Adam's step number, if the capture began with the run
            bc = bias_correction_factor(r, k)
            also = "" if bc is None else (
                f", or {'B' if bc[2] else 'A'} runs Adam without bias correction (its factor "
                f"(1-β1^k)/√(1-β2^k) at Adam's step k = {k} is {r if bc[2] else 1 / r:.6g} for betas ({bc[0]:g}, "
                f"{bc[1]:g}))")
            yield Hint("optimizer-step", f"The optimizer step of step {p} differs by one factor: B's update is "
                       f"{r:.6g} × A's for every parameter, as a different learning rate makes it (schedule, "
                       f"warm-up, scaling){also}", explained_share(site.before, after_err), site.before, after_err,
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
