"""Names in a pair file, and the wrappers around a model: one syntax, one list.

A name in a pair file is literal text with three kinds of holes:

* ``{i}`` (any word in braces): a number (a layer, an expert), bound by name: ``decoder.layers.{i}`` on one side
  and ``model.layers.{i}`` on the other pair layer 3 with layer 3;
* ``*``: any text, in ignore lists (``'*._extra_state'``) and in module rules, where the ``*`` of one side is the
  ``*`` of the other, in order (``b: '*'``, ``a: '*'``: every name as it is);
* ``${var}``: a variable's value (``vars:`` in the file, or ``--var NAME=VALUE``), substituted before anything else.

Wrappers: a model held by megatron's ``Float16Module`` or DDP, torch's DDP or ``torch.compile`` is recorded under
``module.`` / ``_orig_mod.``; every name comparison drops them with ``unwrap``.
"""

from __future__ import annotations

import re

from ..errors import MappingError

#: The prefixes a wrapper puts before the model's names (megatron's Float16Module and DDP, torch's DDP: ``module``;
#: ``torch.compile``: ``_orig_mod``), in any nesting.
WRAPPERS = ("module", "_orig_mod")

PLACEHOLDER = re.compile(r"\{(\w+)\}")
VAR = re.compile(r"\$\{(\w+)\}")
_HOLE = re.compile(r"\{(\w+)\}|\*")


def unwrap(name: str) -> str:
    """``name`` without the wrappers' prefixes: 'module.module.decoder.x' -> 'decoder.x', 'module' -> '' (the root)."""
    changed = True
    while changed:
        changed = False
        for prefix in WRAPPERS:
            if name == prefix:
                return ""
            if name.startswith(prefix + "."):
                name, changed = name[len(prefix) + 1:], True
    return name


def parent(name: str) -> str:
    """The enclosing module of a dotted module name ('' for a top-level one)."""
    return name.rsplit(".", 1)[0] if "." in name else ""


def common_parent(names: list[str]) -> str:
    """The longest dotted prefix all ``names`` share ('' when none)."""
    common = []
    for level in zip(*(n.split(".") for n in names)):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


def inside(child: str, outer: str) -> bool:
    """``child`` is ``outer`` or a module under it (everything is under the root, '')."""
    return outer == "" or child == outer or child.startswith(outer + ".")


def regex(pattern: str, numbers: bool = True) -> str:
    """The regular expression of a name pattern: ``{i}`` a number (a named group), ``*`` any text (a numbered group
    ``s1``, ``s2``, ... in order), the rest literal."""
    out, star, last = [], 0, 0
    for m in _HOLE.finditer(pattern):
        out.append(re.escape(pattern[last:m.start()]))
        if m.group(0) == "*":
            star += 1
            out.append(f"(?P<s{star}>.*?)" if numbers else ".*?")
        else:
            out.append(f"(?P<{m.group(1)}>0|[1-9][0-9]*)" if numbers else "(?:0|[1-9][0-9]*)")
        last = m.end()
    out.append(re.escape(pattern[last:]))
    return "".join(out)


def holes(pattern: str) -> tuple[list[str], int]:
    """(the ``{name}`` placeholders, the number of ``*``) of a name pattern."""
    return PLACEHOLDER.findall(pattern), pattern.count("*")


def template(target: str, source: str, where: str) -> str:
    """``target`` (the other side's name) as a ``re`` expansion template of a match of ``source``'s regex.

    Each ``{name}`` of the target must be one of the source's; its ``*`` are the source's, in order."""
    names, stars = holes(source)
    want, want_stars = holes(target)
    unknown = [n for n in want if n not in names]
    if unknown or want_stars > stars:
        raise MappingError(f"{where}: {target!r} uses {', '.join('{' + n + '}' for n in unknown) or 'more *'} that "
                           f"{source!r} does not bind; both names must use the same placeholders")
    out, star, last = [], 0, 0
    for m in _HOLE.finditer(target):
        out.append(target[last:m.start()].replace("\\", "\\\\"))
        if m.group(0) == "*":
            star += 1
            out.append(f"\\g<s{star}>")
        else:
            out.append(f"\\g<{m.group(1)}>")
        last = m.end()
    out.append(target[last:].replace("\\", "\\\\"))
    return "".join(out)
