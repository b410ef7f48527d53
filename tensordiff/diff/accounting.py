"""Accounting by structure and value: which records with no counterpart carry nothing the diff has not compared.

Two correct programs written by different people record different things: a dropout module at p=0 on one side, a
mask built in another convention, the attention probabilities one kernel returns and another keeps inside. None of
these is a difference, and none may be passed over silently either. Each rule below accounts for a record by what
it *is* (its values and where it sits), never by its name, and the report names the rule and the reason for every
record it accounts. Rules, in the order they are tried:

``same-tensor``
    the record holds exactly the values of a record of its own side that was compared (a tensor handed to several
    modules, returned twice, or copied): compared there.
``pass-through``
    a module without parameters returns its input unchanged (dropout at p=0 or in eval, ``Identity``, megatron's
    ``IdentityOp``, a cast to the same dtype), and in backward hands the gradient through unchanged: it computes
    nothing. A module *named* like dropout that changes its input is never accounted: it is reported (an active
    dropout).
``mask``
    attention masks in any convention (bool True = masked or True = attend, additive float, multiplicative 0/1;
    ``[1, 1, S, S]`` or ``[B, 1, S, S]``; padding masks ``[B, S]``) are reduced to what they mean, which positions
    may attend to which, and compared exactly with the other side's masks; a side that passes no mask applies its
    own causal masking, so a mask with no counterpart is accounted only when it is exactly causal (or masks nothing).
``positions``
    position ids present on one side only that are exactly 0..S-1 in every row (what the other side uses by default).
``labels``
    labels present on one side only that are the input ids shifted by one (the other side shifts inside its loss).
``rope``
    a RoPE angle table on one side whose cos and sin are the other side's cos/sin tables, to the precision of the
    coarser of the two (1e-5 in FP32; a BF16 table is cos(angle) rounded to BF16).
``inside``
    a record of a parameter-free module (or an extra output) strictly inside a module both sides recorded and whose
    compared records agree (SDPA on one side, explicit softmax and dropout on the other). Never for a module with
    parameters, never with the model, the decoder or a layer stack as the enclosing module: a mapping that pairs
    nothing inside the decoder stays inconclusive.
``bias``
    the bias megatron's linear layers return for their caller to add (``skip_bias_add``): added to the module's
    output before it was compared with the other side's, which includes it (``Pair.bias_a`` / ``bias_b``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from .. import dtypes
from ..record import Record, is_inside, module_label
from .result import COMPARED, Accounted, Row

_NUMBERED = re.compile(r"(^|\.)\d+(\.|$)")


Read = Callable[[Record], "np.ndarray | None"]


def _sig(rec: Record) -> tuple:
    return rec.dtype, rec.shape, rec.min, rec.max, rec.mean, rec.l2, rec.nan, rec.inf


def _value_sig(rec: Record) -> tuple:
    """What two records holding the same values in any shape (a tensor and its flattened view) share."""
    return rec.dtype, rec.numel, rec.min, rec.max, rec.mean, rec.l2, rec.nan, rec.inf


def _equal(x: np.ndarray | None, y: np.ndarray | None) -> bool | None:
    """Whether two stored tensors hold the same values in the same order, whatever their shapes (a view, a
    reshape, a copy); None: one was not stored."""
    if x is None or y is None:
        return None
    if x.size != y.size or x.dtype != y.dtype:
        return False
    return bool(np.array_equal(x.reshape(-1), y.reshape(-1), equal_nan=x.dtype.kind in "fc"))


# ---------------------------------------------------------------------------------------------------- masks
@dataclass(frozen=True)
class Mask:
    """What a mask means: ``attend[..., q, k]`` (True = may attend), leading dims dropped where they all agree;
    ``padding``: a [B, S] key padding mask (True = a real token)."""

    attend: np.ndarray
    convention: str
    padding: bool = False

    @property
    def causal(self) -> bool:
        a = self.attend
        if self.padding:
            return False
        return a.ndim == 2 and a.shape[0] == a.shape[1] and bool(np.array_equal(a, np.tri(a.shape[0], dtype=bool)))

    @property
    def nothing(self) -> bool:
        """Masks nothing (every position attends everywhere)."""
        return bool(self.attend.all())

    def same_meaning(self, other: Mask) -> bool:
        a, b = self.attend, other.attend
        if self.padding or other.padding:
            return self.padding == other.padding and a.shape == b.shape and bool(np.array_equal(a, b))
        try:
            a, b = np.broadcast_arrays(a, b)
        except ValueError:
            return False
        return bool(np.array_equal(a, b))


def _squeeze_leading(attend: np.ndarray) -> np.ndarray:
    flat = attend.reshape(-1, *attend.shape[-2:])
    if all(np.array_equal(flat[0], f) for f in flat[1:]):
        return flat[0]
    return attend


def as_mask(x: np.ndarray | None) -> Mask | None:
    """The meaning of ``x`` when it is an attention mask, else None. Square masks need their diagonal attended
    (every query sees itself), which also tells which polarity a bool mask has."""
    if x is None or x.ndim < 2 or x.size == 0 or x.size > (1 << 26):
        return None
    if x.ndim == 2 and x.dtype.kind in "iub" and x.shape[1] > 1:  # [B, S] padding mask: 1 = a real token
        values = np.unique(x)
        if set(values.tolist()) <= {0, 1} and x.dtype.kind != "b" and values.size and 1 in values:
            return Mask(x.astype(bool), "padding 0/1", padding=True)
    q, k = x.shape[-2], x.shape[-1]
    if q < 2 or k < q or x.ndim < 2:
        return None
    diag = np.arange(q), np.arange(k - q, k)
    if x.dtype.kind == "b":
        on = x[..., diag[0], diag[1]]
        if on.all():
            attend, how = x, "bool, True = attend"
        elif not on.any():
            attend, how = ~x, "bool, True = masked"
        else:
            return None
    elif dtypes.floats(x) is not None:  # FP32, FP16, BF16 alike (an additive mask holds the dtype's min)
        x = dtypes.floats(x)
        assert x is not None
        finite = x[np.isfinite(x)]
        if np.isnan(x).any() or ((x > 0).any() and not set(np.unique(x).tolist()) <= {0.0, 1.0}):
            return None
        values = np.unique(x)
        if set(values.tolist()) <= {0.0, 1.0} and 1.0 in values and x.ndim > 2:
            attend, how = x == 1.0, "multiplicative 0/1"
        elif ((x == 0) | (x <= -1e4)).all() and (finite.size == 0 or finite.max() <= 0):
            attend, how = x == 0, "additive float (0 / large negative)"
        else:
            return None
        if not attend[..., diag[0], diag[1]].all():
            return None
    else:
        return None
    return Mask(_squeeze_leading(np.asarray(attend)), how)


def maybe_mask(rec: Record) -> bool:
    """Whether ``rec`` may hold a mask, from its statistics alone (the cheap test before ``as_mask`` reads it)."""
    if len(rec.shape) < 2 or rec.nan:
        return False
    if rec.dtype == "bool" or rec.dtype.startswith(("int", "uint")):
        return rec.min >= 0 and rec.max <= 1
    return rec.max <= 0 or (rec.min == 0 and rec.max == 1)


def compare_masks(xa: np.ndarray, xb: np.ndarray) -> tuple[np.ndarray, np.ndarray, str] | None:
    """Two masks in any conventions as float arrays of what they mean (1 = may attend), broadcast to one shape, and
    a note naming the conventions; None when either is no mask or their shapes cannot mean the same positions."""
    ma, mb = as_mask(xa), as_mask(xb)
    if ma is None or mb is None:
        return None
    if ma.padding != mb.padding:  # a padding mask that masks nothing, in a causal model, means the causal mask
        pad, full = (ma, mb) if ma.padding else (mb, ma)
        if not (pad.nothing and full.causal):
            return None
        x = full.attend.astype(np.float32)
        return (x, x, f"masks compared by meaning: a padding mask that masks nothing ({'A' if pad is ma else 'B'} "
                f"{tuple((xa if pad is ma else xb).shape)}) with its model's causal masking is the other's causal mask")
    try:
        a, b = np.broadcast_arrays(ma.attend, mb.attend)
    except ValueError:
        return None
    return (a.astype(np.float32), b.astype(np.float32),
            f"masks compared by meaning: A {ma.convention} {tuple(xa.shape)}, B {mb.convention} {tuple(xb.shape)}")


def _positions(x: np.ndarray | None) -> bool:
    """Position ids 0..S-1 in every row."""
    if x is None or x.dtype.kind not in "iu" or x.ndim not in (1, 2) or x.shape[-1] < 2:
        return False
    return bool((x.reshape(-1, x.shape[-1]) == np.arange(x.shape[-1])).all())


# ---------------------------------------------------------------------------------------------------- the rules
class _Side:
    """One side's records of one step, with what was compared."""

    def __init__(self, name: str, records: list[Record], rows: list[Row], read: Read):
        self.name, self.records, self.read = name, records, read
        self.by_seq = {r.seq: r for r in records}
        self.compared: set[tuple[int, int]] = set()
        self.ok_modules: dict[str, set[str]] = {}  # module -> phases with a compared row of it (all ok)
        self.bad_modules: set[str] = set()
        for row in rows:
            if row.verdict not in COMPARED:
                continue
            for rec in self.of(row):
                self.compared.add(rec.tensor_id)
                self.ok_modules.setdefault(rec.module, set()).add(rec.phase)
                if row.verdict != "ok":
                    self.bad_modules.add(rec.module)
        in_rows = {rec.seq for row in rows for rec in self.of(row)}
        #: tensors the mapping ignores on purpose (in no row): a copy of one carries the same information
        self.ignored = {r.tensor_id for r in records if r.seq not in in_rows}
        self.param_modules = {r.module for r in records if r.phase == "weights"}
        self.calls: dict[tuple[str, int], list[Record]] = {}
        for r in records:
            self.calls.setdefault((r.module, r.call), []).append(r)
        self.modules = {r.module for r in records if r.phase == "forward"}
        self._arrays: dict[int, np.ndarray | None] = {}

    def of(self, row: Row) -> tuple[Record, ...]:
        if self.name == "A":
            return (row.pair.a,) if row.pair.a is not None else ()
        return row.pair.b_records

    def array(self, rec: Record) -> np.ndarray | None:
        key = rec.tensor_id[1]
        if key not in self._arrays:
            self._arrays[key] = self.read(rec) if rec.has_data else None
        return self._arrays[key]

    def has_params(self, module: str) -> bool:
        return any(m == module or is_inside(m, module) for m in self.param_modules)

    def holds_stack(self, module: str) -> bool:
        """The model, or a module holding numbered modules (a layer stack, the decoder)."""
        if module == "":
            return True
        prefix = module + "."
        return any(m.startswith(prefix) and _NUMBERED.search(m[len(prefix):]) for m in self.modules)


def _equal_values(side: _Side, rec: Record, candidates: Iterable[Record]) -> Record | None:
    """A candidate with exactly ``rec``'s values (stored tensors compared; statistics where neither was stored)."""
    for cand in candidates:
        if cand.seq == rec.seq:
            continue
        same = _equal(side.array(rec), side.array(cand))
        if same or (same is None and not rec.has_data and not cand.has_data and cand.shape == rec.shape):
            return cand
    return None


def account(rows: list[Row], records: dict[str, dict[int, list[Record]]], read: dict[str, Read]) -> list[str]:
    """Set ``Row.accounted`` on the unmatched rows the rules account for; returns findings to report (an active
    dropout). ``records``/``read``: per side ('A', 'B'), the records of each compared step and a tensor reader."""
    findings: list[str] = []
    _masks_by_meaning(rows)
    earlier: dict[tuple[str, tuple], tuple[tuple, Accounted]] = {}  # (side, record key) -> (values, why)
    steps = sorted({r.step for r in rows})
    for step in steps:
        step_rows = [r for r in rows if r.step == step]
        sides = {s: _Side(s, records[s].get(step, []), step_rows, read[s]) for s in ("A", "B")}
        lone = {s: [r for r in step_rows if r.verdict == "unmatched" and not r.linked and not r.not_recorded
                    and sides[s].of(r)] for s in ("A", "B")}
        for s in ("A", "B"):
            _returned_bias(sides[s], lone[s], step_rows)
            _by_value(sides[s], lone[s], findings)
        _masks(sides, lone)
        _rope(sides, lone)
        for s in ("A", "B"):
            _inputs(sides[s], lone[s])
            _inside(sides[s], lone[s])
            _links_of_accounted(sides[s], lone[s])
            for row in lone[s]:  # a statistics-only step: the same values as an earlier step's accounted record
                rec = _rec(sides[s], row)
                seen = earlier.get((s, rec.key))
                if row.accounted is None and seen is not None and seen[0] == _sig(rec):
                    row.accounted = Accounted(seen[1].rule, f"{seen[1].why} (the same values in an earlier step)")
                if row.accounted is not None and rec.has_data:
                    earlier.setdefault((s, rec.key), (_sig(rec), row.accounted))
    return findings


def _masks_by_meaning(rows: list[Row]) -> None:
    """A pair of masks compared by meaning in a step with tensors, holding the same values in a statistics-only
    step (the statistics of two conventions differ even where the masks agree): judged as then."""
    then: dict[tuple, tuple[tuple, tuple, Row]] = {}
    for row in rows:
        a, b = row.pair.a, row.pair.b
        if a is None or b is None:
            continue
        key = (a.key, b.key)
        if row.metrics is not None and row.metrics.source == "tensor" and row.note.startswith("masks compared by meaning"):
            then.setdefault(key, (_sig(a), _sig(b), row))
        elif (row.verdict == "shape" or (row.metrics is not None and row.metrics.source == "stats")) and key in then:
            sig_a, sig_b, first = then[key]
            if (sig_a, sig_b) == (_sig(a), _sig(b)):
                row.metrics, row.verdict = first.metrics, first.verdict
                row.note = f"{first.note} (step {first.step}; the same values here)"


def _rec(side: _Side, row: Row) -> Record:
    return side.of(row)[0]


def _returned_bias(side: _Side, lone: list[Row], rows: list[Row]) -> None:
    """A bias returned apart and added to its module's output where that output was compared."""
    added = {}
    for row in rows:
        bias = row.pair.bias_a if side.name == "A" else row.pair.bias_b
        if bias is not None and row.verdict in COMPARED:
            added[bias.tensor_id] = row
    for row in lone:
        rec = _rec(side, row)
        if row.accounted is None and rec.tensor_id in added:
            owner = added[rec.tensor_id]
            label = (owner.pair.a if side.name == "A" else owner.pair.b).label  # type: ignore[union-attr]
            row.accounted = Accounted("bias", f"the bias {module_label(rec.module)} returns for its caller to add "
                                      f"(skip_bias_add), added to {label} before it was compared")
            side.compared.add(rec.tensor_id)


def _by_value(side: _Side, lone: list[Row], findings: list[str]) -> None:
    """same-tensor and pass-through: grow the compared tensors through equal values until nothing changes."""
    by_sig: dict[tuple, list[Record]] = {}
    for rec in side.records:
        if rec.same_as < 0:
            by_sig.setdefault(_value_sig(rec), []).append(rec)
    changed = True
    while changed:
        changed = False
        for row in lone:
            if row.accounted is not None:
                continue
            rec = _rec(side, row)
            if rec.phase not in ("forward", "backward"):
                continue
            through = _pass_through(side, rec)
            if through is not None and through.tensor_id in side.compared:
                row.accounted = Accounted("pass-through", f"{module_label(rec.module)} ({rec.module_class or '?'}) "
                                          f"returns its input unchanged; {through.label} was compared")
            else:
                cands = by_sig.get(_value_sig(rec), ())
                twin = _equal_values(side, rec, [c for c in cands if c.tensor_id in side.compared])
                ignored = None if twin is not None else _equal_values(
                    side, rec, [c for c in cands if c.tensor_id in side.ignored])
                if ignored is not None:
                    row.accounted = Accounted("same-tensor", f"the same values as {ignored.label}, which the mapping "
                                              "ignores on purpose")
                    changed = True
                    continue
                if twin is None:
                    if through is None and "dropout" in rec.module_class.lower() and rec.kind == "output":
                        finding = (f"{side.name}'s {module_label(rec.module)} ({rec.module_class}) changes its input: "
                                   "an active dropout (p > 0 in training); set its probability to 0 to compare")
                        if finding not in findings:
                            findings.append(finding)
                    continue
                row.accounted = Accounted("same-tensor", f"the same values as {twin.label}, compared there")
            side.compared.add(rec.tensor_id)
            changed = True


def _pass_through(side: _Side, rec: Record) -> Record | None:
    """The input (or, for a gradient, the output gradient) of the same call that ``rec`` equals, when ``rec``'s
    module has no parameters and ``rec`` is its output (or input gradient); else None."""
    if side.has_params(rec.module):
        return None
    pairs = {"output": "input", "input": "output", "grad_input": "grad_output", "grad_output": "grad_input"}
    other = pairs.get(rec.kind)
    if other is None:
        return None
    cands = [r for r in side.calls.get((rec.module, rec.call), ()) if r.kind == other and r.shape == rec.shape
             and r.dtype == rec.dtype]
    return _equal_values(side, rec, cands)


def _masks(sides: dict[str, _Side], lone: dict[str, list[Row]]) -> None:
    """Masks with no counterpart, by meaning: the same as a mask of the other side, or causal where it has none."""
    found: dict[str, list[tuple[Row, Record, Mask]]] = {"A": [], "B": []}
    for s, side in sides.items():
        for row in lone[s]:
            rec = _rec(side, row)
            if row.accounted is None and rec.phase == "forward" and rec.kind in ("input", "output") and maybe_mask(rec):
                mask = as_mask(side.array(rec)) if rec.has_data else None
                if mask is not None:
                    found[s].append((row, rec, mask))
    if not any(found.values()):
        return  # no lone mask: the other side's masks are not read
    every = {s: [as_mask(sides[s].array(r)) for r in sides[s].records if r.phase == "forward" and r.has_data
                 and r.same_as < 0 and r.kind in ("input", "output") and maybe_mask(r)]
             for s in sides}
    for s, items in found.items():
        other = "B" if s == "A" else "A"
        theirs = [m for m in every[other] if m is not None]
        for row, rec, mask in items:
            match = next((m for m in theirs if m.same_meaning(mask)), None)
            shape = "x".join(map(str, rec.shape))
            if match is not None:
                row.accounted = Accounted("mask", f"a mask [{shape}] ({mask.convention}) meaning what {other}'s mask "
                                          f"({match.convention}) means")
            elif mask.padding and mask.nothing:
                row.accounted = Accounted("mask", f"a padding mask [{shape}] that masks nothing (every token real)")
            elif mask.causal and not any(m.causal or m.nothing for m in theirs):
                row.accounted = Accounted("mask", f"the causal mask [{shape}] ({mask.convention}); {other} passes none "
                                          "and applies causal masking itself")
            elif mask.causal and not theirs:
                row.accounted = Accounted("mask", f"the causal mask [{shape}] ({mask.convention}); {other} passes none")
            elif mask.causal and any(m.causal for m in theirs):
                row.accounted = Accounted("mask", f"the causal mask [{shape}] ({mask.convention}), as {other}'s")


def _angles(x: np.ndarray | None) -> np.ndarray | None:
    """``x`` as a RoPE angle table [S, D] (position times the inverse frequencies: row 0 zeros, row s = s * row 1, to
    the precision of ``x``'s dtype), or None."""
    f = dtypes.floats(x)
    if x is None or f is None or x.ndim < 2 or x.shape[-1] < 2 or x.size > (1 << 24):
        return None
    t = f.reshape(-1, x.shape[-1]).astype(np.float64)
    if t.shape[0] < 3 or not np.isfinite(t).all() or np.any(t[0]) or not np.any(t[1]):
        return None
    rtol = max(1e-5, 2 * dtypes.resolution(dtypes.name_of(x.dtype)))  # row s is s * row 1 rounded in x's dtype
    if not np.allclose(t, np.outer(np.arange(t.shape[0]), t[1]), rtol=rtol, atol=1e-6):
        return None
    return t


def _trig(x: np.ndarray | None, first: float) -> np.ndarray | None:
    """``x`` as a cos (``first`` 1) or sin (``first`` 0) table [S, D], every leading slice alike, or None."""
    f = dtypes.floats(x)
    if x is None or f is None or x.ndim < 2 or x.size > (1 << 24):
        return None
    t = f.reshape(-1, *x.shape[-2:]).astype(np.float64)
    if not np.isfinite(t).all() or np.abs(t).max() > 1 + 1e-6 or not np.allclose(t[:, 0], first, atol=1e-6):
        return None
    if any(not np.array_equal(t[0], u) for u in t[1:]):
        return None
    return t[0]


def _rope(sides: dict[str, _Side], lone: dict[str, list[Row]]) -> None:
    """A RoPE angle table on one side (megatron's rotary_pos_emb [S, 1, 1, D]) and cos/sin tables of one call on the
    other (Hugging Face's rotary_emb [1, S, D] each): the same information when cos and sin of the angles are the
    tables (to 1e-5). Tables that disagree stay unaccounted: a RoPE difference is never passed over."""
    for s, other in (("A", "B"), ("B", "A")):
        side, them = sides[s], sides[other]
        tables: list[tuple[Row, Record, np.ndarray]] = []
        for row in lone[s]:
            rec = _rec(side, row)
            if row.accounted is None and rec.phase == "forward" and rec.kind == "output" and rec.has_data:
                angles_of = _angles(side.array(rec))
                if angles_of is not None:
                    tables.append((row, rec, angles_of))
        if not tables:
            continue
        trig: dict[tuple[str, int], dict[str, tuple[Row, Record, np.ndarray]]] = {}
        for row in lone[other]:
            rec = _rec(them, row)
            if row.accounted is not None or rec.phase != "forward" or rec.kind != "output" or not rec.has_data:
                continue
            for name, first in (("cos", 1.0), ("sin", 0.0)):
                t = _trig(them.array(rec), first)
                if t is not None:
                    trig.setdefault((rec.module, rec.call), {}).setdefault(name, (row, rec, t))
        for row, rec, angles in tables:
            for found in trig.values():
                if set(found) != {"cos", "sin"}:
                    continue
                (cos_row, cos_rec, cos), (sin_row, sin_rec, sin) = found["cos"], found["sin"]
                # at the precision of the coarser side: a BF16 table is cos(angle) rounded to BF16
                judged = dtypes.coarsest(dtypes.coarsest(rec.dtype, cos_rec.dtype), sin_rec.dtype)
                atol = 1e-5 + dtypes.resolution(judged)
                if cos.shape != angles.shape or not (np.allclose(np.cos(angles), cos, rtol=0, atol=atol)
                                                     and np.allclose(np.sin(angles), sin, rtol=0, atol=atol)):
                    continue
                shape = "x".join(map(str, rec.shape))
                row.accounted = Accounted("rope", f"a RoPE angle table [{shape}]: cos and sin of it are {other}'s "
                                          f"{cos_rec.label} and {sin_rec.label} (to {atol:.1e}, {judged})")
                for r, table, kind in ((cos_row, cos_rec, "cos"), (sin_row, sin_rec, "sin")):
                    r.accounted = Accounted("rope", f"a RoPE {kind} table [{'x'.join(map(str, table.shape))}] of the "
                                            f"angles in {s}'s {rec.label}")
                break


def _links_of_accounted(side: _Side, lone: list[Row]) -> None:
    """Records holding a tensor accounted for under another name of their side (a table handed to every layer)."""
    accounted = {_rec(side, row).tensor_id: row.accounted for row in lone if row.accounted is not None}
    for row in lone:
        rec = _rec(side, row)
        if row.accounted is None and rec.tensor_id in accounted:
            first = accounted[rec.tensor_id]
            assert first is not None
            row.accounted = Accounted(first.rule, f"the same tensor as a record accounted for above: {first.why}")


def _inputs(side: _Side, lone: list[Row]) -> None:
    """Position ids and labels one side passes and the other derives itself."""
    ids = [r for r in side.records if r.phase == "forward" and r.kind == "input" and r.dtype in ("int64", "int32")
           and r.has_data]
    for row in lone:
        rec = _rec(side, row)
        if row.accounted is not None or rec.phase != "forward" or rec.kind != "input":
            continue
        x = side.array(rec)
        if x is None or x.dtype.kind not in "iu":
            continue
        if _positions(x):
            row.accounted = Accounted("positions", f"position ids 0..{x.shape[-1] - 1} in every row (the default "
                                      "positions of the other side)")
            continue
        for cand in ids:
            y = side.array(cand)
            if (cand.seq != rec.seq and y is not None and y.shape == x.shape and x.ndim == 2
                    and cand.tensor_id in side.compared and np.array_equal(x[:, :-1], y[:, 1:])):
                row.accounted = Accounted("labels", f"next-token labels: {cand.label} shifted by one (the other side "
                                          "shifts inside its loss)")
                break


def _inside(side: _Side, lone: list[Row]) -> None:
    """Records of parameter-free modules, and extra outputs, strictly inside a module whose compared records agree."""
    for row in lone:
        rec = _rec(side, row)
        if row.accounted is not None or rec.phase not in ("forward", "backward"):
            continue
        extra = rec.kind in ("output", "grad_output") and rec.module in side.ok_modules
        if not extra and side.has_params(rec.module):
            continue
        parts = rec.module.split(".") if rec.module else []
        start = len(parts) if extra else len(parts) - 1
        for n in range(start, 0, -1):
            outer = ".".join(parts[:n])
            phases = side.ok_modules.get(outer)
            if not phases or outer in side.bad_modules:
                continue
            if side.holds_stack(outer):
                break  # never the decoder, the model, a layer stack
            if "forward" not in phases or (rec.phase == "backward" and "backward" not in phases):
                continue
            what = (f"an extra output of {outer}" if extra else f"{module_label(rec.module)} "
                    f"({rec.module_class or '?'})")
            row.accounted = Accounted("inside", f"{what}, computed inside {outer}, whose compared records agree")
            break
