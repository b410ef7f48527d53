"""Train one side of a family pair for a few AdamW steps, the way its user writes the loop (no tensordiff import).

    python examples/families/train.py --family gemma --side mcore --dtype float32 --steps 2
    tensordiff capture --auto -o mcore.h5 -- python examples/families/train.py --family gemma --side mcore

Both sides start from one HF initialisation (``--seed``): the mcore side converts it (``build.hf_to_mcore``).
``--fault`` (``table.FAULTS``, all of them mistakes of the megatron-core conversion) is only taken with
``--side mcore``. AdamW runs without weight decay: decoupled decay of Gemma's norm weights would shrink w on the HF
side and 1+w on the megatron side (Megatron-LM leaves norms out of weight decay anyway).
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.nn.functional as F

from examples.families.build import batch, build_hf, build_mcore
from examples.families.table import FAMILIES, FAULTS


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--family", required=True, choices=sorted(FAMILIES))
    p.add_argument("--side", required=True, choices=("mcore", "hf"))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"), help="HF attention implementation")
    p.add_argument("--fault", default="", choices=("", *sorted(FAULTS)))
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="'cpu' (default) or 'cuda': built on the CPU, then moved there")
    args = p.parse_args()
    torch.set_num_threads(1)
    family = FAMILIES[args.family]
    if args.fault and args.side != "mcore":
        p.error(f"fault {args.fault!r} is a mistake of the megatron-core side: use --side mcore")
    if args.fault and args.fault not in family.faults:
        p.error(f"fault {args.fault!r} does not apply to {args.family} (its faults: {', '.join(family.faults)})")

    model = build_hf(family, args.dtype, args.attn, seed=args.seed)
    if args.side == "mcore":  # the HF initialisation converted to megatron-core, the HF model dropped
        model = build_mcore(family, args.dtype, model.state_dict(), args.fault, seed=args.seed)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
        model = model.to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    tokens, labels = (t.to(device) for t in batch(family.hf_config().vocab_size))  # drawn on the CPU: one batch
    b, s = tokens.shape
    positions = torch.arange(s, device=device).unsqueeze(0).expand(b, s)
    causal = torch.ones(s, s, dtype=torch.bool, device=device).triu(1)[None, None]  # True = masked
    for step in range(args.steps):
        opt.zero_grad()
        if args.side == "mcore":
            per_token = model(input_ids=tokens, position_ids=positions, attention_mask=causal, labels=labels)
            loss = per_token.float().mean()
        else:
            logits = model(input_ids=tokens).logits
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))
        loss.backward()
        opt.step()
        print(f"step {step}: loss {loss.item():.6f}", flush=True)


if __name__ == "__main__":
    main()
