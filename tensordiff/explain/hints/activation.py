"""Activation hints: B applies another activation (GELU tanh vs erf, SwiGLU halves swapped or interleaved), or
its backward multiplies by another activation's derivative

See docs/hints/activation.md and docs/hints/activation-backward.md."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import numpy as np

from ... import dtypes
from ...record import Record
from .base import Hint, NotApplicable, Site, describe, fit_sides, make_hint, rel_l2

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


def check_activation(site: Site) -> Iterator[Hint]:
    """B applies another activation to the same input (a forward tensor), or its backward multiplies by another
    activation's derivative (a gradient)."""
    a = site.a
    if a.phase == "forward":
        yield from check_activation_forward(site)
    elif a.phase == "backward":
        yield from check_activation_backward(site)
    else:
        raise NotApplicable(f"not for {describe(a)}")


def _pre_activations(site: Site) -> Iterator[tuple[str, np.ndarray]]:
    """What the diverged tensor may be an activation of, most direct first: the module's own inputs (the activation
    is a module: torch.nn.GELU, mindspore.nn.GELU, HF's GELUActivation, ...), then A's outputs just before it in the
    same parent call (the activation is a function between modules, as in megatron-core's MLP), each also with
    its module's bias (megatron's ``skip_bias_add`` linears return it apart)."""
    a = site.a
    if a.kind == "output":
        for rec, own in site.input_records(a.module, a.call):
            yield f"{a.module} {rec.tensor_label}", own
    for src in site.earlier_outputs():
        x = site.array(src)
        if x is None:
            continue
        yield f"{src.module} {src.tensor_label}", x
        bias = site.weights(src.module).get("bias")
        if bias is not None and bias.shape == x.shape[-1:]:
            yield f"{src.module} {src.tensor_label} + its bias", x + bias


#: Share of a side's elements its function, rounded once to the stored dtype, must give exactly (``_by_rounding``).
_ROUNDED_MATCH = 0.9


def _by_rounding(site: Site, outs: dict[str, np.ndarray], label: str) -> Hint | None:
    """Two activations whose difference is below one rounding of a narrow dtype per element (GELU's tanh form
    against erf in BF16: 2e-4 against 2^-8), told apart by rounding each rebuild to that dtype: a kernel computing
    in float32 and storing BF16 gives its function's value rounded once, exactly, for nearly every element. The side
    whose elements one function gives exactly is that function's; the hint names the two when they differ, and
    explains the elements where the sides differ and each gives its own function's rounded value."""
    name = site.a.dtype
    if dtypes.MANTISSA_BITS.get(name, 52) > dtypes.MANTISSA_BITS["float16"] or len(outs) < 2:
        return None
    rounded = {k: dtypes.rounded(v, name) for k, v in outs.items()}
    match_a = {k: float(np.mean(r == site.xa)) for k, r in rounded.items()}
    match_b = {k: float(np.mean(r == site.xb)) for k, r in rounded.items()}
    name_a, name_b = max(match_a, key=lambda k: match_a[k]), max(match_b, key=lambda k: match_b[k])
    if name_a == name_b or min(match_a[name_a], match_b[name_b]) < _ROUNDED_MATCH:
        return None
    differ = site.xa != site.xb
    if not differ.any():
        return None
    told = differ & (rounded[name_a] == site.xa) & (rounded[name_b] == site.xb)
    share = float(told.sum()) / float(differ.sum())
    hint = make_hint("activation", f"B computes {name_b} where A computes {name_a} (less than one {name} rounding "
                     "apart per element: told by each side's exact rounded values)", site, site.before,
                     f"input: A's {label}; {name_a} rounded to {name} gives {match_a[name_a]:.1%} of A's elements "
                     f"exactly ({name_b}: {match_a[name_b]:.1%}), {name_b} gives {match_b[name_b]:.1%} of B's "
                     f"({name_a}: {match_b[name_a]:.1%}); of the {int(differ.sum())} elements that differ, "
                     f"{share:.1%} are each side's own function", a=name_a, b=name_b, input=label, rounded=True)
    hint.explained = share
    return hint


def check_activation_forward(site: Site) -> Iterator[Hint]:
    """B applies another activation (GELU tanh vs erf, SwiGLU halves swapped or interleaved) to the same input."""
    stored = fitting = False
    for label, pre in _pre_activations(site):
        stored = True
        outs = {}
        for name, fn in ACTIVATIONS.items():
            try:
                y = np.asarray(fn(pre), dtype=np.float64)
            except (ValueError, IndexError):
                continue
            if y.shape == site.xa.shape:
                outs[name] = y
        fitting = fitting or bool(outs)
        fit = fit_sides(site, outs)
        if fit is None:
            told = _by_rounding(site, outs, label)
            if told is not None:
                yield told
                return
            continue
        name_a, name_b, after = fit
        yield make_hint("activation", f"B computes {name_b} where A computes {name_a}", site, after,
                    f"input: A's {label}; A = {name_a} of it (rel L2 {rel_l2(outs[name_a], site.xa):.1e}), "
                    f"B = {name_b} of it (rel L2 {rel_l2(outs[name_b], site.xb):.1e})", a=name_a, b=name_b, input=label)
        return
    if not fitting:
        raise NotApplicable("no input of a fitting shape" if stored else "no input or earlier output stored")


def _upstream(site: Site, fwd: Record, shape: tuple[int, ...]) -> list[Record]:
    """The gradients that may have arrived from above ``fwd``, most likely first: the output gradient of the module
    that takes ``fwd`` as its input (an activation module: torch.nn.GELU, mindspore.nn.GELU, ...), then the latest
    earlier gradients of the same shape in this backward."""
    a = site.a
    linked = {fwd.seq} | {r.seq for r in site.recs_a if r.same_as == fwd.seq}
    users = {(r.module, r.call) for r in site.recs_a
             if r.seq in linked and r.phase == "forward" and r.kind == "input"}
    earlier = [r for r in site.recs_a if r.phase == "backward" and r.seq < a.seq and tuple(r.shape) == shape]
    own = [r for r in earlier if r.kind == "grad_output" and (r.module, r.call) in users]
    rest = [r for r in sorted(earlier, key=lambda r: -r.seq) if r not in own]
    return own + rest[:3]


def check_activation_backward(site: Site) -> Iterator[Hint]:
    """B's backward uses another activation derivative (e.g. the tanh GELU's) than A's forward implies: the gradient
    of a pre-activation (an output of the layer before, or an activation module's own input) is the gradient
    from above times the activation's derivative at it."""
    a = site.a
    if a.phase != "backward" or a.grad_of < 0:
        raise NotApplicable("no forward tensor linked to this gradient")
    fwd = site.by_seq.get(a.grad_of)
    if fwd is None or fwd.kind not in ("output", "input"):
        raise NotApplicable("no forward tensor linked to this gradient")
    x = site.array(fwd)
    if x is None or x.shape != site.xa.shape:
        raise NotApplicable("its forward tensor is not stored" if x is None else
                            "its forward tensor has another shape")
    pres = [("", x)]
    bias = site.weights(fwd.module).get("bias") if fwd.kind == "output" else None
    if bias is not None and bias.shape == x.shape[-1:]:
        pres.append((" + its bias", x + bias))
    tried = False
    for up in _upstream(site, fwd, tuple(x.shape)):
        g = site.array(up)
        if g is None:
            continue
        tried = True
        for suffix, pre in pres:
            grads = {name: g * d(pre) for name, d in DERIVATIVES.items()}
            fit = fit_sides(site, grads)
            if fit is None:
                continue
            name_a, name_b, after = fit
            yield make_hint("activation-backward", f"B's backward multiplies by the derivative of {name_b}; A's by that "
                        f"of {name_a}", site, after,
                        f"A's {up.module} {up.tensor_label} × {name_b}'({fwd.module} {fwd.tensor_label}{suffix}) "
                        f"reproduces B to rel L2 {rel_l2(grads[name_b], site.xb):.1e}", a=name_a, b=name_b)
            return
    if not tried:
        raise NotApplicable("no gradient from above of its shape stored")
