"""tensordiff.compat.mindformers_cpu: real MindFormers 1.9 models train on the MindSpore 2.9 CPU (PyNative, FP32).

The ``build_*`` functions and ``train_step`` below are the working config-construction code for the three models
(tiny: 2 layers, hidden 64, 4 heads, vocab 128, seq 16, batch 2); reuse them.
"""
import atexit
import os
import shutil
import tempfile

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")

# Importing MindFormers creates ./output/log under the current directory: import it from a scratch directory.
_import_dir = tempfile.mkdtemp(prefix="tensordiff-mindformers-import-")
atexit.register(shutil.rmtree, _import_dir, True)
_cwd = os.getcwd()
os.chdir(_import_dir)
try:
    mindformers = pytest.importorskip("mindformers")
finally:
    os.chdir(_cwd)

from mindspore import Tensor, ops  # noqa: E402

from tensordiff.compat import mindformers_cpu as mfc  # noqa: E402

VOCAB, SEQ, BATCH = 128, 16, 2

FP32 = dict(compute_dtype="float32", params_dtype="float32", layernorm_compute_dtype="float32",
            softmax_compute_dtype="float32", rotary_dtype="float32")


# ------------------------------------------------------------------------------------------------
# working model construction (call mfc.init_mindformers_cpu first; see the fixtures)


def build_gpt_model(num_query_groups=4):
    """megatron-style parallel_core GPTModel: RMSNorm, SwiGLU, RoPE, no bias, fp32, no flash attention, dropout 0."""
    from mindformers.parallel_core.training_graph.base_models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from mindformers.parallel_core.training_graph.base_models.gpt.gpt_model import GPTModel
    from mindformers.parallel_core.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=num_query_groups,
        seq_length=SEQ, vocab_size=VOCAB, position_embedding_type="rope", normalization="RMSNorm",
        gated_linear_unit=True, hidden_act="silu", add_bias_linear=False, use_flash_attention=False,
        hidden_dropout=0.0, attention_dropout=0.0, pad_token_id=0, **FP32)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                     max_sequence_length=64, position_embedding_type="rope")
    model.set_train(True)
    return model


def build_qwen3_model():
    """TrainingQwen3ForCausalLM with GQA (4 heads, 2 KV groups) and qk-norm (always on for Qwen3)."""
    from mindformers.models.qwen3.configuration_qwen3 import Qwen3Config
    from mindformers.models.qwen3.modeling_qwen3_train import TrainingQwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, seq_length=SEQ, pad_token_id=0,
        use_flash_attention=False, hidden_dropout=0.0, attention_dropout=0.0, **FP32)
    model = TrainingQwen3ForCausalLM(config)
    model.set_train(True)
    return model


def build_legacy_llama(n_kv_heads=4):
    """Legacy mindformers.LlamaForCausalLM; needs init_mindformers_cpu(use_legacy=True) before building."""
    from mindformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        batch_size=BATCH, seq_length=SEQ, hidden_size=64, num_layers=2, num_heads=4, n_kv_heads=n_kv_heads,
        vocab_size=VOCAB, intermediate_size=128, max_position_embedding=64, pad_token_id=0,
        compute_dtype="float32", layernorm_compute_type="float32", softmax_compute_type="float32",
        rotary_dtype="float32", param_init_type="float32", embedding_init_type="float32",
        use_flash_attention=False, fused_rms_norm=False, use_rope_slice=True)
    model = LlamaForCausalLM(config)
    model.set_train(True)
    return model


def batch(seed=0, length=SEQ):
    """Token ids and labels in [1, VOCAB): id 0 is the pad id, masked out of the loss."""
    rs = np.random.RandomState(seed)
    ids = Tensor(rs.randint(1, VOCAB, (BATCH, length)), ms.int32)
    labels = Tensor(rs.randint(1, VOCAB, (BATCH, length)), ms.int32)
    return ids, labels


def train_step(model, ids, labels=None):
    """One forward + value_and_grad over the trainable parameters: (loss float, {param name: grad ndarray}).

    parallel_core models in train mode return (loss, mtp_loss, extra_loss, attention_loss), each of shape (1,);
    the legacy Llama returns the loss alone (shape (1,)) and shifts its labels internally (ids: [B, S+1]).
    """
    if labels is None:
        def loss_fn(x):
            return model(x)
    else:
        def loss_fn(x):
            return model(x, labels=labels)[0]
    params = model.trainable_params()
    loss, grads = ms.value_and_grad(loss_fn, None, params)(ids)
    return float(loss.asnumpy().reshape(-1)[0]), {p.name: g.asnumpy() for p, g in zip(params, grads)}


def assert_trains(loss, grads, names):
    assert np.isfinite(loss) and 3.0 < loss < 7.0  # ~ln(128) = 4.85 at init
    assert sorted(grads) == sorted(names)
    for name, grad in grads.items():
        assert np.isfinite(grad).all(), name
        assert np.abs(grad).max() > 0, name


def gpt_param_names(n_layers=2, qk_norm=False):
    names = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"]
    per_layer = ["input_layernorm.weight", "self_attention.linear_proj.weight", "self_attention.linear_qkv.weight",
                 "pre_mlp_layernorm.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
    if qk_norm:
        per_layer += ["self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"]
    return names + [f"decoder.layers.{i}.{p}" for i in range(n_layers) for p in per_layer]


# ------------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(autouse=True)
def _restore_fixes():
    """Every test starts and ends with no fix active."""
    mfc.disable()
    yield
    mfc.disable()


@pytest.fixture
def parallel_core(monkeypatch, tmp_path):
    """cwd in tmp (MindFormers writes ./output), PyNative CPU, seed 0, use_legacy=False."""
    monkeypatch.chdir(tmp_path)
    mfc.init_mindformers_cpu(seed=0)


@pytest.fixture
def legacy(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    mfc.init_mindformers_cpu(seed=0, use_legacy=True)
    yield
    mfc.init_mindformers_cpu(seed=0)


# ------------------------------------------------------------------------------------------------
# API


def _expected_targets():
    """The swapped attributes, found independently of the module under test."""
    from mindformers.parallel_core.training_graph.transformer.attention import Attention
    from mindspore.mint.nn import functional as mint_f
    from mindspore.ops.auto_generate import gen_ops_prim as g
    from mindspore.ops.operations.debug_ops import Morph

    return {
        "morph": (Morph, "__call__"), "embedding": (mint_f, "embedding"), "outer": (g.Outer, "__call__"),
        "rms_norm": (g.RmsNorm, "__call__"), "flash_attention": (g.FlashAttentionScore, "__call__"),
        "one_hot": (g.OneHotExt, "__call__"), "zeros_like": (g.ZerosLikeExt, "__call__"),
        "split_with_size": (g.SplitWithSize, "__call__"), "repeat_kv": (Attention, "_repeat_kv"),
    }


def test_fix_names():
    assert mfc.FIXES == ("morph", "embedding", "outer", "rms_norm", "flash_attention", "one_hot", "zeros_like",
                         "split_with_size", "repeat_kv")
    assert set(_expected_targets()) == set(mfc.FIXES)
    with pytest.raises(ValueError, match="no_such_fix"):
        mfc.enable(exclude=("no_such_fix",))
    assert not mfc.is_enabled()


def test_enable_disable_restores_identical_originals():
    targets = _expected_targets()
    originals = {name: vars(owner)[attr] for name, (owner, attr) in targets.items()}
    assert mfc.swap_targets() == {name: [target] for name, target in targets.items()}

    assert mfc.enable() == mfc.FIXES
    assert mfc.enable() == mfc.FIXES  # idempotent
    assert mfc.is_enabled() and mfc.enabled_fixes() == mfc.FIXES
    for name, (owner, attr) in targets.items():
        assert vars(owner)[attr] is not originals[name], name

    mfc.disable()
    assert not mfc.is_enabled() and mfc.enabled_fixes() == ()
    for name, (owner, attr) in targets.items():
        assert vars(owner)[attr] is originals[name], name
    mfc.disable()  # no-op
    assert not mfc.is_enabled()


def test_context_manager_exact_set_and_previous_state():
    owner, attr = _expected_targets()["split_with_size"]
    original = vars(owner)[attr]
    mfc.enable(fixes=("split_with_size", "outer"))
    with mfc.mindformers_cpu(exclude=("split_with_size",)) as active:
        assert active == tuple(f for f in mfc.FIXES if f != "split_with_size")
        assert vars(owner)[attr] is original
    assert mfc.enabled_fixes() == ("outer", "split_with_size")
    mfc.disable()
    with mfc.mindformers_cpu():
        assert mfc.enabled_fixes() == mfc.FIXES
    assert not mfc.is_enabled()


def test_missing_target_raises_and_changes_nothing(monkeypatch):
    from mindformers.parallel_core.training_graph.transformer.attention import Attention

    monkeypatch.delattr(Attention, "_repeat_kv")
    with pytest.raises(RuntimeError, match=r"_repeat_kv.*mindspore 2\.\d.*mindformers 1\.\d"):
        mfc.enable()
    assert not mfc.is_enabled()
    assert mfc.enable(exclude=("repeat_kv",)) == tuple(f for f in mfc.FIXES if f != "repeat_kv")


def test_init_twice(parallel_core):
    mfc.init_mindformers_cpu(seed=3)
    mfc.init_mindformers_cpu(seed=3)
    from mindformers.core.context.build_context import is_legacy_model

    assert ms.get_context("mode") == ms.PYNATIVE_MODE
    assert ms.get_context("device_target") == "CPU"
    assert is_legacy_model() is False


# ------------------------------------------------------------------------------------------------
# kernels


def test_split_with_size_transpose_gradient_defect():
    """Two ops: split with the SplitWithSize primitive MindFormers uses, transpose one part, take the gradient."""
    from mindspore.ops.auto_generate import SplitWithSize

    ms.set_context(mode=ms.PYNATIVE_MODE)
    x = Tensor(np.arange(24, dtype=np.float32).reshape(2, 3, 4))
    w_np = np.random.RandomState(0).randn(3, 3, 2).astype(np.float32)
    w = Tensor(w_np)
    split = SplitWithSize()

    def f(t):
        _, b = split(t, (1, 3), 2)  # b: [2, 3, 3]
        return (ops.transpose(b, (2, 1, 0)) * w).sum()

    expected = np.zeros((2, 3, 4), np.float32)  # d/dx sum(b^T * w) = w^T on the split part, 0 elsewhere
    expected[..., 1:] = w_np.transpose(2, 1, 0)

    wrong = ms.grad(f)(x).asnumpy()
    assert np.abs(wrong - expected).max() > 0.5  # the defect: the backward ignores the permutation
    with mfc.mindformers_cpu(fixes=("split_with_size",)):
        right = ms.grad(f)(x).asnumpy()
    np.testing.assert_array_equal(right, expected)
    np.testing.assert_array_equal(ms.grad(f)(x).asnumpy(), wrong)  # restored


def _attention_reference(q, k, v, scale):
    """numpy causal attention on [B, N, S, D] with GQA."""
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = q @ k.transpose(0, 1, 3, 2) * scale
    s = np.where(np.triu(np.ones(s.shape[-2:], bool), 1), -np.inf, s)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


@pytest.mark.parametrize("layout,sparse_mode", [("BNSD", 0), ("BSND", 0), ("BSH", 0), ("SBH", 0),
                                                ("BNSD", 2), ("BNSD", 3), ("TND", 3), ("TH", 3)])
def test_flash_attention_replacement_matches_numpy(layout, sparse_mode):
    from mindspore.ops.auto_generate import FlashAttentionScore

    ms.set_context(mode=ms.PYNATIVE_MODE)
    b, n1, n2, s, d = 2, 4, 2, 8, 16
    rs = np.random.RandomState(1)
    q, k, v = (rs.randn(b, n, s, d).astype(np.float32) for n in (n1, n2, n2))
    scale = 1 / np.sqrt(d)
    expected = _attention_reference(q, k, v, scale)  # [B, N, S, D]

    to_layout = {
        "BNSD": lambda t: t,
        "BSND": lambda t: t.transpose(0, 2, 1, 3),
        "BSH": lambda t: t.transpose(0, 2, 1, 3).reshape(b, s, -1),
        "SBH": lambda t: t.transpose(2, 0, 1, 3).reshape(s, b, -1),
        "TND": lambda t: t.transpose(0, 2, 1, 3).reshape(b * s, t.shape[1], d),  # batch packed as 2 sequences
        "TH": lambda t: t.transpose(0, 2, 1, 3).reshape(b * s, -1),
    }[layout]
    kwargs = {}
    if sparse_mode == 0:  # the MindFormers default: explicit mask, 1 = masked out, next_tokens = 0
        kwargs["attn_mask"] = Tensor(np.triu(np.ones((b, 1, s, s), np.uint8), 1))
    else:  # compressed mask: ignored, causality comes from sparse_mode
        kwargs["attn_mask"] = Tensor(np.triu(np.ones((2048, 2048), np.uint8), 1))
    if layout in ("TND", "TH"):
        kwargs["actual_seq_qlen"] = kwargs["actual_seq_kvlen"] = (s, 2 * s)
    prim = FlashAttentionScore(head_num=n1, scale_value=scale, next_tokens=0, input_layout=layout,
                               sparse_mode=sparse_mode)
    with mfc.mindformers_cpu(fixes=("flash_attention",)):
        softmax_max, softmax_sum, _, out = prim(*(Tensor(to_layout(t)) for t in (q, k, v)), **kwargs)
    np.testing.assert_allclose(out.asnumpy(), to_layout(expected), rtol=1e-5, atol=1e-6)
    assert softmax_max.shape[-1] == 8 and softmax_sum.shape[-1] == 8

    bad = FlashAttentionScore(head_num=n1, keep_prob=0.9, input_layout=layout)
    with mfc.mindformers_cpu(fixes=("flash_attention",)), pytest.raises(ValueError, match="keep_prob"):
        bad(*(Tensor(to_layout(t)) for t in (q, k, v)), **kwargs)


# ------------------------------------------------------------------------------------------------
# models


def test_gpt_model_trains(parallel_core):
    with mfc.mindformers_cpu():
        model = build_gpt_model()
        loss, grads = train_step(model, *batch())
    assert_trains(loss, grads, gpt_param_names())
    assert grads["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (192, 64)


def test_gpt_model_deterministic(parallel_core):
    with mfc.mindformers_cpu():
        model = build_gpt_model()
        loss1, grads1 = train_step(model, *batch())
        loss2, grads2 = train_step(model, *batch())
        mfc.init_mindformers_cpu(seed=0)
        loss3, grads3 = train_step(build_gpt_model(), *batch())  # rebuilt: same seed, same init weights
    assert loss1 == loss2 == loss3
    for name, grad in grads1.items():
        np.testing.assert_array_equal(grad, grads2[name], err_msg=name)
        np.testing.assert_array_equal(grad, grads3[name], err_msg=name)


def test_gpt_model_split_fix_against_finite_differences(parallel_core):
    """Without split_with_size the loss is unchanged but linear_qkv (and everything below it) gets wrong gradients."""
    ids, labels = batch()
    name = "decoder.layers.1.self_attention.linear_qkv.weight"
    with mfc.mindformers_cpu():
        model = build_gpt_model()
        loss, grads = train_step(model, ids, labels)
    with mfc.mindformers_cpu(exclude=("split_with_size",)):
        loss_bad, grads_bad = train_step(model, ids, labels)
    assert loss_bad == loss
    for unaffected in ("output_layer.weight", "decoder.layers.1.mlp.linear_fc1.weight",
                       "decoder.layers.1.self_attention.linear_proj.weight"):
        np.testing.assert_array_equal(grads_bad[unaffected], grads[unaffected])

    param = next(p for p in model.trainable_params() if p.name == name)
    w = param.asnumpy().copy()
    direction = np.random.RandomState(1).randn(*w.shape).astype(np.float32)
    eps = 1e-2

    def loss_at(weight):
        param.set_data(Tensor(weight))
        return float(model(ids, labels=labels)[0].asnumpy()[0])

    with mfc.mindformers_cpu():
        numeric = (loss_at(w + eps * direction) - loss_at(w - eps * direction)) / (2 * eps)
        param.set_data(Tensor(w))
    assert abs((grads[name] * direction).sum() - numeric) < 0.05 * abs(numeric)
    assert abs((grads_bad[name] * direction).sum() - numeric) > 0.5 * abs(numeric)


def test_gpt_model_hooks_do_not_change_numbers(parallel_core):
    with mfc.mindformers_cpu():
        model = build_gpt_model()
        loss, grads = train_step(model, *batch())
        fired = {"forward": 0, "backward": 0}

        def forward_hook(cell, args, output):
            fired["forward"] += 1

        def backward_hook(cell, grad_input, grad_output):
            fired["backward"] += 1

        handles = []
        for _, cell in model.cells_and_names():
            handles += [cell.register_forward_hook(forward_hook), cell.register_backward_hook(backward_hook)]
        loss_hooked, grads_hooked = train_step(model, *batch())
        for handle in handles:
            handle.remove()
        loss_after, grads_after = train_step(model, *batch())
    assert fired["forward"] > 40 and fired["backward"] > 40
    assert loss_hooked == loss == loss_after
    for name, grad in grads.items():
        np.testing.assert_allclose(grads_hooked[name], grad, rtol=0, atol=1e-6, err_msg=name)
        np.testing.assert_array_equal(grads_after[name], grad, err_msg=name)


def test_gpt_model_gqa_needs_repeat_kv(parallel_core):
    with mfc.mindformers_cpu():
        model = build_gpt_model(num_query_groups=2)
        loss, grads = train_step(model, *batch())
    assert_trains(loss, grads, gpt_param_names())
    assert grads["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (128, 64)
    with mfc.mindformers_cpu(exclude=("repeat_kv",)), pytest.raises(ValueError):
        train_step(model, *batch())
    # A grad that raised leaves MindSpore's PyNative executor unbalanced: without this, a later PyNative grad in
    # the same process through LayerNorm fails ("For LayerNormGrad, the index 7 is out of range of input num 7").
    from mindspore.common.api import _pynative_executor

    _pynative_executor.clear_res()


def test_qwen3_gqa_qk_norm_trains(parallel_core):
    with mfc.mindformers_cpu():
        model = build_qwen3_model()
        loss, grads = train_step(model, *batch())
    assert_trains(loss, grads, gpt_param_names(qk_norm=True))
    assert grads["decoder.layers.0.self_attention.q_layernorm.weight"].shape == (16,)
    assert grads["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (128, 64)  # (4 + 2 + 2) * 16


def test_legacy_llama_trains(legacy):
    ids, _ = batch(length=SEQ + 1)  # the model shifts the labels internally
    model = build_legacy_llama()
    loss_plain, grads_plain = train_step(model, ids)  # these flags need no fix ...
    with mfc.mindformers_cpu():
        loss, grads = train_step(model, ids)  # ... and the fixes do not change its numbers
    names = ["model.tok_embeddings.embedding_weight", "model.norm_out.weight", "lm_head.weight"] + [
        f"model.layers.{i}.{p}.weight" for i in range(2)
        for p in ("attention_norm", "ffn_norm", "attention.wq", "attention.wk", "attention.wv", "attention.wo",
                  "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")]
    assert_trains(loss, grads, names)
    assert loss == loss_plain
    for name, grad in grads.items():
        np.testing.assert_array_equal(grad, grads_plain[name], err_msg=name)
