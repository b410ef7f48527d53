"""Pipeline hints, tested when B is merged from pipeline-parallel stage files (pp-tied also when A is):

* pp-boundary: a stage received the hidden state other than the previous stage sent it;
* pp-layer-offset: a later stage loaded its layers from the checkpoint by their stage-local numbers;
* pp-tied: the gradient of the tied word embeddings is one stage's share: the sum with the other stage's copy (the
  last stage's output layer weight) is A (the embedding group's all-reduce is missing).

See docs/hints/pp-boundary.md."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import numpy as np

from ... import dtypes
from .base import MIN_EXPLAINED, Hint, NotApplicable, Site, explained_share, make_hint, mirrored, rel_l2


def _rounded(x: np.ndarray, dt: Any) -> np.ndarray:
    return np.asarray(x.astype(np.float32).astype(dt).astype(np.float64))


def _arrivals(sent: np.ndarray) -> list[tuple[str, Callable[[], np.ndarray]]]:
    """What a receiving stage gets from ``sent`` ([S, B, H], megatron's layout) under the usual handover mistakes."""
    out: list[tuple[str, Callable[[], np.ndarray]]] = []
    if sent.ndim >= 3 and sent.shape[0] != 1 and sent.shape[1] != 1:
        s, b = sent.shape[:2]
        out.append(("batch first: the sender's [B, S, H] memory read in megatron's [S, B, H] shape",
                    lambda: np.ascontiguousarray(np.swapaxes(sent, 0, 1)).reshape(sent.shape)))
        out.append(("[S, B, H] memory read as [B, S, H] and transposed back",
                    lambda: np.swapaxes(np.ascontiguousarray(sent).reshape((b, s) + sent.shape[2:]), 0, 1)))
    out.append(("zeros: nothing arrived (a receive not waited for, or a buffer never filled)",
                lambda: np.zeros_like(sent)))
    narrow = [("FP16", np.dtype(np.float16))]
    if "bfloat16" in dtypes.NUMPY_DTYPES:
        narrow.insert(0, ("BF16", dtypes.NUMPY_DTYPES["bfloat16"]))
    for name, dt in narrow:
        out.append((f"rounded to {name} on the way (a pipeline_dtype narrower than the model's)",
                    partial(_rounded, sent, dt)))
    return out


_LAYER = re.compile(r"(^|\.)decoder\.layers\.(\d+)(?=\.|$)")


def check_pipeline(site: Site) -> Iterator[Hint]:
    """The pipeline causes: a step-0 weight of a later stage (its layer numbers), else the handover."""
    if site.cb.pp < 2:
        if site.ca.pp < 2:
            raise NotApplicable("neither side is merged from pipeline stage files")
        # the captures given the other way: A is the stage files
        yield from check_pp_tied(site, mirrored=True) if site.a.phase == "param_grad" else \
            mirrored(check_pipeline, site)
        return
    if site.a.phase == "weights":
        yield from check_pp_layer_offset(site)
    elif site.a.phase == "param_grad":
        yield from check_pp_tied(site)
    else:
        yield from check_pp_boundary(site)


def check_pp_tied(site: Site, mirrored: bool = False) -> Iterator[Hint]:
    """B's gradient of a tied weight (the first stage's word embeddings) differs from A's: if the sum of the copies'
    gradients over the stages that hold one (the last stage's output layer weight) reproduces A, each stage stepped on
    its own share and the all-reduce over the embedding group is missing. ``mirrored``: A is the run merged from
    stage files and B the reference (the captures given in the other order): the same test, the sides' roles
    exchanged."""
    cap, rec, other = (site.ca, site.a, "B") if mirrored else (site.cb, site.b, "A")
    own = "A" if mirrored else "B"
    copies = cap.tied_copies(rec) if rec.kind == "grad" else None
    if not copies:
        raise NotApplicable("not the gradient of a weight tied across pipeline stages")
    if site.row.pair.join is not None:
        raise NotApplicable("B's record is joined from several of B's records")

    def in_a_layout(x: np.ndarray) -> np.ndarray:
        if mirrored:  # A's own records are in A's layout
            return np.asarray(x, dtype=np.float64)
        return np.asarray(site.row.pair.b_tensor(lambda _rec: x), dtype=np.float64)

    try:
        total = np.sum([in_a_layout(x) for _, x in copies], axis=0)
    except Exception as err:
        raise NotApplicable(f"{own}'s stage copies cannot be put in A's layout ({type(err).__name__})") from None
    target = site.xb if mirrored else site.xa
    if total.shape != target.shape:
        raise NotApplicable(f"{own}'s stage copies have another shape than {other}")
    after = rel_l2(target, total)
    if explained_share(site.before, after) < MIN_EXPLAINED:
        return
    name = cap.tied_copy_name(rec.module, rec.slot) or "its copy"
    stages = [k for k, _ in copies]
    yield make_hint("pp-tied", f"{own}'s gradient of the tied {rec.module}.{rec.slot} is pipeline stage "
                    f"{stages[0]}'s share only: the sum with stage {stages[-1]}'s copy ({name}) reproduces {other} "
                    "(the all-reduce over the embedding group is missing)", site, after,
                    f"the word embeddings and the output layer share one weight; with pipeline stages the first holds "
                    f"it and the last a copy, each computing its own part of the gradient. The sum of the "
                    f"{len(copies)} stages' gradients matches {other} to rel L2 {after:.1e}; megatron's "
                    "finalize_model_grads all-reduces them over the embedding group (_allreduce_word_embedding_grads) "
                    "so both copies take the same step", stages=stages, copy=name)


def check_pp_layer_offset(site: Site) -> Iterator[Hint]:
    """B's weight of global layer i on pipeline stage k (first layer: offset o) is A's weight of layer i - o: the
    stage loaded the checkpoint by its stage-local layer numbers (the offset was not applied)."""
    stage, offsets = site.cb.stage_of(site.b), site.cb.offsets
    m = _LAYER.search(site.b.module)
    if stage is None or not offsets or m is None or site.a.step != 0:
        raise NotApplicable("not a layer's weight before the first step")
    offset = int(offsets[stage])
    if offset == 0:
        raise NotApplicable("a layer of the first pipeline stage (no offset)")
    layer = int(m.group(2))
    local = site.b.module[:m.start(2)] + str(layer - offset) + site.b.module[m.end(2):]
    theirs = site.weights(local).get(site.b.slot)
    if theirs is None or theirs.shape != site.xb.shape:
        raise NotApplicable(f"A holds no {local}.{site.b.slot} of this shape")
    after = rel_l2(theirs, site.xb)
    if explained_share(site.before, after) < MIN_EXPLAINED:
        return
    yield make_hint("pp-layer-offset", f"B's pipeline stage {stage} holds A's {local}.{site.b.slot} as "
                    f"{site.b.module}.{site.b.slot}: it loaded its layers by their stage-local numbers (layer offset "
                    f"{offset} not applied)", site, after,
                    f"stage {stage}'s first layer is global layer {offset} (its layer_offset); B's weight of layer "
                    f"{layer} equals A's of layer {layer - offset} (rel L2 {after:.1e}): the checkpoint was indexed "
                    "with the stage-local layer number",
                    stage=stage, layer_offset=offset, loaded_from=local)


def check_pp_boundary(site: Site) -> Iterator[Hint]:
    """B was merged from pipeline-parallel stage files and the diverged record is the tensor a stage received (its
    first layer's input): if what the previous stage sent (its last layer's output) agrees with A, the difference
    arises in the handover between the stages; which mistake reproduces what arrived is named when one does."""
    if site.cb.pp < 2:
        raise NotApplicable("B is not merged from pipeline stage files")
    if site.row.pair.join is not None or site.row.pair.ops:
        raise NotApplicable("B's record is transformed or joined by the mapping")
    found = site.cb.received_from(site.b)
    if found is None:
        raise NotApplicable("not a tensor a pipeline stage received")
    sent_rec, sender, receiver = found
    raw = site.cb.array(sent_rec)
    got = site.cb.array(site.b)
    if raw is None or got is None:
        raise NotApplicable("the sending stage's output is not stored")
    sent = np.asarray(raw, dtype=np.float64)
    got = np.asarray(got, dtype=np.float64)
    if sent.shape != site.xa.shape or got.shape != sent.shape:
        raise NotApplicable("the sent and received tensors have other shapes than A's")
    after = rel_l2(site.xa, sent)
    if explained_share(site.before, after) < MIN_EXPLAINED:
        return  # what was sent already differs: the sending stage computes differently, not the handover
    how, fit = "", np.inf
    for name, make in _arrivals(sent):
        err = rel_l2(make(), got)
        if err < fit:
            how, fit = name, err
    named = fit <= 1e-3 * max(rel_l2(sent, got), 1e-30) or fit <= 1e-6
    title = (f"B's pipeline stage {receiver} received {site.b.module}'s input.{site.b.slot} other than stage {sender} "
             f"sent it: the hidden state changes as it is handed over between pipeline stages")
    if named:
        title += f" ({how.split(':')[0]})"
    evidence = (f"stage {sender}'s output ({sent_rec.label}, what megatron's p2p sends on) matches A to rel L2 "
                f"{after:.1e}; stage {receiver}'s received tensor is {rel_l2(sent, got):.3g} (rel L2) away from it")
    if named:
        evidence += f"; it is what was sent under {how} (rel L2 {fit:.1e})"
    else:
        evidence += "; no usual handover mistake (batch-first layout, zeros, BF16/FP16 rounding) reproduces it"
    yield make_hint("pp-boundary", title, site, after, evidence, sender_stage=sender, receiver_stage=receiver,
                    sent=sent_rec.label, arrival=how if named else None)
