"""tensordiff runs: whole training runs side by side from the logs people have."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import struct
import subprocess
import sys

import pytest

from tensordiff.cli import main
from tensordiff.errors import RunsError
from tensordiff.runs import compare_runs, read_run

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


#: a real log: Megatron-LM's own pretrain_gpt.py (core_v0.16.1, one H100, the tiny GPT of
#: examples/megatron_lm/ckpt_variants_gpu.sh, 6 iterations, the distributed optimizer), as it wrote it
REAL_LOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "megatron_lm", "pretrain_gpt.log")


def test_a_real_pretrain_gpt_log_is_read_line_for_line(tmp_path):
    logged = {}
    with open(REAL_LOG, encoding="utf-8") as fh:  # the iteration lines, read here by a plain regex
        for line in fh:
            m = re.search(r"\] iteration\s+(\d+)/\s*\d+ \|.*\| learning rate: ([0-9.E+-]+) \|.*"
                          r"\| lm loss: ([0-9.E+-]+) \|.*\| grad norm: ([0-9.]+) \|", line)
            if m:
                logged[int(m.group(1))] = tuple(float(x) for x in m.group(2, 3, 4))
    assert sorted(logged) == [1, 2, 3, 4, 5, 6]
    run = read_run(REAL_LOG)
    assert run.kind == "megatron-lm log" and sorted(run.loss) == sorted(logged)
    for it, (lr, loss, norm) in logged.items():
        assert (run.lr[it], run.loss[it], run.grad_norm[it]) == pytest.approx((lr, loss, norm), rel=1e-9), it
    # against itself: the same run, every iteration compared
    report = tmp_path / "self.json"
    assert main(["runs", REAL_LOG, REAL_LOG, "--json", str(report)]) == 0
    doc = json.loads(report.read_text())
    assert doc["common_steps"] == 6 and doc["max_rel_loss"] == 0 and doc["passed"]


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
    assert res.steps == [1, 2, 3] and res.rel_loss[1] == 0.0  # a capture's step k is iteration k + 1, as in the logs
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


TINY_TRAIN = r"""
import os, signal, sys, torch, tensordiff
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x, y = torch.randn(32, 8), torch.randn(32, 1)
kill_at = int(sys.argv[2])
with tensordiff.capture(model, sys.argv[1], steps=2, optimizer=opt) as cap:
    for step in range(40):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        opt.step()
        opt.zero_grad()
        cap.step(loss, grad_norm=norm, lr=0.05)
        print(step, repr(loss.item()), repr(norm.item()), flush=True)
        if step % 10 == 9:
            cap.log(val_loss=loss.item() + 1.0)
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
"""


def _tiny_run(tmp_path, name, kill_at=-1):
    pytest.importorskip("torch")
    path = str(tmp_path / name)
    proc = subprocess.run([sys.executable, "-c", TINY_TRAIN, path, str(kill_at)], capture_output=True, text=True,
                          timeout=300)
    printed = {int(s) + 1: (float(loss), float(n)) for s, loss, n in (line.split() for line in proc.stdout.splitlines())}
    return path, proc.returncode, printed


def test_capture_scalars_cover_the_whole_run(tmp_path, capsys):
    """cap.step(loss, grad_norm=..., lr=...) and cap.log(val_loss=...) keep every step, not only the captured two."""
    from tensordiff.store import CaptureFile

    path, code, printed = _tiny_run(tmp_path, "tiny.h5")
    assert code == 0 and len(printed) == 40
    with CaptureFile(path) as cap:
        assert cap.steps == [0, 1]  # tensors of two steps ...
        scalars = cap.scalars()  # ... scalars of all forty, counted from 0
    assert sorted(scalars["loss"]) == list(range(40)) and sorted(scalars["val_loss"]) == [9, 19, 29, 39]
    run = read_run(path)
    assert run.kind == "tensordiff capture" and sorted(run.loss) == list(range(1, 41))
    assert all(run.loss[s] == pytest.approx(printed[s][0], rel=1e-7) for s in printed)
    assert all(run.grad_norm[s] == pytest.approx(printed[s][1], rel=1e-7) for s in printed)
    assert run.lr[40] == pytest.approx(0.05) and run.val_loss[10] == pytest.approx(printed[10][0] + 1.0)
    res = compare_runs(run, read_run(path))
    assert res.passed and res.max_rel_loss == 0.0 and res.val == (40, run.val_loss[40], run.val_loss[40])
    assert main(["ls", path]) == 0
    out = capsys.readouterr().out
    assert "scalar loss: 40 steps (0..39)" in out and "scalar val_loss: 4 steps (9..39)" in out


def test_scalars_survive_sigkill(tmp_path):
    """Each step's scalars are handed to the writer process before ``step()`` returns: a killed run keeps every
    step whose ``step()`` returned."""
    path, code, printed = _tiny_run(tmp_path, "killed.h5", kill_at=24)
    from tensordiff.store import CaptureFile

    assert code == -9 and max(printed) == 25
    with CaptureFile(path) as cap:
        assert cap.steps == [0, 1]  # the captured steps are whole
    run = read_run(path)
    assert sorted(run.loss) == list(range(1, 26)), sorted(run.loss)  # the kill came after step 25's step() returned
    assert all(run.loss[s] == pytest.approx(printed[s][0], rel=1e-7) for s in run.loss)


def test_plot_and_self_contained_html(logs, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    other = tmp_path / "other.log"
    with open(logs[0]) as src:  # the same run, 2% higher loss from iteration 150 on
        text = src.read().splitlines()
    out = []
    for line in text:
        if "| lm loss:" in line and int(line.split("iteration")[1].split("/")[0]) >= 150:
            value = float(line.split("lm loss:")[1].split("|")[0])
            line = line.replace(f"lm loss: {value:.6E}", f"lm loss: {value * 1.02:.6E}")
        out.append(line)
    other.write_text("\n".join(out) + "\n")
    png, page = str(tmp_path / "runs.png"), str(tmp_path / "runs.html")
    assert main(["runs", logs[0], str(other), "--plot", png, "--html", page]) == 1
    assert "FAIL: the relative loss error first exceeds 1.00% at step 150" in capsys.readouterr().out
    with open(png, "rb") as fh:
        head = fh.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", head[16:24])
    assert width >= 800 and height >= 700  # three panels: loss, relative error, grad norm
    with open(page, encoding="utf-8") as fh:
        html_text = fh.read()
    assert "data:image/png;base64," in html_text and "first exceeds 1.00% at step 150" in html_text
    assert "http://" not in html_text and "https://" not in html_text and "<script" not in html_text
    assert html_text.count("<tr>") == 1 + 7 + 1 + 20  # header, 7 measures, per-step header, 20 common steps


def test_plot_without_matplotlib_is_one_line(logs, tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None; from tensordiff.cli import main; "
            f"sys.exit(main(['runs', {logs[0]!r}, {logs[0]!r}, '--plot', {str(tmp_path / 'p.png')!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "pip install 'tensordiff[plot]'" in proc.stderr


def _iteration(line):
    m = re.search(r" iteration\s+(\d+)\s*/", line)
    return int(m.group(1)) if m else None


def test_restart_keeps_the_later_values(tmp_path, capsys):
    """A job that blew up at iteration 60 and resumed from its checkpoint of iteration 50 logs 51..60 twice."""
    whole, resumed = tmp_path / "whole.log", tmp_path / "resumed.log"
    megatron_log(str(whole))
    lines = whole.read_text().splitlines()
    before = []
    for ln in lines:
        it = _iteration(ln)
        if it is not None and it > 60:
            break
        if it is not None and it > 50:  # the diverging attempt: loss 50% higher
            value = float(ln.split("lm loss:")[1].split("|")[0])
            ln = ln.replace(f"lm loss: {value:.6E}", f"lm loss: {value * 1.5:.6E}")
        before.append(ln)
    before.append("Traceback (most recent call last): RuntimeError: loss is nan")
    after = [ln for ln in lines if _iteration(ln) is None or _iteration(ln) > 50]
    resumed.write_text("\n".join(before + after) + "\n")
    run = read_run(str(resumed))
    assert run.relogged == {60} and sorted(run.loss) == list(range(10, 201, 10))
    assert run.loss[60] == pytest.approx(10 * math.exp(-60 / 80) + 2, rel=1e-6)  # the resumed value
    assert main(["runs", str(resumed), str(whole), "--width", "200"]) == 0
    assert "step 60 logged again after a restart, the later values kept" in capsys.readouterr().out


def test_window_and_extra_thresholds(logs, tmp_path, capsys):
    """--window judges part of the run; --ppl-threshold and --grad-norm-threshold add to the verdict."""
    whole, other = tmp_path / "a.log", tmp_path / "b.log"
    megatron_log(str(whole))
    lines = []
    for ln in whole.read_text().splitlines():  # B: loss 3% higher from iteration 150, grad norm 10% higher
        it = _iteration(ln)
        if it is not None:
            value = float(ln.split("lm loss:")[1].split("|")[0])
            if it >= 150:
                ln = ln.replace(f"lm loss: {value:.6E}", f"lm loss: {value * 1.03:.6E}")
            norm = float(ln.split("grad norm:")[1].split("|")[0])
            ln = ln.replace(f"grad norm: {norm:.3f}", f"grad norm: {norm * 1.1:.3f}")
        lines.append(ln)
    other.write_text("\n".join(lines) + "\n")
    a, b = read_run(str(whole)), read_run(str(other))
    early = compare_runs(a, b, window=(1, 140))
    assert early.passed and early.max_rel_step <= 140 and early.judged_text() == "in steps 1..140"
    late = compare_runs(a, b, window=(150, 10**9))
    assert not late.passed and late.first_over == 150 and late.judged_text() == "in steps 150..200"
    gn = compare_runs(a, b, window=(1, 140), grad_norm_threshold=0.05)
    assert not gn.passed and gn.failures == ["the mean relative grad-norm difference is 10.000% > 5.00%"]
    ppl = compare_runs(a, b, ppl_threshold=0.02, threshold=0.05)
    assert not ppl.passed and ppl.first_over is None
    assert [f.split(" differs")[0] for f in ppl.failures] == ["the final training perplexity"]  # validation: same lines
    assert main(["runs", str(whole), str(other), "--window", "1:140", "--grad-norm-threshold", "0.2", "--width", "200"]) == 0
    out = capsys.readouterr().out
    assert "PASS: the relative loss error stays within 1.00% in steps 1..140; grad norm within 20.00%." in out
    assert main(["runs", str(whole), str(other), "--window", "150"]) == 2
    assert "--window 150: expected LO:HI" in capsys.readouterr().err
    assert main(["runs", str(whole), str(other), "--window", "300:400"]) == 2
    assert "no common step is judged" in capsys.readouterr().err


def _nan_log(path, bad_from=None, value="nan"):
    """Megatron-LM lines whose loss is ``value`` from iteration ``bad_from`` on (None: never)."""
    with open(path, "w") as f:
        for it in range(10, 101, 10):
            loss = value if bad_from is not None and it >= bad_from else f"{10 * math.exp(-it / 80) + 2:.6E}"
            f.write(f" [2026-11-30 04:00:00] iteration {it:8d}/     100 | lm loss: {loss} | grad norm: 1.5 |\n")
    return str(path)


@pytest.mark.parametrize(("bad_a", "bad_b", "value"), [(10, 10, "nan"), (None, 50, "nan"), (10, None, "inf")])
def test_non_finite_losses_never_pass(tmp_path, capsys, bad_a, bad_b, value):
    a = _nan_log(tmp_path / "a.log", bad_a, value)
    b = _nan_log(tmp_path / "b.log", bad_b, value)
    assert main(["runs", a, b, "--width", "100"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "PASS" not in out
    first_bad = min(s for s in (bad_a, bad_b) if s is not None)
    assert f"the loss is {value} at step {first_bad}" in " ".join(out.split())


@pytest.mark.parametrize("flag", [["--threshold", "nan"], ["--threshold", "-1"], ["--threshold", "inf"],
                                  ["--ppl-threshold", "nan"], ["--grad-norm-threshold", "-0.5"]])
def test_a_threshold_that_cannot_fail_is_refused(tmp_path, capsys, flag):
    a = _nan_log(tmp_path / "a.log")
    assert main(["runs", a, a, *flag]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flag[0] in err and "finite number >= 0" in err


def test_the_relative_error_curve_draws_bit_identical_steps_at_a_floor_not_as_gaps(logs):
    from tensordiff.report.runs_plot import rel_series

    run = read_run(logs[0])
    same = compare_runs(run, run)  # every loss bit-identical: the whole curve would be a gap on a log axis
    values, equal, floor = rel_series(same)
    assert equal == same.steps and values == [floor] * len(same.steps) and 0 < floor < same.threshold
    assert not any(math.isnan(v) for v in values)


def test_the_sample_lines_in_the_docs_are_read_as_documented(tmp_path):
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "runs.md"),
              encoding="utf-8") as fh:
        blocks = re.findall(r"```text\n(.*?)```", fh.read(), re.S)
    megatron, mindformers = (tmp_path / "megatron.log"), (tmp_path / "mf.log")
    megatron.write_text(blocks[0])
    mindformers.write_text(blocks[1])
    a, b = read_run(str(megatron)), read_run(str(mindformers))
    assert (a.loss, a.grad_norm, a.lr, a.val_loss) == ({10: 8.162007}, {10: 1.51}, {10: 3e-4}, {100: 2.920654})
    assert (b.loss, b.grad_norm, b.lr) == ({1: 9.5}, {1: 1.52}, {1: 0.0003})
