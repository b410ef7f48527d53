"""Argument helpers every command shares: ``--var``, output options, the console, JSON files, running a program."""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Any

from rich.console import Console

from ..errors import UsageError
from ..report.theme import make_console


def given(**options: Any) -> dict[str, Any]:
    """The options given on the command line: an option left unset is None there, and the library's own default
    (written once, beside the function that uses it) applies."""
    return {name: value for name, value in options.items() if value is not None}


def parse_vars(items: list[str], example: str = "heads=12") -> dict[str, str]:
    """``--var NAME=VALUE`` items as a dict; a malformed one is a UsageError."""
    out = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or not name.strip() or not value.strip():
            raise UsageError(f"--var {item!r}: expected NAME=VALUE, e.g. --var {example}")
        out[name.strip()] = value.strip()
    return out


def add_var(parser: argparse.ArgumentParser, help: str = "value for ${NAME} in the mapping file") -> None:
    parser.add_argument("--var", action="append", default=[], metavar="NAME=VALUE", help=help)


def add_output(parser: argparse.ArgumentParser) -> None:
    """``--width`` and ``--no-color``."""
    parser.add_argument("--width", type=int, help="table width (default: the terminal's)")
    parser.add_argument("--no-color", action="store_true", help="plain text output")


def console(args: argparse.Namespace | None = None) -> Console:
    """The console for a command's output: ``--width``, ``--no-color`` and ``NO_COLOR`` honoured."""
    no_color = bool(getattr(args, "no_color", False)) or bool(os.environ.get("NO_COLOR"))
    return make_console(width=getattr(args, "width", None), color=False if no_color else None)


def write_json(path: str | None, doc: dict[str, Any]) -> None:
    """Write ``doc`` to ``path`` (``--json``), if given."""
    if not path:
        return
    try:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=1)
            fh.write("\n")
    except OSError as err:
        raise UsageError(f"{path}: cannot write the JSON report ({err.strerror}); check the --json path") from None


def command_after_dashes(items: list[str]) -> list[str]:
    """The program after '--' (argparse.REMAINDER keeps the '--')."""
    return items[1:] if items and items[0] == "--" else list(items)


def run_program(cmd: list[str], env: dict[str, str]) -> int:
    """Run the training program with ``env`` and wait for it, as a shell waits for its foreground job: a Ctrl-C
    reaches the program (its whole process group), which decides what it does (stops, saves, finishes writing its
    capture); this process ignores it meanwhile, never killing the program under its capture. The program's exit
    code, or minus the signal that ended it (a missing program is a UsageError)."""
    try:
        proc = subprocess.Popen(cmd, env=env)
    except FileNotFoundError:
        raise UsageError(f"cannot run {cmd[0]!r}: no such program; check the command after '--'") from None
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        return proc.wait()
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def program_failed(code: int) -> int:
    """Say that the training program failed; the exit code to pass on: the program's, 128 + N where signal N ended
    it (130 after a Ctrl-C, as a shell gives)."""
    if code < 0:
        name = next((s.name for s in signal.Signals if s.value == -code), f"signal {-code}")
        print(f"tensordiff: the training command was stopped by {name}", file=sys.stderr)
        return 128 - code
    print(f"tensordiff: the training command exited with code {code}", file=sys.stderr)
    return code if 0 < code < 256 else 2


def add_jobs(parser: argparse.ArgumentParser, help: str = "worker processes reading rank files (default: 1 below 16 "
                                                            "rank files, else up to 8; env TENSORDIFF_JOBS)") -> None:
    """``--jobs`` and ``--dask``: how many rank files' indexes are read at once (tensordiff/store/fanout.py), and what
    else the command spreads over ``--jobs`` (``help`` says)."""
    parser.add_argument("--jobs", type=int, default=None, metavar="N", help=help)
    parser.add_argument("--dask", metavar="ADDRESS", default=None,
                        help="read rank files on a Dask distributed cluster (e.g. tcp://host:8786; needs "
                             "tensordiff[dask] and a filesystem the workers share; env TENSORDIFF_DASK)")


def apply_jobs(args: argparse.Namespace) -> None:
    from ..store.fanout import configure

    configure(getattr(args, "jobs", None), getattr(args, "dask", None))


def check_numbers(args: argparse.Namespace, positive: Sequence[str] = (), finite: Sequence[str] = (),
                  at_least_zero: Sequence[str] = ()) -> None:
    """Options that must be finite and > 0 (``positive``), finite and >= 0 (``finite``), or integers >= 0
    (``at_least_zero``): a tolerance of -1 or NaN would make every comparison fail, or none; a UsageError naming the
    option otherwise."""
    for name in (*positive, *finite):
        value = getattr(args, name, None)
        if value is not None and not (math.isfinite(value) and (value > 0 or (name in finite and value == 0))):
            raise UsageError(f"--{name.replace('_', '-')} {value}: must be a finite number "
                             f"{'>= 0' if name in finite else '> 0'}")
    for name in at_least_zero:
        values = getattr(args, name, None)
        for value in values if isinstance(values, list) else [values]:
            if value is not None and value < 0:
                raise UsageError(f"--{name.replace('_', '-')} {value}: must be >= 0")
