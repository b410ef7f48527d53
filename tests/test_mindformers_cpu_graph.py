"""tensordiff.compat.mindformers_cpu in graph mode: real MindFormers 1.9 models train in GRAPH_MODE and under
``mindspore.jit`` on the MindSpore 2.9 CPU (FP32), with PyNative's numbers.

Each training test runs 2 SGD steps from the same initial parameters and batch in PyNative (the reference,
with ``mindformers_cpu()``) and in graph mode (with ``mindformers_cpu_graph(model)`` only). Measured on this CPU:
losses bit-identical, parameter gradients within relative L2 6.0e-7 (Qwen3; 0 for the GPT-2-shaped model).
"""
import dataclasses

import numpy as np
import pytest
from test_mindformers_cpu import (  # also imports MindFormers from a scratch directory
    BATCH,
    SEQ,
    _attention_reference,
    batch,
    build_gpt_model,
    build_legacy_llama,
    build_qwen3_model,
    gpt_param_names,
    mfc,
    ms,
    train_step,
)

LOSS_TOL = 0.0  # measured: bit-identical losses for every model, both steps
GRAD_RTOL = 1e-6  # measured: at most 6.0e-7 relative L2 (Qwen3, step 0)


@pytest.fixture(autouse=True)
def _clean():
    """Every test starts and ends in PyNative, with no fix and no graph swap active."""
    mfc.disable_graph()
    mfc.disable()
    yield
    mfc.disable_graph()
    mfc.disable()
    ms.set_context(mode=ms.PYNATIVE_MODE)


@pytest.fixture
def parallel_core(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    mfc.init_mindformers_cpu(seed=0)


def _rel(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _prim_attributes(model):
    """{dotted path: fix} of the RmsNorm / Outer / FlashAttentionScore attributes, found without the module."""
    from mindspore.ops.auto_generate import gen_ops_prim as g

    kinds = {g.RmsNorm: "rms_norm", g.Outer: "outer", g.FlashAttentionScore: "flash_attention"}
    found = {}
    for path, cell in model.cells_and_names():
        for attr, value in vars(cell).items():
            if type(value) in kinds:
                found[f"{path}.{attr}" if path else attr] = kinds[type(value)]
    return found


def _global_targets():
    from mindformers.parallel_core.training_graph.transformer.attention import Attention
    from mindspore.mint.nn import functional as mint_f

    return [(mint_f, "embedding"), (Attention, "_repeat_kv")]


# ------------------------------------------------------------------------------------------------
# API


def test_enable_graph_disable_graph_restore_identical_originals(parallel_core):
    model = build_gpt_model(num_query_groups=2)
    cells = dict(model.cells_and_names())
    before = {path: (dict(vars(cell)), dict(cell._cells)) for path, cell in cells.items()}
    globals_before = [vars(owner)[attr] for owner, attr in _global_targets()]
    expected = _prim_attributes(model)
    assert sorted(expected.values()).count("rms_norm") == 5 and len(expected) == 9  # 5 norms, 2 Outer, 2 FA

    assert mfc.enable_graph(model) == expected
    assert mfc.enable_graph(model) == {}  # idempotent
    assert mfc.graph_swaps(model) == mfc.graph_swaps() == expected
    assert mfc.enabled_fixes() == ("embedding", "repeat_kv")  # the global fixes, parsed by the graph compiler
    for path in expected:
        owner, attr = path.rsplit(".", 1)
        assert isinstance(getattr(cells[owner], attr), ms.nn.Cell), path
        assert f"{owner}.{attr}" in dict(model.cells_and_names())
    for (owner, attr), original in zip(_global_targets(), globals_before):
        assert vars(owner)[attr] is not original

    mfc.disable_graph(model)
    assert mfc.graph_swaps() == {} and not mfc.is_enabled()
    assert list(dict(model.cells_and_names())) == list(cells)
    for path, cell in cells.items():
        attrs, children = before[path]
        assert vars(cell).keys() == attrs.keys(), path
        assert all(vars(cell)[k] is v for k, v in attrs.items()), path
        assert cell._cells.keys() == children.keys() and all(cell._cells[k] is v for k, v in children.items()), path
    for (owner, attr), original in zip(_global_targets(), globals_before):
        assert vars(owner)[attr] is original


def test_context_manager_keeps_previous_state(parallel_core):
    model = build_gpt_model()
    mfc.enable()  # the PyNative fixes, global ones included, stay on throughout
    norms = mfc.enable_graph(model, fixes=("rms_norm",))
    assert set(norms.values()) == {"rms_norm"} and len(norms) == 5
    with mfc.mindformers_cpu_graph(model, exclude=("rms_norm",)) as swaps:
        assert set(swaps.values()) == {"outer", "flash_attention"} and len(swaps) == 4
        assert mfc.graph_swaps(model) == {**norms, **swaps}
    assert mfc.graph_swaps(model) == norms
    assert mfc.enabled_fixes() == mfc.FIXES  # not owned by the graph swaps: not turned off
    mfc.disable_graph()
    assert mfc.graph_swaps() == {} and _prim_attributes(model).keys() == {**norms, **swaps}.keys()
    assert mfc.enabled_fixes() == mfc.FIXES
    with pytest.raises(ValueError, match="no_such_fix"):
        mfc.enable_graph(model, exclude=("no_such_fix",))


def test_unsupported_flash_attention_refused_before_any_swap():
    from mindspore.ops.auto_generate import FlashAttentionScore, RmsNorm

    class Net(ms.nn.Cell):
        def __init__(self, layout, keep_prob):
            super().__init__()
            self.norm = RmsNorm(1e-6)
            self.fa = FlashAttentionScore(head_num=4, keep_prob=keep_prob, input_layout=layout)

    for layout, keep_prob, error, match in [("TND", 1.0, NotImplementedError, "layout TND"),
                                            ("BNSD", 0.9, ValueError, "keep_prob")]:
        net = Net(layout, keep_prob)
        norm = net.norm
        with pytest.raises(error, match=match):
            mfc.enable_graph(net)
        assert net.norm is norm and mfc.graph_swaps() == {} and not mfc.is_enabled()


def test_graph_cells_give_pynative_numbers(parallel_core):
    """The swapped-in cells run in PyNative too, with bit-identical numbers."""
    with mfc.mindformers_cpu():
        model = build_gpt_model(num_query_groups=2)
        loss, grads = train_step(model, *batch())
        with mfc.mindformers_cpu_graph(model):
            loss_cells, grads_cells = train_step(model, *batch())
    assert loss_cells == loss
    for name, grad in grads.items():
        np.testing.assert_array_equal(grads_cells[name], grad, err_msg=name)


# ------------------------------------------------------------------------------------------------
# kernels


def test_flash_attention_cell_matches_numpy_in_graph_mode():
    """One graph compile: the FlashAttentionScore layouts and causal modes MindFormers uses, GQA, against numpy."""
    from mindspore.ops.auto_generate import FlashAttentionScore

    b, n1, n2, s, d = 2, 4, 2, 8, 16
    rs = np.random.RandomState(1)
    q, k, v = (rs.randn(b, n, s, d).astype(np.float32) for n in (n1, n2, n2))
    scale = 1 / np.sqrt(d)
    expected = _attention_reference(q, k, v, scale)  # causal, [B, N, S, D]
    to_layout = {
        "BNSD": lambda t: t,
        "BSND": lambda t: t.transpose(0, 2, 1, 3),
        "BSH": lambda t: t.transpose(0, 2, 1, 3).reshape(b, s, -1),
        "SBH": lambda t: t.transpose(2, 0, 1, 3).reshape(s, b, -1),
    }
    cases = [("BNSD", 0), ("BSND", 0), ("BSH", 0), ("SBH", 0), ("BNSD", 2), ("SBH", 3)]
    explicit = ms.Tensor(np.triu(np.ones((b, 1, s, s), np.uint8), 1))  # 1 = masked out
    compressed = ms.Tensor(np.triu(np.ones((2048, 2048), np.uint8), 1))  # ignored by sparse modes 2 and 3

    class Net(ms.nn.Cell):
        def __init__(self):
            super().__init__()
            for i, (layout, mode) in enumerate(cases):
                setattr(self, f"fa{i}", FlashAttentionScore(head_num=n1, scale_value=scale, next_tokens=0,
                                                            input_layout=layout, sparse_mode=mode))

        def construct(self, *qkv):
            outs = ()
            for i, (_, mode) in enumerate(cases):
                mask = explicit if mode == 0 else compressed
                outs += (getattr(self, f"fa{i}")(qkv[3 * i], qkv[3 * i + 1], qkv[3 * i + 2],
                                                 None, None, None, mask)[3],)
            return outs

    net = Net()
    assert len(mfc.enable_graph(net, fixes=("flash_attention",))) == len(cases)
    ms.set_context(mode=ms.GRAPH_MODE)
    inputs = [ms.Tensor(to_layout[layout](t)) for layout, _ in cases for t in (q, k, v)]
    for (layout, mode), out in zip(cases, net(*inputs)):
        np.testing.assert_allclose(out.asnumpy(), to_layout[layout](expected), rtol=1e-5, atol=1e-6,
                                   err_msg=f"{layout} sparse_mode {mode}")


def test_split_with_size_gradient_right_in_graph_mode():
    """PyNative's SplitWithSize + Transpose gradient defect is absent in graph mode: no graph swap needed."""
    from mindspore.ops.auto_generate import SplitWithSize

    x = ms.Tensor(np.arange(24, dtype=np.float32).reshape(2, 3, 4))
    w_np = np.random.RandomState(0).randn(3, 3, 2).astype(np.float32)
    w = ms.Tensor(w_np)
    split = SplitWithSize()

    def f(t):
        _, right = split(t, (1, 3), 2)
        return (ms.ops.transpose(right, (2, 1, 0)) * w).sum()

    expected = np.zeros((2, 3, 4), np.float32)
    expected[..., 1:] = w_np.transpose(2, 1, 0)
    assert np.abs(ms.grad(f)(x).asnumpy() - expected).max() > 0.5  # PyNative: the defect
    ms.set_context(mode=ms.GRAPH_MODE)
    np.testing.assert_array_equal(ms.grad(f)(x).asnumpy(), expected)


# ------------------------------------------------------------------------------------------------
# models: 2 SGD steps, PyNative vs GRAPH_MODE (value_and_grad called directly) or a @jit train step


def _gpt2_shaped():
    from examples.megatron_vs_mindformers.mf_models import gpt2_model
    from examples.megatron_vs_mindformers.spec import FAMILIES

    model = gpt2_model(dataclasses.replace(FAMILIES["gpt2"], ffn_hidden_size=128))  # LayerNorm, GELU, tied
    model.set_train(True)
    ids, labels = batch()
    position_ids = ms.Tensor(np.tile(np.arange(SEQ, dtype=np.int32), (BATCH, 1)))  # use_eod_reset=True

    def loss_fn(x):  # a def, not a lambda: the graph parser needs the lambda alone on its line
        return model(x, position_ids=position_ids, labels=labels)[0]

    return model, loss_fn, ids


def _parallel_core(build):
    model = build()
    ids, labels = batch()

    def loss_fn(x):
        return model(x, labels=labels)[0]

    return model, loss_fn, ids


def _legacy_llama():
    model = build_legacy_llama(n_kv_heads=2)
    ids, _ = batch(length=SEQ + 1)  # shifts its labels internally
    return model, model, ids


MODELS = {  # name: (builder, number of cell swaps)
    "gpt-mha": (lambda: _parallel_core(build_gpt_model), 9),  # 5 RmsNorm, 2 Outer, 2 FlashAttentionScore
    "gpt-gqa": (lambda: _parallel_core(lambda: build_gpt_model(num_query_groups=2)), 9),
    "qwen3": (lambda: _parallel_core(build_qwen3_model), 13),  # + q/k layernorms
    "gpt2-shaped": (_gpt2_shaped, 2),  # FlashAttentionScore only: LayerNorm, GELU and positions are native
    "llama-legacy": (_legacy_llama, 0),  # no Ascend-only kernel with these flags
}


def _train(model, loss_fn, ids, jit, steps=2):
    """``steps`` SGD steps: [(loss, [grad ndarray in trainable_params order])]."""
    opt = ms.nn.SGD(model.trainable_params(), learning_rate=0.1)
    grad_fn = ms.value_and_grad(loss_fn, None, opt.parameters)

    def step(x):
        loss, grads = grad_fn(x)
        opt(grads)
        return loss, grads

    if jit:
        step = ms.jit(step)
    out = []
    for _ in range(steps):
        loss, grads = step(ids)
        out.append((float(loss.asnumpy().reshape(-1)[0]), [g.asnumpy() for g in grads]))
    return out


@pytest.mark.parametrize("name,variant", [("gpt-mha", "graph"), ("gpt-gqa", "graph"), ("gpt-gqa", "jit"),
                                          ("qwen3", "graph"), ("qwen3", "jit"), ("gpt2-shaped", "graph"),
                                          ("gpt2-shaped", "jit"), ("llama-legacy", "graph"), ("llama-legacy", "jit")])
def test_trains_like_pynative(name, variant, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    mfc.init_mindformers_cpu(seed=0, use_legacy=name == "llama-legacy")
    try:
        build, n_swaps = MODELS[name]
        model, loss_fn, ids = build()
        params = model.trainable_params()
        initial = [p.asnumpy().copy() for p in params]
        with mfc.mindformers_cpu():
            reference = _train(model, loss_fn, ids, jit=False)
        after_reference = [p.asnumpy().copy() for p in params]
        for p, value in zip(params, initial):
            p.set_data(ms.Tensor(value))

        if variant == "graph":
            ms.set_context(mode=ms.GRAPH_MODE)
        with mfc.mindformers_cpu_graph(model) as swaps:
            got = _train(model, loss_fn, ids, jit=variant == "jit")
        ms.set_context(mode=ms.PYNATIVE_MODE)
    finally:
        mfc.init_mindformers_cpu(seed=0)
    assert len(swaps) == n_swaps
    assert 3.0 < reference[0][0] < 7.0 and reference[1][0] < reference[0][0]  # ~ln(128) at init, then lower
    if name.startswith("gpt-"):
        assert sorted(p.name for p in params) == sorted(gpt_param_names())
    for step, ((loss, grads), (ref_loss, ref_grads)) in enumerate(zip(got, reference)):
        assert abs(loss - ref_loss) <= LOSS_TOL, (step, loss, ref_loss)
        for p, grad, ref in zip(params, grads, ref_grads):
            assert np.abs(ref).max() > 0, p.name
            assert _rel(grad, ref) <= GRAD_RTOL, (step, p.name, _rel(grad, ref))
    for p, ref in zip(params, after_reference):
        assert _rel(p.asnumpy(), ref) <= GRAD_RTOL, p.name


class _LossHead(ms.nn.Cell):
    """A Dense head and MindFormers' parallel_core CrossEntropyLoss, whose _LogSoftmax and _NLLLoss cells have custom
    bprops (MindSpore's PyNative never calls their forward hooks; their construct's gradient never runs)."""

    def __init__(self):
        super().__init__()
        from mindformers.parallel_core.training_graph.loss_func import CrossEntropyLoss

        self.head = ms.nn.Dense(8, 16)
        self.loss = CrossEntropyLoss()

    def construct(self, x, labels, mask):
        return self.loss(self.head(x), labels, mask)


def _capture_loss_head(mode, path):
    import tensordiff

    ms.set_context(mode=mode)
    ms.set_seed(3)
    model = _LossHead()
    rng = np.random.default_rng(0)
    x = ms.Tensor(rng.standard_normal((6, 8)).astype(np.float32))
    labels = ms.Tensor(rng.integers(0, 16, 6).astype(np.int32))
    mask = ms.Tensor(np.ones(6, np.float32))
    opt = ms.nn.SGD(model.trainable_params(), learning_rate=0.1)
    grad_fn = ms.value_and_grad(model, None, opt.parameters)
    classes = [type(c) for _, c in model.cells_and_names()]
    with tensordiff.capture(model, path, steps=1, optimizer=opt, tensors="all") as cap:
        loss, grads = grad_fn(x, labels, mask)
        opt(grads)
        cap.step(loss)
    assert [type(c) for _, c in model.cells_and_names()] == classes  # the cells' classes put back
    return float(loss)


def test_custom_bprop_cells_are_captured_alike_in_pynative_and_graph_mode(parallel_core, tmp_path):
    from tensordiff.store import CaptureFile

    pyn, graph = str(tmp_path / "p.h5"), str(tmp_path / "g.h5")
    with mfc.mindformers_cpu():
        loss_p = _capture_loss_head(ms.PYNATIVE_MODE, pyn)
    loss_g = _capture_loss_head(ms.GRAPH_MODE, graph)
    assert loss_p == loss_g
    want = {("forward", "loss._log_softmax", "output", "0"), ("forward", "loss._nllloss", "output", "0"),
            ("backward", "loss._log_softmax", "grad_output", "0"), ("backward", "loss._nllloss", "grad_output", "0")}
    with CaptureFile(pyn) as cp, CaptureFile(graph) as cg:
        for c in (cp, cg):
            got = {(r.phase, r.module, r.kind, r.slot): r for r in c.records(0)}
            assert want <= set(got), sorted(want - set(got))
            # no "gradient" of an integer tensor (the one-hot labels' zeros), as torch has none
            assert all(r.dtype.startswith("float") for r in c.records(0) if r.phase == "backward")
        p = {(r.phase, r.module, r.kind, r.slot): r for r in cp.records(0)}
        g = {(r.phase, r.module, r.kind, r.slot): r for r in cg.records(0)}
        for key in want:
            a, b = cp.array(p[key]), cg.array(g[key])
            assert _rel(b.astype(np.float64), a.astype(np.float64)) <= 1e-6, key
