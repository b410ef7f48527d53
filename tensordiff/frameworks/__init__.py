"""The only modules of tensordiff, besides the capture adapters (``capturing/torch/``, ``capturing/mindspore/``)
and ``compat/``, that import a framework.

One module per framework, ``torch`` and ``mindspore``, each with the same verbs (safetensors-style): ``dtype_name``,
``to_numpy`` (a framework tensor -> numpy, BF16/FP8 as ``ml_dtypes`` with their bits),
``from_numpy`` (the inverse), ``load_checkpoint`` / ``save_checkpoint`` (a checkpoint file
<-> ``dict[str, np.ndarray]``) and ``replay_call`` (run one module on captured inputs).
The rest of tensordiff imports them lazily, where a framework's object is actually needed.
``torch_safe``: ``torch.save`` files that hold more than tensors, read without running anything they name
(``torch``'s ``load_checkpoint``, Megatron-LM checkpoint folders).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ..errors import UsageError

NAMES = ("torch", "mindspore")


def get(name: str) -> ModuleType:
    """``tensordiff.frameworks.torch`` or ``tensordiff.frameworks.mindspore`` (imports the framework)."""
    if name not in NAMES:
        raise UsageError(f"framework {name!r}: expected one of {', '.join(NAMES)}")
    return importlib.import_module(f"{__name__}.{name}")
