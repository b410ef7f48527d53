"""Read and write checkpoint files as ``dict[str, np.ndarray]``, by file suffix.

| suffix | reader / writer | needs |
|---|---|---|
| ``.safetensors`` | the ``safetensors`` package (torch- and MindSpore-written files alike) | safetensors |
| ``.pt``, ``.pth`` | ``torch.load(..., weights_only=True)`` / ``torch.save`` | torch |
| ``.ckpt`` | ``mindspore.load_checkpoint`` / ``mindspore.save_checkpoint`` | mindspore |

Frameworks are imported only when a file of theirs is read or written. Nothing is upcast:
BF16 and FP8 arrive as ``ml_dtypes`` arrays with their original bits, so a file read and
written again holds the same bytes. A torch file is only ever unpickled with
``weights_only=True``: a file that pickles other objects is refused, not executed.
"""

from __future__ import annotations

import os
import re
from typing import Any, Mapping

import ml_dtypes
import numpy as np

from .ckpt import Checkpoint, CheckpointError, listing

FORMATS = {".safetensors": "safetensors", ".pt": "torch", ".pth": "torch", ".ckpt": "mindspore"}
SUPPORTED = ".safetensors, .pt/.pth (torch), .ckpt (MindSpore)"

#: safetensors dtype codes -> numpy (ml_dtypes for the narrow floats, which safetensors.numpy cannot read).
_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}


def format_of(path: str) -> str:
    """'safetensors', 'torch' or 'mindspore', from the suffix."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in FORMATS:
        raise CheckpointError(f"{path}: unknown checkpoint format {suffix or '(no suffix)'!r}; supported: {SUPPORTED}")
    return FORMATS[suffix]


def load(path: str) -> Checkpoint:
    """The tensors of a checkpoint file (non-tensor entries are left out; see ``load_with_skipped``)."""
    return load_with_skipped(path)[0]


def load_with_skipped(path: str) -> tuple[Checkpoint, dict[str, str]]:
    """(tensors, skipped entries: name -> type) of a checkpoint file."""
    if os.path.isdir(path):
        raise CheckpointError(f"{path}: is a directory (a distributed / torch_dist checkpoint?); tensordiff reads one "
                              f"file: {SUPPORTED}")
    kind = format_of(path)
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such file")
    reader = {"safetensors": _load_safetensors, "torch": _load_torch, "mindspore": _load_mindspore}[kind]
    tensors, skipped = reader(path)
    if not tensors:
        raise CheckpointError(f"{path}: holds no tensors" + (f" (only {listing(skipped)})" if skipped else ""))
    return tensors, skipped


def save(tensors: Checkpoint, path: str) -> int:
    """Write ``tensors`` in the format of ``path``'s suffix (atomically); returns the file size in bytes."""
    kind = format_of(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise CheckpointError(f"{path}: the folder {folder} does not exist")
    base, suffix = os.path.splitext(os.path.basename(path))
    tmp = os.path.join(folder, f".{base}.partial{suffix}")  # MindSpore insists on the .ckpt suffix
    writer = {"safetensors": _save_safetensors, "torch": _save_torch, "mindspore": _save_mindspore}[kind]
    try:
        writer({k: _contiguous(np.asarray(v)) for k, v in tensors.items()}, tmp, path)
        os.replace(tmp, path)
    except OSError as err:
        raise CheckpointError(f"{path}: cannot write it ({err.strerror or err})") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return os.path.getsize(path)


def _contiguous(x: np.ndarray) -> np.ndarray:
    return x if x.flags.c_contiguous else x.copy(order="C")


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:200] if text else type(err).__name__


# ----------------------------------------------------------------------------------- safetensors
def _load_safetensors(path: str) -> tuple[Checkpoint, dict[str, str]]:
    import safetensors

    try:
        with open(path, "rb") as fh:
            items = safetensors.deserialize(fh.read())
    except Exception as err:  # safetensors raises its own error types for a bad header
        raise CheckpointError(f"{path}: not a readable safetensors file ({_first_line(err)}); is it truncated?") from None
    out: Checkpoint = {}
    for name, info in sorted(items, key=lambda item: _natural(item[0])):  # the file keeps no order of its own
        dtype = _ST_DTYPES.get(info["dtype"])
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {info['dtype']}, which tensordiff cannot read; "
                                  f"readable: {', '.join(_ST_DTYPES)}")
        out[name] = np.frombuffer(info["data"], dtype=dtype).reshape(info["shape"])
    return out, {}


def _natural(name: str) -> list:
    """'layers.10' after 'layers.9'."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _save_safetensors(tensors: Checkpoint, tmp: str, path: str) -> None:
    from safetensors.numpy import save_file

    save_file(tensors, tmp)


# ----------------------------------------------------------------------------------------- torch
_UNSUPPORTED_GLOBAL = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")


def _load_torch(path: str) -> tuple[Checkpoint, dict[str, str]]:
    import pickle

    import torch

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = _UNSUPPORTED_GLOBAL.search(str(err))
        if found:
            raise CheckpointError(
                f"{path}: torch refuses to load it with weights_only=True: besides tensors it pickles {found.group(1)}, "
                "and tensordiff never unpickles other objects; fix: if you trust the file, save its "
                "state dict alone, e.g. python -c \"import torch; c = torch.load('IN', weights_only=False); "
                "torch.save(c['model'], 'model.pt')\"") from None
        raise CheckpointError(f"{path}: not a readable torch checkpoint (corrupt, or not written by torch.save)") from None
    except (RuntimeError, EOFError, OSError, ValueError) as err:
        raise CheckpointError(f"{path}: not a readable torch checkpoint ({_first_line(err)}); is it truncated?") from None
    state = _state_dict(obj, path)
    out: Checkpoint = {}
    skipped: dict[str, str] = {}
    for name, value in state.items():
        if isinstance(value, torch.Tensor):
            out[str(name)] = _torch_to_numpy(value)
        else:
            skipped[str(name)] = type(value).__name__
    return out, skipped


def _state_dict(obj: Any, path: str) -> Mapping:
    import torch

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


def _torch_to_numpy(t: Any) -> np.ndarray:
    import torch

    t = t.detach().cpu().contiguous()
    narrow = {torch.bfloat16: (torch.int16, ml_dtypes.bfloat16), torch.float8_e4m3fn: (torch.uint8, ml_dtypes.float8_e4m3fn),
              torch.float8_e5m2: (torch.uint8, ml_dtypes.float8_e5m2)}
    if t.dtype in narrow:
        raw, dtype = narrow[t.dtype]
        return t.view(raw).numpy().view(dtype)
    return t.numpy()


def _save_torch(tensors: Checkpoint, tmp: str, path: str) -> None:
    import torch

    torch.save({k: _numpy_to_torch(v) for k, v in tensors.items()}, tmp)


def _numpy_to_torch(x: np.ndarray) -> Any:
    import torch

    narrow = {np.dtype(ml_dtypes.bfloat16): (np.int16, torch.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn): (np.uint8, torch.float8_e4m3fn),
              np.dtype(ml_dtypes.float8_e5m2): (np.uint8, torch.float8_e5m2)}
    x = x if x.flags.writeable else x.copy()
    if x.dtype in narrow:
        raw, dtype = narrow[x.dtype]
        return torch.from_numpy(x.view(raw)).view(dtype)
    return torch.from_numpy(x)


# ------------------------------------------------------------------------------------- MindSpore
def _load_mindspore(path: str) -> tuple[Checkpoint, dict[str, str]]:
    import mindspore as ms

    try:
        params = ms.load_checkpoint(path)
    except (ValueError, RuntimeError, OSError, TypeError) as err:
        raise CheckpointError(f"{path}: not a readable MindSpore checkpoint ({_first_line(err)})") from None
    out: Checkpoint = {}
    for name, param in params.items():
        array = np.array(param.asnumpy(), copy=True)
        if param.dtype == ms.bfloat16:  # MindSpore's own numpy bfloat16 type: same bits, other dtype object
            array = array.view(np.uint16).view(ml_dtypes.bfloat16)
        out[name] = array
    return out, {}


def _save_mindspore(tensors: Checkpoint, tmp: str, path: str) -> None:
    empty = [k for k, v in tensors.items() if v.size == 0]
    if empty:
        raise CheckpointError(f"{path}: a MindSpore .ckpt silently drops empty tensors ({listing(empty)}); "
                              "write .safetensors instead")
    unsupported = [f"{k} ({v.dtype})" for k, v in tensors.items() if v.dtype not in _MS_DTYPES]
    if unsupported:
        raise CheckpointError(f"{path}: a MindSpore .ckpt cannot hold {listing(unsupported)}; write .safetensors instead")
    import mindspore as ms

    try:
        ms.save_checkpoint([{"name": k, "data": ms.Tensor(v)} for k, v in tensors.items()], tmp)
    except (TypeError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"{path}: MindSpore cannot write it ({_first_line(err)})") from None


_MS_DTYPES = {np.dtype(t) for t in (np.float64, np.float32, np.float16, ml_dtypes.bfloat16, np.int64, np.int32, np.int16,
                                    np.int8, np.uint64, np.uint32, np.uint16, np.uint8, np.bool_)}
