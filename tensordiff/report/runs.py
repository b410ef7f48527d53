"""``tensordiff runs``: two whole runs in one table, and the verdict (plot and HTML page: ``runs_plot``)."""

from __future__ import annotations

from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text

from ..runs.compare import Comparison


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
