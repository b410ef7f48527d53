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
