"""A diff result with its likely causes: what ``tensordiff diff`` reports."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..diff.engine import diff
from ..diff.result import DiffOptions, DiffResult
from .hints import CheckStatus, Hint, find_hints
from .place import explanation


@dataclass
class Diagnosis(DiffResult):
    """A ``DiffResult`` and the causes tested at its first divergence."""

    hints: list[Hint] = field(default_factory=list)
    """Likely causes at the first divergence, best first."""
    hints_note: str = ""
    """Why no hint could be tested (e.g. statistics only), or ''."""
    checks: list[CheckStatus] = field(default_factory=list)
    """Every cause, whether it could be tested at the first divergence and if not why (empty when hints were
    turned off or nothing diverged)."""

    @property
    def explanation(self) -> str:
        """The first divergence in words (``place.explanation``): what was measured, where, and what kind of code
        differs there; '' when nothing diverged."""
        return explanation(self.first) if self.first is not None else ""

    @property
    def checked(self) -> tuple[str, ...]:
        """The causes actually tested (empty when hints were turned off)."""
        return tuple(c.cause for c in self.checks if c.ran)

    @property
    def not_checked(self) -> list[CheckStatus]:
        """The causes that could not be tested here, each with its reason."""
        return [c for c in self.checks if not c.ran]


def explain(result: DiffResult, hints: bool = True) -> Diagnosis:
    """``result`` as a ``Diagnosis``: with ``hints``, the likely causes tested at its first divergence (reads both
    captures again)."""
    fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(DiffResult)}
    if not hints:
        return Diagnosis(**fields)
    found, note, checks = find_hints(result)
    return Diagnosis(**fields, hints=found, hints_note=note, checks=checks)


def diagnose(path_a: str, path_b: str, options: DiffOptions | None = None, hints: bool = True) -> Diagnosis:
    """``diff`` two captures, then (``hints``) test the likely causes at the first divergence."""
    return explain(diff(path_a, path_b, options), hints)
