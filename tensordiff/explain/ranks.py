"""Why records that must be identical across ranks differ: a cause named from the rank files alone (no reference).

The cross-rank check (``MergedCapture.inconsistent_records``) lists the records whose copies differ within a
tensor-parallel or data-parallel group. Which records they are says where the missing collective is:

* only gradients of parameters megatron marks ``sequence_parallel``, across TP ranks: their TP all-reduce is
  missing (megatron's ``finalize_model_grads``; Megatron-LM #1446, gpt-neox #1257);
* parameter gradients across DP ranks: the data-parallel all-reduce is missing, or was not waited for;
* the tied word embeddings' copies across pipeline stages (the first stage's word embeddings, the last stage's
  output layer, marked ``tied``): the embedding group's all-reduce of their gradients is missing (megatron's
  ``finalize_model_grads``, ``_allreduce_word_embedding_grads``), and from the next step on their weights differ;
* weights across ranks (with gradients agreeing): the ranks did not start from the same weights;
* anything else: an activation that should be replicated is not (a missing all-reduce/all-gather in the forward).
"""

from __future__ import annotations

from typing import Any

from ..record import Record


def inconsistency_cause(items: list[tuple[Record, str, list[int]]], split: Any) -> str:
    """One sentence for the earliest phase's inconsistent records; ``split(module, slot)`` gives a parameter's
    megatron attributes ({} if unmarked)."""
    if not items:
        return ""
    order = ("weights", "forward", "loss", "backward", "param_grad")
    first_phase = min((rec.phase for rec, _, _ in items), key=lambda p: order.index(p) if p in order else 99)
    first = [(rec, group) for rec, group, _ in items if rec.phase == first_phase]
    groups = {group for _, group in first}
    if groups == {"PP"} and all(split(rec.module, rec.slot).get("tied") for rec, _ in first):
        names = []
        for rec, _ in first:
            copy = split(rec.module, rec.slot).get("tied_copy")
            name = f"{rec.module}.{rec.slot} on the first" + (f", {copy} on the last" if copy else "")
            if name not in names:
                names.append(name)
        what, why = (("gradients", "") if first_phase == "param_grad" else
                     ("weights", "an earlier step updated them with different gradients: "))
        return (f"the {what} of the tied word embeddings' copies differ across pipeline stages ({'; '.join(names)}): "
                f"{why}each stage computes its own share of the gradient, and the shares must be all-reduced over the "
                "embedding group before the optimizer step (megatron's finalize_model_grads, "
                "_allreduce_word_embedding_grads)")
    if first_phase == "param_grad":
        if groups == {"TP"} and all(split(rec.module, rec.slot).get("sp") for rec, _ in first):
            return (f"the gradients of {len(first)} parameter(s) marked sequence_parallel differ across tensor-parallel "
                    "ranks: each rank holds its partial sum over its sequence shard; they must be all-reduced over "
                    "the TP group before the optimizer step (megatron's finalize_model_grads)")
        if groups == {"DP"}:
            return (f"{len(first)} parameter gradient(s) differ across data-parallel ranks: the data-parallel gradient "
                    "all-reduce is missing, was not waited for, or covers only some parameters")
        return (f"{len(first)} parameter gradient(s) differ across {' and '.join(sorted(groups))} ranks: a gradient "
                "reduction over that group is missing")
    if first_phase == "weights":
        return (f"{len(first)} parameter(s) differ across {' and '.join(sorted(groups))} ranks before this step's "
                "forward: the ranks did not load the same weights, or an earlier step updated them with "
                "gradients that differed across ranks")
    return (f"{len(first)} {first_phase} record(s) that must be replicated differ across "
            f"{' and '.join(sorted(groups))} ranks: a collective in the {first_phase} pass is missing or wrong")
