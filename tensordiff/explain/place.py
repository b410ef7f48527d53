"""The first divergence in words: what was measured there, and what kind of code each kind of place points at.

``diff.divergence`` finds the place and says which case it is (``FirstDivergence.case``) with the facts it saw;
this module writes the sentence a migration engineer reads in ``tensordiff diff``'s panel and the JSON's
``explanation``. One sentence per case, in ``CAUSES``; a new case in ``_locate`` gets its sentence here.
"""

from __future__ import annotations

from typing import Any

from ..diff.result import FirstDivergence
from ..record import module_label


def explanation(first: FirstDivergence) -> str:
    """The whole paragraph: the numbers, the place, and the kind of code that differs there."""
    text = _measured(first)
    if first.introduced:
        text += f"The difference is introduced {first.location}. " + _cause(first)
        b_module = first.where.get("b_module")
        if b_module is not None:
            cls = first.where.get("b_module_class")
            text += (f" On B this tensor is the output of {module_label(b_module)} ({cls}): "
                     f"compare that {cls} with what A computes in its place.")
        return text
    return text + ("No single place introduces it: the error grows gradually to this point "
                   f"(accumulated rounding; consider a noise floor with --noise). First exceeded {first.location}.")


def as_dict(first: FirstDivergence) -> dict[str, Any]:
    """``first.as_dict()`` with its ``explanation`` after ``location``, as the JSON reports write it."""
    out: dict[str, Any] = {}
    for key, value in first.as_dict().items():
        out[key] = value
        if key == "location":
            out["explanation"] = explanation(first)
    return out


def _measured(first: FirstDivergence) -> str:
    """The opening: how far apart the tensor is, against what, and what came in."""
    f = first.facts
    judged = f.get("judged", "")
    err, tol, came_in = first.rel_l2, first.tolerance, first.incoming
    head = f"Step {first.step}, {first.phase}: "
    if "reference_a" in f:  # three-way: B judged against the reference
        head += (f"B's {first.label_b} is {err:.3g} (relative L2) away from the reference, more than the limit "
                 f"{tol:.3g} set by A's own {f['reference_a']:.3g} (A's {first.label_a}), while what came in was "
                 f"{came_in:.3g} away. ")
    elif "grew_to" in f:
        later = f["grew_to"]
        head += (f"{first.label_a} differs from B's {first.label_b} by relative L2 {err:.3g}, within the tolerance "
                 f"{tol:.3g} for {judged}, but made from inputs that are bitwise identical on both sides, and this "
                 f"difference grows to {later['rel_l2']:.3g} at {later['label']} ({later['phase']}), over its tolerance "
                 f"{later['tolerance']:.3g}: rounding starts small everywhere, a difference in the code starts here. ")
    elif f.get("exact"):
        head += (f"{first.label_a} differs from B's {first.label_b} by relative L2 {err:.3g}, within the tolerance "
                 f"{tol:.3g} for {judged}, but both runs are one bitwise reproducible stack and everything that came "
                 "in (its inputs and weights) is bitwise identical: a difference of any size here is a difference in "
                 "the code (same-stack exactness; --no-exact turns it off). ")
    else:
        head += (f"{first.label_a} differs from B's {first.label_b} (relative L2 {err:.3g} > tolerance {tol:.3g} for "
                 f"{judged}) "
                 + (f"while what came in differed by {came_in:.3g}. " if not first.uncompared else
                    "while nothing that came in was compared. " if f.get("nothing_compared") else
                    f"while what came in and was compared differed by {came_in:.3g}. "))
    if first.uncompared:
        names = first.uncompared
        head += (f"Not compared, so not known to agree: {f.get('uncompared_records', len(names))} of the records that came in "
                 f"({', '.join(names[:3])}{' ...' if len(names) > 3 else ''}). ")
    return head


# -- one sentence per case -------------------------------------------------------------------------------------------

#: ``FirstDivergence.case`` -> what kind of code differs at such a place, with ``_fields``' names.
CAUSES: dict[str, str] = {
    "batch": "The runs were fed different inputs: {label_a} ({dtype}) differs from B's {label_b}; integer inputs "
             "(token ids, labels, positions, masks) come from the batch, not from the model: check that both sides load "
             "the same batch (tensordiff batch; tensordiff.batch.load).",
    "checkpoint": "The weights already differ before anything ran{on_b}: the two runs did not load the same checkpoint "
                  "(or converted it differently) for {mod}.{slot}.",
    "optimizer_update": "Step {prev_step} ended with matching gradients for {mod}.{slot}, yet the weights differ at the "
                        "start of step {step}: the optimizer update differs (learning rate, weight decay, "
                        "betas/epsilon, gradient clipping or loss scaling).",
    "loss": "The model's outputs agree but the loss does not: the loss function or its reduction differs (mean vs sum, "
            "masking, label shift).",
    "dp_reduction": "{param_grads_differ} of the {param_grads} parameter gradients differ after the data-parallel "
                    "reduction while {local_grads_agree} of the {local_grads} local gradients (before it) agree, "
                    "{mod}.{slot}'s among them: the reduction changes them (its dtype, sum vs mean, the ranks or "
                    "parameters it covers), not the backward pass.",
    "grad_reduction": "{param_grads_differ} of the {param_grads} parameter gradients differ while every activation "
                      "gradient {agrees}: the gradients are reduced, scaled or accumulated differently after backward "
                      "(the data-parallel all-reduce: sum vs mean, its dtype; gradient accumulation; a loss scale not "
                      "undone), not computed differently by one module.",
    "local_weight_grad": "The activations and gradients around {mod} {agree}, but the local gradient of its parameter "
                         "{slot} (before the data-parallel reduction) does not{on_b}: the weight-gradient computation, "
                         "its scaling or accumulation differs there.",
    "weight_grad": "The activations and gradients around {mod} {agree}, but the gradient of its parameter {slot} does "
                   "not{on_b}: the weight-gradient computation, gradient scaling, accumulation or reduction differs "
                   "there.",
    "module": "The inputs of {mod} ({module_class}) {agree} and its output does not{on_b}: the module itself computes "
              "differently.",
    "after_child": "Every submodule of {mod} {agrees}, the output of {mod} does not{on_b}: the difference comes from "
                   "code in {mod}'s own forward after {after} (a residual or bias add, a functional op).",
    "model_input": "The model input {slot} differs: the two runs were not fed the same batch.",
    "handover": "In A, {mod}'s input.{slot} is the very output of {smod} ({source_class}); B's output of {smod} agrees "
                "with A's, but what {mod} receives on B does not: B changes the tensor on its way from {smod} to {mod} "
                "(a copy or a transfer between devices or pipeline stages, a reshape or layout change, an in-place "
                "update between the two modules).",
    "source_module": "{mod}'s input.{slot} is the output of {place} ({source_class}), which differs while {came_into} "
                     "{place} itself, or code before it that is not a module (attention scores and softmax, RoPE, "
                     "masking, an activation), computes differently.",
    "attention_core": "Everything up to this point {agrees}, but {mod}'s input.{slot}, the attention's output, does "
                      "not: it is made by {place}'s attention core, computed as code (RoPE on q and k, the scores and "
                      "their scale, the mask, softmax, attention dropout), no module of its own.",
    "between_modules": "Everything up to this point {agrees}, but {mod}'s input.{slot} does not: it is made by code "
                       "inside {place} that is not a module of its own (an activation function, a bias add, a reshape "
                       "or rotary embedding).",
    "loss_grad": "The forward pass and the loss {agree}, but the gradient arriving at the model's output {output} does "
                 "not: the loss is reduced differently (mean vs sum, over tokens or micro-batches), scaled differently "
                 "(a loss scale not undone) or masks other labels.",
    "module_backward": "The gradient arriving at {mod}'s output {agree}; the gradient it passes to its input {slot} does "
                       "not{on_b}: {mod}'s backward differs.",
    "consumer_backward": "The gradient of {mod}'s output is the first to differ; that output feeds {place}, whose "
                         "backward (or other code using the same tensor) computes it differently.",
    "code_backward": "Gradients {agree} until the gradient of {mod}'s output, which differs: the backward of code "
                     "between modules (a functional activation, a bias or residual add) differs there.",
}


def _cause(first: FirstDivergence) -> str:
    template = CAUSES.get(first.case)
    return template.format_map(_fields(first)) if template else ""


def _fields(first: FirstDivergence) -> dict[str, Any]:
    """The names ``CAUSES`` uses: the place's ``where`` and ``facts``, and these."""
    complete = not first.uncompared  # else "agree" is said only of what was compared
    place = module_label(first.where.get("module", ""))
    smod = module_label(first.where.get("handed_over_from", ""))
    return {
        **first.where, **first.facts,
        "label_a": first.label_a, "label_b": first.label_b, "slot": first.slot, "step": first.step,
        "prev_step": first.step - 1, "mod": module_label(first.module_a), "place": place, "smod": smod,
        "on_b": f" (on B: {module_label(first.module_b)})" if first.module_b != first.module_a else "",
        "agree": "agree" if complete else "agree where they were compared",
        "agrees": "agrees" if complete else "agrees where compared",
        "source_class": first.facts.get("source_class") or "?",
        "came_into": (f"what came into {place} was not compared (no counterpart, or left out by the mapping):"
                      if first.facts.get("nothing_compared") else
                      f"what came into {place} {'agrees' if complete else 'agrees where compared'}:"),
    }
