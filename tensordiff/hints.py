"""Say why: test the common causes of cross-framework divergence at the first divergence.

Each check rebuilds the diverged tensor from side A's captured tensors under one hypothesis
(B uses the tanh GELU, another norm epsilon, BF16 rounding, a permuted layout, a constant
factor, ...) and measures how much of the A-vs-B gap that explains:

    explained = 1 - rel_l2(hypothesis, B) / rel_l2(A, B)

A check that cannot first reproduce A itself from the same inputs says nothing (its
reconstruction would be guesswork). Hints are ranked by ``explained``; only those that
explain at least half of the gap are reported. Framework-free: numpy on captured arrays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

import ml_dtypes
import numpy as np

from .record import Record, is_inside
from .transforms import apply

if TYPE_CHECKING:
    from .engine import DiffResult, Row
    from .store import Capture

#: A hint must explain at least this share of the gap to be reported.
MIN_EXPLAINED = 0.5

#: Known epsilons and who uses them by default.
EPSILONS = {
    1e-5: "PyTorch nn.LayerNorm / megatron-core default",
    1e-6: "Llama / Qwen RMSNorm",
    1e-7: "MindSpore nn.LayerNorm default",
    1e-8: "common Adam-style epsilon",
    1e-12: "BERT / HF LayerNorm",
    1e-2: "a badly scaled epsilon",
}


@dataclass
class Hint:
    cause: str
    """Short name: activation, norm-epsilon, rope, dtype, layout, missing-bias, factor, checkpoint."""
    title: str
    """One sentence: what B does differently."""
    explained: float
    """Share of the A-vs-B gap this hypothesis explains (0..1)."""
    before: float
    """rel L2 of A vs B."""
    after: float
    """rel L2 of the hypothesis (built from A's tensors) vs B."""
    evidence: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"cause": self.cause, "title": self.title, "explained": round(self.explained, 6),
                "rel_l2_before": self.before, "rel_l2_after": self.after, "evidence": self.evidence,
                "details": self.details}


def _rel(x: np.ndarray, y: np.ndarray) -> float:
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.shape != y.shape:
        return math.inf
    scale = max(float(np.linalg.norm(x)), float(np.linalg.norm(y)))
    return float(np.linalg.norm(x - y)) / scale if scale > 0 else 0.0


def _explained(before: float, after: float) -> float:
    if not math.isfinite(after) or before <= 0:
        return 0.0
    return max(0.0, min(1.0, 1.0 - after / before))


# ----------------------------------------------------------------------------- activations
_erf = np.vectorize(math.erf, otypes=[np.float64])  # numpy has no erf; math.erf is exact in float64


def _gelu_erf(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _halves(x: np.ndarray, interleaved: bool) -> tuple[np.ndarray, np.ndarray]:
    if interleaved:
        return x[..., 0::2], x[..., 1::2]
    h = x.shape[-1] // 2
    return x[..., :h], x[..., h:]


ACTIVATIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "gelu (erf, exact)": _gelu_erf,
    "gelu (tanh approximation)": _gelu_tanh,
    "silu": _silu,
    "relu": lambda x: np.maximum(x, 0.0),
    "swiglu silu(gate) * up, [gate; up]": lambda x: _silu(_halves(x, False)[0]) * _halves(x, False)[1],
    "swiglu silu(up) * gate, [gate; up] swapped": lambda x: _silu(_halves(x, False)[1]) * _halves(x, False)[0],
    "swiglu, gate/up interleaved": lambda x: _silu(_halves(x, True)[0]) * _halves(x, True)[1],
    "geglu gelu(gate) * up": lambda x: _gelu_erf(_halves(x, False)[0]) * _halves(x, False)[1],
    "geglu gelu_tanh(gate) * up": lambda x: _gelu_tanh(_halves(x, False)[0]) * _halves(x, False)[1],
}


def _d_gelu_erf(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + _erf(x / math.sqrt(2.0))) + x * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _d_gelu_tanh(x: np.ndarray) -> np.ndarray:
    k = math.sqrt(2.0 / math.pi)
    t = np.tanh(k * (x + 0.044715 * x ** 3))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3 * 0.044715 * x * x)


def _d_silu(x: np.ndarray) -> np.ndarray:
    s = 1.0 / (1.0 + np.exp(-x))
    return s * (1.0 + x * (1.0 - s))


DERIVATIVES: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "gelu (erf, exact)": _d_gelu_erf,
    "gelu (tanh approximation)": _d_gelu_tanh,
    "silu": _d_silu,
    "relu": lambda x: (x > 0).astype(np.float64),
}


# ----------------------------------------------------------------------------- norms
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


# ----------------------------------------------------------------------------- rope
def _rope(x: np.ndarray, base: float, interleaved: bool, offset: int, seq_axis: int) -> np.ndarray:
    """Rotary embedding over the last dimension; positions along ``seq_axis`` (+ offset)."""
    d = x.shape[-1]
    inv = 1.0 / (base ** (np.arange(0, d, 2, dtype=np.float64) / d))
    pos = np.arange(x.shape[seq_axis], dtype=np.float64) + offset
    ang = np.outer(pos, inv)  # [S, d/2]
    shape = [1] * x.ndim
    shape[seq_axis] = x.shape[seq_axis]
    shape[-1] = d // 2
    cos, sin = np.cos(ang).reshape(shape), np.sin(ang).reshape(shape)
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x, dtype=np.float64)
        out[..., 0::2] = x1 * cos - x2 * sin
        out[..., 1::2] = x1 * sin + x2 * cos
        return out
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


# ----------------------------------------------------------------------------- the site
class _Site:
    """The diverged pair and what side A captured around it."""

    def __init__(self, row: "Row", ca: "Capture", cb: "Capture"):
        self.row = row
        self.a: Record = row.pair.a  # type: ignore[assignment]
        self.b: Record = row.pair.b  # type: ignore[assignment]
        self.ca, self.cb = ca, cb
        self.recs_a = ca.records(self.a.step)
        self.by_seq = {r.seq: r for r in self.recs_a}
        xa, xb = ca.array(self.a), cb.array(self.b)
        self.xa = None if xa is None else xa.astype(np.float64)
        self.xb = None
        if xb is not None:
            xb = apply(row.pair.ops, xb) if row.pair.ops else xb
            self.xb = np.asarray(xb, dtype=np.float64)
        self.before = _rel(self.xa, self.xb) if self.ready else math.nan
        self._weights: dict[str, dict[str, np.ndarray]] = {}
        self._inputs: dict[tuple[str, int], list[np.ndarray]] = {}

    @property
    def ready(self) -> bool:
        return self.xa is not None and self.xb is not None and self.xa.shape == self.xb.shape

    def array(self, rec: Record) -> np.ndarray | None:
        x = self.ca.array(rec)
        return None if x is None else x.astype(np.float64)

    def weights(self, module: str) -> dict[str, np.ndarray]:
        """A's parameters of ``module`` at this step (read once; several checks ask)."""
        if module not in self._weights:
            self._weights[module] = {r.slot: x for r in self.recs_a if r.phase == "weights" and r.module == module
                                     for x in [self.array(r)] if x is not None}
        return self._weights[module]

    def inputs(self, module: str, call: int) -> list[np.ndarray]:
        """A's floating-point inputs of that call, in record order (read once)."""
        if (module, call) not in self._inputs:
            self._inputs[(module, call)] = [
                x for r in self.recs_a
                if r.phase == "forward" and r.kind == "input" and r.module == module and r.call == call
                for x in [self.array(r)] if x is not None and np.issubdtype(x.dtype, np.floating)]
        return self._inputs[(module, call)]

    def earlier_outputs(self, limit: int = 4) -> Iterator[Record]:
        """A's forward outputs made just before the diverged tensor inside the same parent call, newest first."""
        a = self.a
        parent = a.parent if a.kind == "input" else a.module
        found = 0
        for r in sorted(self.recs_a, key=lambda r: -r.seq):
            if r.seq >= a.seq or r.phase != "forward" or r.kind != "output":
                continue
            if parent and not is_inside(r.module, parent):
                continue
            if r.module == a.module:
                continue
            yield r
            found += 1
            if found >= limit:
                return


def _fit_sides(site: "_Site", outs: dict) -> tuple[Any, Any, float] | None:
    """Of candidate rebuilds, the one closest to A and the one closest to B: (key A, key B, B's residual), or
    None when no candidate reproduces A (the inputs are not this op's) or A's and B's best are the same."""
    if not outs:
        return None
    key_a = min(outs, key=lambda k: _rel(outs[k], site.xa))
    if _rel(outs[key_a], site.xa) > 0.05 * site.before:
        return None
    key_b = min(outs, key=lambda k: _rel(outs[k], site.xb))
    if key_b == key_a:
        return None
    return key_a, key_b, _rel(outs[key_b], site.xb)


def _rope_name(k: tuple) -> str:
    return (f"{'interleaved (GPT-J)' if k[0] else 'rotate-half (NeoX)'} pairs, base {k[1]:g}"
            + (f", positions from {k[2]}" if k[2] else ""))


def _hint(cause: str, title: str, site: _Site, after: float, evidence: str = "", **details: Any) -> Hint:
    return Hint(cause, title, _explained(site.before, after), site.before, after, evidence, details)


# ----------------------------------------------------------------------------- checks
def check_activation(site: _Site) -> Iterator[Hint]:
    """B applies another activation (GELU tanh vs erf, SwiGLU halves swapped or interleaved) to the same input."""
    for src in site.earlier_outputs():
        x = site.array(src)
        if x is None:
            continue
        candidates = [(f"{src.module} {src.tensor_label}", x)]
        bias = site.weights(src.module).get("bias")
        if bias is not None and bias.shape == x.shape[-1:]:
            candidates.append((f"{src.module} {src.tensor_label} + its bias", x + bias))
        for label, pre in candidates:
            outs = {}
            for name, fn in ACTIVATIONS.items():
                try:
                    y = np.asarray(fn(pre), dtype=np.float64)
                except (ValueError, IndexError):
                    continue
                if y.shape == site.xa.shape:
                    outs[name] = y
            fit = _fit_sides(site, outs)
            if fit is None:
                continue
            name_a, name_b, after = fit
            yield _hint("activation", f"B computes {name_b} where A computes {name_a}", site, after,
                        f"input: A's {label}; A = {name_a} of it (rel L2 {_rel(outs[name_a], site.xa):.1e}), "
                        f"B = {name_b} of it (rel L2 {after:.1e})", a=name_a, b=name_b, input=label)
            return


def check_activation_backward(site: _Site) -> Iterator[Hint]:
    """B's backward uses another activation derivative (e.g. the tanh GELU's) than A's forward implies."""
    a = site.a
    if a.phase != "backward" or a.grad_of < 0:
        return
    fwd = site.by_seq.get(a.grad_of)
    if fwd is None or fwd.kind != "output":
        return
    x = site.array(fwd)
    if x is None or x.shape != site.xa.shape:
        return
    pres = [("", x)]
    bias = site.weights(fwd.module).get("bias")
    if bias is not None and bias.shape == x.shape[-1:]:
        pres.append((" + its bias", x + bias))
    # the gradient that arrived from above: the latest earlier gradient of the same shape in this backward
    upstream = [r for r in site.recs_a if r.phase == "backward" and r.seq < a.seq and tuple(r.shape) == tuple(x.shape)]
    for up in sorted(upstream, key=lambda r: -r.seq)[:3]:
        g = site.array(up)
        if g is None:
            continue
        for suffix, pre in pres:
            fit = _fit_sides(site, {name: g * d(pre) for name, d in DERIVATIVES.items()})
            if fit is None:
                continue
            name_a, name_b, after = fit
            yield _hint("activation-backward", f"B's backward multiplies by the derivative of {name_b}; A's by that "
                        f"of {name_a}", site, after,
                        f"A's {up.module} {up.tensor_label} × {name_b}'({fwd.module} {fwd.tensor_label}{suffix}) "
                        f"reproduces B to rel L2 {after:.1e}", a=name_a, b=name_b)
            return


def check_norm_epsilon(site: _Site) -> Iterator[Hint]:
    """B normalises with another epsilon (or LayerNorm vs RMSNorm): solve for B's epsilon."""
    a = site.a
    if a.phase != "forward" or a.kind != "output":
        return
    ins = site.inputs(a.module, a.call)
    if not ins or ins[0].shape != site.xa.shape:
        return
    x = ins[0]
    w = site.weights(a.module)
    gamma = next((w[k] for k in ("weight", "gamma") if k in w and w[k].shape == x.shape[-1:]), None)
    beta = next((w[k] for k in ("bias", "beta") if k in w and w[k].shape == x.shape[-1:]), None)
    best = None
    for kind in ("layernorm", "rmsnorm"):
        eps_a = _solve_eps(x, site.xa, kind, gamma, beta)
        fit_a = _rel(_norm(x, kind, eps_a, gamma, beta), site.xa)
        if best is None or fit_a < best[2]:
            best = (kind, eps_a, fit_a)
    kind, eps_a, fit_a = best  # type: ignore[misc]
    if fit_a > 0.05 * site.before:
        return  # A is not a norm of its input with these weights
    for kind_b in (kind, "rmsnorm" if kind == "layernorm" else "layernorm"):
        eps_b = _solve_eps(x, site.xb, kind_b, gamma, beta)
        after = _rel(_norm(x, kind_b, eps_b, gamma, beta), site.xb)
        if _explained(site.before, after) < MIN_EXPLAINED:
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
        yield _hint("norm-epsilon", title, site, after,
                    f"solved from A's input and weights: epsilon A {eps_a:.3g}, B {eps_b:.3g}; "
                    f"{label[kind_b]} with B's epsilon reproduces B to rel L2 {after:.1e}",
                    kind_a=kind, kind_b=kind_b, eps_a=eps_a, eps_b=eps_b)
        return


def check_rope(site: _Site) -> Iterator[Hint]:
    """B rotates q/k with another RoPE convention, base or position offset."""
    if site.xa.ndim != 4:
        return
    for src in site.earlier_outputs(limit=6):
        x = site.array(src)
        if x is None or x.shape != site.xa.shape:
            continue
        for seq_axis in (0, 1, 2):
            variants = {}
            for interleaved in (False, True):
                for base in (10000.0, 500000.0, 1000000.0, 50000.0):
                    for offset in (0, 1):
                        variants[(interleaved, base, offset)] = _rope(x, base, interleaved, offset, seq_axis)
            fit = _fit_sides(site, variants)
            if fit is None:
                continue
            key_a, key_b, after = fit
            err = np.abs(site.xa - site.xb).max(axis=tuple(i for i in range(4) if i != seq_axis))
            yield _hint("rope", f"B applies RoPE with {_rope_name(key_b)}; A with {_rope_name(key_a)}", site, after,
                        f"input: A's {src.module} {src.tensor_label}; max error by position: "
                        f"{err[0]:.1e} at 0, {err[len(err) // 2]:.1e} at {len(err) // 2}, {err[-1]:.1e} at {len(err) - 1}",
                        a=_rope_name(key_a), b=_rope_name(key_b))
            return


def check_rope_table(site: _Site) -> Iterator[Hint]:
    """The rotary angle table itself differs: fit base, pair layout and offset on each side."""
    x = site.xa
    if x.ndim != 4 or x.shape[1] != 1 or x.shape[2] != 1 or "rotary" not in (site.a.module + site.a.module_class).lower():
        return
    s_len, d = x.shape[0], x.shape[-1]

    def table(interleaved: bool, base: float, offset: int) -> np.ndarray:
        inv = 1.0 / (base ** (np.arange(0, d, 2, dtype=np.float64) / d))
        freqs = np.outer(np.arange(s_len, dtype=np.float64) + offset, inv)
        emb = np.repeat(freqs, 2, axis=-1) if interleaved else np.concatenate([freqs, freqs], axis=-1)
        return emb.reshape(s_len, 1, 1, d)

    variants = {(i, b, o): table(i, b, o) for i in (False, True) for b in (10000.0, 50000.0, 500000.0, 1000000.0)
                for o in (0, 1)}
    fit = _fit_sides(site, variants)
    if fit is None:
        return
    key_a, key_b, after = fit
    err = np.abs(site.xa - site.xb).reshape(s_len, -1).max(axis=1)
    yield _hint("rope", f"B's RoPE uses {_rope_name(key_b)}; A's uses {_rope_name(key_a)}", site, after,
                f"fitted angle tables; largest difference at position 0: {err[0]:.1e}, at {s_len - 1}: {err[-1]:.1e}",
                a=_rope_name(key_a), b=_rope_name(key_b))


def _representable(x: np.ndarray, dtype: Any) -> float:
    x32 = x.astype(np.float32)
    return float(np.mean(x32.astype(dtype).astype(np.float32) == x32))


def check_dtype(site: _Site) -> Iterator[Hint]:
    """B computes (or stores) this tensor in BF16/FP16: recomputed from rounded inputs it matches B, or its values
    sit on the narrow grid with an error of the format's rounding size (2^-8 for BF16)."""
    a = site.a
    linear = None  # (input, weight) of a linear layer whose exact product reproduces A
    if a.phase == "forward" and a.kind == "output":
        w = site.weights(a.module).get("weight")
        ins = site.inputs(a.module, a.call)
        if w is not None and w.ndim == 2 and ins and ins[0].shape[-1] == w.shape[1] \
                and _rel(ins[0] @ w.T, site.xa) <= 0.05 * site.before:
            linear = (ins[0], w)
    for name, dt, eps in (("BF16", ml_dtypes.bfloat16, 2.0 ** -8), ("FP16", np.float16, 2.0 ** -11)):
        # 1. the linear layer recomputed from rounded inputs and weight, output rounded
        if linear is not None:
            x, w = linear
            r = lambda v: v.astype(np.float32).astype(dt).astype(np.float64)  # noqa: E731
            after = _rel(r(r(x) @ r(w).T), site.xb)
            if _explained(site.before, after) >= MIN_EXPLAINED:
                yield _hint("dtype", f"B computes {a.module} in {name}: inputs, weight and output rounded to "
                            f"{name}", site, after, f"A's input and weight rounded to {name}, multiplied in "
                            f"float64, the product rounded: reproduces B to rel L2 {after:.1e}", dtype=name)
                return
        # 2. the signature: B's values are all numbers of the narrow format, A's are not
        share_b = _representable(site.xb, dt)
        share_a = _representable(site.xa, dt)
        if share_b > 0.95 and share_a < 0.5:
            near = eps / 64 <= site.before <= 4 * eps
            explained = share_b if near else 0.5 * share_b
            yield Hint("dtype", f"B's values are {name} numbers: B computes or stores this tensor in {name}", explained,
                       site.before, math.nan,
                       f"{share_b:.1%} of B's values are exact {name} numbers, {share_a:.1%} of A's; relative error "
                       f"{site.before:.1e} = 2^{math.log2(site.before):.1f} ({name} rounding: 2^{math.log2(eps):.0f})",
                       {"dtype": name, "share_b": share_b, "signature_only": True})
            return


def _layout_ops(shape: tuple[int, ...]) -> Iterator[tuple[str, Callable[[np.ndarray], np.ndarray]]]:
    from .transforms import OPS

    nd = len(shape)
    if nd >= 2:
        yield "swap01", OPS["swap01"]
    if nd == 2:
        yield "transpose", OPS["transpose"]
    for d in range(nd):
        if shape[d] % 2 == 0 and shape[d] >= 4:
            yield f"interleave(dim={d})", lambda x, d=d: OPS["interleave"](x, d)
            yield f"deinterleave(dim={d})", lambda x, d=d: OPS["deinterleave"](x, d)
            h = shape[d] // 2
            yield f"halves swapped (dim={d})", lambda x, d=d, h=h: np.concatenate(
                [np.take(x, range(h, 2 * h), axis=d), np.take(x, range(h), axis=d)], axis=d)
        if shape[d] % 3 == 0:
            for heads in (1, 2, 4, 8, 12, 16, 32):
                if shape[d] % (3 * heads) == 0 and heads < shape[d] // 3:
                    yield (f"qkv_grouped(heads={heads}, dim={d})",
                           lambda x, d=d, heads=heads: OPS["qkv_grouped"](x, heads, None, d))


def check_layout(site: _Site) -> Iterator[Hint]:
    """B holds the same numbers in another order (interleaved gate/up, per-group QKV, a transpose), or lacks a bias."""
    best = None
    for label, op in _layout_ops(site.xb.shape):
        try:
            moved = np.asarray(op(site.xa), dtype=np.float64)
        except (ValueError, IndexError):
            continue
        after = _rel(moved, site.xb)
        if best is None or after < best[1]:
            best = (label, after)
    if best is not None and _explained(site.before, best[1]) >= MIN_EXPLAINED:
        seen = (f" (B as the mapping presents it, after {' '.join(map(str, site.row.pair.ops))})"
                if site.row.pair.ops else "")
        yield _hint("layout", f"B holds A's values in another order: B = {best[0]} of A", site, best[1],
                    f"the permutation {best[0]} of A's tensor reproduces B{seen} to rel L2 {best[1]:.1e}", op=best[0])
    a = site.a
    if a.phase == "forward" and a.kind == "output":
        bias = site.weights(a.module).get("bias")
        if bias is not None and bias.shape == site.xa.shape[-1:]:
            for sign, text in ((1.0, "adds"), (-1.0, "leaves out")):
                after = _rel(site.xa + sign * bias, site.xb)
                if _explained(site.before, after) >= MIN_EXPLAINED:
                    yield _hint("missing-bias", f"B {text} the bias of {a.module} that A "
                                f"{'leaves out' if sign > 0 else 'adds'} here", site, after,
                                f"A {'+' if sign > 0 else '-'} {a.module}.bias reproduces B to rel L2 {after:.1e}")


def check_factor(site: _Site) -> Iterator[Hint]:
    """B = c * A: a loss reduction (sum vs mean), DP averaging, gradient accumulation, a loss scale."""
    aa = float(np.vdot(site.xa, site.xa))
    if aa == 0:
        return
    c = float(np.vdot(site.xa, site.xb)) / aa
    after = _rel(c * site.xa, site.xb)
    if abs(c - 1.0) < 1e-6 or _explained(site.before, after) < MIN_EXPLAINED:
        return
    names = []
    for n in (2, 3, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096):
        for value, text in ((n, f"{n}"), (1.0 / n, f"1/{n}")):
            if abs(c - value) <= 0.02 * value:
                names.append(text)
    why = (f"≈ {names[0]}: a sum vs mean over {names[0].split('/')[-1]} (tokens, micro-batches, ranks), "
           "DP averaging, gradient accumulation or a loss scale not undone" if names else
           "a scale applied on one side only (loss scale, learning-rate-like factor, init or checkpoint scaling)")
    yield _hint("factor", f"B = {c:.6g} × A ({why})", site, after,
                f"the least-squares factor {c:.6g} reproduces B to rel L2 {after:.1e}", factor=c)


def check_checkpoint(site: _Site, result: "DiffResult") -> Iterator[Hint]:
    """Weights already differ before the first step: name every parameter that differs."""
    if site.a.phase != "weights" or site.a.step != result.steps[0]:
        return
    bad = [r for r in result.rows if r.step == site.a.step and r.phase == "weights" and r.verdict == "diverged"
           and r.pair.a is not None]
    names = [f"{r.pair.a.module}.{r.pair.a.slot} ({r.err:.1e})" for r in bad]  # type: ignore[union-attr]
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    yield Hint("checkpoint", f"The runs did not start from the same weights: {len(bad)} parameter(s) differ at step "
               f"{site.a.step}", 1.0, site.before, 0.0,
               f"{shown}; compare the checkpoints with tensordiff ckpt diff", {"parameters": [n.split(" (")[0] for n in names]})


CHECKS = (check_rope_table, check_activation, check_activation_backward, check_norm_epsilon, check_rope, check_dtype, check_layout, check_factor)


def hints_for_row(row: "Row", ca: "Capture", cb: "Capture", result: "DiffResult | None" = None) -> list[Hint]:
    """Every check at one pair, ranked; only hints explaining at least MIN_EXPLAINED of the gap."""
    if row.pair.a is None or row.pair.b is None:
        return []
    site = _Site(row, ca, cb)
    if not site.ready or not site.before > 0 or not np.all(np.isfinite(site.xa)) or not np.all(np.isfinite(site.xb)):
        return []
    found: list[Hint] = []
    if result is not None:
        found.extend(check_checkpoint(site, result))
    for check in CHECKS:
        try:
            found.extend(h for h in check(site) if h.explained >= MIN_EXPLAINED)
        except (ValueError, FloatingPointError, MemoryError):
            continue  # a check that cannot run on this tensor says nothing
    found.sort(key=lambda h: -round(h.explained, 3))  # ties: the more specific check (CHECKS order) first
    if found:  # a hint far behind the best one is a side effect of the same cause
        found = [h for h in found if h.explained >= found[0].explained - 0.2]
    return found


def find_hints(result: "DiffResult", ca: "Capture | None" = None, cb: "Capture | None" = None) -> tuple[list[Hint], str]:
    """Hints at the first divergence, and a note when they cannot run (tensors not stored)."""
    first = result.first
    if first is None:
        return [], ""
    row = next((r for r in result.rows if r.pair.a is not None and r.step == first.step and r.phase == first.phase
                and r.pair.a.label == first.label_a), None)
    if row is None or row.pair.b is None:
        return [], ""
    if not (row.pair.a.has_data and row.pair.b.has_data):  # type: ignore[union-attr]
        return [], (f"no hints: step {first.step} holds statistics only; capture with --tensors all "
                    "to test the likely causes there")
    if ca is None or cb is None:
        from .store import Capture

        with Capture(result.path_a) as ca, Capture(result.path_b) as cb:
            return find_hints(result, ca, cb)
    with np.errstate(all="ignore"):
        return hints_for_row(row, ca, cb, result), ""
