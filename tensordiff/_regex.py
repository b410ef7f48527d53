"""Regular expressions written by users (mapping files, ignore lists, ``--tensors-match``), matched with a time bound.

Python's ``re`` can take exponential time on patterns such as ``(.*.*)*z`` and cannot be interrupted while it
does; these patterns run on the ``regex`` package's engine (the same syntax), whose matches take a timeout. A match
that runs past ``MATCH_SECONDS``, or a pattern whose matches together run past ``TOTAL_SECONDS``, is one error
naming the pattern, the name it was matched on, and the fix."""

from __future__ import annotations

import time
from typing import Any

import regex

from .errors import MappingError

#: The longest one match may take (module names are short: a well-formed pattern needs microseconds).
MATCH_SECONDS = 0.5
#: The longest all matches of one pattern may take together (thousands of names).
TOTAL_SECONDS = 10.0

class BoundedPattern:
    """A compiled user pattern whose ``fullmatch``/``search`` raise ``MappingError`` past the bounds."""

    __slots__ = ("_compiled", "pattern", "spent", "where")

    def __init__(self, source: str, where: str):
        self._compiled = regex.compile(source)
        self.pattern = source
        self.where = where
        self.spent = 0.0

    def fullmatch(self, text: str) -> Any:
        return self._timed(self._compiled.fullmatch, text)

    def search(self, text: str) -> Any:
        return self._timed(self._compiled.search, text)

    def _timed(self, op: Any, text: str) -> Any:
        start = time.perf_counter()
        try:
            found = op(text, timeout=MATCH_SECONDS)
        except TimeoutError:
            raise MappingError(f"{self.where}: the regular expression {self.pattern!r} takes over {MATCH_SECONDS:g} s "
                               f"on the name {text[:80]!r} (catastrophic backtracking: a repeated group that can match "
                               "the same text in many ways, such as (.*.*)*); simplify it, e.g. (.*)") from None
        self.spent += time.perf_counter() - start
        if self.spent > TOTAL_SECONDS:
            raise MappingError(f"{self.where}: the regular expression {self.pattern!r} has taken over "
                               f"{TOTAL_SECONDS:g} s over the names matched so far; simplify it") from None
        return found

    def __repr__(self) -> str:
        return f"BoundedPattern({self.pattern!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BoundedPattern) and other.pattern == self.pattern

    def __hash__(self) -> int:
        return hash(self.pattern)


def compile_user(source: str, where: str) -> BoundedPattern:
    """``source`` compiled for bounded matching; a syntax error is one ``MappingError`` naming ``where``."""
    try:
        return BoundedPattern(source, where)
    except (regex.error, TypeError, ValueError, OverflowError, RecursionError) as err:
        raise MappingError(f"{where}: bad regular expression {source!r} ({err})") from None
