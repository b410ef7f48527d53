"""Hints on the forms people use: the activation as a module of its own (torch.nn.GELU, torch.nn.SiLU, HF's
GELUActivation, mindspore.nn.GELU), tested on the module's own captured input and on its gradients; and a check
that cannot run at the first divergence says so, with its reason, in the report and the JSON."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from helpers import render  # noqa: E402

import tensordiff  # noqa: E402
from tensordiff.explain import diagnose  # noqa: E402
from tensordiff.report.diff import DiffReport  # noqa: E402


class _GeluTanhBackward(torch.autograd.Function):
    """The exact GELU forward, the tanh GELU's derivative backward: a fused kernel's mistake."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.nn.functional.gelu(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            leaf = x.detach().requires_grad_()
            (dx,) = torch.autograd.grad(torch.nn.functional.gelu(leaf, approximate="tanh"), leaf, grad)
        return dx


class FusedGELU(torch.nn.Module):
    def forward(self, x):
        return _GeluTanhBackward.apply(x)


class MLP(torch.nn.Module):
    """fc1 → (× 1: a tensor of its own, so the activation's input gradient is recorded) → act → fc2."""

    def __init__(self, act):
        super().__init__()
        self.fc1, self.act, self.fc2 = torch.nn.Linear(8, 16), act, torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x) * 1.0))


def _capture(path, model):
    torch.manual_seed(0)
    for p in model.parameters():  # the same weights on both sides whatever the activation module
        torch.nn.init.normal_(p, std=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    with tensordiff.capture(model, path, steps=1, optimizer=opt) as cap:
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        cap.step(loss)
    return path


def _sequential(act):
    return torch.nn.Sequential(torch.nn.Linear(8, 16), act, torch.nn.Linear(16, 4))


def _hf(name):
    activations = pytest.importorskip("transformers.activations")
    return getattr(activations, name)()


ERF, TANH = "gelu (erf, exact)", "gelu (tanh approximation)"


@pytest.mark.parametrize("act_a, act_b, name_a, name_b", [
    (lambda: torch.nn.GELU(), lambda: torch.nn.GELU(approximate="tanh"), ERF, TANH),
    (lambda: torch.nn.SiLU(), lambda: torch.nn.ReLU(), "silu", "relu"),
    (lambda: _hf("GELUActivation"), lambda: _hf("NewGELUActivation"), ERF, TANH),
], ids=["torch-gelu-tanh", "torch-silu-relu", "hf-gelu-new"])
def test_activation_module_is_named_from_its_own_input(tmp_path, act_a, act_b, name_a, name_b):
    a = _capture(str(tmp_path / "a.h5"), _sequential(act_a()))
    b = _capture(str(tmp_path / "b.h5"), _sequential(act_b()))
    result = diagnose(a, b)
    # Sequential: 0 Linear, 1 the activation, 2 Linear; the activation's input agrees, its output does not
    assert (result.first.module_a, result.first.kind) == ("1", "output")
    top = result.hints[0]
    assert top.cause == "activation" and top.explained > 0.9
    assert (top.details["a"], top.details["b"], top.details["input"]) == (name_a, name_b, "1 input.0")
    text = render(DiffReport(result, first_only=True))
    assert f"activation: B computes {name_b} where A computes {name_a}" in " ".join(text.split())


def test_activation_module_backward_from_its_own_input(tmp_path):
    """The activation module's gradient is wrong (forward exact GELU, backward the tanh GELU's derivative): its
    input gradient = its output gradient × the derivative at its forward input."""
    a = _capture(str(tmp_path / "a.h5"), MLP(torch.nn.GELU()))
    b = _capture(str(tmp_path / "b.h5"), MLP(FusedGELU()))
    result = diagnose(a, b)
    assert (result.first.phase, result.first.module_a, result.first.kind) == ("backward", "act", "grad_input")
    top = result.hints[0]
    assert top.cause == "activation-backward" and top.explained > 0.9
    assert (top.details["a"], top.details["b"]) == (ERF, TANH)
    assert "act grad_output.0" in top.evidence and "(act input.0)" in top.evidence


def test_activation_module_backward_linked_input(tmp_path):
    """In a Sequential the activation's input is the Linear's output (one tensor, recorded once): the gradient
    that diverges is the Linear's output gradient, rebuilt from the activation's output gradient."""
    a = _capture(str(tmp_path / "a.h5"), _sequential(torch.nn.GELU()))
    b = _capture(str(tmp_path / "b.h5"), _sequential(FusedGELU()))
    result = diagnose(a, b)
    assert (result.first.phase, result.first.module_a, result.first.kind) == ("backward", "0", "grad_output")
    top = result.hints[0]
    assert top.cause == "activation-backward" and top.explained > 0.9 and top.details["b"] == TANH
    assert top.evidence.startswith("A's 1 grad_output.0")


def test_a_check_that_cannot_run_says_why(tmp_path):
    """Tanh vs Sigmoid: no known cause; RoPE (a 2-D tensor) and bias (an activation has none) could not be tested,
    and the report and the JSON say so."""
    a = _capture(str(tmp_path / "a.h5"), _sequential(torch.nn.Tanh()))
    b = _capture(str(tmp_path / "b.h5"), _sequential(torch.nn.Sigmoid()))
    result = diagnose(a, b)
    assert result.first.module_a == "1" and result.hints == []
    status = {c.cause: c for c in result.checks}
    assert not status["RoPE"].ran and "2-D" in status["RoPE"].reason
    assert not status["bias"].ran and status["bias"].reason == "the module has no bias"
    assert result.checked == ("activation", "norm epsilon", "dtype", "layout", "dropout", "loss normalisation",
                              "aux loss", "constant factor", "vocabulary padding", "checkpoint", "optimizer step")
    text = " ".join(render(DiffReport(result, first_only=True)).split())
    assert ("No known cause explains this divergence (tested: activation, norm epsilon, dtype, layout, dropout, "
            "loss normalisation, aux loss, constant factor, vocabulary padding, checkpoint, optimizer step). Not "
            "tested here: "
            "RoPE (needs q/k (4-D) or an attention output (3-D), "
            "this one is 2-D); attention scale (not an attention output (a 3-D forward tensor) or the scores a "
            "softmax module takes); bias (the module has no bias); tied embeddings (not a parameter gradient of a "
            "matrix (forward)); router normalisation (not a block's 3-D forward output). See docs/hints.md.") in text
    checks = DiffReport(result).to_dict()["checks"]
    assert {"cause": "RoPE", "ran": False, "reason": "needs q/k (4-D) or an attention output (3-D), this one is 2-D"} in checks
    assert {"cause": "activation", "ran": True, "reason": None} in checks


def test_mindspore_gelu_cell(tmp_path):
    """mindspore.nn.GELU(approximate=False) vs its default approximate=True, captured in PyNative mode."""
    ms = pytest.importorskip("mindspore")
    import numpy as np

    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")

    def run(path, approximate):
        ms.set_seed(0)
        net = ms.nn.SequentialCell([ms.nn.Dense(8, 16), ms.nn.GELU(approximate=approximate), ms.nn.Dense(16, 4)])
        x = ms.Tensor(np.random.default_rng(1).normal(size=(6, 8)).astype(np.float32))
        step = ms.value_and_grad(lambda: net(x).square().mean(), None, net.trainable_params())
        with tensordiff.capture(net, path, steps=1) as cap:
            loss, grads = step()
            cap.step(loss, grads=grads)
        return path

    result = diagnose(run(str(tmp_path / "a.h5"), False), run(str(tmp_path / "b.h5"), True))
    assert (result.first.module_a, result.first.kind) == ("1", "output")  # SequentialCell: 1 is the GELU
    top = result.hints[0]
    assert top.cause == "activation" and top.explained > 0.9
    assert (top.details["a"], top.details["b"], top.details["input"]) == (ERF, TANH, "1 input.0")
