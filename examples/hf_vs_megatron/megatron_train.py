"""Train a megatron-core GPTModel with a Llama config for a few steps on the CPU: no tensordiff.

    python megatron_train.py --save-weights mcore.safetensors --steps 2

The same tiny model as hf_train.py (RMSNorm, SwiGLU, RoPE, 4 heads in 2 query groups, no
biases, untied output layer), built with megatron-core's local layer spec; the weights it
starts from are written in megatron-core's names for ``tensordiff ckpt convert``.
"""

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a file: the repository root holds tensordiff.compat's CPU shims
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from tensordiff.compat.megatron_cpu import init_megatron_cpu

VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, SEQ, BATCH = 128, 64, 128, 2, 4, 2, 16, 2


def build(seed, rope_base=10000, eps=1e-6):
    init_megatron_cpu(seed)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS,
        num_query_groups=KV_HEADS, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=torch.float32, init_method_std=0.05, normalization="RMSNorm", layernorm_epsilon=eps,
        add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=False,
    )
    torch.manual_seed(seed)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                    vocab_size=VOCAB, max_sequence_length=SEQ, share_embeddings_and_output_weights=False,
                    position_embedding_type="rope", rotary_base=rope_base)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--save-weights", help="write the starting weights here (megatron-core names)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.1)
    args = p.parse_args()
    torch.set_num_threads(2)
    model = build(args.seed)
    if args.save_weights:
        save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()
                   if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}, args.save_weights)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    tokens, labels = ids[:, :-1], ids[:, 1:]
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]  # True = masked
    for step in range(args.steps):
        per_token = model(tokens, position_ids, causal, labels=labels)  # [B, S]
        loss = per_token.float().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"megatron-core llama step {step}: loss {loss.item():.6f}", flush=True)


if __name__ == "__main__":
    main()
