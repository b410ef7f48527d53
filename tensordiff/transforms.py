"""Layout normalisers: small named operations that bring B's tensor into A's layout.

Written in mapping files as strings, e.g. ``swap01`` or ``qkv_grouped(heads=4, dim=0)``.
Permutations do not change statistics, so stats-only records are compared as they are.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .errors import MappingError


def _swap01(x: np.ndarray) -> np.ndarray:
    return np.swapaxes(x, 0, 1) if x.ndim >= 2 else x


def _transpose(x: np.ndarray) -> np.ndarray:
    return x.T if x.ndim == 2 else x


def _qkv_grouped(x: np.ndarray, heads: int, groups: int | None = None, dim: int = 0) -> np.ndarray:
    """[all q | all k | all v] along ``dim`` -> Megatron's per-group packing [q_g, k_g, v_g] for each group."""
    groups = groups or heads
    dim = dim % x.ndim
    total = x.shape[dim]
    head_dim = total // (heads + 2 * groups)
    q, k, v = np.split(x, [heads * head_dim, (heads + groups) * head_dim], axis=dim)
    parts = []
    per = heads // groups
    for g in range(groups):
        parts.append(np.take(q, range(g * per * head_dim, (g + 1) * per * head_dim), axis=dim))
        parts.append(np.take(k, range(g * head_dim, (g + 1) * head_dim), axis=dim))
        parts.append(np.take(v, range(g * head_dim, (g + 1) * head_dim), axis=dim))
    return np.concatenate(parts, axis=dim)


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
}

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


STATS: dict[str, Callable[..., tuple | None] | None] = {name: None for name in OPS}
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
                raise MappingError(f"{where}: transform {text!r}: {key.strip()} must be a number, got {value.strip()!r}") from None
            kwargs.append((key.strip(), int(num) if num.is_integer() and key.strip() != "factor" else num))
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


def apply(ops: tuple[Op, ...], x: np.ndarray) -> np.ndarray:
    for op in ops:
        x = op(x)
    return x
