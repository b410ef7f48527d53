"""transforms: each layout op on small arrays with hand-written expectations, parse_op, the statistics that
follow an op (apply_stats), and the QkvGroups / Chunk splits."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import ml_dtypes, needs_ml_dtypes

from tensordiff.errors import MappingError
from tensordiff.transforms import OPS, STATS, Chunk, Op, QkvGroups, apply, apply_mean, apply_stats, parse_op, parse_split


def op(text: str) -> Op:
    return parse_op(text, "test")


def run(text: str, x: np.ndarray) -> np.ndarray:
    return apply((op(text),), x)


def qkv_rows(heads: int, groups: int, head_dim: int):
    """Row labels of the three projections: q head h row r = 100 + 10h + r, k group g = 200 + 10g + r, v = 300 + ..."""
    q = [100 + 10 * h + r for h in range(heads) for r in range(head_dim)]
    k = [200 + 10 * g + r for g in range(groups) for r in range(head_dim)]
    v = [300 + 10 * g + r for g in range(groups) for r in range(head_dim)]
    return q, k, v


# ------------------------------------------------------------------------------------------------ ops
def test_swap01_swaps_the_first_two_axes():
    x = np.arange(24).reshape(2, 3, 4)
    y = run("swap01", x)
    assert y.shape == (3, 2, 4) and y[2, 1, 3] == x[1, 2, 3] and y[0, 1, 0] == x[1, 0, 0]
    assert run("swap01", np.arange(5)).tolist() == list(range(5))  # 1-D: unchanged


def test_transpose_transposes_a_matrix_and_leaves_other_ranks_alone():
    x = np.array([[1, 2, 3], [4, 5, 6]])
    assert run("transpose", x).tolist() == [[1, 4], [2, 5], [3, 6]]
    cube = np.arange(8).reshape(2, 2, 2)
    assert np.array_equal(run("transpose", cube), cube)


def test_deinterleave_gathers_even_rows_then_odd_rows():
    x = np.array([10, 20, 11, 21, 12, 22])          # g0 u0 g1 u1 g2 u2
    assert run("deinterleave", x).tolist() == [10, 11, 12, 20, 21, 22]
    m = np.array([[10, 20, 11, 21], [30, 40, 31, 41]])
    assert run("deinterleave(dim=-1)", m).tolist() == [[10, 11, 20, 21], [30, 31, 40, 41]]
    assert run("deinterleave(dim=1)", m).tolist() == [[10, 11, 20, 21], [30, 31, 40, 41]]


def test_interleave_is_the_inverse_of_deinterleave():
    x = np.array([10, 11, 12, 20, 21, 22])
    assert run("interleave", x).tolist() == [10, 20, 11, 21, 12, 22]
    rng = np.random.default_rng(0)
    for dim, shape in ((0, (8, 3)), (1, (3, 8)), (-1, (2, 3, 6))):
        m = rng.standard_normal(shape).astype(np.float32)
        there = run(f"deinterleave(dim={dim})", m)
        assert not np.array_equal(there, m)
        assert np.array_equal(run(f"interleave(dim={dim})", there), m)
        assert np.array_equal(run(f"deinterleave(dim={dim})", run(f"interleave(dim={dim})", m)), m)


def test_qkv_grouped_packs_q_k_v_per_group_with_gqa():
    q, k, v = qkv_rows(heads=4, groups=2, head_dim=2)
    x = np.array(q + k + v)
    # group 0 holds q heads 0, 1 then k0, v0; group 1 q heads 2, 3 then k1, v1
    expected = [100, 101, 110, 111, 200, 201, 300, 301,
                120, 121, 130, 131, 210, 211, 310, 311]
    assert run("qkv_grouped(heads=4, groups=2)", x).tolist() == expected


def test_qkv_grouped_without_groups_is_multi_head_attention():
    q, k, v = qkv_rows(heads=3, groups=3, head_dim=1)
    x = np.array(q + k + v)
    assert run("qkv_grouped(heads=3)", x).tolist() == [100, 200, 300, 110, 210, 310, 120, 220, 320]


def test_qkv_grouped_along_the_last_dim_packs_columns():
    q, k, v = qkv_rows(heads=2, groups=1, head_dim=1)
    x = np.array([q + k + v, [c + 1000 for c in q + k + v]])  # [2, 4]
    y = run("qkv_grouped(heads=2, groups=1, dim=-1)", x)
    assert y.tolist() == [[100, 110, 200, 300], [1100, 1110, 1200, 1300]]


def test_unrepeat_keeps_the_first_of_each_run_of_repeated_heads():
    base = np.arange(2 * 3 * 2 * 4).reshape(2, 3, 2, 4)       # [B, S, groups, D]
    repeated = np.repeat(base, 3, axis=2)                      # [B, S, heads = 3 * groups, D]
    assert np.array_equal(run("unrepeat(times=3)", repeated), base)   # default dim=2
    assert np.array_equal(run("unrepeat(times=3, dim=-2)", repeated), base)
    assert np.array_equal(run("unrepeat(times=1)", repeated), repeated)


def test_unrepeat_sum_adds_up_each_run_of_heads():
    x = np.array([[1.0, 2.0, 10.0, 20.0], [3.0, 4.0, 30.0, 40.0]])  # two groups of two heads along dim 1
    assert run("unrepeat_sum(times=2, dim=1)", x).tolist() == [[3.0, 30.0], [7.0, 70.0]]
    assert np.array_equal(run("unrepeat_sum(times=1, dim=1)", x), x)


def test_unflatten0_splits_the_first_axis_into_rows():
    x = np.arange(6 * 5).reshape(6, 5)                       # [B*S, V] with B=2, S=3
    y = run("unflatten0(rows=2)", x)
    assert y.shape == (2, 3, 5) and y[1, 0, 4] == x[3, 4] and y[0, 2, 1] == x[2, 1]
    assert run("unflatten0", x).shape == (1, 6, 5)


def test_flatten01_merges_the_first_two_axes():
    x = np.arange(24).reshape(2, 3, 4)
    y = run("flatten01", x)
    assert y.shape == (6, 4) and y[4, 2] == x[1, 1, 2]


def test_scale_multiplies_in_float64():
    x = np.array([1.0, -2.0, 0.5], dtype=np.float32)
    y = run("scale(factor=-0.5)", x)
    assert y.dtype == np.float64 and y.tolist() == [-0.5, 1.0, -0.25]


def test_identity_changes_nothing():
    x = np.arange(4)
    assert run("identity", x) is x and run("identity(dim=3)", x) is x


def test_ops_apply_left_to_right():
    x = np.arange(6).reshape(2, 3)
    assert apply((op("transpose"), op("scale(factor=2)")), x).tolist() == [[0, 6], [2, 8], [4, 10]]
    assert apply((), x) is x


# ------------------------------------------------------------------------------------------ parse_op
@pytest.mark.parametrize("text, name, kwargs, shown", [
    ("swap01", "swap01", (), "swap01"),
    ("swap01()", "swap01", (), "swap01"),
    ("  unrepeat ( times = 2 , dim = -1 )  ", "unrepeat", (("times", 2), ("dim", -1)), "unrepeat(times=2, dim=-1)"),
    ("qkv_grouped(heads=4, groups=2, dim=0)", "qkv_grouped", (("heads", 4), ("groups", 2), ("dim", 0)),
     "qkv_grouped(heads=4, groups=2, dim=0)"),
    ("scale(factor=2)", "scale", (("factor", 2.0),), "scale(factor=2.0)"),
    ("scale(factor=0.125)", "scale", (("factor", 0.125),), "scale(factor=0.125)"),
])
def test_parse_op_reads_names_and_numeric_keywords(text, name, kwargs, shown):
    parsed = op(text)
    assert parsed == Op(name, kwargs) and str(parsed) == shown
    assert [type(v) for _, v in parsed.kwargs] == [type(v) for _, v in kwargs]  # ints stay ints, a factor a float


@pytest.mark.parametrize("text, fragment", [
    ("rotate90", "unknown transform 'rotate90'"),
    ("Swap01", "unknown transform 'Swap01'"),
    ("swap01(", "unknown transform 'swap01('"),
    ("", "unknown transform ''"),
    ("scale(2)", "needs keyword arguments (name=value)"),
    ("scale(factor=two)", "factor must be a number, got 'two'"),
])
def test_parse_op_rejects_a_malformed_transform_with_a_mapping_error(text, fragment):
    with pytest.raises(MappingError) as err:
        parse_op(text, "map.yaml: rule 3")
    assert str(err.value).startswith("map.yaml: rule 3: ") and fragment in str(err.value)


def test_parse_op_rejects_a_keyword_the_op_does_not_take():
    with pytest.raises(MappingError):
        parse_op("scale(facter=2)", "map.yaml: rule 1")


# ---------------------------------------------------------------------------------------- statistics
def stats(x: np.ndarray) -> tuple:
    d = np.asarray(x, dtype=np.float64).reshape(-1)
    return d.size, float(d.min()), float(d.max()), float(d.mean()), float(np.sqrt(np.dot(d, d)))


_rng = np.random.default_rng(3)
#: One case per op with statistics: (op text, input). unrepeat's input really is repeated (its premise).
STATS_CASES = [
    ("identity", _rng.standard_normal((3, 4))),
    ("swap01", _rng.standard_normal((3, 4, 2))),
    ("transpose", _rng.standard_normal((3, 5))),
    ("qkv_grouped(heads=4, groups=2, dim=0)", _rng.standard_normal((16, 3))),
    ("flatten01", _rng.standard_normal((2, 3, 4))),
    ("unflatten0(rows=2)", _rng.standard_normal((6, 3))),
    ("deinterleave(dim=0)", _rng.standard_normal((6, 3))),
    ("interleave(dim=1)", _rng.standard_normal((3, 6))),
    ("scale(factor=-2.5)", _rng.standard_normal((4, 4)) + 0.3),
    ("unrepeat(times=3, dim=1)", np.repeat(_rng.standard_normal((2, 2, 5)) + 0.1, 3, axis=1)),
    ("unrepeat_sum(times=1)", _rng.standard_normal((2, 3, 4))),
]


def test_every_op_with_statistics_has_a_case():
    covered = {op(text).name for text, _ in STATS_CASES}
    assert covered == {name for name, fn in STATS.items() if fn is not None}
    assert set(STATS) == set(OPS)


@pytest.mark.parametrize("text, x", STATS_CASES, ids=[t for t, _ in STATS_CASES])
def test_statistics_carried_through_an_op_equal_the_statistics_of_its_result(text, x):
    carried = apply_stats((op(text),), stats(x))
    assert carried is not None
    actual = stats(apply((op(text),), x))
    assert carried[0] == actual[0]
    assert carried[1:] == pytest.approx(actual[1:], rel=1e-12, abs=1e-12)


def test_statistics_follow_a_chain_of_ops():
    x = np.repeat(_rng.standard_normal((3, 2, 4)), 2, axis=2)
    ops = (op("swap01"), op("unrepeat(times=2, dim=2)"), op("scale(factor=3)"), op("flatten01"))
    assert apply_stats(ops, stats(x)) == pytest.approx(stats(apply(ops, x)), rel=1e-12)
    assert apply_stats((), (4, -1.0, 1.0, 0.0, 2.0)) == (4, -1.0, 1.0, 0.0, 2.0)


def test_statistics_cannot_follow_a_sum_of_repeated_heads():
    st = (8, -1.0, 1.0, 0.0, 2.0)
    assert apply_stats((op("unrepeat_sum(times=2)"),), st) is None
    assert apply_stats((op("swap01"), op("unrepeat_sum(times=2)"), op("scale(factor=2)")), st) is None
    assert apply_stats((Op("not_an_op"),), st) is None


def test_only_the_total_follows_a_sum_of_repeated_heads():
    # MindFormers repeats k/v heads before core_attention; their gradients summed per group are megatron's: the sum
    # of all elements is the same on both sides, so statistics-only steps still compare the means
    g = _rng.standard_normal((3, 2, 8, 4))
    ops = (op("swap01"), op("unrepeat_sum(times=2, dim=2)"), op("scale(factor=3)"))
    summed = apply(ops, g)
    numel, mean = apply_mean(ops, g.size, float(g.mean()))
    assert numel == summed.size and mean == pytest.approx(float(summed.mean()), rel=1e-12)
    assert apply_mean((op("unrepeat(times=2, dim=2)"), op("unrepeat_sum(times=2)")), g.size, 0.0) is None


# -------------------------------------------------------------------------------------------- splits
def test_qkv_groups_split_gives_q_k_v_of_the_per_group_packing():
    q, k, v = qkv_rows(heads=4, groups=2, head_dim=2)
    packed = run("qkv_grouped(heads=4, groups=2)", np.array(q + k + v))
    parts = QkvGroups(4, 2).split(packed)
    assert [p.tolist() for p in parts] == [q, k, v]
    assert all(p.flags.c_contiguous for p in parts)


def odd_bits(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Random values of ``dtype`` with a NaN carrying a payload and a negative zero: bits a copy must keep."""
    x = np.random.default_rng(4).standard_normal(shape)
    if dtype == "float32":
        out = x.astype(np.float32)
        out.view(np.uint32).flat[0] = 0x7FC00ABC
    else:
        out = x.astype(ml_dtypes.bfloat16)
        out.view(np.uint16).flat[0] = 0x7FC1
    out.flat[1] = -0.0
    return out


def raw(x: np.ndarray) -> np.ndarray:
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


DTYPES = ["float32", pytest.param("bfloat16", marks=needs_ml_dtypes)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, groups, dim, shape", [
    (4, 2, 0, (16, 3)), (4, 4, 0, (24, 2)), (6, 2, 1, (3, 20)), (2, 1, -1, (2, 3, 8)),
])
def test_qkv_groups_split_and_join_round_trip_bit_exactly(heads, groups, dim, shape, dtype):
    x = odd_bits(shape, dtype)
    s = QkvGroups(heads, groups, dim)
    parts = s.split(x)
    assert [p.shape for p in parts] == s.parts_shapes(x.shape)
    assert s.joined_shape([p.shape for p in parts]) == x.shape
    back = s.join(parts)
    assert back.dtype == x.dtype and np.array_equal(raw(back), raw(x))
    # join is the qkv_grouped op: [all q | all k | all v] -> per-group packing
    flat = np.concatenate(parts, axis=dim)
    assert np.array_equal(raw(run(f"qkv_grouped(heads={heads}, groups={groups}, dim={dim})", flat)), raw(x))


@pytest.mark.parametrize("heads, groups", [(3, 2), (0, 1), (4, 0), (-2, -1)])
def test_qkv_groups_needs_heads_a_positive_multiple_of_groups(heads, groups):
    with pytest.raises(MappingError, match="heads must be a positive multiple of groups"):
        QkvGroups(heads, groups)


def test_qkv_groups_shape_errors():
    s = QkvGroups(4, 2)
    with pytest.raises(ValueError, match="9 rows are not heads\\+2\\*groups = 4\\+2\\*2 = 8 blocks"):
        s.split(np.zeros((9, 2)))
    with pytest.raises(ValueError, match="q/k/v have 8/2/4 rows"):
        s.join([np.zeros((8, 3)), np.zeros((2, 3)), np.zeros((4, 3))])
    with pytest.raises(ValueError, match="differ outside dim 0"):
        s.join([np.zeros((8, 3)), np.zeros((4, 3)), np.zeros((4, 2))])
    with pytest.raises(ValueError, match="cannot split a scalar"):
        s.parts_shapes(())


def test_chunk_splits_into_equal_blocks():
    x = np.arange(12, dtype=np.float32).reshape(2, 6)
    parts = Chunk(3, dim=1).split(x)
    assert [p.tolist() for p in parts] == [[[0, 1], [6, 7]], [[2, 3], [8, 9]], [[4, 5], [10, 11]]]
    assert all(p.flags.c_contiguous for p in parts)
    assert Chunk(2).parts_shapes((8, 3)) == [(4, 3), (4, 3)] and Chunk(2).joined_shape([(4, 3), (4, 3)]) == (8, 3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, dim, shape", [(2, 0, (8, 3)), (3, 1, (2, 6)), (2, -1, (2, 3, 4))])
def test_chunk_split_and_join_round_trip_bit_exactly(n, dim, shape, dtype):
    x = odd_bits(shape, dtype)
    back = Chunk(n, dim).join(Chunk(n, dim).split(x))
    assert back.dtype == x.dtype and np.array_equal(raw(back), raw(x))


def test_chunk_shape_errors():
    with pytest.raises(MappingError, match="n must be at least 2"):
        Chunk(1)
    with pytest.raises(ValueError, match="5 rows along dim 0 do not split into 2 equal blocks"):
        Chunk(2).parts_shapes((5, 3))
    with pytest.raises(ValueError, match="different sizes"):
        Chunk(2).join([np.zeros((2, 3)), np.zeros((3, 3))])
    with pytest.raises(ValueError, match="differ outside dim 0"):
        Chunk(2).join([np.zeros((2, 3)), np.zeros((2, 4))])


def test_parse_split_builds_the_named_split():
    s = parse_split("chunk(n=3, dim=1)", "t")
    assert isinstance(s, Chunk) and (s.n, s.dim) == (3, 1)
    q = parse_split("qkv_groups(heads=8, groups=2)", "t")
    assert isinstance(q, QkvGroups) and (q.heads, q.groups, q.per) == (8, 2, 4)
    for bad, fragment in (("slice(n=2)", "unknown split"), ("chunk(n=two)", "expected name=integer"),
                          ("chunk(m=2)", "unexpected keyword"), ("qkv_groups(heads=3, groups=2)", "positive multiple")):
        with pytest.raises(MappingError, match=fragment):
            parse_split(bad, "t")
