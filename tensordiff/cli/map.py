"""``tensordiff map A B -o mapping.yaml``: propose a mapping file for a pair no built-in mapping fits."""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

from .._text import listing, plural
from ..diff.autoselect import picked_name
from ..diff.propose import propose
from ..errors import UsageError
from ._args import console


def add_parsers(sub: Any) -> None:
    m = sub.add_parser("map", help="propose a mapping file (B's names onto A's) from two captures of one checkpoint",
                       description="Match B's parameters to A's by value (the same checkpoint at the first step, under "
                                   "known transforms and joins), then modules by tree position, class and shape; "
                                   "write rename rules to edit, with what stays unmatched commented out.",
                       epilog="example: tensordiff map mcore.h5 hf.h5 -o mapping.yaml; then "
                              "tensordiff diff mcore.h5 hf.h5 --mapping mapping.yaml")
    m.add_argument("a", help="capture A (the names to map onto)")
    m.add_argument("b", help="capture B (the names to map)")
    m.add_argument("-o", "--output", help="write the mapping here (default: print it)")
    m.add_argument("--step", type=int, help="the step to match (default: the first both hold; its weights must be "
                                            "one checkpoint)")
    m.add_argument("--force", action="store_true", help="overwrite an existing --output file")
    m.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.output and os.path.exists(args.output) and not args.force:
        raise UsageError(f"{args.output}: already exists; pass --force to overwrite it, or another -o")
    prop = propose(args.a, args.b, args.step)
    text = prop.yaml()
    if not args.output:
        print(text, end="")
        return 0
    with open(args.output, "w", encoding="utf-8") as fh:
        fh.write(text)
    out = console(None)
    if prop.derived:
        line = f"wrote the mapping {picked_name(prop.builtin)}: roles from structure and configs, not values"
        if prop.builtin_trial is not None:
            t = prop.builtin_trial
            line += (f"; trial diff of step {prop.step}: {sum(c.compared for c in t.coverage.values())} pairs "
                     f"compared, {t.outcome}" + (f", first divergence at {t.first.label_a}" if t.first else ""))
        out.print(line)
        for finding in prop.findings:
            out.print(f"finding: {finding}", style="tensordiff.diverged")
        out.print(f"wrote {args.output}; tensordiff diff {args.a} {args.b} uses the same mapping without --mapping")
        return 0
    if prop.builtin:
        line = (f"a mapping tensordiff diff picks by itself fits these captures already: {picked_name(prop.builtin)}; "
                f"`tensordiff diff {args.a} {args.b}` uses it")
        if prop.builtin_trial is not None:
            t = prop.builtin_trial
            line += (f" ({sum(c.compared for c in t.coverage.values())} pairs compared at step {prop.step}, "
                     f"{t.outcome})")
        out.print(line + ". The proposal is written anyway: prefer that one unless it fits worse.",
                  style="tensordiff.unmatched", markup=False)
    joined = sum(len(m.b) for m in prop.matches if m.how == "join")
    out.print(f"parameters: {prop.params_by_value} of B's {prop.params_total_b} matched A's {prop.params_total_a} by value "
              f"at step {prop.step}" + (f" ({joined} of them joined into {sum(m.how == 'join' for m in prop.matches)} of "
                                        "A's)" if joined else "") + (", statistics only" if prop.stats_only else ""))
    by = {how: sum(m.how == how for m in prop.matches) for how in ("value", "join", "tree", "class")}
    out.print(f"modules paired: {by['value']} by parameter values, {by['join']} by joined parameters, {by['tree']} by the "
              f"module tree, {by['class']} by class and shape")
    if prop.trial is not None:
        t = prop.trial
        compared = sum(c.compared for c in t.coverage.values())
        differ = sum(r.verdict == "diverged" for r in t.rows)
        share = ", ".join(f"{ph} {c.share_a:.0%} · {c.share_b:.0%}" for ph, c in t.coverage.items())
        out.print(f"trial diff of step {prop.step} with these rules: {plural(compared, 'pair', 'pairs')} compared"
                  + (f", {differ} differ (a real divergence, or a wrong guess: read the rules)" if differ else "")
                  + f"; compared (A · B): {share}")
    if prop.not_compared:
        out.print(f"found but not compared, their shapes differ: {listing(prop.not_compared, 3, '; ')} "
                  "(listed in the file)")
    for side, left in (("A", prop.left_a), ("B", prop.left_b)):
        if left:
            n = sum(len(v) for v in left.values())
            out.print(f"no counterpart in {'B' if side == 'A' else 'A'} for {plural(n, 'record', 'records')} of {side}: "
                      f"{listing(_shown(p) for p in left)} (commented out under ignore: uncomment "
                      "what should be left out)")
    for finding in prop.findings:
        out.print(f"finding: {finding}", style="tensordiff.diverged")
    out.print(f"wrote {args.output}; next: tensordiff diff {args.a} {args.b} --mapping {args.output}")
    return 0


def _shown(pattern: str) -> str:
    """A module pattern as a reader writes the name: 'decoder.layers.N.mlp', '<model>'."""
    return re.sub(r"\{\w+\}", "N", pattern) or "<model>"
