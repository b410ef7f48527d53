"""Command line: ``tensordiff capture | diff | ls | show``.

Exit codes: 0 no divergence (or success), 1 divergence found, 2 bad input or error.
Errors print one line, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Sequence

import numpy as np

from . import __version__, ckpt_cli
from ._capture_common import ENV_OUTPUT, ENV_STATUS, ENV_STEPS, ENV_TENSORS, TENSOR_MODES
from .errors import TensordiffError, UsageError

EXAMPLE = "example: tensordiff capture -o a.h5 --steps 2 -- python train.py; tensordiff diff a.h5 b.h5 --first-divergence"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tensordiff", description="Find where two training runs first part ways, layer by layer.",
                                epilog=EXAMPLE)
    p.add_argument("--version", action="version", version=f"tensordiff {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    c = sub.add_parser("capture", help="run a training command with capture on",
                       description="Run COMMAND with capture turned on. The program must call tensordiff.capture(model, ...) "
                                   "or run through a hooks/ entry point; -o, --steps and --tensors override its arguments.",
                       epilog="example: tensordiff capture -o run.h5 --steps 2 -- python train.py --lr 1e-4")
    c.add_argument("-o", "--output", required=True, help="HDF5 file to write ('{rank}' is replaced by the rank)")
    c.add_argument("--steps", type=int, default=1, help="training steps to capture (default 1)")
    c.add_argument("--tensors", choices=TENSOR_MODES, default="first", help="store full tensors for the first step (default), all steps, or none")
    c.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the training command")

    d = sub.add_parser("diff", help="compare two captures and name the first divergence",
                       description="Compare capture B against capture A. Exit 0: no divergence, 1: divergence, 2: error.",
                       epilog="example: tensordiff diff a.h5 b.h5 --first-divergence --json report.json")
    d.add_argument("a", help="capture A (the reference)")
    d.add_argument("b", help="capture B")
    d.add_argument("--first-divergence", action="store_true", help="show only the table of the phase holding the first divergence")
    d.add_argument("--mapping", help="YAML rename rules from B's names to A's (see docs/mapping.md)")
    d.add_argument("--var", action="append", default=[], metavar="NAME=VALUE", help="value for ${NAME} in the mapping file")
    d.add_argument("--rtol", type=float, help="one relative-L2 tolerance for every float pair (default: by dtype)")
    d.add_argument("--noise", nargs=2, metavar=("R1", "R2"), help="two captures of the same run: their differences set a per-tensor noise floor")
    d.add_argument("--reference", metavar="R", help="three-way: an FP32 capture of the same model, checkpoint and batch; "
                                                    "B is judged by its error against R next to A's own")
    d.add_argument("--reference-mapping", metavar="FILE", help="rename rules from R's names to A's (default: by name)")
    d.add_argument("--reference-factor", type=float, default=3.0,
                   help="three-way: B is off when its error against R exceeds this many times A's (default 3)")
    d.add_argument("--noise-file", metavar="FILE", help="per-tensor noise written by tensordiff noise")
    d.add_argument("--noise-factor", type=float, default=3.0, help="allowed multiple of the measured noise (default 3)")
    d.add_argument("--jump", type=float, default=3.0, help="error growth that counts as introduced (default 3x)")
    d.add_argument("--no-order", action="store_true", help="do not match leftovers by execution order and shape")
    d.add_argument("--no-hints", action="store_true", help="do not test likely causes at the first divergence")
    d.add_argument("--phase", action="append", help="show only this phase (repeatable)")
    d.add_argument("--step", type=int, action="append", help="compare only this step (repeatable)")
    d.add_argument("--max-rows", type=int, default=40, help="rows per table before ok rows collapse (0: all)")
    d.add_argument("--json", metavar="FILE", help="also write a machine-readable report")
    d.add_argument("--width", type=int, help="table width (default: the terminal's)")
    d.add_argument("--no-color", action="store_true", help="plain text output")

    r = sub.add_parser("replay", help="run one module of A's code on B's captured inputs: introduced or inherited?",
                       description="Build the model with --model (side A's framework), load the module's weights from "
                                   "A's capture and run it on A's and on B's captured inputs. Exit 1: the difference is "
                                   "introduced in the module; 0: inherited from its inputs; 2: error.",
                       epilog="example: tensordiff replay a.h5 b.h5 --module decoder.layers.1.mlp --model examples.gpt.models:replay_model")
    r.add_argument("a")
    r.add_argument("b")
    r.add_argument("--module", required=True, help="the module (A's name) to replay")
    r.add_argument("--model", required=True, metavar="MODULE:FUNCTION", help="a function that builds side A's model")
    r.add_argument("--mapping", help="rename rules from B's names to A's (see docs/mapping.md)")
    r.add_argument("--var", action="append", default=[], metavar="NAME=VALUE")
    r.add_argument("--step", type=int, default=None, help="step to replay (default: the first in both)")
    r.add_argument("--call", type=int, default=0, help="which call of the module (default 0)")
    r.add_argument("--json", metavar="FILE")

    u = sub.add_parser("runs", help="compare two whole training runs: loss, perplexity, grad norm",
                       description="Compare the loss curves of two runs (Megatron-LM or MindFormers training logs, or "
                                   "tensordiff captures), aligned by step. Exit 0: the relative loss error stays within "
                                   "--threshold after --warmup steps; 1: it does not; 2: bad input.",
                       epilog="example: tensordiff runs megatron.log mindformers.log --threshold 0.01 --warmup 20 --plot runs.png")
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
    u.add_argument("--width", type=int)
    u.add_argument("--no-color", action="store_true")

    n = sub.add_parser("noise", help="measure one side's run-to-run noise as per-tensor tolerances",
                       description="Measure the noise of one side: from two captures of the same run (R1 R2), or by "
                                   "running COMMAND twice, the second time with every float parameter moved by one ulp "
                                   "before the first step. Writes per-tensor tolerances for diff --noise-file.",
                       epilog="example: tensordiff noise -o noise.json --steps 1 -- python train.py; "
                              "tensordiff diff a.h5 b.h5 --noise-file noise.json")
    n.add_argument("runs", nargs="*", help="R1 R2 (two captures of the same run), or -- COMMAND")
    n.add_argument("-o", "--output", required=True, help="noise file to write (JSON)")
    n.add_argument("--steps", type=int, default=1, help="with COMMAND: steps to capture (default 1)")
    n.add_argument("--seed", type=int, default=1, help="with COMMAND: seed of the one-ulp perturbation (default 1)")

    b = sub.add_parser("batch", help="write one batch file that both frameworks load",
                       description="Write a batch file (tokens, labels, loss mask, attention mask, position ids, seed) that "
                                   "each framework loads with tensordiff.batch.load(path, vocab_size, framework). With "
                                   "--check, read an existing file and check it against a vocabulary instead.",
                       epilog="example: tensordiff batch -o batch.h5 --vocab 128 --seq 16 --batch 2 --seed 0")
    b.add_argument("-o", "--output", help="batch file to write")
    b.add_argument("--vocab", type=int, help="the model's vocabulary size")
    b.add_argument("--seq", type=int, default=16, help="sequence length (default 16)")
    b.add_argument("--batch", type=int, default=2, help="sequences (default 2)")
    b.add_argument("--seed", type=int, default=0, help="seed of the ids or of the text windows (default 0)")
    b.add_argument("--text", help="take windows of this UTF-8 text file, one byte per token (needs --vocab >= 256)")
    b.add_argument("--low", type=int, default=1, help="smallest random id (default 1: id 0 is often padding)")
    b.add_argument("--check", metavar="FILE", help="check FILE (against --vocab when given) and print it")

    ls = sub.add_parser("ls", help="list the steps and phases of a capture")
    ls.add_argument("file")

    sh = sub.add_parser("show", help="show the records of a capture, with their statistics")
    sh.add_argument("file")
    sh.add_argument("pattern", nargs="?", default="", help="only modules whose name contains this text")
    sh.add_argument("--step", type=int, default=None, help="step to show (default: the first)")
    sh.add_argument("--phase", action="append", help="only this phase (repeatable)")
    sh.add_argument("--width", type=int)
    sh.add_argument("--no-color", action="store_true")

    ckpt_cli.add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command is None:
        _parser().print_help()
        return 2
    try:
        return {"capture": _capture, "diff": _diff, "runs": _runs, "replay": _replay, "noise": _noise, "batch": _batch, "ls": _ls, "show": _show,
                "ckpt": ckpt_cli.run}[args.command](args)
    except TensordiffError as err:
        print(f"tensordiff: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tensordiff: interrupted", file=sys.stderr)
        return 2


def _capture(args: argparse.Namespace) -> int:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise UsageError("no training command given; put it after '--', e.g. tensordiff capture -o run.h5 -- python train.py")
    if args.steps < 1:
        raise UsageError(f"--steps {args.steps}: capture at least 1 step")
    out = os.path.abspath(args.output)
    if os.path.exists(out):
        os.remove(out)
    status = out + ".status"
    if os.path.exists(status):
        os.remove(status)
    env = dict(os.environ, **{ENV_OUTPUT: out, ENV_STEPS: str(args.steps), ENV_TENSORS: args.tensors,
                              ENV_STATUS: status})
    try:
        code = subprocess.call(cmd, env=env)
    except FileNotFoundError:
        raise UsageError(f"cannot run {cmd[0]!r}: no such program; check the command after '--'") from None
    problems: list[str] = []
    if os.path.exists(status):
        with open(status, encoding="utf-8") as f:
            problems = [line.strip() for line in f if line.strip()]
        os.remove(status)
    if problems and not os.path.exists(out):
        script = next((part for part in cmd if part.endswith(".py")), cmd[0])
        raise UsageError(f"{script}: {problems[0]}")
    for line in problems:
        print(f"tensordiff: warning: {line}", file=sys.stderr)
    if code != 0:
        print(f"tensordiff: the training command exited with code {code}", file=sys.stderr)
        return code if 0 < code < 256 else 2
    if not os.path.exists(out) and "{rank}" not in out:
        raise UsageError(f"{cmd[0]} ran but wrote no capture to {out}: the program must call tensordiff.capture(model, ...) "
                         "or be started through a hooks/ entry point (see docs/guide.md)")
    if os.path.exists(out):
        from .store import Capture

        with Capture(out) as cap:
            print(f"tensordiff: wrote {out}: {len(cap.steps)} step(s), {sum(len(cap.records(s)) for s in cap.steps)} records, "
                  f"{cap.nbytes() / 1e6:.1f} MB")
    return 0


def _runs(args: argparse.Namespace) -> int:
    import json

    from rich.table import Table

    from .runs import compare_runs, read_run

    window = None
    if args.window:
        lo, sep, hi = args.window.partition(":")
        try:
            if not sep:
                raise ValueError
            window = (int(lo) if lo else 0, int(hi) if hi else 2**62)
        except ValueError:
            raise UsageError(f"--window {args.window}: expected LO:HI step numbers, e.g. --window 100:300 or 100:") from None
    res = compare_runs(read_run(args.a), read_run(args.b), threshold=args.threshold, warmup=args.warmup, window=window,
                       ppl_threshold=args.ppl_threshold, grad_norm_threshold=args.grad_norm_threshold)
    console = _console(args)
    console.print(f"A {res.a.describe()}")
    console.print(f"B {res.b.describe()}")
    table = Table(title=f"{len(res.steps)} common steps, judged {res.judged_text()}", title_justify="left")
    for name, justify in (("measure", "left"), ("A", "right"), ("B", "right"), ("relative", "right")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for row in res.measures():
        table.add_row(*row)
    console.print(table)
    console.print(res.verdict(), style="tensordiff.ok" if res.passed else "tensordiff.diverged")
    if args.plot or args.html:
        from .runs_report import plot_png, write_html

        png = plot_png(res)
        if args.plot:
            with open(args.plot, "wb") as fh:
                fh.write(png)
            console.print(f"plot: {args.plot}")
        if args.html:
            write_html(res, args.html, png)
            console.print(f"report: {args.html}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(res.as_dict(), fh, indent=1)
    return 0 if res.passed else 1


def _replay(args: argparse.Namespace) -> int:
    import json

    from .align import Mapping
    from .replay import load_factory, replay

    variables = dict(v.partition("=")[::2] for v in args.var)
    mapping = Mapping.load(args.mapping, variables) if args.mapping else None
    res = replay(args.a, args.b, args.module, load_factory(args.model), step=args.step, call=args.call, mapping=mapping)
    print(f"replay of {res.module} ({res.module_class}), step {res.step}, call {res.call}, with A's code:")
    print(f"  A's output vs B's output, as captured      {res.ab:10.3g}")
    print(f"  on A's inputs, vs A's output (faithful?)   {res.replay_a:10.3g}")
    print(f"  on B's inputs, vs B's output               {res.replay_b:10.3g}")
    print(f"  on B's inputs, vs A's output               {res.replay_b_vs_a:10.3g}")
    for note in res.notes:
        print(f"  note: {note}")
    print(res.sentence())
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(res.as_dict(), fh, indent=1)
    if res.verdict == "unfaithful":
        return 2
    return 1 if res.verdict == "introduced" else 0


def _noise(args: argparse.Namespace) -> int:
    import tempfile

    from . import noise as noises
    from .engine import measure_noise

    runs = list(args.runs)
    if runs and runs[0] == "--":
        runs = runs[1:]
    if len(runs) == 2 and all(r.endswith(".h5") for r in runs):
        paths, how = runs, "two captures of the same run"
        measured = measure_noise(runs[0], runs[1])
    elif runs:
        with tempfile.TemporaryDirectory(prefix="tensordiff-noise-") as tmp:
            paths = [os.path.join(tmp, "plain.h5"), os.path.join(tmp, "perturbed.h5")]
            for path, perturb in zip(paths, (None, args.seed)):
                env = dict(os.environ, **{ENV_OUTPUT: path, ENV_STEPS: str(args.steps), ENV_TENSORS: "all"})
                env.pop("TENSORDIFF_PERTURB", None)
                if perturb is not None:
                    env["TENSORDIFF_PERTURB"] = str(perturb)
                try:
                    code = subprocess.call(runs, env=env)
                except FileNotFoundError:
                    raise UsageError(f"cannot run {runs[0]!r}: no such program; check the command after '--'") from None
                if code != 0:
                    print(f"tensordiff: the training command exited with code {code}", file=sys.stderr)
                    return code if 0 < code < 256 else 2
                if not os.path.exists(path):
                    raise UsageError(f"{runs[0]} ran but wrote no capture: it must call tensordiff.capture(model, ...)")
            measured = measure_noise(paths[0], paths[1])
            how = f"one run and the same run with every float parameter moved by one ulp (seed {args.seed})"
            paths = [" ".join(runs), f"{' '.join(runs)} (perturbed)"]
    else:
        raise UsageError("tensordiff noise needs R1.h5 R2.h5, or -- COMMAND; e.g. tensordiff noise -o noise.json -- python train.py")
    noises.save(args.output, measured, paths, how)
    print(f"tensordiff: wrote {args.output}: noise of {len(measured)} tensors ({how})")
    for phase, (median, worst, count) in noises.summary(measured).items():
        print(f"  {phase:<10} {count:4d} tensors  median rel L2 {median:.1e}  max {worst:.1e}")
    return 0


def _batch(args: argparse.Namespace) -> int:
    from . import batch as batches

    if args.check:
        b = batches.read(args.check, args.vocab)
        ids = np.concatenate([b.tokens.ravel(), b.labels.ravel()])
        print(f"{args.check}: batch {b.batch_size} x seq {b.seq_length}, ids {ids.min()}..{ids.max()}, "
              f"source {b.attrs.get('source', '?')}, seed {b.attrs.get('seed', '?')}"
              + (f"; fits vocab {args.vocab}" if args.vocab else ""))
        return 0
    if not args.output or args.vocab is None:
        raise UsageError("tensordiff batch needs -o FILE and --vocab V, e.g. tensordiff batch -o batch.h5 --vocab 128 --seq 16")
    b = batches.make(args.vocab, args.seq, args.batch, seed=args.seed, text=args.text, low=args.low)
    batches.save(args.output, b)
    print(f"tensordiff: wrote {args.output}: batch {b.batch_size} x seq {b.seq_length}, vocab {args.vocab}, "
          f"{b.attrs['source']}, seed {args.seed}")
    return 0


def _console(args: argparse.Namespace):
    from .report import make_console

    return make_console(width=args.width, color=False if args.no_color or os.environ.get("NO_COLOR") else None)


def _diff(args: argparse.Namespace) -> int:
    from .align import Mapping
    from .engine import DiffOptions, diff, measure_noise
    from .report import DiffReport
    from .tolerance import Tolerances

    variables = {}
    for item in args.var:
        name, eq, value = item.partition("=")
        if not eq or not name:
            raise UsageError(f"--var {item!r}: expected NAME=VALUE, e.g. --var heads=12")
        variables[name] = value
    mapping = Mapping.load(args.mapping, variables) if args.mapping else None
    tolerances = Tolerances(override=args.rtol, noise_factor=args.noise_factor)
    if args.noise:
        tolerances.noise = measure_noise(args.noise[0], args.noise[1], mapping=None)
    if args.noise_file:
        from . import noise as noises

        tolerances.noise = {**noises.load(args.noise_file), **tolerances.noise}
    options = DiffOptions(mapping=mapping, tolerances=tolerances, order_fallback=not args.no_order, jump=args.jump,
                          steps=args.step, hints=not args.no_hints, reference=args.reference,
                          reference_mapping=Mapping.load(args.reference_mapping, variables) if args.reference_mapping else None,
                          reference_factor=args.reference_factor)
    result = diff(args.a, args.b, options)
    report = DiffReport(result, max_rows=args.max_rows, phases=args.phase, first_only=args.first_divergence)
    _console(args).print(report)
    if args.json:
        report.write_json(args.json)
    return 1 if result.first is not None else 0


def _ls(args: argparse.Namespace) -> int:
    from rich.table import Table

    from .record import PHASES
    from .store import Capture

    console = _console(argparse.Namespace(width=None, no_color=False))
    with Capture(args.file) as cap:
        console.print(f"{args.file}: {cap.nbytes() / 1e6:.2f} MB, format {cap.attrs.get('tensordiff_format')}")
        for key in ("framework", "framework_version", "megatron_core_version", "transformers_version", "model_class",
                    "rank", "world_size", "created", "argv"):
            if key in cap.attrs:
                console.print(f"  {key}: {cap.attrs[key]}")
        table = Table(title="steps", title_justify="left")
        table.add_column("step", justify="right")
        for phase in PHASES:
            table.add_column(phase, justify="right")
        table.add_column("tensors", justify="right")
        table.add_column("loss", justify="right")
        for step in cap.steps:
            recs = cap.records(step)
            counts = [str(sum(1 for r in recs if r.phase == p)) for p in PHASES]
            loss = cap.step_attrs(step).get("loss")
            table.add_row(str(step), *counts, str(sum(1 for r in recs if r.has_data and r.same_as < 0)),
                          f"{loss:.6g}" if isinstance(loss, float) else "-")
        console.print(table)
        if cap.incomplete_steps:
            console.print(f"  incomplete steps (ignored): {cap.incomplete_steps}")
        for name, values in sorted(cap.scalars().items()):
            steps = sorted(values)
            console.print(f"  scalar {name}: {len(steps)} steps ({steps[0]}..{steps[-1]}), last {values[steps[-1]]:.6g}")
    return 0


def _show(args: argparse.Namespace) -> int:
    from rich.table import Table

    from .store import Capture

    console = _console(args)
    with Capture(args.file) as cap:
        if not cap.steps:
            raise UsageError(f"{args.file}: holds no complete step")
        step = cap.steps[0] if args.step is None else args.step
        if step not in cap.steps:
            raise UsageError(f"{args.file}: no step {step}; steps are {cap.steps}")
        table = Table(title=f"{args.file} step {step}", title_justify="left")
        for col, just in (("#", "right"), ("phase", "left"), ("module · tensor", "left"), ("dtype", "left"), ("shape", "left"),
                          ("mean", "right"), ("l2", "right"), ("min", "right"), ("max", "right"), ("nan/inf", "right")):
            table.add_column(col, justify=just, overflow="fold")
        n = 0
        for r in cap.records(step):
            if args.pattern not in r.module or (args.phase and r.phase not in args.phase):
                continue
            n += 1
            table.add_row(str(r.seq), r.phase, r.label + (" (link)" if r.same_as >= 0 else ""), r.dtype,
                          "×".join(map(str, r.shape)) or "scalar", f"{r.mean:.4g}", f"{r.l2:.4g}", f"{r.min:.4g}",
                          f"{r.max:.4g}", f"{r.nan}/{r.inf}")
        console.print(table)
        if n == 0:
            raise UsageError(f"{args.file}: no record matches {args.pattern!r} in step {step}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
