"""The command line as a user meets it: exit codes, one-line errors, JSON, capture of a script."""

import json
import os
import subprocess
import sys
import textwrap

import h5py
import pytest
import torch

import tensordiff
from tensordiff.cli import main

SCRIPT = textwrap.dedent(
    """
    import sys, torch, tensordiff
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.{act}(), torch.nn.Linear(6, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tensordiff.capture(model, optimizer=opt) as cap:
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            loss = model(torch.randn(5, 6, generator=g)).square().mean()
            loss.backward(); opt.step(); opt.zero_grad()
            cap.step(loss)
    """
)


def _capture(tmp_path, name, act="Tanh", steps=2):
    script = tmp_path / f"{name}.py"
    script.write_text(SCRIPT.format(act=act))
    out = tmp_path / f"{name}.h5"
    proc = subprocess.run([sys.executable, "-m", "tensordiff", "capture", "-o", str(out), "--steps", str(steps), "--",
                           sys.executable, str(script)], capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=_root()))
    assert proc.returncode == 0, proc.stderr
    assert "wrote" in proc.stdout
    return str(out)


def _root():
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    return _capture(tmp, "a"), _capture(tmp, "b"), _capture(tmp, "c", act="Sigmoid"), tmp


def test_capture_command_writes_the_requested_steps(pair):
    from tensordiff.store import CaptureFile

    with CaptureFile(pair[0]) as cap:
        assert cap.steps == [0, 1]
        assert cap.attrs["framework"] == "torch"


def test_diff_identical_runs_exits_0(pair, capsys):
    assert main(["diff", pair[0], pair[1], "--width", "80"]) == 0
    assert "No divergence" in capsys.readouterr().out


def test_diff_divergent_runs_exits_1_and_writes_json(pair, tmp_path, capsys):
    report = tmp_path / "r.json"
    assert main(["diff", pair[0], pair[2], "--first-divergence", "--json", str(report), "--width", "80"]) == 1
    out = capsys.readouterr().out
    assert "First divergence" in out
    data = json.loads(report.read_text())
    first = data["first_divergence"]
    assert {"step", "phase", "module_a", "module_b"} <= set(first)
    # Sequential: 0 Linear, 1 activation, 2 Linear; the activation changed
    assert (first["step"], first["phase"], first["module_a"], first["module_b"]) == (0, "forward", "1", "1")
    assert data["summary"]["diverged"] > 0


def test_json_first_divergence_is_null_without_divergence(pair, tmp_path):
    report = tmp_path / "ok.json"
    assert main(["diff", pair[0], pair[1], "--json", str(report)]) == 0
    assert json.loads(report.read_text())["first_divergence"] is None


def test_table_fits_80_columns_without_colour(pair, capsys):
    main(["diff", pair[0], pair[2], "--width", "80", "--max-rows", "0"])
    out = capsys.readouterr().out
    assert "\x1b[" not in out
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "FIRST" in out and "DIVERGED" in out


def _one_line_error(capsys, argv, *needles):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err
    return err


def test_missing_file(pair, capsys):
    _one_line_error(capsys, ["diff", pair[0], "/nonexistent/x.h5"], "/nonexistent/x.h5", "no such file")


def test_truncated_file(pair, tmp_path, capsys):
    with open(pair[0], "rb") as fh:
        data = fh.read()
    bad = tmp_path / "trunc.h5"
    bad.write_bytes(data[: len(data) // 3])
    _one_line_error(capsys, ["diff", pair[0], str(bad)], str(bad), "truncated")


def test_not_a_capture(pair, tmp_path, capsys):
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f["x"] = [1, 2, 3]
    _one_line_error(capsys, ["diff", str(other), pair[0]], str(other), "not a tensordiff capture")
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    _one_line_error(capsys, ["ls", str(text)], str(text), "not a readable HDF5 file")


def test_no_module_in_common(pair, tmp_path, capsys):
    class Other(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(6, 2)

        def forward(self, x):
            return self.proj(x)

    model = Other()
    path = str(tmp_path / "other.h5")
    with tensordiff.capture(model, path, steps=1) as cap:
        model(torch.randn(2, 6)).sum().backward()
        cap.step()
    _one_line_error(capsys, ["diff", pair[0], path, "--no-order"], "no module in common", "--mapping")


def test_bad_mapping_file(pair, tmp_path, capsys):
    bad = tmp_path / "m.yaml"
    bad.write_text("rules:\n  - b: 'x('\n    a: y\n")
    _one_line_error(capsys, ["diff", pair[0], pair[1], "--mapping", str(bad)], str(bad), "bad regular expression")


def test_capture_of_a_program_that_never_starts_capture(tmp_path, capsys):
    script = tmp_path / "plain.py"
    script.write_text("print('training without tensordiff')\n")
    _one_line_error(capsys, ["capture", "-o", str(tmp_path / "x.h5"), "--", sys.executable, str(script)],
                    "wrote no capture", "tensordiff.capture")


def test_ls_and_show(pair, capsys):
    assert main(["ls", pair[0]]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "weights" in out
    assert main(["show", pair[0], "2", "--phase", "param_grad", "--width", "120"]) == 0
    out = capsys.readouterr().out
    assert "grad weight" in out and "grad bias" in out
    _one_line_error(capsys, ["show", pair[0], "nomodule"], "no record matches")


def test_autocapture_hook_captures_an_unmodified_script(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text(textwrap.dedent(
        """
        import torch
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(4):
            loss = model(torch.randn(5, 6)).square().mean()
            loss.backward(); opt.step(); opt.zero_grad()
        assert not model[0]._forward_hooks, "hooks left behind"
        assert not torch.nn.modules.module._global_forward_pre_hooks, "global hook left behind"
        """))
    out = tmp_path / "auto.h5"
    proc = subprocess.run([sys.executable, "-m", "tensordiff", "capture", "-o", str(out), "--steps", "2", "--",
                           sys.executable, os.path.join(_root(), "hooks", "torch_autocapture.py"), str(script)],
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=_root()))
    assert proc.returncode == 0, proc.stderr
    from tensordiff.store import CaptureFile

    with CaptureFile(str(out)) as cap:
        assert cap.steps == [0, 1]
        recs = cap.records(0)
        assert {r.module for r in recs if r.phase == "param_grad"} == {"0", "2"}
        assert [r.module for r in recs if r.phase == "forward" and r.kind == "output"] == ["0", "1", "2", ""]
