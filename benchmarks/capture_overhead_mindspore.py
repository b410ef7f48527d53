"""Step-time overhead and file size of capture on a MindFormers GPTModel on the CPU (MindSpore PyNative or graph).

    .venv/bin/python benchmarks/capture_overhead_mindspore.py [--layers 4 --hidden 256 --steps 12] [--graph]

``--graph`` runs GRAPH_MODE (capture through probes compiled into the graph) and also reports the steps after
the capture, and the one that compiles the graph again without the probes.

Prints the median step time of: no capture; statistics only (every step captured); full
tensors on the first step; and the capture file's size against the bytes of the tensors
it holds. Run from a scratch directory if you mind MindFormers' ./output/log.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")

import mindspore as ms  # noqa: E402
import numpy as np  # noqa: E402

import tensordiff  # noqa: E402
from examples.megatron_vs_mindformers.spec import FAMILIES  # noqa: E402
from tensordiff.batch import make  # noqa: E402
from tensordiff.compat import mindformers_cpu  # noqa: E402
from tensordiff.store import CaptureFile  # noqa: E402


def build(spec):
    from examples.megatron_vs_mindformers.mf_models import _gpt_model

    ms.set_seed(1)
    model = _gpt_model(spec)
    model.set_train(True)
    return model


def run(spec, steps: int, path: str | None, tensors: str, cap_steps: int, graph: bool = False) -> list[float]:
    model = build(spec)
    if graph:
        mindformers_cpu.enable_graph(model)
    batches = []
    for i in range(steps):
        b = make(spec.vocab_size, spec.seq_length, spec.batch_size, seed=i)
        batches.append({k: ms.Tensor(v.astype(np.int32) if v.dtype == np.int64 else v) for k, v in b.arrays().items()})
    opt = ms.nn.AdamWeightDecay(model.trainable_params(), learning_rate=1e-4)

    def loss_fn(b):
        return model(b["tokens"], labels=b["labels"], attention_mask=b["attention_mask"], loss_mask=b["loss_mask"])[0]

    grad_fn = ms.value_and_grad(loss_fn, None, opt.parameters)
    times = []
    with tensordiff.capture(model, path, steps=cap_steps, optimizer=opt, tensors=tensors) as cap:
        for b in batches:
            t0 = time.perf_counter()
            loss, grads = grad_fn(ms.mutable(b) if graph else b)
            opt(grads)
            cap.step(loss)
            times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--graph", action="store_true", help="GRAPH_MODE: capture through probes compiled into the graph")
    args = p.parse_args()
    mindformers_cpu.init_mindformers_cpu(seed=1)  # sets PyNative: graph mode after it
    mindformers_cpu.enable()
    if args.graph:
        ms.set_context(mode=ms.GRAPH_MODE)
    spec = replace(FAMILIES["llama"], num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=4 * args.hidden,
                   num_attention_heads=max(1, args.hidden // 64), num_query_groups=max(1, args.hidden // 64),
                   vocab_size=8192, seq_length=args.seq, batch_size=args.batch)
    nparams = sum(int(np.prod(p.shape)) for p in build(spec).trainable_params())
    print(f"MindFormers parallel_core GPTModel: {nparams / 1e6:.1f}M parameters, batch {args.batch}x{args.seq}, "
          f"MindSpore {ms.__version__} {'GRAPH_MODE' if args.graph else 'PyNative'} CPU")
    warm = 2
    with tempfile.TemporaryDirectory() as tmp:
        g = args.graph
        plain = run(spec, args.steps, None, "none", 1, g)
        base = plain[warm:]
        stats_path = os.path.join(tmp, "stats.h5")
        stats = run(spec, args.steps, stats_path, "none", args.steps, g)[warm:]
        full_path = os.path.join(tmp, "full.h5")
        full = run(spec, args.steps, full_path, "first", 1, g)
        t_base = statistics.median(base)
        print(f"plain step                         {t_base * 1e3:8.1f} ms")
        print(f"statistics, every step             {statistics.median(stats) * 1e3:8.1f} ms  "
              f"{statistics.median(stats) / t_base:.2f}x")
        print(f"full tensors, first step           {full[0] * 1e3:8.1f} ms  {full[0] / t_base:.2f}x "
              f"(includes the first step's own {'compile' if g else 'warm-up'})")
        if g:
            after = run(spec, args.steps, os.path.join(tmp, "two.h5"), "none", 2, g)
            print(f"graph: step after a 2-step capture  {after[2] * 1e3:8.1f} ms  (compiles the graph without the probes)")
            # the first steps after any compile run slower (plain runs too): steps as far from their compile compared
            late = 3 + warm + 2
            if args.steps > late:
                t_late, t_plain = statistics.median(after[late:]), statistics.median(plain[late - 2:-2])
                print(f"graph: steps {late}.. after capture     {t_late * 1e3:8.1f} ms  {t_late / t_plain:.2f}x "
                      f"(plain steps {late - 2}..{args.steps - 3}: {t_plain * 1e3:.1f} ms)")
        with CaptureFile(full_path) as c:
            held = sum(r.numel * np.dtype(r.dtype).itemsize for r in c.records(0) if r.has_data and r.same_as < 0)
        size = os.path.getsize(full_path)
        print(f"file (first step, full tensors)    {size / 1e6:8.1f} MB  {size / held:.2f}x the tensors' bytes")
        print(f"file (statistics, {args.steps} steps)         {os.path.getsize(stats_path) / 1e6:8.1f} MB")


if __name__ == "__main__":
    main()
