"""A diff result with its likely causes: what ``tensordiff diff`` reports."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..diff.engine import diff
from ..diff.result import DiffOptions, DiffResult
from .hints import CHECKED, Hint, find_hints


@dataclass
class Diagnosis(DiffResult):
    """A ``DiffResult`` and the causes tested at its first divergence."""

    hints: list[Hint] = field(default_factory=list)
    """Likely causes at the first divergence, best first."""
    hints_note: str = ""
    """Why no hint could be tested (e.g. statistics only), or ''."""
    checked: tuple[str, ...] = ()
    """The causes tested (empty when hints were turned off)."""


def explain(result: DiffResult) -> Diagnosis:
    """Test the likely causes at ``result``'s first divergence (reads both captures again)."""
    fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(DiffResult)}
    hints, note = find_hints(result)
    return Diagnosis(**fields, hints=hints, hints_note=note, checked=CHECKED)


def diagnose(path_a: str, path_b: str, options: DiffOptions | None = None, hints: bool = True) -> Diagnosis:
    """``diff`` two captures, then (``hints``) test the likely causes at the first divergence."""
    result = diff(path_a, path_b, options)
    if not hints:
        return Diagnosis(**{f.name: getattr(result, f.name) for f in dataclasses.fields(DiffResult)})
    return explain(result)
