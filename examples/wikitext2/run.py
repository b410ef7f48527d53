"""Megatron-LM vs MindFormers on WikiText-2, whole training runs, in one command.

    python examples/wikitext2/run.py --data ../shared/data/wikitext-2          # or: make wikitext2
    python examples/wikitext2/run.py --data DIR --steps 50 --out /tmp/wt2       # a quicker look

1. tokenizes WikiText-2 with the GPT-2 BPE (prepare.py) into one shared batch order;
2. trains the GPT-2-shaped megatron-core GPTModel (CPU, FP32) and saves its initial weights;
3. converts them with ``tensordiff ckpt convert`` to MindFormers' names;
4. trains MindFormers' GPTModel from them on the same batches;
5. ``tensordiff diff`` of the first step, every tensor (does it start the same?);
6. ``tensordiff runs`` of the whole runs: table, plot (runs.png), HTML report, JSON.

Prints every command (the workflow to copy for your own models). Exit code: ``tensordiff runs``'s
(0 the loss curves agree within --threshold after --warmup, 1 they do not, 2 bad input).
The WikiText-2 text is read from --data or $TENSORDIFF_WIKITEXT2 and is not copied anywhere.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)

from examples.megatron_vs_mindformers.run import _run  # noqa: E402
from examples.wikitext2.common import Train  # noqa: E402
from examples.wikitext2.prepare import DataError, data_dir  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", help="WikiText-2 folder with valid.txt and test.txt (default $TENSORDIFF_WIKITEXT2)")
    p.add_argument("--steps", type=int, default=Train.steps, help=f"training steps (default {Train.steps})")
    p.add_argument("--out", help="output folder (default out/wikitext2)")
    p.add_argument("--threshold", type=float, default=0.01, help="largest relative loss error allowed (default 1%%)")
    p.add_argument("--warmup", type=int, default=10, help="steps not judged at the start (default 10)")
    p.add_argument("--megatron-gelu", choices=("tanh", "erf"), default="tanh",
                   help="Megatron's GELU: tanh matches MindFormers (default); erf (torch's F.gelu default) is a "
                        "deliberate first-step difference to see what the curves make of it")
    p.add_argument("--verbose", action="store_true", help="show the frameworks' own output")
    args = p.parse_args(argv)
    try:
        data = data_dir(args.data)
    except DataError as err:
        print(f"run.py: error: {err}", file=sys.stderr)
        return 2
    out = os.path.abspath(args.out or os.path.join(ROOT, "out", "wikitext2"))
    os.makedirs(out, exist_ok=True)
    py, td = sys.executable, [sys.executable, "-m", "tensordiff"]
    f = {k: os.path.join(out, v) for k, v in (
        ("tokens", "tokens.h5"), ("ckpt", "init.safetensors"), ("ms_ckpt", "init.ckpt"), ("a", "megatron.h5"),
        ("log", "megatron.log"), ("b", "mindformers.h5"), ("diff", "first_step.json"), ("png", "runs.png"),
        ("html", "runs.html"), ("json", "runs.json"))}
    steps = str(args.steps)
    pipeline = [
        [py, os.path.join(HERE, "prepare.py"), "--data", data, "-o", f["tokens"]],
        [py, os.path.join(HERE, "megatron_train.py"), "--tokens", f["tokens"], "--steps", steps,
         "--save-ckpt", f["ckpt"], "--capture", f["a"], "--log", f["log"], "--gelu", args.megatron_gelu],
        td + ["ckpt", "convert", f["ckpt"], f["ms_ckpt"], "--mapping", "mcore-mindformers", "--to", "mindformers",
              "--var", "norm=layernorm", "--var", "fc1_layout=stacked", "--var", "heads=4", "--var", "groups=4"],
        [py, os.path.join(HERE, "mindformers_train.py"), "--tokens", f["tokens"], "--steps", steps,
         "--load-ckpt", f["ms_ckpt"], "--capture", f["b"]],
    ]
    for cmd in pipeline:
        code = _run(cmd, quiet=not args.verbose, cwd=out)  # MindFormers writes ./output/log: keep it in --out
        if code != 0:
            print(f"run.py: the step above failed with exit code {code}", file=sys.stderr)
            return 2
    print("\nThe first step, tensor by tensor:", flush=True)
    code = _run(td + ["diff", f["a"], f["b"], "--mapping", "mcore-mindformers", "--var", "fc1_layout=stacked",
                      "--first-divergence", "--max-rows", "8", "--json", f["diff"]], quiet=False, cwd=out)
    if code == 2:
        return 2
    print(f"\nThe whole runs ({args.steps} steps):", flush=True)
    return _run(td + ["runs", f["a"], f["b"], "--threshold", str(args.threshold), "--warmup", str(args.warmup),
                      "--plot", f["png"], "--html", f["html"], "--json", f["json"]], quiet=False, cwd=out)


if __name__ == "__main__":
    sys.exit(main())
