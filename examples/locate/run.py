"""From the curve to the layer, on the CPU: two long runs that part after a while, the step, the layer, the cause.

    python examples/locate/run.py                 # both modes (own state, shared state); files in out/locate/
    python examples/locate/run.py --iters 40      # shorter runs
    python examples/locate/run.py --variant beta2 # B with Adam beta2 0.95: a shared resume erases it (exit 3)

Two runs of ``examples/megatron_loop/train.py`` (megatron-core's schedule, DDP, distributed optimizer, Adam, clipping,
megatron-core's learning-rate scheduler; Megatron-LM's flags) from one seed and one batch, each checkpointing every
10 iterations (``--save``, Megatron-LM's ``torch_dist`` folders) and each captured whole with statistics only
(``tensordiff capture --megatron --tensors none``: every layer, every step). They differ in one setting that only
shows after a while: B's cosine learning-rate decay runs over 100 iterations instead of A's 300 (a horizon written
in other units, as happens between frameworks: epochs vs iterations, samples vs steps). During the 5 warm-up
iterations their learning rates are equal; after them, B's falls faster.

Then, as a user would:

1. ``tensordiff runs a.log b.log`` names the iteration K where the loss curves part (and, from the two statistics
   captures, which layer drifts first: the heat map in ``runs.html``);
2. ``tensordiff locate ... --mode shared --run`` resumes both runs from A's checkpoint before K, captures the
   iterations up to K+1 with full tensors and names the first divergence: the weights after the first resumed
   iteration, with the optimizer-step hint "B's update is 0.95 × A's for every parameter" (the learning rate);
3. ``tensordiff locate ... --mode own --run`` resumes each run from its own checkpoint: the weights had already
   drifted at J, and the report says by how much.

It prints every command it runs. Exit 0 when every stage ran (the verdicts are in the output and the JSON files).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TRAIN = os.path.join(ROOT, "examples", "megatron_loop", "train.py")


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))


def _shown(cmd: list[str]) -> str:
    return " ".join(shlex.quote(os.path.relpath(c, ROOT) if os.path.isabs(c) and c.startswith(ROOT) else c)
                    for c in cmd)


def tensordiff(*args: str, cwd: str, log: str | None = None) -> int:
    """``tensordiff ARGS`` (shown as the user types it), its output printed or written to ``log``."""
    cmd = ["tensordiff", *args]
    print(f"$ {_shown(cmd)}", flush=True)
    real = [sys.executable, "-m", "tensordiff", *args]
    if log is None:
        return subprocess.call(real, env=_env(), cwd=cwd)
    with open(log, "w", encoding="utf-8") as fh:
        code = subprocess.call(real, env=_env(), cwd=cwd, stdout=fh, stderr=subprocess.STDOUT)
    if code != 0:
        with open(log, encoding="utf-8", errors="replace") as fh:
            print(fh.read()[-4000:], file=sys.stderr)
    return code


def train_command(iters: int, decay_iters: int, save: str, beta2: float = 0.999) -> list[str]:
    """One run, as Megatron-LM flags write it (``python`` is the interpreter running this example)."""
    return ["python", TRAIN, "--data", "batch.h5", "--train-iters", str(iters), "--lr", "1e-3", "--min-lr", "1e-4",
            "--lr-decay-style", "cosine", "--lr-warmup-iters", "5", "--lr-decay-iters", str(decay_iters),
            "--adam-beta2", str(beta2), "--save", save, "--save-interval", "10"]


#: What B changes (``--variant``): (A's decay iterations, B's; A's Adam beta2, B's).
VARIANTS = {"decay": ((300, 100), (0.999, 0.999)), "beta2": ((300, 300), (0.999, 0.95))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=60, help="training iterations of each run (default 60)")
    p.add_argument("--out", default=os.path.join(ROOT, "out", "locate"))
    p.add_argument("--mode", choices=("both", "own", "shared"), default="both")
    p.add_argument("--reuse", action="store_true", help="keep the two runs of an earlier call (same --iters)")
    p.add_argument("--variant", choices=sorted(VARIANTS), default="decay",
                   help="what B changes: decay (its cosine decay over 100 iterations, default) or beta2 (Adam's "
                        "beta2 0.95 for 0.999: a setting --mode shared's resume restores from A's state)")
    args = p.parse_args(argv)
    out = os.path.abspath(args.out)
    marker = os.path.join(out, "runs.done")
    done = ""
    if args.reuse and os.path.exists(marker):
        with open(marker, encoding="utf-8") as fh:
            done = fh.read()
    (decay_a, decay_b), (beta_a, beta_b) = VARIANTS[args.variant]
    cmd = {"a": train_command(args.iters, decay_a, "ckpt_a", beta_a), "b": train_command(args.iters, decay_b, "ckpt_b", beta_b)}
    if done != f"{args.iters} {args.variant}":
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        if tensordiff("batch", "-o", "batch.h5", "--vocab", "128", "--seq", "16", "--batch", "4", cwd=out,
                      log=os.path.join(out, "batch.log")):
            return 2
        for name in ("a", "b"):  # each run whole, with statistics every step
            code = tensordiff("capture", "--megatron", "-o", f"{name}.h5", "--tensors", "none", "--steps",
                              str(args.iters), "--", *cmd[name], cwd=out, log=os.path.join(out, f"{name}.log"))
            if code:
                return 2
        with open(marker, "w") as fh:
            fh.write(f"{args.iters} {args.variant}")
    code = tensordiff("runs", "a.log", "b.log", "--json", "runs.json", "--html", "runs.html", cwd=out)
    if code not in (0, 1):
        return 2
    tensordiff("runs", "a.h5", "b.h5", "--json", "drift.json", "--html", "drift.html", cwd=out)
    with open(os.path.join(out, "runs.json"), encoding="utf-8") as fh:
        k = json.load(fh)["first_step_over_threshold"]
    print(f"\nThe curves part at iteration {k}.\n", flush=True)
    modes = ("shared", "own") if args.mode == "both" else (args.mode,)
    for mode in modes:
        code = tensordiff("locate", "a.log", "b.log", "--ckpt-a", "ckpt_a", "--ckpt-b", "ckpt_b",
                          "--cmd-a", shlex.join(cmd["a"]), "--cmd-b", shlex.join(cmd["b"]),
                          "--mode", mode, "--run", "--out", mode, "--json", f"locate_{mode}.json", cwd=out)
        if code not in (0, 1, 3):
            return 2
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
