"""The one loader of pair files: read, check the top level, bind the variables; the sections parse themselves
(``modules.parse`` for ``diff``, ``ckpt.table.ConversionTable.from_pair`` for ``ckpt``).

Files written before the two were one (a ``diff`` mapping with ``rules:`` and ``a:``/``b:`` regexes, a ``ckpt``
table with ``entries:``) are still read: each becomes a pair file with only its one section.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass, field, replace
from typing import Any

from .._yaml import load_yaml
from ..errors import MappingError
from .names import VAR

VERSION = 2
FOLDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pairs")
#: The names the built-in files had when ``diff`` and ``ckpt`` kept them apart: still accepted.
ALIASES = {"hf-llama-to-mcore": "mcore-hf-llama", "mcore-to-hf-llama": "mcore-hf-llama",
           "hf-gpt2-to-mcore": "mcore-hf-gpt2",
           "mindformers-to-mcore": "mcore-mindformers", "mcore-to-mindformers": "mcore-mindformers",
           "mindformers-llama-to-mcore": "mcore-mindformers-llama",
           "mcore-to-mindformers-llama": "mcore-mindformers-llama"}
_TOP = {"tensordiff_mapping", "description", "sides", "example", "vars", "indices", "modules", "tensors"}


def builtin() -> dict[str, str]:
    """The pair files shipped with tensordiff: name -> path."""
    return {f[:-5]: os.path.join(FOLDER, f) for f in sorted(os.listdir(FOLDER)) if f.endswith(".yaml")}


@functools.cache
def builtin_with(section: str) -> tuple[str, ...]:
    """The built-in pairs that have a ``modules`` (for ``diff``) or ``tensors`` (for ``ckpt``) section."""
    out = []
    for name, path in builtin().items():
        with open(path, encoding="utf-8") as fh:
            if re.search(rf"^{section}:", fh.read(), re.MULTILINE):
                out.append(name)
    return tuple(out)


@dataclass(frozen=True)
class Var:
    """A variable of a pair file: ``vars: {heads: {default: 32, choices: [...], help: ...}}`` or ``heads: 32``."""

    name: str
    default: str | None = None
    choices: tuple[str, ...] = ()
    help: str = ""


def value_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


@dataclass
class PairFile:
    """One model pair's names on two sides: a ``modules`` section for captures, a ``tensors`` section for
    checkpoints, variables shared by both (see docs/mapping.md)."""

    name: str
    path: str
    sides: tuple[str, str]
    """the two sides' names; ``diff`` takes the first as A (the names mapped onto), the second as B."""
    description: str = ""
    example: str = ""
    variables: dict[str, Var] = field(default_factory=dict)
    values: dict[str, str] = field(default_factory=dict)
    """the variables' values in force: defaults, then ``--var``."""
    indices: dict[str, str] = field(default_factory=dict)
    given: dict[str, str] = field(default_factory=dict)
    """the values the caller set (``--var``), over the defaults."""
    legacy: bool = False
    """a file of the older format (``modules`` rules are then regexes with ``a:``/``b:``)."""
    _doc: dict = field(default_factory=dict, repr=False)

    def section(self, key: str) -> dict | None:
        value = self._doc.get(key)
        return value if isinstance(value, dict) else None

    def with_values(self, values: dict[str, str]) -> PairFile:
        """This file with other variable values (defaults first, then ``values``)."""
        bound = {v.name: v.default for v in self.variables.values() if v.default is not None}
        given = {str(k): value_text(v) for k, v in values.items()}
        bound.update(given)
        return replace(self, values=bound, given=given)

    def subst(self, text: Any, where: str, missing: list[str] | None = None) -> str:
        """``text`` with ``${var}`` replaced; an unset variable is an error, or, with ``missing``, noted there and
        left in place."""
        def repl(m: re.Match) -> str:
            if m.group(1) in self.values:
                return self.values[m.group(1)]
            if missing is None:
                raise MappingError(f"{self.path}: {where} uses ${{{m.group(1)}}} but no value is set; add it under "
                                   f"vars: or pass --var {m.group(1)}=VALUE")
            missing.append(m.group(1))
            return m.group(0)
        return VAR.sub(repl, str(text))

    def holds(self, when: Any, where: str) -> bool:
        """An entry's or a rule's ``when: {var: value}``: it applies only while every variable has that value."""
        if not when:
            return True
        if not isinstance(when, dict):
            raise MappingError(f"{where}: when: must map variables to values, e.g. {{fc1_layout: stacked}}")
        for name, want in when.items():
            if not _scalar(want):
                raise MappingError(f"{where}: when: {name}: expected a value (text, a number or true/false), got "
                                   f"{want!r}")
            if str(name) not in self.values:
                raise MappingError(f"{where}: when: uses variable {name!r}, which has no value and no default in "
                                   "vars:")
            if self.values[str(name)] != value_text(want):
                return False
        return True

    def describe(self) -> str:
        """'mcore-mindformers (fc1=deinterleave)': the name and the variables set."""
        shown = [f"{k}={v}" for k, v in self.values.items() if k in self.variables]
        return self.name + (f" ({', '.join(shown)})" if shown else "")


def resolve(name_or_path: str) -> str:
    """The path of a built-in pair (by name, or a former name) or of a file."""
    if os.path.exists(name_or_path):
        return name_or_path
    files = builtin()
    name = ALIASES.get(name_or_path, name_or_path)
    return files.get(name, name_or_path)


def load(name_or_path: str, variables: dict[str, str] | None = None) -> PairFile:
    """A built-in pair by name, or a YAML file, with ``variables`` (``--var``) over the file's defaults."""
    path = resolve(name_or_path)
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except UnicodeDecodeError as err:
        raise MappingError(f"{path}: not UTF-8 text (byte {err.start}: {err.object[err.start:err.start + 4]!r}); save "
                           "the mapping file as UTF-8") from None
    except OSError as err:
        raise MappingError(f"{name_or_path}: no such mapping ({err.strerror}); built-in: {', '.join(builtin())}; or "
                           "pass the path of a YAML pair file (docs/mapping.md)") from None
    base = os.path.basename(path)
    name = base[:-5] if base.endswith(".yaml") else base[:-4] if base.endswith(".yml") else base
    return from_text(text, path, name, variables)


def from_text(text: str, path: str = "<mapping>", name: str = "", variables: dict[str, str] | None = None) -> PairFile:
    doc = load_yaml(text, path, "mapping file")
    if not isinstance(doc, dict):
        raise MappingError(f"{path}: a mapping file is a YAML mapping with 'sides:' and a 'modules:' or 'tensors:' "
                           "section (see docs/mapping.md)")
    legacy = _legacy(doc, path)
    if legacy is not None:
        doc = legacy
    version = doc.get("tensordiff_mapping", VERSION)
    if version != VERSION:
        raise MappingError(f"{path}: tensordiff_mapping {version!r} is not supported (this tensordiff reads version "
                           f"{VERSION}, and the older files with 'rules:' or 'entries:' at the top)")
    unknown = sorted(set(map(str, doc)) - _TOP)
    if unknown:
        raise MappingError(f"{path}: unknown key(s) {', '.join(unknown)}; a pair file has {', '.join(sorted(_TOP))}")
    if doc.get("modules") is None and doc.get("tensors") is None:
        raise MappingError(f"{path}: neither a 'modules:' section (for diff) nor a 'tensors:' section (for ckpt); "
                           "see docs/mapping.md")
    sides = doc.get("sides")
    if not (isinstance(sides, list) and len(sides) == 2 and all(isinstance(s, str) and s for s in sides)
            and sides[0] != sides[1]):
        raise MappingError(f"{path}: sides must name two different sides, e.g. sides: [mcore, hf]; got {sides!r}")
    for key in ("modules", "tensors"):
        if doc.get(key) is not None and not isinstance(doc[key], dict):
            raise MappingError(f"{path}: {key}: must be a mapping (see docs/mapping.md), got {doc[key]!r}")
    variables_ = _vars(doc.get("vars"), path)
    indices = doc.get("indices")
    if indices is not None and not (isinstance(indices, dict) and all(_scalar(v) for v in indices.values())):
        raise MappingError(f"{path}: indices: expected a mapping of placeholders to variable names, got {indices!r}")
    for key in ("description", "example"):
        if doc.get(key) is not None and not isinstance(doc[key], str):
            raise MappingError(f"{path}: {key}: expected text, got {doc[key]!r}; see docs/mapping.md")
    pair = PairFile(name=name, path=path, sides=(sides[0], sides[1]), description=str(doc.get("description", "")),
                    example=str(doc.get("example", "")), variables=variables_,
                    indices={str(k): str(v) for k, v in (indices or {"i": "num_layers"}).items()},
                    legacy=legacy is not None and "modules" in doc, _doc=doc)
    return pair.with_values(variables or {})


def _scalar(value: Any) -> bool:
    return isinstance(value, (str, int, float, bool))


def _vars(raw: Any, path: str) -> dict[str, Var]:
    def fail(key: str, expected: str, got: Any) -> MappingError:
        return MappingError(f"{path}: {key}: expected {expected}, got {got!r}; see docs/mapping.md")

    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise fail("vars", "a mapping of names to a default or {default:, choices:, help:}", raw)
    out = {}
    for name, spec in raw.items():
        if isinstance(spec, dict):
            unknown = set(spec) - {"default", "choices", "help"}
            if unknown:
                raise fail(f"vars: {name}", "the keys default, choices and help", sorted(unknown))
            default = spec.get("default")
            if default is not None and not _scalar(default):
                raise fail(f"vars: {name}: default", "text, a number or true/false", default)
            if spec.get("help") is not None and not isinstance(spec["help"], str):
                raise fail(f"vars: {name}: help", "text", spec["help"])
            choices = spec.get("choices")
            if choices is not None and not (isinstance(choices, list) and all(_scalar(c) for c in choices)):
                raise fail(f"vars: {name}: choices", "a list of text or numbers", choices)
            var = Var(str(name), None if default is None else value_text(default),
                      tuple(value_text(c) for c in choices or ()), str(spec.get("help", "")))
            if var.choices and var.default is not None and var.default not in var.choices:
                raise fail(f"vars: {name}: default", f"one of its choices ({', '.join(var.choices)})", default)
            out[str(name)] = var
        elif spec is None or _scalar(spec):
            out[str(name)] = Var(str(name), None if spec is None else value_text(spec))
        else:
            raise fail(f"vars: {name}", "text, a number or {default:, choices:, help:}", spec)
    return out


def _legacy(doc: dict, path: str) -> dict | None:
    """An older file as a pair file: a ``diff`` mapping (``rules:``) or a ``ckpt`` table (``entries:``)."""
    if "tensordiff_ckpt_table" in doc or ("entries" in doc and "modules" not in doc and "tensors" not in doc):
        if doc.get("tensordiff_ckpt_table", 1) != 1 or isinstance(doc.get("tensordiff_ckpt_table"), bool):
            raise MappingError(f"{path}: tensordiff_ckpt_table {doc.get('tensordiff_ckpt_table')!r} is not supported "
                               "(this tensordiff reads version 1, and pair files: docs/mapping.md)")
        if "sides" not in doc:
            raise MappingError(f"{path}: a checkpoint table is a YAML mapping with 'sides:' and 'entries:' (see "
                               "docs/mapping.md)")
        tensors = {k: doc[k] for k in ("formats", "ignore", "entries") if k in doc}
        return {"tensordiff_mapping": VERSION, "sides": doc["sides"], "tensors": tensors,
                **{k: doc[k] for k in ("description", "example", "vars", "indices") if k in doc}}
    if "rules" in doc and "modules" not in doc:
        if doc.get("tensordiff_mapping", 1) != 1 or isinstance(doc.get("tensordiff_mapping"), bool):
            raise MappingError(f"{path}: tensordiff_mapping {doc['tensordiff_mapping']!r} with a top-level 'rules:' "
                               "list: version 1 has 'rules:' at the top, version 2 under 'modules:' (docs/mapping.md)")
        modules = {k: doc[k] for k in ("rules", "order_fallback", "ignore_a", "ignore_b", "strip_b") if k in doc}
        return {"tensordiff_mapping": VERSION, "sides": ["a", "b"], "modules": modules,
                **{k: doc[k] for k in ("description", "vars") if k in doc}}
    return None
