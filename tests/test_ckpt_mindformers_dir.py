"""``tensordiff.ckpt.mindformers_dir`` on folders the real MindFormers 1.9 Trainer wrote (``tests/mf_ckpt_runs.py``:
llama_tiny.yaml, 6 steps, a save every 2, in the legacy layout and the checkpoint 2.0 layout), and the one-line errors
for folders that are incomplete or damaged."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil

import numpy as np
import pytest

for _name in ("mindspore", "mindformers"):  # find, do not import (MindFormers writes ./output/log)
    if importlib.util.find_spec(_name) is None:
        pytest.skip(f"{_name} is not installed", allow_module_level=True)

import mf_ckpt_runs as runs  # noqa: E402

from tensordiff.ckpt import files as ckpt_files  # noqa: E402
from tensordiff.ckpt.mindformers_dir import is_mindformers_dir, iterations, load_dir  # noqa: E402
from tensordiff.cli import main  # noqa: E402
from tensordiff.errors import CheckpointError  # noqa: E402

WEIGHTS = 21
FILES = {s: f"llama_tiny_rank_0-{s}_1.ckpt" for s in (2, 4, 6)}


@pytest.fixture(scope="module")
def legacy():
    return runs.run("legacy")


@pytest.fixture(scope="module")
def v2():
    return runs.run("v2")


def _error(path, step=None) -> str:
    with pytest.raises(CheckpointError) as err:
        load_dir(str(path), step)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_iterations_lists_the_saved_steps(legacy, v2):
    rank0 = os.path.join(legacy.checkpoint, "rank_0")
    expected = {s: os.path.join(rank0, f) for s, f in FILES.items()}
    for path in (os.path.dirname(legacy.checkpoint), legacy.checkpoint, rank0):  # output/, checkpoint/, rank_0/
        assert is_mindformers_dir(path) and iterations(path) == expected
    folders = {s: os.path.join(v2.checkpoint, f"iteration_{s:08d}") for s in (2, 4, 6)}
    assert iterations(os.path.dirname(v2.checkpoint)) == iterations(v2.checkpoint) == folders
    assert iterations(folders[4]) == {4: folders[4]}
    assert not is_mindformers_dir(os.path.join(rank0, FILES[2])) and not is_mindformers_dir(legacy.folder)


def test_load_dir_legacy_is_what_mindspore_loads(legacy):
    import mindspore as ms

    tensors, skipped, info = load_dir(legacy.checkpoint, step=4)
    file = os.path.join(legacy.checkpoint, "rank_0", FILES[4])
    direct = {k: v.asnumpy() for k, v in ms.load_checkpoint(file).items()}
    assert sorted(skipped) == sorted(["epoch_num", "step_num", "global_step", "loss_scale", "scale_sense",
                                      "global_batch_size"])
    assert sorted(tensors) == sorted(set(direct) - set(skipped)) and len(tensors) == 3 * WEIGHTS
    assert all(np.array_equal(tensors[k], direct[k]) for k in tensors)
    assert len([k for k in tensors if k.startswith("adam_m.")]) == len([k for k in tensors if k.startswith("adam_v.")]) \
        == WEIGHTS
    assert np.abs(tensors["adam_m.model.layers.0.attention.wq.weight"]).max() > 0
    assert tensors["adam_v.lm_head.weight"].min() > 0
    assert info == {"format": "mindformers-ckpt", "path": file, "step": 4, "steps": [2, 4, 6], "epoch": 4,
                    "step_num": 4, "global_step": 4, "loss_scale": 1.0, "global_batch_size": 2,
                    "learning_rate": None, "ranks": [0], "rank": 0, "parallel": "one rank"}
    assert load_dir(legacy.checkpoint)[2]["step"] == 6  # the last save by default


def test_load_dir_v2_equals_the_legacy_run(legacy, v2):
    """The two layouts of the same training: the same numbers at every saved step."""
    for step in (2, 6):
        a, _, _ = load_dir(legacy.checkpoint, step)
        b, skipped, info = load_dir(os.path.dirname(v2.checkpoint), step)
        assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)
        assert skipped == {"global_step": "int32 (1,) (in info)"}
        assert (info["format"], info["step"], info["epoch"], info["global_step"], info["loss_scale"]) == \
            ("mindformers-2.0", step, step, step, 1.0)


def test_data_parallel_ranks_read_rank_0_and_sharded_ones_are_refused(legacy, tmp_path):
    from tensordiff.frameworks.mindspore import save_checkpoint

    ckpt = tmp_path / "checkpoint"
    shutil.copytree(legacy.checkpoint, ckpt)
    shutil.copytree(ckpt / "rank_0", ckpt / "rank_1")  # what a data-parallel run writes: the same tensors
    for f in FILES.values():
        os.rename(ckpt / "rank_1" / f, ckpt / "rank_1" / f.replace("rank_0", "rank_1"))
    info = load_dir(str(ckpt), 4)[2]
    assert info["ranks"] == [0, 1] and info["parallel"] == \
        "2 ranks with the same names and shapes (data-parallel replicas): rank 0 read"
    shard = dict(ckpt_files.load(str(ckpt / "rank_1" / "llama_tiny_rank_1-4_1.ckpt")))
    shard["model.layers.0.attention.wq.weight"] = shard["model.layers.0.attention.wq.weight"][:32]
    shard["step_num"] = np.array(4, np.int64)
    os.remove(ckpt / "rank_1" / "llama_tiny_rank_1-4_1.ckpt")
    save_checkpoint(shard, str(ckpt / "rank_1" / "llama_tiny_rank_1-4_1.ckpt"))
    assert _error(ckpt, 4) == (
        f"{ckpt}: the ranks hold sharded tensors (model.layers.0.attention.wq.weight is (64, 64) in rank 0, (32, 64) "
        "in rank 1), which tensordiff does not join: merge them with mindspore.parallel.transform_checkpoints("
        "checkpoint_dir, out_dir, prefix, src_strategy_file=<output>/strategy/ckpt_strategy.ckpt, "
        "dst_strategy_file=None) and pass the merged .ckpt")


def test_bad_folders_say_what_is_missing(legacy, v2, tmp_path):
    assert _error(legacy.checkpoint, 3) == f"{legacy.checkpoint}: no checkpoint of step 3; saved steps: 2, 4, 6"
    no_rank0 = tmp_path / "a" / "checkpoint"
    shutil.copytree(os.path.join(legacy.checkpoint, "rank_0"), no_rank0 / "rank_1")
    assert _error(no_rank0) == (f"{no_rank0}: no rank_0 folder (holds rank_1); pass the rank_R folder to read, or "
                                "copy rank_0 back")
    empty = tmp_path / "b" / "checkpoint" / "rank_0"
    empty.mkdir(parents=True)
    shutil.copy(os.path.join(legacy.checkpoint, "rank_0", "meta.json"), empty)
    assert _error(empty.parent) == (
        f"{empty.parent}: no saved step (it holds meta.json); the Trainer saves with a CheckpointMonitor entry in the "
        "YAML's callbacks (save_checkpoint_steps: N)")
    cut = tmp_path / "c" / "checkpoint" / "rank_0"
    shutil.copytree(os.path.join(legacy.checkpoint, "rank_0"), cut)
    data = (cut / FILES[6]).read_bytes()
    os.remove(cut / FILES[6])
    (cut / FILES[6]).write_bytes(data[: len(data) // 2])
    message = _error(cut.parent)
    assert message.startswith(f"{cut / FILES[6]}: not a readable MindSpore checkpoint (") and message.endswith(
        "; is it truncated (a run stopped while saving)? delete it")
    shutil.rmtree(cut.parent.parent)
    it = tmp_path / "d" / "iteration_00000004"
    shutil.copytree(os.path.join(v2.checkpoint, "iteration_00000004"), it)
    os.remove(it / "llama_tiny-model-0000000-0000001.safetensors")
    assert _error(it) == (f"{it}: no PREFIX-model-NNNNNNN-NNNNNNN.safetensors (it holds common.json, "
                          "llama_tiny-opt-0000000-0000001.safetensors); an iteration folder of an unfinished save? "
                          "load another step")
    from tensordiff.frameworks.mindspore import save_checkpoint

    bare = tmp_path / "e" / "rank_0"
    bare.mkdir(parents=True)
    save_checkpoint({"w": np.ones(3, np.float32)}, str(bare / "net_rank_0-3_2.ckpt"))  # not a CheckpointMonitor's
    with pytest.raises(CheckpointError, match=r"net_rank_0-3_2\.ckpt: holds no step_num or global_step entry \(not "
                       r"saved by MindFormers' CheckpointMonitor\?\); its name says epoch 3, step 2 of that epoch, not a "
                       r"global step: pass the file itself$"):
        iterations(str(bare))
    assert _error(tmp_path) == (f"{tmp_path}: not a MindFormers checkpoint folder: no rank_R/ or iteration_NNNNNNNN/ "
                                "folder (it holds a, b, d, e); pass the Trainer's output/checkpoint folder")


def test_ckpt_diff_and_convert_take_the_folders(legacy, v2, tmp_path, capsys):
    assert main(["ckpt", "diff", os.path.dirname(legacy.checkpoint), v2.checkpoint]) == 0
    assert "63 tensors: 63 identical, 0 within tolerance, 0 differ" in capsys.readouterr().out
    out = tmp_path / "step6.safetensors"
    assert main(["ckpt", "convert", legacy.checkpoint, str(out), "--mapping", "mcore-mindformers-llama", "--var",
                 "heads=4", "--var", "groups=2"]) == 0
    assert "42 ignored by the table (adam_m.model.tok_embeddings.embedding_weight" in " ".join(
        capsys.readouterr().out.split())  # the table maps weights only: the Adam moments are left out
    converted = ckpt_files.load(str(out))
    assert len(converted) == 15 and np.array_equal(converted["output_layer.weight"],
                                                   load_dir(legacy.checkpoint)[0]["lm_head.weight"])
    empty = tmp_path / "checkpoint" / "rank_0"
    empty.mkdir(parents=True)
    assert main(["ckpt", "diff", str(empty.parent), v2.checkpoint]) == 2
    assert capsys.readouterr().err.count("\n") == 1


# ------------------------------------------------------------------ resuming (the same Trainer runs)
# The MindFormers 1.9 Trainer saves a checkpoint every 2 steps and resumes from one with the same numbers.
#
# Real Trainer runs (``tests/mf_ckpt_runs.py``: llama_tiny.yaml, random weights, seed 0, one batch repeated every step,
# 6 steps, ``CheckpointMonitor`` with ``save_checkpoint_steps: 2``), in both layouts 1.9 writes:
#
# * legacy (the default): ``load_checkpoint: <run>/output/checkpoint`` (the folder holding rank_0/) and
#   ``resume_training: llama_tiny_rank_0-4_1.ckpt`` resume at step 5;
# * checkpoint 2.0 (``use_legacy_format: False``): ``load_checkpoint: <run>/output/checkpoint/iteration_00000002``,
#   ``resume_training: True``, ``load_ckpt_format: safetensors`` resume at step 3.
#
# The resumed steps print the uninterrupted run's losses and global norms, and the last checkpoint of the resumed run
# holds the same weights and Adam moments bit for bit. The facts: /work/shared/notes/mindformers-checkpoints.md.

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
