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
