"""Two runs' configurations side by side, before any tensor (``tensordiff config A B``).

``read_config`` sniffs what holds a run's settings (a Megatron-LM log or flags, a checkpoint folder, a MindFormers
YAML, a config.json, a capture) and gives one ``Settings`` in the canonical keys of ``table.TABLE``;
``compare_settings`` names what differs in effect. Framework-free: text, YAML, JSON.
"""

from __future__ import annotations

from .compare import ConfigDiff, Difference, compare_settings
from .readers import read_config, run_settings
from .settings import Settings, Value
from .table import ROWS, TABLE, Row

__all__ = ["ROWS", "TABLE", "ConfigDiff", "Difference", "Row", "Settings", "Value", "compare_settings", "read_config",
           "run_settings"]
