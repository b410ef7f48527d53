"""Stage 3, the diff: two captures in, every tensor pair judged and the first divergence named.

Pipeline, one module per step:

1. ``align``: line up the records of one step in five passes (rename rules → exact name →
   wrapper prefixes → gradient follows its tensor → execution order and shape); what is left is
   reported as unmatched, never as passing;
2. ``metrics`` / ``judge``: compare each pair (relative L2, max |Δ|, cosine, ULP share; float64
   chunks, or the statistics when tensors were not stored) and judge it against its
   ``tolerance`` (by dtype, ``--rtol``, or a measured noise floor);
3. ``reference`` / ``noise``: the other sources of a tolerance: a three-way diff against an FP32
   reference run, per-tensor noise measured from two runs of one side;
4. ``divergence``: the first row in execution order whose error is introduced there, not inherited;
   ``coverage``: what was compared per phase, pairs that are only guesses, and whether no divergence
   is agreement (exit 0) or inconclusive (exit 3);
5. ``engine``: ``diff(path_a, path_b, options)`` runs 1-4 step by step and returns a ``DiffResult``
   (``result``: the plain data every later stage reads); ``workers``: the pairs of a distributed run merged and
   compared in worker processes, where its rank files are read.

Beside them, what no pair of names says:

* ``accounting``: records with no counterpart that carry nothing the diff has not compared (by structure and value);
* ``routing``: MoE tokens routed apart by a near tie of router scores (the ``routing`` rule);
* ``exactness``: same-stack exactness (one framework, version, device, dtype: any difference is the code's);
* ``nonfinite``: the first NaN or Inf of a run, in execution order, from the index alone;
* ``autoselect``: which built-in mapping fits two captures; ``propose``: a mapping file proposed where none fits.

Needs numpy, h5py and pyyaml (ml_dtypes to read BF16/FP8 tensors); imports neither torch nor MindSpore.
"""

import sys
import types

from ..mapping import RenameRules
from .engine import diff
from .result import DiffOptions, DiffResult, FirstDivergence, Row
from .tolerance import Tolerances

__all__ = ["DiffOptions", "DiffResult", "FirstDivergence", "RenameRules", "Row", "Tolerances", "diff"]


class _CallableModule(types.ModuleType):
    """``tensordiff.diff(a, b)`` as ``tensordiff.capture(...)`` is called: the package calls its ``diff``."""

    def __call__(self, path_a: str, path_b: str, options: DiffOptions | None = None) -> DiffResult:
        return diff(path_a, path_b, options)


sys.modules[__name__].__class__ = _CallableModule
