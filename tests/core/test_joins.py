"""Many-to-one mapping rules ("joins"): several of B's modules onto one of A's.

A is Megatron-like: one ``qkv`` Linear whose output rows are packed per query group
(``QkvGroups``); B is Hugging Face-like: ``q``, ``k``, ``v`` Linears. 4 heads in 2 groups,
head_dim 2, hidden 4. Both sides compute the same thing from one checkpoint.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import T, write_capture

from tensordiff.cli import main
from tensordiff.diff import DiffOptions, RenameRules, diff
from tensordiff.errors import MappingError
from tensordiff.transforms import QkvGroups

HEADS, GROUPS, HD, H = 4, 2, 2, 4
RNG = np.random.default_rng(3)
X = RNG.standard_normal((3, H)).astype(np.float32)
WQ = RNG.standard_normal((HEADS * HD, H)).astype(np.float32)
WK = RNG.standard_normal((GROUPS * HD, H)).astype(np.float32)
WV = RNG.standard_normal((GROUPS * HD, H)).astype(np.float32)
SPLIT0 = QkvGroups(HEADS, GROUPS, dim=0)
SPLIT1 = QkvGroups(HEADS, GROUPS, dim=-1)

MAPPING = f"""
rules:
  - b: ['attn\\.q', 'attn\\.k', 'attn\\.v']
    a: 'attn.qkv'
    join: 'qkv_groups(heads={HEADS}, groups={GROUPS})'
"""


def side_a(wq=WQ):
    w = SPLIT0.join([wq, WK, WV])
    y = X @ w.T
    return [T("weights", "attn.qkv", "param", "weight", w),
            T("forward", "attn.qkv", "input", "0", X),
            T("forward", "attn.qkv", "output", "0", y),
            T("param_grad", "attn.qkv", "grad", "weight", np.ones_like(w))]


def side_b(wq=WQ):
    ys = [X @ w.T for w in (wq, WK, WV)]
    out = [T("weights", f"attn.{n}", "param", "weight", w) for n, w in zip("qkv", (wq, WK, WV))]
    out.append(T("forward", "attn.q", "input", "0", X))                                   # 3
    out.append(T("forward", "attn.q", "output", "0", ys[0]))
    out.append(T("forward", "attn.k", "input", "0", X, same_as=3, extra={"has_data": 1}))  # the same input
    out.append(T("forward", "attn.k", "output", "0", ys[1]))
    out.append(T("forward", "attn.v", "input", "0", X, same_as=3, extra={"has_data": 1}))
    out.append(T("forward", "attn.v", "output", "0", ys[2]))
    out += [T("param_grad", f"attn.{n}", "grad", "weight", np.ones_like(w)) for n, w in zip("qkv", (wq, WK, WV))]
    return out


def run(tmp_path, b_recs, store=True, mapping=MAPPING):
    a = write_capture(str(tmp_path / "a.h5"), [side_a()])
    if not store:
        b_recs = [T(t.phase, t.module, t.kind, t.slot, t.value, same_as=t.same_as, store=False) for t in b_recs]
    b = write_capture(str(tmp_path / "b.h5"), [b_recs])
    return diff(a, b, DiffOptions(mapping=RenameRules.from_text(mapping, "map.yaml")))


@pytest.mark.parametrize("store", [True, False], ids=["tensors", "statistics"])
def test_three_b_modules_join_into_as_one_and_every_record_is_compared(tmp_path, store):
    res = run(tmp_path, side_b(), store=store)
    joined = [r for r in res.rows if r.pair.join is not None]
    assert sorted((r.phase, r.pair.a.kind) for r in joined) == [  # type: ignore[union-attr]
        ("forward", "output"), ("param_grad", "grad"), ("weights", "param")]
    assert all(r.verdict == "ok" for r in joined)
    assert {r.pair.b.module for r in joined} == {"attn.q+k+v"}  # type: ignore[union-attr]
    assert res.outcome == "agree" and res.exit_code == 0
    assert all(c.only_a == 0 and c.only_b == 0 for c in res.coverage.values())
    assert res.coverage["weights"].recorded_b == 3 and res.coverage["weights"].compared_b == 3


def test_a_changed_part_is_a_divergence_at_the_joined_module(tmp_path):
    wq = WQ.copy()
    wq[1] += 0.5  # one row of q: the joined weight, and q's output, differ
    res = run(tmp_path, side_b(wq))
    assert res.first is not None
    assert (res.first.phase, res.first.module_a, res.first.kind) == ("weights", "attn.qkv", "param")
    assert res.exit_code == 1


def test_parts_in_the_wrong_order_are_caught_not_passed(tmp_path):
    swapped = MAPPING.replace("['attn\\.q', 'attn\\.k', 'attn\\.v']", "['attn\\.q', 'attn\\.v', 'attn\\.k']")
    res = run(tmp_path, side_b(), mapping=swapped)
    assert res.exit_code == 1 and res.first is not None and res.first.module_a == "attn.qkv"


def test_a_join_with_wrong_heads_is_a_shape_row_and_never_exit_0(tmp_path):
    res = run(tmp_path, side_b(), mapping=MAPPING.replace(f"heads={HEADS}", "heads=3").replace(f"groups={GROUPS}",
                                                                                                "groups=3"))
    assert res.exit_code == 3 and res.outcome == "inconclusive"
    assert any(r.verdict == "shape" and "qkv_groups" in r.note for r in res.rows)


def test_a_missing_part_leaves_the_others_unmatched_and_the_diff_inconclusive(tmp_path):
    kept = [t for t in side_b() if t.module != "attn.v"]
    for t in kept:
        if t.same_as == 3:
            t.same_as = 2  # attn.q's input moved up one row with attn.v's weight gone
    res = run(tmp_path, kept)
    assert res.exit_code == 3
    assert not any(r.pair.join is not None for r in res.rows)


@pytest.mark.parametrize("text,fragment", [
    ("rules:\n  - {b: ['x', 'y'], a: 'z'}\n", "say how they join"),
    ("rules:\n  - {b: 'x', a: 'z', join: 'chunk(n=2)'}\n", "'join:' needs 'b:' to list"),
    ("rules:\n  - {b: ['x', 'y'], a: 'z', join: 'glue(n=2)'}\n", "unknown split 'glue"),
    ("rules:\n  - {b: ['x', '('], a: 'z', join: 'chunk(n=2)'}\n", "bad regular expression '('"),
])
def test_a_malformed_join_is_one_mapping_error(text, fragment):
    with pytest.raises(MappingError) as err:
        RenameRules.from_text(text, "map.yaml")
    assert str(err.value).startswith("map.yaml: rule 1") and fragment in str(err.value)


def test_the_cli_reports_the_joined_names(tmp_path, capsys):
    a = write_capture(str(tmp_path / "a.h5"), [side_a()])
    b = write_capture(str(tmp_path / "b.h5"), [side_b()])
    (tmp_path / "m.yaml").write_text(MAPPING)
    code = main(["diff", a, b, "--mapping", str(tmp_path / "m.yaml"), "--max-rows", "0"])
    out = capsys.readouterr().out
    assert code == 0 and "B: attn.q+k+v weight" in out
