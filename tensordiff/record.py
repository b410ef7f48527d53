"""One captured tensor: where it was seen and what it held, and its row in a capture file's index.

A capture is a sequence of steps; each step a list of records in the order they
were produced. ``seq`` is that order within the step (weights first, then the
forward pass, the loss, the backward pass in the order it ran, the parameter
gradients).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from operator import attrgetter
from typing import Any

import numpy as np

#: Phases of a step, in the order they happen.
PHASES: tuple[str, ...] = ("weights", "forward", "loss", "backward", "param_grad")
PHASE_RANK = {p: i for i, p in enumerate(PHASES)}


@dataclass(frozen=True, slots=True)
class Record:
    """Metadata and statistics of one captured tensor."""

    step: int
    seq: int
    phase: str
    module: str
    call: int
    kind: str
    slot: str
    module_class: str
    dtype: str
    shape: tuple[int, ...]
    min: float = 0.0
    max: float = 0.0
    mean: float = 0.0
    l2: float = 0.0
    nan: int = 0
    inf: int = 0
    numel: int = 0
    has_data: bool = False
    #: seq of the earlier record holding the very same tensor (-1: none).
    same_as: int = -1
    #: for gradients, seq of the forward record this is the gradient of (-1: none).
    grad_of: int = -1
    #: seq at which the module call that produced this record was entered (-1: none).
    enter: int = -1
    #: the enclosing module call when this module was entered ("" at the root).
    parent: str = ""

    def __reduce__(self) -> tuple:
        """Pickled as its field values (worker processes send many records: ~1.7x faster both ways than the
        dataclass's own state)."""
        return Record, _field_values(self)

    @property
    def tensor_id(self) -> tuple[int, int]:
        """(step, seq of the record that first held this tensor): a link (``same_as``) and its source are one tensor."""
        return self.step, self.same_as if self.same_as >= 0 else self.seq

    @property
    def key(self) -> tuple[str, str, int, str, str]:
        return (self.phase, self.module, self.call, self.kind, self.slot)

    @property
    def label(self) -> str:
        """``module[call] kind.slot`` as shown in tables."""
        mod = self.module or "<model>"
        call = f"[{self.call}]" if self.call else ""
        return f"{mod}{call} {self.tensor_label}"

    @property
    def tensor_label(self) -> str:
        if self.kind in ("param", "grad", "loss"):
            return self.slot if self.kind != "grad" else f"grad {self.slot}"
        if self.kind == "grad_local":
            return f"local grad {self.slot}"
        return f"{self.kind}.{self.slot}" if self.slot else self.kind

    @property
    def stats_known(self) -> bool:
        """False for a record whose statistics could not be known: a data-parallel mean of local gradients merged
        from rank files that hold statistics only (min, max, mean and L2 are NaN, with no NaN element counted)."""
        return math.isfinite(self.l2) or self.nan > 0 or self.inf > 0 or self.has_data


#: A record's field values in the order ``Record(...)`` takes them (its pickled form).
_field_values = attrgetter(*(f.name for f in fields(Record)))

#: Text of any length, stored as UTF-8 (what ``h5py.string_dtype()`` is).
_TEXT = np.dtype("O", metadata={"vlen": str})
#: A record's row in a capture file's index (docs/format.md): its fields in their order, but ``step`` (the step's group
#: holds the rows), with ``shape`` as text ('4,8'; '' for a scalar) and ``has_data`` as 0 or 1.
INDEX_DTYPE = np.dtype(
    [
        ("seq", np.int64),
        ("phase", _TEXT),
        ("module", _TEXT),
        ("call", np.int32),
        ("kind", _TEXT),
        ("slot", _TEXT),
        ("module_class", _TEXT),
        ("dtype", _TEXT),
        ("shape", _TEXT),
        ("min", np.float64),
        ("max", np.float64),
        ("mean", np.float64),
        ("l2", np.float64),
        ("nan", np.int64),
        ("inf", np.int64),
        ("numel", np.int64),
        ("has_data", np.int8),
        ("same_as", np.int64),
        ("grad_of", np.int64),
        ("enter", np.int64),
        ("parent", _TEXT),
    ]
)
#: The index's columns, in order.
ROW_FIELDS: tuple[str, ...] = INDEX_DTYPE.names or ()
#: The columns holding integers, numbers and text: what a reader checks each column holds.
INT_COLUMNS = tuple(name for name in ROW_FIELDS if INDEX_DTYPE[name].kind == "i")
FLOAT_COLUMNS = tuple(name for name in ROW_FIELDS if INDEX_DTYPE[name].kind == "f")
TEXT_COLUMNS = tuple(name for name in ROW_FIELDS if INDEX_DTYPE[name].kind == "O")


def module_label(name: str) -> str:
    return name or "<model>"


def is_inside(child: str, parent: str) -> bool:
    """True when module ``child`` is nested in module ``parent`` (the root holds all)."""
    if parent == "":
        return child != ""
    return child.startswith(parent + ".")


def flatten(value: Any, prefix: str, is_tensor: Callable[[Any], bool]) -> Iterator[tuple[str, Any]]:
    """(slot, tensor) pairs of a nested output or argument structure: '0', '1.0', 'key', ..."""
    if is_tensor(value):
        yield prefix, value
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from flatten(item, f"{prefix}.{i}" if prefix else str(i), is_tensor)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from flatten(item, f"{prefix}.{key}" if prefix else str(key), is_tensor)
