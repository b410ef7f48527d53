"""Local gradients (kind ``grad_local``, before the data-parallel reduction) on synthetic captures: merged on read as
the mean over DP of each rank's own (TP-concatenated, summed over TP under sequence parallelism), paired with the
other side's local gradients or, where it has none, its gradients, and the reduction named when only it differs.

The model: y = x @ W.T, loss = mean(y), x [S=2, B=4, 3] ([S, B, H] as megatron-core), W [4, 3]. DP rank d takes
half the batch and its loss is its local mean, so its local gradient is twice its half's share: their mean over DP
is the single-device gradient.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import T, needs_ml_dtypes, write_capture

from tensordiff.diff import DiffOptions, diff
from tensordiff.store import MergedCapture, open_capture

RNG = np.random.default_rng(7)
W = RNG.standard_normal((4, 3)).astype(np.float32)
N = RNG.standard_normal(3).astype(np.float32) + 1.0  # a replicated parameter (a norm's weight)
X = RNG.standard_normal((2, 4, 3)).astype(np.float32)
IDS = np.arange(8, dtype=np.int64).reshape(4, 2)


def grads(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dy, dW, dN) of loss = mean((x * N) @ W.T) for this batch: the gradients of its own (local) mean."""
    dy = np.full(x.shape[:2] + (4,), 1.0 / (x.shape[0] * x.shape[1] * 4), dtype=np.float32)
    dw = np.einsum("sbo,sbi->oi", dy, x * N).astype(np.float32)
    dn = np.einsum("sbo,oi,sbi->i", dy, W, x).astype(np.float32)
    return dy, dw, dn


def step(x: np.ndarray, ids: np.ndarray, w: np.ndarray, n: np.ndarray, gw: np.ndarray, gn: np.ndarray,
         local: tuple[np.ndarray, np.ndarray] | None = None, store_local: bool = True) -> list[T]:
    dy = grads(x)[0]
    out = [T("weights", "fc", "param", "weight", w, module_class="ColumnParallelLinear"),
           T("weights", "norm", "param", "weight", n, module_class="RMSNorm"),
           T("forward", "", "input", "0", ids, module_class="Net"),
           T("forward", "fc", "input", "0", x * N, module_class="ColumnParallelLinear"),
           T("forward", "fc", "output", "0", (x * N) @ W.T, module_class="ColumnParallelLinear"),
           T("loss", "loss", "loss", "value", np.array(float(((x * N) @ W.T).mean()), dtype=np.float32)),
           T("backward", "fc", "grad_output", "0", dy, module_class="ColumnParallelLinear", grad_of=4)]
    if local is not None:
        out += [T("param_grad", "fc", "grad_local", "weight", local[0], module_class="ColumnParallelLinear",
                  store=store_local),
                T("param_grad", "norm", "grad_local", "weight", local[1], module_class="RMSNorm", store=store_local)]
    out += [T("param_grad", "fc", "grad", "weight", gw, module_class="ColumnParallelLinear"),
            T("param_grad", "norm", "grad", "weight", gn, module_class="RMSNorm")]
    return out


def single(tmp_path, name: str = "ref") -> str:
    _, gw, gn = grads(X)
    return write_capture(str(tmp_path / f"{name}.h5"), [step(X, IDS, W, N, gw, gn)])


def ranks(tmp_path, name: str, tp: int, dp: int, reduce=None, sp_norm: bool = False, store_local: bool = True) -> str:
    """One file per rank; ``reduce(locals) -> reduced`` says how B reduces the local gradients over DP (default:
    the mean). Under ``sp_norm`` each TP rank holds half of the norm's local gradient (a partial sum)."""
    reduce = reduce or (lambda ls: np.mean(np.stack(ls).astype(np.float64), axis=0).astype(np.float32))
    xs = np.split(X, dp, axis=1)
    local = [grads(x) for x in xs]
    gw = reduce([g[1] for g in local])
    gn = reduce([g[2] for g in local])
    for rank in range(tp * dp):
        t, d = rank % tp, rank // tp
        coords = {"world_size": tp * dp, "rank": rank, "tp": tp, "tp_rank": t, "dp": dp, "dp_rank": d, "pp": 1,
                  "source": "megatron.core.parallel_state", "sequence_parallel": sp_norm}
        splits = {"fc.weight": {"tp": True, "sp": False, "dim": 0, "stride": 1}}
        if sp_norm:
            splits["norm.weight"] = {"tp": False, "sp": True}
        lw = np.split(local[d][1], tp, axis=0)[t]
        ln = local[d][2] / tp if sp_norm else local[d][2]
        recs = step(xs[d], np.split(IDS, dp, axis=0)[d], np.split(W, tp, axis=0)[t], N, np.split(gw, tp, axis=0)[t],
                    gn, local=(lw, ln), store_local=store_local)
        if tp > 1:  # the output and its gradient: the rank's columns
            recs[4].value = np.split(recs[4].value, tp, axis=-1)[t]
            recs[6].value = np.split(recs[6].value, tp, axis=-1)[t]
        write_capture(str(tmp_path / f"{name}.rank{rank}.h5"), [recs], parallel=json.dumps(coords),
                      param_splits=json.dumps(splits))
    return str(tmp_path / f"{name}.rank*.h5")


@pytest.mark.parametrize("tp,dp,sp", [(1, 2, False), (2, 2, False), (2, 2, True)])
def test_local_gradients_merge_as_the_mean_over_dp_of_each_ranks_tp_joined_gradient(tmp_path, tp, dp, sp):
    _, gw, gn = grads(X)
    with open_capture(ranks(tmp_path, "run", tp, dp, sp_norm=sp)) as cap:
        assert isinstance(cap, MergedCapture)
        local = {r.module: r for r in cap.records(0) if r.kind == "grad_local"}
        for module, expected in (("fc", gw), ("norm", gn)):
            rec = local[module]
            np.testing.assert_allclose(cap.array(rec), expected, rtol=1e-6, atol=1e-9)
            assert rec.shape == expected.shape and rec.stats_known and rec.has_data
            assert rec.l2 == pytest.approx(float(np.linalg.norm(expected.astype(np.float64))), rel=1e-6)
            assert rec.mean == pytest.approx(float(expected.astype(np.float64).mean()), rel=1e-6, abs=1e-12)
        assert [len(c) for c in [cap.dp_copies(local["fc"])]] == [dp]
        assert cap.inconsistencies(0) == []  # local gradients differ across DP (and are partial sums under SP)


def test_local_gradients_stored_as_statistics_only_have_no_statistics_when_merged_and_are_never_passed(tmp_path):
    pattern = ranks(tmp_path, "run", 1, 2, store_local=False)
    with open_capture(pattern) as cap:
        rec = next(r for r in cap.records(0) if r.kind == "grad_local")
        assert not rec.stats_known and not rec.has_data and np.isnan(rec.l2) and rec.numel == 12
    result = diff(single(tmp_path), pattern)
    skipped = [r for r in result.rows if r.verdict == "skipped"]
    assert len(skipped) == 2 and "data-parallel mean" in skipped[0].note
    assert result.outcome == "inconclusive" and result.coverage["param_grad"].stats_only == 2
    assert any(reason.startswith("param_grad: 2 pair(s) not compared from statistics: B holds no statistics of these "
                                 "tensors (a data-parallel mean merged") for reason in result.reasons), result.reasons


def test_local_gradients_pair_with_the_single_device_gradients_and_coverage_counts_each_record_once(tmp_path):
    result = diff(single(tmp_path), ranks(tmp_path, "run", 2, 2))
    assert result.outcome == "agree", result.reasons
    cov = result.coverage["param_grad"]
    assert (cov.recorded_a, cov.compared_a, cov.recorded_b, cov.compared_b, cov.only_a, cov.only_b) == (2, 2, 4, 4, 0, 0)
    stand_ins = [r for r in result.rows if r.pair.stand_in]
    assert [(r.pair.a.kind, r.pair.b.kind, r.pair.stand_in, r.verdict) for r in stand_ins] == [
        ("grad", "grad_local", "a", "ok")] * 2
    # the other way round: A's local gradients with B's gradients (B has no local ones)
    back = diff(ranks(tmp_path, "run", 2, 2), single(tmp_path))
    assert back.outcome == "agree", back.reasons
    assert [r.pair.stand_in for r in back.rows if r.pair.stand_in] == ["b", "b"]
    cov = back.coverage["param_grad"]
    assert (cov.recorded_a, cov.recorded_b, cov.only_a, cov.only_b) == (4, 2, 0, 0)


def test_two_data_parallel_runs_pair_their_local_gradients_by_name(tmp_path):
    result = diff(ranks(tmp_path, "a", 1, 2), ranks(tmp_path, "b", 2, 2))
    assert result.outcome == "agree", result.reasons
    assert not any(r.pair.stand_in for r in result.rows)
    assert sum(r.pair.a.kind == "grad_local" for r in result.rows if r.pair.a is not None and r.verdict == "ok") == 2


def test_a_sum_over_dp_is_located_at_the_reduction_with_the_factor_of_dp(tmp_path):
    from tensordiff.explain.hints import find_hints

    pattern = ranks(tmp_path, "sum", 1, 2, reduce=lambda ls: np.sum(np.stack(ls), axis=0).astype(np.float32))
    result = diff(single(tmp_path), pattern, DiffOptions())
    first = result.first
    assert first is not None and (first.phase, first.kind, first.module_a) == ("param_grad", "grad", "fc")
    assert first.location == "in the data-parallel gradient reduction" and first.introduced
    assert first.where["reduction"] and first.where["data_parallel"] and first.where["local_grads_agree"] == 2
    hints, _, _ = find_hints(result)
    assert hints[0].cause == "factor" and hints[0].title.startswith("B = 2 × A (≈ 2, B's data-parallel size")


@needs_ml_dtypes
def test_a_bf16_reduction_is_located_at_the_reduction_and_named_with_its_dtype(tmp_path):
    import ml_dtypes

    from tensordiff.explain.hints import find_hints

    def bf16_mean(ls):  # each rank's gradient in BF16, summed in BF16, divided by DP
        b = [x.astype(ml_dtypes.bfloat16).astype(np.float32) for x in ls]
        return ((b[0] + b[1]).astype(ml_dtypes.bfloat16).astype(np.float32) / len(ls)).astype(np.float32)

    result = diff(single(tmp_path), ranks(tmp_path, "bf16", 1, 2, reduce=bf16_mean))
    first = result.first
    assert first is not None and first.location == "in the data-parallel gradient reduction"
    assert all(r.verdict == "ok" for r in result.rows if r.pair.stand_in == "a")  # the local gradients agree
    hints, _, _ = find_hints(result)
    top = hints[0]
    assert top.cause == "dtype" and top.title == ("B reduces gradients in BF16; reduce in FP32 (megatron "
                                                  "grad_reduce_in_fp32, torch DDP without the bf16 compress hook)")
    assert top.explained == pytest.approx(1.0) and top.details["dp"] == 2 and top.details["share_local"] < 0.5


def test_a_local_gradient_that_differs_is_the_weight_gradient_not_the_reduction(tmp_path):
    pattern = ranks(tmp_path, "run", 1, 2)
    _, gw, gn = grads(X)
    ref = write_capture(str(tmp_path / "off.h5"), [step(X, IDS, W, N, gw * 1.5, gn)])  # A's fc gradient is off
    result = diff(ref, pattern)
    first = result.first
    assert first is not None and first.location == "in the weight gradient of fc.weight"
    assert first.label_b == "fc local grad weight" and first.where["local"]


@needs_ml_dtypes
def test_the_dp_mean_of_bf16_local_gradients_is_not_rounded_back_to_bf16(tmp_path):
    import ml_dtypes

    bf16 = np.dtype(ml_dtypes.bfloat16)
    g0 = np.array([1.0, 1.0078125], dtype=bf16)  # neighbours on the BF16 grid: their mean lies between them
    g1 = np.array([1.0078125, 1.0], dtype=bf16)
    for rank, g in enumerate((g0, g1)):
        coords = {"world_size": 2, "rank": rank, "tp": 1, "tp_rank": 0, "dp": 2, "dp_rank": rank, "pp": 1,
                  "source": "megatron.core.parallel_state"}
        recs = [T("forward", "", "input", "0", np.zeros((1, 2), np.int64), module_class="Net"),
                T("param_grad", "fc", "grad_local", "weight", g, module_class="Linear")]
        write_capture(str(tmp_path / f"b.rank{rank}.h5"), [recs], parallel=json.dumps(coords))
    with open_capture(str(tmp_path / "b.rank*.h5")) as cap:
        rec = next(r for r in cap.records(0) if r.kind == "grad_local")
        got = cap.array(rec)
        assert got.dtype == np.float32 and got.tolist() == [1.00390625, 1.00390625]
