"""MindSpore adapter: what is recorded, that training is untouched, and that nothing is left behind."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")

import tensordiff  # noqa: E402
from tensordiff.store import CaptureFile  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def pynative():
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    yield
    ms.set_context(mode=ms.PYNATIVE_MODE)


def _tiny():
    from examples.megatron_vs_mindformers.ms_gpt import MSGPTConfig, build

    ms.set_seed(7)
    return build(MSGPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=8))


def _batch():
    from tensordiff.batch import make

    b = make(64, 8, 2, seed=3)
    return {k: ms.Tensor(v.astype(np.int32) if v.dtype == np.int64 else v) for k, v in b.arrays().items()}


def _train(model, steps, path=None, with_optimizer=True, **kw):
    b = _batch()
    opt = ms.nn.SGD(model.trainable_params(), learning_rate=0.1)
    fn = ms.value_and_grad(lambda: model(b["tokens"], b["position_ids"], b["attention_mask"], b["labels"], b["loss_mask"]),
                           None, opt.parameters)
    losses, grads_seen = [], []
    with tensordiff.capture(model, path, steps=steps, optimizer=opt if with_optimizer else None, **kw) as cap:
        for _ in range(steps):
            loss, grads = fn()
            grads_seen.append([g.asnumpy().copy() for g in grads])
            opt(grads)
            cap.step(loss, grads=None if with_optimizer else grads)
            losses.append(float(loss))
    return losses, grads_seen, cap


def test_capture_does_not_change_training(tmp_path):
    plain_losses, plain_grads, _ = _train(_tiny(), 2)
    model = _tiny()
    losses, grads, cap = _train(model, 2, str(tmp_path / "ms.h5"))
    assert losses == plain_losses  # bit for bit
    for a, b in zip(plain_grads[1], grads[1]):
        np.testing.assert_array_equal(a, b)
    for _, cell in model.cells_and_names():  # every hook removed
        assert not cell._forward_pre_hook and not cell._forward_hook and not cell._backward_hook
    assert not cap.active


def test_records_every_phase_with_mindspore_names(tmp_path):
    path = str(tmp_path / "ms.h5")
    losses, grads, _ = _train(_tiny(), 2, path)
    with CaptureFile(path) as cap:
        assert cap.attrs["framework"] == "mindspore"
        assert cap.steps == [0, 1]
        recs = cap.records(0)
        by_key = {(r.phase, r.module, r.kind, r.slot, r.call): r for r in recs}
        w = by_key[("weights", "decoder.layers.0.input_layernorm", "param", "gamma", 0)]
        assert w.shape == (32,) and w.dtype == "float32"
        out = by_key[("forward", "decoder.layers.1.mlp.linear_fc1", "output", "0", 0)]
        assert out.shape == (8, 2, 128)  # [S, B, 4H], as Megatron
        assert out.module_class == "Dense"
        g = by_key[("backward", "decoder.layers.1.mlp.linear_fc1", "grad_output", "0", 0)]
        assert g.grad_of == out.seq
        pg = by_key[("param_grad", "decoder.layers.1.mlp.linear_fc1", "grad", "weight", 0)]
        # the optimizer's input is value_and_grad's gradient, bit for bit
        names = [p.name for p in _tiny().trainable_params()]
        np.testing.assert_array_equal(cap.array(pg), grads[0][names.index("decoder.layers.1.mlp.linear_fc1.weight")])
        loss = next(r for r in recs if r.phase == "loss")
        assert float(cap.array(loss)) == pytest.approx(losses[0], rel=0, abs=0)
        # weights at the start of step 1 are the SGD update of step 0
        w1 = next(r for r in cap.records(1) if r.phase == "weights" and r.module == "decoder.layers.1.mlp.linear_fc1"
              and r.slot == "weight")
        w0 = by_key[("weights", "decoder.layers.1.mlp.linear_fc1", "param", "weight", 0)]
        assert w1.l2 != w0.l2


def test_cell_called_twice_gets_call_indices(tmp_path):
    from mindspore import nn, ops

    class Twice(nn.Cell):
        def __init__(self):
            super().__init__()
            self.lin = nn.Dense(4, 4)

        def construct(self, x):
            return ops.sum(self.lin(self.lin(x)))

    net = Twice()
    x = ms.Tensor(np.ones((2, 4), np.float32))
    path = str(tmp_path / "t.h5")
    with tensordiff.capture(net, path, steps=1) as cap:
        loss, grads = ms.value_and_grad(net, None, net.trainable_params())(x)
        cap.step(loss, grads=grads)
    with CaptureFile(path) as c:
        outs = [r for r in c.records(0) if r.module == "lin" and r.kind == "output"]
        assert [r.call for r in outs] == [0, 1]
        grads_out = [r for r in c.records(0) if r.module == "lin" and r.kind == "grad_output"]
        assert sorted(r.call for r in grads_out) == [0, 1]
        pg = {r.slot for r in c.records(0) if r.phase == "param_grad"}
        assert pg == {"weight", "bias"}


def test_hook_capture_refuses_graph_mode_and_capture_takes_the_graph_route(tmp_path):
    from tensordiff.capturing.mindspore.adapter import MindSporeCapture
    from tensordiff.capturing.mindspore.graph import MindSporeGraphCapture
    from tensordiff.capturing.options import CaptureOptions
    from tensordiff.errors import UsageError

    model = _tiny()
    ms.set_context(mode=ms.GRAPH_MODE)
    with pytest.raises(UsageError, match=r"GRAPH_MODE.*PYNATIVE_MODE"):  # Python hooks never run in a graph
        MindSporeCapture(model, CaptureOptions(path=str(tmp_path / "g.h5")))
    before = {name: type(c) for name, c in model.cells_and_names()}
    with tensordiff.capture(model, str(tmp_path / "g.h5")) as cap:
        assert isinstance(cap, MindSporeGraphCapture) and cap.active
        assert all(type(c) is not before[name] for name, c in model.cells_and_names() if name == "decoder.layers.0")
    assert {name: type(c) for name, c in model.cells_and_names()} == before


def test_bf16_tensor_stored_losslessly():
    import ml_dtypes

    from tensordiff.frameworks.mindspore import to_numpy

    values = np.array([1.0, -2.5, 3.140625, 1e-3], dtype=np.float32)
    t = ms.Tensor(values).astype(ms.bfloat16)
    out = to_numpy(t)
    assert out.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(out, values.astype(ml_dtypes.bfloat16))


def test_graph_mode_under_the_cli_is_captured(tmp_path):
    import subprocess

    batch = tmp_path / "b.h5"
    from tensordiff.batch import make, save

    save(str(batch), make(128, 16, 2))
    ckpt = tmp_path / "w.safetensors"
    from safetensors.numpy import save_file

    from examples.megatron_vs_mindformers.ms_gpt import MSGPTConfig, build

    ms.set_seed(0)
    model = build(MSGPTConfig())
    save_file({n: p.asnumpy() for n, p in model.parameters_and_names()}, str(ckpt))
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = tmp_path / "g.h5"
    proc = subprocess.run([sys.executable, "-m", "tensordiff", "capture", "-o", str(out), "--",
                           sys.executable, os.path.join(ROOT, "examples/megatron_vs_mindformers/mindspore_side.py"),
                           "--family", "gpt2", "--batch", str(batch), "--load-ckpt", str(ckpt), "--graph",
                           "--train-steps", "1"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with CaptureFile(str(out)) as c:
        assert c.attrs["capture_mode"] == "graph" and c.steps == [0]
        assert any(r.module == "decoder.layers.1.mlp" and r.kind == "output" for r in c.records(0))


def test_scalars_for_every_step_after_the_captured_ones(tmp_path):
    """cap.step(loss, grads=..., grad_norm=...) keeps the scalars of all steps; tensors only of the first."""
    from tensordiff.runs import read_run

    path = str(tmp_path / "ms.h5")
    model, b = _tiny(), _batch()
    opt = ms.nn.SGD(model.trainable_params(), learning_rate=0.1)
    fn = ms.value_and_grad(lambda: model(b["tokens"], b["position_ids"], b["attention_mask"], b["labels"], b["loss_mask"]),
                           None, opt.parameters)
    losses, norms = [], []
    with tensordiff.capture(model, path, steps=1) as cap:
        for _step in range(6):
            loss, grads = fn()
            norm = ms.ops.sqrt(sum(ms.ops.sum(g * g) for g in grads))
            opt(grads)
            cap.step(loss, grads=grads, grad_norm=norm, lr=0.1)
            losses.append(float(loss))
            norms.append(float(norm))
        cap.log(val_loss=losses[-1] + 0.5)
    with CaptureFile(path) as c:
        assert c.steps == [0]
    run = read_run(path)
    assert sorted(run.loss) == [1, 2, 3, 4, 5, 6] and run.loss[6] == pytest.approx(losses[-1], rel=1e-7)
    assert [run.grad_norm[s] for s in range(1, 7)] == pytest.approx(norms, rel=1e-7)
    assert run.val_loss == {6: pytest.approx(losses[-1] + 0.5)}  # logged after the last step(): its step
