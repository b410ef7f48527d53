"""``tensordiff ckpt convert | diff``: one shared checkpoint for both frameworks, and a check that it is.

* ``convert SRC DST --mapping TABLE``: rename and re-lay-out every tensor (both directions
  come from one table; the direction is read from SRC's names, its suffix, or ``--to``).
* ``diff A B``: tensor by tensor, after bringing B into A's names and layout with a table
  (``--mapping``, or found automatically).

Exit codes: 0 success / identical within tolerance, 1 some tensor differs or is on one side
only, 2 bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
from typing import Any

from .. import _progress as progress
from ..ckpt.compare import diff_checkpoints
from ..ckpt.convert import convert_file
from ..errors import UsageError
from ..mapping import builtin_with
from ..report.ckpt import CkptDiffReport, ConvertSummary
from ._args import add_output, add_var, console, parse_vars, write_json

CONVERT_EXAMPLE = ("example: tensordiff ckpt convert mcore.pt mf.ckpt --mapping mcore-mindformers; "
                   "tensordiff ckpt convert mcore.pt llama.ckpt --mapping mcore-mindformers-llama "
                   "--var heads=32 --var groups=8")
DIFF_EXAMPLE = "example: tensordiff ckpt diff mcore.pt mf.ckpt --mapping mcore-mindformers --json diff.json"


def add_parsers(sub: Any) -> None:
    """``ckpt`` with its actions ``convert`` and ``diff``."""
    tables = ", ".join(builtin_with("tensors")) or "none"
    k = sub.add_parser("ckpt", help="convert or compare checkpoints across frameworks",
                       description=f"Convert one checkpoint between megatron-core and MindFormers, or compare two. "
                                   f"Built-in tables: {tables} (see docs/checkpoints.md).", epilog=CONVERT_EXAMPLE)
    k.set_defaults(run=run, ckpt_parser=k)
    actions = k.add_subparsers(dest="ckpt_command", metavar="ACTION")

    c = actions.add_parser("convert", help="rename and re-lay-out every tensor of a checkpoint for the other framework",
                           description="Convert SRC to the other side of a mapping table and write DST. Every key and shape "
                                       "is checked first; all problems are reported at once. Exit 0: written, 2: error.",
                           epilog=CONVERT_EXAMPLE)
    c.add_argument("src", help="checkpoint to read (.safetensors, .pt/.pth, .ckpt)")
    c.add_argument("dst", help="checkpoint to write; the suffix picks the format")
    c.add_argument("--mapping", required=True, help=f"built-in table ({tables}) or a YAML table file")
    c.add_argument("--to", metavar="SIDE", help="the side to convert to, e.g. mindformers or mcore (default: the side SRC is "
                                                "not on)")
    add_var(c, "a table variable, e.g. --var heads=32 --var groups=8 or --var fc1_layout=stacked")

    d = actions.add_parser("diff", help="compare two checkpoints tensor by tensor, across frameworks",
                           description="Compare B against A after converting B to A's names and layout. Exit 0: every "
                                       "tensor identical (same dtype) or within tolerance (different dtypes); 1: a tensor "
                                       "differs or is on one side only; 2: error.", epilog=DIFF_EXAMPLE)
    d.add_argument("a", help="checkpoint A (the reference)")
    d.add_argument("b", help="checkpoint B")
    d.add_argument("--mapping", help="table to bring B to A's names (default: a built-in table that fits both files)")
    add_var(d, "a table variable, e.g. --var heads=32")
    d.add_argument("--sides", metavar="A_SIDE,B_SIDE", help="the tables' sides of A and B when their names do not tell, "
                                                            "e.g. mcore,mindformers")
    d.add_argument("--rtol", type=float, help="one relative-L2 tolerance for every float pair (default: identical bits "
                                              "for the same dtype, by dtype otherwise)")
    d.add_argument("--max-rows", type=int, default=None, help="rows before identical rows collapse (0: all)")
    d.add_argument("--json", metavar="FILE", help="also write a machine-readable report")
    add_output(d)




def run(args: argparse.Namespace) -> int:
    if args.ckpt_command == "convert":
        return run_convert(args)
    if args.ckpt_command == "diff":
        return run_diff(args)
    args.ckpt_parser.print_help()
    return 2


def run_convert(args: argparse.Namespace) -> int:
    with progress.task(f"converting {args.src} into {args.dst}"):
        done = convert_file(args.src, args.dst, args.mapping, parse_vars(args.var, "heads=32"), to=args.to)
    console(args).print(ConvertSummary(done))
    return 0


def run_diff(args: argparse.Namespace) -> int:
    sides = None
    if args.sides:
        parts = [s.strip() for s in args.sides.split(",")]
        if len(parts) != 2 or not all(parts):
            raise UsageError(f"--sides {args.sides!r}: expected A_SIDE,B_SIDE, e.g. --sides mcore,mindformers")
        sides = (parts[0], parts[1])
    with progress.task(f"comparing {args.a} with {args.b}"):
        result = diff_checkpoints(args.a, args.b, mapping=args.mapping, variables=parse_vars(args.var, "heads=32"),
                                  sides=sides, rtol=args.rtol)
    console(args).print(CkptDiffReport(result, max_rows=args.max_rows))
    write_json(args.json, result.to_dict())
    return 0 if result.passed else 1
