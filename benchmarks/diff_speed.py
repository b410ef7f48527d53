"""Speed and memory of ``tensordiff diff``, and the scaling of the first-divergence search.

    .venv/bin/python benchmarks/diff_speed.py [--layers 4 --hidden 512 --seq 256 --batch 4 --steps 1]
        [--jobs 1,2] [--repeat 3] [--synthetic 64x4M --dtype bfloat16] [--rows 2600,5200,10400,20800]
        [--files A.h5 B.h5 | --keep DIR] [--skip-diff] [--skip-search]

1. Two capture files: a megatron-core GPT (FP32, on the CPU, full tensors, the real capture API), B's weights of
   one layer moved by ~1e-4 relative; or, with ``--synthetic NxM``, N records of M elements of ``--dtype`` written
   by ``CaptureWriter`` (as many records per step as a large model has, BF16 if asked); or two given files.
2. ``tensordiff.diff.diff`` on them (the Python API the CLI uses), each run in a fresh process so the peak RSS is
   the diff's own: tensor bytes compared (both sides), seconds, CPU seconds (all threads), GB/s overall, GB/s per
   core of CPU time, GB/s of the compare alone, peak RSS against the largest tensor pair. With ``--jobs 1`` also the
   time split from cProfile (reading/decompressing, comparing, aligning, the divergence search) and its top entries.
3. The divergence search alone on synthetic steps of 2.6k..20.8k rows whose every row is diverged and none
   introduced (the worst case: every row is a candidate): seconds per step and the ratio per doubling (linear: ~2).

Targets (issue 13): >= 1 GB/s per core in the compare, parallel across tensors, peak RSS a small multiple of the
largest tensor pair; the search linear in the rows of a step.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import pstats
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402


# ------------------------------------------------------------------------------------------------ captures
def build_gpt_captures(tmp: str, layers: int, hidden: int, seq: int, batch: int, steps: int) -> tuple[str, str]:
    """Two FP32 captures of a megatron-core GPT with full tensors on every step; B's layer-1 fc1 weight moved."""
    import torch

    import tensordiff
    from examples.gpt.models import GPTSpec, build_mcore_gpt, make_batch, mcore_loss

    spec = GPTSpec(num_layers=layers, hidden_size=hidden, num_attention_heads=max(1, hidden // 64), vocab_size=8192,
                   seq_length=seq, batch_size=batch)
    paths = []
    for side in ("a", "b"):
        model = build_mcore_gpt(spec, seed=1)
        if side == "b":
            with torch.no_grad():
                w = dict(model.named_parameters())[f"decoder.layers.{min(1, layers - 1)}.mlp.linear_fc1.weight"]
                w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(3)) * 1e-4 * w.abs().mean())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        path = os.path.join(tmp, f"{side}.h5")
        with tensordiff.capture(model, path, steps=steps, optimizer=opt, tensors="all") as cap:
            for i in range(steps):
                tokens, labels, _ = make_batch(spec, seed=i)
                loss = mcore_loss(model, tokens, labels)
                loss.backward()
                opt.step()
                opt.zero_grad()
                cap.step(loss)
        paths.append(path)
        nparams = sum(p.numel() for p in model.parameters())
    print(f"megatron-core GPT: {nparams / 1e6:.2f} M parameters, {layers} layers, hidden {hidden}, batch {batch}x{seq}, "
          f"{steps} step(s) with full tensors")
    return paths[0], paths[1]


def build_synthetic_captures(tmp: str, records: int, numel: int, dtype: str) -> tuple[str, str]:
    """Two captures of one step: ``records`` forward outputs of ``numel`` elements each, written by ``CaptureWriter``;
    B = A plus relative noise of 1e-3 (narrow dtypes round it)."""
    from tensordiff import dtypes
    from tensordiff.store import CaptureWriter
    from tensordiff.store.format import shape_text

    np_dtype = dtypes.NUMPY_DTYPES[dtype]
    rng = np.random.default_rng(0)
    base = rng.standard_normal(numel).astype(np.float32)
    paths = []
    for side in ("a", "b"):
        rows, data = [], {}
        for seq in range(records):
            x = np.roll(base, seq * 7919)
            if side == "b":
                x = x + np.float32(1e-3) * np.roll(base, seq * 104729 + 1)
            x = x.astype(np_dtype)
            f = x.astype(np.float64)
            rows.append({"seq": seq, "phase": "forward", "module": f"layers.{seq}.mlp", "call": 0, "kind": "output",
                         "slot": "0", "module_class": "MLP", "dtype": dtype, "shape": shape_text((numel,)),
                         "numel": numel, "has_data": 1, "same_as": -1, "grad_of": -1, "enter": seq, "parent": "",
                         "min": float(f.min()), "max": float(f.max()), "mean": float(f.mean()),
                         "l2": float(np.sqrt(np.add.reduce(f * f))), "nan": 0, "inf": 0})
            data[seq] = x
        path = os.path.join(tmp, f"{side}.h5")
        writer = CaptureWriter(path, {"framework": "torch", "framework_version": "0.0"}, background=False)
        writer.submit(0, rows, data, {"wall_time": 0.0})
        writer.close()
        paths.append(path)
    print(f"synthetic: {records} records of {numel} {dtype} elements per side")
    return paths[0], paths[1]


# ---------------------------------------------------------------------------------------------- one diff
def _rss_now() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    """This process's peak RSS: VmHWM (ru_maxrss keeps the forking parent's across exec)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child(path_a: str, path_b: str, jobs: int, profile: bool) -> dict:
    """One diff in this (fresh) process: its figures as a dict."""
    from tensordiff import dtypes
    from tensordiff.diff import DiffOptions, diff
    from tensordiff.diff.result import DiffOptions as _Options

    with contextlib.suppress(ImportError):  # what `tensordiff diff` does in its process (older trees: nothing)
        from tensordiff import _native

        _native.keep_freed_memory()
    kw: dict[str, Any] = {"jobs": jobs} if "jobs" in _Options.__dataclass_fields__ else {}
    options = DiffOptions(**kw)
    rss0 = _rss_now()
    prof = cProfile.Profile() if profile else None
    cpu0, t0 = os.times(), time.perf_counter()
    if prof is not None:
        prof.enable()
    result = diff(path_a, path_b, options)
    if prof is not None:
        prof.disable()
    wall = time.perf_counter() - t0
    cpu1 = os.times()
    cpu = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    peak = _peak_rss()

    def nbytes(rec) -> int:
        dt = dtypes.NUMPY_DTYPES.get(rec.dtype)
        return rec.numel * (np.dtype(dt).itemsize if dt is not None else 4)

    compared = largest = 0
    tensors = 0
    for row in result.rows:
        if row.metrics is not None and row.metrics.source == "tensor":
            pair = nbytes(row.pair.a) + sum(nbytes(r) for r in row.pair.b_records)
            compared += pair
            largest = max(largest, pair)
            tensors += 1
    out: dict[str, Any] = {"jobs": jobs, "wall": wall, "cpu": cpu, "bytes": compared, "pairs": tensors, "largest_pair": largest,
           "peak_rss": peak, "rss_before": rss0, "outcome": result.outcome,
           "first": result.first.label_a if result.first is not None else None,
           "digest": _digest(result)}
    if prof is not None:
        st = pstats.Stats(prof)
        split: dict[str, float] = {}
        for (file, _line, func), (_cc, _nc, _tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
            name = f"{os.path.basename(file)}:{func}"
            for label, want in (("read", ("reader.py:array", "merged.py:array", "pipeline.py:array")),
                                ("compare", ("metrics.py:compare_arrays",)), ("align", ("align.py:align_step",)),
                                ("divergence", ("divergence.py:find_first_divergence",)),
                                ("coverage", ("coverage.py:coverage",))):
                if name in want:
                    split[label] = split.get(label, 0.0) + ct
        out["split"] = split
        st.sort_stats("tottime")
        top = []
        for (file, line, func), (_cc, nc, tt, ct, _callers) in sorted(st.stats.items(),  # type: ignore[attr-defined]
                                                                      key=lambda kv: -kv[1][2])[:12]:
            top.append(f"{tt:7.3f} s own {ct:7.3f} s cum {nc:7d} calls  {os.path.basename(file)}:{line}({func})")
        out["top"] = top
    return out


def _digest(result) -> str:
    """Every row's verdict and metrics, hashed: the serial and the parallel diff must agree exactly."""
    import hashlib

    h = hashlib.sha256()
    for row in result.rows:
        m = row.metrics.as_dict() if row.metrics is not None else None
        h.update(repr((row.step, row.phase, row.verdict, row.note, row.tol, m)).encode())
    from tensordiff.explain.place import explanation

    h.update(repr(explanation(result.first) if result.first is not None else None).encode())
    return h.hexdigest()[:16]


def run_child(path_a: str, path_b: str, jobs: int, profile: bool) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", path_a, path_b, "--jobs", str(jobs)]
    if profile:
        cmd.append("--profile")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # the tree first, then what the caller's path had (wheels installed with --target: isal, ml_dtypes)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p))
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_diff(path_a: str, path_b: str, jobs_list: list[int], repeat: int) -> None:
    size = os.path.getsize(path_a) + os.path.getsize(path_b)
    print(f"files: {size / 1e6:.1f} MB on disk ({os.path.basename(path_a)}, {os.path.basename(path_b)})")
    prof = run_child(path_a, path_b, 1, True)
    total = prof["wall"]
    print(f"profile (--jobs 1, cProfile on: slower): {total:.2f} s; "
          + ", ".join(f"{k} {v:.2f} s ({100 * v / total:.0f}%)" for k, v in sorted(prof["split"].items())))
    compare = prof["split"].get("compare", 0.0)
    if compare:
        print(f"  compare alone: {prof['bytes'] / compare / 1e9:.2f} GB/s (one thread, profiled)")
    for line in prof["top"]:
        print("  " + line)
    digests: set[str] = set()
    for jobs in jobs_list:
        runs = [run_child(path_a, path_b, jobs, False) for _ in range(repeat)]
        wall = statistics.median(r["wall"] for r in runs)
        cpu = statistics.median(r["cpu"] for r in runs)
        r = runs[0]
        peak = max(x["peak_rss"] for x in runs)
        digests.update(x["digest"] for x in runs)
        print(f"--jobs {jobs}: {r['bytes'] / 1e9:.3f} GB compared in {r['pairs']} pairs; median of {repeat}: "
              f"{wall:.2f} s wall, {cpu:.2f} s CPU -> {r['bytes'] / wall / 1e9:.3f} GB/s, "
              f"{r['bytes'] / cpu / 1e9:.3f} GB/s per core; peak RSS {peak / 2**20:.0f} MiB "
              f"({(peak - r['rss_before']) / 2**20:.0f} MiB above the imports; largest pair "
              f"{r['largest_pair'] / 2**20:.1f} MiB: x{(peak - r['rss_before']) / max(r['largest_pair'], 1):.1f}); "
              f"outcome {r['outcome']}, first {r['first']}")
    print("results identical across --jobs: " + ("yes" if len(digests) == 1 else f"NO ({sorted(digests)})"))


# ------------------------------------------------------------------------------------------ the search
def synthetic_step(n_rows: int, step: int = 0):
    """(records, rows) of one step of about ``n_rows`` rows in a transformer's shape (layers of attention and MLP
    submodules, links from each output to the next input, gradients), every row diverged by an error that grows
    slowly along the step (each phase's first row agrees): no row is introduced, so the search looks at every one."""
    from tensordiff.diff.align import Pair
    from tensordiff.diff.metrics import Metrics
    from tensordiff.diff.result import Row
    from tensordiff.record import Record

    recs: list[Record] = []

    def add(phase: str, module: str, kind: str, slot: str, **kw) -> Record:
        r = Record(step=step, seq=len(recs), phase=phase, module=module, call=0, kind=kind, slot=slot,
                   module_class="M", dtype="float32", shape=(4,), min=0.0, max=0.0, mean=0.0, l2=0.0, nan=0, inf=0,
                   numel=4, has_data=True, **kw)
        recs.append(r)
        return r

    subs = ("input_layernorm", "self_attention.linear_qkv", "self_attention.core_attention",
            "self_attention.linear_proj", "pre_mlp_layernorm", "mlp.linear_fc1", "mlp.linear_fc2")
    per_layer = 6 * len(subs) + 2  # weights, forward (the layer's and each submodule's input and output), grads
    layers = max(1, n_rows // per_layer)
    for i in range(layers):
        for s in subs:
            add("weights", f"decoder.layers.{i}.{s}", "param", "weight")
    outputs = []
    model_in = add("forward", "", "input", "0", enter=len(recs))
    e = len(recs)
    add("forward", "embedding", "input", "0", same_as=model_in.seq, enter=e)
    prev = add("forward", "embedding", "output", "0", enter=e)
    for i in range(layers):
        layer = f"decoder.layers.{i}"
        enter = len(recs)
        add("forward", layer, "input", "0", same_as=prev.seq, enter=enter, parent="decoder")
        for s in subs:
            e = len(recs)
            add("forward", f"{layer}.{s}", "input", "0", same_as=prev.seq, enter=e, parent=layer)
            prev = add("forward", f"{layer}.{s}", "output", "0", enter=e, parent=layer)
            outputs.append(prev)
        prev = add("forward", layer, "output", "0", same_as=prev.seq, enter=enter, parent="decoder")
    add("forward", "", "output", "0", same_as=prev.seq, enter=model_in.seq)
    add("loss", "", "loss", "value")
    for out in reversed(outputs):
        add("backward", out.module, "grad_output", "0", grad_of=out.seq, enter=out.enter, parent=out.parent)
        add("backward", out.module, "grad_input", "0", grad_of=out.seq - 1, enter=out.enter, parent=out.parent)
    for i in range(layers):
        for s in subs:
            add("param_grad", f"decoder.layers.{i}.{s}", "grad", "weight")
    rows = []
    firsts = {r.phase: r.seq for r in reversed(recs)}
    for r in recs:
        ok = r.phase == "weights" or firsts[r.phase] == r.seq  # nothing came in before them: they would be introduced
        err = 0.99e-5 if ok else 1e-5 * (1 + 0.5 * r.seq / len(recs))  # grows by 1.5x over the step: never 3x
        m = Metrics(rel_l2=err, max_abs=err, max_rel=err, cosine=1.0, ulp_share=0.0, nonfinite_mismatch=0,
                    source="tensor")
        rows.append(Row(step=step, phase=r.phase, pair=Pair(r, r, "exact"), metrics=m, tol=1e-5,
                        verdict="ok" if ok else "diverged"))
    return recs, rows


def bench_search(sizes: list[int], repeat: int) -> None:
    from tensordiff.diff.divergence import find_first_divergence

    prev_t = None
    for n in sizes:
        recs, rows = synthetic_step(n)
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            first = find_first_divergence(rows, {0: recs}, 3.0)
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        ratio = f"  x{t / prev_t:.2f} per doubling" if prev_t else ""
        print(f"search: {len(rows):6d} rows per step  {t:8.3f} s{ratio}  (first: {first.label_a if first else None}, "
              f"introduced {first.introduced if first else None})")
        prev_t = t


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--synthetic", metavar="NxM", help="N records of M elements (M may end in K or M) instead of the GPT")
    p.add_argument("--dtype", default="float32", help="dtype of the synthetic records (float32, bfloat16, float16)")
    p.add_argument("--files", nargs=2, metavar=("A", "B"), help="diff these two capture files")
    p.add_argument("--keep", metavar="DIR", help="write the captures into DIR (kept) instead of a temporary directory")
    p.add_argument("--jobs", default="1,2", help="comma-separated --jobs values to time")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--rows", default="2600,5200,10400,20800", help="rows per step for the search's scaling")
    p.add_argument("--skip-diff", action="store_true")
    p.add_argument("--skip-search", action="store_true")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], int(args.jobs), args.profile)))
        return
    print(f"host: {os.cpu_count()} CPUs, numpy {np.__version__}")
    if not args.skip_diff:
        with tempfile.TemporaryDirectory() as scratch:
            tmp = args.keep or scratch
            os.makedirs(tmp, exist_ok=True)
            if args.files:
                path_a, path_b = args.files
            elif args.synthetic:
                n, _, m = args.synthetic.lower().partition("x")
                scale = {"k": 1 << 10, "m": 1 << 20}.get(m[-1:], 1)
                numel = int(m.rstrip("km")) * scale
                path_a, path_b = build_synthetic_captures(tmp, int(n), numel, args.dtype)
            else:
                path_a, path_b = build_gpt_captures(tmp, args.layers, args.hidden, args.seq, args.batch, args.steps)
            bench_diff(path_a, path_b, [int(j) for j in args.jobs.split(",")], args.repeat)
    if not args.skip_search:
        bench_search([int(n) for n in args.rows.split(",")], max(1, min(args.repeat, 3)))


if __name__ == "__main__":
    main()
