"""Host and device cost of one statistics reduction on CUDA (``StatsCollector.add``), by tensor size.

    python3 benchmarks/stats_kernel.py [--dtype bf16] [--reps 1000]

Prints host microseconds per call (the time the training thread spends starting the reduction), total
microseconds per call after a synchronize, and the bandwidth it reaches; then the host cost of one plain
``torch.add_`` launch on the same machine, for scale. Needs a CUDA GPU. ``TENSORDIFF_STATS_KERNEL=nvrtc`` (the
default: the CUDA C kernel launched through ctypes), ``triton`` or ``eager`` chooses the kernel measured.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from tensordiff.capturing.torch.stats import StatsCollector, triton_available

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--reps", type=int, default=1000, help="calls per size below 4Mi values (20 above)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("stats_kernel: needs a CUDA GPU; nothing measured", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, fused Triton kernel: {triton_available()}")
    collector = StatsCollector()
    for n in (4096, 1 << 20, 8 << 20, 134 << 20):
        x = torch.randn(n, device="cuda", dtype=torch.float32).to(DTYPES[args.dtype])
        handles = [collector.add(x) for _ in range(5)]
        collector.collect(handles)
        if n == 4096:
            from tensordiff.capturing.torch.cuda_stats import fast_stats_why

            used = "nvrtc" if collector._fast not in (None, False) else ("triton" if triton_available() else "eager")
            print(f"kernel: {used} {fast_stats_why()}")
        reps = args.reps if n < (1 << 22) else 20
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        handles = [collector.add(x) for _ in range(reps)]
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        collector.collect(handles)
        gbs = x.element_size() * n * reps / (t2 - t0) / 1e9
        print(f"{n:>11} values: host {1e6 * (t1 - t0) / reps:7.1f} us/call, total {1e6 * (t2 - t0) / reps:9.1f} us/call,"
              f" {gbs:7.1f} GB/s")
    y = torch.zeros(1, device="cuda")
    for _ in range(10):
        y.add_(1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.reps):
        y.add_(1)
    print(f"for scale, one torch add_ launch: host {1e6 * (time.perf_counter() - t0) / args.reps:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
