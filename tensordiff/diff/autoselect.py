"""Pick the built-in mapping (and its variables) that fits two captures, from what the captures say about themselves.

Evidence, strongest first: the frameworks and model classes in the files' attributes, the module classes and
names of the records (MindFormers' ``MLPInterleaved`` is the interleaved gate/up layout), and the model
configuration the capture recorded (heads and query groups for grouped-query attention). A mapping maps B's
names onto A's, so every built-in expects megatron-core on side A. ``--mapping`` always overrides; the
choice is said in the report.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from ..mapping import RenameRules
from ..mapping.names import unwrap
from ..record import Record

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


def _none(fw_a: str, cls_a: str, fw_b: str, cls_b: str) -> str:
    return (f"none: no built-in mapping fits A = {fw_a} {cls_a}, B = {fw_b} {cls_b}; names are lined up as they are "
            "(--mapping FILE gives one; `tensordiff map A B -o FILE` proposes one)")
