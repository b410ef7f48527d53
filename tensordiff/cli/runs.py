"""``tensordiff runs A B``: two whole training runs, step by step, with a verdict, a plot and an HTML page."""

from __future__ import annotations

import argparse
from typing import Any

from .. import _progress as progress
from ..errors import UsageError
from ..report.runs import DEFAULT_TOP, DriftReport, RunsReport
from ..runs import compare_runs, read_run
from ..runs.compare import DEFAULT_THRESHOLD, DEFAULT_WARMUP
from ..runs.drift import DEFAULT_BASELINE, DEFAULT_FACTOR, DriftTable
from ._args import add_output, add_var, console, given, parse_vars, write_json


def add_parsers(sub: Any) -> None:
    u = sub.add_parser("runs", help="compare two whole training runs: loss, perplexity, grad norm",
                       description="Compare the loss curves of two runs (Megatron-LM or MindFormers training logs, or "
                                   "tensordiff captures), aligned by step. Exit 0: the relative loss error stays within "
                                   "--threshold after --warmup steps; 1: it does not; 2: bad input.",
                       epilog="example: tensordiff runs megatron.log mindformers.log --threshold 0.01 --warmup 20 "
                              "--plot runs.png")
    u.add_argument("a", help="run A: a training log or a capture")
    u.add_argument("b", help="run B")
    u.add_argument("--threshold", type=float, help=f"largest relative loss error allowed (default {DEFAULT_THRESHOLD} = "
                   f"{DEFAULT_THRESHOLD * 100:g}%%)")
    u.add_argument("--warmup", type=int, help=f"steps not judged at the start (default {DEFAULT_WARMUP})")
    u.add_argument("--window", metavar="LO:HI", help="judge only steps LO..HI (both included; either may be left out)")
    u.add_argument("--ppl-threshold", type=float, metavar="REL",
                   help="also fail when the final or validation perplexities differ by more than REL (e.g. 0.02)")
    u.add_argument("--grad-norm-threshold", type=float, metavar="REL",
                   help="also fail when the mean relative grad-norm difference exceeds REL (e.g. 0.05)")
    u.add_argument("--json", metavar="FILE", help="also write a machine-readable report")
    u.add_argument("--plot", metavar="PNG", help="draw both loss curves, their relative error and the grad norms "
                                                  "(needs matplotlib: pip install 'tensordiff[plot]')")
    u.add_argument("--html", metavar="FILE", help="write a self-contained HTML report with the plot and the table")
    u.add_argument("--drift-baseline", type=int, default=DEFAULT_BASELINE, metavar="N",
                   help="captures with statistics for many steps: the layer drift table measures each record's noise "
                        f"on the first N common steps (default {DEFAULT_BASELINE})")
    u.add_argument("--drift-factor", type=float, default=DEFAULT_FACTOR, metavar="F",
                   help=f"a record departs when over F x its baseline noise (default {DEFAULT_FACTOR:g}; never below "
                        "the dtype's floor)")
    u.add_argument("--drift-top", type=int, default=DEFAULT_TOP, metavar="N",
                   help=f"earliest-drifting layers shown (default {DEFAULT_TOP})")
    u.add_argument("--no-drift", action="store_true", help="captures: leave out the layer drift table")
    u.add_argument("--fail-on-drift", action="store_true", help="exit 1 when a layer drifts, even if the loss passes")
    u.add_argument("--mapping", help="captures of two frameworks: the rename rules of `tensordiff diff` (default: the "
                                     "built-in that fits the captures)")
    add_var(u)
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


def _is_capture(path: str) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(8).startswith(b"\x89HDF")
    except OSError:
        return False


def _drift(args: argparse.Namespace, res: Any) -> tuple[DriftTable | None, str]:
    """The layer drift table when both runs are captures with statistics for several steps, else (None, why not;
    '' when there is nothing to say: logs, or --no-drift)."""
    if args.no_drift or not (_is_capture(args.a) and _is_capture(args.b)):
        return None, ""
    from ..mapping import RenameRules
    from ..runs.drift import layer_drift
    from ..store import CaptureFile

    if args.drift_baseline < 1 or args.drift_top < 0:
        raise UsageError("--drift-baseline is a number of steps >= 1, --drift-top >= 0")
    mapping = RenameRules.load(args.mapping, parse_vars(args.var)) if args.mapping else None
    with CaptureFile(args.a) as ca, CaptureFile(args.b) as cb:
        common = sorted(set(ca.steps) & set(cb.steps))
        if len(common) < 2:
            return None, (f"layer drift: not measured, the captures share {len(common)} captured step (statistics of "
                          "many steps are needed: capture with --tensors none --steps N)")
        if len(common) <= args.drift_baseline:
            return None, (f"layer drift: not measured, the captures share {len(common)} captured steps and the "
                          f"baseline alone takes {args.drift_baseline} (--drift-baseline N, or capture more steps)")
        loss = {s: (res.a.loss[s], res.b.loss[s]) for s in res.steps}
        return layer_drift(ca, cb, baseline=args.drift_baseline, factor=args.drift_factor, mapping=mapping,
                           loss=loss), ""


def _settings(a: str, b: str) -> Any:
    """The two runs' settings compared (``tensordiff config``) where both logs (or captures) hold them, else None."""
    from ..config import compare_settings, run_settings

    sa, sb = run_settings(a, None), run_settings(b, None)
    return None if sa is None or sb is None else compare_settings(sa, sb)


def run(args: argparse.Namespace) -> int:
    with progress.task(f"reading {args.a}") as shown:
        run_a = read_run(args.a)
        shown.describe(f"reading {args.b}")
        run_b = read_run(args.b)
    res = compare_runs(run_a, run_b, **given(threshold=args.threshold, warmup=args.warmup), window=_window(args.window),
                       ppl_threshold=args.ppl_threshold, grad_norm_threshold=args.grad_norm_threshold)
    with progress.task("the layer drift table"):
        drift, why = _drift(args, res)
    out = console(args)
    out.print(RunsReport(res))
    settings = _settings(args.a, args.b)
    if settings is not None and settings.differences:
        said = "; ".join(f"{d.row.label}: A {d.a.value}, B {d.b.value}" for d in settings.differences)
        out.print(f"The runs' settings differ in {len(settings.differences)} that change what a run computes "
                  f"(tensordiff config, from their logs): {said}.", style="tensordiff.diverged")
    if drift is not None:
        out.print(DriftReport(drift, top=args.drift_top))
    elif why:
        out.print(why, style="tensordiff.dim")
    if args.plot or args.html:
        from ..report.runs_plot import plot_png, write_html

        png = plot_png(res, drift=drift)
        if args.plot:
            with open(args.plot, "wb") as fh:
                fh.write(png)
            out.print(f"plot: {args.plot}")
        if args.html:
            write_html(res, args.html, png, drift=drift, top=args.drift_top)
            out.print(f"report: {args.html}")
    doc = res.as_dict()
    doc["settings"] = None if settings is None else settings.as_dict()
    doc["drift"] = drift.as_dict() if drift is not None else ({"measured": False, "why": why} if why else None)
    write_json(args.json, doc)
    return 0 if res.passed and not (args.fail_on_drift and drift is not None and drift.drifted) else 1
