"""One run's configuration, normalized: canonical key -> value, with where each value came from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Value:
    value: Any
    source: str
    """'set' (the input holds it, or it is derived from what the input holds) or 'default' (the framework's)."""
    origin: str
    """where: the flag, the YAML path, the key, or the default it fell back to."""

    def as_dict(self) -> dict[str, Any]:
        return {"value": self.value, "source": self.source, "origin": self.origin}


@dataclass
class Settings:
    path: str
    kind: str
    """what the input was: 'Megatron-LM log', 'Megatron-LM flags', 'Megatron-LM checkpoint', 'MindFormers YAML',
    'HF config.json', 'capture (megatron)', ..."""
    framework: str
    """'megatron', 'mindformers' or 'hf'."""
    values: dict[str, Value] = field(default_factory=dict)
    context: dict[str, Any] = field(default_factory=dict)
    """facts the rows' conditions read: 'loads_checkpoint'."""
    unread: int = 0
    """how many of the input's settings no row reads (logging, paths, parallel layout ...)."""

    def get(self, key: str) -> Any:
        value = self.values.get(key)
        return None if value is None else value.value

    def put(self, key: str, value: Any, source: str, origin: str) -> None:
        if value is not None:
            self.values[key] = Value(value, source, origin)
