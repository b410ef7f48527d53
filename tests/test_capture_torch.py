"""Capture on plain torch modules: nothing left behind, numbers unchanged, storage exact."""

import json

import h5py
import ml_dtypes
import numpy as np
import pytest
import torch

import tensordiff
from tensordiff.store import CaptureFile


class TiedTwice(torch.nn.Module):
    """Calls the same Linear twice (tied weights / recomputation)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.out(torch.relu(self.lin(torch.tanh(self.lin(x)))))


def _train(model, steps, cap=None, seed=0):
    torch.manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        x = torch.randn(4, 8)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if cap is not None:
            cap.step(loss)
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def test_capture_leaves_numbers_and_model_untouched(tmp_path):
    torch.manual_seed(1)
    m1 = TiedTwice()
    m2 = TiedTwice()
    m2.load_state_dict(m1.state_dict())
    plain_losses, plain_params = _train(m1, 4)
    with tensordiff.capture(m2, str(tmp_path / "c.h5"), steps=2) as cap:
        cap_losses, cap_params = _train(m2, 4, cap)
    assert plain_losses == cap_losses  # bit for bit
    assert all(torch.equal(a, b) for a, b in zip(plain_params, cap_params))
    for module in m2.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks and not module._backward_hooks
    with CaptureFile(str(tmp_path / "c.h5")) as c:
        assert c.steps == [0, 1]


def test_hooks_removed_after_last_captured_step(tmp_path):
    model = TiedTwice()
    cap = tensordiff.capture(model, str(tmp_path / "c.h5"), steps=1)
    _train(model, 1, cap)
    assert not model.lin._forward_hooks  # gone before close(): later steps cost nothing
    _train(model, 2, cap)
    cap.close()
    with CaptureFile(str(tmp_path / "c.h5")) as c:
        assert c.steps == [0]


def test_module_called_twice_gets_two_call_indices(tmp_path):
    model = TiedTwice()
    with tensordiff.capture(model, str(tmp_path / "c.h5"), steps=1) as cap:
        _train(model, 1, cap)
    with CaptureFile(str(tmp_path / "c.h5")) as c:
        recs = c.records(0)
        calls = sorted({r.call for r in recs if r.module == "lin" and r.kind == "output"})
        assert calls == [0, 1]
        grads = [r for r in recs if r.module == "lin" and r.phase == "backward" and r.kind == "grad_output"]
        assert sorted(r.call for r in grads) == [0, 1]
        # backward runs in reverse: call 1's gradient is recorded first
        assert grads[0].call == 1
        phases = [r.phase for r in recs]
        assert phases.index("weights") < phases.index("forward") < phases.index("backward") < phases.index("param_grad")
        loss = [r for r in recs if r.phase == "loss"]
        assert len(loss) == 1 and loss[0].has_data


def test_bf16_and_fp16_are_stored_losslessly_in_their_width(tmp_path):
    model = torch.nn.Linear(16, 16).to(torch.bfloat16)
    half = torch.nn.Linear(16, 16).to(torch.float16)
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    with tensordiff.capture(model, str(tmp_path / "bf.h5"), steps=1) as cap:
        y = model(x)
        cap.step()
    with tensordiff.capture(half, str(tmp_path / "fp.h5"), steps=1) as cap:
        half(x.to(torch.float16))
        cap.step()
    with CaptureFile(str(tmp_path / "bf.h5")) as c:
        out = next(r for r in c.records(0) if r.kind == "output")
        assert out.dtype == "bfloat16"
        arr = c.array(out)
        assert arr.dtype == np.dtype(ml_dtypes.bfloat16)
        assert np.array_equal(arr.view(np.uint16), y.detach().view(torch.int16).numpy().view(np.uint16))
        # FP32 accumulation: within the documented 1e-6 of a float64 reduction (capturing/torch/stats.py)
        assert out.l2 == pytest.approx(float(torch.linalg.vector_norm(y.detach().double())), rel=1e-6)
    with h5py.File(str(tmp_path / "bf.h5")) as f:
        stored = f["steps/000000/data"][str(out.seq)]
        assert stored.dtype == np.uint16  # raw bits, not upcast
    with CaptureFile(str(tmp_path / "fp.h5")) as c:
        out = next(r for r in c.records(0) if r.kind == "output")
        assert out.dtype == "float16" and c.array(out).dtype == np.float16


def test_statistics_count_nan_and_inf(tmp_path):
    model = torch.nn.Identity()
    x = torch.tensor([1.0, float("nan"), float("inf"), -2.0, float("nan")])
    with tensordiff.capture(model, str(tmp_path / "c.h5"), steps=1, tensors="none") as cap:
        model(x)
        cap.step()
    with CaptureFile(str(tmp_path / "c.h5")) as c:
        out = next(r for r in c.records(0) if r.kind == "output")
        assert (out.nan, out.inf, out.numel, out.has_data) == (2, 1, 5, False)


def test_unwritable_path_does_not_break_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    model = TiedTwice()
    with pytest.warns(RuntimeWarning, match="capture not started"):
        cap = tensordiff.capture(model, str(blocker / "sub" / "c.h5"), steps=1)
    losses, _ = _train(model, 2, cap)
    cap.close()
    assert len(losses) == 2 and not model.lin._forward_hooks


def test_incomplete_step_is_ignored_by_readers(tmp_path):
    model = TiedTwice()
    path = str(tmp_path / "c.h5")
    with tensordiff.capture(model, path, steps=1) as cap:
        _train(model, 1, cap)
    with h5py.File(path, "a") as f:  # what a crash in the middle of writing step 1 leaves
        f.create_group("steps/000001")
    with CaptureFile(path) as c:
        assert c.steps == [0] and c.incomplete_steps == [1]


def test_no_path_means_capture_is_off(tmp_path, monkeypatch):
    model = TiedTwice()
    cap = tensordiff.capture(model)
    assert not cap.active
    assert not model.lin._forward_hooks
    monkeypatch.setenv("TENSORDIFF_OUTPUT", str(tmp_path / "env.h5"))
    monkeypatch.setenv("TENSORDIFF_STEPS", "1")
    with tensordiff.capture(model, steps=5) as cap:
        _train(model, 1, cap)
    with CaptureFile(str(tmp_path / "env.h5")) as c:
        assert c.steps == [0] and c.attrs["steps_requested"] == 1


def test_two_runs_that_crash_in_their_first_forward_are_never_a_pass(tmp_path):
    from tensordiff.cli import main

    def crash(module, args, output):
        raise RuntimeError("CUDA out of memory (as the run reported it)")

    paths = []
    for name in ("a", "b"):
        torch.manual_seed(0)
        model = TiedTwice()
        model.out.register_forward_hook(crash)  # the run dies in its first forward, inside the capture block
        path = str(tmp_path / f"{name}.h5")
        with pytest.raises(RuntimeError, match="out of memory"), tensordiff.capture(model, path, steps=2):
            model(torch.randn(4, 8))
        paths.append(path)
    with CaptureFile(paths[1]) as cap:
        assert cap.steps == [0]
        assert cap.step_attrs(0)["interrupted"] == "RuntimeError: CUDA out of memory (as the run reported it)"
    report = tmp_path / "r.json"
    assert main(["diff", *paths, "--json", str(report)]) == 3
    reasons = json.loads(report.read_text())["inconclusive_reasons"]
    assert any("the run stopped on an exception inside a compared step" in r and "A step 0: RuntimeError" in r
               for r in reasons)
