"""MindSpore graph mode: capture through probes compiled into the graph (GRAPH_MODE, ``mindspore.jit``).

The model is the MindSpore GPT of examples/megatron_vs_mindformers/ms_gpt.py (MindSpore's own nn layers), trained
with SGD on one batch; the same model and batch run in PyNative are the reference for every graph-mode record.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")

import tensordiff  # noqa: E402
from tensordiff.store import CaptureFile  # noqa: E402

with contextlib.suppress(RuntimeError):  # set already, by another test module in this process
    ms.set_device("CPU")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def cpu_context():
    yield
    ms.set_context(mode=ms.PYNATIVE_MODE)


def _model(gelu_approximate: bool = False):
    from examples.megatron_vs_mindformers.ms_gpt import MSGPTConfig, build

    ms.set_seed(7)
    return build(MSGPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=8,
                             gelu_approximate=gelu_approximate))


def _batch():
    from tensordiff.batch import make

    b = make(64, 8, 2, seed=3)
    return {k: ms.Tensor(v.astype(np.int32) if v.dtype == np.int64 else v) for k, v in b.arrays().items()}


def _run(mode: int, path: str | None, steps: int = 3, capture_steps: int = 2, jit: bool = False,
         gelu_approximate: bool = False) -> tuple[list[float], object, list]:
    """Train ``steps`` SGD steps in ``mode``; capture the first ``capture_steps`` into ``path`` (None: no capture).
    ``jit``: the whole step (value_and_grad and the update) is one ``mindspore.jit`` function."""
    ms.set_context(mode=mode)
    model = _model(gelu_approximate)
    b = _batch()
    opt = ms.nn.SGD(model.trainable_params(), learning_rate=0.1)

    def loss_fn(tokens, position_ids, attention_mask, labels, loss_mask):
        return model(tokens, position_ids, attention_mask, labels, loss_mask)

    grad_fn = ms.value_and_grad(loss_fn, None, opt.parameters)

    def train_step(*batch):  # the batch as arguments, as a data loader feeds it (not constants of the graph)
        loss, grads = grad_fn(*batch)
        opt(grads)
        return loss

    step = ms.jit(train_step) if jit else train_step
    cells = list(model.cells_and_names()) + [("optimizer", opt)]
    classes = [type(c) for _, c in cells]
    losses = []
    with tensordiff.capture(model, path, steps=capture_steps, optimizer=opt, tensors="all") as cap:
        for _ in range(steps):
            losses.append(float(step(b["tokens"], b["position_ids"], b["attention_mask"], b["labels"], b["loss_mask"])))
            cap.step(losses[-1])
    return losses, cap, [(name, type(c), cls) for (name, c), cls in zip(cells, classes)]


def _key(r):
    return r.phase, r.module, r.call, r.kind, r.slot


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("graph")
    pyn, graph = str(d / "pynative.h5"), str(d / "graph.h5")
    losses_p, _, _ = _run(ms.PYNATIVE_MODE, pyn)
    losses_g, cap, classes = _run(ms.GRAPH_MODE, graph)
    ms.set_context(mode=ms.PYNATIVE_MODE)
    return pyn, graph, losses_p, losses_g, cap, classes


def test_every_graph_record_equals_its_pynative_record(pair):
    pyn, graph, losses_p, losses_g, _, _ = pair
    assert losses_g[:2] == losses_p[:2]  # FP32 on the CPU: the compiled graph computes the same losses
    with CaptureFile(pyn) as cp, CaptureFile(graph) as cg:
        assert cg.attrs["capture_mode"] == "graph" and cg.attrs["not_recorded"] == "grad_input"
        assert cg.steps == [0, 1]
        for step in (0, 1):
            ref = {_key(r): r for r in cp.records(step)}
            recs = cg.records(step)
            kinds = {r.kind for r in recs}
            assert kinds == {"param", "input", "output", "grad_output", "grad", "loss"}
            # every cell output and output gradient PyNative recorded, graph mode recorded too; beyond them only the
            # gradients of outputs that are a child's output tensor (PyNative hooks that tensor once), linked to the
            # child's: the same bytes, stored once
            wanted = {k for k in ref if k[3] in ("input", "output", "grad_output")}
            got = {_key(r): r for r in recs if r.kind in ("input", "output", "grad_output")}
            assert wanted <= set(got), sorted(wanted - set(got))[:5]
            sources = {r.same_as for r in recs if r.same_as >= 0}
            extra = [got[k] for k in set(got) - wanted]
            assert extra and all(r.phase == "backward" and (r.same_as >= 0 or r.seq in sources) for r in extra), extra
            assert all(r.grad_of >= 0 for r in recs if r.kind == "grad_output")
            for r in recs:
                if _key(r) not in ref:
                    continue
                p = ref[_key(r)]
                a, b = cp.array(p), cg.array(r)
                assert a.shape == b.shape and a.dtype == b.dtype, _key(r)
                if step == 0 and r.phase == "weights":  # the same starting point, bit for bit
                    np.testing.assert_array_equal(a, b, err_msg=str(_key(r)))
                else:  # FP32: the compiled graph may pick other kernels (output_layer: 3e-8) and order sums otherwise
                    scale = max(float(np.linalg.norm(a.astype(np.float64))), 1e-30)
                    assert float(np.linalg.norm(a.astype(np.float64) - b.astype(np.float64))) / scale <= 1e-6, _key(r)


def test_graph_capture_leaves_the_classes_and_the_numbers_as_they_were(pair):
    _, _, _, losses_g, cap, classes = pair
    assert not cap.active
    for name, now, before in classes:
        assert now is before, name
    plain, _, _ = _run(ms.GRAPH_MODE, None)
    assert losses_g == plain  # the steps after the capture compiled the user's graph again, without probes


def test_diff_of_pynative_and_graph_agrees(pair, tmp_path):
    pyn, graph = pair[0], pair[1]
    report = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "tensordiff", "diff", pyn, graph, "--json", str(report)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    import json

    summary = json.loads(report.read_text())["summary"]
    assert json.loads(report.read_text())["outcome"] == "agree"
    assert summary["not_recorded_a"] > 0 and summary["not_recorded_b"] == 0  # PyNative's grad_input records


def test_jit_step_from_pynative_is_captured_with_graph_true(tmp_path):
    path = str(tmp_path / "jit.h5")
    os.environ["TENSORDIFF_GRAPH"] = "1"
    try:
        losses, _, _ = _run(ms.PYNATIVE_MODE, path, steps=2, capture_steps=1, jit=True)
    finally:
        del os.environ["TENSORDIFF_GRAPH"]
    plain, _, _ = _run(ms.PYNATIVE_MODE, None, steps=2, jit=True)
    assert losses == plain
    with CaptureFile(path) as c:
        outs = [r for r in c.records(0) if r.kind == "output" and r.module == "decoder.layers.1.mlp.activation_func"]
        assert len(outs) == 1 and outs[0].has_data
        assert sum(r.phase == "param_grad" for r in c.records(0)) == len(list(_model().trainable_params()))


def test_a_graph_only_difference_is_found_at_its_cell(pair, tmp_path):
    """The graph-mode run uses the tanh GELU; PyNative of the same model the erf one: the diff names the cell."""
    pyn = pair[0]
    faulty = str(tmp_path / "graph_gelu.h5")
    _run(ms.GRAPH_MODE, faulty, steps=1, capture_steps=1, gelu_approximate=True)
    report = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "tensordiff", "diff", pyn, faulty, "--first-divergence",
                           "--json", str(report)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:]
    import json

    first = json.loads(report.read_text())["first_divergence"]
    assert first["module_b"] == "decoder.layers.0.mlp.activation_func", first


class _WithIdentity(ms.nn.Cell):
    """Dense -> a split into heads (not a cell) -> nn.Identity (an identity norm, as an attention without qk-norm has
    for its query) -> Dense; the loss a mean square."""

    def __init__(self):
        super().__init__()
        self.up = ms.nn.Dense(8, 16)
        self.norm = ms.nn.Identity()
        self.down = ms.nn.Dense(16, 4)

    def construct(self, x):
        q = self.norm(self.up(x).reshape((3, 4, 4)))
        return (self.down(q.reshape((3, 16))) ** 2).mean()


def _identity_run(mode: int, path: str) -> float:
    ms.set_context(mode=mode)
    ms.set_seed(5)
    model = _WithIdentity()
    x = ms.Tensor(np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32))
    opt = ms.nn.SGD(model.trainable_params(), learning_rate=0.1)
    grad_fn = ms.value_and_grad(model, None, opt.parameters)
    with tensordiff.capture(model, path, steps=1, optimizer=opt, tensors="all") as cap:
        loss, grads = grad_fn(x)
        opt(grads)
        cap.step(loss)
    return float(loss)


def test_an_identity_cells_gradient_has_its_pynative_name(tmp_path):
    """PyNative has one tensor for an identity cell's input and output, hooked at its first record (the input): its
    gradient is ``grad_input``. Graph mode sees it at the output probe and records it under the same name."""
    pyn, graph = str(tmp_path / "p.h5"), str(tmp_path / "g.h5")
    assert _identity_run(ms.PYNATIVE_MODE, pyn) == _identity_run(ms.GRAPH_MODE, graph)
    with CaptureFile(pyn) as cp, CaptureFile(graph) as cg:
        want = {_key(r) for r in cp.records(0) if r.module == "norm" and r.phase == "backward"}
        got = {_key(r): r for r in cg.records(0) if r.module == "norm" and r.phase == "backward"}
        assert want == set(got) == {("backward", "norm", 0, "grad_input", "0")}
        p = next(r for r in cp.records(0) if _key(r) in want)
        np.testing.assert_allclose(cg.array(got[_key(p)]), cp.array(p), rtol=1e-6)
        source = got[("backward", "norm", 0, "grad_input", "0")].grad_of
        assert next(r for r in cg.records(0) if r.seq == source).slot == "0"  # the input's forward record
