"""msprobe's dumps read as a capture: ``MsprobeDump(path)`` is a capture reader (``CaptureReader``, nothing is
copied), so that ``tensordiff diff`` aligns, compares and explains them like any capture.

msprobe (MindStudio Probe, PyPI ``mindstudio-probe``) writes, per step and rank, ``DUMP/step<N>/rank<R>/``:
``dump.json`` (its ``data``: one entry per module call, with statistics of each tensor and, in task ``tensor``, the
file holding it), ``construct.json`` (each call's enclosing call, in the order the calls were entered),
``stack.json``, and ``dump_tensor_data/`` (``.pt`` for PyTorch, ``.npy`` for MindSpore). ``path`` may be the dump
folder (every ``step<N>`` of it), one step or rank folder, or a ``dump.json``.

Entries read (level ``L0``, and the module entries of level ``mix``), ``Module.<name>.<Class>.<dir>.<n>`` (MindSpore:
``Cell.``): module ``<name>``, class ``<Class>``, call ``<n>``:

* ``forward``: ``parameters`` of a module's first call -> phase ``weights``, kind ``param`` (the values the call
  used); ``input_args[i]`` -> ``input`` slot ``i``, ``input_kwargs[k]`` -> ``input`` slot ``k`` (nested: ``i.j``),
  at the call's entry; ``output[i]`` -> ``output`` slot ``i``, at its exit. The order of entry is
  ``construct.json``'s;
* ``backward``: msprobe's ``input`` (the gradients arriving at the module: of its outputs) -> ``grad_output``,
  its ``output`` (the gradients it hands on: of its inputs) -> ``grad_input``, each with ``grad_of`` naming the
  forward record of the same slot;
* ``parameters_grad``: -> phase ``param_grad``, kind ``grad`` (call 0; the last value msprobe lists).

Statistics: ``Max``/``Min``/``Mean``/``Norm`` -> ``max``/``min``/``mean``/``l2``. msprobe counts no NaN or Inf:
a record whose statistics are not finite gets ``nan``/``inf`` = 1 ("at least one"), exact when its tensor is read.
Integer and bool tensors (msprobe gives no mean or norm) get theirs from the stored tensor, else NaN.

Not read: API-level entries (``Functional.*``, ``Tensor.*``, ``Torch.*``, ``Distributed.*``, MindSpore's
``Mint.*``/``Primitive.*``...): they name no module (counted in the attribute ``msprobe_skipped``). msprobe records
neither the root model's call nor the loss: a diff against a tensordiff capture reports those records as having no
counterpart (a mapping's ``ignore:`` names them on purpose; docs/msprobe.md).

Tensors are read when asked for: ``.pt`` by ``torch_file.read_tensor`` (no unpickling, no torch), ``.npy`` by
``np.load(allow_pickle=False)``. A damaged ``dump.json`` or tensor file is one ``CaptureFileError`` line.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np

from .. import dtypes
from ..errors import CaptureFileError
from ..record import Record
from .base import ReaderBase
from .torch_file import read_tensor

_STEP = re.compile(r"^step(\d+)$")
_RANK = re.compile(r"^(rank\d*|proc\d+)$")  # proc<pid>: msprobe on MindSpore without a rank
_MODULE_PREFIXES = ("Module", "Cell")
_DIRECTIONS = ("forward", "backward", "parameters_grad")
#: msprobe's dtype names (torch's ``torch.float32``, MindSpore's ``Float32``, numpy's) -> tensordiff's
_DTYPES = {"float": "float32", "double": "float64", "half": "float16", "long": "int64", "int": "int32",
           "bool_": "bool"}
_TENSOR_TYPES = ("torch.Tensor", "mindspore.Tensor", "mindspore._c_expression.Tensor", "numpy.ndarray",
                 "torch.nn.parameter.Parameter", "mindspore.common.parameter.Parameter", "mindspore.Parameter")

#: What to do about a damaged dump.
_FIX = "the dump is truncated or was edited; dump again with msprobe"


def is_msprobe_dump(path: str) -> bool:
    """Whether ``path`` is an msprobe dump: a folder holding ``step<N>/rank*/dump.json`` (or one step's or rank's
    folder), or a ``dump.json`` whose start reads like msprobe's (``"task"`` and ``"level"`` before ``"data"``)."""
    try:
        return bool(_rank_dirs(path)) if os.path.isdir(path) else _sniff(path)
    except OSError:
        return False


def _sniff(path: str) -> bool:
    if os.path.basename(path) != "dump.json":
        return False
    with open(path, "rb") as fh:
        head = fh.read(4096).decode("utf-8", "replace")
    return '"task"' in head and '"level"' in head and '"data"' in head


def _rank_dirs(path: str) -> dict[int, str]:
    """step -> its rank folder holding dump.json; ``path`` a dump folder, a step folder or a rank folder."""
    if os.path.isfile(os.path.join(path, "dump.json")):
        parent = os.path.basename(os.path.dirname(os.path.abspath(path)))
        m = _STEP.match(parent)
        return {int(m.group(1)) if m else 0: path}
    out: dict[int, str] = {}
    step_dirs = {int(m.group(1)): os.path.join(path, n) for n in os.listdir(path) for m in [_STEP.match(n)] if m}
    if not step_dirs and any(_RANK.match(n) for n in os.listdir(path)):
        step_dirs = {0: path}  # a step folder
    for step, folder in sorted(step_dirs.items()):
        ranks = sorted(n for n in os.listdir(folder) if _RANK.match(n) and
                       os.path.isfile(os.path.join(folder, n, "dump.json")))
        if len(ranks) > 1:
            raise CaptureFileError(f"{path}: an msprobe dump of {len(ranks)} ranks ({', '.join(ranks)}); pass one "
                                   f"rank's folder ({os.path.join(folder, ranks[0])}) to read that rank")
        if ranks:
            out[step] = os.path.join(folder, ranks[0])
    return out


def _dtype(path: str, name: Any) -> str:
    text = str(name).split(".")[-1].lower()
    text = _DTYPES.get(text, text)
    if text not in dtypes.NUMPY_DTYPES and text not in ("bfloat16", "complex64", "complex128", "uint16", "uint32",
                                                         "uint64"):
        raise CaptureFileError(f"{path}: dtype {name!r} is not one tensordiff knows; {_FIX}")
    return text


def _number(value: Any) -> float:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):  # msprobe writes some statistics as text
        try:
            return float(value)
        except ValueError:
            return math.nan
    return math.nan


def _tensors(value: Any, prefix: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(slot, msprobe's tensor entry) of a nested argument list: ``0``, ``1.0``, ``key``; non-tensors skipped."""
    if isinstance(value, dict) and "type" in value and "shape" in value and "dtype" in value:
        if str(value["type"]) in _TENSOR_TYPES or str(value["type"]).endswith("Tensor"):
            yield prefix, value
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _tensors(item, f"{prefix}.{i}" if prefix else str(i))
    elif isinstance(value, dict) and "type" not in value:
        for key, item in value.items():
            yield from _tensors(item, f"{prefix}.{key}" if prefix else str(key))


class MsprobeDump(ReaderBase):
    """An msprobe dump read as a capture (see the module docstring)."""

    def __init__(self, path: str):
        super().__init__(path)
        if not os.path.exists(path):
            raise CaptureFileError(f"{path}: no such file or folder; check the path of the msprobe dump")
        folder = os.path.dirname(os.path.abspath(path)) if os.path.isfile(path) else path
        self._dirs = _rank_dirs(folder)
        if not self._dirs:
            raise CaptureFileError(f"{path}: no msprobe dump here (no step<N>/rank<R>/dump.json); pass the dump_path "
                                   "msprobe wrote, a step or rank folder of it, or its dump.json")
        self.steps = sorted(self._dirs)
        self._cache: dict[int, list[Record]] = {}
        self._files: dict[tuple[int, int], str] = {}
        self._skipped: dict[int, int] = {}
        first = self._load_json(self.steps[0], "dump.json")
        framework = str(first.get("framework", ""))
        self.attrs = {
            "framework": "mindspore" if framework.lower() == "mindspore" else "torch",
            "tensordiff_format": 1, "source": "msprobe",
            "msprobe_task": str(first.get("task", "")), "msprobe_level": str(first.get("level", "")),
            "tensors": "all" if str(first.get("task", "")) == "tensor" else "none",
            "world_size": 1, "rank": 0,
        }
        self._meta = {self.steps[0]: first}

    # ------------------------------------------------------------------ the reader contract
    def close(self) -> None:
        self._cache.clear()

    def forget(self, step: int) -> None:
        self._cache.pop(step, None)

    def step_attrs(self, step: int) -> dict[str, Any]:
        return {"complete": 1, "records": len(self.records(step))}

    def scalars(self) -> dict[str, dict[int, float]]:
        return {}  # msprobe records no loss

    def nbytes(self) -> int:
        total = 0
        for folder in self._dirs.values():
            for dirpath, _dirs, names in os.walk(folder):
                total += sum(os.path.getsize(os.path.join(dirpath, n)) for n in names)
        return total

    def records(self, step: int) -> list[Record]:
        if step not in self._cache:
            if step not in self._dirs:
                raise CaptureFileError(f"{self.path}: holds no step {step} (steps {self.steps})")
            self._cache[step] = self._build(step)
            self.attrs["msprobe_skipped"] = sum(self._skipped.values())
        return self._cache[step]

    def array(self, record: Record) -> np.ndarray | None:
        if not record.has_data:
            return None
        if record.step not in self._cache:
            self.records(record.step)
        file = self._files.get((record.step, record.seq))
        if file is None:
            return None
        arr = self._read(file, record.dtype)
        if tuple(arr.shape) != record.shape:
            if arr.size != math.prod(record.shape):
                raise CaptureFileError(f"{file}: holds a tensor of shape {list(arr.shape)}, dump.json says "
                                       f"{list(record.shape)} for {record.label}; {_FIX}")
            arr = arr.reshape(record.shape)
        return arr

    # ------------------------------------------------------------------ reading the dump
    def _load_json(self, step: int, name: str, required: bool = True) -> dict[str, Any]:
        file = os.path.join(self._dirs[step], name)
        if not os.path.isfile(file):
            if required:
                raise CaptureFileError(f"{file}: missing; {_FIX}")
            return {}
        try:
            with open(file, encoding="utf-8") as fh:
                value = json.load(fh)
        except json.JSONDecodeError as err:
            raise CaptureFileError(f"{file}: not valid JSON ({err.msg} at line {err.lineno} column {err.colno}); "
                                   f"{_FIX}") from None
        except (OSError, UnicodeDecodeError) as err:
            raise CaptureFileError(f"{file}: cannot be read ({type(err).__name__}: {err}); {_FIX}") from None
        if not isinstance(value, dict) or (name == "dump.json" and not isinstance(value.get("data"), dict)):
            raise CaptureFileError(f"{file}: not an msprobe {name} (expected an object" +
                                   (" with a 'data' object" if name == "dump.json" else "") + f"); {_FIX}")
        return value

    def _read(self, file: str, logical: str) -> np.ndarray:
        if file.endswith(".npy"):
            try:
                arr = np.load(file, allow_pickle=False)
            except ValueError as err:
                if "allow_pickle" in str(err):
                    raise CaptureFileError(f"{file}: refused: it holds Python objects (a pickled array), which "
                                           "tensordiff never loads; re-create the dump with msprobe") from None
                raise CaptureFileError(f"{file}: not a readable .npy file ({err}); {_FIX}") from None
            except OSError as err:
                raise CaptureFileError(f"{file}: cannot be read ({err}); {_FIX}") from None
            name = dtypes.name_of(arr.dtype)
            if name != logical and not (logical == "bfloat16" and name == "float32"):
                raise CaptureFileError(f"{file}: holds {name}, dump.json says {logical}; {_FIX}")
            return arr  # msprobe stores MindSpore's BF16 as float32: compared at that width
        arr, name = read_tensor(file)
        if name != logical:
            raise CaptureFileError(f"{file}: holds {name}, dump.json says {logical}; {_FIX}")
        return dtypes.from_storage(arr, name)

    def _build(self, step: int) -> list[Record]:
        where = os.path.join(self._dirs[step], "dump.json")
        meta = self._meta.get(step) or self._load_json(step, "dump.json")
        data: dict[str, Any] = meta["data"]
        tensor_dir = os.path.join(self._dirs[step], "dump_tensor_data")
        construct = self._load_json(step, "construct.json", required=False)
        calls: dict[str, tuple[str, str, int, str]] = {}  # key -> (module, class, call, direction)
        skipped = 0
        for key in data:
            parts = str(key).split(".")
            if parts[0] not in _MODULE_PREFIXES or len(parts) < 4 or parts[-2] not in _DIRECTIONS \
                    or not parts[-1].isdigit():
                skipped += 1
                continue
            calls[key] = (".".join(parts[1:-3]), parts[-3], int(parts[-1]), parts[-2])
        self._skipped[step] = skipped
        if not calls:
            raise CaptureFileError(f"{where}: no module-level entries ({skipped} API-level ones: a level L1 dump); "
                                   "tensordiff lines up modules: dump at level L0 or mix")
        forward = [k for k, v in calls.items() if v[3] == "forward"]
        entered = [k for k in construct if k in calls and calls[k][3] == "forward"]
        order = entered + [k for k in forward if k not in set(entered)]

        def parent_of(key: str) -> str | None:
            up = construct.get(key)
            return up if isinstance(up, str) and up in calls else None

        out: list[Record] = []
        files: dict[int, str] = {}
        fwd: dict[tuple[str, int, str, str], int] = {}  # (module, call, kind, slot) -> seq
        enter_of: dict[tuple[str, int], tuple[int, str]] = {}

        def add(key: str, phase: str, kind: str, slot: str, entry: Any, enter: int, parent: str,
                grad_of: int = -1, call: int | None = None) -> None:
            module, cls, n, _ = calls[key]
            if not isinstance(entry, dict):
                raise CaptureFileError(f"{where}: {key} {kind} {slot}: expected a tensor entry; {_FIX}")
            try:
                shape = tuple(int(s) for s in entry.get("shape") or ())
            except (TypeError, ValueError):
                raise CaptureFileError(f"{where}: {key} {kind} {slot}: shape {entry.get('shape')!r} is not a list of "
                                       f"sizes; {_FIX}") from None
            dtype = _dtype(where, entry.get("dtype"))
            stats = [_number(entry.get(k)) for k in ("Min", "Max", "Mean", "Norm")]
            seq = len(out)
            data_name = entry.get("data_name")
            has_data = isinstance(data_name, str) and bool(data_name)
            if has_data:
                file = os.path.join(tensor_dir, os.path.basename(str(data_name)))
                files[seq] = file
            nonfinite = [s for s in stats if not math.isfinite(s)]
            nan = int(any(math.isnan(s) for s in stats[:2] + stats[3:]) and dtypes.is_float(dtype))
            inf = int(any(math.isinf(s) for s in stats))
            if has_data and (nonfinite and (not dtypes.is_float(dtype) or nan or inf)):
                arr = self._read(files[seq], dtype)  # integer and bool tensors: msprobe gives no mean or norm
                stats, nan, inf = _stats(arr)
            out.append(Record(step=step, seq=seq, phase=phase, module=module, call=n if call is None else call,
                              kind=kind, slot=slot, module_class=cls, dtype=dtype, shape=shape, min=stats[0],
                              max=stats[1], mean=stats[2], l2=stats[3], nan=nan, inf=inf, numel=math.prod(shape),
                              has_data=has_data, grad_of=grad_of, enter=enter, parent=parent))

        weights_seen: set[str] = set()
        for key in order:  # weights: the parameters of each module's first call
            module, _cls, _n, _ = calls[key]
            params = data[key].get("parameters") if isinstance(data[key], dict) else None
            if module in weights_seen or not isinstance(params, dict):
                continue
            weights_seen.add(module)
            for slot, entry in _tensors(params, ""):
                add(key, "weights", "param", slot, entry, -1, "", call=0)

        stack: list[str] = []

        def leave(key: str) -> None:
            module, _cls, n, _ = calls[key]
            enter, parent = enter_of[(module, n)]
            for slot, entry in _tensors(data[key].get("output"), ""):
                fwd[(module, n, "output", slot)] = len(out)
                add(key, "forward", "output", slot, entry, enter, parent)

        for key in order:
            up = parent_of(key)
            while stack and stack[-1] != up:
                leave(stack.pop())
            module, _cls, n, _ = calls[key]
            parent = calls[up][0] if up is not None else ""
            enter_of[(module, n)] = (len(out), parent)
            entry = data[key] if isinstance(data[key], dict) else {}
            for slot, item in [*_tensors(entry.get("input_args"), ""), *_tensors(entry.get("input_kwargs"), "")]:
                fwd[(module, n, "input", slot)] = len(out)
                add(key, "forward", "input", slot, item, enter_of[(module, n)][0], parent)
            stack.append(key)
        while stack:
            leave(stack.pop())

        grads: list[tuple[str, str, dict[str, Any]]] = []
        for key, (module, _cls, n, direction) in calls.items():
            entry = data[key] if isinstance(data[key], dict) else {}
            if direction == "backward":
                enter, parent = enter_of.get((module, n), (-1, ""))
                for side, kind, fkind in (("input", "grad_output", "output"), ("output", "grad_input", "input")):
                    for slot, item in _tensors(entry.get(side), ""):
                        add(key, "backward", kind, slot, item, enter, parent, fwd.get((module, n, fkind, slot), -1))
            elif direction == "parameters_grad":
                grads.append((key, module, entry))
        for key, _module, entry in grads:
            for name, values in entry.items():
                last = values[-1] if isinstance(values, list) and values else values
                if isinstance(last, dict) and "shape" in last:
                    add(key, "param_grad", "grad", str(name), last, -1, "", call=0)
        for seq, file in files.items():
            self._files[(step, seq)] = file
        return out


def _stats(arr: np.ndarray) -> tuple[list[float], int, int]:
    """min, max, mean, L2 (over the finite elements of a float tensor) and the NaN and Inf counts of ``arr``."""
    x = np.asarray(arr, dtype=np.float64).reshape(-1)
    if x.size == 0:
        return [0.0, 0.0, 0.0, 0.0], 0, 0
    nan, inf = int(np.isnan(x).sum()), int(np.isinf(x).sum())
    finite = x[np.isfinite(x)]
    if finite.size == 0:
        return [math.nan] * 4, nan, inf
    return [float(finite.min()), float(finite.max()), float(finite.mean()), float(np.sqrt(np.sum(finite * finite)))], \
        nan, inf
