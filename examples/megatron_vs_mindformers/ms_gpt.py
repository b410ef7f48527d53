"""A hand-written MindSpore port of the megatron-core GPT (GPT-2 style: LayerNorm, GELU, learned positions).

This is the kind of port an engineer writes when moving a Megatron model to MindSpore by
hand: the module tree mirrors megatron-core's names (``decoder.layers.0.mlp.linear_fc1``),
but the building blocks are MindSpore's own, with MindSpore's defaults:

* ``nn.LayerNorm`` stores ``gamma``/``beta`` (Megatron: ``weight``/``bias``) and defaults to
  epsilon 1e-7 (Megatron 1e-5);
* ``nn.GELU`` defaults to ``approximate=True``, the tanh form (Megatron: exact erf);
* ``nn.Embedding`` stores ``embedding_table`` (Megatron: ``weight``);
* ``nn.Dense`` adds its bias (Megatron's ``linear_proj``/``linear_fc1``/``linear_fc2`` return
  the bias separately and add it later).

``faithful=True`` passes the Megatron values (epsilon 1e-5, erf GELU); ``gelu_approximate``
and ``layernorm_epsilon`` inject the two MindSpore defaults one at a time.
Activations are ``[S, B, H]`` as in Megatron; the output layer reuses the word embeddings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mindspore as ms
import numpy as np
from mindspore import nn, ops


@dataclass
class MSGPTConfig:
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    vocab_size: int = 128
    seq_length: int = 16
    layernorm_epsilon: float = 1e-5
    gelu_approximate: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


class Embedding(nn.Cell):
    def __init__(self, cfg: MSGPTConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.seq_length, cfg.hidden_size)

    def construct(self, input_ids, position_ids):
        h = self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
        return h.transpose(1, 0, 2)  # [B, S, H] -> [S, B, H]


class CoreAttention(nn.Cell):
    """softmax(q k^T / sqrt(d), causal mask) v with q, k, v ``[S, B, N, D]``; returns ``[S, B, N*D]``."""

    def __init__(self, cfg: MSGPTConfig):
        super().__init__()
        self.scale = 1.0 / math.sqrt(cfg.head_dim)

    def construct(self, q, k, v, attention_mask):
        s, b, n, d = q.shape
        q = q.transpose(1, 2, 0, 3)  # [B, N, S, D]
        k = k.transpose(1, 2, 3, 0)  # [B, N, D, S]
        v = v.transpose(1, 2, 0, 3)
        scores = ops.matmul(q, k) * self.scale
        scores = ops.masked_fill(scores, attention_mask, ms.Tensor(-10000.0, ms.float32))
        probs = ops.softmax(scores, axis=-1)
        ctx = ops.matmul(probs, v)  # [B, N, S, D]
        return ctx.transpose(2, 0, 1, 3).reshape(s, b, n * d)


class SelfAttention(nn.Cell):
    def __init__(self, cfg: MSGPTConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.linear_qkv = nn.Dense(h, 3 * h)
        self.core_attention = CoreAttention(cfg)
        self.linear_proj = nn.Dense(h, h)

    def construct(self, hidden_states, attention_mask):
        s, b, _ = hidden_states.shape
        n, d = self.cfg.num_attention_heads, self.cfg.head_dim
        qkv = self.linear_qkv(hidden_states).reshape(s, b, n, 3 * d)  # Megatron packing: [q_h, k_h, v_h] per head
        q, k, v = qkv[..., :d], qkv[..., d:2 * d], qkv[..., 2 * d:]
        return self.linear_proj(self.core_attention(q, k, v, attention_mask))


class MLP(nn.Cell):
    def __init__(self, cfg: MSGPTConfig):
        super().__init__()
        h = cfg.hidden_size
        self.linear_fc1 = nn.Dense(h, 4 * h)
        self.activation_func = nn.GELU(approximate=cfg.gelu_approximate)
        self.linear_fc2 = nn.Dense(4 * h, h)

    def construct(self, x):
        return self.linear_fc2(self.activation_func(self.linear_fc1(x)))


class TransformerLayer(nn.Cell):
    def __init__(self, cfg: MSGPTConfig):
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = nn.LayerNorm((h,), epsilon=cfg.layernorm_epsilon)
        self.self_attention = SelfAttention(cfg)
        self.pre_mlp_layernorm = nn.LayerNorm((h,), epsilon=cfg.layernorm_epsilon)
        self.mlp = MLP(cfg)

    def construct(self, hidden_states, attention_mask):
        hidden_states = hidden_states + self.self_attention(self.input_layernorm(hidden_states), attention_mask)
        return hidden_states + self.mlp(self.pre_mlp_layernorm(hidden_states))


class Decoder(nn.Cell):
    def __init__(self, cfg: MSGPTConfig):
        super().__init__()
        self.layers = nn.CellList([TransformerLayer(cfg) for _ in range(cfg.num_layers)])
        self.final_layernorm = nn.LayerNorm((cfg.hidden_size,), epsilon=cfg.layernorm_epsilon)

    def construct(self, hidden_states, attention_mask):
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask)
        return self.final_layernorm(hidden_states)


class OutputLayer(nn.Cell):
    """Logits ``[S, B, V]`` with the (tied) word-embedding matrix passed in, as in Megatron."""

    def construct(self, hidden_states, weight):
        return ops.matmul(hidden_states, weight.T)


class GPTModel(nn.Cell):
    def __init__(self, cfg: MSGPTConfig):
        super().__init__()
        self.cfg = cfg
        self.embedding = Embedding(cfg)
        self.decoder = Decoder(cfg)
        self.output_layer = OutputLayer()

    def construct(self, input_ids, position_ids, attention_mask, labels, loss_mask):
        h = self.decoder(self.embedding(input_ids, position_ids), attention_mask)
        logits = self.output_layer(h, self.embedding.word_embeddings.embedding_table)  # [S, B, V]
        logp = ops.log_softmax(logits.astype(ms.float32), axis=-1)
        nll = -ops.gather_elements(logp, 2, labels.T.astype(ms.int32)[..., None])[..., 0]  # [S, B]
        mask = loss_mask.T
        return (nll * mask).sum() / mask.sum()


def build(cfg: MSGPTConfig, state: dict[str, np.ndarray] | None = None) -> GPTModel:
    """The model, with ``state`` (MindSpore parameter names -> arrays) loaded strictly when given."""
    model = GPTModel(cfg)
    if state is not None:
        params = {name: ms.Parameter(ms.Tensor(value), name=name) for name, value in state.items()}
        missing, unexpected = ms.load_param_into_net(model, params, strict_load=True)
        if missing or unexpected:
            raise KeyError(f"checkpoint does not fit the model: missing {missing}, unexpected {unexpected}")
    return model


def replay_model(gelu_approximate: bool = False) -> GPTModel:
    """The default port, for ``tensordiff replay --model examples.megatron_vs_mindformers.ms_gpt:replay_model``
    (PyNative; the weights come from the capture)."""
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    return build(MSGPTConfig(gelu_approximate=gelu_approximate))


def replay_model_gelu_approx() -> GPTModel:
    """The port with MindSpore's default nn.GELU() (``run.py --fault gelu-approx``)."""
    return replay_model(gelu_approximate=True)
