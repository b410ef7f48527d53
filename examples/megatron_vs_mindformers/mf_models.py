"""MindFormers models of spec.py's families (and the GPT-2-shaped one of examples/wikitext2).

Call ``tensordiff.compat.mindformers_cpu.init_mindformers_cpu()`` and ``enable()`` first (the CPU
kernels MindFormers lacks). GPTModel and Qwen3 are MindFormers 1.9's Megatron-style
``parallel_core`` code: parameter names are megatron-core's, activations ``[S, B, H]``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mindspore as ms
import numpy as np

FP32 = dict(compute_dtype="float32", params_dtype="float32", layernorm_compute_dtype="float32",
            softmax_compute_dtype="float32", rotary_dtype="float32")


def _parallel_core_gpt(spec: Any, position_embedding_type: str, share_embeddings: bool, **config: Any) -> Any:
    """MindFormers' parallel_core GPTModel for ``spec`` (FP32, no dropout, local layer spec); ``config``:
    what differs between the model families (norm, activation, biases, ...)."""
    from mindformers.parallel_core.training_graph.base_models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from mindformers.parallel_core.training_graph.base_models.gpt.gpt_model import GPTModel
    from mindformers.parallel_core.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads, num_query_groups=spec.num_query_groups,
        kv_channels=spec.head_dim, seq_length=spec.seq_length, vocab_size=spec.vocab_size,
        position_embedding_type=position_embedding_type, layernorm_epsilon=spec.layernorm_epsilon,
        use_flash_attention=False, hidden_dropout=0.0, attention_dropout=0.0,
        use_interleaved_weight_layout_mlp=spec.family != "llama-stacked", **config, **FP32)
    stacked = spec.family == "llama-stacked"  # MLP with [gate; up] rows instead of the default MLPInterleaved
    layer_spec = get_gpt_layer_local_spec(use_interleaved_weight_layout_mlp=not stacked)
    return GPTModel(config=cfg, transformer_layer_spec=layer_spec, vocab_size=spec.vocab_size,
                    max_sequence_length=spec.seq_length, position_embedding_type=position_embedding_type,
                    share_embeddings_and_output_weights=share_embeddings, rotary_base=spec.rotary_base)


def _gpt_model(spec: Any) -> Any:
    return _parallel_core_gpt(spec, "rope", False, rotary_base=spec.rotary_base, normalization="RMSNorm",
                              gated_linear_unit=True, hidden_act="silu", add_bias_linear=False, pad_token_id=0)


def gpt2_model(spec: Any) -> Any:
    """GPT-2's design: LayerNorm, GELU (MindFormers' GELU cell: the tanh form, GPT-2's own), learned absolute
    positions, biases, tied embeddings. Positions reach the embedding only with ``use_eod_reset=True``."""
    return _parallel_core_gpt(spec, "learned_absolute", True, normalization="LayerNorm", gated_linear_unit=False,
                              hidden_act="gelu", add_bias_linear=True, pad_token_id=-1, use_eod_reset=True)


def _qwen3_model(spec: Any) -> Any:
    from mindformers.models.qwen3.configuration_qwen3 import Qwen3Config
    from mindformers.models.qwen3.modeling_qwen3_train import TrainingQwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.ffn_hidden_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_query_groups, head_dim=spec.head_dim, max_position_embeddings=spec.seq_length,
        seq_length=spec.seq_length, rope_theta=spec.rotary_base, rms_norm_eps=spec.layernorm_epsilon, pad_token_id=0,
        tie_word_embeddings=False, use_flash_attention=False, hidden_dropout=0.0, attention_dropout=0.0, **FP32)
    return TrainingQwen3ForCausalLM(config)


def _legacy_llama(spec: Any) -> Any:
    from mindformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        batch_size=spec.batch_size, seq_length=spec.seq_length, hidden_size=spec.hidden_size, num_layers=spec.num_layers,
        num_heads=spec.num_attention_heads, n_kv_heads=spec.num_query_groups, vocab_size=spec.vocab_size,
        intermediate_size=spec.ffn_hidden_size, max_position_embedding=spec.seq_length, rms_norm_eps=spec.layernorm_epsilon,
        theta=float(spec.rotary_base), pad_token_id=0, compute_dtype="float32", layernorm_compute_type="float32",
        softmax_compute_type="float32", rotary_dtype="float32", param_init_type="float32",
        embedding_init_type="float32", use_flash_attention=False, fused_rms_norm=False, use_rope_slice=True)
    return LlamaForCausalLM(config)


def load_state(model: Any, state: dict[str, np.ndarray]) -> None:
    """Load MindSpore-named arrays strictly: every parameter of the model, nothing else."""
    params = {name: ms.Parameter(ms.Tensor(value), name=name) for name, value in state.items()}
    not_loaded, unused = ms.load_param_into_net(model, params, strict_load=True)
    if not_loaded or unused:
        from tensordiff.errors import TensordiffError

        raise TensordiffError(f"the checkpoint does not fit {type(model).__name__}: parameters not loaded {not_loaded}, "
                              f"checkpoint entries unused {unused}; convert it with tensordiff ckpt convert")


def build_mindformers(spec: Any, state: dict[str, np.ndarray],
                      loss_mask: bool = True) -> tuple[Any, Callable[[dict], Any]]:
    """(model, loss_fn(batch)) for the ``llama`` / ``llama-stacked`` (parallel_core GPTModel), ``qwen3`` or
    ``llama-legacy`` family. ``loss_mask=False``: the model called with labels and no ``loss_mask=`` (as users
    commonly call it): it builds its own from the input ids (not the pad token) and the labels."""
    if spec.family == "llama-legacy":
        model = _legacy_llama(spec)
        model.set_train(True)
        load_state(model, state)

        def legacy_loss(b: dict) -> Any:
            # the legacy model takes [B, S+1] ids and shifts the labels itself; masked mean over non-pad tokens
            return model(b["stream"]).reshape(())

        return model, legacy_loss
    model = _qwen3_model(spec) if spec.family == "qwen3" else _gpt_model(spec)
    model.set_train(True)
    load_state(model, state)

    def loss_fn(b: dict) -> Any:
        # train mode returns (loss, mtp_loss, extra_loss, attention_loss); loss is the masked mean
        masks = {"loss_mask": b["loss_mask"]} if loss_mask else {}
        out = model(b["tokens"], labels=b["labels"], attention_mask=b["attention_mask"], **masks)
        return out[0].reshape(())

    return model, loss_fn
