"""Host time capture adds per record, on the CPU, with tensors so small that the reductions cost next to nothing.

    python benchmarks/record_cost.py [--layers 50] [--steps 10] [--no-reductions] [--profile 25]

A stack of ``--layers`` blocks (LayerNorm, Linear, GELU, Linear) of width 8 on a [2, 8] batch, SGD: ~26 records a
block a step. Times plain steps, then steps under a statistics-only capture, and prints the host microseconds each
record adds ((captured - plain) / records). ``--no-reductions`` replaces the statistics with a constant row, leaving
what the recorder itself costs (hooks, rows, the handover to the writer); ``--profile N`` prints cProfile's top N
entries of five captured steps.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import tempfile
import time

if __package__ in (None, "") and "tensordiff" not in sys.modules:  # run as a file: the repository root importable
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

import tensordiff
from tensordiff.store import CaptureFile


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=50)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--no-reductions", action="store_true")
    p.add_argument("--profile", type=int, default=0, metavar="N")
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    if args.no_reductions:
        from tensordiff.capturing.torch import adapter

        adapter.TorchTensors.stats = lambda self, t: (0.0, 0.0, 0.0, 0.0, 0.0, 0.0)  # type: ignore[method-assign]
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 8), torch.nn.GELU(),
                                                      torch.nn.Linear(8, 8)) for _ in range(args.layers)])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(2, 8)

    def step() -> torch.Tensor:
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    def timed(n: int, cap=None) -> list[float]:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            loss = step()
            if cap is not None:
                cap.step(loss)
            out.append(time.perf_counter() - t0)
        return out

    timed(5)
    plain = statistics.median(timed(args.steps))
    path = os.path.join(tempfile.mkdtemp(prefix="td-record-cost-"), "cost.h5")
    with tensordiff.capture(model, path, steps=args.steps + 7, optimizer=opt, tensors="none") as cap:
        timed(1, cap)  # the first captured step also records the weights
        captured = statistics.median(timed(args.steps, cap))
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            timed(5, cap)
            prof.disable()
    with CaptureFile(path) as c:
        records = len(c.records(c.steps[-1]))
    os.remove(path)
    what = "recorder only (no reductions)" if args.no_reductions else "with reductions"
    print(f"record_cost ({what}): plain step {plain * 1e3:.2f} ms, captured {captured * 1e3:.2f} ms, {records} records "
          f"a step: {(captured - plain) / records * 1e6:.1f} us of host time a record")
    if args.profile:
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(args.profile)
        print(text.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
