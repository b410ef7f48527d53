"""``tensordiff runs``: two whole runs in one table, and the verdict (plot and HTML page: ``runs_plot``)."""

from __future__ import annotations

import math

from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text

from ..runs.compare import Comparison
from ..runs.drift import DriftTable
from .theme import Name, wide

#: The earliest-drifting layers shown (``--drift-top``), in the table and the HTML page.
DEFAULT_TOP = 10


class RunsReport:
    """A runs comparison that renders itself (``console.print(RunsReport(comparison))``)."""

    def __init__(self, comparison: Comparison):
        self.comparison = comparison

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        res = self.comparison
        yield Text(f"A {res.a.describe()}")
        yield Text(f"B {res.b.describe()}")
        table = Table(title=f"{len(res.steps)} common steps, judged {res.judged_text()}", title_justify="left")
        table.add_column("measure", justify="left")
        for name in ("A", "B", "relative"):
            table.add_column(name, justify="right")
        for row in res.measures():
            table.add_row(*row)
        yield table
        yield Text(res.verdict(), style="tensordiff.ok" if res.passed else "tensordiff.diverged")


def drift_rows(table: DriftTable, top: int) -> list[tuple[str, str, str, str, str, str]]:
    """(layer, first drift step, kind, the record that departed first, ratio there, largest ratio) of the ``top``
    earliest-drifting layers, as text (the terminal and the HTML share them)."""
    rows = []
    for cell in table.ranking()[:top]:
        assert cell.first is not None
        ratios = table.layer_ratios(cell.layer)
        peak = max((v for v in ratios if not math.isnan(v)), default=math.nan)
        rows.append((cell.layer, str(table.steps[cell.first]), cell.kind, cell.first_record,
                     _ratio(cell.ratios[cell.first]), _ratio(peak)))
    return rows


def _ratio(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.3g}"


def drift_title(table: DriftTable) -> str:
    return (f"layer drift: {len(table.layers)} layers x {len(table.steps)} steps; noise from steps "
            f"{table.steps[0]}..{table.steps[table.baseline - 1]}, over {table.factor:g}x of it (and the dtype's floor) "
            "counts, again at 2 of the next 3 steps")


class DriftReport:
    """The layer drift table of ``tensordiff runs`` on two captures: the earliest-drifting layers, the verdict, and
    what was not compared."""

    def __init__(self, table: DriftTable, top: int = DEFAULT_TOP):
        self.table, self.top = table, top

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        t = self.table
        if t.mapping_note:
            yield Text(f"mapping: {t.mapping_note}", style="tensordiff.dim")
        rows = drift_rows(t, self.top)
        if rows:
            table = Table(title=drift_title(t), title_justify="left")
            for name, justify in (("layer", "left"), ("first drift", "right"), ("kind", "left"),
                                  ("first record over", "left"), ("ratio there", "right"), ("max ratio", "right")):
                table.add_column(name, justify=justify, overflow="fold")  # type: ignore[arg-type]
            for row in rows:
                table.add_row(Name(row[0]), *row[1:3], Name(row[3]), *row[4:])
            yield wide(table)
            more = len(t.ranking()) - len(rows)
            if more > 0:
                yield Text(f"... and {more} more drifting layers (--drift-top N, --json)", style="tensordiff.dim")
        else:
            yield Text(drift_title(t), style="tensordiff.title")
        yield Text(("DRIFT: " if t.drifted else "NO DRIFT: ") + t.verdict(),
                   style="tensordiff.drift" if t.drifted else "tensordiff.ok")
        for note in t.notes():
            yield Text(f"note: {note}", style="tensordiff.unmatched")
