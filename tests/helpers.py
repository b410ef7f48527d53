"""Test helpers shared by every layer of the suite: synthetic captures, renders at a fixed width, goldens.

Framework-free: numpy, h5py and rich only, so the core tests (tests/core/) can use them in an
environment without torch or MindSpore.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

try:
    import ml_dtypes
except ImportError:  # the core venv (make test-core) has no ml_dtypes: BF16/FP8 tests skip there
    ml_dtypes = None

#: Marks a test (or a parameter) that needs ml_dtypes arrays (BF16, FP8).
needs_ml_dtypes = pytest.mark.skipif(ml_dtypes is None, reason="needs ml_dtypes (BF16/FP8 arrays)")

#: tensordiff capture's settings handed to a program through the environment: a test's own subprocess never
#: inherits them from an outer capture
CAPTURE_ENV = ("TENSORDIFF_OUTPUT", "TENSORDIFF_STEPS", "TENSORDIFF_TENSORS", "TENSORDIFF_DISABLE", "TENSORDIFF_EVERY")


def subprocess_env(root: str) -> dict[str, str]:
    """The environment for a program a test runs: the repository importable, plain output, one thread, no capture
    settings inherited."""
    env = dict(os.environ, PYTHONPATH=root, NO_COLOR="1", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    for name in CAPTURE_ENV:
        env.pop(name, None)
    return env


GOLDEN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
#: Set (``TENSORDIFF_UPDATE_GOLDENS=1 pytest tests/core/test_golden.py`` or ``python tests/core/test_golden.py``)
#: to rewrite the golden files from the current output instead of comparing against them.
UPDATE_ENV = "TENSORDIFF_UPDATE_GOLDENS"


@dataclass
class T:
    """One tensor record of a synthetic step: what a framework adapter would have recorded."""

    phase: str
    module: str
    kind: str
    slot: str
    value: np.ndarray | None = None
    call: int = 0
    module_class: str = ""
    dtype: str = ""
    shape: tuple[int, ...] | None = None
    store: bool = True
    """store the tensor (``has_data``); statistics are always computed from ``value``."""
    same_as: int = -1
    grad_of: int = -1
    enter: int = -1
    parent: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def _stats(x: np.ndarray) -> dict[str, Any]:
    """A record's statistics, as every adapter writes them (``tensordiff.stats.host_stats``)."""
    from tensordiff.stats import host_stats

    d = np.asarray(x)
    mn, mx, total, l2, nan, inf = host_stats(d)
    return {"min": mn, "max": mx, "mean": total / d.size if d.size else 0.0, "l2": l2, "nan": int(nan), "inf": int(inf)}


def rows_of(tensors: list[T]) -> tuple[list[dict[str, Any]], dict[int, np.ndarray]]:
    """Index rows and stored tensors of one step, in the writer's format (seq = position in the list)."""
    from tensordiff import dtypes
    from tensordiff.store.format import shape_text

    rows, data = [], {}
    for seq, t in enumerate(tensors):
        x = None if t.value is None else np.asarray(t.value)
        shape = t.shape if t.shape is not None else (tuple(x.shape) if x is not None else ())
        dtype = t.dtype or (dtypes.name_of(x.dtype) if x is not None else "float32")
        numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
        row = {"seq": seq, "phase": t.phase, "module": t.module, "call": t.call, "kind": t.kind, "slot": t.slot,
               "module_class": t.module_class, "dtype": dtype, "shape": shape_text(shape), "numel": numel,
               "has_data": 0, "same_as": t.same_as, "grad_of": t.grad_of, "enter": t.enter, "parent": t.parent,
               **(_stats(x) if x is not None else {"min": 0.0, "max": 0.0, "mean": 0.0, "l2": 0.0, "nan": 0, "inf": 0})}
        if x is not None and t.store and t.same_as < 0:
            data[seq] = x
            row["has_data"] = 1
        elif t.same_as >= 0:  # a link holds its source's tensor, as the recorder writes it
            row["has_data"] = rows[t.same_as]["has_data"]
        row.update(t.extra)
        rows.append(row)
    return rows, data


def write_capture(path: str, steps: list[list[T]], framework: str = "torch", losses: list[float] | None = None,
                  scalars: dict[int, dict[str, float]] | None = None, **attrs: Any) -> str:
    """A capture file of the given steps, written by the real ``CaptureWriter`` (in the calling thread)."""
    from tensordiff.store import CaptureWriter

    writer = CaptureWriter(path, {"framework": framework, "framework_version": "0.0", **attrs}, background=False)
    for step, tensors in enumerate(steps):
        rows, data = rows_of(tensors)
        step_attrs: dict[str, Any] = {"wall_time": 0.0}
        if losses is not None:
            step_attrs["loss"] = losses[step]
        writer.submit(step, rows, data, step_attrs)
    for step, values in sorted((scalars or {}).items()):
        writer.submit_scalars(step, values)
    writer.close()
    return path


def render(renderable: Any, width: int = 80) -> str:
    """What ``console.print(renderable)`` shows at ``width`` columns, without colour."""
    from tensordiff.report.theme import make_console

    buf = io.StringIO()
    make_console(file=buf, width=width, color=False).print(renderable)
    return buf.getvalue()


def check_golden(name: str, text: str) -> None:
    """``text`` must equal ``tests/golden/NAME``; with TENSORDIFF_UPDATE_GOLDENS=1 the file is rewritten instead."""
    path = os.path.join(GOLDEN_DIR, name)
    if os.environ.get(UPDATE_ENV) and os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{UPDATE_ENV} is set in CI: goldens would be rewritten instead of compared; unset it")
    if os.environ.get(UPDATE_ENV):
        os.makedirs(GOLDEN_DIR, exist_ok=True)
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
        return
    assert os.path.exists(path), f"no golden file {path}; run with {UPDATE_ENV}=1 to write it"
    with open(path, encoding="utf-8") as fh:
        expected = fh.read()
    assert text == expected, f"{name} differs from its golden file (rerun with {UPDATE_ENV}=1 if the change is intended)"


# ----------------------------------------------------------------------------------------- as a user sees it
#: an ANSI escape sequence (colours, cursor moves of a progress bar)
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def on_terminal(cmd: list[str], columns: int, cwd: str | None = None, env: dict[str, str] | None = None,
                timeout: float = 300) -> tuple[int, str]:
    """(exit code, everything written to the terminal, raw: ANSI codes and carriage returns kept)."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    full = dict(os.environ if env is None else env)
    full.pop("COLUMNS", None)
    full.pop("LINES", None)
    full["TERM"] = "xterm-256color"
    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, cwd=cwd, env=full, close_fds=True)
    os.close(slave)
    out = bytearray()
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the terminal closed: the program ended
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    return proc.wait(timeout), out.decode("utf-8", "replace")


def plain(raw: str) -> str:
    """What a terminal shows at the end, roughly: ANSI codes and carriage returns out (a progress bar that was
    erased leaves its text behind here; read it from ``raw``)."""
    return ANSI.sub("", raw).replace("\r\n", "\n").replace("\r", "")
