"""The recorder's boundary at run time: every adapter overrides only ``Recorder.HOOKS``, ``capture()`` returns a
``CaptureHandle`` either way, and ``state`` walks through a step as ``StepState`` says."""

import contextlib

import pytest
import torch

import tensordiff
from tensordiff._warn import TensordiffWarning
from tensordiff.capturing.recorder import CaptureHandle, NullCapture, Recorder, StepState

#: what a subclass may set besides the hooks
SETTINGS = {"framework"}


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _load_adapters():
    import tensordiff.capturing.auto
    import tensordiff.capturing.megatron
    import tensordiff.capturing.torch.adapter

    with contextlib.suppress(ImportError):  # no MindSpore here: its adapters are checked where it is
        import tensordiff.capturing.mindspore.graph  # noqa: F401


def test_adapters_override_only_the_hooks():
    _load_adapters()
    subclasses = {c.__name__: c for c in _subclasses(Recorder)}
    assert {"TorchCapture", "TrainingCapture", "MegatronStepCapture"} <= set(subclasses)
    bad = []
    for name, cls in subclasses.items():
        for attr in vars(cls):
            if attr.startswith("__") or not hasattr(Recorder, attr):
                continue
            if attr not in Recorder.HOOKS and attr not in SETTINGS:
                bad.append(f"{cls.__module__}.{name}.{attr}")
    assert not bad, f"overrides beyond Recorder.HOOKS: {bad}"
    for hook in Recorder.HOOKS:
        assert callable(getattr(Recorder, hook)) and getattr(Recorder, hook).__doc__, hook


def test_capture_returns_a_handle_either_way(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    off = tensordiff.capture(model)  # no path, no tensordiff capture: off
    assert isinstance(off, NullCapture) and isinstance(off, CaptureHandle) and off.path is None
    with tensordiff.capture(model, str(tmp_path / "c.h5"), steps=2, optimizer=opt) as cap:
        assert isinstance(cap, CaptureHandle) and isinstance(cap.state, StepState)
        assert not cap.state.in_step and cap.state.step == 0
        for i in range(3):
            loss = model(torch.randn(2, 4)).square().mean()
            assert cap.state.recording == (i < 2) and cap.call_depth == 0
            loss.backward()
            opt.step()
            assert cap.state.step_ready == (i < 2) and cap.state.grads_taken == (i < 2)
            opt.zero_grad()
            cap.step(loss)
            assert cap.state.step == min(i + 1, 2) and cap.state.iteration == i + 1 and not cap.state.in_step
        assert cap.state.done and cap.finished and not cap.active
    assert cap.state.closed and not cap.state.failed


def test_fail_stops_the_capture_and_removes_every_hook(tmp_path):
    model = torch.nn.Linear(4, 1)
    cap = tensordiff.capture(model, str(tmp_path / "c.h5"), steps=2)
    model(torch.randn(2, 4))  # the step is open
    assert cap.state.recording
    with pytest.warns(TensordiffWarning, match="capture stopped"):
        cap.fail(RuntimeError("boom"))
    assert cap.state.failed and not cap.state.in_step and not cap.active
    assert not model._forward_hooks and not model._forward_pre_hooks
    model(torch.randn(2, 4)).sum().backward()  # the model runs as if never captured
    cap.close()
    assert cap.state.closed


def test_the_loss_is_read_at_the_end_of_its_step(tmp_path):
    """``loss()`` records the loss and reads its value with the step's statistics (one wait for the device): the
    value stored is the one given, whatever the program does to its tensor before ``step()``."""
    from tensordiff.store import CaptureFile

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = str(tmp_path / "c.h5")
    values = []
    with tensordiff.capture(model, path, steps=2, optimizer=opt) as cap:
        for _ in range(3):
            loss = model(torch.randn(2, 4)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            values.append(float(loss.detach()))
            cap.loss(loss)
            if cap.active:  # the third step is not recorded (steps=2)
                assert cap.loss_recorded and cap.step_loss == pytest.approx(values[-1])
            with torch.no_grad():
                loss.mul_(10.0)  # after loss(): the step keeps the value it was given
            cap.step(grad_norm=torch.tensor(2.5))
    with CaptureFile(path) as c:
        assert [c.step_attrs(s)["loss"] for s in c.steps] == pytest.approx(values[:2], rel=1e-6)
        scalars = c.scalars()
        assert [scalars["grad_norm"][i] for i in range(3)] == [2.5, 2.5, 2.5]
