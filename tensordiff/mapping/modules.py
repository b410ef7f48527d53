"""The ``modules`` section of a pair file: how B's recorded module names map onto A's, for ``diff``.

    modules:
      order_fallback: false           # what no rule or name pairs is not matched by execution order
      strip: {hf: ['model.']}         # prefixes dropped from B's names first (a wrapper A does not have)
      ignore:                         # records left out on purpose, per side
        mcore: [{module: '', kinds: [output, grad_output]}]
      rules:
        - hf: 'model.layers.{i}.self_attn'            # B's name (the second side)
          mcore: 'decoder.layers.{i}.self_attention'  # A's name (the first side)
          activations: [swap01]                       # B's tensors into A's layout
        - hf: ['model.layers.{i}.mlp.gate_proj', 'model.layers.{i}.mlp.up_proj']
          mcore: 'decoder.layers.{i}.mlp.linear_fc1'
          split: 'chunk(n=2)'                         # A's one tensor is B's parts joined

Names follow ``names``' syntax. A file of the older format (``a:``/``b:`` with regexes, ``join:``) is read too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .._regex import BoundedPattern, compile_user
from ..errors import MappingError
from ..record import PHASES, Record
from ..transforms import VALUE_ONLY, Op, Split, parse_op, parse_split
from .names import regex, template, unwrap
from .pairfile import PairFile, from_text, load

PARAM_KINDS = ("param", "grad", "grad_local")
INPUT_KINDS = ("input", "grad_input")
_RULE_KEYS = {"phases", "kinds", "slots", "only_slots", "inputs", "outputs", "activations", "params", "split", "when",
              "experts"}
_SECTION_KEYS = {"order_fallback", "strip", "ignore", "rules"}


@dataclass
class Rule:
    b: BoundedPattern
    a: str
    """A's name as an expansion template of ``b``'s match."""
    phases: frozenset[str] | None = None
    kinds: frozenset[str] | None = None
    slots: dict[str, str] = field(default_factory=dict)
    only_slots: frozenset[str] | None = None
    inputs: tuple[Op, ...] = ()
    outputs: tuple[Op, ...] = ()
    params: dict[str, tuple[Op, ...]] = field(default_factory=dict)
    parts: tuple[BoundedPattern, ...] = ()
    """a join: B's modules (``b`` is the first), joined in this order."""
    join: str = ""
    """the join's split, e.g. ``qkv_groups(heads=4, groups=2)``; see ``split_for``."""
    experts: int = 0
    """a fan-out: B's parameters hold this many experts along dim 0, each one A's module (``fan``)."""
    fan: dict[str, tuple[str, str, tuple[Op, ...]]] = field(default_factory=dict)
    """B's parameter slot -> (A's module with ``{e}`` for the expert, A's slot, B's ops after taking expert e)."""

    def fan_targets(self, rec: Record, module: str) -> list[tuple[tuple, tuple[Op, ...]]]:
        """For a fan-out rule: each expert's (A's key, B's ops) of B's parameter or gradient record."""
        if not self.experts or rec.kind not in PARAM_KINDS or rec.slot not in self.fan or not self._admits(rec):
            return []
        m = self.b.fullmatch(module)
        if not m:
            return []
        name, slot, ops = self.fan[rec.slot]
        base = m.expand(name)
        return [((rec.phase, base.replace("{e}", str(e)), rec.call, rec.kind, slot),
                 (Op("select", (("index", e), ("dim", 0))), *ops)) for e in range(self.experts)]

    def split_for(self, kind: str) -> Split:
        """The join's split for a record kind: parameters join along dim 0, activations along the last dim,
        unless the split names its dim."""
        text = self.join.strip()
        if "dim=" not in text.replace(" ", ""):
            dim = "0" if kind in PARAM_KINDS else "-1"
            if text.endswith(")") and "(" in text:
                head, inner = text[:text.index("(")], text[text.index("(") + 1:-1].strip()
                text = f"{head}({inner + ', ' if inner else ''}dim={dim})"
            else:
                text = f"{text}(dim={dim})"
        return parse_split(text, "split")

    def _admits(self, rec: Record) -> bool:
        """The rule's phase, kind and slot limits let ``rec`` through."""
        return ((self.phases is None or rec.phase in self.phases) and (self.kinds is None or rec.kind in self.kinds)
                and (self.only_slots is None or rec.kind in PARAM_KINDS or rec.slot in self.only_slots))

    def target(self, rec: Record, module: str | None = None) -> tuple[tuple, tuple[Op, ...]] | None:
        """Where B's record goes in A (and B's transforms), or None; ``module``: B's name with the prefixes stripped."""
        if not self._admits(rec):
            return None
        if self.parts and rec.kind not in INPUT_KINDS:
            return None  # a join's outputs, gradients and parameters are paired by ``join_target``
        if self.experts:
            return None  # a fan-out's parameters are paired by ``fan_targets``
        m = self.b.fullmatch(rec.module if module is None else module)
        if not m:
            return None
        name = m.expand(self.a)
        return (rec.phase, name, rec.call, rec.kind, self.slots.get(rec.slot, rec.slot)), self.ops_for(rec)

    def join_target(self, rec: Record, module: str) -> tuple[tuple, int] | None:
        """For a join: (A's key, which part) of B's output, gradient or parameter record, or None."""
        if not self.parts or rec.kind in INPUT_KINDS or not self._admits(rec):
            return None
        for i, pattern in enumerate(self.parts):
            m = pattern.fullmatch(module)
            if m:
                return (rec.phase, m.expand(self.a), rec.call, rec.kind, self.slots.get(rec.slot, rec.slot)), i
        return None

    def ops_for(self, rec: Record) -> tuple[Op, ...]:
        if rec.kind in PARAM_KINDS:
            ops = self.params.get(rec.slot, ())
            return ops if rec.kind == "param" else tuple(op for op in ops if op.name not in VALUE_ONLY)
        return self.inputs if rec.kind in INPUT_KINDS else self.outputs


@dataclass(frozen=True)
class Ignore:
    """Records left out on purpose: a module pattern, optionally only some kinds or slots."""

    module: BoundedPattern
    kinds: frozenset[str] | None = None
    slots: frozenset[str] | None = None

    def hits(self, rec: Record, module: str | None = None) -> bool:
        """``module``: the record's module name as the rules see it (B's with the prefixes stripped); a wrapper's prefix
        (``module.``: DDP, Float16Module) is dropped, as every name comparison does."""
        return (self.module.fullmatch(unwrap(rec.module if module is None else module)) is not None
                and (self.kinds is None or rec.kind in self.kinds)
                and (self.slots is None or rec.slot in self.slots))


@dataclass
class RenameRules:
    """The ``modules`` section with its variables bound: rename rules from B's names to A's."""

    rules: list[Rule] = field(default_factory=list)
    order_fallback: bool = True
    ignore_a: list[Ignore] = field(default_factory=list)
    ignore_b: list[Ignore] = field(default_factory=list)
    strip_b: tuple[str, ...] = ()
    """prefixes dropped from B's module names before matching (a wrapper A does not have)."""
    description: str = ""
    path: str = ""
    name: str = ""

    @classmethod
    def load(cls, name_or_path: str, variables: dict[str, str] | None = None) -> RenameRules:
        """The ``modules`` section of a built-in pair (by name) or a file."""
        return parse(load(name_or_path, variables))

    @classmethod
    def from_text(cls, text: str, path: str = "<mapping>", variables: dict[str, str] | None = None) -> RenameRules:
        return parse(from_text(text, path, "", variables))


def parse(pair: PairFile) -> RenameRules:
    """The ``modules`` section of ``pair`` (a newer or an older file)."""
    path = pair.path
    section = pair.section("modules")
    if section is None:
        raise MappingError(f"{path}: no 'modules:' section, so it cannot line up captures (it maps checkpoint "
                           "tensors only); add one (docs/mapping.md), or write one with tensordiff map A.h5 B.h5")
    side_a, side_b = pair.sides
    legacy = pair.legacy
    unknown = set(map(str, section)) - (_SECTION_KEYS if not legacy else {"rules", "order_fallback", "ignore_a",
                                                                           "ignore_b", "strip_b"})
    if unknown:
        raise MappingError(f"{path}: modules: unknown key(s) {', '.join(sorted(unknown))}; the keys are "
                           f"{', '.join(sorted(_SECTION_KEYS))} (docs/mapping.md)")

    def pattern(text: Any, where: str) -> BoundedPattern:
        source = pair.subst(text, where)
        return compile_user(source if legacy else regex(source), f"{path}: {where}")

    def ops(items: Any, where: str) -> tuple[Op, ...]:
        if items is None:
            return ()
        if isinstance(items, str):
            items = [items]
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise MappingError(f"{path}: {where}: transforms are a name or a list of names, e.g. [swap01] or "
                               f"['qkv_grouped(heads=4, dim=0)'] (got {items!r})")
        return tuple(parse_op(pair.subst(i, where), f"{path}: {where}") for i in items)

    def table(raw: dict, key: str, where: str) -> dict:
        value = raw.get(key) or {}
        if not isinstance(value, dict):
            example = "{hidden_states: '0'}" if key == "slots" else "{weight: [transpose]}"
            raise MappingError(f"{path}: {where}: '{key}:' maps names to {'names' if key == 'slots' else 'transforms'}, "
                               f"e.g. {key}: {example} (got {value!r})")
        if key == "slots" and not all(isinstance(v, (str, int)) for v in value.values()):
            raise MappingError(f"{path}: {where}: 'slots:' maps B's slot names to A's, as text (got {value!r})")
        return value

    def ignores(items: Any, where: str) -> list[Ignore]:
        if items is not None and not isinstance(items, list):
            raise MappingError(f"{path}: {where}: must be a list of module names or {{module: NAME, kinds: [...]}}")
        out = []
        for item in items or []:
            spec = item if isinstance(item, dict) else {"module": item}
            names = spec.get("module")
            names = names if isinstance(names, list) and not legacy else [names]
            if not names or not all(isinstance(n, str) for n in names):
                what = "regex" if legacy else "name"
                raise MappingError(f"{path}: {where}: an entry is a module {what} (text) or {{module: {what.upper()}, "
                                   f"kinds: [...], slots: [...]}}, got {item!r}")
            kinds, slots = spec.get("kinds"), spec.get("slots")
            for key, value in (("kinds", kinds), ("slots", slots)):
                if value is not None and not (isinstance(value, list) and all(isinstance(x, (str, int)) for x in value)):
                    raise MappingError(f"{path}: {where}: '{key}:' must be a list, e.g. {key}: [output, grad_output] "
                                       f"(got {value!r})")
            for n in names:
                out.append(Ignore(pattern(n, where), frozenset(kinds) if kinds is not None else None,
                                  frozenset(str(x) for x in slots) if slots is not None else None))
        return out

    if legacy:
        key_a, key_b, key_split = "a", "b", "join"
        ignore = {"a": section.get("ignore_a"), "b": section.get("ignore_b")}
        strip = section.get("strip_b") or []
    else:
        key_a, key_b, key_split = side_a, side_b, "split"
        ignore = section.get("ignore") or {}
        if not isinstance(ignore, dict) or set(map(str, ignore)) - {side_a, side_b}:
            raise MappingError(f"{path}: modules: ignore: maps each side ({side_a}, {side_b}) to a list of names; "
                               f"got {ignore!r}")
        raw_strip = section.get("strip") or {}
        if not isinstance(raw_strip, dict) or set(map(str, raw_strip)) - {side_b}:
            raise MappingError(f"{path}: modules: strip: maps {side_b} (the side renamed) to a list of prefixes; "
                               f"got {raw_strip!r}")
        strip = raw_strip.get(side_b) or []
        ignore = {"a": ignore.get(side_a), "b": ignore.get(side_b)}
    rules = []
    raw_rules = section.get("rules") or []
    if not isinstance(raw_rules, list):
        raise MappingError(f"{path}: modules: rules: must be a list of rules ({side_b}: NAME, {side_a}: NAME)")
    for i, raw in enumerate(raw_rules):
        where = f"rule {i + 1}"
        if not isinstance(raw, dict) or key_a not in raw or key_b not in raw:
            raise MappingError(f"{path}: {where} needs both '{key_a}:' (A's module name) and '{key_b}:' (B's)")
        if not legacy:
            extra = set(map(str, raw)) - _RULE_KEYS - {side_a, side_b}
            if extra:
                raise MappingError(f"{path}: {where}: unknown key(s) {', '.join(sorted(extra))}; a rule has "
                                   f"{side_a}, {side_b}, {', '.join(sorted(_RULE_KEYS))}")
        if not pair.holds(raw.get("when"), f"{path}: {where}"):
            continue
        sources = raw[key_b] if isinstance(raw[key_b], list) else [raw[key_b]]
        if not isinstance(raw[key_a], str) or not all(isinstance(x, str) for x in sources):
            raise MappingError(f"{path}: {where}: '{key_a}:' must be a module name and '{key_b}:' a "
                               f"{'regex' if legacy else 'name'} or a list of them, as text (got {raw[key_a]!r}, "
                               f"{raw[key_b]!r}); quote them")
        if not sources:
            raise MappingError(f"{path}: {where}: '{key_b}:' is an empty list; give a name, or a list of them with "
                               f"'{key_split}:'")
        for key in ("kinds", "phases", "only_slots"):
            value = raw.get(key)
            if value is not None and not (isinstance(value, list) and all(isinstance(x, (str, int)) for x in value)):
                raise MappingError(f"{path}: {where}: '{key}:' must be a list, e.g. {key}: [output, grad_output] "
                                   f"(got {value!r})")
        compiled = tuple(pattern(s, where) for s in sources)
        target = pair.subst(raw[key_a], where)
        if not legacy:
            target = template(target, pair.subst(sources[0], where), f"{path}: {where}")
        if raw.get(key_split) is not None and not isinstance(raw[key_split], str):
            raise MappingError(f"{path}: {where}: '{key_split}:' is one split as text, e.g. {key_split}: 'chunk(n=2)' "
                               f"(got {raw[key_split]!r})")
        join = pair.subst(raw[key_split], where) if raw.get(key_split) is not None else ""
        if len(compiled) > 1 and not join:
            raise MappingError(f"{path}: {where}: '{key_b}:' lists {len(compiled)} modules; say how they join into A's "
                               f"one with '{key_split}:', e.g. {key_split}: 'qkv_groups(heads=32, groups=8)' or "
                               f"{key_split}: 'chunk(n=2)'")
        if join and len(compiled) < 2:
            raise MappingError(f"{path}: {where}: '{key_split}:' needs '{key_b}:' to list the modules joined, in order")
        phases = raw.get("phases")
        if phases is not None:
            unknown_phases = set(phases) - set(PHASES)
            if unknown_phases:
                raise MappingError(f"{path}: {where}: unknown phase(s) {sorted(unknown_phases)}; phases are "
                                   f"{', '.join(PHASES)}")
        experts, fan = 0, {}
        if raw.get("experts") is not None:
            spec = raw["experts"]
            if not (isinstance(spec, dict) and isinstance(spec.get("count"), int) and isinstance(spec.get("slots"), dict)):
                raise MappingError(f"{path}: {where}: 'experts:' is {{count: N, slots: {{B_SLOT: {{{side_a}: NAME with "
                                   f"{{e}}, slot: A_SLOT, ops: [...]}}}}}} (got {spec!r})")
            experts = spec["count"]
            for b_slot, one in spec["slots"].items():
                if not (isinstance(one, dict) and isinstance(one.get(key_a), str)):
                    raise MappingError(f"{path}: {where}: experts: slots: {b_slot}: needs '{key_a}:' (A's module, "
                                       "with {e} for the expert)")
                fan_name = template(pair.subst(one[key_a], where).replace("{e}", "\x00"), pair.subst(sources[0], where),
                                    f"{path}: {where}").replace("\x00", "{e}")
                fan[str(b_slot)] = (fan_name, str(one.get("slot", b_slot)), ops(one.get("ops"), f"{where}: experts"))
        rule = Rule(
            experts=experts, fan=fan,
            b=compiled[0], a=target,
            phases=frozenset(phases) if phases is not None else None,
            kinds=frozenset(raw["kinds"]) if raw.get("kinds") is not None else None,
            slots={str(k): str(v) for k, v in table(raw, "slots", where).items()},
            only_slots=frozenset(str(x) for x in raw["only_slots"]) if raw.get("only_slots") is not None else None,
            inputs=ops(raw.get("inputs", raw.get("activations")), where),
            outputs=ops(raw.get("outputs", raw.get("activations")), where),
            params={str(k): ops(v, f"{where}: params: {k}") for k, v in table(raw, "params", where).items()},
            parts=compiled if join else (), join=join)
        if join:
            for kind in ("param", "output"):
                try:
                    rule.split_for(kind)
                except MappingError as err:
                    raise MappingError(f"{path}: {where}: {err}") from None
        rules.append(rule)
    order_fallback = section.get("order_fallback", True)
    if not isinstance(order_fallback, bool):  # 'no' or 0 must not read as true
        raise MappingError(f"{path}: order_fallback must be true or false, unquoted (got {order_fallback!r})")
    if not isinstance(strip, list) or not all(isinstance(p, str) for p in strip):
        raise MappingError(f"{path}: the prefixes to strip are a list of text, e.g. ['model.'] (got {strip!r})")
    where_a, where_b = ("ignore_a", "ignore_b") if legacy else (f"ignore: {side_a}", f"ignore: {side_b}")
    return RenameRules(rules=rules, order_fallback=order_fallback, ignore_a=ignores(ignore["a"], where_a),
                       ignore_b=ignores(ignore["b"], where_b), strip_b=tuple(strip),
                       description=pair.description, path=path, name=pair.name)

