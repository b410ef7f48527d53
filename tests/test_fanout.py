"""Many rank files read in a process pool or on a Dask cluster (tensordiff/store/fanout.py): the same verdicts as
one process, and bad settings are one line with exit code 2."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import T, write_capture

RANKS = 20  # above POOL_MIN_FILES: the automatic setting uses the pool too


def write_dp_run(folder, name, skew_rank=None):
    """A data-parallel run of RANKS rank files: x [B=1 per rank, 3], a replicated weight (skewed on one rank)."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((4, 3)).astype(np.float32)
    x = rng.standard_normal((RANKS, 3)).astype(np.float32)
    for rank in range(RANKS):
        coords = {"world_size": RANKS, "rank": rank, "dp": RANKS, "dp_rank": rank, "tp": 1, "tp_rank": 0, "pp": 1,
                  "source": "torch.distributed"}
        wr = w * (1.001 if rank == skew_rank else 1.0)
        recs = [T("weights", "fc", "param", "weight", wr, module_class="Linear"),
                T("forward", "", "input", "0", x[rank:rank + 1], module_class="Net"),
                T("forward", "fc", "output", "0", x[rank:rank + 1] @ wr.T, module_class="Linear")]
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
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        assert main(["check", good, "--dask", cluster.scheduler_address, "--no-color"]) == 0
        assert main(["check", bad, "--dask", cluster.scheduler_address, "--no-color"]) == 1
    assert "weights fc weight: DP ranks 0/3 differ" in " ".join(capsys.readouterr().out.split())
