"""Agreement-matrix pairs on a GPU in BF16 at a medium size (issue 41, part 2): clean pairs and faults, each side
captured with ``tensordiff capture --auto`` of ``examples/pairs/train.py --device cuda --optim adamw`` and compared
with ``tensordiff diff X Y --first-divergence --json r.json`` (no ``--mapping``), both argument orders of every
clean pair.

    python benchmarks/agreement_gpu.py --out /tmp/agpu --summary-dir $OUT          # on the H200 (medium, BF16)
    python benchmarks/agreement_gpu.py --device cpu --size tiny --dtype float32 --out /tmp/agpu-cpu   # a check here

The pairs (``cases``), run in this order so that a run stopped by ``--deadline-s`` keeps the most useful ones:
megatron-core ``GPTModel`` (local spec, ``Float16Module`` in BF16) against Hugging Face ``LlamaForCausalLM`` with
SDPA and with eager attention, untied then tied embeddings; Llama SDPA against Llama eager (mask passed in); the
faults of B = Llama SDPA (``rope-base``, ``norm-eps``, ``act``, ``weight``: ``examples/pairs/models.apply_fault``),
each of which must be found (exit 1) at its module and phase; megatron-core against Hugging Face GPT-2 (LayerNorm,
GELU, learned positions, biases, tied), eager and SDPA.

Writes ``summary.json`` (every case: exit codes of both orders, outcome, first divergence, hints, accounted records
by rule, unaccounted rows, inconclusive reasons, the rows closest to or over their tolerance, seconds) and
``summary.md`` (the table) to ``--summary-dir`` after every case, and the diff reports as ``reports.tar.gz``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from examples.pairs.matrix import Case, Outcome, Runner, _key, symmetric  # noqa: E402
from examples.pairs.models import Arch, Side, Style  # noqa: E402

SIZES = {
    # issue 41's medium size: 8 layers, hidden 1024, 16 heads in 4 query groups, FFN 2816 (gated), seq 1024
    "medium": dict(layers=8, hidden=1024, ffn=2816, heads=16, groups=4, vocab=32000, seq=1024, batch=1),
    "small": dict(layers=4, hidden=256, ffn=704, heads=8, groups=2, vocab=4096, seq=256, batch=1),
    "tiny": dict(layers=2, hidden=64, ffn=128, heads=4, groups=2, vocab=128, seq=16, batch=2),
}
FAULTS = ("rope-base", "norm-eps", "act", "weight", "dropout")


def cases(size: str, dtype: str) -> list[Case]:
    dims = SIZES[size]
    llama = Arch(**dims, dtype=dtype, init_std=0.02)
    # GPT-2: multi-head attention, FFN 4 x hidden
    gpt2 = Arch(**{**dims, "groups": dims["heads"], "ffn": 4 * dims["hidden"]}, norm="LayerNorm", act="gelu",
                pos="learned", bias="all", tied=True, dtype=dtype, init_std=0.02)
    mc, sdpa, eager = Side("mcore"), Side("hf-llama"), Side("hf-llama", Style(attn="eager"))
    out = []
    for tied in (False, True):
        arch = replace(llama, tied=tied)
        t = "tied" if tied else "untied"
        out += [Case(f"mcore-vs-hf-llama-sdpa[{t}]", arch, mc, sdpa),
                Case(f"mcore-vs-hf-llama-eager[{t}]", arch, mc, eager),
                Case(f"hf-llama-sdpa-vs-eager[{t}]", arch, sdpa, Side("hf-llama", Style(attn="eager", mask="passed")))]
        if not tied:
            out += [Case(f"mcore-vs-hf-llama-sdpa[untied]+{f}", arch, mc, replace(sdpa, fault=f)) for f in FAULTS]
    out += [Case("mcore-vs-hf-gpt2-eager[tied]", gpt2, mc, Side("hf-gpt2", Style(attn="eager"))),
            Case("mcore-vs-hf-gpt2-sdpa[tied]", gpt2, mc, Side("hf-gpt2"))]
    return out


class GpuRunner(Runner):
    """``matrix.Runner`` whose captures run ``train.py`` with ``--device`` / ``--optim``."""

    def __init__(self, out: str, steps: int, train_args: list[str]):
        super().__init__(out, steps)
        self.train_args = train_args
        self.env["PYTHONUNBUFFERED"] = "1"

    def diff_doc(self, name: str, reversed_: bool) -> dict:
        with open(os.path.join(self.out, f"r-{_key(name, reversed_)}.json"), encoding="utf-8") as fh:
            return json.load(fh)


def _row(r: dict) -> dict:
    m = r.get("metrics") or {}
    return {"step": r["step"], "phase": r["phase"], "a": r["a"], "b": r["b"], "verdict": r["verdict"],
            "how": r.get("how"), "dtype": r.get("dtype_a"), "rel_l2": m.get("rel_l2"), "tolerance": r.get("tolerance"),
            "max_abs": m.get("max_abs"), "cosine": m.get("cosine"), "source": m.get("source"), "note": r.get("note")}


def details(doc: dict, code: int, seconds: float) -> dict:
    """What one report says, small: verdict, first divergence, hints, accounting, the rows nearest their tolerance."""
    rows = doc.get("rows") or []
    compared = [r for r in rows if r["verdict"] not in ("unmatched",) and (r.get("metrics") or {}).get("rel_l2")
                is not None and r.get("tolerance")]
    bad = [_row(r) for r in rows if r["verdict"] not in ("ok", "unmatched")]
    closest = sorted(compared, key=lambda r: -(r["metrics"]["rel_l2"] / r["tolerance"]))[:8]
    margin: dict[str, float] = {}
    for r in compared:  # the largest error / tolerance per phase
        key = r["phase"]
        margin[key] = max(margin.get(key, 0.0), r["metrics"]["rel_l2"] / r["tolerance"])
    unaccounted = [f"step {r['step']} {r['phase']}: {r['a'] or ''} | {r['b'] or ''}" for r in rows
                   if r["verdict"] == "unmatched" and not r["linked"] and not r["not_recorded"] and not r.get("accounted")]
    first = doc.get("first_divergence")
    return {"exit": code, "outcome": doc.get("outcome"), "seconds": round(seconds, 1), "swapped": doc.get("swapped"),
            "mapping": doc.get("mapping_note"), "summary": doc.get("summary"),
            "first_divergence": first, "hints": [{k: h.get(k) for k in ("cause", "explained", "message", "detail")
                                                  if k in h} for h in (doc.get("hints") or [])[:3]],
            "exact": doc.get("exact"), "inconclusive_reasons": doc.get("inconclusive_reasons"),
            "first_nonfinite": doc.get("first_nonfinite"), "unaccounted": unaccounted[:40],
            "not_ok_rows": bad[:40], "closest_rows": [_row(r) for r in closest],
            "max_error_over_tolerance": {k: round(v, 4) for k, v in margin.items()}}


def environment(device: str) -> dict:
    import importlib.metadata as md

    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "device": torch.cuda.get_device_name(0) if device == "cuda" and torch.cuda.is_available() else "cpu"}
    for dist in ("megatron-core", "transformers", "numpy", "h5py"):
        try:
            env[dist] = md.version(dist)
        except md.PackageNotFoundError:
            env[dist] = None
    return env


def table(results: list[dict]) -> str:
    lines = ["| pair | orders: exit | outcome | first divergence (phase, tensor_a) | top hint | accounted (rule: records) "
             "| unaccounted | max error/tol (fwd, bwd, grad) | s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        d = r.get("straight") or {}
        first = d.get("first_divergence")
        found = f"{first['phase']} `{first['tensor_a']}`" if first else "-"
        hint = (f"{d['hints'][0]['cause']} {d['hints'][0].get('explained', 0):.0%}" if d.get("hints") else "-")
        acc = ", ".join(f"{k} {v}" for k, v in sorted(r.get("accounted", {}).items())) or "-"
        un = len(r.get("unaccounted") or [])
        m = d.get("max_error_over_tolerance") or {}
        mt = ", ".join(f"{m[p]:.2f}" if p in m else "-" for p in ("forward", "backward", "param_grad"))
        mark = "✓" if r.get("passed") else "✗"
        lines.append(f"| {r['case']} | {r.get('orders', '')} | {mark} {r.get('outcome', r.get('error', ''))} | {found} "
                     f"| {hint} | {acc} | {un} | {mt} | {r.get('seconds', 0):.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "out", "agreement_gpu"))
    p.add_argument("--summary-dir", help="where summary.json, summary.md and reports.tar.gz go (default --out)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--size", choices=sorted(SIZES), default="medium")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--optim", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--lr", type=float, help="train.py's --lr (default: its own for --optim)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--only", help="only cases whose name holds one of these (comma-separated)")
    p.add_argument("--skip", help="leave out cases whose name holds one of these (comma-separated)")
    p.add_argument("--jobs", type=int, default=4, help="captures, then diffs, run side by side")
    p.add_argument("--deadline-s", type=float, default=0, help="start no capture or diff after this many seconds")
    p.add_argument("--keep", action="store_true", help="keep the capture files (default: removed at the end)")
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    summary_dir = args.summary_dir or args.out
    os.makedirs(summary_dir, exist_ok=True)
    train_args = ["--device", args.device, "--optim", args.optim] + ([] if args.lr is None else ["--lr", str(args.lr)])
    runner = GpuRunner(args.out, args.steps, train_args)
    runner.env.setdefault("TENSORDIFF_JOBS", str(max(1, (os.cpu_count() or 2) // args.jobs)))
    only, skip = (args.only or "").split(",") if args.only else [], (args.skip or "").split(",") if args.skip else []
    todo = [c for c in cases(args.size, args.dtype)
            if (not only or any(o in c.name for o in only)) and not any(k in c.name for k in skip)]
    late = lambda: args.deadline_s and time.perf_counter() - t_start > args.deadline_s
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "env": environment(args.device), "size": SIZES[args.size],
            "dtype": args.dtype, "optim": args.optim, "lr": args.lr, "steps": args.steps, "train_args": train_args,
            "command": " ".join([os.path.relpath(__file__, ROOT), *(argv if argv is not None else sys.argv[1:])])}
    print(json.dumps(meta), flush=True)
    results: list[dict] = []

    def save() -> None:
        doc = {**meta, "wall_s": round(time.perf_counter() - t_start, 1), "captures": {
            os.path.basename(k): {"seconds": round(v, 1), "log": runner.logs.get(k, "")} for k, v in runner.seconds.items()},
            "results": results}
        with open(os.path.join(summary_dir, "summary.json"), "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=1, default=str)
        with open(os.path.join(summary_dir, "summary.md"), "w", encoding="utf-8") as fh:
            fh.write(f"{meta['date']} {meta['env']}\n\n{table(results)}\n")

    # captures first, side by side (the GPU has room for all; each writer compresses on its own core)
    sides = list({_key(asdict(c.arch), s.as_dict()): (c.arch, s) for c in todo for s in (c.a, c.b)}.values())
    failed: dict[str, str] = {}
    for arch in {c.arch: None for c in todo}:  # the shared starting weights, once per architecture, before the pool
        runner.weights(arch)

    def cap(item: tuple[Arch, Side]) -> None:
        if late():
            failed[_key(asdict(item[0]), item[1].as_dict())] = "not captured: past --deadline-s"
            return
        try:
            t0 = time.perf_counter()
            runner.capture(*item)
            print(f"captured {item[1].as_dict()} in {time.perf_counter() - t0:.0f} s", flush=True)
        except Exception as err:  # the case reports it
            failed[_key(asdict(item[0]), item[1].as_dict())] = str(err)[-3000:]
            print(f"capture failed: {item[1].as_dict()}: {str(err)[-1500:]}", flush=True)

    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(cap, sides))
    print(f"captures done at {time.perf_counter() - t_start:.0f} s", flush=True)

    def one(case: Case) -> dict:
        entry: dict = {"case": case.name, "fault": case.fault, "a": case.a.as_dict(), "b": case.b.as_dict()}
        errs = [failed[k] for k in (_key(asdict(case.arch), case.a.as_dict()), _key(asdict(case.arch), case.b.as_dict()))
                if k in failed]
        if errs or late():
            entry.update(passed=False, error=errs[0] if errs else "not run: past --deadline-s")
            return entry
        a, b = runner.capture(case.arch, case.a), runner.capture(case.arch, case.b)
        docs = {}
        outcomes: list[Outcome] = []
        for reversed_, (x, y) in ((False, (a, b)), (True, (b, a))):
            t0 = time.perf_counter()
            outcome = runner._diff(case, x, y, reversed_)
            seconds = time.perf_counter() - t0
            outcomes.append(outcome)
            try:
                docs["reversed" if reversed_ else "straight"] = details(runner.diff_doc(case.name, reversed_),
                                                                       outcome.exit_code, seconds)
            except (OSError, ValueError) as err:
                docs["reversed" if reversed_ else "straight"] = {"exit": outcome.exit_code, "error": str(err),
                                                                 "reasons": outcome.reasons}
        sym = symmetric(*outcomes)
        entry.update(passed=sym.passed, outcome=sym.outcome, orders=sym.orders, found=sym.found, hint=sym.hint,
                     accounted=sym.accounted, unaccounted=sym.unaccounted[:40], reasons=sym.reasons[:20],
                     seconds=round(sum(d.get("seconds", 0) for d in docs.values()), 1),
                     captures_s={"a": round(runner.seconds.get(a, 0), 1), "b": round(runner.seconds.get(b, 0), 1)},
                     losses={"a": runner.logs.get(a, ""), "b": runner.logs.get(b, "")}, **docs)
        print(f"{'PASS' if sym.passed else 'FAIL'} {case.name:42s} exit {sym.orders} {sym.outcome:12s} {sym.found} "
              f"{sym.hint} ({entry['seconds']:.0f} s)", flush=True)
        for line in (sym.unaccounted[:8] + sym.reasons[:4]):
            print(f"      {line[:300]}", flush=True)
        return entry

    with ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(one, c) for c in todo]
        for fut in futures:
            try:
                results.append(fut.result())
            except Exception as err:
                results.append({"case": "?", "passed": False, "error": repr(err)[-2000:]})
            save()
    save()
    with tarfile.open(os.path.join(summary_dir, "reports.tar.gz"), "w:gz") as tar:
        for name in sorted(os.listdir(args.out)):
            if name.startswith("r-") and name.endswith(".json"):
                tar.add(os.path.join(args.out, name), arcname=name)
    if not args.keep:
        for name in os.listdir(args.out):
            if name.endswith(".h5"):
                os.remove(os.path.join(args.out, name))
    clean = [r for r in results if not r.get("fault")]
    faults = [r for r in results if r.get("fault")]
    print(f"clean pairs agree: {sum(r['passed'] for r in clean)}/{len(clean)}; faults found at their place with the "
          f"right hint first: {sum(r['passed'] for r in faults)}/{len(faults)}; {time.perf_counter() - t_start:.0f} s",
          flush=True)
    return 0 if all(r["passed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
