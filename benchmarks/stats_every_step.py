"""What statistics on every step cost: a megatron-core GPT trained on the CPU without capture and with
``tensors="none"`` captured on every step (what ``tensordiff runs`` needs for its layer drift table).

    .venv/bin/python benchmarks/stats_every_step.py [--layers 2 8 --hidden 256 --steps 20 --repeat 3]

Each setting runs in turns (plain, statistics, plain, statistics, ...; ``--repeat`` rounds), on the same model,
seed and batches, after a warm-up, so that a shared machine's load falls on both alike. Prints, per layer count: the
median step time of each, their ratio, the records per step, and the host microseconds each record adds
((statistics - plain) / records). A step runs from the batch to the end of ``cap.step(loss)``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling capture_overhead.py

import capture_overhead  # noqa: E402
import torch  # noqa: E402

from examples.gpt.models import GPTSpec, build_mcore_gpt  # noqa: E402
from tensordiff.store import CaptureFile  # noqa: E402


def run(spec: GPTSpec, steps: int, path: str | None) -> list[float]:
    """Step times of ``steps`` steps, captured on every step to ``path`` (statistics only) or not at all: the training
    loop of capture_overhead.py."""
    return capture_overhead.run(spec, steps, path, "none", steps)


def measure(layers: int, args: argparse.Namespace, tmp: str) -> dict:
    spec = GPTSpec(num_layers=layers, hidden_size=args.hidden, num_attention_heads=max(1, args.hidden // 64),
                   vocab_size=8192, seq_length=args.seq, batch_size=args.batch)
    nparams = sum(p.numel() for p in build_mcore_gpt(spec, seed=1).parameters())
    run(spec, args.warmup, None)
    run(spec, args.warmup, os.path.join(tmp, "warm.h5"))
    plain: list[float] = []
    stats: list[float] = []
    path = os.path.join(tmp, f"stats{layers}.h5")
    for _ in range(args.repeat):
        plain += run(spec, args.steps, None)
        stats += run(spec, args.steps, path)
    with CaptureFile(path) as cap:
        records = len(cap.records(cap.steps[-1]))
        captured = len(cap.steps)
    mp, ms = statistics.median(plain), statistics.median(stats)
    return {"layers": layers, "params_m": round(nparams / 1e6, 2), "plain_ms": round(mp * 1e3, 2),
            "stats_ms": round(ms * 1e3, 2), "ratio": round(ms / mp, 3), "records_per_step": records,
            "us_per_record": round((ms - mp) / records * 1e6, 1), "steps_captured": captured,
            "file_kb_per_step": round(os.path.getsize(path) / captured / 1e3, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, nargs="+", default=[2, 8])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=20, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeat", type=int, default=3, help="rounds of (plain, statistics)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: the cores)")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    torch.set_num_threads(args.threads or max(1, os.cpu_count() or 1))
    print(f"megatron-core GPT on the CPU, hidden {args.hidden}, batch {args.batch}x{args.seq}, {args.repeat} x "
          f"{args.steps} timed steps per setting, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print("| layers | parameters | plain step ms | statistics every step ms | x plain | records / step | "
          "host µs / record | file kB / step |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for layers in args.layers:
            r = measure(layers, args, tmp)
            rows.append(r)
            print(f"| {r['layers']} | {r['params_m']} M | {r['plain_ms']} | {r['stats_ms']} | {r['ratio']:.2f} | "
                  f"{r['records_per_step']} | {r['us_per_record']} | {r['file_kb_per_step']} |", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
