"""Rank files merged on read (tensordiff.store.merged), on synthetic captures of a column-parallel Linear.

Full model: y = x @ W.T, W [4, 3] (out, in), x [S=2, B=4, 3] ([S, B, H] as megatron-core). TP=2 splits W's rows
(partition_dim 0) and y's last dim; DP=2 splits the batch (dim 1) and scales activation gradients by 1/DP.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import T, write_capture

from tensordiff.errors import CaptureFileError
from tensordiff.store import CaptureFile, MergedCapture, open_capture

RNG = np.random.default_rng(5)
W = RNG.standard_normal((4, 3)).astype(np.float32)
X = RNG.standard_normal((2, 4, 3)).astype(np.float32)
IDS = np.arange(8, dtype=np.int64).reshape(4, 2)


def recs(w, x, ids, dy):
    y = x @ w.T
    return [T("weights", "fc", "param", "weight", w, module_class="ColumnParallelLinear"),
            T("forward", "", "input", "0", ids, module_class="Net"),
            T("forward", "fc", "input", "0", x, module_class="ColumnParallelLinear"),
            T("forward", "fc", "output", "0", y, module_class="ColumnParallelLinear"),
            T("backward", "fc", "grad_output", "0", dy, module_class="ColumnParallelLinear"),
            T("param_grad", "fc", "grad", "weight", np.ones_like(w), module_class="ColumnParallelLinear")]


def write_run(tmp_path, name, tp, dp, drop=(), skew_rank=None):
    dy_full = (X @ W.T) / 4.0  # the global run's gradient
    paths = []
    for rank in range(tp * dp):
        t, d = rank % tp, rank // tp
        if rank in drop:
            continue
        w = np.split(W, tp, axis=0)[t]
        x = np.split(X, dp, axis=1)[d] * (1.01 if rank == skew_rank else 1.0)
        ids = np.split(IDS, dp, axis=0)[d]
        dy = np.split(np.split(dy_full, tp, axis=-1)[t], dp, axis=1)[d] * dp  # a local mean: DP times the global
        coords = {"world_size": tp * dp, "rank": rank, "tp": tp, "tp_rank": t, "dp": dp, "dp_rank": d, "pp": 1,
                  "source": "megatron.core.parallel_state"}
        splits = {"fc.weight": {"tp": True, "sp": False, "dim": 0, "stride": 1}}
        paths.append(write_capture(str(tmp_path / f"{name}.rank{rank}.h5"), [recs(w, x, ids, dy)],
                                   parallel=json.dumps(coords), param_splits=json.dumps(splits)))
    return str(tmp_path / f"{name}.rank*.h5")


@pytest.mark.parametrize("tp,dp", [(2, 1), (1, 2), (2, 2)])
def test_rank_files_read_back_as_the_single_device_tensors(tmp_path, tp, dp):
    full = {r.module + r.kind: r.value for r in recs(W, X, IDS, (X @ W.T) / 4.0)}
    with open_capture(write_run(tmp_path, "run", tp, dp)) as cap:
        assert isinstance(cap, MergedCapture) and (cap.tp, cap.dp) == (tp, dp)
        merged = cap.records(0)
        assert sorted(r.module + r.kind for r in merged) == sorted(full)  # every record of the run, once
        for rec in merged:
            expected = full[rec.module + rec.kind]
            got = cap.array(rec)
            assert rec.shape == expected.shape and got is not None
            np.testing.assert_allclose(got, expected, rtol=1e-6)
            assert rec.l2 == pytest.approx(float(np.linalg.norm(expected.astype(np.float64))), rel=1e-6)
            assert rec.numel == expected.size


def test_a_missing_rank_file_is_one_error_naming_it(tmp_path):
    with pytest.raises(CaptureFileError, match=r"a run of 4 ranks needs one file per rank; missing rank\(s\) \[2\]"):
        open_capture(write_run(tmp_path, "run", 2, 2, drop=(2,)))


def test_a_plain_path_is_a_plain_capture_and_an_empty_glob_says_so(tmp_path):
    pattern = write_run(tmp_path, "run", 2, 1)
    with open_capture(pattern.replace("*", "0")) as cap:
        assert type(cap) is CaptureFile
    with pytest.raises(CaptureFileError, match="no file matches"):
        open_capture(str(tmp_path / "other.rank*.h5"))


def test_a_plain_torch_ddp_run_is_merged_batch_first(tmp_path):
    x = RNG.standard_normal((4, 3)).astype(np.float32)  # [B, H]: no megatron, the batch comes first
    paths = []
    for rank in range(2):
        local = np.split(x, 2, axis=0)[rank]
        coords = {"world_size": 2, "rank": rank, "source": "torch.distributed"}
        paths.append(write_capture(str(tmp_path / f"ddp.rank{rank}.h5"), [[
            T("weights", "fc", "param", "weight", W, module_class="Linear"),
            T("forward", "", "input", "0", local, module_class="Net"),
            T("forward", "fc", "output", "0", local @ W.T, module_class="Linear")]], parallel=json.dumps(coords)))
    with open_capture(str(tmp_path / "ddp.rank*.h5")) as cap:
        assert (cap.tp, cap.dp) == (1, 2)
        out = next(r for r in cap.records(0) if r.kind == "output")
        np.testing.assert_allclose(cap.array(out), x @ W.T, rtol=1e-6)
        assert cap.inconsistencies(0) == []


def test_check_says_consistent_or_names_the_records_that_differ_across_ranks(tmp_path, capsys):
    from tensordiff.cli import main

    assert main(["check", write_run(tmp_path, "good", 2, 1), "--no-color"]) == 0
    assert "Consistent: every record that must be identical across ranks is." in capsys.readouterr().out
    assert main(["check", write_run(tmp_path, "bad", 2, 1, skew_rank=1), "--no-color"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "step 0: 1 record(s) that must be identical differ across ranks" in out
    assert "forward fc input.0: TP ranks 0/1 differ" in out
    assert "a collective in the forward pass is missing or wrong" in out
    assert main(["check", str(tmp_path / "good.rank0.h5")]) == 2
    assert "names one file; give the rank files of a run as a quoted glob" in capsys.readouterr().err
