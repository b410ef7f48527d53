"""``tensordiff check 'run.rank*.h5'``: the cross-rank consistency check of one distributed run, no reference."""

from __future__ import annotations

import argparse
from typing import Any

from .. import _progress as progress
from ..errors import UsageError
from ..explain.ranks import inconsistency_cause
from ..store import open_capture
from ._args import add_jobs, add_output, apply_jobs, console


def add_parsers(sub: Any) -> None:
    c = sub.add_parser("check", help="check one distributed run's rank files against each other (no reference run)",
                       description="Every record that must be identical on the ranks holding it (parameters, reduced "
                                   "gradients, activations replicated across tensor-parallel ranks) is compared across "
                                   "the rank files. Exit 0: consistent; 1: records differ (the cause is named); "
                                   "2: bad input. See docs/distributed.md.",
                       epilog="example: tensordiff check 'run.rank*.h5'")
    c.add_argument("files", help="the rank files of one run, as a quoted glob: 'run.rank*.h5'")
    c.add_argument("--show", type=int, default=8, help="records listed per step (default 8)")
    add_output(c)
    add_jobs(c)
    c.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    apply_jobs(args)
    out = console(args)
    with open_capture(args.files) as cap:
        if not cap.merged:
            raise UsageError(f"{args.files}: names one file; give the rank files of a run as a quoted glob, "
                             "e.g. 'run.rank*.h5'")
        layout = " x ".join(f"{k} {v}" for k, v in (("TP", cap.tp), ("DP", cap.dp), ("PP", cap.pp)) if k != "PP" or v > 1)
        sp = ", sequence parallel" if cap.sp else ""
        out.print(f"{args.files}: {len(cap.paths)} rank files ({layout}{sp}), {len(cap.steps)} step(s)")
        bad_steps = 0
        for step in cap.steps:
            with progress.task(f"checking step {step} across {len(cap.paths)} rank files"):
                items = cap.inconsistent_records(step)
            if not items:
                out.print(f"step {step}: every replicated record agrees across ranks")
                continue
            bad_steps += 1
            out.print(f"step {step}: {len(items)} record(s) that must be identical differ across ranks")
            for rec, group, ranks in items[: args.show]:
                out.print(f"  {rec.phase:<10} {rec.label}: {group} ranks {'/'.join(map(str, ranks))} differ",
                          highlight=False)
            if len(items) > args.show:
                out.print(f"  ... and {len(items) - args.show} more (--show N)")
            out.print(f"  cause: {inconsistency_cause(items, cap.param_split)}", highlight=False)
        if bad_steps:
            out.print(f"Inconsistent: {bad_steps} of {len(cap.steps)} step(s) hold records that differ across ranks.")
            return 1
        out.print("Consistent: every record that must be identical across ranks is.")
    return 0
