"""``torch.save`` files that hold more than tensors, read without running anything they name.

Megatron-LM's ``model_optim_rng.pt`` holds, beside the model's state dict, the run's ``args`` (an
``argparse.Namespace`` whose values include torch dtypes and megatron enums), the optimizer's state, the learning-rate
scheduler's and the RNG states (Python's ``random.getstate()``, numpy's ``get_state()`` arrays). torch's safe loader
(``weights_only=True``) refuses such a file at the first name it does not know. ``load`` reads it with that same
loader and an allow-list, and runs no code the file names:

* plain data classes are built as themselves: ``argparse.Namespace`` (its ``__dict__`` set from the file), numpy
  arrays and dtypes (numpy's own reconstruction of an array from its bytes);
* every other name the file holds (an enum of megatron, ``functools.partial``, a class of the training code) becomes an
  inert stand-in (:class:`Opaque`): it keeps the name and what the file would have built it from, and nothing of the
  file is called; the tensors and plain values around it are read as they are;
* a file that names code (``os.system``, ``builtins.eval``, ``subprocess``, ``importlib``, ...) is refused with one
  line, whatever else it holds: a checkpoint never needs them.

The names are found first by torch's own scan of the pickle (``get_unsafe_globals_in_checkpoint``), so the file is
read once. Used by ``frameworks/torch.py``'s ``load_checkpoint``.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointError

#: names that only code needs: a file that names one is refused (module prefixes, and single builtins)
_CODE_MODULES = ("os", "posix", "nt", "subprocess", "sys", "importlib", "runpy", "code", "codeop", "pickle", "_pickle",
                 "marshal", "ctypes", "shutil", "socket", "pty", "webbrowser", "multiprocessing", "types", "inspect",
                 "threading", "signal", "asyncio", "pathlib", "tempfile", "io", "_io", "gc", "pdb", "timeit", "sysconfig")
_CODE_BUILTINS = {"eval", "exec", "compile", "getattr", "setattr", "delattr", "__import__", "open", "globals",
                  "locals", "vars", "input", "breakpoint", "exit", "quit", "help", "memoryview", "type", "object",
                  "super", "classmethod", "staticmethod", "property"}
_CODE_OPERATORS = {"attrgetter", "methodcaller", "itemgetter", "call"}
#: data names that live in a code module: read as inert stand-ins like any other name (Megatron-LM's saved ``args``
#: hold ``exit_signal=signal.SIGTERM``, pickled as ``signal.Signals(15)``); the module's functions stay refused
_DATA_IN_CODE = {"signal.Signals", "signal.Handlers", "signal.Sigmasks"}


def _plain() -> dict[str, Any]:
    """Plain-data classes and numpy's array reconstruction, built as themselves."""
    from numpy.core import multiarray  # numpy < 2, as this project pins

    out: dict[str, Any] = {
        "argparse.Namespace": argparse.Namespace,
        "numpy.core.multiarray._reconstruct": multiarray._reconstruct,  # type: ignore[attr-defined]
        "numpy.core.multiarray.scalar": multiarray.scalar,  # type: ignore[attr-defined]
        "numpy.ndarray": np.ndarray,
        "numpy.dtype": np.dtype,
    }
    for name in dir(np.dtypes) if hasattr(np, "dtypes") else ():
        cls = getattr(np.dtypes, name)
        if isinstance(cls, type) and issubclass(cls, np.dtype):
            out[f"numpy.dtypes.{name}"] = cls
    return out


class Opaque:
    """An object a checkpoint names but tensordiff does not build: the name (``opaque_name``) and what the file would
    have built it from (``args``, ``state``). Inert: nothing of the file is called to make it."""

    opaque_name = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> Opaque:
        inst = object.__new__(cls)
        inst.__dict__["args"] = args
        return inst

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.__dict__["state"] = state

    def __setitem__(self, key: Any, value: Any) -> None:  # a dict-like the file fills (SETITEMS)
        self.__dict__.setdefault("items", {})[key] = value

    def append(self, value: Any) -> None:  # a list-like the file fills (APPENDS)
        self.__dict__.setdefault("values", []).append(value)

    def extend(self, values: Any) -> None:
        self.__dict__.setdefault("values", []).extend(values)

    def __repr__(self) -> str:
        args = ", ".join(map(repr, self.__dict__.get("args", ())))
        return f"{self.opaque_name}({args})"


def _opaque(name: str) -> type:
    short = re.sub(r"\W", "_", name.rpartition(".")[2]) or "Opaque"
    return type(short, (Opaque,), {"opaque_name": name, "__module__": __name__})


def code_name(name: str) -> bool:
    """Whether a pickled global names code rather than data (such a file is refused)."""
    module, _, attr = name.rpartition(".")
    if name in _DATA_IN_CODE:
        return False
    if module in ("builtins", "__builtin__"):
        return attr in _CODE_BUILTINS
    if module in ("operator", "_operator"):
        return attr in _CODE_OPERATORS
    return any(module == m or module.startswith(m + ".") for m in _CODE_MODULES)


def load(path: Any, shown_as: str | None = None) -> Any:
    """The object a ``torch.save`` file (a path, or a file object) holds, read by torch's safe loader with the
    allow-list above (a ``CheckpointError`` for a file that names code; torch's own errors for a damaged one)."""
    shown = shown_as or str(path)
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # not a zip-format torch file, or damaged: torch.load says which
        names = []
    if hasattr(path, "seek"):
        path.seek(0)
    hostile = sorted(n for n in names if code_name(n))
    if hostile:
        raise CheckpointError(f"{shown}: refused: loading it would call {hostile[0]} (code, not tensors); "
                              "tensordiff reads "
                              "checkpoints with torch's safe loader only and never runs what a file names; fix: do not "
                              "use this file unless you know where it came from")
    plain = _plain()
    allowed: list[Any] = [(plain[n], n) if n in plain else (_opaque(n), n) for n in names]
    if any(n.startswith("numpy.") for n in names):  # a dtype is built as its class (numpy.dtypes.*), unnamed
        allowed += [(obj, n) for n, obj in plain.items() if n.startswith("numpy.") and n not in names]
    with torch.serialization.safe_globals(allowed):
        return torch.load(path, map_location="cpu", weights_only=True)


# ------------------------------------------------------------------------------- raw pickles (DCP's .metadata)
def _dcp_classes() -> list[Any]:
    """The plain data classes of a PyTorch distributed checkpoint's ``.metadata`` (and nothing else)."""
    from torch.distributed.checkpoint import filesystem, metadata, planner

    names = ("Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata", "BytesStorageMetadata",
             "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
    out = [getattr(metadata, n) for n in names if hasattr(metadata, n)]
    out += [getattr(planner, n) for n in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "LoadPlan",
                                          "ReadItem", "LoadItemType") if hasattr(planner, n)]
    out += [getattr(filesystem, n) for n in ("_StorageInfo", "_StoragePrefix") if hasattr(filesystem, n)]
    return out + [torch.Size]


def _protocol2(data: bytes, shown_as: str) -> bytes:
    """A protocol-4/5 pickle re-encoded with the opcodes torch's weights-only unpickler reads (it knows no FRAME,
    MEMOIZE, SHORT_BINUNICODE nor STACK_GLOBAL). Only parsed (``pickletools.genops``), never run: strings become
    BINUNICODE literals (a memoized string is written again where it is fetched), STACK_GLOBAL of two strings the
    GLOBAL instruction naming them, MEMOIZE an explicit LONG_BINPUT."""
    import pickletools
    import struct

    try:
        ops = list(pickletools.genops(data))
    except Exception as err:  # a truncated or damaged pickle
        raise CheckpointError(f"{shown_as}: not a readable pickle ({err}); is it truncated?") from None
    out: list[tuple[str, Any]] = []  # ("str", value) or ("raw", bytes)
    memo_str: dict[int, str] = {}
    memo_next = 0
    for i, (op, arg, pos) in enumerate(ops):
        end = ops[i + 1][2] if i + 1 < len(ops) else len(data)
        name = op.name
        if name == "FRAME":
            continue
        if name == "PROTO":
            out.append(("raw", b"\x80\x02"))
        elif name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"):
            out.append(("str", arg))
        elif name in ("MEMOIZE", "BINPUT", "LONG_BINPUT"):
            idx = memo_next if name == "MEMOIZE" else int(arg)  # type: ignore[arg-type]
            memo_next = max(memo_next, idx + 1)
            if out and out[-1][0] == "str":
                memo_str[idx] = out[-1][1]
            else:
                out.append(("raw", b"r" + struct.pack("<I", idx)))
        elif name in ("BINGET", "LONG_BINGET"):
            got = int(arg)  # type: ignore[arg-type]
            out.append(("str", memo_str[got]) if got in memo_str else ("raw", b"j" + struct.pack("<I", got)))
        elif name == "STACK_GLOBAL":
            if len(out) < 2 or out[-1][0] != "str" or out[-2][0] != "str":
                raise CheckpointError(f"{shown_as}: refused: a pickle that computes the name of what it loads "
                                      "(STACK_GLOBAL of non-constant names); fix: do not use this file unless you know "
                                      "where it came from")
            qual, module = out.pop()[1], out.pop()[1]
            out.append(("raw", b"c" + module.encode() + b"\n" + qual.encode() + b"\n"))
        else:
            out.append(("raw", data[pos:end]))
    parts = []
    for kind, value in out:
        if kind == "str":
            raw = value.encode("utf-8", "surrogatepass")
            parts.append(b"X" + struct.pack("<I", len(raw)) + raw)
        else:
            parts.append(value)
    return b"".join(parts)


def _pickle_globals(data: bytes) -> list[str]:
    """The names a (protocol 2) pickle loads, found by parsing it (nothing run)."""
    import pickletools

    return [str(arg).replace(" ", ".") for op, arg, _ in pickletools.genops(data) if op.name == "GLOBAL"]


def load_dcp_metadata(path: str) -> Any:
    """The ``Metadata`` object of a PyTorch distributed checkpoint's ``.metadata`` file (a plain pickle), read with
    torch's weights-only unpickler that allows only DCP's own metadata classes, ``torch.Size`` and torch's defaults
    (dtypes, layouts). A file naming anything else is refused with one line; nothing it names is ever called."""
    import io

    from torch import _weights_only_unpickler as wu

    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read it ({err.strerror or err})") from None
    stream = _protocol2(data, path)
    allowed = _dcp_classes()
    known = {f"{c.__module__}.{c.__qualname__}" for c in allowed}
    for name in _pickle_globals(stream):
        if code_name(name):
            raise CheckpointError(f"{path}: refused: loading it would call {name} (code, not checkpoint metadata); "
                                  "tensordiff never runs what a file names; fix: do not use this folder unless you "
                                  "know where it came from")
        if name not in known and not name.startswith("torch.") and not name.startswith("collections.OrderedDict"):
            raise CheckpointError(f"{path}: names {name}, which a distributed checkpoint's metadata does not hold "
                                  "(only torch.distributed.checkpoint's metadata classes are read); fix: pass a folder "
                                  "written by torch.distributed.checkpoint / megatron-core")
    try:
        with torch.serialization.safe_globals(allowed):
            return wu.Unpickler(io.BytesIO(stream), encoding="utf-8").load()
    except Exception as err:
        raise CheckpointError(f"{path}: refused by torch's safe unpickler ({str(err).splitlines()[0][:160]}); not "
                              "the metadata of a torch distributed checkpoint, or a damaged one") from None


def load_bytes(data: bytes, shown_as: str) -> Any:
    """The object of a ``torch.save`` blob held in memory (a DCP item), read as ``load`` reads a file."""
    import io

    return load(io.BytesIO(data), shown_as=shown_as)
