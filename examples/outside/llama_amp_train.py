# A user's script: a tiny Llama (GQA, untied) trained 2 AdamW steps from one saved checkpoint, either the way the
# Hugging Face Trainer does bf16=True (FP32 weights, torch.autocast to BF16) or loaded straight in BF16
# (from_pretrained(torch_dtype=torch.bfloat16)). It records itself with tensordiff.capture, as docs/guide.md shows.
import argparse
import contextlib
import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import tensordiff

p = argparse.ArgumentParser()
p.add_argument("--mode", choices=("autocast", "bf16"), required=True)
p.add_argument("--eps", type=float, help="train with this RMSNorm epsilon (default: the checkpoint's, 1e-6)")
p.add_argument("--ckpt", default="llama_ckpt")
p.add_argument("-o", "--out", required=True)
args = p.parse_args()
torch.manual_seed(0)
if not os.path.isdir(args.ckpt):
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    LlamaForCausalLM(cfg).save_pretrained(args.ckpt)
dtype = torch.float32 if args.mode == "autocast" else torch.bfloat16
extra = {} if args.eps is None else {"rms_norm_eps": args.eps}
model = LlamaForCausalLM.from_pretrained(args.ckpt, torch_dtype=dtype, **extra)
model.train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1))
amp = torch.autocast("cpu", dtype=torch.bfloat16) if args.mode == "autocast" else contextlib.nullcontext()
with tensordiff.capture(model, args.out, steps=2, optimizer=opt) as cap:
    for step in range(2):
        with amp:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        cap.step(loss)
        print(f"step {step} loss {loss.item():.6f}")
