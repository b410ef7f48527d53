"""MindSpore: tensors <-> numpy, ``.ckpt`` checkpoints, and one cell called on captured inputs.

BF16 crosses as its raw bits (``ml_dtypes.bfloat16`` on the numpy side), never upcast.
"""

from __future__ import annotations

from typing import Any

import mindspore as ms
import ml_dtypes
import numpy as np

from .._text import first_line, listing
from ..errors import CheckpointError, UsageError
from ..record import flatten


def dtype_name(dtype: Any) -> str:
    """MindSpore dtype -> tensordiff's name ('Float32' -> 'float32', 'BFloat16' -> 'bfloat16')."""
    return str(dtype).lower()


def to_numpy(t: Any) -> np.ndarray:
    """A host copy of a MindSpore tensor, same width (BF16 -> ml_dtypes.bfloat16 bits)."""
    if t.dtype == ms.bfloat16:
        return np.array(t.view(ms.int16).asnumpy(), copy=True).view(ml_dtypes.bfloat16)
    return np.array(t.asnumpy(), copy=True)


def host_view(t: Any) -> np.ndarray:
    """A numpy view of a tensor's host data (no copy where MindSpore allows; BF16 as ml_dtypes)."""
    return t.view(ms.int16).asnumpy().view(ml_dtypes.bfloat16) if t.dtype == ms.bfloat16 else t.asnumpy()


def from_numpy(x: np.ndarray) -> Any:
    """The inverse of ``to_numpy`` (an ml_dtypes BF16 array becomes a BF16 tensor)."""
    x = np.ascontiguousarray(x)
    if x.dtype == np.dtype(ml_dtypes.bfloat16):
        return ms.Tensor(x.view(np.int16)).view(ms.bfloat16)
    return ms.Tensor(x)


def check_pynative() -> None:
    """Python hooks only run in PyNative mode: refuse graph mode with the fix."""
    if ms.get_context("mode") != ms.PYNATIVE_MODE:
        raise UsageError(
            "MindSpore is in GRAPH_MODE, where Python hooks do not run; capture needs PyNative: call "
            "mindspore.set_context(mode=mindspore.PYNATIVE_MODE) before building the model"
        )


# ------------------------------------------------------------------------------------ checkpoints
#: numpy dtypes a MindSpore .ckpt can hold.
CKPT_DTYPES = {np.dtype(t) for t in (np.float64, np.float32, np.float16, ml_dtypes.bfloat16, np.int64, np.int32,
                                     np.int16, np.int8, np.uint64, np.uint32, np.uint16, np.uint8, np.bool_)}


def load_checkpoint(path: str, names: tuple[str, ...] | None = None) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(tensors, skipped entries) of a ``.ckpt`` file (``mindspore.load_checkpoint``); ``names``: only these entries."""
    first: list[str] = []  # MindSpore refuses a choice that keeps nothing: the first entry is kept too, then dropped

    def choose(name: str) -> bool:
        if names is None or name in names:
            return True
        if not first:
            first.append(name)
        return name in first

    try:
        params = ms.load_checkpoint(path, choice_func=choose)
    except (ValueError, RuntimeError, OSError, TypeError) as err:
        raise CheckpointError(f"{path}: not a readable MindSpore checkpoint ({first_line(err)})") from None
    out: dict[str, np.ndarray] = {}
    for name, param in params.items():
        if names is not None and name not in names:
            continue
        array = np.array(param.asnumpy(), copy=True)
        if param.dtype == ms.bfloat16:  # MindSpore's own numpy bfloat16 type: same bits, other dtype object
            array = array.view(np.uint16).view(ml_dtypes.bfloat16)
        out[name] = array
    return out, {}


def save_checkpoint(tensors: dict[str, np.ndarray], path: str, shown_as: str = "") -> None:
    """``mindspore.save_checkpoint`` of ``tensors`` to ``path``; ``shown_as``: the name messages give the file."""
    where = shown_as or path
    empty = [k for k, v in tensors.items() if v.size == 0]
    if empty:
        raise CheckpointError(f"{where}: a MindSpore .ckpt silently drops empty tensors ({listing(empty)}); "
                              "write .safetensors instead")
    unsupported = [f"{k} ({v.dtype})" for k, v in tensors.items() if v.dtype not in CKPT_DTYPES]
    if unsupported:
        raise CheckpointError(f"{where}: a MindSpore .ckpt cannot hold {listing(unsupported)}; write .safetensors instead")
    try:
        ms.save_checkpoint([{"name": k, "data": ms.Tensor(v)} for k, v in tensors.items()], path)
    except (TypeError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"{where}: MindSpore cannot write it ({first_line(err)})") from None


# -------------------------------------------------------------------------------------- datasets
def write_mindrecord(path: str, columns: dict[str, np.ndarray], shown_as: str = "") -> None:
    """One MindRecord file (``mindspore.mindrecord.FileWriter``), a row per first-axis entry of each column: what
    MindFormers' ``MindDataset`` loader reads. Integer columns are written as int32 (its ``input_ids``), one shard."""
    import os

    from mindspore.mindrecord import FileWriter

    where = shown_as or path
    for leftover in (path, path + ".db"):  # FileWriter refuses an existing file: the caller asked for this path
        if os.path.exists(leftover):
            os.remove(leftover)
    rows = {k: (v.astype(np.int32) if v.dtype.kind in "iu" else v.astype(np.float32)) for k, v in columns.items()}
    schema = {k: {"type": "int32" if v.dtype == np.int32 else "float32", "shape": [-1]} for k, v in rows.items()}
    try:
        writer = FileWriter(file_name=path, shard_num=1, overwrite=True)
        writer.add_schema(schema, "tensordiff batch")
        count = len(next(iter(rows.values())))
        writer.write_raw_data([{k: v[i].reshape(-1) for k, v in rows.items()} for i in range(count)])
        writer.commit()
    except (TypeError, ValueError, RuntimeError, OSError) as err:
        raise UsageError(f"{where}: MindSpore cannot write the MindRecord file ({first_line(err)})") from None


# ----------------------------------------------------------------------------------------- replay
def replay_call(model: Any, module_name: str, inputs: list[tuple[str, np.ndarray]],
                weights: dict[str, np.ndarray]) -> np.ndarray:
    """Call cell ``module_name`` of ``model`` with captured inputs and weights; its output.0 (``tensordiff replay``)."""
    check_pynative()
    cells = dict(model.cells_and_names())
    if module_name not in cells:
        raise UsageError(f"the model has no cell {module_name!r}")
    sub = cells[module_name]
    params = dict(sub.parameters_and_names())
    for name, value in weights.items():
        if name in params:
            params[name].set_data(from_numpy(value))
    positional: dict[int, Any] = {}
    kwargs: dict[str, Any] = {}
    for slot, x in inputs:
        t = from_numpy(x)
        if slot.isdigit():
            positional[int(slot)] = t
        elif "." not in slot:
            kwargs[slot] = t
    args = [positional.get(i) for i in range(max(positional) + 1)] if positional else []
    out = sub(*args, **kwargs)
    for _, t in flatten(out, "", lambda v: isinstance(v, ms.Tensor)):
        return to_numpy(t)
    raise ValueError(f"{module_name} returned no tensor")
