"""Two checkpoints compared tensor by tensor, across frameworks: ``diff_checkpoints(a, b)``.

B is first brought into A's names and layout with a table (given, or the built-in one whose
two sides fit the two files). Same dtype: identical bits are required (``rtol`` relaxes that);
different dtypes: relative L2 within the coarser dtype's tolerance. A tensor that differs but
equals B *before* the table's transform gets a note naming the layout variable to check.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import numpy as np

from .. import dtypes
from .._text import listing, plural
from ..diff.metrics import Metrics, compare_arrays
from ..diff.tolerance import Tolerances
from ..errors import CheckpointError, TensordiffError, UsageError
from ..mapping import builtin_with
from ..transforms import contiguous
from .files import describe_skipped, format_of, load_with_skipped
from .plan import Checkpoint, Conversion
from .table import ConversionTable

JSON_VERSION = 1

CkptVerdict = Literal["identical", "ok", "differs", "shape", "a_only", "b_only"]
#: Every verdict a checkpoint row can have.
CKPT_VERDICTS: tuple[CkptVerdict, ...] = get_args(CkptVerdict)


@dataclass
class DiffRow:
    """One tensor of two checkpoints."""

    name: str
    """A's name (or B's for B-only keys)."""
    verdict: CkptVerdict
    """identical (same bytes) | ok (within tolerance) | differs | shape | a_only | b_only."""
    shape_a: tuple[int, ...] | None = None
    shape_b: tuple[int, ...] | None = None
    dtype_a: str | None = None
    dtype_b: str | None = None
    metrics: Metrics | None = None
    tol: float | None = None
    b_from: tuple[str, ...] = ()
    """B's original names when B was converted and they differ from ``name``."""
    note: str = ""

    @property
    def passed(self) -> bool:
        return self.verdict in ("identical", "ok")

    def as_dict(self) -> dict:
        return {"name": self.name, "verdict": self.verdict, "shape_a": self.shape_a, "shape_b": self.shape_b,
                "dtype_a": self.dtype_a, "dtype_b": self.dtype_b, "tolerance": self.tol, "b_from": list(self.b_from) or None,
                "note": self.note or None, "metrics": self.metrics.as_dict() if self.metrics else None}


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(
        contiguous(a).reshape(-1).view(np.uint8), contiguous(b).reshape(-1).view(np.uint8))


def compare_tensor(name: str, a: np.ndarray, b: np.ndarray, rtol: float | None = None) -> DiffRow:
    """Same dtype: bit-equality unless ``rtol``; different dtypes: relative L2 within the coarser dtype's tolerance."""
    da, db = dtypes.name_of(a.dtype), dtypes.name_of(b.dtype)
    row = DiffRow(name, "shape", tuple(a.shape), tuple(b.shape), da, db)
    if a.shape != b.shape:
        return row
    if _same_bytes(a, b):
        row.verdict, row.tol = "identical", 0.0
        row.metrics = Metrics(0.0, 0.0, 0.0, 1.0, 1.0, 0, "tensor")
        return row
    tol = Tolerances(override=rtol).limit(da, db) if (rtol is not None or da != db) else 0.0
    judged = dtypes.coarsest(da, db)
    row.metrics = compare_arrays(a, b, judged if dtypes.is_float(judged) else "float64")
    row.tol = tol
    row.verdict = "ok" if row.metrics.rel_l2 <= tol and row.metrics.nonfinite_mismatch == 0 else "differs"
    return row


def diff_tensors(a: Checkpoint, b: Checkpoint, rtol: float | None = None,
                 b_origin: dict[str, tuple[str, ...]] | None = None) -> list[DiffRow]:
    """Rows in A's order, then B-only keys."""
    rows = []
    for name, xa in a.items():
        if name not in b:
            rows.append(DiffRow(name, "a_only", tuple(xa.shape), None, dtypes.name_of(xa.dtype)))
            continue
        row = compare_tensor(name, xa, b[name], rtol)
        origin = (b_origin or {}).get(name, ())
        row.b_from = origin if origin and origin != (name,) else ()
        rows.append(row)
    for name, xb in b.items():
        if name not in a:
            row = DiffRow(name, "b_only", None, tuple(xb.shape), None, dtypes.name_of(xb.dtype))
            origin = (b_origin or {}).get(name, ())
            row.b_from = origin if origin and origin != (name,) else ()
            rows.append(row)
    return rows


@dataclass
class CheckpointDiff:
    """Two checkpoints compared tensor by tensor (``report.ckpt.CkptDiffReport`` renders it)."""

    path_a: str
    path_b: str
    rows: list[DiffRow]
    how: str = "(names compared as they are)"
    """How B's names were brought to A's."""
    mapping: str | None = None
    """The table used, described (name and variables), or None."""
    notes: list[str] = field(default_factory=list)

    def count(self, verdict: CkptVerdict) -> int:
        return sum(1 for r in self.rows if r.verdict == verdict)

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.rows)

    def to_dict(self) -> dict[str, Any]:
        """The JSON report (``--json``)."""
        return {
            "tensordiff_ckpt_diff": JSON_VERSION, "a": self.path_a, "b": self.path_b, "mapping": self.mapping,
            "how": self.how, "notes": self.notes, "passed": self.passed,
            "summary": {v: self.count(v) for v in CKPT_VERDICTS},
            "rows": [r.as_dict() for r in self.rows],
        }


def diff_checkpoints(path_a: str, path_b: str, mapping: str | None = None, variables: dict[str, str] | None = None,
                     sides: tuple[str, str] | None = None, rtol: float | None = None) -> CheckpointDiff:
    """Compare checkpoint B against A after converting B to A's names and layout.

    ``mapping``: a table name or file (default: a built-in table that fits both files, or the names
    as they are); ``sides``: the table's sides of A and B when the names do not tell; ``rtol``: one
    relative-L2 tolerance for every float pair (default: identical bits for the same dtype).
    Raises ``TensordiffError`` subclasses on bad input."""
    variables = dict(variables or {})
    a, skipped_a = load_with_skipped(path_a)
    b, skipped_b = load_with_skipped(path_b)
    notes: list[str] = []
    table = (ConversionTable.load(mapping, variables) if mapping
             else _detect(a, b, path_a, path_b, variables, sides, notes))
    if table is None and sides is not None:  # never accepted and then ignored
        raise UsageError(f"--sides {','.join(sides)}: no conversion table applies to {path_a} and {path_b} (names are "
                         "compared as they are); name one with --mapping, or leave --sides out")
    how, described = "(names compared as they are)", None
    origin: dict[str, tuple[str, ...]] = {}
    conv = None
    b_raw = b
    if table is not None:
        described = table.describe()
        side_a, side_b = sides if sides else (_side(table, a, path_a, path_b), _side(table, b, path_b, path_a))
        for side in (side_a, side_b):
            if side not in table.sides:
                raise UsageError(f"--sides {','.join(sides or ())}: {table.name} has the sides {' and '.join(table.sides)}")
        a = {k: v for k, v in a.items() if not table.ignored(k, side_a)}
        ignored_b = [k for k in b if table.ignored(k, side_b)]
        if side_a == side_b:
            b = {k: v for k, v in b.items() if k not in set(ignored_b)}
            how = f"({side_b} names, like A)"
        else:
            conv = table.convert(b, source=side_b, path=path_b, strict=False)
            rest = {k: b[k] for k in conv.plan.unexpected}
            rest.update({k: b[k] for k, _ in conv.plan.misshaped})
            origin = dict(conv.origin)
            b = dict(conv.tensors)
            for k, v in rest.items():
                b.setdefault(k, v)
            how = f"({side_b}, converted to A's {side_a} names and layout)"
            if conv.plan.misshaped:
                notes.append("B could not be converted whole: " + listing((d for _, d in conv.plan.misshaped), 3, "; "))
        if ignored_b:
            notes.append(f"{plural(len(ignored_b), 'entry', 'entries')} of B ignored by the table ({listing(ignored_b, 3)})")
    for path, skipped in ((path_a, skipped_a), (path_b, skipped_b)):
        if skipped:
            notes.append(f"{path}: {describe_skipped(skipped)} left out")
    rows = diff_tensors(a, b, rtol, origin)
    if conv is not None and table is not None:
        _explain_layouts(rows, conv, table, a, b_raw)
    if table is None and any(r.verdict == "differs" for r in rows):
        for name in builtin_with("tensors"):
            try:
                fits = ConversionTable.load(name, variables, lenient=True)
            except TensordiffError:
                continue
            if all(fits.coverage(a, s)[0] == len(a) for s in fits.sides):
                notes.append(f"the names fit both sides of {name}: if A and B come from different frameworks, pass "
                             f"--mapping {name} --sides A_SIDE,B_SIDE (e.g. {','.join(fits.sides)})")
    return CheckpointDiff(path_a, path_b, rows, how=how, mapping=described, notes=notes)


def _side(table: ConversionTable, tensors: Checkpoint, path: str, other: str) -> str:
    side, why = table.detect_side(tensors, path, other)
    if side is None:
        raise CheckpointError(f"{path}: cannot tell which side of {table.name} it is on ({why}); "
                              f"pass --sides A_SIDE,B_SIDE, e.g. --sides {','.join(table.sides)}")
    return side


def _detect(a: Checkpoint, b: Checkpoint, path_a: str, path_b: str, variables: dict[str, str],
            sides: tuple[str, str] | None, notes: list[str]) -> ConversionTable | None:
    """A built-in table whose two sides fit A and B, or ``None`` to compare the names as they are."""
    formats = {format_of(path_a), format_of(path_b)}
    if set(a) == set(b) and sides is None and (len(formats) == 1 or "safetensors" in formats):
        return None  # same names, and nothing says the files come from different frameworks
    best: tuple[float, str] | None = None
    for name in builtin_with("tensors"):
        try:
            table = ConversionTable.load(name, variables, lenient=True)
        except TensordiffError:
            continue
        side_a, _ = table.detect_side(a, path_a, path_b)
        side_b, _ = table.detect_side(b, path_b, path_a)
        if sides:
            side_a, side_b = sides if set(sides) <= set(table.sides) else (None, None)
        if side_a is None or side_b is None or side_a == side_b:
            continue
        (hit_a, n_a), (hit_b, n_b) = table.coverage(a, side_a), table.coverage(b, side_b)
        score = hit_a / max(n_a, 1) + hit_b / max(n_b, 1)
        if min(hit_a / max(n_a, 1), hit_b / max(n_b, 1)) >= 0.5 and (best is None or score > best[0]):
            best = (score, name)
    if best is None:
        if set(a) != set(b):
            notes.append("no built-in table fits both files: names compared as they are (pass --mapping to convert B)")
        return None
    table = ConversionTable.load(best[1], variables)  # now unset variables are an error, with an example
    notes.append(f"{best[1]} fits both files' names (--mapping picks another)")
    return table


def _explain_layouts(rows: list[DiffRow], conv: Conversion, table: ConversionTable, a: Checkpoint, b_raw: Checkpoint) -> None:
    """A differing tensor that equals B *before* the table's transform: the layout variable is likely wrong."""
    by_dst = {k: inst for inst in conv.plan.instances for k in inst.dst}
    for row in rows:
        inst = by_dst.get(row.name)
        if row.verdict != "differs" or inst is None or inst.entry.split is not None or not inst.entry.ops[conv.plan.target]:
            continue
        if row.name in a and compare_tensor(row.name, a[row.name], b_raw[inst.src[0]]).passed:
            ops = ", ".join(str(o) for o in inst.entry.ops[conv.plan.target])
            chosen = " or ".join(f"--var {k} (now {v})" for k, v in inst.entry.when.items())
            row.note = f"equals B without {ops}: check {chosen or 'the table'}"
