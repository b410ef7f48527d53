"""`tensordiff capture --auto`: a plain PyTorch script (tests/scripts/plain_gpt.py, which never imports tensordiff)
recorded step by step, training steps only, every hook gone after the last one. Real torch, no mocks."""

import gc
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.modules.module as torch_module
import torch.optim.optimizer as torch_optimizer

from tensordiff.capturing import auto_main
from tensordiff.capturing.auto import AutoCapture
from tensordiff.capturing.launch import auto_command
from tensordiff.cli import main
from tensordiff.errors import UsageError
from tensordiff.store import CaptureFile

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
SCRIPTS = os.path.join(TESTS, "scripts")
SCRIPT = os.path.join(SCRIPTS, "plain_gpt.py")
ENTRY = "tensordiff.capturing.auto_main"


def _global_hooks():
    """Sizes of torch's global hook tables: what a capture may add and must take away."""
    return {name: len(table) for name, table in [
        ("forward_pre", torch_module._global_forward_pre_hooks), ("forward", torch_module._global_forward_hooks),
        ("forward_always", torch_module._global_forward_hooks_always_called),
        ("forward_kwargs", torch_module._global_forward_hooks_with_kwargs),
        ("optimizer_pre", torch_optimizer._global_optimizer_pre_hooks),
        ("optimizer_post", torch_optimizer._global_optimizer_post_hooks)]}


def _module_hooks(model):
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()) + \
        sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three `tensordiff capture --auto` runs of the plain script, side by side: clean, clean again, GELU tanh.
    Evaluation at every iteration: before step 0 (the model is not known yet) and between the captured steps."""
    tmp = tmp_path_factory.mktemp("auto")
    env = dict(os.environ, PYTHONPATH=ROOT, NO_COLOR="1")
    for name in ("TENSORDIFF_OUTPUT", "TENSORDIFF_STEPS", "TENSORDIFF_TENSORS", "TENSORDIFF_DISABLE"):
        env.pop(name, None)
    jobs = {}
    for name, extra in (("a", []), ("b", []), ("tanh", ["--gelu", "tanh"])):
        out = str(tmp / f"{name}.h5")
        cmd = [sys.executable, "-m", "tensordiff", "capture", "--auto", "-o", out, "--steps", "2", "--",
               sys.executable, SCRIPT, "--iters", "4", "--eval-every", "1", *extra]
        jobs[name] = (out, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    done = {}
    for name, (out, proc) in jobs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr
        done[name] = {"path": out, "stdout": stdout, "stderr": stderr}
    done["tmp"] = tmp
    return done


def _auto_in_process(monkeypatch, out, argv, steps=2):
    """Run the packaged entry point in this process, as `tensordiff capture --auto` would in a child.
    (A fresh program has no recorder of its own; here one abandoned by an earlier test may wait for the collector.)"""
    gc.collect()
    monkeypatch.setenv("TENSORDIFF_OUTPUT", str(out))
    monkeypatch.setenv("TENSORDIFF_STEPS", str(steps))
    auto_main.main(argv)


def _layout(path, step):
    with CaptureFile(path) as cap:
        return [(r.phase, r.module, r.call, r.kind, r.slot, r.shape) for r in cap.records(step)]


def test_two_auto_captures_of_the_same_script_and_seed_diff_with_exit_code_0(runs, capsys):
    assert "tensordiff: wrote" in runs["a"]["stdout"] and "2 step(s)" in runs["a"]["stdout"]
    assert main(["diff", runs["a"]["path"], runs["b"]["path"]]) == 0
    assert "No divergence" in capsys.readouterr().out


def test_step_0_and_step_1_hold_the_same_forward_records_and_none_of_the_evaluation_calls(runs):
    forward = [[rec for rec in _layout(runs["a"]["path"], step) if rec[0] == "forward"] for step in (0, 1)]
    assert len(forward[0]) == len(forward[1]) == 52
    assert forward[0] == forward[1]
    # the script evaluates (eval_iters=2) before step 0 and between steps 0 and 1: none of it is a second call
    assert {rec[2] for rec in forward[0]} == {0}
    # the model's keyword argument (targets=) is recorded in step 0 too, not only from step 1 on
    assert ("forward", "", 0, "input", "targets", (4, 16)) in forward[0]
    assert "4 evaluation call(s) skipped" in runs["a"]["stderr"]


def test_the_steps_of_a_script_that_evaluates_match_the_same_script_that_never_does(runs, monkeypatch, capsys):
    never = runs["tmp"] / "never.h5"
    monkeypatch.syspath_prepend(SCRIPTS)
    _auto_in_process(monkeypatch, never, ["-m", "plain_gpt", "--eval-every", "0", "--iters", "3"])
    assert "val loss" not in capsys.readouterr().out
    for step in (0, 1):
        assert _layout(runs["a"]["path"], step) == _layout(str(never), step)
    assert main(["diff", runs["a"]["path"], str(never)]) == 0


def test_the_loss_the_model_returns_is_the_steps_loss(runs):
    printed = [float(line.split()[-1]) for line in runs["a"]["stdout"].splitlines() if ": loss " in line]
    with CaptureFile(runs["a"]["path"]) as cap:
        for step in (0, 1):
            assert cap.step_attrs(step)["loss"] == pytest.approx(printed[step], abs=5e-5)
            assert [r.module for r in cap.records(step) if r.phase == "loss"] == ["loss"]


def test_the_gelu_tanh_fault_is_first_found_in_forward_at_the_mlp_activation_with_the_activation_hint(runs, tmp_path):
    report = tmp_path / "r.json"
    assert main(["diff", runs["a"]["path"], runs["tanh"]["path"], "--json", str(report)]) == 1
    data = json.loads(report.read_text())
    first = data["first_divergence"]
    assert (first["step"], first["phase"], first["module_a"], first["module_b"], first["kind"]) == \
        (0, "forward", "blocks.0.mlp.act", "blocks.0.mlp.act", "output")
    assert first["location"] == "in blocks.0.mlp.act"
    assert data["hints"][0]["cause"] == "activation"
    assert "tanh" in data["hints"][0]["title"]


def test_auto_with_a_command_that_is_not_python_is_one_error_line_and_exit_2(tmp_path, capsys):
    for cmd, needle in ((["bash", "train.sh"], "bash is not a python command"),
                        ([sys.executable, "-c", "print(1)"], "python -c CODE")):
        assert main(["capture", "--auto", "-o", str(tmp_path / "x.h5"), "--", *cmd]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert needle in err
    assert not (tmp_path / "x.h5").exists()


@pytest.mark.parametrize("cmd, expected", [
    (["python", "train.py", "--lr", "1"], ["python", "-m", ENTRY, "train.py", "--lr", "1"]),
    (["python3", "-u", "train.py"], ["python3", "-u", "-m", ENTRY, "train.py"]),
    (["/opt/venv/bin/python3.11", "-W", "ignore", "t.py", "-m", "x"],
     ["/opt/venv/bin/python3.11", "-W", "ignore", "-m", ENTRY, "t.py", "-m", "x"]),
    (["python", "-m", "pkg.train", "--steps", "9"], ["python", "-m", ENTRY, "-m", "pkg.train", "--steps", "9"]),
    (["python", "-um", "pkg.train"], ["python", "-u", "-m", ENTRY, "-m", "pkg.train"]),
])
def test_auto_runs_python_python3_a_path_to_python_and_dash_m_through_the_packaged_entry_point(cmd, expected):
    assert auto_command(cmd) == expected


@pytest.mark.parametrize("cmd", [["torchrun", "train.py"], ["python"], ["python", "-m"], ["python", "--version"]])
def test_auto_refuses_a_command_that_runs_no_python_script(cmd):
    with pytest.raises(UsageError, match="--auto"):
        auto_command(cmd)


@pytest.mark.parametrize("launcher", ["torch.distributed.run", "torch.distributed.launch"])
def test_auto_refuses_a_torch_launcher_and_names_megatron_in_one_line(tmp_path, capsys, launcher):
    cmd = [sys.executable, "-m", launcher, "--standalone", "--nproc-per-node", "1", "train.py"]
    assert main(["capture", "--auto", "-o", str(tmp_path / "x.h5"), "--", *cmd]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"python -m {launcher}" in err and "--megatron" in err
    assert not (tmp_path / "x.h5").exists()


def test_every_hook_is_removed_right_after_the_last_captured_step(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(SCRIPTS)
    import plain_gpt

    monkeypatch.setenv("TENSORDIFF_OUTPUT", str(tmp_path / "direct.h5"))
    monkeypatch.setenv("TENSORDIFF_STEPS", "2")
    before = _global_hooks()
    torch.manual_seed(0)
    model = plain_gpt.GPT(32, 8, 16, 1, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(32, (2, 8))
    gc.collect()  # see _auto_in_process
    auto = AutoCapture()
    assert auto.install()
    assert _global_hooks() != before
    hooks_after = []
    for _ in range(3):
        model.eval()
        with torch.no_grad():
            model(x, targets=x)
        model.train()
        _, loss = model(x, targets=x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        hooks_after.append((auto.steps, _global_hooks() == before, _module_hooks(model)))
    assert hooks_after[0][0] == 1 and hooks_after[0][2] > 0  # capturing: the model's hooks are in place
    assert hooks_after[1] == (2, True, 0)  # the last captured step: everything gone at its optimizer.step()
    assert hooks_after[2] == (2, True, 0)
    auto.close()
    assert "recorded 2 training step(s) of GPT" in capsys.readouterr().err


def test_the_packaged_entry_point_leaves_no_global_hook_behind(tmp_path, monkeypatch, capsys):
    before = _global_hooks()
    _auto_in_process(monkeypatch, tmp_path / "one.h5", [SCRIPT, "--iters", "2", "--eval-every", "1"], steps=5)
    assert _global_hooks() == before
    with CaptureFile(str(tmp_path / "one.h5")) as cap:
        assert cap.steps == [0, 1]  # 5 asked for, the script trained 2: the file holds those
    assert "1 evaluation call(s)" not in capsys.readouterr().err


def test_a_capture_that_cannot_start_warns_removes_its_hooks_and_training_goes_on(tmp_path, monkeypatch, capsys):
    before = _global_hooks()
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.warns(RuntimeWarning, match="autocapture stopped"):
        _auto_in_process(monkeypatch, blocker / "x.h5", [SCRIPT, "--iters", "3", "--eval-every", "0"])
    assert capsys.readouterr().out.count(": loss ") == 3
    assert _global_hooks() == before


def test_a_program_that_only_evaluates_records_nothing_and_says_why(tmp_path, monkeypatch):
    script = tmp_path / "infer.py"
    script.write_text("import torch\nm = torch.nn.Linear(3, 3).eval()\n"
                      "with torch.no_grad():\n    m(torch.ones(2, 3))\nwith torch.inference_mode():\n    m(torch.ones(2, 3))\n")
    status = tmp_path / "status"
    monkeypatch.setenv("TENSORDIFF_STATUS", str(status))
    _auto_in_process(monkeypatch, tmp_path / "none.h5", [str(script)])
    assert not (tmp_path / "none.h5").exists()
    assert "no training step" in status.read_text() and "2 module call(s)" in status.read_text()


def test_auto_steps_aside_when_the_program_calls_tensordiff_capture_itself(tmp_path, monkeypatch, capsys):
    script = tmp_path / "own.py"
    script.write_text(
        "import torch, tensordiff\n"
        "model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "with tensordiff.capture(model, optimizer=opt) as cap:\n"
        "    for _ in range(3):\n"
        "        loss = model(torch.ones(2, 4)).sum()\n"
        "        loss.backward(); opt.step(); opt.zero_grad()\n"
        "        cap.step(loss)\n")
    before = _global_hooks()
    _auto_in_process(monkeypatch, tmp_path / "own.h5", [str(script)])
    assert "stepped aside" in capsys.readouterr().err
    assert _global_hooks() == before
    with CaptureFile(str(tmp_path / "own.h5")) as cap:  # the program's own capture, whole
        assert cap.steps == [0, 1]
        assert [r.module for r in cap.records(0) if r.phase == "loss"] == ["loss"]
