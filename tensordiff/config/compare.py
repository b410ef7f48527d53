"""Two runs' settings, row by row: what differs in effect, what was compared, what only one side holds."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .settings import Settings, Value
from .table import ROWS, TABLE, Row


def _either(key: str, test: Callable[[Any], bool]) -> Callable[[Settings, Settings], bool]:
    return lambda a, b: any(s.get(key) is not None and test(s.get(key)) for s in (a, b))


#: When a conditional row is compared (else it is listed as not applicable, with the reason).
CONDITIONS: dict[str, tuple[Callable[[Settings, Settings], bool], str]] = {
    "rope": (_either("position_embedding", lambda v: v == "rope"), "neither side uses RoPE"),
    "moe": (_either("num_experts", lambda v: isinstance(v, int) and v > 1), "neither side has experts"),
    "decay": (_either("lr_schedule", lambda v: v != "constant"), "both schedules are constant"),
    "warmup": (_either("lr_warmup_steps", lambda v: isinstance(v, (int, float)) and v > 0), "neither side warms up"),
    "weight_decay": (_either("weight_decay", lambda v: isinstance(v, (int, float)) and v != 0),
                     "no weight decay on either side"),
    "from_scratch": (lambda a, b: not a.context.get("loads_checkpoint", True)
                     and not b.context.get("loads_checkpoint", True), "a side starts from a checkpoint"),
}


def same(row: Row, a: Any, b: Any) -> bool:
    """Whether two normalized values of ``row`` are the same in effect."""
    if row.compare == "float":
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) \
                and not isinstance(b, bool):
            return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
        return a == b
    if isinstance(a, str) and isinstance(b, str):
        return a.lower() == b.lower()
    return bool(a == b)


@dataclass(frozen=True)
class Difference:
    row: Row
    a: Value
    b: Value

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.row.key, "label": self.row.label, "a": self.a.as_dict(), "b": self.b.as_dict(),
                "why": self.row.why}


@dataclass
class ConfigDiff:
    a: Settings
    b: Settings
    differences: list[Difference] = field(default_factory=list)
    same: list[str] = field(default_factory=list)
    """rows compared and equal."""
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    not_applicable: list[tuple[str, str]] = field(default_factory=list)
    """(row, why) of the conditional rows not compared."""

    @property
    def differ(self) -> bool:
        return bool(self.differences)

    def as_dict(self) -> dict[str, Any]:
        def side(s: Settings) -> dict[str, Any]:
            return {"path": s.path, "kind": s.kind, "framework": s.framework,
                    "settings": {k: v.as_dict() for k, v in s.values.items()}}

        return {"a": side(self.a), "b": side(self.b), "differences": [d.as_dict() for d in self.differences],
                "same": self.same, "only_a": self.only_a, "only_b": self.only_b,
                "not_applicable": [{"key": k, "why": w} for k, w in self.not_applicable],
                "verdict": "differ" if self.differ else "same"}


def compare_settings(a: Settings, b: Settings) -> ConfigDiff:
    """Every row of the table, in its order: compared where both sides hold it (and its condition holds)."""
    out = ConfigDiff(a, b)
    for row in TABLE:
        va, vb = a.values.get(row.key), b.values.get(row.key)
        if va is None and vb is None:
            continue
        if va is None or vb is None:
            (out.only_a if vb is None else out.only_b).append(row.key)
            continue
        if row.when:
            holds, why = CONDITIONS[row.when]
            if not holds(a, b):
                out.not_applicable.append((row.key, why))
                continue
        if same(row, va.value, vb.value):
            out.same.append(row.key)
        else:
            out.differences.append(Difference(row, va, vb))
    return out


def bearing_on(diff: ConfigDiff, keys: list[str]) -> list[Difference]:
    """The differences among ``keys`` (rows), in the table's order."""
    wanted = {k for k in keys if k in ROWS}
    return [d for d in diff.differences if d.row.key in wanted]
