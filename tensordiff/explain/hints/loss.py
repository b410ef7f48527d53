"""Loss-normalisation hint: the loss (and so every gradient) is normalised over other counts on the two sides.

From A's captured batch (the model's ``labels`` with their ignore index -100, its ``loss_mask``, the number of model
calls in the step: micro-batches, the data-parallel size) the check names the normalisation that explains B:

* at the loss, where A's per-token losses are captured (megatron-core's model output with ``labels=``), each usual
  reduction of them (the mean over the tokens the loss mask keeps, over all tokens, over samples of per-sample sums or
  means, the sum) is computed; the one that gives A's loss and the one that gives B's are named;
* elsewhere (a gradient where no loss was captured, or a loss without per-token losses) B = c·A is fitted and c
  matched to a ratio of the batch's counts: masked vs all tokens, tokens per sample, samples, micro-batches, DP size.

It runs before the generic constant factor (``factor``), which finds c but not which normalisation it is.

See docs/hints/loss-normalisation.md. Framework-free: numpy on captured arrays.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from .base import Hint, NotApplicable, Site, make_hint, rel_l2
from .factor import _data_parallel

#: a ratio of counts names B/A when it matches this closely (relative)
_MATCH = 1e-3

Reduce = Callable[[np.ndarray, np.ndarray], float]

#: reductions of per-token losses ``x`` [B, S] with the loss mask ``m``
REDUCTIONS: dict[str, Reduce] = {
    "the mean over the tokens the loss mask keeps": lambda x, m: float((x * m).sum() / m.sum()),
    "the masked losses summed and divided by all tokens (the loss mask's zeros counted)":
        lambda x, m: float((x * m).sum() / m.size),
    "the mean over all tokens, the loss mask ignored": lambda x, m: float(x.mean()),
    "the mean over samples of each sample's sum over tokens": lambda x, m: float((x * m).sum(axis=1).mean()),
    "the mean over samples of each sample's mean over its tokens":
        lambda x, m: float(((x * m).sum(axis=1) / np.maximum(m.sum(axis=1), 1)).mean()),
    "the sum over tokens": lambda x, m: float((x * m).sum()),
}


def _batch(site: Site) -> tuple[np.ndarray | None, np.ndarray | None, int, np.ndarray | None]:
    """A's labels, loss mask (1 = counts; from ``loss_mask`` or the labels' ignore index), number of model calls
    in the step, and per-token losses (the model's output in the labels' shape), of the model's first call."""
    model_in = [r for r in site.recs_a if r.phase == "forward" and r.kind == "input" and r.module == ""]
    calls = len({r.call for r in model_in}) or 1
    first = min((r.call for r in model_in), default=0)
    slots = {r.slot: r for r in model_in if r.call == first}
    labels = site.array(slots["labels"]) if "labels" in slots else None
    mask = site.array(slots["loss_mask"]) if "loss_mask" in slots else None
    if labels is not None and (mask is None or mask.shape != labels.shape):
        mask = (labels >= 0).astype(np.float64)
    per_token = None
    if labels is not None:
        outs = [r for r in site.recs_a if r.phase == "forward" and r.kind == "output" and r.module == ""
                and r.call == first and tuple(r.shape) == labels.shape]
        x = site.array(outs[0]) if outs else None
        per_token = x if x is not None and x.dtype.kind == "f" else None
    return labels, mask, calls, per_token


def _ratios(labels: np.ndarray | None, mask: np.ndarray | None, calls: int, dp: int) -> list[tuple[float, str]]:
    """Candidate B/A factors with what each says, most specific first."""
    out: list[tuple[float, str]] = []
    if labels is not None and mask is not None and labels.ndim == 2:
        b = labels.shape[0]
        n, m = labels.size, float(mask.sum())
        if 0 < m < n:
            out += [(m / n, f"B divides by all {n} tokens, A by the {m:.0f} the loss mask keeps (masked tokens "
                     "counted in B's mean)"),
                    (n / m, f"A divides by all {n} tokens, B by the {m:.0f} the loss mask keeps (masked tokens "
                     "counted in A's mean)")]
        if m > 0:
            out += [(m / b, f"B sums each sample's tokens ({m / b:g} per sample) and averages over the {b} samples; "
                     "A averages over tokens"),
                    (b / m, f"A sums each sample's tokens ({m / b:g} per sample) and averages over the {b} samples; "
                     "B averages over tokens"),
                    (m, f"B sums the per-token losses of the {m:.0f} tokens, A averages them"),
                    (1 / m, f"A sums the per-token losses of the {m:.0f} tokens, B averages them"),
                    (float(b), f"B sums the {b} samples' means, A averages them"),
                    (1 / b, f"A sums the {b} samples' means, B averages them")]
    if calls > 1:
        out += [(float(calls), f"B sums the losses of the {calls} micro-batches, A averages them"),
                (1 / calls, f"A sums the losses of the {calls} micro-batches, B averages them")]
    if dp > 1:
        out += [(float(dp), f"B's loss or gradients are not divided by its data-parallel size {dp}"),
                (1 / dp, f"B divides by the data-parallel size {dp} once more than A")]
    return [(r, t) for r, t in out if r != 1]


def check_loss_normalisation(site: Site) -> Iterator[Hint]:
    """The loss is normalised over other counts: the reduction (or the ratio of counts) that reproduces B."""
    a = site.a
    if a.phase not in ("loss", "backward", "param_grad"):
        return  # ruled out: a forward output is computed before any loss
    if a.phase != "loss" and any(r.phase == "loss" for r in site.recs_a):
        return  # ruled out: the loss was compared before this gradient and agrees
    labels, mask, calls, per_token = _batch(site)
    if labels is None and calls <= 1 and _data_parallel(site.cb) <= 1:
        raise NotApplicable("the model's labels are not stored")
    if a.phase == "loss" and site.xa.size == 1 and per_token is not None and mask is not None:
        got = {name: f(per_token, mask) for name, f in REDUCTIONS.items()}
        key_a = min(got, key=lambda k: abs(got[k] - float(site.xa.ravel()[0])))
        key_b = min(got, key=lambda k: abs(got[k] - float(site.xb.ravel()[0])))
        if key_a != key_b and rel_l2(np.full(site.xa.shape, got[key_a]), site.xa) <= 0.05 * site.before:
            after = rel_l2(np.full(site.xb.shape, got[key_b]), site.xb)
            yield make_hint("loss-normalisation", f"B's loss is {key_b}, A's is {key_a}", site, after,
                            f"from A's {per_token.size} per-token losses and its loss mask ({mask.sum():.0f} of "
                            f"{mask.size} tokens count): {key_a} = {got[key_a]:.6g} (A's loss), {key_b} = "
                            f"{got[key_b]:.6g} (B's: {float(site.xb.ravel()[0]):.6g})",
                            a=key_a, b=key_b, factor=float(site.xb.ravel()[0]) / float(site.xa.ravel()[0]))
            return
    aa = float(np.vdot(site.xa, site.xa))
    if aa == 0:
        return
    c = float(np.vdot(site.xa, site.xb)) / aa
    for r, text in _ratios(labels, mask, calls, _data_parallel(site.cb)):
        if abs(c - r) <= _MATCH * r:
            after = rel_l2(r * site.xa, site.xb)
            yield make_hint("loss-normalisation", f"B = {c:.6g} × A = {r:.6g}: {text}", site, after,
                            f"B = {r:.6g} × A reproduces B to rel L2 {after:.1e} (least-squares factor {c:.6g})",
                            factor=c, ratio=r, reason=text)
            return
