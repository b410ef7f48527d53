"""Two runs' configurations side by side, before any tensor (``tensordiff config A B``).

* ``readers``: ``read_config`` sniffs what holds a run's settings (a Megatron-LM log or flags, a checkpoint folder, a
  MindFormers YAML, a config.json, a capture);
* ``normalize``: each framework's settings as the canonical keys of ``table.TABLE`` (defaults filled in, derived rows);
* ``settings``: ``Settings``, one run's configuration (key -> value, with where each came from);
* ``table``: the equivalence table, one row per setting that changes what a run computes;
* ``compare``: ``compare_settings`` names what differs in effect.

Framework-free: text, YAML, JSON.
"""

from __future__ import annotations

from .compare import ConfigDiff, Difference, compare_settings
from .readers import read_config, run_settings
from .settings import Settings, Value
from .table import ROWS, TABLE, Row

__all__ = ["ROWS", "TABLE", "ConfigDiff", "Difference", "Row", "Settings", "Value", "compare_settings", "read_config",
           "run_settings"]
