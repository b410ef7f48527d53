"""Megatron vs MindSpore, end to end, in one command: one batch, one checkpoint, two captures, one diff.

    python examples/megatron_vs_mindformers/run.py --family llama
    python examples/megatron_vs_mindformers/run.py --family llama --fault split-with-size
    python examples/megatron_vs_mindformers/run.py --family gpt2 --fault gelu-approx
    python examples/megatron_vs_mindformers/run.py --family llama --graph     # the MindSpore side in GRAPH_MODE
    python examples/megatron_vs_mindformers/run.py --family llama --jit       # PyNative, its train step mindspore.jit
    python examples/megatron_vs_mindformers/run.py --family llama --no-loss-mask   # labels and no loss_mask= passed
    python examples/megatron_vs_mindformers/run.py --family llama --fault split-with-size \
        --reuse-megatron out/megatron_vs_mindformers/llama    # the MindSpore side again, against that Megatron run

Prints every command it runs (the workflow to copy for your own models) and exits with
``tensordiff diff``'s code: 0 no divergence, 1 divergence, 2 error. Files go to --out.

The Megatron side (the batch, its capture, the checkpoint and its conversion) depends on ``--family`` and ``--steps``
only: ``--reuse-megatron DIR`` takes those four files from an earlier run's output folder of the same family and steps
(``run.json`` there says which) and runs only the MindSpore side and the diff.
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
sys.path.insert(0, ROOT)

from examples.megatron_vs_mindformers.mindspore_side import FAULTS  # noqa: E402
from examples.megatron_vs_mindformers.spec import FAMILIES  # noqa: E402

#: per family: (checkpoint table, its --var values, capture mapping, its --var values); no capture mapping:
#: tensordiff diff picks the built-in one (and its variables) from the two captures and says which
SETUP: dict[str, tuple[str, list[str], str | None, list[str]]] = {
    "gpt2": (os.path.join(HERE, "ms_gpt_pair.yaml"), [], os.path.join(HERE, "ms_gpt_pair.yaml"), []),
    "llama": ("mcore-mindformers", ["heads=4", "groups=4"], None, []),
    "llama-stacked": ("mcore-mindformers", ["heads=4", "groups=4", "fc1_layout=stacked"], None, []),
    "llama-legacy": ("mcore-mindformers-llama", ["heads=4", "groups=4"], None, []),
    "qwen3": ("mcore-mindformers", ["heads=4", "groups=2"], None, []),
}


def _run(cmd: list[str], quiet: bool, cwd: str) -> int:
    shown = " ".join(shlex.quote(os.path.relpath(c, ROOT) if os.path.isabs(c) and c.startswith(ROOT) else c) for c in cmd)
    print(f"$ {shown}", flush=True)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if quiet:  # the frameworks' own start-up chatter goes to a log next to the outputs
        proc = subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout.splitlines():
            if line.startswith(("tensordiff", "megatron-core", "mindspore ", "mindformers step", "prepare.py")):
                print("  " + line)
        if proc.returncode != 0:  # show what went wrong in full
            print(proc.stdout[-6000:], file=sys.stderr)
        return proc.returncode
    return subprocess.call(cmd, env=env, cwd=cwd)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=sorted(FAMILIES), default="llama")
    p.add_argument("--fault", choices=sorted(FAULTS), default="none", help="one mistake on the MindSpore side")
    p.add_argument("--out", help="output folder (default out/megatron_vs_mindformers/FAMILY[-FAULT][-graph])")
    p.add_argument("--steps", type=int, default=2, help="training steps to capture (default 2)")
    p.add_argument("--graph", action="store_true", help="run the MindSpore side in GRAPH_MODE (captured through probes "
                                                        "compiled into the graph)")
    p.add_argument("--jit", action="store_true", help="the MindSpore side in PyNative with its train step a "
                                                      "mindspore.jit function (captured through the same probes)")
    p.add_argument("--no-loss-mask", action="store_true", help="call the MindFormers model with labels and no "
                                                               "loss_mask= (it builds its own from the ids)")
    p.add_argument("--reuse-megatron", metavar="DIR",
                   help="take the batch, the Megatron capture and the checkpoints from DIR, an earlier run's --out of "
                        "the same --family and --steps, instead of making them again")
    p.add_argument("--verbose", action="store_true", help="show the frameworks' own output")
    args = p.parse_args(argv)
    if args.graph and args.jit:
        p.error("--graph and --jit: one or the other")
    side_a = {"family": args.family, "steps": args.steps}  # what the Megatron side's files depend on
    spec = FAMILIES[args.family]
    table, table_vars, mapping, mapping_vars = SETUP[args.family]
    name = args.family + ("" if args.fault == "none" else f"-{args.fault}") + ("-graph" if args.graph else "") \
        + ("-jit" if args.jit else "") + ("-nolossmask" if args.no_loss_mask else "")
    out = os.path.abspath(args.out or os.path.join(ROOT, "out", "megatron_vs_mindformers", name))
    os.makedirs(out, exist_ok=True)
    py, td = sys.executable, [sys.executable, "-m", "tensordiff"]
    table_args = [a for v in table_vars for a in ("--var", v)]
    mapping_args = [a for v in mapping_vars for a in ("--var", v)]
    f = {k: os.path.join(out, v) for k, v in (("batch", "batch.h5"), ("ckpt", "init.safetensors"),
                                              ("ms_ckpt", "init.ckpt"), ("a", "megatron.h5"), ("b", "mindspore.h5"),
                                              ("json", "report.json"))}
    steps = [
        td + ["batch", "-o", f["batch"], "--vocab", str(spec.vocab_size), "--seq", str(spec.seq_length),
              "--batch", str(spec.batch_size), "--seed", "0"],
        # --tensors all: the GQA mapping un-repeats KV heads, which statistics alone cannot follow after step 0
        td + ["capture", "-o", f["a"], "--steps", str(args.steps), "--tensors", "all", "--", py,
              os.path.join(HERE, "megatron_side.py"),
              "--family", args.family, "--batch", f["batch"], "--save-ckpt", f["ckpt"], "--train-steps", str(args.steps)],
        td + ["ckpt", "convert", f["ckpt"], f["ms_ckpt"], "--mapping", table,
              "--to", "mindspore" if args.family == "gpt2" else "mindformers"] + table_args,
        td + ["capture", "-o", f["b"], "--steps", str(args.steps), "--tensors", "all", "--", py,
              os.path.join(HERE, "mindspore_side.py"),
              "--family", args.family, "--batch", f["batch"], "--load-ckpt", f["ms_ckpt"], "--fault", args.fault,
              "--train-steps", str(args.steps)] + (["--graph"] if args.graph else []) + (["--jit"] if args.jit else [])
            + (["--no-loss-mask"] if args.no_loss_mask else []),
    ]
    if args.reuse_megatron:
        src = os.path.abspath(args.reuse_megatron)
        try:
            with open(os.path.join(src, "run.json"), encoding="utf-8") as fh:
                made = json.load(fh)
        except (OSError, ValueError) as err:
            print(f"run.py: --reuse-megatron {src}: no run.json of an earlier run.py there ({err})", file=sys.stderr)
            return 2
        if made != side_a:
            print(f"run.py: --reuse-megatron {src}: made for {made}, this run is {side_a}", file=sys.stderr)
            return 2
        for key in ("batch", "ckpt", "ms_ckpt", "a"):
            shutil.copyfile(os.path.join(src, os.path.basename(f[key])), f[key])
        print(f"run.py: the batch, the Megatron capture and the checkpoints from {src}", flush=True)
        steps = steps[3:]  # the MindSpore side only
    for cmd in steps:
        code = _run(cmd, quiet=not args.verbose, cwd=out)  # MindFormers writes ./output/log: keep it in --out
        if code != 0:
            print(f"run.py: the step above failed with exit code {code}", file=sys.stderr)
            return 2
    with open(os.path.join(out, "run.json"), "w", encoding="utf-8") as fh:
        json.dump(side_a, fh)
    return _run(td + ["diff", f["a"], f["b"]] + (["--mapping", mapping] if mapping else []) + mapping_args +
                ["--first-divergence", "--json", f["json"]], quiet=False, cwd=out)


if __name__ == "__main__":
    sys.exit(main())
