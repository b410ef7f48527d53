"""The tiny megatron-core GPT of ``examples/gpt/train.py`` trained under msprobe's ``PrecisionDebugger``: the same
weights (``--seed``), batches, optimizer and faults as ``train.py``, so its dump and a tensordiff capture of
``train.py`` describe one run.

    benchmarks/setup_bench_env.sh        # once: .venv-bench with msprobe (PyPI: mindstudio-probe)
    .venv-bench/bin/python benchmarks/msprobe_dump.py --out /tmp/ms [--task tensor|statistics] [--level L0|L1|mix]
        [--steps 1] [--fault ln-eps]
    tensordiff diff /tmp/ms a.h5         # the dump folder read as a capture (tensordiff/store/msprobe.py)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
warnings.filterwarnings("ignore")


def main(argv: list[str] | None = None) -> list[float]:
    from examples.gpt.train import FAULTS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="msprobe's dump_path (created)")
    p.add_argument("--task", choices=("tensor", "statistics"), default="tensor")
    p.add_argument("--level", choices=("L0", "L1", "mix"), default="L0")
    p.add_argument("--steps", type=int, default=1, help="training steps, all dumped")
    p.add_argument("--fault", choices=sorted(FAULTS), default="none")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args(argv)

    import torch
    from msprobe.pytorch import PrecisionDebugger

    from examples.gpt.models import GPTSpec, make_batch
    from examples.gpt.train import build, optimizer_for

    os.makedirs(args.out, exist_ok=True)
    config = {"task": args.task, "dump_path": args.out, "rank": [], "step": list(range(args.steps)),
              "level": args.level, "async_dump": False,
              args.task: {"scope": [], "list": [], "data_mode": ["all"]}}
    if args.task == "statistics":
        config[args.task]["summary_mode"] = "statistics"
    cfg = os.path.join(args.out, "msprobe_config.json")
    with open(cfg, "w") as fh:
        json.dump(config, fh, indent=1)
    spec = GPTSpec(num_layers=args.layers)
    model, loss_fn = build(argparse.Namespace(fault=args.fault, seed=args.seed, load_ckpt=None, save_ckpt=None,
                                              framework="mcore"), spec)
    opt = optimizer_for(model, args.fault, args.lr)
    debugger = PrecisionDebugger(config_path=cfg)
    losses = []
    for step in range(args.steps):
        tokens, labels, _ = make_batch(spec, seed=step)
        debugger.start(model)
        loss = loss_fn(model, tokens, labels)
        loss.backward()
        debugger.stop()
        opt.step()
        opt.zero_grad(set_to_none=True)
        debugger.step()
        losses.append(loss.item())
        print(f"step {step}: loss {loss.item():.6f}", flush=True)
    del torch
    return losses


if __name__ == "__main__":
    main()
