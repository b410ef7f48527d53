"""The built-in mapping and its variables are picked from what two captures say about themselves."""

from __future__ import annotations

import json

from tensordiff.diff.autoselect import pick_mapping
from tensordiff.record import Record

MCORE = {"framework": "torch", "megatron_core_version": "0.16.1", "model_class": "GPTModel",
         "model_config": json.dumps({"num_attention_heads": 4, "num_query_groups": 2})}


def rec(module: str, module_class: str = "") -> Record:
    return Record(step=0, seq=0, phase="forward", module=module, call=0, kind="output", slot="0",
                  module_class=module_class, dtype="float32", shape=(2,))


A_RECS = [rec("decoder.layers.0.mlp", "MLP"), rec("decoder.layers.0.mlp.linear_fc1", "ColumnParallelLinear")]


def test_mindformers_parallel_core_with_interleaved_fc1_and_gqa():
    b = {"framework": "mindspore", "model_class": "TrainingQwen3ForCausalLM", "mindformers_version": "1.9.0"}
    rules, note = pick_mapping(MCORE, b, A_RECS, [rec("model.decoder.layers.0.mlp", "MLPInterleaved")])
    assert rules is not None and rules.path.endswith("mcore-mindformers.yaml")
    assert note.startswith("mcore-mindformers (fc1_layout=interleaved, kv_repeat=2), picked from the captures: "
                           "B is MindFormers' parallel_core TrainingQwen3ForCausalLM; its MLP is MLPInterleaved; "
                           "4 heads in 2 query groups")


def test_mindformers_with_stacked_fc1_gets_the_identity_layout():
    b = {"framework": "mindspore", "model_class": "GPTModel"}
    a = dict(MCORE, model_config=json.dumps({"num_attention_heads": 4, "num_query_groups": 4}))
    _, note = pick_mapping(a, b, A_RECS, [rec("decoder.layers.0.mlp", "MLP")])
    assert note.startswith("mcore-mindformers (fc1_layout=stacked, kv_repeat=1)")


def test_legacy_llama_and_hf_gpt2():
    _, note = pick_mapping(MCORE, {"framework": "mindspore", "model_class": "LlamaForCausalLM"}, A_RECS,
                           [rec("model.layers.0.feed_forward")])
    assert note.startswith("mcore-mindformers-llama (heads=4, groups=2), picked from the captures")
    _, note = pick_mapping(MCORE, {"framework": "torch", "model_class": "GPT2LMHeadModel",
                                   "transformers_version": "4.57.1"}, A_RECS, [rec("transformer.h.0.mlp")])
    assert note.startswith("mcore-hf-gpt2 (heads=4), picked from the captures")


def weights(module: str) -> Record:
    return Record(step=0, seq=0, phase="weights", module=module, call=0, kind="param", slot="weight",
                  module_class="Linear", dtype="float32", shape=(2, 2))


def test_a_hugging_face_llama_layout_is_recognised_by_its_modules_whatever_the_class():
    b_recs = [weights(f"model.layers.0.{m}") for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                       "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    rules, note = pick_mapping(MCORE, {"framework": "torch", "model_class": "Qwen2ForCausalLM"}, A_RECS, b_recs)
    assert rules is not None and rules.path.endswith("mcore-hf-llama.yaml")
    assert note.startswith("mcore-hf-llama (heads=4, groups=2), picked from the captures: B is Hugging Face "
                           "Qwen2ForCausalLM")
    # q_proj without a gated MLP (OPT, say) is not the Llama layout
    rules, note = pick_mapping(MCORE, {"framework": "torch", "model_class": "OPTForCausalLM"}, A_RECS, b_recs[:3])
    assert rules is None and note.startswith("none: no built-in mapping fits")


def test_same_code_needs_no_mapping_and_unknown_pairs_say_so():
    assert pick_mapping(MCORE, dict(MCORE), A_RECS, A_RECS) == (None, "")
    rules, note = pick_mapping(MCORE, {"framework": "torch", "model_class": "MyGPT"}, A_RECS, [rec("blocks.0")])
    assert rules is None
    assert note == ("none: no built-in mapping fits A = torch GPTModel, B = torch MyGPT; names are lined up as they "
                    "are (--mapping FILE gives one; `tensordiff map A B -o FILE` proposes one)")
    rules, note = pick_mapping({"framework": "mindspore", "model_class": "GPTModel"}, MCORE, A_RECS, A_RECS)
    assert rules is None and note.startswith("none: no built-in mapping fits A = mindspore GPTModel, B = torch")
    assert pick_mapping({"framework": "torch", "model_class": "Net"}, {"framework": "torch", "model_class": "Net2"},
                        A_RECS, A_RECS) == (None, "")
