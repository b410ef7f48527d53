"""A warning from inside a training run is one line on stderr (never the source line under it), can be silenced
with Python's own filters, and never raises, not even under ``-W error``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROGRAM = ("import tensordiff\n"
           "cap = tensordiff.capture(object(), 'run.h5', steps=1)   # not a model: the capture does not start\n"
           "cap.step()\n"
           "print('training went on')\n")


@pytest.mark.parametrize(("flags", "lines"), [([], 1), (["-W", "error"], 1), (["-W", "ignore::RuntimeWarning"], 0)])
def test_a_capture_warning_is_one_line_and_never_stops_the_run(tmp_path, flags, lines):
    proc = subprocess.run([sys.executable, *flags, "-c", PROGRAM], cwd=tmp_path, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert proc.returncode == 0 and proc.stdout == "training went on\n", proc.stderr
    err = proc.stderr.splitlines()
    assert len(err) == lines, proc.stderr
    if lines:
        assert "tensordiff: capture not started (UsageError: cannot capture a builtins.object" in err[0]
        assert err[0].endswith("training goes on without it")
