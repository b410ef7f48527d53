"""``tensordiff ckpt convert | diff``: one shared checkpoint for both frameworks, and a check that it is.

* ``convert SRC DST --mapping TABLE``: rename and re-lay-out every tensor (both directions
  come from one table; the direction is read from SRC's names, its suffix, or ``--to``).
* ``diff A B``: tensor by tensor, after bringing B into A's names and layout with a table
  (``--mapping``, or found automatically). Same dtype: identical bits are required (``--rtol``
  relaxes that); different dtypes: relative L2 within the coarser dtype's tolerance.

Exit codes: 0 success / identical within tolerance, 1 some tensor differs or is on one side
only, 2 bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rich import box
from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table as RichTable
from rich.text import Text

from . import ckpt_io
from .ckpt import Checkpoint, CheckpointError, DiffRow, Table, builtin_tables, compare_tensor, diff_tensors, listing
from .errors import TensordiffError, UsageError

JSON_VERSION = 1
CONVERT_EXAMPLE = ("example: tensordiff ckpt convert mcore.pt mf.ckpt --mapping mcore-to-mindformers; "
                   "tensordiff ckpt convert mcore.pt llama.ckpt --mapping mcore-to-mindformers-llama --var heads=32 --var groups=8")
DIFF_EXAMPLE = "example: tensordiff ckpt diff mcore.pt mf.ckpt --mapping mcore-to-mindformers --json diff.json"


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``ckpt`` (with ``convert`` and ``diff``) to the subparsers of ``tensordiff``."""
    tables = ", ".join(builtin_tables()) or "none"
    k = sub.add_parser("ckpt", help="convert or compare checkpoints across frameworks",
                       description=f"Convert one checkpoint between megatron-core and MindFormers, or compare two. "
                                   f"Built-in tables: {tables} (see docs/checkpoints.md).", epilog=CONVERT_EXAMPLE)
    k.set_defaults(ckpt_parser=k)
    actions = k.add_subparsers(dest="ckpt_command", metavar="ACTION")

    c = actions.add_parser("convert", help="rename and re-lay-out every tensor of a checkpoint for the other framework",
                           description="Convert SRC to the other side of a mapping table and write DST. Every key and shape "
                                       "is checked first; all problems are reported at once. Exit 0: written, 2: error.",
                           epilog=CONVERT_EXAMPLE)
    c.add_argument("src", help="checkpoint to read (.safetensors, .pt/.pth, .ckpt)")
    c.add_argument("dst", help="checkpoint to write; the suffix picks the format")
    c.add_argument("--mapping", required=True, help=f"built-in table ({tables}) or a YAML table file")
    c.add_argument("--to", metavar="SIDE", help="the side to convert to, e.g. mindformers or mcore (default: the side SRC is not on)")
    c.add_argument("--var", action="append", default=[], metavar="NAME=VALUE",
                   help="a table variable, e.g. --var heads=32 --var groups=8 or --var fc1_layout=stacked")

    d = actions.add_parser("diff", help="compare two checkpoints tensor by tensor, across frameworks",
                           description="Compare B against A after converting B to A's names and layout. Exit 0: every "
                                       "tensor identical (same dtype) or within tolerance (different dtypes); 1: a tensor "
                                       "differs or is on one side only; 2: error.", epilog=DIFF_EXAMPLE)
    d.add_argument("a", help="checkpoint A (the reference)")
    d.add_argument("b", help="checkpoint B")
    d.add_argument("--mapping", help="table to bring B to A's names (default: a built-in table that fits both files)")
    d.add_argument("--var", action="append", default=[], metavar="NAME=VALUE", help="a table variable, e.g. --var heads=32")
    d.add_argument("--sides", metavar="A_SIDE,B_SIDE", help="the tables' sides of A and B when their names do not tell, "
                                                            "e.g. mcore,mindformers")
    d.add_argument("--rtol", type=float, help="one relative-L2 tolerance for every float pair (default: identical bits "
                                              "for the same dtype, by dtype otherwise)")
    d.add_argument("--max-rows", type=int, default=40, help="rows before identical rows collapse (0: all)")
    d.add_argument("--json", metavar="FILE", help="also write a machine-readable report")
    d.add_argument("--width", type=int, help="table width (default: the terminal's)")
    d.add_argument("--no-color", action="store_true", help="plain text output")
    return k


def run(args: argparse.Namespace) -> int:
    """Run ``tensordiff ckpt ...``; errors print one line and return 2."""
    try:
        if args.ckpt_command == "convert":
            return _convert(args)
        if args.ckpt_command == "diff":
            return _diff(args)
        args.ckpt_parser.print_help()
        return 2
    except TensordiffError as err:
        print(f"tensordiff: error: {err}", file=sys.stderr)
        return 2


def _variables(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or not name.strip() or not value.strip():
            raise UsageError(f"--var {item!r}: expected NAME=VALUE, e.g. --var heads=32")
        out[name.strip()] = value.strip()
    return out


def _console(args: argparse.Namespace) -> Console:
    from .report import make_console

    no_color = getattr(args, "no_color", False) or bool(os.environ.get("NO_COLOR"))
    return make_console(width=getattr(args, "width", None), color=False if no_color else None)


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


# --------------------------------------------------------------------------------------- convert
def _convert(args: argparse.Namespace) -> int:
    ckpt_io.format_of(args.dst)
    if os.path.abspath(args.src) == os.path.abspath(args.dst):
        raise UsageError(f"{args.dst}: DST is SRC; write the converted checkpoint to another file")
    table = Table.load(args.mapping, _variables(args.var))
    tensors, skipped = ckpt_io.load_with_skipped(args.src)
    if args.to is not None:
        if args.to not in table.sides:
            raise UsageError(f"--to {args.to}: {table.name} converts between {' and '.join(table.sides)}")
        source, why = table.other(args.to), "--to"
    else:
        source, why = table.detect_side(tensors, args.src, args.dst)
        if source is None:
            raise CheckpointError(f"{args.src}: cannot tell whether it is {table.sides[0]} or {table.sides[1]} ({why}); "
                                  f"pass --to {table.sides[1]} or --to {table.sides[0]}")
    conv = table.convert(tensors, source=source, path=args.src)
    size = ckpt_io.save(conv.tensors, args.dst)
    plan = conv.plan
    dts = Counter(str(v.dtype) for v in conv.tensors.values())
    changed = sum(n for n in conv.applied.values())
    renamed = sum(1 for i in plan.instances if i.src != i.dst)
    lines = [("mapping", table.describe()), ("direction", f"{plan.source} → {plan.target}: {why}")]
    if plan.counts:
        lines.append(("layers", ", ".join(f"{k}={v}" for k, v in plan.counts.items()) + " (from the keys)"))
    lines.append(("tensors", f"{len(tensors)} read, {renamed} renamed, {changed} re-laid-out" + (":" if changed else "")))
    lines += [("", f"  {what} ×{n}: {pattern}") for (what, pattern), n in conv.applied.items()]
    left = []
    if skipped:
        left.append(_skipped(skipped))
    if plan.ignored:
        left.append(f"{len(plan.ignored)} ignored by the table ({listing(plan.ignored, 2)})")
    if left:
        lines.append(("left out", "; ".join(left)))
    console = _console(args)
    console.print(Text.assemble((f"{args.src} → {args.dst}", "tensordiff.title"),
                                f": {_plural(len(conv.tensors), 'tensor', 'tensors')}, {_mb(size)} "
                                f"({', '.join(f'{k} ×{n}' for k, n in dts.items())})"))
    for label, text in lines:
        console.print(Text.assemble("  ", (f"{label:<10}", "tensordiff.dim"), text))
    return 0


def _skipped(skipped: dict[str, str]) -> str:
    """'9 non-tensor entries (*._extra_state: NoneType ×9)'."""
    groups = Counter((name.rsplit(".", 1)[-1], kind) for name, kind in skipped.items())
    shown = ", ".join(f"*.{last}: {kind} ×{n}" for (last, kind), n in groups.most_common(3))
    return _plural(len(skipped), "non-tensor entry", "non-tensor entries") + f" ({shown}{', ...' if len(groups) > 3 else ''})"


def _plural(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


# ------------------------------------------------------------------------------------------ diff
@dataclass
class CkptDiff:
    """Two checkpoints compared tensor by tensor; renders itself (``console.print(result)``)."""

    path_a: str
    path_b: str
    rows: list[DiffRow]
    how: str = "(names compared as they are)"
    mapping: str | None = None
    notes: list[str] = field(default_factory=list)
    max_rows: int = 40

    def count(self, verdict: str) -> int:
        return sum(1 for r in self.rows if r.verdict == verdict)

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.rows)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield Text.assemble(("A ", "tensordiff.title"), self.path_a)
        yield Text.assemble(("B ", "tensordiff.title"), self.path_b, (f"  {self.how}", "tensordiff.dim"))
        if self.mapping:
            yield Text.assemble(("mapping ", "tensordiff.title"), self.mapping)
        for note in self.notes:
            yield Text(note, style="tensordiff.dim")
        yield self._table(options.max_width)
        yield self._summary()

    def _table(self, width: int) -> RichTable:
        from .report import fmt

        cells = []
        for item in _select(self.rows, self.max_rows):
            if isinstance(item, int):
                cells.append(item)
                continue
            row, m = item, item.metrics
            shape = _fmt_shape(row.shape_a if row.shape_a is not None else row.shape_b)
            if row.verdict == "shape":
                shape = f"{_fmt_shape(row.shape_a)}/{_fmt_shape(row.shape_b)}"
            dts = [d for d in (row.dtype_a, row.dtype_b) if d]
            dtype = _short(dts[0]) if len(set(dts)) == 1 else "/".join(_short(d) for d in dts)
            cells.append((row, [shape, dtype, fmt(m.rel_l2) if m else "-", fmt(m.max_abs) if m else "-",
                                _VERDICT[row.verdict][0]]))
        heads = ["shape", "dtype", "rel L2", "max|Δ|", "verdict"]
        others = [max([len(h)] + [len(c[1][k]) for c in cells if not isinstance(c, int)]) for k, h in enumerate(heads)]
        longest = max([6] + [len(c[0].name) for c in cells if not isinstance(c, int)])
        name_width = min(longest, max(24, width - sum(others) - 3 * len(others)))  # 3: pad, rule, pad
        table = RichTable(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, expand=False)
        table.add_column("tensor", overflow="fold", width=name_width)
        for head, w in zip(heads, others):
            table.add_column(head, justify="right" if head in ("rel L2", "max|Δ|") else "left", no_wrap=True, min_width=w)
        for item in cells:
            if isinstance(item, int):
                table.add_row(Text(f"… {item} more identical or within tolerance", style="tensordiff.dim"),
                              "", "", "", "", "")
                continue
            row, values = item
            name = Text(_wrap_dotted(row.name, name_width))
            if row.b_from:
                name.append("\n" + _wrap_dotted("B: " + _brace(row.b_from), name_width, indent="   "), style="tensordiff.dim")
            if row.note:
                name.append("\n" + _wrap_dotted(row.note, name_width, indent="   "), style="tensordiff.dim")
            table.add_row(name, *values[:4], Text(values[4], style=_VERDICT[row.verdict][1]))
        return table

    def _summary(self) -> Text:
        text = Text()
        text.append(f"{sum(1 for r in self.rows if r.verdict not in ('a_only', 'b_only'))} tensors: ")
        text.append(f"{self.count('identical')} identical", style="tensordiff.ok")
        text.append(f", {self.count('ok')} within tolerance, ")
        text.append(f"{self.count('differs')} differ", style="tensordiff.diverged" if self.count("differs") else "")
        if self.count("shape"):
            text.append(f", {self.count('shape')} with other shapes", style="tensordiff.shape")
        if self.count("a_only") or self.count("b_only"):
            text.append(f"; {self.count('a_only')} only in A, {self.count('b_only')} only in B", style="tensordiff.unmatched")
        text.append("\n")
        if self.passed:
            text.append("Same checkpoint: every tensor is identical or within its tolerance.", style="tensordiff.ok")
        else:
            bad = [r.name for r in self.rows if not r.passed]
            text.append(f"Different: {listing(bad, 5)}", style="tensordiff.diverged")
        return text

    def to_dict(self) -> dict[str, Any]:
        return {
            "tensordiff_ckpt_diff": JSON_VERSION, "a": self.path_a, "b": self.path_b, "mapping": self.mapping,
            "how": self.how, "notes": self.notes, "passed": self.passed,
            "summary": {v: self.count(v) for v in _VERDICT},
            "rows": [r.as_dict() for r in self.rows],
        }

    def write_json(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(self.to_dict(), fh, indent=1)
            fh.write("\n")


_VERDICT = {"identical": ("identical", "tensordiff.ok"), "ok": ("ok", "tensordiff.ok"),
            "differs": ("DIFFERS", "tensordiff.diverged"), "shape": ("SHAPE", "tensordiff.shape"),
            "a_only": ("A only", "tensordiff.unmatched"), "b_only": ("B only", "tensordiff.unmatched")}
_SHORT = {"float64": "f64", "float32": "f32", "float16": "f16", "bfloat16": "bf16", "float8_e4m3fn": "f8e4m3",
          "float8_e5m2": "f8e5m2", "int64": "i64", "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8"}


def _short(dtype: str) -> str:
    return _SHORT.get(dtype, dtype)


def _fmt_shape(shape: tuple[int, ...] | None) -> str:
    if shape is None:
        return "-"
    return "×".join(map(str, shape)) or "scalar"


def _wrap_dotted(text: str, width: int, indent: str = "  ") -> str:
    """Break a long dotted name after dots (not inside words) to fit ``width``."""
    if len(text) <= width:
        return text
    lines, line = [], ""
    for piece in text.replace(".", ".\0").split("\0"):
        if line and len(line) + len(piece) > width:
            lines.append(line)
            line = indent
        line += piece
    lines.append(line)
    return "\n".join(lines)


def _brace(names: tuple[str, ...]) -> str:
    """('m.l.0.wq.weight', 'm.l.0.wk.weight') -> 'm.l.0.{wq,wk}.weight'."""
    if len(names) == 1:
        return names[0]
    split = [n.split(".") for n in names]
    head = 0
    while all(len(p) > head + 1 and p[head] == split[0][head] for p in split):
        head += 1
    tail = 0
    while all(len(p) > head + tail + 1 and p[-1 - tail] == split[0][-1 - tail] for p in split):
        tail += 1
    middles = [".".join(p[head:len(p) - tail]) for p in split]
    prefix = ".".join(split[0][:head]) + ("." if head else "")
    suffix = ("." if tail else "") + ".".join(split[0][len(split[0]) - tail:])
    return f"{prefix}{{{','.join(middles)}}}{suffix}"


def _select(rows: list[DiffRow], max_rows: int) -> list[DiffRow | int]:
    """Every failing row; passing rows until ``max_rows``; the rest collapse into counts."""
    if max_rows <= 0 or len(rows) <= max_rows:
        return list(rows)
    from .report import collapse

    budget = max(0, max_rows - sum(1 for r in rows if not r.passed))
    keep: set[int] = set()
    for i, row in enumerate(rows):
        if not row.passed or budget > 0:
            budget -= row.passed
            keep.add(i)
    return collapse(rows, keep)


def _diff(args: argparse.Namespace) -> int:
    variables = _variables(args.var)
    a, skipped_a = ckpt_io.load_with_skipped(args.a)
    b, skipped_b = ckpt_io.load_with_skipped(args.b)
    sides = None
    if args.sides:
        sides = [s.strip() for s in args.sides.split(",")]
        if len(sides) != 2 or not all(sides):
            raise UsageError(f"--sides {args.sides!r}: expected A_SIDE,B_SIDE, e.g. --sides mcore,mindformers")
    notes: list[str] = []
    table = Table.load(args.mapping, variables) if args.mapping else _detect(a, b, args, variables, sides, notes)
    how, mapping = "(names compared as they are)", None
    origin: dict[str, tuple[str, ...]] = {}
    conv = None
    b_raw = b
    if table is not None:
        mapping = table.describe()
        side_a, side_b = sides if sides else (_side(table, a, args.a, args.b), _side(table, b, args.b, args.a))
        for side in (side_a, side_b):
            if side not in table.sides:
                raise UsageError(f"--sides {args.sides}: {table.name} has the sides {' and '.join(table.sides)}")
        a = {k: v for k, v in a.items() if not table.ignored(k, side_a)}
        ignored_b = [k for k in b if table.ignored(k, side_b)]
        if side_a == side_b:
            b = {k: v for k, v in b.items() if k not in set(ignored_b)}
            how = f"({side_b} names, like A)"
        else:
            conv = table.convert(b, source=side_b, path=args.b, strict=False)
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
            notes.append(f"{len(ignored_b)} entries of B ignored by the table ({listing(ignored_b, 3)})")
    for path, skipped in ((args.a, skipped_a), (args.b, skipped_b)):
        if skipped:
            notes.append(f"{path}: {_skipped(skipped)} left out")
    rows = diff_tensors(a, b, args.rtol, origin)
    if conv is not None:
        _explain_layouts(rows, conv, table, a, b_raw)
    if table is None and any(r.verdict == "differs" for r in rows):
        for name in builtin_tables():
            try:
                fits = Table.load(name, variables, lenient=True)
            except TensordiffError:
                continue
            if all(fits.coverage(a, s)[0] == len(a) for s in fits.sides):
                notes.append(f"the names fit both sides of {name}: if A and B come from different frameworks, pass "
                             f"--mapping {name} --sides A_SIDE,B_SIDE (e.g. {','.join(fits.sides)})")
    result = CkptDiff(args.a, args.b, rows, how=how, mapping=mapping, notes=notes, max_rows=args.max_rows)
    _console(args).print(result)
    if args.json:
        result.write_json(args.json)
    return 0 if result.passed else 1


def _side(table: Table, tensors: Checkpoint, path: str, other: str) -> str:
    side, why = table.detect_side(tensors, path, other)
    if side is None:
        raise CheckpointError(f"{path}: cannot tell which side of {table.name} it is on ({why}); "
                              f"pass --sides A_SIDE,B_SIDE, e.g. --sides {','.join(table.sides)}")
    return side


def _detect(a: Checkpoint, b: Checkpoint, args: argparse.Namespace, variables: dict[str, str],
            sides: list[str] | None, notes: list[str]) -> Table | None:
    """A built-in table whose two sides fit A and B, or ``None`` to compare the names as they are."""
    formats = {ckpt_io.format_of(args.a), ckpt_io.format_of(args.b)}
    if set(a) == set(b) and sides is None and (len(formats) == 1 or "safetensors" in formats):
        return None  # same names, and nothing says the files come from different frameworks
    best: tuple[float, str] | None = None
    for name in builtin_tables():
        try:
            table = Table.load(name, variables, lenient=True)
        except TensordiffError:
            continue
        side_a, _ = table.detect_side(a, args.a, args.b)
        side_b, _ = table.detect_side(b, args.b, args.a)
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
    table = Table.load(best[1], variables)  # now unset variables are an error, with an example
    notes.append(f"{best[1]} fits both files' names (--mapping picks another)")
    return table


def _explain_layouts(rows: list[DiffRow], conv: Any, table: Table, a: Checkpoint, b_raw: Checkpoint) -> None:
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
