"""Train one side of a matrix pair for a few steps, the way its users write the loop: no tensordiff import.

    python examples/pairs/train.py --arch '{"norm": "LayerNorm"}' --side '{"family": "hf-llama"}' \
        --weights w.safetensors --steps 2

``--weights`` holds the starting weights in megatron-core names (``models.random_state``); every family converts
them. ``tensordiff capture --auto`` records it unmodified (``matrix.py`` runs it so).

``--device cuda`` builds the model as on the CPU, then moves it to the GPU (Megatron-LM's ``.cuda()`` after building;
a Hugging Face model's ``.to("cuda")``), with the batch drawn on the CPU and moved there: one batch on every device.
``--optim adamw`` trains with ``torch.optim.AdamW`` (``--lr`` then defaults to 1e-3) instead of SGD (default, lr 0.1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from examples.pairs.models import Arch, Style, apply_fault, build


def batch(arch: Arch) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, arch.vocab, (arch.batch, arch.seq + 1), generator=gen)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="{}", help="models.Arch fields, as JSON")
    p.add_argument("--side", required=True, help='{"family": ..., "style": {...}, "fault": ...}')
    p.add_argument("--weights", required=True)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--lr", type=float, help="learning rate (default: 0.1 for SGD, 1e-3 for AdamW)")
    p.add_argument("--optim", choices=("sgd", "adamw"), default="sgd")
    p.add_argument("--device", default="cpu", help="'cpu' (default) or 'cuda'")
    args = p.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
    arch = Arch(**json.loads(args.arch))
    side = json.loads(args.side)
    family, style, fault = side["family"], Style(**side.get("style", {})), side.get("fault", "")
    model = build(family, arch, style, load_file(args.weights))
    apply_fault(model, family, fault, arch)
    if device.type != "cpu":
        model = model.to(device)  # after the fault: a replaced buffer (the RoPE table) moves with the rest
    model.train()
    if args.optim == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr or 1e-3)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=args.lr or 0.1)
    tokens, labels = (t.to(device) for t in batch(arch))
    b, s = tokens.shape
    for step in range(args.steps):
        if family == "mcore":
            positions = torch.arange(s, device=device).unsqueeze(0).expand(b, s)
            causal = torch.ones(s, s, dtype=torch.bool, device=device).triu(1)[None, None]  # True = masked
            if style.call == "pos":
                per_token = model(tokens, positions, causal, labels=labels)
            else:
                per_token = model(input_ids=tokens, position_ids=positions, attention_mask=causal, labels=labels)
            loss = per_token.float().mean()
        else:
            if family == "plain":
                mask = torch.ones(s, s, dtype=torch.bool, device=device).triu(1) if style.mask == "passed" else None
                logits = model(tokens, mask) if style.call == "pos" else model(tokens, mask=mask)
            else:
                kwargs = {"attention_mask": torch.ones(b, s, dtype=torch.long, device=device)} if style.mask == "passed" else {}
                logits = model(input_ids=tokens, **kwargs).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"{family} step {step}: loss {loss.item():.6f}", flush=True)


if __name__ == "__main__":
    main()
