"""Tiny mixture-of-experts GPT builders: megatron-core ``GPTModel`` with MoE layers and HF ``MixtralForCausalLM``.

* ``build_mcore_moe``: megatron-core ``GPTModel``, local spec with ``num_experts`` (``SequentialMLP`` experts, a
  ``TopKRouter``), FP32, CPU, the ``allgather`` token dispatcher; ``aux_coeff`` is ``moe_aux_loss_coeff`` (its
  load-balancing loss adds a gradient in backward through ``MoEAuxLossAutoScaler`` and leaves the loss value alone),
  ``z_coeff`` is ``moe_z_loss_coeff``.
* ``build_hf_mixtral``: HF ``MixtralForCausalLM``; with ``output_router_logits=True`` its loss is the language-model
  loss + ``router_aux_loss_coef`` × ``load_balancing_loss_func`` of the gates' logits.

Layouts: megatron activations are ``[S, B, H]`` (the router's input), its router's logits ``[S*B, E]``; HF's gate
(``block_sparse_moe.gate``, an ``nn.Linear``) gives ``[B*S, E]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from tensordiff.compat.megatron_cpu import init_megatron_cpu


@dataclass
class MoESpec:
    """Size of the tiny MoE GPT."""

    num_layers: int = 2
    hidden_size: int = 32
    ffn_hidden_size: int = 64
    num_attention_heads: int = 4
    num_experts: int = 4
    topk: int = 2
    vocab_size: int = 64
    seq_length: int = 16
    batch_size: int = 2
    #: larger than GPT-2's 0.02: the router's logits then spread, the experts' loads are uneven and the
    #: load-balancing loss's gradient stands well above FP32 noise
    init_std: float = 0.2


def build_mcore_moe(spec: MoESpec, seed: int = 1234, aux_coeff: float = 0.0, z_coeff: float | None = None) -> Any:
    """Megatron-core GPTModel whose MLPs are MoE layers (top-k softmax router, SequentialMLP experts)."""
    init_megatron_cpu(seed)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        moe_ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        init_method_std=spec.init_std,
        add_bias_linear=False,
        bias_activation_fusion=False,
        num_moe_experts=spec.num_experts,
        moe_router_topk=spec.topk,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=aux_coeff,
        moe_z_loss_coeff=z_coeff,
        moe_token_dispatcher_type="allgather",
    )
    torch.manual_seed(seed)
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(num_experts=spec.num_experts, moe_grouped_gemm=False),
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.seq_length,
        share_embeddings_and_output_weights=True,
    )


def mcore_loss(model: Any, tokens: Tensor, labels: Tensor) -> Tensor:
    """Megatron's per-token cross-entropy ``[B, S]``, averaged (the aux losses are not in it: they act in backward)."""
    b, s = tokens.shape
    position_ids = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)[None, None]
    return model(tokens, position_ids, mask, labels=labels).float().mean()


def mcore_tracked_aux_loss(model: Any) -> Tensor:
    """The load-balancing losses megatron-core tracked in this forward (``aux_loss / coeff`` per layer), summed over
    the layers and × the coefficient: the aux loss as MindFormers' reported loss includes it. Detached: its gradient
    already flows through ``MoEAuxLossAutoScaler``."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    tracked = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
    if tracked is None:
        return torch.zeros(())
    return tracked["values"].detach().sum() * model.config.moe_aux_loss_coeff


def clear_aux_loss_tracker() -> None:
    """Zero megatron-core's per-layer aux-loss tracker (a training loop does so after logging each step)."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    clear_aux_losses_tracker()


def build_hf_mixtral(spec: MoESpec, seed: int = 1234, aux_coeff: float = 0.02, output_router_logits: bool = False
                     ) -> Any:
    """HF MixtralForCausalLM of ``spec``'s size, initialised from ``seed``; with ``output_router_logits`` its loss adds
    ``aux_coeff`` × the load-balancing loss."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.ffn_hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_attention_heads,
        num_local_experts=spec.num_experts,
        num_experts_per_tok=spec.topk,
        max_position_embeddings=spec.seq_length,
        initializer_range=spec.init_std,
        output_router_logits=output_router_logits,
        router_aux_loss_coef=aux_coeff,
        attn_implementation="eager",
        use_cache=False,
    )
    torch.manual_seed(seed)
    return MixtralForCausalLM(config)


def hf_loss(model: Any, tokens: Tensor, labels: Tensor) -> Tensor:
    """HF's loss: the next-token cross-entropy of the shifted labels (+ the aux loss where the config asks)."""
    return model(input_ids=tokens, labels=labels).loss


def make_batch(spec: MoESpec, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Random tokens ``[B, S]`` and their next-token labels (megatron's, already shifted) from one stream."""
    g = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, spec.vocab_size, (spec.batch_size, spec.seq_length + 1), generator=g)
    return stream[:, :-1].contiguous(), stream[:, 1:].contiguous()
