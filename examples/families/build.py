"""Build a megatron-core ``GPTModel`` from a Hugging Face model the way a user converts one (Megatron-Bridge style).

* ``build_hf``: the HF model of a family's tiny config, randomly initialised from a seed (norm weights, biases and
  GPT-OSS's attention sinks perturbed so that a wrong norm convention or a dropped bias shows);
* ``mcore_config``: megatron-core ``TransformerConfig`` and ``GPTModel`` keyword arguments derived from the HF config;
* ``hf_to_mcore``: HF state dict -> megatron-core names (q/k/v packed per query group, fc1 = [gate; up] or c_fc;
  biases, norm ones included, wherever HF has them);
* ``build_mcore``: the megatron-core model holding the converted weights (local layer spec, CPU), a fault applied to
  its conversion where asked (``table.FAULTS``);
* ``check_equivalent``: max |logits difference| of the two on one batch (optionally after AdamW steps).

    python -m examples.families.build            # every family: FP32 logits, 2 AdamW steps on llama, the faults
"""

from __future__ import annotations

import os
import sys
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.nn.functional as F
from torch import Tensor

from examples.families.table import FAMILIES, FAULTS, Family

BATCH, SEQ = 2, 16


def gelu_tanh(x: Tensor) -> Tensor:
    """HF's ``gelu_pytorch_tanh``."""
    return F.gelu(x, approximate="tanh")


def _family(family: Family | str) -> Family:
    return FAMILIES[family] if isinstance(family, str) else family


# --------------------------------------------------------------------------------------------------- Hugging Face
def hf_attn(family: Family | str, attn: str = "sdpa") -> str:
    """``attn``, or "eager" where the family's HF model has no SDPA attention (GPT-OSS: its attention sinks)."""
    from transformers import AutoModelForCausalLM

    cfg = _family(family).hf_config()
    supports_sdpa = AutoModelForCausalLM._model_mapping[type(cfg)]._supports_sdpa
    return "eager" if attn == "sdpa" and not supports_sdpa else attn


def build_hf(family: Family | str, dtype: str = "float32", attn: str = "sdpa", seed: int = 0) -> Any:
    """The family's HF causal LM, initialised by ``transformers`` from ``seed``; every norm weight then gets
    0.1 * randn added (neither all ones nor all zeros), every bias (GPT-OSS's fused ``*_proj_bias`` of the experts
    included) small random values and GPT-OSS's attention sinks randn (``transformers`` draws them with std 0.02).
    ``attn`` "sdpa" falls back to "eager" where the model has no SDPA attention (``hf_attn``)."""
    from transformers import AutoModelForCausalLM

    attn = hf_attn(family, attn)
    cfg = _family(family).hf_config(attn)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith((".bias", "_bias")):
                p.copy_(0.05 * torch.randn_like(p))
            elif name.endswith(".sinks"):
                p.copy_(torch.randn_like(p))
        if cfg.model_type == "deepseek_v3":  # a sigmoid router on std-0.02 weights barely depends on the token
            for name, p in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    p.mul_(15.0)
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):  # zeros by default: make it change the routing
                    b.copy_(0.05 * torch.randn_like(b))
    return model.to(getattr(torch, dtype))


# --------------------------------------------------------------------------------------------------- megatron config
def _moe(cfg: Any) -> bool:
    return cfg.model_type in ("mixtral", "qwen3_moe", "olmoe", "gpt_oss", "deepseek_v3")


#: GPT-OSS's expert activation, hard-coded in ``transformers``' ``GptOssExperts`` (not in the config):
#: gate.clamp(max=limit) * sigmoid(alpha * gate) * (up.clamp(-limit, limit) + 1); megatron-core's ``quick_gelu``
#: has alpha 1.702 built in
GPT_OSS_ALPHA, GPT_OSS_LIMIT = 1.702, 7.0


def _gated(cfg: Any) -> bool:
    """A gated MLP (act(gate) * up); StarCoder2's is c_fc -> act -> c_proj."""
    return cfg.model_type != "starcoder2"


def _norm(cfg: Any) -> tuple[str, float]:
    """(megatron normalization, epsilon): an ``rms_norm_eps`` means RMSNorm, a ``norm_epsilon`` LayerNorm."""
    if hasattr(cfg, "rms_norm_eps"):
        return "RMSNorm", cfg.rms_norm_eps
    return "LayerNorm", cfg.norm_epsilon


def mcore_config(cfg: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(``TransformerConfig`` kwargs, ``GPTModel`` kwargs) derived from the HF config only."""
    gpt_oss = cfg.model_type == "gpt_oss"
    act = {"silu": F.silu, "gelu_pytorch_tanh": gelu_tanh}[cfg.hidden_act]
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    normalization, eps = _norm(cfg)
    # StarCoder2: a bias on every linear; GPT-OSS: on q/k/v/o, the router and the experts' fc1/fc2
    bias = bool(getattr(cfg, "use_bias", False)) or gpt_oss
    tf: dict[str, Any] = dict(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_key_value_heads, kv_channels=head_dim,
        normalization=normalization, layernorm_epsilon=eps, gated_linear_unit=_gated(cfg), activation_func=act,
        add_bias_linear=bias,
        add_qkv_bias=bias or cfg.model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False)),
        qk_layernorm=cfg.model_type in ("qwen3", "qwen3_moe"), hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=cfg.initializer_range, use_cpu_initialization=True, params_dtype=torch.float32,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
    )
    if gpt_oss:
        if getattr(cfg, "rope_scaling", None):
            raise NotImplementedError("gpt_oss: only plain RoPE (rope_scaling=None) is converted, not YaRN")
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        # the experts' clamped GLU (quick_gelu's 1.702 is GPT_OSS_ALPHA), the attention sinks (a learnable
        # softmax offset per head, megatron's local DotProductAttention: SoftmaxOne); RoPE rotates halves
        # (rotary_interleaved=False, megatron's default)
        tf.update(activation_func=quick_gelu, glu_linear_offset=1.0, activation_func_clamp_value=GPT_OSS_LIMIT,
                  softmax_type="learnable")
        sliding = [t == "sliding_attention" for t in cfg.layer_types]
        if any(sliding) and cfg.sliding_window < cfg.max_position_embeddings:
            # HF: query i sees keys i - sliding_window < j <= i (exact; on a CPU-only torch it needs the
            # device="cuda" shim: megatron builds its sliding-window mask there)
            tf.update(window_size=(cfg.sliding_window - 1, 0), window_attn_skip_freq=[int(s) for s in sliding])
    if cfg.model_type == "deepseek_v3":
        tf.update(_deepseek_v3(cfg))
    elif _moe(cfg):
        experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
        # HF: softmax over all experts, top-k, renormalised (Mixtral; Qwen3-MoE with norm_topk_prob) == megatron's
        # top-k of the logits then softmax over the k (pre_softmax=False), GPT-OSS's router (top-k of the logits,
        # softmax over the k) too; without renormalisation: pre_softmax=True
        renorm = cfg.model_type in ("mixtral", "gpt_oss") or bool(getattr(cfg, "norm_topk_prob", False))
        tf.update(num_moe_experts=experts, moe_router_topk=cfg.num_experts_per_tok,
                  moe_ffn_hidden_size=getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size,
                  moe_router_pre_softmax=not renorm, moe_router_score_function="softmax",
                  moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.0,
                  moe_token_dispatcher_type="allgather", moe_grouped_gemm=False)
    gpt = dict(vocab_size=cfg.vocab_size, max_sequence_length=cfg.max_position_embeddings,
               position_embedding_type="rope", rotary_base=cfg.rope_theta,
               rotary_percent=float(getattr(cfg, "partial_rotary_factor", 1.0) or 1.0),
               share_embeddings_and_output_weights=bool(cfg.tie_word_embeddings))
    return tf, gpt


def _deepseek_v3(cfg: Any) -> dict[str, Any]:
    """DeepSeek-V3's multi-latent attention and MoE as megatron-core config fields (``MLATransformerConfig``)."""
    if cfg.rope_scaling is not None:
        raise NotImplementedError("deepseek_v3: only plain RoPE (rope_scaling=None) is converted, not YaRN")
    if not cfg.norm_topk_prob:
        raise NotImplementedError("deepseek_v3: megatron-core's sigmoid router renormalises the top k: "
                                  "norm_topk_prob must be True")
    dense = cfg.first_k_dense_replace
    return dict(
        num_query_groups=cfg.num_attention_heads, kv_channels=cfg.v_head_dim,
        multi_latent_attention=True, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
        qk_head_dim=cfg.qk_nope_head_dim, qk_pos_emb_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
        # MLA's RoPE takes x[0::2], x[1::2] and rotates halves: HF's rope_interleave=True (the default) as is
        rope_type="rope", rotary_base=cfg.rope_theta, rotary_percent=1.0, rotary_interleaved=False,
        qk_layernorm=True,  # megatron-core's local spec builds MLA's q_layernorm / kv_layernorm only with it
        num_moe_experts=cfg.n_routed_experts, moe_router_topk=cfg.num_experts_per_tok,
        moe_ffn_hidden_size=cfg.moe_intermediate_size,
        moe_shared_expert_intermediate_size=cfg.moe_intermediate_size * cfg.n_shared_experts,
        moe_layer_freq=[0] * dense + [1] * (cfg.num_hidden_layers - dense),
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=cfg.routed_scaling_factor, moe_router_pre_softmax=False,
        moe_router_num_groups=cfg.n_group, moe_router_group_topk=cfg.topk_group,
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="allgather", moe_grouped_gemm=False)


# --------------------------------------------------------------------------------------------------- weights
def _pack_qkv(q: Tensor, k: Tensor, v: Tensor, groups: int, head_dim: int, per_group: bool = True) -> Tensor:
    """[all q], [all k], [all v] rows -> megatron's rows per query group [q heads of g, k_g, v_g]."""
    if not per_group:  # the qkv-layout fault: [all q | all k | all v]
        return torch.cat([q, k, v])
    rest = q.shape[1:]
    q, k, v = (t.reshape(groups, -1, *rest) for t in (q, k, v))
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest).contiguous()


def hf_to_mcore(hf: dict[str, Tensor], cfg: Any, fault: str = "") -> dict[str, Tensor]:
    """HF state dict -> megatron-core ``GPTModel`` state dict (``fault``: a conversion mistake of ``table.FAULTS``)."""
    if cfg.model_type == "deepseek_v3":
        return _deepseek_v3_to_mcore(hf, cfg, fault)
    gemma = cfg.model_type == "gemma"
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    nq, nkv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim

    def norm(w: Tensor) -> Tensor:  # Gemma's HF norm computes x * (1 + w); megatron's torch RMSNorm x * w
        return w + 1.0 if gemma and fault != "norm-offset" else w

    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"]}

    def put(mc: str, name: str, weight: Any = lambda w: w) -> None:
        """megatron ``mc.weight`` (through ``weight``) and ``mc.bias`` from HF ``name``, its bias where there is one
        (the dropped-bias fault drops every linear bias, megatron-core giving linear_qkv one with add_bias_linear)."""
        out[mc + ".weight"] = weight(hf[name + ".weight"])
        if name + ".bias" in hf and not (fault == "dropped-bias" and "norm" not in mc):
            out[mc + ".bias"] = hf[name + ".bias"]

    put("decoder.final_layernorm", "model.norm", norm)
    if not cfg.tie_word_embeddings:
        out["output_layer.weight"] = hf["lm_head.weight"]
    elif fault == "untied-output":
        out["output_layer.weight"] = hf["model.embed_tokens.weight"].clone()
    for i in range(cfg.num_hidden_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        put(m + "input_layernorm", h + "input_layernorm", norm)
        put(m + "pre_mlp_layernorm", h + "post_attention_layernorm", norm)
        for suffix in ("weight", "bias"):
            if h + f"self_attn.qkv_proj.{suffix}" in hf:  # Phi-3: fused [Q | K | V]
                q, k, v = hf[h + f"self_attn.qkv_proj.{suffix}"].split([nq, nkv, nkv])
            elif h + f"self_attn.q_proj.{suffix}" in hf:
                q, k, v = (hf[h + f"self_attn.{n}_proj.{suffix}"] for n in "qkv")
            else:
                continue
            if suffix == "bias" and fault == "dropped-bias":
                continue
            out[m + f"self_attention.linear_qkv.{suffix}"] = _pack_qkv(
                q, k, v, cfg.num_key_value_heads, head_dim, per_group=fault != "qkv-layout")
        put(m + "self_attention.linear_proj", h + "self_attn.o_proj")
        if h + "self_attn.q_norm.weight" in hf:
            out[m + "self_attention.q_layernorm.weight"] = hf[h + "self_attn.q_norm.weight"]
            out[m + "self_attention.k_layernorm.weight"] = hf[h + "self_attn.k_norm.weight"]
        if h + "self_attn.sinks" in hf:  # GPT-OSS's attention sinks: megatron's learnable softmax offset
            out[m + "self_attention.core_attention.softmax_offset"] = hf[h + "self_attn.sinks"]
        if cfg.model_type == "gpt_oss":
            # router: a linear with a bias; experts fused [E, in, out] (x @ W), gate/up interleaved along the last
            # dim (gate = [..., ::2], up = [..., 1::2]) -> per expert fc1 [gate; up] rows [2F, H], fc2 [H, F]
            put(m + "mlp.router", h + "mlp.router")
            gate_up, gate_up_bias = hf[h + "mlp.experts.gate_up_proj"], hf[h + "mlp.experts.gate_up_proj_bias"]
            down, down_bias = hf[h + "mlp.experts.down_proj"], hf[h + "mlp.experts.down_proj_bias"]
            for e in range(gate_up.shape[0]):
                fc1, fc2 = m + f"mlp.experts.local_experts.{e}.linear_fc1", m + f"mlp.experts.local_experts.{e}.linear_fc2"
                out[fc1 + ".weight"] = torch.cat([gate_up[e][:, ::2].T, gate_up[e][:, 1::2].T])
                out[fc1 + ".bias"] = torch.cat([gate_up_bias[e][::2], gate_up_bias[e][1::2]])
                out[fc2 + ".weight"] = down[e].T
                out[fc2 + ".bias"] = down_bias[e]
        elif _moe(cfg):
            moe = h + ("block_sparse_moe." if cfg.model_type == "mixtral" else "mlp.")
            out[m + "mlp.router.weight"] = hf[moe + "gate.weight"]
            names = ("w1", "w3", "w2") if cfg.model_type == "mixtral" else ("gate_proj", "up_proj", "down_proj")
            for e in range(out[m + "mlp.router.weight"].shape[0]):
                gate, up, down = (hf[moe + f"experts.{e}.{n}.weight"] for n in names)
                out[m + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = torch.cat([gate, up])
                out[m + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = down
        else:
            if h + "mlp.c_fc.weight" in hf:  # StarCoder2: not gated, c_fc -> act -> c_proj
                put(m + "mlp.linear_fc1", h + "mlp.c_fc")
            elif h + "mlp.gate_up_proj.weight" in hf:  # Phi-3: fused [gate | up], megatron's layout already
                put(m + "mlp.linear_fc1", h + "mlp.gate_up_proj")
            else:
                out[m + "mlp.linear_fc1.weight"] = torch.cat([hf[h + "mlp.gate_proj.weight"],
                                                              hf[h + "mlp.up_proj.weight"]])
            put(m + "mlp.linear_fc2", h + ("mlp.c_proj" if h + "mlp.c_proj.weight" in hf else "mlp.down_proj"))
    return {k: v.detach().clone().float().contiguous() for k, v in out.items()}


def _deepseek_v3_to_mcore(hf: dict[str, Tensor], cfg: Any, fault: str = "") -> dict[str, Tensor]:
    """DeepSeek-V3: q_a/q_b (or q_proj), kv_a_proj_with_mqa, kv_b_proj and their norms to MLA's down/up projections
    (rows per head [nope | rope] on both sides; with HF's rope_interleave=False the rope rows are reordered for
    MLA's x[0::2], x[1::2]); the first ``first_k_dense_replace`` layers dense; routers with their score-correction
    bias (megatron's expert_bias), routed and shared experts fc1 = [gate; up]."""
    heads, nope, rope = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    rows = torch.arange(rope) if cfg.rope_interleave else \
        torch.stack([torch.arange(rope // 2), torch.arange(rope // 2) + rope // 2], dim=1).reshape(-1)
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["output_layer.weight"] = hf["lm_head.weight"]

    def glu(mc: str, h: str) -> None:
        out[mc + "linear_fc1.weight"] = torch.cat([hf[h + "gate_proj.weight"], hf[h + "up_proj.weight"]])
        out[mc + "linear_fc2.weight"] = hf[h + "down_proj.weight"]

    for i in range(cfg.num_hidden_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        a, sa = h + "self_attn.", m + "self_attention."
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
        lora = cfg.q_lora_rank is not None
        q = hf[a + ("q_b_proj.weight" if lora else "q_proj.weight")].reshape(heads, nope + rope, -1)
        q = torch.cat([q[:, :nope], q[:, nope:][:, rows]], dim=1).reshape(heads * (nope + rope), -1)
        out[sa + ("linear_q_up_proj.weight" if lora else "linear_q_proj.weight")] = q
        if lora:
            out[sa + "linear_q_down_proj.weight"] = hf[a + "q_a_proj.weight"]
            out[sa + "q_layernorm.weight"] = hf[a + "q_a_layernorm.weight"]
        kv = hf[a + "kv_a_proj_with_mqa.weight"]  # [kv_lora_rank | rope] rows
        r = cfg.kv_lora_rank
        out[sa + "linear_kv_down_proj.weight"] = torch.cat([kv[:r], kv[r:][rows]])
        out[sa + "kv_layernorm.weight"] = hf[a + "kv_a_layernorm.weight"]
        out[sa + "linear_kv_up_proj.weight"] = hf[a + "kv_b_proj.weight"]  # rows per head [k_nope | v] on both
        out[sa + "linear_proj.weight"] = hf[a + "o_proj.weight"]
        if i < cfg.first_k_dense_replace:
            glu(m + "mlp.", h + "mlp.")
            continue
        out[m + "mlp.router.weight"] = hf[h + "mlp.gate.weight"]
        out[m + "mlp.router.expert_bias"] = hf[h + "mlp.gate.e_score_correction_bias"]
        for e in range(cfg.n_routed_experts):
            glu(m + f"mlp.experts.local_experts.{e}.", h + f"mlp.experts.{e}.")
        glu(m + "mlp.shared_experts.", h + "mlp.shared_experts.")
    return {k: v.detach().clone().float().contiguous() for k, v in out.items()}


# --------------------------------------------------------------------------------------------------- megatron-core
def _mla_core_attention_class() -> type:
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.utils import divide

    class MLADotProductAttention(DotProductAttention):
        """megatron-core 0.16.1's local ``DotProductAttention`` taking the ``k_channels`` / ``v_channels`` MLA passes
        (its local spec builds it without them: "unexpected keyword argument 'k_channels'"): q and k have
        k_channels per head, v v_channels, the context [s, b, heads * v_channels]; MLA gives its own softmax scale."""

        def __init__(self, *args: Any, k_channels: int | None = None, v_channels: int | None = None,
                     **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if v_channels is not None:
                self.hidden_size_per_partition = divide(v_channels * self.config.num_attention_heads,
                                                        self.tp_group.size())
            if k_channels is not None:
                self.hidden_size_per_attention_head = k_channels

    return MLADotProductAttention


def _build_mla(config: Any, gpt: dict[str, Any]) -> Any:
    """megatron-core's ``GPTModel`` with multi-latent attention on the local spec, dense layers where
    ``moe_layer_freq`` says (the decoder block spec), two workarounds of megatron-core 0.16.1 without Transformer
    Engine: the core attention above, and ``multi_latent_attention.HAVE_TE`` False while the model is built (its
    import of ``TELinear`` succeeds against the stand-in ``MagicMock`` that ``extensions.transformer_engine`` binds,
    and MLA's ``isinstance(self.linear_proj, TELinear)`` then raises "isinstance() arg 2 must be a type")."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer import multi_latent_attention as mla

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    core = _mla_core_attention_class()
    for layer_spec in spec.layer_specs:
        layer_spec.submodules.self_attention.submodules.core_attention = core
    had_te, mla.HAVE_TE = mla.HAVE_TE, False
    try:
        return GPTModel(config=config, transformer_layer_spec=spec, **gpt)
    finally:
        mla.HAVE_TE = had_te


def _scaled_embedding_class() -> type:
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding

    class ScaledEmbedding(LanguageModelEmbedding):
        """Gemma's embedding: the output × sqrt(hidden), the normalizer in the output's dtype (as HF Gemma)."""

        def forward(self, *args: Any, **kwargs: Any) -> Tensor:
            emb = super().forward(*args, **kwargs)
            return emb * torch.tensor(self.config.hidden_size ** 0.5, dtype=emb.dtype)

    return ScaledEmbedding


def build_mcore(family: Family | str, dtype: str = "float32", hf_state: dict[str, Tensor] | None = None,
                fault: str = "", seed: int = 0) -> Any:
    """megatron-core ``GPTModel`` of the family (local spec) holding ``hf_state`` converted (strict load);
    ``fault`` (``table.FAULTS``) is a mistake in that conversion."""
    from tensordiff.compat.megatron_cpu import init_megatron_cpu

    init_megatron_cpu(seed)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    fam = _family(family)
    if not fam.mcore_can_express:
        raise NotImplementedError(f"{fam.name}: {fam.reason}")
    if fault and fault not in fam.faults:
        raise ValueError(f"fault {fault!r} does not apply to {fam.name} (its faults: {fam.faults})")
    cfg = fam.hf_config()
    if hf_state is None:
        hf_state = build_hf(fam, seed=seed).state_dict()
    tf, gpt = mcore_config(cfg)
    if fault == "dropped-bias":  # megatron-core gives linear_qkv a bias whenever add_bias_linear: both off
        tf["add_qkv_bias"] = tf["add_bias_linear"] = False
    elif fault == "rope-theta":
        gpt["rotary_base"] = 1e6
        if tf.get("multi_latent_attention"):
            tf["rotary_base"] = 1e6  # multi-latent attention builds its own rotary embedding from the config
    elif fault == "partial-rotary":
        gpt["rotary_percent"] = 0.5
    elif fault == "untied-output":
        gpt["share_embeddings_and_output_weights"] = False
    elif fault == "router-softmax":
        tf["moe_router_pre_softmax"] = not tf["moe_router_pre_softmax"]
    if tf.get("multi_latent_attention"):
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        model = _build_mla(MLATransformerConfig(**tf), gpt)
    else:
        config = TransformerConfig(**tf)
        spec = get_gpt_layer_local_spec(num_experts=tf.get("num_moe_experts"), moe_grouped_gemm=False,
                                        qk_layernorm=tf["qk_layernorm"], normalization=tf["normalization"])
        model = GPTModel(config=config, transformer_layer_spec=spec, **gpt)
    if cfg.model_type == "gemma" and fault != "embed-scale":
        model.embedding.__class__ = _scaled_embedding_class()  # Megatron-Bridge extends the instance likewise
    if tf.get("num_moe_experts") and tf["add_bias_linear"]:  # GPT-OSS: experts with biases, trainable (see there)
        fc2_class = _expert_fc2_class()
        for name, module in model.named_modules():
            if name.endswith("linear_fc2") and ".local_experts." in name:
                module.__class__ = fc2_class
    state = hf_to_mcore(hf_state, cfg, fault)
    own = {k for k in model.state_dict() if not k.endswith("_extra_state")}
    if own != set(state):
        raise KeyError(f"{fam.name}: missing {sorted(own - set(state))}, unexpected {sorted(set(state) - own)}")
    model.load_state_dict(state, strict=False)  # strict over every key but the _extra_state ones (checked above)
    if dtype == "bfloat16":  # Megatron-LM's BF16: the model wrapped, its parameters cast, its outputs in FP32
        model.config.bf16 = True
        model = Float16Module(model.config, model)
    return model


def _expert_fc2_class() -> type:
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    class ExpertRowParallelLinear(RowParallelLinear):
        """An expert's ``linear_fc2`` whose output is a fresh tensor (a copy, the same values). megatron-core 0.16.1's
        ``MLP.forward`` adds an expert's fc2 bias in place (``output += output_bias * per_token_scale``) to the
        output of ``RowParallelLinear``, which at tensor and expert parallel size 1 is the input of
        ``_ReduceFromModelParallelRegion`` returned as is: a custom Function's view, so the in-place add raises under
        autograd ("Output 0 of _ReduceFromModelParallelRegion is a view and is being modified inplace")."""

        def forward(self, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
            output, bias = super().forward(*args, **kwargs)
            return (output.clone() if bias is not None and torch.is_grad_enabled() else output), bias

    return ExpertRowParallelLinear


# --------------------------------------------------------------------------------------------------- checks
def batch(vocab: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Fixed random tokens [B, S] and their next-token labels (drawn on the CPU from one generator)."""
    ids = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def mcore_forward(model: Any, tokens: Tensor, labels: Tensor | None = None) -> Tensor:
    """Logits [B, S, V] (labels None) or the per-token loss [B, S]."""
    b, s = tokens.shape
    positions = torch.arange(s).unsqueeze(0).expand(b, s)
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)[None, None]  # True = masked
    return model(input_ids=tokens, position_ids=positions, attention_mask=causal, labels=labels)


def hf_loss(model: Any, tokens: Tensor, labels: Tensor) -> Tensor:
    logits = model(input_ids=tokens).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def check_equivalent(family: Family | str, dtype: str = "float32", steps: int = 0, fault: str = "",
                     attn: str = "sdpa") -> float:
    """Max |logits(mcore) - logits(HF)| on one batch, both built from one HF init, after ``steps`` AdamW steps
    (lr 1e-3, no weight decay) on both sides."""
    fam = _family(family)
    hf = build_hf(fam, dtype, attn)
    mc = build_mcore(fam, dtype, hf.state_dict(), fault)
    tokens, labels = batch(fam.hf_config().vocab_size)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.0) for m in (hf, mc)]
    for _ in range(steps):
        for opt in opts:
            opt.zero_grad()
        hf_loss(hf, tokens, labels).backward()
        mcore_forward(mc, tokens, labels).float().mean().backward()
        for opt in opts:
            opt.step()
    with torch.no_grad():
        a, b = mcore_forward(mc.eval(), tokens).float(), hf.eval()(input_ids=tokens).logits.float()
    return float((a - b).abs().max())


def main() -> None:
    torch.set_num_threads(1)
    for name, fam in FAMILIES.items():
        if not fam.mcore_can_express:
            print(f"{name:12s} not expressible: {fam.reason}")
            continue
        line = f"{name:12s} fp32 {check_equivalent(fam):.2e}  eager {check_equivalent(fam, attn='eager'):.2e}"
        line += f"  bf16 {check_equivalent(fam, 'bfloat16'):.2e}  2 AdamW {check_equivalent(fam, steps=2):.2e}"
        print(line, flush=True)
        for fault in fam.faults:
            steps = 1 if fault == "untied-output" else 0
            print(f"{'':14s}{fault:15s} {check_equivalent(fam, fault=fault, steps=steps):.2e}"
                  + (" (after 1 AdamW step)" if steps else ""), flush=True)
    assert set(FAULTS) >= {f for fam in FAMILIES.values() for f in fam.faults}


if __name__ == "__main__":
    main()
