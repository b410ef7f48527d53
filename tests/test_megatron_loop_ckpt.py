"""Checkpoints of the megatron-core loop (examples/megatron_loop/train.py, megatron-core's schedule, DDP and
distributed optimizer) with Megatron-LM's flags: --save/--save-interval write Megatron-LM's layout (torch_dist through
megatron-core's dist_checkpointing, torch as mp_rank_XX/model_optim_rng.pt + distrib_optim.pt), --load/--ckpt-step
resume, and the resumed run prints, for the iterations after the checkpoint, the same log lines (learning rate, loss,
grad norm; bit for bit on the CPU) as the uninterrupted run; also under `tensordiff capture --megatron`.
Real megatron-core, no mocks."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")

from helpers import subprocess_env

from tensordiff.cli import main as td_main
from tensordiff.store import CaptureFile

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
LOOP = os.path.join(ROOT, "examples", "megatron_loop", "train.py")
#: a schedule with warm-up and cosine decay and weight decay: the scheduler's and AdamW's state must come back too
SCHEDULE = ["--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--min-lr", "1e-4", "--weight-decay", "0.1"]


def _env() -> dict[str, str]:
    return subprocess_env(ROOT)


def _lines(text: str) -> dict[int, str]:
    """iteration -> its whole log line (learning rate, lm loss, grad norm as printed)."""
    return {int(m.group(1)): m.group(0) for m in re.finditer(r" iteration\s+(\d+)/\s*\d+ \|.*", text)}


def _run_all(cmds: dict[str, list[str]]) -> dict[str, str]:
    """Two at a time (two cores): name -> stdout; each must succeed."""
    out, names = {}, list(cmds)
    for i in range(0, len(names), 2):
        procs = {n: subprocess.Popen(cmds[n], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                                     cwd=ROOT) for n in names[i:i + 2]}
        for n, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=300)
            assert proc.returncode == 0, (n, stdout[-2000:], stderr[-3000:])
            out[n] = stdout + stderr
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mloop")
    batch = str(tmp / "batch.h5")
    assert td_main(["batch", "-o", batch, "--vocab", "128", "--seq", "16", "--batch", "4", "--seed", "0"]) == 0
    base = [sys.executable, LOOP, "--data", batch, *SCHEDULE]
    saved = _run_all({fmt: [*base, "--train-iters", "6", "--save", str(tmp / fmt), "--save-interval", "3",
                            "--ckpt-format", fmt] for fmt in ("torch_dist", "torch")})
    cap = str(tmp / "resumed.h5")
    resumed = _run_all({
        "torch_dist": [*base, "--train-iters", "6", "--load", str(tmp / "torch_dist"), "--ckpt-step", "3"],
        "torch": [*base, "--train-iters", "6", "--load", str(tmp / "torch"), "--ckpt-step", "3"],
        "captured": [sys.executable, "-m", "tensordiff", "capture", "--megatron", "-o", cap, "--steps", "2", "--",
                     *base, "--train-iters", "6", "--load", str(tmp / "torch_dist"), "--ckpt-step", "3"],
        "finetune": [*base, "--train-iters", "2", "--load", str(tmp / "torch"), "--finetune"],
    })
    return {"tmp": tmp, "saved": saved, "resumed": resumed, "capture": cap}


def test_save_writes_megatron_lms_layout_for_both_formats(runs):
    tmp = runs["tmp"]
    for fmt in ("torch_dist", "torch"):
        assert (tmp / fmt / "latest_checkpointed_iteration.txt").read_text() == "6"
        assert sorted(p.name for p in (tmp / fmt).iterdir()) == ["iter_0000003", "iter_0000006",
                                                                  "latest_checkpointed_iteration.txt"]
        assert f"successfully saved checkpoint from iteration       3 to {tmp / fmt} [ {fmt} ]" in runs["saved"][fmt]
    dist = sorted(p.name for p in (tmp / "torch_dist" / "iter_0000003").iterdir())
    assert dist == [".metadata", "__0_0.distcp", "__0_1.distcp", "common.pt", "metadata.json"]
    assert sorted(p.name for p in (tmp / "torch" / "iter_0000003" / "mp_rank_00").iterdir()) == [
        "distrib_optim.pt", "model_optim_rng.pt"]


def test_the_schedule_is_megatron_cores_and_logged_in_megatron_lms_order(runs):
    lines = _lines(runs["saved"]["torch_dist"])
    assert sorted(lines) == [1, 2, 3, 4, 5, 6]
    assert re.fullmatch(r" iteration +1/ +6 \| learning rate: 1\.000000E-03 \| lm loss: [0-9.]+E\+00 \| "
                        r"grad norm: [0-9.]+ \|", lines[1]), lines[1]
    # cosine from 1e-3 (after one warm-up iteration) down to --min-lr 1e-4 at iteration 6
    lrs = [float(re.search(r"learning rate: (\S+)", lines[i]).group(1)) for i in range(1, 7)]
    assert lrs == pytest.approx([1e-3, 9.140576e-4, 6.890576e-4, 4.109424e-4, 1.859424e-4, 1e-4], rel=1e-6)
    # both formats train the same run
    assert _lines(runs["saved"]["torch"]) == lines


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_a_run_resumed_from_iteration_3_prints_the_uninterrupted_runs_iterations_4_to_6(runs, fmt):
    full, resumed = _lines(runs["saved"][fmt]), _lines(runs["resumed"][fmt])
    assert sorted(resumed) == [4, 5, 6]
    assert [resumed[i] for i in (4, 5, 6)] == [full[i] for i in (4, 5, 6)]  # the printed digits, all of them
    assert f"successfully loaded checkpoint from {runs['tmp'] / fmt} [ t 0, p 0 ] at iteration 3 [ {fmt} ]" \
        in runs["resumed"][fmt]


def test_resuming_under_capture_megatron_gives_the_same_iterations_and_captures_them(runs):
    full, resumed = _lines(runs["saved"]["torch_dist"]), _lines(runs["resumed"]["captured"])
    assert [resumed[i] for i in (4, 5, 6)] == [full[i] for i in (4, 5, 6)]
    with CaptureFile(runs["capture"]) as cap:
        assert len(cap.steps) == 2
        losses = [cap.step_attrs(s)["loss"] for s in cap.steps]
        scalars = cap.scalars()
    # the captured steps are the resumed run's first two: iterations 4 and 5 of the uninterrupted run
    expected = [float(re.search(r"lm loss: (\S+)", full[i]).group(1)) for i in (4, 5, 6)]
    assert losses == pytest.approx(expected[:2], rel=1e-6)
    assert [scalars["loss"][k] for k in sorted(scalars["loss"])] == pytest.approx(expected, rel=1e-6)


def test_finetune_loads_the_weights_only_and_restarts_at_iteration_1(runs):
    out = runs["resumed"]["finetune"]
    assert "at iteration 0 [ torch ]" in out
    lines = _lines(out)
    assert sorted(lines) == [1, 2]
    # the weights of iteration 6, the schedule from its start (warm-up: 1e-3 after iteration 1)
    assert "learning rate: 1.000000E-03" in lines[1]
    assert lines[1] != _lines(runs["saved"]["torch"])[1]
