"""A megatron-core <-> Hugging Face mapping derived from the configs and B's module tree: roles by shape and run
order, never by a family's names (``tensordiff.mapping.derive``)."""

from __future__ import annotations

import numpy as np
import pytest

from tensordiff.diff.accounting import _equal
from tensordiff.mapping.derive import derive
from tensordiff.record import Record
from tensordiff.transforms import apply, parse_op

H, HEADS, GROUPS, HD, FFN, V = 64, 4, 2, 16, 128, 96
CFG_A = {"num_attention_heads": HEADS, "num_query_groups": GROUPS, "hidden_size": H}


def tree(layer: list[tuple[str, tuple[int, ...] | None, str]], layers: int = 2, outer: str = "model",
         extra: list[tuple[str, tuple[int, ...] | None, str]] | None = None) -> list[Record]:
    """Weights and forward records of a decoder: each layer's (relative name, weight shape or None, class), in the
    order they run, under ``{outer}.layers.{i}``; an embedding before, a final norm and lm_head after."""
    mods = [(f"{outer}.embed_tokens", (V, H), "Embedding")]
    for i in range(layers):
        mods.append((f"{outer}.layers.{i}", None, "DecoderLayer"))
        mods += [(f"{outer}.layers.{i}.{name}", shape, cls) for name, shape, cls in layer]
    mods += [(f"{outer}.norm", (H,), "RMSNorm"), *(extra or []), ("lm_head", (V, H), "Linear")]
    recs = []
    for seq, (mod, shape, cls) in enumerate(mods):
        if shape is not None:
            recs.append(Record(0, seq, "weights", mod, 0, "param", "weight", cls, "float32", shape))
    for seq, (mod, _, cls) in enumerate(mods, start=len(recs)):
        recs.append(Record(0, seq, "forward", mod, 0, "output", "0", cls, "float32", (2, 8, H)))
    return recs


LLAMA = [("input_layernorm", (H,), "RMSNorm"), ("self_attn", None, "Attention"),
         ("self_attn.q_proj", (HEADS * HD, H), "Linear"), ("self_attn.k_proj", (GROUPS * HD, H), "Linear"),
         ("self_attn.v_proj", (GROUPS * HD, H), "Linear"), ("self_attn.o_proj", (H, HEADS * HD), "Linear"),
         ("post_attention_layernorm", (H,), "RMSNorm"), ("mlp", None, "MLP"),
         ("mlp.gate_proj", (FFN, H), "Linear"), ("mlp.up_proj", (FFN, H), "Linear"), ("mlp.down_proj", (H, FFN), "Linear")]


def hf_cfg(**extra: object) -> dict:
    return {"model_type": "llama", "hidden_size": H, "num_attention_heads": HEADS, "num_key_value_heads": GROUPS,
            "head_dim": HD, "intermediate_size": FFN, "num_hidden_layers": 2, **extra}


def rules(derived) -> dict[str, tuple]:
    """B's pattern -> (A's name, the join, B's params' ops) for each rule."""
    return {r.b.pattern: (r.a, r.join, {k: [str(o) for o in v] for k, v in r.params.items()}) for r in derived.rules.rules}


def test_a_llama_layout_under_any_names_gets_q_k_v_joined_per_group_and_gate_up_chunked():
    renamed = [(n.replace("self_attn", "attn").replace("q_proj", "wq").replace("k_proj", "wk").replace("v_proj", "wv")
                .replace("o_proj", "wo").replace("gate_proj", "w1").replace("up_proj", "w3").replace("down_proj", "w2")
                .replace("mlp", "ffn"), s, c) for n, s, c in LLAMA]
    d = derive(CFG_A, hf_cfg(model_type="my_llama"), [], tree(renamed, outer="backbone"))
    assert d.rules is not None and d.note == "derived from the captures (4 heads in 2 query groups)"
    joins = {r.a.replace("\\g<i>", "{i}"): (r.join, [p.pattern for p in r.parts]) for r in d.rules.rules if r.join}
    qkv_join, parts = joins["decoder.layers.{i}.self_attention.linear_qkv"]
    assert qkv_join == "qkv_groups(heads=4, groups=2)" and [p.split("\\.")[-1] for p in parts] == ["wq", "wk", "wv"]
    fc1_join, parts = joins["decoder.layers.{i}.mlp.linear_fc1"]
    assert fc1_join == "chunk(n=2)" and [p.split("\\.")[-1] for p in parts] == ["w1", "w3"]
    targets = {r.a.replace("\\g<i>", "{i}") for r in d.rules.rules}
    assert {"decoder.layers.{i}.self_attention.linear_proj", "decoder.layers.{i}.mlp.linear_fc2",
            "decoder.layers.{i}.input_layernorm", "decoder.layers.{i}.pre_mlp_layernorm", "decoder.final_layernorm",
            "embedding.word_embeddings", "output_layer", "decoder"} <= targets


def test_a_fused_qkv_is_read_as_q_k_v_blocks_and_a_fused_gate_up_as_megatron_s_own():
    phi3 = [("input_layernorm", (H,), "RMSNorm"), ("self_attn", None, "Attention"),
            ("self_attn.qkv_proj", ((HEADS + 2 * GROUPS) * HD, H), "Linear"),
            ("self_attn.o_proj", (H, HEADS * HD), "Linear"), ("post_attention_layernorm", (H,), "RMSNorm"),
            ("mlp", None, "MLP"), ("mlp.gate_up_proj", (2 * FFN, H), "Linear"), ("mlp.down_proj", (H, FFN), "Linear")]
    d = derive(CFG_A, hf_cfg(model_type="phi3"), [], tree(phi3))
    assert "fused QKV [Q|K|V], fused gate/up" in d.note
    qkv = next(r for r in d.rules.rules if r.a.endswith("linear_qkv"))
    assert [str(o) for o in qkv.params["weight"]] == ["qkv_grouped(heads=4, groups=2, dim=0)"]
    assert [str(o) for o in qkv.outputs] == ["swap01", "qkv_grouped(heads=4, groups=2, dim=-1)"]
    fc1 = next(r for r in d.rules.rules if r.a.endswith("linear_fc1"))
    assert fc1.b.pattern.endswith("gate_up_proj") and not fc1.join and not fc1.params


def test_gemma_norms_compare_with_an_offset_on_the_value_only_unless_megatron_keeps_w():
    d = derive(CFG_A, hf_cfg(model_type="gemma"), [], tree(LLAMA))
    norm = next(r for r in d.rules.rules if r.a.endswith("input_layernorm"))
    assert [str(o) for o in norm.params["weight"]] == ["offset(value=1.0)"]
    weight = Record(0, 0, "weights", "model.layers.0.input_layernorm", 0, "param", "weight", "", "float32", (H,))
    grad = Record(0, 0, "param_grad", "model.layers.0.input_layernorm", 0, "grad", "weight", "", "float32", (H,))
    assert [str(o) for o in norm.ops_for(weight)] == ["offset(value=1.0)"] and norm.ops_for(grad) == ()
    kept = derive({**CFG_A, "layernorm_zero_centered_gamma": True}, hf_cfg(model_type="gemma"), [], tree(LLAMA))
    assert not next(r for r in kept.rules.rules if r.a.endswith("input_layernorm")).params
    assert parse_op("offset(value=1)", "t")(np.zeros(3)).tolist() == [1.0, 1.0, 1.0]


def test_experts_and_router_map_by_shape_and_their_token_ordered_activations_are_left_out_on_purpose():
    moe = [("input_layernorm", (H,), "RMSNorm"), *LLAMA[1:6], ("post_attention_layernorm", (H,), "RMSNorm"),
           ("block_sparse_moe", None, "SparseMoeBlock"), ("block_sparse_moe.gate", (4, H), "Linear")]
    for e in range(4):
        moe += [(f"block_sparse_moe.experts.{e}.w1", (FFN, H), "Linear"),
                (f"block_sparse_moe.experts.{e}.w3", (FFN, H), "Linear"),
                (f"block_sparse_moe.experts.{e}.w2", (H, FFN), "Linear")]
    d = derive(CFG_A, hf_cfg(model_type="mixtral", num_local_experts=4), [], tree(moe))
    assert "4 experts" in d.note
    targets = {r.a.replace("\\g<i>", "{i}"): r for r in d.rules.rules}
    assert targets["decoder.layers.{i}.mlp.router"].b.pattern.endswith("block_sparse_moe\\.gate")
    fc1 = targets["decoder.layers.{i}.mlp.experts.local_experts.3.linear_fc1"]
    assert fc1.join == "chunk(n=2)" and fc1.kinds == {"param", "grad", "grad_local"}
    ignored = [i.module.pattern for i in d.rules.ignore_b]
    assert any(p.endswith("block_sparse_moe\\.experts") for p in ignored)


@pytest.mark.parametrize("layer, cfg, said", [
    (LLAMA + [("pre_feedforward_layernorm", (H,), "RMSNorm"), ("post_feedforward_layernorm", (H,), "RMSNorm")],
     {}, "4 norms"),
    (LLAMA, {"use_parallel_residual": True}, "a parallel residual"),
    ([*LLAMA[:6], ("self_attn.q_norm", (HEADS * HD,), "RMSNorm"), ("self_attn.k_norm", (GROUPS * HD,), "RMSNorm"),
      *LLAMA[6:]], {}, "q or k of all heads at once"),
    (LLAMA, {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping: 50: tanh soft-capping"),
])
def test_what_megatron_core_cannot_compute_is_said_and_no_mapping_derived(layer, cfg, said):
    d = derive(CFG_A, hf_cfg(**cfg), [], tree(layer))
    assert d.rules is None and d.cannot and said in "; ".join(d.cannot)


QL, KVL, NOPE, ROPE, VH, SFF = 32, 24, 16, 8, 16, 32
MLA = [("input_layernorm", (H,), "RMSNorm"), ("self_attn", None, "Attention"),
       ("self_attn.q_a_proj", (QL, H), "Linear"), ("self_attn.q_a_layernorm", (QL,), "RMSNorm"),
       ("self_attn.q_b_proj", (HEADS * (NOPE + ROPE), QL), "Linear"),
       ("self_attn.kv_a_proj_with_mqa", (KVL + ROPE, H), "Linear"), ("self_attn.kv_a_layernorm", (KVL,), "RMSNorm"),
       ("self_attn.kv_b_proj", (HEADS * (NOPE + VH), KVL), "Linear"), ("self_attn.o_proj", (H, HEADS * VH), "Linear"),
       ("post_attention_layernorm", (H,), "RMSNorm"), ("mlp", None, "MoE"), ("mlp.gate", (4, H), "Router"),
       *[(f"mlp.experts.{e}.{n}", shape, "Linear") for e in range(4)
         for n, shape in (("gate_proj", (SFF, H)), ("up_proj", (SFF, H)), ("down_proj", (H, SFF)))],
       ("mlp.shared_experts.gate_proj", (SFF, H), "Linear"), ("mlp.shared_experts.up_proj", (SFF, H), "Linear"),
       ("mlp.shared_experts.down_proj", (H, SFF), "Linear")]


def test_multi_latent_attention_and_a_shared_expert_map_by_the_latent_sizes_the_config_gives():
    cfg = hf_cfg(model_type="deepseek_v3", q_lora_rank=QL, kv_lora_rank=KVL, qk_nope_head_dim=NOPE,
                 qk_rope_head_dim=ROPE, v_head_dim=VH, n_routed_experts=4, moe_intermediate_size=SFF,
                 n_shared_experts=1, num_key_value_heads=HEADS, head_dim=ROPE)
    d = derive(CFG_A, cfg, [], tree(MLA))
    assert d.rules is not None, d.note
    assert "multi-latent attention, 4 experts, a shared expert" in d.note
    got = {r.a.replace("\\g<i>", "{i}"): r.b.pattern for r in d.rules.rules}
    for mcore, hf in (("linear_q_down_proj", "q_a_proj"), ("linear_q_up_proj", "q_b_proj"),
                      ("linear_kv_down_proj", "kv_a_proj_with_mqa"), ("linear_kv_up_proj", "kv_b_proj"),
                      ("q_layernorm", "q_a_layernorm"), ("kv_layernorm", "kv_a_layernorm"), ("linear_proj", "o_proj")):
        assert got[f"decoder.layers.{{i}}.self_attention.{mcore}"].endswith(f"self_attn\\.{hf}"), mcore
    assert "decoder.layers.{i}.mlp.shared_experts.linear_fc2" in got


def test_a_weight_of_no_predicted_role_derives_nothing_and_says_which():
    odd = [*LLAMA, ("mlp.extra", (7, H), "Linear")]
    d = derive(CFG_A, hf_cfg(), [], tree(odd))
    assert d.rules is None and "mlp.extra: a [7, 64] weight of no role the configs predict" in d.note


def test_a_copy_with_its_first_two_dimensions_swapped_holds_the_same_values():
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    assert _equal(x, np.ascontiguousarray(x.transpose(1, 0, 2))) is True
    assert _equal(x, x.reshape(3, 2, 4)) is True  # a view: the same order
    assert _equal(x, np.ascontiguousarray(x.transpose(1, 0, 2))[::-1].copy()) is False


def test_experts_held_in_one_tensor_fan_out_to_megatron_s_per_expert_linears():
    """GPT-OSS: one module holds every expert as [experts, in, out] tensors, gate and up interleaved; the attention
    holds a per-head sinks parameter."""
    e, layer = 4, [(n, s, c) for n, s, c in LLAMA if not n.startswith("mlp")]
    layer.insert(1, ("self_attn", None, "Attention"))
    recs = tree(layer + [("mlp", None, "MLP"), ("mlp.router", (e, H), "Router")])
    extra = []
    for i in range(2):
        for slot, shape in (("gate_up_proj", (e, H, 2 * FFN)), ("gate_up_proj_bias", (e, 2 * FFN)),
                            ("down_proj", (e, FFN, H)), ("down_proj_bias", (e, H))):
            extra.append(Record(0, 900 + len(extra), "weights", f"model.layers.{i}.mlp.experts", 0, "param", slot,
                                "Experts", "float32", shape))
        extra.append(Record(0, 900 + len(extra), "weights", f"model.layers.{i}.self_attn", 0, "param", "sinks",
                            "Attention", "float32", (HEADS,)))
    d = derive(CFG_A, hf_cfg(model_type="gpt_oss", num_local_experts=e), [], recs + extra)
    assert d.rules is not None and "4 experts in one tensor, attention sinks" in d.note
    fan = next(r for r in d.rules.rules if r.experts)
    gate_up = Record(0, 0, "weights", "model.layers.1.mlp.experts", 0, "param", "gate_up_proj", "", "float32",
                     (e, H, 2 * FFN))
    targets = fan.fan_targets(gate_up, gate_up.module)
    assert [t[0][1] for t in targets] == [f"decoder.layers.1.mlp.experts.local_experts.{k}.linear_fc1" for k in range(e)]
    assert [str(o) for o in targets[2][1]] == ["select(index=2, dim=0)", "transpose", "deinterleave(dim=0)"]
    x = np.arange(e * 3 * 4, dtype=np.float64).reshape(e, 3, 4)  # [experts, in, out], out = g0 u0 g1 u1
    assert apply(targets[1][1], x).tolist() == [list(x[1][:, 0]), list(x[1][:, 2]), list(x[1][:, 1]), list(x[1][:, 3])]
    sinks = next(r for r in d.rules.rules if r.slots.get("sinks") == "softmax_offset")
    assert sinks.a.endswith("self_attention.core_attention")
