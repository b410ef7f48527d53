"""One training run as per-step scalars: loss, grad norm, learning rate, validation loss."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Run:
    """The scalars of one run by step (steps numbered from 1, as the training logs do)."""

    path: str
    kind: str
    """'megatron-lm log', 'mindformers log', 'tensorboard events' or 'tensordiff capture'."""
    loss: dict[int, float] = field(default_factory=dict)
    grad_norm: dict[int, float] = field(default_factory=dict)
    lr: dict[int, float] = field(default_factory=dict)
    val_loss: dict[int, float] = field(default_factory=dict)
    relogged: set[int] = field(default_factory=set)
    """steps logged more than once (a restart from a checkpoint): the last value is kept"""

    def put(self, what: str, step: int, value: float) -> None:
        """Record ``what`` ('loss', 'grad_norm', 'lr' or 'val_loss') of ``step``; a later value wins."""
        if what == "loss" and step in self.loss:
            self.relogged.add(step)
        getattr(self, what)[step] = value

    def describe(self) -> str:
        text = f"{self.path} ({self.kind}, {len(self.loss)} steps"
        if self.relogged:
            lo, hi = min(self.relogged), max(self.relogged)
            which = f"step {lo}" if lo == hi else f"{len(self.relogged)} steps in {lo}..{hi}"
            text += f"; {which} logged again after a restart, the later values kept"
        return text + ")"
