"""Starting weights as a Megatron-LM ``--ckpt-format torch`` release checkpoint, for ``pretrain_gpt.py --load``.

    python examples/megatron_lm/release_ckpt.py init.safetensors ckpt
    python pretrain_gpt.py ... --load ckpt --finetune --no-load-optim --no-load-rng --ckpt-format torch

``init.safetensors`` holds a megatron-core GPTModel's weights under its own names (what
``examples/megatron_loop/train.py --save-init`` writes). The folder written is what Megatron-LM's ``save_checkpoint``
writes for a release at TP=1, PP=1:

* ``ckpt/latest_checkpointed_iteration.txt``: ``release``;
* ``ckpt/release/mp_rank_00/model_optim_rng.pt``: ``{"model": state_dict, "checkpoint_version": 3.0,
  "iteration": 0}``.

``checkpoint_version`` 3.0 is the one Megatron-LM writes today: below 2.0 it would re-order the rows of a legacy
``query_key_value`` weight on load (``fix_query_key_value_ordering``); megatron-core's ``linear_qkv`` is never
touched, so the rows stay as megatron-core packs them (per query group ``[q_g, k_g, v_g]``), as
``tensordiff ckpt convert --mapping mcore-mindformers-llama`` reads them.

Megatron-LM loads the model with ``strict=True``, and on any mismatch quietly loads again with ``strict=False``
(printing ``load_return: ...``). So the state dict must hold the very keys of ``GPTModel.state_dict()``: with the
local spec that is every weight plus ``_extra_state`` (``None``) of each parallel linear layer (``linear_qkv``,
``linear_proj``, ``linear_fc1``, ``linear_fc2``, ``output_layer``), which this script adds. Only tensors and
``None`` are saved, so ``torch.load(weights_only=True)`` reads it.
"""

from __future__ import annotations

import argparse
import os
import sys

#: the modules of megatron-core's local-spec GPTModel whose state dict has an ``_extra_state`` entry
LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "output_layer")


def state_dict(weights: dict) -> dict:
    """``weights`` with an ``_extra_state: None`` beside the weight of every parallel linear layer."""
    out = dict(weights)
    for name in weights:
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rpartition(".")[2] in LINEARS:
            out[module + "._extra_state"] = None
    return out


def write(weights: dict, folder: str) -> str:
    """Write the release checkpoint of ``weights`` into ``folder``; returns the ``.pt`` file's path."""
    import torch

    path = os.path.join(folder, "release", "mp_rank_00", "model_optim_rng.pt")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"model": state_dict(weights), "checkpoint_version": 3.0, "iteration": 0}, path)
    with open(os.path.join(folder, "latest_checkpointed_iteration.txt"), "w", encoding="utf-8") as f:
        f.write("release")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("weights", help="the weights, megatron-core names (.safetensors)")
    p.add_argument("folder", help="the checkpoint folder to write (pretrain_gpt.py --load FOLDER)")
    args = p.parse_args(argv)
    from safetensors.torch import load_file

    if not os.path.isfile(args.weights):
        print(f"release_ckpt.py: {args.weights}: no such file", file=sys.stderr)
        return 2
    weights = load_file(args.weights)
    path = write(weights, args.folder)
    print(f"release_ckpt.py: wrote {path}: {len(weights)} tensors, checkpoint_version 3.0, release")
    return 0


if __name__ == "__main__":
    sys.exit(main())
