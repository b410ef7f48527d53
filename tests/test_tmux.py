"""The first hour as a user sees it, in a real terminal (tmux, 80 columns): a diff's names are never cut, and a Ctrl-C
typed during ``tensordiff capture`` stops the training program, which keeps every step it returned and says so.

Skipped where tmux is not installed.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid

import pytest

from tensordiff.store import CaptureFile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TMUX = shutil.which("tmux")
pytestmark = pytest.mark.skipif(TMUX is None, reason="tmux is not installed")


class Pane:
    """One detached tmux session of ``columns`` x 50, on its own server socket; ``run`` types a command line."""

    def __init__(self, cwd: str, columns: int = 80):
        self.socket = f"td-{uuid.uuid4().hex[:8]}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("TMUX")}
        env.pop("COLUMNS", None)
        self.env = env
        self._tmux("new-session", "-d", "-x", str(columns), "-y", "50", "-c", cwd, "bash --norc --noprofile")
        self._tmux("set-option", "-g", "history-limit", "20000")

    def _tmux(self, *args: str) -> str:
        return subprocess.run([TMUX, "-L", self.socket, *args], env=self.env, capture_output=True, text=True,
                              check=True, timeout=30).stdout

    def run(self, line: str) -> None:
        self._tmux("send-keys", "-t", "0", line, "Enter")

    def ctrl_c(self) -> None:
        self._tmux("send-keys", "-t", "0", "C-c")

    def screen(self) -> str:
        """Everything the pane shows, its scrollback included, as a user would read it (lines the terminal wrapped
        joined: the width test reads the lines as the program wrote them)."""
        return self._tmux("capture-pane", "-p", "-J", "-S", "-", "-t", "0")  # -J: a wrapped line joined

    def wait_for(self, pattern: str, timeout: float = 240) -> re.Match:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            m = re.search(pattern, self.screen())
            if m:
                return m
            time.sleep(0.2)
        raise AssertionError(f"{pattern!r} not on the screen after {timeout} s:\n{self.screen()[-3000:]}")

    def close(self) -> None:
        subprocess.run([TMUX, "-L", self.socket, "kill-server"], env=self.env, capture_output=True, timeout=30)


@pytest.fixture
def pane(tmp_path):
    p = Pane(str(tmp_path))
    try:
        yield p
    finally:
        p.close()


def test_ctrl_c_during_capture_keeps_every_returned_step(pane, tmp_path):
    py, td = shlex.quote(sys.executable), f"{shlex.quote(sys.executable)} -m tensordiff"
    train = shlex.quote(os.path.join(ROOT, "examples", "gpt", "train.py"))
    pane.run(f"export PYTHONPATH={shlex.quote(ROOT)}; {td} capture -o run.h5 --steps 200 --tensors none -- "
             f"{py} {train} --train-steps 200; echo EXIT=$?")
    pane.wait_for(r"step 6: loss")  # training is under way, steps handed to the writer
    pane.ctrl_c()
    code = int(pane.wait_for(r"EXIT=(\d+)").group(1))
    screen = pane.screen()
    assert code == 130, screen[-3000:]  # the program's own status after SIGINT, passed on
    kept = re.search(r"run\.h5 keeps (\d+) complete step\(s\)", screen)
    assert kept, screen[-3000:]
    printed = [int(s) for s in re.findall(r"^step (\d+): loss", screen, re.M)]  # steps whose step() returned
    with CaptureFile(str(tmp_path / "run.h5")) as cap:
        steps = cap.steps
    assert len(steps) == int(kept.group(1))
    assert steps == list(range(len(steps))) and len(steps) >= max(printed) + 1
    assert "Traceback" not in screen.split("step 0: loss", 1)[0]  # nothing before training said anything wrong


def test_names_whole_and_progress_in_an_80_column_terminal(pane, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "tests", "core"))
    from test_terminal import _cut_words, _long_run

    names = _long_run(str(tmp_path / "a.h5"))
    _long_run(str(tmp_path / "b.h5"), framework="mindspore", gelu_tanh=True)
    td = f"{shlex.quote(sys.executable)} -m tensordiff"
    pane.run(f"TENSORDIFF_PROGRESS_DELAY=0 {td} diff a.h5 b.h5 --first-divergence --max-rows 0; echo EXIT=$?")
    assert pane.wait_for(r"EXIT=(\d+)").group(1) == "1"
    screen = pane.screen()
    lines = screen.splitlines()[1:]  # the command typed is joined into one long line
    assert max(map(len, lines)) <= 80
    assert _cut_words(screen, names) == []
    assert "First divergence" in screen and "comparing" not in screen  # the bar was drawn and erased
