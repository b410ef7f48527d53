"""RoPE hints: B rotates q/k with another convention (rotate-half vs interleaved pairs), base or position offset

Three forms: the rotary angle table itself differs (Megatron's ``rotary_pos_emb`` output); the rotated q/k
differ (4-D tensors a model records); or, where RoPE is applied as code inside the attention (Hugging Face
models, Megatron's ``core_attention``), the attention output differs and is rebuilt from A's q, k and v
before RoPE (a packed ``linear_qkv`` output or separate q/k/v projections) under each convention.

See docs/hints/rope.md."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ... import dtypes
from ...diff.accounting import rope_base
from ...record import Record
from .attention import BASES, _attention, _rel, attention_rebuilds, rope_variants, rotate
from .base import Hint, NotApplicable, Site, fit_sides, make_hint, rel_l2


def _rope_name(k: tuple) -> str:
    partial = ""
    if len(k) > 3:  # a share of each head's dims (attention rebuilt), or a number of dims (a table's)
        partial = (f", on the first {k[3]:g} of each head's dims (partial rotary: rotary_percent / "
                   "partial_rotary_factor)" if k[3] < 1 else f", over {k[3]} dims")
    return (f"{'interleaved (GPT-J)' if k[0] else 'rotate-half (NeoX)'} pairs, base {k[1]:g}"
            + (f", positions from {k[2]}" if k[2] else "") + partial)


def check_rope(site: Site) -> Iterator[Hint]:
    """B's RoPE differs: its rotary angle table (a rotary module's output), or q/k rotated another way."""
    x = site.xa
    if x.ndim == 3:
        if "rotary" in (site.a.module + site.a.module_class).lower():
            yield from check_rope_cos_table(site)
            return
        yield from check_rope_attention(site)
        return
    if x.ndim != 4:
        raise NotApplicable(f"needs q/k (4-D) or an attention output (3-D), this one is {x.ndim}-D")
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
                        variants[(interleaved, base, offset)] = rotate(x, base, interleaved, offset, seq_axis)
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

    def table(interleaved: bool, base: float, offset: int, width: int = d) -> np.ndarray:
        """The angle table of a RoPE over ``width`` dims, its first ``d`` columns (B's, compared with A's ``d``)."""
        inv = 1.0 / (base ** (np.arange(0, width, 2, dtype=np.float64) / width))
        freqs = np.outer(np.arange(s_len, dtype=np.float64) + offset, inv)
        emb = np.repeat(freqs, 2, axis=-1) if interleaved else np.concatenate([freqs, freqs], axis=-1)
        return emb[:, :d].reshape(s_len, 1, 1, d)

    bases = (10000.0, 50000.0, 500000.0, 1000000.0)
    variants: dict[tuple, np.ndarray] = {(i, b, o): table(i, b, o) for i in (False, True) for b in bases
                                         for o in (0, 1)}
    variants.update({(False, b, 0, d * m): table(False, b, 0, d * m) for b in bases for m in (2, 4)})
    fit = fit_sides(site, variants)
    if fit is None:
        return
    key_a, key_b, after = fit
    err = np.abs(site.xa - site.xb).reshape(s_len, -1).max(axis=1)
    if len(key_a) != len(key_b) and key_a[:2] == key_b[:2]:  # the same RoPE over another number of dims
        rot_a, rot_b = (k[3] if len(k) > 3 else d for k in (key_a, key_b))
        yield make_hint("rope", f"A rotates {rot_a} of each head's dims, B {rot_b} (partial rotary: rotary_percent / "
                        f"partial_rotary_factor / rotary_pct differ), both rotate-half with base {key_a[1]:g}", site,
                        after, f"A's table is a RoPE over {rot_a} dims; B's first {d} columns are one over {rot_b}",
                        a=f"{rot_a} dims", b=f"{rot_b} dims")
        return
    yield make_hint("rope", f"B's RoPE uses {_rope_name(key_b)}; A's uses {_rope_name(key_a)}", site, after,
                f"fitted angle tables; largest difference at position 0: {err[0]:.1e}, at {s_len - 1}: {err[-1]:.1e}",
                a=_rope_name(key_a), b=_rope_name(key_b))


def check_rope_attention(site: Site) -> Iterator[Hint]:
    """The attention output differs and RoPE is applied as code: rebuild it from A's q, k, v before RoPE with each
    convention (pairs, base, position offset) and see which reproduces A and which reproduces B."""
    for rb in attention_rebuilds(site):
        outs = {key: _attention(q, k, rb.v) for key, (q, k) in rope_variants(rb).items()}
        err_a = {key: _rel(o, rb.xa) for key, o in outs.items()}
        key_a = min(err_a, key=lambda key: err_a[key])
        if not site.reproduces(err_a[key_a], rb.before):
            continue  # these are not this attention's inputs, or not in this packing
        err_b = {key: _rel(o, rb.xb) for key, o in outs.items()}
        key_b = min(err_b, key=lambda key: err_b[key])
        if key_b == key_a:
            return

        def name(key: tuple | None) -> str:
            return "no RoPE" if key is None else _rope_name(key)

        tables = _table_bases(site)
        left = max(err_a[key_a], err_b[key_b])  # the same whichever capture is given first
        hint = make_hint("rope", f"B applies RoPE with {name(key_b)}; A with {name(key_a)}", site, left,
                         f"{rb.describe(' before RoPE')}: A's RoPE reproduces A to {err_a[key_a]:.1e}, B's reproduces B "
                         f"to {err_b[key_b]:.1e}" + (f"; {tables}" if tables else ""), a=name(key_a), b=name(key_b))
        hint.before = rb.before
        hint.explained = max(0.0, min(1.0, 1.0 - left / rb.before))
        yield hint
        return


def _read_table(x: np.ndarray, slot: str) -> tuple[str, float, bool] | None:
    """A rotary table read back: (what it is, its base, interleaved pairs), or None when ``x`` is not one. A
    Megatron angle table ([S, 1, 1, D], position 0 all zeros) or a Hugging Face cos table ([.., S, D], the first
    output, position 0 all ones)."""
    if x.ndim < 2 or x.shape[-1] < 4:
        return None
    d = x.shape[-1]
    rows = x.reshape(-1, x.shape[-2], d) if x.ndim >= 3 and x.shape[-2] > 1 else x.reshape(x.shape[0], d)
    table = rows[0] if rows.ndim == 3 else rows  # [S, D]
    if table.shape[0] < 2:
        return None
    pairs = bool(np.isclose(table[1, 0], table[1, 1]))  # interleaved: [f0, f0, f1, f1, ...]
    row1 = table[1, 0::2] if pairs else table[1, : d // 2]
    if np.all(np.abs(table) <= 1.0 + 1e-6) and slot in ("0", "cos") and table[0].min() > 0.999:
        angles = np.arccos(np.clip(row1, -1.0, 1.0))  # a cos table: position 0 is all ones
        what = "cos table"
    elif np.allclose(table[0], 0.0):
        angles = row1
        what = "angle table"
    else:
        return None
    base = rope_base(angles)
    return None if base is None else (what, base, pairs)


def _nice(base: float) -> float:
    """A base read back from a table, shown as the round number it is (9999.86 -> 10000)."""
    for digits in (1, 2, 3):
        r = float(f"{base:.{digits}g}")
        if abs(r - base) <= 2e-3 * base:
            return r
    return base


def _fit_cos(x: np.ndarray, guess: float, pairs: bool, dtype: str) -> tuple[float, float, bool]:
    """The base whose cos table is closest to ``x`` ([.., S, D]), searched around ``guess`` (a read-back of position
    1, coarse in a narrow dtype) and at its round neighbours: (base, relative L2 residual, frequencies rounded to
    ``dtype``: a model cast whole to BF16 rounds its inverse-frequency buffer too)."""
    d, s_len = x.shape[-1], x.shape[-2]
    pos = np.arange(s_len, dtype=np.float64)
    narrow = dtypes.MANTISSA_BITS.get(dtype, 52) < dtypes.MANTISSA_BITS["float32"]

    def residual(base: float, rounded: bool) -> float:
        inv = 1.0 / (base ** (np.arange(0, d, 2, dtype=np.float64) / d))
        if rounded:
            inv = dtypes.rounded(inv, dtype)
        ang = np.outer(pos, inv)
        emb = np.repeat(ang, 2, axis=-1) if pairs else np.concatenate([ang, ang], axis=-1)
        return rel_l2(np.broadcast_to(np.cos(emb), x.shape), x)

    grid = [float(b) for b in guess * np.exp(np.linspace(-1.5, 1.5, 121))]
    grid += [_nice(b) for b in grid] + list(BASES)
    roundings = (False, True) if narrow else (False,)
    best = min((residual(b, r), b, r) for b in set(grid) for r in roundings)
    # the roundest base that fits about as well: a narrow table cannot tell 9908 from 10000 over a few positions
    enough = max(1.25 * best[0], 0.25 * dtypes.resolution(dtype))
    for digits in (1, 2, 3):
        nice = float(f"{best[1]:.{digits}g}")
        fits = min((residual(nice, r), nice, r) for r in roundings)
        if fits[0] <= enough:
            return fits[1], fits[0], fits[2]
    return best[1], best[0], best[2]


def check_rope_cos_table(site: Site) -> Iterator[Hint]:
    """Both sides' rotary cos tables ([.., S, D], a Hugging Face rotary module's first output) differ: each side's
    base fitted (from position 1's angles, then the closest table around it) and B's table rebuilt with B's base."""
    a, b = _read_table(site.xa, site.a.slot), _read_table(site.xb, site.b.slot)
    if a is None or b is None or a[0] != "cos table" or b[0] != "cos table":
        raise NotApplicable("not a rotary cos table on both sides")
    dtype = site.row.judged or site.a.dtype
    base_a, mine, rounded_a = _fit_cos(site.xa, a[1], a[2], dtype)
    base_b, theirs, rounded_b = _fit_cos(site.xb, b[1], b[2], dtype)
    if not site.reproduces(mine) or (abs(base_a - base_b) <= 1e-3 * base_a and a[2] == b[2]):
        return
    key_a, key_b = (a[2], base_a, 0), (b[2], base_b, 0)
    rounding = f" (frequencies rounded to {dtype})" if rounded_a or rounded_b else ""
    yield make_hint("rope", f"B's RoPE uses {_rope_name(key_b)}; A's uses {_rope_name(key_a)}", site,
                    max(mine, theirs), f"cos tables fitted{rounding}: A's base reproduces A to {mine:.1e}, B's "
                    f"reproduces B to {theirs:.1e}", a=_rope_name(key_a), b=_rope_name(key_b))


def _table_bases(site: Site) -> str:
    """Each side's rotary table read back as a base: A's angle table (Megatron's rotary_pos_emb output, [S, 1, 1, D])
    or cos table (Hugging Face's rotary_emb first output, [.., S, D]); '' when neither side recorded one."""
    found = []
    for side, cap in (("A", site.ca), ("B", site.cb)):
        for r in cap.records(site.a.step):
            if r.phase != "forward" or r.kind != "output" or "rotary" not in (r.module + r.module_class).lower():
                continue
            if not r.has_data or r.same_as >= 0 or len(r.shape) < 2 or r.shape[-1] < 4:
                continue
            x = cap.array(r)
            read = _read_table(x, r.slot) if x is not None else None
            if read is not None:
                found.append(f"{side}'s {read[0]} ({r.module}) reads as base {read[1]:.4g}")
                break
    return "; ".join(found)
