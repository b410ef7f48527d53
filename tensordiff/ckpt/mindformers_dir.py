"""Read the checkpoint folder a MindFormers 1.9 Trainer writes, optimizer state included.

Two layouts (``CheckpointMonitor`` in the YAML's ``callbacks``; docs/checkpoints.md):

- legacy (the default): ``checkpoint/rank_R/PREFIX_rank_R-E_S.ckpt`` + ``meta.json``, one folder per rank; the step
  of a save is the file's ``step_num`` entry;
- 2.0 (``use_legacy_format: False``): ``checkpoint/iteration_NNNNNNNN/`` holding ``PREFIX-model-I-N.safetensors``,
  ``PREFIX-opt-I-N.safetensors`` and ``common.json``, plus ``latest_checkpointed_iteration.txt``; the step is the
  folder's number.

The path given may be the run's output folder (``output/``), its ``checkpoint/`` folder, one ``rank_R/`` folder or one
``iteration_NNNNNNNN/`` folder. The legacy name's ``E_S`` is epoch E, step S *within* the epoch: not a global step
without the steps per epoch, so the step is the file's ``step_num`` entry (the Trainer's ``cur_step_num``, global,
kept across a resume), else its ``global_step`` entry (the optimizer's update count; equal without gradient
accumulation). Reading them parses each file (``mindspore.load_checkpoint`` with a ``choice_func``).

``load_dir`` returns the weights under MindSpore's parameter names, the Adam moments under MindSpore's own names
(``adam_m.<param>``, ``adam_v.<param>``); the bookkeeping entries (``epoch_num``, ``step_num``, ``global_step``,
``loss_scale``, ``scale_sense``, ``global_batch_size``) go to ``info`` (and ``skipped``). No learning rate is saved: the
Trainer recomputes it from ``global_step`` and the YAML's ``lr_schedule``.

Several ranks: data-parallel ranks hold the same full tensors (checked: the same names and shapes in the first and
last rank), so rank 0 is read and ``info["parallel"]`` says so. Sharded ranks (model or optimizer parallel: shapes
or names differ) are refused with the MindSpore call that merges them; the CPU cannot produce such a run to test on
(semi_auto_parallel in GRAPH_MODE fails with "Invalid backend: CPU"). MindSpore is imported only to read ``.ckpt``
files, through ``tensordiff.frameworks``; the 2.0 layout's safetensors and JSON need no framework.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import numpy as np

from .._text import first_line, listing
from ..errors import CheckpointError

LEGACY_FILE = re.compile(r"(?P<prefix>.+)-(?P<epoch>\d+)_(?P<step>\d+)\.ckpt")
RANK_DIR = re.compile(r"rank_(\d+)")
ITERATION_DIR = re.compile(r"iteration_(\d{8})")
V2_FILE = re.compile(r"(?:(?P<prefix>.+)-)?(?P<kind>model|opt)-(?P<index>\d{7})-(?P<total>\d{7})\.safetensors")
#: entries that are the Trainer's bookkeeping, not state of a parameter
BOOKKEEPING = ("epoch_num", "step_num", "global_step", "loss_scale", "scale_sense", "global_batch_size")
_STEP_ENTRIES = ("step_num", "global_step", "epoch_num")


def is_mindformers_dir(path: str) -> bool:
    """A MindFormers Trainer's output folder, ``checkpoint/`` folder, ``rank_R/`` or ``iteration_NNNNNNNN/`` folder."""
    if not os.path.isdir(path):
        return False
    path = os.path.normpath(path)
    names = os.listdir(path)
    base = os.path.basename(path)
    if ITERATION_DIR.fullmatch(base) or (RANK_DIR.fullmatch(base) and any(LEGACY_FILE.fullmatch(n) or n == "meta.json"
                                                                          for n in names)):
        return True
    if any(ITERATION_DIR.fullmatch(n) or RANK_DIR.fullmatch(n) for n in names if os.path.isdir(os.path.join(path, n))):
        return True
    return os.path.isdir(os.path.join(path, "checkpoint")) and is_mindformers_dir(os.path.join(path, "checkpoint"))


def iterations(path: str) -> dict[int, str]:
    """Global step -> the ``.ckpt`` file (legacy: rank 0's, or the ``rank_R/`` folder's given) or the
    ``iteration_NNNNNNNN`` folder (2.0) saved at that step, in step order."""
    kind, where, _ = _layout(path)
    return _legacy_steps(where) if kind == "legacy" else dict(sorted(where.items()))


def load_dir(path: str, step: int | None = None) -> tuple[dict[str, np.ndarray], dict[str, str], dict[str, Any]]:
    """(tensors, skipped, info) of the save at global ``step`` (default: the last one) of a MindFormers folder.

    ``info``: ``format``, ``path`` (the file or folder read), ``step``, ``steps`` (all saved), ``epoch``, ``step_num``,
    ``global_step``, ``loss_scale``, ``global_batch_size``, ``learning_rate`` (None: not saved), ``ranks`` (found),
    ``rank`` (read), ``parallel`` (what was concluded about the ranks)."""
    kind, where, ranks = _layout(path)
    steps = _legacy_steps(where) if kind == "legacy" else dict(sorted(where.items()))
    if not steps:
        raise CheckpointError(f"{path}: no saved step ({_holds(where if kind == 'legacy' else path)}); the Trainer "
                              "saves with a CheckpointMonitor entry in the YAML's callbacks (save_checkpoint_steps: N)")
    if step is None:
        step = max(steps)
    if step not in steps:
        raise CheckpointError(f"{path}: no checkpoint of step {step}; saved steps: {listing([str(s) for s in steps])}")
    info: dict[str, Any] = {"step": step, "steps": sorted(steps), "path": steps[step], "learning_rate": None,
                            "ranks": sorted(ranks), "rank": 0}
    if kind == "legacy":
        tensors, skipped = _read_legacy(steps[step], steps, info)
        info.update(format="mindformers-ckpt", rank=int(os.path.basename(where)[len("rank_"):]))
        info["parallel"] = _check_ranks(tensors, ranks, where, step)
    else:
        tensors, skipped = _read_v2(steps[step], info)
        info.update(format="mindformers-2.0", rank=None, parallel="one file set per iteration (no rank folders)")
    return tensors, skipped, info


# ------------------------------------------------------------------------------------------------ layout
def _layout(path: str) -> tuple[str, Any, dict[int, str]]:
    """('legacy', the rank folder to read, {rank: folder}) or ('2.0', {step: iteration folder}, {})."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such folder; pass a MindFormers output folder, its checkpoint/ folder, a "
                              "rank_R/ or an iteration_NNNNNNNN/ folder")
    path = os.path.normpath(path)
    base = os.path.basename(path)
    if ITERATION_DIR.fullmatch(base):
        return "2.0", {int(base[len("iteration_"):]): path}, {}
    if RANK_DIR.fullmatch(base):
        parent = os.path.dirname(path)
        return "legacy", path, _subdirs(parent, RANK_DIR)
    if not _subdirs(path, RANK_DIR) and not _subdirs(path, ITERATION_DIR) and os.path.isdir(
            os.path.join(path, "checkpoint")):
        path = os.path.join(path, "checkpoint")  # the output folder
    iters, ranks = _subdirs(path, ITERATION_DIR), _subdirs(path, RANK_DIR)
    if iters:
        return "2.0", iters, {}
    if ranks:
        if 0 not in ranks:
            raise CheckpointError(f"{path}: no rank_0 folder (holds {listing(sorted(os.listdir(path)))}); pass the "
                                  "rank_R folder to read, or copy rank_0 back")
        return "legacy", ranks[0], ranks
    raise CheckpointError(f"{path}: not a MindFormers checkpoint folder: no rank_R/ or iteration_NNNNNNNN/ folder "
                          f"({_holds(path)}); pass the Trainer's output/checkpoint folder")


def _subdirs(path: str, pattern: re.Pattern) -> dict[int, str]:
    found = {int(m.group(1)): os.path.join(path, n) for n in os.listdir(path)
             if (m := pattern.fullmatch(n)) and os.path.isdir(os.path.join(path, n))}
    return dict(sorted(found.items()))


def _holds(path: str) -> str:
    names = sorted(os.listdir(path))
    return f"it holds {listing(names)}" if names else "it is empty"


# ------------------------------------------------------------------------------------------------ legacy
def _legacy_steps(rank_dir: str) -> dict[int, str]:
    """Global step -> file of one rank folder (a step saved twice, under two prefixes: the newer file)."""
    files = sorted((os.path.join(rank_dir, n) for n in os.listdir(rank_dir) if LEGACY_FILE.fullmatch(n)),
                   key=os.path.getmtime)
    return dict(sorted({_file_step(f): f for f in files}.items()))


def _file_step(file: str) -> int:
    entries = _read(file, names=_STEP_ENTRIES)
    for name in ("step_num", "global_step"):
        if name in entries:
            return int(np.asarray(entries[name]).reshape(-1)[0])
    epoch, _, step = os.path.basename(file)[:-len(".ckpt")].rpartition("-")[2].partition("_")
    raise CheckpointError(f"{file}: holds no step_num or global_step entry (not saved by MindFormers' "
                          f"CheckpointMonitor?); its name says epoch {epoch}, step {step} of that epoch, not a global "
                          "step: pass the file itself")


def _read(file: str, names: tuple[str, ...] | None = None, steps: dict[int, str] | None = None) -> dict[str, np.ndarray]:
    from .. import frameworks

    try:
        return frameworks.get("mindspore").load_checkpoint(file, names=names)[0]
    except CheckpointError as err:
        others = [str(s) for s, f in (steps or {}).items() if f != file]
        raise CheckpointError(f"{first_line(err)}; is it truncated (a run stopped while saving)? delete it"
                              + (f" or load another step ({listing(others)})" if others else "")) from None


def _read_legacy(file: str, steps: dict[int, str], info: dict[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    entries = _read(file, steps=steps)
    tensors = {k: v for k, v in entries.items() if k not in BOOKKEEPING}
    skipped = {k: f"{v.dtype} {tuple(v.shape)} (in info)" for k, v in entries.items() if k in BOOKKEEPING}
    value = {k: np.asarray(v).reshape(-1)[0].item() for k, v in entries.items() if k in BOOKKEEPING}
    info.update(epoch=value.get("epoch_num"), step_num=value.get("step_num"), global_step=value.get("global_step"),
                loss_scale=value.get("loss_scale", value.get("scale_sense")),
                global_batch_size=value.get("global_batch_size"))
    return tensors, skipped


def _check_ranks(tensors: dict[str, np.ndarray], ranks: dict[int, str], rank_dir: str, step: int) -> str:
    """What the other ranks are; refuses sharded ones (the last rank's file of the same step compared)."""
    if len(ranks) <= 1:
        return "one rank"
    last = max(ranks)
    other = _legacy_steps(ranks[last]).get(step)
    if other is None:
        raise CheckpointError(f"{ranks[last]}: no checkpoint of step {step}, which {rank_dir} has; the ranks' saves "
                              "do not match: load a step every rank saved")
    theirs = _read(other)
    shapes = {k: v.shape for k, v in theirs.items() if k not in BOOKKEEPING}
    differ = sorted(set(shapes) ^ set(tensors)) or [k for k in tensors if shapes[k] != tensors[k].shape]
    if differ:
        name = differ[0]
        what = (f"{name} is {tensors[name].shape if name in tensors else 'absent'} in rank 0, "
                f"{shapes.get(name, 'absent')} in rank {last}")
        raise CheckpointError(f"{os.path.dirname(rank_dir)}: the ranks hold sharded tensors ({what}), which tensordiff "
                              "does not join: merge them with mindspore.parallel.transform_checkpoints(checkpoint_dir, "
                              "out_dir, prefix, src_strategy_file=<output>/strategy/ckpt_strategy.ckpt, "
                              "dst_strategy_file=None) and pass the merged .ckpt")
    return f"{len(ranks)} ranks with the same names and shapes (data-parallel replicas): rank 0 read"


# ----------------------------------------------------------------------------------------------- 2.0
def _read_v2(folder: str, info: dict[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    from .safetensors_io import load_safetensors as _load_safetensors

    files = {n: m for n in sorted(os.listdir(folder)) if (m := V2_FILE.fullmatch(n))}
    if not any(m.group("kind") == "model" for m in files.values()):
        raise CheckpointError(f"{folder}: no PREFIX-model-NNNNNNN-NNNNNNN.safetensors ({_holds(folder)}); an "
                              "iteration folder of an unfinished save? load another step")
    for kind in ("model", "opt"):
        mine = [m for m in files.values() if m.group("kind") == kind]
        if mine:
            total = int(mine[0].group("total"))
            missing = sorted(set(range(total)) - {int(m.group("index")) for m in mine})
            if missing:
                raise CheckpointError(f"{folder}: {kind} file(s) {listing([f'{i:07d}' for i in missing])} of "
                                      f"{total:07d} missing; the save is incomplete: load another step")
    tensors: dict[str, np.ndarray] = {}
    for name in files:
        for key, value in _load_safetensors(os.path.join(folder, name))[0].items():
            if key in tensors and tensors[key].shape != value.shape:
                raise CheckpointError(f"{folder}: {key} is {tensors[key].shape} in one file and {value.shape} in "
                                      f"{name}: sharded tensors, which tensordiff does not join yet")
            tensors.setdefault(key, value)
    common: dict[str, Any] = {}
    common_file = os.path.join(folder, "common.json")
    if os.path.exists(common_file):
        try:
            with open(common_file, encoding="utf-8") as fh:
                common = json.load(fh)
        except (OSError, ValueError) as err:
            raise CheckpointError(f"{common_file}: not readable JSON ({first_line(err)}); is it truncated? load "
                                  "another step") from None
    skipped = {k: f"{v.dtype} {tuple(v.shape)} (in info)" for k, v in tensors.items() if k in BOOKKEEPING}
    global_step = tensors.get("global_step")
    info.update(epoch=common.get("epoch_num"), step_num=common.get("step_num"),
                global_step=int(global_step.reshape(-1)[0]) if global_step is not None else common.get("global_step"),
                loss_scale=common.get("loss_scale"), global_batch_size=common.get("global_batch_size"))
    return {k: v for k, v in tensors.items() if k not in BOOKKEEPING}, skipped
