"""Hugging Face LlamaForCausalLM vs megatron-core (llama spec), from one checkpoint, as a new user runs them.

Both training scripts (examples/hf_vs_megatron/) are plain: neither imports tensordiff. They are captured
with `tensordiff capture --auto`, the checkpoint is converted with the built-in mcore-hf-llama table, and
`tensordiff diff` is given no --mapping and no --var: it must pick mcore-hf-llama (4 heads in 2 query
groups) and join q/k/v onto linear_qkv and gate/up onto linear_fc1. Each fault is one mistake on the Hugging
Face side, with the answer written down before running. Real transformers and megatron-core, no mocks.
"""

import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from tensordiff.cli import main

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
EXAMPLE = os.path.join(ROOT, "examples", "hf_vs_megatron")

#: fault -> (hf_train.py arguments, expected first divergence (phase, A's module, kind, slot), top hint cause,
#: words the top hint's title must hold)
FAULTS = {
    "rms-eps": (["--rms-eps", "1e-3"], ("forward", "decoder.layers.0.input_layernorm", "output", "0"),
                "norm-epsilon", "1.00e-03"),
    "gelu": (["--act", "gelu_pytorch_tanh"], ("forward", "decoder.layers.0.mlp.linear_fc2", "input", "0"),
             "activation", "gelu"),
    # at the tables themselves: megatron's angles against HF's cos and sin read back as angles
    "rope-theta": (["--rope-theta", "500000"], ("forward", "rotary_pos_emb", "output", "0"), "rope", "base 500000"),
}


def _env():
    env = dict(os.environ, PYTHONPATH=ROOT, NO_COLOR="1")
    for name in ("TENSORDIFF_OUTPUT", "TENSORDIFF_STEPS", "TENSORDIFF_TENSORS", "TENSORDIFF_DISABLE"):
        env.pop(name, None)
    return env


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """The example end to end (its README's command): captures, conversion and the diff's exit code and output."""
    out = tmp_path_factory.mktemp("hf_llama")
    proc = subprocess.run([sys.executable, os.path.join(EXAMPLE, "run.py"), "--out", str(out)], env=_env(),
                          capture_output=True, text=True, timeout=900)
    return out, proc


def _diff(folder, b_name, tmp_path, *extra):
    report = tmp_path / f"{b_name}.json"
    code = main(["diff", str(folder / "mcore.h5"), str(folder / b_name), "--json", str(report), "--width", "80", *extra])
    return code, json.loads(report.read_text())


def test_a_clean_pair_agrees_with_no_mapping_given(clean, tmp_path, capsys):
    folder, proc = clean
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "mapping derived from the captures (4 heads in 2 query groups): B is Hugging Face" in proc.stdout
    assert "No divergence: every record of both runs was compared" in proc.stdout
    code, report = _diff(folder, "hf.h5", tmp_path)
    assert code == 0 and report["outcome"] == "agree"
    for phase in ("weights", "forward", "backward", "param_grad"):
        cov = report["coverage"][phase]
        assert cov["only_a"] == 0 and cov["only_b"] == 0 and cov["compared_a"] == cov["recorded_a"], (phase, cov)
    joined = {(r["phase"], r["module_a"], r["module_b"]) for r in report["rows"] if r["step"] == 0
              and "+" in (r["module_b"] or "")}
    for phase in ("weights", "forward", "backward", "param_grad"):
        assert (phase, "decoder.layers.1.self_attention.linear_qkv", "model.layers.1.self_attn.q_proj+k_proj+v_proj") \
            in joined
        assert (phase, "decoder.layers.1.mlp.linear_fc1", "model.layers.1.mlp.gate_proj+up_proj") in joined


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_fault_on_the_hf_side_is_found_at_its_module_with_the_right_hint(clean, tmp_path, fault):
    folder, proc = clean
    assert proc.returncode == 0
    args, expected, cause, words = FAULTS[fault]
    b = folder / f"hf-{fault}.h5"
    cmd = [sys.executable, "-m", "tensordiff", "capture", "--auto", "-o", str(b), "--steps", "2", "--",
           sys.executable, os.path.join(EXAMPLE, "hf_train.py"), "--weights", str(folder / "hf.safetensors"),
           "--steps", "2", *args]
    run = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    code, report = _diff(folder, b.name, tmp_path)
    first = report["first_divergence"]
    assert code == 1 and first["step"] == 0
    assert (first["phase"], first["module_a"], first["kind"], first["slot"]) == expected
    top = report["hints"][0]
    assert top["cause"] == cause and words in top["title"] and top["explained"] > 0.9, report["hints"]
    # the captures' recorded model configs: the one setting that differs, named as bearing on the divergence
    bearing = [d["key"] for d in report["config_differences"]["bearing"]]
    assert bearing == [{"rms-eps": "norm_epsilon", "gelu": "activation", "rope-theta": "rotary_base"}[fault]]
    if fault == "rope-theta":  # the tables of both conventions, fitted: Megatron's angles, HF's cos and sin
        assert first["tensor_b"] == "model.rotary_emb output.0" and "A's uses rotate-half (NeoX) pairs, base 10000" \
            in top["title"]


def test_a_wrong_query_group_count_is_never_a_pass(clean, tmp_path):
    folder, _ = clean
    code, report = _diff(folder, "hf.h5", tmp_path, "--mapping", "mcore-hf-llama", "--var", "heads=4",
                         "--var", "groups=4")
    assert code == 3 and report["outcome"] == "inconclusive"
    assert any(r["verdict"] == "shape" and r["module_a"].endswith("linear_qkv") for r in report["rows"])


def test_map_on_a_pair_whose_mapping_is_derived_writes_it_with_its_trial(clean, tmp_path, capsys):
    folder, _ = clean
    out = tmp_path / "proposed.yaml"
    assert main(["map", str(folder / "mcore.h5"), str(folder / "hf.h5"), "-o", str(out)]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert ("wrote the mapping derived from the captures (4 heads in 2 query groups): roles from structure and "
            "configs, not values; trial diff of step 0:") in printed
    assert re.search(r"\d+ pairs compared, agree", printed), printed
    text = out.read_text()
    assert text.startswith("# Derived by `tensordiff map` from the two captures' configs and B's module tree")
    assert "split: qkv_groups(heads=4, groups=2)" in text
    code, report = _diff(folder, "hf.h5", tmp_path, "--mapping", str(out))
    assert code == 0 and report["outcome"] == "agree"


def _diff_reversed(folder, b_name, tmp_path, *extra):
    """``diff hf.h5 mcore.h5``: the reference given first, as people write it."""
    report = tmp_path / f"{b_name}-reversed.json"
    code = main(["diff", str(folder / b_name), str(folder / "mcore.h5"), "--json", str(report), "--width", "80", *extra])
    return code, json.loads(report.read_text())


@pytest.mark.parametrize("extra", [(), ("--mapping", "mcore-hf-llama", "--var", "heads=4", "--var", "groups=2")],
                         ids=["picked", "given"])
def test_the_hf_capture_given_first_agrees_with_the_same_rows_as_the_other_order(clean, tmp_path, capsys, extra):
    folder, proc = clean
    assert proc.returncode == 0
    code, straight = _diff(folder, "hf.h5", tmp_path, *extra)
    code_back, back = _diff_reversed(folder, "hf.h5", tmp_path, *extra)
    assert (code, code_back) == (0, 0) and back["outcome"] == "agree"
    assert back["swapped"] is True and straight["swapped"] is False
    assert back["a"]["path"].endswith("mcore.h5")  # A is the mapping's first side whichever came first
    assert "(given second)" in " ".join(capsys.readouterr().out.split())
    rows = lambda rep: sorted((r["step"], r["phase"], r["a"] or "", r["b"] or "", r["verdict"]) for r in rep["rows"])
    assert rows(back) == rows(straight)
    assert back["summary"] == straight["summary"]


def test_a_fault_with_the_hf_capture_given_first_is_the_same_first_divergence_and_hint(clean, tmp_path):
    folder, _ = clean
    b = folder / "hf-rms-eps.h5"
    if not b.exists():  # captured by the fault test when it ran first on this worker
        cmd = [sys.executable, "-m", "tensordiff", "capture", "--auto", "-o", str(b), "--steps", "2", "--",
               sys.executable, os.path.join(EXAMPLE, "hf_train.py"), "--weights", str(folder / "hf.safetensors"),
               "--steps", "2", *FAULTS["rms-eps"][0]]
        assert subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600).returncode == 0
    code, straight = _diff(folder, b.name, tmp_path)
    code_back, back = _diff_reversed(folder, b.name, tmp_path)
    assert (code, code_back) == (1, 1)
    assert back["first_divergence"]["module_a"] == "decoder.layers.0.input_layernorm"
    assert back["first_divergence"] == straight["first_divergence"]
    assert [h["cause"] for h in back["hints"]] == [h["cause"] for h in straight["hints"]]
    assert back["hints"][0]["cause"] == "norm-epsilon"


def test_map_with_the_hf_capture_given_first_finds_the_built_in_in_the_other_order(clean, tmp_path, capsys):
    folder, _ = clean
    out = tmp_path / "proposed.yaml"
    assert main(["map", str(folder / "hf.h5"), str(folder / "mcore.h5"), "-o", str(out)]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "wrote the mapping derived from the captures (4 heads in 2 query groups)" in printed
    assert re.search(r"\d+ pairs compared, agree", printed), printed
