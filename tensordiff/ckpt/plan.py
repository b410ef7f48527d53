"""What a conversion would do, checked before it does anything: every key, every shape, all problems at once."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .._text import bracket_shape, bracket_shapes, listing
from ..errors import CheckpointError, TensordiffError
from ..mapping import builtin_with
from .schema import Dim, Entry

Checkpoint = dict[str, np.ndarray]


class TableLike(Protocol):
    """What a plan needs of its table (``table.ConversionTable``)."""

    name: str
    path: str

    def describe(self) -> str: ...

    def alternatives(self) -> Iterator[tuple[str, Any]]: ...


@dataclass
class Instance:
    entry: Entry
    index: dict[str, int]
    src: tuple[str, ...]
    dst: tuple[str, ...]


@dataclass
class Plan:
    """What converting one checkpoint would do, and everything wrong with it."""

    table: TableLike
    source: str
    target: str
    path: str
    instances: list[Instance] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    misshaped: list[tuple[str, str]] = field(default_factory=list)
    """(key, explanation)."""
    ignored: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    """inferred index ranges, e.g. {'num_layers': 32}."""
    symbols: dict[str, int] = field(default_factory=dict)
    """the shape symbols' values (given with --var, or the majority of the tensors)."""
    meta: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict, repr=False)
    """the source checkpoint: key -> (shape, dtype name)."""

    @property
    def problems(self) -> int:
        return len(self.missing) + len(self.unexpected) + len(self.misshaped)

    def raise_if_bad(self) -> None:
        if self.problems:
            raise CheckpointError(self.message())

    def message(self) -> str:
        counts = [f"{len(v)} {k}" for k, v in (("missing", self.missing), ("unexpected", self.unexpected),
                                                 ("mis-shaped", self.misshaped)) if v]
        parts = [f"{self.path}: does not fit side '{self.source}' of mapping {self.table.describe()}: {', '.join(counts)}"]
        if self.missing:
            parts.append(f"missing ({len(self.missing)}): {listing(self.missing)}")
        if self.unexpected:
            parts.append(f"unexpected ({len(self.unexpected)}): {listing(self.unexpected)}")
        if self.misshaped:
            parts.append(f"mis-shaped ({len(self.misshaped)}): {listing((d for _, d in self.misshaped), sep='; ')}")
        parts.append("fix: " + self.fix())
        return ". ".join(parts)

    def fix(self) -> str:
        hints = []
        table = self.table
        for hint, alt in table.alternatives():
            try:
                if alt.plan(self.meta, self.source, self.path).problems < self.problems:
                    hints.append(hint)
            except TensordiffError:
                continue
        matched = len(self.instances)
        if self.unexpected and len(self.unexpected) > matched:
            others = [n for n in builtin_with("tensors") if n != table.name]
            hints.append(f"check that this is a {self.source} checkpoint for {table.name}"
                         + (f" (other tables: {', '.join(others)})" if others else "")
                         + f", or pass --to {self.source} if the direction was guessed wrong")
        if self.missing or self.unexpected:
            hints.append(f"fix the checkpoint, or copy the table ({table.path}) and add these names to its entries "
                         "(or its ignore: patterns if they are optional), then pass --mapping your.yaml")
        elif self.misshaped:
            hints.append("check the model config (--var values) and that both files come from the same model")
        return "; ".join(hints)


@dataclass
class Conversion:
    tensors: Checkpoint
    plan: Plan
    origin: dict[str, tuple[str, ...]]
    """target key -> the source keys it was made from."""
    applied: Counter
    """(transform, name pattern) -> how many tensors."""




def check_shapes(plan: Plan, candidates: list[Instance], meta: dict, env: dict[str, int]) -> None:
    """Check each candidate's shapes against its entry (symbols bound by majority vote); keep the good ones."""
    env = dict(env)
    checks: list[tuple[Instance, tuple[int, ...], tuple[Dim, ...]]] = []
    for inst in candidates:
        entry, source = inst.entry, plan.source
        part_shapes = [tuple(meta[k][0]) for k in inst.src]
        kinds = {meta[k][1] for k in inst.src}
        if len(kinds) > 1:
            plan.misshaped.append((inst.src[0], f"{' + '.join(inst.src)} have different dtypes {sorted(kinds)}"))
            continue
        try:
            if entry.split is None:
                shape, dims = part_shapes[0], entry.shapes[source]
            elif entry.joined == source:
                shape, dims = part_shapes[0], entry.shapes[source]
                entry.split.parts_shapes(shape)
            else:
                shape, dims = entry.split.joined_shape(part_shapes), entry.shapes[entry.joined or source]
        except ValueError as err:
            plan.misshaped.append((inst.src[0], f"{' + '.join(inst.src)} {bracket_shapes(part_shapes)}: {err}"))
            continue
        plan.instances.append(inst)
        if dims is not None:
            checks.append((inst, shape, dims))
    # bind the shape symbols by majority vote (a lone odd tensor is the one reported), then check
    # (a bare name such as 'ffn' outvotes an expression such as '2*ffn')
    changed = True
    while changed:
        votes: dict[str, tuple[Counter, Counter]] = {}
        for _, shape, dims in checks:
            if len(shape) != len(dims):
                continue
            for actual, dim in zip(shape, dims):
                solved = dim.solve(actual, env)
                if solved:
                    votes.setdefault(solved[0], (Counter(), Counter()))[dim.text != solved[0]][solved[1]] += 1
        changed = bool(votes)
        for name, (bare, derived) in votes.items():
            env[name] = (bare or derived).most_common(1)[0][0]
    plan.symbols = env
    bad: set[int] = set()
    # the same entry has the same shape at every index (layer): the odd ones out are reported
    by_entry: dict[int, list[tuple[Instance, tuple[tuple[int, ...], ...]]]] = {}
    for inst in plan.instances:
        by_entry.setdefault(id(inst.entry), []).append((inst, tuple(tuple(meta[k][0]) for k in inst.src)))
    for group in by_entry.values():
        common = Counter(shapes for _, shapes in group).most_common(1)[0][0]
        for inst, shapes in group:
            if shapes != common:
                plan.misshaped.append((inst.src[0], f"{' + '.join(inst.src)} is {bracket_shapes(shapes)}, but "
                                       f"{bracket_shapes(common)} at the other indices"))
                bad.add(id(inst))
    for inst, shape, dims in checks:
        if id(inst) in bad:
            continue
        expected = [d.value(env) for d in dims]
        if len(shape) != len(dims) or any(e is not None and e != a for e, a in zip(expected, shape)):
            want = "[" + ", ".join("?" if e is None else str(e) for e in expected) + "]"
            names = "[" + ", ".join(d.text for d in dims) + "]"
            what = " + ".join(inst.src) if len(inst.src) > 1 else inst.src[0]
            shown = bracket_shape(shape) + (" joined" if len(inst.src) > 1 else "")
            plan.misshaped.append((inst.src[0], f"{what} is {shown}, expected {want} = {names}"))
            bad.add(id(inst))
    order = {k: n for n, k in enumerate(meta)}
    plan.instances = sorted((i for i in plan.instances if id(i) not in bad), key=lambda i: min(order[k] for k in i.src))

