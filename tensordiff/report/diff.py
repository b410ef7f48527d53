"""Rendering a diff: rich tables (readable at 80 columns, without colour) and the JSON report."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from rich import box
from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from .._text import plural
from ..diff.result import DiffResult, Row, RowVerdict, phase_rows
from ..explain.diagnosis import Diagnosis
from ..explain.hints import CHECKED, CheckStatus
from ..explain.place import as_dict as first_as_dict
from ..explain.place import explanation
from ..record import module_label
from .theme import MAX_ROWS, Name, collapse, fmt, fmt_cos, table_width, wide

VERDICT_TEXT: dict[RowVerdict, str] = {"ok": "ok", "diverged": "DIVERGED", "unmatched": "unmatched", "shape": "SHAPE",
                                      "drift": "drift", "skipped": "skipped", "uncertain": "UNCERTAIN",
                                      "routed": "routed"}
JSON_VERSION = 1
_STEP = re.compile(r"\b([Ss])tep (\d+)\b")


class DiffReport:
    """A diff result (and, for a ``Diagnosis``, its likely causes) that renders itself: ``console.print(report)``."""

    def __init__(self, result: DiffResult, max_rows: int | None = None, phases: Iterable[str] | None = None,
                 first_only: bool = False, iteration_of: Callable[[int], int] | None = None):
        self.result = result
        self.max_rows = MAX_ROWS if max_rows is None else max_rows
        self.phases = set(phases) if phases else None
        self.first_only = first_only
        #: a capture step's training iteration (``tensordiff locate``: the resumed run's numbering), said instead
        self.iteration_of = iteration_of

    def _steps(self, text: str) -> str:
        """``text`` with its capture steps ("step 1", "Step 0") said as iterations, where they are known."""
        if self.iteration_of is None:
            return text
        of = self.iteration_of
        return _STEP.sub(lambda m: f"{'I' if m.group(1) == 'S' else 'i'}teration {of(int(m.group(2)))}", text)

    # ------------------------------------------------------------------ text
    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        res = self.result
        given = (" (given second)", " (given first)") if res.swapped else ("", "")
        yield Text.assemble(("A ", "tensordiff.title"), f"{res.path_a} ({_who(res.attrs_a)}){given[0]}")
        yield Text.assemble(("B ", "tensordiff.title"), f"{res.path_b} ({_who(res.attrs_b)}){given[1]}")
        if res.mapping_note:
            yield Text.assemble(("mapping ", "tensordiff.title"), (res.mapping_note, "tensordiff.dim"))
        if res.rank_inconsistencies:
            n = len(res.rank_inconsistencies)
            yield Text(f"cross-rank check: {n} record(s) that must be identical on every rank differ: "
                       f"{'; '.join(res.rank_inconsistencies[:3])}{' ...' if n > 3 else ''}", style="tensordiff.diverged")
        first = res.first
        first_key = (first.step, first.phase, first.label_a, first.label_b) if first else None
        for step, phase, rows in phase_rows(res):
            if self.phases is not None and phase not in self.phases:
                continue
            if self.first_only and first is not None and (step, phase) != (first.step, first.phase):
                continue
            if self.first_only and first is None and self.max_rows > 0 and not any(map(_open, rows)):
                continue  # no divergence: only the tables holding what keeps it from agreeing (--max-rows 0: all)
            yield wide(self._table(step, phase, rows, first_key, table_width(console, options)))
        yield self._summary()
        for side, where in res.nonfinite.items():
            if where is not None:
                yield Text(f"{side}'s first NaN/Inf (execution order): {where}", style="tensordiff.diverged")
        if first is not None:
            style = "tensordiff.diverged"
            title = "First divergence" if first.introduced else "First divergence (accumulated, not introduced at one place)"
            body = Name(Text(self._steps(explanation(first))))
            yield Panel(body, title=title, title_align="left", border_style=style,
                        box=box.ASCII if console.legacy_windows else box.ROUNDED)
            yield from self._hints()
            for finding in res.findings:  # what the accounting found besides (a RoPE table, a pad-token loss mask)
                yield Text(f"Also found: {finding}", style="tensordiff.unmatched")
        elif res.outcome == "inconclusive":
            yield Text("Inconclusive: no divergence among the pairs compared, but not everything was compared "
                       "(exit code 3):", style="tensordiff.inconclusive")
            for reason in res.reasons:
                yield Name(Text(f"  - {reason}", style="tensordiff.unmatched"), indent="    ")
        else:
            skipped = any(c.not_recorded_a or c.not_recorded_b for c in res.coverage.values())
            accounted = any(c.accounted_a or c.accounted_b for c in res.coverage.values())
            why = _not_recorded_why(res)
            yield Text("No divergence: every record of both runs was compared, or ignored on purpose by the mapping"
                       + (", or accounted for by a rule of structure and value (the 'accounted' lines)"
                          if accounted else "")
                       + (f", or is of a kind the other side never records ({why})" if skipped else "")
                       + ", and every pair is within its tolerance"
                       + (", but for the 'routed' rows below." if res.routing else "."), style="tensordiff.ok")
        yield from _routing_lines(res)

    def _table(self, step: int, phase: str, rows: list[Row], first_key: Any, width: int) -> Table | Group:
        wide = width >= 110
        table = Table(title=self._steps(f"step {step}") + f" · {phase}", title_justify="left", box=box.SIMPLE_HEAD,
                      pad_edge=False, show_edge=False, expand=False)
        table.add_column("#", justify="right", style="tensordiff.dim", no_wrap=True)
        table.add_column("module · tensor", overflow="fold", ratio=1)
        if wide:
            table.add_column("dtype", no_wrap=True)
        three = self.result.options.reference is not None
        if three:  # B judged by its error against the reference R, next to A's own
            table.add_column("A↔B", justify="right", no_wrap=True)
            table.add_column("A↔R", justify="right", no_wrap=True)
            table.add_column("B↔R", justify="right", no_wrap=True)
        else:
            table.add_column("rel L2", justify="right", no_wrap=True)
            table.add_column("max|Δ|", justify="right", no_wrap=True)
        if wide:
            table.add_column("cos", justify="right", no_wrap=True)
            table.add_column("ulp%", justify="right", no_wrap=True)
            table.add_column("tol", justify="right", no_wrap=True)
        table.add_column("verdict", no_wrap=True)
        stats_only = [r for r in rows if r.metrics is not None and r.metrics.source == "stats"]
        if stats_only:
            table.caption = ("~ compared by statistics only (tensors not stored for this step; "
                             "capture with --tensors all to store them)")
            table.caption_justify = "left"
        unmatched: dict[str, list[Row]] = {"A": [], "B": []}
        linked: list[Row] = []
        accounted: list[Row] = []
        skipped_kinds: dict[str, list[Row]] = {"A": [], "B": []}
        if self.max_rows > 0:  # one line per side for the records with no counterpart (--max-rows 0 lists them)
            for row in rows:
                if row.verdict == "unmatched" and row.linked:
                    linked.append(row)
                elif row.verdict == "unmatched" and row.accounted is not None:
                    accounted.append(row)
                elif row.verdict == "unmatched" and row.not_recorded:
                    skipped_kinds["A" if row.pair.a is not None else "B"].append(row)
                elif row.verdict == "unmatched":
                    unmatched["A" if row.pair.a is not None else "B"].append(row)
            rows = [r for r in rows if r.verdict != "unmatched"]
        after = after_bad = 0
        if self.first_only and self.max_rows > 0 and first_key is not None:
            at = next((i for i, r in enumerate(rows) if r.pair.a is not None
                       and (r.step, r.phase, r.pair.a.label, r.pair.b.label if r.pair.b else None) == first_key),
                      None)
            if at is not None and len(rows) > at + 4:
                after = len(rows) - (at + 4)
                after_bad = sum(1 for r in rows[at + 4:] if r.verdict == "diverged")
                rows = rows[:at + 4]
        shown = _select(rows, self.max_rows)
        for item in shown:
            if isinstance(item, int):
                table.add_row("", Text(f"… {item} rows within tolerance (--max-rows 0 shows all)", style="tensordiff.dim"),
                              *([""] * (len(table.columns) - 2)))
                continue
            row = item
            rec = row.pair.a or row.pair.b
            assert rec is not None
            is_first = first_key is not None and row.pair.a is not None and (
                row.step, row.phase, row.pair.a.label, row.pair.b.label if row.pair.b else None) == first_key
            name = Text(module_label(rec.module) + (f"[{rec.call}]" if rec.call else ""))
            name.append(f" {rec.tensor_label}", style="tensordiff.dim")
            if (row.pair.a is not None and row.pair.b is not None and row.pair.b.label != row.pair.a.label
                    and (row.pair.how != "prefix" or row.pair.stand_in)):  # a wrapper prefix is not worth a line;
                # a gradient standing in for a local one (before the DP reduction) is
                name.append(f"\n  B: {row.pair.b.label}", style="tensordiff.dim")
            elif row.pair.a is None:
                name.append("  (B only)", style="tensordiff.unmatched")
            elif row.pair.b is None:
                name.append("  (A only)", style="tensordiff.unmatched")
            if row.note and row.note != "statistics only":
                name.append(f"\n  {row.note}", style="tensordiff.dim")
            m = row.metrics
            verdict = VERDICT_TEXT.get(row.verdict, row.verdict)
            vstyle = f"tensordiff.{row.verdict}"
            if is_first:
                verdict, vstyle = "FIRST", "tensordiff.first"
            cells: list[Any] = [str(rec.seq), Name(name, indent="  ")]
            if wide:
                b_dtype = row.pair.b.dtype if row.pair.b is not None else rec.dtype
                cells.append(rec.dtype if b_dtype == rec.dtype else f"{rec.dtype}/{b_dtype}")
            approx = "~" if m is not None and m.source == "stats" else ""
            if three:
                cells += [fmt(row.ab.rel_l2) if row.ab else (approx + fmt(m.rel_l2) if m else "-"),
                          fmt(row.ref_a) if not math.isnan(row.ref_a) else "-",
                          (approx + fmt(m.rel_l2)) if m and row.ab else "-"]
            else:
                cells += [approx + fmt(m.rel_l2) if m else "-", fmt(m.max_abs) if m else "-"]
            if wide:
                ulp = f"{100 * m.ulp_share:.1f}" if m and not math.isnan(m.ulp_share) else "-"
                cells += [fmt_cos(m.cosine) if m else "-", ulp, fmt(row.tol) if m else "-"]
            cells.append(Text(verdict, style=vstyle))
            table.add_row(*cells)
        if after:
            table.add_row("", Text(f"… {after} more rows after the first divergence ({after_bad} over tolerance: "
                                   "it propagates; --max-rows 0 shows all)", style="tensordiff.dim"),
                          *([""] * (len(table.columns) - 2)))
        notes: list[Text] = []  # below the table, at full width
        for side, lost in unmatched.items():
            if lost:
                names = sorted({re.sub(r"\.\d+(?=\.|$)", ".N", module_label((r.pair.a or r.pair.b).module))  # type: ignore[union-attr]
                                for r in lost})
                other = "B" if side == "A" else "A"
                notes.append(Text(f"    {side} only, no counterpart in {other}: {plural(len(lost), 'record', 'records')} "
                                  f"of {', '.join(names)}", style="tensordiff.unmatched"))
        if linked:
            notes.append(Text(f"    {plural(len(linked), 'record', 'records')} recorded again under another name, compared "
                              "there (--max-rows 0 lists them)", style="tensordiff.dim"))
        for line in _accounted_lines(accounted):
            notes.append(Text(line, style="tensordiff.dim"))
        for side, lost in skipped_kinds.items():
            if lost:
                other = "B" if side == "A" else "A"
                kinds = sorted({(r.pair.a or r.pair.b).kind for r in lost})  # type: ignore[union-attr]
                notes.append(Text(f"    {side}'s {plural(len(lost), 'record', 'records')} of kind {', '.join(kinds)}: {other} "
                                  "never records these (a graph-mode capture), not compared", style="tensordiff.dim"))
        return Group(table, *notes) if notes else table

    def _hints(self) -> RenderResult:
        res = self.result
        if not isinstance(res, Diagnosis):
            return
        if res.hints:
            yield Text("Likely causes, tested on the captured tensors (share of the gap each explains):",
                       style="tensordiff.title")
            grid = Table.grid(padding=(0, 1))
            grid.add_column(no_wrap=True, justify="right")
            grid.add_column(no_wrap=True, justify="right")
            grid.add_column(ratio=1, overflow="fold")
            for i, hint in enumerate(res.hints, 1):
                text = Text(f"{hint.cause}: ", style="tensordiff.title")
                text.append(self._steps(hint.title))
                if hint.evidence:
                    text.append(f"\n{self._steps(hint.evidence)}", style="tensordiff.dim")
                grid.add_row(f"{i}.", Text(f"{hint.explained:.1%}", style="tensordiff.ok" if hint.explained > 0.9 else ""),
                             Name(text))
            yield grid
            if res.hints[0].explained < 0.9 and res.not_checked:  # a partial answer: say what else was not tested
                yield Text(f"Not tested here: {_not_tested(res.not_checked)}.", style="tensordiff.dim")
        elif res.hints_note:
            yield Text(res.hints_note, style="tensordiff.dim")
        elif res.first is not None and res.checked:
            yield Text(f"No known cause explains this divergence (tested: {', '.join(res.checked)}).",
                       style="tensordiff.dim")
            yield Text((f"Not tested here: {_not_tested(res.not_checked)}. " if res.not_checked else "")
                       + "See docs/hints.md.", style="tensordiff.dim")
        elif res.first is not None and res.checks:
            yield Text(f"No cause could be tested here: {_not_tested(res.not_checked)}.", style="tensordiff.dim")

    def _summary(self) -> Text:
        res = self.result
        text = Text()
        text.append(f"{len(res.steps)} step(s) compared: ")
        text.append(f"{res.count('ok')} ok", style="tensordiff.ok")
        text.append(", ")
        text.append(f"{res.count('diverged')} diverged", style="tensordiff.diverged" if res.count("diverged") else "")
        text.append(", ")
        only_a, only_b = res.only_in("a"), res.only_in("b")
        text.append(f"{only_a} only in A, {only_b} only in B", style="tensordiff.unmatched" if only_a or only_b else "")
        linked = res.linked("a") + res.linked("b")
        if linked:
            text.append(f" ({linked} more recorded again under another name, compared there)", style="tensordiff.dim")
        by_rule = _rule_counts(res.rows)
        if by_rule:
            text.append("; accounted by rule: " + ", ".join(f"{n} {rule}" for rule, n in by_rule.items()),
                        style="tensordiff.dim")
        skipped = [sum(getattr(c, f"not_recorded_{s}") for c in res.coverage.values()) for s in "ab"]
        if any(skipped):
            why = _not_recorded_why(res)
            text.append(f"; not recorded by the other side on purpose ({why}): "
                        f"{skipped[0]} of A's, {skipped[1]} of B's", style="tensordiff.dim")
        if res.count("drift"):
            text.append(f", {res.count('drift')} drifted without effect", style="tensordiff.drift")
        if res.count("routed"):
            text.append(f", {res.count('routed')} differ only through tokens routed apart on a near tie (rule routing)",
                        style="tensordiff.drift")
        if res.count("shape"):
            text.append(f", {res.count('shape')} with different shapes", style="tensordiff.shape")
        if res.count("skipped"):
            text.append(f", {res.count('skipped')} not comparable from statistics", style="tensordiff.skipped")
        if res.count("uncertain"):
            text.append(f", {res.count('uncertain')} uncertain pairs", style="tensordiff.unmatched")
        if res.only_a_steps or res.only_b_steps:
            text.append(f"; steps only in A: {res.only_a_steps}, only in B: {res.only_b_steps}", style="tensordiff.unmatched")
        if res.coverage:
            text.append("\ncompared (A · B): ")
            parts = []
            for phase, cov in res.coverage.items():
                parts.append(f"{phase} {_share(cov.compared_a, cov.recorded_a)} · "
                             f"{_share(cov.compared_b, cov.recorded_b)}")
            text.append(", ".join(parts), style="tensordiff.dim")
        return text

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        res = self.result
        hints = res.hints if isinstance(res, Diagnosis) else []
        hints_note = res.hints_note if isinstance(res, Diagnosis) else ""
        checks = res.checks if isinstance(res, Diagnosis) else []
        rows = []
        for row in res.rows:
            a, b = row.pair.a, row.pair.b
            rows.append({
                "step": row.step, "phase": row.phase, "verdict": row.verdict, "how": row.pair.how or None,
                "linked": row.linked, "not_recorded": row.not_recorded,
                "accounted": row.accounted.as_dict() if row.accounted else None, "stand_in": row.pair.stand_in or None,
                "a": a.label if a else None, "b": b.label if b else None,
                "module_a": a.module if a else None, "module_b": b.module if b else None,
                "kind": (a or b).kind, "slot": (a or b).slot,  # type: ignore[union-attr]
                "dtype_a": a.dtype if a else None, "dtype_b": b.dtype if b else None,
                "tolerance": row.tol if row.metrics else None,
                "metrics": row.metrics.as_dict() if row.metrics else None, "note": row.note or None,
            })
        return {
            "tensordiff_report": JSON_VERSION,
            "a": _side(res.path_a, res.attrs_a),
            "b": _side(res.path_b, res.attrs_b),
            "steps": res.steps,
            "hints": [h.as_dict() for h in hints], "hints_note": hints_note or None,
            "checks": [c.as_dict() for c in checks],
            "summary": {"ok": res.count("ok"), "diverged": res.count("diverged"), "drift": res.count("drift"),
                        "routed": res.count("routed"),
                        "only_a": res.only_in("a"), "only_b": res.only_in("b"),
                        "linked_a": res.linked("a"), "linked_b": res.linked("b"),
                        "shape_mismatch": res.count("shape"), "skipped": res.count("skipped"),
                        "steps_only_a": res.only_a_steps, "steps_only_b": res.only_b_steps,
                        "uncertain": res.count("uncertain"),
                        "not_recorded_a": sum(c.not_recorded_a for c in res.coverage.values()),
                        "not_recorded_b": sum(c.not_recorded_b for c in res.coverage.values()),
                        "accounted": _rule_counts(res.rows)},
            "exact": res.exact or None,
            "first_divergence": first_as_dict(res.first) if res.first else None,
            "outcome": res.outcome, "exit_code": res.exit_code, "inconclusive_reasons": res.reasons,
            "findings": res.findings,
            "routing": [f.as_dict() for f in res.routing],
            "mapping_note": res.mapping_note or None,
            "swapped": res.swapped,
            "rank_inconsistencies": res.rank_inconsistencies,
            "first_nonfinite": {"a": res.nonfinite.get("A"), "b": res.nonfinite.get("B")},
            "coverage": {phase: cov.as_dict() for phase, cov in res.coverage.items()},
            "rows": rows,
        }



def _routing_lines(res: DiffResult) -> Iterator[Text]:
    """The near-tie routing flips (``diff.routing``) and what they account for: said whenever there are any."""
    for flip in res.routing:
        routed = [r for r in res.rows if r.step == flip.step and r.verdict == "routed"]
        first_of_step = flip is next(f for f in res.routing if f.step == flip.step)
        tokens = f"token{'s' if len(flip.tokens) > 1 else ''} {flip.where()} of A's {list(flip.grid_a)} layout"
        yield Text(
            f"Routing, step {flip.step}: the routers of {module_label(flip.module_a)} sent "
            f"{plural(len(flip.tokens), 'token', 'tokens')} of {flip.tokens_total} ({tokens}) to other experts on a "
            f"near tie of their router scores (each gap at most {flip.gap_share:.0%} of what the runs' own difference "
            f"moves it by): rounding decided, not a conversion fault. The other tokens agree there (rel L2 "
            f"{flip.rest:.1e}, tolerance {flip.tol:.1e}). "
            + (f"{plural(len(routed), 'record', 'records')} of this step differ only through these tokens (verdict "
               "'routed', each with its check)." if routed and first_of_step else ""),
            style="tensordiff.drift")


def _share(part: int, whole: int) -> str:
    """'100%', '97%', '-' (nothing recorded); never rounds a gap up to 100%."""
    if not whole:
        return "-"
    share = part / whole
    return "100%" if part == whole else f"{min(share, 0.99):.0%}"


def _not_tested(statuses: list[CheckStatus]) -> str:
    """'RoPE (needs a 4-D tensor, this one is 2-D); norm epsilon, bias (not for a forward input)': causes that share
    a reason are named together; the reason alone when every cause shares it."""
    by_reason: dict[str, list[str]] = {}
    for c in statuses:
        by_reason.setdefault(c.reason, []).append(c.cause)
    if len(by_reason) == 1 and len(statuses) == len(CHECKED):
        return next(iter(by_reason))
    return "; ".join(f"{', '.join(causes)} ({reason})" for reason, causes in by_reason.items())


def _side(path: str, attrs: dict) -> dict[str, Any]:
    return {"path": path, "framework": attrs.get("framework"), "framework_version": attrs.get("framework_version"),
            "capture_mode": attrs.get("capture_mode") or "hooks"}


def _who(attrs: dict) -> str:
    parts = [str(attrs.get("framework", "?")) + " " + str(attrs.get("framework_version", ""))]
    for key, label in (("megatron_core_version", "megatron-core"), ("transformers_version", "transformers"),
                       ("mindformers_version", "mindformers")):
        if key in attrs:
            parts.append(f"{label} {attrs[key]}")
    if "model_class" in attrs:
        parts.append(str(attrs["model_class"]))
    if attrs.get("capture_mode") == "graph":
        parts.append("graph mode")
    return ", ".join(p.strip() for p in parts)


def _open(row: Row) -> bool:
    """A row behind an inconclusive reason: not compared, and not accounted for by any rule."""
    if row.verdict == "unmatched":
        return not (row.linked or row.not_recorded or row.accounted is not None)
    return row.verdict in ("shape", "skipped", "uncertain")


def _select(rows: list[Row], max_rows: int) -> list[Row | int]:
    """Rows to show: all non-ok rows and context; long runs of ok rows collapse into one marker."""
    if max_rows <= 0 or len(rows) <= max_rows:
        return list(rows)
    keep: set[int] = set()
    for i, row in enumerate(rows):
        if row.verdict != "ok":
            keep.update(range(max(0, i - 2), min(len(rows), i + 3)))
    budget = max_rows - len(keep)
    i = 0
    while budget > 0 and i < len(rows):
        if i not in keep:
            keep.add(i)
            budget -= 1
        i += 1
    return collapse(rows, keep)




def _rule_counts(rows: list[Row]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for row in rows:
        if row.verdict == "unmatched" and row.accounted is not None:
            counts[row.accounted.rule] = counts.get(row.accounted.rule, 0) + 1
    return counts


#: layer numbers in module names ('decoder.layers.3.mlp' -> 'decoder.layers.N.mlp'), not slots or counts
_FOLD = re.compile(r"(?<=[A-Za-z_])\.\d+(?=\.[A-Za-z_]|\s(?:input|output|grad_input|grad_output|grad)\b|$)")


def _accounted_lines(rows: list[Row]) -> list[str]:
    """One line per (side, rule, reason with layer numbers folded): what was accounted for and why."""
    groups: dict[tuple[str, str, str], list[Row]] = {}
    for row in rows:
        assert row.accounted is not None
        side = "A" if row.pair.a is not None else "B"
        why = _FOLD.sub(".N", row.accounted.why)
        groups.setdefault((side, row.accounted.rule, why), []).append(row)
    out = []
    for (side, rule, why), items in groups.items():
        names = sorted({f"{_FOLD.sub('.N', module_label(rec.module))} {rec.tensor_label}"
                        for r in items for rec in [r.pair.a or r.pair.b] if rec is not None})
        shown = ", ".join(names[:3]) + (f" (+{len(names) - 3})" if len(names) > 3 else "")
        out.append(f"    {side}: {plural(len(items), 'record', 'records')} accounted ({rule}): {shown}: {why}")
    return out


def _not_recorded_why(res: DiffResult) -> str:
    """Why records of one side have no counterpart on purpose: a source's own words (Megatron-LM's gradient files
    hold gradients only), else graph mode's."""
    return "; ".join(str(attrs["not_recorded_why"]) for attrs in (res.attrs_a, res.attrs_b)
                     if attrs.get("not_recorded_why")) or "graph mode: gradients of cell inputs"
