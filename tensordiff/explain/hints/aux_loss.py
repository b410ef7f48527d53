"""Aux-loss hint: one side trains a mixture-of-experts model with the router's auxiliary loss (a load-balancing loss,
a z-loss) × a coefficient, the other without it (or with another coefficient).

The routers are found by structure: a module with a 2-D ``weight`` [E, H] applied to its input [..., H], whose
parent holds E numbered experts (``experts.0`` ... ``experts.{E-1}``, megatron's ``local_experts.N``), or, as a
fallback, whose class or name says router or gate. Their logits are rebuilt from A's captured input and weight
(``x·Wᵀ (+ b)``); which experts each token went to is the router's own routing map where it returns one, else the
top-k of its logits, with k read from the routing map, the experts' captured inputs (k·T rows in all) or, where
neither is stored, tried from 1 up. From them each usual auxiliary term is computed, with its gradient:

* the Switch/GShard load-balancing loss over all layers' tokens together, ``E·Σ_i f_i·P_i`` (HF transformers'
  ``load_balancing_loss_func``: f_i the share of top-k slots that chose expert i, P_i the mean softmax probability);
* the same per layer, ``E/k·Σ_i f_i·P_i``, summed over the layers (megatron-core's
  ``switch_load_balancing_loss_func``: ``E/(k·T²)·Σ_i P_i·tokens_i``, each layer's added in backward by
  ``MoEAuxLossAutoScaler``);
* the router z-loss, the mean over tokens of ``logsumexp(logits)²``, summed over the layers (megatron-core's
  ``z_loss_func``).

Where B's loss is the diverged tensor (a scalar: the model's loss output or the loss record), B = A + c·aux is solved
for each term; a plausible coefficient (0 < c ≤ 1) is confirmed on the gradient of the last router's weight, which
then becomes ``A's + c·∂aux/∂W`` (the term whose gradient does it best is named). Where a gradient is the diverged
tensor (megatron-core adds the aux loss in backward only: the loss agrees), the gradient of each term at that tensor
(the router's input, its logits or its weight) is fitted as ``B = A + c·∂aux/∂x`` by least squares, and the term that
reproduces B best is named. It runs after the loss normalisation and before the constant factor.

See docs/hints/aux-loss.md. Framework-free: numpy on captured arrays.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from ...diff.result import DiffResult
from ...record import Record
from .base import MIN_EXPLAINED, Hint, NotApplicable, Site, explained_share, rel_l2

#: the largest coefficient of an auxiliary loss taken for one (the usual ones are 1e-4 ... 0.1)
_MAX_COEFF = 1.0
#: the router's selection is taken as A's when the rebuilt logits' top-k give its routing map
#: an expert module: ``P.experts.N`` (HF), ``P.experts.local_experts.N`` (megatron-core's SequentialMLP)
_EXPERT = re.compile(r"^(?P<parent>.*?)\.(?:experts\.)?(?:local_)?experts\.(?P<n>\d+)$")


@dataclass
class _Call:
    """One call of a router in A's step: its input, weight, logits [T, E] and which experts each token chose."""

    module: str
    module_class: str
    call: int
    seq: int
    input_rec: Record
    x: np.ndarray
    """the input as [T, H]"""
    weight: np.ndarray
    z: np.ndarray
    """the logits [T, E]"""
    chosen: np.ndarray | None
    """[T, E] bool: the router's own routing map, or None (the top-k of the logits)"""
    output_rec: Record | None
    """the output record that holds the logits themselves (HF's gate), or None"""


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _lse(z: np.ndarray) -> np.ndarray:
    m = z.max(axis=-1)
    return m + np.log(np.exp(z - m[:, None]).sum(axis=-1))


def _chosen(c: _Call, k: int) -> np.ndarray:
    if c.chosen is not None:
        return c.chosen
    top = np.argsort(-c.z, axis=-1, kind="stable")[:, :k]
    m = np.zeros(c.z.shape, dtype=bool)
    np.put_along_axis(m, top, True, axis=-1)
    return m


def _switch_grad(p: np.ndarray, f: np.ndarray, scale: float) -> np.ndarray:
    """∂(scale·Σ_i f_i·Σ_t p_ti)/∂z_t with p = softmax(z) and f held constant: scale·p_t ⊙ (f - p_t·f)."""
    return scale * p * (f[None, :] - (p @ f)[:, None])


def _switch_all_layers(calls: list[_Call], k: int) -> tuple[float, list[np.ndarray]]:
    """HF's load_balancing_loss_func: E·Σ_i f_i·P_i over all the routers' tokens concatenated."""
    z = np.concatenate([c.z for c in calls])
    e = z.shape[1]
    p = _softmax(z)
    f = np.concatenate([_chosen(c, k) for c in calls]).sum(axis=0) / len(z)
    aux = float(e * (f * p.mean(axis=0)).sum())
    out, start = [], 0
    for c in calls:
        n = len(c.z)
        out.append(_switch_grad(p[start:start + n], f, e / len(z)))
        start += n
    return aux, out


def _switch_per_layer(calls: list[_Call], k: int) -> tuple[float, list[np.ndarray]]:
    """megatron-core's switch_load_balancing_loss_func per router call, E/(k·T²)·Σ_i P_i·tokens_i, summed."""
    aux, out = 0.0, []
    for c in calls:
        t, e = c.z.shape
        p = _softmax(c.z)
        f = _chosen(c, k).sum(axis=0) / t
        aux += float(e / k * (f * p.mean(axis=0)).sum())
        out.append(_switch_grad(p, f, e / (k * t)))
    return aux, out


def _z_loss(calls: list[_Call], k: int) -> tuple[float, list[np.ndarray]]:
    """The router z-loss: mean over tokens of logsumexp(logits)², summed over the router calls."""
    aux, out = 0.0, []
    for c in calls:
        lse = _lse(c.z)
        aux += float((lse ** 2).mean())
        out.append((2.0 / len(c.z)) * lse[:, None] * _softmax(c.z))
    return aux, out


Term = Callable[[list[_Call], int], tuple[float, list[np.ndarray]]]

#: the auxiliary terms tested, most common first (a tie keeps this order): (key, words, function)
TERMS: tuple[tuple[str, str, Term], ...] = (
    ("load-balancing (all layers)", "the load-balancing loss E·Σ f_i·P_i over all layers' tokens together "
     "(Switch/GShard, as HF transformers' load_balancing_loss_func)", _switch_all_layers),
    ("load-balancing (per layer)", "the load-balancing loss E/k·Σ f_i·P_i of each layer, summed over the layers "
     "(Switch/GShard, as megatron-core's switch_load_balancing_loss_func)", _switch_per_layer),
    ("z-loss", "the router z-loss, the mean of logsumexp(logits)², summed over the layers (ST-MoE, as "
     "megatron-core's z_loss_func)", _z_loss),
)


# ----------------------------------------------------------------------------- the routers
def _experts(site: Site) -> dict[str, dict[int, list[Record]]]:
    """A's numbered experts by the module holding them (``P.experts.N``, ``P.experts.local_experts.N``: P): each
    expert's first forward inputs (one per call). One pass over A's records."""
    out: dict[str, dict[int, list[Record]]] = {}
    for r in site.recs_a:
        if r.phase != "forward" or "experts." not in r.module:
            continue
        m = _EXPERT.match(r.module)
        if m is None:
            continue
        inputs = out.setdefault(m.group("parent"), {}).setdefault(int(m.group("n")), [])
        if r.kind == "input" and r.slot == "0":
            inputs.append(r)
    return out


def _looks_like_router(module: str, module_class: str) -> bool:
    leaf = module.rsplit(".", 1)[-1].lower()
    return "router" in module_class.lower() or leaf in ("gate", "router", "gating") or "router" in leaf


def _router_modules(site: Site) -> dict[str, tuple[Record, int]]:
    """Modules that route tokens to experts, by structure: the ``weight`` record [E, H] of each, with E."""
    out: dict[str, tuple[Record, int]] = {}
    experts = _experts(site)
    for r in site.recs_a:
        if r.phase != "weights" or r.slot != "weight" or len(r.shape) != 2 or not 2 <= r.shape[0] <= 4096:
            continue
        e = r.shape[0]
        parent = r.module.rsplit(".", 1)[0] if "." in r.module else ""
        if len(experts.get(parent, ())) == e or _looks_like_router(r.module, r.module_class):
            out[r.module] = (r, e)
    return out


def _calls(site: Site, routers: dict[str, tuple[Record, int]]) -> list[_Call]:
    """Every call of the routers in A's step, in forward order, with the logits rebuilt from input and weight."""
    calls = []
    forward: dict[str, list[Record]] = {}
    for r in site.recs_a:
        if r.phase == "forward" and r.module in routers:
            forward.setdefault(r.module, []).append(r)
    for module, (wrec, e) in routers.items():
        w = site.array(wrec)
        if w is None:
            continue
        bias = site.weights(module).get("bias")
        recs = forward.get(module, [])
        for call in sorted({r.call for r in recs}):
            ins = [r for r in recs if r.call == call and r.kind == "input" and r.shape and r.shape[-1] == w.shape[1]]
            x = site.array(ins[0]) if ins else None
            if x is None or not np.issubdtype(x.dtype, np.floating):
                continue
            x2 = x.reshape(-1, w.shape[1])
            z = x2 @ w.T + (bias if bias is not None and bias.shape == (e,) else 0.0)
            outs = [r for r in recs if r.call == call and r.kind == "output" and tuple(r.shape[-1:]) == (e,)]
            chosen, logits_rec = None, None
            for r in outs:
                y = site.ca.array(r)
                if y is None or y.size != z.size:
                    continue
                if y.dtype == np.bool_:
                    chosen = y.reshape(z.shape)
                elif logits_rec is None and rel_l2(np.asarray(y, np.float64).reshape(z.shape), z) < 1e-4:
                    logits_rec, z = r, np.asarray(y, np.float64).reshape(z.shape)  # the logits as A computed them
            calls.append(_Call(module, wrec.module_class, call, ins[0].seq, ins[0], x2, w, z, chosen, logits_rec))
    return sorted(calls, key=lambda c: c.seq)


def _topk(site: Site, calls: list[_Call]) -> list[int]:
    """The routers' k: from their routing maps, else the experts' inputs (k·T rows in all), else 1 ... E-1."""
    for c in calls:
        if c.chosen is not None:
            per_token = c.chosen.sum(axis=-1)
            if per_token.size and (per_token == per_token[0]).all() and 0 < per_token[0] < c.z.shape[1]:
                return [int(per_token[0])]
    c = calls[-1]
    parent = c.module.rsplit(".", 1)[0] if "." in c.module else ""
    experts = _experts(site).get(parent, {})
    rows = [r.shape[0] for recs in experts.values() for r in recs if r.call == c.call and r.shape]
    e = c.z.shape[1]
    if experts and max(experts) < e and rows and sum(rows) % len(c.z) == 0 and 0 < sum(rows) // len(c.z) < e:
        return [sum(rows) // len(c.z)]  # (an expert no token chose may not have been called)
    return list(range(1, min(c.z.shape[1], 9)))


# ----------------------------------------------------------------------------- the diverged tensor
def _is_loss(site: Site) -> bool:
    """The diverged tensor is the loss: the loss record, or a scalar output of the whole model."""
    a = site.a
    if site.xa.size != 1:
        return False
    return a.phase == "loss" or (a.phase == "forward" and a.kind == "output" and a.module == "")


def _grad_at_site(site: Site, calls: list[_Call], grads: list[np.ndarray]) -> tuple[np.ndarray, list[str]] | None:
    """The gradient of an aux term (∂aux/∂z of each call) at the diverged gradient, in its shape, and the routers it
    comes through, or None (the diverged tensor is not a router's input, logits or parameter)."""
    a = site.a
    total = np.zeros(site.xa.shape)
    hit: list[str] = []
    if a.phase == "param_grad":
        for c, g in zip(calls, grads):
            if c.module != a.module:
                continue
            if a.slot == "weight" and c.weight.shape == site.xa.shape:
                total += g.T @ c.x
                hit.append(c.module)
            elif a.slot == "bias" and site.xa.shape == (g.shape[1],):
                total += g.sum(axis=0)
                hit.append(c.module)
    elif a.phase == "backward" and a.grad_of in site.by_seq:
        of = site.by_seq[a.grad_of].tensor_id
        for c, g in zip(calls, grads):
            if c.input_rec.tensor_id == of and int(np.prod(c.input_rec.shape)) == site.xa.size:
                total += (g @ c.weight).reshape(site.xa.shape)  # the router's input: ∂z/∂x = W
                hit.append(c.module)
            elif c.output_rec is not None and c.output_rec.tensor_id == of and g.size == site.xa.size:
                total += g.reshape(site.xa.shape)  # the router's logits themselves
                hit.append(c.module)
    return (total, list(dict.fromkeys(hit))) if hit else None


def _router_grad_rows(site: Site, result: DiffResult | None, module: str) -> tuple[np.ndarray, np.ndarray] | None:
    """A's and B's gradient of ``module``'s weight at this step (B in A's layout), or None."""
    if result is None:
        return None
    for r in result.rows:
        p = r.pair
        if (r.step != site.a.step or r.phase != "param_grad" or p.a is None or p.b is None or p.a.module != module
                or p.a.slot != "weight"):
            continue
        ga = p.a_tensor(site.ca.array)
        try:
            gb = p.b_tensor(site.cb.array)
        except Exception:
            gb = None
        if ga is None or gb is None or np.shape(ga) != np.shape(gb):
            return None
        return np.asarray(ga, np.float64), np.asarray(gb, np.float64)
    return None


def _names(calls: list[_Call]) -> str:
    mods = list(dict.fromkeys(c.module for c in calls))
    return ", ".join(mods) if len(mods) <= 3 else f"{mods[0]}, ... {mods[-1]} ({len(mods)} routers)"


def check_aux_loss(site: Site, result: DiffResult | None = None) -> Iterator[Hint]:
    """B's loss (or gradient) = A's + c × an auxiliary loss of A's router logits (or its gradient)."""
    a = site.a
    at_loss = _is_loss(site)
    if not at_loss and a.phase not in ("backward", "param_grad"):
        return  # ruled out: a forward tensor is computed before any loss
    found = _router_modules(site)
    if not found:
        return  # ruled out: no module of A routes tokens to experts
    calls = _calls(site, found)
    if not calls:
        raise NotApplicable("no router logits captured (the routers' inputs or weights are not stored)")
    ks = _topk(site, calls)
    e = calls[-1].z.shape[1]
    tried: list[tuple[float, float, str, str, int, float, float | None]] = []
    through: list[str] = []
    for key, words, term in TERMS:
        for k in ks:
            aux, grads = term(calls, k)
            if at_loss:
                if not aux > 0:
                    continue
                c = float(site.xb.ravel()[0] - site.xa.ravel()[0]) / aux
                after = rel_l2(site.xa + c * aux, site.xb)
                share = explained_share(site.before, after)
                confirmed = None
                last = calls[-1]
                rows = _router_grad_rows(site, result, last.module)
                if rows is not None:
                    ga, gb = rows
                    g = sum((gz.T @ cl.x for cl, gz in zip(calls, grads) if cl.module == last.module),
                            np.zeros(ga.shape))
                    if g.shape == ga.shape and rel_l2(ga, gb) > 0:
                        confirmed = explained_share(rel_l2(ga, gb), rel_l2(ga + c * g, gb))
                        share = min(share, confirmed)
            else:
                at = _grad_at_site(site, calls, grads)
                if at is None:
                    continue
                g, through = at
                gg = float(np.vdot(g, g))
                if gg == 0:
                    continue
                c = float(np.vdot(g, site.xb - site.xa)) / gg
                after = rel_l2(site.xa + c * g, site.xb)
                share, confirmed = explained_share(site.before, after), None
            if 0 < c <= _MAX_COEFF and math.isfinite(share):
                tried.append((share, after, key, words, k, c, confirmed))
    if not tried:
        return
    best = max(tried, key=lambda t: round(t[0], 3))  # ties: the more common term (TERMS order), the smaller k
    share, after, key, words, k, c, confirmed = best
    if share < MIN_EXPLAINED:
        return
    kind = f"{calls[-1].module_class or '?'}; {e} experts, top-{k}"
    if at_loss:
        aux = float(site.xb.ravel()[0] - site.xa.ravel()[0]) / c
        title = (f"B's loss = A's loss + {c:.4g} × {words}, computed from the logits of A's routers {_names(calls)} "
                 f"({kind}): B adds an auxiliary loss that A leaves out (or weighs it otherwise); add it on both "
                 "sides, or leave it out of both (HF: output_router_logits; megatron-core: moe_aux_loss_coeff, "
                 "moe_z_loss_coeff), to compare")
        evidence = (f"{key} of A's router logits ({len(calls)} router calls, {sum(len(cl.z) for cl in calls)} token "
                    f"rows) = {aux:.6g}; A's loss + {c:.6g} × it = B's loss {float(site.xb.ravel()[0]):.6g}")
        if confirmed is not None:
            evidence += (f"; {calls[-1].module}'s weight gradient: A's + {c:.4g} × the term's gradient explains "
                         f"{confirmed:.1%} of the gap to B's")
        else:
            evidence += "; the router's weight gradients are not stored to confirm it"
        routers = list(dict.fromkeys(cl.module for cl in calls))
    else:
        title = (f"B's {a.label} = A's + {c:.4g} × the gradient of {words}, through A's router {', '.join(through)} "
                 f"({kind}): B trains with an auxiliary loss that A leaves out (or weighs it otherwise); "
                 "megatron-core adds it in backward only (moe_aux_loss_coeff, moe_z_loss_coeff), the loss value "
                 "unchanged")
        evidence = (f"A's + {c:.6g} × the gradient of the {key} term there reproduces B to rel L2 {after:.1e} "
                    f"(c fitted by least squares over {site.xa.size} elements)")
        routers = through
    others = {t[2]: round(t[0], 4) for t in sorted(tried, key=lambda t: -t[0]) if t[2] != key}
    yield Hint("aux-loss", title, share, site.before, after, evidence,
               {"term": key, "coefficient": c, "routers": routers,
                "experts": e, "topk": k, "gradient_explained": confirmed, "other_terms": others})
