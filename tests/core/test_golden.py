"""Golden-text tests of every renderable in ``tensordiff.report``, rich-style: render at 80 columns without
colour and compare with ``tests/golden/*.txt`` exactly.

Inputs are built synthetically (numpy, h5py, rich only: no torch, MindSpore, megatron or transformers):
a tiny MLP written as captures with ``helpers.write_capture``, checkpoints as numpy dicts, runs as ``Run``.
Every test chdirs into its tmp_path and uses relative file names, so no temporary path, date or host name
reaches a golden.

Rewrite the goldens after an intended change, then read them:

    TENSORDIFF_UPDATE_GOLDENS=1 .venv/bin/python -m pytest tests/core/test_golden.py
    .venv/bin/python tests/core/test_golden.py          # the same
"""

from __future__ import annotations

import math
import os
import re
import sys

import numpy as np
import pytest

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _TESTS not in sys.path:  # run as a script: tests/conftest.py has not put tests/ on the path
    sys.path.insert(0, _TESTS)

from helpers import GOLDEN_DIR, UPDATE_ENV, T, check_golden, render, write_capture

from tensordiff import _native
from tensordiff.ckpt import diff_tensors
from tensordiff.ckpt.compare import CheckpointDiff
from tensordiff.diff import DiffOptions
from tensordiff.explain import diagnose
from tensordiff.explain.replay import ReplayResult
from tensordiff.mapping import RenameRules
from tensordiff.report.capture import CaptureListing, NoiseSummary, RecordTable, ReplaySummary
from tensordiff.report.ckpt import CkptDiffReport, ConvertSummary
from tensordiff.report.diff import DiffReport
from tensordiff.report.runs import RunsReport
from tensordiff.runs import compare_runs
from tensordiff.runs.run import Run
from tensordiff.store import CaptureFile

WIDTH = 80


@pytest.fixture(autouse=True)
def _one_statistics_path(monkeypatch):
    """The goldens hold statistics to float64 rounding (a repeated weight's L2 shows as ~2.0e-16 or ~0 by the order
    of its sum): numpy's path everywhere, whether or not this machine builds the compiled loops (those are checked
    against it in test_native.py)."""
    monkeypatch.setitem(_native._state, "lib", None)

# ----------------------------------------------------------------------------------------- a tiny MLP
#
#   ToyMLP:  x ─ mlp[ linear_fc1 ─ gelu (a function, not a module) ─ linear_fc2 ] ─ head ─ logits
#   loss = 0.5 · Σ logits² / batch
#
# recorded the way the recorder does it: the weights, then every module's inputs and outputs in the order
# they run (a tensor handed on is recorded once and linked with same_as), the loss, the gradients of the
# forward tensors in the order backward produces them (grad_of), the parameter gradients.

BATCH = 2


def _gelu(h: np.ndarray, tanh: bool) -> np.ndarray:
    if tanh:
        return 0.5 * h * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * h ** 3)))
    erf = np.vectorize(math.erf, otypes=[np.float64])
    return 0.5 * h * (1.0 + erf(h / math.sqrt(2.0)))


def _dgelu(h: np.ndarray, tanh: bool) -> np.ndarray:
    if tanh:
        k = math.sqrt(2.0 / math.pi)
        t = np.tanh(k * (h + 0.044715 * h ** 3))
        return 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * k * (1.0 + 3 * 0.044715 * h * h)
    erf = np.vectorize(math.erf, otypes=[np.float64])
    return 0.5 * (1.0 + erf(h / math.sqrt(2.0))) + h * np.exp(-0.5 * h * h) / math.sqrt(2 * math.pi)


def _init(seed: int = 0) -> dict[tuple[str, str], np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        ("mlp.linear_fc1", "weight"): rng.normal(0, 0.5, (8, 4)), ("mlp.linear_fc1", "bias"): rng.normal(0, 0.1, 8),
        ("mlp.linear_fc2", "weight"): rng.normal(0, 0.5, (4, 8)), ("mlp.linear_fc2", "bias"): rng.normal(0, 0.1, 4),
        ("head", "weight"): rng.normal(0, 0.5, (3, 4)),
    }


CLASSES = {"": "ToyMLP", "mlp": "MLP", "mlp.linear_fc1": "Linear", "mlp.linear_fc2": "Linear", "head": "Linear",
           "mlp.act": "GELU", "drop": "Dropout",
           "pos_embed": "Embedding"}


def _f32(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


def toy_step(params: dict[tuple[str, str], np.ndarray], x: np.ndarray, *, gelu_tanh: bool = False, store: bool = True,
             dropout: bool = False, pad_vocab: int = 0, act_module: bool = False, fc1_repeat: int = 1,
             fc2_grad_scale: float = 1.0, fc2_error: float = 0.0, extra: dict[tuple[str, str], np.ndarray] | None = None,
             ) -> tuple[list[T], dict[tuple[str, str], np.ndarray], float]:
    """One training step of the toy MLP as records, its parameter gradients, and the loss.

    Knobs for side B: ``gelu_tanh`` (the tanh GELU), ``pad_vocab`` (head rows padded with zeros: other shapes),
    ``act_module`` (the GELU is a module of its own: records A lacks), ``fc1_repeat`` (linear_fc1's weight stored
    with every row repeated, its gradient split between the copies), ``fc2_grad_scale`` (a factor on one
    parameter gradient), ``fc2_error`` (linear_fc2's output off by this relative amount in a pattern no known
    cause makes: a kernel bug). For A: ``dropout`` (a Dropout module, p=0, between mlp and head,
    that B does not have; its gradient is not recorded, to keep the toy short). ``extra``: parameters no
    computation uses, recorded with the weights."""
    recs: list[T] = []

    def add(phase: str, module: str, kind: str, slot: str, value: np.ndarray, **kw) -> int:
        recs.append(T(phase, module, kind, slot, _f32(value), module_class=CLASSES.get(module, ""), store=store, **kw))
        return len(recs) - 1

    w1, b1 = params[("mlp.linear_fc1", "weight")], params[("mlp.linear_fc1", "bias")]
    w2, b2 = params[("mlp.linear_fc2", "weight")], params[("mlp.linear_fc2", "bias")]
    w3 = params[("head", "weight")]
    w3_b = np.concatenate([w3, np.zeros((pad_vocab, w3.shape[1]))]) if pad_vocab else w3

    add("weights", "mlp.linear_fc1", "param", "weight", np.repeat(w1, fc1_repeat, axis=0))
    add("weights", "mlp.linear_fc1", "param", "bias", b1)
    add("weights", "mlp.linear_fc2", "param", "weight", w2)
    add("weights", "mlp.linear_fc2", "param", "bias", b2)
    add("weights", "head", "param", "weight", w3_b)
    for (module, slot), value in (extra or {}).items():
        add("weights", module, "param", slot, value)

    h = x @ w1.T + b1
    g = _gelu(h, gelu_tanh)
    y = g @ w2.T + b2
    if fc2_error:
        y = y + fc2_error * np.abs(y).mean() * np.sin(np.arange(y.size) ** 2).reshape(y.shape)
    logits = y @ w3_b.T
    loss = 0.5 * float(np.sum(logits ** 2)) / BATCH

    root = add("forward", "", "input", "0", x, enter=len(recs))
    mlp = add("forward", "mlp", "input", "0", x, enter=len(recs), same_as=root)
    fc1_in = add("forward", "mlp.linear_fc1", "input", "0", x, enter=len(recs), parent="mlp", same_as=root)
    fc1_out = add("forward", "mlp.linear_fc1", "output", "0", h, enter=fc1_in, parent="mlp")
    if act_module:
        act_in = add("forward", "mlp.act", "input", "0", h, enter=len(recs), parent="mlp", same_as=fc1_out)
        act_out = add("forward", "mlp.act", "output", "0", g, enter=act_in, parent="mlp")
        fc2_in = add("forward", "mlp.linear_fc2", "input", "0", g, enter=len(recs), parent="mlp", same_as=act_out)
    else:
        fc2_in = add("forward", "mlp.linear_fc2", "input", "0", g, enter=len(recs), parent="mlp")
    fc2_out = add("forward", "mlp.linear_fc2", "output", "0", y, enter=fc2_in, parent="mlp")
    add("forward", "mlp", "output", "0", y, enter=mlp, same_as=fc2_out)
    into_head = fc2_out
    if dropout:
        drop_in = add("forward", "drop", "input", "0", y, enter=len(recs), same_as=fc2_out)
        into_head = add("forward", "drop", "output", "0", y, enter=drop_in)
    head_in = add("forward", "head", "input", "0", y, enter=len(recs), same_as=into_head)
    head_out = add("forward", "head", "output", "0", logits, enter=head_in)
    add("forward", "", "output", "0", logits, enter=root, same_as=head_out)
    add("loss", "loss", "loss", "value", np.float32(loss))

    dlogits = logits / BATCH
    dy = dlogits @ w3_b
    dg = dy @ w2
    dh = dg * _dgelu(h, gelu_tanh)
    add("backward", "head", "grad_output", "0", dlogits, grad_of=head_out, enter=head_in)
    add("backward", "mlp.linear_fc2", "grad_output", "0", dy, grad_of=fc2_out, enter=fc2_in, parent="mlp")
    add("backward", "mlp.linear_fc2", "grad_input", "0", dg, grad_of=fc2_in, enter=fc2_in, parent="mlp")
    add("backward", "mlp.linear_fc1", "grad_output", "0", dh, grad_of=fc1_out, enter=fc1_in, parent="mlp")

    grads = {("mlp.linear_fc1", "weight"): dh.T @ x, ("mlp.linear_fc1", "bias"): dh.sum(0),
             ("mlp.linear_fc2", "weight"): dy.T @ g, ("mlp.linear_fc2", "bias"): dy.sum(0),
             ("head", "weight"): (dlogits.T @ y)[:w3.shape[0]]}
    recorded = dict(grads)
    recorded[("mlp.linear_fc1", "weight")] = np.repeat(grads[("mlp.linear_fc1", "weight")] / fc1_repeat, fc1_repeat, axis=0)
    recorded[("mlp.linear_fc2", "weight")] = grads[("mlp.linear_fc2", "weight")] * fc2_grad_scale
    recorded[("head", "weight")] = dlogits.T @ y
    for (module, slot), value in recorded.items():
        add("param_grad", module, "grad", slot, value)
    return recs, grads, loss


def _batch(seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 1, (BATCH, 4))


def toy_run(path: str, steps: int = 1, lr: float = 0.1, framework: str = "torch", version: str = "2.4.0",
            scalars: bool = False, stored: tuple[int, ...] | None = None, per_step: dict[int, dict] | None = None,
            **knobs) -> str:
    """``steps`` steps of SGD on the toy MLP, written as a capture (steps not in ``stored``: statistics only).
    ``knobs`` go to every ``toy_step``, ``per_step[step]`` to that step only."""
    params = _init()
    all_steps, losses, values = [], [], {}
    for step in range(steps):
        store = stored is None or step in stored
        recs, grads, loss = toy_step(params, _batch(1 + step), store=store, **{**knobs, **(per_step or {}).get(step, {})})
        all_steps.append(recs)
        losses.append(loss)
        norm = math.sqrt(sum(float(np.sum(g ** 2)) for g in grads.values()))
        values[step] = {"loss": loss, "grad_norm": norm, "lr": lr}
        params = {k: v - lr * grads[k] for k, v in params.items()}
    return write_capture(path, all_steps, framework=framework, losses=losses, scalars=values if scalars else None,
                         framework_version=version, model_class="ToyMLP", **({"rank": 0, "world_size": 1} if scalars else {}))


# ----------------------------------------------------------------------------------------- plumbing
@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    """Relative file names only: no temporary path in any golden."""
    monkeypatch.chdir(tmp_path)


def golden(name: str, renderable, width: int = WIDTH, normalise=None) -> str:
    text = render(renderable, width=width)
    if normalise is not None:
        text = normalise(text)
    check_golden(name, text)
    return text


# ----------------------------------------------------------------------------------------- tensordiff diff
@pytest.fixture
def gelu_pair():
    """A: the exact GELU; B (another framework): the tanh GELU, so linear_fc2's input is the first divergence."""
    a = toy_run("a.h5")
    b = toy_run("b.h5", framework="mindspore", version="2.9.0", gelu_tanh=True)
    return diagnose(a, b)


def test_diff_report(gelu_pair):
    res = gelu_pair
    assert res.first is not None and res.first.module_a == "mlp.linear_fc2" and res.first.kind == "input"
    assert res.hints and res.hints[0].cause == "activation"
    golden("diff_report.txt", DiffReport(res))


def test_diff_report_first_only(gelu_pair):
    golden("diff_report_first_only.txt", DiffReport(gelu_pair, first_only=True))


def test_diff_report_json_keys(gelu_pair):
    report = DiffReport(gelu_pair).to_dict()
    # the keys documented since format 1 stay; coverage and the outcome were added with the inconclusive verdict
    assert set(report) >= {"tensordiff_report", "a", "b", "steps", "hints", "hints_note", "summary",
                           "first_divergence", "rows", "outcome", "exit_code", "inconclusive_reasons", "coverage"}
    assert (report["outcome"], report["exit_code"], report["inconclusive_reasons"]) == ("diverged", 1, [])
    assert set(report["coverage"]) == {"weights", "forward", "loss", "backward", "param_grad"}
    assert set(report["a"]) == {"path", "framework", "framework_version", "capture_mode"}
    assert set(report["summary"]) >= {"ok", "diverged", "drift", "only_a", "only_b", "shape_mismatch"}
    assert set(report["rows"][0]) >= {"step", "phase", "verdict", "a", "b", "metrics"}
    assert report["first_divergence"]["location"] == "inside mlp between linear_fc1 and linear_fc2"
    assert report["hints"][0]["cause"] == "activation"


#: B stores linear_fc1's weight with every row twice (like repeated KV heads) and sums its gradient
#: over the copies: the mapping undoes both. Statistics follow the un-repeat; through the sum only the total
#: follows, and not even that after an un-repeat (which keeps one part of each run): that row is skipped.
REPEAT_MAPPING = """
rules:
  - {b: 'mlp\\.linear_fc1', a: mlp.linear_fc1, phases: [weights], params: {weight: 'unrepeat(times=2, dim=0)'}}
  - {b: 'mlp\\.linear_fc1', a: mlp.linear_fc1, phases: [param_grad],
     params: {weight: ['unrepeat(times=1, dim=0)', 'unrepeat_sum(times=2, dim=0)']}}
"""


def test_diff_report_every_verdict():
    """One report with a row of each verdict but drift: ok, DIVERGED (FIRST, with a factor hint), unmatched on
    either side, SHAPE, skipped, and statistics-only rows (step 1 is captured with store=False).

    B pads the head's vocabulary by a row (other shapes), has its GELU as a module (records A lacks), has no
    dropout module (records B lacks), stores linear_fc1's weight repeated (REPEAT_MAPPING) and doubles one
    gradient in step 0 (a loss scale not undone); both sides then take the same SGD step."""
    a = toy_run("a.h5", steps=2, stored=(0,), dropout=True)
    b = toy_run("b.h5", steps=2, stored=(0,), framework="mindspore", version="2.9.0", pad_vocab=1, act_module=True,
                fc1_repeat=2, per_step={0: {"fc2_grad_scale": 2.0}})
    res = diagnose(a, b, DiffOptions(mapping=RenameRules.from_text(REPEAT_MAPPING)))
    seen = {r.verdict for r in res.rows}
    assert seen == {"ok", "diverged", "unmatched", "shape", "skipped"}, seen
    assert res.unmatched("a") and res.unmatched("b")
    assert any(r.metrics is not None and r.metrics.source == "stats" for r in res.rows)
    assert res.first is not None and res.first.phase == "param_grad" and res.first.step == 0
    assert res.hints and res.hints[0].cause == "factor"
    golden("diff_report_verdicts.txt", DiffReport(res))


def test_diff_report_activation_module():
    """Both sides have the GELU as a module of its own (mlp.act); B's is the tanh GELU: its output diverges while
    its input agrees, and the hint rebuilds both from the module's own input."""
    a = toy_run("a.h5", act_module=True)
    b = toy_run("b.h5", framework="mindspore", version="2.9.0", act_module=True, gelu_tanh=True)
    res = diagnose(a, b)
    assert (res.first.module_a, res.first.kind) == ("mlp.act", "output")
    assert res.hints[0].cause == "activation" and res.hints[0].details["input"] == "mlp.act input.0"
    golden("diff_report_activation_module.txt", DiffReport(res, first_only=True))


def test_diff_report_no_known_cause():
    """B's linear_fc2 computes its output slightly off in a pattern no check reproduces: the report names the
    causes tested and those that could not be, with the reason; the JSON has every check's status."""
    a = toy_run("a.h5")
    b = toy_run("b.h5", framework="mindspore", version="2.9.0", fc2_error=1e-3)
    res = diagnose(a, b)
    assert (res.first.module_a, res.first.kind) == ("mlp.linear_fc2", "output") and res.hints == []
    # activation: tested (a SwiGLU of the 8-wide input would be 4 wide); a norm keeps the shape: not tested
    assert res.checked == ("activation", "dtype", "layout", "bias", "dropout", "loss normalisation", "aux loss",
                           "constant factor", "vocabulary padding", "checkpoint", "optimizer step")
    assert [(c.cause, c.reason) for c in res.not_checked] == [
        ("norm epsilon", "no input of a fitting shape"),
        ("RoPE", "needs q/k (4-D) or an attention output (3-D), this one is 2-D"),
        ("attention scale", "not an attention output (a 3-D forward tensor) or the scores a softmax module takes"),
        ("tied embeddings", "not a parameter gradient of a matrix (forward)"),
        ("router normalisation", "not a block's 3-D forward output")]
    checks = DiffReport(res).to_dict()["checks"]
    assert [c["cause"] for c in checks] == ["activation", "norm epsilon", "RoPE", "attention scale", "dtype", "layout",
                                            "bias", "dropout", "loss normalisation", "aux loss", "tied embeddings",
                                            "router normalisation", "constant factor", "vocabulary padding",
                                            "checkpoint",
                                            "optimizer step"]
    assert checks[1] == {"cause": "norm epsilon", "ran": False, "reason": "no input of a fitting shape"}
    golden("diff_report_no_cause.txt", DiffReport(res, first_only=True))


def test_diff_report_drift():
    """A parameter nothing computes with (like attention's key bias, which softmax ignores) moved apart by B's
    optimizer in step 0: drift at step 1, not a divergence. B is in sync again at step 2, where its tanh GELU
    diverges (a pos_embed still apart at step 2 would itself be named the first divergence there). Only the
    weights tables (``phases``); the first-divergence panel is still shown."""
    pos = np.linspace(-1, 1, 6)
    a = toy_run("a.h5", steps=3, extra={("pos_embed", "weight"): pos})
    b = toy_run("b.h5", steps=3, extra={("pos_embed", "weight"): pos},
                per_step={1: {"extra": {("pos_embed", "weight"): pos + 0.05}}, 2: {"gelu_tanh": True}})
    res = diagnose(a, b)
    assert res.count("drift") == 1
    assert res.first is not None and (res.first.step, res.first.phase) == (2, "forward")
    golden("diff_report_drift.txt", DiffReport(res, phases=["weights"]))


def test_diff_report_clean():
    a = toy_run("a.h5", steps=2)
    b = toy_run("b.h5", steps=2)
    res = diagnose(a, b)
    assert res.first is None
    text = golden("diff_report_clean.txt", DiffReport(res))
    assert "No divergence" in text


# ----------------------------------------------------------------------------------------- tensordiff ckpt
def _ckpt_pair() -> tuple[dict, dict, dict]:
    rng = np.random.default_rng(3)
    f32 = lambda *shape: rng.normal(0, 0.02, shape).astype(np.float32)
    layer = "decoder.layers.11.self_attention"
    emb, qkv, proj, fc1, fc2 = f32(32, 8), f32(24, 8), f32(8, 8), f32(32, 8), f32(8, 16)
    a = {
        "embedding.word_embeddings.weight": emb,
        f"{layer}.linear_qkv.weight": qkv,  # identical
        f"{layer}.linear_qkv.layer_norm_weight": np.ones(8, np.float32),  # float32 vs float16: within tolerance
        f"{layer}.linear_proj.weight": proj,  # differs
        "decoder.layers.11.mlp.linear_fc1.weight": fc1,  # differs: B's rows are interleaved (noted)
        "decoder.layers.11.mlp.linear_fc2.weight": fc2,  # other shape
        "decoder.layers.11.mlp.linear_fc2.bias": np.zeros(8, np.float32),  # only in A
        "output_layer.weight": emb.copy(),
    }
    inter = np.empty_like(fc1)
    inter[0::2], inter[1::2] = fc1[:16], fc1[16:]
    b = {
        "embedding.word_embeddings.weight": emb.copy(),
        f"{layer}.linear_qkv.weight": qkv.copy(),
        f"{layer}.linear_qkv.layer_norm_weight": (1 + 1e-3 * (np.arange(8) % 2)).astype(np.float16),
        f"{layer}.linear_proj.weight": proj * np.float32(1.5),
        "decoder.layers.11.mlp.linear_fc1.weight": inter,
        "decoder.layers.11.mlp.linear_fc2.weight": f32(8, 24),
        "output_layer.weight": emb.copy(),
        "decoder.layers.11.self_attention.core_attention.rotary_pos_emb.inv_freq": np.ones(2, np.float32),  # only in B
    }
    # B's fused QKV came from three MindFormers tensors (a brace group that fits the column: see
    # test_known_bug_ckpt_brace_group_wider_than_column)
    mf = "model.layers.11.attention"
    origin = {f"{layer}.linear_qkv.weight": (f"{mf}.wq.weight", f"{mf}.wk.weight", f"{mf}.wv.weight")}
    return a, b, origin


def test_ckpt_diff_report():
    a, b, origin = _ckpt_pair()
    rows = diff_tensors(a, b, b_origin=origin)
    fc1 = next(r for r in rows if r.name.endswith("linear_fc1.weight"))
    fc1.note = "equals B without interleave(dim=0): check --var fc1_layout (now interleaved)"  # as _explain_layouts writes it
    diff = CheckpointDiff("mcore.safetensors", "mf.safetensors", rows,
                          how="(mindformers, converted to A's mcore names and layout)",
                          mapping="mcore-mindformers (fc1_layout=interleaved)",
                          notes=["2 entries of B ignored by the table (global_step, learning_rate)"])
    assert {r.verdict for r in rows} == {"identical", "ok", "differs", "shape", "a_only", "b_only"}
    golden("ckpt_diff.txt", CkptDiffReport(diff))


def test_ckpt_diff_report_same_collapsed():
    """Many identical tensors beyond max_rows collapse into one line; the verdict is 'Same checkpoint'."""
    rng = np.random.default_rng(4)
    a = {f"decoder.layers.{i}.mlp.linear_fc{j}.weight": rng.normal(0, 1, (4, 4)).astype(np.float32)
         for i in range(6) for j in (1, 2)}
    b = {k: v.copy() for k, v in a.items()}
    diff = CheckpointDiff("a.safetensors", "b.safetensors", diff_tensors(a, b))
    assert diff.passed
    golden("ckpt_diff_same.txt", CkptDiffReport(diff, max_rows=4))


def _mb_free(text: str) -> str:
    # the converted file's size depends on the safetensors header layout (its padding changed across versions)
    return re.sub(r"\d+\.\d (kB|MB)", r"N.N \1", text)


def test_ckpt_convert_summary():
    pytest.importorskip("safetensors")
    from tensordiff.ckpt import save
    from tensordiff.ckpt.convert import convert_file

    rng = np.random.default_rng(5)
    hidden, heads, groups, head_dim, ffn, vocab = 8, 2, 1, 4, 16, 32
    src = {"embedding.word_embeddings.weight": (vocab, hidden)}
    for i in range(2):
        layer = f"decoder.layers.{i}"
        src.update({
            f"{layer}.input_layernorm.weight": (hidden,),
            f"{layer}.self_attention.linear_qkv.weight": ((heads + 2 * groups) * head_dim, hidden),
            f"{layer}.self_attention.linear_proj.weight": (hidden, heads * head_dim),
            f"{layer}.pre_mlp_layernorm.weight": (hidden,),
            f"{layer}.mlp.linear_fc1.weight": (2 * ffn, hidden),
            f"{layer}.mlp.linear_fc2.weight": (hidden, ffn),
        })
    src.update({"decoder.final_layernorm.weight": (hidden,), "output_layer.weight": (vocab, hidden),
                "decoder.layers.0.self_attention.core_attention.rotary_pos_emb.inv_freq": (head_dim // 2,)})
    tensors = {k: rng.normal(0, 1, s).astype(np.float16 if len(s) == 1 else np.float32) for k, s in src.items()}
    save(tensors, "mcore.safetensors")
    done = convert_file("mcore.safetensors", "mf.safetensors", "mcore-mindformers", to="mindformers")
    assert done.read == len(src) and len(done.conversion.tensors) == len(src) - 1
    golden("ckpt_convert.txt", ConvertSummary(done), normalise=_mb_free)


# ----------------------------------------------------------------------------------------- tensordiff runs
def _curve(n: int, start: float, end: float) -> dict[int, float]:
    return {s: end + (start - end) * math.exp(-(s - 1) / 6) for s in range(1, n + 1)}


def _runs(b_loss, b_gn) -> tuple[Run, Run]:
    loss, gn = _curve(20, 10.5, 6.0), _curve(20, 4.0, 1.2)
    a = Run("megatron.log", "megatron-lm log", loss=loss, grad_norm=gn, lr=dict.fromkeys(loss, 0.0003),
            val_loss={10: 6.9, 20: 6.2})
    b = Run("mindformers.log", "mindformers log", loss={s: b_loss(s, v) for s, v in loss.items()},
            grad_norm={s: b_gn(s, v) for s, v in gn.items()}, lr=dict.fromkeys(loss, 0.0003),
            val_loss={10: b_loss(10, 6.9), 20: b_loss(20, 6.2)})
    return a, b


def test_runs_report_pass():
    a, b = _runs(lambda s, v: v * (1 + 2e-4 * (-1) ** s), lambda s, v: v * (1 + 2e-3 * (-1) ** s))
    res = compare_runs(a, b, threshold=0.01, warmup=2, ppl_threshold=0.02, grad_norm_threshold=0.05)
    assert res.passed
    golden("runs_pass.txt", RunsReport(res))


def test_runs_report_fail():
    a, b = _runs(lambda s, v: v * (1 + (0.003 * (s - 10) if s > 10 else 1e-4)), lambda s, v: v * 1.08)
    b.relogged = {11, 12}  # a restart from a checkpoint logged these steps again
    res = compare_runs(a, b, threshold=0.01, warmup=2, ppl_threshold=0.02, grad_norm_threshold=0.05)
    assert not res.passed and len(res.failures) == 4, res.failures
    golden("runs_fail.txt", RunsReport(res))


# ----------------------------------------------------------------------------------------- ls / show
def _mb_normalised(text: str) -> str:
    # the capture's size in MB depends on the h5py / HDF5 version (metadata layout): not part of the golden
    return re.sub(r"^(\S+): \d+\.\d\d MB,", r"\1: N.NN MB,", text, count=1)


def test_ls():
    path = toy_run("run.h5", steps=3, scalars=True, stored=(0,))
    with CaptureFile(path) as cap:
        text = golden("ls.txt", CaptureListing(cap), normalise=_mb_normalised)
    assert "N.NN MB" in text


def test_show():
    path = toy_run("run.h5", steps=1)
    with CaptureFile(path) as cap:
        records = cap.records(0)
        table = RecordTable(f"{path} step 0", records)
        text = render(table)
        lines = text.splitlines()
        for r in records[:5]:  # one line per record, names and statistics whole
            assert any(r.label in line and f"{r.mean:.4g}" in line and f"{r.l2:.4g}" in line for line in lines), r.label
        golden("show.txt", table)


# ----------------------------------------------------------------------------------------- replay / noise
def test_replay_summary():
    res = ReplayResult(module="mlp.linear_fc2", step=0, call=0, module_class="Linear", ab=1.6e-4, replay_a=0.0,
                       replay_b=1.5e-4, replay_b_vs_a=2.2e-7, verdict="introduced",
                       notes=["input 1: not captured on B, A's used"])
    golden("replay.txt", ReplaySummary(res))


def test_noise_summary():
    noise = {("forward", f"layers.{i}", 0, "output", "0"): 1e-7 * (i + 1) for i in range(5)}
    noise.update({("backward", f"layers.{i}", 0, "grad_output", "0"): 3e-7 * (i + 1) for i in range(4)})
    noise.update({("param_grad", f"layers.{i}", 0, "grad", "weight"): 2e-6 * (i + 1) for i in range(2)})
    golden("noise.txt", NoiseSummary("noise.json", noise, "two captures of the same run"))


# ----------------------------------------------------------------------------------------- wrapping and plurals
def test_a_brace_group_wider_than_the_name_column_wraps_at_commas():
    a, b, _ = _ckpt_pair()
    layer = "decoder.layers.11.self_attention"
    origin = {f"{layer}.linear_qkv.weight": tuple(f"{layer}.linear_{x}.weight" for x in "qkv")}
    text = render(CkptDiffReport(CheckpointDiff("a.safetensors", "b.safetensors", diff_tensors(a, b, b_origin=origin))))
    words = re.findall(r"[A-Za-z_]+", text)
    assert {"linear_q", "linear_k", "linear_v", "self_attention"} <= set(words)  # no name cut inside a word


def test_one_unmatched_record_is_singular():
    a = toy_run("a.h5", extra={("pos_embed", "weight"): np.zeros(6)})
    b = toy_run("b.h5")
    text = render(DiffReport(diagnose(a, b), phases=["weights"]))
    assert "A only, no counterpart in B: 1 record of pos_embed" in text


def test_one_noise_tensor_is_singular():
    text = render(NoiseSummary("noise.json", {("loss", "loss", 0, "loss", "value"): 0.0}, "two captures of the same run"))
    assert "1 tensors" not in text


# ----------------------------------------------------------------------------------------- every golden
def test_goldens_fit_80_columns():
    if os.environ.get(UPDATE_ENV):
        pytest.skip("goldens are being rewritten")
    # but the output of a pipe, which is as wide as its names (test_terminal.py)
    names = sorted(f for f in os.listdir(GOLDEN_DIR) if f.endswith(".txt") and f != "width_pipe.txt")
    assert names
    for name in names:
        with open(os.path.join(GOLDEN_DIR, name), encoding="utf-8") as fh:
            for number, line in enumerate(fh.read().splitlines(), 1):
                assert len(line) <= WIDTH, f"{name}:{number} is {len(line)} columns: {line!r}"


if __name__ == "__main__":
    os.environ[UPDATE_ENV] = "1"
    sys.exit(pytest.main([os.path.abspath(__file__), "-q", "-p", "no:cacheprovider"]))
