"""Checkpoint folders as the frameworks write them, by what they hold: which iterations were saved.

``saved_steps(path)`` -> {iteration: what to load for it}: a Megatron-LM ``--save`` folder (``iter_NNNNNNN``
folders, ``latest_checkpointed_iteration.txt``) gives the folder itself for every iteration (Megatron-LM loads an
iteration with ``--load DIR --ckpt-step J``); a MindFormers output or checkpoint folder gives the checkpoint of each
saved step. A folder of neither kind is one line naming what was looked for.
"""

from __future__ import annotations

import os
import re

from .._text import listing
from ..errors import CheckpointError

_ITER = re.compile(r"iter_(\d{7})")


def is_megatron(path: str) -> bool:
    """A Megatron-LM ``--save`` folder (or one of its ``iter_NNNNNNN`` folders)."""
    if not os.path.isdir(path):
        return False
    names = os.listdir(path)
    return ("latest_checkpointed_iteration.txt" in names or any(_ITER.fullmatch(n) for n in names)
            or bool(_ITER.fullmatch(os.path.basename(os.path.normpath(path)))))


def saved_steps(path: str) -> dict[int, str]:
    """The iterations a checkpoint folder holds -> what a resumed run loads for each."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such folder; pass the folder the run saved its checkpoints in (Megatron-LM's "
                              "--save, MindFormers' output_dir/checkpoint)")
    from . import megatron_dir, mindformers_dir

    if mindformers_dir.is_mindformers_dir(path):  # first: a 2.0 folder has Megatron's tracker file name too
        return mindformers_dir.iterations(path)
    if is_megatron(path):
        return dict.fromkeys(megatron_dir.iterations(path), path)
    found = listing(sorted(os.listdir(path))[:6]) or "nothing"
    raise CheckpointError(f"{path}: neither a Megatron-LM --save folder (iter_NNNNNNN folders) nor a MindFormers "
                          f"checkpoint folder (rank_N/*.ckpt); it holds {found}")
