"""A record's read plan: how its tensor is read, as plain data another process can follow (``CaptureReader.plan``).

* ``FilePlan(path, record)``: one stored tensor of one capture file;
* ``MergePlan(spec, grid)``: rank files' tensors (``grid``: rows of (path, record)) joined as ``spec`` (a
  ``MergeSpec``: how one record merges across tensor- and data-parallel ranks) says (``merged.py``);
* ``SumPlan(parts)``: the sum of other plans' tensors (a tied weight's local gradient: one share per pipeline stage,
  ``pipeline.py``).

``read_plan`` follows a plan, in the diff's process or in a worker (``diff/workers.py``): the one place a merged
tensor is put together. Plans are frozen dataclasses of numbers, text and records: they pickle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np

from ..record import Record


@dataclass(frozen=True)
class MergeSpec:
    """How one record merges: TP concatenation (dim, stride), DP concatenation (dim) and scale, or DP mean."""

    tp_dim: int | None = None
    tp_stride: int = 1
    dp_dim: int | None = None
    scale: float = 1.0
    dp_mean: bool = False
    swap01: bool = False
    tp_sum: bool = False
    #: a reduced gradient that each DP rank holds a part of (megatron's distributed optimizer): the parts joined,
    #: (start, end) per DP rank and the parameter's shape on one TP rank
    dp_shards: tuple[tuple[int, int], ...] | None = None
    shard_shape: tuple[int, ...] = ()


@dataclass(frozen=True)
class FilePlan:
    """One stored tensor: ``record`` of the capture file at ``path``."""

    path: str
    record: Record


#: A grid of rank files' records: rows (DP ranks, or TP ranks for a gradient the DP ranks hold in parts) of
#: (path, record)
Grid: TypeAlias = tuple[tuple[tuple[str, Record], ...], ...]


@dataclass(frozen=True)
class MergePlan:
    """Rank files' tensors (``grid``) joined as ``spec`` says."""

    spec: MergeSpec
    grid: Grid


@dataclass(frozen=True)
class SumPlan:
    """The sum of other plans' tensors."""

    parts: tuple[Plan, ...]


#: A read plan, one of the three
Plan: TypeAlias = FilePlan | MergePlan | SumPlan


def read_plan(plan: Plan | None, read: Callable[[str, Record], np.ndarray | None]) -> np.ndarray | None:
    """The tensor ``plan`` describes, each stored tensor read by ``read(path, record)``; None where one of them is
    not stored. The one place a merged tensor is put together (in the diff's process or in a worker)."""
    if plan is None:
        return None
    if isinstance(plan, FilePlan):
        return read(plan.path, plan.record)
    if isinstance(plan, SumPlan):
        parts = [read_plan(p, read) for p in plan.parts]
        if not parts or any(p is None for p in parts):
            return None
        return sum_parts([p for p in parts if p is not None])
    spec = plan.spec
    rows = read_grid(plan.grid, read)
    if rows is None:
        return None
    if spec.dp_shards is not None:  # a reduced gradient held in parts by the DP ranks, then TP-joined
        per_tp = [np.concatenate([x.reshape(-1) for x in row]).reshape(spec.shard_shape) for row in rows]
        return join_tp(per_tp, spec.tp_dim, spec.tp_stride) if spec.tp_dim is not None else per_tp[0]
    pieces = [dp_row(spec, row) for row in rows]
    if spec.dp_mean:
        mean = np.mean(np.stack([p.astype(np.float64) for p in pieces]), axis=0)
        # the mean of narrow floats (BF16 local gradients) stays float32: rounding it back to BF16 would add
        # the very rounding a BF16 reduction is judged by
        wide = pieces[0].dtype if pieces[0].dtype.itemsize >= 4 or pieces[0].dtype.kind not in "fV" else np.float32
        out = mean.astype(wide)
    elif spec.dp_dim is not None:
        out = np.concatenate(pieces, axis=spec.dp_dim)
    else:
        out = pieces[0]
    if spec.scale != 1.0:
        out = (out.astype(np.float64) * spec.scale).astype(out.dtype)
    if spec.swap01 and out.ndim >= 2:
        out = np.ascontiguousarray(np.swapaxes(out, 0, 1))
    return out


def read_grid(grid: Grid, read: Callable[[str, Record], np.ndarray | None]) -> list[list[np.ndarray]] | None:
    """The grid's tensors, row by row; None at the first one not stored (the rest are not read)."""
    rows = []
    for row in grid:
        xs = []
        for path, rec in row:
            x = read(path, rec)
            if x is None:
                return None
            xs.append(x)
        rows.append(xs)
    return rows


def dp_row(spec: MergeSpec, parts: list[np.ndarray]) -> np.ndarray:
    """One data-parallel rank's tensor from its TP ranks' parts: joined, summed, or rank 0's copy."""
    if spec.tp_dim is not None:
        return join_tp(parts, spec.tp_dim, spec.tp_stride)
    return sum_parts(parts) if spec.tp_sum else parts[0]


def sum_parts(parts: list[np.ndarray]) -> np.ndarray:
    """The sum of partial sums (one per TP rank), in float64, in the parts' dtype."""
    return np.sum(np.stack([p.astype(np.float64) for p in parts]), axis=0).astype(parts[0].dtype)


def join_tp(parts: list[np.ndarray], dim: int, stride: int) -> np.ndarray:
    axis = dim % parts[0].ndim
    if stride <= 1:
        return np.concatenate(parts, axis=axis)
    # each rank holds [block_0 of rank r; block_1 of rank r; ...]: gather block k of every rank, then the blocks
    chunks = [np.split(p, stride, axis=axis) for p in parts]
    return np.concatenate([np.concatenate([c[k] for c in chunks], axis=axis) for k in range(stride)], axis=axis)
