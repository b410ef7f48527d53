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
    if module in ("builtins", "__builtin__"):
        return attr in _CODE_BUILTINS
    if module in ("operator", "_operator"):
        return attr in _CODE_OPERATORS
    return any(module == m or module.startswith(m + ".") for m in _CODE_MODULES)


def load(path: str) -> Any:
    """The object a ``torch.save`` file holds, read by torch's safe loader with the allow-list above (a
    ``CheckpointError`` for a file that names code; torch's own errors for a damaged one)."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # not a zip-format torch file, or damaged: torch.load says which
        names = []
    hostile = sorted(n for n in names if code_name(n))
    if hostile:
        raise CheckpointError(f"{path}: refused: loading it would call {hostile[0]} (code, not tensors); "
                              "tensordiff reads "
                              "checkpoints with torch's safe loader only and never runs what a file names; fix: do not "
                              "use this file unless you know where it came from")
    plain = _plain()
    allowed: list[Any] = [(plain[n], n) if n in plain else (_opaque(n), n) for n in names]
    if any(n.startswith("numpy.") for n in names):  # a dtype is built as its class (numpy.dtypes.*), unnamed
        allowed += [(obj, n) for n, obj in plain.items() if n.startswith("numpy.") and n not in names]
    with torch.serialization.safe_globals(allowed):
        return torch.load(path, map_location="cpu", weights_only=True)
