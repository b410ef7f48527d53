"""The MindFormers 1.9 Trainer saves a checkpoint every 2 steps and resumes from one with the same numbers.

Real Trainer runs (``tests/mf_ckpt_runs.py``: llama_tiny.yaml, random weights, seed 0, one batch repeated every step,
6 steps, ``CheckpointMonitor`` with ``save_checkpoint_steps: 2``), in both layouts 1.9 writes:

* legacy (the default): ``load_checkpoint: <run>/output/checkpoint`` (the folder holding rank_0/) and
  ``resume_training: llama_tiny_rank_0-4_1.ckpt`` resume at step 5;
* checkpoint 2.0 (``use_legacy_format: False``): ``load_checkpoint: <run>/output/checkpoint/iteration_00000002``,
  ``resume_training: True``, ``load_ckpt_format: safetensors`` resume at step 3.

The resumed steps print the uninterrupted run's losses and global norms, and the last checkpoint of the resumed run
holds the same weights and Adam moments bit for bit. The facts: /work/shared/notes/mindformers-checkpoints.md.
"""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest

for _name in ("mindspore", "mindformers"):  # find, do not import (MindFormers writes ./output/log)
    if importlib.util.find_spec(_name) is None:
        pytest.skip(f"{_name} is not installed", allow_module_level=True)

import mf_ckpt_runs as runs  # noqa: E402

#: (loss, global norm) of steps 1..6 as the Trainer prints them (6 decimals for the loss)
LOSSES = {1: (4.873266, 2.2048316), 2: (4.705645, 1.9555113), 3: (4.574961, 1.8185508), 4: (4.461069, 1.7576478),
          5: (4.355036, 1.732501), 6: (4.253455, 1.6957887)}
WEIGHTS = 21  # the tiny legacy Llama's parameters


def _close(losses: dict, expected: dict) -> bool:
    """Same steps, each (loss, norm) within 1e-6 of the expected."""
    return sorted(losses) == sorted(expected) and all(
        abs(a - b) <= 1e-6 for s in expected for a, b in zip(losses[s], expected[s]))


def _ckpt(path: str) -> dict[str, np.ndarray]:
    from tensordiff.frameworks.mindspore import load_checkpoint

    return load_checkpoint(path)[0]


def _safetensors(path: str) -> dict[str, np.ndarray]:
    from tensordiff.ckpt.files import load

    return load(path)


@pytest.fixture(scope="module")
def legacy():
    return runs.run("legacy")


@pytest.fixture(scope="module")
def v2():
    return runs.run("v2")


def test_legacy_layout_every_2_steps(legacy):
    rank0 = os.path.join(legacy.checkpoint, "rank_0")
    assert sorted(os.listdir(legacy.checkpoint)) == ["rank_0"]
    assert sorted(os.listdir(rank0)) == ["llama_tiny_rank_0-2_1.ckpt", "llama_tiny_rank_0-4_1.ckpt",
                                         "llama_tiny_rank_0-6_1.ckpt", "meta.json"]
    with open(os.path.join(rank0, "meta.json")) as f:
        assert json.load(f) == {"last_epoch": 6, "last_step": 1, "last_ckpt_file": "llama_tiny_rank_0-6_1.ckpt"}
    assert _close(legacy.losses, LOSSES)
    t = _ckpt(os.path.join(rank0, "llama_tiny_rank_0-4_1.ckpt"))
    weights = [k for k in t if k.startswith(("model.", "lm_head."))]
    assert len(weights) == WEIGHTS and t["model.tok_embeddings.embedding_weight"].shape == (128, 64)
    assert sorted(k for k in t if k.startswith("adam_m.")) == sorted("adam_m." + k for k in weights)
    assert sorted(k for k in t if k.startswith("adam_v.")) == sorted("adam_v." + k for k in weights)
    scalars = {k: t[k].tolist() for k in set(t) - set(weights) if not k.startswith("adam_")}
    assert scalars == {"global_step": [4], "epoch_num": 4, "step_num": 4, "scale_sense": 1.0, "loss_scale": 1.0,
                       "global_batch_size": 2}
    assert t["global_step"].dtype == np.int32 and t["step_num"].dtype == np.int64
    assert t["adam_v.lm_head.weight"].min() > 0 and np.abs(t["adam_m.lm_head.weight"]).max() > 1e-4


def test_legacy_resume_from_step_4_repeats_steps_5_and_6(legacy):
    resumed = runs.run("legacy-resume")
    assert "dataset skip 4 steps." in resumed.stdout
    assert sorted(resumed.losses) == [5, 6]
    assert resumed.losses == {s: legacy.losses[s] for s in (5, 6)}
    name = "rank_0/llama_tiny_rank_0-6_1.ckpt"
    a, b = _ckpt(os.path.join(legacy.checkpoint, name)), _ckpt(os.path.join(resumed.checkpoint, name))
    assert sorted(a) == sorted(b) and len(a) == 3 * WEIGHTS + 6
    assert [k for k in a if not np.array_equal(a[k], b[k])] == []
    assert b["global_step"].tolist() == [6] and b["step_num"] == 6


def test_v2_layout_every_2_steps(v2):
    assert sorted(os.listdir(v2.checkpoint)) == ["iteration_00000002", "iteration_00000004", "iteration_00000006",
                                                 "latest_checkpointed_iteration.txt"]
    with open(os.path.join(v2.checkpoint, "latest_checkpointed_iteration.txt")) as f:
        assert f.read() == "6"
    it = os.path.join(v2.checkpoint, "iteration_00000004")
    assert sorted(os.listdir(it)) == ["common.json", "llama_tiny-model-0000000-0000001.safetensors",
                                      "llama_tiny-opt-0000000-0000001.safetensors"]
    with open(os.path.join(it, "common.json")) as f:
        assert json.load(f) == {"epoch_num": 4, "step_num": 4, "global_step": 4, "loss_scale": 1.0,
                                "global_batch_size": 2, "ckpt_status": None}
    model = _safetensors(os.path.join(it, "llama_tiny-model-0000000-0000001.safetensors"))
    opt = _safetensors(os.path.join(it, "llama_tiny-opt-0000000-0000001.safetensors"))
    assert len(model) == WEIGHTS and sorted(opt) == sorted(
        ["global_step"] + [f"adam_{m}.{k}" for m in "mv" for k in model])
    assert opt["global_step"].tolist() == [4]
    assert _close(v2.losses, LOSSES)


def test_v2_resume_from_iteration_2_repeats_steps_3_to_6(v2):
    resumed = runs.run("v2-resume")
    assert "dataset skip 2 steps." in resumed.stdout
    assert resumed.losses == {s: v2.losses[s] for s in (3, 4, 5, 6)}
    for kind in ("model", "opt"):
        name = f"iteration_00000006/llama_tiny-{kind}-0000000-0000001.safetensors"
        with open(os.path.join(v2.checkpoint, name), "rb") as a, open(os.path.join(resumed.checkpoint, name), "rb") as b:
            assert a.read() == b.read()
