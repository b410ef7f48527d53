"""``tensordiff config``: the settings that differ in effect, then what was compared and what only one side holds."""

from __future__ import annotations

from typing import Any

from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text

from ..config import ROWS, ConfigDiff, Difference, Value


def _value(v: Value) -> str:
    value = v.value
    text = f"{value:g}" if isinstance(value, float) else str(value)
    return f"{text}\n({'default' if v.source == 'default' else 'set'}: {v.origin})"


def difference_table(differences: list[Difference], title: str) -> Table:
    table = Table(title=title, title_justify="left", show_lines=True)
    table.add_column("setting", justify="left")
    table.add_column("A", justify="left", overflow="fold")
    table.add_column("B", justify="left", overflow="fold")
    table.add_column("why it matters", justify="left")
    for d in differences:
        table.add_row(d.row.label, _value(d.a), _value(d.b), d.row.why)
    return table


def _names(keys: list[str]) -> str:
    return ", ".join(ROWS[k].label for k in keys)


class ConfigReport:
    """A configuration comparison that renders itself (``console.print(ConfigReport(diff))``)."""

    def __init__(self, diff: ConfigDiff):
        self.diff = diff

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        d = self.diff
        yield Text(f"A {d.a.path} ({d.a.kind})")
        yield Text(f"B {d.b.path} ({d.b.kind})")
        if d.differences:
            yield difference_table(d.differences, f"{len(d.differences)} setting(s) differ in effect")
        compared = len(d.same) + len(d.differences)
        yield Text(f"compared: {compared} settings, {len(d.same)} the same", style="tensordiff.dim")
        for side, keys in (("A", d.only_a), ("B", d.only_b)):
            if keys:
                yield Text(f"only in {side} (not compared): {_names(keys)}", style="tensordiff.dim")
        if d.not_applicable:
            yield Text("not applicable: " + "; ".join(f"{ROWS[k].label} ({why})" for k, why in d.not_applicable),
                       style="tensordiff.dim")
        unread = [f"{s} {x.unread}" for s, x in (("A", d.a), ("B", d.b)) if x.unread]
        if unread:
            yield Text(f"settings no row reads (paths, logging, parallel layout ...): {', '.join(unread)}",
                       style="tensordiff.dim")
        if d.differences:
            yield Text(f"DIFFER: {_names([x.row.key for x in d.differences])}", style="tensordiff.diverged")
        else:
            yield Text("SAME: no setting differs in effect", style="tensordiff.ok")


def as_json(diff: ConfigDiff) -> dict[str, Any]:
    return diff.as_dict()
