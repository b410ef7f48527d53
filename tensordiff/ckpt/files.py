"""Read and write checkpoint files as ``dict[str, np.ndarray]``, by file suffix.

| suffix | reader / writer | needs |
|---|---|---|
| ``.safetensors`` | the ``safetensors`` package (torch- and MindSpore-written files alike) | safetensors |
| ``.pt``, ``.pth`` | ``torch.load(..., weights_only=True)`` / ``torch.save`` | torch |
| ``.ckpt`` | ``mindspore.load_checkpoint`` / ``mindspore.save_checkpoint`` | mindspore |
| a MindFormers folder | its Trainer's checkpoints (``mindformers_dir``: legacy ``rank_R/*.ckpt`` or 2.0
  ``iteration_NNNNNNNN/``), the last step saved, weights and Adam moments | mindspore (legacy) |
| a folder | Megatron-LM's ``--save`` (``--ckpt-format torch_dist`` or ``torch``, any TP/PP): the iteration its
  ``latest_checkpointed_iteration.txt`` names, or the ``iter_NNNNNNN`` folder given, joined into the full model with
  the optimizer's moments (``megatron_dir.py``) | torch |

Frameworks are imported only when a file of theirs is read or written, through
``tensordiff.frameworks`` (which also refuses any pickle beyond tensors). Nothing is upcast:
BF16 and FP8 arrive as ``ml_dtypes`` arrays with their original bits, so a file read and
written again holds the same bytes. A torch file is only ever read by torch's safe loader (``weights_only=True``;
``frameworks/torch_safe.py``): a file that names code is refused, not executed.
"""

from __future__ import annotations

import os
from collections import Counter

import numpy as np

from .. import frameworks
from .._text import listing, plural
from ..errors import CheckpointError
from ..transforms import contiguous
from . import megatron_dir, mindformers_dir
from .plan import Checkpoint
from .safetensors_io import load_safetensors as _load_safetensors
from .safetensors_io import save_safetensors as _save_safetensors

FORMATS = {".safetensors": "safetensors", ".pt": "torch", ".pth": "torch", ".ckpt": "mindspore"}
SUPPORTED = ".safetensors, .pt/.pth (torch), .ckpt (MindSpore)"

def format_of(path: str) -> str:
    """'safetensors', 'torch' or 'mindspore', from the suffix ('torch' for a Megatron-LM --save folder)."""
    if os.path.isdir(path):
        return "mindspore" if mindformers_dir.is_mindformers_dir(path) else "torch"
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in FORMATS:
        raise CheckpointError(f"{path}: unknown checkpoint format {suffix or '(no suffix)'!r}; supported: {SUPPORTED}")
    return FORMATS[suffix]


def load(path: str) -> Checkpoint:
    """The tensors of a checkpoint file (non-tensor entries are left out; see ``load_with_skipped``)."""
    return load_with_skipped(path)[0]


def load_with_skipped(path: str) -> tuple[Checkpoint, dict[str, str]]:
    """(tensors, skipped entries: name -> type) of a checkpoint file."""
    if os.path.isdir(path) and mindformers_dir.is_mindformers_dir(path):
        return mindformers_dir.load_dir(path)[:2]
    if os.path.isdir(path):
        tensors, skipped, _ = megatron_dir.load_dir(path)
        return tensors, skipped
    kind = format_of(path)
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such file")
    if kind == "safetensors":
        tensors, skipped = _load_safetensors(path)
    else:
        tensors, skipped = frameworks.get(kind).load_checkpoint(path)
    if not tensors:
        raise CheckpointError(f"{path}: holds no tensors" + (f" (only {listing(skipped)})" if skipped else ""))
    return tensors, skipped


def megatron_dir_file(path: str) -> str:
    """The folder of the iteration a Megatron-LM ``--save`` directory names (its ``latest_checkpointed_iteration.txt``),
    or the ``iter_NNNNNNN`` / ``release`` folder given; a ``CheckpointError`` names what is missing. Kept for callers
    that want the iteration folder; ``load_with_skipped`` reads it through ``megatron_dir.load_dir``."""
    return megatron_dir.iteration_folder(path)


def save(tensors: Checkpoint, path: str) -> int:
    """Write ``tensors`` in the format of ``path``'s suffix (atomically); returns the file size in bytes."""
    kind = format_of(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise CheckpointError(f"{path}: the folder {folder} does not exist")
    base, suffix = os.path.splitext(os.path.basename(path))
    tmp = os.path.join(folder, f".{base}.partial{suffix}")  # MindSpore insists on the .ckpt suffix
    arrays = {k: contiguous(np.asarray(v)) for k, v in tensors.items()}
    try:
        if kind == "safetensors":
            _save_safetensors(arrays, tmp)
        elif kind == "mindspore":
            frameworks.get(kind).save_checkpoint(arrays, tmp, shown_as=path)
        else:
            frameworks.get(kind).save_checkpoint(arrays, tmp)
        os.replace(tmp, path)
    except OSError as err:
        raise CheckpointError(f"{path}: cannot write it ({err.strerror or err})") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return os.path.getsize(path)


def describe_skipped(skipped: dict[str, str]) -> str:
    """'9 non-tensor entries (*._extra_state: NoneType ×9)'."""
    groups = Counter((name.rsplit(".", 1)[-1], kind) for name, kind in skipped.items())
    shown = ", ".join(f"*.{last}: {kind} ×{n}" for (last, kind), n in groups.most_common(3))
    return plural(len(skipped), "non-tensor entry", "non-tensor entries") + f" ({shown}{', ...' if len(groups) > 3 else ''})"
