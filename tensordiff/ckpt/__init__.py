"""One checkpoint for both frameworks: conversion driven by declarative tables, and a check that it is the same.

* ``schema``: a table's pieces (variables, entries, symbolic shapes, name patterns);
* ``table``: ``ConversionTable``, a YAML table with its variables bound; ``convert()`` in either
  direction (both come from the one table; every conversion is a permutation, so A -> B -> A is
  bit-exact);
* ``plan``: what a conversion would do, every key and shape checked first, all problems in one error;
* ``compare``: ``diff_checkpoints(a, b)``, tensor by tensor after bringing B to A's names;
* ``files``: ``load`` / ``save`` by suffix (.safetensors, .pt, .ckpt; frameworks imported only there).

Layout transforms and splits (QKV groups, gate/up chunks) come from ``tensordiff.transforms``.
"""

from .compare import CheckpointDiff, DiffRow, compare_tensor, diff_checkpoints, diff_tensors
from .files import load, save
from .plan import Checkpoint, Conversion, Plan
from .table import ConversionTable

__all__ = ["Checkpoint", "CheckpointDiff", "Conversion", "ConversionTable", "DiffRow", "Plan", "compare_tensor",
           "diff_checkpoints", "diff_tensors", "load", "save"]
