"""``tensordiff capture -o FILE -- COMMAND`` and ``tensordiff noise``: run a training program with capture on."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

from .._regex import compile_user
from ..capturing.launch import LAUNCHERS, launch_command, quiet_startup
from ..capturing.options import (
    ENV_DURABLE,
    ENV_EVERY,
    ENV_OUTPUT,
    ENV_PERTURB,
    ENV_STATUS,
    ENV_STEPS,
    ENV_TENSORS,
    ENV_TENSORS_MATCH,
    ENV_TENSORS_MAX_MB,
    TENSOR_MODES,
    rank_files,
)
from ..diff import noise as noises
from ..errors import MappingError, UsageError
from ..report.capture import NoiseSummary
from ..store import CaptureFile
from ._args import command_after_dashes, console, program_failed, run_program


def add_parsers(sub: Any) -> None:
    c = sub.add_parser("capture", help="run a training command with capture on",
                       description="Run COMMAND with capture turned on. The program calls tensordiff.capture(model, ...) "
                                   "(-o, --steps and --tensors override its arguments), or, with --auto, is any PyTorch "
                                   "script: its model and training steps are found through torch's global hooks.",
                       epilog="examples: tensordiff capture -o run.h5 --steps 2 -- python train.py --lr 1e-4; "
                              "tensordiff capture --auto -o run.h5 --steps 2 -- python plain_train.py --lr 1e-4")
    c.add_argument("-o", "--output", required=True, help="HDF5 file to write ('{rank}' is replaced by the rank)")
    for launcher in LAUNCHERS.values():
        c.add_argument(f"--{launcher.name}", action="store_true", help=launcher.help)
    c.add_argument("--steps", default="1",
                   help="training steps to capture (default 1); 'all': every step until the run ends (statistics "
                        "always on, with --tensors none)")
    c.add_argument("--every", type=int, default=1, metavar="N",
                   help="capture every Nth training step (0, N, 2N, ...; --steps of them): statistics of a whole run "
                        "for the layer drift table of tensordiff runs, at 1/N of the cost (default 1: every step)")
    c.add_argument("--tensors", choices=TENSOR_MODES, default="first",
                   help="store full tensors for the first step (default), all steps, or none")
    c.add_argument("--tensors-max-mb", type=float, default=None, metavar="MIB",
                   help="store full tensors only for records up to MIB each, statistics for larger ones; 0: no limit "
                        "(default: no limit; 64 for models of 1B parameters or more)")
    c.add_argument("--tensors-match", default=None, metavar="REGEX",
                   help="store full tensors only for modules whose name matches REGEX (statistics for the rest)")
    c.add_argument("--durable", action="store_true",
                   help="each captured step is on disk before training goes on: a killed run loses no finished step")
    c.add_argument("--framework-logs", action="store_true",
                   help="keep the frameworks' own start-up output as it is (by default MindFormers' INFO lines on "
                        "stdout, Megatron-LM's INFO logging and the notices that Transformer Engine or Apex are not "
                        "installed are left out; MindFormers' log files keep everything; env "
                        "TENSORDIFF_FRAMEWORK_LOGS=1)")
    c.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the training command")
    c.set_defaults(run=run_capture)

    n = sub.add_parser("noise", help="measure one side's run-to-run noise as per-tensor tolerances",
                       description="Measure the noise of one side: from two captures of the same run (R1 R2), or by "
                                   "running COMMAND twice, the second time with every float parameter moved by one ulp "
                                   "before the first step. Writes per-tensor tolerances for diff --noise-file.",
                       epilog="example: tensordiff noise -o noise.json --steps 1 -- python train.py; "
                              "tensordiff diff a.h5 b.h5 --noise-file noise.json")
    n.add_argument("runs", nargs=argparse.REMAINDER, help="R1 R2 (two captures of the same run), or -- COMMAND")
    n.add_argument("-o", "--output", help="noise file to write (JSON; required)")
    n.add_argument("--steps", type=int, default=1, help="with COMMAND: steps to capture (default 1)")
    n.add_argument("--seed", type=int, default=1, help="with COMMAND: seed of the one-ulp perturbation (default 1)")
    n.set_defaults(run=run_noise)


def _say_kept(out: str) -> None:
    """After a run that stopped early: which capture file(s) it left and how many complete steps each holds."""
    for path in [out] if os.path.exists(out) else rank_files(out):
        try:
            with CaptureFile(path) as cap:
                steps = cap.steps
        except Exception as err:  # a file the run could not finish: said, never a traceback
            print(f"tensordiff: {path}: not readable ({type(err).__name__}); nothing was kept", file=sys.stderr)
            continue
        print(f"tensordiff: {path} keeps {len(steps)} complete step(s)"
              + (f" ({steps[0]}..{steps[-1]})" if steps else ""), file=sys.stderr)


def run_capture(args: argparse.Namespace) -> int:
    if args.cmd and args.cmd[0] != "--":  # a program is run only when it follows '--': never a misnamed file
        raise UsageError(f"tensordiff capture: put the training command after '--' (got {' '.join(args.cmd[:3])!r}), "
                         "e.g. tensordiff capture -o run.h5 -- python train.py")
    cmd = command_after_dashes(args.cmd)
    if not cmd:
        raise UsageError("no training command given; put it after '--', e.g. tensordiff capture -o run.h5 -- python train.py")
    args.steps = _steps(str(args.steps))
    if args.steps < 1:
        raise UsageError(f"--steps {args.steps}: capture at least 1 step")
    script = next((part for part in cmd if part.endswith(".py")), cmd[0])
    if args.auto and args.megatron:
        raise UsageError("--auto and --megatron: choose one (--megatron for a megatron-core program, --auto for any "
                         "other PyTorch script)")
    if args.mindformers and (args.auto or args.megatron):
        raise UsageError("--mindformers runs a MindFormers Trainer command: use it alone, without --auto or --megatron")
    extra_env: dict[str, str] = {}
    launcher = next((name for name in LAUNCHERS if getattr(args, name)), None)
    if launcher is not None:
        cmd, extra_env = launch_command(launcher, cmd, os.path.abspath(args.output))
    out = os.path.abspath(args.output)
    if os.path.exists(out):
        os.remove(out)
    status = out + ".status"
    if os.path.exists(status):
        os.remove(status)
    env = dict(os.environ, **extra_env, **{ENV_OUTPUT: out, ENV_STEPS: str(args.steps), ENV_TENSORS: args.tensors,
                              ENV_STATUS: status})
    if args.every != 1:
        if args.every < 1:
            raise UsageError(f"--every {args.every}: expected 1 (every step) or more")
        env[ENV_EVERY] = str(args.every)
    if args.tensors_max_mb is not None:
        if not args.tensors_max_mb >= 0:
            raise UsageError(f"--tensors-max-mb {args.tensors_max_mb:g}: expected a size in MiB, 0 for no limit")
        env[ENV_TENSORS_MAX_MB] = f"{args.tensors_max_mb:g}"
    if args.tensors_match is not None:
        try:
            compile_user(args.tensors_match, f"--tensors-match {args.tensors_match!r}")
        except MappingError as err:
            raise UsageError(str(err)) from None
        env[ENV_TENSORS_MATCH] = args.tensors_match
    if args.durable:
        env[ENV_DURABLE] = "1"
    quiet_startup(env, keep=args.framework_logs)
    for path in rank_files(out):  # a rank file left by an earlier run would pass for this run's
        os.remove(path)
    code = run_program(cmd, env)
    problems: list[str] = []
    if os.path.exists(status):
        with open(status, encoding="utf-8") as f:
            problems = list(dict.fromkeys(line.strip() for line in f if line.strip()))  # once, not once per rank
        os.remove(status)
    if problems and not os.path.exists(out):
        raise UsageError(f"{script}: {problems[0]}")
    for line in problems:
        print(f"tensordiff: warning: {line}", file=sys.stderr)
    if code != 0:
        failed = program_failed(code)
        _say_kept(out)
        return failed
    ranks = [] if os.path.exists(out) else rank_files(out)
    if not os.path.exists(out) and not ranks:
        raise UsageError(f"{cmd[0]} ran but wrote no capture to {out}"
                         + (" (nor a per-rank file)" if "{rank}" not in out else "")
                         + ": the program must call tensordiff.capture(model, ...), or run it with --auto (see docs/guide.md)")
    for path in [out] if os.path.exists(out) else ranks:
        with CaptureFile(path) as cap:
            print(f"tensordiff: wrote {path}: {len(cap.steps)} step(s), {sum(len(cap.records(s)) for s in cap.steps)} "
                  f"records, {cap.nbytes() / 1e6:.1f} MB")
    if ranks:
        pattern = ranks[0].replace(".rank0.", ".rank*.") if ".rank0." in ranks[0] else out.replace("{rank}", "*")
        print(f"tensordiff: {len(ranks)} rank file(s); diff them as one run, merged on read: tensordiff diff REF.h5 "
              f"'{pattern}' (docs/distributed.md)")
    return 0


def _noise_files(args: argparse.Namespace) -> list[str]:
    """R1 R2 of ``tensordiff noise`` (options may follow them: ``noise r1.h5 r2.h5 -o n.json``)."""
    p = argparse.ArgumentParser(prog="tensordiff noise", add_help=False)
    p.add_argument("files", nargs="*")
    p.add_argument("-o", "--output")
    p.add_argument("--steps", type=int)
    p.add_argument("--seed", type=int)
    try:
        more, unknown = p.parse_known_args(args.runs)
    except SystemExit:
        raise UsageError("tensordiff noise: bad options after the capture files; see tensordiff noise --help") from None
    if unknown:
        raise UsageError(f"tensordiff noise: unknown argument(s) {' '.join(unknown)}; a command to run goes after '--'")
    for name in ("output", "steps", "seed"):
        if getattr(more, name) is not None:
            setattr(args, name, getattr(more, name))
    return list(more.files)


def run_noise(args: argparse.Namespace) -> int:
    command = args.runs[0:1] == ["--"]  # a program is run only when it follows '--': never a misnamed file
    runs = args.runs[1:] if command else _noise_files(args)
    if not args.output:
        raise UsageError("tensordiff noise needs -o NOISE.json, the noise file to write")
    if not command and len(runs) != 2:
        raise UsageError(f"tensordiff noise takes two captures of the same run (R1 R2), got {len(runs)} file(s); to "
                         "measure by running the training twice, put the command after '--': tensordiff noise -o "
                         "noise.json -- python train.py")
    if not command:
        paths, how = runs, "two captures of the same run"
        measured = noises.measure_noise(runs[0], runs[1])
    elif runs:
        with tempfile.TemporaryDirectory(prefix="tensordiff-noise-") as tmp:
            files = [os.path.join(tmp, "plain.h5"), os.path.join(tmp, "perturbed.h5")]
            for path, perturb in zip(files, (None, args.seed)):
                env = dict(os.environ, **{ENV_OUTPUT: path, ENV_STEPS: str(args.steps), ENV_TENSORS: "all"})
                env.pop(ENV_PERTURB, None)
                if perturb is not None:
                    env[ENV_PERTURB] = str(perturb)
                code = run_program(runs, env)
                if code != 0:
                    return program_failed(code)
                if not os.path.exists(path):
                    raise UsageError(f"{runs[0]} ran but wrote no capture: it must call tensordiff.capture(model, ...)")
            measured = noises.measure_noise(files[0], files[1])
        how = f"one run and the same run with every float parameter moved by one ulp (seed {args.seed})"
        paths = [" ".join(runs), f"{' '.join(runs)} (perturbed)"]
    else:
        raise UsageError("tensordiff noise needs R1.h5 R2.h5, or -- COMMAND; e.g. tensordiff noise -o noise.json -- python "
                         "train.py")
    noises.save(args.output, measured, paths, how)
    console().print(NoiseSummary(args.output, measured, how))
    return 0


#: ``--steps all``: more steps than any run has (the capture ends with the run).
ALL_STEPS = 10**12


def _steps(text: str) -> int:
    """``--steps``: a whole number, or 'all'."""
    if text.strip().lower() == "all":
        return ALL_STEPS
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"--steps {text!r}: give a whole number of steps, or 'all'") from None
