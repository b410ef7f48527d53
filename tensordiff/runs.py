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

Framework-free: plain text, HDF5, and a small reader of TFRecord-framed ``Event`` protobufs.
"""

from __future__ import annotations

import math
import os
import re
import struct
from dataclasses import dataclass, field
from typing import Any

from .errors import TensordiffError


class RunsError(TensordiffError):
    """A run file is missing or in no format tensordiff reads."""


@dataclass
class Run:
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
        fields = dict((k.strip(), v) for k, v in _MEGATRON_FIELD.findall("|" + m.group(2)))
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


#: TensorBoard tags -> what they are (the first tags are MindFormers' and Megatron-LM's own).
TB_TAGS = {
    "loss": "loss", "lm loss": "loss", "lm_loss": "loss", "train/loss": "loss", "train_loss": "loss",
    "grad-norm": "grad_norm", "grad_norm": "grad_norm", "global_norm": "grad_norm",
    "learning-rate": "lr", "learning_rate": "lr", "lr": "lr",
    "lm loss validation": "val_loss", "validation loss": "val_loss", "val/loss": "val_loss", "eval_loss": "val_loss",
    "val_loss": "val_loss",
}


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _fields(buf: bytes):
    """(field number, wire type, value) of a protobuf message; length-delimited values as bytes."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos:pos + 8], pos + 8
        elif wire == 2:
            size, pos = _varint(buf, pos)
            value, pos = buf[pos:pos + size], pos + size
        elif wire == 5:
            value, pos = buf[pos:pos + 4], pos + 4
        else:
            raise ValueError(f"wire type {wire}")
        yield number, wire, value


def _tensor_scalar(buf: bytes) -> float | None:
    """A scalar TensorProto (dtype float/double): float_val (5) or double_val (6) or tensor_content (4)."""
    dtype = None
    for number, wire, value in _fields(buf):
        if number == 1 and wire == 0:
            dtype = value
        elif number == 5:
            return struct.unpack("<f", value[:4])[0] if wire == 2 else struct.unpack("<f", value)[0]
        elif number == 6:
            return struct.unpack("<d", value[:8])[0]
        elif number == 4 and len(value) in (4, 8):
            return struct.unpack("<f" if (dtype in (None, 1) and len(value) == 4) else "<d", value)[0]
    return None


def _read_tfevents(path: str, data: bytes) -> Run:
    run = Run(path, "tensorboard events")
    pos = 0
    while pos + 12 <= len(data):
        (length,) = struct.unpack("<Q", data[pos:pos + 8])
        record = data[pos + 12:pos + 12 + length]
        pos += 12 + length + 4
        if len(record) < length:
            raise RunsError(f"{path}: truncated TensorBoard event file (a record of {length} bytes is cut short); "
                            "copy the file again once the run has flushed it")
        step = 0
        values: list[tuple[str, float]] = []
        for number, wire, value in _fields(record):
            if number == 2 and wire == 0:
                step = value
            elif number == 5 and wire == 2:  # Summary
                for n2, w2, val in _fields(value):
                    if n2 != 1 or w2 != 2:
                        continue
                    tag, scalar = "", None
                    for n3, w3, v3 in _fields(val):
                        if n3 == 1 and w3 == 2:
                            tag = v3.decode("utf-8", "replace")
                        elif n3 == 2 and w3 == 5:
                            scalar = struct.unpack("<f", v3)[0]
                        elif n3 == 8 and w3 == 2:
                            scalar = _tensor_scalar(v3)
                    if tag and scalar is not None:
                        values.append((tag, float(scalar)))
        for tag, scalar in values:
            what = TB_TAGS.get(tag.strip().lower())
            if what is not None:
                run.put(what, step, scalar)
    if not run.loss:
        raise RunsError(f"{path}: a TensorBoard event file with no loss scalar (tags read: {', '.join(sorted(TB_TAGS))}); "
                        "pass the training log instead")
    return run


def _read_capture(path: str) -> Run:
    """A capture's per-step scalars (``cap.step(loss, grad_norm=...)``, every step of the run), or else
    the loss of each captured step."""
    from .store import Capture

    run = Run(path, "tensordiff capture")
    try:
        with Capture(path) as cap:
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
            return _read_tfevents(path, data)
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


@dataclass
class Comparison:
    a: Run
    b: Run
    steps: list[int]
    threshold: float
    warmup: int
    rel_loss: dict[int, float]
    mean_rel_loss: float
    max_rel_loss: float
    max_rel_step: int | None
    first_over: int | None
    final_loss: tuple[float, float] | None
    final_ppl: tuple[float, float] | None
    val: tuple[int, float, float] | None
    grad_norm_mean_rel: float | None
    grad_norm_max_rel: float | None
    window: tuple[int, int] | None = None
    """only steps in [lo, hi] are judged (``--window``)"""
    failures: list[str] = field(default_factory=list)
    """the user thresholds that failed, in words (the loss threshold first)"""
    ppl_threshold: float | None = None
    grad_norm_threshold: float | None = None

    @property
    def passed(self) -> bool:
        return not self.failures

    def measures(self) -> list[tuple[str, str, str, str]]:
        """(measure, A, B, relative) rows of the report, as text (the terminal table and the HTML share them)."""
        rows = [("mean relative loss error", "", "", pct(self.mean_rel_loss))]
        if self.max_rel_step is not None:
            s = self.max_rel_step
            rows.append((f"max relative loss error (step {s})", f"{self.a.loss[s]:.6g}", f"{self.b.loss[s]:.6g}",
                         pct(self.max_rel_loss)))
        if self.final_loss and self.final_ppl:
            (la, lb), (pa, pb) = self.final_loss, self.final_ppl
            rows.append((f"final training loss (step {self.steps[-1]})", f"{la:.6g}", f"{lb:.6g}", pct(_rel(la, lb))))
            rows.append(("final training perplexity", f"{pa:.6g}", f"{pb:.6g}", pct(_rel(pa, pb))))
        if self.val is not None:
            step, la, lb = self.val
            pa, pb = _ppl(la), _ppl(lb)
            rows.append((f"validation loss (step {step})", f"{la:.6g}", f"{lb:.6g}", pct(_rel(la, lb))))
            rows.append((f"validation perplexity (step {step})", f"{pa:.6g}", f"{pb:.6g}", pct(_rel(pa, pb))))
        if self.grad_norm_mean_rel is not None:
            rows.append(("grad norm, mean / max relative difference", "", "",
                         f"{pct(self.grad_norm_mean_rel)} / {pct(self.grad_norm_max_rel)}"))
        return rows

    def judged_text(self) -> str:
        if self.window is not None:
            return f"in steps {max(self.window[0], self.warmup + 1)}..{min(self.window[1], self.steps[-1])}"
        return f"after step {self.warmup}"

    def verdict(self) -> str:
        if self.passed:
            text = f"PASS: the relative loss error stays within {_thr(self.threshold)} {self.judged_text()}"
            extra = [f"perplexity within {_thr(self.ppl_threshold)}" if self.ppl_threshold is not None else "",
                     f"grad norm within {_thr(self.grad_norm_threshold)}" if self.grad_norm_threshold is not None else ""]
            extra = [e for e in extra if e]
            return text + ("; " + ", ".join(extra) if extra else "") + "."
        return "FAIL: " + "; ".join(self.failures) + "."

    def as_dict(self) -> dict[str, Any]:
        def clean(v: Any) -> Any:
            return None if isinstance(v, float) and not math.isfinite(v) else v

        return {
            "tensordiff_runs": 1,
            "a": {"path": self.a.path, "kind": self.a.kind, "steps": len(self.a.loss), "relogged": sorted(self.a.relogged)},
            "b": {"path": self.b.path, "kind": self.b.kind, "steps": len(self.b.loss), "relogged": sorted(self.b.relogged)},
            "common_steps": len(self.steps), "threshold": self.threshold, "warmup": self.warmup,
            "window": list(self.window) if self.window else None, "ppl_threshold": self.ppl_threshold,
            "grad_norm_threshold": self.grad_norm_threshold, "failures": self.failures,
            "mean_rel_loss": clean(self.mean_rel_loss), "max_rel_loss": clean(self.max_rel_loss),
            "max_rel_step": self.max_rel_step, "first_step_over_threshold": self.first_over,
            "final_loss": self.final_loss, "final_ppl": self.final_ppl,
            "validation": None if self.val is None else {"step": self.val[0], "loss_a": self.val[1], "loss_b": self.val[2],
                                                         "ppl_a": _ppl(self.val[1]), "ppl_b": _ppl(self.val[2])},
            "grad_norm_mean_rel": self.grad_norm_mean_rel, "grad_norm_max_rel": self.grad_norm_max_rel,
            "passed": self.passed,
            "rel_loss": {str(k): clean(v) for k, v in self.rel_loss.items()},
        }


def pct(x: float | None) -> str:
    """A relative error as a percentage, readable at any size (0.0042% rather than 0.000%)."""
    if x is None or not math.isfinite(x):
        return "n/a" if x is None else str(x)
    return f"{x:.3%}" if x >= 1e-3 or x == 0 else f"{x * 100:.2g}%"


def _thr(x: float) -> str:
    """A threshold as the user wrote it: 1.00%, 0.05%."""
    return f"{x:.2%}" if x >= 1e-4 else pct(x)


def _ppl(loss: float) -> float:
    return math.exp(min(loss, 700))  # no overflow for a diverged run


def _rel(a: float, b: float) -> float:
    return abs(b - a) / abs(a) if a != 0 else (0.0 if b == 0 else math.inf)


def compare_runs(a: Run, b: Run, threshold: float = 0.01, warmup: int = 0, window: tuple[int, int] | None = None,
                 ppl_threshold: float | None = None, grad_norm_threshold: float | None = None) -> Comparison:
    """Align by step (only steps both logged) and judge the relative loss error after ``warmup`` steps
    (and inside ``window``, both ends included). Optional thresholds: the relative difference of the
    final and validation perplexities (``ppl_threshold``), the mean relative grad-norm difference."""
    steps = sorted(set(a.loss) & set(b.loss))
    if not steps:
        raise RunsError(f"{a.path} (steps {min(a.loss)}..{max(a.loss)}) and {b.path} (steps {min(b.loss)}..{max(b.loss)}) "
                        "share no logged step; log both at a common interval")
    lo, hi = window if window is not None else (steps[0], steps[-1])
    rel = {s: _rel(a.loss[s], b.loss[s]) for s in steps}
    judged = [s for s in steps if s > warmup and lo <= s <= hi]
    if not judged:
        raise RunsError(f"no common step is judged: the runs share steps {steps[0]}..{steps[-1]}, the warm-up ends at "
                        f"{warmup}" + (f" and the window is {lo}..{hi}" if window else "") +
                        "; lower --warmup or widen --window")
    values = [rel[s] for s in judged]
    worst = max(judged, key=lambda s: rel[s])
    first_over = next((s for s in judged if rel[s] > threshold), None)
    last = steps[-1]
    final = (a.loss[last], b.loss[last])
    ppl = (_ppl(final[0]), _ppl(final[1]))
    val_steps = sorted(set(a.val_loss) & set(b.val_loss))
    val = (val_steps[-1], a.val_loss[val_steps[-1]], b.val_loss[val_steps[-1]]) if val_steps else None
    gn_steps = [s for s in sorted(set(a.grad_norm) & set(b.grad_norm)) if s > warmup and lo <= s <= hi]
    gn = [_rel(a.grad_norm[s], b.grad_norm[s]) for s in gn_steps]
    gn_mean = sum(gn) / len(gn) if gn else None
    failures = []
    if first_over is not None:
        failures.append(f"the relative loss error first exceeds {_thr(threshold)} at step {first_over} "
                        f"(max {pct(rel[worst])} at step {worst})")
    if ppl_threshold is not None:
        checks = [("final training perplexity", ppl)]
        if val is not None:
            checks.append((f"validation perplexity at step {val[0]}", (_ppl(val[1]), _ppl(val[2]))))
        for name, (pa, pb) in checks:
            if _rel(pa, pb) > ppl_threshold:
                failures.append(f"the {name} differs by {pct(_rel(pa, pb))} > {_thr(ppl_threshold)}")
    if grad_norm_threshold is not None:
        if gn_mean is None:
            failures.append("a grad-norm threshold was given but the runs share no logged grad norm")
        elif gn_mean > grad_norm_threshold:
            failures.append(f"the mean relative grad-norm difference is {pct(gn_mean)} > {_thr(grad_norm_threshold)}")
    return Comparison(
        a=a, b=b, steps=steps, threshold=threshold, warmup=warmup, rel_loss=rel,
        mean_rel_loss=sum(values) / len(values), max_rel_loss=rel[worst], max_rel_step=worst, first_over=first_over,
        final_loss=final, final_ppl=ppl, val=val,
        grad_norm_mean_rel=gn_mean, grad_norm_max_rel=max(gn) if gn else None,
        window=window, failures=failures, ppl_threshold=ppl_threshold,
        grad_norm_threshold=grad_norm_threshold,
    )
