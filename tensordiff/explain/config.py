"""Which differences of the two runs' recorded model configurations bear on the first divergence: those of the
settings that act where it is (its module, its phase, after the first step or not) or on the causes the hints found
there (``tensordiff config`` compares them all)."""

from __future__ import annotations

from ..diff.result import DiffResult
from ..errors import TensordiffError


def config_bearing(result: DiffResult) -> tuple[list, list]:
    """The differences of the captures' recorded model configs (``tensordiff config``) that bear on the first
    divergence, and the others; both empty without a first divergence or without a config on each side."""
    first = result.first
    if first is None:
        return [], []
    from ..config.compare import compare_settings, rows_for
    from ..config.readers import read_config

    try:
        cfg = compare_settings(read_config(result.path_a), read_config(result.path_b))
    except TensordiffError:  # no recorded config (older captures, a rank-file glob): nothing to add
        return [], []
    causes = [h.cause for h in getattr(result, "hints", [])]
    keys = set(rows_for(first.module_a, first.phase, first.step > min(result.steps, default=0), causes))
    bearing = [d for d in cfg.differences if d.row.key in keys]
    return bearing, [d for d in cfg.differences if d.row.key not in keys]
