"""One mapping concept: a *pair file* per model pair says how the names of one side are the names of the other.

* ``modules:`` the recorded modules (``tensordiff diff --mapping NAME``): rename rules, records left out, layout
  transforms of B's tensors into A's;
* ``tensors:`` the checkpoint tensors (``tensordiff ckpt ... --mapping NAME``): one entry per tensor, its shape,
  splits and per-direction transforms;
* ``sides``, ``vars`` (``--var NAME=VALUE``), ``description``, ``example``: shared by both.

Modules: ``pairfile``, the one loader (read, check, bind the variables); ``modules``, the ``modules:`` section;
``names``, names and the wrappers around a model; ``derive``, a megatron-core <-> Hugging Face mapping derived from
the two recorded configs. Both commands take the same NAME (``pairs/*.yaml`` here, or a path); ``tensordiff map``
writes this format. What is true of every pair (masks, pass-throughs, q/k/v inputs that are one tensor, ...) is not
written in a pair file: the diff accounts for it by structure and value (``tensordiff.diff.accounting``). See
docs/mapping.md; README.md here says how to add a pair.
"""

from __future__ import annotations

from .modules import Ignore, RenameRules, Rule
from .names import WRAPPERS, unwrap
from .pairfile import ALIASES, PairFile, Var, builtin, builtin_with, from_text, load, resolve, value_text

__all__ = ["ALIASES", "WRAPPERS", "Ignore", "PairFile", "RenameRules", "Rule", "Var", "builtin", "builtin_with",
           "from_text", "load", "resolve", "unwrap", "value_text"]
