# A user's script: a tiny Mistral (GQA, sliding-window attention, tied embeddings) saved once, then loaded in BF16
# with from_pretrained(torch_dtype=...) and trained 2 AdamW steps with Hugging Face's own loss (labels=).
# It records itself with tensordiff.capture, as docs/guide.md shows.
import argparse
import os

import torch
from transformers import MistralConfig, MistralForCausalLM

import tensordiff

p = argparse.ArgumentParser()
p.add_argument("--attn", default="sdpa")
p.add_argument("--window", type=int, help="the sliding window to train with (default: the checkpoint's, 24)")
p.add_argument("--ckpt", default="mistral_ckpt")
p.add_argument("-o", "--out", required=True)
args = p.parse_args()
torch.manual_seed(0)
if not os.path.isdir(args.ckpt):
    cfg = MistralConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, sliding_window=24,
                        tie_word_embeddings=True)
    MistralForCausalLM(cfg).save_pretrained(args.ckpt)
extra = {} if args.window is None else {"sliding_window": args.window}
model = MistralForCausalLM.from_pretrained(args.ckpt, torch_dtype=torch.bfloat16, attn_implementation=args.attn,
                                           **extra)
model.train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1))
with tensordiff.capture(model, args.out, steps=2, optimizer=opt) as cap:
    for step in range(2):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        cap.step(loss)
        print(f"step {step} loss {loss.item():.6f}")
