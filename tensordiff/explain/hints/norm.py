"""Norm hints: B normalises with another epsilon, or LayerNorm where A uses RMSNorm (or the reverse)

See docs/hints/norm-epsilon.md."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from .base import MIN_EXPLAINED, Hint, NotApplicable, Site, describe, explained_share, make_hint, rel_l2

#: Known epsilons and who uses them by default.
EPSILONS = {
    1e-5: "PyTorch nn.LayerNorm / megatron-core default",
    1e-6: "Llama / Qwen RMSNorm",
    1e-7: "MindSpore nn.LayerNorm default",
    1e-8: "common Adam-style epsilon",
    1e-12: "BERT / HF LayerNorm",
    1e-2: "a badly scaled epsilon",
}


def _norm(x: np.ndarray, kind: str, eps: float, gamma: np.ndarray | None, beta: np.ndarray | None) -> np.ndarray:
    if kind == "layernorm":
        xc = x - x.mean(axis=-1, keepdims=True)
        y = xc / np.sqrt((xc ** 2).mean(axis=-1, keepdims=True) + eps)
    else:
        y = x / np.sqrt((x ** 2).mean(axis=-1, keepdims=True) + eps)
    if gamma is not None:
        y = y * gamma
    if beta is not None:
        y = y + beta
    return y


def _solve_eps(x: np.ndarray, y: np.ndarray, kind: str, gamma: np.ndarray | None, beta: np.ndarray | None) -> float:
    """The epsilon that makes ``norm(x)`` closest to ``y`` (robust median over rows)."""
    x2 = x.reshape(-1, x.shape[-1])
    y2 = y.reshape(-1, y.shape[-1])
    xc = x2 - x2.mean(axis=-1, keepdims=True) if kind == "layernorm" else x2
    var = (xc ** 2).mean(axis=-1, keepdims=True)
    yb = y2 - (beta if beta is not None else 0.0)
    num = xc * (gamma if gamma is not None else 1.0)
    big = np.abs(yb) > 0.5 * np.sqrt((yb ** 2).mean(axis=-1, keepdims=True))
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(big, num / yb, np.nan)  # = sqrt(var + eps) per element
    s = np.nanmedian(scale, axis=-1)
    eps_rows = s ** 2 - var[:, 0]
    eps = float(np.nanmedian(eps_rows))
    return max(eps, 0.0)


def _nearest_known(eps: float) -> tuple[float, str] | None:
    if eps <= 0:
        return None
    best = min(EPSILONS, key=lambda e: abs(math.log10(e) - math.log10(eps)))
    return (best, EPSILONS[best]) if abs(math.log10(best) - math.log10(eps)) < 0.15 else None


def check_norm_epsilon(site: Site) -> Iterator[Hint]:
    """B normalises with another epsilon (or LayerNorm vs RMSNorm): solve for B's epsilon."""
    a = site.a
    if a.phase != "forward" or a.kind != "output":
        raise NotApplicable(f"not for {describe(a)}")
    ins = site.inputs(a.module, a.call)
    if not ins:
        raise NotApplicable("the module's input is not stored")
    if ins[0].shape != site.xa.shape:
        raise NotApplicable("no input of a fitting shape")
    x = ins[0]
    w = site.weights(a.module)
    gamma = next((w[k] for k in ("weight", "gamma") if k in w and w[k].shape == x.shape[-1:]), None)
    beta = next((w[k] for k in ("bias", "beta") if k in w and w[k].shape == x.shape[-1:]), None)
    best = None
    for kind in ("layernorm", "rmsnorm"):
        eps_a = _solve_eps(x, site.xa, kind, gamma, beta)
        fit_a = rel_l2(_norm(x, kind, eps_a, gamma, beta), site.xa)
        if best is None or fit_a < best[2]:
            best = (kind, eps_a, fit_a)
    kind, eps_a, fit_a = best  # type: ignore[misc]
    if fit_a > 0.05 * site.before:
        return  # A is not a norm of its input with these weights
    for kind_b in (kind, "rmsnorm" if kind == "layernorm" else "layernorm"):
        eps_b = _solve_eps(x, site.xb, kind_b, gamma, beta)
        after = rel_l2(_norm(x, kind_b, eps_b, gamma, beta), site.xb)
        if explained_share(site.before, after) < MIN_EXPLAINED:
            continue
        label = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}
        known = _nearest_known(eps_b)
        known_a = _nearest_known(eps_a)
        eps_b_text = f"{known[0]:.0e}" if known else f"{eps_b:.2e}"
        eps_a_text = f"{known_a[0]:.0e}" if known_a else f"{eps_a:.2e}"
        if kind_b != kind:
            title = f"B normalises with {label[kind_b]} where A uses {label[kind]}"
        else:
            title = f"B's {label[kind]} epsilon is {eps_b_text}, A's is {eps_a_text}"
        if known:
            title += f" ({eps_b_text}: {known[1]})"
        yield make_hint("norm-epsilon", title, site, after,
                    f"solved from A's input and weights: epsilon A {eps_a:.3g}, B {eps_b:.3g}; "
                    f"{label[kind_b]} with B's epsilon reproduces B to rel L2 {after:.1e}",
                    kind_a=kind, kind_b=kind_b, eps_a=eps_a, eps_b=eps_b)
        return
