# A user's script: a tiny GPT-NeoX (parallel residual, partial rotary, LayerNorm with bias, GELU) from transformers,
# trained a few steps with AdamW on random tokens. Nothing here knows about tensordiff.
import argparse

import torch
import torch.nn.functional as F
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

p = argparse.ArgumentParser()
p.add_argument("--attn", default="sdpa")
p.add_argument("--eps", type=float, default=1e-5)
p.add_argument("--steps", type=int, default=3)
args = p.parse_args()
torch.manual_seed(0)
cfg = GPTNeoXConfig(vocab_size=96, hidden_size=48, num_hidden_layers=3, num_attention_heads=4, intermediate_size=96,
                    rotary_pct=0.5, max_position_embeddings=32, layer_norm_eps=1e-5, hidden_dropout=0.0,
                    attention_dropout=0.0, use_parallel_residual=True, tie_word_embeddings=False)
cfg._attn_implementation = args.attn
model = GPTNeoXForCausalLM(cfg)
model.gpt_neox.layers[2].post_attention_layernorm.eps = args.eps   # the "config drift" a user might introduce
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(1))
for step in range(args.steps):
    logits = model(input_ids=data[:, :-1]).logits
    loss = F.cross_entropy(logits.reshape(-1, 96), data[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()
    print("step", step, loss.item())
