"""The agreement matrix, whole: every generated clean pair must agree, every injected fault be found at its place.

    python benchmarks/agreement_matrix.py                      # all pairs and faults (~10 min on 2 cores)
    python benchmarks/agreement_matrix.py --markdown out.md    # also the table for docs/agreement.md

Pairs and faults come from ``examples/pairs/matrix.py`` (shared with ``tests/test_agreement_matrix.py``, which runs
its fixed sample in CI). One row per pair: the clean outcome, what was accounted for and by which rule, the coverage;
then for each fault where its first divergence was named and the top hint. Two rates at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from examples.pairs.matrix import Outcome, Runner, all_cases  # noqa: E402


def table(results: list[Outcome]) -> list[str]:
    clean = {r.case: r for r in results if not r.fault}
    faults: dict[str, list[Outcome]] = {}
    for r in results:
        if r.fault:
            faults.setdefault(r.case.split("+")[0], []).append(r)
    lines = ["| pair | clean | accounted for (rule: records) | faults found at their place (first divergence, top hint) |",
             "|---|---|---|---|"]
    for name in [n for n in faults if n not in clean]:  # faults whose pair has no clean row of its own
        clean[name] = None  # type: ignore[assignment]
    for name, r in clean.items():
        fs = "; ".join(f"{'✓' if f.passed else '✗'} {f.fault}: {f.found or f.outcome}{' (' + f.hint + ')' if f.hint else ''}"
                       for f in faults.get(name, []))
        if r is None:
            lines.append(f"| {name} | - | - | {fs} |")
            continue
        acc = ", ".join(f"{rule} {n}" for rule, n in sorted(r.accounted.items())) or "-"
        lines.append(f"| {name} | {'✓' if r.passed else '✗'} {r.outcome} (exit {r.exit_code}) | {acc} | {fs} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "out", "matrix"))
    p.add_argument("--markdown", help="write the table and the rates here")
    p.add_argument("--jobs", type=int, default=2)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    results = Runner(args.out).run_all(all_cases(), jobs=args.jobs)
    clean = [r for r in results if not r.fault]
    faults = [r for r in results if r.fault]
    lines = table(results)
    rates = (f"clean pairs that agree: {sum(r.passed for r in clean)}/{len(clean)}; "
             f"faults diverged at their module and phase, the right hint first: {sum(r.passed for r in faults)}/{len(faults)} "
             f"({time.perf_counter() - t0:.0f} s)")
    print("\n".join(lines))
    print(rates)
    for r in results:
        if not r.passed:
            print(f"FAIL {r.case}: exit {r.exit_code} {r.outcome} {r.found}")
            for line in r.unaccounted[:10] + r.reasons[:4]:
                print(f"    {line}")
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as fh:
            fh.write("\n".join(lines) + f"\n\n{rates}\n")
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
