"""Train a tiny mixture-of-experts GPT for a few steps with capture on: megatron-core or HF Mixtral, with or
without the router's auxiliary (load-balancing) loss.

    tensordiff capture -o a.h5 --steps 1 --tensors all -- python examples/moe/train.py --framework hf
    tensordiff capture -o b.h5 --steps 1 --tensors all -- python examples/moe/train.py --framework hf --fault aux-loss
    tensordiff diff a.h5 b.h5 --first-divergence

Both runs of one framework start from the same weights (built from --seed) and see the same batches.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch

import tensordiff
from examples.moe.models import (
    MoESpec,
    build_hf_mixtral,
    build_mcore_moe,
    clear_aux_loss_tracker,
    hf_loss,
    make_batch,
    mcore_loss,
    mcore_tracked_aux_loss,
)

FAULTS: dict[str, str] = {
    "none": "no auxiliary loss (megatron-core: moe_aux_loss_coeff 0; HF: output_router_logits=False)",
    "aux-loss": "the load-balancing loss × --aux-coeff (megatron-core: moe_aux_loss_coeff, a gradient added in "
                "backward, the loss value unchanged; HF: output_router_logits=True, router_aux_loss_coef, added to "
                "the loss)",
    "aux-loss-reported": "megatron-core: moe_aux_loss_coeff as aux-loss, and the reported loss adds the tracked "
                         "load-balancing losses (as MindFormers' reported loss does)",
    "z-loss": "megatron-core: the router z-loss × --aux-coeff (moe_z_loss_coeff), a gradient added in backward",
    "loss-scale": "megatron-core: the loss × 1.05, no auxiliary loss (another loss fault, for contrast)",
}
HF_FAULTS = ("none", "aux-loss")


def build(args: argparse.Namespace, spec: MoESpec) -> tuple[torch.nn.Module, Callable]:
    if args.framework == "hf":
        model = build_hf_mixtral(spec, seed=args.seed, aux_coeff=args.aux_coeff,
                                 output_router_logits=args.fault == "aux-loss")
        return model, lambda m, tokens, labels: hf_loss(m, tokens, tokens)  # HF shifts the labels itself
    aux = args.aux_coeff if args.fault in ("aux-loss", "aux-loss-reported") else 0.0
    z = args.aux_coeff if args.fault == "z-loss" else None
    model = build_mcore_moe(spec, seed=args.seed, aux_coeff=aux, z_coeff=z)
    if args.fault == "aux-loss-reported":
        def reported(m: Any, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return mcore_loss(m, tokens, labels) + mcore_tracked_aux_loss(m)

        return model, reported
    if args.fault == "loss-scale":
        return model, lambda m, tokens, labels: 1.05 * mcore_loss(m, tokens, labels)
    return model, mcore_loss


def main(argv: list[str] | None = None) -> list[float]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--framework", choices=("mcore", "hf"), default="mcore",
                   help="megatron-core GPTModel with MoE layers or HF transformers' MixtralForCausalLM")
    p.add_argument("--fault", choices=sorted(FAULTS), default="none", help="; ".join(f"{k}: {v}" for k, v in
                                                                               FAULTS.items()))
    p.add_argument("--aux-coeff", type=float, default=None,
                   help="the auxiliary loss's coefficient (default: 0.01 for megatron-core, 0.02 for HF)")
    p.add_argument("--train-steps", type=int, default=1, help="training steps to run")
    p.add_argument("--seed", type=int, default=1234, help="seed of the initial weights")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--capture", help="capture file (tensordiff capture -o sets it instead)")
    p.add_argument("--capture-steps", type=int, default=1)
    p.add_argument("--capture-tensors", choices=("first", "all", "none"), default="all",
                   help="full tensors of every captured step (default), of the first, or none")
    args = p.parse_args(argv)
    if args.framework == "hf" and args.fault not in HF_FAULTS:
        p.error(f"--fault {args.fault} applies to --framework mcore")
    if args.aux_coeff is None:
        args.aux_coeff = 0.02 if args.framework == "hf" else 0.01
    spec = MoESpec(num_layers=args.layers)
    model, loss_fn = build(args, spec)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    with tensordiff.capture(model, args.capture, steps=args.capture_steps, optimizer=opt,
                            tensors=args.capture_tensors) as cap:
        for step in range(args.train_steps):
            tokens, labels = make_batch(spec, seed=step)
            if args.framework == "mcore":
                clear_aux_loss_tracker()  # this step's aux losses only (a training loop clears after logging)
            loss = loss_fn(model, tokens, labels)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            cap.step(loss)
            losses.append(loss.item())
            print(f"step {step}: loss {loss.item():.6f}", flush=True)
    return losses


if __name__ == "__main__":
    main()
