"""Run a PyTorch training program, unedited, with capture on: what ``tensordiff capture --auto`` runs.

    tensordiff capture --auto -o run.h5 --steps 2 -- python train.py ARGS
    # runs: python -m tensordiff.capturing.auto_main train.py ARGS
    tensordiff capture --auto -o run.h5 -- python -m package.train ARGS
    # runs: python -m tensordiff.capturing.auto_main -m package.train ARGS

The program runs as ``__main__`` with its own ``sys.argv`` and, for a script, its folder first on
``sys.path``, as under ``python train.py``; ``AutoCapture`` (``auto.py``) records its first training
steps. Without ``TENSORDIFF_OUTPUT`` (not started by ``tensordiff capture``) it runs without capture.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Any

from .options import report_status

USAGE = "usage: python -m tensordiff.capturing.auto_main SCRIPT [ARGS...] | -m MODULE [ARGS...]"


def main(argv: list[str] | None = None, as_program: bool = False, attach: Any = None) -> None:
    """Run ``SCRIPT ARGS`` or ``-m MODULE ARGS`` with autocapture on (``attach``: another way to capture, an object
    with ``install()`` and ``close(finished)``, e.g. ``megatron.MegatronCapture``).

    ``as_program``: this process was started to run it (``python -m ...auto_main``): ``sys.path[0]`` becomes
    the script's folder instead of the current one, as under ``python SCRIPT``. Otherwise (called from Python)
    the folder is put first and ``sys.argv`` and ``sys.path`` are restored afterwards.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or (argv[0] == "-m" and len(argv) < 2):
        sys.stderr.write(USAGE + "\n")
        raise SystemExit(2)
    auto = _auto_capture() if attach is None else attach
    if auto is not None and not auto.install() and attach is None:
        sys.stderr.write("tensordiff: capture is off (no TENSORDIFF_OUTPUT, or TENSORDIFF_DISABLE=1): running without it; "
                         "start it with `tensordiff capture --auto -o FILE -- python SCRIPT ...`\n")
    saved_argv, saved_path = sys.argv, list(sys.path)
    finished = False
    try:
        if argv[0] == "-m":
            sys.argv = argv[1:]  # run_module puts the module's file in sys.argv[0]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            folder = os.path.dirname(os.path.abspath(argv[0]))
            if as_program and sys.path:
                sys.path[0] = folder
            else:
                sys.path.insert(0, folder)
            sys.argv = argv
            runpy.run_path(argv[0], run_name="__main__")
        finished = True
    except SystemExit as stop:
        finished = stop.code in (None, 0)
        raise
    finally:
        if auto is not None:
            auto.close(finished=finished)
        if not as_program:
            sys.argv = saved_argv
            sys.path[:] = saved_path


def _auto_capture() -> Any:
    """An ``AutoCapture``, or None (said once) where this python cannot import torch: the program runs as it is."""
    try:
        from .auto import AutoCapture
    except ImportError as err:
        message = f"autocapture needs PyTorch, and {sys.executable} cannot import it ({err})"
        report_status(message)
        sys.stderr.write(f"tensordiff: {message}; running without capture\n")
        return None
    return AutoCapture()


if __name__ == "__main__":
    main(as_program=True)
