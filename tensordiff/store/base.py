"""The reader contract: ``CaptureReader``, what every reader of a capture offers, whatever it reads (a capture file,
rank files merged on read, pipeline stages joined, an msprobe dump, Megatron-LM's gradient files, a worker's plans).

Every reader has the reading API (``path``, ``attrs``, ``steps``, ``records(step)``, ``array(record)``, ...) and
declares the capabilities only some readers have; those it lacks answer their stated defaults (``ReaderBase``, which
every reader derives from): one rank's layout (``tp = dp = pp = 1``, ``sp`` False, not ``merged``, ``paths`` its own
path), no rank or stage copies (``tp_copies``, ``dp_copies``, ``tied_copies``, ``received_from``, ``stage_of`` ->
None), no cross-rank inconsistencies (``[]``), no read plan (``plan`` -> None: read here). Callers type against
``CaptureReader`` and ask a capability directly: no reader is told apart by its class or its private attributes
outside ``store/`` (tests/core/test_reader_contract.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np

from ..record import Record
from .plan import Plan

_R = TypeVar("_R", bound="ReaderBase")


@runtime_checkable
class CaptureReader(Protocol):
    """What every capture reader offers (see the module docstring)."""

    #: the file, folder or glob read
    path: str
    #: the capture's attributes (framework, settings, the run's layout, ...)
    attrs: dict[str, Any]
    #: the complete steps, in order, and those a run left unfinished
    steps: list[int]
    incomplete_steps: list[int]
    #: merged from the rank files of one distributed run (``paths``; ``tp``, ``dp``, ``pp``, ``sp`` their layout)
    merged: bool
    tp: int
    dp: int
    pp: int
    sp: bool
    #: each pipeline stage's layer offset (its first layer's global number); empty for one stage
    offsets: Sequence[int]

    @property
    def framework(self) -> str: ...

    @property
    def paths(self) -> list[str]:
        """The files read: the rank files of a merged run, else ``[path]``."""
        ...

    def records(self, step: int) -> list[Record]: ...

    def iter_records(self) -> Iterator[Record]: ...

    def array(self, record: Record) -> np.ndarray | None:
        """The tensor of ``record``, or None (statistics only)."""
        ...

    def step_attrs(self, step: int) -> dict[str, Any]: ...

    def scalars(self) -> dict[str, dict[int, float]]:
        """Per-step scalars of the run: name -> {step: value}."""
        ...

    def nbytes(self) -> int:
        """The size of what is read, in bytes."""
        ...

    def plan(self, record: Record) -> Plan | None:
        """How ``record``'s tensor is read, as plain data a worker process can follow (``plan.read_plan``), or None:
        read it here (a reader of another format)."""
        ...

    def same_stored(self, record: Record, other: CaptureReader, other_record: Record) -> bool:
        """Whether ``record``'s tensor here and ``other_record``'s in ``other`` are stored as the same bytes (False
        where it cannot tell cheaply: the tensors are then read and compared)."""
        ...

    def forget(self, step: int) -> None:
        """Drop what was kept of a step's records (memory); they are read again if asked for."""
        ...

    def tp_copies(self, record: Record) -> list[np.ndarray] | None:
        """Each tensor-parallel rank's copy of a record merged as replicated, or None."""
        ...

    def dp_copies(self, record: Record) -> list[np.ndarray] | None:
        """Each data-parallel rank's own tensor of a record merged as their mean (a local gradient), or None."""
        ...

    def tied_copies(self, record: Record) -> list[tuple[int, np.ndarray]] | None:
        """Each pipeline stage's copy of a tied weight's record as (stage, tensor), or None."""
        ...

    def tied_copy_name(self, module: str, slot: str) -> str:
        """The name of the last pipeline stage's copy of tied weight ``module.slot``, or ''."""
        ...

    def received_from(self, record: Record) -> tuple[Record, int, int] | None:
        """For a tensor a pipeline stage received, what the previous stage sent, with the sending and receiving
        stages; else None."""
        ...

    def stage_of(self, record: Record) -> int | None:
        """The pipeline stage holding ``record``, or None."""
        ...

    def param_split(self, module: str, slot: str) -> dict[str, Any]:
        """How a parameter is split across ranks (``tp``, ``dim``, ``stride``, ``sp``, ``tied_copy``), or {}."""
        ...

    def inconsistent_records(self, step: int) -> list[tuple[Record, str, list[int]]]:
        """Records that must be identical on the ranks holding them but differ: (record, group, ranks)."""
        ...

    def inconsistencies(self, step: int) -> list[str]:
        """``inconsistent_records`` in words: '<label>: TP ranks 0/1 differ'."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> CaptureReader: ...

    def __exit__(self, *exc: object) -> None: ...


class ReaderBase(ABC):
    """What every reader derives from: the contract's stated defaults (see the module docstring); a reader
    implements ``records``, ``array``, ``step_attrs`` and ``nbytes``, and overrides the capabilities it has."""

    path: str
    attrs: dict[str, Any]
    steps: list[int]
    incomplete_steps: list[int]
    merged = False
    tp = 1
    dp = 1
    pp = 1
    sp = False
    offsets: Sequence[int] = ()

    def __init__(self, path: str):
        self.path = path
        self.attrs = {}
        self.steps = []
        self.incomplete_steps = []

    # context manager -------------------------------------------------------
    def __enter__(self: _R) -> _R:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Nothing to release (a reader holding files closes them)."""
        return None

    # reading ---------------------------------------------------------------
    @property
    def framework(self) -> str:
        return str(self.attrs.get("framework", "?"))

    @property
    def paths(self) -> list[str]:
        return [self.path]

    @abstractmethod
    def records(self, step: int) -> list[Record]: ...

    def iter_records(self) -> Iterator[Record]:
        for step in self.steps:
            yield from self.records(step)

    @abstractmethod
    def array(self, record: Record) -> np.ndarray | None: ...

    @abstractmethod
    def step_attrs(self, step: int) -> dict[str, Any]: ...

    def scalars(self) -> dict[str, dict[int, float]]:
        return {}

    @abstractmethod
    def nbytes(self) -> int: ...

    def plan(self, record: Record) -> Plan | None:
        return None

    def same_stored(self, record: Record, other: CaptureReader, other_record: Record) -> bool:
        return False

    def forget(self, step: int) -> None:
        """Nothing kept (a reader keeping each step's records drops them)."""
        return None

    # capabilities of merged rank files and pipeline stages ---------------------------------------------
    def tp_copies(self, record: Record) -> list[np.ndarray] | None:
        return None

    def dp_copies(self, record: Record) -> list[np.ndarray] | None:
        return None

    def tied_copies(self, record: Record) -> list[tuple[int, np.ndarray]] | None:
        return None

    def tied_copy_name(self, module: str, slot: str) -> str:
        return ""

    def received_from(self, record: Record) -> tuple[Record, int, int] | None:
        return None

    def stage_of(self, record: Record) -> int | None:
        return None

    def param_split(self, module: str, slot: str) -> dict[str, Any]:
        return {}

    def inconsistent_records(self, step: int) -> list[tuple[Record, str, list[int]]]:
        return []

    def inconsistencies(self, step: int) -> list[str]:
        return [f"{rec.label}: {group} ranks {'/'.join(map(str, ranks))} differ"
                for rec, group, ranks in self.inconsistent_records(step)]
