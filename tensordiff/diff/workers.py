"""Tensor pairs measured in worker processes: a distributed run's merge and compare spread over the rank-file pool.

A diff of hundreds of rank files spends its time putting each merged tensor together (one small read per rank
file) and comparing it. Both run where the rank files are read: the diff's process sends the matched pairs in
batches (``BATCH_PAIRS`` pairs or ``BATCH_BYTES`` of tensors), each with its records' *plans*
(``CaptureReader.plan``, ``plan.read_plan``: which rank file records to read and how to join them, plain data),
to the executor of ``store/fanout.py`` (a process pool on one host, a Dask cluster across hosts); a worker reads,
merges and compares with the very functions the diff's own process uses (``judge.measure_pair``) and returns the
metrics only. A worker keeps the rank files it opened for the rest of its diff (``session``): each file's
attributes are read once per worker, not once per tensor.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ..record import Record
from ..store import CaptureFile, CaptureReader, ReaderBase
from ..store.plan import FilePlan, Plan, read_plan
from .align import Pair
from .judge import Measured, measure_pair

#: A batch's size: at most this many pairs, or this many bytes of (estimated) tensors, whichever comes first.
BATCH_PAIRS = 64
BATCH_BYTES = 64 << 20

_open: dict[str, CaptureFile] = {}  # this worker's open rank files, for the diff named by _session
_session = [""]
_lock = threading.Lock()


def _file(path: str, session: str) -> CaptureFile:
    with _lock:
        if _session[0] != session:  # a later diff (a long-lived Dask worker): the files may have been rewritten
            for cap in _open.values():
                cap.close()
            _open.clear()
            _session[0] = session
        found = _open.get(path)
        if found is None:  # tensors only: the diff's process checked the file's attributes and index
            found = _open[path] = CaptureFile.unopened(path)
        return found


class PlannedSide(ReaderBase):
    """One side of a batch in a worker: its records' plans, followed over the rank files this worker has open.
    Only what ``measure_pair`` reads (``array``, ``same_stored``, through ``plan``); no records, steps or file of
    its own."""

    def __init__(self, plans: dict[tuple[int, int], Plan | None], session: str):
        super().__init__("<plans>")
        self._plans, self._session = plans, session

    def records(self, step: int) -> list[Record]:
        return []

    def step_attrs(self, step: int) -> dict[str, Any]:
        return {}

    def nbytes(self) -> int:
        return 0

    def _read(self, path: str, record: Record) -> np.ndarray | None:
        return _file(path, self._session).array(record)

    def plan(self, record: Record) -> Plan | None:
        return self._plans.get((record.step, record.seq))

    def array(self, record: Record) -> np.ndarray | None:
        return read_plan(self.plan(record), self._read)

    def same_stored(self, record: Record, other: CaptureReader, other_record: Record) -> bool:
        mine, theirs = self.plan(record), other.plan(other_record)
        if not isinstance(mine, FilePlan) or not isinstance(theirs, FilePlan):
            return False  # merged tensors are read and compared
        return _file(mine.path, self._session).same_stored(mine.record, _file(theirs.path, self._session),
                                                           theirs.record)


def measure_batch(pairs: list[Pair], plans_a: dict[tuple[int, int], Plan | None],
                  plans_b: dict[tuple[int, int], Plan | None], ulp_k: int, session: str) -> list[tuple[bool, Any]]:
    """In a worker: each pair measured as the diff's process would (``measure_pair``); per pair (True, Measured),
    or (False, the error it raised), so that the diff raises the first one in row order as a serial diff does."""
    ca, cb = PlannedSide(plans_a, session), PlannedSide(plans_b, session)
    out: list[tuple[bool, Any]] = []
    for pair in pairs:
        try:
            measured: Measured = measure_pair(ca, cb, pair, ulp_k)
            out.append((True, measured))
        except Exception as err:  # handed back to the diff's process, raised there in row order
            out.append((False, err))
    return out


def records_of(pair: Pair) -> tuple[list[Record], list[Record]]:
    """The records of each side whose tensors ``measure_pair`` may read."""
    a = [r for r in (pair.a, pair.bias_a) if r is not None]
    b = [r for r in (*pair.b_records, pair.bias_b) if r is not None]
    return a, b
