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


#: the settings a first divergence in such a place can come from: (words in the module name or hint cause, rows)
_OPTIMIZER = ("optimizer", "adam_beta1", "adam_beta2", "adam_eps", "weight_decay", "weight_decay_params", "clip_grad",
              "lr", "lr_schedule", "lr_warmup_steps", "lr_warmup_init", "min_lr", "loss_scaling", "grad_reduce_dtype")
_NORM = ("normalization", "norm_epsilon", "apply_layernorm_1p", "norm_dtype")
_ROPE = ("position_embedding", "rotary_base", "rotary_percent", "rope_scaling", "rotary_dtype")
_PLACES: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    (("norm", "norm-epsilon"), _NORM),
    (("rotary", "rope"), _ROPE),
    (("attention", "attn", "self_attn", "linear_qkv", "wq", "wk", "wv"),
     ("softmax_dtype", "attention_dropout", "num_attention_heads", "num_query_groups", "qkv_bias", *_ROPE)),
    (("mlp", "fc1", "fc2", "feed_forward", "w1", "w2", "w3", "act", "activation"),
     ("activation", "ffn_hidden_size", "linear_bias", "hidden_dropout")),
    (("embedding", "tok_embeddings", "wte", "embed_tokens"), ("vocab_rows", "tied_embeddings", "hidden_dropout")),
    (("output_layer", "lm_head", "lm_head.weight"), ("vocab_rows", "tied_embeddings")),
    (("dropout",), ("hidden_dropout", "attention_dropout")),
    (("dtype",), ("params_dtype", "compute_dtype", "norm_dtype", "softmax_dtype", "rotary_dtype")),
    (("optimizer-step",), _OPTIMIZER),
    (("checkpoint",), ("params_dtype", "tied_embeddings", "vocab_rows", "qkv_bias", "linear_bias")),
)


def rows_for(module: str, phase: str, after_first_step: bool, causes: list[str] | None = None) -> list[str]:
    """The table rows that bear on a first divergence in ``module`` at ``phase`` (``after_first_step``: a step after
    the first captured one), and on the hints' ``causes``: what ``tensordiff diff`` shows from the configurations."""
    words = [w for w in module.lower().replace("_", ".").split(".") if w] + [module.lower()] + list(causes or [])
    keys: list[str] = ["compute_dtype", "params_dtype"]  # every tensor is computed in them
    if phase == "weights":
        keys += list(_OPTIMIZER) if after_first_step else ["params_dtype", "tied_embeddings", "vocab_rows"]
    if phase == "loss":
        keys += ["loss_scaling", "vocab_rows"]
    for names, rows in _PLACES:
        if any(n in w for n in names for w in words):
            keys += rows
    return list(dict.fromkeys(keys))
