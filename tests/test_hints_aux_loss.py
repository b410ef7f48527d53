"""The aux-loss hint on real mixture-of-experts models (examples/moe): a router's auxiliary loss on one side only.

* HF transformers' MixtralForCausalLM with ``output_router_logits=True`` on B: its loss adds
  ``router_aux_loss_coef`` × ``load_balancing_loss_func`` of the gates' logits. The forward agrees, the loss does
  not; the hint rebuilds B's loss from A's gate logits and confirms the coefficient on the last gate's gradient.
* megatron-core's GPTModel with MoE layers and ``moe_aux_loss_coeff`` (or ``moe_z_loss_coeff``) on B: the loss value
  agrees (``MoEAuxLossAutoScaler`` adds the term's gradient in backward), and the first gradient to differ is the
  last router's input gradient; the hint fits the coefficient from the term's gradient through that router.
* B's reported loss adds megatron-core's tracked load-balancing losses (as MindFormers' reported loss does).

Expected answers are written from the configurations: the coefficient each side was built with.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

from examples.moe import train
from tensordiff.cli import main
from tensordiff.explain import diagnose


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """Captures of examples/moe/train.py (1 step, every tensor), made once per (framework, fault, extra args)."""
    folder = tmp_path_factory.mktemp("hints-moe")
    made: dict = {}

    def get(framework, fault="none", *extra):
        key = (framework, fault, extra)
        if key not in made:
            made[key] = str(folder / f"{framework}-{fault}-{len(made)}.h5")
            train.main(["--framework", framework, "--fault", fault, "--capture", made[key], *extra])
        return made[key]

    return get


def _top(result):
    assert result.first is not None and result.hints, result.hints_note
    return result.hints[0]


def _loss_row(result):
    return next(r for r in result.rows if r.phase == "loss")


def test_hf_mixtral_aux_loss_in_the_loss(moe):
    result = diagnose(moe("hf"), moe("hf", "aux-loss", "--aux-coeff", "0.02"))
    first = result.first
    assert (first.phase, first.module_a, first.label_a) == ("forward", "", "<model> output.loss")
    top = _top(result)
    assert top.cause == "aux-loss" and top.explained > 0.99
    d = top.details
    assert d["term"] == "load-balancing (all layers)"
    assert d["coefficient"] == pytest.approx(0.02, rel=1e-3)
    assert d["gradient_explained"] > 0.99  # the last gate's weight gradient = A's + c × the term's
    assert (d["experts"], d["topk"]) == (4, 2)
    assert d["routers"] == ["model.layers.0.block_sparse_moe.gate", "model.layers.1.block_sparse_moe.gate"]
    assert "B's loss = A's loss + 0.02 × the load-balancing loss" in top.title
    assert "load_balancing_loss_func" in top.title


def test_hf_mixtral_aux_coefficient_default(moe):
    """Mixtral's default router_aux_loss_coef 0.001: the fit still names it."""
    top = _top(diagnose(moe("hf"), moe("hf", "aux-loss", "--aux-coeff", "0.001")))
    assert top.cause == "aux-loss" and top.explained > 0.99
    assert top.details["coefficient"] == pytest.approx(0.001, rel=1e-2)


def test_hf_cli_reports_aux_loss_and_clean_pair_agrees(moe, tmp_path):
    report = tmp_path / "aux.json"
    assert main(["diff", moe("hf"), moe("hf", "aux-loss", "--aux-coeff", "0.02"), "--first-divergence",
                 "--json", str(report)]) == 1
    hints = json.loads(report.read_text())["hints"]
    assert hints[0]["cause"] == "aux-loss" and hints[0]["details"]["coefficient"] == pytest.approx(0.02, rel=1e-3)
    again = moe("hf", "none", "--seed", "1234")  # A' = A's configuration, captured again
    assert main(["diff", moe("hf"), again, "--json", str(tmp_path / "clean.json")]) == 0
    assert diagnose(moe("hf"), again).first is None


def test_mcore_aux_loss_in_backward(moe):
    result = diagnose(moe("mcore"), moe("mcore", "aux-loss", "--aux-coeff", "0.01"))
    assert _loss_row(result).verdict == "ok"  # megatron-core's aux loss leaves the loss value alone
    first = result.first
    assert (first.phase, first.module_a, first.label_a) == (
        "backward", "decoder.layers.1.pre_mlp_layernorm", "decoder.layers.1.pre_mlp_layernorm grad_output.0")
    top = _top(result)
    assert top.cause == "aux-loss" and top.explained > 0.99
    d = top.details
    assert d["term"] == "load-balancing (per layer)"
    assert d["coefficient"] == pytest.approx(0.01, rel=1e-3)
    assert d["routers"] == ["decoder.layers.1.mlp.router"]  # the router whose input that gradient is
    assert (d["experts"], d["topk"]) == (4, 2)
    assert "switch_load_balancing_loss_func" in top.title and "through A's router decoder.layers.1.mlp.router" in top.title


def test_mcore_z_loss_is_told_from_load_balancing(moe):
    top = _top(diagnose(moe("mcore"), moe("mcore", "z-loss", "--aux-coeff", "0.001")))
    assert top.cause == "aux-loss" and top.explained > 0.99
    assert top.details["term"] == "z-loss"
    assert top.details["coefficient"] == pytest.approx(0.001, rel=1e-3)


def test_mcore_reported_loss_adds_the_aux_loss(moe):
    """B's reported loss = the language-model loss + the tracked load-balancing losses (MindFormers' reported loss)."""
    result = diagnose(moe("mcore"), moe("mcore", "aux-loss-reported", "--aux-coeff", "0.01"))
    assert result.first.phase == "loss"
    top = _top(result)
    assert top.cause == "aux-loss" and top.explained > 0.99
    assert top.details["term"] == "load-balancing (per layer)"
    assert top.details["coefficient"] == pytest.approx(0.01, rel=1e-3)
    assert top.details["gradient_explained"] > 0.99


def test_mcore_clean_pair_agrees(moe, tmp_path):
    again = moe("mcore", "none", "--seed", "1234")
    assert main(["diff", moe("mcore"), again, "--json", str(tmp_path / "clean.json")]) == 0


def test_not_on_another_loss_fault(moe):
    """The loss × 1.05 in a MoE model: a plausible coefficient fits the loss, but not the router's gradient (every
    gradient × 1.05): the constant factor is named, the aux loss is not."""
    result = diagnose(moe("mcore"), moe("mcore", "loss-scale"))
    assert result.first.phase == "loss"
    top = _top(result)
    assert top.cause == "factor" and top.details["factor"] == pytest.approx(1.05, rel=1e-4)
    assert all(h.cause != "aux-loss" for h in result.hints)
    assert next(c for c in result.checks if c.cause == "aux loss").ran


def _qwen2_moe(path, output_router_logits):
    """HF Qwen2-MoE: a gate per layer beside a shared expert and its one-column shared_expert_gate (no router)."""
    import torch
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    import tensordiff

    torch.manual_seed(0)
    config = Qwen2MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                            shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=4, num_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
                            initializer_range=0.2, output_router_logits=output_router_logits, router_aux_loss_coef=0.05,
                            attn_implementation="eager", use_cache=False)
    model = Qwen2MoeForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with tensordiff.capture(model, path, steps=1, tensors="all", optimizer=opt) as cap:
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        cap.step(loss)
    return path


def test_hf_qwen2_moe_aux_loss(tmp_path):
    result = diagnose(_qwen2_moe(str(tmp_path / "a.h5"), False), _qwen2_moe(str(tmp_path / "b.h5"), True))
    top = _top(result)
    assert top.cause == "aux-loss" and top.explained > 0.99
    assert top.details["routers"] == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    assert top.details["coefficient"] == pytest.approx(0.05, rel=1e-3)
    assert top.details["term"] == "load-balancing (all layers)"


def test_router_not_stored_says_why(tmp_path):
    """The gates' tensors left out of the capture (tensors_match): the check cannot run, and says so."""
    import torch

    import tensordiff
    from examples.moe.models import MoESpec, build_hf_mixtral, hf_loss, make_batch

    def run(path, on):
        spec = MoESpec()
        model = build_hf_mixtral(spec, aux_coeff=0.02, output_router_logits=on)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tokens, _ = make_batch(spec)
        with tensordiff.capture(model, path, steps=1, tensors="all", optimizer=opt, tensors_match=r"^(?!.*gate)") as cap:
            loss = hf_loss(model, tokens, tokens)
            loss.backward()
            opt.step()
            cap.step(loss)
        return path

    result = diagnose(run(str(tmp_path / "a.h5"), False), run(str(tmp_path / "b.h5"), True))
    assert result.first.label_a == "<model> output.loss"
    assert all(h.cause != "aux-loss" for h in result.hints)
    status = next(c for c in result.checks if c.cause == "aux loss")
    assert not status.ran and status.reason.startswith("no router logits captured")
