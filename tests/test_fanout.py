"""Many rank files read in a process pool or on a Dask cluster (tensordiff/store/fanout.py): the same verdicts as
one process, and bad settings are one line with exit code 2."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import T, write_capture

RANKS = 20  # above POOL_MIN_FILES: the automatic setting uses the pool too


def write_dp_run(folder, name, skew_rank=None, swap_rank=None):
    """A data-parallel run of RANKS rank files: x [B=1 per rank, 3], a replicated weight (skewed on one rank); on
    ``swap_rank`` the output's values in reverse order (the same statistics: only the merged tensors tell)."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((4, 3)).astype(np.float32)
    x = rng.standard_normal((RANKS, 3)).astype(np.float32)
    for rank in range(RANKS):
        coords = {"world_size": RANKS, "rank": rank, "dp": RANKS, "dp_rank": rank, "tp": 1, "tp_rank": 0, "pp": 1,
                  "source": "torch.distributed"}
        wr = w * (1.001 if rank == skew_rank else 1.0)
        y = x[rank:rank + 1] @ wr.T
        if rank == swap_rank:
            y = np.ascontiguousarray(y[:, ::-1])
        recs = [T("weights", "fc", "param", "weight", wr, module_class="Linear"),
                T("forward", "", "input", "0", x[rank:rank + 1], module_class="Net"),
                T("forward", "fc", "output", "0", y, module_class="Linear")]
        write_capture(str(folder / f"{name}.rank{rank}.h5"), [recs], parallel=json.dumps(coords))
    return str(folder / f"{name}.rank*.h5")


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_a_pool_reads_the_rank_files_to_the_same_verdict(tmp_path, capsys, jobs):
    from tensordiff.cli import main

    good, bad = write_dp_run(tmp_path, "good"), write_dp_run(tmp_path, "bad", skew_rank=7)
    assert main(["check", good, "--jobs", jobs, "--no-color"]) == 0
    assert main(["check", bad, "--jobs", jobs, "--no-color"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "weights fc weight: DP ranks 0/7 differ" in out
    assert main(["diff", good, good, "--jobs", jobs]) == 0


def test_bad_jobs_and_an_unreachable_dask_scheduler_are_one_line_and_exit_2(tmp_path, capsys):
    from tensordiff.cli import main

    good = write_dp_run(tmp_path, "good")
    assert main(["check", good, "--jobs", "0"]) == 2
    assert "--jobs 0: give a number of worker processes, 1 or more" in capsys.readouterr().err
    pytest.importorskip("distributed")
    assert main(["check", good, "--dask", "tcp://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert "--dask tcp://127.0.0.1:9: no Dask scheduler answers there" in err and "Traceback" not in err


def test_a_dask_cluster_reads_the_rank_files_to_the_same_verdict(tmp_path, capsys):
    distributed = pytest.importorskip("distributed")
    from tensordiff.cli import main

    good, bad = write_dp_run(tmp_path, "good"), write_dp_run(tmp_path, "bad", skew_rank=3)
    swapped = write_dp_run(tmp_path, "swapped", swap_rank=5)
    report = tmp_path / "dask.json"
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        assert main(["check", good, "--dask", cluster.scheduler_address, "--no-color"]) == 0
        assert main(["check", bad, "--dask", cluster.scheduler_address, "--no-color"]) == 1
        # the merge and compare on the cluster's workers: a fault only the merged tensors show
        assert main(["diff", good, swapped, "--dask", cluster.scheduler_address, "--no-hints", "--json",
                     str(report)]) == 1
    assert "weights fc weight: DP ranks 0/3 differ" in " ".join(capsys.readouterr().out.split())
    first = json.loads(report.read_text())["first_divergence"]
    assert (first["phase"], first["module_a"], first["kind"]) == ("forward", "fc", "output")


def test_worker_processes_merge_and_compare_to_the_same_rows_as_one_process(tmp_path):
    from tensordiff.cli import main

    good, bad = write_dp_run(tmp_path, "good"), write_dp_run(tmp_path, "bad", swap_rank=11)
    reports = {}
    for jobs in ("1", "2"):
        out = tmp_path / f"jobs{jobs}.json"
        assert main(["diff", good, bad, "--jobs", jobs, "--no-hints", "--json", str(out)]) == 1
        reports[jobs] = json.loads(out.read_text())
    first = reports["2"]["first_divergence"]
    assert (first["step"], first["phase"], first["module_a"], first["kind"]) == (0, "forward", "fc", "output")
    row = next(r for r in reports["2"]["rows"] if r["phase"] == "forward" and r["module_a"] == "fc")
    assert row["metrics"]["source"] == "tensor"  # the statistics are the same: only the merged tensors tell
    assert row["verdict"] == "diverged" and first["rel_l2"] == row["metrics"]["rel_l2"] > 0.1
    assert reports["1"]["rows"] == reports["2"]["rows"]
    assert reports["1"]["first_divergence"] == first


def test_a_pair_measured_from_its_plans_in_a_worker_equals_the_merged_read(tmp_path):
    from tensordiff.diff.align import align_step
    from tensordiff.diff.judge import measure_pair
    from tensordiff.diff.workers import measure_batch, records_of
    from tensordiff.store import open_capture
    from tensordiff.store.plan import MergePlan

    good, bad = write_dp_run(tmp_path, "good"), write_dp_run(tmp_path, "bad", swap_rank=4)
    with open_capture(good) as ca, open_capture(bad) as cb:
        pairs = [p for p in align_step(ca.records(0), cb.records(0), None, False) if p.matched]
        plans_a = {(r.step, r.seq): ca.plan(r) for p in pairs for r in records_of(p)[0]}
        plans_b = {(r.step, r.seq): cb.plan(r) for p in pairs for r in records_of(p)[1]}
        assert all(isinstance(plan, MergePlan) and len(plan.grid) in (1, RANKS) for plan in plans_b.values())
        here = [measure_pair(ca, cb, p, 2) for p in pairs]
    there = measure_batch(pairs, plans_a, plans_b, 2, "test")  # what a worker process runs, after the files closed
    assert [ok for ok, _ in there] == [True] * len(pairs)
    assert [value for _, value in there] == here
    assert any(m is not None and m.rel_l2 > 0 for m, _, _ in here)


def test_a_rank_file_damaged_where_only_a_worker_reads_is_one_line_and_exit_2(tmp_path, capsys):
    import h5py

    from tensordiff.cli import main

    good = write_dp_run(tmp_path, "good")
    bad = write_dp_run(tmp_path, "bad")
    with h5py.File(str(tmp_path / "bad.rank13.h5"), "r+") as f:  # the output's tensor: one element too many
        data = f["steps"][next(iter(f["steps"]))]["data"]
        del data["2"]
        data.create_dataset("2", data=np.zeros(5, np.float32))
    assert main(["diff", good, bad, "--jobs", "2", "--no-hints"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "bad.rank13.h5" in err and "holds 5 elements" in err
