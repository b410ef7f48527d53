"""Every key of every file format tensordiff reads, given a value of the wrong type: one TensordiffError naming the
file (exit 2 on the command line), never another exception (exit 4, an internal error).

The formats: pair files (the built-in ones, the documented one, and the older diff and ckpt files), the split table
that merges rank files, and noise files. For each document every key path is replaced in turn by a value of each
other type; whatever loads must then also work (its rules tried on a record, its table matched against a name)."""

from __future__ import annotations

import copy
import json
import os

import pytest
import yaml

from tensordiff.ckpt.table import ConversionTable
from tensordiff.diff import noise
from tensordiff.errors import TensordiffError
from tensordiff.mapping import builtin, from_text
from tensordiff.mapping.modules import parse
from tensordiff.record import Record
from tensordiff.store.merged import _load_rules

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WRONG = (5, "x", ["x"], {"k": 1}, None, True)


def paths(doc, prefix=()):
    """Every key path of a YAML/JSON document (list positions included)."""
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in items:
        yield (*prefix, key)
        yield from paths(value, (*prefix, key))


def replaced(doc, path, value):
    out = copy.deepcopy(doc)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


def mutations(doc, limit_lists=2):
    """(path, wrong value, mutated document), lists cut to their first ``limit_lists`` items to keep it quick."""
    def cut(d):
        if isinstance(d, dict):
            return {k: cut(v) for k, v in d.items()}
        if isinstance(d, list):
            return [cut(v) for v in d[:limit_lists]]
        return d
    small = cut(doc)
    for path in paths(small):
        for value in WRONG:
            yield path, value, replaced(small, path, value)


def general(path, sides=()) -> str:
    """A key path as a pattern: list positions '#', a side's name '{side}' (modules/rules/#/{side})."""
    return "/".join("#" if isinstance(k, int) else "{side}" if k in sides else str(k) for k in path)


def type_errors(doc, limit_lists=2, sides=()):
    """The mutations that put a value of another type (not None: an absent key) where the document has one:
    (pattern of the key path, wrong value, mutated document)."""
    for path, value, mutated in mutations(doc, limit_lists):
        node = doc
        for key in path:
            node = node[key]
        if value is not None and type(value) is not type(node):
            yield general(path, sides), value, mutated


def check_refusals(name, outcomes, accepted):
    """Every type error at a key path no pattern of ``accepted`` names was refused (a loader that takes anything
    fails here), and at least one was refused at all. ``outcomes``: (pattern, value, refused)."""
    import fnmatch

    wrongly = [(p, v) for p, v, refused in outcomes if not refused and not any(fnmatch.fnmatchcase(p, a) for a in accepted)]
    assert not wrongly, f"{name}: values of the wrong type loaded without a word: {wrongly[:8]}"
    refused = sum(r for _, _, r in outcomes)
    must = sum(1 for p, _, _ in outcomes if not any(fnmatch.fnmatchcase(p, a) for a in accepted))
    assert refused >= must > 0, (name, refused, must)


#: Key paths of a pair file where a value of another type loads on purpose, and why.
PAIR_ACCEPTED = {
    # a name: a number or true/false in YAML (slots: {0: hidden}, kinds: [0]) is read as its text
    "*/kinds/#": "a name", "*/only_slots/#": "a name", "*/slots/*": "a name", "vars/*/choices/#": "a value",
    # short forms: a name for {module: NAME}, a list of names for one name (several modules, joined)
    "modules/ignore/{side}/#": "a name, a list of names or {module:, kinds:, slots:}",
    "modules/ignore/{side}/#/module": "a name or a list of names",
    "ignore_a/#": "a name or {module:, kinds:}",
    "modules/rules/#/{side}": "a name or a list of names joined", "rules/#/b": "a name or a list of names joined",
    "*/shape/#": "a dimension: a number or a variable", "*/shape/*/#": "a dimension: a number or a variable",
    "tensors/entries/#/shape": "one shape for both sides, or one per side",
    "tensors/entries/#/{side}": "a tensor name, or a list of names (split or joined)",
    "*/when/*": "a variable's value: a number or true/false reads as its text",
    "vars/*": "a variable: {default:, choices:, help:} or its default value",
}


def record(module="decoder.layers.0.mlp.linear_fc1", kind="output", slot="0", phase="forward"):
    return Record(step=0, seq=0, phase=phase, module=module, call=0, kind=kind, slot=slot, module_class="Linear",
                  dtype="float32", shape=(2, 2), numel=4)


def use_pair(text: str, path: str) -> None:
    pair = from_text(text, path, "p", {"heads": "4", "groups": "2"})
    if pair.section("modules") is not None:
        rules = parse(pair)
        for r in (record(), record("model.layers.0.mlp.gate_proj"), record(kind="param", slot="weight",
                                                                          phase="weights")):
            for rule in rules.rules:
                rule.target(r)
                rule.join_target(r, r.module)
                rule.ops_for(r)
            for ignore in rules.ignore_a + rules.ignore_b:
                ignore.hits(r)
    if pair.section("tensors") is not None:
        table = ConversionTable.from_pair(pair, lenient=True)
        table.match("decoder.layers.0.mlp.linear_fc1.weight", table.sides[0])
        table.ignored("x", table.sides[1])


def _pair_docs():
    docs = {}
    for name, path in builtin().items():
        with open(path, encoding="utf-8") as fh:
            docs[name] = fh.read()
    with open(os.path.join(ROOT, "docs", "mapping.md"), encoding="utf-8") as fh:
        page = fh.read()
    block = page[page.index("## The pair file"):]
    docs["docs-example"] = block[block.index("```yaml\n") + 8:block.index("```\n", block.index("```yaml\n") + 8)]
    docs["older-diff"] = ("tensordiff_mapping: 1\nvars: {heads: 4}\nstrip_b: ['model.']\norder_fallback: false\n"
                          "ignore_a: [{module: 'x', kinds: [output]}]\nignore_b: ['y']\nrules:\n"
                          "  - {b: 'h\\.(\\d+)', a: 'layers.\\1', kinds: [output], slots: {'0': hidden},\n"
                          "     activations: [swap01], params: {weight: [transpose]}}\n"
                          "  - {b: ['q\\.(\\d+)', 'k\\.(\\d+)'], a: 'qk.\\1', join: 'chunk(n=2)'}\n")
    docs["older-ckpt"] = ("tensordiff_ckpt_table: 1\nsides: [mcore, ms]\nformats: {mcore: [.pt]}\nvars: {n: {default: 1}}\n"
                          "ignore: {ms: ['adam.*']}\nentries:\n  - {mcore: 'l.{i}.w', ms: 'm.{i}.w', shape: [h, h]}\n"
                          "  - {mcore: 'l.{i}.qkv', ms: ['m.{i}.q', 'm.{i}.k'], split: 'chunk(n=2, dim=0)'}\n")
    return docs


@pytest.mark.parametrize("name", sorted(_pair_docs()))
def test_a_pair_file_with_any_value_of_the_wrong_type_is_one_mapping_error(name, tmp_path):
    text = _pair_docs()[name]
    use_pair(text, f"{name}.yaml")  # the file as it is works
    doc = yaml.safe_load(text)
    sides = set(doc.get("sides") or [])
    outcomes = []
    for path, value, mutated in type_errors(doc, sides=sides):
        try:
            use_pair(yaml.safe_dump(mutated), f"{name}.yaml")
            outcomes.append((path, value, False))
        except TensordiffError as err:
            assert str(err).startswith(f"{name}.yaml") or f"{name}.yaml" in str(err) or "mapping p" in str(err), \
                (path, value, str(err))
            assert "\n" not in str(err), (path, value)
            outcomes.append((path, value, True))
        except Exception as err:
            pytest.fail(f"{name}: {path} = {value!r}: {type(err).__name__}: {err}")
    assert len(outcomes) > 30
    check_refusals(name, outcomes, PAIR_ACCEPTED)


def test_the_split_table_with_any_value_of_the_wrong_type_is_one_mapping_error(tmp_path):
    path = os.path.join(ROOT, "tensordiff", "store", "splits", "megatron-core.yaml")
    with open(path, encoding="utf-8") as fh:
        doc = yaml.safe_load(fh)
    tp, sp = _load_rules(path=path)
    assert tp and sp
    target = tmp_path / "splits.yaml"
    outcomes = []
    for key_path, value, mutated in type_errors(doc):
        target.write_text(yaml.safe_dump(mutated))
        try:
            rules = _load_rules(path=str(target))
            for rule in rules[0] + rules[1]:
                rule.hits(record())
            outcomes.append((key_path, value, False))
        except TensordiffError as err:
            assert str(target) in str(err), (key_path, value, str(err))
            outcomes.append((key_path, value, True))
        except Exception as err:
            pytest.fail(f"{key_path} = {value!r}: {type(err).__name__}: {err}")
    # a class, a kind or a slot is a name (a number reads as its text); the description is never read
    check_refusals("split table", outcomes, {"*/class", "*/kinds/#", "*/slots/#", "description"})


def test_a_noise_file_with_any_value_of_the_wrong_type_is_one_noise_file_error(tmp_path):
    good = tmp_path / "good.json"
    noise.save(str(good), {("forward", "decoder.layers.0", 0, "output", "0"): 1e-6,
                           ("backward", "embedding", 1, "grad_output", "0"): 2e-7}, ["r1.h5", "r2.h5"], "two runs")
    doc = json.loads(good.read_text())
    assert len(noise.load(str(good))) == 2
    bad = tmp_path / "bad.json"
    outcomes = []
    for key_path, value, mutated in type_errors(doc, limit_lists=6):
        bad.write_text(json.dumps(mutated))
        try:
            noise.load(str(bad))
            outcomes.append((key_path, value, False))
        except TensordiffError as err:
            assert str(bad) in str(err), (key_path, value, str(err))
            outcomes.append((key_path, value, True))
        except Exception as err:
            pytest.fail(f"{key_path} = {value!r}: {type(err).__name__}: {err}")
    # what the file says about itself (when, how, from which runs, its column names) is shown, never read; a
    # record's tolerance may be an integer (0, 1) where a float is written
    outcomes = [o for o in outcomes if not (o[0] == "records/#/#" and type(o[1]) is int)]
    check_refusals("noise file", outcomes, {"created", "how", "runs", "runs/#", "fields", "fields/#"})


def test_a_batch_file_with_an_attribute_or_a_field_of_the_wrong_type_is_one_batch_error(tmp_path):
    import h5py
    import numpy as np

    from tensordiff import batch

    good = tmp_path / "good.h5"
    batch.save(str(good), batch.make(100, 8, 2, seed=0))
    assert batch.read(str(good), vocab_size=100).tokens.shape == (2, 8)
    with h5py.File(good, "r") as f:
        attrs = list(f.attrs)
        fields = list(f)
    wrong_attrs = ("x", np.arange(3), -1, 2**40, np.float64("nan"))
    wrong_fields = (np.array(b"x"), np.zeros((2,), np.int64), np.zeros((2, 8), np.float32),
                    np.zeros((2, 8, 1), np.int64), np.full((2, 8), -5, np.int64), np.zeros((0, 0), np.int64))
    cases = [("attr", a, v) for a in attrs for v in wrong_attrs] + [("field", n, v) for n in fields for v in wrong_fields]
    for i, (where, name, value) in enumerate(cases):
        bad = tmp_path / f"bad{i}.h5"
        bad.write_bytes(good.read_bytes())
        with h5py.File(bad, "r+") as f:
            if where == "attr":
                f.attrs[name] = value
            else:
                del f[name]
                f.create_dataset(name, data=value)
        try:
            batch.read(str(bad), vocab_size=100)
        except TensordiffError as err:
            assert str(bad) in str(err) and "\n" not in str(err), (where, name, value, str(err))
        except Exception as err:
            pytest.fail(f"{where} {name} = {value!r}: {type(err).__name__}: {err}")
