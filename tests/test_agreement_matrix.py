"""The fixed CI sample of the agreement matrix (``examples/pairs/matrix.py``; the whole matrix is
``benchmarks/agreement_matrix.py``): clean pairs of independently written real models (megatron-core, Hugging Face,
plain PyTorch), each captured unmodified with ``tensordiff capture --auto`` and diffed with no ``--mapping``, must
agree with every record compared or accounted for by a named rule; each injected fault must diverge at its module
and phase."""

from __future__ import annotations

import importlib.util

import pytest

for _name in ("megatron", "transformers", "safetensors"):
    if importlib.util.find_spec(_name) is None:
        pytest.skip(f"{_name} is not installed", allow_module_level=True)

from examples.pairs.matrix import Runner, all_cases, expected  # noqa: E402

SAMPLE = [c for c in all_cases() if c.sample]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    runner = Runner(str(tmp_path_factory.mktemp("matrix")))
    return {r.case: r for r in runner.run_all(SAMPLE)}


def test_the_sample_covers_clean_pairs_and_faults_of_several_families():
    clean = [c for c in SAMPLE if not c.fault]
    assert len(clean) >= 4 and len(SAMPLE) - len(clean) >= 8
    assert {c.b.family for c in clean} >= {"hf-llama", "hf-qwen2", "hf-gpt2", "plain"}


@pytest.mark.parametrize("case", [c for c in SAMPLE if not c.fault], ids=lambda c: c.name)
def test_a_clean_pair_agrees_with_what_was_accounted_named(results, case):
    r = results[case.name]
    assert (r.exit_code, r.outcome) == (0, "agree"), r.unaccounted[:10] + r.reasons
    assert r.unaccounted == []
    assert set(r.accounted) <= {"same-tensor", "pass-through", "mask", "positions", "labels", "rope", "inside", "bias"}
    if case.a.family != case.b.family or case.a.style.attn != case.b.style.attn:
        # code written by others records what the other side does not: each such record accounted by a named rule
        assert sum(r.accounted.values()) > 0


@pytest.mark.parametrize("case", [c for c in SAMPLE if c.fault], ids=lambda c: c.name)
def test_a_fault_diverges_at_its_module_and_phase(results, case):
    r = results[case.name]
    phase, *modules = expected(case)
    assert (r.exit_code, r.outcome) == (1, "diverged"), r.reasons
    assert r.found.split()[0] == phase and r.passed, (r.found, modules)  # passed: in one of ``modules``


# ------------------------------------------------------------------------------- BF16 RoPE tables, judged by meaning
def test_bf16_rope_tables_are_compared_as_angles_and_another_base_diverges_there(tmp_path):
    """megatron-core's RoPE angle table against Hugging Face's cos and sin tables: compared as one pair, B's tables
    read back as angles. Llama cast whole to BF16 (``.to(torch.bfloat16)``) casts its ``inv_freq`` buffer too, so its
    tables are of frequencies rounded to BF16: at 128 positions and head dim 32 they part from megatron's FP32 angles
    by far more than BF16's resolution in cos, yet by less than one BF16 rounding in the angles: the pair agrees in
    both orders. A RoPE base of 500000 on B is a divergence at the table itself, the rope hint naming both bases,
    however small its effect downstream."""
    import json
    from dataclasses import replace

    from examples.pairs.matrix import LLAMA, Case, _key
    from examples.pairs.models import Side

    arch = replace(LLAMA, hidden=64, heads=2, groups=2, seq=128, dtype="bfloat16")
    runner = Runner(str(tmp_path))
    clean = runner.run(Case("bf16-rope", arch, Side("mcore"), Side("hf-llama")))
    assert (clean.exit_code, clean.outcome, clean.orders) == (0, "agree", "0/0"), clean.unaccounted[:6] + clean.reasons
    with open(tmp_path / f"r-{_key('bf16-rope', False)}.json", encoding="utf-8") as fh:
        doc = json.load(fh)
    [table] = [r for r in doc["rows"] if r["step"] == 0 and r["a"] == "module.rotary_pos_emb output.0"]
    assert table["verdict"] == "ok" and table["b"] == "model.rotary_emb output.0"
    assert table["note"].startswith("RoPE tables compared by meaning: B's cos and sin read back as angles")
    assert 0 < table["metrics"]["rel_l2"] <= table["tolerance"] == 2 ** -8  # the frequencies' BF16 rounding
    assert not [r for r in doc["rows"] if r["b"] in ("model.rotary_emb output.0", "model.rotary_emb output.1")
                and r["a"] is None and not r["linked"]]

    fault = runner.run(Case("bf16-rope+rope-base", arch, Side("mcore"), Side("hf-llama", fault="rope-base")))
    assert fault.exit_code == 1 and fault.outcome == "diverged", fault.reasons
    for reversed_ in (False, True):
        with open(tmp_path / f"r-{_key('bf16-rope+rope-base', reversed_)}.json", encoding="utf-8") as fh:
            doc = json.load(fh)
        first, top = doc["first_divergence"], doc["hints"][0]
        assert (first["step"], first["phase"], first["tensor_a"]) == (0, "forward", "module.rotary_pos_emb output.0")
        assert top["cause"] == "rope" and top["explained"] > 0.99 and "base 500000" in top["title"] \
            and "base 10000" in top["title"], top


# ------------------------------------------------- BF16 faults a wide tolerance hides, and hints without a record
def _reports(runner, name: str) -> list[dict]:
    import json

    from examples.pairs.matrix import _key

    out = []
    for reversed_ in (False, True):
        with open(f"{runner.out}/r-{_key(name, reversed_)}.json", encoding="utf-8") as fh:
            out.append(json.load(fh))
    return out


def test_a_bf16_rope_base_under_the_tolerance_is_named_where_it_was_made(tmp_path):
    """A plain PyTorch GPT applying RoPE as code, 16 positions, BF16: another base changes layer 0's attention output
    by 2.8% from bitwise identical q, k, v, under BF16's 4.2% for two implementations; it first exceeds two modules
    later. The diff names the attention, where the difference was made, and the rope hint (its float64 rebuild held
    to a few BF16 roundings) names both bases, in both orders."""
    [case] = [c for c in all_cases() if c.name == "plain-rope-gqa-kw-vs-pos-mask[bf16]+rope-base"]
    runner = Runner(str(tmp_path))
    r = runner.run(case)
    assert r.passed and r.orders == "1/1", (r.found, r.hint, r.reasons)
    for doc in _reports(runner, case.name):
        first, top = doc["first_divergence"], doc["hints"][0]
        assert first["tensor_a"] == "transformer.h.0.attn.c_proj input.0" and first["introduced"]
        assert first["rel_l2"] < first["tolerance"] and first["incoming_rel_l2"] == 0.0
        assert "made from inputs that are bitwise identical" in first["explanation"]
        assert top["cause"] == "rope" and top["explained"] > 0.85
        assert "base 500000" in top["title"] and "base 10000" in top["title"]


def test_attention_dropout_inside_sdpa_is_named_with_its_probability(tmp_path):
    """Hugging Face Llama with ``attention_dropout=0.1`` (SDPA's dropout_p: no dropout record) against megatron-core:
    the keep-masks of the first positions solved against the attention rebuilt from megatron's q, k, v."""
    [case] = [c for c in all_cases() if c.name == "mcore-vs-hf-llama-gqa-sdpa+dropout"]
    runner = Runner(str(tmp_path))
    r = runner.run(case)
    assert r.passed, (r.found, r.hint, r.reasons)
    straight, back = _reports(runner, case.name)
    for doc, reversed_ in ((straight, False), (back, True)):
        side = "A" if reversed_ and not doc.get("swapped") else "B"  # HF's side: the diff may put megatron first
        top = doc["hints"][0]
        assert top["cause"] == "dropout" and top["details"]["side"] == side, top
        assert abs(top["details"]["p"] - 0.1) < 1e-3 and top["explained"] > 0.99


def test_two_bf16_cos_tables_are_read_back_as_their_bases(tmp_path):
    """Hugging Face against Hugging Face: the first divergence is the rotary module's cos table; each side's base
    fitted (the frequencies rounded to BF16, as a model cast whole rounds them) and named as the round number."""
    [case] = [c for c in all_cases() if c.name == "hf-llama-sdpa-vs-eager[bf16]+rope-base"]
    runner = Runner(str(tmp_path))
    r = runner.run(case)
    assert r.passed, (r.found, r.hint, r.reasons)
    for doc in _reports(runner, case.name):
        first, top = doc["first_divergence"], doc["hints"][0]
        assert first["tensor_a"] == "model.rotary_emb output.0"
        assert top["cause"] == "rope" and top["explained"] > 0.99, top
        assert "base 500000" in top["title"] and "base 10000" in top["title"]
        assert "rounded to bfloat16" in top["evidence"]


@pytest.mark.parametrize("name, tensor", [
    ("mcore-vs-hf-llama-gqa-sdpa+attn-scale", "decoder.layers.0.self_attention.linear_proj input.0"),  # rebuilt
    ("mcore-pos-vs-kw+attn-scale", "decoder.layers.0.self_attention.core_attention.scale_mask_softmax input.0")])
def test_attention_scores_scaled_by_1_over_head_dim_are_named(tmp_path, name, tensor):
    """Layer 0's scores scaled by 1/head_dim on B (HF ``self_attn.scaling``, megatron ``softmax_scale``): at the
    attention output, the scale fitted on each side of the attention rebuilt from A's q, k, v; at the scores a
    softmax module takes, one factor, 1/sqrt(head_dim), named against head_dim from the recorded configs."""
    [case] = [c for c in all_cases() if c.name == name]
    runner = Runner(str(tmp_path))
    r = runner.run(case)
    assert r.passed, (r.found, r.hint, r.reasons)
    straight, _ = _reports(runner, case.name)
    first, top = straight["first_divergence"], straight["hints"][0]
    assert first["tensor_a"] == tensor
    assert top["cause"] == "attention-scale" and top["explained"] > 0.99, top
    assert "1/head_dim" in top["title"] and "(head_dim 16)" in top["title"]
    if "b" in top["details"]:
        assert top["details"]["b"] == pytest.approx(1 / 16, rel=1e-3)
        assert top["details"]["a"] == pytest.approx(16 ** -0.5, rel=1e-3)
    else:
        assert top["details"]["factor"] == pytest.approx(0.25, rel=1e-4)


def test_map_never_learns_a_wrong_qkv_conversion(tmp_path, capsys):
    """megatron-core against Hugging Face Llama whose q/k/v were cut from megatron's per-group linear_qkv as if it
    were [Q | K | V] (4 heads in 2 groups): the values fit only that layout, the configs predict qkv_groups. `map`
    proposes the configs' layout and says what the values fit as a finding; `diff` with its mapping then finds the
    conversion at step 0's weights of linear_qkv, as the built-in mapping does."""
    import json
    from dataclasses import replace as dc_replace

    from examples.pairs.matrix import LLAMA
    from examples.pairs.models import Side
    from tensordiff.cli import main

    runner = Runner(str(tmp_path))
    a = runner.capture(LLAMA, Side("mcore"))
    b = runner.capture(LLAMA, dc_replace(Side("hf-llama"), fault="qkv-concat"))
    out = tmp_path / "proposed.yaml"
    assert main(["map", a, b, "-o", str(out)]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "finding: " in printed and "they match only if joined as [Q | K | V]" in printed
    assert "the conversion may be wrong" in printed
    text = out.read_text()
    assert "# FINDING:" in text and "qkv_groups(heads=4, groups=2)" in text
    for mapping in (["--mapping", str(out)], []):
        report = tmp_path / "r.json"
        assert main(["diff", a, b, "--first-divergence", "--json", str(report), *mapping]) == 1
        first = json.loads(report.read_text())["first_divergence"]
        assert (first["step"], first["phase"], first["module_a"]) == (
            0, "weights", "decoder.layers.0.self_attention.linear_qkv"), first
