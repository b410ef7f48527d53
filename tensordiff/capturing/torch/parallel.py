"""Where a rank sits in a distributed run, and how its parameters are split: what a reader needs to merge rank files.

* ``layout()``: world size and rank from ``torch.distributed``; with megatron-core's ``parallel_state``
  initialised (looked up in ``sys.modules``, never imported here), the tensor-, pipeline-, data-, context- and
  expert-parallel sizes, this rank's place in each, the ranks of its groups, the virtual pipeline size (``vpp``,
  when used), and ``sequence_parallel`` from the model's config; for a pipeline stage, the offset of its first
  layer (``layer_offset``: the global number of its local layer 0).
* ``param_splits(model)``: for each parameter megatron marks, ``tensor_model_parallel``, ``partition_dim``,
  ``partition_stride``, ``sequence_parallel`` (its gradient is a partial sum until the TP all-reduce) and
  ``shared_embedding`` (``tied``: one of the copies of the tied word embeddings that pipeline stages hold, the first
  stage's ``embedding.word_embeddings.weight`` and the last stage's ``output_layer.weight``, kept equal by the
  embedding group's all-reduce of their gradients).

Both are written into the capture as JSON (``parallel`` attribute, ``param_splits`` metadata). Nothing here may
fail the capture: a value that cannot be read is left out.
"""

from __future__ import annotations

import sys
from typing import Any


def _group_ranks(dist: Any, group: Any) -> list[int] | None:
    try:
        return [int(r) for r in dist.get_process_group_ranks(group)]
    except Exception:
        return None


def layout(model: Any = None) -> dict[str, Any]:
    """This rank's coordinates (see the module docstring); {} outside a distributed run."""
    out: dict[str, Any] = {}
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return out
        out["world_size"], out["rank"] = dist.get_world_size(), dist.get_rank()
        ps = sys.modules.get("megatron.core.parallel_state")
        if ps is None or not ps.model_parallel_is_initialized():
            out["source"] = "torch.distributed"
            return out
        out["source"] = "megatron.core.parallel_state"
        for key, size, rank, group in (
            ("tp", ps.get_tensor_model_parallel_world_size, ps.get_tensor_model_parallel_rank,
             ps.get_tensor_model_parallel_group),
            ("pp", ps.get_pipeline_model_parallel_world_size, ps.get_pipeline_model_parallel_rank,
             ps.get_pipeline_model_parallel_group),
            ("dp", ps.get_data_parallel_world_size, ps.get_data_parallel_rank, ps.get_data_parallel_group),
            ("cp", ps.get_context_parallel_world_size, ps.get_context_parallel_rank, ps.get_context_parallel_group),
            ("ep", ps.get_expert_model_parallel_world_size, ps.get_expert_model_parallel_rank, None),
        ):
            try:
                out[key], out[f"{key}_rank"] = int(size()), int(rank())
                if group is not None:
                    ranks = _group_ranks(dist, group())
                    if ranks is not None:
                        out[f"{key}_group"] = ranks
            except Exception:
                continue
        try:  # virtual pipeline stages (model chunks): None when not used
            vpp = ps.get_virtual_pipeline_model_parallel_world_size()
            if vpp:
                out["vpp"] = int(vpp)
        except Exception:
            pass
        config = _config(model)
        if config is not None:
            out["sequence_parallel"] = bool(getattr(config, "sequence_parallel", False))
        offset = _layer_offset(model)
        if offset is not None:
            out["layer_offset"] = offset
    except Exception:
        pass
    return out


def _config(model: Any) -> Any:
    seen = 0
    while model is not None and seen < 4:
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "tensor_model_parallel_size"):
            return config
        model, seen = getattr(model, "module", None), seen + 1
    return None


def _layer_offset(model: Any) -> int | None:
    """A pipeline stage's global number of its first local layer (megatron's ``layer_number`` is 1-based, global)."""
    try:
        for name, module in model.named_modules():
            number = getattr(module, "layer_number", None)
            tail = name.rsplit(".", 1)[-1]
            if isinstance(number, int) and tail.isdigit() and ".layers." in f".{name}":
                return number - 1 - int(tail)
    except Exception:
        return None
    return None


def param_splits(model: Any) -> dict[str, dict[str, Any]]:
    """``{module.param: {"tp": bool, "dim": int, "stride": int, "sp": bool[, "tied": True]}}`` for the parameters
    megatron marks (``tied``: ``shared_embedding``, a pipeline stage's copy of the tied word embeddings)."""
    out: dict[str, dict[str, Any]] = {}
    try:
        for name, p in model.named_parameters():
            tp = bool(getattr(p, "tensor_model_parallel", False))
            sp = bool(getattr(p, "sequence_parallel", False))
            tied = getattr(p, "shared_embedding", False) is True
            if not (tp or sp or tied):
                continue
            entry: dict[str, Any] = {"tp": tp, "sp": sp}
            if tp:
                entry["dim"] = int(getattr(p, "partition_dim", 0))
                entry["stride"] = int(getattr(p, "partition_stride", 1))
            if tied:
                entry["tied"] = True
            out[name] = entry
    except Exception:
        return out
    return out
