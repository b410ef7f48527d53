"""Vocabulary-padding hint: one side pads its vocabulary (Megatron rounds it up to a multiple of
``make_vocab_size_divisible_by`` × TP) and the padded logits take part in its softmax, or the padded rows differ.

Two forms:

* **other sizes**: A's and B's logits (a forward output compared as ``shape``) differ in their last dimension only,
  and the first ``V`` columns (the real vocabulary, the smaller size) agree. Where the diff stops, at the per-token
  loss or the loss after them, the check rebuilds B's loss from A's with the softmax-denominator term of the padded
  columns: ``loss_B = loss_A ± (logsumexp(all columns) - logsumexp(the first V))``.
* **one size**: the diverged tensor (logits, an embedding or output weight) agrees on its first ``V`` columns (or
  rows) and differs only beyond them: the padded rows are initialised (or trained, or masked) differently.

See docs/hints/vocab-padding.md. Framework-free: numpy on captured arrays.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from ...diff.result import DiffResult
from .base import Hint, Site, make_hint, rel_l2

_AGREE = 1e-4


def _lse(z: np.ndarray) -> np.ndarray:
    m = z.max(axis=-1, keepdims=True)
    return (m + np.log(np.exp(z - m).sum(axis=-1, keepdims=True)))[..., 0]


def _logits(site: Site, result: DiffResult) -> Iterator[tuple[Any, np.ndarray, np.ndarray]]:
    """(row, A's, B's) of forward outputs of the diverged step compared as 'shape' that differ in the last dimension
    only (B in A's layout where its transform applies, else as stored)."""
    for r in result.rows:
        if r.step != site.a.step or r.verdict != "shape" or r.phase != "forward" or r.pair.a is None or r.pair.b is None:
            continue
        if r.pair.a.kind != "output":
            continue
        za = r.pair.a_tensor(site.ca.array)
        if za is None:
            continue
        try:
            zb = r.pair.b_tensor(site.cb.array)
        except Exception:
            zb = None
        if zb is None or np.shape(zb)[:-1] != np.shape(za)[:-1]:
            zb = site.cb.array(r.pair.b)
        if zb is None or za.ndim < 2 or za.shape[:-1] != zb.shape[:-1] or za.shape[-1] == zb.shape[-1]:
            continue
        yield r, np.asarray(za, np.float64), np.asarray(zb, np.float64)


def _to_site(d: np.ndarray, site: Site) -> np.ndarray | None:
    """The per-token term ``d`` in the diverged tensor's shape: itself, transposed ([S, B] vs [B, S]) or its mean
    (a scalar loss)."""
    if d.shape == site.xa.shape:
        return d
    if d.ndim == 2 and d.T.shape == site.xa.shape:
        return d.T
    if site.xa.size == 1:
        return np.full(site.xa.shape, d.mean())
    return None


def _other_sizes(site: Site, result: DiffResult) -> Iterator[Hint]:
    for row, za, zb in _logits(site, result):
        va, vb = za.shape[-1], zb.shape[-1]
        real = min(va, vb)
        if rel_l2(za[..., :real], zb[..., :real]) > _AGREE:
            continue  # the real vocabulary's logits differ too: not (only) padding
        padded, side = (zb, "B") if vb > va else (za, "A")
        d = _lse(padded) - _lse(padded[..., :real])
        term = _to_site(d, site)
        if term is None:
            continue
        hyp = site.xa + term if side == "B" else site.xa - term
        after = rel_l2(hyp, site.xb)
        other = "A" if side == "B" else "B"
        yield make_hint(
            "vocab-padding",
            f"{side}'s vocabulary is padded: its {row.pair.a.label if side == 'A' else row.pair.b.label} has "
            f"{max(va, vb)} columns, {other}'s {real} (the real vocabulary); the {max(va, vb) - real} padded logits "
            f"take part in {side}'s softmax (mask them to -inf, or slice the logits to the real vocabulary, before "
            "the loss)", site, after,
            f"the first {real} logits agree (rel L2 {rel_l2(za[..., :real], zb[..., :real]):.1e}); A's loss "
            f"{'+' if side == 'B' else '-'} the padded columns' softmax-denominator term reproduces B to rel L2 "
            f"{after:.1e}", vocab=real, padded=max(va, vb), side=side, logits=row.pair.a.label)
        return


def _same_size(site: Site) -> Iterator[Hint]:
    """Only the trailing columns (or rows) of the diverged tensor differ: padded rows that differ."""
    xa, xb = site.xa, site.xb
    if xa.ndim < 2:
        return
    scale = float(np.abs(xa).max()) or 1.0
    vocab = _vocab_sizes(site)
    for axis in (xa.ndim - 1, 0):
        n = xa.shape[axis]
        if n < 16 or (vocab and n not in vocab):
            continue  # a padded vocabulary is a vocabulary dimension: not a linear_qkv weight's rows
        other = tuple(i for i in range(xa.ndim) if i != axis)
        differs = np.any(np.abs(xa - xb) > 1e-6 * scale, axis=other)
        if not differs.any() or differs.all():
            continue
        k = int(np.argmax(differs))
        if k < n // 2 or not differs[k:].all():
            continue
        hyp = xa.copy()
        idx: list[Any] = [slice(None)] * xa.ndim
        idx[axis] = slice(k, None)
        hyp[tuple(idx)] = xb[tuple(idx)]
        after = rel_l2(hyp, xb)
        where = "columns" if axis == xa.ndim - 1 else "rows"
        yield make_hint(
            "vocab-padding",
            f"Only the {where} from {k} on ({n - k} of {n}) differ, the first {k} agree: a vocabulary padded "
            f"from {k} to {n} whose padded {where} differ (initialised or masked differently on one side)",
            site, after, f"{where} 0..{k - 1} agree exactly, {k}..{n - 1} all differ",
            vocab=k, padded=n, side="both", axis=axis)
        return


def _vocab_sizes(site: Site) -> set[int]:
    """The vocabulary sizes the two runs have: their configs' vocab_size (padded or not) and their word embeddings'
    rows; empty when neither says."""
    from ...diff.autoselect import _config

    sizes: set[int] = set()
    for cap in (site.ca, site.cb):
        cfg = _config(cap.attrs)
        sizes.update(int(cfg[k]) for k in ("vocab_size", "padded_vocab_size", "n_vocab") if isinstance(cfg.get(k), int))
        for r in cap.records(site.a.step):
            if (r.phase == "weights" and len(r.shape) == 2
                    and ("embed" in r.module.lower() or "embedding" in r.module_class.lower())):
                sizes.add(int(r.shape[0]))
    return sizes


def check_vocab_padding(site: Site, result: DiffResult) -> Iterator[Hint]:
    """One side's vocabulary is padded: logits of other sizes whose padded columns enter the softmax, or padded
    rows or columns that alone differ."""
    found = list(_other_sizes(site, result))
    if found:
        yield from found
        return
    yield from _same_size(site)
