"""The family matrix: per decoder family of ``table.FAMILIES``, megatron-core against Hugging Face, captured with
``tensordiff capture --auto`` and compared with ``tensordiff diff`` with no ``--mapping``, in both argument orders.

    python examples/families/matrix.py                    # every family, FP32 and BF16, clean pairs and faults
    python examples/families/matrix.py --only gemma,phi3  # some families
    python examples/families/matrix.py --dtype float32 --clean

Each pair is first checked equivalent by its logits (``build.check_equivalent``) before tensordiff is asked. A clean
pair must end ``agree`` (exit 0) in both orders; a fault (``table.FAULTS``, a mistake of the megatron-core
conversion) must end ``diverged`` (exit 1) in both orders, its first divergence in the module ``EXPECTED`` names and
its top hint the cause named there. A family megatron-core cannot express must end with the mapping note saying
so in one line and never ``agree``. Shared by ``tests/test_families.py`` (a sample) and
``benchmarks/agreement_families.py`` (all of it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from examples.families.table import FAMILIES  # noqa: E402
from tensordiff.mapping import unwrap  # noqa: E402

#: fault -> (phase, A's module the first divergence is in (or under), the top hint's cause)
EXPECTED: dict[str, tuple[str, str, str]] = {
    "norm-offset": ("weights", "decoder.layers.0.input_layernorm", "norm-offset"),
    "embed-scale": ("forward", "decoder.layers.0", "embedding-scale"),
    "qkv-layout": ("weights", "decoder.layers.0.self_attention.linear_qkv", "layout"),
    "rope-theta": ("forward", "rotary_pos_emb", "rope"),
    "partial-rotary": ("forward", "rotary_pos_emb", "rope"),
    "untied-output": ("param_grad", "embedding.word_embeddings", "tied"),
    "dropped-bias": ("forward", "decoder.layers.0.self_attention.linear_qkv", "missing-bias"),
    "router-softmax": ("forward", "decoder.layers.0.mlp", "router-norm"),
}
DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class Case:
    family: str
    dtype: str = "float32"
    fault: str = ""

    @property
    def name(self) -> str:
        return f"{self.family}[{'bf16' if self.dtype == 'bfloat16' else 'fp32'}]" + (f"+{self.fault}" if self.fault else "")


@dataclass
class Outcome:
    case: Case
    passed: bool
    codes: tuple[int, int]
    found: str = ""
    hint: str = ""
    note: str = ""
    reasons: list[str] = field(default_factory=list)


def cases(families: list[str] | None = None, dtypes: tuple[str, ...] = DTYPES, clean_only: bool = False) -> list[Case]:
    out = []
    for name, fam in FAMILIES.items():
        if families and name not in families:
            continue
        for dtype in dtypes:
            out.append(Case(name, dtype))
            if fam.mcore_can_express and not clean_only:
                out += [Case(name, dtype, f) for f in fam.faults]
    return out


_LOCKS: dict[str, threading.Lock] = {}
_LOCKS_LOCK = threading.Lock()


def _capture(out: str, case: Case, side: str, env: dict, device: str = "cpu") -> str:
    """``device``: where the side trains, 'cpu' or 'cuda' (a capture's name says which). One capture per file, made
    once: cases sharing it (a clean side) wait for it."""
    fault = case.fault if side == "mcore" else ""
    where = "" if device == "cpu" else f"-{device}"
    path = os.path.join(out, f"{case.family}-{case.dtype}{where}-{side}{'-' + fault if fault else ''}.h5")
    with _LOCKS_LOCK:
        lock = _LOCKS.setdefault(path, threading.Lock())
    with lock:
        return path if os.path.exists(path) else _make(path, case, side, fault, env, device)


def _make(path: str, case: Case, side: str, fault: str, env: dict, device: str) -> str:
    cmd = [sys.executable, "-m", "tensordiff", "capture", "--auto", "-o", path + ".part", "--", sys.executable,
           os.path.join(HERE, "train.py"), "--family", case.family, "--side", side, "--dtype", case.dtype,
           "--device", device, *(["--fault", fault] if fault else [])]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    os.replace(path + ".part", path)
    return path


def _diff(a: str, b: str, env: dict) -> tuple[int, dict]:
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "r.json")
        proc = subprocess.run([sys.executable, "-m", "tensordiff", "diff", a, b, "--json", report], env=env,
                              capture_output=True, text=True, timeout=900)
        if not os.path.exists(report):
            return proc.returncode, {"outcome": "error", "error": (proc.stdout[-1500:] + proc.stderr[-1500:]).strip()}
        with open(report, encoding="utf-8") as fh:
            return proc.returncode, json.load(fh)


def judge(case: Case, code: int, doc: dict) -> tuple[bool, str, str, list[str]]:
    first = doc.get("first_divergence")
    hints = doc.get("hints") or []
    hint = f"{hints[0]['cause']} {hints[0]['explained']:.0%}" if hints else ""
    if first:
        first = {**first, "module_a": unwrap(first["module_a"])}  # megatron's Float16Module: module.decoder...
    found = f"{first['phase']} {first['module_a']}" if first else ""
    reasons = list(doc.get("inconclusive_reasons") or [])
    if doc.get("error"):
        reasons.append(doc["error"])
    if not FAMILIES[case.family].mcore_can_express:  # one line saying so, exit 2: never a verdict
        said = str(doc.get("error", ""))
        return code == 2 and "cannot express" in said and len(said.strip().splitlines()) == 1, found, hint, reasons
    if not case.fault:
        flips = doc.get("routing") or []  # MoE in BF16: tokens routed apart on near ties, accounted and named
        if flips:
            found = "; ".join(f"routed: {unwrap(f['module_a'])} {len(f['tokens'])} token(s), "
                              f"{len(f['accounted'])} record(s)" for f in flips)
        return code == 0 and doc.get("outcome") == "agree", found, hint, reasons
    phase, module, cause = EXPECTED[case.fault]
    where = first is not None and first["phase"] == phase and (
        first["module_a"] == module or first["module_a"].startswith(module + ".") or module in first.get("location", ""))
    return code == 1 and where and bool(hints) and hints[0]["cause"] == cause, found, hint, reasons


def run_case(case: Case, out: str, device: str = "cpu") -> Outcome:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), NO_COLOR="1")
    for name in ("TENSORDIFF_OUTPUT", "TENSORDIFF_STEPS", "TENSORDIFF_TENSORS", "TENSORDIFF_DISABLE"):
        env.pop(name, None)
    try:
        if not FAMILIES[case.family].mcore_can_express:  # only the HF side exists: diffed against megatron's Llama
            a = _capture(out, Case("llama", case.dtype), "mcore", env, device)
        else:
            a = _capture(out, case, "mcore", env, device)
        b = _capture(out, case, "hf", env, device)
    except RuntimeError as err:
        return Outcome(case, False, (-1, -1), reasons=[str(err)])
    (code, doc), (back_code, back) = _diff(a, b, env), _diff(b, a, env)
    ok, found, hint, reasons = judge(case, code, doc)
    ok_back, found_back, hint_back, reasons_back = judge(case, back_code, back)
    if (found, hint.split(" ")[0]) != (found_back, hint_back.split(" ")[0]):
        reasons.append(f"the other order says {found_back!r} {hint_back!r}")
        ok = False
    return Outcome(case, ok and ok_back, (code, back_code), found, hint, str(doc.get("mapping_note", "")),
                   reasons + [r for r in reasons_back if r not in reasons])


def run_all(selected: list[Case], out: str, jobs: int = 2, device: str = "cpu") -> list[Outcome]:
    os.makedirs(out, exist_ok=True)
    with ThreadPoolExecutor(jobs) as pool:
        return list(pool.map(lambda c: run_case(c, out, device), selected))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "out", "families"))
    p.add_argument("--only", help="families, comma-separated")
    p.add_argument("--dtype", choices=DTYPES, help="one dtype only")
    p.add_argument("--clean", action="store_true", help="clean pairs only")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--device", default="cpu", help="'cpu' (default) or 'cuda': where both sides train")
    args = p.parse_args(argv)
    selected = cases(args.only.split(",") if args.only else None, (args.dtype,) if args.dtype else DTYPES, args.clean)
    results = run_all(selected, args.out, args.jobs, args.device)
    for r in results:
        print(f"{'PASS' if r.passed else 'FAIL'} {r.case.name:32s} exit {r.codes[0]}/{r.codes[1]}  {r.found}  {r.hint}")
        if not r.passed:
            for line in r.reasons[:6]:
                print(f"      {line}")
    clean = [r for r in results if not r.case.fault]
    faults = [r for r in results if r.case.fault]
    print(f"clean pairs agree in both orders: {sum(r.passed for r in clean)}/{len(clean)}; faults found at their "
          f"module with the right hint first: {sum(r.passed for r in faults)}/{len(faults)}")
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
