"""RoPE hints: B rotates q/k with another convention (rotate-half vs interleaved pairs), base or position offset

See docs/hints/rope.md."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ...record import Record
from .base import Hint, NotApplicable, Site, fit_sides, make_hint


def _rope(x: np.ndarray, base: float, interleaved: bool, offset: int, seq_axis: int) -> np.ndarray:
    """Rotary embedding over the last dimension; positions along ``seq_axis`` (+ offset)."""
    d = x.shape[-1]
    inv = 1.0 / (base ** (np.arange(0, d, 2, dtype=np.float64) / d))
    pos = np.arange(x.shape[seq_axis], dtype=np.float64) + offset
    ang = np.outer(pos, inv)  # [S, d/2]
    shape = [1] * x.ndim
    shape[seq_axis] = x.shape[seq_axis]
    shape[-1] = d // 2
    cos, sin = np.cos(ang).reshape(shape), np.sin(ang).reshape(shape)
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x, dtype=np.float64)
        out[..., 0::2] = x1 * cos - x2 * sin
        out[..., 1::2] = x1 * sin + x2 * cos
        return out
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _rope_name(k: tuple) -> str:
    return (f"{'interleaved (GPT-J)' if k[0] else 'rotate-half (NeoX)'} pairs, base {k[1]:g}"
            + (f", positions from {k[2]}" if k[2] else ""))


def check_rope(site: Site) -> Iterator[Hint]:
    """B's RoPE differs: its rotary angle table (a rotary module's output), or q/k rotated another way."""
    x = site.xa
    if x.ndim != 4:
        raise NotApplicable(f"needs a 4-D tensor, this one is {x.ndim}-D")
    table = x.shape[1] == 1 and x.shape[2] == 1 and "rotary" in (site.a.module + site.a.module_class).lower()
    if table:
        hints = list(check_rope_table(site))
        if hints:
            yield from hints
            return
    sources = [src for src in site.earlier_outputs(limit=6) if tuple(src.shape) == x.shape and src.has_data]
    if not sources and not table:
        raise NotApplicable("no earlier output of its shape to rotate")
    yield from check_rope_qk(site, sources)


def check_rope_qk(site: Site, sources: list[Record]) -> Iterator[Hint]:
    """B rotates q/k with another RoPE convention, base or position offset (``sources``: A's tensors it may rotate)."""
    for src in sources:
        x = site.array(src)
        if x is None or x.shape != site.xa.shape:
            continue
        for seq_axis in (0, 1, 2):
            variants = {}
            for interleaved in (False, True):
                for base in (10000.0, 500000.0, 1000000.0, 50000.0):
                    for offset in (0, 1):
                        variants[(interleaved, base, offset)] = _rope(x, base, interleaved, offset, seq_axis)
            fit = fit_sides(site, variants)
            if fit is None:
                continue
            key_a, key_b, after = fit
            err = np.abs(site.xa - site.xb).max(axis=tuple(i for i in range(4) if i != seq_axis))
            yield make_hint("rope", f"B applies RoPE with {_rope_name(key_b)}; A with {_rope_name(key_a)}", site, after,
                        f"input: A's {src.module} {src.tensor_label}; max error by position: "
                        f"{err[0]:.1e} at 0, {err[len(err) // 2]:.1e} at {len(err) // 2}, {err[-1]:.1e} at {len(err) - 1}",
                        a=_rope_name(key_a), b=_rope_name(key_b))
            return


def check_rope_table(site: Site) -> Iterator[Hint]:
    """The rotary angle table itself differs: fit base, pair layout and offset on each side."""
    x = site.xa
    if x.ndim != 4 or x.shape[1] != 1 or x.shape[2] != 1 or "rotary" not in (site.a.module + site.a.module_class).lower():
        return
    s_len, d = x.shape[0], x.shape[-1]

    def table(interleaved: bool, base: float, offset: int) -> np.ndarray:
        inv = 1.0 / (base ** (np.arange(0, d, 2, dtype=np.float64) / d))
        freqs = np.outer(np.arange(s_len, dtype=np.float64) + offset, inv)
        emb = np.repeat(freqs, 2, axis=-1) if interleaved else np.concatenate([freqs, freqs], axis=-1)
        return emb.reshape(s_len, 1, 1, d)

    variants = {(i, b, o): table(i, b, o) for i in (False, True) for b in (10000.0, 50000.0, 500000.0, 1000000.0)
                for o in (0, 1)}
    fit = fit_sides(site, variants)
    if fit is None:
        return
    key_a, key_b, after = fit
    err = np.abs(site.xa - site.xb).reshape(s_len, -1).max(axis=1)
    yield make_hint("rope", f"B's RoPE uses {_rope_name(key_b)}; A's uses {_rope_name(key_a)}", site, after,
                f"fitted angle tables; largest difference at position 0: {err[0]:.1e}, at {s_len - 1}: {err[-1]:.1e}",
                a=_rope_name(key_a), b=_rope_name(key_b))
