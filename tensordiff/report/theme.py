"""One theme for every renderable: named styles, number formats, the console, the collapsing of long tables.

Renderables use the ``tensordiff.*`` styles only; ``make_console`` is the one place a Console is made
(``color=False`` for plain text and golden tests).
"""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.theme import Theme

THEME = Theme(
    {
        "tensordiff.ok": "green",
        "tensordiff.diverged": "bold red",
        "tensordiff.first": "bold white on red",
        "tensordiff.unmatched": "yellow",
        "tensordiff.shape": "magenta",
        "tensordiff.drift": "yellow",
        "tensordiff.skipped": "dim",
        "tensordiff.uncertain": "yellow",
        "tensordiff.inconclusive": "bold yellow",
        "tensordiff.dim": "dim",
        "tensordiff.title": "bold",
    }
)

def fmt(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if math.isinf(value):
        return "inf"
    if value == 0:
        return "0"
    if value == 1:
        return "1"
    return f"{value:.1e}"


def fmt_cos(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "-"
    if value >= 1.0 - 1e-15:
        return "1"
    # 1 - cos is what matters near 1
    return f"1-{1 - value:.0e}" if value > 0.999 else f"{value:.4f}"


def collapse(rows: list, keep: set[int]) -> list:
    """``rows`` with every run of rows not in ``keep`` replaced by its length (an int: one "… N more" line)."""
    out: list = []
    for i, row in enumerate(rows):
        if i in keep:
            out.append(row)
        elif out and isinstance(out[-1], int):
            out[-1] += 1
        else:
            out.append(1)
    return out


def make_console(file: Any = None, width: int | None = None, color: bool | None = None) -> Console:
    return Console(file=file, width=width, theme=THEME, color_system="auto" if color is not False else None,
                   no_color=color is False, highlight=False, soft_wrap=False)
