"""One checkpoint for both frameworks: conversion driven by declarative tables, and a check that it is the same.

* ``schema``: a table's pieces (variables, entries, symbolic shapes, name patterns);
* ``table``: ``ConversionTable``, a YAML table with its variables bound; ``convert()`` in either
  direction (both come from the one table; every conversion is a permutation, so A -> B -> A is
  bit-exact);
* ``plan``: what a conversion would do, every key and shape checked first, all problems in one error;
* ``compare``: ``diff_checkpoints(a, b)``, tensor by tensor after bringing B to A's names;
* ``convert``: ``convert_file(src, dst, mapping)``: read, convert with a table, write;
* ``files``: ``load`` / ``save`` by suffix (.safetensors, .pt, .ckpt; frameworks imported only there);
  ``safetensors_io``: safetensors files as numpy arrays, BF16 and FP8 with their bits;
* ``dirs``: the checkpoint folders the frameworks write, and which iterations they hold;
  ``megatron_dir``: a Megatron-LM ``--save`` folder read as one full model with its optimizer state;
  ``mindformers_dir``: the folder a MindFormers 1.9 Trainer writes, optimizer state included;
* ``state``: a whole training state carried across (Megatron-LM's ``--save`` at iteration J written as the folder a
  MindFormers Trainer resumes from).

Layout transforms and splits (QKV groups, gate/up chunks) come from ``tensordiff.transforms``.
"""

from .compare import CheckpointDiff, DiffRow, compare_tensor, diff_checkpoints, diff_tensors
from .files import load, save
from .plan import Checkpoint, Conversion, Plan
from .table import ConversionTable

__all__ = ["Checkpoint", "CheckpointDiff", "Conversion", "ConversionTable", "DiffRow", "Plan", "compare_tensor",
           "diff_checkpoints", "diff_tensors", "load", "save"]
