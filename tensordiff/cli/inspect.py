"""``tensordiff ls FILE`` and ``tensordiff show FILE [PATTERN]``: what a capture holds."""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import UsageError
from ..report.capture import CaptureListing, RecordTable
from ..store import CaptureFile
from ._args import add_output, console


def add_parsers(sub: Any) -> None:
    ls = sub.add_parser("ls", help="list the steps and phases of a capture")
    ls.add_argument("file")
    ls.set_defaults(run=run_ls)

    sh = sub.add_parser("show", help="show the records of a capture, with their statistics")
    sh.add_argument("file")
    sh.add_argument("pattern", nargs="?", default="", help="only modules whose name contains this text")
    sh.add_argument("--step", type=int, default=None, help="step to show (default: the first)")
    sh.add_argument("--phase", action="append", help="only this phase (repeatable)")
    add_output(sh)
    sh.set_defaults(run=run_show)


def run_ls(args: argparse.Namespace) -> int:
    with CaptureFile(args.file) as cap:
        console(args).print(CaptureListing(cap))
    return 0


def run_show(args: argparse.Namespace) -> int:
    with CaptureFile(args.file) as cap:
        if not cap.steps:
            raise UsageError(f"{args.file}: holds no complete step")
        step = cap.steps[0] if args.step is None else args.step
        if step not in cap.steps:
            raise UsageError(f"{args.file}: no step {step}; steps are {cap.steps}")
        records = [r for r in cap.records(step)
                   if args.pattern in r.module and not (args.phase and r.phase not in args.phase)]
        if not records:
            raise UsageError(f"{args.file}: no record matches {args.pattern!r} in step {step}")
        console(args).print(RecordTable(f"{args.file} step {step}", records))
    return 0
