"""Megatron vs MindSpore end to end on the CPU: real megatron-core and MindSpore, one shared checkpoint and batch,
each side in its own process, as examples/megatron_vs_mindformers/run.py runs them. With every fix the two agree
within FP32 noise; each fault is named where it is made.

The MindSpore side is a real MindFormers model for every family but ``gpt2``: that one is the hand-written MindSpore
port of GPT-2 in ``examples/megatron_vs_mindformers/ms_gpt.py`` (MindFormers 1.9 has no trainable GPT-2 of the
mcore kind), and its test ids say so (``gpt2-msport``)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from accounting_checks import unaccounted_citations

# find, do not import: importing MindFormers writes ./output/log into the current directory
for _name in ("megatron.core", "mindspore", "mindformers"):
    if importlib.util.find_spec(_name.split(".")[0]) is None:
        pytest.skip(f"{_name} is not installed", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = os.path.join(ROOT, "examples", "megatron_vs_mindformers", "run.py")


GPT2 = pytest.param("gpt2", id="gpt2-msport")  # the hand-written MindSpore port, not a MindFormers model


@pytest.fixture(scope="module")
def pair_run():
    """``pair_run(tmp_path, family, fault, ...)``: run.py's exit code, JSON report and output. The Megatron side
    (which does not depend on the MindSpore side's fault or mode) is made by a family's first run in this module
    and reused by the later ones (run.py --reuse-megatron); any test alone makes its own."""
    megatron_side: dict[str, str] = {}  # family -> the output folder of its first run

    def run(tmp_path, family, fault="none", graph=False, jit=False, no_loss_mask=False):
        return _run(megatron_side, tmp_path, family, fault, graph, jit, no_loss_mask)

    return run


def _run(megatron_side, tmp_path, family, fault, graph, jit, no_loss_mask):
    out = tmp_path / f"{family}-{fault}{'-graph' if graph else ''}{'-jit' if jit else ''}"
    reuse = ["--reuse-megatron", megatron_side[family]] if family in megatron_side else []
    proc = subprocess.run([sys.executable, RUN, "--family", family, "--fault", fault, "--out", str(out)]
                          + (["--graph"] if graph else []) + (["--jit"] if jit else [])
                          + (["--no-loss-mask"] if no_loss_mask else []) + reuse,
                          capture_output=True, text=True, timeout=900)
    report = out / "report.json"
    assert report.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    if not reuse and (out / "run.json").exists():
        megatron_side[family] = str(out)
    with open(report) as f:
        return proc.returncode, json.load(f), proc.stdout


@pytest.mark.parametrize("family", [GPT2, "llama", "llama-stacked", "qwen3", "llama-legacy"])
def test_all_fixes_agree_within_fp32_noise(pair_run, tmp_path, family):
    code, report, out = pair_run(tmp_path, family)
    # the legacy Llama keeps q/k/v and w1/w3 apart where megatron fuses them: joined by the built-in mapping
    assert code == 0, out[-3000:]
    assert report["outcome"] == "agree" and report["inconclusive_reasons"] == []
    assert all(c["only_a"] == c["only_b"] == 0 for c in report["coverage"].values())
    assert report["first_divergence"] is None and report["hints"] == []
    picked = {"gpt2": None, "llama": "mcore-mindformers (fc1_layout=interleaved, kv_repeat=1), picked from the captures",
              # stacked fc1, keyword calls, no --mapping given: the layout is read from B's MLP class
              "llama-stacked": "mcore-mindformers (fc1_layout=stacked, kv_repeat=1), picked from the captures",
              "qwen3": "mcore-mindformers (fc1_layout=interleaved, kv_repeat=2), picked from the captures",
              "llama-legacy": "mcore-mindformers-llama (heads=4, groups=4), picked from the captures"}[family]
    assert picked is None or report["mapping_note"].startswith(picked), report["mapping_note"]
    s = report["summary"]
    assert s["diverged"] == 0 and s["shape_mismatch"] == 0
    assert s["ok"] > (150 if family == "llama-legacy" else 250)  # layers, gradients and weights really were compared
    compared = {(r["phase"], r["module_a"]) for r in report["rows"] if r["verdict"] == "ok"}
    # the legacy Llama's w1 applies SiLU in its own cell: its fc1 output is not compared, the joined weights are
    module = "decoder.layers.1.mlp.linear_fc2" if family == "llama-legacy" else "decoder.layers.1.mlp.linear_fc1"
    for phase in ("weights", "forward", "backward", "param_grad"):
        assert (phase, module) in compared
    for phase in ("weights", "forward", "backward", "param_grad"):  # q/k/v joined onto linear_qkv in every family
        assert (phase, "decoder.layers.1.self_attention.linear_qkv") in compared
    if family == "llama-legacy":
        assert ("weights", "decoder.layers.1.mlp.linear_fc1") in compared
        assert ("param_grad", "decoder.layers.1.mlp.linear_fc1") in compared
    assert ("loss", "loss") in compared
    # FP32 noise between the frameworks stays far below the tolerance
    worst = max(r["metrics"]["rel_l2"] for r in report["rows"] if r["verdict"] == "ok" and r["step"] == 0
                and r["metrics"]["source"] == "tensor")
    assert worst < 1e-5
    assert unaccounted_citations(report["rows"]) == []


@pytest.mark.parametrize("graph", [False, True], ids=["pynative", "graph"])
def test_labels_and_no_loss_mask_agree(pair_run, tmp_path, graph):
    """MindFormers' GPTModel called with labels and no loss_mask= (as users commonly call it) builds its own loss
    mask, ids that are not the pad token times labels that are not the ignore index, [B, S] and flattened: all
    ones on this batch, accounted for by value (megatron passes none), and the pair agrees; in GRAPH_MODE too."""
    code, report, out = pair_run(tmp_path, "llama", graph=graph, no_loss_mask=True)
    assert code == 0 and report["outcome"] == "agree", out[-3000:]
    assert all(c["only_a"] == c["only_b"] == 0 for c in report["coverage"].values())
    for step in (0, 1):
        made = {r["b"]: r["accounted"] for r in report["rows"] if r["step"] == step and r["a"] is None
                and r["b"] in ("preprocess_labels_and_masks output.2", "preprocess_labels_and_masks output.4")}
        assert made == {
            f"preprocess_labels_and_masks output.{slot}": {
                "rule": "loss-mask", "why": f"a loss mask of all ones [{shape}]: every token counts, as on the other "
                                            "side, which passes none"}
            for slot, shape in (("2", "2x16"), ("4", "32"))}
    assert unaccounted_citations(report["rows"]) == []


def test_split_with_size_gradient_defect_is_named(pair_run, tmp_path):
    code, report, _ = pair_run(tmp_path, "llama", "split-with-size")
    assert code == 1
    first = report["first_divergence"]
    assert (first["step"], first["phase"]) == (0, "backward")
    assert first["module_a"] == "decoder.layers.1.self_attention.linear_qkv"
    assert first["kind"] == "grad_output"
    assert first["location"] == ("in the backward of code inside decoder.layers.1.self_attention "
                                 "between linear_qkv and q_layernorm")
    # the forward pass and the loss agree: only gradients show the defect
    early = [r["verdict"] for r in report["rows"] if r["step"] == 0 and r["phase"] in ("forward", "loss") and r["a"] and r["b"]]
    assert len(early) > 50 and set(early) == {"ok"}
    # MindSpore's gradient of the transposed split output holds the right values in the wrong places
    top = report["hints"][0]
    assert top["cause"] == "layout" and top["details"]["op"] == "rearranged" and top["explained"] > 0.99


def test_fc1_loaded_unconverted_is_a_checkpoint_divergence(pair_run, tmp_path):
    code, report, _ = pair_run(tmp_path, "llama", "fc1-unconverted")
    assert code == 1
    first = report["first_divergence"]
    assert (first["step"], first["phase"], first["module_a"], first["slot"]) == (
        0, "weights", "decoder.layers.0.mlp.linear_fc1", "weight")
    assert first["location"] == "in decoder.layers.0.mlp.linear_fc1.weight before the first step (the checkpoint)"
    bad = {r["module_a"] for r in report["rows"] if r["step"] == 0 and r["phase"] == "weights" and r["verdict"] == "diverged"}
    assert bad == {"decoder.layers.0.mlp.linear_fc1", "decoder.layers.1.mlp.linear_fc1"}
    assert [h["cause"] for h in report["hints"]] == ["layout", "checkpoint"]  # the specific cause first
    assert report["hints"][0]["details"]["op"] == "deinterleave(dim=0)"


def test_mindspore_default_gelu_is_named_on_the_msport_gpt2(pair_run, tmp_path):
    code, report, _ = pair_run(tmp_path, "gpt2", "gelu-approx")
    assert code == 1
    first = report["first_divergence"]
    assert (first["step"], first["phase"], first["module_a"], first["kind"]) == (
        0, "forward", "decoder.layers.0.mlp.linear_fc2", "input")
    assert first["location"] == "inside decoder.layers.0.mlp between linear_fc1 and linear_fc2"
    assert first["where"]["b_module"] == "decoder.layers.0.mlp.activation_func"
    assert first["where"]["b_module_class"] == "GELU"
    top = report["hints"][0]
    assert top["cause"] == "activation" and top["details"]["b"] == "gelu (tanh approximation)"
    assert top["explained"] > 0.99


def test_mindspore_default_layernorm_epsilon_is_named_on_the_msport_gpt2(pair_run, tmp_path):
    code, report, _ = pair_run(tmp_path, "gpt2", "ln-eps")
    assert code == 1
    first = report["first_divergence"]
    assert (first["step"], first["phase"], first["module_a"], first["kind"]) == (
        0, "forward", "decoder.layers.0.input_layernorm", "output")
    assert first["location"] == "in decoder.layers.0.input_layernorm"
    top = report["hints"][0]
    assert top["cause"] == "norm-epsilon" and "MindSpore nn.LayerNorm default" in top["title"]
    assert top["details"]["eps_b"] == pytest.approx(1e-7, rel=0.05)


# The MindSpore side in GRAPH_MODE (captured through probes compiled into the graph): the verdicts of PyNative above.
GRAPH_CASES = {
    # clean: the embedding's output gradient (MindFormers' Morph output, its dtype inferred as int32), identity
    # q/k norms (one tensor in and out in PyNative), legacy Llama's attention output (wo's input only)
    ("llama", "none"): None,
    ("llama-legacy", "none"): None,
    ("gpt2", "gelu-approx"): (0, "forward", "decoder.layers.0.mlp.linear_fc2", "input",
                              "inside decoder.layers.0.mlp between linear_fc1 and linear_fc2"),
    ("qwen3", "fc1-unconverted"): (0, "weights", "decoder.layers.0.mlp.linear_fc1", "param",
                                   "in decoder.layers.0.mlp.linear_fc1.weight before the first step (the checkpoint)"),
}


@pytest.mark.parametrize(("family", "fault"), sorted(GRAPH_CASES),
                         ids=[f"{f}{'-msport' if f == 'gpt2' else ''}-{x}" for f, x in sorted(GRAPH_CASES)])
def test_graph_mode_gives_the_pynative_verdicts(pair_run, tmp_path, family, fault):
    code, report, out = pair_run(tmp_path, family, fault, graph=True)
    _assert_graph_verdict(code, report, out, GRAPH_CASES[(family, fault)])


@pytest.mark.parametrize(("family", "fault"), [pytest.param("gpt2", "gelu-approx", id="gpt2-msport-gelu-approx"),
                                               ("llama", "none")])
def test_a_jit_train_step_run_from_pynative_gives_the_graph_mode_verdicts(pair_run, tmp_path, family, fault):
    """run.py --jit: the MindSpore side stays in PyNative, its whole train step a ``mindspore.jit`` function,
    captured with ``graph=True`` through the same probes."""
    code, report, out = pair_run(tmp_path, family, fault, jit=True)
    _assert_graph_verdict(code, report, out, GRAPH_CASES[(family, fault)])


def _assert_graph_verdict(code, report, out, expected):
    assert report["b"]["capture_mode"] == "graph" and report["a"]["capture_mode"] == "hooks"
    assert unaccounted_citations(report["rows"]) == []
    if expected is None:
        assert code == 0 and report["outcome"] == "agree", out[-3000:]
        assert report["summary"]["diverged"] == 0 and report["summary"]["ok"] > 150
        assert all(c["only_a"] == c["only_b"] == 0 for c in report["coverage"].values())
        ok = {(r["step"], r["a"]) for r in report["rows"] if r["verdict"] == "ok"}
        assert {(0, "embedding.word_embeddings grad_output.0"), (1, "embedding.word_embeddings grad_output.0")} <= ok
        return
    assert code == 1, out[-3000:]
    first = report["first_divergence"]
    assert (first["step"], first["phase"], first["module_a"], first["kind"], first["location"]) == expected


def test_reuse_megatron_refuses_a_folder_of_another_family_or_none(tmp_path):
    """run.py --reuse-megatron (how the tests above make each family's Megatron side once) takes an earlier run's
    Megatron files only when that run was of the same family and steps (its run.json)."""
    other = tmp_path / "gpt2"
    other.mkdir()
    (other / "run.json").write_text(json.dumps({"family": "gpt2", "steps": 2}))
    for folder, words in ((other, "made for {'family': 'gpt2', 'steps': 2}, this run is {'family': 'llama', 'steps': 2}"),
                          (tmp_path, "no run.json of an earlier run.py there")):
        proc = subprocess.run([sys.executable, RUN, "--family", "llama", "--out", str(tmp_path / "out"),
                               "--reuse-megatron", str(folder)], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and words in proc.stderr, proc.stderr[-2000:]
        assert not (tmp_path / "out" / "megatron.h5").exists()
