"""Checks on a diff's accounting shared by the tests of real model pairs (framework-free)."""

from __future__ import annotations

import re


def unaccounted_citations(rows: list[dict]) -> list[str]:
    """(JSON report rows) every accounted record whose reason names a record of the same step left unaccounted:
    what must never be (a record accounted for by reference to one that is not)."""
    bad = []
    for step in sorted({r["step"] for r in rows}):
        step_rows = [r for r in rows if r["step"] == step]
        left = [r["a"] or r["b"] for r in step_rows if r["verdict"] == "unmatched" and not r["linked"]
                and not r["not_recorded"] and r["accounted"] is None]
        for r in step_rows:
            if r["accounted"] is None:
                continue
            for label in left:
                if re.search(re.escape(label) + r"(?![\w.\[])", r["accounted"]["why"]):
                    bad.append(f"step {step}: {r['a'] or r['b']} ({r['accounted']['why']}) cites {label}")
    return bad
