"""diff.align: the five passes that line up two steps' records (rules, exact, wrapper prefixes, tensor, order),
the mapping file that drives the first, and what is left over (reported unmatched, never passing).

Records are built directly: align works on ``Record`` objects, not on files."""

from __future__ import annotations

import dataclasses

import pytest

from tensordiff.diff.align import Pair, align_step
from tensordiff.errors import MappingError
from tensordiff.mapping import RenameRules
from tensordiff.record import Record
from tensordiff.transforms import Op


def rec(seq: int, phase: str, module: str, kind: str, slot: str = "0", shape: tuple[int, ...] = (2, 3), call: int = 0,
        same_as: int = -1, grad_of: int = -1, dtype: str = "float32") -> Record:
    return Record(step=0, seq=seq, phase=phase, module=module, call=call, kind=kind, slot=slot, module_class="",
                  dtype=dtype, shape=shape, same_as=same_as, grad_of=grad_of)


def fwd(seq: int, module: str, kind: str = "output", slot: str = "0", **kw) -> Record:
    return rec(seq, "forward", module, kind, slot, **kw)


def matched(pairs: list[Pair]) -> dict[tuple, tuple]:
    """(A's module, kind, slot, call) -> (B's module, kind, slot, call, how, ops) for every matched pair."""
    return {(p.a.module, p.a.kind, p.a.slot, p.a.call): (p.b.module, p.b.kind, p.b.slot, p.b.call, p.how, p.ops)
            for p in pairs if p.matched}


def only_a(pairs: list[Pair]) -> list[str]:
    return [f"{p.a.module}:{p.a.kind}.{p.a.slot}" for p in pairs if p.b is None]


def only_b(pairs: list[Pair]) -> list[str]:
    return [f"{p.b.module}:{p.b.kind}.{p.b.slot}" for p in pairs if p.a is None]


def rules(text: str, variables: dict[str, str] | None = None) -> RenameRules:
    return RenameRules.from_text(text, "map.yaml", variables)


# ------------------------------------------------------------------------------------------- exact
def test_records_with_the_same_phase_module_call_kind_and_slot_pair_exactly():
    a = [fwd(0, "fc", "input"), fwd(1, "fc", "output")]
    b = [fwd(0, "fc", "input"), fwd(1, "fc", "output")]
    pairs = align_step(a, b)
    assert [(p.a.seq, p.b.seq, p.how, p.ops) for p in pairs] == [(0, 0, "exact", ()), (1, 1, "exact", ())]


def test_the_call_index_keeps_two_calls_of_one_module_apart():
    # B records its two calls in the opposite order: each call still finds its own counterpart
    a = [fwd(0, "fc", call=0), fwd(1, "fc", call=1)]
    b = [fwd(0, "fc", call=1), fwd(1, "fc", call=0)]
    pairs = align_step(a, b, order_fallback=False)
    assert [(p.a.call, p.b.call, p.b.seq, p.how) for p in pairs] == [(0, 0, 1, "exact"), (1, 1, 0, "exact")]


def test_strip_b_drops_a_prefix_from_bs_names_before_the_exact_pass():
    mapping = rules("rules: []\nstrip_b: ['model.']\n")
    a = [fwd(0, "", "input"), fwd(1, "layers.0", "output")]
    b = [fwd(0, "model", "input"), fwd(1, "model.layers.0", "output")]
    pairs = align_step(a, b, mapping, order_fallback=False)
    assert matched(pairs) == {("", "input", "0", 0): ("model", "input", "0", 0, "exact", ()),
                              ("layers.0", "output", "0", 0): ("model.layers.0", "output", "0", 0, "exact", ())}


# ----------------------------------------------------------------------------------------- prefix
@pytest.mark.parametrize("b_name", ["module.decoder.fc", "_orig_mod.decoder.fc", "_orig_mod.module.decoder.fc"])
def test_wrapper_prefixes_module_and_orig_mod_are_dropped_from_either_side(b_name):
    a = [fwd(0, "decoder.fc")]
    b = [fwd(0, b_name)]
    pairs = align_step(a, b, order_fallback=False)
    assert matched(pairs) == {("decoder.fc", "output", "0", 0): (b_name, "output", "0", 0, "prefix", ())}
    # and the other way round: A is the wrapped side
    pairs = align_step(b, a, order_fallback=False)
    assert [p.how for p in pairs] == ["prefix"]


def test_a_bare_wrapper_module_is_the_root_of_the_other_side():
    # DDP / Float16Module: the wrapper itself ('module') is the model the other run calls ''
    a = [fwd(0, "", "input"), fwd(1, "", "output")]
    b = [fwd(0, "module", "input"), fwd(1, "module", "output")]
    pairs = align_step(a, b, order_fallback=False)
    assert [(p.a.module, p.b.module, p.how) for p in pairs] == [("", "module", "prefix"), ("", "module", "prefix")]


def test_an_exact_name_wins_over_a_wrapper_match():
    # B has both 'fc' and 'module.fc'; A's 'fc' takes B's 'fc' (exact pass first), A's 'module.fc' the other
    a = [fwd(0, "fc"), fwd(1, "module.fc")]
    b = [fwd(0, "module.fc"), fwd(1, "fc")]
    pairs = align_step(a, b, order_fallback=False)
    assert [(p.a.module, p.b.module, p.how) for p in pairs] == [("fc", "fc", "exact"), ("module.fc", "module.fc", "exact")]


# ------------------------------------------------------------------------------------------ rules
GPT2ISH = r"""
description: toy HF -> mcore
rules:
  - b: 'h\.(\d+)'
    a: 'layers.\1'
    kinds: [input, output]
    only_slots: ['0']
    slots: {'0': hidden_states}
    activations: [swap01]
  - b: 'h\.(\d+)\.c_fc'
    a: 'layers.\1.fc1'
    inputs: [swap01]
    outputs: ['swap01', 'scale(factor=2)']
    params:
      weight: [transpose]
"""


def test_a_rename_rule_maps_bs_module_onto_as_with_its_regex_groups():
    mapping = rules(GPT2ISH)
    a = [rec(0, "weights", "layers.3.fc1", "param", "weight", shape=(4, 2)),
         fwd(1, "layers.3.fc1", "input"), fwd(2, "layers.3.fc1", "output"),
         rec(3, "param_grad", "layers.3.fc1", "grad", "weight", shape=(4, 2))]
    b = [rec(0, "weights", "h.3.c_fc", "param", "weight", shape=(2, 4)),
         fwd(1, "h.3.c_fc", "input", shape=(3, 2)), fwd(2, "h.3.c_fc", "output", shape=(3, 2)),
         rec(3, "param_grad", "h.3.c_fc", "grad", "weight", shape=(2, 4))]
    got = matched(align_step(a, b, mapping, order_fallback=False))
    assert got == {
        ("layers.3.fc1", "param", "weight", 0): ("h.3.c_fc", "param", "weight", 0, "rule", (Op("transpose"),)),
        ("layers.3.fc1", "input", "0", 0): ("h.3.c_fc", "input", "0", 0, "rule", (Op("swap01"),)),
        ("layers.3.fc1", "output", "0", 0): ("h.3.c_fc", "output", "0", 0, "rule",
                                             (Op("swap01"), Op("scale", (("factor", 2.0),)))),
        ("layers.3.fc1", "grad", "weight", 0): ("h.3.c_fc", "grad", "weight", 0, "rule", (Op("transpose"),)),
    }


def test_a_rule_renames_slots_and_only_slots_and_kinds_limit_what_it_renames():
    mapping = rules(GPT2ISH)
    a = [fwd(0, "layers.0", "input", "hidden_states"), fwd(1, "layers.0", "input", "attention_mask"),
         fwd(2, "layers.0", "output", "hidden_states"), rec(3, "backward", "layers.0", "grad_output", "hidden_states")]
    b = [fwd(0, "h.0", "input", "0"), fwd(1, "h.0", "input", "1"),
         fwd(2, "h.0", "output", "0"), rec(3, "backward", "h.0", "grad_output", "0")]
    pairs = align_step(a, b, mapping, order_fallback=False)
    assert matched(pairs) == {
        ("layers.0", "input", "hidden_states", 0): ("h.0", "input", "0", 0, "rule", (Op("swap01"),)),
        ("layers.0", "output", "hidden_states", 0): ("h.0", "output", "0", 0, "rule", (Op("swap01"),)),
    }
    # slot '1' is not in only_slots, grad_output not in kinds: both stay unmatched on both sides
    assert only_a(pairs) == ["layers.0:input.attention_mask", "layers.0:grad_output.hidden_states"]
    assert only_b(pairs) == ["h.0:input.1", "h.0:grad_output.0"]


def test_a_slot_rename_applies_to_parameters_too():
    mapping = rules("rules:\n  - {b: 'ln', a: 'norm', slots: {gamma: weight, beta: bias}}\n")
    a = [rec(0, "weights", "norm", "param", "weight", shape=(4,)), rec(1, "weights", "norm", "param", "bias", shape=(4,))]
    b = [rec(0, "weights", "ln", "param", "beta", shape=(4,)), rec(1, "weights", "ln", "param", "gamma", shape=(4,))]
    pairs = align_step(a, b, mapping, order_fallback=False)
    assert [(p.a.slot, p.b.slot, p.how) for p in pairs] == [("weight", "gamma", "rule"), ("bias", "beta", "rule")]


def test_rules_run_before_the_exact_pass_so_a_same_named_tensor_gets_its_transform():
    # MindFormers' interleaved linear_fc1 has megatron's name but another row order
    mapping = rules("rules:\n  - b: 'mlp\\.linear_fc1'\n    a: 'mlp.linear_fc1'\n    params: {weight: ['deinterleave(dim=0)']}\n")
    a = [rec(0, "weights", "mlp.linear_fc1", "param", "weight", shape=(8, 2))]
    b = [rec(0, "weights", "mlp.linear_fc1", "param", "weight", shape=(8, 2))]
    (pair,) = align_step(a, b, mapping)
    assert pair.how == "rule" and pair.ops == (Op("deinterleave", (("dim", 0),)),)


def test_the_first_rule_whose_target_exists_in_a_wins():
    mapping = rules("rules:\n  - {b: 'blk', a: 'missing'}\n  - {b: 'blk', a: 'block'}\n  - {b: 'blk', a: 'other'}\n")
    a = [fwd(0, "other"), fwd(1, "block")]
    b = [fwd(0, "blk")]
    pairs = align_step(a, b, mapping, order_fallback=False)
    assert matched(pairs) == {("block", "output", "0", 0): ("blk", "output", "0", 0, "rule", ())}
    assert only_a(pairs) == ["other:output.0"]


def test_a_rule_limited_to_phases_leaves_other_phases_alone():
    mapping = rules("rules:\n  - {b: 'enc', a: 'encoder', phases: [weights, param_grad]}\n")
    a = [rec(0, "weights", "encoder", "param", "weight"), fwd(1, "encoder")]
    b = [rec(0, "weights", "enc", "param", "weight"), fwd(1, "enc")]
    pairs = align_step(a, b, mapping, order_fallback=False)
    assert [((p.a or p.b).phase, p.how) for p in pairs] == [
        ("weights", "rule"), ("forward", ""), ("forward", "")]


def test_ignore_a_and_ignore_b_leave_records_out_of_the_report_entirely():
    mapping = rules(r"""
rules: []
ignore_a: ['layers\.\d+\.dropout']
ignore_b:
  - 'act'
  - {module: '', kinds: [output]}
""")
    a = [fwd(0, "", "input"), fwd(1, "layers.0.dropout"), fwd(2, "fc"), fwd(3, "", "output")]
    b = [fwd(0, "", "input"), fwd(1, "act"), fwd(2, "fc"), fwd(3, "", "output", shape=(9,))]
    pairs = align_step(a, b, mapping, order_fallback=False)
    # neither matched nor unmatched: left out; B's root *input* is not hit (kinds: [output] only)
    assert [(p.a.module if p.a else None, p.b.module if p.b else None) for p in pairs] == [
        ("", ""), ("fc", "fc"), ("", None)]


def test_vars_and_variables_fill_in_dollar_names_and_the_caller_overrides_the_file():
    text = r"""
vars: {heads: 4, n: 1}
rules:
  - b: 'attn${n}'
    a: 'attention.${n}'
    outputs: ['qkv_grouped(heads=${heads}, dim=0)']
"""
    assert rules(text).rules[0].outputs == (Op("qkv_grouped", (("heads", 4), ("dim", 0))),)
    over = rules(text, {"heads": "8", "n": "2"})
    rule = over.rules[0]
    assert rule.outputs == (Op("qkv_grouped", (("heads", 8), ("dim", 0))),)
    assert rule.b.pattern == "attn2" and rule.a == "attention.2"


def test_a_missing_variable_is_a_mapping_error_naming_it_and_the_fix():
    with pytest.raises(MappingError) as err:
        rules("rules:\n  - {b: 'x', a: 'y', outputs: ['qkv_grouped(heads=${heads})']}\n")
    text = str(err.value)
    assert text.startswith("map.yaml: rule 1") and "${heads}" in text and "--var heads=VALUE" in text


@pytest.mark.parametrize("text, fragment", [
    ("rules: [\n", "not valid YAML at line"),
    ("- just\n- a list\n", "a YAML mapping with 'sides:' and a 'modules:' or 'tensors:' section"),
    ("description: no rules\n", "neither a 'modules:' section (for diff) nor a 'tensors:' section"),
    ("rules:\n  - {b: 'x'}\n", "rule 1 needs both 'a:'"),
    ("rules:\n  - {b: 'x', a: 'y'}\n  - {b: '(', a: 'y'}\n", "rule 2: bad regular expression '('"),
    ("rules:\n  - {b: 'x', a: 'y', phases: [forwards]}\n", "unknown phase(s) ['forwards']"),
    ("rules:\n  - {b: 'x', a: 'y', activations: [rotate90]}\n", "unknown transform 'rotate90'"),
    ("rules: []\nignore_b: [{kinds: [output]}]\n", "ignore_b: an entry is a module regex"),
    ("rules: []\nignore_a: ['[']\n", "ignore_a: bad regular expression '['"),
])
def test_a_malformed_mapping_is_one_mapping_error_naming_the_file(text, fragment):
    with pytest.raises(MappingError) as err:
        rules(text)
    assert str(err.value).startswith("map.yaml: ") and fragment in str(err.value)
    assert "\n" not in str(err.value)


def test_load_reads_a_file_and_names_a_missing_one(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("description: mine\norder_fallback: false\nrules:\n  - {b: 'x', a: 'y'}\n")
    loaded = RenameRules.load(str(path))
    assert loaded.description == "mine" and loaded.order_fallback is False and loaded.path == str(path)
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(MappingError, match=r"nope\.yaml: no such mapping .*built-in: mcore-hf-gpt2, mcore-hf-llama"):
        RenameRules.load(missing)


def test_every_built_in_mapping_loads_by_name_and_by_its_former_names():
    from tensordiff.mapping import ALIASES, builtin

    shipped = builtin()
    assert {"mcore-hf-gpt2", "mcore-hf-llama", "mcore-mindformers", "mcore-mindformers-llama"} <= set(shipped)
    values = {"heads": "4", "groups": "2"}
    for name, path in shipped.items():
        loaded = RenameRules.load(name, values)
        assert loaded.path == path and loaded.rules and loaded.name == name, name
    for old, new in ALIASES.items():  # the names diff and ckpt had before the two were one file
        assert RenameRules.load(old, values).path == shipped[new]


def test_a_mappings_variable_comes_from_the_caller_over_its_default():
    # mcore-hf-gpt2 packs c_attn with qkv_grouped(heads=${heads}); heads has no default: the caller says it
    def heads(mapping: RenameRules) -> set[int]:
        return {dict(o.kwargs)["heads"] for r in mapping.rules for ops in (r.outputs, *r.params.values())
                for o in ops if o.name == "qkv_grouped"}

    assert heads(RenameRules.load("mcore-hf-gpt2", {"heads": "4"})) == {4}
    assert heads(RenameRules.from_text("vars: {heads: 12}\nrules:\n  - {b: x, a: y, outputs: ['qkv_grouped(heads=${heads})']}\n",
                                       "m.yaml", {"heads": "6"})) == {6}
    with pytest.raises(MappingError, match=r"mcore-hf-gpt2\.yaml: rule 7 uses \$\{heads\} but no value is set; .*--var heads"):
        RenameRules.load("mcore-hf-gpt2")


# ----------------------------------------------------------------------------------------- tensor
def _act_vs_no_act():
    """A records the activation as a module ('act'): its output is fc2's input (same tensor, same_as) and the
    gradient is recorded under 'act'. B applies it as a function: the tensor is first seen as fc2's input and
    its gradient is recorded under fc2 as grad_input."""
    a = [fwd(0, "act", "output"), fwd(1, "fc2", "input", same_as=0), fwd(2, "fc2", "output"),
         rec(3, "backward", "fc2", "grad_output", grad_of=2), rec(4, "backward", "act", "grad_output", grad_of=0)]
    b = [fwd(0, "fc2", "input"), fwd(1, "fc2", "output"),
         rec(2, "backward", "fc2", "grad_output", grad_of=1), rec(3, "backward", "fc2", "grad_input", grad_of=0)]
    return a, b


def test_a_gradient_pairs_with_the_gradient_of_its_forward_tensor():
    a, b = _act_vs_no_act()
    pairs = align_step(a, b, order_fallback=False)
    got = matched(pairs)
    assert got[("act", "grad_output", "0", 0)] == ("fc2", "grad_input", "0", 0, "tensor", ())
    assert got[("fc2", "grad_output", "0", 0)] == ("fc2", "grad_output", "0", 0, "exact", ())
    assert only_a(pairs) == ["act:output.0"] and only_b(pairs) == []


def test_a_gradient_does_not_follow_a_tensor_whose_forward_records_were_not_paired():
    a, b = _act_vs_no_act()
    b[0] = fwd(0, "other", "input")  # B's tensor is no longer lined up with A's fc2 input
    pairs = align_step(a, b, order_fallback=False)
    assert ("act", "grad_output", "0", 0) not in matched(pairs)
    assert "act:grad_output.0" in only_a(pairs) and "fc2:grad_input.0" in only_b(pairs)


def test_a_gradient_paired_through_its_tensor_takes_the_tensors_transforms():
    a, b = _act_vs_no_act()
    b = [dataclasses.replace(r, module="mlp." + r.module) for r in b]
    mapping = rules("rules:\n  - {b: 'mlp\\.(\\w+)', a: '\\1', inputs: [swap01]}\n")
    got = matched(align_step(a, b, mapping, order_fallback=False))
    assert got[("fc2", "input", "0", 0)][4:] == ("rule", (Op("swap01"),))
    assert got[("act", "grad_output", "0", 0)] == ("mlp.fc2", "grad_input", "0", 0, "tensor", (Op("swap01"),))


def test_a_gradient_recorded_under_an_ignored_module_still_follows_its_tensor():
    # B records the activation as a cell the mapping ignores; its gradient is filed under that cell
    a = [fwd(0, "fc2", "input"), rec(1, "backward", "fc2", "grad_input", grad_of=0)]
    b = [fwd(0, "act", "output"), fwd(1, "fc2", "input", same_as=0), rec(2, "backward", "act", "grad_output", grad_of=0)]
    mapping = rules("rules: []\nignore_b: ['act']\n")
    pairs = align_step(a, b, mapping, order_fallback=False)
    assert matched(pairs) == {("fc2", "input", "0", 0): ("fc2", "input", "0", 0, "exact", ()),
                              ("fc2", "grad_input", "0", 0): ("act", "grad_output", "0", 0, "tensor", ())}
    assert only_a(pairs) == [] and only_b(pairs) == []


# ------------------------------------------------------------------------------------------ order
def _renamed():
    a = [fwd(0, "encoder.0", "input"), fwd(1, "encoder.0", "output", shape=(2, 4)),
         fwd(2, "encoder.1", "output", shape=(2, 4)), fwd(3, "head", "output", shape=(2, 5))]
    b = [fwd(0, "enc_a", "input"), fwd(1, "enc_a", "output", shape=(2, 4)),
         fwd(2, "enc_b", "output", shape=(2, 4)), fwd(3, "lm", "output", shape=(2, 6))]
    return a, b


def test_leftovers_pair_in_execution_order_where_kind_and_shape_agree():
    a, b = _renamed()
    pairs = align_step(a, b)
    assert [(p.a.module if p.a else None, p.b.module if p.b else None, p.how) for p in pairs] == [
        ("encoder.0", "enc_a", "order"), ("encoder.0", "enc_a", "order"), ("encoder.1", "enc_b", "order"),
        ("head", None, ""), (None, "lm", "")]  # shapes (2,5) vs (2,6): not guessed


def test_order_matching_stays_within_a_phase():
    a = [fwd(0, "x"), rec(1, "backward", "y", "grad_output")]
    b = [rec(0, "backward", "u", "output"), fwd(1, "v", "grad_output")]  # kinds swapped between phases
    pairs = align_step(a, b)
    assert not any(p.matched for p in pairs)


@pytest.mark.parametrize("how", ["argument", "mapping"])
def test_order_fallback_turned_off_leaves_renamed_records_unmatched(how):
    a, b = _renamed()
    if how == "argument":
        pairs = align_step(a, b, order_fallback=False)
    else:
        pairs = align_step(a, b, rules("rules: []\norder_fallback: false\n"))
    assert not any(p.matched for p in pairs)
    assert only_a(pairs) == ["encoder.0:input.0", "encoder.0:output.0", "encoder.1:output.0", "head:output.0"]
    assert only_b(pairs) == ["enc_a:input.0", "enc_a:output.0", "enc_b:output.0", "lm:output.0"]


# -------------------------------------------------------------------------------------- unmatched
def test_unmatched_records_are_pairs_with_one_side_none_listed_per_phase_after_as_records():
    a = [rec(0, "weights", "fc", "param", "weight"), rec(1, "weights", "only_a", "param", "weight"),
         fwd(2, "fc"), rec(3, "param_grad", "fc", "grad", "weight")]
    b = [rec(0, "weights", "only_b", "param", "bias", shape=(7,)), rec(1, "weights", "fc", "param", "weight"),
         fwd(2, "fc"), fwd(3, "extra", shape=(1,)), rec(4, "param_grad", "fc", "grad", "weight")]
    pairs = align_step(a, b)
    shown = [((p.a.phase, p.a.module) if p.a else None, (p.b.phase, p.b.module) if p.b else None, p.matched)
             for p in pairs]
    assert shown == [
        (("weights", "fc"), ("weights", "fc"), True),
        (("weights", "only_a"), None, False),
        (None, ("weights", "only_b"), False),
        (("forward", "fc"), ("forward", "fc"), True),
        (None, ("forward", "extra"), False),
        (("param_grad", "fc"), ("param_grad", "fc"), True),
    ]
    lone = [p for p in pairs if not p.matched]
    assert all(p.how == "" and p.ops == () for p in lone)
