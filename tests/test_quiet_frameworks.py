"""Under ``tensordiff capture`` the frameworks' start-up chatter is left out (``tensordiff/capturing/startup``):
MindFormers' INFO lines on stdout but its callbacks' (a step's loss; its log files keep them all), megatron-core's
notices that Transformer Engine or Apex are not installed. Everything else is as without tensordiff: warnings,
MindFormers' warnings, another ``sitecustomize`` on the path. ``--framework-logs`` (or
``TENSORDIFF_FRAMEWORK_LOGS=1``) keeps it all."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tensordiff.capturing.startup import FOLDER

pytest.importorskip("mindformers")

PROGRAM = """
import warnings
warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.", UserWarning)
warnings.warn("some other warning", UserWarning)
from mindformers.tools.logger import logger
logger.info("hello-info")
logger.warning("hello-warning")
import sys
sys.path.insert(0, "hooks")
from callback.monitor import report  # a callback's INFO line (as MindFormers' MFLossMonitor logs a step's loss)
report()
"""
CALLBACK = """from mindformers.tools.logger import logger

def report():
    logger.info("{ Epoch:[  1/  1], step:[    1/    1], loss: 4.5")
"""


def _run(tmp_path, *, framework_logs: bool) -> subprocess.CompletedProcess:
    user_site = tmp_path / "user_site"  # the user's own sitecustomize, shadowed by ours: it must still run
    user_site.mkdir(exist_ok=True)
    (user_site / "sitecustomize.py").write_text("print('user sitecustomize ran')\n")
    (tmp_path / "hooks" / "callback").mkdir(parents=True, exist_ok=True)
    (tmp_path / "hooks" / "callback" / "monitor.py").write_text(CALLBACK)
    env = {k: v for k, v in os.environ.items() if k not in ("TENSORDIFF_FRAMEWORK_LOGS", "LOG_MF_PATH")}
    env["PYTHONPATH"] = os.pathsep.join([FOLDER, str(user_site)])
    if framework_logs:
        env["TENSORDIFF_FRAMEWORK_LOGS"] = "1"
    return subprocess.run([sys.executable, "-c", PROGRAM], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)


def test_startup_quiets_mindformers_info_and_missing_accelerator_notices(tmp_path):
    done = _run(tmp_path, framework_logs=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "hello-info" not in done.stdout and "hello-warning" in done.stdout
    assert "{ Epoch:[  1/  1], step:[    1/    1], loss: 4.5" in done.stdout  # the run's progress stays
    assert "not installed" not in done.stderr and "some other warning" in done.stderr
    assert "user sitecustomize ran" in done.stdout
    with open(tmp_path / "output" / "log" / "rank_0" / "info.log", encoding="utf-8") as fh:
        assert "hello-info" in fh.read()  # MindFormers' own log keeps every line


def test_framework_logs_keeps_everything(tmp_path):
    done = _run(tmp_path, framework_logs=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "hello-info" in done.stdout and "hello-warning" in done.stdout
    assert "Transformer Engine and Apex are not installed" in done.stderr
    assert "user sitecustomize ran" in done.stdout


@pytest.mark.parametrize("flag", [[], ["--framework-logs"]])
def test_capture_runs_the_program_with_the_startup_folder(tmp_path, flag):
    probe = ("import os, sys; m = sys.modules.get('sitecustomize'); print('startup:', getattr(m, '__file__', None)); "
             "print('megatron:', os.environ.get('MEGATRON_LOGGING_LEVEL'))")
    env = {k: v for k, v in os.environ.items() if k not in ("TENSORDIFF_FRAMEWORK_LOGS", "MEGATRON_LOGGING_LEVEL")}
    done = subprocess.run([sys.executable, "-m", "tensordiff", "capture", *flag, "-o", "x.h5", "--", sys.executable,
                           "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "wrote no capture" in done.stderr  # the probe captures nothing: said, exit 2
    line = next(line for line in done.stdout.splitlines() if line.startswith("startup:"))
    level = next(line for line in done.stdout.splitlines() if line.startswith("megatron:"))
    if flag:
        assert FOLDER not in line and level == "megatron: None"
    else:
        assert line == f"startup: {os.path.join(FOLDER, 'sitecustomize.py')}"
        assert level == "megatron: 30"  # Megatron-LM's setup_logging reads it with int(): WARNING
