"""One theme for every renderable: named styles, number formats, the console and its width, the collapsing of long
tables.

Renderables use the ``tensordiff.*`` styles only; ``make_console`` is the one place a Console is made
(``color=False`` for plain text and golden tests).

Width, so that a module name is never cut or wrapped inside a word: ``--width`` if given, else the terminal's, else
``COLUMNS``, else (a pipe, a file, CI) prose wraps at ``READING`` columns and every table is as wide as its longest
name needs (``wide(table)``). Where a table is narrower than its names (a narrow terminal), a ``Name`` breaks after a
dot or at a space, never inside a word of the name.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.style import StyleType
from rich.text import Text
from rich.theme import Theme

#: prose (paragraphs, panels) wraps at this many columns where the output has no width of its own
READING = 100
#: the width tables may take where the output has no width of its own (wide enough for any name)
UNBOUNDED = 10_000
#: the rows a table of pairs shows before its passing rows collapse (``--max-rows``; 0: all)
MAX_ROWS = 40

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


class _Console(Console):
    """A Console whose prose wraps at ``reading`` columns while its lines may be ``width`` long (tables in ``wide``)."""

    reading: int | None = None

    @property
    def options(self) -> ConsoleOptions:
        opts = super().options
        return opts.update_width(min(opts.max_width, self.reading)) if self.reading else opts


def make_console(file: Any = None, width: int | None = None, color: bool | None = None) -> Console:
    console = _Console(file=file, width=width, theme=THEME, color_system="auto" if color is not False else None,
                       no_color=color is False, highlight=False, soft_wrap=False)
    if width is None and not console.is_terminal and not os.environ.get("COLUMNS", "").strip().isdigit():
        console.width, console.reading = UNBOUNDED, READING  # no width of its own: never cut a name to 80 columns
    return console


def table_width(console: Console, options: ConsoleOptions) -> int:
    """The width a table may take here: the whole line (``UNBOUNDED`` where the output has no width), else the
    options' width."""
    reading = getattr(console, "reading", None)
    return console.width if reading else options.max_width


class wide:
    """``renderable`` (a table of names) rendered at ``table_width``: its natural width where the output has no
    width of its own, the console's otherwise."""

    def __init__(self, renderable: Any) -> None:
        self.renderable = renderable

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield from console.render(self.renderable, options.update_width(table_width(console, options)))

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement.get(console, options.update_width(table_width(console, options)), self.renderable)


#: where a line may break, most wanted first: after a space; after the dot of a dotted name or a slash (a letter on
#: either side of the dot: decoder.layers.1.mlp, never inside a number: 1.6e-04); after a comma ({wq,wk,wv})
_BREAKS = (re.compile(r"(?<=\s)(?=\S)"), re.compile(r"(?<=/)|(?<=[A-Za-z_)\]}]\.)|(?<=\.)(?=[A-Za-z_{])"),
           re.compile(r"(?<=,)"))


class Name:
    """Text that holds module names: a table cell (a name and what follows it), or a paragraph that names modules.
    Whole words where they fit; a word wider than the line breaks after its dots, then after its commas (``indent``
    starts each continued line); folded inside a word only where one piece is wider than the whole line. At least
    as wide as its longest piece, at most its full length."""

    def __init__(self, text: Text | str, style: StyleType = "", indent: str = "") -> None:
        self.text = text if isinstance(text, Text) else Text(text, style=style)
        self.indent = indent

    @staticmethod
    def _pieces(line: Text, level: int) -> list[Text]:
        """``line`` cut at the breaks of ``_BREAKS[level]``."""
        plain, out, at = line.plain, [], 0
        for m in _BREAKS[level].finditer(plain):
            if m.start() > at:
                out.append(line[at:m.start()])
                at = m.start()
        if at < len(plain):
            out.append(line[at:])
        return out

    def _smallest(self, line: Text, level: int = 0) -> list[Text]:
        return [p for piece in self._pieces(line, level)
                for p in ([piece] if level + 1 == len(_BREAKS) else self._smallest(piece, level + 1))]

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        lines = self.text.split("\n", allow_blank=True)
        longest = max((len(p.plain.rstrip()) for line in lines for p in self._smallest(line)), default=1)
        full = max((len(line.plain) for line in lines), default=1)
        return Measurement(min(longest + len(self.indent), full, options.max_width), min(full, options.max_width))

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = max(options.max_width, 1)
        out = Text(style=self.text.style, end="")
        used = 0  # columns on the current line
        held = 0  # of which text (not the indent)
        indent = self.indent

        def put(piece: Text) -> None:
            nonlocal used, held
            if used and used + len(piece.plain.rstrip()) > width:  # a new line, its leading spaces dropped
                out.append("\n" + indent)
                used, held = len(indent), 0
                piece = piece[len(piece.plain) - len(piece.plain.lstrip()):]
            out.append_text(piece)
            used += len(piece.plain)
            held += len(piece.plain)

        def place(text: Text, level: int) -> None:
            """Whole pieces of this level where they fit (on this line, or on a line of their own unless this line
            would keep only a short label: 'B:'), else cut at the next level's breaks."""
            for piece in self._pieces(text, level):
                size = len(piece.plain.rstrip())
                fits = used + size <= width or (len(indent) + len(piece.plain.strip()) <= width and held > 4)
                if fits or level + 1 == len(_BREAKS):
                    put(piece)
                else:
                    place(piece, level + 1)

        for n, line in enumerate(self.text.split("\n", allow_blank=True)):
            if n:
                out.append("\n")
                used = held = 0
            # a continued line starts under its own line's text, further in by ``indent``
            indent = " " * (len(line.plain) - len(line.plain.lstrip())) + self.indent
            place(line, 0)
        yield from console.render(out, options.update(overflow="fold", no_wrap=False))
