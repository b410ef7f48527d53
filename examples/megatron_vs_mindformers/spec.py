"""The tiny model both frameworks build, one description per family (no framework imported here).

* ``gpt2``: LayerNorm, erf GELU, learned positions, biases, tied embeddings. Megatron side:
  megatron-core ``GPTModel``; MindSpore side: the hand-written port in ``ms_gpt.py``.
* ``llama``: RMSNorm, SwiGLU, RoPE, no biases, multi-head attention, untied output layer.
  Megatron side: megatron-core ``GPTModel``; MindSpore side: MindFormers' ``parallel_core``
  ``GPTModel`` (the Megatron-style model of MindFormers 1.x).
* ``llama-legacy``: the ``llama`` model; MindSpore side: the legacy MindFormers ``LlamaForCausalLM``
  (``tok_embeddings``, ``attention.wq/wk/wv``, ``feed_forward.w1/w2/w3``; activations ``[B, S, H]``).
* ``llama-stacked``: the ``llama`` model; MindSpore side: the same ``parallel_core`` ``GPTModel`` built with
  ``use_interleaved_weight_layout_mlp=False`` (``linear_fc1`` rows stacked [gate; up], as Megatron's).
* ``qwen3``: ``llama`` with grouped-query attention (4 heads, 2 groups) and RMSNorm on q and k.
  MindSpore side: ``TrainingQwen3ForCausalLM``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Spec:
    family: str = "gpt2"
    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: int = 256
    num_attention_heads: int = 4
    num_query_groups: int = 4
    vocab_size: int = 128
    seq_length: int = 16
    batch_size: int = 2
    init_std: float = 0.05
    layernorm_epsilon: float = 1e-5
    rotary_base: int = 10000
    qk_layernorm: bool = False
    gelu: str = "erf"  # gpt2: "erf" (torch's F.gelu) or "tanh" (GPT-2's own, MindFormers' default)
    lr: float = 0.1  # plain SGD on both sides: the same update maths in both frameworks

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


FAMILIES = {
    "gpt2": Spec(),
    "llama": Spec(family="llama", ffn_hidden_size=128, num_query_groups=4, layernorm_epsilon=1e-6),
    "llama-stacked": Spec(family="llama-stacked", ffn_hidden_size=128, num_query_groups=4, layernorm_epsilon=1e-6),
    "llama-legacy": Spec(family="llama-legacy", ffn_hidden_size=128, num_query_groups=4, layernorm_epsilon=1e-6),
    "qwen3": Spec(family="qwen3", ffn_hidden_size=128, num_query_groups=2, layernorm_epsilon=1e-6, qk_layernorm=True),
}
