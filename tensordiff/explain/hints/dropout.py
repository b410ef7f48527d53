"""Dropout hint: a dropout is active on one side (p > 0 in training mode) and passes its input through on the other.

At a forward output whose module is a dropout (by class name) or has no parameters, each side's output is compared
with A's input of that call (which both sides received: the inputs agree at a first divergence). A dropping side
zeroes a share ``p`` of the elements and scales the rest by ``1/(1-p)``: its output is ``input × keep-mask / (1-p)``
exactly. The check measures both (the zeros share, the scale of the kept elements) and rebuilds B's output as A's
output × B's keep-mask / (1-p) (or, where A drops, as A's input): what explains the gap.

See docs/hints/dropout.md. Framework-free: numpy on captured arrays.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ... import dtypes
from .attention import attention_probs, attention_rebuilds, rope_variants
from .base import REBUILD_ROUNDINGS, Hint, NotApplicable, Site, make_hint, rel_l2

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


def _fit(site: Site) -> float:
    """How closely a rebuild must match: ``_FIT``, or a few roundings of the dtype the pair was judged in (a BF16
    dropout rounds ``x × keep / (1-p)``)."""
    return max(_FIT, REBUILD_ROUNDINGS * dtypes.resolution(site.row.judged or site.a.dtype))


def _drop(x: np.ndarray, y: np.ndarray, fit: float = _FIT) -> _Drop | None:
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
    if not scale > 1.0 + fit or rel_l2(x * keep * scale, y) > fit:
        return None
    return _Drop(zeros, scale, keep)


def check_dropout(site: Site) -> Iterator[Hint]:
    """A dropout active on one side: its output is the input with a share p zeroed and the rest × 1/(1-p); or, in an
    attention computed as code (SDPA's ``dropout_p``, Hugging Face's functional attention dropout), its
    probabilities dropped so (``check_attention_dropout``)."""
    a = site.a
    if a.phase != "forward":
        return  # ruled out: a dropout shows first in a forward tensor
    classes = f"{a.module_class} {site.b.module_class}".lower()
    named = "dropout" in classes
    if site.xa.ndim == 3 and not named:
        hints = list(check_attention_dropout(site))
        if hints:
            yield from hints
            return
    if a.kind != "output":
        return
    if not named and site.weights(a.module):
        return  # a module with parameters and not named like a dropout
    ins = [x for x in site.inputs(a.module, a.call) if x.shape == site.xa.shape]
    if not ins:
        if named:
            raise NotApplicable("the dropout's input is not stored")
        return
    x = ins[0]
    fit = _fit(site)
    drop_a, drop_b = _drop(x, site.xa, fit), _drop(x, site.xb, fit)
    if drop_b is None and drop_a is None:
        return
    module = a.module or "<model>"
    kind_a = f"{module} ({a.module_class or '?'})"
    kind_b = f"{site.b.module or '<model>'} ({site.b.module_class or '?'})"

    def said(d: _Drop) -> str:
        return (f"{d.zeros:.1%} of its elements zeroed, the rest scaled by {d.scale:.6g} = 1/(1-{d.p:.3g})")

    if drop_b is not None and drop_a is None and rel_l2(x, site.xa) <= fit:
        hyp = site.xa * drop_b.keep * drop_b.scale
        title = (f"B's {kind_b} drops out ({said(drop_b)}); A's passes its input through: dropout is active on B "
                 "(p > 0 in training mode); set its probability to 0 (or evaluate) to compare")
        side, d = "B", drop_b
    elif drop_a is not None and drop_b is None and rel_l2(x, site.xb) <= fit:
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


#: Query positions (of one sequence) whose attention-dropout masks are solved exactly: query q has 2**(q+1) masks.
_MASK_POSITIONS = 6
#: Positions the side that does not drop is rebuilt on.
_REBUILT = 32
#: Share of (position, head) rows one mask and one scale must rebuild for an attention dropout to be said.
_ROWS_FITTED = 0.9


def check_attention_dropout(site: Site) -> Iterator[Hint]:
    """One side drops attention probabilities and the other does not, in an attention computed as code: A's q, k, v
    (recorded earlier in the same call) rebuild the side that does not drop; at each of the first query positions
    and each head, the dropping side's output is its probabilities × a keep-mask × 1/(1-p) applied to v. The masks
    are solved exactly (every mask over the keys the query sees), one scale shared by all rows."""
    for full in attention_rebuilds(site):
        rb = full.prefix(_REBUILT)  # the masks are solved on the first positions: a short prefix says as much
        variants = rope_variants(rb)
        heads = rb.q.shape[1]
        v = np.repeat(rb.v, heads // rb.v.shape[1], axis=1)  # [S, heads, hd]
        for clean, dropping, side, other in ((rb.xa, rb.xb, "B", "A"), (rb.xb, rb.xa, "A", "B")):
            fits = {}
            for key, (q, k) in variants.items():
                probs = attention_probs(q, k)
                out = np.matmul(probs, v.transpose(1, 0, 2)).transpose(1, 0, 2).reshape(clean.shape)
                fits[key] = (float(np.linalg.norm(out - clean) / max(float(np.linalg.norm(clean)), 1e-30)), probs)
            key = min(fits, key=lambda k: fits[k][0])
            if not site.reproduces(fits[key][0], rb.before):
                continue
            solved = _solve_masks(fits[key][1], v, dropping, site)
            if solved is None:
                continue
            scale, dropped, total, rebuilt, n = solved
            rows = dropping[:n]
            before = float(np.linalg.norm(clean[:n] - rows) / max(float(np.linalg.norm(rows)), 1e-30))
            after = float(np.linalg.norm(rebuilt - rows) / max(float(np.linalg.norm(rows)), 1e-30))
            if before == 0:
                continue
            p = 1.0 - 1.0 / scale
            hint = make_hint(
                "dropout", f"{side}'s attention drops out its probabilities ({dropped} of {total} zeroed at the first "
                f"{n} positions, the rest scaled by {scale:.6g} = 1/(1-{p:.3g})); {other}'s does not: attention "
                f"dropout is active on {side} (attention_dropout, --attention-dropout, dropout_p > 0 in training "
                "mode); set it to 0 on both to compare", site, after,
                f"{rb.describe()}: {other}'s rebuilt to {fits[key][0]:.1e}; {side}'s rows rebuilt from the same "
                f"probabilities × solved keep-masks × {scale:.6g} to {after:.1e}",
                side=side, p=p, scale=scale, zeros=dropped / max(total, 1))
            hint.before = before
            hint.explained = max(0.0, min(1.0, 1.0 - after / before))
            yield hint
            return


def _solve_masks(probs: np.ndarray, v: np.ndarray, y: np.ndarray, site: Site):
    """Keep-masks and one scale > 1 rebuilding ``y``'s first rows ([S, heads*hd]) as (probs × mask × scale) @ v:
    (scale, probabilities dropped, probabilities seen, the rebuilt rows, positions), or None."""
    heads, s_len, _ = probs.shape
    hd = v.shape[-1]
    n = min(_MASK_POSITIONS, s_len)
    tol = _fit(site)
    rows = y[:n].reshape(n, heads, hd)
    candidates = {}  # (position, head) -> [(mask, c)] every mask's contribution before scaling
    scales = []
    for qpos in range(n):
        masks = np.array(list(itertools.product((0.0, 1.0), repeat=qpos + 1)))  # [M, qpos+1]
        for h in range(heads):
            contrib = probs[h, qpos, : qpos + 1, None] * v[: qpos + 1, h]  # [keys, hd]
            cs = masks @ contrib  # [M, hd]
            target = rows[qpos, h]
            candidates[(qpos, h)] = (masks, cs, target)
            norms = (cs * cs).sum(-1)
            ok = norms > 0
            if not ok.any():
                continue
            s = np.where(ok, cs @ target / np.where(ok, norms, 1.0), 0.0)
            res = np.linalg.norm(target[None] - s[:, None] * cs, axis=-1) / max(float(np.linalg.norm(target)), 1e-30)
            best = int(np.argmin(np.where(ok, res, np.inf)))
            if res[best] <= tol and masks[best].any():
                scales.append(float(s[best]))
    if len(scales) < 2:
        return None
    scale = float(np.median(scales))
    if not scale > 1.0 + 4 * tol:
        return None  # all kept and unscaled is no dropout
    rebuilt = np.zeros_like(rows)
    fitted = dropped = total = 0
    for (qpos, h), (masks, cs, target) in candidates.items():
        ref = max(float(np.linalg.norm(cs[-1])), 1e-30)  # the row kept whole: its own scale
        res = np.linalg.norm(target[None] - scale * cs, axis=-1) / ref
        best = int(np.argmin(res))
        rebuilt[qpos, h] = scale * cs[best]
        fitted += res[best] <= tol
        dropped += int((masks[best] == 0).sum())
        total += masks.shape[1]
    if fitted < _ROWS_FITTED * len(candidates) or (dropped == 0 and len(candidates) < 8):
        return None
    return scale, dropped, total, rebuilt.reshape(n, heads * hd), n
