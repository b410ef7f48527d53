"""Adam's update rebuilt from captured gradients: which betas and epsilon reproduce each side's step.

A capture that starts with a fresh optimizer (no moments yet) and holds every step's parameter gradients determines
Adam's moments at each step: ``m = β1·m + (1-β1)·g``, ``v = β2·v + (1-β2)·g²``. The update of the ``k``-th step is
then, for AdamW with bias correction (torch's ``AdamW``, Apex/TE ``FusedAdam``, megatron-core's optimizer,
MindFormers' ``AdamW``)::

    ΔW = -lr · m̂ / (√v̂ + ε) - lr·wd · W        m̂ = m / (1-β1^k),  v̂ = v / (1-β2^k)

``fit_adam`` tries a grid of (β1, β2, ε) and, for each, fits the three coefficients (``lr``, ``lr·wd`` of the
parameters with two or more dimensions, ``lr·wd`` of the 1-D ones: norms and biases) by least squares; the
residual (relative L2 over every parameter) says how well that Adam reproduces the update. Settings whose residual
is at the best one's level are *consistent* with the update: at the first step (``k = 1``) no beta can be told from
another (``m̂ = g``, ``v̂ = g²``), and ε only shows where ``|g|`` is near it; the consistent sets say what the data
can tell apart. Bias correction is a factor per step (``(1-β1^k) / √(1-β2^k)`` where ε is small), so it shows as a
learning-rate factor: ``bias_correction_factor`` names it.

Framework-free: numpy only. Used by ``update`` (the optimizer-step hint).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

BETA1 = (0.0, 0.8, 0.85, 0.9, 0.95, 0.99)
BETA2 = (0.9, 0.95, 0.98, 0.99, 0.995, 0.999, 0.9999)
EPS = (1e-16, 1e-15, 1e-12, 1e-10, 1e-8, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3)
#: the betas users run with, for naming a bias-correction factor
COMMON_BETAS = ((0.9, 0.999), (0.9, 0.95), (0.9, 0.98), (0.9, 0.99), (0.95, 0.999))
#: gradient clips tried (``max_norm`` of the global gradient norm, Megatron-LM's ``--clip-grad``, default 1.0) when
#: no setting rebuilds an update without clipping
CLIPS = (1.0, 0.5, 2.0, 5.0, 0.25, 0.1, 10.0)
#: elements sampled (evenly, per parameter) when the parameters hold more
SAMPLE = 1 << 16
#: a setting is consistent with an update when its residual is within this factor of the best one's (plus the floor)
_SPREAD, _FLOOR = 1.5, 1e-7


@dataclass(frozen=True)
class AdamSetting:
    beta1: float
    beta2: float
    eps: float
    clip: float | None = None
    """the global gradient-norm clip (``max_norm``) the gradients went through first; None: no clipping"""

    def __str__(self) -> str:
        clip = "" if self.clip is None else f", clip {self.clip:g}"
        return f"betas ({self.beta1:g}, {self.beta2:g}), eps {self.eps:g}{clip}"


@dataclass
class AdamFit:
    """One side's update fitted by each setting: ``residual[setting]`` and its coefficients
    ``(lr, lr·wd of ≥2-D parameters, lr·wd of 1-D parameters)``; ``k`` is Adam's step number of the update."""

    k: int
    residual: dict[AdamSetting, float]
    coefficients: dict[AdamSetting, tuple[float, float, float]]

    @property
    def best(self) -> AdamSetting:
        return min(self.residual, key=self.residual.__getitem__)

    @property
    def best_residual(self) -> float:
        return self.residual[self.best]

    def consistent(self) -> set[AdamSetting]:
        """The settings that reproduce the update as well as the best one does (up to rounding)."""
        limit = _SPREAD * self.best_residual + _FLOOR
        return {s for s, r in self.residual.items() if r <= limit}


def _sample(arrays: Mapping[str, np.ndarray], limit: int = SAMPLE) -> dict[str, np.ndarray]:
    """Flat indices of each parameter's sampled elements (every one when they all fit in ``limit``)."""
    total = sum(a.size for a in arrays.values())
    stride = max(1, math.ceil(total / limit))
    return {k: np.arange(0, a.size, stride) for k, a in arrays.items()}


def fit_adam(sides: Mapping[str, tuple[Sequence[Mapping[str, np.ndarray]], Mapping[str, np.ndarray],
                                      Mapping[str, np.ndarray]]],
             norms: Mapping[str, Sequence[float]] | None = None, clip_above: float = 1e-3) -> dict[str, AdamFit]:
    """Each side's update fitted by Adam from a fresh start: ``sides[side] = (grads, weights, update)`` with the
    gradients of every step up to p (``grads[i][key]``, oldest first), the weights ``W(p)`` and the update
    ``W(s) - W(p)``, all keyed alike (each side's own gradients: Adam's sign-like first steps turn a gradient's
    rounding into a visible update, so A's gradients do not rebuild B's update to rounding). ``norms[side]``: the
    global gradient norm of each step; when a side's update is not rebuilt to ``clip_above`` without clipping, every
    side is fitted again with each of ``CLIPS`` (the gradients scaled by ``min(1, clip / (norm + 1e-6))``, as
    megatron-core and torch clip them)."""
    fits = {side: _fit_one(*data) for side, data in sides.items()}
    if norms and any(f.best_residual > clip_above for f in fits.values()):
        for side, (grads, weights, update) in sides.items():
            fit = fits[side]
            seen: dict[tuple[float, ...], float] = {}  # the steps' relative scales -> the clip fitted for them
            for clip in CLIPS:
                scales = tuple(min(1.0, clip / (n + 1e-6)) for n in norms[side])
                if all(x == 1.0 for x in scales):
                    continue  # a clip that clips nothing is no clipping
                shape = tuple(round(x / scales[-1], 9) for x in scales)
                if shape in seen:  # Adam's step does not see a common factor of every gradient (but for ε): the same
                    done = [x for x in fit.residual if x.clip == seen[shape]]
                    for x in done:
                        twin = AdamSetting(x.beta1, x.beta2, x.eps, clip)
                        fit.residual[twin], fit.coefficients[twin] = fit.residual[x], fit.coefficients[x]
                    continue
                seen[shape] = clip
                _fit_one(grads, weights, update, scales, clip, fit)
    return fits


def _fit_one(grads: Sequence[Mapping[str, np.ndarray]], weights: Mapping[str, np.ndarray],
             update: Mapping[str, np.ndarray], scales: Sequence[float] | None = None, clip: float | None = None,
             into: AdamFit | None = None) -> AdamFit:
    keys = [k for k in weights if all(k in g for g in grads) and k in update]
    idx = _sample({k: weights[k] for k in keys})

    def flat(x: Mapping[str, np.ndarray]) -> np.ndarray:
        return np.concatenate([np.asarray(x[k], np.float64).ravel()[idx[k]] for k in keys])

    g = [flat(step) * (1.0 if scales is None else scales[i]) for i, step in enumerate(grads)]
    w = flat(weights)
    two_d = np.concatenate([np.full(idx[k].size, np.ndim(weights[k]) >= 2) for k in keys])
    columns = [w * two_d, w * ~two_d]
    delta = flat(update)
    norm = float(np.linalg.norm(delta)) or math.inf
    k = len(g)
    fit = into if into is not None else AdamFit(k, {}, {})
    mine: list[AdamSetting] = []

    def moments(b1: float, b2: float) -> tuple[np.ndarray, np.ndarray]:
        return _moments(g, b1, b2)

    def solve(setting: AdamSetting, m_hat: np.ndarray, root_v: np.ndarray) -> float:
        u = m_hat / (root_v + setting.eps)
        a = -np.stack([u] + [c for c in columns if np.any(c)], axis=1)
        coef, *_ = np.linalg.lstsq(a, delta, rcond=None)
        rest = iter(coef[1:])
        wd2, wd1 = (float(next(rest)) if np.any(c) else 0.0 for c in columns)
        fit.residual[setting] = float(np.linalg.norm(a @ coef - delta)) / norm
        fit.coefficients[setting] = (float(coef[0]), wd2, wd1)
        mine.append(setting)
        return fit.residual[setting]

    for b1 in BETA1:
        for b2 in BETA2:
            m_hat, root_v = moments(b1, b2)
            for eps in EPS:
                solve(AdamSetting(b1, b2, eps, clip), m_hat, root_v)
    # epsilon between the grid's values (an effective ε/√(1-β2^k) without bias correction is rarely on it)
    best = min(mine, key=fit.residual.__getitem__)
    m_hat, root_v = moments(best.beta1, best.beta2)
    i = EPS.index(best.eps)
    lo, hi = math.log10(EPS[max(i - 1, 0)]), math.log10(EPS[min(i + 1, len(EPS) - 1)])
    golden = (math.sqrt(5) - 1) / 2
    for _ in range(30):
        x1, x2 = hi - golden * (hi - lo), lo + golden * (hi - lo)
        r1 = solve(AdamSetting(best.beta1, best.beta2, float(f"{10 ** x1:.3g}"), clip), m_hat, root_v)
        r2 = solve(AdamSetting(best.beta1, best.beta2, float(f"{10 ** x2:.3g}"), clip), m_hat, root_v)
        lo, hi = (lo, x2) if r1 <= r2 else (x1, hi)
    refined = min(mine, key=fit.residual.__getitem__).eps
    if refined not in EPS:  # every beta at that epsilon too, so that the consistent sets stay complete
        for b1 in BETA1:
            for b2 in BETA2:
                solve(AdamSetting(b1, b2, refined, clip), *moments(b1, b2))
    return fit


def bias_correction_factor(r: float, k: int) -> tuple[float, float, bool] | None:
    """The common betas whose bias correction at step ``k`` is the factor ``r`` between B's update and A's:
    ``(β1, β2, B_lacks)``; ``B_lacks`` when B's update is A's × (1-β1^k)/√(1-β2^k) (B without bias correction)."""
    for b1, b2 in COMMON_BETAS:
        f = (1 - b1 ** k) / math.sqrt(1 - b2 ** k)
        if abs(r / f - 1) < 2e-3:
            return b1, b2, True
        if abs(r * f - 1) < 2e-3:
            return b1, b2, False
    return None


def _moments(grads: Sequence[np.ndarray], b1: float, b2: float) -> tuple[np.ndarray, np.ndarray]:
    """Adam's bias-corrected moments after ``grads`` from zero: ``m̂`` and ``√v̂``."""
    m = np.zeros(np.shape(grads[0]))
    v = np.zeros(np.shape(grads[0]))
    for g in grads:
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
    k = len(grads)
    return m / (1 - b1 ** k), np.sqrt(v / (1 - b2 ** k))


def adam_update(grads: Sequence[np.ndarray], w: np.ndarray, setting: AdamSetting,
                coefficients: tuple[float, float, float], norms: Sequence[float] | None = None) -> np.ndarray:
    """The update ``ΔW`` of one parameter under ``setting`` and the fitted coefficients (``fit_adam``'s model);
    ``norms``: each step's global gradient norm, for a setting that clips."""
    scaled = [np.asarray(g, np.float64) * (min(1.0, setting.clip / (norms[i] + 1e-6))
                                           if setting.clip is not None and norms is not None else 1.0)
              for i, g in enumerate(grads)]
    m_hat, root_v = _moments(scaled, setting.beta1, setting.beta2)
    u = m_hat / (root_v + setting.eps)
    lr, wd2, wd1 = coefficients
    return -(lr * u + (wd2 if np.ndim(w) >= 2 else wd1) * np.asarray(w, np.float64))


def describe(settings: set[AdamSetting]) -> str:
    """What a set of consistent settings says about each of Adam's settings: 'β1 any (the update does not depend
    on it), β2 0.95, ε 1e-08' (``any`` where every value tried fits; several values where the data cannot tell)."""
    out = []
    for name, attr, grid in (("β1", "beta1", BETA1), ("β2", "beta2", BETA2), ("ε", "eps", EPS)):
        values = sorted({getattr(s, attr) for s in settings})
        if set(grid) <= set(values):
            out.append(f"{name} any")
            continue
        if attr == "eps":  # refined between the grid's values: two digits say it
            values = sorted({float(f"{v:.2g}") for v in values})
        if len(values) <= 3:
            out.append(f"{name} " + " or ".join(f"{v:g}" for v in values))
        else:
            out.append(f"{name} {values[0]:g}..{values[-1]:g}")
    clips = sorted({s.clip for s in settings}, key=lambda c: (c is not None, c or 0.0))
    if clips != [None]:
        out.append("clip " + " or ".join("none" if c is None else f"{c:g}" for c in clips))
    return ", ".join(out)
