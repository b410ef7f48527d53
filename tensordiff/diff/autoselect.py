"""Pick the built-in mapping (and its variables) that fits two captures, from what the captures say about themselves.

Evidence, strongest first: the frameworks and model classes in the files' attributes, the module classes and
names of the records (MindFormers' ``MLPInterleaved`` is the interleaved gate/up layout), and the model
configuration the capture recorded (heads and query groups for grouped-query attention). A mapping maps its
second side's names onto its first side's (every built-in has megatron-core first), but the captures may come in
either order: ``orient`` matches a pair file's sides to the two captures by their content, never by argument
position, and the diff then runs with the mapping's first side as A. ``--mapping`` always overrides the choice of
file (not of order); both are said in the report.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from ..mapping import RenameRules
from ..mapping.derive import derive
from ..mapping.names import unwrap
from ..record import Record

#: What a note says when B computes what megatron-core cannot (``derive``): the diff then says that, in one line.
CANNOT_EXPRESS = "computes what megatron-core cannot express"
_LAYERS = re.compile(r"^(model\.)?decoder\.layers\.\d+")


def _config(attrs: dict[str, Any]) -> dict[str, Any]:
    try:
        value = json.loads(str(attrs.get("model_config", "") or "{}"))
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _first(config: dict[str, Any], *names: str) -> Any:
    return next((config[n] for n in names if config.get(n) is not None), None)


def _is_mcore(attrs: dict[str, Any], records: Iterable[Record]) -> bool:
    return str(attrs.get("framework")) == "torch" and "megatron_core_version" in attrs and any(
        _LAYERS.match(unwrap(r.module)) for r in records)


_HF_LLAMA = (re.compile(r"^model\.layers\.\d+\.self_attn\.q_proj$"), re.compile(r"^model\.layers\.\d+\.mlp\.gate_proj$"))


def _is_hf_llama(records: Iterable[Record]) -> bool:
    """transformers' Llama layout (Llama, Mistral, Qwen2, ...): decoder layers with q_proj and a gated MLP."""
    names = {unwrap(r.module) for r in records if r.phase == "weights"}
    return all(any(p.match(n) for n in names) for p in _HF_LLAMA)


def pick_mapping(attrs_a: dict[str, Any], attrs_b: dict[str, Any], records_a: list[Record],
                 records_b: list[Record]) -> tuple[RenameRules | None, str]:
    """(the built-in mapping with its variables, or None to line names up as they are; one sentence saying why)."""
    fw_a, fw_b = str(attrs_a.get("framework", "?")), str(attrs_b.get("framework", "?"))
    cls_a, cls_b = str(attrs_a.get("model_class", "?")), str(attrs_b.get("model_class", "?"))
    if fw_a == fw_b and cls_a == cls_b:
        return None, ""  # the same code on both sides: names line up as they are
    if not _is_mcore(attrs_a, records_a):
        if fw_a == fw_b:
            return None, ""  # one framework, no built-in: names as they are, and coverage tells how well they fit
        return None, _none(fw_a, cls_a, fw_b, cls_b)
    cfg_a, cfg_b = _config(attrs_a), _config(attrs_b)
    heads = _first(cfg_a, "num_attention_heads") or _first(cfg_b, "num_attention_heads", "num_heads", "n_head")
    groups = _first(cfg_a, "num_query_groups") or _first(cfg_b, "num_query_groups", "num_key_value_heads", "n_kv_heads")
    variables: dict[str, str] = {}
    if fw_b == "torch" and _first(cfg_b, "model_type") not in (None, "gpt2") and not cls_b.startswith("GPT2"):
        derived = derive(cfg_a, cfg_b, records_a, records_b)  # a Hugging Face decoder: its roles by shape
        if derived.rules is not None:
            return derived.rules, (f"{derived.note}: B is Hugging Face {cls_b} (model_type {_first(cfg_b, 'model_type')}"
                                   "); each module's role from its parameters' shapes, the configs' sizes and the "
                                   "order it ran (--mapping overrides)")
        if derived.cannot:
            return None, f"none: Hugging Face {cls_b} {CANNOT_EXPRESS}: {'; '.join(derived.cannot)}"
        if not _is_hf_llama(records_b):
            return None, _none(fw_a, cls_a, fw_b, cls_b) + f"; no mapping derived: {derived.note}"
    if fw_b == "mindspore" and cls_b == "LlamaForCausalLM":
        name = "mcore-mindformers-llama"
        why = "B is MindFormers' legacy LlamaForCausalLM"
        if heads:
            variables["heads"] = str(heads)
            variables["groups"] = str(groups or heads)
            why += f"; {heads} heads in {groups or heads} query groups"
    elif fw_b == "mindspore" and any(_LAYERS.match(unwrap(r.module)) for r in records_b):
        name = "mcore-mindformers"
        interleaved = any(r.module_class == "MLPInterleaved" for r in records_b)
        variables["fc1_layout"] = "interleaved" if interleaved else "stacked"
        why = f"B is MindFormers' parallel_core {cls_b}; its MLP is {'MLPInterleaved' if interleaved else 'MLP'}"
        if heads and groups and int(heads) % int(groups) == 0:
            variables["kv_repeat"] = str(int(heads) // int(groups))
            why += f"; {heads} heads in {groups} query groups"
    elif fw_b == "torch" and _is_hf_llama(records_b):
        name = "mcore-hf-llama"
        why = f"B is Hugging Face {cls_b} (Llama layout: self_attn.q_proj/k_proj/v_proj, mlp.gate_proj/up_proj)"
        if heads:
            variables["heads"] = str(heads)
            variables["groups"] = str(groups or heads)
            why += f"; {heads} heads in {groups or heads} query groups"
    elif fw_b == "torch" and (cls_b.startswith("GPT2") or _first(cfg_b, "model_type") == "gpt2"):
        name = "mcore-hf-gpt2"
        why = f"B is Hugging Face {cls_b}"
        if heads:
            variables["heads"] = str(heads)
            why += f"; {heads} heads"
    else:
        return None, _none(fw_a, cls_a, fw_b, cls_b)
    rules = RenameRules.load(name, variables)
    shown = ", ".join(f"{k}={v}" for k, v in variables.items())
    return rules, f"{name}{f' ({shown})' if shown else ''}, picked from the captures: {why} (--mapping overrides)"


def picked_name(note: str) -> str:
    """The mapping a pick's note names: 'mcore-hf-llama (heads=4, groups=2)', 'derived from the captures (...)'."""
    return note.split(", picked from the captures")[0].split(": B is")[0]


def _rule_hits(mapping: RenameRules, records_a: list[Record], records_b: list[Record]) -> int:
    """How many records the mapping's rules pair with A as its first side and B as its second."""
    from .align import align_step  # align imports this module's neighbours only; kept local to stay cycle-free

    return sum(1 for p in align_step(records_a, records_b, mapping, order_fallback=False) if p.how == "rule")


def orient(attrs_a: dict[str, Any], attrs_b: dict[str, Any], records_a: list[Record], records_b: list[Record],
           mapping: RenameRules | None, auto: bool) -> tuple[bool, RenameRules | None, str]:
    """(whether the captures are to be swapped so that A is the mapping's first side, the mapping, the note).

    A given mapping (``--mapping``, a ``map`` output, a user's file) is applied in the orientation its rules fit
    better, counted over one step's records: the captures' content decides, never their argument order. With no
    mapping given and ``auto``, the built-in pick is tried with the captures in both orders."""
    if mapping is not None:
        if not mapping.rules:
            return False, mapping, ""
        straight, swapped = _rule_hits(mapping, records_a, records_b), _rule_hits(mapping, records_b, records_a)
        if swapped > straight:
            return True, mapping, (f"{mapping.name or mapping.path}: its first side is the second capture given "
                                   f"({swapped} records fit its rules that way, {straight} the other): A and B "
                                   "swapped so that A is the mapping's first side")
        return False, mapping, ""
    if not auto:
        return False, None, ""
    picked, note = pick_mapping(attrs_a, attrs_b, records_a, records_b)
    if picked is not None:
        return False, picked, note
    back, back_note = pick_mapping(attrs_b, attrs_a, records_b, records_a)
    if back is not None:
        return True, back, (back_note + "; the captures were given in the other order: A and B swapped so that A is "
                            "the mapping's first side (megatron-core)")
    return False, None, back_note if CANNOT_EXPRESS in back_note else note


def _none(fw_a: str, cls_a: str, fw_b: str, cls_b: str) -> str:
    return (f"none: no built-in mapping fits A = {fw_a} {cls_a}, B = {fw_b} {cls_b}; names are lined up as they are "
            "(--mapping FILE gives one; `tensordiff map A B -o FILE` proposes one)")
