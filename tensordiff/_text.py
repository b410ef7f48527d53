"""Small text helpers shared by messages and tables: lists, plurals, shapes."""

from __future__ import annotations

from collections.abc import Iterable

#: Items named in a message before "... and N more".
SHOWN = 10


def listing(items: Iterable[str], limit: int = SHOWN, sep: str = ", ") -> str:
    """'a, b, c ... and 7 more'."""
    items = list(items)
    text = sep.join(items[:limit])
    return text + (f" ... and {len(items) - limit} more" if len(items) > limit else "")


def plural(n: int, one: str, many: str) -> str:
    """'1 tensor', '3 tensors'."""
    return f"{n} {one if n == 1 else many}"


def bracket_shape(shape: Iterable[int]) -> str:
    """'[4, 8]' (messages)."""
    return "[" + ", ".join(map(str, shape)) + "]"


def bracket_shapes(shapes: Iterable[Iterable[int]]) -> str:
    """'[4, 8], [4, 8]'."""
    return ", ".join(bracket_shape(s) for s in shapes)


def times_shape(shape: Iterable[int] | None) -> str:
    """'4×8' (tables); 'scalar' for (); '-' for None."""
    if shape is None:
        return "-"
    return "×".join(map(str, shape)) or "scalar"


def first_line(err: BaseException | str, limit: int = 200, default: str | None = None) -> str:
    """The first non-empty line of an error's message, cut to ``limit`` characters (one-line messages);
    ``default`` when there is none (None: the exception's type name)."""
    line = next((part.strip() for part in str(err).splitlines() if part.strip()), "")
    if line:
        return line[:limit]
    if default is None:
        return type(err).__name__ if isinstance(err, BaseException) else ""
    return default
