"""RoPE hints: B rotates q/k with another convention (rotate-half vs interleaved pairs), base or position offset

Three forms: the rotary angle table itself differs (Megatron's ``rotary_pos_emb`` output); the rotated q/k
differ (4-D tensors a model records); or, where RoPE is applied as code inside the attention (Hugging Face
models, Megatron's ``core_attention``), the attention output differs and is rebuilt from A's q, k and v
before RoPE (a packed ``linear_qkv`` output or separate q/k/v projections) under each convention.

See docs/hints/rope.md."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ...diff.accounting import rope_base
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
    if x.ndim == 3:
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


#: Attention rebuilt on at most this many positions of one sequence: causal attention at a position
#: depends on the positions before it only, so the prefix is exact, and the cost stays small.
_MAX_POSITIONS = 256
_BASES = (10000.0, 500000.0, 1000000.0, 50000.0)


def _qkv_candidates(site: Site, width: int) -> Iterator[tuple[str, list[np.ndarray]]]:
    """A's q, k, v before RoPE from inside the same attention call, [..., features] in the site's layout:
    ('packed', [qkv]) for one fused projection, ('separate', [q, k, v]) for three."""
    lead = site.xa.shape[:-1]
    outs = [r for r in site.earlier_outputs(limit=8) if r.has_data and tuple(r.shape[:-1]) == lead]
    outs.reverse()  # execution order
    for r in outs:
        if r.shape[-1] > width:
            x = site.array(r)
            if x is not None:
                yield "packed " + r.module, [x]
    proj = [r for r in outs if r.shape[-1] <= width]
    for i in range(len(proj) - 2):
        q, k, v = proj[i:i + 3]
        if q.shape[-1] == width and k.shape[-1] == v.shape[-1] and width % k.shape[-1] == 0:
            xs = [site.array(r) for r in (q, k, v)]
            if all(x is not None for x in xs):
                yield f"{q.module}, {k.module}, {v.module}", xs  # type: ignore[misc]


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Causal softmax attention, [S, heads, hd] / [S, groups, hd] -> [S, heads*hd] (GQA: groups repeated)."""
    s_len, heads, hd = q.shape
    rep = heads // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)
    scores = np.where(np.triu(np.ones((s_len, s_len), dtype=bool), 1)[None], -np.inf, scores)
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v).reshape(s_len, heads * hd)


def _splits(packed: np.ndarray, width: int) -> Iterator[tuple[str, int, list[np.ndarray]]]:
    """(packing, head_dim, [q, k, v]) for each way a fused projection's last dim can hold width-wide q."""
    from ...transforms import QkvGroups

    total = packed.shape[-1]
    for hd in (128, 64, 256, 96, 80, 32, 16, 8, 4, 2):
        if width % hd or (total - width) % (2 * hd):
            continue
        heads, groups = width // hd, (total - width) // (2 * hd)
        if groups < 1 or heads % groups:
            continue
        yield f"per-group [q_g, k_g, v_g] ({heads} heads, {groups} groups)", hd, QkvGroups(heads, groups, -1).split(packed)
        yield f"[q | k | v] ({heads} heads, {groups} groups)", hd, list(np.split(packed, [width, width + groups * hd], -1))


def check_rope_attention(site: Site) -> Iterator[Hint]:
    """The attention output differs and RoPE is applied as code: rebuild it from A's q, k, v before RoPE with each
    convention (pairs, base, position offset) and see which reproduces A and which reproduces B."""
    x = site.xa
    width = x.shape[-1]
    found = list(_qkv_candidates(site, width))
    if not found:
        raise NotApplicable("no q, k, v recorded before this 3-D tensor in the same call (RoPE applied as code "
                            "needs the projection's output)")
    tried = False
    for seq_axis in (0, 1):  # [S, B, H] (Megatron) or [B, S, H]
        n = min(x.shape[seq_axis], _MAX_POSITIONS)

        def crop(t: np.ndarray, axis: int = seq_axis, n: int = n) -> np.ndarray:
            t = np.moveaxis(t, axis, 0)[:n]
            return t[:, 0] if t.ndim == 3 else t  # the first sequence of the batch: [n, features]

        xa, xb = crop(site.xa), crop(site.xb)
        before = float(np.linalg.norm(xa - xb) / max(float(np.linalg.norm(xa)), 1e-30))
        if before == 0:
            continue
        for source, xs in found:
            layouts: list[tuple[str, int, list[np.ndarray]]] = []
            if len(xs) == 1:
                layouts = list(_splits(crop(xs[0]), width))
            else:
                q, k, v = (crop(t) for t in xs)
                for hd in (128, 64, 256, 96, 80, 32, 16, 8, 4, 2):
                    if width % hd == 0 and k.shape[-1] % hd == 0 and (width // hd) % (k.shape[-1] // hd) == 0:
                        layouts.append(("separate", hd, [q, k, v]))
            for packing, hd, (q, k, v) in layouts:
                qh, kh, vh = (t.reshape(t.shape[0], -1, hd).astype(np.float64) for t in (q, k, v))
                outs: dict[tuple | None, np.ndarray] = {}
                for interleaved in (False, True):  # no position offsets: attention sees relative positions only
                    for base in _BASES:
                        outs[(interleaved, base, 0)] = _attention(_rope(qh, base, interleaved, 0, 0),
                                                                  _rope(kh, base, interleaved, 0, 0), vh)
                outs[None] = _attention(qh, kh, vh)
                tried = True
                err_a = {key: float(np.linalg.norm(o - xa) / max(float(np.linalg.norm(xa)), 1e-30)) for key, o in outs.items()}
                key_a = min(err_a, key=lambda key: err_a[key])
                if err_a[key_a] > 0.05 * before:
                    continue  # these are not this attention's inputs, or not in this packing
                err_b = {key: float(np.linalg.norm(o - xb) / max(float(np.linalg.norm(xb)), 1e-30)) for key, o in outs.items()}
                key_b = min(err_b, key=lambda key: err_b[key])
                if key_b == key_a:
                    return

                def name(key: tuple | None) -> str:
                    return "no RoPE" if key is None else _rope_name(key)

                tables = _table_bases(site)
                hint = make_hint("rope", f"B applies RoPE with {name(key_b)}; A with {name(key_a)}", site, err_b[key_b],
                                 f"attention rebuilt from A's {source} ({packing}, head_dim {hd}) before RoPE, on the "
                                 f"first {n} positions of one sequence: A's RoPE reproduces A to {err_a[key_a]:.1e}, "
                                 f"B's reproduces B to {err_b[key_b]:.1e}" + (f"; {tables}" if tables else ""),
                                 a=name(key_a), b=name(key_b))
                hint.before = before
                hint.explained = max(0.0, min(1.0, 1.0 - err_b[key_b] / before))
                yield hint
                return
    if not tried:
        raise NotApplicable("the q, k, v recorded before it do not split into heads of this width")


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
            if x is None:
                continue
            d = x.shape[-1]
            rows = x.reshape(-1, x.shape[-2], d) if x.ndim >= 3 and x.shape[-2] > 1 else x.reshape(x.shape[0], d)
            table = rows[0] if rows.ndim == 3 else rows  # [S, D]
            if table.shape[0] < 2:
                continue
            pairs = bool(np.isclose(table[1, 0], table[1, 1]))  # interleaved: [f0, f0, f1, f1, ...]
            row1 = table[1, 0::2] if pairs else table[1, : d // 2]
            if np.all(np.abs(table) <= 1.0 + 1e-6) and r.slot in ("0", "cos") and table[0].min() > 0.999:
                angles = np.arccos(np.clip(row1, -1.0, 1.0))  # a cos table: position 0 is all ones
                what = "cos table"
            elif np.allclose(table[0], 0.0):
                angles = row1
                what = "angle table"
            else:
                continue
            base = rope_base(angles)
            if base is not None:
                found.append(f"{side}'s {what} ({r.module}) reads as base {base:.4g}")
                break
    return "; ".join(found)
