"""YAML for mapping files and checkpoint tables: safe loading, one-line errors with the line number."""

from __future__ import annotations

from typing import Any

import yaml

from .errors import MappingError


def load_yaml(text: str, path: str, what: str) -> Any:
    """``yaml.safe_load`` of ``text``; a syntax error becomes one MappingError naming ``path`` and the line."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise MappingError(f"{path}: not valid YAML{where}; fix the syntax of the {what}") from None
