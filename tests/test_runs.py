"""tensordiff runs: whole training runs side by side from the logs people have."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

from tensordiff.cli import main
from tensordiff.runs import RunsError, compare_runs, read_run

# MindFormers' own logging code (MFLossMonitor.print_output_info) writes the lines, in a child process
MF_LOG = r'''
import sys, types, numpy as np
from mindformers.core.callback import callback as cbmod
lines = []
class Capture:
    def info(self, fmt, *a): lines.append(fmt % a if a else fmt)
    def warning(self, *a, **k): pass
cbmod.logger = Capture()
monitor = cbmod.MFLossMonitor(learning_rate=3e-4, per_print_times=1)
params = types.SimpleNamespace(dataset_sink_mode=True)
for epoch in (1, 2):
    for step in range(1, 101):
        g = (epoch - 1) * 100 + step
        loss = 10 * np.exp(-g / 80) + 2
        loss *= 1.002 if g < 150 else 1.03
        monitor.print_output_info(params, epoch, 2, 1.0, step, 100, loss, 812.0, False, 1.0, 0, 0,
                                  np.array([1.5 + g / 1000]), np.array([loss]), np.array([0.0]), np.array([0.0]),
                                  np.array([0.0]))
open(sys.argv[1], "w").write("\n".join("2026-11-30 04:00:00,000 - mindformers - INFO - " + l for l in lines) + "\n")
'''


def megatron_log(path):
    """Lines in Megatron-LM's training_log format (megatron/training, not part of megatron-core's wheel)."""
    with open(path, "w") as f:
        f.write("using world size: 1, data-parallel size: 1, tensor-model-parallel size: 1\n")
        for it in range(10, 201, 10):
            loss = 10 * math.exp(-it / 80) + 2
            f.write(f" [2026-11-30 04:00:00] iteration {it:8d}/     200 | consumed samples:        {it * 8:5d} | "
                    "elapsed time per iteration (ms): 812.3 | learning rate: 3.000000E-04 | global batch size:     8 | "
                    f"lm loss: {loss:.6E} | loss scale: 1.0 | grad norm: {1.5 + it / 1000:.3f} | "
                    "number of skipped iterations:   0 | number of nan iterations:   0 |\n")
            if it % 100 == 0:
                f.write("-" * 100 + "\n")
                f.write(f" validation loss at iteration {it} | lm loss value: {loss + 0.1:.6E} | "
                        f"lm loss PPL: {math.exp(loss + 0.1):.6E} | \n")


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("runs")
    mega = str(folder / "megatron.log")
    megatron_log(mega)
    mf = None
    if importlib.util.find_spec("mindformers") is not None:
        mf = str(folder / "mindformers.log")
        subprocess.run([sys.executable, "-c", MF_LOG, mf], cwd=folder, check=True, capture_output=True, timeout=300)
    return mega, mf


def test_megatron_log_reader(logs):
    run = read_run(logs[0])
    assert run.kind == "megatron-lm log" and sorted(run.loss) == list(range(10, 201, 10))
    assert run.loss[100] == pytest.approx(10 * math.exp(-100 / 80) + 2, rel=1e-6)
    assert run.grad_norm[200] == pytest.approx(1.7) and run.lr[10] == pytest.approx(3e-4)
    assert run.val_loss == {100: pytest.approx(10 * math.exp(-1.25) + 2.1, rel=1e-6),
                            200: pytest.approx(10 * math.exp(-2.5) + 2.1, rel=1e-6)}


def test_mindformers_log_from_its_own_logging_code(logs):
    if logs[1] is None:
        pytest.skip("needs MindFormers")
    run = read_run(logs[1])
    assert run.kind == "mindformers log" and sorted(run.loss) == list(range(1, 201))  # epoch 2 continues the steps
    assert run.loss[101] == pytest.approx((10 * math.exp(-101 / 80) + 2) * 1.002, rel=1e-5)
    assert run.grad_norm[150] == pytest.approx(1.65) and run.lr[1] == pytest.approx(3e-4)


def test_runs_aligns_intervals_and_gives_a_verdict(logs, tmp_path, capsys):
    if logs[1] is None:
        pytest.skip("needs MindFormers")
    report = str(tmp_path / "r.json")
    assert main(["runs", logs[0], logs[1], "--warmup", "20", "--json", report]) == 1
    out = capsys.readouterr().out
    assert "FAIL: the relative loss error first exceeds 1.00% at step 150" in out
    with open(report) as fh:
        doc = json.load(fh)
    assert doc["common_steps"] == 20  # Megatron logged every 10 steps, MindFormers every step
    assert doc["max_rel_loss"] == pytest.approx(0.03, rel=1e-4)
    assert doc["first_step_over_threshold"] == 150
    res = compare_runs(read_run(logs[0]), read_run(logs[1]), threshold=0.05, warmup=20)
    assert res.passed and res.grad_norm_max_rel == pytest.approx(0.0, abs=1e-3)


def test_captures_are_runs_too(tmp_path):
    pytest.importorskip("megatron.core")
    from examples.gpt import train

    a, b = str(tmp_path / "a.h5"), str(tmp_path / "b.h5")
    la = train.main(["--capture", a, "--train-steps", "3", "--capture-steps", "3"])
    lb = train.main(["--capture", b, "--train-steps", "3", "--capture-steps", "3", "--fault", "optimizer-wd"])
    res = compare_runs(read_run(a), read_run(b))
    assert res.steps == [0, 1, 2] and res.rel_loss[0] == 0.0
    assert res.final_loss == (pytest.approx(la[-1], rel=1e-6), pytest.approx(lb[-1], rel=1e-6))


def test_unknown_format_names_the_line(tmp_path, capsys):
    junk = tmp_path / "notes.txt"
    junk.write_text("hello world\nsecond line\n")
    megatron = tmp_path / "m.log"
    megatron_log(str(megatron))
    assert main(["runs", str(megatron), str(junk)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(junk) in err and "'hello world'" in err
    with pytest.raises(RunsError, match="no such file"):
        read_run(str(tmp_path / "missing.log"))


def test_tensorboard_events_from_tensorboardx(tmp_path, logs):
    """The event files MindFormers writes (through tensorboardX's SummaryWriter, its tensor_writer)."""
    tbx = pytest.importorskip("tensorboardX")
    writer = tbx.SummaryWriter(str(tmp_path / "tb"))
    for step in range(10, 201, 10):
        writer.add_scalar("loss", 10 * math.exp(-step / 80) + 2, global_step=step)
        writer.add_scalar("grad-norm", 1.5 + step / 1000, global_step=step)
        writer.add_scalar("learning-rate", 3e-4, global_step=step)
    writer.close()
    (events,) = [str(p) for p in (tmp_path / "tb").iterdir()]
    run = read_run(events)
    assert run.kind == "tensorboard events" and sorted(run.loss) == list(range(10, 201, 10))
    assert run.loss[100] == pytest.approx(10 * math.exp(-1.25) + 2, rel=1e-6)  # stored as float32
    assert run.grad_norm[200] == pytest.approx(1.7, rel=1e-6)
    res = compare_runs(read_run(logs[0]), run)
    assert res.passed and res.max_rel_loss < 1e-6  # the Megatron-LM log and these events hold the same curve
    cut = tmp_path / "events.out.tfevents.cut"
    with open(events, "rb") as fh:
        cut.write_bytes(fh.read()[:-7])
    with pytest.raises(RunsError, match="truncated TensorBoard event file"):
        read_run(str(cut))
