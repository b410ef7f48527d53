"""Where a MindSpore rank sits in a distributed run (msrun, mpirun): what a reader needs to merge its rank files.

``layout()``: world size and rank from ``mindspore.communication``; the parallel mode from the auto-parallel
context (a ``data_parallel`` run: every rank is a data-parallel rank); with MindFormers' ``parallel_core``
parallel state initialised (looked up in ``sys.modules``, never imported here), its tensor-, pipeline- and
data-parallel sizes and this rank's place in each. Written into the capture as the ``parallel`` attribute (JSON),
as the torch adapter writes it. Nothing here may fail the capture: a value that cannot be read is left out.
"""

from __future__ import annotations

import sys
from typing import Any

_MF_STATE = "mindformers.parallel_core.inference.parallel_state"


def layout() -> dict[str, Any]:
    """This rank's coordinates; {} outside a distributed run."""
    out: dict[str, Any] = {}
    try:
        from mindspore.communication import get_group_size, get_rank

        world, rank = int(get_group_size()), int(get_rank())
    except Exception:  # communication not initialised: a single process
        return out
    if world <= 1:
        return out
    out.update(world_size=world, rank=rank, source="mindspore.communication")
    try:
        import mindspore as ms

        mode = str(ms.get_auto_parallel_context("parallel_mode"))
        out["parallel_mode"] = mode
        if mode == "data_parallel":
            out.update(tp=1, tp_rank=0, pp=1, pp_rank=0, dp=world, dp_rank=rank)
    except Exception:
        pass
    ps = sys.modules.get(_MF_STATE)
    try:
        if ps is not None and ps.model_parallel_is_initialized():
            for key, size, rank_of in (
                ("tp", ps.get_tensor_model_parallel_world_size, ps.get_tensor_model_parallel_rank),
                ("pp", ps.get_pipeline_model_parallel_world_size, ps.get_pipeline_model_parallel_rank),
                ("dp", ps.get_data_parallel_world_size, ps.get_data_parallel_rank),
            ):
                out[key], out[f"{key}_rank"] = int(size()), int(rank_of())
    except Exception:
        pass
    return out
