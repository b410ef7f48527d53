"""What ``tensordiff diff`` shows as a user sees it: on a pseudo-terminal of 80 columns and through a pipe (make, CI,
``| less``), with module names longer than a narrow column (megatron's own are).

- A pipe with no ``COLUMNS``: every name whole on its line; prose wraps at ``theme.READING``.
- A terminal, or ``COLUMNS``: no line wider than it; a name breaks only after a dot, never inside a word.
- Progress: drawn on a terminal (stderr) for work longer than ``TENSORDIFF_PROGRESS_DELAY``, never with ``--quiet``,
  never into a pipe; the report is the same with or without it.

Goldens: ``width_pipe.txt``, ``width_terminal_80.txt`` (TENSORDIFF_UPDATE_GOLDENS=1 rewrites them).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from helpers import check_golden, on_terminal, plain, write_capture
from test_golden import _batch, _init, toy_step

from tensordiff.report.theme import READING

PREFIX = "language_model.encoder.decoder.layers.11.self_attention.core_attention_block."
TD = [sys.executable, "-m", "tensordiff"]


def _long_run(path: str, framework: str = "torch", **knobs) -> list[str]:
    """The golden toy MLP with megatron-length module names; returns the labels of its records."""
    recs, _, loss = toy_step(_init(), _batch(1), **knobs)
    for r in recs:
        r.module = PREFIX + r.module if r.module else r.module
        r.parent = PREFIX + r.parent if r.parent else r.parent
    write_capture(path, [recs], framework=framework, losses=[loss], model_class="ToyMLP")
    return sorted({r.module for r in recs if r.module and r.phase != "loss"})


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """a.h5, b.h5 (B: the tanh GELU, so the diff diverges) in a folder, and the module names."""
    folder = tmp_path_factory.mktemp("width")
    names = _long_run(str(folder / "a.h5"))
    _long_run(str(folder / "b.h5"), framework="mindspore", gelu_tanh=True)
    return str(folder), names


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "TENSORDIFF_QUIET")}
    env.update(extra)
    return env


def _piped(folder: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(TD + ["diff", "a.h5", "b.h5", *args], cwd=folder, env=_env(**env), capture_output=True,
                          text=True, timeout=300)


def _cut_words(text: str, names: list[str]) -> list[str]:
    """Words of ``text`` that are a piece of a module name but not whole dot-separated parts of it (a name folded
    inside a word)."""
    parts = {p for n in names for p in n.split(".")}
    bad = []
    for word in text.split():
        core = word.strip(".,:;'\"()")
        if not re.fullmatch(r"[\w.]*[._][\w.]*", core) or not any(core in n for n in names):
            continue  # not a piece of a dotted name
        if not all(p in parts for p in core.strip(".").split(".")):
            bad.append(word)
    return bad


def test_pipe_keeps_every_name_whole(pair):
    folder, names = pair
    done = _piped(folder, "--first-divergence", "--max-rows", "0", "--no-color")
    assert done.returncode == 1, done.stderr
    lines = done.stdout.splitlines()
    for name in names:  # each module's records: the whole name at the start of a row's name cell
        assert any(f" {name} " in line for line in lines), name
    assert _cut_words(done.stdout, names) == []
    assert max(map(len, lines)) > 100  # the table took the width its names need
    panel = [line for line in lines if line.startswith(("╭", "│", "╰"))]
    assert panel and max(map(len, panel)) <= READING  # prose wraps at the reading width
    assert done.stderr == ""  # no progress bar into a pipe
    check_golden("width_pipe.txt", done.stdout)


def test_columns_is_the_width_of_a_pipe(pair):
    folder, names = pair
    done = _piped(folder, "--max-rows", "0", "--no-color", COLUMNS="90")
    assert done.returncode == 1
    assert max(map(len, done.stdout.splitlines())) <= 90
    assert _cut_words(done.stdout, names) == []


def test_terminal_breaks_names_after_a_dot_only(pair):
    folder, names = pair
    code, raw = on_terminal(TD + ["diff", "a.h5", "b.h5", "--first-divergence", "--max-rows", "0", "--no-color"], 80,
                            cwd=folder, env=_env(TENSORDIFF_PROGRESS_DELAY="1000"))
    text = plain(raw)
    assert code == 1, text
    assert max(map(len, text.splitlines())) <= 80
    assert _cut_words(text, names) == []
    # names longer than their column, broken after a dot
    assert any(re.search(r"[a-z_]\.$", line.rstrip()) for line in text.splitlines())
    check_golden("width_terminal_80.txt", text)


def test_progress_on_a_terminal_only(pair):
    folder, _ = pair
    args = TD + ["diff", "a.h5", "b.h5", "--max-rows", "3", "--no-color"]
    code, raw = on_terminal(args, 100, cwd=folder, env=_env(TENSORDIFF_PROGRESS_DELAY="0"))
    assert code == 1
    assert "comparing" in raw and "tensor pairs" in raw and "\x1b[" in raw  # drawn, then erased (cursor moves)
    code_q, raw_q = on_terminal(args + ["--quiet"], 100, cwd=folder, env=_env(TENSORDIFF_PROGRESS_DELAY="0"))
    assert code_q == 1 and "comparing" not in raw_q
    piped = _piped(folder, "--max-rows", "3", "--no-color", TENSORDIFF_PROGRESS_DELAY="0", COLUMNS="100")
    assert "comparing" not in piped.stderr
    # the report itself is the same with or without the bar
    report = plain(raw_q).splitlines()
    assert report == piped.stdout.splitlines()
