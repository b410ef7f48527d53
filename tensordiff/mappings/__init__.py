"""The built-in mapping files, by name (the names are public: ``--mapping NAME``).

* ``*.yaml`` here: capture rename rules (``tensordiff diff --mapping``), see docs/mapping.md;
* ``ckpt/*.yaml``: checkpoint conversion tables (``tensordiff ckpt --mapping``), see docs/checkpoints.md;
* ``splits/*.yaml``: how each record of a distributed rank is split (merging rank files on read), see
  docs/distributed.md.
"""

from __future__ import annotations

import os

FOLDER = os.path.dirname(os.path.abspath(__file__))


def _yaml_files(folder: str) -> dict[str, str]:
    if not os.path.isdir(folder):
        return {}
    return {f[:-5]: os.path.join(folder, f) for f in sorted(os.listdir(folder)) if f.endswith(".yaml")}


def rename_rules() -> dict[str, str]:
    """Capture mappings shipped with tensordiff: name -> file."""
    return _yaml_files(FOLDER)


def ckpt_tables() -> dict[str, str]:
    """Checkpoint tables shipped with tensordiff: name -> file."""
    return _yaml_files(os.path.join(FOLDER, "ckpt"))


def split_tables() -> dict[str, str]:
    """Split tables for merging rank files: name -> file."""
    return _yaml_files(os.path.join(FOLDER, "splits"))
