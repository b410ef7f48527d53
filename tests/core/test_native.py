"""The compiled loops (``tensordiff._native``) against the paths they stand in for: the float64 reference's metrics on
generated pairs (dtypes, sizes around the block length, scales, specials), the same bytes for the
shuffle undone; and numpy's path when it is switched off."""

from __future__ import annotations

import platform

import numpy as np
import pytest
from helpers import ml_dtypes, needs_ml_dtypes

from tensordiff import _native
from tensordiff.diff import metrics
from tensordiff.store import codec

native = pytest.mark.skipif(_native.lib() is None, reason=f"no compiled loops here: {_native.why_not()}")


def _numpy_path(monkeypatch):
    monkeypatch.setitem(_native._state, "lib", None)


def _pair(rng, n: int, da, db, rel: float, scale: float):
    a = (rng.standard_normal(n) * scale).astype(np.float32)
    b = a + (rel * scale * rng.standard_normal(n)).astype(np.float32)
    return a.astype(da), b.astype(db)


@native
@needs_ml_dtypes
@pytest.mark.parametrize("n", [1, 7, 4095, 4096, 4097, 70_001])
@pytest.mark.parametrize("da,db", [("float32", "float32"), ("bfloat16", "bfloat16"), ("float32", "bfloat16"),
                                   ("bfloat16", "float32")])
def test_the_compiled_compare_gives_numpys_metrics(monkeypatch, n, da, db):
    rng = np.random.default_rng(n)
    types = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
    for rel, scale, judged in ((1e-3, 1.0, "bfloat16"), (1e-7, 1e-20, "float32"), (2.0, 1e20, "float32"),
                               (0.0, 3.0, "bfloat16")):
        a, b = _pair(rng, n, types[da], types[db], rel, scale)
        got = metrics.compare_arrays(a, b, judged)
        want = metrics._compare_f64(a, b, judged)  # the float64 reference (numpy's float32 path squares in float32:
        # at 1e-20 its squares lose their bits, the compiled path squares in float64)
        for name in ("rel_l2", "max_abs", "max_rel", "cosine"):
            assert getattr(got, name) == pytest.approx(getattr(want, name), rel=1e-6, abs=1e-300), (name, rel, scale)
        assert abs(got.ulp_share - want.ulp_share) <= 1 / n + 1e-12  # a float32 square's rounding at a boundary
        assert got.nonfinite_mismatch == want.nonfinite_mismatch == 0


@native
@pytest.mark.parametrize("special", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_go_to_the_float64_path(special):
    a = np.linspace(-1, 1, 10_000, dtype=np.float32)
    b = a.copy()
    a[5000] = special
    m = metrics.compare_arrays(a, b, "float32")
    assert m.nonfinite_mismatch == 1 and m.rel_l2 == np.inf
    b[5000] = special
    assert metrics.compare_arrays(a, b, "float32").rel_l2 == 0.0


@native
@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_the_compiled_shuffle_and_unshuffle_give_numpys_bytes(monkeypatch, itemsize):
    raw = np.random.default_rng(itemsize).integers(0, 256, 4096 * itemsize + itemsize * 3, dtype=np.uint8)
    planes = codec.shuffle(raw, itemsize).copy()
    got = codec.unshuffle(planes, itemsize)
    partial = codec.unshuffle(planes, itemsize, out=np.empty(itemsize * 1000, np.uint8))  # an edge chunk
    _numpy_path(monkeypatch)
    assert np.array_equal(planes, codec.shuffle(raw, itemsize))
    assert planes[:4096 + 3].tolist() == raw[::itemsize].tolist()  # plane 0: every element's first byte
    assert np.array_equal(got, raw) and np.array_equal(got, codec.unshuffle(planes, itemsize))
    assert np.array_equal(partial, raw[:itemsize * 1000])


def test_switched_off_the_numpy_paths_answer(monkeypatch):
    _numpy_path(monkeypatch)
    a = np.arange(1, 9, dtype=np.float32)
    m = metrics.compare_arrays(a, a * 2, "float32")
    assert m.rel_l2 == pytest.approx(0.5) and m.cosine == pytest.approx(1.0)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_glibcs_malloc_is_told_to_keep_freed_blocks():
    assert _native.keep_freed_memory() is True


def _stat_cases():
    rng = np.random.default_rng(7)
    for n in (1, 5, 4095, 4097, 200_003):
        for dtype in (np.float32, np.float64):
            x = (rng.standard_normal(n) * 10.0 ** rng.integers(-20, 20)).astype(dtype)
            yield x
            y = x.copy()
            y[rng.integers(0, n, max(1, n // 50))] = np.nan
            y[rng.integers(0, n, max(1, n // 70))] = rng.choice([np.inf, -np.inf])
            yield y
    yield np.full(9000, np.nan, np.float32)                      # no finite value: min and max 0
    yield np.array([np.inf, -np.inf, np.nan, 3.0], np.float64)    # one finite value, after the specials
    yield np.array([-0.0, 0.0, 5e-45], np.float32)                  # signed zero, a subnormal


@native
@pytest.mark.parametrize("x", list(_stat_cases()), ids=lambda x: f"{x.dtype}-{x.size}")
def test_the_compiled_statistics_follow_the_rule_as_numpy_does(monkeypatch, x):
    from tensordiff.stats import host_stats

    got = host_stats(x)
    _numpy_path(monkeypatch)
    want = host_stats(x)
    assert got[0] == want[0] and got[1] == want[1] and got[4:] == want[4:]  # min, max, the counts: exact
    assert got[2] == pytest.approx(want[2], rel=1e-12, abs=1e-12 * want[3])  # float64 sums in another order
    assert got[3] == pytest.approx(want[3], rel=1e-12)


@native
def test_cuda_launch_hands_the_kernel_its_arguments():
    """``td_cuda_launch`` (capture's statistics kernel launched through the driver, ``cuda_stats.py``) calls the launch
    function it is given with the grid, the stream and the six kernel arguments in order, and returns its result."""
    import ctypes

    seen = {}
    proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p,
                             ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)

    def launch(kernel, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        kinds = (ctypes.c_uint64, ctypes.c_int64, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int32)
        seen.update(kernel=kernel, grid=(gx, gy, gz), block=(bx, by, bz), shared=shared, stream=stream, extra=extra,
                    args=[ctypes.cast(params[i], ctypes.POINTER(kind)).contents.value for i, kind in enumerate(kinds)])
        return 7

    fn = proto(launch)
    got = _native.lib().td_cuda_launch(ctypes.cast(fn, ctypes.c_void_p).value, 0xABC, 2**40 + 5, -3, 2**33, 0, 99,
                                       -1, 12, 256, 0xDEF)
    assert got == 7
    assert seen == {"kernel": 0xABC, "grid": (12, 1, 1), "block": (256, 1, 1), "shared": 0, "stream": 0xDEF,
                    "extra": None, "args": [2**40 + 5, -3, 2**33, 0, 99, -1]}
