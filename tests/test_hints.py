"""Root-cause hints on real megatron-core models with one fault injected: the right cause ranks first,
and on clean pairs no hint claims more than noise."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from examples.gpt import train
from examples.megatron_vs_mindformers import megatron_side
from tensordiff.batch import make, save
from tensordiff.diff import DiffOptions
from tensordiff.explain import diagnose as diff
from tensordiff.explain.hints import hints_for_row
from tensordiff.store import CaptureFile


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hints-gpt")
    made = {}

    def get(fault, steps=1, *extra):
        if (fault, steps, extra) not in made:
            made[fault, steps, extra] = str(folder / f"{fault}-{steps}-{'-'.join(extra).replace('/', '_')}.h5")
            train.main(["--capture", made[fault, steps, extra], "--train-steps", str(steps), "--capture-steps",
                        str(steps), "--fault", fault, "--capture-tensors", "all", *extra])
        return made[fault, steps, extra]

    return get


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hints-llama")
    batch = str(folder / "batch.h5")
    save(batch, make(128, 16, 2, seed=0))
    made = {}

    def get(name):
        if name not in made:
            made[name] = str(folder / f"{name}.h5")
            extra = ["--bf16"] if name.startswith("bf16") and name != "bf16-fc1" else []
            fault = name[len("bf16-"):] if extra and name != "bf16" else ("none" if extra else name)
            megatron_side.main(["--family", "llama", "--batch", batch, "--fault", fault, "--capture", made[name],
                                "--train-steps", "1", "--capture-steps", "1", *extra])
        return made[name]

    get.batch = batch
    return get


def _top(result):
    assert result.first is not None and result.hints, result.hints_note
    return result.hints[0]


def test_gelu_tanh_is_an_activation_variant(gpt):
    top = _top(diff(gpt("none"), gpt("gelu-tanh")))
    assert top.cause == "activation" and top.explained > 0.99
    assert top.details["a"] == "gelu (erf, exact)" and top.details["b"] == "gelu (tanh approximation)"


def test_gelu_backward_is_an_activation_derivative(gpt):
    top = _top(diff(gpt("none"), gpt("gelu-backward")))
    assert top.cause == "activation-backward" and top.explained > 0.99
    assert top.details["b"] == "gelu (tanh approximation)"


def test_layernorm_epsilon_is_solved(gpt):
    top = _top(diff(gpt("none"), gpt("ln-eps")))
    assert top.cause == "norm-epsilon" and top.explained > 0.99
    assert top.details["eps_b"] == pytest.approx(1e-2, rel=1e-3)
    assert top.details["eps_a"] == pytest.approx(1e-5, rel=1e-2)


def test_halved_gradient_is_a_constant_factor(gpt):
    top = _top(diff(gpt("none"), gpt("grad-scale")))
    assert top.cause == "factor" and top.details["factor"] == pytest.approx(0.5, rel=1e-6)
    assert "1/2" in top.title


def test_scaled_checkpoint_names_the_parameter(gpt):
    result = diff(gpt("none"), gpt("ckpt"))
    # both explain it all; the specific cause (the scale) comes first, then which parameters differ
    assert [h.cause for h in result.hints] == ["factor", "checkpoint"]
    assert result.hints[1].details["parameters"] == ["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert result.hints[0].details["factor"] == pytest.approx(1.01, rel=1e-6)


def test_learning_rate_is_an_optimizer_step_factor(gpt):
    result = diff(gpt("none", 2), gpt("optimizer-lr", 2))
    assert (result.first.step, result.first.phase) == (1, "weights")
    top = _top(result)
    assert top.cause == "optimizer-step" and top.details["fit"] == "lr"
    assert top.details["factor"] == pytest.approx(0.9, rel=1e-4) and top.details["step"] == 0
    assert top.explained > 0.99


def test_weight_decay_on_norms_is_an_optimizer_step(gpt):
    result = diff(gpt("none", 2), gpt("optimizer-wd", 2))
    assert (result.first.step, result.first.phase) == (1, "weights")
    top = _top(result)
    assert top.cause == "optimizer-step" and top.details["fit"] == "weight-decay"
    assert "B also decays the 1-D parameters" in top.title
    assert top.details["decay"] == pytest.approx(1e-3 * 0.1, rel=1e-3)  # lr · wd
    assert all(name.endswith(("bias", "weight")) for name in top.details["parameters"])
    assert top.explained > 0.99


def test_adam_epsilon_is_named(gpt):
    # B's AdamW has eps 1e-4: Adam rebuilt from the fresh moments and each side's gradients names it (the betas
    # cannot show at Adam's first step, and the report says so)
    result = diff(gpt("none", 2), gpt("optimizer-eps", 2))
    assert (result.first.step, result.first.phase) == (1, "weights")
    top = _top(result)
    assert top.cause == "optimizer-step" and top.details["fit"] == "adam" and top.explained > 0.99
    assert list(top.details["differs"]) == ["eps"]
    assert top.details["b"]["eps"] == pytest.approx(1e-4, rel=0.05) and top.details["a"]["eps"] == pytest.approx(
        1e-8, rel=0.05)
    assert "B's epsilon is 0.0001 where A's is 1e-08" in top.title
    assert top.details["consistent"]["A"].startswith("β1 any, β2 any")


@pytest.mark.parametrize("framework", ["mcore", "hf"])
def test_adam_betas_are_named(gpt, framework):
    # betas (0.9, 0.95) against (0.9, 0.999): equal first steps (bias correction), apart from Adam's second step on
    extra = () if framework == "mcore" else ("--framework", "hf")
    result = diff(gpt("none", 3, *extra), gpt("optimizer-betas", 3, *extra))
    assert (result.first.step, result.first.phase) == (2, "weights")
    top = _top(result)
    assert top.cause == "optimizer-step" and top.details["fit"] == "adam" and top.details["adam_step"] == 2
    assert top.details["differs"] == {"beta2": {"A": [0.999], "B": [0.95]}}
    assert "B's β2 is 0.95 where A's is 0.999" in top.title and top.explained > 0.99


@pytest.mark.parametrize("framework", ["mcore", "hf"])
def test_missing_bias_correction_is_named(gpt, framework):
    # AdamW without bias correction (MindSpore's nn.AdamWeightDecay computes it so): Adam's term is 1/(1-0.9)·√(1-0.999)
    # = 3.16228 × A's at the first step while the weight decay is A's; a learning rate would scale both
    extra = () if framework == "mcore" else ("--framework", "hf")
    result = diff(gpt("none", 2, *extra), gpt("optimizer-bias-correction", 2, *extra))
    assert (result.first.step, result.first.phase) == (1, "weights")
    top = _top(result)
    assert top.cause == "optimizer-step" and top.details["fit"] == "bias-correction" and top.details["side"] == "B"
    assert top.details["factor"] == pytest.approx(0.1 / 0.001 ** 0.5, rel=1e-4)
    assert top.details["betas"] == [0.9, 0.999] and top.explained > 0.99


def test_learning_rate_fit_holds_over_three_steps(gpt):
    # the Adam rebuild finds one setting for both sides: the learning-rate fit names the factor, as before
    result = diff(gpt("none", 3), gpt("optimizer-lr", 3))
    top = _top(result)
    assert top.cause == "optimizer-step" and top.details["fit"] == "lr"
    assert top.details["factor"] == pytest.approx(0.9, rel=1e-4)


def test_a_clean_rewrite_agrees_over_two_adam_steps(gpt):
    # q, k, v as three matmuls instead of one: the key bias's true gradient is 0 (the softmax ignores it), so Adam
    # turns its rounding noise into +-lr updates; the keys shift by one vector per head, the scores by a constant per
    # query row, and the softmax removes it: those rows drift without effect, the pair agrees
    result = diff(gpt("none", 2), gpt("split-qkv", 2))
    assert result.first is None and result.outcome == "agree", result.reasons
    for r in result.rows:
        if r.verdict != "ok":
            assert r.verdict == "drift" and r.step == 1, (r.phase, r.pair.a.label, r.verdict)
            assert r.phase == "weights" or ".self_attention." in r.pair.a.module, r.pair.a.label


def test_no_optimizer_hint_where_the_forward_differs(gpt):
    result = diff(gpt("none", 2), gpt("ln-eps", 2))
    assert (result.first.step, result.first.phase) == (0, "forward")
    assert [h.cause for h in result.hints] == ["norm-epsilon"]
    assert {c.cause: c for c in result.checks}["optimizer step"].ran  # ruled out: the weights of step 0 agree


def test_active_dropout_is_named_with_its_probability(gpt):
    # megatron-core with hidden_dropout 0.1 in training mode: its embedding dropout is the first to change a tensor
    result = diff(gpt("none"), gpt("dropout"))
    assert result.first.module_a == "embedding.embedding_dropout"
    top = _top(result)
    assert top.cause == "dropout" and top.explained > 0.99 and top.details["side"] == "B"
    assert top.details["p"] == pytest.approx(0.1, rel=1e-4) and 0.05 < top.details["zeros"] < 0.15
    assert "B's embedding.embedding_dropout (Dropout) drops out" in top.title and "1/(1-0.1)" in top.title


def test_hf_gpt2_dropout_against_megatron(gpt):
    pytest.importorskip("transformers")
    from tensordiff.mapping import RenameRules

    # HF GPT-2 with embd/resid/attn_pdrop 0.1 (the same weights) against megatron-core without dropout
    result = diff(gpt("none"), gpt("dropout", 1, "--framework", "hf"),
                  DiffOptions(mapping=RenameRules.load("mcore-hf-gpt2", {"heads": "4"})))
    assert (result.first.module_a, result.first.module_b) == ("embedding.embedding_dropout", "transformer.drop")
    top = _top(result)
    assert top.cause == "dropout" and top.explained > 0.99 and top.details["p"] == pytest.approx(0.1, rel=1e-4)
    assert "B's transformer.drop (Dropout) drops out" in top.title


def test_padded_vocabulary_is_named(gpt):
    # megatron-core's vocabulary padded 128 -> 136 (8 non-zero rows): the logits compare as 'shape', the diff stops at
    # the per-token loss, which the padded columns' softmax-denominator term explains
    result = diff(gpt("none"), gpt("vocab-pad"))
    assert (result.first.phase, result.first.label_a) == ("forward", "<model> output.0")
    top = _top(result)
    assert top.cause == "vocab-padding" and top.explained > 0.99
    assert (top.details["vocab"], top.details["padded"], top.details["side"]) == (128, 136, "B")
    assert "B's vocabulary is padded" in top.title and "8 padded logits take part in B's softmax" in top.title


def test_padded_megatron_vocabulary_against_hf(gpt):
    pytest.importorskip("transformers")
    from tensordiff.mapping import RenameRules

    # megatron-core padded to 136 against HF GPT-2 with the real 128 (and megatron's GELU): the loss differs
    result = diff(gpt("vocab-pad"), gpt("none", 1, "--framework", "hf", "--hf-activation", "gelu"),
                  DiffOptions(mapping=RenameRules.load("mcore-hf-gpt2", {"heads": "4"})))
    assert result.first.phase == "loss"
    top = _top(result)
    assert top.cause == "vocab-padding" and top.explained > 0.99
    assert (top.details["vocab"], top.details["padded"], top.details["side"]) == (128, 136, "A")


def test_loss_over_all_tokens_instead_of_the_masked_ones(gpt):
    # both runs mask the last 4 tokens of the last sample; B divides the masked sum by all 32 tokens, A by the 28 kept
    result = diff(gpt("none", 1, "--pad-tokens", "4"), gpt("loss-mask", 1, "--pad-tokens", "4"))
    assert result.first.phase == "loss"
    assert [h.cause for h in result.hints] == ["loss-normalisation", "factor"]  # the named one first
    top = result.hints[0]
    assert top.details["a"] == "the mean over the tokens the loss mask keeps" and top.explained > 0.99
    assert top.details["b"].startswith("the masked losses summed and divided by all tokens")
    assert top.details["factor"] == pytest.approx(28 / 32, rel=1e-5)


def test_loss_sum_per_sample_is_a_loss_normalisation(gpt):
    result = diff(gpt("none"), gpt("loss-sum-per-sample"))
    top = _top(result)
    assert top.cause == "loss-normalisation" and top.explained > 0.99
    assert top.details["b"] == "the mean over samples of each sample's sum over tokens"
    assert top.details["factor"] == pytest.approx(16, rel=1e-5)  # the tokens per sample


def test_hf_loss_sum_per_sample_against_megatron(gpt):
    pytest.importorskip("transformers")
    from tensordiff.mapping import RenameRules

    # HF GPT-2 (the same weights) whose training script sums each sample's token losses, against megatron-core's mean
    result = diff(gpt("none"), gpt("loss-sum-per-sample", 1, "--framework", "hf", "--hf-activation", "gelu"),
                  DiffOptions(mapping=RenameRules.load("mcore-hf-gpt2", {"heads": "4"})))
    top = _top(result)
    assert top.cause == "loss-normalisation" and top.explained > 0.99
    assert top.details["factor"] == pytest.approx(16, rel=1e-5)  # the tokens per sample


def test_rope_interleaved_pairs(llama):
    top = _top(diff(llama("none"), llama("rope-interleaved")))
    assert top.cause == "rope"
    assert top.details["a"].startswith("rotate-half") and top.details["b"].startswith("interleaved")


def test_rope_base(llama):
    top = _top(diff(llama("none"), llama("rope-base")))
    assert top.cause == "rope" and "base 500000" in top.details["b"] and "base 10000" in top.details["a"]


def test_bf16_linear_is_a_compute_dtype(llama):
    result = diff(llama("none"), llama("bf16-fc1"))
    assert result.first.module_a == "decoder.layers.0.mlp.linear_fc1"
    top = _top(result)
    assert top.cause == "dtype" and top.details["dtype"] == "BF16" and top.explained > 0.99


def _no_hint_anywhere(path_a, path_b, mapping=None):
    # rounding differences only: judged by tolerance (same-stack exactness would name the rewrite)
    result = diff(path_a, path_b, DiffOptions(mapping=mapping, exact=False), hints=False)
    assert result.first is None
    checked = 0
    with CaptureFile(path_a) as ca, CaptureFile(path_b) as cb:
        for row in result.rows:
            if row.step == 0 and row.metrics is not None and row.metrics.rel_l2 > 0 and row.pair.a.has_data:
                checked += 1
                assert hints_for_row(row, ca, cb, result) == [], row.pair.a.label
    return checked


def test_no_hint_on_a_clean_pair_split_qkv(gpt):
    # fused vs split QKV: FP32 rounding differences only
    assert _no_hint_anywhere(gpt("none"), gpt("split-qkv")) > 20


def test_megatron_vs_hf_gelu_is_named_across_frameworks(tmp_path):
    pytest.importorskip("transformers")
    from tensordiff.mapping import RenameRules

    ckpt, ref, hf = (str(tmp_path / n) for n in ("ckpt.safetensors", "ref.h5", "hf.h5"))
    train.main(["--capture", ref, "--train-steps", "1", "--capture-steps", "1", "--save-ckpt", ckpt])
    train.main(["--framework", "hf", "--load-ckpt", ckpt, "--capture", hf, "--train-steps", "1", "--capture-steps", "1"])
    # megatron-core uses the exact (erf) GELU, HF GPT-2 its default gelu_new (tanh)
    result = diff(ref, hf, DiffOptions(mapping=RenameRules.load("mcore-hf-gpt2", {"heads": "4"})))
    top = _top(result)
    assert top.cause == "activation" and top.details["b"] == "gelu (tanh approximation)"
    assert top.explained > 0.99


def test_bf16_run_against_fp32_reference(llama):
    """A BF16 run (Megatron-LM's Float16Module, on the CPU here) is judged with BF16 tolerances everywhere, its
    FP32 loss included: no false alarm; a real fault in it is still found and explained."""
    clean = diff(llama("none"), llama("bf16"))
    assert clean.first is None
    loss_rows = [r for r in clean.rows if r.phase == "loss"]
    assert loss_rows and all(r.judged == "bfloat16" and r.verdict == "ok" for r in loss_rows)
    faulty = diff(llama("none"), llama("bf16-rope-base"))
    assert faulty.first.module_a == "rotary_pos_emb"
    assert faulty.hints[0].cause == "rope" and "base 500000" in faulty.hints[0].details["b"]


def test_bf16_weights_are_recognised_as_bf16(llama):
    from tensordiff.diff.tolerance import Tolerances

    result = diff(llama("none"), llama("bf16"), DiffOptions(tolerances=Tolerances(override=1e-6)))
    assert result.first.phase == "weights"
    causes = [h.cause for h in result.hints]
    assert causes[:2] == ["dtype", "checkpoint"] and result.hints[0].details["dtype"] == "BF16"


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_on_gpu_against_fp32_on_gpu(tmp_path):
    """On one GPU: megatron-core in BF16 (Float16Module) vs FP32, same weights and batch; then a RoPE fault in BF16."""
    batch, ckpt = str(tmp_path / "batch.h5"), str(tmp_path / "init.safetensors")
    save(batch, make(128, 16, 2, seed=0))
    paths = {}
    for name, extra in (("fp32", ["--save-ckpt", ckpt]), ("bf16", ["--load-ckpt", ckpt, "--bf16"]),
                        ("bf16-rope", ["--load-ckpt", ckpt, "--bf16", "--fault", "rope-base"])):
        paths[name] = str(tmp_path / f"{name}.h5")
        megatron_side.main(["--family", "llama", "--batch", batch, "--capture", paths[name], "--train-steps", "1",
                            "--capture-steps", "1", "--device", "cuda", *extra])
    assert diff(paths["fp32"], paths["bf16"]).first is None
    faulty = diff(paths["fp32"], paths["bf16-rope"])
    assert faulty.first.module_a == "rotary_pos_emb" and faulty.hints[0].cause == "rope"


def test_swiglu_halves_swapped(llama):
    top = _top(diff(llama("none"), llama("swiglu-swapped")))
    assert top.cause == "activation" and top.explained > 0.99
    assert top.details["b"] == "swiglu silu(up) * gate, [gate; up] swapped"


def test_missing_bias_megatron_skip_bias_add_vs_hf(tmp_path):
    """megatron-core's linear_proj returns its output without the bias (skip_bias_add), HF's c_proj adds it: the
    diff adds the bias megatron returns before comparing (the outputs agree, the returned bias is accounted 'bias';
    the first divergence is the GELU variant after it).
    A port that really leaves a bias out is found at that output, and the hint names the bias."""
    pytest.importorskip("transformers")
    import torch
    from safetensors.torch import load_file, save_file

    import tensordiff
    from examples.gpt.models import GPTSpec, build_hf_gpt2, hf_loss, make_batch
    from tensordiff.mapping import RenameRules

    init, ckpt, ref, hf, port = (str(tmp_path / n) for n in ("init.safetensors", "ckpt.safetensors", "ref.h5", "hf.h5",
                                                             "port.h5"))
    train.main(["--train-steps", "0", "--save-ckpt", init])
    state = load_file(init)
    g = torch.Generator().manual_seed(0)
    for key in state:  # megatron initialises biases to zero: give them values so that leaving one out shows
        if key.endswith(".bias"):
            state[key] = 0.05 * torch.randn(state[key].shape, generator=g)
    save_file(state, ckpt)
    train.main(["--load-ckpt", ckpt, "--capture", ref, "--train-steps", "1", "--capture-steps", "1"])
    train.main(["--framework", "hf", "--load-ckpt", ckpt, "--capture", hf, "--train-steps", "1", "--capture-steps", "1"])
    mapping = RenameRules.load("mcore-hf-gpt2", {"heads": "4"})
    result = diff(ref, hf, DiffOptions(mapping=mapping))
    # what is left is the GELU: HF GPT-2's gelu_new (tanh) against megatron's erf, after linear_proj
    assert result.first.module_a == "decoder.layers.0.mlp.linear_fc2" and _top(result).cause == "activation"
    proj = [r for r in result.rows if r.pair.a is not None and r.pair.a.module == "decoder.layers.0.self_attention.linear_proj"
            and r.step == 0 and r.phase == "forward"]
    assert {(r.pair.a.slot, r.verdict, r.accounted.rule if r.accounted else None) for r in proj} >= {
        ("0", "ok", None), ("1", "unmatched", "bias")}

    spec = GPTSpec()
    model = build_hf_gpt2(spec, load_file(ckpt))
    c_proj = model.transformer.h[0].attn.c_proj

    def without_bias(x: torch.Tensor) -> torch.Tensor:  # a port that forgets this layer's bias
        return (x.reshape(-1, x.size(-1)) @ c_proj.weight).reshape(*x.shape[:-1], -1)

    c_proj.forward = without_bias
    opt = train.optimizer_for(model, "none", 1e-3)
    with tensordiff.capture(model, port, steps=1, optimizer=opt) as cap:
        tokens, labels, _ = make_batch(spec, seed=0)
        loss = hf_loss(model, tokens, labels)
        loss.backward()
        opt.step()
        cap.step(loss)
    result = diff(ref, port, DiffOptions(mapping=mapping))
    assert (result.first.module_a, result.first.kind) == ("decoder.layers.0.self_attention.linear_proj", "output")
    top = _top(result)
    assert top.cause == "missing-bias" and top.explained > 0.99
    assert "B leaves out the bias of decoder.layers.0.self_attention.linear_proj" in top.title
