"""A whole training state carried across frameworks: Megatron-LM's ``--save`` at iteration J (weights, Adam's moments
and step) written as the checkpoint folder a MindFormers 1.9 Trainer resumes from.

    convert_state("ckpt_a", 4, "out/shared_state", "mcore-mindformers-llama", {"heads": "4", "groups": "2"})
    # -> out/shared_state/rank_0/shared_rank_0-4_1.ckpt + rank_0/meta.json
    # resume B with   load_checkpoint: out/shared_state   resume_training: shared_rank_0-4_1.ckpt
    #                 load_ckpt_format: ckpt              runner_config.epochs: the total (the Trainer skips J steps)

What the file holds, entry by entry as the Trainer writes its own (docs/locate.md, /work/shared/notes):

* the weights under MindSpore's names, converted by the mapping table (``ConversionTable.convert``);
* ``adam_m.<name>`` / ``adam_v.<name>``: Megatron's ``exp_avg`` / ``exp_avg_sq`` converted by the SAME table (a moment
  has its parameter's shape and layout: a QKV split or a gate/up interleave applies identically), float32 as
  MindFormers' AdamW keeps them;
* ``global_step`` int32 [1] = Adam's step count. Both sides count the updates done: MindFormers' AdamW adds 1 to
  ``global_step`` before its update and uses the new value in the bias corrections ``1 - beta^t``, torch's Adam (which
  megatron-core wraps) does the same with ``state["step"]``; the learning-rate schedule reads ``global_step`` before
  the increment, as megatron-core's scheduler has stepped J times. So ``global_step`` = Megatron's step, not step - 1;
* ``step_num`` int64 = J (the Trainer's ``cur_step_num``: how many steps it skips in the dataset and counts from),
  ``epoch_num`` int64 = the epoch of step J (``ceil(J / steps_per_epoch)``; the Trainer starts at that epoch, or the
  one before when J is not an epoch's last step);
* ``scale_sense`` and ``loss_scale`` float32 1.0 (no loss scaling in an FP32/BF16 Megatron run), ``global_batch_size``
  int64 (Megatron's ``--global-batch-size``: the Trainer scales the steps it skips by old / new global batch).

``meta.json`` is the Trainer's own: ``{"last_epoch": E, "last_step": S, "last_ckpt_file": NAME}``.

``check_hyper(groups, config)``: Megatron's saved Adam hyper-parameters against the MindFormers YAML's ``optimizer``
section; a difference is a finding to report (the resumed runs will part because of it), not a reason to refuse.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._yaml import load_yaml
from ..errors import CheckpointError, UsageError
from . import megatron_dir
from .files import save
from .table import ConversionTable

#: MindFormers' AdamW-family optimizers: decoupled weight decay, eps outside the square root (as torch's Adam/AdamW)
MF_ADAMW = ("AdamW", "FusedAdamW", "PmaAdamW", "FusedPmaAdamW")
#: MindFormers AdamW's defaults (``mindformers.core.optim.AdamW.__init__``)
MF_DEFAULTS = {"betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
#: the Trainer's moments, by Megatron's name of them
MOMENTS = {"exp_avg": "adam_m", "exp_avg_sq": "adam_v"}


def legacy_name(prefix: str, iteration: int, steps_per_epoch: int = 1) -> str:
    """``PREFIX_rank_0-E_S.ckpt``: the file name CheckpointMonitor gives step ``iteration`` (epoch E, step S in it)."""
    epoch, step = epoch_of(iteration, steps_per_epoch)
    return f"{prefix}_rank_0-{epoch}_{step}.ckpt"


def epoch_of(iteration: int, steps_per_epoch: int = 1) -> tuple[int, int]:
    """(epoch, step within it) of global step ``iteration`` (both from 1)."""
    if steps_per_epoch < 1:
        raise UsageError(f"steps per epoch {steps_per_epoch}: must be 1 or more")
    epoch = max(1, math.ceil(iteration / steps_per_epoch))
    return epoch, iteration - (epoch - 1) * steps_per_epoch


@dataclass
class ConvertedState:
    """What ``convert_state`` wrote (``as_dict`` for JSON)."""

    src: str
    """A's iteration folder read."""
    iteration: int
    dst: str
    """the folder holding ``rank_0/``: B's ``load_checkpoint``."""
    file: str
    """the .ckpt written: its name is B's ``resume_training``."""
    mapping: str
    global_step: int
    epoch: int
    weights: int
    moments: int
    global_batch_size: int
    hyper: list[dict[str, Any]] = field(default_factory=list)
    """Megatron's Adam param groups (betas, eps, weight_decay, wd_mult...)."""
    mismatches: list[str] = field(default_factory=list)
    """hyper-parameters that differ from B's YAML (empty: equivalent, or no YAML given)."""
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"src": self.src, "iteration": self.iteration, "dst": self.dst, "file": self.file,
                "mapping": self.mapping, "global_step": self.global_step, "epoch": self.epoch,
                "weights": self.weights, "moments": self.moments, "global_batch_size": self.global_batch_size,
                "hyper": self.hyper, "mismatches": self.mismatches, "notes": self.notes}


def convert_state(src: str, iteration: int, dst: str, mapping: str, variables: dict[str, str] | None = None,
                  to: str = "mindformers", prefix: str = "shared", steps_per_epoch: int = 1,
                  config: str | None = None, global_batch_size: int | None = None) -> ConvertedState:
    """Write A's Megatron-LM state of ``iteration`` (``src``: its ``--save`` folder) as a MindFormers legacy checkpoint
    folder ``dst`` (``dst/rank_0/PREFIX_rank_0-E_S.ckpt`` + ``meta.json``) that the Trainer resumes from.

    ``mapping``/``variables``: the conversion table (``mcore-mindformers-llama``, ``heads``/``groups``);
    ``steps_per_epoch``: B's dataset's steps per epoch (epoch and file name); ``config``: B's YAML, whose optimizer is
    checked against Megatron's (``mismatches``); ``global_batch_size``: default Megatron's saved one."""
    if to != "mindformers":
        raise UsageError(f"--to {to}: a training state converts from Megatron-LM to MindFormers only (MindFormers' "
                         "optimizer state into a Megatron-LM folder is not written yet)")
    tensors, _, info = megatron_dir.load_dir(src, iteration)
    folder = str(info.get("folder") or src)
    table = ConversionTable.load(mapping, variables)
    if to not in table.sides:
        raise UsageError(f"mapping {table.name} converts between {' and '.join(table.sides)}, not to {to}")
    source = table.other(to)
    weights = {k: v for k, v in tensors.items() if not k.startswith("optimizer.")}
    notes: list[str] = []
    masters = {k[len("optimizer.fp32_param."):]: v for k, v in tensors.items() if k.startswith("optimizer.fp32_param.")}
    if masters:  # a BF16/FP16 model: the update starts from the FP32 main parameters
        weights.update({k: v for k, v in masters.items() if k in weights})
        notes.append(f"weights from Megatron's FP32 main parameters ({len(masters)}), the copy its optimizer updates")
    moments: dict[str, dict[str, np.ndarray]] = {}
    for kind in MOMENTS:
        lead = f"optimizer.{kind}."
        moments[kind] = {k[len(lead):]: v for k, v in tensors.items() if k.startswith(lead)}
        missing = sorted(set(weights) - set(moments[kind]) - {k for k in weights if table.ignored(k, source)})
        if missing:
            why = info.get("optimizer_note") or "saved without the optimizer (--no-save-optim)?"
            raise CheckpointError(f"{folder}: no Adam {kind} for {len(missing)} parameter(s) ({missing[0]}...): "
                                  f"{why}; shared state needs A's optimizer state")
    step = info.get("step")
    if step is None:
        raise CheckpointError(f"{folder}: no Adam step count in the saved optimizer (param_groups' or states' "
                              "'step'); MindFormers' AdamW needs it for its bias corrections")
    step = int(step)
    if step != iteration:
        notes.append(f"Adam's step {step} is not the iteration {iteration} (skipped updates, e.g. FP16 overflows): "
                     f"global_step = {step}, step_num = {iteration}")
    where = f"{folder} ({table.name})"
    out: dict[str, np.ndarray] = dict(table.convert(weights, source=source, path=where).tensors)
    n_weights = len(out)
    for kind, lead in MOMENTS.items():
        conv = table.convert(moments[kind], source=source, path=f"{where}, {kind}")
        for name, value in conv.tensors.items():
            if name not in out:
                raise CheckpointError(f"{where}: {kind} converts to {name}, which no weight does")
            out[f"{lead}.{name}"] = np.ascontiguousarray(value, dtype=np.float32)
    args = info.get("args") or {}
    gbs = int(global_batch_size or args.get("global_batch_size") or 0)
    if not gbs:
        raise UsageError(f"{folder}: the saved args have no global_batch_size; pass global_batch_size")
    epoch, in_epoch = epoch_of(iteration, steps_per_epoch)
    out.update({
        "scale_sense": np.array(1.0, dtype=np.float32),
        "global_step": np.array([step], dtype=np.int32),
        "epoch_num": np.array(epoch, dtype=np.int64),
        "step_num": np.array(iteration, dtype=np.int64),
        "loss_scale": np.array(1.0, dtype=np.float32),
        "global_batch_size": np.array(gbs, dtype=np.int64),
    })
    if args.get("fp16"):
        notes.append("Megatron ran in FP16 with a dynamic loss scale, which is not carried over (scale_sense 1.0)")
    rank = os.path.join(dst, "rank_0")
    os.makedirs(rank, exist_ok=True)
    name = legacy_name(prefix, iteration, steps_per_epoch)
    file = os.path.join(rank, name)
    save(out, file)
    with open(os.path.join(rank, "meta.json"), "w", encoding="utf-8") as fh:
        json.dump({"last_epoch": epoch, "last_step": in_epoch, "last_ckpt_file": name}, fh)
    groups = list(info.get("optimizer_groups") or [])
    mismatches = check_hyper(groups, config, args) if config else []
    return ConvertedState(folder, iteration, os.path.abspath(dst), os.path.abspath(file), table.describe(), step, epoch,
                          n_weights, len(out) - n_weights - 6, gbs, groups, mismatches, notes)


def _yaml_optimizer(config: str) -> tuple[dict[str, Any], dict[str, Any]]:
    with open(config, encoding="utf-8") as fh:
        doc = load_yaml(fh.read(), config, "MindFormers config")
    if not isinstance(doc, dict):
        raise UsageError(f"{config}: not a MindFormers YAML (a mapping of sections)")
    return dict(doc.get("optimizer") or {}), doc


def check_hyper(groups: list[dict[str, Any]], config: str, args: dict[str, Any] | None = None) -> list[str]:
    """What differs between Megatron's saved Adam (its param groups) and the optimizer of MindFormers YAML ``config``:
    one line each; empty when equivalent. The learning rate is not compared (each run keeps its own schedule)."""
    opt, doc = _yaml_optimizer(config)
    if not groups:
        return ["A's checkpoint holds no optimizer param groups: betas, eps and weight decay not checked"]
    out: list[str] = []
    kind = str(opt.get("type", "?"))
    if kind not in MF_ADAMW:
        out.append(f"B's optimizer is {kind}, not AdamW: the converted Adam moments may mean something else to it")
    decoupled = {bool(g.get("decoupled_weight_decay", True)) for g in groups}
    if decoupled == {False}:
        out.append("A's Adam couples the weight decay to the gradient (Adam, not AdamW); B's AdamW decouples it")
    if any(g.get("amsgrad") for g in groups):
        out.append("A's Adam uses AMSGrad (max_exp_avg_sq), which B's AdamW has no state for")
    mine = {k: opt.get(k, MF_DEFAULTS[k]) for k in MF_DEFAULTS}
    betas = [float(b) for b in mine["betas"]]
    for name, theirs in (("betas", betas), ("eps", float(mine["eps"]))):
        values = {json.dumps(g.get(name)) for g in groups if g.get(name) is not None}
        for value in sorted(values):
            if not np.allclose(json.loads(value), theirs, rtol=1e-6, atol=0):
                out.append(f"{name}: A's Adam {json.loads(value)}, B's YAML {theirs}")
    decay = [g for g in groups if float(g.get("wd_mult", 1.0)) > 0]
    wd = max((float(g.get("weight_decay", 0.0)) for g in decay), default=0.0)
    if not math.isclose(wd, float(mine["weight_decay"]), rel_tol=1e-6, abs_tol=1e-12):
        out.append(f"weight_decay: A's Adam {wd:g}, B's YAML {float(mine['weight_decay']):g}")
    clip = (args or {}).get("clip_grad")
    wrapper = doc.get("runner_wrapper") or {}
    if clip is not None and isinstance(wrapper, dict):
        theirs_clip = float(wrapper.get("max_grad_norm", 1.0)) if wrapper.get("use_clip_grad") else 0.0
        if not math.isclose(float(clip), theirs_clip, rel_tol=1e-6):
            out.append(f"gradient clipping: A's --clip-grad {clip:g}, B's runner_wrapper "
                       f"{'max_grad_norm ' + format(theirs_clip, 'g') if theirs_clip else 'none (use_clip_grad off)'}")
    return out


__all__ = ["ConvertedState", "check_hyper", "convert_state", "epoch_of", "legacy_name"]
