"""`tensordiff capture --megatron`: a megatron-core training loop that never calls tensordiff
(examples/megatron_loop/train.py: megatron-core's schedule, its DDP and distributed optimizer, a loss function that
reports ``lm loss`` as [sum, tokens]) captured through the launcher, under `python` and under `torchrun` (gloo, TP=2),
checked against the same loop captured through `tensordiff.capture`. Real megatron-core, no mocks."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")

from tensordiff.store import CaptureFile

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
LOOP = os.path.join(ROOT, "examples", "megatron_loop", "train.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=ROOT, NO_COLOR="1", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    for name in ("TENSORDIFF_OUTPUT", "TENSORDIFF_STEPS", "TENSORDIFF_TENSORS", "TENSORDIFF_DISABLE"):
        env.pop(name, None)
    return env


def _td(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tensordiff", *args], capture_output=True, text=True, env=_env(),
                          timeout=timeout, cwd=ROOT)


def _iterations(text: str) -> dict[int, float]:
    """The loop's Megatron-LM-style log lines: iteration -> lm loss."""
    return {int(m.group(1)): float(m.group(2))
            for m in re.finditer(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)", text)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Captures of the loop (3 iterations, 2 captured; gradient clipping off, so that the direct capture, which takes
    the gradients after the optimizer step, sees the same ones): through --megatron (TP=1 with 2 micro-batches, TP=1,
    TP=2 under torchrun, and TP=1 with another norm epsilon) and through tensordiff.capture (TP=1 with 2
    micro-batches, TP=2 under torchrun)."""
    tmp = tmp_path_factory.mktemp("megatron")
    plans = {
        "mb2": ("launcher", [sys.executable], ["--microbatches", "2"]),
        "mb2_direct": ("direct", [sys.executable], ["--microbatches", "2"]),
        "tp1": ("launcher", [sys.executable], []),
        "eps": ("launcher", [sys.executable], ["--eps", "1e-2"]),
        "tp2": ("launcher", TORCHRUN, ["--tp", "2"]),
        "tp2_direct": ("direct", TORCHRUN, ["--tp", "2"]),
        "dp2": ("launcher", TORCHRUN, []),  # DP=2 with the distributed optimizer: each rank owns a shard
        "dp2_sum": ("launcher", TORCHRUN, ["--dp-sum"]),
        "pp2": ("launcher", TORCHRUN, ["--pp", "2"]),  # two pipeline stages, megatron's pipeline schedule
    }
    out = {}
    started = []
    for name, (how, launcher, extra) in plans.items():  # two at a time (2 cores; the torchrun ones run alone)
        path = str(tmp / f"{name}.h5")
        loop = [*launcher, LOOP, "--steps", "3", "--clip", "0", *extra]
        if how == "direct":
            cmd = [*loop, "--direct", path]
        else:
            cmd = [sys.executable, "-m", "tensordiff", "capture", "--megatron", "-o", path, "--steps", "2", "--", *loop]
        started.append((name, path, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                                     env=_env(), cwd=ROOT)))
        if len(started) == 2 or launcher is TORCHRUN:
            for done, done_path, proc in started:
                stdout, stderr = proc.communicate(timeout=300)
                assert proc.returncode == 0, (done, stdout[-2000:], stderr[-3000:])
                files = sorted(glob.glob(str(tmp / f"{done}.rank*.h5"))) or [done_path]
                out[done] = {"path": done_path if len(files) == 1 else str(tmp / f"{done}.rank*.h5"),
                             "files": files, "stdout": stdout, "stderr": stderr}
            started = []
    return out


def test_the_launcher_captures_the_loop_unedited_with_megatrons_loss_steps_and_scalars(runs):
    run = runs["mb2"]
    assert "--megatron recorded 2 training step(s) of DistributedDataParallel" in run["stderr"]
    logged = _iterations(run["stdout"])
    assert sorted(logged) == [1, 2, 3]
    with CaptureFile(run["path"]) as cap:
        assert cap.steps == [0, 1]
        attrs = [cap.step_attrs(s) for s in cap.steps]
        assert [a["iteration"] for a in attrs] == [1, 2]  # as the log prints it
        for step, a in zip(cap.steps, attrs):  # sum loss / sum tokens over the micro-batches, as Megatron-LM
            assert a["loss"] == pytest.approx(logged[step + 1], rel=1e-6)
        records = cap.records(0)
        # two micro-batches: each module is called twice in a step, forward and backward
        calls = {r.call for r in records if r.module == "module.decoder.layers.0.mlp.linear_fc1" and r.phase == "forward"}
        assert calls == {0, 1}
        assert sum(r.phase == "param_grad" for r in records) == 15
        scalars = cap.scalars()
    # every iteration of the run, the captured ones and the one after them
    assert sorted(scalars["loss"]) == [0, 1, 2] and scalars["loss"][2] == pytest.approx(logged[3], rel=1e-6)
    assert set(scalars) >= {"loss", "grad_norm", "lr", "loss_scale"}
    assert scalars["lr"][0] == pytest.approx(1e-3)


def assert_everything_compared(report: dict, steps: list[int]) -> None:
    """Both sides' every record compared or accounted for, in every phase, on ``steps`` (no count copied from an
    output: a record lost on one side fails here)."""
    assert report["steps"] == steps
    for phase, c in report["coverage"].items():
        assert c["recorded_a"] > 0 and c["compared_a"] + c["accounted_a"] + c["linked_a"] == c["recorded_a"], phase
        assert c["compared_b"] + c["accounted_b"] + c["linked_b"] == c["recorded_b"], phase
        assert c["share_a"] == c["share_b"] == 1.0, (phase, c)


def test_the_launchers_capture_agrees_with_the_direct_one(runs, tmp_path):
    report = tmp_path / "report.json"
    proc = _td("diff", runs["mb2_direct"]["path"], runs["mb2"]["path"], "--json", str(report))
    assert proc.returncode == 0, proc.stdout[-3000:]
    data = json.loads(report.read_text())
    summary = data["summary"]
    assert summary["diverged"] == 0 and summary["only_a"] == summary["only_b"] == 0
    assert_everything_compared(data, steps=[0, 1])


def test_under_torchrun_every_rank_is_captured_and_agrees_with_the_direct_capture_and_with_tp1(runs):
    assert len(runs["tp2"]["files"]) == 2 and len(runs["tp2_direct"]["files"]) == 2
    assert "2 rank file(s)" in runs["tp2"]["stdout"]
    for ref in (runs["tp2_direct"]["path"], runs["tp1"]["path"]):
        proc = _td("diff", ref, runs["tp2"]["path"])
        assert proc.returncode == 0, (ref, proc.stdout[-3000:])
        assert "No divergence" in proc.stdout


def test_dp2_with_the_distributed_optimizer_agrees_with_tp1_its_gradient_shards_joined(runs, tmp_path):
    with CaptureFile(runs["dp2"]["files"][0]) as cap:  # this rank's part of each reduced gradient
        shards = json.loads(cap.step_attrs(0)["grad_shards"])
        assert len(shards) == 15 and any(lo == hi for lo, hi, _ in shards.values())
    report = tmp_path / "dp2.json"
    proc = _td("diff", runs["tp1"]["path"], runs["dp2"]["path"], "--json", str(report))
    assert proc.returncode == 0, proc.stdout[-3000:]
    data = json.loads(report.read_text())
    assert data["summary"]["diverged"] == 0 and data["summary"]["only_a"] == data["summary"]["only_b"] == 0
    grads = [r for r in data["rows"] if r["phase"] == "param_grad" and r["kind"] == "grad" and not r["stand_in"]]
    assert len(grads) == 30 and all(r["verdict"] == "ok" for r in grads)  # 15 parameters, 2 steps, all compared


def test_pp2_every_stage_captured_through_the_pipeline_schedule_agrees_with_tp1(runs, tmp_path):
    assert len(runs["pp2"]["files"]) == 2 and "2 rank file(s)" in runs["pp2"]["stdout"]
    with CaptureFile(runs["pp2"]["files"][1]) as last:  # the last stage holds the output layer and the loss
        assert any(r.module == "module.output_layer" for r in last.records(0))
        assert [last.step_attrs(s)["iteration"] for s in last.steps] == [1, 2]
    report = tmp_path / "pp2.json"
    proc = _td("diff", runs["tp1"]["path"], runs["pp2"]["path"], "--json", str(report))
    assert proc.returncode == 0, proc.stdout[-3000:]
    data = json.loads(report.read_text())
    summary = data["summary"]
    assert summary["diverged"] == 0 and summary["only_a"] == summary["only_b"] == 0
    assert_everything_compared(data, steps=[0, 1])


def test_a_dp_reduction_that_sums_is_found_in_the_reduction_with_its_factor(runs, tmp_path):
    report = tmp_path / "sum.json"
    proc = _td("diff", runs["tp1"]["path"], runs["dp2_sum"]["path"], "--first-divergence", "--json", str(report))
    assert proc.returncode == 1, proc.stdout[-3000:]
    data = json.loads(report.read_text())
    first = data["first_divergence"]
    assert (first["step"], first["phase"], first["kind"]) == (0, "param_grad", "grad")
    assert first["location"] == "in the data-parallel gradient reduction" and first["where"]["reduction"] is True
    assert data["hints"][0]["cause"] == "factor" and "B sums the gradients" in data["hints"][0]["title"]


def test_a_norm_epsilon_on_one_side_is_found_at_the_first_norm(runs):
    proc = _td("diff", runs["tp1"]["path"], runs["eps"]["path"], "--first-divergence")
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "Step 0, forward: module.decoder.layers.0.input_layernorm output.0" in " ".join(proc.stdout.split())


def test_runs_reads_the_loops_log_against_the_capture(runs, tmp_path):
    log = tmp_path / "train.log"
    log.write_text(runs["tp1"]["stdout"])
    report = tmp_path / "runs.json"
    proc = _td("runs", str(log), runs["tp1"]["path"], "--json", str(report))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(report.read_text())
    with CaptureFile(runs["tp1"]["path"]) as cap:
        captured = sorted(cap.scalars()["loss"])
    # the log's iterations and the capture's steps line up: every captured loss is compared with the log's
    assert data["common_steps"] == len(captured) >= 2, data


def test_megatron_on_a_program_that_is_not_megatron_is_one_line_exit_2(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text("import torch\nm = torch.nn.Linear(4, 4)\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
                      "for _ in range(2):\n    m(torch.randn(2, 4)).sum().backward()\n    opt.step()\n")
    proc = _td("capture", "--megatron", "-o", str(tmp_path / "x.h5"), "--", sys.executable, str(script))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--megatron saw no megatron-core training step" in lines[0], proc.stderr
    assert "plain.py" in lines[0] and "--auto" in lines[0]


@pytest.mark.parametrize("cmd, says", [
    (["bash", "train.sh"], "--megatron: bash is not a python command"),
    (["torchrun", "--nproc-per-node", "2"], "names no training script"),
    (["torchrun", "--no-python", "train"], "--no-python runs a program that is not Python"),
])
def test_a_launch_command_megatron_cannot_run_is_one_line_exit_2(tmp_path, cmd, says):
    proc = _td("capture", "--megatron", "-o", str(tmp_path / "x.h5"), "--", *cmd)
    assert proc.returncode == 2 and says in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_auto_and_megatron_together_are_refused(tmp_path):
    proc = _td("capture", "--megatron", "--auto", "-o", str(tmp_path / "x.h5"), "--", sys.executable, LOOP)
    assert proc.returncode == 2 and "choose one" in proc.stderr


def test_the_command_is_rewritten_for_every_worker():
    from tensordiff.capturing.launch import megatron_command

    assert megatron_command(["torchrun", "--nproc-per-node", "2", "--master-port=1234", "pretrain_gpt.py", "--bf16"]) \
        == ["torchrun", "--nproc-per-node", "2", "--master-port=1234", "-m", "tensordiff.capturing.megatron_main",
            "pretrain_gpt.py", "--bf16"]
    assert megatron_command(["python3", "-m", "torch.distributed.run", "--standalone", "-m", "pkg.train", "--x"]) \
        == ["python3", "-m", "torch.distributed.run", "--standalone", "-m", "tensordiff.capturing.megatron_main",
            "-m", "pkg.train", "--x"]
    assert megatron_command(["python", "-u", "pretrain_gpt.py", "--bf16"]) \
        == ["python", "-u", "-m", "tensordiff.capturing.megatron_main", "pretrain_gpt.py", "--bf16"]


def test_every_wrapper_is_taken_away_when_the_capture_closes(tmp_path, monkeypatch):
    import megatron.core.optimizer as optimizer_mod
    import megatron.core.pipeline_parallel as pp
    import megatron.core.pipeline_parallel.schedules as schedules

    from tensordiff.capturing.megatron import MegatronCapture

    before = (schedules.get_forward_backward_func, pp.get_forward_backward_func,
              optimizer_mod.get_megatron_optimizer)
    monkeypatch.setenv("TENSORDIFF_OUTPUT", str(tmp_path / "x.h5"))
    monkeypatch.setenv("TENSORDIFF_STATUS", str(tmp_path / "status"))
    cap = MegatronCapture()
    assert cap.install()
    assert schedules.get_forward_backward_func is not before[0] and pp.get_forward_backward_func is not before[1]
    assert optimizer_mod.get_megatron_optimizer is not before[2]
    cap.close(finished=True)
    assert (schedules.get_forward_backward_func, pp.get_forward_backward_func,
            optimizer_mod.get_megatron_optimizer) == before
    assert "saw no megatron-core training step" in (tmp_path / "status").read_text()


MEGATRON_LM = os.environ.get("MEGATRON_LM")


@pytest.mark.skipif(not MEGATRON_LM or not os.path.exists(os.path.join(MEGATRON_LM or "", "pretrain_gpt.py")),
                    reason="MEGATRON_LM (a Megatron-LM checkout, tag core_v0.16.1) not set")
@pytest.mark.skipif(not shutil.which("nvidia-smi"), reason="pretrain_gpt.py needs a CUDA GPU")
def test_pretrain_gpt_is_captured_unedited_agrees_with_a_rerun_and_finds_a_norm_epsilon(tmp_path):
    proc = subprocess.run(["bash", os.path.join(ROOT, "examples", "megatron_lm", "pretrain_gpt.sh"), str(tmp_path)],
                          capture_output=True, text=True, env=dict(_env(), PYTHON=sys.executable), timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "diff ref rerun: exit 0" in proc.stdout
    assert "diff ref eps: exit 1" in proc.stdout and "input_layernorm" in proc.stdout
