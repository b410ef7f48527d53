"""Distributed capture under torchrun (gloo, CPU): one file per rank, found and summarised, with each rank's
coordinates and megatron-core's parameter splits in the file. Real megatron-core, TP=2, two processes."""

import json
import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")

from tensordiff.store import CaptureFile

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
SCRIPT = os.path.join(ROOT, "examples", "distributed", "mcore_train.py")
TORCHRUN = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")


def _env():
    env = dict(os.environ, PYTHONPATH=ROOT, NO_COLOR="1", OMP_NUM_THREADS="1")
    for name in ("TENSORDIFF_OUTPUT", "TENSORDIFF_STEPS", "TENSORDIFF_TENSORS", "TENSORDIFF_DISABLE"):
        env.pop(name, None)
    return env


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    if TORCHRUN is None:
        pytest.skip("torchrun is not installed next to this python")
    out = tmp_path_factory.mktemp("dist") / "tp2.h5"
    proc = subprocess.run([sys.executable, "-m", "tensordiff", "capture", "-o", str(out), "--steps", "2", "--",
                           TORCHRUN, "--standalone", "--nproc_per_node", "2", SCRIPT, "--tp", "2"],
                          capture_output=True, text=True, env=_env(), timeout=600)
    return out, proc


def test_capture_under_torchrun_finds_and_summarises_every_rank_file(tp2):
    out, proc = tp2
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        assert f"tensordiff: wrote {out.parent / f'tp2.rank{rank}.h5'}: 2 step(s)" in proc.stdout
    assert "tensordiff: 2 rank file(s)" in proc.stdout
    assert not out.exists()


def test_each_rank_file_holds_its_coordinates_and_the_parameter_splits(tp2):
    out, _ = tp2
    for rank in (0, 1):
        with CaptureFile(str(out.parent / f"tp2.rank{rank}.h5")) as cap:
            coords = json.loads(cap.attrs["parallel"])
            assert (coords["world_size"], coords["rank"], coords["tp"], coords["tp_rank"], coords["dp"], coords["pp"]) \
                == (2, rank, 2, rank, 1, 1)
            assert coords["tp_group"] == [0, 1] and coords["sequence_parallel"] is False
            splits = json.loads(cap.attrs["param_splits"])
            assert splits["decoder.layers.0.mlp.linear_fc1.weight"] == {"tp": True, "sp": False, "dim": 0, "stride": 2}
            assert splits["decoder.layers.0.self_attention.linear_proj.weight"]["dim"] == 1
            assert "decoder.layers.0.input_layernorm.weight" not in splits  # replicated, not marked
            qkv = [r for r in cap.records(0) if r.phase == "weights" and r.module.endswith("0.self_attention.linear_qkv")]
            assert qkv[0].shape == (64, 64)  # (4 + 2*2) x 16 rows / TP 2
