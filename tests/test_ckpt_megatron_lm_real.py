"""tensordiff reads the --save folders that Megatron-LM's own pretrain_gpt.py (tag core_v0.16.1, megatron-core 0.16.1,
one H200, no Transformer Engine/Apex) wrote: examples/megatron_lm/ckpt_variants_gpu.sh, the same tiny GPT (2 layers,
hidden 64, 4 heads, seq 16, vocab 128, tied embeddings, FP32, weight decay 0.01) trained 6 iterations from seed 1234,
saved at 3 and 6, in every checkpoint layout: torch_dist with the distributed optimizer (its default dp_reshardable
buckets; one bucket and several), with --dist-ckpt-optim-fully-reshardable, without the distributed optimizer; torch
with distrib_optim.pt (one bucket, several) and without; bf16; and two resumes (--load --ckpt-step 3).

Two of them are in the repository, cut down (4 MB, ``tests/data/megatron_lm``, from one H100 run of the same script):
``dist_do`` (both saves) and ``dist`` (its iteration 6), so that CI reads a real torch_dist folder with and without
the distributed optimizer; the tests of the other layouts skip. All of them (23 MB): set TENSORDIFF_MLM_CKPTS to the
script's OUT."""

from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("torch")

from tensordiff.ckpt import megatron_dir

BUNDLED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "megatron_lm")
ROOT = os.environ.get("TENSORDIFF_MLM_CKPTS", "") or BUNDLED

FP32 = ["dist_do", "dist", "torch_do", "torch", "dist_do_buckets", "torch_do_buckets", "dist_do_full"]
WITH_DO = ["dist_do", "torch_do", "dist_do_buckets", "torch_do_buckets", "dist_do_full"]
WITHOUT_DO = ["dist", "torch"]
PARAMS = 28  # word + position embeddings, 2 layers x 12 (2 norms, qkv, proj, fc1, fc2: weight + bias), final norm
SHAPES = {"embedding.word_embeddings.weight": (128, 64), "embedding.position_embeddings.weight": (16, 64),
          "decoder.layers.1.self_attention.linear_qkv.weight": (192, 64),
          "decoder.layers.1.self_attention.linear_proj.weight": (64, 64),
          "decoder.layers.0.mlp.linear_fc1.weight": (128, 64), "decoder.layers.0.mlp.linear_fc2.weight": (64, 128),
          "decoder.layers.0.input_layernorm.weight": (64,), "decoder.final_layernorm.bias": (64,)}
#: the distributed and the plain optimizer do not round alike (same data, same seed): largest difference of a weight,
#: over that tensor's largest magnitude, seen 1.5e-4 at iteration 3 and 3.7e-4 at 6; the moments 5e-7
DO_VS_PLAIN = 1e-3

_cache: dict = {}


def held(name: str, iteration: int | None = None) -> None:
    """Skip unless ROOT holds this layout (and this save of it)."""
    folder = os.path.join(ROOT, name)
    if not os.path.isdir(folder) or (iteration is not None and iteration not in megatron_dir.iterations(folder)):
        pytest.skip(f"{name}{f' iteration {iteration}' if iteration else ''} is not in {ROOT} (the repository holds "
                    "dist_do and dist's iteration 6; TENSORDIFF_MLM_CKPTS: every layout)")


def load(name: str, iteration: int | None = None):
    held(name, iteration)
    key = (name, iteration)
    if key not in _cache:
        _cache[key] = megatron_dir.load_dir(os.path.join(ROOT, name), iteration)
    return _cache[key]


def split(tensors):
    model = {k: v for k, v in tensors.items() if not k.startswith("optimizer.")}
    moments = {k: v for k, v in tensors.items() if k.startswith(("optimizer.exp_avg.", "optimizer.exp_avg_sq."))}
    return model, moments


def rel(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) or 1.0))


@pytest.mark.parametrize("name", FP32 + ["dist_do_bf16", "dist_resume", "torch_resume"])
def test_every_layout_is_the_full_model_and_its_adam_moments(name):
    tensors, skipped, info = load(name)
    model, moments = split(tensors)
    assert len(model) == PARAMS
    for k, shape in SHAPES.items():
        assert model[k].shape == shape, (k, model[k].shape)
    assert "output_layer.weight" not in model  # tied to the word embeddings
    assert len(moments) == 2 * PARAMS
    for k, v in model.items():
        for state in ("exp_avg", "exp_avg_sq"):
            m = moments[f"optimizer.{state}.{k}"]
            assert m.shape == v.shape and m.dtype == np.float32
            assert np.abs(m).max() > 0, (name, state, k)
        assert (moments[f"optimizer.exp_avg_sq.{k}"] >= 0).all()
    assert info["iteration"] == 6 and info["step"] == 6
    assert info["tp"] == 1 and info["pp"] == 1
    assert "optimizer_note" not in info
    assert not [k for k, v in skipped.items() if v == "optimizer buffer"]
    fmt = "torch" if name.startswith("torch") else "torch_dist"
    assert info["format"] == fmt
    layout = {"dist_do": "dp_reshardable", "dist_do_buckets": "dp_reshardable", "dist_do_bf16": "dp_reshardable",
              "dist_do_full": "fully_reshardable"}.get(name)
    assert info.get("optimizer_layout") == layout
    assert info["args"]["use_distributed_optimizer"] is (name in WITH_DO or name == "dist_do_bf16")


def test_iterations_and_steps_of_each_save():
    held("dist_do")
    for name in FP32 + ["dist_do_bf16"]:
        if not os.path.isdir(os.path.join(ROOT, name)) or (ROOT == BUNDLED and name != "dist_do"):
            continue  # not held, or held cut down (dist: its last save only)
        assert sorted(megatron_dir.iterations(os.path.join(ROOT, name))) == [3, 6]
        _, _, info = load(name, 3)
        assert info["iteration"] == 3 and info["step"] == 3
    for name in ("dist_resume", "torch_resume"):  # resumed from iteration 3: saves only iteration 6
        if os.path.isdir(os.path.join(ROOT, name)):
            assert sorted(megatron_dir.iterations(os.path.join(ROOT, name))) == [6]


def test_several_buckets_were_really_saved():
    """--overlap-grad-reduce --ddp-bucket-size 10000: five buckets in the dp_reshardable folder, read the same as one"""
    import tensordiff.frameworks.torch_safe as torch_safe

    held("dist_do_buckets")
    meta = torch_safe.load_dcp_metadata(os.path.join(ROOT, "dist_do_buckets", "iter_0000006", ".metadata"))
    buckets = {k.split(".bucket_idx_")[1].split(".")[0] for k in meta.state_dict_metadata if ".bucket_idx_" in k}
    assert buckets == {"0", "1", "2", "3", "4"}
    one = load("dist_do")[0]
    for k, v in load("dist_do_buckets")[0].items():
        np.testing.assert_array_equal(v, one[k])


@pytest.mark.parametrize("iteration", [3, 6])
def test_the_distributed_optimizer_layouts_hold_identical_state(iteration):
    """dp_reshardable (one bucket, five), fully_reshardable, distrib_optim.pt (one bucket, several): the same
    training, bit for bit: the weights and both moments equal exactly"""
    ref = load("dist_do", iteration)[0]
    for name in WITH_DO[1:]:
        got = load(name, iteration)[0]
        assert sorted(got) == sorted(ref)
        for k, v in ref.items():
            np.testing.assert_array_equal(got[k], v, err_msg=f"{name} {k}")


@pytest.mark.parametrize("iteration", [3, 6])
def test_without_the_distributed_optimizer_torch_dist_and_torch_agree_and_stay_close(iteration):
    plain = load("dist", iteration)[0]
    ref = load("dist_do", iteration)[0]
    worst = max(rel(plain[k], ref[k]) for k in ref if not k.startswith("optimizer."))
    assert 0 < worst < DO_VS_PLAIN
    assert max(rel(plain[k], ref[k]) for k in ref if k.startswith("optimizer.exp_avg")) < 1e-5
    if os.path.isdir(os.path.join(ROOT, "torch")):  # not in the repository's cut-down copy
        for k, v in load("torch", iteration)[0].items():
            np.testing.assert_array_equal(v, plain[k], err_msg=k)


def test_a_resume_from_iteration_3_reaches_the_same_iteration_6():
    for name, base in (("dist_resume", "dist"), ("torch_resume", "torch")):
        ref = load(base)[0]
        got, _, info = load(name)
        assert info["args"]["ckpt_step"] == 3
        for k, v in ref.items():
            np.testing.assert_array_equal(got[k], v, err_msg=f"{name} {k}")


def test_bf16_weights_with_fp32_main_parameters_from_the_buckets():
    tensors, _, info = load("dist_do_bf16")
    model, _ = split(tensors)
    assert {str(v.dtype) for v in model.values()} == {"bfloat16"}
    mains = {k[len("optimizer.fp32_param."):]: v for k, v in tensors.items() if k.startswith("optimizer.fp32_param.")}
    assert sorted(mains) == sorted(model)
    for k, v in model.items():
        assert mains[k].dtype == np.float32
        np.testing.assert_array_equal(mains[k].astype(v.dtype), v)  # the weight is its main parameter, rounded
    assert info["args"]["bf16"] is True
    fp32 = load("dist_do")[0]
    # bf16 training parts from FP32 a little (seen: 6e-2 of a weight matrix's largest magnitude at iteration 6)
    assert max(rel(mains[k], fp32[k]) for k in model if k.endswith(".weight") and "norm" not in k) < 0.1
