"""Megatron-LM's ``--save-wgrads-interval`` files read as a capture (tensordiff.store.MegatronGradDump): the
megatron-core loop (Megatron-LM's flags and file layout, examples/megatron_loop/grads.py) writes them while
``tensordiff capture --megatron`` records the same run; the diff compares every parameter gradient, says which of A's
phases the files do not hold, and finds a fault. Bad files are one line. No mocks."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import zipfile

import pytest

pytest.importorskip("megatron.core")

from tests.helpers import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOOP = os.path.join(ROOT, "examples", "megatron_loop", "train.py")


def _run(cmd: list[str], cwd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(ROOT), cwd=cwd, timeout=600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wgrads")
    out = {}
    for name, extra in (("ref", []), ("eps", ["--eps", "1e-2"])):
        save = str(tmp / f"save_{name}")
        cmd = [sys.executable, "-m", "tensordiff", "capture", "--megatron", "-o", str(tmp / f"{name}.h5"), "--steps",
               "2", "--tensors", "all", "--", sys.executable, LOOP, "--steps", "2", "--save", save,
               "--save-wgrads-interval", "1", *extra]
        proc = _run(cmd, str(tmp))
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        out[name], out[f"save_{name}"] = str(tmp / f"{name}.h5"), save
    out["tmp"] = str(tmp)
    return out


def _diff(a: str, b: str, tmp: str, name: str) -> tuple[subprocess.CompletedProcess, dict]:
    path = os.path.join(tmp, f"{name}.json")
    proc = _run([sys.executable, "-m", "tensordiff", "diff", a, b, "--json", path], tmp)
    assert proc.returncode in (0, 1, 3), proc.stderr[-3000:]
    with open(path) as fh:
        return proc, json.load(fh)


def test_the_files_are_read_as_a_capture(runs):
    from tensordiff.store import MegatronGradDump, open_capture

    with open_capture(runs["save_ref"]) as dump:
        assert isinstance(dump, MegatronGradDump)
        assert dump.steps == [0, 1] and dump.step_attrs(1)["iteration"] == 2
        recs = dump.records(0)
        assert {r.phase for r in recs} == {"param_grad"} and len(recs) == 15
        qkv = next(r for r in recs if r.module == "decoder.layers.0.self_attention.linear_qkv" and r.slot == "weight")
        assert qkv.kind == "grad" and qkv.dtype == "float32" and dump.array(qkv).shape == qkv.shape
        assert set(dump.attrs["not_recorded_phases"].split(",")) == {"weights", "forward", "loss", "backward"}
    # an iteration's folder or its file name the same dump, that iteration only
    with open_capture(os.path.join(runs["save_ref"], "wgrads", "iter_0000002", "mp_rank_00.pth")) as one:
        assert one.steps == [1]


def test_capture_against_the_files_of_the_same_run_agrees(runs):
    proc, doc = _diff(runs["ref"], runs["save_ref"], runs["tmp"], "same")
    assert proc.returncode == 0, proc.stdout[-3000:]
    cov = doc["coverage"]
    assert cov["param_grad"]["compared_a"] == cov["param_grad"]["recorded_a"] == 30
    assert cov["forward"]["compared_a"] == 0 and cov["forward"]["not_recorded_a"] == cov["forward"]["recorded_a"] > 0
    assert "Megatron-LM's wgrads hold gradients only" in proc.stdout


def test_a_forward_fault_shows_in_the_files(runs):
    # B's run has another RMSNorm epsilon: its gradient files differ from A's capture from the first iteration
    proc, doc = _diff(runs["ref"], runs["save_eps"], runs["tmp"], "eps")
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert doc["first_divergence"]["step"] == 0 and doc["first_divergence"]["phase"] == "param_grad"


def test_two_runs_files_against_each_other(runs):
    proc, _ = _diff(runs["save_ref"], runs["save_ref"], runs["tmp"], "self")
    assert proc.returncode == 0, proc.stdout[-2000:]
    proc, _ = _diff(runs["save_ref"], runs["save_eps"], runs["tmp"], "files")
    assert proc.returncode == 1, proc.stdout[-2000:]


def _copy(src: str, dst: str) -> None:
    import shutil

    shutil.copytree(src, dst)


def test_bad_files_are_one_line(runs, tmp_path):
    # a sharded run's files: not joined, said in one line
    sharded = str(tmp_path / "sharded")
    _copy(runs["save_ref"], sharded)
    first = os.path.join(sharded, "wgrads", "iter_0000001")
    os.link(os.path.join(first, "mp_rank_00.pth"), os.path.join(first, "mp_rank_01.pth"))
    proc = _run([sys.executable, "-m", "tensordiff", "diff", runs["ref"], sharded], str(tmp_path))
    assert proc.returncode == 2 and "mp_rank_00.pth, mp_rank_01.pth" in proc.stderr and "Traceback" not in proc.stderr
    # a .pth whose pickle names os.system: refused, nothing run
    hostile = str(tmp_path / "hostile")
    _copy(runs["save_ref"], hostile)
    file = os.path.join(hostile, "wgrads", "iter_0000001", "mp_rank_00.pth")

    class Boom:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "ran"),))

    with zipfile.ZipFile(file, "w") as zf:
        zf.writestr("archive/data.pkl", pickle.dumps({"model_chunk0": {"w": Boom()}}, protocol=2))
    proc = _run([sys.executable, "-m", "tensordiff", "diff", runs["ref"], hostile], str(tmp_path))
    assert proc.returncode == 2 and "refused" in proc.stderr and "os" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not os.path.exists(tmp_path / "ran")


REAL = os.environ.get("TENSORDIFF_MLM_GRADS")


@pytest.mark.skipif(not REAL or not os.path.isdir(REAL or ""), reason="TENSORDIFF_MLM_GRADS is not set to the output of "
                    "examples/megatron_lm/grads_gpu.sh (Megatron-LM's own wgrads files, not in the repository)")
def test_megatron_lm_pretrain_gpt_files(tmp_path):
    """pretrain_gpt.py's own --save-wgrads-interval files (H200, core_v0.16.1): against tensordiff's capture of the
    same run they agree (every one of the 56 parameter gradients of 2 iterations compared); against the run with
    another --norm-epsilon they diverge at iteration 1's first gradient."""
    proc, doc = _diff(os.path.join(REAL, "capture.h5"), os.path.join(REAL, "files"), str(tmp_path), "real")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert doc["coverage"]["param_grad"]["compared_b"] == doc["coverage"]["param_grad"]["recorded_b"] == 56
    proc, doc = _diff(os.path.join(REAL, "files"), os.path.join(REAL, "files_eps"), str(tmp_path), "real_eps")
    assert proc.returncode == 1 and doc["first_divergence"]["step"] == 0

