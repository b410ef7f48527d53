"""``tensordiff ckpt``: the checkpoint diff table and the conversion summary."""

from __future__ import annotations

from collections import Counter

from rich import box
from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text

from .._text import listing, plural, times_shape
from ..ckpt.compare import CheckpointDiff, CkptVerdict, DiffRow
from ..ckpt.convert import ConvertedFile
from ..ckpt.files import describe_skipped
from .theme import MAX_ROWS, Name, collapse, fmt, table_width, wide


class CkptDiffReport:
    """A checkpoint diff that renders itself (``console.print(CkptDiffReport(diff))``)."""

    def __init__(self, diff: CheckpointDiff, max_rows: int | None = None):
        self.diff = diff
        self.max_rows = MAX_ROWS if max_rows is None else max_rows

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield Text.assemble(("A ", "tensordiff.title"), self.diff.path_a)
        yield Text.assemble(("B ", "tensordiff.title"), self.diff.path_b, (f"  {self.diff.how}", "tensordiff.dim"))
        if self.diff.mapping:
            yield Text.assemble(("mapping ", "tensordiff.title"), self.diff.mapping)
        for note in self.diff.notes:
            yield Text(note, style="tensordiff.dim")
        yield wide(self._table(table_width(console, options)))
        yield self._summary()

    def _table(self, width: int) -> Table:
        cells: list[int | tuple[DiffRow, list[str]]] = []
        for item in _select(self.diff.rows, self.max_rows):
            if isinstance(item, int):
                cells.append(item)
                continue
            row, m = item, item.metrics
            shape = times_shape(row.shape_a if row.shape_a is not None else row.shape_b)
            if row.verdict == "shape":
                shape = f"{times_shape(row.shape_a)}/{times_shape(row.shape_b)}"
            dts = [d for d in (row.dtype_a, row.dtype_b) if d]
            dtype = _short(dts[0]) if len(set(dts)) == 1 else "/".join(_short(d) for d in dts)
            cells.append((row, [shape, dtype, fmt(m.rel_l2) if m else "-", fmt(m.max_abs) if m else "-",
                                _VERDICT[row.verdict][0]]))
        heads = ["shape", "dtype", "rel L2", "max|Δ|", "verdict"]
        others = [max([len(h)] + [len(c[1][k]) for c in cells if not isinstance(c, int)]) for k, h in enumerate(heads)]
        longest = max([6] + [len(c[0].name) for c in cells if not isinstance(c, int)]
                      + [len("B: " + _brace(c[0].b_from)) for c in cells if not isinstance(c, int) and c[0].b_from])
        name_width = min(longest, max(24, width - sum(others) - 3 * len(others)))  # 3: pad, rule, pad
        table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, expand=False)
        table.add_column("tensor", overflow="fold", width=name_width)
        for head, w in zip(heads, others):
            table.add_column(head, justify="right" if head in ("rel L2", "max|Δ|") else "left", no_wrap=True, min_width=w)
        for cell in cells:
            if isinstance(cell, int):
                table.add_row(Text(f"… {cell} more identical or within tolerance", style="tensordiff.dim"),
                              "", "", "", "", "")
                continue
            row, values = cell
            name = Text(row.name)
            if row.b_from:
                name.append("\nB: " + _brace(row.b_from), style="tensordiff.dim")
            if row.note:
                name.append("\n" + row.note, style="tensordiff.dim")
            table.add_row(Name(name, indent="  "), *values[:4], Text(values[4], style=_VERDICT[row.verdict][1]))
        return table

    def _summary(self) -> Text:
        text = Text()
        text.append(f"{sum(1 for r in self.diff.rows if r.verdict not in ('a_only', 'b_only'))} tensors: ")
        text.append(f"{self.diff.count('identical')} identical", style="tensordiff.ok")
        text.append(f", {self.diff.count('ok')} within tolerance, ")
        text.append(f"{self.diff.count('differs')} differ", style="tensordiff.diverged" if self.diff.count("differs") else "")
        if self.diff.count("shape"):
            text.append(f", {self.diff.count('shape')} with other shapes", style="tensordiff.shape")
        if self.diff.count("a_only") or self.diff.count("b_only"):
            text.append(f"; {self.diff.count('a_only')} only in A, {self.diff.count('b_only')} only in "
                        "B", style="tensordiff.unmatched")
        text.append("\n")
        if self.diff.passed:
            text.append("Same checkpoint: every tensor is identical or within its tolerance.", style="tensordiff.ok")
        else:
            bad = [r.name for r in self.diff.rows if not r.passed]
            text.append(f"Different: {listing(bad, 5)}", style="tensordiff.diverged")
        return text



_VERDICT: dict[CkptVerdict, tuple[str, str]] = {"identical": ("identical", "tensordiff.ok"), "ok": ("ok", "tensordiff.ok"),
            "differs": ("DIFFERS", "tensordiff.diverged"), "shape": ("SHAPE", "tensordiff.shape"),
            "a_only": ("A only", "tensordiff.unmatched"), "b_only": ("B only", "tensordiff.unmatched")}
_SHORT = {"float64": "f64", "float32": "f32", "float16": "f16", "bfloat16": "bf16", "float8_e4m3fn": "f8e4m3",
          "float8_e5m2": "f8e5m2", "int64": "i64", "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8"}


def _short(dtype: str) -> str:
    return _SHORT.get(dtype, dtype)


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
    budget = max(0, max_rows - sum(1 for r in rows if not r.passed))
    keep: set[int] = set()
    for i, row in enumerate(rows):
        if not row.passed or budget > 0:
            budget -= row.passed
            keep.add(i)
    return collapse(rows, keep)




def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


class ConvertSummary:
    """What ``tensordiff ckpt convert`` did, in a few lines."""

    def __init__(self, done: ConvertedFile):
        self.done = done

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        done = self.done
        conv, plan = done.conversion, done.conversion.plan
        dts = Counter(str(v.dtype) for v in conv.tensors.values())
        changed = sum(n for n in conv.applied.values())
        renamed = sum(1 for i in plan.instances if i.src != i.dst)
        lines = [("mapping", done.mapping), ("direction", f"{plan.source} → {plan.target}: {done.why}")]
        if plan.counts:
            lines.append(("layers", ", ".join(f"{k}={v}" for k, v in plan.counts.items()) + " (from the keys)"))
        lines.append(("tensors", f"{done.read} read, {renamed} renamed, {changed} re-laid-out" + (":" if changed else "")))
        lines += [("", f"  {what} ×{n}: {pattern}") for (what, pattern), n in conv.applied.items()]
        left = []
        if done.skipped:
            left.append(describe_skipped(done.skipped))
        if plan.ignored:
            left.append(f"{len(plan.ignored)} ignored by the table ({listing(plan.ignored, 2)})")
        if left:
            lines.append(("left out", "; ".join(left)))
        yield Text.assemble((f"{done.src} → {done.dst}", "tensordiff.title"),
                            f": {plural(len(conv.tensors), 'tensor', 'tensors')}, {_mb(done.size)} "
                            f"({', '.join(f'{k} ×{n}' for k, n in dts.items())})")
        for label, text in lines:
            yield Text.assemble("  ", (f"{label:<10}", "tensordiff.dim"), text)
