"""Where a statistics capture's step time goes: the recorder's host time by part, against the plain step.

    python3 benchmarks/step_profile.py --device cuda --size 125m|1b [--steps 10]
    .venv-bench/bin/python benchmarks/step_profile.py            # the CPU model of vs_msprobe.py

The model, batches and optimizer are ``vs_msprobe.py``'s (``Job``). Plain steps are timed first: the whole step
(``torch.cuda.synchronize()`` at both ends) and the host's part of it (until ``job.step`` returns, before the
closing synchronize: what the host spends enqueueing). Then a statistics capture (``tensors="none"``) with the
recorder's entry points wrapped in timers, each part's host milliseconds a step (medians):

* ``weights``: the step's weights recorded at its first call (nothing of the model runs meanwhile);
* ``calls``: the modules' forward pre- and post-hooks, the weights excluded;
* ``grad hooks``: the gradients of the recorded activations, as backward produces them;
* ``param grads``: the parameters' gradients at the optimizer's step;
* ``end step``: ``cap.step()``, in three parts: ``gpu wait`` (a synchronize before the statistics are read: the
  GPU finishing the step's work), ``collect`` (the statistics brought to the host), ``submit`` (the step handed to
  the writer process); the rest is the rows filled in and the step's bookkeeping.

``records``: the records of a step; ``us/record``: (captured - plain) / records.

``--full``: the first captured step stores every tensor (``tensors="first"``, the kernels compiled before it); its
parts are printed on their own, with ``clones`` (starting the device copies of the stored tensors, inside the
hooks' times), then the medians of the steps after it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from vs_msprobe import GPU_SIZES, Job  # noqa: E402


def _timed(acc: dict[str, float], key: str, fn: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[key] += time.perf_counter() - t0

    return wrapper


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--size", choices=sorted(GPU_SIZES), default="125m")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--full", action="store_true", help="the first captured step stores every tensor")
    args = p.parse_args()
    for key, value in dict(layers=4, hidden=256, seq=128, batch=4, vocab=8192).items():
        setattr(args, key, value)
        setattr(args, f"{key}_set", False)
    job = Job(args)
    n = args.warmup + args.steps
    for i in range(args.warmup):
        job.step(i)
    job.sync()

    def run(cap: Any, acc: dict[str, float] | None) -> tuple[list[float], list[float], list[dict[str, float]]]:
        whole, host, parts = [], [], []
        for i in range(args.warmup, n):
            if acc is not None:
                acc.clear()
            job.sync()
            t0 = time.perf_counter()
            loss = job.step(i)
            t1 = time.perf_counter()
            if cap is not None:
                cap.step(loss)
            job.sync()
            t2 = time.perf_counter()
            whole.append(t2 - t0)
            host.append(t1 - t0)
            if acc is not None:
                parts.append(dict(acc))
        return whole, host, parts

    plain, plain_host, _ = run(None, None)

    import tensordiff
    from tensordiff.capturing.recorder import Recorder

    acc: dict[str, float] = defaultdict(float)
    originals = {name: getattr(Recorder, name) for name in ("_ensure_step", "on_call", "on_return", "_grad_hook",
                                                             "take_param_grads", "step")}
    Recorder._ensure_step = _timed(acc, "weights", originals["_ensure_step"])
    Recorder.on_call = _timed(acc, "calls+weights", originals["on_call"])
    Recorder.on_return = _timed(acc, "calls", originals["on_return"])
    Recorder._grad_hook = _timed(acc, "grad hooks", originals["_grad_hook"])
    Recorder.take_param_grads = _timed(acc, "param grads", originals["take_param_grads"])
    Recorder.step = _timed(acc, "end step", originals["step"])
    from tensordiff.capturing.torch.stats import StatsCollector

    collect = StatsCollector.collect

    def waited_collect(self: Any, handles: Any) -> Any:
        t0 = time.perf_counter()
        job.sync()
        acc["  gpu wait"] += time.perf_counter() - t0
        return _timed(acc, "  collect", collect)(self, handles)

    StatsCollector.collect = waited_collect
    from tensordiff.capturing.torch.copies import HostCopier

    copy = HostCopier.copy
    HostCopier.copy = _timed(acc, "  clones", copy)
    with tempfile.TemporaryDirectory() as tmp:
        if args.full and job.cuda:
            from tensordiff.capturing.torch.cuda_stats import fast_stats

            fast_stats(0)  # compiled and checked now, not in the step measured
        cap = tensordiff.capture(job.model, os.path.join(tmp, "c.h5"), steps=args.steps + 1, optimizer=job.opt,
                                 tensors="first" if args.full else "none")
        writer = cap._writer
        writer.submit = _timed(acc, "  submit", writer.submit)
        if not args.full:
            job.step(0)  # the kernel's compile and the first step's setup
            cap.step()
            job.sync()
        captured, cap_host, parts = run(cap, acc)
        t_close = time.perf_counter()
        cap.close()
        close_s = time.perf_counter() - t_close
        from tensordiff.store import CaptureFile

        with CaptureFile(os.path.join(tmp, "c.h5")) as c:
            records = len(c.records(c.steps[-1]))
    for name, fn in originals.items():
        setattr(Recorder, name, fn)
    StatsCollector.collect = collect
    HostCopier.copy = copy
    for row in parts:
        row["calls"] = row.get("calls", 0.0) + row.pop("calls+weights", 0.0) - row.get("weights", 0.0)
    med = statistics.median
    plain_ms = med(plain) * 1e3
    print(job.describe)
    print(f"plain step {plain_ms:.1f} ms (host enqueues for {med(plain_host) * 1e3:.1f} ms of it); records a step "
          f"{records}")
    keys = ["weights", "calls", "grad hooks", "param grads", "end step", "  gpu wait", "  collect", "  submit",
            "  clones"]
    groups = [("the full step", captured[:1], cap_host[:1], parts[:1]), ("the steps after it", captured[1:],
              cap_host[1:], parts[1:])] if args.full else [("captured", captured, cap_host, parts)]
    for title, whole, host, rows in groups:
        if not whole:
            continue
        cap_ms = med(whole) * 1e3
        print(f"{title}: {cap_ms:.1f} ms ({cap_ms / plain_ms:.2f}x; host {med(host) * 1e3:.1f} ms before cap.step); "
              f"{(cap_ms - plain_ms) * 1e3 / max(records, 1):.1f} us a record added")
        total = 0.0
        for key in keys:
            ms = med([row.get(key, 0.0) for row in rows]) * 1e3
            total += ms if not key.startswith(" ") else 0.0
            print(f"  {key:12s} {ms:8.2f} ms")
        print(f"  {'sum':12s} {total:8.2f} ms")
    if args.full:
        print(f"close() after the last step: {close_s:.1f} s (the file written)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
