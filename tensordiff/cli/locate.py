"""``tensordiff locate A B``: from the step where two runs' loss curves part to the layer, by resuming both runs
from a checkpoint before it with capture on, and diffing the resumed steps.

Exit codes: 0 the plan is written (without ``--run``), or the resumed steps agree and the curves do not part there;
1 a divergence was found; 2 bad input or a resumed run failed (its log named); 3 inconclusive (``diff``'s), or the
resumed steps agree while the loss curves part: what parts them was not in what the resumed runs computed (a
setting the resume restored from the checkpoint, a step the capture did not reach).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from typing import Any

from .. import _progress as progress
from ..config import ConfigDiff, compare_settings, run_settings
from ..diff.result import DiffOptions
from ..errors import UsageError
from ..explain import diagnose
from ..explain.hints.update import fit_updates
from ..mapping import RenameRules
from ..report.locate import LocateReport
from ..report.runs import RunsReport
from ..runs.compare import DEFAULT_THRESHOLD, DEFAULT_WARMUP
from ..runs.locate import MODES, LocatePlan, NothingToLocate, plan_locate
from ..store import open_capture
from ._args import add_output, add_var, console, given, parse_vars, write_json

EXAMPLE = ("example: tensordiff locate a.log b.log --ckpt-a ckpt_a --ckpt-b ckpt_b --cmd-a 'torchrun ... "
           "pretrain_gpt.py ...' --cmd-b 'python run_mindformer.py --config b.yaml' --run")


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("locate", help="resume two runs from a checkpoint before their curves part, and name the layer",
                       description="Find the step K where the loss curves of two runs part (as `tensordiff runs`), pick "
                                   "the latest checkpoint J before it, write the two commands that resume each run from "
                                   "J and capture iterations J+1..K+1, and with --run run them and diff the captures "
                                   "step by step. Exit 0: plan written (no --run) or the resumed steps agree, 1: "
                                   "divergence, 2: error, 3: inconclusive.", epilog=EXAMPLE)
    p.add_argument("a", help="run A: a training log or a capture (its loss curve)")
    p.add_argument("b", help="run B")
    p.add_argument("--ckpt-a", required=True, metavar="DIR", help="A's checkpoint folder (Megatron-LM --save, or "
                                                                  "MindFormers' checkpoint folder)")
    p.add_argument("--ckpt-b", metavar="DIR", help="B's checkpoint folder (--mode own)")
    p.add_argument("--cmd-a", required=True, metavar="COMMAND", help="A's training command as you ran it (one string)")
    p.add_argument("--cmd-b", required=True, metavar="COMMAND", help="B's training command")
    p.add_argument("--mode", choices=MODES, default="own",
                   help="own: each run resumes from its own checkpoint (default); shared: B resumes from A's state")
    p.add_argument("--step", type=int, metavar="K", help="look at iteration K (default: where the curves part)")
    p.add_argument("--threshold", type=float, help=f"relative loss error where the curves part ({DEFAULT_THRESHOLD})")
    p.add_argument("--warmup", type=int, help=f"steps not judged at the start (default {DEFAULT_WARMUP})")
    p.add_argument("--out", default="locate", metavar="DIR", help="folder for the captures, logs and YAML copies "
                                                                  "(default ./locate)")
    p.add_argument("--tensors", choices=("all", "first", "none"), default="all",
                   help="full tensors of every resumed step (default), of the first, or statistics only")
    p.add_argument("--run", dest="execute", action="store_true", help="run both resumed commands, then diff their "
                                                                          "captures")
    p.add_argument("--mapping", help="rename rules from B's names to A's for the diff (default: found automatically); "
                                     "--mode shared with Megatron-LM A and MindFormers B also converts A's state "
                                     "(weights, Adam moments, step) for B with its tensors table")
    add_var(p)
    p.add_argument("--steps-per-epoch", type=int, default=1, metavar="N",
                   help="--mode shared, Megatron-LM A, MindFormers B: steps in an epoch of B's dataset (the epoch "
                        "the converted checkpoint is in; default 1)")
    p.add_argument("--json", metavar="FILE", help="also write a machine-readable report")
    add_output(p)
    p.set_defaults(run=run)


def _split(text: str, flag: str) -> list[str]:
    try:
        cmd = shlex.split(text)
    except ValueError as err:
        raise UsageError(f"{flag} {text!r}: not a command line ({err}); quote it as one string") from None
    if not cmd:
        raise UsageError(f"{flag}: empty; pass the training command as one string")
    return cmd


def _last_line(path: str, width: int = 60) -> str:
    """The last line the run wrote to its log, cut to ``width`` (the progress line only)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, os.path.getsize(path) - 4096))
            lines = [line.strip() for line in fh.read().decode("utf-8", "replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1][:width] if lines else ""


def _run_side(side: Any) -> None:
    for path, text in side.files.items():
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
    cmd = [sys.executable, "-m", "tensordiff", *side.capture_command[1:]]
    with open(side.log, "w", encoding="utf-8") as log, \
            progress.task(f"running {side.name}") as shown:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        while True:
            try:
                code = proc.wait(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                shown.describe(f"running {side.name}: {_last_line(side.log)}")
    if code != 0 or not os.path.exists(side.capture):
        tail = ""
        try:
            with open(side.log, encoding="utf-8", errors="replace") as fh:
                lines = [line.strip() for line in fh if line.strip()]
            tail = f"; its last line: {lines[-1][:160]!r}" if lines else ""
        except OSError:
            pass
        raise UsageError(f"{side.log}: run {side.name}'s resumed command exited with code {code}{tail}; read the log, "
                         "fix the command (--cmd-" + side.name.lower() + ") and run again")


def run(args: argparse.Namespace) -> int:
    try:
        plan: LocatePlan = plan_locate(args.a, args.b, args.ckpt_a, args.ckpt_b, _split(args.cmd_a, "--cmd-a"),
                                       _split(args.cmd_b, "--cmd-b"), args.out, mode=args.mode,
                                       **given(threshold=args.threshold, warmup=args.warmup), step=args.step,
                                       tensors=args.tensors,
                                       mapping=args.mapping, variables=parse_vars(args.var),
                                       steps_per_epoch=args.steps_per_epoch)
    except NothingToLocate as nothing:
        out = console(args)
        out.print(RunsReport(nothing.comparison))
        out.print(str(nothing))
        write_json(args.json, {"tensordiff_locate": 1, "step": None, "runs": nothing.comparison.as_dict()})
        return 0
    out = console(args)
    settings = _settings_diff(args.a, args.b, _split(args.cmd_a, "--cmd-a"), _split(args.cmd_b, "--cmd-b"))
    result = None
    updates: list = []
    lrs: tuple[dict[int, float], dict[int, float]] = ({}, {})
    if plan.state is not None:  # shared mode across frameworks: A's state written for B before anything runs
        out.print(f"converting A's state of iteration {plan.resume} for B into {plan.state.dst} ...")
        plan.state.convert()
    if args.execute:
        for side in (plan.a, plan.b):
            out.print(f"running {side.name} (log: {side.log}) ...")
            _run_side(side)
        mapping = RenameRules.load(args.mapping, parse_vars(args.var)) if args.mapping else None
        result = diagnose(plan.a.capture, plan.b.capture, DiffOptions(mapping=mapping))
        with open_capture(plan.a.capture) as ca, open_capture(plan.b.capture) as cb:
            updates = fit_updates(result, ca, cb)
            lrs = (ca.scalars().get("lr", {}), cb.scalars().get("lr", {}))
    else:
        for side in (plan.a, plan.b):
            for path, text in side.files.items():
                with open(path, "w", encoding="utf-8") as fh:
                    fh.write(text)
    report = LocateReport(plan, result, updates, lrs, settings)
    out.print(report)
    write_json(args.json, report.to_dict())
    if result is None:
        return 0
    return 3 if report.unexplained_parting() else result.exit_code


def _settings_diff(log_a: str, log_b: str, cmd_a: list[str], cmd_b: list[str]) -> ConfigDiff | None:
    """The two runs' settings compared (``tensordiff config``), from their logs or commands; None when either side's
    cannot be read."""
    a, b = run_settings(log_a, cmd_a), run_settings(log_b, cmd_b)
    return None if a is None or b is None else compare_settings(a, b)
