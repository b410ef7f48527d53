"""One mapping concept: a pair file per model pair, read by one loader for ``diff`` (``modules:``) and ``ckpt``
(``tensors:``), one name syntax, one wrapper list; older files still read."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tensordiff.ckpt.table import ConversionTable
from tensordiff.errors import MappingError
from tensordiff.mapping import ALIASES, RenameRules, builtin, builtin_with, from_text, load, unwrap
from tensordiff.record import Record

DOC = __import__("os").path.join(__import__("os").path.dirname(__file__), "..", "..", "docs", "mapping.md")


def rec(module: str, kind: str = "output", slot: str = "0", phase: str = "forward") -> Record:
    return Record(step=0, seq=0, phase=phase, module=module, call=0, kind=kind, slot=slot, module_class="",
                  dtype="float32", shape=(2,), numel=2)


def target(rules: RenameRules, r: Record) -> tuple | None:
    for rule in rules.rules:
        hit = rule.target(r) or rule.join_target(r, r.module)
        if hit:
            return hit[0]
    return None


def test_the_documented_pair_file_loads_for_diff_and_for_ckpt():
    with open(DOC, encoding="utf-8") as fh:
        text = fh.read()
    block = text[text.index("## The pair file"):]
    yaml_text = block[block.index("```yaml\n") + 8:block.index("```\n", block.index("```yaml\n") + 8)]
    rules = RenameRules.from_text(yaml_text, "doc.yaml", {"heads": "4"})
    assert target(rules, rec("transformer.h.3", "input")) == ("forward", "decoder.layers.3", 0, "input", "hidden_states")
    assert rules.strip_b == ("transformer.",) and len(rules.ignore_b) == 2
    # fc1_layout=stacked (its default): the interleaved rule is left out; with --var fc1_layout=interleaved it is in
    assert len(RenameRules.from_text(yaml_text, "doc.yaml", {"heads": "4", "fc1_layout": "interleaved"}).rules) \
        == len(rules.rules) + 1
    table = ConversionTable.from_pair(from_text(yaml_text, "doc.yaml", "doc", {"heads": "4"}))
    w = np.arange(16, dtype=np.float32).reshape(4, 4)
    out = table.convert({"transformer.h.0.attn.c_proj.weight": w}, source="hf", path="hf.safetensors", strict=False)
    assert np.array_equal(out.tensors["decoder.layers.0.self_attention.linear_proj.weight"], w.T)


def test_one_name_serves_both_commands_and_the_former_names_still_resolve():
    files = builtin()
    assert set(builtin_with("tensors")) == {"mcore-hf-llama", "mcore-mindformers", "mcore-mindformers-llama"}
    assert set(builtin_with("modules")) == set(files)
    for name in builtin_with("tensors"):
        pair = load(name, {"heads": "4", "groups": "2"})
        assert pair.sides[0] == "mcore" and RenameRules.load(name, {"heads": "4", "groups": "2"}).rules
        assert ConversionTable.load(name, {"heads": "4", "groups": "2"}).entries
    assert {ALIASES[n] for n in ("hf-llama-to-mcore", "mcore-to-hf-llama")} == {"mcore-hf-llama"}
    assert load("mcore-to-mindformers").path == load("mindformers-to-mcore").path == files["mcore-mindformers"]


def test_the_built_in_rules_use_placeholders_not_regexes():
    for path in builtin().values():
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        assert "\\d" not in text and "\\." not in text and "(\\" not in text, path


def test_a_variable_chooses_rules_in_both_sections_of_one_file():
    # mcore-mindformers: fc1_layout=interleaved deinterleaves linear_fc1 in the captures and in the checkpoint
    inter = RenameRules.load("mcore-mindformers", {"fc1_layout": "interleaved"})
    stacked = RenameRules.load("mcore-mindformers", {"fc1_layout": "stacked"})
    fc1 = rec("decoder.layers.1.mlp.linear_fc1")
    assert [str(o) for r in inter.rules if r.target(fc1) for o in r.outputs] == ["deinterleave(dim=-1)"]
    assert not [r for r in stacked.rules if r.target(fc1)]
    ops = {str(o) for e in ConversionTable.load("mcore-mindformers", {"fc1_layout": "interleaved"}).entries
           for o in e.ops["mindformers"]}
    assert ops == {"interleave(dim=0)"}
    assert not any(e.ops["mindformers"] for e in ConversionTable.load("mcore-mindformers",
                                                                      {"fc1_layout": "stacked"}).entries)


def test_a_star_on_both_sides_renames_any_name_and_lists_are_any_of_their_names():
    text = ("tensordiff_mapping: 2\nsides: [mcore, ms]\nmodules:\n  ignore:\n    ms: [{module: [loss, 'loss.*'], "
            "kinds: [output]}]\n  rules:\n    - {ms: 'a.*.b', mcore: 'x.*.y', kinds: [param], slots: {gamma: weight}}\n")
    rules = RenameRules.from_text(text, "p.yaml")
    assert target(rules, rec("a.layers.3.b", "param", "gamma", "weights")) == \
        ("weights", "x.layers.3.y", 0, "param", "weight")
    assert [i.hits(rec(m)) for i in rules.ignore_b for m in ("loss", "loss.nll", "lossy")] == [True, False, False,
                                                                                             False, True, False]


def test_older_files_of_both_kinds_are_read_as_pair_files_with_one_section():
    old_diff = "tensordiff_mapping: 1\nvars: {n: 2}\nrules:\n  - {b: 'h\\.(\\d+)', a: 'layers.\\1', join: ''}\n"
    rules = RenameRules.from_text(old_diff, "old.yaml")
    assert target(rules, rec("h.7")) == ("forward", "layers.7", 0, "output", "0")
    with pytest.raises(MappingError, match=r"old\.yaml: no 'tensors:' section, so it cannot convert checkpoints"):
        ConversionTable.from_pair(from_text(old_diff, "old.yaml"))
    old_table = ("tensordiff_ckpt_table: 1\nsides: [mcore, ms]\nentries:\n  - {mcore: 'l.{i}.w', ms: 'm.{i}.w'}\n")
    table = ConversionTable.from_pair(from_text(old_table, "t.yaml"))
    assert table.match("m.4.w", "ms")[2] == {"i": 4}
    with pytest.raises(MappingError, match=r"t\.yaml: no 'modules:' section, so it cannot line up captures"):
        RenameRules.from_text(old_table, "t.yaml")


@pytest.mark.parametrize("text, fragment", [
    ("tensordiff_mapping: 2\nsides: [a, b]\nmodules: {rules: [{b: x, c: y}]}\n", "rule 1 needs both 'a:'"),
    ("tensordiff_mapping: 2\nsides: [a, b]\nmodules: {rules: [{b: x, a: y, join: z}]}\n", "unknown key(s) join"),
    ("tensordiff_mapping: 2\nsides: [a, b]\nmodules: {rules: [{b: 'x.{i}', a: 'y.{j}'}]}\n", "does not bind"),
    ("tensordiff_mapping: 2\nsides: [a, b]\nmodules: {ignore: {c: [x]}}\n", "ignore: maps each side (a, b)"),
    ("tensordiff_mapping: 2\nsides: [a, b]\nmodules: {strip: {a: [x]}}\n", "strip: maps b (the side renamed)"),
    ("tensordiff_mapping: 2\nsides: [a, b]\nmodules: {rules: [{b: x, a: y, when: {v: 1}}]}\n", "when: uses variable 'v'"),
    ("tensordiff_mapping: 2\nsides: [a, a]\nmodules: {}\n", "sides must name two different sides"),
    ("tensordiff_mapping: 3\nsides: [a, b]\nmodules: {}\n", "tensordiff_mapping 3 is not supported"),
    ("tensordiff_mapping: 2\nsides: [a, b]\nmodule: {}\n", "unknown key(s) module"),
])
def test_a_malformed_pair_file_is_one_error_naming_the_file(text, fragment):
    with pytest.raises(MappingError) as err:
        RenameRules.from_text(text, "p.yaml")
    assert str(err.value).startswith("p.yaml: ") and fragment in str(err.value) and "\n" not in str(err.value)


def test_one_list_of_wrappers_is_dropped_from_every_name():
    assert unwrap("module.module.decoder.layers.0") == "decoder.layers.0"
    assert unwrap("_orig_mod.module.embedding") == "embedding"
    assert unwrap("module") == "" and unwrap("modules.x") == "modules.x"
    # the aligner and the rank-file merge both use it: no other copy of the list in the package
    import tensordiff

    pkg = __import__("os").path.dirname(tensordiff.__file__)
    hits = []
    for folder, _, files in __import__("os").walk(pkg):
        for f in files:
            if f.endswith(".py"):
                with open(__import__("os").path.join(folder, f), encoding="utf-8") as fh:
                    if re.search(r"['\"]_orig_mod", fh.read()):
                        hits.append(f)
    assert hits == ["names.py"]


def test_the_checkpoint_header_names_every_variable_given_and_the_layout_ones_in_force():
    described = ConversionTable.load("mcore-mindformers", {"heads": "4", "groups": "2"}).describe()
    assert described == "mcore-mindformers (fc1_layout=interleaved, norm=rmsnorm, mcore_spec=local, heads=4, groups=2)"
    with open(DOC.replace("mapping.md", "checkpoints.md"), encoding="utf-8") as fh:
        assert "--var norm=layernorm" in fh.read()  # the variable the header shows is documented
