"""``tensordiff diff A B``: name the first divergence, test its likely causes, print the tables."""

from __future__ import annotations

import argparse
from typing import Any

from rich.text import Text

from ..diff import noise as noises
from ..diff.result import DEFAULT_JUMP, DEFAULT_REFERENCE_FACTOR, DiffOptions
from ..diff.tolerance import DEFAULT_NOISE_FACTOR, Tolerances
from ..explain import diagnose
from ..explain.config import config_bearing
from ..mapping import RenameRules
from ..record import PHASES
from ..report.diff import DiffReport
from ._args import add_jobs, add_output, add_var, apply_jobs, check_numbers, console, given, parse_vars, write_json


def add_parsers(sub: Any) -> None:
    d = sub.add_parser("diff", help="compare two captures and name the first divergence",
                       description="Compare capture B against capture A. Exit 0: no divergence and everything compared, "
                                   "1: divergence, 2: error, 3: inconclusive (no divergence, but not everything "
                                   "was compared).",
                       epilog="example: tensordiff diff a.h5 b.h5 --first-divergence --json report.json")
    d.add_argument("a", help="capture A (the reference)")
    d.add_argument("b", help="capture B")
    d.add_argument("--first-divergence", action="store_true", help="show only the table of the phase holding the first "
                                                                   "divergence (none: the tables of what was not "
                                                                   "compared; with --max-rows 0, every table)")
    d.add_argument("--mapping", help="YAML rename rules from B's names to A's, or a built-in name (default: the built-in "
                                     "that fits the captures, see docs/mapping.md)")
    d.add_argument("--no-auto-mapping", action="store_true",
                   help="without --mapping, line names up as they are instead of picking a built-in mapping")
    add_var(d)
    d.add_argument("--rtol", type=float, help="one relative-L2 tolerance for every float pair (default: by dtype)")
    d.add_argument("--noise", nargs=2, metavar=("R1", "R2"), help="two captures of the same run: their differences set a "
                                                                  "per-tensor noise floor")
    d.add_argument("--reference", metavar="R", help="three-way: an FP32 capture of the same model, checkpoint and batch; "
                                                    "B is judged by its error against R next to A's own")
    d.add_argument("--reference-mapping", metavar="FILE", help="rename rules from R's names to A's (default: by name)")
    d.add_argument("--reference-factor", type=float, default=None,
                   help="three-way: B is off when its error against R exceeds this many times A's "
                        f"(default {DEFAULT_REFERENCE_FACTOR:g})")
    d.add_argument("--noise-file", metavar="FILE", help="per-tensor noise written by tensordiff noise")
    d.add_argument("--noise-factor", type=float, default=None,
                   help=f"allowed multiple of the measured noise (default {DEFAULT_NOISE_FACTOR:g})")
    d.add_argument("--jump", type=float, default=None,
                   help=f"error growth that counts as introduced (default {DEFAULT_JUMP:g}x)")
    d.add_argument("--no-order", action="store_true", help="do not match leftovers by execution order and shape")
    d.add_argument("--no-exact", action="store_true",
                   help="judge same-stack pairs by tolerance only (default: on one bitwise reproducible stack, a "
                        "difference of any size where a module's inputs are bitwise identical is a divergence)")
    d.add_argument("--no-hints", action="store_true", help="do not test likely causes at the first divergence")
    d.add_argument("--phase", action="append", choices=PHASES, help="show only this phase (repeatable)")
    d.add_argument("--step", type=int, action="append", help="compare only this step (repeatable)")
    d.add_argument("--max-rows", type=int, default=None, help="rows per table before ok rows collapse (0: all)")
    d.add_argument("--json", metavar="FILE", help="also write a machine-readable report")
    add_output(d)
    add_jobs(d, help="threads comparing tensor pairs, and worker processes reading rank files' indexes (default: the "
                     "usable cores, at most 8; rank files: 1 below 16 files; env TENSORDIFF_JOBS)")
    d.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    check_numbers(args, positive=("reference_factor", "noise_factor", "jump"), finite=("rtol",),
                  at_least_zero=("step", "max_rows"))
    apply_jobs(args)
    variables = parse_vars(args.var)
    mapping = RenameRules.load(args.mapping, variables) if args.mapping else None
    tolerances = Tolerances(**given(override=args.rtol, noise_factor=args.noise_factor))
    if args.noise:
        tolerances.noise = noises.measure_noise(args.noise[0], args.noise[1], mapping=None)
    if args.noise_file:
        tolerances.noise = {**noises.load(args.noise_file), **tolerances.noise}
    reference_mapping = RenameRules.load(args.reference_mapping, variables) if args.reference_mapping else None
    options = DiffOptions(**given(mapping=mapping, tolerances=tolerances, order_fallback=not args.no_order,
                                  jump=args.jump, steps=args.step, reference=args.reference,
                                  reference_mapping=reference_mapping, reference_factor=args.reference_factor,
                                  auto_mapping=not args.no_auto_mapping, jobs=args.jobs, exact=not args.no_exact))
    result = diagnose(args.a, args.b, options, hints=not args.no_hints)
    report = DiffReport(result, max_rows=args.max_rows, phases=args.phase, first_only=args.first_divergence)
    out = console(args)
    out.print(report)
    bearing, others = config_bearing(result)
    for line in config_lines(bearing, others):
        out.print(line)
    doc = report.to_dict()
    if bearing or others:
        doc["config_differences"] = {"bearing": [d.as_dict() for d in bearing], "others": [d.as_dict() for d in others]}
    write_json(args.json, doc)
    return result.exit_code


def config_lines(bearing: list, others: list) -> list[Text]:
    lines = []
    if bearing:
        lines.append(Text("The runs' recorded configurations differ in what bears on the first divergence:",
                          style="tensordiff.diverged"))
        for d in bearing:
            lines.append(Text(f"  {d.row.label}: A {d.a.value!r}, B {d.b.value!r} ({d.row.why})"))
    if others:
        lines.append(Text(f"They also differ in {', '.join(d.row.label for d in others)} (tensordiff config A B "
                          "shows all)."))
    return lines
