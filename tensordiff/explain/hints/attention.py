"""Attention rebuilt from A's recorded q, k, v, where a model computes attention as code (Hugging Face's
``self_attn``, SDPA, a Megatron ``core_attention``): the candidates (a packed projection's output split into heads,
three projections, the attention module's own inputs), the causal softmax rebuilt in float64, and the checks that
rebuild it under another hypothesis: RoPE (``rope.check_rope_attention``), an active attention dropout
(``dropout.check_attention_dropout``) and the scale of the scores (``check_attention_scale``).

See docs/hints/attention-scale.md. Framework-free: numpy on captured arrays.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ... import dtypes
from ...record import Record
from .base import REBUILD_ROUNDINGS, Hint, NotApplicable, Site, make_hint

#: Attention rebuilt on at most this many positions of one sequence: causal attention at a position
#: depends on the positions before it only, so the prefix is exact, and the cost stays small.
_MAX_POSITIONS = 256


def _qkv_candidates(site: Site, width: int) -> Iterator[tuple[str, list[np.ndarray]]]:
    """A's q, k, v from inside the same attention call, [..., features] in the site's layout: ('packed', [qkv]) for
    one fused projection; three projections (or their per-head [.., heads, hd] forms, a q/k norm's output); the
    inputs of the module call that made the tensor (Megatron's ``core_attention``: q, k, v as it received them)."""
    lead = tuple(site.xa.shape[:-1])
    arrays: dict[int, np.ndarray | None] = {}

    def flat(r: Record) -> np.ndarray | None:
        if r.seq not in arrays:
            x = site.array(r)
            arrays[r.seq] = None if x is None else x.reshape(*lead, -1)
        return arrays[r.seq]

    def width_of(r: Record) -> int | None:
        shape = tuple(r.shape)
        if shape[:-1] == lead:
            return shape[-1]
        if len(shape) == len(lead) + 2 and shape[:-2] == lead:
            return shape[-2] * shape[-1]
        return None

    outs = [r for r in site.earlier_outputs(limit=10) if r.has_data and width_of(r) is not None]
    outs.reverse()  # execution order
    for r in outs:
        if tuple(r.shape[:-1]) == lead and r.shape[-1] > width:
            x = flat(r)
            if x is not None:
                yield "packed " + r.module, [x]
    proj = [r for r in outs if (width_of(r) or 0) <= width]
    for q, k, v in itertools.combinations(proj, 3):
        wq, wk, wv = width_of(q), width_of(k), width_of(v)
        if wq == width and wk == wv and wk is not None and width % wk == 0:
            xs = [flat(r) for r in (q, k, v)]
            if all(x is not None for x in xs):
                yield f"{q.module}, {k.module}, {v.module}", xs  # type: ignore[misc]
    src = site.a if site.a.kind == "output" else site.by_seq.get(site.a.same_as)
    if src is not None and src.phase == "forward" and src.kind == "output":
        ins = [r for r in site.recs_a if r.phase == "forward" and r.kind == "input" and r.module == src.module
               and r.call == src.call and r.has_data and width_of(r) is not None and len(r.shape) == len(lead) + 2]
        if len(ins) >= 3 and width_of(ins[0]) == width:
            xs = [flat(r) for r in ins[:3]]
            if all(x is not None for x in xs):
                yield f"{src.module}'s inputs", xs  # type: ignore[misc]


def attention_probs(q: np.ndarray, k: np.ndarray, scale: float | None = None) -> np.ndarray:
    """Causal softmax probabilities [heads, S, S] of q [S, heads, hd] against k [S, groups, hd] (GQA: repeated),
    the scores scaled by ``scale`` (default 1/sqrt(hd))."""
    s_len, heads, hd = q.shape
    k = np.repeat(k, heads // k.shape[1], axis=1)
    scale = 1.0 / math.sqrt(hd) if scale is None else scale
    scores = np.matmul(q.transpose(1, 0, 2), k.transpose(1, 2, 0)) * scale  # [heads, S, S]
    scores = np.where(np.triu(np.ones((s_len, s_len), dtype=bool), 1)[None], -np.inf, scores)
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    return p / p.sum(axis=-1, keepdims=True)


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float | None = None) -> np.ndarray:
    """Causal softmax attention, [S, heads, hd] / [S, groups, hd] -> [S, heads*hd] (GQA: groups repeated)."""
    s_len, heads, hd = q.shape
    v = np.repeat(v, heads // v.shape[1], axis=1)
    probs = attention_probs(q, k, scale)
    return np.matmul(probs, v.transpose(1, 0, 2)).transpose(1, 0, 2).reshape(s_len, heads * hd)


def _splits(packed: np.ndarray, width: int) -> Iterator[tuple[str, int, list[np.ndarray]]]:
    """(packing, head_dim, [q, k, v]) for each way a fused projection's last dim can hold width-wide q."""
    from ...transforms import QkvGroups

    total = packed.shape[-1]
    for hd in (128, 64, 256, 96, 80, 32, 16, 8, 4, 2):
        if width % hd or (total - width) % (2 * hd):
            continue
        heads, groups = width // hd, (total - width) // (2 * hd)
        if groups < 1 or heads % groups:
            continue
        yield f"per-group [q_g, k_g, v_g] ({heads} heads, {groups} groups)", hd, QkvGroups(heads, groups, -1).split(packed)
        yield f"[q | k | v] ({heads} heads, {groups} groups)", hd, list(np.split(packed, [width, width + groups * hd], -1))


def rotate(x: np.ndarray, base: float, interleaved: bool, offset: int, seq_axis: int) -> np.ndarray:
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


#: RoPE bases tried where a rotation is rebuilt (Llama 2: 1e4; Llama 3: 5e5; Qwen: 1e6; ...).
BASES = (10000.0, 500000.0, 1000000.0, 50000.0)


#: Partial rotary: the share of each head's dims rotated (megatron-core rotary_percent, HF partial_rotary_factor,
#: GPT-NeoX rotary_pct); the rest pass through.
ROTARY_FRACTIONS = (0.5, 0.25)


def rotate_partial(x: np.ndarray, base: float, fraction: float) -> np.ndarray:
    """Rotate-half RoPE on the first ``fraction`` of the last dimension (its own base over those dims), the rest as is:
    how megatron-core (``rotary_percent``) and Hugging Face (``partial_rotary_factor``) apply partial rotary."""
    rot = int(x.shape[-1] * fraction)
    return np.concatenate([rotate(x[..., :rot], base, False, 0, 0), x[..., rot:]], axis=-1)


def rope_variants(rb: AttentionRebuild) -> dict[tuple | None, tuple[np.ndarray, np.ndarray]]:
    """q and k under each RoPE convention (pairs, base, and for rotate-half the share of dims rotated; no position
    offsets: attention sees relative positions only), and as they are (None). Keys: (interleaved, base, 0) for a
    full rotation, (False, base, 0, fraction) for a partial one."""
    out: dict[tuple | None, tuple[np.ndarray, np.ndarray]] = {}
    for interleaved in (False, True):
        for base in BASES:
            out[(interleaved, base, 0)] = (rotate(rb.q, base, interleaved, 0, 0), rotate(rb.k, base, interleaved, 0, 0))
    for fraction in ROTARY_FRACTIONS:
        if int(rb.hd * fraction) % 2 == 0 and int(rb.hd * fraction) >= 2:
            for base in BASES:
                out[(False, base, 0, fraction)] = (rotate_partial(rb.q, base, fraction),
                                                   rotate_partial(rb.k, base, fraction))
    out[None] = (rb.q, rb.k)
    return out


@dataclass
class AttentionRebuild:
    """A's attention inputs found for an attention output: q, k, v before RoPE ([n, heads|groups, hd], float64) of the
    first sequence's first ``n`` positions, where they came from, and both sides' outputs cropped alike."""

    source: str
    packing: str
    hd: int
    n: int
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    xa: np.ndarray
    xb: np.ndarray
    before: float

    def prefix(self, n: int) -> AttentionRebuild:
        """The same on the first ``n`` positions (causal attention there depends on them only)."""
        if n >= self.n:
            return self
        xa, xb = self.xa[:n], self.xb[:n]
        before = float(np.linalg.norm(xa - xb) / max(float(np.linalg.norm(xa)), 1e-30))
        return AttentionRebuild(self.source, self.packing, self.hd, n, self.q[:n], self.k[:n], self.v[:n], xa, xb,
                                before)

    def describe(self, what: str = "") -> str:
        """'attention rebuilt from A's X (packing, head_dim d){what}, on the first n positions of one sequence'."""
        return (f"attention rebuilt from A's {self.source} ({self.packing}, head_dim {self.hd}){what}, on the first "
                f"{self.n} positions of one sequence")


#: Positions a candidate q, k, v is first tried on: one that does not rebuild A there is not this attention's.
_SCREEN = 32


def attention_rebuilds(site: Site) -> Iterator[AttentionRebuild]:
    """Each way A's recorded q, k, v (a packed projection's output or three projections, earlier in the same call)
    split into heads of the attention output's width, in each sequence layout ([S, B, H] or [B, S, H]), that
    rebuilds A's attention output under some RoPE convention (or none) on the first ``_SCREEN`` positions. Raises
    NotApplicable when nothing recorded before the tensor can be its q, k, v."""
    floor = max(1e-4, REBUILD_ROUNDINGS * dtypes.resolution(site.row.judged or site.a.dtype))
    for rb in _attention_candidates(site):
        small = rb.prefix(_SCREEN)
        rebuilt = [_attention(q, k, small.v) for q, k in rope_variants(small).values()]
        if any(min(_rel(o, small.xa), _rel(o, small.xb)) <= floor for o in rebuilt):  # either side: one may drop out
            yield rb


def _attention_candidates(site: Site) -> Iterator[AttentionRebuild]:
    x = site.xa
    width = x.shape[-1]
    found = list(_qkv_candidates(site, width))
    if not found:
        raise NotApplicable("no q, k, v recorded before this 3-D tensor in the same call (attention computed as code "
                            "needs the projection's output)")
    tried = False
    for seq_axis in (0, 1):  # [S, B, H] (Megatron) or [B, S, H]
        n = min(x.shape[seq_axis], _MAX_POSITIONS)

        def crop(t: np.ndarray, axis: int = seq_axis, n: int = n) -> np.ndarray:
            t = np.moveaxis(t, axis, 0)[:n]
            return t[:, 0] if t.ndim == 3 else t  # the first sequence of the batch: [n, features]

        xa, xb = crop(site.xa), crop(site.xb)
        before = float(np.linalg.norm(xa - xb) / max(float(np.linalg.norm(xa)), 1e-30))
        if before == 0:
            continue
        for source, xs in found:
            layouts: list[tuple[str, int, list[np.ndarray]]] = []
            if len(xs) == 1:
                layouts = list(_splits(crop(xs[0]), width))
            else:
                q, k, v = (crop(t) for t in xs)
                for hd in (128, 64, 256, 96, 80, 32, 16, 8, 4, 2):
                    if width % hd == 0 and k.shape[-1] % hd == 0 and (width // hd) % (k.shape[-1] // hd) == 0:
                        layouts.append(("separate", hd, [q, k, v]))
            for packing, hd, (q, k, v) in layouts:
                qh, kh, vh = (t.reshape(t.shape[0], -1, hd).astype(np.float64) for t in (q, k, v))
                tried = True
                yield AttentionRebuild(source, packing, hd, n, qh, kh, vh, xa, xb, before)
    if not tried:
        raise NotApplicable("the q, k, v recorded before it do not split into heads of this width")


def _rel(o: np.ndarray, x: np.ndarray) -> float:
    return float(np.linalg.norm(o - x) / max(float(np.linalg.norm(x)), 1e-30))


def _named_scales(hd: int, width: int) -> dict[str, float]:
    """Usual scales of attention scores, by head_dim and the attention's width: a fitted scale is shown as one when
    it is within ``_SCALE_CLOSE`` of it."""
    return {"1/sqrt(head_dim)": hd ** -0.5, "1/head_dim": 1.0 / hd, "1 (unscaled)": 1.0,
            "1/sqrt(hidden)": width ** -0.5}


_SCALE_CLOSE = 0.01
#: Positions the scale is fitted on (then checked on the whole rebuild).
_FIT_POSITIONS = 64


def _fit_scale(q: np.ndarray, k: np.ndarray, v: np.ndarray, x: np.ndarray, around: float) -> tuple[float, float]:
    """The score scale whose attention is closest to ``x``: golden-section search on its logarithm within a factor
    of 32 of ``around``. (scale, relative L2 residual)."""
    def err(log_s: float) -> float:
        return _rel(_attention(q, k, v, math.exp(log_s)), x)

    lo, hi = math.log(around) - math.log(32.0), math.log(around) + math.log(32.0)
    ratio = (math.sqrt(5.0) - 1.0) / 2.0
    c, d = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    fc, fd = err(c), err(d)
    for _ in range(40):
        if fc < fd:
            hi, d, fd = d, c, fc
            c = hi - ratio * (hi - lo)
            fc = err(c)
        else:
            lo, c, fc = c, d, fd
            d = lo + ratio * (hi - lo)
            fd = err(d)
    best = (lo + hi) / 2.0
    return math.exp(best), err(best)


def check_attention_scale(site: Site) -> Iterator[Hint]:
    """The scores are scaled otherwise (``softmax_scale``, HF ``scaling``, 1/d for 1/sqrt(d), none at all): on each
    side, the scale whose rebuilt attention (A's q, k, v, the RoPE convention that rebuilds A best) reproduces that
    side, named when it is a usual one."""
    if site.a.phase == "forward" and site.xa.ndim == 4 and "softmax" in (site.a.module + site.a.module_class).lower():
        yield from _scores_scale(site)
        return
    if site.a.phase != "forward" or site.xa.ndim != 3:
        raise NotApplicable("not an attention output (a 3-D forward tensor) or the scores a softmax module takes")
    for rb in attention_rebuilds(site):
        small = rb.prefix(_FIT_POSITIONS)
        default = rb.hd ** -0.5
        variants = rope_variants(small)
        fits = {key: _fit_scale(q, k, small.v, small.xa, default) for key, (q, k) in variants.items()}
        key = min(fits, key=lambda k: fits[k][1])
        q_full, k_full = rope_variants(rb)[key]
        scale_a = fits[key][0]
        scale_b, _ = _fit_scale(*variants[key], small.v, small.xb, default)
        err_a = _rel(_attention(q_full, k_full, rb.v, scale_a), rb.xa)
        err_b = _rel(_attention(q_full, k_full, rb.v, scale_b), rb.xb)
        if not (site.reproduces(err_a, rb.before) and site.reproduces(err_b, rb.before)):
            continue
        if abs(scale_b / scale_a - 1.0) <= _SCALE_CLOSE:
            return  # one scale on both sides: not the cause

        usual = _named_scales(rb.hd, rb.xa.shape[-1])

        def name(s: float, usual: dict[str, float] = usual) -> str:
            named = [n for n, v in usual.items() if abs(s / v - 1.0) <= _SCALE_CLOSE]
            return f"{named[0]} = {s:.6g}" if named else f"{s:.6g}"

        left = max(err_a, err_b)
        hint = make_hint("attention-scale", f"B scales the attention scores by {name(scale_b)}; A by {name(scale_a)} "
                         f"(head_dim {rb.hd}): the softmax scale differs (megatron softmax_scale, Hugging Face "
                         "scaling, a query-key normalisation factor)", site, left,
                         f"{rb.describe()}: A's scale reproduces A to {err_a:.1e}, B's reproduces B to {err_b:.1e}; "
                         f"B / A = {scale_b / scale_a:.6g}", a=scale_a, b=scale_b, head_dim=rb.hd)
        hint.before = rb.before
        hint.explained = max(0.0, min(1.0, 1.0 - left / rb.before))
        yield hint
        return


def _head_dim(attrs: dict) -> int | None:
    """head_dim from a capture's recorded model config (kv_channels, head_dim, or hidden / heads)."""
    from ...diff.autoselect import _config, _first

    cfg = _config(attrs)
    hd = _first(cfg, "kv_channels", "head_dim")
    if hd:
        return int(hd)
    hidden, heads = _first(cfg, "hidden_size", "n_embd"), _first(cfg, "num_attention_heads", "n_head")
    return int(hidden) // int(heads) if hidden and heads else None


def _scores_scale(site: Site) -> Iterator[Hint]:
    """The scores a softmax module takes ([B, heads, S, S], Megatron's ``scale_mask_softmax``) differ by one factor:
    the scale applied to q·k before it, named against head_dim where the configs give it."""
    xa, xb = site.xa, site.xb
    live = np.isfinite(xa) & np.isfinite(xb) & (np.abs(xa) < 1e30) & (np.abs(xb) < 1e30)  # masked scores aside
    a, b = xa[live], xb[live]
    den = float(a @ a)
    if not den > 0:
        raise NotApplicable("no unmasked scores")
    factor = float(a @ b) / den
    after = float(np.linalg.norm(b - factor * a) / max(float(np.linalg.norm(b)), 1e-30))
    if not site.reproduces(after) or abs(factor - 1.0) <= _SCALE_CLOSE or factor <= 0:
        return
    hd = _head_dim(site.ca.attrs) or _head_dim(site.cb.attrs)
    said = ""
    if hd:
        for ratio, what in ((hd ** -0.5, "B scales by 1/head_dim where A scales by 1/sqrt(head_dim)"),
                            (hd ** 0.5, "B scales by 1/sqrt(head_dim) where A scales by 1/head_dim, or B does not "
                                        "scale where A scales by 1/sqrt(head_dim)")):
            if abs(factor / ratio - 1.0) <= _SCALE_CLOSE:
                said = f": {what} (head_dim {hd})"
                break
    yield make_hint("attention-scale", f"B's attention scores are {factor:.6g} × A's{said}: the softmax scale "
                    "differs (megatron softmax_scale, Hugging Face scaling, a query-key normalisation factor)", site,
                    after, f"the scores {site.a.module} takes, masked ones aside: B = {factor:.6g} × A to rel L2 "
                    f"{after:.1e}", factor=factor, head_dim=hd)
