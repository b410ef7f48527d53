"""The decoder families of the megatron-core vs Hugging Face pairs: tiny HF configs and the faults that apply.

Every family is a ``transformers`` config class and its keyword arguments (tiny sizes); ``build.py`` derives the
megatron-core ``TransformerConfig`` from that config and converts the HF weights, as Megatron-Bridge does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: sizes shared by every family (GQA: 4 query heads, 2 key/value heads)
TINY: dict[str, Any] = dict(
    num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=128, vocab_size=128, max_position_embeddings=64, rope_theta=10000.0, attention_dropout=0.0,
    use_cache=False, tie_word_embeddings=False,
    pad_token_id=None,  # no padding_idx: its embedding row would get no gradient on the HF side only
)
MOE: dict[str, Any] = dict(num_experts_per_tok=2, router_aux_loss_coef=0.0, output_router_logits=False)

FAULTS: dict[str, str] = {
    "norm-offset": "mcore: the conversion forgot Gemma's +1, megatron norm weights are w instead of 1+w",
    "embed-scale": "mcore: no sqrt(hidden) scaling of the embedding output (Gemma's normalizer dropped)",
    "qkv-layout": "mcore: linear_qkv rows written as [all q | all k | all v] not per query group [q_g, k_g, v_g]",
    "rope-theta": "mcore: rotary base 1e6 instead of the config's rope_theta",
    "untied-output": "mcore: share_embeddings_and_output_weights=False, output_layer a copy of the embedding "
                     "(same logits at init, diverges after the first update)",
    "dropped-bias": "mcore: add_qkv_bias=False, the HF q/k/v biases dropped (StarCoder2, a bias on every linear: "
                    "add_bias_linear=False too, megatron-core giving linear_qkv a bias whenever add_bias_linear, "
                    "so every linear bias dropped)",
    "partial-rotary": "mcore: rotary_percent=0.5 while HF rotates the whole head",
    "router-softmax": "mcore: moe_router_pre_softmax flipped: the top-k probabilities renormalised where HF does not, "
                      "or not where it does (every token's MoE output scaled by its own factor)",
}
_DENSE = ("qkv-layout", "rope-theta", "partial-rotary")
_MOE_FAULTS = ("qkv-layout", "rope-theta", "router-softmax")


@dataclass(frozen=True)
class Family:
    name: str
    config_class: str
    """the ``transformers`` config class (its model: ``AutoModelForCausalLM.from_config``)."""
    config_kwargs: dict[str, Any] = field(default_factory=dict)
    faults: tuple[str, ...] = ()
    mcore_can_express: bool = True
    reason: str = ""
    """why megatron-core's GPTModel (local spec) cannot express the family, when it cannot."""

    @property
    def moe(self) -> bool:
        """A mixture-of-experts family (routed MLPs)."""
        return "num_experts_per_tok" in self.config_kwargs

    def hf_config(self, attn: str = "sdpa") -> Any:
        import transformers

        cfg = getattr(transformers, self.config_class)(**{**TINY, **self.config_kwargs})
        cfg._attn_implementation = attn
        return cfg


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", "LlamaConfig", {}, _DENSE),
    Family("llama-tied", "LlamaConfig", {"tie_word_embeddings": True}, (*_DENSE, "untied-output")),
    Family("mistral", "MistralConfig", {"sliding_window": None}, _DENSE),
    Family("qwen2", "Qwen2Config", {"use_sliding_window": False}, (*_DENSE, "dropped-bias")),
    Family("qwen3", "Qwen3Config", {"use_sliding_window": False}, _DENSE),
    Family("gemma", "GemmaConfig", {"hidden_act": "gelu_pytorch_tanh", "tie_word_embeddings": True},
           ("norm-offset", "embed-scale", *_DENSE, "untied-output")),
    Family("phi3", "Phi3Config", {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "sliding_window": None,
                                  "bos_token_id": 1, "eos_token_id": 2}, _DENSE),
    Family("starcoder2", "Starcoder2Config", {"hidden_act": "gelu_pytorch_tanh", "use_bias": True,
                                              "norm_epsilon": 1e-5, "sliding_window": None, "residual_dropout": 0.0,
                                              "embedding_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2},
           (*_DENSE, "dropped-bias")),
    Family("mixtral", "MixtralConfig", {**MOE, "num_local_experts": 4, "sliding_window": None}, _MOE_FAULTS),
    Family("qwen3_moe", "Qwen3MoeConfig", {**MOE, "num_experts": 4, "moe_intermediate_size": 128,
                                           "decoder_sparse_step": 1, "mlp_only_layers": [],
                                           "use_sliding_window": False}, _MOE_FAULTS),
    # GPT-OSS: attention sinks, biases on q/k/v/o, the router and the experts, a clamped GLU; plain RoPE here (its
    # YaRN not converted) and a sliding window as long as max_position_embeddings (the sliding layers see everything)
    Family("gpt_oss", "GptOssConfig", {**MOE, "num_local_experts": 4, "rope_scaling": None,
                                       "sliding_window": TINY["max_position_embeddings"]}, _MOE_FAULTS),
    # DeepSeek-V3: multi-latent attention (q and kv through low-rank projections with their norms, RoPE on a part of
    # each head), a dense first layer, then sigmoid routing with a score-correction bias and a shared expert
    Family("deepseek_v3", "DeepseekV3Config", {**MOE, "num_key_value_heads": 4, "head_dim": 8,  # its RoPE part
                                               "q_lora_rank": 32, "kv_lora_rank": 32,
                                               "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
                                               "n_routed_experts": 4, "n_shared_experts": 1,
                                               "moe_intermediate_size": 32, "first_k_dense_replace": 1,
                                               "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5,
                                               "norm_topk_prob": True, "rms_norm_eps": 1e-6, "rope_scaling": None},
           ("rope-theta",)),
    # Gemma 2 / 3: norms after attention and after the MLP too (four a layer), attention logit soft-capping (2):
    # megatron-core's layer has two norms and no soft-capping (Megatron-Bridge adds its own modules for them)
    Family("gemma2", "Gemma2Config", {"hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
                                      "query_pre_attn_scalar": 16}, (), mcore_can_express=False,
           reason="Gemma 2's norms after attention and after the MLP (four a layer) and its attention logit "
                  "soft-capping: megatron-core's layer has two norms and no soft-capping"),
    Family("gemma3", "Gemma3TextConfig", {"hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
                                          "query_pre_attn_scalar": 16, "rope_scaling": None}, (),
           mcore_can_express=False, reason="Gemma 3's norms after attention and after the MLP (four a layer): "
                                           "megatron-core's layer has two"),
    Family("olmoe", "OlmoeConfig", {**MOE, "num_experts": 4}, (), mcore_can_express=False,
           reason="OLMoE's q_norm/k_norm are RMSNorms over the whole q/k projection (all heads), megatron-core's "
                  "qk_layernorm normalises each head (kv_channels) separately"),
)}
