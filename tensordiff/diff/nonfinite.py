"""The first NaN or Inf of a run, in execution order: step by step, the parameters as the step began, the forward
pass, the loss, the backward pass as it ran, the parameter gradients (read from the index's NaN/Inf counts: no
tensor is read)."""

from __future__ import annotations

from ..record import Record
from ..store import CaptureReader


def first_nonfinite(cap: CaptureReader) -> Record | None:
    """The first record of ``cap`` holding a NaN or an Inf, or None."""
    for step in cap.steps:
        for rec in cap.records(step):
            if rec.nan or rec.inf:
                return rec
    return None


def describe(rec: Record | None) -> str | None:
    """``step 1 backward decoder.layers.3.mlp grad_output.0: 12 NaN, 0 Inf of 4096 values`` (None: none)."""
    if rec is None:
        return None
    return f"step {rec.step} {rec.phase} {rec.label}: {rec.nan} NaN, {rec.inf} Inf of {rec.numel} values"
