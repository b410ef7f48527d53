"""Megatron-LM's parameter-gradient files, written by the loop as Megatron-LM writes them (its flag, its layout):
``--save-wgrads-interval N``: every Nth iteration, each parameter's reduced gradient (``main_grad``, after the
data-parallel reduction, before the optimizer step) to ``SAVE/wgrads/iter_NNNNNNN/mp_rank_TT[_PPP].pth``, a
``torch.save({"model_chunk0": {name: tensor}})`` written by data-parallel rank 0. ``tensordiff diff`` reads the
``--save`` folder as a capture (``tensordiff.store.MegatronGradDump``).

Megatron-LM's ``--save-dgrads-interval`` (full backward hooks on the linear layers) is not offered: on megatron-core's
local output layer the hook's view meets the vocab-parallel cross entropy's in-place update and autograd refuses it
(Megatron-LM registers its hooks on that layer too; not tried there).
"""

from __future__ import annotations

import argparse
import os

import torch


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--save-wgrads-interval", type=int, help="write the parameters' reduced gradients every N iterations "
                   "under --save (Megatron-LM's wgrads files)")


def due(interval: int | None, iteration: int) -> bool:
    return bool(interval) and iteration % int(interval) == 0


def write(save: str, kind: str, iteration: int, state: dict[str, torch.Tensor]) -> None:
    """One rank's file of ``kind`` (wgrads, dgrads) for ``iteration``, where Megatron-LM puts it."""
    from megatron.core import parallel_state

    if parallel_state.get_data_parallel_rank() != 0:
        return
    folder = os.path.join(save, kind, f"iter_{iteration:07d}")
    os.makedirs(folder, exist_ok=True)
    name = f"mp_rank_{parallel_state.get_tensor_model_parallel_rank():02d}"
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        name += f"_{parallel_state.get_pipeline_model_parallel_rank():03d}"
    torch.save({"model_chunk0": state}, os.path.join(folder, name + ".pth"))


def weight_grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.main_grad.cpu() for name, p in module.named_parameters()
            if getattr(p, "main_grad", None) is not None}
