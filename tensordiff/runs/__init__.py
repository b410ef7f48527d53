"""Whole training runs: loss, perplexity and grad-norm curves of two frameworks, step by step.

* ``readers``: ``read_run(path)`` for Megatron-LM and MindFormers logs, TensorBoard event files
  (``tfevents``) and tensordiff captures, recognised from the content;
* ``run``: ``Run``, per-step scalars;
* ``compare``: ``compare_runs(a, b, threshold, warmup, ...)`` -> ``Comparison`` with its verdict;
* ``drift``: ``layer_drift(capture_a, capture_b, baseline, ...)`` -> ``DriftTable``: for each layer, the step at which
  its statistics first depart beyond their noise (captures with statistics for many steps);
* ``locate``: from the curve to the layer: where two long runs part, the checkpoint to resume both from, the commands.

Framework-free. The table is ``tensordiff.report.runs``; the plot and HTML page ``tensordiff.report.runs_plot``.
"""

from .compare import Comparison, compare_runs
from .drift import DriftTable, layer_drift
from .readers import read_run
from .run import Run

__all__ = ["Comparison", "DriftTable", "Run", "compare_runs", "layer_drift", "read_run"]
