"""The package's maps cannot lag: each package's docstring names every module and folder in it.

A package's ``__init__`` docstring is the map a newcomer reads first (``help(tensordiff.diff)``); a module added
without a line there is a module nobody finds. A name counts when it is written as ``name`` (or ``name/...`` for a
folder), as the maps write them.
"""

from __future__ import annotations

import ast
import os
import re

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tensordiff")


def _packages() -> list[str]:
    """Every folder of the package that is a Python package, relative to ``tensordiff/``'s parent."""
    out = []
    for folder, dirs, files in os.walk(PACKAGE):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        if "__init__.py" in files:
            out.append(folder)
    return sorted(out)


def _contents(folder: str) -> list[str]:
    """The modules (``.py`` files but ``__init__``) and sub-folders of ``folder``."""
    names = []
    for entry in sorted(os.listdir(folder)):
        path = os.path.join(folder, entry)
        if entry == "__pycache__" or entry.startswith("."):
            continue
        if os.path.isdir(path):
            names.append(entry)
        elif entry.endswith(".py") and entry != "__init__.py":
            names.append(entry[:-3])
    return names


def _unnamed(folder: str) -> list[str]:
    with open(os.path.join(folder, "__init__.py"), encoding="utf-8") as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    return [name for name in _contents(folder) if not re.search(rf"``{re.escape(name)}(/[^`]*)?``", doc)]


def test_the_packages_are_found():
    found = {os.path.relpath(p, os.path.dirname(PACKAGE)) for p in _packages()}
    assert {"tensordiff", "tensordiff/diff", "tensordiff/store", "tensordiff/capturing", "tensordiff/explain/hints"} <= found


@pytest.mark.parametrize("folder", _packages(), ids=lambda p: os.path.relpath(p, os.path.dirname(PACKAGE)))
def test_each_package_docstring_names_each_of_its_modules(folder):
    assert _unnamed(folder) == [], (
        f"{os.path.relpath(folder, os.path.dirname(PACKAGE))}/__init__.py's docstring does not name these modules or "
        "folders: add a line for each (``name``: what it is for)")


def test_a_module_left_out_of_a_map_is_found(tmp_path):
    """The rule itself: a module the docstring leaves out is reported, one named is not."""
    (tmp_path / "__init__.py").write_text('"""A map: ``named`` and ``data/`` are here."""\n')
    for name in ("named.py", "forgotten.py"):
        (tmp_path / name).write_text("")
    (tmp_path / "data").mkdir()
    assert _unnamed(str(tmp_path)) == ["forgotten"]
