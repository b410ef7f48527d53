"""Stage 4, explain: why the runs part ways where the diff says they do.

* ``place``: the first divergence in words: what was measured there and what kind of code each kind of place
  (``FirstDivergence.case``: a module, the attention core, the loss's gradient, the optimizer update, ...) points at;
* ``hints``: the common causes (activation, norm epsilon, RoPE, dtype, layout, bias, factor,
  checkpoint), each tested on the captured tensors at the first divergence and ranked by the
  share of the gap it explains (one module per cause);
* ``diagnosis``: ``diagnose(a, b, options)`` = ``diff`` + hints, the ``Diagnosis`` the report shows;
* ``config``: which differences of the runs' recorded model configurations bear on the first divergence;
* ``replay``: run one module of side A's code on B's captured inputs: introduced or inherited?
* ``ranks``: why records that must be identical across ranks differ, named from the rank files alone.

Framework-free except ``replay``, which calls the model through ``tensordiff.frameworks``.
"""

from .diagnosis import Diagnosis, diagnose, explain

__all__ = ["Diagnosis", "diagnose", "explain"]
