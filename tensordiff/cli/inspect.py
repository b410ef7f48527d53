"""``tensordiff ls FILE`` and ``tensordiff show FILE [PATTERN]``: what a capture holds."""

from __future__ import annotations

import argparse
from typing import Any

from .._text import times_shape
from ..errors import UsageError
from ..report.capture import CaptureListing, RecordTable
from ..store import CaptureReader, open_capture
from ._args import add_output, console


def add_parsers(sub: Any) -> None:
    ls = sub.add_parser("ls", help="list the steps and phases of a capture (--records: every record, one per line)",
                        epilog="example: tensordiff ls run.h5 --records --phase forward | grep mlp")
    ls.add_argument("file")
    ls.add_argument("--records", action="store_true",
                    help="list every record of a step, one per line: phase, name, dtype, shape (for mappings and grep)")
    ls.add_argument("--step", type=int, default=None, help="with --records: the step (default: the first)")
    ls.add_argument("--phase", action="append", help="with --records: only this phase (repeatable)")
    ls.set_defaults(run=run_ls)

    sh = sub.add_parser("show", help="show the records of a capture, with their statistics")
    sh.add_argument("file")
    sh.add_argument("pattern", nargs="?", default="", help="only modules whose name contains this text")
    sh.add_argument("--step", type=int, default=None, help="step to show (default: the first)")
    sh.add_argument("--phase", action="append", help="only this phase (repeatable)")
    add_output(sh)
    sh.set_defaults(run=run_show)


def run_ls(args: argparse.Namespace) -> int:
    with open_capture(args.file) as cap:
        if not args.records:
            console(args).print(CaptureListing(cap))
            return 0
        step = _step(args.file, cap, args.step)
        for r in cap.records(step):  # one line each, never wrapped: made for grep, diff and mapping files
            if args.phase and r.phase not in args.phase:
                continue
            link = " (link)" if r.same_as >= 0 else ""
            print(f"{r.phase:<10} {r.label}{link}  {r.dtype} {times_shape(r.shape)}")
    return 0


def _step(path: str, cap: CaptureReader, step: int | None) -> int:
    if not cap.steps:
        raise UsageError(f"{path}: holds no complete step")
    chosen = cap.steps[0] if step is None else step
    if chosen not in cap.steps:
        raise UsageError(f"{path}: no step {chosen}; steps are {cap.steps}")
    return chosen


def run_show(args: argparse.Namespace) -> int:
    with open_capture(args.file) as cap:
        step = _step(args.file, cap, args.step)
        records = [r for r in cap.records(step)
                   if args.pattern in r.module and not (args.phase and r.phase not in args.phase)]
        if not records:
            raise UsageError(f"{args.file}: no record matches {args.pattern!r} in step {step}")
        console(args).print(RecordTable(f"{args.file} step {step}", records))
    return 0
