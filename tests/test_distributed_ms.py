"""MindSpore distributed capture under msrun (CPU): MindFormers' GPTModel trained data-parallel on 2 ranks with
MindSpore's DistributedGradReducer, one file per rank, merged on read against the single-process run."""

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

pytest.importorskip("mindspore")
pytest.importorskip("mindformers")

from tensordiff.store import CaptureFile

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
SCRIPT = os.path.join(ROOT, "examples", "distributed", "ms_train.py")
MSRUN = shutil.which("msrun", path=os.path.dirname(sys.executable)) or shutil.which("msrun")


def _env():
    env = dict(os.environ, PYTHONPATH=ROOT, NO_COLOR="1", OMP_NUM_THREADS="1",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    for name in ("TENSORDIFF_OUTPUT", "TENSORDIFF_STEPS", "TENSORDIFF_TENSORS", "TENSORDIFF_DISABLE"):
        env.pop(name, None)
    return env


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _msrun(folder, *args):
    return [MSRUN, "--worker_num", "2", "--local_worker_num", "2", "--master_port", str(_port()), "--join", "True",
            "--log_dir", str(folder / f"logs{_port()}"), SCRIPT, *args]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if MSRUN is None:
        pytest.skip("msrun is not installed next to this python")
    folder = tmp_path_factory.mktemp("msrun")
    ref = folder / "ref.h5"
    proc = subprocess.run([sys.executable, SCRIPT, "--capture", str(ref)], capture_output=True, text=True, env=_env(),
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    dp2 = folder / "dp2.h5"  # through tensordiff capture, as a user runs it
    cap = subprocess.run([sys.executable, "-m", "tensordiff", "capture", "-o", str(dp2), "--steps", "2", "--",
                          *_msrun(folder)], capture_output=True, text=True, env=_env(), timeout=900)
    dpsum = subprocess.run(_msrun(folder, "--fault", "dp-sum", "--capture", str(folder / "dpsum.h5")),
                           capture_output=True, text=True, env=_env(), timeout=900)
    assert dpsum.returncode == 0, dpsum.stdout[-3000:]
    return {"ref": str(ref), "dp2": str(folder / "dp2.rank*.h5"), "dpsum": str(folder / "dpsum.rank*.h5"),
            "capture": cap, "folder": folder}


def test_capture_under_msrun_finds_and_summarises_every_rank_file(runs):
    proc, folder = runs["capture"], runs["folder"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        assert f"tensordiff: wrote {folder / f'dp2.rank{rank}.h5'}: 2 step(s)" in proc.stdout
    assert "tensordiff: 2 rank file(s); diff them as one run, merged on read" in proc.stdout
    with CaptureFile(str(folder / "dp2.rank1.h5")) as cap:
        coords = json.loads(cap.attrs["parallel"])
        assert (coords["world_size"], coords["rank"], coords["dp"], coords["dp_rank"], coords["tp"]) == (2, 1, 2, 1, 1)
        assert coords["source"] == "mindspore.communication" and coords["parallel_mode"] == "data_parallel"


def test_msrun_data_parallel_rank_files_agree_with_the_single_process_run(runs, tmp_path):
    from tensordiff.cli import main

    report = tmp_path / "r.json"
    assert main(["diff", runs["ref"], runs["dp2"], "--json", str(report)]) == 0
    doc = json.loads(report.read_text())
    assert doc["summary"]["shape_mismatch"] == 0 and doc["summary"]["ok"] > 400
    assert all(c["only_a"] == c["only_b"] == 0 and c["compared_a"] == c["recorded_a"] for c in doc["coverage"].values())


def test_msrun_gradients_summed_not_averaged_are_the_gradient_reduction_with_factor_2(runs, tmp_path):
    from tensordiff.cli import main

    report = tmp_path / "r.json"
    assert main(["diff", runs["ref"], runs["dpsum"], "--json", str(report)]) == 1
    doc = json.loads(report.read_text())
    first = doc["first_divergence"]
    assert (first["step"], first["phase"], first["location"]) == (0, "param_grad", "in the gradient reduction")
    assert doc["hints"][0]["cause"] == "factor" and "B = 2 × A" in doc["hints"][0]["title"]
