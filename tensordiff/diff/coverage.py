"""Honest coverage: what was compared, which pairs are only guesses, and whether "no divergence" means agreement.

A diff can only vouch for what it compared. Three rules keep it from passing silently:

* a pair made by order and shape alone, across modules whose names and classes both disagree, is a guess:
  when its values differ it becomes an *uncertain* row (with its evidence), never a divergence on its own;
* coverage is counted per phase: records on each side, and the pairs whose two tensors were judged;
* no divergence is called agreement (exit 0) only when every record on both sides was compared (as a pair,
  or as the same tensor under another record of its side) or is ignored on purpose by the mapping, and every
  phase A recorded had pairs compared. Otherwise the outcome is *inconclusive* (exit 3), each reason named.
"""

from __future__ import annotations

import re
from collections import Counter

from ..record import PHASES, Record, module_label
from .result import COMPARED, DiffResult, Outcome, PhaseCoverage, Row

_INDEX = re.compile(r"\.\d+(?=\.|$)")


def _leaf(rec: Record) -> str:
    """The last word of a module name, numbers dropped: 'decoder.layers.3.mlp' -> 'mlp'."""
    name = _INDEX.sub("", rec.module)
    return name.rsplit(".", 1)[-1]


def mark_uncertain(rows: list[Row]) -> None:
    """Diverged pairs matched by order and shape only are 'uncertain' when the evidence against them is as strong
    as for them: their module names and classes both disagree, or they are arguments of other names (an argument
    is paired by its name, never by its position alone)."""
    for row in rows:
        a, b = row.pair.a, row.pair.b
        if row.verdict != "diverged" or row.pair.how != "order" or a is None or b is None:
            continue
        same_class = bool(a.module_class) and a.module_class == b.module_class
        other_argument = a.kind in ("input", "grad_input") and a.slot != b.slot
        if (same_class or _leaf(a) == _leaf(b)) and not other_argument:
            continue
        row.verdict = "uncertain"
        if other_argument:
            evidence = (f"paired by order and shape only: A's argument {a.tensor_label} of {module_label(a.module)} "
                        f"vs B's {b.tensor_label} of {module_label(b.module)}")
        else:
            evidence = (f"paired by order and shape only: A's {module_label(a.module)} ({a.module_class or '?'}) "
                        f"vs B's {module_label(b.module)} ({b.module_class or '?'}); names and classes differ")
        row.note = evidence if not row.note else f"{row.note}; {evidence}"


SKIPPABLE_KINDS = frozenset({"input", "grad_input"})


def not_recorded(attrs: dict) -> frozenset[str]:
    """The record kinds a capture says it never records (a graph-mode MindSpore capture: cell inputs and their
    gradients), from its ``not_recorded`` attribute."""
    value = attrs.get("not_recorded", "")
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if not isinstance(value, str):
        return frozenset()
    # only kinds a capture may leave out by design: a file saying it never records outputs would hide divergences
    return frozenset(k.strip() for k in value.split(",")) & SKIPPABLE_KINDS


def not_recorded_phases(attrs: dict) -> frozenset[str]:
    """The phases a source says it never holds (``not_recorded_phases``: Megatron-LM's gradient files hold no
    weights, forward or loss), as a reader of that format declares them."""
    value = attrs.get("not_recorded_phases", "")
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    return frozenset(p.strip() for p in value.split(",")) & frozenset(PHASES) if isinstance(value, str) else frozenset()


def mark_unmatched(rows: list[Row], skip_a: frozenset[str] = frozenset(),
                   skip_b: frozenset[str] = frozenset(), phases_a: frozenset[str] = frozenset(),
                   phases_b: frozenset[str] = frozenset()) -> None:
    """Mark the records with no counterpart that need none: ``Row.linked`` when the tensor was compared under another
    record of the same side (a cell's output that is the next module's input: recorded twice, compared once);
    ``Row.not_recorded`` for A's records of a kind B says it never records (``skip_b``: B's ``not_recorded``), and
    the reverse, and for A's records of a phase B's source never holds (``phases_b``: ``not_recorded_phases``). Runs
    before ``accounting.account``, which looks at the rest."""
    seen_a = {r.pair.a.tensor_id for r in rows if r.verdict in COMPARED and r.pair.a is not None}
    seen_b = {x.tensor_id for r in rows if r.verdict in COMPARED for x in r.pair.b_records}
    input_only_a, input_only_b = _input_only_partners(rows)
    for row in rows:
        if row.verdict != "unmatched":
            continue
        a, b = row.pair.a, row.pair.b
        if (a is not None and a.tensor_id in seen_a) or (b is not None and b.tensor_id in seen_b):
            row.linked = True
        elif ((a is not None and (a.phase in phases_b or a.kind in skip_b
                                  or ("grad_input" in skip_b and _tensor_of(a) in input_only_a)))
              or (b is not None and (b.phase in phases_a or b.kind in skip_a
                                     or ("grad_input" in skip_a and _tensor_of(b) in input_only_b)))):
            row.not_recorded = True


def coverage(rows: list[Row]) -> dict[str, PhaseCoverage]:
    """Per phase, in execution order: records on each side and how many were compared. A record with no
    counterpart of its own counts as compared when ``mark_unmatched`` linked it to a compared tensor of its side, or
    when a rule accounted for it (``Row.accounted``); records of a kind the other side never records are counted as
    such (``not_recorded_a`` / ``_b``), named in the report, not left as "only in"."""
    out = {phase: PhaseCoverage(phase) for phase in PHASES}
    for row in rows:
        cov = out[row.phase]
        a = row.pair.a
        # a side's gradient standing in for the local gradient it did not record is counted in its own pair only
        own_a = a is not None and row.pair.stand_in != "a"
        own_b = len(row.pair.b_records) if row.pair.stand_in != "b" else 0
        cov.recorded_a += own_a
        cov.recorded_b += own_b  # a join's parts are records of B's each
        if row.verdict in COMPARED:
            cov.compared_a += own_a
            cov.compared_b += own_b
        elif row.verdict == "unmatched":
            side = "a" if a is not None else "b"
            if row.linked:
                setattr(cov, f"compared_{side}", getattr(cov, f"compared_{side}") + 1)
                setattr(cov, f"linked_{side}", getattr(cov, f"linked_{side}") + 1)
            elif row.accounted is not None:
                setattr(cov, f"compared_{side}", getattr(cov, f"compared_{side}") + 1)
                setattr(cov, f"accounted_{side}", getattr(cov, f"accounted_{side}") + 1)
            elif row.not_recorded:
                setattr(cov, f"not_recorded_{side}", getattr(cov, f"not_recorded_{side}") + 1)
            else:
                setattr(cov, f"only_{side}", getattr(cov, f"only_{side}") + 1)
        elif row.verdict == "uncertain":
            cov.uncertain += 1
        elif row.verdict == "shape":
            cov.shape += 1
        else:
            cov.stats_only += 1
    return {phase: cov for phase, cov in out.items() if cov.recorded_a or cov.recorded_b}


def _tensor_of(rec: Record) -> tuple[int, int] | None:
    """The forward tensor a gradient record belongs to (its ``grad_of``, as the seq first holding it), else None."""
    return (rec.step, rec.grad_of) if rec.phase == "backward" and rec.grad_of >= 0 else None


def _input_only_partners(rows: list[Row]) -> tuple[set, set]:
    """A's forward tensors (as ``Record.tensor_id``, and every seq of A's holding them) whose paired B tensor B holds only as
    cell inputs, and the reverse. A side that never records the gradients of cell inputs (graph mode) has no gradient
    of such a tensor under any name: the other side's gradient of it is accounted for as never recorded there (the
    tensor a Megatron ``core_attention`` returns is, in a compiled MindSpore graph, only ``wo``'s input)."""
    outputs_a = {r.pair.a.tensor_id for r in rows if r.phase == "forward" and r.pair.a is not None
                 and r.pair.a.kind == "output"}
    outputs_b = {x.tensor_id for r in rows if r.phase == "forward" for x in r.pair.b_records if x.kind == "output"}
    partners_a: dict[tuple[int, int], set] = {}
    partners_b: dict[tuple[int, int], set] = {}
    for r in rows:
        if r.phase != "forward" or r.verdict not in COMPARED or r.pair.a is None:
            continue
        for x in r.pair.b_records:
            partners_a.setdefault(r.pair.a.tensor_id, set()).add(x.tensor_id)
            partners_b.setdefault(x.tensor_id, set()).add(r.pair.a.tensor_id)
    only_a = {t for t, bs in partners_a.items() if not bs & outputs_b}
    only_b = {t for t, as_ in partners_b.items() if not as_ & outputs_a}
    # a gradient names its forward record, which may be a link: every seq of the tensor stands for it
    links_a = {(r.pair.a.step, r.pair.a.seq): r.pair.a.tensor_id for r in rows if r.phase == "forward"
               and r.pair.a is not None}
    links_b = {(x.step, x.seq): x.tensor_id for r in rows if r.phase == "forward" for x in r.pair.b_records}
    return ({seq for seq, t in links_a.items() if t in only_a} | only_a,
            {seq for seq, t in links_b.items() if t in only_b} | only_b)


#: Parameter gradients missing on one side: how to record them.
_PARAM_GRAD_FIX = ("; to record B's parameter gradients pass its optimizer to the capture: "
                   "tensordiff.capture(model, path, optimizer=opt) (MindSpore: the optimizer the train step calls; "
                   "--auto finds torch optimizers itself)")


#: The loss missing on one side: how to record it.
_LOSS_FIX = ("; B computes its loss outside the model, where `tensordiff capture --auto` cannot see it: record it "
             "with cap.step(loss) (tensordiff.capture), or return it from the model")


def judge_outcome(result: DiffResult) -> tuple[Outcome, list[str]]:
    """'diverged' when a first divergence was named; else 'agree' or 'inconclusive' with every reason."""
    if result.first is not None:
        return "diverged", []
    reasons = []
    for phase, cov in result.coverage.items():
        if cov.shape:
            reasons.append(f"{phase}: {cov.shape} pair(s) found but not compared: their shapes differ (a mapping or "
                           "layout transform is missing or wrong; see the SHAPE rows)")
        if cov.stats_only:
            why = Counter(r.note for r in result.rows if r.phase == phase and r.verdict == "skipped" and r.note)
            reasons.append(f"{phase}: {cov.stats_only} pair(s) not compared from statistics: " + (
                "; ".join(f"{note} ({n})" for note, n in why.most_common(2)) if why else
                "statistics cannot follow their layout transform; capture with --tensors all to compare them"))
        if cov.uncertain:
            routed = sum(1 for r in result.rows if r.phase == phase and r.verdict == "uncertain"
                         and r.note.startswith("differs after tokens were routed"))
            if routed:
                reasons.append(f"{phase}: {routed} pair(s) differ after tokens were routed to other experts on a near tie, "
                               "and hold statistics only: whether they differ only through those tokens cannot be "
                               "checked (capture with --tensors all; see the 'uncertain' rows)")
            if cov.uncertain - routed:
                reasons.append(f"{phase}: {cov.uncertain - routed} pair(s) matched by order only differ (see the "
                               "'uncertain' rows)")
        if cov.recorded_a and not cov.compared and cov.not_recorded_a < cov.recorded_a:
            reasons.append(f"{phase}: A recorded {cov.recorded_a} record(s), B {cov.recorded_b}, and no pair was compared"
                           + ("" if cov.recorded_b else " (B did not record this phase)")
                           + (_PARAM_GRAD_FIX if phase == "param_grad" and not cov.recorded_b else "")
                           + (_LOSS_FIX if phase == "loss" and not cov.recorded_b else ""))
        elif cov.recorded_b and not cov.recorded_a and phase == "param_grad":
            reasons.append(f"{phase}: B recorded {cov.recorded_b} record(s), A none (A did not record this phase)"
                           + _PARAM_GRAD_FIX.replace("B's", "A's"))
    if result.rank_inconsistencies:
        n = len(result.rank_inconsistencies)
        reasons.append(f"{n} record(s) that must be identical on every rank holding them differ across the rank files "
                       f"(a missing or unwaited all-reduce, an unreduced sequence-parallel gradient): "
                       f"{'; '.join(result.rank_inconsistencies[:3])}{' ...' if n > 3 else ''}")
    for finding in result.findings:
        reasons.append(finding)
    if result.interrupted:
        reasons.append(f"the run stopped on an exception inside a compared step, so that step holds only what ran "
                       f"before it: {'; '.join(result.interrupted[:2])}")
    only_a = sum(c.only_a for c in result.coverage.values())
    only_b = sum(c.only_b for c in result.coverage.values())
    if only_a or only_b:
        reasons.append(f"{only_a} of A's and {only_b} of B's records have no counterpart and are not accounted for "
                       "(the 'only in' lines); a mapping gives them one, or ignores them on purpose (its ignore: list)")
    return ("inconclusive", reasons) if reasons else ("agree", [])
