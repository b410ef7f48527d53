"""diff.tolerance: the relative-L2 limit a pair is judged by (dtype, the coarser of two, the runs' compute
dtype, --rtol, a measured noise floor), and the same rules seen through the engine's verdicts."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import T, write_capture

from tensordiff.diff import DiffOptions, diff
from tensordiff.diff.tolerance import DEFAULT_RTOL, EXACT, Tolerances, judged_dtype

KEY = ("forward", "fc", 0, "output", "0")


@pytest.mark.parametrize("dtype, limit", [
    ("float64", 1e-10), ("float32", 1e-5), ("float16", 5e-3), ("bfloat16", 3e-2),
    ("float8_e4m3fn", 2.5e-1), ("float8_e5m2", 5e-1),
])
def test_each_float_dtype_has_its_own_limit(dtype, limit):
    assert Tolerances().limit(dtype, "float64") == limit  # against a wide reference: the dtype's own limit


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float8_e4m3fn"])
def test_two_narrow_tensors_of_one_dtype_are_allowed_sqrt2_times_the_limit(dtype):
    assert Tolerances().limit(dtype, dtype) == pytest.approx(DEFAULT_RTOL[dtype] * 2 ** 0.5)
    assert Tolerances().limit(dtype, "float32") == DEFAULT_RTOL[dtype]
    assert Tolerances(override=1e-3).limit(dtype, dtype) == 1e-3  # --rtol is taken as given
    assert Tolerances().limit("float32", "float32") == DEFAULT_RTOL["float32"]


def test_limits_loosen_as_precision_drops():
    order = ["float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"]
    limits = [DEFAULT_RTOL[d] for d in order]
    assert limits == sorted(limits) and len(set(limits)) == len(limits)


@pytest.mark.parametrize("a, b", [("float32", "bfloat16"), ("bfloat16", "float32"), ("float16", "bfloat16")])
def test_the_coarser_dtype_of_a_pair_decides(a, b):
    assert Tolerances().limit(a, b) == DEFAULT_RTOL["bfloat16"]
    assert judged_dtype(a, b) == "bfloat16"


def test_a_bf16_runs_fp32_outputs_are_judged_as_bf16():
    tol = Tolerances()
    assert judged_dtype("float32", "float32", run_dtype="bfloat16") == "bfloat16"
    assert tol.limit("float32", "float32", run_dtype="bfloat16") == DEFAULT_RTOL["bfloat16"]
    # a run dtype finer than the pair does not tighten it
    assert judged_dtype("bfloat16", "bfloat16", run_dtype="float32") == "bfloat16"
    assert tol.limit("float32", "float32", run_dtype="float32") == DEFAULT_RTOL["float32"]


@pytest.mark.parametrize("dtype", ["int64", "int32", "int8", "uint8", "bool"])
def test_integer_and_boolean_pairs_must_match_exactly(dtype):
    tol = Tolerances(override=0.5)
    assert tol.limit(dtype, dtype) == EXACT == 0.0
    assert tol.limit(dtype, dtype, run_dtype="bfloat16") == 0.0      # a compute dtype does not loosen token ids
    assert judged_dtype(dtype, dtype, run_dtype="bfloat16") == dtype


def test_rtol_override_replaces_every_float_limit():
    tol = Tolerances(override=1e-3)
    assert [tol.limit(d, d) for d in ("float64", "float32", "bfloat16")] == [1e-3, 1e-3, 1e-3]
    assert tol.limit("float32", "float32", run_dtype="bfloat16") == 1e-3


def test_a_measured_noise_floor_times_the_factor_raises_the_limit_of_its_tensor_only():
    tol = Tolerances(noise={KEY: 1e-4}, noise_factor=3.0)
    assert tol.limit("float32", "float32", KEY) == pytest.approx(3e-4)
    assert tol.limit("float32", "float32", ("forward", "other", 0, "output", "0")) == 1e-5
    assert tol.limit("float32", "float32") == 1e-5
    assert Tolerances(noise={KEY: 1e-4}, noise_factor=10).limit("float32", "float32", KEY) == pytest.approx(1e-3)


def test_a_noise_floor_below_the_dtype_limit_does_not_tighten_it():
    tol = Tolerances(noise={KEY: 1e-8}, noise_factor=3.0)
    assert tol.limit("float32", "float32", KEY) == 1e-5
    assert Tolerances(override=1e-3, noise={KEY: 1e-8}).limit("float32", "float32", KEY) == 1e-3
    assert Tolerances(override=1e-3, noise={KEY: 1e-3}).limit("float32", "float32", KEY) == pytest.approx(3e-3)


# ------------------------------------------------------------------------------- through the engine
def _pair(tmp_path, weight_dtype: str, rel: float, name: str = ""):
    """Two one-layer captures whose weights are held in ``weight_dtype`` (the run's compute dtype; statistics
    only, so no BF16 array is needed); B's FP32 output and loss are off by ``rel`` (relative)."""
    w = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
    out = np.linspace(1.0, 2.0, 8, dtype=np.float32)

    def step(scale):
        return [T("weights", "fc", "param", "weight", w, dtype=weight_dtype, store=False),
                T("forward", "fc", "output", "0", (out * scale).astype(out.dtype)),
                T("loss", "", "loss", "value", np.array(2.5 * scale, dtype=np.float32))]

    a = write_capture(str(tmp_path / f"a{name}.h5"), [step(1.0)])
    b = write_capture(str(tmp_path / f"b{name}.h5"), [step(1.0 + rel)])
    return a, b


def _rows(result):
    return {(r.phase, r.pair.a.module): r for r in result.rows}


def test_an_fp32_runs_loss_off_by_a_thousandth_diverges_and_a_bf16_runs_does_not(tmp_path):
    a, b = _pair(tmp_path, "float32", 1e-3, "32")
    rows = _rows(diff(a, b))
    assert rows[("loss", "")].verdict == "diverged" and rows[("loss", "")].judged == "float32"
    assert rows[("loss", "")].tol == 1e-5

    a, b = _pair(tmp_path, "bfloat16", 1e-3, "16")
    rows = _rows(diff(a, b))
    loss = rows[("loss", "")]
    assert loss.pair.a.dtype == "float32" and loss.judged == "bfloat16"
    assert loss.tol == DEFAULT_RTOL["bfloat16"] and loss.verdict == "ok"
    assert loss.metrics.rel_l2 == pytest.approx(1e-3 / 1.001, rel=1e-4)


def test_the_engine_applies_rtol_and_the_noise_floor(tmp_path):
    a, b = _pair(tmp_path, "float32", 1e-3)
    out = ("forward", "fc")
    assert _rows(diff(a, b))[out].verdict == "diverged"
    loose = _rows(diff(a, b, DiffOptions(tolerances=Tolerances(override=2e-3))))[out]
    assert loose.tol == 2e-3 and loose.verdict == "ok"
    noisy = _rows(diff(a, b, DiffOptions(tolerances=Tolerances(noise={("forward", "fc", 0, "output", "0"): 5e-4}))))
    assert noisy[out].tol == pytest.approx(1.5e-3) and noisy[out].verdict == "ok"
    assert noisy[("loss", "")].tol == 1e-5 and noisy[("loss", "")].verdict == "diverged"


def test_integer_tensors_differing_in_one_element_diverge_under_any_rtol(tmp_path):
    ids = np.arange(1000, dtype=np.int64)
    other = ids.copy()
    other[7] += 1
    w = np.ones((2, 2), np.float32)
    a = write_capture(str(tmp_path / "a.h5"), [[T("weights", "emb", "param", "weight", w),
                                                T("forward", "emb", "input", "0", ids)]])
    b = write_capture(str(tmp_path / "b.h5"), [[T("weights", "emb", "param", "weight", w),
                                                T("forward", "emb", "input", "0", other)]])
    row = _rows(diff(a, b, DiffOptions(tolerances=Tolerances(override=0.1))))[("forward", "emb")]
    assert row.tol == 0.0 and row.judged == "int64" and row.verdict == "diverged"
    assert 0 < row.metrics.rel_l2 < 1e-3  # far inside the 0.1 given: integers ignore it
