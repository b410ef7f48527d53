"""PyTorch: tensors <-> numpy, ``.pt`` checkpoints, and one module called on captured inputs.

BF16 and FP8 cross as their raw bits (``ml_dtypes`` arrays on the numpy side), never upcast.
A ``.pt`` file is only ever read by torch's safe loader (``weights_only=True``, ``torch_safe.py``): plain data
is read, other named objects become inert stand-ins, and a file that names code is refused, never executed.
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np
import torch

from .._text import first_line, listing
from ..errors import CheckpointError
from ..record import flatten
from . import torch_safe

#: torch dtype <-> (torch dtype of the same width to view the bits as, numpy dtype)
NARROW = {
    torch.bfloat16: (torch.int16, ml_dtypes.bfloat16),
    torch.float8_e4m3fn: (torch.uint8, ml_dtypes.float8_e4m3fn),
    torch.float8_e5m2: (torch.uint8, ml_dtypes.float8_e5m2),
}
_NUMPY_NARROW = {np.dtype(np_dtype): (raw, torch_dtype) for torch_dtype, (raw, np_dtype) in NARROW.items()}
_BITS = {1: np.uint8, 2: np.int16}


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    """'torch.bfloat16' -> 'bfloat16' (the names of ``tensordiff.dtypes``)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A tensor as a numpy array of the same width (BF16 -> ml_dtypes.bfloat16); moved to the CPU if needed."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    view = NARROW.get(t.dtype)
    if view is not None:
        return t.view(view[0]).numpy().view(view[1])
    return t.numpy()


def from_numpy(x: np.ndarray) -> torch.Tensor:
    """The inverse of ``to_numpy``: ml_dtypes arrays come back as torch BF16/FP8 through their raw bits."""
    x = np.ascontiguousarray(x)
    if not x.flags.writeable:
        x = x.copy()
    narrow = _NUMPY_NARROW.get(x.dtype)
    if narrow is not None:
        return torch.from_numpy(x.view(_BITS[x.dtype.itemsize])).view(narrow[1])
    return torch.from_numpy(x)


# ------------------------------------------------------------------------------------ checkpoints
_UNSUPPORTED_GLOBAL = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")
_BLOCKED_GLOBAL = re.compile(r"unsupported GLOBAL ([\w.]+) whose module [\w.]+ is blocked")
_UNPICKLER_ERROR = re.compile(r"WeightsUnpickler error: \s*(.+?)\s*(?:\n|$)")


def load_checkpoint(path: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(tensors, skipped non-tensor entries: name -> type) of a ``.pt`` state dict (flat, or Megatron's ``{'model': ...}``)."""
    try:
        obj = torch_safe.load(path)  # torch's safe loader; names beyond plain data become inert stand-ins
    except pickle.UnpicklingError as err:
        found = _UNSUPPORTED_GLOBAL.search(str(err))
        if found:
            raise CheckpointError(
                f"{path}: torch's safe loader (weights_only=True) met {found.group(1)}, which tensordiff's scan of the "
                "file did not find; tensordiff never unpickles outside that loader; fix: save the tensors alone "
                "(torch.save(state_dict)) or as .safetensors") from None
        blocked = _BLOCKED_GLOBAL.search(str(err))
        if blocked:  # a pickle that would run code when loaded: refused, never run
            raise CheckpointError(
                f"{path}: refused: loading it would call {blocked.group(1)} (code, not tensors); tensordiff reads "
                "checkpoints with torch's safe loader only (weights_only=True) and never runs what a file names; fix: "
                "do not use this file unless you know where it came from") from None
        detail = _UNPICKLER_ERROR.search(str(err))
        raise CheckpointError(f"{path}: refused by torch's safe loader (weights_only=True"
                              f"{': ' + detail.group(1) if detail else ''}): not a torch.save file of tensors, a "
                              "damaged one, or one that holds other objects; tensordiff never unpickles anything "
                              "else") from None
    except (RuntimeError, EOFError, OSError, ValueError) as err:
        raise CheckpointError(f"{path}: not a readable torch checkpoint ({first_line(err)}); is it truncated?") from None
    out: dict[str, np.ndarray] = {}
    skipped: dict[str, str] = {}
    for name, value in _state_dict(obj, path).items():
        if isinstance(value, torch.Tensor):
            out[str(name)] = to_numpy(value.contiguous())
        else:
            skipped[str(name)] = type(value).__name__
    return out, skipped


def _state_dict(obj: Any, path: str) -> Mapping:
    if isinstance(obj, Mapping):
        if any(isinstance(v, torch.Tensor) for v in obj.values()):
            return obj
        model = obj.get("model")
        if isinstance(model, Mapping) and any(isinstance(v, torch.Tensor) for v in model.values()):
            return model
        keys = listing(f"{k!r}: {type(v).__name__}" for k, v in obj.items())
        raise CheckpointError(f"{path}: holds a dict ({keys}) with no tensors at the top level and no 'model' state "
                              "dict; expected a flat {name: tensor} state dict or Megatron's {'model': {...}}")
    raise CheckpointError(f"{path}: holds a {type(obj).__name__}, not a state dict; expected a flat {{name: tensor}} "
                          "dict or Megatron's {'model': {...}}")


def save_checkpoint(tensors: dict[str, np.ndarray], path: str) -> None:
    """``torch.save`` of a flat state dict."""
    torch.save({k: from_numpy(v) for k, v in tensors.items()}, path)


# ----------------------------------------------------------------------------------------- replay
def replay_call(model: torch.nn.Module, module_name: str, inputs: list[tuple[str, np.ndarray]],
                weights: dict[str, np.ndarray]) -> np.ndarray:
    """Call ``module_name`` of ``model`` with captured inputs and weights; its output.0 as numpy (``tensordiff replay``)."""
    sub = model.get_submodule(module_name) if module_name else model
    first = next(sub.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    with torch.no_grad():
        params = dict(sub.named_parameters())
        for name, value in weights.items():
            if name in params:
                params[name].copy_(from_numpy(value).to(params[name].device))
    positional: dict[int, torch.Tensor] = {}
    kwargs: dict[str, torch.Tensor] = {}
    for slot, x in inputs:
        t = from_numpy(x).to(device)
        if slot.isdigit():
            positional[int(slot)] = t
        elif "." not in slot:
            kwargs[slot] = t
    args = [positional.get(i) for i in range(max(positional) + 1)] if positional else []
    with torch.no_grad():
        out = sub(*args, **kwargs)
    for _, t in flatten(out, "", lambda v: isinstance(v, torch.Tensor)):
        return to_numpy(t)
    raise ValueError(f"{module_name} returned no tensor")
