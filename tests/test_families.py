"""A CI sample of the family matrix (``examples/families/matrix.py``; all of it: ``benchmarks/agreement_families.py``):
megatron-core built from a Hugging Face family's config (weights converted, equivalence checked by logits) against
that Hugging Face model, captured with ``tensordiff capture --auto`` and diffed with no ``--mapping`` in both
argument orders. The mapping is derived from the configs and the module tree (no family's names are written
anywhere): the clean pairs agree, the conversion faults are found at their module with the right hint first, and a
family megatron-core cannot express is said so in one line."""

from __future__ import annotations

import importlib.util

import pytest

for _name in ("megatron", "transformers", "safetensors"):
    if importlib.util.find_spec(_name) is None:
        pytest.skip(f"{_name} is not installed", allow_module_level=True)

from examples.families.build import check_equivalent  # noqa: E402
from examples.families.matrix import EXPECTED, Case, run_case  # noqa: E402

SAMPLE = [
    Case("gemma"), Case("gemma", fault="norm-offset"),
    Case("phi3"),
    Case("mixtral", "bfloat16"), Case("mixtral", "bfloat16", "router-softmax"), Case("gpt_oss"),
    Case("starcoder2"),  # not in the list, no convention of its own: LayerNorm, biases, c_fc/c_proj
    Case("deepseek_v3"),
    Case("olmoe"),
]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("families"))
    return {c.name: run_case(c, out) for c in SAMPLE}


@pytest.mark.parametrize("family", ["gemma", "phi3", "mixtral", "starcoder2", "gpt_oss", "deepseek_v3"])
def test_each_pair_is_equivalent_by_its_logits_before_tensordiff_is_asked(family):
    assert check_equivalent(family) < 1e-5


@pytest.mark.parametrize("case", [c for c in SAMPLE if not c.fault and c.family != "olmoe" and c.dtype == "float32"],
                         ids=lambda c: c.name)
def test_a_clean_pair_agrees_in_both_orders_with_no_mapping(outcomes, case):
    r = outcomes[case.name]
    assert r.codes == (0, 0) and r.passed, r.reasons
    assert r.note.startswith("derived from the captures ("), r.note


@pytest.mark.parametrize("case", [c for c in SAMPLE if c.fault], ids=lambda c: c.name)
def test_a_conversion_fault_is_found_at_its_module_with_its_hint_first(outcomes, case):
    r = outcomes[case.name]
    phase, module, cause = EXPECTED[case.fault]
    assert r.codes == (1, 1), r.reasons
    assert r.found.startswith(f"{phase} {module}") and r.hint.split(" ")[0] == cause, (r.found, r.hint)
    assert r.passed


def test_gemma_norms_are_read_as_one_plus_w_and_phi3_fuses_qkv_as_q_k_v(outcomes):
    assert "norms x(1+w)" in outcomes["gemma[fp32]"].note
    assert "fused QKV [Q|K|V], fused gate/up" in outcomes["phi3[fp32]"].note
    assert "4 experts" in outcomes["mixtral[bf16]"].note
    assert "4 experts in one tensor, attention sinks" in outcomes["gpt_oss[fp32]"].note
    assert "multi-latent attention, 4 experts (the first layer dense), a shared expert" in \
        outcomes["deepseek_v3[fp32]"].note


def test_a_family_megatron_core_cannot_express_is_said_in_one_line(outcomes):
    r = outcomes["olmoe[fp32]"]
    assert r.codes == (2, 2) and r.passed
    said = r.reasons[0]
    assert len(said.splitlines()) == 1 and "computes what megatron-core cannot express" in said
    assert "q_norm normalises [64] (q or k of all heads at once)" in said


def test_a_bf16_moe_pair_whose_routers_part_on_a_near_tie_agrees_and_says_so(outcomes):
    """The batch has one token whose top-2 router scores are a near tie in layer 0: BF16 rounding sends it to another
    expert on one side. The diff checks that this is all that differs (the other tokens, the gradients without that
    token's share) and ends agree, naming the block and the token."""
    r = outcomes["mixtral[bf16]"]
    assert r.codes == (0, 0) and r.passed, (r.found, r.reasons)
    assert r.found.startswith("routed: decoder.layers.0.mlp 1 token(s)"), r.found
