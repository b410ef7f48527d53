"""The models of the agreement matrix, built the way their users build them, from one shared set of weights.

One ``Arch`` (sizes and architecture choices) is shared by both sides of a pair; each side picks a family and a
``Style`` (how its code is written: attention kernel, mask passed in or built inside, dropout modules, call style).
Weights always start as megatron-core names (``mcore_state``); each family converts them to its own names:

* ``mcore``: megatron-core ``GPTModel``, local layer spec (FP32, CPU, explicit bool causal mask);
* ``hf-llama``, ``hf-mistral``, ``hf-qwen2``, ``hf-qwen3``, ``hf-gpt2``: transformers' models from a tiny random config;
* ``plain``: a GPT written in plain PyTorch the way people write one (nanoGPT's layout: ``nn.GELU``, ``nn.Dropout``,
  SDPA or manual attention, ``c_attn`` packing all q, then all k, then all v).

Faults are applied after the weights are loaded: ``apply_fault``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

FAMILIES = ("mcore", "hf-llama", "hf-mistral", "hf-qwen2", "hf-qwen3", "hf-gpt2", "plain")


@dataclass(frozen=True)
class Arch:
    """What both sides of a pair compute (sizes and architecture)."""

    layers: int = 2
    hidden: int = 64
    ffn: int = 128
    heads: int = 4
    groups: int = 4
    """key/value heads (= heads: MHA; 1: MQA)."""
    vocab: int = 128
    seq: int = 16
    batch: int = 2
    norm: str = "RMSNorm"
    """'RMSNorm' or 'LayerNorm'."""
    act: str = "swiglu"
    """'swiglu' or 'gelu'."""
    pos: str = "rope"
    """'rope' or 'learned' (absolute position embeddings)."""
    bias: str = "none"
    """'none', 'all' (every linear) or 'qkv' (the q/k/v projections only)."""
    tied: bool = False
    qk_norm: bool = False
    eps: float = 1e-5
    rope_base: float = 10000.0
    init_std: float = 0.05
    dtype: str = "float32"
    """the compute dtype both sides train in: 'float32' or 'bfloat16' (megatron-core wrapped in its
    ``Float16Module``, the others cast with ``.to(torch.bfloat16)``, as their users do)."""

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass(frozen=True)
class Style:
    """How one side's code is written (changes no number)."""

    attn: str = "sdpa"
    """'sdpa' or 'eager' (manual attention; HF eager returns the attention probabilities as a second output)."""
    mask: str = "none"
    """'passed' (a mask handed to the model) or 'none' (the model builds its causal mask itself)."""
    call: str = "kw"
    """'kw' (keyword arguments) or 'pos' (positional)."""
    dropout_modules: bool = False
    """dropout modules at p=0 in every block (the plain family)."""
    fc1: str = "stacked"
    """megatron fc1 rows: 'stacked' [gate; up] (the plain family with SwiGLU: 'interleaved' keeps them interleaved)."""
    loss: str = "outside"
    """'outside' (cross-entropy of the logits in the script) or 'labels' (labels passed to the model)."""


@dataclass(frozen=True)
class Side:
    family: str
    style: Style = field(default_factory=Style)
    fault: str = ""

    def as_dict(self) -> dict:
        return {"family": self.family, "style": asdict(self.style), "fault": self.fault}


# --------------------------------------------------------------------------------------------------- megatron-core
def build_mcore(arch: Arch, seed: int = 1234) -> Any:
    from tensordiff.compat.megatron_cpu import init_megatron_cpu

    init_megatron_cpu(seed)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=arch.layers, hidden_size=arch.hidden, ffn_hidden_size=arch.ffn, num_attention_heads=arch.heads,
        num_query_groups=arch.groups, kv_channels=arch.head_dim, use_cpu_initialization=True, hidden_dropout=0.0,
        attention_dropout=0.0, params_dtype=torch.float32, init_method_std=arch.init_std, normalization=arch.norm,
        layernorm_epsilon=arch.eps, add_bias_linear=arch.bias == "all", add_qkv_bias=arch.bias == "qkv",
        gated_linear_unit=arch.act == "swiglu", activation_func=F.silu if arch.act == "swiglu" else F.gelu,
        bias_activation_fusion=False, qk_layernorm=arch.qk_norm,
    )
    torch.manual_seed(seed)
    spec = get_gpt_layer_local_spec(normalization=arch.norm, qk_layernorm=arch.qk_norm)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=arch.vocab, max_sequence_length=arch.seq,
                    share_embeddings_and_output_weights=arch.tied,
                    position_embedding_type="rope" if arch.pos == "rope" else "learned_absolute",
                    rotary_base=int(arch.rope_base))


def mcore_state(model: Any) -> dict[str, Tensor]:
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()
            if isinstance(v, Tensor) and not k.endswith("_extra_state")}


def _qkv_parts(t: Tensor, arch: Arch) -> tuple[Tensor, Tensor, Tensor]:
    """megatron's rows per query group [q of the group, k, v] -> (all q, all k, all v) rows."""
    nq, hd = arch.heads // arch.groups, arch.head_dim
    g = t.reshape(arch.groups, (nq + 2) * hd, *t.shape[1:])
    q, k, v = g.split([nq * hd, hd, hd], dim=1)
    return q.reshape(-1, *t.shape[1:]), k.reshape(-1, *t.shape[1:]), v.reshape(-1, *t.shape[1:])


# --------------------------------------------------------------------------------------------------- Hugging Face
def _hf_config(family: str, arch: Arch, style: Style) -> Any:
    import transformers

    common = dict(vocab_size=arch.vocab, hidden_size=arch.hidden, intermediate_size=arch.ffn,
                  num_hidden_layers=arch.layers, num_attention_heads=arch.heads, num_key_value_heads=arch.groups,
                  max_position_embeddings=arch.seq, rms_norm_eps=arch.eps, rope_theta=arch.rope_base,
                  tie_word_embeddings=arch.tied, attention_dropout=0.0, hidden_act="silu", use_cache=False)
    if family == "hf-llama":
        cfg = transformers.LlamaConfig(**common, attention_bias=arch.bias == "all", mlp_bias=arch.bias == "all",
                                       head_dim=arch.head_dim)
    elif family == "hf-mistral":
        cfg = transformers.MistralConfig(**common, sliding_window=None, head_dim=arch.head_dim)
    elif family == "hf-qwen2":
        cfg = transformers.Qwen2Config(**common, use_sliding_window=False)
    elif family == "hf-qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=arch.head_dim, attention_bias=False,
                                       use_sliding_window=False)
    else:
        raise ValueError(family)
    cfg._attn_implementation = style.attn
    return cfg


def hf_llama_state(sd: dict[str, Tensor], arch: Arch) -> dict[str, Tensor]:
    """megatron-core names -> Llama-family names (q/k/v split per group, fc1 [gate; up] split)."""
    out = {"model.embed_tokens.weight": sd["embedding.word_embeddings.weight"],
           "model.norm.weight": sd["decoder.final_layernorm.weight"]}
    out["lm_head.weight"] = sd.get("output_layer.weight", sd["embedding.word_embeddings.weight"])
    for i in range(arch.layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[h + "input_layernorm.weight"] = sd[m + "input_layernorm.weight"]
        out[h + "post_attention_layernorm.weight"] = sd[m + "pre_mlp_layernorm.weight"]
        for suffix in ("weight", "bias"):
            key = m + "self_attention.linear_qkv." + suffix
            if key in sd:
                for name, part in zip(("q_proj", "k_proj", "v_proj"), _qkv_parts(sd[key], arch)):
                    out[h + f"self_attn.{name}.{suffix}"] = part.contiguous()
            for mname, hname in (("self_attention.linear_proj", "self_attn.o_proj"), ("mlp.linear_fc2", "mlp.down_proj")):
                if m + f"{mname}.{suffix}" in sd:
                    out[h + f"{hname}.{suffix}"] = sd[m + f"{mname}.{suffix}"]
            if m + f"mlp.linear_fc1.{suffix}" in sd:
                gate, up = sd[m + f"mlp.linear_fc1.{suffix}"].chunk(2, dim=0)
                out[h + f"mlp.gate_proj.{suffix}"], out[h + f"mlp.up_proj.{suffix}"] = gate.contiguous(), up.contiguous()
        if arch.qk_norm:
            out[h + "self_attn.q_norm.weight"] = sd[m + "self_attention.q_layernorm.weight"]
            out[h + "self_attn.k_norm.weight"] = sd[m + "self_attention.k_layernorm.weight"]
    return out


def hf_gpt2_state(sd: dict[str, Tensor], arch: Arch) -> dict[str, Tensor]:
    """megatron-core names -> GPT2LMHeadModel names (Conv1D weights [in, out]; c_attn [all q | all k | all v])."""
    out = {"transformer.wte.weight": sd["embedding.word_embeddings.weight"],
           "transformer.wpe.weight": sd["embedding.position_embeddings.weight"],
           "transformer.ln_f.weight": sd["decoder.final_layernorm.weight"],
           "transformer.ln_f.bias": sd["decoder.final_layernorm.bias"]}
    out["lm_head.weight"] = sd.get("output_layer.weight", out["transformer.wte.weight"])
    for i in range(arch.layers):
        m, h = f"decoder.layers.{i}.", f"transformer.h.{i}."
        for mn, hn in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
            out[h + hn + ".weight"], out[h + hn + ".bias"] = sd[m + mn + ".weight"], sd[m + mn + ".bias"]
        out[h + "attn.c_attn.weight"] = torch.cat(_qkv_parts(sd[m + "self_attention.linear_qkv.weight"], arch)).t().contiguous()
        out[h + "attn.c_attn.bias"] = torch.cat(_qkv_parts(sd[m + "self_attention.linear_qkv.bias"], arch))
        for mn, hn in (("self_attention.linear_proj", "attn.c_proj"), ("mlp.linear_fc1", "mlp.c_fc"),
                       ("mlp.linear_fc2", "mlp.c_proj")):
            out[h + hn + ".weight"] = sd[m + mn + ".weight"].t().contiguous()
            out[h + hn + ".bias"] = sd[m + mn + ".bias"]
    return out


def build_hf(family: str, arch: Arch, style: Style, sd: dict[str, Tensor]) -> Any:
    import transformers

    if family == "hf-gpt2":
        cfg = transformers.GPT2Config(vocab_size=arch.vocab, n_positions=arch.seq, n_embd=arch.hidden,
                                      n_layer=arch.layers, n_head=arch.heads, n_inner=arch.ffn,
                                      layer_norm_epsilon=arch.eps, activation_function="gelu", resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, tie_word_embeddings=arch.tied)
        cfg._attn_implementation = style.attn
        model = transformers.GPT2LMHeadModel(cfg)
        model.load_state_dict(hf_gpt2_state(sd, arch), strict=True)
        return model
    cls = {"hf-llama": transformers.LlamaForCausalLM, "hf-mistral": transformers.MistralForCausalLM,
           "hf-qwen2": transformers.Qwen2ForCausalLM, "hf-qwen3": transformers.Qwen3ForCausalLM}[family]
    model = cls(_hf_config(family, arch, style))
    state = hf_llama_state(sd, arch)
    if arch.tied:
        state.pop("lm_head.weight")
    model.load_state_dict(state, strict=not arch.tied)
    return model


# --------------------------------------------------------------------------------------------------- plain PyTorch
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rope(x: Tensor, base: float) -> Tensor:
    """Rotate-half RoPE on [B, heads, S, D]."""
    s, d = x.shape[-2], x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = torch.outer(torch.arange(s, dtype=torch.float32), inv)
    ang = torch.cat([ang, ang], dim=-1)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)  # the tables in the model's dtype, as HF does
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class CausalSelfAttention(nn.Module):
    def __init__(self, arch: Arch, style: Style):
        super().__init__()
        self.arch, self.style = arch, style
        qkv = (arch.heads + 2 * arch.groups) * arch.head_dim
        self.c_attn = nn.Linear(arch.hidden, qkv, bias=arch.bias != "none")
        self.c_proj = nn.Linear(arch.heads * arch.head_dim, arch.hidden, bias=arch.bias == "all")
        self.attn_dropout = nn.Dropout(0.0) if style.dropout_modules else None
        self.resid_dropout = nn.Dropout(0.0) if style.dropout_modules else None
        self.rope_base = arch.rope_base
        self.norm_factor = math.sqrt(arch.head_dim)  # the scores are divided by it

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        a = self.arch
        b, s, _ = x.shape
        q, k, v = self.c_attn(x).split([a.heads * a.head_dim, a.groups * a.head_dim, a.groups * a.head_dim], dim=-1)
        q = q.view(b, s, a.heads, a.head_dim).transpose(1, 2)
        k = k.view(b, s, a.groups, a.head_dim).transpose(1, 2)
        v = v.view(b, s, a.groups, a.head_dim).transpose(1, 2)
        if a.pos == "rope":
            q, k = _rope(q, self.rope_base), _rope(k, self.rope_base)
        if a.groups != a.heads:
            k = k.repeat_interleave(a.heads // a.groups, dim=1)
            v = v.repeat_interleave(a.heads // a.groups, dim=1)
        if self.style.attn == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else ~mask, is_causal=mask is None,
                                               scale=1.0 / self.norm_factor)
        else:
            att = (q @ k.transpose(-2, -1)) / self.norm_factor
            causal = mask if mask is not None else torch.ones(s, s, dtype=torch.bool).triu(1)
            att = att.masked_fill(causal, float("-inf")).softmax(dim=-1)
            if self.attn_dropout is not None:
                att = self.attn_dropout(att)
            y = att @ v
        y = self.c_proj(y.transpose(1, 2).reshape(b, s, a.heads * a.head_dim))
        return self.resid_dropout(y) if self.resid_dropout is not None else y


class MLP(nn.Module):
    def __init__(self, arch: Arch, style: Style):
        super().__init__()
        self.gated = arch.act == "swiglu"
        self.interleaved = style.fc1 == "interleaved"
        self.c_fc = nn.Linear(arch.hidden, arch.ffn * (2 if self.gated else 1), bias=arch.bias == "all")
        self.act = nn.SiLU() if self.gated else nn.GELU()
        self.c_proj = nn.Linear(arch.ffn, arch.hidden, bias=arch.bias == "all")
        self.dropout = nn.Dropout(0.0) if style.dropout_modules else None

    def forward(self, x: Tensor) -> Tensor:
        h = self.c_fc(x)
        if self.gated:
            if self.interleaved:
                gate, up = h[..., 0::2], h[..., 1::2]
            else:
                gate, up = h.chunk(2, dim=-1)
            h = self.act(gate) * up
        else:
            h = self.act(h)
        h = self.c_proj(h)
        return self.dropout(h) if self.dropout is not None else h


def _norm(arch: Arch) -> nn.Module:
    return RMSNorm(arch.hidden, arch.eps) if arch.norm == "RMSNorm" else nn.LayerNorm(arch.hidden, eps=arch.eps)


class Block(nn.Module):
    def __init__(self, arch: Arch, style: Style):
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = _norm(arch), CausalSelfAttention(arch, style), _norm(arch), MLP(arch, style)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, arch: Arch, style: Style):
        super().__init__()
        self.arch, self.style = arch, style
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(arch.vocab, arch.hidden),
            **({"wpe": nn.Embedding(arch.seq, arch.hidden)} if arch.pos == "learned" else {}),
            drop=nn.Dropout(0.0) if style.dropout_modules else nn.Identity(),
            h=nn.ModuleList([Block(arch, style) for _ in range(arch.layers)]),
            ln_f=_norm(arch),
        ))
        self.lm_head = nn.Linear(arch.hidden, arch.vocab, bias=False)
        if arch.tied:
            self.lm_head.weight = self.transformer.wte.weight

    def forward(self, idx: Tensor, mask: Tensor | None = None) -> Tensor:
        x = self.transformer.wte(idx)
        if "wpe" in self.transformer:
            x = x + self.transformer.wpe(torch.arange(idx.shape[1]))
        x = self.transformer.drop(x)
        for block in self.transformer.h:
            x = block(x, mask) if self.style.call == "pos" else block(x, mask=mask)
        return self.lm_head(self.transformer.ln_f(x))


def plain_state(sd: dict[str, Tensor], arch: Arch, style: Style) -> dict[str, Tensor]:
    out = {"transformer.wte.weight": sd["embedding.word_embeddings.weight"],
           "transformer.ln_f.weight": sd["decoder.final_layernorm.weight"]}
    if "decoder.final_layernorm.bias" in sd:
        out["transformer.ln_f.bias"] = sd["decoder.final_layernorm.bias"]
    if arch.pos == "learned":
        out["transformer.wpe.weight"] = sd["embedding.position_embeddings.weight"]
    out["lm_head.weight"] = sd.get("output_layer.weight", sd["embedding.word_embeddings.weight"])
    for i in range(arch.layers):
        m, h = f"decoder.layers.{i}.", f"transformer.h.{i}."
        for mn, hn in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
            for suffix in ("weight", "bias"):
                if m + f"{mn}.{suffix}" in sd:
                    out[h + f"{hn}.{suffix}"] = sd[m + f"{mn}.{suffix}"]
        for suffix in ("weight", "bias"):
            key = m + "self_attention.linear_qkv." + suffix
            if key in sd:
                out[h + f"attn.c_attn.{suffix}"] = torch.cat(_qkv_parts(sd[key], arch))
            for mn, hn in (("self_attention.linear_proj", "attn.c_proj"), ("mlp.linear_fc2", "mlp.c_proj")):
                if m + f"{mn}.{suffix}" in sd:
                    out[h + f"{hn}.{suffix}"] = sd[m + f"{mn}.{suffix}"]
            if m + f"mlp.linear_fc1.{suffix}" in sd:
                fc1 = sd[m + f"mlp.linear_fc1.{suffix}"]
                if arch.act == "swiglu" and style.fc1 == "interleaved":
                    gate, up = fc1.chunk(2, dim=0)
                    fc1 = torch.stack([gate, up], dim=1).reshape(fc1.shape)
                out[h + f"mlp.c_fc.{suffix}"] = fc1
    return {k: v.contiguous() for k, v in out.items()}


def build_plain(arch: Arch, style: Style, sd: dict[str, Tensor]) -> GPT:
    model = GPT(arch, style)
    state = plain_state(sd, arch, style)
    if arch.tied:
        state.pop("lm_head.weight")
    model.load_state_dict(state, strict=not arch.tied)
    return model


# --------------------------------------------------------------------------------------------------- faults
#: fault -> what it changes (on the side it is given to)
FAULTS = {
    "norm-eps": "layer 1's second norm uses epsilon 1e-2",
    "eps-tiny": "layer 1's second norm epsilon 1% larger: below every tolerance (same-stack exactness finds it)",
    "act": "layer 1's MLP activation is another function (tanh GELU for GELU, GELU for SiLU)",
    "rope-base": "RoPE base 500000 instead of 10000 in every layer",
    "dropout": "an active dropout (p=0.1) in layer 0's attention",
    "attn-scale": "layer 0's attention scores scaled by 1/head_dim instead of 1/sqrt(head_dim)",
    "qkv-concat": "a conversion that read megatron's per-group linear_qkv as [Q | K | V] (Hugging Face families)",
    "weight": "layer 0's q/k/v weight scaled by 1.01 after loading",
}


def fault_effect(fault: str, arch: Arch) -> float | None:
    """The relative change (L2) a fault makes to the one function it replaces, on inputs of the scale the model
    feeds it, computed in float64; None for a fault that is not one function's change (a weight, the RoPE base, an
    active dropout). A fault whose effect is below one rounding of the dtype the pair trains in
    (``dtypes.resolution``) leaves both programs computing the same numbers in that dtype: no fault there."""
    if fault == "act":  # the MLP's activation on its pre-activations (unit scale after the norm and fc1)
        x = torch.randn(1 << 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        base = F.gelu(x) if arch.act == "gelu" else F.silu(x)
        other = F.gelu(x, approximate="tanh") if arch.act == "gelu" else F.gelu(x)
        return float((other - base).norm() / base.norm())
    if fault in ("norm-eps", "eps-tiny"):  # 1 / sqrt(ms + eps) with ms the hidden states' mean square (init_std**2)
        ms = arch.init_std ** 2
        eps = 1e-2 if fault == "norm-eps" else arch.eps * 1.01
        return abs((ms + arch.eps) ** 0.5 / (ms + eps) ** 0.5 - 1.0)
    return None


def _layers(model: Any, family: str) -> Any:
    model = getattr(model, "module", model)  # megatron's Float16Module
    if family == "mcore":
        return model.decoder.layers
    if family in ("hf-gpt2", "plain"):
        return model.transformer.h
    return model.model.layers


def apply_fault(model: Any, family: str, fault: str, arch: Arch) -> None:
    if not fault:
        return
    model = getattr(model, "module", model)  # megatron's Float16Module
    layers = _layers(model, family)
    if fault in ("norm-eps", "eps-tiny"):
        norm = {"mcore": "pre_mlp_layernorm", "hf-gpt2": "ln_2", "plain": "ln_2"}.get(family, "post_attention_layernorm")
        mod = getattr(layers[1], norm)
        for attr in ("eps", "variance_epsilon"):
            if hasattr(mod, attr):
                setattr(mod, attr, 1e-2 if fault == "norm-eps" else getattr(mod, attr) * 1.01)
    elif fault == "act":
        other: Any = (lambda x: F.gelu(x, approximate="tanh")) if arch.act == "gelu" else F.gelu
        if family == "mcore":  # megatron's gated MLP calls its config's activation: layer 1 gets its own config
            import copy

            layers[1].mlp.config = copy.copy(layers[1].mlp.config)
            layers[1].mlp.config.activation_func = other
            layers[1].mlp.activation_func = other
        elif family == "plain" or family == "hf-gpt2":
            layers[1].mlp.act = _Fn(other)
        else:
            layers[1].mlp.act_fn = _Fn(other)
    elif fault == "rope-base":
        if family == "mcore":
            from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

            d = arch.head_dim
            model.rotary_pos_emb.inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
            assert isinstance(model.rotary_pos_emb, RotaryEmbedding)
        elif family == "plain":
            for block in layers:
                block.attn.rope_base = 500000.0
        else:
            rot = model.model.rotary_emb
            d = arch.head_dim
            rot.inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
            rot.original_inv_freq = rot.inv_freq
    elif fault == "dropout":
        if family == "plain":
            layers[0].attn.attn_dropout = nn.Dropout(0.1)
            layers[0].attn.style = Style(**{**asdict(layers[0].attn.style), "attn": "eager"})
        elif family == "mcore":
            layers[0].self_attention.core_attention.attention_dropout.p = 0.1
        elif family == "hf-gpt2":
            layers[0].attn.attn_dropout.p = 0.1
        else:
            layers[0].self_attn.attention_dropout = 0.1
    elif fault == "attn-scale":
        scale = 1.0 / arch.head_dim
        if family == "mcore":
            layers[0].self_attention.core_attention.softmax_scale = scale
        elif family == "plain":
            layers[0].attn.norm_factor = float(arch.head_dim)
        else:
            layers[0].self_attn.scaling = scale
    elif fault == "qkv-concat":  # every layer: q/k/v cut from megatron's per-group rows as if they were [Q|K|V]
        from tensordiff.transforms import QkvGroups

        with torch.no_grad():
            for layer in layers:
                attn = layer.self_attn
                parts = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
                fused = QkvGroups(arch.heads, arch.groups, 0).join([p.detach().float().numpy() for p in parts])
                rows = [p.shape[0] for p in parts]
                for p, x in zip(parts, (fused[:rows[0]], fused[rows[0]:rows[0] + rows[1]], fused[rows[0] + rows[1]:])):
                    p.copy_(torch.from_numpy(x).to(p.dtype))
    elif fault == "weight":
        with torch.no_grad():
            if family == "mcore":
                layers[0].self_attention.linear_qkv.weight.mul_(1.01)
            elif family in ("plain", "hf-gpt2"):
                layers[0].attn.c_attn.weight.mul_(1.01)
            else:
                for name in ("q_proj", "k_proj", "v_proj"):
                    getattr(layers[0].self_attn, name).weight.mul_(1.01)
    else:
        raise ValueError(f"unknown fault {fault!r}; known: {sorted(FAULTS)}")


class _Fn(nn.Module):
    """An activation module calling a function (the replaced activation of a fault)."""

    def __init__(self, fn: Any):
        super().__init__()
        self.fn = fn

    def forward(self, x: Tensor) -> Tensor:
        return self.fn(x)


# --------------------------------------------------------------------------------------------------- shared weights
def random_state(arch: Arch, seed: int = 0) -> dict[str, Tensor]:
    """Starting weights in megatron-core's names (every family converts them): normal(0, init_std) matrices,
    norm weights near 1, small biases, so that a wrong norm weight or bias shows."""
    g = torch.Generator().manual_seed(seed)

    def mat(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g) * arch.init_std

    def near_one(n: int) -> Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    hd, qkv = arch.head_dim, (arch.heads + 2 * arch.groups) * arch.head_dim
    fc1 = arch.ffn * (2 if arch.act == "swiglu" else 1)
    sd: dict[str, Tensor] = {"embedding.word_embeddings.weight": mat(arch.vocab, arch.hidden)}
    if arch.pos == "learned":
        sd["embedding.position_embeddings.weight"] = mat(arch.seq, arch.hidden)

    def norm(prefix: str, n: int = arch.hidden) -> None:
        sd[prefix + ".weight"] = near_one(n)
        if arch.norm == "LayerNorm":
            sd[prefix + ".bias"] = 0.05 * torch.randn(n, generator=g)

    for i in range(arch.layers):
        m = f"decoder.layers.{i}."
        norm(m + "input_layernorm")
        sd[m + "self_attention.linear_qkv.weight"] = mat(qkv, arch.hidden)
        if arch.bias != "none":
            sd[m + "self_attention.linear_qkv.bias"] = 0.05 * torch.randn(qkv, generator=g)
        if arch.qk_norm:
            norm(m + "self_attention.q_layernorm", hd)
            norm(m + "self_attention.k_layernorm", hd)
        sd[m + "self_attention.linear_proj.weight"] = mat(arch.hidden, arch.heads * hd)
        norm(m + "pre_mlp_layernorm")
        sd[m + "mlp.linear_fc1.weight"] = mat(fc1, arch.hidden)
        sd[m + "mlp.linear_fc2.weight"] = mat(arch.hidden, arch.ffn)
        if arch.bias == "all":
            sd[m + "self_attention.linear_proj.bias"] = 0.05 * torch.randn(arch.hidden, generator=g)
            sd[m + "mlp.linear_fc1.bias"] = 0.05 * torch.randn(fc1, generator=g)
            sd[m + "mlp.linear_fc2.bias"] = 0.05 * torch.randn(arch.hidden, generator=g)
    norm("decoder.final_layernorm")
    if not arch.tied:
        sd["output_layer.weight"] = mat(arch.vocab, arch.hidden)
    return sd


def load_mcore(model: Any, sd: dict[str, Tensor]) -> None:
    """Load megatron-core weights strictly (every parameter given, nothing left over)."""
    own = {k for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    if own != set(sd):
        raise KeyError(f"megatron-core keys differ: missing {sorted(own - set(sd))}, extra {sorted(set(sd) - own)}")
    model.load_state_dict(sd, strict=False)


def build(family: str, arch: Arch, style: Style, sd: dict[str, Tensor]) -> Any:
    """The model of ``family`` holding the weights ``sd`` (megatron-core names)."""
    if family == "mcore":
        model = build_mcore(arch)
        load_mcore(model, sd)
        if arch.dtype == "bfloat16":  # how Megatron-LM trains in BF16: the model wrapped, its outputs cast to FP32
            from megatron.core.transformer.module import Float16Module

            model.config.bf16 = True
            model = Float16Module(model.config, model)
        return model
    model = build_plain(arch, style, sd) if family == "plain" else build_hf(family, arch, style, sd)
    return model.to(torch.bfloat16) if arch.dtype == "bfloat16" else model
