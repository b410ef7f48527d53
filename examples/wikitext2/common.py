"""What both trainings share (no framework imported here): the model shape, the schedule, the data.

The model is GPT-2's design scaled down to train on a CPU in minutes: LayerNorm, tanh GELU (GPT-2's
own, and MindFormers' default), learned absolute positions, biases, embeddings tied to the output
layer. Adam as both frameworks ship it (torch.optim.AdamW, MindFormers' AdamW) with the same
per-step learning rate, no weight decay on biases and norms, gradient clipping at 1.0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import h5py
import numpy as np

from examples.megatron_vs_mindformers.spec import Spec


@dataclass(frozen=True)
class Train:
    steps: int = 300
    batch_size: int = 4
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup: int = 30
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    clip_grad: float = 1.0
    eval_interval: int = 25
    eval_batches: int = 4


def model_spec(vocab_size: int, seq_length: int, batch_size: int, gelu: str = "tanh") -> Spec:
    return Spec(family="gpt2", num_layers=2, hidden_size=128, ffn_hidden_size=512, num_attention_heads=4,
                num_query_groups=4, vocab_size=vocab_size, seq_length=seq_length, batch_size=batch_size,
                init_std=0.02, layernorm_epsilon=1e-5, gelu=gelu)


def learning_rates(t: Train) -> list[float]:
    """Linear warm-up, then cosine decay to ``min_lr`` (Megatron-LM's and MindFormers' usual schedule)."""
    out = []
    for step in range(t.steps):
        if step < t.warmup:
            out.append(t.lr * (step + 1) / t.warmup)
        else:
            progress = (step - t.warmup) / max(1, t.steps - t.warmup)
            out.append(t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * progress)))
    return out


def decays(name: str, ndim: int) -> bool:
    """Megatron's default: weight decay on matrices only (not on biases, norm weights)."""
    return ndim > 1


class Tokens:
    """The file prepare.py writes: ``train`` and ``valid`` windows of seq+1 token ids (compact vocabulary),
    the training windows already in the shared batch order."""

    def __init__(self, path: str):
        with h5py.File(path, "r") as f:
            self.train = f["train"][()]
            self.valid = f["valid"][()]
            self.vocab_size = int(f.attrs["vocab_size"])
            self.seq_length = int(f.attrs["seq_length"])

    def batch(self, step: int, batch_size: int) -> np.ndarray:
        n = len(self.train) // batch_size
        i = step % n
        return self.train[i * batch_size:(i + 1) * batch_size]

    def valid_batches(self, batch_size: int, count: int) -> list[np.ndarray]:
        return [self.valid[i * batch_size:(i + 1) * batch_size] for i in range(count)
                if (i + 1) * batch_size <= len(self.valid)]
