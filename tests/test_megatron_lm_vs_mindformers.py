"""Megatron-LM's pretrain_gpt.py (GPU) against the MindFormers Trainer (CPU), examples/megatron_lm/vs_mindformers*:
the starting weights as a Megatron-LM release checkpoint that loads strictly, the Trainer's YAML for
pretrain_gpt.py's mock data, and (with a GPU, a Megatron-LM checkout and MindFormers) the whole pair: agree, and a
fault on Megatron-LM's side found at its module."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples", "megatron_lm")
sys.path.insert(0, EXAMPLES)

import release_ckpt  # noqa: E402
import vs_mindformers  # noqa: E402

LOAD = """
import sys, torch, torch.distributed as dist
sys.path.insert(0, {root!r})
from tensordiff.compat.megatron_cpu import enable
enable()
from megatron.core import parallel_state, tensor_parallel
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
parallel_state.initialize_model_parallel(1)
tensor_parallel.model_parallel_cuda_manual_seed(1, inference_rng_tracker=True, force_reset_rng=True)
from examples.distributed.mcore_train import build
model = build(1, 7)  # other weights than the checkpoint's: loading must replace every one
state = torch.load({path!r}, map_location="cpu", weights_only=True)  # as Megatron-LM's torch.load reads it
print(model.load_state_dict(state["model"], strict=True))
print("version", state["checkpoint_version"], "iteration", state["iteration"])
from safetensors.torch import load_file
init = load_file({init!r})
print("equal", all(torch.equal(p, init[n]) for n, p in model.named_parameters()), len(init))
"""


def _env():
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")


def test_release_checkpoint_keys_are_the_state_dicts():
    import numpy as np

    weights = {"embedding.word_embeddings.weight": np.zeros(2), "decoder.layers.0.self_attention.linear_qkv.weight": 1,
               "decoder.layers.0.input_layernorm.weight": 2, "decoder.layers.0.mlp.linear_fc1.weight": 3,
               "output_layer.weight": 4}
    sd = release_ckpt.state_dict(weights)
    extra = sorted(k for k in sd if k not in weights)
    assert extra == ["decoder.layers.0.mlp.linear_fc1._extra_state",
                     "decoder.layers.0.self_attention.linear_qkv._extra_state", "output_layer._extra_state"]
    assert all(sd[k] is None for k in extra)


def test_release_checkpoint_loads_strictly_into_megatron_cores_gpt(tmp_path):
    for name in ("megatron.core", "safetensors"):
        if importlib.util.find_spec(name.split(".")[0]) is None:
            pytest.skip(f"{name} is not installed")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "megatron_loop", "train.py"), "--save-init",
                           "init.safetensors", "--steps", "0", "--batch", "2"], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert release_ckpt.main([str(tmp_path / "init.safetensors"), str(tmp_path / "ckpt")]) == 0
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "release"
    pt = tmp_path / "ckpt" / "release" / "mp_rank_00" / "model_optim_rng.pt"
    code = LOAD.format(root=ROOT, path=str(pt), init=str(tmp_path / "init.safetensors"))
    proc = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "<All keys matched successfully>" in proc.stdout  # what Megatron-LM's strict load needs
    assert "version 3.0 iteration 0" in proc.stdout and "equal True 15" in proc.stdout


def test_trainer_yaml_for_pretrain_gpts_mock_data(tmp_path):
    path = tmp_path / "llama_tiny.yaml"
    vs_mindformers.write_config(str(path))
    text = path.read_text()
    with open(os.path.join(ROOT, "examples", "launchers", "llama_tiny.yaml"), encoding="utf-8") as f:
        base = f.read()
    assert "pad_token_id: -1" in text and "pad_token_id: 0" not in text  # mock data holds id 0; Megatron pads with -1
    assert "  epochs: 1 " in text  # one pass over the rows: each step the next 2, as Megatron-LM's iterations
    changed = [(a, b) for a, b in zip(base.splitlines(), text.splitlines()) if a != b]
    assert len(changed) == 2 and len(base.splitlines()) == len(text.splitlines())


def test_compare_without_the_gpu_captures_says_what_is_missing(tmp_path, capsys):
    assert vs_mindformers.main(["compare", "--out", str(tmp_path)]) == 2
    assert "needs init.safetensors (prepare) and megatron.h5 (vs_mindformers_gpu.sh)" in capsys.readouterr().err


MEGATRON_LM = os.environ.get("MEGATRON_LM")


@pytest.mark.skipif(not MEGATRON_LM or not os.path.exists(os.path.join(MEGATRON_LM or "", "pretrain_gpt.py")),
                    reason="MEGATRON_LM (a Megatron-LM checkout, tag core_v0.16.1) not set")
@pytest.mark.skipif(not shutil.which("nvidia-smi"), reason="pretrain_gpt.py needs a CUDA GPU")
@pytest.mark.skipif(importlib.util.find_spec("mindformers") is None, reason="MindFormers is not installed")
def test_pretrain_gpt_on_a_gpu_agrees_with_the_trainer_and_a_norm_epsilon_is_found(tmp_path):
    out = str(tmp_path)
    assert vs_mindformers.main(["prepare", "--out", out]) == 0
    proc = subprocess.run(["bash", os.path.join(EXAMPLES, "vs_mindformers_gpu.sh"), os.path.join(out, "ckpt"), out,
                           "none", "norm-eps"], capture_output=True, text=True,
                          env=dict(_env(), PYTHON=sys.executable), timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "padded vocab (size: 128) with 0 dummy tokens (new size: 128)" in proc.stdout
    assert "loading release checkpoint" in proc.stdout and "load_return" not in proc.stdout
    assert vs_mindformers.main(["compare", "--out", out]) == 0
    with open(os.path.join(out, "report.json")) as f:
        clean = json.load(f)
    assert clean["outcome"] == "agree" and clean["summary"]["diverged"] == 0 and clean["summary"]["ok"] >= 160
    with open(os.path.join(out, "report-norm-eps.json")) as f:
        fault = json.load(f)
    assert fault["first_divergence"]["module_a"].endswith("decoder.layers.0.input_layernorm")
    assert fault["hints"][0]["cause"] == "norm-epsilon"
