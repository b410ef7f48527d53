"""One rule for a record's statistics (``tensordiff/stats.py``), whichever framework writes it: the same values give
the same index row from torch and from MindSpore, NaN and Inf included (they are counted and left out of min, max,
sum and l2), so a NaN on both sides never compares as a difference."""

import math

import numpy as np
import pytest
import torch

from tensordiff.capturing.torch.stats import StatsCollector, reduce_stats_eager
from tensordiff.stats import host_stats

VALUES = [
    np.array([1.0, np.nan, 3.0], dtype=np.float32),                          # the issue's example
    np.array([np.nan, np.nan], dtype=np.float32),                            # no finite value
    np.array([[1.0, -np.inf], [np.inf, -2.5]], dtype=np.float32),
    np.array([0.5, np.nan, np.inf, -2.0, np.nan], dtype=np.float64),
    np.linspace(-3, 5, 200_000, dtype=np.float32),                           # chunked accumulation
    np.array([3, 0, 7], dtype=np.int64),
    np.array([True, False, True]),
]


def _torch_row(x: np.ndarray) -> list[float]:
    collector = StatsCollector()
    return list(collector.collect([collector.add(torch.from_numpy(x.copy()))])[0])


def _mindspore_row(x: np.ndarray) -> list[float]:
    ms = pytest.importorskip("mindspore")
    from tensordiff.capturing.mindspore.adapter import MindSporeTensors

    backend = MindSporeTensors()
    t = ms.Tensor(x.copy())
    return list(backend.host_stats([backend.stats(t)])[0])


@pytest.mark.parametrize("x", VALUES, ids=lambda x: f"{x.dtype}{list(x.shape)}")
def test_torch_and_mindspore_write_the_same_row_for_the_same_values(x):
    expected = list(host_stats(x))
    assert _torch_row(x) == expected
    assert _mindspore_row(x) == expected
    finite = x.astype(np.float64)[np.isfinite(x.astype(np.float64))]
    assert expected[4:] == [float(np.isnan(x.astype(np.float64)).sum()), float(np.isinf(x.astype(np.float64)).sum())]
    if finite.size:
        assert expected[:2] == [finite.min(), finite.max()]
        assert expected[2] == pytest.approx(finite.sum(), rel=1e-12, abs=1e-9)
    else:
        assert expected[:4] == [0.0, 0.0, 0.0, 0.0]


def test_the_issue_example_keeps_min_and_max_of_the_finite_values():
    assert host_stats(np.array([1.0, np.nan, 3.0]))[:2] == (1.0, 3.0)
    row = reduce_stats_eager(torch.tensor([1.0, float("nan"), 3.0])).tolist()  # the no-Triton device path
    assert row[:2] == [1.0, 3.0] and row[2] == 4.0 and math.isclose(row[3], math.sqrt(10), rel_tol=1e-6) and row[4:] == [1.0, 0.0]
