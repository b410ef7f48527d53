"""``tensordiff merge 'run.rank*.h5' -o run.h5``: write a distributed run's rank files as one capture."""

from __future__ import annotations

import argparse
import os
from typing import Any

from ..errors import UsageError
from ..store import open_capture
from ..store.merged import write_capture_copy
from ._args import add_jobs, apply_jobs


def add_parsers(sub: Any) -> None:
    m = sub.add_parser("merge", help="write the rank files of one distributed run as one capture (single-device space)",
                       description="Merge a distributed run's rank files (TP, DP, PP) into one capture, as `tensordiff diff` "
                                   "reads them on the fly (see docs/distributed.md).",
                       epilog="example: tensordiff merge 'run.rank*.h5' -o run.h5")
    m.add_argument("files", help="the rank files, as a quoted glob: 'run.rank*.h5'")
    m.add_argument("-o", "--output", required=True, help="the merged capture to write")
    m.add_argument("--force", action="store_true", help="overwrite --output")
    add_jobs(m)
    m.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    apply_jobs(args)
    if os.path.exists(args.output) and not args.force:
        raise UsageError(f"{args.output}: already exists; pass --force to overwrite it, or another -o")
    with open_capture(args.files) as cap:
        if not cap.merged:
            raise UsageError(f"{args.files}: names one file; give the rank files of a run as a quoted glob, "
                             "e.g. 'run.rank*.h5'")
        n = write_capture_copy(cap, args.output)
        print(f"tensordiff: wrote {args.output}: {len(cap.steps)} step(s), {n} records, merged from "
              f"{len(cap.paths)} rank files (TP {cap.tp} x DP {cap.dp}{f' x PP {cap.pp}' if cap.pp > 1 else ''})")
    return 0
