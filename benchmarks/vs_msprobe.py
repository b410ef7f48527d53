"""tensordiff next to msprobe on one model and batch: step time, bytes written, peak memory, write time, diff speed.

    benchmarks/setup_bench_env.sh                       # once: .venv-bench with tensordiff, megatron-core, msprobe
    .venv-bench/bin/python benchmarks/vs_msprobe.py [--layers 4 --hidden 256 --seq 128 --batch 4 --steps 20]
    python3 benchmarks/vs_msprobe.py --device cuda --size 125m|1b [--settings none,td-stats,...] [--json out.json]

Settings (``--settings``, comma-separated; default all):

* ``none``: no capture.
* ``td-stats``: ``tensordiff.capture(..., tensors="none")``: statistics of every record, every step.
* ``td-full``: ``tensors="first"``: every tensor of the first step stored, statistics on the later steps
  (``--td-max-mb``: tensordiff's per-record limit; from 1B parameters it stores records up to 64 MiB by default).
* ``ms-stats``: msprobe's ``PrecisionDebugger``, level L0 (module level), task ``statistics``, every step.
* ``ms-full``: level L0, task ``tensor``, the first step only (msprobe's debugger holds one task; after its last
  step its hooks stay in place and record nothing).

Each setting runs in its own fresh process of this script (``--worker``): the same model (same seed), the same
batches, the same warm-up (``--warmup`` plain steps), then ``--steps`` timed steps under the setting. A fresh
process per setting is what makes the peak host memory honest (``ru_maxrss`` only grows) and keeps msprobe's
hooks and patches (it patches megatron on import, and its debugger is a process-wide singleton) out of the
other settings. The step time runs from the batch to the end of the capture call (``cap.step(loss)``;
msprobe: ``debugger.start(model)`` before the forward to ``debugger.stop(); debugger.step()`` after the
optimizer step, its documented loop), with ``torch.cuda.synchronize()`` at both ends on the GPU.

Figures per setting: median step time and its ratio to ``none``'s median; the first timed step's ratio (the
full-tensor step); bytes on disk (every file the setting wrote) per timed step, and against the model's weight
bytes; peak host memory above the RSS at the end of the warm-up (VmHWM, reset after the warm-up by writing 5 to
``/proc/self/clear_refs``); peak device memory above the allocation at the end of the warm-up
(``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``); write time: from the end of the last
step until the capture is closed (tensordiff's writer runs in a background thread; msprobe writes inside
``stop()``/``step()``, so its writing is in its step times). ``td-full`` runs twice, and ``tensordiff diff``
compares the two captures in a fresh process: wall and CPU seconds (``wait4``), tensor bytes compared (the
tensors stored in both files, links counted once), GB/s and GB/s per core of CPU time, peak RSS.

``--device cuda --size 125m|1b``: megatron-core GPT in BF16 (``Float16Module``), Llama layout (RMSNorm, SwiGLU,
RoPE, grouped-query attention), seq 2048, micro-batch 2, AdamW, built by ``examples/distributed/gpu_gpt.py``'s
functions. Without msprobe importable the ``ms-*`` settings are skipped with the reason printed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
warnings.filterwarnings("ignore")

SETTINGS = {
    "none": "no capture",
    "td-stats": "tensordiff statistics, every step",
    "td-full": "tensordiff tensors of step 0, statistics after",
    "ms-stats": "msprobe L0 statistics, every step",
    "ms-full": "msprobe L0 tensors of step 0",
}
# gpu_gpt.py's size keys (its own SIZES win where they have these names): 125M and 1.03B parameters
GPU_SIZES = {
    "125m": dict(vocab=32000, hidden=768, ffn=2048, layers=12, heads=12, groups=4, seq=2048, batch=2),
    "1b": dict(vocab=32000, hidden=2048, ffn=5632, layers=20, heads=16, groups=4, seq=2048, batch=2),
}
RESULT_TAG = "VS_MSPROBE_RESULT "


# ------------------------------------------------------------------------------------------------- the model
class Job:
    """One model, its optimizer and its batches: ``step(i)`` trains on batch ``i`` and returns the loss."""

    def __init__(self, args: argparse.Namespace):
        import torch

        self.torch = torch
        self.cuda = args.device == "cuda"
        if self.cuda:
            self._build_gpu(args)
        else:
            self._build_cpu(args)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.params = sum(p.numel() for p in self.model.parameters())

    def _build_cpu(self, args: argparse.Namespace) -> None:
        import torch

        from examples.gpt.models import GPTSpec, build_mcore_gpt, make_batch, mcore_loss

        torch.set_num_threads(max(1, os.cpu_count() or 1))
        spec = GPTSpec(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=max(1, args.hidden // 64),
                       vocab_size=args.vocab, seq_length=args.seq, batch_size=args.batch)
        self.model = build_mcore_gpt(spec, seed=1)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        n = args.warmup + args.steps
        self.batches = [make_batch(spec, seed=i)[:2] for i in range(n)]
        self._loss = mcore_loss
        self.describe = (f"megatron-core GPT, FP32 on the CPU ({torch.get_num_threads()} threads): {args.layers} "
                         f"layers, hidden {args.hidden}, vocab {args.vocab}, batch {args.batch}x{args.seq}, AdamW")

    def _build_gpu(self, args: argparse.Namespace) -> None:
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state, tensor_parallel

        from examples.distributed import gpu_gpt

        size = dict(getattr(gpu_gpt, "SIZES", {}).get(args.size) or GPU_SIZES[args.size])  # one source once it has them
        for key in ("layers", "hidden", "seq", "batch", "vocab"):
            if getattr(args, f"{key}_set"):
                size[key] = getattr(args, key)
        ns = argparse.Namespace(**size, tp=1, dp=1, device="cuda", dtype="bf16", ddp="none", grad_reduce="fp32",
                                seed=1234, lr=1e-4, eps_layer=None)  # every option gpu_gpt.build reads
        torch.cuda.set_device(0)
        if not dist.is_initialized():
            dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        tensor_parallel.model_parallel_cuda_manual_seed(ns.seed)
        model = gpu_gpt.build(ns)
        gpu_gpt.load_weights(model, ns)
        self.model = gpu_gpt.wrap(model, ns)  # Float16Module: BF16 parameters
        self.trainer = gpu_gpt.Trainer(self.model, ns, gpu_gpt.batch(ns, torch.device("cuda", 0)))
        self.trainer.opt = torch.optim.AdamW(self.model.parameters(), lr=ns.lr)  # gpu_gpt's Trainer uses SGD
        self.opt = self.trainer.opt
        self.describe = (f"megatron-core GPT {args.size}, BF16 (Float16Module) on {torch.cuda.get_device_name(0)}: "
                         f"{ns.layers} layers, hidden {ns.hidden}, FFN {ns.ffn} gated, {ns.heads} heads in {ns.groups} "
                         f"groups, vocab {ns.vocab}, batch {ns.batch}x{ns.seq}, AdamW")

    def step(self, i: int) -> Any:
        if self.cuda:
            return self.trainer.step()  # one batch, every step
        tokens, labels = self.batches[i]
        loss = self._loss(self.model, tokens, labels)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return loss

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------- memory probes
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_peak_rss() -> bool:
    """Set VmHWM back to the current RSS (Linux 4.0+); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def dir_bytes(path: str) -> tuple[int, int]:
    """Bytes on disk (apparent sizes) and the number of files under ``path``."""
    total = files = 0
    for dirpath, _dirs, names in os.walk(path):
        for name in names:
            total += os.path.getsize(os.path.join(dirpath, name))
            files += 1
    return total, files


# ------------------------------------------------------------------------------------------------ the worker
def msprobe_debugger(setting: str, out: str, steps: int) -> Any:
    """msprobe's PrecisionDebugger at L0 for this setting, configured by a config.json in ``out``."""
    from msprobe.pytorch import PrecisionDebugger

    task = "statistics" if setting == "ms-stats" else "tensor"
    config = {
        "task": task, "dump_path": os.path.join(out, "dump"), "rank": [],
        "step": [] if task == "statistics" else [0],  # [] = every step
        "level": "L0", "async_dump": False,
        task: {"scope": [], "list": [], "data_mode": ["all"]},
    }
    if task == "statistics":
        config[task]["summary_mode"] = "statistics"
    path = os.path.join(out, "msprobe_config.json")
    with open(path, "w") as fh:
        json.dump(config, fh, indent=1)
    return PrecisionDebugger(config_path=path)


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One setting in this process: warm-up, timed steps under the setting, its figures."""
    import torch

    setting, out = args.worker, args.out
    os.makedirs(out, exist_ok=True)
    job = Job(args)
    for i in range(args.warmup):
        job.step(i)
    job.sync()
    t0 = time.perf_counter()
    if setting.startswith("ms-"):
        debugger = msprobe_debugger(setting, out, args.steps)
    elif setting.startswith("td-"):
        import tensordiff

        extra = {} if args.td_max_mb is None else {"tensors_max_mb": args.td_max_mb}
        cap = tensordiff.capture(job.model, os.path.join(out, "capture.h5"), steps=args.steps, optimizer=job.opt,
                                 tensors="none" if setting == "td-stats" else "first", **extra)
    setup_s = time.perf_counter() - t0
    rss_reset = reset_peak_rss()
    rss0 = _status_kib("VmRSS") * 1024
    if job.cuda:
        torch.cuda.reset_peak_memory_stats()
        dev0 = torch.cuda.memory_allocated()
    times, cpu = [], []
    for k in range(args.steps):
        i = args.warmup + k
        job.sync()
        t0, c0 = time.perf_counter(), time.process_time()
        if setting.startswith("ms-"):
            debugger.start(job.model)
            job.step(i)
            debugger.stop()
            debugger.step()
        else:
            loss = job.step(i)
            if setting.startswith("td-"):
                cap.step(loss)
        job.sync()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    t_end = time.perf_counter()
    if setting.startswith("td-"):
        cap.close()
    elif setting.startswith("ms-"):
        debugger.stop()  # nothing left to write: msprobe wrote in each step's stop()/step()
    write_s = time.perf_counter() - t_end
    peak_rss = _status_kib("VmHWM") * 1024
    written, files = dir_bytes(out)
    records = 0
    if setting.startswith("td-") and os.path.exists(os.path.join(out, "capture.h5")):
        from tensordiff.store import CaptureFile

        with CaptureFile(os.path.join(out, "capture.h5")) as c:  # records a step (the last one: statistics)
            records = len(c.records(c.steps[-1])) if c.steps else 0
    result: dict[str, Any] = {
        "setting": setting, "describe": job.describe, "params": job.params, "weight_bytes": job.weight_bytes,
        "warmup": args.warmup, "steps": args.steps, "step_s": times, "median_s": statistics.median(times),
        "step_cpu_s": cpu, "median_cpu_s": statistics.median(cpu),
        "first_s": times[0], "after_first_s": statistics.median(times[1:]) if len(times) > 1 else times[0],
        "records": records, "setup_s": setup_s, "write_s": write_s, "bytes": written, "files": files,
        "rss_before": rss0, "peak_rss": peak_rss, "peak_rss_delta": peak_rss - rss0,
        "peak_rss_since": "warm-up end" if rss_reset else "process start (clear_refs not writable)",
    }
    if job.cuda:
        result["peak_device_delta"] = torch.cuda.max_memory_allocated() - dev0
        result["peak_device"] = torch.cuda.max_memory_allocated()
    return result


# ------------------------------------------------------------------------------------------------ the driver
def msprobe_missing() -> str | None:
    """Why msprobe cannot run here, or None; asked in a fresh process (its import patches megatron)."""
    code = "from msprobe.pytorch import PrecisionDebugger"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), cwd=ROOT)
    if proc.returncode == 0:
        return None
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else f"exit code {proc.returncode}"


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run_worker(args: argparse.Namespace, setting: str, out: str) -> dict[str, Any]:
    """``setting`` in a fresh process of this script; its result dict, or ``{"error": ...}``."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", setting, "--out", out, "--device", args.device,
           "--steps", str(args.steps), "--warmup", str(args.warmup)]
    for key in ("layers", "hidden", "seq", "batch", "vocab"):
        if args.device == "cpu" or getattr(args, f"{key}_set"):
            cmd += [f"--{key}", str(getattr(args, key))]
    if args.device == "cuda":
        cmd += ["--size", args.size]
    if args.td_max_mb is not None:
        cmd += ["--td-max-mb", str(args.td_max_mb)]
    log = os.path.join(out + ".log")
    t0 = time.perf_counter()
    try:
        with open(log, "w") as fh:
            proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT, timeout=args.timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        return {"setting": setting, "error": f"timed out after {args.timeout} s"}
    with open(log, errors="replace") as fh:
        text = fh.read()
    for line in reversed(text.splitlines()):
        if line.startswith(RESULT_TAG):
            res = json.loads(line[len(RESULT_TAG):])
            res["wall_s"] = time.perf_counter() - t0
            return res
    tail = [ln for ln in text.strip().splitlines() if ln.strip()][-1:] or [f"exit code {rc}"]
    return {"setting": setting, "error": f"exit code {rc}: {tail[0][:300]}"}


def tensor_bytes(path: str) -> int | None:
    """Bytes of the tensors stored in a capture (each stored tensor once; links not counted)."""
    try:
        import numpy as np

        from tensordiff import dtypes
        from tensordiff.store import CaptureFile

        total = 0
        with CaptureFile(path) as cap:
            for rec in cap.iter_records():
                if rec.has_data and rec.same_as < 0:
                    dt = dtypes.NUMPY_DTYPES.get(rec.dtype)
                    total += rec.numel * (np.dtype(dt).itemsize if dt is not None else 4)
        return total
    except Exception as err:  # the store is being reworked: the diff's speed is then given per file byte
        print(f"vs_msprobe: tensor bytes not read from {path} ({type(err).__name__}: {err})", file=sys.stderr)
        return None


def run_diff(path_a: str, path_b: str, out: str, extra: list[str]) -> dict[str, Any]:
    """``tensordiff diff A B`` in a fresh process: wall, CPU (wait4: the process and the children it waited for),
    peak RSS, exit code, and the speed against the tensor bytes of both files."""
    cmd = [sys.executable, "-m", "tensordiff", "diff", path_a, path_b, "--no-color", "--width", "200",
           "--json", os.path.join(out, "diff.json"), *extra]
    with open(os.path.join(out, "diff.txt"), "w") as fh:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT)
        try:
            _pid, status, usage = os.wait4(proc.pid, 0)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    cpu = usage.ru_utime + usage.ru_stime
    sizes = [tensor_bytes(p) for p in (path_a, path_b)]
    compared = sum(s for s in sizes if s is not None) if None not in sizes else None
    basis = "tensor bytes" if compared is not None else "file bytes"
    nbytes = compared if compared is not None else os.path.getsize(path_a) + os.path.getsize(path_b)
    return {"exit": proc.returncode, "wall_s": wall, "cpu_s": cpu, "bytes": nbytes, "basis": basis,
            "file_bytes": os.path.getsize(path_a) + os.path.getsize(path_b),
            "gbps": nbytes / wall / 1e9, "gbps_per_core": nbytes / max(cpu, 1e-9) / 1e9,
            "peak_rss": usage.ru_maxrss * 1024, "cmd": " ".join(["tensordiff", "diff", "A", "B", *extra])}


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f}" if n < 1e10 else f"{n / 1e9:.1f} G"


def table(rows: list[dict[str, Any]], base: dict[str, Any] | None, cuda: bool) -> str:
    head = ["setting", "step ms (median)", "x plain", "CPU x plain", "first step x", "after it x", "records / step",
            "host µs / record", "MB written", "MB / step",
            "x weights / step", "peak RSS +MiB"] + (["peak device +MiB"] if cuda else []) + ["write s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    plain = base["median_s"] if base and "median_s" in base else None
    for r in rows:
        name = f"`{r['setting']}` {SETTINGS.get(r['setting'].split('#')[0], '')}"
        if "#" in r["setting"]:
            name += " (again, for the diff)"
        if "error" in r or "skipped" in r:
            lines.append(f"| {name} | " + (r.get("error") or r.get("skipped")) + " |" + " |" * (len(head) - 2))
            continue
        per_step = r["bytes"] / r["steps"]
        cells = [name, f"{r['median_s'] * 1e3:.1f}",
                 f"{r['median_s'] / plain:.2f}" if plain else "",
                 f"{r['median_cpu_s'] / base['median_cpu_s']:.2f}" if plain and base else "",
                 f"{r['first_s'] / plain:.2f}" if plain else "",
                 f"{r.get('after_first_s', r['median_s']) / plain:.2f}" if plain else "",
                 str(r.get("records") or ""),
                 f"{(r['median_s'] - plain) / r['records'] * 1e6:.1f}" if plain and r.get("records") else "",
                 _mb(r["bytes"]), _mb(per_step), f"{per_step / r['weight_bytes']:.2f}",
                 f"{r['peak_rss_delta'] / 2**20:.0f}"]
        if cuda:
            cells.append(f"{r.get('peak_device_delta', 0) / 2**20:.0f}")
        cells.append(f"{r['write_s']:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def diff_table(d: dict[str, Any]) -> str:
    if "error" in d:
        return f"diff: {d['error']}"
    return "\n".join([
        "| diff of two td-full runs | exit | wall s | CPU s | GB compared | GB/s | GB/s per core | peak RSS MiB |",
        "|---|---|---|---|---|---|---|---|",
        f"| `{d['cmd']}` | {d['exit']} | {d['wall_s']:.2f} | {d['cpu_s']:.2f} | {d['bytes'] / 1e9:.3f} ({d['basis']}, "
        f"both files; {d['file_bytes'] / 1e9:.3f} on disk) | {d['gbps']:.3f} | {d['gbps_per_core']:.3f} | "
        f"{d['peak_rss'] / 2**20:.0f} |",
    ])


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs of one setting: the median of each timing, the rest from the first run."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[0]
    out = dict(ok[0])
    for key in ("median_s", "median_cpu_s", "first_s", "after_first_s", "write_s", "peak_rss_delta", "peak_device_delta",
                "setup_s"):
        if key in out:
            out[key] = statistics.median(r[key] for r in ok)
    out["repeats"] = len(ok)
    return out


class Interrupted(Exception):
    """SIGTERM (a time limit ran out): stop, and report what was measured."""


def _interrupt(signum: int, _frame: Any) -> None:
    raise Interrupted(signal.Signals(signum).name)


def driver(args: argparse.Namespace) -> int:
    wanted = [s.strip() for s in args.settings.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in SETTINGS]
    if unknown:
        print(f"vs_msprobe: unknown setting(s) {', '.join(unknown)}; choose from {', '.join(SETTINGS)}", file=sys.stderr)
        return 2
    skipped: dict[str, str] = {}
    if any(s.startswith("ms-") for s in wanted):
        why = msprobe_missing()
        if why:
            print(f"vs_msprobe: msprobe settings skipped: msprobe is not importable ({why}); "
                  "benchmarks/setup_bench_env.sh installs it", flush=True)
            skipped = {s: f"skipped: msprobe not importable ({why})" for s in wanted if s.startswith("ms-")}
    work = args.workdir or tempfile.mkdtemp(prefix="vs_msprobe_")
    os.makedirs(work, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in wanted}
    diff_pair: list[str] = []
    report: dict[str, Any] = {"command": " ".join(sys.argv), "rows": []}
    interrupted = None
    signal.signal(signal.SIGTERM, _interrupt)

    def rows() -> list[dict[str, Any]]:
        return [median_of(runs[s]) if runs.get(s) else {"setting": s, "skipped": skipped.get(s, "not run")}
                for s in [*wanted, *(k for k in runs if k not in wanted)]]

    try:
        for rep in range(args.repeat):
            order = list(wanted)
            if "td-full" in wanted and args.diff and rep == 0:
                order.append("td-full#2")  # the second identical run, for the diff
            for setting in order:
                if setting in skipped:
                    continue
                out = os.path.join(work, f"{setting.replace('#', '_')}.{rep}")
                print(f"vs_msprobe: {setting} (run {rep + 1}/{args.repeat}) ...", file=sys.stderr, flush=True)
                res = run_worker(args, setting.split("#")[0], out)
                res["setting"] = setting
                print(f"vs_msprobe: {setting}: " + (res["error"] if "error" in res else
                      f"median {res['median_s'] * 1e3:.1f} ms, first {res['first_s'] * 1e3:.1f} ms, "
                      f"{res['bytes'] / 1e6:.1f} MB, write {res['write_s']:.2f} s"), file=sys.stderr, flush=True)
                runs.setdefault(setting, []).append(res)
                if setting.startswith("td-full") and rep == 0 and "error" not in res:
                    diff_pair.append(os.path.join(out, "capture.h5"))
                elif not args.keep:
                    shutil.rmtree(out, ignore_errors=True)
                report["rows"] = rows()
                _dump(args.json, report)
        if len(diff_pair) == 2:
            print("vs_msprobe: tensordiff diff of the two td-full captures ...", file=sys.stderr, flush=True)
            report["diff"] = run_diff(diff_pair[0], diff_pair[1], work, args.diff_args.split())
    except (Interrupted, KeyboardInterrupt) as err:
        interrupted = str(err) or type(err).__name__
    finally:
        report["rows"] = rows()
        if interrupted:
            report["interrupted"] = interrupted
        _dump(args.json, report)
        print_report(report, args)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"\nfiles kept in {work}", file=sys.stderr)
    return 130 if interrupted else 0


def _dump(path: str | None, report: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as fh:
            json.dump(report, fh, indent=1)


def print_report(report: dict[str, Any], args: argparse.Namespace) -> None:
    rows = report["rows"]
    base = next((r for r in rows if r["setting"] == "none" and "median_s" in r), None)
    first = next((r for r in rows if "describe" in r), None)
    if first:
        print(f"{first['describe']}; {first['params'] / 1e6:.2f} M parameters "
              f"({first['weight_bytes'] / 1e6:.1f} MB of weights); {args.warmup} warm-up + {args.steps} timed "
              f"steps per setting, each setting in a fresh process" +
              (f", median of {args.repeat} runs" if args.repeat > 1 else ""))
    print()
    print(table(rows, base, args.device == "cuda"))
    if "diff" in report:
        print()
        print(diff_table(report["diff"]))
    elif args.diff and any(r["setting"] == "td-full" for r in rows):
        print("\ndiff: not run")
    if report.get("interrupted"):
        print(f"\ninterrupted ({report['interrupted']}): the rows above are what was measured before")
    sys.stdout.flush()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--size", choices=sorted(GPU_SIZES), default="125m", help="--device cuda: the model")
    p.add_argument("--layers", type=int, help="CPU: 4 (GPU: from --size)")
    p.add_argument("--hidden", type=int, help="CPU: 256 (GPU: from --size)")
    p.add_argument("--seq", type=int, help="CPU: 128 (GPU: 2048)")
    p.add_argument("--batch", type=int, help="CPU: 4 (GPU: 2)")
    p.add_argument("--vocab", type=int, help="CPU: 8192 (GPU: 32000)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per setting")
    p.add_argument("--warmup", type=int, default=3, help="plain steps before the timed ones, in every setting")
    p.add_argument("--td-max-mb", type=float, help="td-full: tensors_max_mb (records above it keep statistics only; "
                   "0: every record in full, as msprobe stores them; default: tensordiff's own, 64 at 1B parameters)")
    p.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated, of: " + ", ".join(SETTINGS))
    p.add_argument("--repeat", type=int, default=1, help="run the settings this many times (interleaved), medians")
    p.add_argument("--no-diff", dest="diff", action="store_false", help="skip the second td-full run and the diff")
    p.add_argument("--diff-args", default="", help="extra arguments for tensordiff diff (e.g. '--jobs 2')")
    p.add_argument("--timeout", type=int, default=3600, help="seconds one setting may take")
    p.add_argument("--workdir", help="where the settings write (default: a new temporary folder, removed after)")
    p.add_argument("--keep", action="store_true", help="keep the written files")
    p.add_argument("--json", help="also write the figures as JSON")
    p.add_argument("--worker", choices=sorted(SETTINGS), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    defaults = dict(layers=4, hidden=256, seq=128, batch=4, vocab=8192)
    for key, value in defaults.items():
        setattr(args, f"{key}_set", getattr(args, key) is not None)
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.steps < 1 or args.warmup < 0 or args.repeat < 1:
        print("vs_msprobe: --steps and --repeat must be >= 1, --warmup >= 0", file=sys.stderr)
        raise SystemExit(2)
    if args.worker:
        res = worker(args)
        print(RESULT_TAG + json.dumps(res), flush=True)
        return
    raise SystemExit(driver(args))


if __name__ == "__main__":
    main()
