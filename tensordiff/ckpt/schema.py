"""The pieces of a checkpoint table: variables, entries, symbolic shapes, name patterns.

Plain data parsed from YAML by ``table.ConversionTable``; nothing here reads a checkpoint.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import MappingError
from ..mapping.names import PLACEHOLDER, regex
from ..mapping.pairfile import Var, value_text
from ..transforms import Op, Split

# ------------------------------------------------------------------------------ symbolic shapes
_ALLOWED = (ast.Expression, ast.BinOp, ast.Add, ast.Sub, ast.Mult, ast.Constant, ast.Name, ast.Load)


class Dim:
    """One dimension of a symbolic shape: an integer expression of names (``2*ffn``, ``(heads+2*groups)*head_dim``)."""

    def __init__(self, text: Any, where: str):
        self.text = str(text).strip()
        try:
            tree = ast.parse(self.text, mode="eval")
        except SyntaxError:
            tree = None
        if tree is None or not all(isinstance(n, _ALLOWED) for n in ast.walk(tree)) or any(
                isinstance(n, ast.Constant) and type(n.value) is not int for n in ast.walk(tree)):
            raise MappingError(f"{where}: shape dimension {self.text!r} must be an integer expression of names with + - *")
        self.names = frozenset(n.id for n in ast.walk(tree) if isinstance(n, ast.Name))
        self._code = compile(tree, "<shape>", "eval")

    def value(self, env: dict[str, int]) -> int | None:
        if not self.names <= env.keys():
            return None
        return int(eval(self._code, {"__builtins__": {}}, dict(env)))

    def solve(self, actual: int, env: dict[str, int]) -> tuple[str, int] | None:
        """The one unknown name's value if this dimension is linear in it (``2*ffn`` = 256 -> ffn = 128)."""
        unknown = self.names - env.keys()
        if len(unknown) != 1:
            return None
        name = next(iter(unknown))
        f0, f1, f2 = (int(eval(self._code, {"__builtins__": {}}, {**env, name: v})) for v in (0, 1, 2))
        slope = f1 - f0
        if slope <= 0 or f2 - f1 != slope or (actual - f0) % slope:
            return None
        value = (actual - f0) // slope
        return (name, value) if value > 0 else None


def parse_shape(raw: Any, where: str) -> tuple[Dim, ...]:
    if not isinstance(raw, list):
        raise MappingError(f"{where}: shape must be a list such as [vocab, hidden], got {raw!r}")
    return tuple(Dim(d, where) for d in raw)



# ---------------------------------------------------------------------------------------- tables
ENTRY_FIELDS = {"shape", "split", "optional", "when"}
__all__ = ["ENTRY_FIELDS", "PLACEHOLDER", "Dim", "Entry", "Var", "name_regex", "parse_shape", "value_text"]


@dataclass
class Entry:
    """One line of a table: a tensor (or a group of tensors) on each side."""

    names: dict[str, tuple[str, ...]]
    """side -> name patterns (``{i}`` placeholders); one side has one name, the other one or more."""
    placeholders: tuple[str, ...]
    shapes: dict[str, tuple[Dim, ...] | None]
    """side -> symbolic shape of the (joined) tensor on that side, if given."""
    ops: dict[str, tuple[Op, ...]]
    """side -> transforms applied when producing that side (1:1 entries)."""
    split: Split | None
    joined: str | None
    """the side holding the single tensor of a split entry."""
    optional: bool
    where: str
    when: dict[str, str] = field(default_factory=dict)
    """the variable values that chose this entry."""
    regex: dict[str, tuple[re.Pattern, ...]] = field(default_factory=dict)

    def pattern(self, side: str) -> str:
        return " + ".join(self.names[side])

    def concrete(self, side: str, index: dict[str, int]) -> tuple[str, ...]:
        return tuple(PLACEHOLDER.sub(lambda m: str(index[m.group(1)]), n) for n in self.names[side])


def name_regex(name: str) -> re.Pattern:
    """A tensor name with ``{i}`` placeholders as a regex (the one name syntax, ``tensordiff.mapping.names``)."""
    return re.compile(regex(name))
