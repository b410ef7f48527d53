"""Train the tiny megatron-core GPT on the CPU with statistics captured every step, optionally with a fault that
starts late in one layer. Test data for tests/test_runs_drift.py (and the docs' example of ``runs``' drift table).

    python tests/scripts/drift_gpt.py -o a.h5 --steps 30
    python tests/scripts/drift_gpt.py -o b.h5 --steps 30 --fault-layer 1 --fault-step 15 --fault-scale 1e-3

The fault: from iteration ``--fault-step`` on (iterations counted from 1, as ``tensordiff runs`` counts them), the
weight of ``decoder.layers.<L>.pre_mlp_layernorm`` is multiplied by (1 + scale) before each iteration, so the
weights that iteration uses, and everything computed from them, are the first to differ (``--hf``: the same
fault in ``transformer.h.<L>.ln_2``). ``--no-grads`` captures
without gradients of module outputs (records on one side only); ``--steps`` shorter than the other run's leaves
steps on one side only.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
warnings.filterwarnings("ignore")

import torch  # noqa: E402

import tensordiff  # noqa: E402
from examples.gpt.models import GPTSpec, build_hf_gpt2, build_mcore_gpt, hf_loss, make_batch, mcore_loss  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-o", "--output", help="the capture (statistics only, every step); none: no capture")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--fault-layer", type=int, help="the layer whose pre-MLP norm weight is scaled")
    p.add_argument("--fault-step", type=int, default=15, help="the first iteration with the fault (from 1)")
    p.add_argument("--fault-scale", type=float, default=1e-3)
    p.add_argument("--no-grads", action="store_true", help="capture without gradients of module outputs and inputs")
    p.add_argument("--hf", action="store_true", help="train Hugging Face's GPT2LMHeadModel carrying the same starting "
                                                     "weights instead (another framework's names and layouts)")
    args = p.parse_args()
    torch.set_num_threads(1)
    spec = GPTSpec(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=4)
    model = build_mcore_gpt(spec, seed=args.seed)
    loss_of = mcore_loss
    if args.hf:
        model = build_hf_gpt2(spec, model.state_dict(), activation="gelu")  # the erf GELU, as the mcore model's
        loss_of = hf_loss
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    norm = None
    if args.fault_layer is not None:
        norm = (model.transformer.h[args.fault_layer].ln_2.weight if args.hf
                else model.decoder.layers[args.fault_layer].pre_mlp_layernorm.weight)
    batches = [make_batch(spec, seed=i) for i in range(args.steps)]
    t0 = time.perf_counter()
    with tensordiff.capture(model, args.output, steps=args.steps, optimizer=opt, tensors="none",
                            grads=not args.no_grads) as cap:
        for it, (tokens, labels, _) in enumerate(batches, start=1):
            if norm is not None and it >= args.fault_step:
                with torch.no_grad():
                    norm.mul_(1 + args.fault_scale)
            loss = loss_of(model, tokens, labels)
            loss.backward()
            opt.step()
            opt.zero_grad()
            cap.step(loss)
            print(f" iteration {it:8d}/{args.steps:8d} | lm loss: {loss.item():.6E} |", flush=True)
    print(f"{args.steps} steps in {time.perf_counter() - t0:.2f} s", flush=True)


if __name__ == "__main__":
    main()
