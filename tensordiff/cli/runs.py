"""``tensordiff runs A B``: two whole training runs, step by step, with a verdict, a plot and an HTML page."""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import UsageError
from ..report.runs import RunsReport
from ..runs import compare_runs, read_run
from ._args import add_output, console, write_json


def add_parsers(sub: Any) -> None:
    u = sub.add_parser("runs", help="compare two whole training runs: loss, perplexity, grad norm",
                       description="Compare the loss curves of two runs (Megatron-LM or MindFormers training logs, or "
                                   "tensordiff captures), aligned by step. Exit 0: the relative loss error stays within "
                                   "--threshold after --warmup steps; 1: it does not; 2: bad input.",
                       epilog="example: tensordiff runs megatron.log mindformers.log --threshold 0.01 --warmup 20 "
                              "--plot runs.png")
    u.add_argument("a", help="run A: a training log or a capture")
    u.add_argument("b", help="run B")
    u.add_argument("--threshold", type=float, default=0.01, help="largest relative loss error allowed (default 0.01 = 1%%)")
    u.add_argument("--warmup", type=int, default=0, help="steps not judged at the start (default 0)")
    u.add_argument("--window", metavar="LO:HI", help="judge only steps LO..HI (both included; either may be left out)")
    u.add_argument("--ppl-threshold", type=float, metavar="REL",
                   help="also fail when the final or validation perplexities differ by more than REL (e.g. 0.02)")
    u.add_argument("--grad-norm-threshold", type=float, metavar="REL",
                   help="also fail when the mean relative grad-norm difference exceeds REL (e.g. 0.05)")
    u.add_argument("--json", metavar="FILE", help="also write a machine-readable report")
    u.add_argument("--plot", metavar="PNG", help="draw both loss curves, their relative error and the grad norms "
                                                  "(needs matplotlib: pip install 'tensordiff[plot]')")
    u.add_argument("--html", metavar="FILE", help="write a self-contained HTML report with the plot and the table")
    add_output(u)
    u.set_defaults(run=run)


def _window(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    lo, sep, hi = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return (int(lo) if lo else 0, int(hi) if hi else 2**62)
    except ValueError:
        raise UsageError(f"--window {text}: expected LO:HI step numbers, e.g. --window 100:300 or 100:") from None


def run(args: argparse.Namespace) -> int:
    res = compare_runs(read_run(args.a), read_run(args.b), threshold=args.threshold, warmup=args.warmup,
                       window=_window(args.window), ppl_threshold=args.ppl_threshold,
                       grad_norm_threshold=args.grad_norm_threshold)
    out = console(args)
    out.print(RunsReport(res))
    if args.plot or args.html:
        from ..report.runs_plot import plot_png, write_html

        png = plot_png(res)
        if args.plot:
            with open(args.plot, "wb") as fh:
                fh.write(png)
            out.print(f"plot: {args.plot}")
        if args.html:
            write_html(res, args.html, png)
            out.print(f"report: {args.html}")
    write_json(args.json, res.as_dict())
    return 0 if res.passed else 1
