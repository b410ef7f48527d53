"""What a capture records about the model's configuration: the fields that decide how two frameworks' tensors line up.

Read by duck typing from the model's ``config`` (megatron-core ``TransformerConfig``, Hugging Face
``PretrainedConfig``, MindFormers' configs), looking through wrappers (``module``: DDP, Float16Module;
``model``: MindFormers' Training*ForCausalLM) and a few model attributes. Only plain values are kept;
nothing is imported and nothing can fail the capture (a field that cannot be read is left out).
``tensordiff diff`` uses them to pick a built-in mapping and its variables.
"""

from __future__ import annotations

import json
from typing import Any

#: Config fields kept, under their own names (frameworks name the same thing differently).
FIELDS = (
    "model_type", "num_layers", "num_hidden_layers", "hidden_size", "ffn_hidden_size", "intermediate_size",
    "num_attention_heads", "num_heads", "n_head", "num_query_groups", "num_key_value_heads", "n_kv_heads",
    "kv_channels", "head_dim", "gated_linear_unit", "hidden_act", "activation_function", "normalization",
    "layernorm_epsilon", "rms_norm_eps", "layer_norm_epsilon", "position_embedding_type", "rotary_base", "rope_theta",
    "theta", "tie_word_embeddings", "share_embeddings_and_output_weights", "add_bias_linear",
    "use_interleaved_weight_layout_mlp", "vocab_size", "padded_vocab_size",
    # what a derived mapping and `tensordiff config` need beyond the sizes (tensordiff.mapping.derive)
    "activation_func", "layernorm_zero_centered_gamma", "rotary_percent", "partial_rotary_factor", "rotary_pct",
    "qk_layernorm", "add_qkv_bias", "attention_bias", "num_moe_experts", "num_local_experts", "num_experts",
    "n_routed_experts", "moe_ffn_hidden_size", "moe_intermediate_size", "moe_router_topk", "num_experts_per_tok",
    "use_parallel_residual", "parallel_attn",
    # multi-latent attention and shared experts (DeepSeek): HF's names, then megatron-core's
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "qk_head_dim",
    "qk_pos_emb_head_dim", "multi_latent_attention", "n_shared_experts", "moe_shared_expert_intermediate_size",
    "first_k_dense_replace", "moe_layer_freq",
    # what megatron-core cannot compute (Gemma 2): said, never a false divergence
    "attn_logit_softcapping", "final_logit_softcapping",
)


def _plain(value: Any) -> Any:
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    name = getattr(value, "__name__", None)  # an activation function: megatron's config holds the callable
    return name if isinstance(name, str) else None


def model_config(model: Any) -> dict[str, Any]:
    """The alignment-relevant config of ``model`` (and the models it wraps), as plain values."""
    out: dict[str, Any] = {}
    seen: set[int] = set()
    todo = [model]
    while todo and len(seen) < 8:
        obj = todo.pop(0)
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        for holder in (getattr(obj, "config", None), obj):
            if holder is None:
                continue
            for name in FIELDS:
                if name in out:
                    continue
                try:
                    value = _plain(getattr(holder, name, None))
                except Exception:  # a property that raises: leave it out
                    continue
                if value is not None:
                    out[name] = value
        for inner in ("module", "model"):
            try:
                todo.append(getattr(obj, inner, None))
            except Exception:
                continue
    return out


def model_config_attr(model: Any) -> str | None:
    """``model_config(model)`` as the JSON text stored in the file's ``model_config`` attribute (None when empty)."""
    try:
        config = model_config(model)
    except Exception:  # the training run comes first
        return None
    return json.dumps(config, sort_keys=True) if config else None
