"""Train a Hugging Face LlamaForCausalLM for a few steps: plain transformers + PyTorch, no tensordiff.

    python hf_train.py --weights model.safetensors --steps 2

Written the way a user writes one: a tiny random LlamaConfig, the weights loaded from a
safetensors file in transformers' names, keyword calls, the loss computed outside the model,
SGD. ``tensordiff capture --auto`` records it without any edit (see run.py).
"""

import argparse

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, SEQ, BATCH = 128, 64, 128, 2, 4, 2, 16, 2


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--weights", required=True, help="safetensors in transformers' names")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--rms-eps", type=float, default=1e-6)
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    p.add_argument("--act", default="silu", help="hidden_act")
    args = p.parse_args()
    torch.set_num_threads(2)

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=SEQ,
                         rms_norm_eps=args.rms_eps, rope_theta=args.rope_theta, tie_word_embeddings=False,
                         attention_dropout=0.0, hidden_act=args.act)
    config._attn_implementation = args.attn
    model = LlamaForCausalLM(config)
    model.load_state_dict(load_file(args.weights), strict=True)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    for step in range(args.steps):
        logits = model(input_ids=inputs).logits
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"hf llama step {step}: loss {loss.item():.6f}", flush=True)


if __name__ == "__main__":
    main()
