"""The command line's one error handler: bad input is one line and exit 2; so is a bug, with the traceback on request."""

from __future__ import annotations

import pytest

from tensordiff import cli
from tensordiff.cli import inspect


def test_a_missing_capture_is_one_line_naming_the_file(tmp_path, capsys):
    assert cli.main(["ls", str(tmp_path / "nope.h5")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"tensordiff: error: {tmp_path / 'nope.h5'}: no such file")


def test_a_malformed_var_is_one_line_with_an_example(tmp_path, capsys):
    assert cli.main(["diff", "a.h5", "b.h5", "--var", "heads"]) == 2
    assert capsys.readouterr().err == "tensordiff: error: --var 'heads': expected NAME=VALUE, e.g. --var heads=12\n"


def test_a_bug_is_one_line_its_own_exit_code_and_the_traceback_only_on_request(monkeypatch, capsys):
    def broken(args):
        raise RuntimeError("index out of step\nsecond line")

    monkeypatch.setattr(inspect, "run_ls", broken)
    assert cli.main(["ls", "x.h5"]) == cli.EXIT_INTERNAL == 4  # never 1 (diverged), 2 (bad input) or 0
    err = capsys.readouterr().err
    assert err == ("tensordiff: internal error in ls: RuntimeError: index out of step; please report it "
                   "(tensordiff --debug ls ... shows the traceback; exit code 4)\n")
    assert cli.main(["--debug", "ls", "x.h5"]) == 4
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.endswith("exit code 4)\n")
    monkeypatch.setenv("TENSORDIFF_DEBUG", "1")
    assert cli.main(["ls", "x.h5"]) == 4
    assert "Traceback (most recent call last)" in capsys.readouterr().err


def test_a_capture_file_is_never_run_as_a_command(tmp_path, capsys, monkeypatch):
    """noise and capture run a program only after '--': a capture named where a command could go is refused."""
    monkeypatch.chdir(tmp_path)  # where the file would leave its mark, had it run
    run = tmp_path / "run.h5"
    run.write_text("#!/bin/sh\ntouch ran\n")
    run.chmod(0o755)
    assert cli.main(["noise", "-o", str(tmp_path / "n.json"), str(run)]) == 2
    assert "got 1 file(s)" in capsys.readouterr().err
    assert cli.main(["capture", "-o", str(tmp_path / "c.h5"), str(run)]) == 2
    assert "put the training command after '--'" in capsys.readouterr().err
    assert not (tmp_path / "ran").exists()
    # the files first, options after them: still two captures, read as such
    assert cli.main(["noise", str(run), str(run), "-o", str(tmp_path / "n.json")]) == 2
    assert capsys.readouterr().err.startswith(f"tensordiff: error: {run}: not a readable HDF5 file")
    assert not (tmp_path / "ran").exists() and not (tmp_path / "n.json").exists()


def test_every_command_has_a_runner():
    parser = cli.parser()
    commands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert sorted(commands) == ["batch", "capture", "check", "ckpt", "config", "diff", "locate", "ls", "map", "merge",
                               "noise", "replay", "runs", "show"]
    for name, sub in commands.items():
        assert callable(sub.get_default("run")), name


@pytest.mark.parametrize("argv", [["diff", "--help"], ["ckpt", "diff", "--help"], ["runs", "--help"]])
def test_help_exits_zero(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 0
    assert "usage: tensordiff" in capsys.readouterr().out


def test_ls_records_lists_one_record_per_line_for_grep(tmp_path, capsys):
    import numpy as np
    from helpers import T, write_capture

    x = np.ones((2, 3), dtype=np.float32)
    path = write_capture(str(tmp_path / "r.h5"), [[
        T("weights", "decoder.layers.0.mlp.linear_fc1", "param", "weight", x, module_class="Linear"),
        T("forward", "decoder.layers.0.mlp.linear_fc1", "input", "0", x, enter=1),
        T("forward", "decoder.layers.0.mlp.linear_fc1", "output", "0", x, enter=1)]])
    assert cli.main(["ls", path, "--records"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "weights    decoder.layers.0.mlp.linear_fc1 weight  float32 2×3",
        "forward    decoder.layers.0.mlp.linear_fc1 input.0  float32 2×3",
        "forward    decoder.layers.0.mlp.linear_fc1 output.0  float32 2×3",
    ]
    assert cli.main(["ls", path, "--records", "--phase", "forward", "--step", "0"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2
    assert cli.main(["ls", path, "--records", "--step", "4"]) == 2
    assert capsys.readouterr().err == f"tensordiff: error: {path}: no step 4; steps are [0]\n"


def test_a_closed_pipe_ends_quietly(tmp_path):
    import os
    import subprocess
    import sys

    import numpy as np
    from helpers import T, write_capture

    x = np.ones(3, dtype=np.float32)
    path = write_capture(str(tmp_path / "p.h5"), [[T("forward", f"m{i}", "output", "0", x) for i in range(5000)]])
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(f"{sys.executable} -m tensordiff ls {path} --records | head -1", shell=True,
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=root))
    assert proc.stdout == "forward    m0 output.0  float32 3\n"
    assert proc.stderr == ""


def test_an_output_path_that_cannot_be_written_is_bad_input(tmp_path, capsys):
    """A folder given as a file, a file in a folder that does not exist: one line naming the path, exit 2."""
    log = tmp_path / "a.log"
    log.write_text("".join(f" iteration {i:8d}/ 30 | lm loss: {3 - i / 100:.6E} |\n" for i in range(1, 31)))
    assert cli.main(["runs", str(tmp_path), str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"tensordiff: error: {tmp_path}: Is a directory; check the path (a file, in a "
                                       "folder that exists and can be written)\n")
    missing = tmp_path / "no" / "r.json"
    assert cli.main(["runs", str(log), str(log), "--json", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(missing) in err and "Traceback" not in err


@pytest.mark.parametrize(("flag", "message"), [
    (["--rtol", "-1"], "--rtol -1.0: must be a finite number >= 0"),
    (["--rtol", "nan"], "--rtol nan: must be a finite number >= 0"),
    (["--reference-factor", "-1"], "--reference-factor -1.0: must be a finite number > 0"),
    (["--noise-factor", "inf"], "--noise-factor inf: must be a finite number > 0"),
    (["--step", "-1"], "--step -1: must be >= 0"),
])
def test_a_diff_option_that_would_make_the_verdict_meaningless_is_refused(capsys, flag, message):
    assert cli.main(["diff", "a.h5", "b.h5", *flag]) == 2  # refused before any file is read
    assert capsys.readouterr().err == f"tensordiff: error: {message}\n"


def test_an_unknown_phase_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["diff", "a.h5", "b.h5", "--phase", "nope"])
    assert exc.value.code == 2 and "invalid choice: 'nope'" in capsys.readouterr().err


def test_ckpt_diff_sides_with_no_table_to_apply_them_to_is_refused(tmp_path, capsys):
    pytest.importorskip("safetensors")  # the files it compares (the core environment has no checkpoint readers)
    import numpy as np

    from tensordiff.ckpt.files import save

    a, b = str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")
    for path in (a, b):
        save({"w": np.ones((2, 3), np.float32)}, path)
    assert cli.main(["ckpt", "diff", a, b]) == 0  # the same names, compared as they are
    capsys.readouterr()
    assert cli.main(["ckpt", "diff", a, b, "--sides", "a,b"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tensordiff: error: --sides a,b: no conversion table applies") and err.count("\n") == 1


def _capture(tmp_path):
    import numpy as np
    from helpers import T, write_capture

    w = np.ones((2, 2), np.float32)
    return write_capture(str(tmp_path / "c.h5"), [[T("weights", "fc", "param", "weight", w),
                                                     T("forward", "fc", "output", "0", w)]])


@pytest.mark.parametrize(("name", "text", "fragment"), [
    ("mapping", "rules:\n  - {b: x, a: y, params: 'x'}\n", "'params:' maps names to transforms"),
    ("mapping", "rules: 5\n", "rules: must be a list of rules"),
    ("mapping", "strip_b: 5\nrules: []\n", "the prefixes to strip are a list of text"),
    ("noise", '{"tensordiff_noise": 1, "records": [["forward", "fc", "zero", "output", "0", 1e-6]]}',
     "record 0 is not [phase, module, call, kind, slot, rel_l2]"),
    ("noise", '{"tensordiff_noise": null, "records": []}', "tensordiff_noise is None, not a format number"),
    ("noise", '{"tensordiff_noise": "x", "records": []}', "tensordiff_noise is 'x', not a format number"),
])
def test_a_file_with_a_value_of_the_wrong_type_is_one_line_and_exit_2(tmp_path, capsys, name, text, fragment):
    cap = _capture(tmp_path)
    path = tmp_path / ("m.yaml" if name == "mapping" else "n.json")
    path.write_text(text)
    option = "--mapping" if name == "mapping" else "--noise-file"
    assert cli.main(["diff", cap, cap, option, str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"tensordiff: error: {path}: ") and fragment in err, err


def test_an_output_in_a_folder_that_does_not_exist_is_refused_before_anything_runs(tmp_path, capsys):
    out = tmp_path / "missing" / "dir" / "batch.h5"
    assert cli.main(["batch", "-o", str(out), "--vocab", "100", "--seq", "8", "--batch", "1"]) == 2
    assert capsys.readouterr().err == (f"tensordiff: error: {out}: the folder {out.parent} does not exist; create it "
                                       f"(mkdir -p {out.parent}) or write the file elsewhere\n")
    assert not out.parent.exists()
