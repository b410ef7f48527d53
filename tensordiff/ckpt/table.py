"""Checkpoint conversion between frameworks, driven by declarative mapping tables.

A checkpoint here is ``dict[str, np.ndarray]`` (BF16/FP8 as ``ml_dtypes`` arrays, never
upcast); reading and writing files is ``files``' job, so this module needs neither torch
nor MindSpore. A table (YAML, ``mappings/ckpt/*.yaml`` or a user file, see
docs/checkpoints.md) lists, per tensor, its name on two sides (``mcore`` and e.g.
``mindformers``), its symbolic shape and how the layout changes:

* 1:1 rename, optionally with a transform per direction (``to_mindformers: interleave(dim=0)``,
  ``to_mcore: deinterleave(dim=0)``; the transforms of ``tensordiff.transforms``);
* 1:N split / N:1 join (``split: qkv_groups(heads=${heads}, groups=${groups})``): one tensor
  on one side is several on the other.

Both directions come from the same table. Every conversion is a pure permutation of
elements, so A -> B -> A gives back the same bytes. Conversion first checks every key and
shape of the source and raises one ``CheckpointError`` that lists all problems at once.
"""

from __future__ import annotations

import itertools
import os
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .. import dtypes
from .._text import bracket_shapes
from ..errors import CheckpointError, MappingError, TensordiffError
from ..mapping import PairFile
from ..mapping import load as load_pair
from ..mapping.names import VAR, regex
from ..transforms import Op, apply, contiguous, parse_op, parse_split
from .plan import Checkpoint, Conversion, Instance, Plan, check_shapes
from .schema import ENTRY_FIELDS, PLACEHOLDER, Dim, Entry, Var, name_regex, parse_shape, value_text


@dataclass
class ConversionTable:
    """A checkpoint mapping table with its variables bound (``Table.load``)."""

    name: str
    path: str
    description: str
    sides: tuple[str, str]
    formats: dict[str, tuple[str, ...]]
    variables: dict[str, Var]
    values: dict[str, str]
    """the variables' values in force (defaults and --var)."""
    ignore: dict[str, tuple[str, ...]]
    entries: list[Entry]
    indices: dict[str, str]
    example: str = ""
    missing_vars: tuple[str, ...] = ()
    """variables the active entries use but nobody set (only when loaded with ``lenient=True``)."""
    _pair: PairFile | None = field(default=None, repr=False)
    _ignore_rx: dict[str, tuple[re.Pattern, ...]] = field(default_factory=dict, repr=False)

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, name_or_path: str, variables: dict[str, str] | None = None, lenient: bool = False) -> ConversionTable:
        """The ``tensors`` section of a built-in pair (by name) or a file. ``lenient``: do not fail on unset
        variables (names only)."""
        return cls.from_pair(load_pair(name_or_path, variables), lenient)

    @classmethod
    def from_pair(cls, pair: PairFile, lenient: bool = False) -> ConversionTable:
        section = pair.section("tensors")
        path = pair.path
        if section is None:
            raise MappingError(f"{path}: no 'tensors:' section, so it cannot convert checkpoints (it lines up "
                               "captures only); add one (docs/mapping.md)")
        if "entries" not in section:
            raise MappingError(f"{path}: tensors: needs an 'entries:' list (see docs/mapping.md)")
        _check_section(section, path, pair.sides)
        table = cls(name=pair.name, path=path, description=pair.description, sides=pair.sides,
                    formats={s: tuple(str(x) for x in (section.get("formats") or {}).get(s) or ()) for s in pair.sides},
                    variables=dict(pair.variables), values=dict(pair.values),
                    ignore={s: tuple(str(x) for x in (section.get("ignore") or {}).get(s) or ()) for s in pair.sides},
                    entries=[], indices=dict(pair.indices), example=pair.example, _pair=pair)
        table._ignore_rx = {s: tuple(re.compile(regex(p, numbers=False)) for p in table.ignore[s]) for s in pair.sides}
        table._bind(lenient)
        return table

    def _bind(self, lenient: bool) -> None:
        for vname, var in self.variables.items():
            if var.choices and vname in self.values and self.values[vname] not in var.choices:
                raise MappingError(f"{self.path}: --var {vname}={self.values[vname]} is not one of {', '.join(var.choices)}"
                                   + (f" ({var.help})" if var.help else ""))
        assert self._pair is not None  # tables are made by from_pair
        raw_entries = (self._pair.section("tensors") or {}).get("entries") or []
        if not isinstance(raw_entries, list):
            raise MappingError(f"{self.path}: entries: must be a list")
        missing: list[str] = []
        for n, raw in enumerate(raw_entries):
            entry = self._entry(raw, f"{self.path}: entry {n + 1}", missing)
            if entry is not None:
                self.entries.append(entry)
        symbols = {name for e in self.entries for dims in e.shapes.values() for d in dims or () for name in d.names}
        known = set(self.variables) | set(self.indices.values()) | symbols
        unknown = sorted(set(self.values) - known)
        if unknown and not lenient:
            raise MappingError(f"{self.name}: unknown --var {', '.join(unknown)}; this table knows "
                               f"{', '.join(sorted(known)) or 'no variables'}")
        for placeholder in {p for e in self.entries for p in e.placeholders}:
            self.indices.setdefault(placeholder, f"num_{placeholder}")
        self.missing_vars = tuple(dict.fromkeys(missing))
        if missing and not lenient:
            raise MappingError(self.missing_vars_message())
        produced: dict[tuple[str, str], str] = {}
        for entry in self.entries:
            for side in self.sides:
                for nm in entry.names[side]:
                    key = (side, PLACEHOLDER.sub("{}", nm))
                    if key in produced and produced[key] != entry.where:
                        raise MappingError(f"{entry.where}: {side} name {nm!r} is also in {produced[key]}; each name "
                                           "may appear once per side (use when: to choose between variants)")
                    produced[key] = entry.where

    def _entry(self, raw: Any, where: str, missing: list[str]) -> Entry | None:
        """One entry of the YAML, with variables substituted; ``None`` when its ``when:`` does not hold."""
        a, b = self.sides
        if not isinstance(raw, dict):
            raise MappingError(f"{where}: must be a mapping with keys {a}: and {b}:")
        allowed = ENTRY_FIELDS | {a, b, f"to_{a}", f"to_{b}"}
        unknown = set(raw) - allowed
        if unknown:
            raise MappingError(f"{where}: unknown field(s) {', '.join(sorted(map(str, unknown)))}; "
                               f"fields are {', '.join(sorted(allowed))}")
        if not isinstance(raw.get("optional", False), bool):
            raise MappingError(f"{where}: optional: must be true or false, got {raw['optional']!r}")
        assert self._pair is not None
        pair = self._pair
        when = raw.get("when") or {}
        if not pair.holds(when, where):
            return None
        unset: list[str] = []

        def subst(text: Any) -> str:
            return pair.subst(text, where, unset)

        names: dict[str, tuple[str, ...]] = {}
        for side in self.sides:
            items = raw.get(side)
            items = items if isinstance(items, list) else [items]
            if not items or not all(isinstance(x, str) for x in items):
                raise MappingError(f"{where}: '{side}:' must be a name or a list of names")
            names[side] = tuple(subst(x) for x in items)
        placeholders = {side: sorted({p for nm in names[side] for p in PLACEHOLDER.findall(nm)}) for side in self.sides}
        if placeholders[a] != placeholders[b]:
            raise MappingError(f"{where}: both sides must use the same placeholders, got {placeholders}")
        multi = [s for s in self.sides if len(names[s]) > 1]
        split, joined = None, None
        if len(multi) == 2:
            raise MappingError(f"{where}: only one side may list several names (a 1:N split)")
        if multi:
            if "split" not in raw:
                raise MappingError(f"{where}: '{multi[0]}:' lists {len(names[multi[0]])} names, so the entry needs "
                                   "split: (e.g. split: 'chunk(n=2, dim=0)')")
            if f"to_{a}" in raw or f"to_{b}" in raw:
                raise MappingError(f"{where}: a split entry takes no to_<side>: transforms")
            joined = self.other(multi[0])
            if not isinstance(raw["split"], str):
                raise MappingError(f"{where}: 'split:' is one split as text, e.g. split: 'chunk(n=2, dim=0)' "
                                   f"(got {raw['split']!r})")
            text = subst(raw["split"])
            split = None if unset else parse_split(text, where)
        elif "split" in raw:
            raise MappingError(f"{where}: split: needs a list of names on one side")
        if bool(raw.get(f"to_{a}")) != bool(raw.get(f"to_{b}")):
            raise MappingError(f"{where}: give both to_{a}: and to_{b}: (both directions come from this table), or neither")
        ops: dict[str, tuple[Op, ...]] = {}
        for side in self.sides:
            items = raw.get(f"to_{side}") or []
            items = [items] if isinstance(items, str) else items
            if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
                raise MappingError(f"{where}: 'to_{side}:' is a transform or a list of them, e.g. "
                                   f"to_{side}: ['interleave(dim=0)'] (got {items!r})")
            texts = [subst(i) for i in items]
            ops[side] = () if unset else tuple(parse_op(t, where) for t in texts)
        shapes: dict[str, tuple[Dim, ...] | None] = dict.fromkeys(self.sides)
        raw_shape = raw.get("shape")
        if isinstance(raw_shape, dict):
            for side, spec in raw_shape.items():
                if side not in self.sides:
                    raise MappingError(f"{where}: shape: names unknown side {side!r}")
                shapes[side] = parse_shape(spec, where)
        elif raw_shape is not None:
            parsed = parse_shape(raw_shape, where)
            shapes = {s: parsed if joined is None or s == joined else None for s in self.sides}
        missing += unset
        entry = Entry(names=names, placeholders=tuple(placeholders[a]), shapes=shapes, ops=ops, split=split,
                      joined=joined, optional=bool(raw.get("optional", False)), where=where,
                      when={str(k): value_text(v) for k, v in when.items()})
        entry.regex = {s: tuple(name_regex(nm) for nm in names[s]) for s in self.sides}
        return entry

    def alternatives(self) -> Iterator[tuple[str, ConversionTable]]:
        """This table with one variable set to another of its choices: (the --var that does it, the table)."""
        for vname, var in self.variables.items():
            for choice in var.choices:
                if choice == self.values.get(vname):
                    continue
                try:
                    assert self._pair is not None
                    alt = ConversionTable.from_pair(self._pair.with_values({**self.values, vname: choice}),
                                                    lenient=True)
                except TensordiffError:
                    continue
                if not alt.missing_vars:
                    yield f"pass --var {vname}={choice}" + (f" ({var.help})" if var.help else ""), alt

    def missing_vars_message(self) -> str:
        parts = []
        for vname in self.missing_vars:
            var = self.variables.get(vname)
            parts.append(f"--var {vname}=N" + (f" ({var.help})" if var and var.help else ""))
        example = f"; example: {self.example}" if self.example else ""
        return f"mapping {self.name} needs {' and '.join(parts)}{example}"

    def describe(self) -> str:
        """'mcore-mindformers (fc1_layout=interleaved, heads=4)': the variables this section uses (not only the
        captures'), and every value the caller gave."""
        section = (self._pair.section("tensors") if self._pair else None) or {}
        used = set(VAR.findall(str(section))) | {str(k) for e in section.get("entries") or [] if isinstance(e, dict)
                                                 for k in (e.get("when") or {})}
        given = self._pair.given if self._pair else {}
        shown = [f"{k}={v}" for k, v in self.values.items() if (k in self.variables and k in used) or k in given]
        return self.name + (f" ({', '.join(shown)})" if shown else "")

    def other(self, side: str) -> str:
        return self.sides[1] if side == self.sides[0] else self.sides[0]

    # ------------------------------------------------------------------ matching
    def ignored(self, key: str, side: str) -> bool:
        return any(rx.fullmatch(key) for rx in self._ignore_rx[side])

    def match(self, key: str, side: str) -> tuple[Entry, int, dict[str, int]] | None:
        """The entry (and part, and placeholder values) whose ``side`` name is ``key``."""
        for entry in self.entries:
            for part, rx in enumerate(entry.regex[side]):
                m = rx.fullmatch(key)
                if m:
                    return entry, part, {k: int(v) for k, v in m.groupdict().items()}
        return None

    def coverage(self, keys: Iterable[str], side: str) -> tuple[int, int]:
        """(keys that fit ``side``'s names, keys not ignored on ``side``)."""
        hit = total = 0
        for key in keys:
            if self.ignored(key, side):
                continue
            total += 1
            hit += self.match(key, side) is not None
        return hit, total

    def detect_side(self, keys: Iterable[str], path: str = "", other_path: str = "") -> tuple[str | None, str]:
        """Which side ``keys`` (a file at ``path``) belong to, and why; ``None`` when it cannot be told."""
        keys = list(keys)
        scores = {s: self.coverage(keys, s)[0] for s in self.sides}
        a, b = self.sides
        if scores[a] != scores[b]:
            best = a if scores[a] > scores[b] else b
            return (best, f"its names fit side {best}") if scores[best] else (None, "none of its names fit either side")
        if scores[a] == 0:
            return None, "none of its names fit either side"
        suffix = os.path.splitext(path)[1].lower()
        for side in self.sides:
            if suffix and suffix in self.formats[side]:
                return side, f"the names fit both sides; {suffix} files are {side}"
        other = os.path.splitext(other_path)[1].lower()
        for side in self.sides:
            if other and other in self.formats[side]:
                return self.other(side), f"the names fit both sides; the other file ({other}) is {side}"
        return None, "the names fit both sides of the table"

    # ------------------------------------------------------------------ planning
    def plan(self, meta: dict[str, tuple[tuple[int, ...], str]], source: str, path: str = "checkpoint") -> Plan:
        """Check every key and shape of a ``source``-side checkpoint (``meta``: key -> (shape, dtype name))."""
        if source not in self.sides:
            raise MappingError(f"{self.name}: unknown side {source!r}; sides are {', '.join(self.sides)}")
        target = self.other(source)
        plan = Plan(table=self, source=source, target=target, path=path, meta=meta)
        found: dict[int, dict[tuple, set[int]]] = {}  # entry id -> index tuple -> parts present
        seen_index: dict[str, set[int]] = {}
        fixed = {p: int(self.values[v]) for p, v in self.indices.items() if v in self.values and self.values[v].isdigit()}
        for key in meta:
            if self.ignored(key, source):
                plan.ignored.append(key)
                continue
            hit = self.match(key, source)
            if hit is None:
                plan.unexpected.append(key)
                continue
            entry, part, index = hit
            if any(p in fixed and v >= fixed[p] for p, v in index.items()):
                plan.unexpected.append(key)
                continue
            for p, v in index.items():
                seen_index.setdefault(p, set()).add(v)
            found.setdefault(id(entry), {}).setdefault(tuple(index[p] for p in entry.placeholders), set()).add(part)
        counts = {p: fixed.get(p, max(seen_index.get(p, {-1})) + 1) for p in self.indices}
        plan.counts = {self.indices[p]: n for p, n in counts.items() if p in seen_index or p in fixed}
        candidates: list[Instance] = []
        for entry in self.entries:
            present = found.get(id(entry), {})
            for combo in itertools.product(*(range(counts.get(p, 0)) for p in entry.placeholders)):
                index = dict(zip(entry.placeholders, combo))
                src = entry.concrete(source, index)
                have = present.get(combo, set())
                if not have and entry.optional:
                    continue
                if len(have) < len(src):
                    plan.missing += [k for k in src if k not in meta]
                    continue
                candidates.append(Instance(entry, index, src, entry.concrete(target, index)))
        check_shapes(plan, candidates, meta, {k: int(v) for k, v in self.values.items() if v.lstrip("-").isdigit()})
        return plan

    def convert(self, tensors: Checkpoint, source: str | None = None, target: str | None = None,
                path: str = "checkpoint", strict: bool = True) -> Conversion:
        """Convert a checkpoint to the other side. ``strict``: raise one ``CheckpointError`` on any problem."""
        if source is None:
            source = self.other(target) if target is not None else self.detect_side(tensors, path)[0]
            if source is None:
                raise CheckpointError(f"{path}: cannot tell which side of {self.name} it is ({', '.join(self.sides)}); "
                                      f"pass --to {self.sides[1]} or --to {self.sides[0]}")
        meta = {k: (tuple(v.shape), dtypes.name_of(v.dtype)) for k, v in tensors.items()}
        plan = self.plan(meta, source, path)
        if strict:
            plan.raise_if_bad()
        out: Checkpoint = {}
        origin: dict[str, tuple[str, ...]] = {}
        applied: Counter = Counter()
        for inst in plan.instances:
            entry = inst.entry
            try:
                if entry.split is None:
                    results = [contiguous(apply(entry.ops[plan.target], tensors[inst.src[0]]))]
                    for op in entry.ops[plan.target]:
                        applied[(str(op), entry.pattern(plan.target))] += 1
                elif entry.joined == plan.source:
                    results = entry.split.split(tensors[inst.src[0]])
                    applied[(f"split {entry.split}", entry.pattern(plan.source))] += 1
                else:
                    results = [entry.split.join([tensors[k] for k in inst.src])]
                    applied[(f"join {entry.split}", entry.pattern(plan.target))] += 1
            except ValueError as err:  # a table without shape: lines lets a bad shape through to here
                shapes = bracket_shapes(tensors[k].shape for k in inst.src)
                raise CheckpointError(f"{path}: cannot convert {' + '.join(inst.src)} {shapes} "
                                      f"({entry.where}): {err}; add shape: to the entry or check the --var values") from None
            for key, value in zip(inst.dst, results):
                out[key] = value
                origin[key] = inst.src
        return Conversion(tensors=out, plan=plan, origin=origin, applied=applied)


def _check_section(section: dict, path: str, sides: tuple[str, str]) -> None:
    """The types of the ``tensors`` section's keys besides its entries: one error naming the key, never a crash or a
    silent skip."""
    def fail(key: str, expected: str, got: Any) -> MappingError:
        return MappingError(f"{path}: tensors: {key}: expected {expected}, got {got!r}; see docs/mapping.md")

    unknown = set(map(str, section)) - {"formats", "ignore", "entries"}
    if unknown:
        raise MappingError(f"{path}: tensors: unknown key(s) {', '.join(sorted(unknown))}; the keys are entries, "
                           "formats and ignore (docs/mapping.md)")
    for key in ("formats", "ignore"):
        value = section.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise fail(key, f"a mapping of each side ({', '.join(sides)}) to a list of text", value)
        for side, items in value.items():
            if side not in sides:
                raise fail(key, f"sides named in 'sides:' ({', '.join(sides)})", side)
            if items is not None and not (isinstance(items, list) and all(isinstance(x, str) for x in items)):
                raise fail(f"{key}: {side}", "a list of text", items)
