"""Checkpoint conversion between frameworks, driven by declarative mapping tables.

A checkpoint here is ``dict[str, np.ndarray]`` (BF16/FP8 as ``ml_dtypes`` arrays, never
upcast); reading and writing files is ``ckpt_io``'s job, so this module needs neither torch
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

import ast
import fnmatch
import itertools
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

from . import dtypes
from ._yaml import load_yaml
from .compare import Metrics, compare_arrays
from .errors import MappingError, TensordiffError
from .tolerance import Tolerances
from .transforms import Op, apply, parse_op

TABLE_VERSION = 1
#: Keys named per category in an error message before "... and N more".
SHOWN = 10
#: Placeholders (``{i}`` in names) and the variable that holds how many values they take.
DEFAULT_INDICES = {"i": "num_layers"}
TABLE_DIR = os.path.join(os.path.dirname(__file__), "mappings", "ckpt")

Checkpoint = dict[str, np.ndarray]


class CheckpointError(TensordiffError):
    """A checkpoint is missing or unreadable, or does not fit its mapping table (all problems in one message)."""


def builtin_tables() -> dict[str, str]:
    """Tables shipped with tensordiff: name -> file."""
    if not os.path.isdir(TABLE_DIR):
        return {}
    return {f[:-5]: os.path.join(TABLE_DIR, f) for f in sorted(os.listdir(TABLE_DIR)) if f.endswith(".yaml")}


def listing(items: Iterable[str], limit: int = SHOWN, sep: str = ", ") -> str:
    """'a, b, c ... and 7 more'."""
    items = list(items)
    text = sep.join(items[:limit])
    return text + (f" ... and {len(items) - limit} more" if len(items) > limit else "")


# ---------------------------------------------------------------------------------------- splits
_CALL = re.compile(r"^\s*([a-z_0-9]+)\s*(?:\((.*)\))?\s*$")


class _Split:
    """One tensor on the joined side <-> ``len(parts)`` tensors on the other side."""

    name = ""

    def __init__(self, dim: int = 0):
        self.dim = dim

    def parts_shapes(self, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
        raise NotImplementedError

    def joined_shape(self, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
        raise NotImplementedError

    def split(self, x: np.ndarray) -> list[np.ndarray]:
        raise NotImplementedError

    def join(self, parts: list[np.ndarray]) -> np.ndarray:
        raise NotImplementedError

    def _axis(self, shape: tuple[int, ...]) -> int:
        if not shape:
            raise ValueError(f"{self} cannot split a scalar")
        return self.dim % len(shape)

    def _same_rest(self, shapes: list[tuple[int, ...]], axis: int) -> None:
        rest = {s[:axis] + s[axis + 1:] for s in shapes}
        if len({len(s) for s in shapes}) != 1 or len(rest) != 1:
            raise ValueError(f"{self}: the parts' shapes {_shapes(shapes)} differ outside dim {self.dim}")


class QkvGroups(_Split):
    """Megatron's per-group ``linear_qkv`` rows ``[q heads of group g, k_g, v_g] for g`` <-> q, k, v."""

    name = "qkv_groups"

    def __init__(self, heads: int, groups: int, dim: int = 0):
        super().__init__(dim)
        if heads <= 0 or groups <= 0 or heads % groups:
            raise MappingError(f"qkv_groups(heads={heads}, groups={groups}): heads must be a positive multiple of groups; "
                               "check --var heads and --var groups")
        self.heads, self.groups, self.per = heads, groups, heads // groups

    def __str__(self) -> str:
        return f"qkv_groups(heads={self.heads}, groups={self.groups})"

    def _head_dim(self, rows: int) -> int:
        unit = self.heads + 2 * self.groups
        if rows % unit:
            raise ValueError(f"{rows} rows are not heads+2*groups = {self.heads}+2*{self.groups} = {unit} blocks of "
                             "head_dim; check --var heads and --var groups")
        return rows // unit

    def parts_shapes(self, shape):
        axis = self._axis(shape)
        hd = self._head_dim(shape[axis])
        return [shape[:axis] + (n * hd,) + shape[axis + 1:] for n in (self.heads, self.groups, self.groups)]

    def joined_shape(self, shapes):
        axis = self._axis(shapes[0])
        self._same_rest(shapes, axis)
        q, k, v = (s[axis] for s in shapes)
        hd = q // self.heads
        if q % self.heads or k != self.groups * hd or v != self.groups * hd:
            raise ValueError(f"q/k/v have {q}/{k}/{v} rows; with heads={self.heads}, groups={self.groups} they need "
                             f"heads*head_dim / groups*head_dim / groups*head_dim; check --var heads and --var groups")
        return shapes[0][:axis] + (q + k + v,) + shapes[0][axis + 1:]

    def split(self, x):
        y = np.moveaxis(x, self._axis(x.shape), 0)
        hd = self._head_dim(y.shape[0])
        blocks = y.reshape((self.groups, self.per + 2, hd) + y.shape[1:])
        q = blocks[:, :self.per].reshape((self.heads * hd,) + y.shape[1:])
        k = blocks[:, self.per].reshape((self.groups * hd,) + y.shape[1:])
        v = blocks[:, self.per + 1].reshape((self.groups * hd,) + y.shape[1:])
        return [_contiguous(np.moveaxis(p, 0, self._axis(x.shape))) for p in (q, k, v)]

    def join(self, parts):
        axis = self._axis(parts[0].shape)
        self.joined_shape([p.shape for p in parts])
        q, k, v = (np.moveaxis(p, axis, 0) for p in parts)
        hd = q.shape[0] // self.heads
        rest = q.shape[1:]
        blocks = np.concatenate([q.reshape((self.groups, self.per, hd) + rest), k.reshape((self.groups, 1, hd) + rest),
                                 v.reshape((self.groups, 1, hd) + rest)], axis=1)
        return _contiguous(np.moveaxis(blocks.reshape((-1,) + rest), 0, axis))


class Chunk(_Split):
    """``n`` equal blocks along ``dim``, e.g. Megatron's ``linear_fc1`` ``[gate; up]`` <-> w1 (gate), w3 (up)."""

    name = "chunk"

    def __init__(self, n: int = 2, dim: int = 0):
        super().__init__(dim)
        if n < 2:
            raise MappingError(f"chunk(n={n}): n must be at least 2")
        self.n = n

    def __str__(self) -> str:
        return f"chunk(n={self.n}, dim={self.dim})"

    def parts_shapes(self, shape):
        axis = self._axis(shape)
        if shape[axis] % self.n:
            raise ValueError(f"{shape[axis]} rows along dim {self.dim} do not split into {self.n} equal blocks")
        return [shape[:axis] + (shape[axis] // self.n,) + shape[axis + 1:]] * self.n

    def joined_shape(self, shapes):
        axis = self._axis(shapes[0])
        self._same_rest(shapes, axis)
        if len({s[axis] for s in shapes}) != 1:
            raise ValueError(f"{self}: the parts have different sizes {_shapes(shapes)}; they must be equal")
        return shapes[0][:axis] + (shapes[0][axis] * self.n,) + shapes[0][axis + 1:]

    def split(self, x):
        return [_contiguous(p) for p in np.split(x, self.n, axis=self._axis(x.shape))]

    def join(self, parts):
        self.joined_shape([p.shape for p in parts])
        return np.concatenate(parts, axis=self._axis(parts[0].shape))


SPLITS: dict[str, type[_Split]] = {"qkv_groups": QkvGroups, "chunk": Chunk}


def _parse_split(text: str, where: str) -> _Split:
    m = _CALL.match(str(text))
    if not m or m.group(1) not in SPLITS:
        raise MappingError(f"{where}: unknown split {text!r}; known: {', '.join(f'{k}(...)' for k in SPLITS)}")
    kwargs: dict[str, int] = {}
    for part in (m.group(2) or "").split(","):
        if not part.strip():
            continue
        key, eq, value = part.partition("=")
        try:
            kwargs[key.strip()] = int(value)
        except ValueError:
            raise MappingError(f"{where}: split {text!r}: expected name=integer, got {part.strip()!r}") from None
        if not eq:
            raise MappingError(f"{where}: split {text!r} needs keyword arguments (name=value)")
    try:
        return SPLITS[m.group(1)](**kwargs)
    except TypeError as err:
        raise MappingError(f"{where}: split {text!r}: {err}") from None


def _contiguous(x: np.ndarray) -> np.ndarray:
    return x if x.flags.c_contiguous else x.copy(order="C")


def _shapes(shapes: Iterable[tuple[int, ...]]) -> str:
    return ", ".join(_shape(s) for s in shapes)


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


# ------------------------------------------------------------------------------ symbolic shapes
_ALLOWED = (ast.Expression, ast.BinOp, ast.Add, ast.Sub, ast.Mult, ast.Constant, ast.Name, ast.Load)


class _Dim:
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
        return int(eval(self._code, {"__builtins__": {}}, dict(env)))  # noqa: S307 - validated AST of + - * only

    def solve(self, actual: int, env: dict[str, int]) -> tuple[str, int] | None:
        """The one unknown name's value if this dimension is linear in it (``2*ffn`` = 256 -> ffn = 128)."""
        unknown = self.names - env.keys()
        if len(unknown) != 1:
            return None
        name = next(iter(unknown))
        f0, f1, f2 = (int(eval(self._code, {"__builtins__": {}}, {**env, name: v})) for v in (0, 1, 2))  # noqa: S307
        slope = f1 - f0
        if slope <= 0 or f2 - f1 != slope or (actual - f0) % slope:
            return None
        value = (actual - f0) // slope
        return (name, value) if value > 0 else None


def _parse_shape(raw: Any, where: str) -> tuple[_Dim, ...]:
    if not isinstance(raw, list):
        raise MappingError(f"{where}: shape must be a list such as [vocab, hidden], got {raw!r}")
    return tuple(_Dim(d, where) for d in raw)


# ---------------------------------------------------------------------------------------- tables
_ENTRY_FIELDS = {"shape", "split", "optional", "when"}
_PLACEHOLDER = re.compile(r"\{(\w+)\}")
_VAR = re.compile(r"\$\{(\w+)\}")


@dataclass(frozen=True)
class Var:
    name: str
    default: str | None = None
    choices: tuple[str, ...] = ()
    help: str = ""


@dataclass
class Entry:
    """One line of a table: a tensor (or a group of tensors) on each side."""

    names: dict[str, tuple[str, ...]]
    """side -> name patterns (``{i}`` placeholders); one side has one name, the other one or more."""
    placeholders: tuple[str, ...]
    shapes: dict[str, tuple[_Dim, ...] | None]
    """side -> symbolic shape of the (joined) tensor on that side, if given."""
    ops: dict[str, tuple[Op, ...]]
    """side -> transforms applied when producing that side (1:1 entries)."""
    split: _Split | None
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
        return tuple(_PLACEHOLDER.sub(lambda m: str(index[m.group(1)]), n) for n in self.names[side])


def _regex(name: str) -> re.Pattern:
    parts = _PLACEHOLDER.split(name)
    out = []
    for k, part in enumerate(parts):
        out.append(re.escape(part) if k % 2 == 0 else f"(?P<{part}>0|[1-9][0-9]*)")
    return re.compile("".join(out))


@dataclass
class Table:
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
    _doc: dict = field(default_factory=dict, repr=False)

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, name_or_path: str, variables: dict[str, str] | None = None, lenient: bool = False) -> "Table":
        """A built-in table by name, or a YAML file. ``lenient``: do not fail on unset variables (names only)."""
        path = name_or_path
        tables = builtin_tables()
        if not os.path.exists(path) and path in tables:
            path = tables[path]
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except OSError as err:
            known = ", ".join(tables) or "none"
            raise MappingError(f"{name_or_path}: no such checkpoint mapping ({err.strerror}); built-in tables: {known}; "
                               "or pass the path of a YAML table (see docs/checkpoints.md)") from None
        doc = load_yaml(text, path, "table")
        name = os.path.basename(path)[:-5] if path.endswith(".yaml") else os.path.basename(path)
        return cls.from_doc(doc, name, path, variables, lenient)

    @classmethod
    def from_doc(cls, doc: Any, name: str, path: str, variables: dict[str, str] | None = None,
                 lenient: bool = False) -> "Table":
        if not isinstance(doc, dict) or "entries" not in doc or "sides" not in doc:
            raise MappingError(f"{path}: a checkpoint table is a YAML mapping with 'sides:' and 'entries:' (see docs/checkpoints.md)")
        if doc.get("tensordiff_ckpt_table", TABLE_VERSION) != TABLE_VERSION:
            raise MappingError(f"{path}: tensordiff_ckpt_table {doc.get('tensordiff_ckpt_table')!r} is not supported "
                               f"(this tensordiff reads version {TABLE_VERSION})")
        sides = doc["sides"]
        if not (isinstance(sides, list) and len(sides) == 2 and all(isinstance(s, str) for s in sides) and sides[0] != sides[1]):
            raise MappingError(f"{path}: sides must name two different sides, e.g. [mcore, mindformers]; got {sides!r}")
        side_a, side_b = sides
        var_defs: dict[str, Var] = {}
        for vname, spec in (doc.get("vars") or {}).items():
            if isinstance(spec, dict):
                default = spec.get("default")
                var_defs[str(vname)] = Var(str(vname), None if default is None else _text(default),
                                           tuple(_text(c) for c in spec.get("choices") or ()), str(spec.get("help", "")))
            else:
                var_defs[str(vname)] = Var(str(vname), None if spec is None else _text(spec))
        indices = {str(k): str(v) for k, v in (doc.get("indices") or DEFAULT_INDICES).items()}
        values = {v.name: v.default for v in var_defs.values() if v.default is not None}
        values.update({str(k): _text(v) for k, v in (variables or {}).items()})
        table = cls(name=name, path=path, description=str(doc.get("description", "")), sides=(side_a, side_b),
                    formats={s: tuple(str(x) for x in (doc.get("formats") or {}).get(s) or ()) for s in sides},
                    variables=var_defs, values=values,
                    ignore={s: tuple(str(x) for x in (doc.get("ignore") or {}).get(s) or ()) for s in sides},
                    entries=[], indices=indices, example=str(doc.get("example", "")), _doc=doc)
        table._bind(lenient)
        return table

    def _bind(self, lenient: bool) -> None:
        for vname, var in self.variables.items():
            if var.choices and vname in self.values and self.values[vname] not in var.choices:
                raise MappingError(f"{self.name}: --var {vname}={self.values[vname]} is not one of {', '.join(var.choices)}"
                                   + (f" ({var.help})" if var.help else ""))
        raw_entries = self._doc["entries"] or []
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
                    key = (side, _PLACEHOLDER.sub("{}", nm))
                    if key in produced and produced[key] != entry.where:
                        raise MappingError(f"{entry.where}: {side} name {nm!r} is also in {produced[key]}; each name "
                                           "may appear once per side (use when: to choose between variants)")
                    produced[key] = entry.where

    def _entry(self, raw: Any, where: str, missing: list[str]) -> Entry | None:
        """One entry of the YAML, with variables substituted; ``None`` when its ``when:`` does not hold."""
        a, b = self.sides
        if not isinstance(raw, dict):
            raise MappingError(f"{where}: must be a mapping with keys {a}: and {b}:")
        allowed = _ENTRY_FIELDS | {a, b, f"to_{a}", f"to_{b}"}
        unknown = set(raw) - allowed
        if unknown:
            raise MappingError(f"{where}: unknown field(s) {', '.join(sorted(map(str, unknown)))}; "
                               f"fields are {', '.join(sorted(allowed))}")
        when = raw.get("when") or {}
        if not isinstance(when, dict):
            raise MappingError(f"{where}: when: must map variables to values, e.g. {{fc1_layout: stacked}}")
        for vname, want in when.items():
            if str(vname) not in self.values:
                raise MappingError(f"{where}: when: uses variable {vname!r}, which has no value and no default in vars:")
            if self.values[str(vname)] != _text(want):
                return None
        unset: list[str] = []

        def subst(text: Any) -> str:
            def repl(m: re.Match) -> str:
                if m.group(1) in self.values:
                    return self.values[m.group(1)]
                unset.append(m.group(1))
                return m.group(0)
            return _VAR.sub(repl, str(text))

        names: dict[str, tuple[str, ...]] = {}
        for side in self.sides:
            items = raw.get(side)
            items = items if isinstance(items, list) else [items]
            if not items or not all(isinstance(x, str) for x in items):
                raise MappingError(f"{where}: '{side}:' must be a name or a list of names")
            names[side] = tuple(subst(x) for x in items)
        placeholders = {side: sorted({p for nm in names[side] for p in _PLACEHOLDER.findall(nm)}) for side in self.sides}
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
            text = subst(raw["split"])
            split = None if unset else _parse_split(text, where)
        elif "split" in raw:
            raise MappingError(f"{where}: split: needs a list of names on one side")
        if bool(raw.get(f"to_{a}")) != bool(raw.get(f"to_{b}")):
            raise MappingError(f"{where}: give both to_{a}: and to_{b}: (both directions come from this table), or neither")
        ops: dict[str, tuple[Op, ...]] = {}
        for side in self.sides:
            items = raw.get(f"to_{side}") or []
            texts = [subst(i) for i in ([items] if isinstance(items, str) else items)]
            ops[side] = () if unset else tuple(parse_op(t, where) for t in texts)
        shapes: dict[str, tuple[_Dim, ...] | None] = {s: None for s in self.sides}
        raw_shape = raw.get("shape")
        if isinstance(raw_shape, dict):
            for side, spec in raw_shape.items():
                if side not in self.sides:
                    raise MappingError(f"{where}: shape: names unknown side {side!r}")
                shapes[side] = _parse_shape(spec, where)
        elif raw_shape is not None:
            parsed = _parse_shape(raw_shape, where)
            shapes = {s: parsed if joined is None or s == joined else None for s in self.sides}
        missing += unset
        entry = Entry(names=names, placeholders=tuple(placeholders[a]), shapes=shapes, ops=ops, split=split,
                      joined=joined, optional=bool(raw.get("optional", False)), where=where,
                      when={str(k): _text(v) for k, v in when.items()})
        entry.regex = {s: tuple(_regex(nm) for nm in names[s]) for s in self.sides}
        return entry

    def missing_vars_message(self) -> str:
        parts = []
        for vname in self.missing_vars:
            var = self.variables.get(vname)
            parts.append(f"--var {vname}=N" + (f" ({var.help})" if var and var.help else ""))
        example = f"; example: {self.example}" if self.example else ""
        return f"mapping {self.name} needs {' and '.join(parts)}{example}"

    def describe(self) -> str:
        """'mcore-to-mindformers (fc1_layout=interleaved)'."""
        shown = [f"{k}={v}" for k, v in self.values.items() if k in self.variables]
        return self.name + (f" ({', '.join(shown)})" if shown else "")

    def other(self, side: str) -> str:
        return self.sides[1] if side == self.sides[0] else self.sides[0]

    # ------------------------------------------------------------------ matching
    def ignored(self, key: str, side: str) -> bool:
        return any(fnmatch.fnmatchcase(key, pat) for pat in self.ignore[side])

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
    def plan(self, meta: dict[str, tuple[tuple[int, ...], str]], source: str, path: str = "checkpoint") -> "Plan":
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
        self._check_shapes(plan, candidates, meta)
        return plan

    def _check_shapes(self, plan: "Plan", candidates: list["Instance"], meta: dict) -> None:
        env = {k: int(v) for k, v in self.values.items() if v.lstrip("-").isdigit()}
        checks: list[tuple[Instance, tuple[int, ...], tuple[_Dim, ...]]] = []
        for inst in candidates:
            entry, source = inst.entry, plan.source
            shapes = [tuple(meta[k][0]) for k in inst.src]
            kinds = {meta[k][1] for k in inst.src}
            if len(kinds) > 1:
                plan.misshaped.append((inst.src[0], f"{' + '.join(inst.src)} have different dtypes {sorted(kinds)}"))
                continue
            try:
                if entry.split is None:
                    shape, dims = shapes[0], entry.shapes[source]
                elif entry.joined == source:
                    shape, dims = shapes[0], entry.shapes[source]
                    entry.split.parts_shapes(shape)
                else:
                    shape, dims = entry.split.joined_shape(shapes), entry.shapes[entry.joined or source]
            except ValueError as err:
                plan.misshaped.append((inst.src[0], f"{' + '.join(inst.src)} {_shapes(shapes)}: {err}"))
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
        by_entry: dict[int, list[tuple[Instance, tuple[int, ...]]]] = {}
        for inst in plan.instances:
            by_entry.setdefault(id(inst.entry), []).append((inst, tuple(tuple(meta[k][0]) for k in inst.src)))
        for group in by_entry.values():
            common = Counter(shapes for _, shapes in group).most_common(1)[0][0]
            for inst, shapes in group:
                if shapes != common:
                    plan.misshaped.append((inst.src[0], f"{' + '.join(inst.src)} is {_shapes(shapes)}, but "
                                           f"{_shapes(common)} at the other indices"))
                    bad.add(id(inst))
        for inst, shape, dims in checks:
            if id(inst) in bad:
                continue
            expected = [d.value(env) for d in dims]
            if len(shape) != len(dims) or any(e is not None and e != a for e, a in zip(expected, shape)):
                want = "[" + ", ".join("?" if e is None else str(e) for e in expected) + "]"
                names = "[" + ", ".join(d.text for d in dims) + "]"
                what = " + ".join(inst.src) if len(inst.src) > 1 else inst.src[0]
                shown = _shape(shape) + (" joined" if len(inst.src) > 1 else "")
                plan.misshaped.append((inst.src[0], f"{what} is {shown}, expected {want} = {names}"))
                bad.add(id(inst))
        order = {k: n for n, k in enumerate(meta)}
        plan.instances = sorted((i for i in plan.instances if id(i) not in bad), key=lambda i: min(order[k] for k in i.src))

    def convert(self, tensors: Checkpoint, source: str | None = None, target: str | None = None,
                path: str = "checkpoint", strict: bool = True) -> "Conversion":
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
                    results = [_contiguous(apply(entry.ops[plan.target], tensors[inst.src[0]]))]
                    for op in entry.ops[plan.target]:
                        applied[(str(op), entry.pattern(plan.target))] += 1
                elif entry.joined == plan.source:
                    results = entry.split.split(tensors[inst.src[0]])
                    applied[(f"split {entry.split}", entry.pattern(plan.source))] += 1
                else:
                    results = [entry.split.join([tensors[k] for k in inst.src])]
                    applied[(f"join {entry.split}", entry.pattern(plan.target))] += 1
            except ValueError as err:  # a table without shape: lines lets a bad shape through to here
                raise CheckpointError(f"{path}: cannot convert {' + '.join(inst.src)} {_shapes(tensors[k].shape for k in inst.src)} "
                                      f"({entry.where}): {err}; add shape: to the entry or check the --var values") from None
            for key, value in zip(inst.dst, results):
                out[key] = value
                origin[key] = inst.src
        return Conversion(tensors=out, plan=plan, origin=origin, applied=applied)


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


@dataclass
class Instance:
    entry: Entry
    index: dict[str, int]
    src: tuple[str, ...]
    dst: tuple[str, ...]


@dataclass
class Plan:
    """What converting one checkpoint would do, and everything wrong with it."""

    table: Table
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
        for vname, var in table.variables.items():
            for choice in var.choices:
                if choice == table.values.get(vname):
                    continue
                try:
                    alt = Table.from_doc(table._doc, table.name, table.path, {**table.values, vname: choice}, lenient=True)
                    if alt.missing_vars:
                        continue
                    if alt.plan(self.meta, self.source, self.path).problems < self.problems:
                        hints.append(f"pass --var {vname}={choice}" + (f" ({var.help})" if var.help else ""))
                except TensordiffError:
                    continue
        matched = len(self.instances)
        if self.unexpected and len(self.unexpected) > matched:
            others = [n for n in builtin_tables() if n != table.name]
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


# -------------------------------------------------------------------------------------- diffing
VERDICTS = ("identical", "ok", "differs", "shape", "a_only", "b_only")


@dataclass
class DiffRow:
    name: str
    """A's name (or B's for B-only keys)."""
    verdict: str
    """identical (same bytes) | ok (within tolerance) | differs | shape | a_only | b_only."""
    shape_a: tuple[int, ...] | None = None
    shape_b: tuple[int, ...] | None = None
    dtype_a: str | None = None
    dtype_b: str | None = None
    metrics: Metrics | None = None
    tol: float | None = None
    b_from: tuple[str, ...] = ()
    """B's original names when B was converted and they differ from ``name``."""
    note: str = ""

    @property
    def passed(self) -> bool:
        return self.verdict in ("identical", "ok")

    def as_dict(self) -> dict:
        return {"name": self.name, "verdict": self.verdict, "shape_a": self.shape_a, "shape_b": self.shape_b,
                "dtype_a": self.dtype_a, "dtype_b": self.dtype_b, "tolerance": self.tol, "b_from": list(self.b_from) or None,
                "note": self.note or None, "metrics": self.metrics.as_dict() if self.metrics else None}


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(
        _contiguous(a).reshape(-1).view(np.uint8), _contiguous(b).reshape(-1).view(np.uint8))


def compare_tensor(name: str, a: np.ndarray, b: np.ndarray, rtol: float | None = None) -> DiffRow:
    """Same dtype: bit-equality unless ``rtol``; different dtypes: relative L2 within the coarser dtype's tolerance."""
    da, db = dtypes.name_of(a.dtype), dtypes.name_of(b.dtype)
    row = DiffRow(name, "shape", tuple(a.shape), tuple(b.shape), da, db)
    if a.shape != b.shape:
        return row
    if _same_bytes(a, b):
        row.verdict, row.tol = "identical", 0.0
        row.metrics = Metrics(0.0, 0.0, 0.0, 1.0, 1.0, 0, "tensor")
        return row
    tol = Tolerances(override=rtol).limit(da, db) if (rtol is not None or da != db) else 0.0
    judged = dtypes.coarsest(da, db)
    row.metrics = compare_arrays(a, b, judged if dtypes.is_float(judged) else "float64")
    row.tol = tol
    row.verdict = "ok" if row.metrics.rel_l2 <= tol and row.metrics.nonfinite_mismatch == 0 else "differs"
    return row


def diff_tensors(a: Checkpoint, b: Checkpoint, rtol: float | None = None,
                 b_origin: dict[str, tuple[str, ...]] | None = None) -> list[DiffRow]:
    """Rows in A's order, then B-only keys."""
    rows = []
    for name, xa in a.items():
        if name not in b:
            rows.append(DiffRow(name, "a_only", tuple(xa.shape), None, dtypes.name_of(xa.dtype)))
            continue
        row = compare_tensor(name, xa, b[name], rtol)
        origin = (b_origin or {}).get(name, ())
        row.b_from = origin if origin and origin != (name,) else ()
        rows.append(row)
    for name, xb in b.items():
        if name not in a:
            row = DiffRow(name, "b_only", None, tuple(xb.shape), None, dtypes.name_of(xb.dtype))
            origin = (b_origin or {}).get(name, ())
            row.b_from = origin if origin and origin != (name,) else ()
            rows.append(row)
    return rows
