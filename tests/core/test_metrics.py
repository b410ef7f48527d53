"""diff.metrics (compare_arrays, compare_stats, rel_l2) and the dtype helpers they stand on (dtypes.ulp, coarsest).

Expected values are worked out by hand from the definitions in the docstrings."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import ml_dtypes, needs_ml_dtypes

from tensordiff import dtypes
from tensordiff.diff import metrics
from tensordiff.diff.metrics import compare_arrays, compare_stats, rel_l2
from tensordiff.record import Record


def up_ulps(a: np.ndarray, k: np.ndarray) -> np.ndarray:
    """``a`` (positive) moved up by ``k`` units in the last place of its own dtype: k added to the raw bits."""
    width = {2: np.uint16, 4: np.uint32}[a.dtype.itemsize]
    return (a.view(width) + k.astype(width)).view(a.dtype)


# ------------------------------------------------------------------------------------------ dtypes.ulp
@pytest.mark.parametrize("name, value, expected", [
    ("float32", 1.0, 2.0 ** -23),
    ("float32", 1.5, 2.0 ** -23),       # same binade [1, 2)
    ("float32", 2.0, 2.0 ** -22),
    ("float32", 0.75, 2.0 ** -24),
    ("float32", 1024.0, 2.0 ** -13),
    ("float64", 1.0, 2.0 ** -52),
    ("float16", 1.0, 2.0 ** -10),
    ("float16", 65504.0, 32.0),         # float16's largest finite: 2**15 * 2**-10
    ("bfloat16", 1.0, 2.0 ** -7),
    ("bfloat16", 3.0, 2.0 ** -6),
    ("float8_e4m3fn", 1.0, 2.0 ** -3),
    ("float8_e5m2", 1.0, 2.0 ** -2),
])
def test_ulp_at_known_magnitudes(name, value, expected):
    assert dtypes.ulp(np.array([value]), name)[0] == expected


@pytest.mark.parametrize("name, smallest_normal, subnormal_step", [
    ("float32", 2.0 ** -126, 2.0 ** -149),
    ("float16", 2.0 ** -14, 2.0 ** -24),
    ("bfloat16", 2.0 ** -126, 2.0 ** -133),
    ("float8_e4m3fn", 2.0 ** -6, 2.0 ** -9),
])
def test_ulp_stays_at_the_subnormal_step_below_the_smallest_normal(name, smallest_normal, subnormal_step):
    mags = np.array([smallest_normal, smallest_normal / 2, smallest_normal / 1000, subnormal_step])
    assert dtypes.ulp(mags, name).tolist() == [subnormal_step] * 4


def test_ulp_agrees_with_numpy_spacing_for_float32_and_float16():
    rng = np.random.default_rng(0)
    for np_type, name in ((np.float32, "float32"), (np.float16, "float16")):
        x = np.abs(rng.standard_normal(200) * 10.0 ** rng.integers(-4, 4, 200)).astype(np_type)
        assert np.array_equal(dtypes.ulp(x.astype(np.float64), name), np.spacing(x).astype(np.float64))


def test_ulp_of_zero_is_the_subnormal_step():
    assert dtypes.ulp(np.array([0.0]), "float32")[0] == 2.0 ** -149


def test_ulp_of_an_integer_dtype_is_zero():
    assert dtypes.ulp(np.array([1.0, 1000.0]), "int64").tolist() == [0.0, 0.0]


@pytest.mark.parametrize("a, b, expected", [
    ("float32", "bfloat16", "bfloat16"),
    ("bfloat16", "float32", "bfloat16"),
    ("float16", "bfloat16", "bfloat16"),      # 7 mantissa bits < 10
    ("float64", "float32", "float32"),
    ("float8_e5m2", "float8_e4m3fn", "float8_e5m2"),
    ("float32", "float32", "float32"),
    ("int64", "float16", "float16"),          # the float side has a precision, the int side none
    ("float16", "int64", "float16"),
    ("int64", "int32", "int64"),              # neither is a float: A's is kept
])
def test_coarsest_is_the_dtype_with_fewer_mantissa_bits(a, b, expected):
    assert dtypes.coarsest(a, b) == expected


# -------------------------------------------------------------------------------------- compare_arrays
def test_relative_l2_max_abs_max_rel_and_cosine_of_a_doubled_vector():
    a = np.array([1.0, 2.0, 2.0], dtype=np.float32)   # ||a|| = 3
    m = compare_arrays(a, 2 * a, "float32")
    assert m.rel_l2 == pytest.approx(3 / 6)           # ||a - 2a|| / ||2a||
    assert m.max_abs == 2.0
    assert m.max_rel == pytest.approx(1.0)            # |a - 2a| / |a| = 1 everywhere
    assert m.cosine == pytest.approx(1.0)
    assert m.ulp_share == 0.0 and m.nonfinite_mismatch == 0 and m.source == "tensor"


def test_orthogonal_vectors_have_cosine_zero():
    m = compare_arrays(np.array([1.0, 0.0]), np.array([0.0, 1.0]), "float64")
    assert m.rel_l2 == pytest.approx(math.sqrt(2)) and m.cosine == 0.0 and m.max_abs == 1.0


def test_opposite_vectors_have_cosine_minus_one_and_relative_error_two():
    a = np.array([3.0, -4.0])
    m = compare_arrays(a, -a, "float64")
    assert m.cosine == pytest.approx(-1.0) and m.rel_l2 == pytest.approx(2.0) and m.max_abs == 8.0


def test_max_rel_floors_small_values_of_a_at_a_thousandth_of_its_rms():
    a = np.array([0.0, 10.0])
    b = np.array([1e-3, 10.0])
    m = compare_arrays(a, b, "float64")
    rms_a = 10.0 / math.sqrt(2)
    assert m.max_rel == pytest.approx(1e-3 / (1e-3 * rms_a))   # not 1e-3 / 0
    assert m.max_abs == pytest.approx(1e-3)


def test_ulp_share_counts_elements_within_k_float32_ulps():
    a = np.array([1.0, 1.0, 1.5, 3.0, 100.0, 1e-3, 1e-3, 7.0], dtype=np.float32)
    k = np.array([0, 1, 4, 5, 3, 4, 9, 40])
    b = up_ulps(a, k)
    # every b stays in a's binade, so b - a is exactly k ulps of a (and of b)
    assert compare_arrays(a, b, "float32", ulp_k=4).ulp_share == 5 / 8   # k = 0, 1, 4, 3, 4
    assert compare_arrays(a, b, "float32", ulp_k=0).ulp_share == 1 / 8   # only k = 0
    assert compare_arrays(a, b, "float32", ulp_k=40).ulp_share == 1.0


@pytest.mark.parametrize("carrier", [pytest.param("bfloat16", marks=needs_ml_dtypes), "float64"])
def test_ulp_share_counts_bfloat16_ulps_and_a_float32_judgement_is_stricter(carrier):
    base = np.array([1.0, 1.0, 1.0, 2.0, 0.5, 0.5])
    k = np.array([0, 2, 4, 5, 1, 8])
    if carrier == "bfloat16":   # real BF16 arrays, moved up by k in their raw bits
        a = base.astype(ml_dtypes.bfloat16)
        b = up_ulps(a, k)
    else:                       # the same values carried in float64, BF16 ulps by hand: 2**-7 in [1, 2)
        a = base
        b = base + k * np.array([2.0 ** -7] * 3 + [2.0 ** -6] + [2.0 ** -8] * 2)
    assert float(b[1]) == 1.0 + 2 * 2.0 ** -7
    assert compare_arrays(a, b, "bfloat16", ulp_k=4).ulp_share == 4 / 6   # k = 0, 2, 4, 1
    # judged as FP32 the same BF16 steps (>= 2**-8) are far beyond 4 * 2**-23: only the identical element counts
    assert compare_arrays(a, b, "float32", ulp_k=4).ulp_share == 1 / 6


def test_matching_nan_and_inf_count_as_equal():
    a = np.array([np.nan, np.inf, -np.inf, 1.0], dtype=np.float32)
    m = compare_arrays(a, a.copy(), "float32")
    assert m.rel_l2 == 0.0 and m.nonfinite_mismatch == 0 and m.ulp_share == 1.0 and m.max_abs == 0.0


@pytest.mark.parametrize("b_first", [1.0, np.inf, -np.inf])
def test_a_nan_on_one_side_only_is_a_mismatch_and_an_infinite_error(b_first):
    a = np.array([np.nan, 2.0])
    b = np.array([b_first, 2.0])
    m = compare_arrays(a, b, "float64")
    assert m.nonfinite_mismatch == 1 and m.rel_l2 == math.inf and m.ulp_share == 0.5
    assert m.as_dict()["rel_l2"] is None  # JSON has no inf


def test_infinities_of_opposite_sign_are_a_mismatch():
    m = compare_arrays(np.array([np.inf, 1.0, 1.0]), np.array([-np.inf, 1.0, 1.0]), "float64")
    assert m.nonfinite_mismatch == 1 and m.rel_l2 == math.inf


def test_matching_nans_leave_the_error_of_the_finite_elements():
    m = compare_arrays(np.array([np.nan, 3.0, 4.0]), np.array([np.nan, 3.0, 4.5]), "float64")
    assert m.nonfinite_mismatch == 0
    assert m.rel_l2 == pytest.approx(0.5 / math.hypot(3.0, 4.5))


def test_all_zeros_on_both_sides_agree_exactly():
    z = np.zeros((3, 4), dtype=np.float32)
    m = compare_arrays(z, z.copy(), "float32")
    assert (m.rel_l2, m.max_abs, m.cosine, m.ulp_share) == (0.0, 0.0, 1.0, 1.0)


def test_zeros_against_ones_are_a_full_relative_error():
    m = compare_arrays(np.zeros(4), np.ones(4), "float64")
    assert m.rel_l2 == 1.0 and m.cosine == 0.0 and m.max_abs == 1.0


def test_empty_arrays_agree():
    m = compare_arrays(np.zeros((0, 3), np.float32), np.zeros((0, 3), np.float32), "float32")
    assert m.rel_l2 == 0.0 and m.ulp_share == 1.0 and m.cosine == 1.0


def test_integer_arrays_are_compared_exactly():
    a = np.array([1, 2, 3, 4], dtype=np.int64)
    assert compare_arrays(a, a.copy(), "int64").rel_l2 == 0.0
    m = compare_arrays(a, np.array([1, 2, 3, 5]), "int64")
    assert m.rel_l2 == pytest.approx(1 / math.sqrt(1 + 4 + 9 + 25)) and m.ulp_share == 0.75


def test_small_chunks_give_the_same_numbers_as_one_chunk(monkeypatch):
    rng = np.random.default_rng(1)
    a = rng.standard_normal((7, 11)).astype(np.float32)
    b = (a + rng.standard_normal(a.shape).astype(np.float32) * 1e-6).astype(np.float32)
    a.flat[[3, 40]] = [np.nan, np.inf]
    b.flat[[3, 40, 60]] = [np.nan, np.inf, -np.inf]   # two matching specials, one mismatch
    b2 = b.copy()
    b2.flat[60] = a.flat[60] * 1.01                    # the same without the mismatch
    for bb in (b, b2):
        whole = compare_arrays(a, bb, "float32")
        monkeypatch.setattr(metrics, "CHUNK", 5)        # 77 elements: 16 chunks, the last partial
        chunked = compare_arrays(a, bb, "float32")
        monkeypatch.undo()
        assert metrics.CHUNK == 1 << 22
        for name in ("rel_l2", "max_abs", "max_rel", "cosine"):
            assert getattr(chunked, name) == pytest.approx(getattr(whole, name), rel=1e-12), name
        assert (chunked.ulp_share, chunked.nonfinite_mismatch) == (whole.ulp_share, whole.nonfinite_mismatch)
    assert compare_arrays(a, b, "float32").nonfinite_mismatch == 1
    assert 0 < compare_arrays(a, b2, "float32").rel_l2 < 1


# -------------------------------------------------------------------------------------- compare_stats
def stats_record(l2: float, mean: float, numel: int = 4, mn: float = -1.0, mx: float = 1.0, nan: int = 0,
                 inf: int = 0) -> Record:
    return Record(step=0, seq=0, phase="forward", module="m", call=0, kind="output", slot="0", module_class="",
                  dtype="float32", shape=(numel,), min=mn, max=mx, mean=mean, l2=l2, nan=nan, inf=inf, numel=numel)


def test_compare_stats_takes_the_relative_difference_of_the_norms():
    m = compare_stats(stats_record(10.0, 1.0), stats_record(11.0, 1.0))
    assert m.rel_l2 == pytest.approx(1 / 11) and m.source == "stats"
    assert math.isnan(m.cosine) and math.isnan(m.ulp_share) and math.isnan(m.max_rel)


def test_compare_stats_sees_a_shifted_mean_relative_to_the_rms():
    # same norm, means 1.0 vs 1.5; rms = 10 / sqrt(4) = 5: the mean moved by a tenth of it
    m = compare_stats(stats_record(10.0, 1.0), stats_record(10.0, 1.5))
    assert m.rel_l2 == pytest.approx(0.5 / 5.0)


def test_compare_stats_max_abs_is_the_larger_move_of_min_or_max():
    m = compare_stats(stats_record(10.0, 1.0, mn=-2.0, mx=3.0), stats_record(10.0, 1.0, mn=-2.5, mx=3.25))
    assert m.max_abs == 0.5 and m.rel_l2 == 0.0


def test_compare_stats_of_two_zero_tensors_is_zero():
    assert compare_stats(stats_record(0.0, 0.0, mn=0, mx=0), stats_record(0.0, 0.0, mn=0, mx=0)).rel_l2 == 0.0


@pytest.mark.parametrize("field", ["nan", "inf"])
def test_compare_stats_counts_different_nan_or_inf_counts_as_a_mismatch(field):
    m = compare_stats(stats_record(10.0, 1.0), stats_record(10.0, 1.0, **{field: 2}))
    assert m.rel_l2 == math.inf and m.nonfinite_mismatch == 1


# -------------------------------------------------------------------------------------------- rel_l2
def test_rel_l2_of_small_arrays():
    assert rel_l2(np.array([3.0, 4.0]), np.array([0.0, 0.0])) == 1.0
    assert rel_l2(np.array([1.0, 2.0, 2.0]), np.array([2.0, 4.0, 4.0])) == pytest.approx(0.5)
    assert rel_l2(np.zeros(3), np.zeros(3)) == 0.0


@needs_ml_dtypes
def test_rel_l2_compares_bfloat16_with_float32_by_value():
    x = np.array([1.0, -0.5, 3.0])
    assert rel_l2(x.astype(ml_dtypes.bfloat16), x.astype(np.float32)) == 0.0
    assert rel_l2(np.array([1.0 + 2.0 ** -7], dtype=ml_dtypes.bfloat16), np.ones(1, np.float32)) == \
        pytest.approx(2.0 ** -7 / (1 + 2.0 ** -7))


def test_rel_l2_of_different_shapes_is_infinite():
    assert rel_l2(np.ones((2, 3)), np.ones((3, 2))) == math.inf


def test_rel_l2_with_nan_and_inf_is_zero_when_they_match_and_infinite_when_not():
    x = np.array([np.nan, np.inf, 1.0])
    assert rel_l2(x, x.copy()) == 0.0
    assert rel_l2(x, np.array([1.0, np.inf, 1.0])) == math.inf
    assert rel_l2(x, np.array([np.nan, -np.inf, 1.0])) == math.inf


def test_rel_l2_agrees_with_compare_arrays_on_finite_data():
    rng = np.random.default_rng(2)
    a = rng.standard_normal(50)
    b = a + rng.standard_normal(50) * 1e-3
    assert rel_l2(a, b) == pytest.approx(compare_arrays(a, b, "float64").rel_l2, rel=1e-12)


def test_rel_l2_agrees_with_compare_arrays_when_matching_nans_sit_beside_a_difference():
    a = np.array([np.nan, 3.0, 4.0])
    b = np.array([np.nan, 3.0, 4.5])
    assert rel_l2(a, b) == pytest.approx(compare_arrays(a, b, "float64").rel_l2)


@pytest.mark.parametrize("name", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("noise", [0.0, 1e-6, 1e-2])
def test_the_float32_path_agrees_with_the_float64_path(name, noise):
    from tensordiff.diff.metrics import _compare_f64

    dt = dtypes.NUMPY_DTYPES.get(name)
    if dt is None:
        pytest.skip(f"{name} needs ml_dtypes")
    rng = np.random.default_rng(7)
    a32 = rng.standard_normal(300_001).astype(np.float32)  # more than one float32 chunk, not a multiple of it
    a, b = a32.astype(dt), (a32 + np.float32(noise) * rng.standard_normal(a32.size).astype(np.float32)).astype(dt)
    fast, slow = compare_arrays(a, b, name), _compare_f64(a, b, name)
    assert fast.rel_l2 == pytest.approx(slow.rel_l2, rel=1e-6, abs=1e-12)
    assert fast.ulp_share == slow.ulp_share and fast.max_abs == slow.max_abs
    assert fast.max_rel == pytest.approx(slow.max_rel, rel=1e-6) and fast.cosine == pytest.approx(slow.cosine, abs=1e-9)


def test_a_float32_pair_with_nan_in_one_place_takes_the_float64_path():
    a = np.ones(1000, dtype=np.float32)
    b = a.copy()
    b[500] = np.nan
    m = compare_arrays(a, b, "float32")
    assert m.nonfinite_mismatch == 1 and m.rel_l2 == math.inf


def test_the_float32_path_keeps_one_minus_cosine_near_one():
    # 1 - cos ~ rel_l2**2 / 2 ~ 5e-11: float32 products summed (the old way) carry ~1e-8 of rounding
    rng = np.random.default_rng(3)
    a = rng.standard_normal(200_000).astype(np.float32)
    b = (a * (1 + 1e-5 * rng.standard_normal(a.size))).astype(np.float32)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    exact = 1 - np.add.reduce(a64 * b64) / math.sqrt(np.add.reduce(a64 * a64) * np.add.reduce(b64 * b64))
    m = compare_arrays(a, b, "float32")
    assert 1e-11 < exact < 1e-10
    assert 1 - m.cosine == pytest.approx(exact, rel=1e-3)


@pytest.mark.parametrize("factor", [3.0, -0.1])
def test_the_float32_path_sums_a_dot_product_when_the_norms_are_far_apart(factor):
    from tensordiff.diff.metrics import _compare_f64

    rng = np.random.default_rng(4)
    a = rng.standard_normal(100_000).astype(np.float32)
    b = (factor * a + rng.standard_normal(a.size).astype(np.float32)).astype(np.float32)
    fast, slow = compare_arrays(a, b, "float32"), _compare_f64(a, b, "float32")
    assert fast.cosine == pytest.approx(slow.cosine, abs=1e-9)
    assert fast.rel_l2 == pytest.approx(slow.rel_l2, rel=1e-9)


@pytest.mark.parametrize("name", ["float32", "float16", "bfloat16"])
def test_the_float32_path_counts_ulps_at_zero_subnormals_and_binade_edges_like_the_float64_path(name):
    from tensordiff.diff.metrics import _compare_f64

    tiny = np.float32(2.0 ** -149)
    a = np.array([0.0, 0.0, tiny, 4 * tiny, 2.0 ** -126, 2.0 ** -14, 2.0 ** -15, 1.0, 1.0, 2.0, 65504.0, -3.0],
                 dtype=np.float32)
    b = np.array([0.0, 3 * tiny, 0.0, 9 * tiny, 2.0 ** -126 + 2.0 ** -140, 2.0 ** -14 + 2.0 ** -24, 2.0 ** -15,
                  1.0 + 2.0 ** -22, 1.0 - 2.0 ** -9, 2.0 - 2.0 ** -8, 65504.0 + 32.0, -3.0 - 2.0 ** -6],
                 dtype=np.float32)
    for k in (0, 1, 4, 64):
        assert compare_arrays(a, b, name, ulp_k=k).ulp_share == _compare_f64(a, b, name, ulp_k=k).ulp_share, k


def test_the_float32_path_gives_the_same_numbers_in_small_chunks(monkeypatch):
    rng = np.random.default_rng(5)
    a = rng.standard_normal(10_007).astype(np.float32)
    b = (a + 1e-4 * rng.standard_normal(a.size)).astype(np.float32)
    whole = compare_arrays(a, b, "float32")
    monkeypatch.setattr(metrics, "CHUNK32", 1000)   # 11 chunks, the last partial
    chunked = compare_arrays(a, b, "float32")
    assert (chunked.max_abs, chunked.max_rel, chunked.ulp_share) == (whole.max_abs, whole.max_rel, whole.ulp_share)
    for name in ("rel_l2", "cosine"):
        assert getattr(chunked, name) == pytest.approx(getattr(whole, name), rel=1e-12), name


def test_rel_l2_of_two_dimensional_arrays_is_over_every_element():
    x = np.array([[3.0, 0.0], [0.0, 4.0]])
    assert rel_l2(x, np.zeros((2, 2))) == 1.0
    assert rel_l2(x, np.array([[3.0, 0.0], [0.0, 4.5]])) == pytest.approx(0.5 / np.hypot(3.0, 4.5))
