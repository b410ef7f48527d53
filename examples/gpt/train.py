"""Train the tiny GPT for a few steps with capture on: megatron-core or HF GPT-2, with optional injected faults.

    tensordiff capture -o a.h5 --steps 2 -- python examples/gpt/train.py
    tensordiff capture -o b.h5 --steps 2 -- python examples/gpt/train.py --fault gelu-tanh
    tensordiff diff a.h5 b.h5 --first-divergence

Both frameworks start from the same weights (megatron-core built from --seed, or
--load-ckpt; HF GPT-2 gets them converted) and see the same batches.
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
import torch.nn.functional as F

import tensordiff
from examples.gpt import models
from examples.gpt.models import (
    GPTSpec,
    build_hf_gpt2,
    build_mcore_gpt,
    hf_logits,
    hf_loss,
    make_batch,
    mcore_loss,
    use_split_qkv,
)

FAULTS: dict[str, str] = {
    "none": "no fault",
    "ln-eps": "forward: decoder.layers.1.pre_mlp_layernorm uses epsilon 1e-2 instead of 1e-5",
    "gelu-tanh": "forward: layer 1's MLP uses the tanh GELU instead of erf",
    "gelu-backward": "backward: layer 1's GELU backward uses the tanh-approximation derivative",
    "ckpt": "checkpoint: decoder.layers.0.self_attention.linear_qkv.weight is scaled by 1.01 after loading",
    "grad-scale": "parameter gradient: decoder.layers.1.mlp.linear_fc2.weight's gradient is halved (a missing average)",
    "optimizer-wd": "optimizer: weight decay also applied to biases and LayerNorm weights",
    "optimizer-lr": "optimizer: the learning rate is 0.9x (a schedule or a scaling that differs)",
    "optimizer-eps": "optimizer: Adam's epsilon is 1e-4 instead of 1e-8",
    "optimizer-betas": "optimizer: Adam's betas are (0.9, 0.95) instead of (0.9, 0.999) (shows from the third step)",
    "optimizer-bias-correction": "optimizer: AdamW without bias correction (as MindSpore's nn.AdamWeightDecay)",
    "split-qkv": "equivalent rewrite, not a fault: q, k, v projections as three matmuls instead of one",
    "dropout": "forward: hidden dropout 0.1 in training mode (megatron's embedding dropout and bias-dropout-add; with "
               "--framework hf, GPT-2's embd/resid/attn_pdrop)",
    "vocab-pad": f"the vocabulary padded {GPTSpec.vocab_size} -> {GPTSpec.vocab_size + 8} (a padded vocabulary size): 8 "
                 "more embedding/output rows, initialised non-zero, whose logits take part in the softmax",
    "loss-sum-per-sample": "loss: the mean over samples of each sample's sum over tokens, instead of the mean over tokens",
    "loss-mask": "loss: the masked per-token losses averaged over all tokens instead of the ones the loss mask keeps "
                 "(use with --pad-tokens)",
}
#: faults that also apply to --framework hf
HF_FAULTS = ("none", "dropout", "loss-sum-per-sample", "optimizer-lr", "optimizer-wd", "optimizer-eps",
             "optimizer-betas", "optimizer-bias-correction")


class _GeluTanhBackward(torch.autograd.Function):
    """Exact (erf) GELU forward with the tanh approximation's derivative in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return F.gelu(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            xd = x.detach().requires_grad_(True)
            (dx,) = torch.autograd.grad(F.gelu(xd, approximate="tanh"), xd, grad)
        return dx


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _padded_vocab(mcore: torch.nn.Module, spec: GPTSpec, seed: int, extra: int = 8) -> torch.nn.Module:
    """The same model with ``extra`` more vocabulary rows (random, like a fresh init of a padded vocabulary)."""
    padded_spec = GPTSpec(**{**spec.__dict__, "vocab_size": spec.vocab_size + extra})
    padded = build_mcore_gpt(padded_spec, seed=seed)
    state = {k: v for k, v in mcore.state_dict().items() if isinstance(v, torch.Tensor)}
    key = "embedding.word_embeddings.weight"
    g = torch.Generator().manual_seed(seed + 1)
    state[key] = torch.cat([state[key], spec.init_std * torch.randn(extra, state[key].shape[1], generator=g)])
    padded.load_state_dict(state, strict=False)
    return padded


def build(args: argparse.Namespace, spec: GPTSpec) -> tuple[torch.nn.Module, Callable]:
    mcore = build_mcore_gpt(spec, seed=args.seed, hidden_dropout=0.1 if args.fault == "dropout" else 0.0)
    if args.load_ckpt:
        from safetensors.torch import load_file

        state = load_file(args.load_ckpt)
        missing, unexpected = mcore.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise SystemExit(f"{args.load_ckpt}: missing {missing}, unexpected {unexpected}")
    if args.save_ckpt:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in mcore.state_dict().items() if isinstance(v, torch.Tensor)}, args.save_ckpt)
    if args.framework == "hf":
        return build_hf_gpt2(spec, mcore.state_dict(), activation=args.hf_activation,
                             dropout=0.1 if args.fault == "dropout" else 0.0), (
            hf_loss_sum_per_sample if args.fault == "loss-sum-per-sample" else hf_loss)
    layer1 = mcore.decoder.layers[min(1, spec.num_layers - 1)]
    if args.fault == "ln-eps":
        layer1.pre_mlp_layernorm.eps = 1e-2
    elif args.fault == "gelu-tanh":
        layer1.mlp.activation_func = _gelu_tanh
    elif args.fault == "gelu-backward":
        layer1.mlp.activation_func = _GeluTanhBackward.apply
    elif args.fault == "ckpt":
        with torch.no_grad():
            mcore.decoder.layers[0].self_attention.linear_qkv.weight.mul_(1.01)
    elif args.fault == "grad-scale":
        layer1.mlp.linear_fc2.weight.register_hook(lambda g: g * 0.5)
    elif args.fault == "split-qkv":
        use_split_qkv(mcore)
    elif args.fault == "vocab-pad":
        mcore = _padded_vocab(mcore, spec, args.seed)
    if args.pad_tokens or args.fault in ("loss-sum-per-sample", "loss-mask"):
        return mcore, _masked_loss(spec, args.pad_tokens, args.fault)
    return mcore, mcore_loss


def hf_loss_sum_per_sample(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """HF's logits, the cross-entropy summed over each sample's tokens, then averaged over samples (a per-sample
    normalisation, as some training scripts write it)."""
    logits = hf_logits(model, tokens).float()
    per_token = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1),
                                                  reduction="none")
    return per_token.view(labels.shape).sum(dim=1).mean()


def loss_mask(spec: GPTSpec, pad_tokens: int) -> torch.Tensor:
    """1 where a token counts in the loss: the last ``pad_tokens`` positions of the last sample are padding."""
    mask = torch.ones(spec.batch_size, spec.seq_length)
    if pad_tokens:
        mask[-1, -pad_tokens:] = 0
    return mask


def _masked_loss(spec: GPTSpec, pad_tokens: int, fault: str) -> Callable:
    """megatron-core called with ``loss_mask=`` (recorded with the batch), its per-token losses reduced as ``fault``
    says: the mean over the tokens the mask keeps (right), over all tokens, or over samples of per-sample sums."""
    mask = loss_mask(spec, pad_tokens)

    def loss(model: Any, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b, s = tokens.shape
        position_ids = torch.arange(s).unsqueeze(0).expand(b, s)
        per_token = model(tokens, position_ids, models.causal_mask(s), labels=labels, loss_mask=mask).float() * mask
        if fault == "loss-sum-per-sample":
            return per_token.sum(1).mean()
        if fault == "loss-mask":
            return per_token.sum() / mask.numel()
        return per_token.sum() / mask.sum()

    return loss


class AdamWNoBiasCorrection(torch.optim.Optimizer):
    """AdamW without bias correction, as MindSpore's ``nn.AdamWeightDecay`` computes it:
    ``W -= lr · (m / (√v + ε) + wd · W)``."""

    def __init__(self, params: Any, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["m"], state["v"] = torch.zeros_like(p), torch.zeros_like(p)
                state["m"].mul_(b1).add_(p.grad, alpha=1 - b1)
                state["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.addcdiv_(state["m"], state["v"].sqrt().add_(group["eps"]), value=-group["lr"])


def optimizer_for(model: torch.nn.Module, fault: str, lr: float) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        (no_decay if p.ndim == 1 and fault != "optimizer-wd" else decay).append(p)
    groups = [g for g in ({"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0})
              if g["params"]]
    lr *= 0.9 if fault == "optimizer-lr" else 1.0
    if fault == "optimizer-bias-correction":
        return AdamWNoBiasCorrection(groups, lr=lr)
    return torch.optim.AdamW(groups, lr=lr, eps=1e-4 if fault == "optimizer-eps" else 1e-8,
                             betas=(0.9, 0.95) if fault == "optimizer-betas" else (0.9, 0.999))


def main(argv: list[str] | None = None) -> list[float]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--framework", choices=("mcore", "hf"), default="mcore", help="megatron-core GPTModel or HF transformers "
                                                                                 "GPT-2")
    p.add_argument("--fault", choices=sorted(FAULTS), default="none", help="inject one fault (HF_FAULTS with --framework hf)")
    p.add_argument("--train-steps", type=int, default=2, help="training steps to run")
    p.add_argument("--seed", type=int, default=1234, help="seed of the initial weights")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--pad-tokens", type=int, default=0, help="the last N tokens of the last sample are padding, "
                   "masked out of the loss (megatron-core called with loss_mask=)")
    p.add_argument("--hf-activation", default="gelu_new", help="HF GPT-2's activation_function (gelu: megatron's)")
    p.add_argument("--save-ckpt", help="write the initial weights (safetensors)")
    p.add_argument("--load-ckpt", help="start from these weights (safetensors)")
    p.add_argument("--capture", help="capture file (tensordiff capture -o sets it instead)")
    p.add_argument("--capture-steps", type=int, default=2)
    p.add_argument("--capture-tensors", choices=("first", "all", "none"), default="first",
                   help="full tensors of the first captured step (default), of every step, or none")
    args = p.parse_args(argv)
    if args.fault not in HF_FAULTS and args.framework != "mcore":
        p.error(f"--fault {args.fault} applies to --framework mcore")
    spec = GPTSpec(num_layers=args.layers)
    model, loss_fn = build(args, spec)
    opt = optimizer_for(model, args.fault, args.lr)
    losses = []
    with tensordiff.capture(model, args.capture, steps=args.capture_steps, optimizer=opt,
                           tensors=args.capture_tensors) as cap:
        for step in range(args.train_steps):
            tokens, labels, _ = make_batch(spec, seed=step)
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
