"""Train the GPT-2-shaped megatron-core GPTModel on WikiText-2 (CPU, FP32), with tensordiff on.

    python examples/wikitext2/megatron_train.py --tokens tokens.h5 --save-ckpt init.safetensors \\
        --capture megatron.h5 --log megatron.log

The capture holds every tensor of the first step and the loss, grad norm, learning rate and
validation loss of every step (``cap.step(loss, grad_norm=..., lr=...)``, ``cap.log(val_loss=...)``).
``--log`` also writes Megatron-LM's log lines (``iteration N/ M | ... | lm loss: ...``), the way
Megatron-LM's training loop prints them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch

import tensordiff
from examples.megatron_vs_mindformers.megatron_side import build_mcore, state_for_saving
from examples.wikitext2.common import Tokens, Train, decays, learning_rates, model_spec


def _megatron_bf16(model, t: Train):
    """Megatron-LM's BF16 recipe: BF16 parameters behind Float16Module, gradients in megatron-core's DDP
    buffers (FP32), megatron-core's optimizer with FP32 main weights, clipping and the same Adam settings.
    Returns (optimizer, the DDP-wrapped model to train)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    model.config.bf16 = True
    model.config.params_dtype = torch.bfloat16
    model = Float16Module(model.config, model)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay,
                        adam_beta1=t.betas[0], adam_beta2=t.betas[1], adam_eps=t.eps, clip_grad=t.clip_grad,
                        bf16=True, params_dtype=torch.bfloat16), [ddp])
    return opt, ddp


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", required=True, help="written by prepare.py")
    p.add_argument("--steps", type=int, default=Train.steps)
    p.add_argument("--seed", type=int, default=1234, help="seed of the initial weights")
    p.add_argument("--save-ckpt", help="write the initial weights here (safetensors, megatron-core names)")
    p.add_argument("--capture", help="tensordiff capture file")
    p.add_argument("--log", help="also write Megatron-LM style log lines here")
    p.add_argument("--gelu", choices=("tanh", "erf"), default="tanh",
                   help="tanh: GPT-2's and MindFormers' GELU (default); erf: torch's F.gelu default")
    p.add_argument("--load-ckpt", help="start from these weights (safetensors, megatron-core names)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--bf16", action="store_true",
                   help="BF16 as Megatron-LM trains it: Float16Module, megatron-core's DDP and optimizer (FP32 main "
                        "weights and gradients); needs --device cuda")
    args = p.parse_args(argv)
    t = Train(steps=args.steps)
    data = Tokens(args.tokens)
    spec = model_spec(data.vocab_size, data.seq_length, t.batch_size, gelu=args.gelu)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))

    model = build_mcore(spec, args.seed, args.device)
    if args.load_ckpt:
        from safetensors.torch import load_file

        model.load_state_dict(load_file(args.load_ckpt), strict=False)
    if args.save_ckpt:
        from safetensors.torch import save_file

        save_file(state_for_saving(model), args.save_ckpt)
    dev = torch.device(args.device)
    model = model.to(dev)
    if args.bf16:
        opt, model = _megatron_bf16(model, t)
    else:
        named = list(model.named_parameters())
        opt = torch.optim.AdamW(
            [{"params": [p for n, p in named if decays(n, p.ndim)], "weight_decay": t.weight_decay},
             {"params": [p for n, p in named if not decays(n, p.ndim)], "weight_decay": 0.0}],
            lr=t.lr, betas=t.betas, eps=t.eps)
    lrs = learning_rates(t)
    seq = data.seq_length
    position_ids = torch.arange(seq, device=dev).unsqueeze(0).expand(t.batch_size, seq)
    # True = masked; one per sample, as MindFormers builds it (a [1, 1, S, S] mask broadcasts the same)
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=dev), diagonal=1).expand(t.batch_size, 1, seq, seq)

    def lm_loss(window) -> torch.Tensor:
        ids = torch.from_numpy(window).long().to(dev)
        per_token = model(ids[:, :-1], position_ids[:len(ids)], causal, labels=ids[:, 1:])  # [B, S]
        return per_token.float().mean()

    log = open(args.log, "w") if args.log else None  # noqa: SIM115 - written through the loop, closed at the end
    started = time.time()
    with tensordiff.capture(model, args.capture, steps=1, optimizer=opt.optimizer if args.bf16 else opt) as cap:
        for step in range(t.steps):
            for group in opt.param_groups:
                group["lr"] = lrs[step]
            t0 = time.time()
            if args.bf16:
                model.zero_grad_buffer()
                opt.zero_grad()
            loss = lm_loss(data.batch(step, t.batch_size))
            loss.backward()
            if args.bf16:
                model.finish_grad_sync()
                _, grad_norm, _ = opt.step()  # clips at config.clip_grad, returns the norm before clipping
                grad_norm = torch.tensor(grad_norm)
            else:
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip_grad)
                opt.step()
                opt.zero_grad(set_to_none=True)
            cap.step(loss, grad_norm=grad_norm, lr=lrs[step])
            it = step + 1
            line = (f" iteration {it:8d}/{t.steps:8d} | consumed samples: {it * t.batch_size:12d} | "
                    f"elapsed time per iteration (ms): {(time.time() - t0) * 1000:.1f} | learning rate: {lrs[step]:.6E} | "
                    f"global batch size: {t.batch_size:5d} | lm loss: {loss.item():.6E} | loss scale: 1.0 | "
                    f"grad norm: {grad_norm.item():.3f} | number of skipped iterations:   0 | "
                    f"number of nan iterations:   0 |")
            if log:
                print(line, file=log, flush=True)
            if it % t.eval_interval == 0 or it == t.steps:
                with torch.no_grad():
                    losses = [lm_loss(w).item() for w in data.valid_batches(t.batch_size, t.eval_batches)]
                val = sum(losses) / len(losses)
                cap.log(val_loss=val)  # lands on the step just ended
                if log:
                    print(f" validation loss at iteration {it} | lm loss value: {val:.6E} | "
                          f"lm loss PPL: {torch.tensor(val).exp().item():.6E} |", file=log, flush=True)
                print(f"megatron-core step {it}/{t.steps}: loss {loss.item():.4f}, validation loss {val:.4f} "
                      f"({time.time() - started:.0f} s)", flush=True)
    if log:
        log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
