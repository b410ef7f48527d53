"""Tiny GPT builders shared by tests, the demo and examples.

* ``build_mcore_gpt``: megatron-core ``GPTModel`` (local spec, FP32, CPU, biases, tied embeddings).
* ``build_hf_gpt2``: HF ``GPT2LMHeadModel`` carrying the same weights (``mcore_to_hf_gpt2_state``).
* ``mcore_loss`` / ``hf_loss``: the same next-token loss (mean over all B*S tokens).
* ``use_split_qkv``: numerically equivalent rewrite of megatron's fused QKV projection.

Layouts: megatron activations are ``[S, B, H]`` (its ``output_layer`` gives ``[S, B, V]``;
``GPTModel.forward`` without labels transposes to ``[B, S, V]``); HF activations are ``[B, S, H]``.
"""
from __future__ import annotations

import math
import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from tensordiff.compat.megatron_cpu import init_megatron_cpu


@dataclass
class GPTSpec:
    """Size of the tiny GPT shared by both frameworks."""

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    vocab_size: int = 128
    seq_length: int = 16
    batch_size: int = 2
    # GPT-2 uses 0.02: fc1 pre-activations have std ~0.16 and erf vs tanh GELU differ by only
    # ~2e-5 relative. 0.05 (std ~0.4) makes that ~1.5e-4, clearly above FP32 noise (~1e-7),
    # while the initial loss stays near ln(vocab) and training converges normally.
    init_std: float = 0.05
    position_embedding_type: str = "learned_absolute"
    layernorm_epsilon: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def _gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


_ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": _gelu_tanh}


def build_mcore_gpt(spec: GPTSpec, seed: int = 1234, activation: str = "gelu", hidden_dropout: float = 0.0) -> Any:
    """Megatron-core GPTModel (local layer spec, FP32, no dropout unless ``hidden_dropout``, tied embeddings like
    GPT-2)."""
    init_megatron_cpu(seed)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        use_cpu_initialization=True,
        hidden_dropout=hidden_dropout,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        init_method_std=spec.init_std,
        layernorm_epsilon=spec.layernorm_epsilon,
        add_bias_linear=True,
        activation_func=_ACTIVATIONS[activation],
        bias_activation_fusion=False,  # megatron's fused bias-gelu is the tanh form
    )
    torch.manual_seed(seed)
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.seq_length,
        share_embeddings_and_output_weights=True,
        position_embedding_type=spec.position_embedding_type,  # type: ignore[arg-type]
    )


def causal_mask(seq_length: int) -> Tensor:
    """Megatron attention mask ``[1, 1, S, S]``, bool, True = masked (future positions)."""
    return torch.ones(seq_length, seq_length, dtype=torch.bool).triu(1)[None, None]


def mcore_loss(model: Any, tokens: Tensor, labels: Tensor) -> Tensor:
    """Megatron's training loss: per-token vocab-parallel cross-entropy ``[B, S]``, averaged."""
    b, s = tokens.shape
    position_ids = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
    per_token = model(tokens, position_ids, causal_mask(s).to(tokens.device), labels=labels)
    return per_token.float().mean()


def mcore_logits(model: Any, tokens: Tensor) -> Tensor:
    """Megatron logits, returned by GPTModel as ``[B, S, V]`` (output_layer computes [S, B, V])."""
    b, s = tokens.shape
    position_ids = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
    return model(tokens, position_ids, causal_mask(s).to(tokens.device))


def make_batch(spec: GPTSpec, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Random next-token batch: ``(tokens, labels, position_ids)``, int64 ``[B, S]``."""
    g = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, spec.vocab_size, (spec.batch_size, spec.seq_length + 1), generator=g)
    tokens, labels = stream[:, :-1].contiguous(), stream[:, 1:].contiguous()
    position_ids = torch.arange(spec.seq_length).unsqueeze(0).expand(spec.batch_size, -1).contiguous()
    return tokens, labels, position_ids


def _unpack_qkv(t: Tensor, spec: GPTSpec, num_query_groups: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Megatron packed rows ``[g0: q.., k, v | g1: ...]`` -> (all q, all k, all v) rows."""
    ng = num_query_groups or spec.num_attention_heads
    nq, hd = spec.num_attention_heads // ng, spec.head_dim
    g = t.reshape(ng, (nq + 2) * hd, *t.shape[1:])
    q, k, v = g.split([nq * hd, hd, hd], dim=1)
    return q.reshape(-1, *t.shape[1:]), k.reshape(-1, *t.shape[1:]), v.reshape(-1, *t.shape[1:])


def mcore_to_hf_gpt2_state(mcore_state_dict: dict[str, Tensor], spec: GPTSpec) -> dict[str, Tensor]:
    """Convert megatron-core GPT weights (or gradients) to HF ``GPT2LMHeadModel`` names/layouts.

    HF Conv1D weights are ``[in, out]`` (transposed vs megatron's ``[out, in]``); ``c_attn``
    columns are ``[all q | all k | all v]``; ``lm_head`` is tied to ``wte``.
    """
    sd = {k: v for k, v in mcore_state_dict.items() if not k.endswith("_extra_state")}
    used: set = set()

    def take(k: str) -> Tensor:
        used.add(k)
        return sd[k].detach().clone()

    out: dict[str, Tensor] = {}
    out["transformer.wte.weight"] = take("embedding.word_embeddings.weight")
    out["lm_head.weight"] = out["transformer.wte.weight"].clone()
    if "output_layer.weight" in sd:  # untied megatron model
        out["lm_head.weight"] = take("output_layer.weight")
    out["transformer.wpe.weight"] = take("embedding.position_embeddings.weight")
    for i in range(spec.num_layers):
        m, h = f"decoder.layers.{i}.", f"transformer.h.{i}."
        for mn, hn in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
            out[h + hn + ".weight"] = take(m + mn + ".weight")
            out[h + hn + ".bias"] = take(m + mn + ".bias")
        qkv_w = take(m + "self_attention.linear_qkv.weight")
        qkv_b = take(m + "self_attention.linear_qkv.bias")
        out[h + "attn.c_attn.weight"] = torch.cat(_unpack_qkv(qkv_w, spec), 0).t().contiguous()
        out[h + "attn.c_attn.bias"] = torch.cat(_unpack_qkv(qkv_b, spec), 0)
        for mn, hn in (("self_attention.linear_proj", "attn.c_proj"),
                       ("mlp.linear_fc1", "mlp.c_fc"), ("mlp.linear_fc2", "mlp.c_proj")):
            out[h + hn + ".weight"] = take(m + mn + ".weight").t().contiguous()
            out[h + hn + ".bias"] = take(m + mn + ".bias")
    out["transformer.ln_f.weight"] = take("decoder.final_layernorm.weight")
    out["transformer.ln_f.bias"] = take("decoder.final_layernorm.bias")
    missing = set(sd) - used
    if missing:
        raise KeyError(f"unconverted megatron keys: {sorted(missing)}")
    return out


def build_hf_gpt2(spec: GPTSpec, mcore_state_dict: dict[str, Tensor], activation: str = "gelu_new",
                  dropout: float = 0.0) -> Any:
    """HF GPT2LMHeadModel matching ``spec`` with converted megatron weights (strict load); ``dropout``: its
    ``embd_pdrop``, ``resid_pdrop`` and ``attn_pdrop``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=spec.vocab_size,
        n_positions=spec.seq_length,
        n_embd=spec.hidden_size,
        n_layer=spec.num_layers,
        n_head=spec.num_attention_heads,
        layer_norm_epsilon=spec.layernorm_epsilon,
        activation_function=activation,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        use_cache=False,
        tie_word_embeddings=True,
        attn_implementation="eager",
    )
    model = GPT2LMHeadModel(config)
    model.load_state_dict(mcore_to_hf_gpt2_state(mcore_state_dict, spec), strict=True)
    return model


def hf_logits(model: Any, tokens: Tensor) -> Tensor:
    """HF logits ``[B, S, V]`` (no labels passed, so HF does not shift)."""
    return model(input_ids=tokens).logits


def hf_loss(model: Any, tokens: Tensor, labels: Tensor) -> Tensor:
    """Cross-entropy of HF logits against the already shifted labels, mean over B*S tokens."""
    logits = hf_logits(model, tokens)
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1))


def _split_qkv_forward(self: Any, input_: Tensor, weight: Tensor | None = None,
                       runtime_gather_output: bool | None = None) -> tuple[Tensor, Tensor | None]:
    """linear_qkv forward as three matmuls (q, k, v row blocks), re-packed in megatron order."""
    w = self.weight if weight is None else weight
    heads = self.config.num_attention_heads
    ng = self.config.num_query_groups or heads
    hd = self.config.kv_channels
    nq = heads // ng
    sizes = [nq * hd, hd, hd]
    wq, wk, wv = (x.reshape(-1, w.size(1)) for x in w.reshape(ng, (nq + 2) * hd, -1).split(sizes, 1))
    add_bias = self.bias is not None and not self.skip_bias_add
    if add_bias:
        bq, bk, bv = (x.reshape(-1) for x in self.bias.reshape(ng, (nq + 2) * hd).split(sizes, 1))
    else:
        bq = bk = bv = None
    parts = [F.linear(input_, wx, bx) for wx, bx in ((wq, bq), (wk, bk), (wv, bv))]
    lead = input_.shape[:-1]
    out = torch.cat([p.reshape(*lead, ng, -1) for p in parts], dim=-1).reshape(*lead, -1)
    return out, (self.bias if self.skip_bias_add else None)


def use_split_qkv(model: Any, enable: bool = True) -> Any:
    """Make every ``self_attention.linear_qkv`` use three separate q/k/v matmuls (TP=1 only).

    Same parameters, module names and ``(output, bias)`` return; only the instance's ``forward``
    is replaced. ``enable=False`` restores the class forward.
    """
    for name, mod in model.named_modules():
        if name.endswith("self_attention.linear_qkv"):
            if enable:
                mod.forward = types.MethodType(_split_qkv_forward, mod)
            else:
                mod.__dict__.pop("forward", None)
    return model


# ----------------------------------------------------------------------------- self-check
def _diff(a: Tensor, b: Tensor) -> str:
    a, b = a.detach().double(), b.detach().double()
    rel = (a - b).norm() / max(b.norm().item(), 1e-30)
    return f"max_abs={(a - b).abs().max().item():.3e} rel_l2={rel.item():.3e}"


def _self_check(spec: GPTSpec | None = None) -> None:
    spec = spec or GPTSpec()
    tokens, labels, _ = make_batch(spec)
    print(f"spec={spec}")
    for act in ("gelu_tanh", "gelu"):
        mc = build_mcore_gpt(spec, activation=act)
        again = build_mcore_gpt(spec, activation=act).state_dict()
        same = all(torch.equal(v, again[k]) for k, v in mc.state_dict().items() if isinstance(v, Tensor))
        hf = build_hf_gpt2(spec, mc.state_dict())
        lm, lh = mcore_loss(mc, tokens, labels), hf_loss(hf, tokens, labels)
        lm.backward()
        lh.backward()
        n_grad = sum(p.grad is not None for p in mc.parameters())
        print(f"[mcore {act} vs HF gelu_new] deterministic={same} params_with_grad={n_grad}"
              f"/{len(list(mc.parameters()))} loss mcore={lm.item():.6f} hf={lh.item():.6f}"
              f" |d|={abs(lm.item() - lh.item()):.3e}")
        with torch.no_grad():
            print("  logits", _diff(mcore_logits(mc, tokens), hf_logits(hf, tokens)))
        g = mcore_to_hf_gpt2_state({k: p.grad for k, p in mc.named_parameters()}, spec)
        worst = max(((k, (g[k].double() - p.grad.double()).norm().item()
                      / max(p.grad.double().norm().item(), 1e-30)) for k, p in hf.named_parameters()),
                    key=lambda kv: kv[1])
        allg = torch.cat([g[k].flatten() for k, _ in hf.named_parameters()])
        allh = torch.cat([p.grad.flatten() for _, p in hf.named_parameters()])
        print(f"  grads (all, {len(list(hf.named_parameters()))} tensors) {_diff(allg, allh)};"
              f" worst tensor {worst[0]} rel_l2={worst[1]:.3e}")
    # erf vs tanh GELU at the first MLP
    fc1 = mc.decoder.layers[0].mlp.linear_fc1
    cap: dict[str, Tensor] = {}
    h = fc1.register_forward_hook(lambda m, i, o: cap.__setitem__("pre", (o[0] + o[1]).detach()))
    with torch.no_grad():
        mcore_logits(mc, tokens)
    h.remove()
    pre = cap["pre"]
    print(f"first MLP pre-activation std={pre.std().item():.3f}; gelu erf vs tanh:",
          _diff(_gelu_tanh(pre), F.gelu(pre)))
    # split vs fused QKV
    mc = build_mcore_gpt(spec)
    outs: dict[str, Tensor] = {}
    qkv = mc.decoder.layers[0].self_attention.linear_qkv
    h = qkv.register_forward_hook(lambda m, i, o: outs.__setitem__("qkv", o[0].detach()))
    with torch.no_grad():
        lf, lossf = mcore_logits(mc, tokens), mcore_loss(mc, tokens, labels)
        qf = outs["qkv"]
        use_split_qkv(mc)
        ls, losss = mcore_logits(mc, tokens), mcore_loss(mc, tokens, labels)
        qs = outs["qkv"]
    h.remove()
    print("split vs fused QKV: linear_qkv", _diff(qs, qf), "| logits", _diff(ls, lf),
          f"| loss |d|={abs(losss.item() - lossf.item()):.3e}")
    # training sanity: a few Adam steps on one batch
    mc = build_mcore_gpt(spec)
    opt = torch.optim.Adam(mc.parameters(), lr=1e-3)
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = mcore_loss(mc, tokens, labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    print(f"train 20 Adam steps (lr=1e-3): loss {losses[0]:.4f} -> {losses[-1]:.4f}"
          f" (ln V = {math.log(spec.vocab_size):.4f})")


if __name__ == "__main__":
    _self_check()


def replay_model() -> Any:
    """The default tiny megatron-core GPT, for ``tensordiff replay --model examples.gpt.models:replay_model``
    (the weights come from the capture)."""
    return build_mcore_gpt(GPTSpec())
