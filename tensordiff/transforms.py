"""Tensor layouts, defined once for captures, checkpoints and hints.

* Ops (``OPS``): small named operations that bring B's tensor into A's layout, written in
  mapping files as strings, e.g. ``swap01`` or ``qkv_grouped(heads=4, dim=0)``. Permutations
  do not change statistics, so stats-only records are compared as they are (``apply_stats``).
* Splits (``SPLITS``): one tensor on one side is several on the other, e.g. Megatron's
  per-group ``linear_qkv`` rows <-> q, k, v (``QkvGroups``), ``linear_fc1`` [gate; up] <-> w1, w3
  (``Chunk``). Checkpoint tables use them in both directions; ``qkv_grouped`` is ``QkvGroups.join``.
"""

from __future__ import annotations

import inspect
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ._text import bracket_shapes
from .errors import MappingError


def _swap01(x: np.ndarray) -> np.ndarray:
    return np.swapaxes(x, 0, 1) if x.ndim >= 2 else x


def _transpose(x: np.ndarray) -> np.ndarray:
    return x.T if x.ndim == 2 else x


def _qkv_grouped(x: np.ndarray, heads: int, groups: int | None = None, dim: int = 0) -> np.ndarray:
    """[all q | all k | all v] along ``dim`` -> Megatron's per-group packing [q_g, k_g, v_g] for each group."""
    groups = groups or heads
    axis = dim % x.ndim
    head_dim = x.shape[axis] // (heads + 2 * groups)
    parts = np.split(x, [heads * head_dim, (heads + groups) * head_dim], axis=axis)
    return QkvGroups(heads, groups, axis).join(parts)


def _flatten01(x: np.ndarray) -> np.ndarray:
    return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:]) if x.ndim >= 2 else x


def _deinterleave(x: np.ndarray, dim: int = 0) -> np.ndarray:
    """Rows [g0, u0, g1, u1, ...] along ``dim`` -> [g0, g1, ... ; u0, u1, ...] (MindFormers MLPInterleaved -> Megatron)."""
    dim = dim % x.ndim
    even = np.take(x, range(0, x.shape[dim], 2), axis=dim)
    odd = np.take(x, range(1, x.shape[dim], 2), axis=dim)
    return np.concatenate([even, odd], axis=dim)


def _interleave(x: np.ndarray, dim: int = 0) -> np.ndarray:
    """Inverse of ``deinterleave``: [g ; u] along ``dim`` -> [g0, u0, g1, u1, ...]."""
    dim = dim % x.ndim
    half = x.shape[dim] // 2
    first, second = np.split(x, [half], axis=dim)
    out = np.stack([first, second], axis=dim + 1)
    return out.reshape(x.shape)


def _unflatten0(x: np.ndarray, rows: int = 1) -> np.ndarray:
    """[rows*M, ...] -> [rows, M, ...]: MindFormers' logits [B*S, V] back to [B, S, V]."""
    return x.reshape((rows, x.shape[0] // rows) + x.shape[1:]) if x.ndim >= 1 and rows > 0 else x


def _scale(x: np.ndarray, factor: float) -> np.ndarray:
    return x.astype(np.float64) * factor


def _unrepeat(x: np.ndarray, times: int = 1, dim: int = 2) -> np.ndarray:
    """Undo ``repeat_interleave(times)`` of KV heads along ``dim`` (GQA): keep the first of each run."""
    dim = dim % x.ndim
    return np.take(x, range(0, x.shape[dim], times), axis=dim) if times > 1 else x


def _unrepeat_sum(x: np.ndarray, times: int = 1, dim: int = 2) -> np.ndarray:
    """Gradient of repeated KV heads back onto the group: sum each run of ``times`` heads along ``dim``."""
    dim = dim % x.ndim
    if times <= 1:
        return x
    shape = x.shape[:dim] + (x.shape[dim] // times, times) + x.shape[dim + 1:]
    return x.astype(np.float64).reshape(shape).sum(axis=dim + 1)


def _identity(x: np.ndarray, dim: int = 0) -> np.ndarray:
    return x


def _select(x: np.ndarray, index: int = 0, dim: int = 0) -> np.ndarray:
    """One slice of ``x`` along ``dim``: expert ``index`` of a tensor holding every expert (GPT-OSS's fused experts)."""
    return np.take(x, index, axis=dim % x.ndim)


def _offset(x: np.ndarray, value: float = 1.0) -> np.ndarray:
    """``x + value``: a norm weight kept as ``w`` where the other side keeps ``value + w`` (Gemma's ``x * (1 + w)``
    against a converted weight). A parameter's value only: its gradient is the same on both sides."""
    return x.astype(np.float64) + value


OPS: dict[str, Callable[..., np.ndarray]] = {
    "identity": _identity,
    "unflatten0": _unflatten0,
    "unrepeat": _unrepeat,
    "unrepeat_sum": _unrepeat_sum,
    "swap01": _swap01,
    "transpose": _transpose,
    "qkv_grouped": _qkv_grouped,
    "flatten01": _flatten01,
    "scale": _scale,
    "deinterleave": _deinterleave,
    "interleave": _interleave,
    "offset": _offset,
    "select": _select,
}
#: Ops that change a parameter's value and not its gradient (``Rule.ops_for`` leaves them out for gradients).
VALUE_ONLY = frozenset({"offset"})

#: How each op changes (numel, min, max, mean, l2): None = statistics cannot follow it.
_PERMUTATION = ("swap01", "transpose", "qkv_grouped", "flatten01", "unflatten0", "deinterleave", "interleave",
                "identity")


def _stats_scale(st: tuple, factor: float) -> tuple:
    numel, mn, mx, mean, l2 = st
    lo, hi = sorted((mn * factor, mx * factor))
    return numel, lo, hi, mean * factor, l2 * abs(factor)


def _stats_unrepeat(st: tuple, times: int = 1, dim: int = 2) -> tuple:
    numel, mn, mx, mean, l2 = st
    return numel // max(times, 1), mn, mx, mean, l2 / max(times, 1) ** 0.5


def _stats_unrepeat_sum(st: tuple, times: int = 1, dim: int = 2) -> tuple | None:
    return st if times <= 1 else None  # sums of unknown parts: no statistics follow


STATS: dict[str, Callable[..., tuple | None] | None] = dict.fromkeys(OPS)
STATS.update({name: (lambda st, **_: st) for name in _PERMUTATION})
STATS.update({"scale": _stats_scale, "unrepeat": _stats_unrepeat, "unrepeat_sum": _stats_unrepeat_sum})

_CALL = re.compile(r"^\s*([a-z_0-9]+)\s*(?:\((.*)\))?\s*$")


@dataclass(frozen=True)
class Op:
    name: str
    kwargs: tuple[tuple[str, float | int], ...] = ()

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return OPS[self.name](x, **dict(self.kwargs))

    def __str__(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.kwargs)
        return f"{self.name}({args})" if args else self.name


def parse_op(text: str, where: str) -> Op:
    m = _CALL.match(str(text))
    if not m or m.group(1) not in OPS:
        raise MappingError(f"{where}: unknown transform {text!r}; known: {', '.join(sorted(OPS))}")
    kwargs: list[tuple[str, float | int]] = []
    if m.group(2):
        for part in m.group(2).split(","):
            if not part.strip():
                continue
            key, eq, value = part.partition("=")
            if not eq:
                raise MappingError(f"{where}: transform {text!r} needs keyword arguments (name=value)")
            try:
                num = float(value)
            except ValueError:
                raise MappingError(f"{where}: transform {text!r}: {key.strip()} must be a number, got "
                                   f"{value.strip()!r}") from None
            kwargs.append((key.strip(), int(num) if num.is_integer() and key.strip() not in ("factor", "value") else num))
    params = list(inspect.signature(OPS[m.group(1)]).parameters.values())[1:]  # after the tensor
    takes = [p.name for p in params]
    unknown = [k for k, _ in kwargs if k not in takes]
    if unknown:
        raise MappingError(f"{where}: transform {text!r}: {m.group(1)} takes "
                           f"{', '.join(takes) or 'no arguments'}, not {', '.join(unknown)}")
    missing = [p.name for p in params if p.default is inspect.Parameter.empty and p.name not in dict(kwargs)]
    if missing:
        raise MappingError(f"{where}: transform {text!r} needs {', '.join(f'{n}=' for n in missing)}, "
                           f"e.g. {m.group(1)}({', '.join(f'{n}=2' for n in missing)})")
    return Op(m.group(1), tuple(kwargs))


def apply_stats(ops: tuple[Op, ...], st: tuple) -> tuple | None:
    """(numel, min, max, mean, l2) of B's tensor after ``ops``, or None when statistics cannot follow."""
    for op in ops:
        fn = STATS.get(op.name)
        out = fn(st, **dict(op.kwargs)) if fn is not None else None
        if out is None:
            return None
        st = out
    return st


def apply_mean(ops: tuple[Op, ...], numel: int, mean: float) -> tuple[int, float] | None:
    """(numel, mean) of B's tensor after ``ops``, where only the sum of its elements follows them (``unrepeat_sum``:
    the gradient of repeated heads summed per group keeps the total); None when not even that follows."""
    for op in ops:
        kw = dict(op.kwargs)
        if op.name in _PERMUTATION:
            continue
        if op.name == "scale":
            mean *= float(kw["factor"])
        elif op.name == "offset":
            mean += float(kw.get("value", 1.0))
        elif op.name == "unrepeat_sum":
            times = max(int(kw.get("times", 1)), 1)
            numel, mean = numel // times, mean * times
        else:
            return None
    return numel, mean


def apply(ops: tuple[Op, ...], x: np.ndarray) -> np.ndarray:
    for op in ops:
        x = op(x)
    return x


# ---------------------------------------------------------------------------------------- splits
def contiguous(x: np.ndarray) -> np.ndarray:
    """``x`` in C order (a view when it already is)."""
    return x if x.flags.c_contiguous else x.copy(order="C")


class Split(ABC):
    """One tensor on the joined side <-> ``len(parts)`` tensors on the other side."""

    name = ""

    def __init__(self, dim: int = 0):
        self.dim = dim

    @abstractmethod
    def parts_shapes(self, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
        """The parts' shapes for a joined tensor of ``shape`` (ValueError when it does not split)."""

    @abstractmethod
    def joined_shape(self, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
        """The joined shape for parts of ``shapes`` (ValueError when they do not join)."""

    @abstractmethod
    def split(self, x: np.ndarray) -> list[np.ndarray]:
        """The parts of ``x``, each C-contiguous."""

    @abstractmethod
    def join(self, parts: list[np.ndarray]) -> np.ndarray:
        """The inverse of ``split``."""

    def _axis(self, shape: tuple[int, ...]) -> int:
        if not shape:
            raise ValueError(f"{self} cannot split a scalar")
        return self.dim % len(shape)

    def _same_rest(self, shapes: list[tuple[int, ...]], axis: int) -> None:
        rest = {s[:axis] + s[axis + 1:] for s in shapes}
        if len({len(s) for s in shapes}) != 1 or len(rest) != 1:
            raise ValueError(f"{self}: the parts' shapes {bracket_shapes(shapes)} differ outside dim {self.dim}")


class QkvGroups(Split):
    """Megatron's per-group ``linear_qkv`` rows ``[q heads of group g, k_g, v_g] for g`` <-> q, k, v."""

    name = "qkv_groups"

    def __init__(self, heads: int, groups: int, dim: int = 0):
        super().__init__(dim)
        if heads <= 0 or groups <= 0 or heads % groups:
            raise MappingError(f"qkv_groups(heads={heads}, groups={groups}): heads must be a positive multiple of groups; "
                               "check --var heads and --var groups")
        self.heads, self.groups, self.per = heads, groups, heads // groups

    def __str__(self) -> str:
        return f"qkv_groups(heads={self.heads}, groups={self.groups})"

    def _head_dim(self, rows: int) -> int:
        unit = self.heads + 2 * self.groups
        if rows % unit:
            raise ValueError(f"{rows} rows are not heads+2*groups = {self.heads}+2*{self.groups} = {unit} blocks of "
                             "head_dim; check --var heads and --var groups")
        return rows // unit

    def parts_shapes(self, shape):
        axis = self._axis(shape)
        hd = self._head_dim(shape[axis])
        return [shape[:axis] + (n * hd,) + shape[axis + 1:] for n in (self.heads, self.groups, self.groups)]

    def joined_shape(self, shapes):
        axis = self._axis(shapes[0])
        self._same_rest(shapes, axis)
        q, k, v = (s[axis] for s in shapes)
        hd = q // self.heads
        if q % self.heads or k != self.groups * hd or v != self.groups * hd:
            raise ValueError(f"q/k/v have {q}/{k}/{v} rows; with heads={self.heads}, groups={self.groups} they need "
                             f"heads*head_dim / groups*head_dim / groups*head_dim; check --var heads and --var groups")
        return shapes[0][:axis] + (q + k + v,) + shapes[0][axis + 1:]

    def split(self, x):
        y = np.moveaxis(x, self._axis(x.shape), 0)
        hd = self._head_dim(y.shape[0])
        blocks = y.reshape((self.groups, self.per + 2, hd) + y.shape[1:])
        q = blocks[:, :self.per].reshape((self.heads * hd,) + y.shape[1:])
        k = blocks[:, self.per].reshape((self.groups * hd,) + y.shape[1:])
        v = blocks[:, self.per + 1].reshape((self.groups * hd,) + y.shape[1:])
        return [contiguous(np.moveaxis(p, 0, self._axis(x.shape))) for p in (q, k, v)]

    def join(self, parts):
        axis = self._axis(parts[0].shape)
        self.joined_shape([p.shape for p in parts])
        q, k, v = (np.moveaxis(p, axis, 0) for p in parts)
        hd = q.shape[0] // self.heads
        rest = q.shape[1:]
        blocks = np.concatenate([q.reshape((self.groups, self.per, hd) + rest), k.reshape((self.groups, 1, hd) + rest),
                                 v.reshape((self.groups, 1, hd) + rest)], axis=1)
        return contiguous(np.moveaxis(blocks.reshape((-1,) + rest), 0, axis))


class Chunk(Split):
    """``n`` equal blocks along ``dim``, e.g. Megatron's ``linear_fc1`` ``[gate; up]`` <-> w1 (gate), w3 (up)."""

    name = "chunk"

    def __init__(self, n: int = 2, dim: int = 0):
        super().__init__(dim)
        if n < 2:
            raise MappingError(f"chunk(n={n}): n must be at least 2")
        self.n = n

    def __str__(self) -> str:
        return f"chunk(n={self.n}, dim={self.dim})"

    def parts_shapes(self, shape):
        axis = self._axis(shape)
        if shape[axis] % self.n:
            raise ValueError(f"{shape[axis]} rows along dim {self.dim} do not split into {self.n} equal blocks")
        return [shape[:axis] + (shape[axis] // self.n,) + shape[axis + 1:]] * self.n

    def joined_shape(self, shapes):
        axis = self._axis(shapes[0])
        self._same_rest(shapes, axis)
        if len({s[axis] for s in shapes}) != 1:
            raise ValueError(f"{self}: the parts have different sizes {bracket_shapes(shapes)}; they must be equal")
        return shapes[0][:axis] + (shapes[0][axis] * self.n,) + shapes[0][axis + 1:]

    def split(self, x):
        return [contiguous(p) for p in np.split(x, self.n, axis=self._axis(x.shape))]

    def join(self, parts):
        self.joined_shape([p.shape for p in parts])
        return np.concatenate(parts, axis=self._axis(parts[0].shape))


SPLITS: dict[str, type[Split]] = {"qkv_groups": QkvGroups, "chunk": Chunk}


def parse_split(text: str, where: str) -> Split:
    m = _CALL.match(str(text))
    if not m or m.group(1) not in SPLITS:
        raise MappingError(f"{where}: unknown split {text!r}; known: {', '.join(f'{k}(...)' for k in SPLITS)}")
    kwargs: dict[str, int] = {}
    for part in (m.group(2) or "").split(","):
        if not part.strip():
            continue
        key, eq, value = part.partition("=")
        try:
            kwargs[key.strip()] = int(value)
        except ValueError:
            raise MappingError(f"{where}: split {text!r}: expected name=integer, got {part.strip()!r}") from None
        if not eq:
            raise MappingError(f"{where}: split {text!r} needs keyword arguments (name=value)")
    try:
        return SPLITS[m.group(1)](**kwargs)
    except TypeError as err:
        raise MappingError(f"{where}: split {text!r}: {err}") from None
