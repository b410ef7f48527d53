"""YAML for mapping files and checkpoint tables: safe loading, one-line errors with the line number, and a bound on
what aliases expand to (a "billion laughs" file is refused before anything walks it)."""

from __future__ import annotations

from typing import Any

import yaml

from .errors import MappingError

#: The most nodes a document may hold once its aliases are expanded (a mapping file has hundreds).
MAX_NODES = 100_000


def load_yaml(text: str, path: str, what: str) -> Any:
    """``yaml.safe_load`` of ``text``; a syntax error becomes one MappingError naming ``path`` and the line."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        size = _expanded_size(node, {}, 0) if node is not None else 0
        if size > MAX_NODES:
            raise MappingError(f"{path}: its aliases (*name) expand to over {MAX_NODES} values; a {what} has no need of "
                               "that many: write the values out, without nested aliases")
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise MappingError(f"{path}: not valid YAML{where}; fix the syntax of the {what}") from None
    except RecursionError:
        raise MappingError(f"{path}: nested too deeply to be a {what}") from None


def _expanded_size(node: yaml.Node, seen: dict[int, int], depth: int) -> int:
    """How many nodes ``node`` stands for with every alias expanded, counted without expanding (each node once)."""
    known = seen.get(id(node))
    if known is not None:
        return known
    if depth > 200:
        raise RecursionError
    seen[id(node)] = MAX_NODES + 1  # a node reached again while being counted: a cycle, never a finite document
    if isinstance(node, yaml.SequenceNode):
        size = 1 + sum(_expanded_size(child, seen, depth + 1) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        size = 1 + sum(_expanded_size(k, seen, depth + 1) + _expanded_size(v, seen, depth + 1) for k, v in node.value)
    else:
        size = 1
    seen[id(node)] = min(size, MAX_NODES + 1)
    return seen[id(node)]
