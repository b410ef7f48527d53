"""Stage 4, explain: why the runs part ways where the diff says they do.

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
