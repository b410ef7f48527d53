"""Step-time overhead and file size of capture on a megatron-core GPT on the CPU.

    .venv/bin/python benchmarks/capture_overhead.py [--layers 4 --hidden 256 --steps 20] [--writer thread]

Prints the median step time of: no capture; statistics only (every step captured);
full tensors on the first step; and the capture file's size against the bytes of
the tensors it holds. Targets (DEVELOPERS.md): statistics <= 1.10x, first-step full
tensors <= 1.5x, file <= the tensors' own bytes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")

import torch  # noqa: E402

import tensordiff  # noqa: E402
from examples.gpt.models import GPTSpec, build_mcore_gpt, make_batch, mcore_loss  # noqa: E402
from tensordiff.store import CaptureFile  # noqa: E402

WRITER: str | None = None  # --writer: the capture's writer (default: tensordiff's own choice)


def run(spec: GPTSpec, steps: int, path: str | None, tensors: str, cap_steps: int) -> list[float]:
    model = build_mcore_gpt(spec, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    batches = [make_batch(spec, seed=i) for i in range(steps)]
    with tensordiff.capture(model, path, steps=cap_steps, optimizer=opt, tensors=tensors, writer=WRITER) as cap:
        for tokens, labels, _ in batches:
            t0 = time.perf_counter()
            loss = mcore_loss(model, tokens, labels)
            loss.backward()
            opt.step()
            opt.zero_grad()
            cap.step(loss)
            times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--writer", choices=("process", "thread"), help="the capture's writer (default: its own choice)")
    args = p.parse_args()
    global WRITER
    WRITER = args.writer
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    spec = GPTSpec(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=max(1, args.hidden // 64),
                   vocab_size=8192, seq_length=args.seq, batch_size=args.batch)
    model = build_mcore_gpt(spec, seed=1)
    nparams = sum(p.numel() for p in model.parameters())
    print(f"megatron-core GPT: {nparams / 1e6:.2f} M parameters, batch {args.batch}x{args.seq}, {args.steps} steps, "
          f"{torch.get_num_threads()} threads")
    with tempfile.TemporaryDirectory() as tmp:
        run(spec, 3, None, "none", 1)  # warm-up
        base = run(spec, args.steps, None, "none", 1)
        stats_path = os.path.join(tmp, "stats.h5")
        stats = run(spec, args.steps, stats_path, "none", args.steps)
        full_path = os.path.join(tmp, "full.h5")
        full = run(spec, args.steps, full_path, "first", args.steps)
        med = statistics.median(base)
        print(f"plain step             {med * 1e3:8.1f} ms")
        print(f"statistics, every step {statistics.median(stats) * 1e3:8.1f} ms  {statistics.median(stats) / med:5.2f}x")
        print(f"full tensors, step 0   {full[0] * 1e3:8.1f} ms  {full[0] / med:5.2f}x  (then statistics: "
              f"{statistics.median(full[1:]) / med:.2f}x)")
        with CaptureFile(full_path) as cap:
            recs = cap.records(0)
            raw = sum(r.numel * (2 if r.dtype in ("bfloat16", "float16") else 8 if r.dtype in ("int64", "float64") else 4)
                      for r in recs if r.has_data and r.same_as < 0)
        size = os.path.getsize(full_path)
        print(f"file {size / 1e6:.1f} MB for {args.steps} steps; step-0 tensors hold {raw / 1e6:.1f} MB "
              f"({size / raw:.2f}x the tensors' bytes); statistics-only file {os.path.getsize(stats_path) / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
