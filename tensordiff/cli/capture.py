"""``tensordiff capture -o FILE -- COMMAND`` and ``tensordiff noise``: run a training program with capture on."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
from typing import Any

from .._regex import compile_user
from ..capturing.launch import mindformers_command
from ..capturing.options import (
    AUTO_MODULE,
    ENV_DURABLE,
    ENV_EVERY,
    ENV_OUTPUT,
    ENV_PERTURB,
    ENV_STATUS,
    ENV_STEPS,
    ENV_TENSORS,
    ENV_TENSORS_MATCH,
    ENV_TENSORS_MAX_MB,
    MEGATRON_MODULE,
    TENSOR_MODES,
    rank_files,
)
from ..capturing.startup import ENV_FRAMEWORK_LOGS
from ..capturing.startup import FOLDER as STARTUP_FOLDER
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
    c.add_argument("--auto", action="store_true",
                   help="PyTorch script that does not call tensordiff: run `python SCRIPT ...` / `python -m MODULE ...` "
                        "through tensordiff's entry point; training steps only (evaluation is skipped)")
    c.add_argument("--megatron", action="store_true",
                   help="a megatron-core training program that does not call tensordiff (Megatron-LM's "
                        "pretrain_gpt.py, or any loop on megatron-core's schedule and optimizer): `torchrun [OPTIONS] "
                        "SCRIPT ...` or `python SCRIPT ...`, every rank captured (docs/megatron-lm.md)")
    c.add_argument("--mindformers", action="store_true",
                   help="a MindFormers Trainer command with --config x.yaml (run_mindformer.py, under python or msrun): "
                        "run on a copy of the YAML with the TensordiffCapture callback added (docs/mindformers-trainer.md)")
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
    extra_env: dict[str, str] = {}
    if args.mindformers and (args.auto or args.megatron):
        raise UsageError("--mindformers runs a MindFormers Trainer command: use it alone, without --auto or --megatron")
    if args.mindformers:
        cmd, extra_env = mindformers_command(cmd, os.path.abspath(args.output) + ".mindformers.yaml")
    elif args.megatron:
        cmd = megatron_command(cmd)
        if _PYTHON.fullmatch(os.path.basename(cmd[0])):
            _check_auto_importable(cmd[0], MEGATRON_MODULE, "--megatron")
    elif args.auto:
        cmd = auto_command(cmd)
        _check_auto_importable(cmd[0])
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
    if not (args.framework_logs or os.environ.get(ENV_FRAMEWORK_LOGS)):  # the frameworks' start-up chatter, quieted
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [STARTUP_FOLDER, env.get("PYTHONPATH")]))
        env.setdefault("MEGATRON_LOGGING_LEVEL", "30")  # Megatron-LM's root logger at WARNING (its default: INFO)
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


_PYTHON = re.compile(r"python[0-9.]*(\.exe)?")


#: torchrun's options that take no value (torch.distributed.run); every other option takes one
_TORCHRUN_FLAGS = {"--standalone", "-m", "--module", "--no-python", "--no_python", "--run-path", "--run_path",
                   "--virtual-local-rank", "--virtual_local_rank"}
_LAUNCHERS = ("torch.distributed.run", "torch.distributed.launch")


def megatron_command(cmd: list[str]) -> list[str]:
    """``torchrun [OPTIONS] SCRIPT ARGS`` (or ``python -m torch.distributed.run ...``) with every worker run through
    the packaged entry point (``torchrun [OPTIONS] -m tensordiff.capturing.megatron_main SCRIPT ARGS``), or
    ``python SCRIPT ARGS`` as ``auto_command`` does; anything else is a UsageError."""
    launcher = 1 if cmd and os.path.basename(cmd[0]) == "torchrun" else 0
    if not launcher and len(cmd) > 2 and _PYTHON.fullmatch(os.path.basename(cmd[0])) and cmd[1] == "-m" \
            and cmd[2] in _LAUNCHERS:
        launcher = 3
    if not launcher:
        return auto_command(cmd, MEGATRON_MODULE, "--megatron", launchers=True)
    i = launcher
    module = False
    while i < len(cmd) and cmd[i].startswith("-") and cmd[i] != "--":
        flag = cmd[i].split("=", 1)[0]
        if flag in ("--no-python", "--no_python"):
            raise UsageError("--megatron: torchrun --no-python runs a program that is not Python; run the Python "
                             "training script under torchrun (`torchrun [OPTIONS] pretrain_gpt.py ARGS`)")
        module = module or flag in ("-m", "--module")
        i += 1 if "=" in cmd[i] or flag in _TORCHRUN_FLAGS else 2
    if cmd[i:i + 1] == ["--"]:
        i += 1
    if i >= len(cmd):
        raise UsageError(f"--megatron: `{shlex.join(cmd)}` names no training script; write the command as "
                         "`torchrun --nproc-per-node N pretrain_gpt.py ARGS`")
    options = [a for a in cmd[launcher:i] if a.split("=", 1)[0] not in ("-m", "--module")]
    script = ["-m", cmd[i]] if module else [cmd[i]]
    return [*cmd[:launcher], *options, "-m", MEGATRON_MODULE, *script, *cmd[i + 1:]]


def auto_command(cmd: list[str], module: str = AUTO_MODULE, flag: str = "--auto",
                 launchers: bool = False) -> list[str]:
    """``python [OPTIONS] SCRIPT ARGS`` or ``python [OPTIONS] -m MODULE ARGS``, run through the packaged entry point
    (``python [OPTIONS] -m tensordiff.capturing.auto_main SCRIPT ARGS``); anything else is a UsageError."""
    if not cmd or not _PYTHON.fullmatch(os.path.basename(cmd[0])):
        also = " or `torchrun [OPTIONS] train.py ARGS`" if launchers else ""
        raise UsageError(f"{flag}: {shlex.join(cmd[:1]) or 'nothing'} is not a python command; write the command as "
                         f"`python train.py ARGS` or `python -m package.module ARGS`{also}")
    i = 1
    while i < len(cmd):
        arg = cmd[i]
        if arg == "-" or not arg.startswith("-"):
            break
        if arg.startswith("--"):
            if arg != "--check-hash-based-pycs":
                raise UsageError(f"{flag}: `{shlex.join(cmd[:i + 1])}` runs no script; write the command as "
                                 "`python train.py ARGS` or `python -m package.module ARGS`")
            i += 2
            continue
        for j, short in enumerate(arg[1:], 2):  # short options, possibly combined (-u, -uB, -Wignore, -mpkg.mod)
            if short not in "mcWX":
                continue
            value, used = (arg[j:], 1) if arg[j:] else (cmd[i + 1] if i + 1 < len(cmd) else "", 2)
            if short == "c":
                raise UsageError(f"{flag}: `python -c CODE` has no script to run through the capture; save the code in a "
                                 "file and run `python FILE`")
            if short == "m":
                if not value:
                    raise UsageError(f"{flag}: `python -m` names no module; write `python -m package.module ARGS`")
                if value in _LAUNCHERS:  # the launcher's process has no model: the workers it starts do
                    raise UsageError(f"{flag}: `python -m {value}` starts worker processes that {flag} would not "
                                     "capture; for a megatron-core program use `tensordiff capture --megatron -- "
                                     f"python -m {value} ... train.py ARGS`, else capture one worker: "
                                     "`python train.py ARGS`")
                options = cmd[1:i] + ([arg[:j - 1]] if j > 2 else [])
                return [cmd[0], *options, "-m", module, "-m", value, *cmd[i + used:]]
            i += used - 1
            break
        i += 1
    if i >= len(cmd) or cmd[i] == "-":
        raise UsageError(f"{flag}: `{shlex.join(cmd)}` names no script; write the command as `python train.py ARGS` or "
                         "`python -m package.module ARGS`")
    return [cmd[0], *cmd[1:i], "-m", module, *cmd[i:]]


def _check_auto_importable(python: str, module: str = AUTO_MODULE, flag: str = "--auto") -> None:
    """The program's python must import tensordiff (it runs the entry point): one line if it cannot."""
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    try:
        code = subprocess.call([python, "-c", probe], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except FileNotFoundError:
        raise UsageError(f"cannot run {python!r}: no such program; check the command after '--'") from None
    except OSError as err:
        raise UsageError(f"cannot run {python!r}: {err.strerror}; check the command after '--'") from None
    if code != 0:
        raise UsageError(f"{flag}: {python} cannot import {module}; install this tensordiff into that python's "
                         f"environment, or start the command with {sys.executable}")


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
