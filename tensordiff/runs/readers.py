"""Whole training runs side by side: loss, perplexity and grad-norm curves of two frameworks.

Readers, by what the file holds (sniffed, not by name):

* Megatron-LM training logs: ``iteration N/ M | ... | lm loss: X | ... | grad norm: Y | ...`` and
  ``validation loss at iteration N | lm loss value: X | lm loss PPL: P``;
* MindFormers logs: ``{ Epoch:[e/E], step:[s/S], loss: X, ... global_norm: [Y] ...}`` (the step is
  made global: s + (e-1)·S), also the ``loss:[X/mean]`` form;
* TensorBoard event files (``events.out.tfevents.*``, as MindFormers, Megatron-LM and tensorboardX
  write them): scalars ``loss``/``lm loss``, ``grad-norm``, ``learning-rate``, ``lm loss validation``;
* tensordiff captures (``.h5``): the per-step scalars given to ``cap.step(loss, grad_norm=..., lr=...)``
  and ``cap.log(val_loss=...)`` for every step of the run, else the loss of each captured step.

Framework-free: plain text, HDF5 (``tensordiff.store``) and ``tfevents``.
"""

from __future__ import annotations

import os
import re
import struct

from ..errors import RunsError, TensordiffError
from ..store import CaptureFile
from .run import Run
from .tfevents import TB_TAGS, read_tfevents

_NUM = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|nan|inf)"
_MEGATRON_ITER = re.compile(r"\biteration\s+(\d+)\s*/\s*\d+\s*\|")
_MEGATRON_FIELD = re.compile(r"\|\s*([a-zA-Z][a-zA-Z0-9 _\-()/]*?):\s*" + _NUM)
_MEGATRON_VAL = re.compile(r"validation loss at iteration\s+(\d+)\s*\|(.*)")
_MF_STEP = re.compile(r"\{\s*Epoch:\[\s*(\d+)\s*/\s*(\d+)\s*\],\s*step:\[\s*(\d+)\s*/\s*(\d+)\s*\],\s*(.*)")
_MF_LOSS = re.compile(r"loss:\s*\[?\s*" + _NUM)
_MF_NORM = re.compile(r"global_norm:\s*\[?\s*" + _NUM)
_MF_LR = re.compile(r"\blr:\s*\[?\s*" + _NUM)


def _parse_megatron(line: str, run: Run) -> bool:
    m = _MEGATRON_VAL.search(line)
    if m:
        fields = {k.strip(): v for k, v in _MEGATRON_FIELD.findall("|" + m.group(2))}
        value = fields.get("lm loss value")
        if value is not None:
            run.val_loss[int(m.group(1))] = float(value)
            return True
        return False
    m = _MEGATRON_ITER.search(line)
    if not m:
        return False
    step = int(m.group(1))
    fields = {k.strip(): v for k, v in _MEGATRON_FIELD.findall(line[m.end() - 1:])}
    if "lm loss" not in fields:
        return False
    run.put("loss", step, float(fields["lm loss"]))
    if "grad norm" in fields:
        run.grad_norm[step] = float(fields["grad norm"])
    if "learning rate" in fields:
        run.lr[step] = float(fields["learning rate"])
    return True


def _parse_mindformers(line: str, run: Run) -> bool:
    m = _MF_STEP.search(line)
    if not m:
        return False
    epoch, step, per_epoch, rest = int(m.group(1)), int(m.group(3)), int(m.group(4)), m.group(5)
    loss = _MF_LOSS.search(rest)
    if not loss:
        return False
    global_step = step + (epoch - 1) * per_epoch
    run.put("loss", global_step, float(loss.group(1)))
    norm = _MF_NORM.search(rest)
    if norm:
        run.grad_norm[global_step] = float(norm.group(1))
    lr = _MF_LR.search(rest)
    if lr:
        run.lr[global_step] = float(lr.group(1))
    return True


def _read_capture(path: str) -> Run:
    """A capture's per-step scalars (``cap.step(loss, grad_norm=...)``, every step of the run), or else
    the loss of each captured step."""
    run = Run(path, "tensordiff capture")
    try:
        with CaptureFile(path) as cap:
            # a capture counts steps from 0; the logs count iterations from 1: step k is iteration k + 1
            for name, values in cap.scalars().items():
                what = TB_TAGS.get(name)
                if what is not None:
                    getattr(run, what).update({step + 1: v for step, v in values.items()})
            if not run.loss:
                for step in cap.steps:
                    loss = cap.step_attrs(step).get("loss")
                    if loss is not None:
                        run.loss[step + 1] = float(loss)
    except TensordiffError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise RunsError(f"{path}: unreadable capture ({err}); capture the run again") from None
    if not run.loss:
        raise RunsError(f"{path}: the capture has no loss for any step; call cap.step(loss) in the training loop")
    return run


def read_run(path: str) -> Run:
    """Read a training log or a capture; the format is recognised from the content."""
    if not os.path.exists(path):
        raise RunsError(f"{path}: no such file; pass a Megatron-LM or MindFormers training log, or a tensordiff capture")
    with open(path, "rb") as fh:
        head = fh.read(8)
    if os.path.basename(path).startswith("events.out.tfevents"):
        with open(path, "rb") as fh:
            data = fh.read()
        try:
            return read_tfevents(path, data)
        except (ValueError, IndexError, struct.error):
            raise RunsError(f"{path}: not a readable TensorBoard event file (corrupt record); pass the training log "
                            "instead") from None
    if head.startswith(b"\x89HDF"):
        return _read_capture(path)
    with open(path, encoding="utf-8", errors="replace") as fh:
        lines = fh.readlines()
    for kind, parse in (("megatron-lm log", _parse_megatron), ("mindformers log", _parse_mindformers)):
        run = Run(path, kind)
        hits = sum(parse(line, run) for line in lines)
        if hits:
            return run
    first = next((line.strip() for line in lines if line.strip()), "")
    raise RunsError(f"{path}: no line in a known format (Megatron-LM 'iteration N/M | ... | lm loss: X', MindFormers "
                    f"'{{ Epoch:[..], step:[..], loss: X', or a tensordiff capture); the first line reads "
                    f"{first[:120]!r}")
