"""The family matrix, whole: megatron-core against each Hugging Face decoder family of ``examples/families/table.py``,
FP32 and BF16, clean pairs in both argument orders and the faults conversions really have.

    python benchmarks/agreement_families.py                     # every family (~6 min on 2 cores)
    python benchmarks/agreement_families.py --markdown out.md   # also the table for docs/agreement.md
    python benchmarks/agreement_families.py --device cuda --dtype bfloat16 --jobs 4   # on a GPU

Cases, judging and the expected place and hint of each fault are ``examples/families/matrix.py``'s (its sample runs in
CI: ``tests/test_families.py``). One row per family and dtype: the clean outcome in both orders, the mapping the diff
derived, then each fault with its first divergence and top hint.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from examples.families.matrix import Outcome, cases, run_all  # noqa: E402


def table(results: list[Outcome]) -> list[str]:
    rows: dict[tuple[str, str], list[Outcome]] = {}
    for r in results:
        rows.setdefault((r.case.family, r.case.dtype), []).append(r)
    lines = ["| family | dtype | clean pair (both orders) | mapping derived | conversion faults (first divergence, top hint) |",
             "|---|---|---|---|---|"]
    for (family, dtype), outs in rows.items():
        clean = next((r for r in outs if not r.case.fault), None)
        verdict = "-" if clean is None else (f"{'✓' if clean.passed else '✗'} exit {clean.codes[0]}/{clean.codes[1]}"
                                             + (f" ({clean.hint})" if clean.hint else "")
                                             + (f" ({clean.found})" if clean.found.startswith("routed") else ""))
        derived = clean.note.split(": B is")[0].replace("derived from the captures ", "") if clean and clean.note else "-"
        faults = "; ".join(f"{'✓' if r.passed else '✗'} {r.case.fault}: {r.found} ({r.hint})" for r in outs
                           if r.case.fault)
        lines.append(f"| {family} | {'BF16' if dtype == 'bfloat16' else 'FP32'} | {verdict} | {derived} | {faults or '-'} |")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "out", "families"))
    p.add_argument("--markdown", help="write the table here")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--device", default="cpu", help="'cpu' (default) or 'cuda': where both sides train")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), help="one dtype only")
    args = p.parse_args()
    start = time.perf_counter()
    results = run_all(cases(dtypes=(args.dtype,) if args.dtype else ("float32", "bfloat16")), args.out, args.jobs,
                      args.device)
    lines = table(results)
    clean = [r for r in results if not r.case.fault]
    faults = [r for r in results if r.case.fault]
    summary = (f"clean pairs agree in both orders: "
               f"{sum(r.passed for r in clean)}/{len(clean)}; conversion faults at their module with the right hint "
               f"first: {sum(r.passed for r in faults)}/{len(faults)} ({time.perf_counter() - start:.0f} s)")
    print("\n".join(lines + [summary]))
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as fh:
            fh.write("\n".join(lines + ["", summary]) + "\n")
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
