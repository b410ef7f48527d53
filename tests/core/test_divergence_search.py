"""The first-divergence search answers from per-step indexes (linear in a step's rows); its answers must be the
ones of the plain scan it replaced, which is kept below as the reference (``reference_incoming``, the search before
the indexes, verbatim but for names).

Steps are generated at random: a tree of module calls (some called twice), inputs linked to the output that
produced them (``same_as``), outputs that are their last child's tensor again, gradients, parameter gradients with
and without local (pre-reduction) ones, and rows of every verdict, unmatched and linked rows among them."""

from __future__ import annotations

import math
import random

import pytest

from tensordiff.diff.align import Pair
from tensordiff.diff.divergence import NOTHING_COMPARED, _incoming, _is_local, _query, _Step, find_first_divergence
from tensordiff.diff.metrics import Metrics
from tensordiff.diff.result import Row
from tensordiff.record import PHASE_RANK, Record


# ------------------------------------------------------------------------------- the reference (the old scan)
def reference_step_incoming(st: _Step, seqs: list[int], of: Record | None = None) -> tuple[float, list[Record]]:
    own = st.canonical(of) if of is not None else None
    errs, uncompared = [], []
    for s in seqs:
        rec = st.recs[s]
        canon = st.canonical(rec)
        if canon == own:
            continue
        if s in st.err:
            errs.append(st.err[s])
        elif s not in st.own_row and canon in st.tensor_err:
            errs.append(st.tensor_err[canon])
        elif rec.kind in ("input", "output", "param", "grad", "grad_local", "grad_input", "grad_output"):
            uncompared.append(rec)
    if not errs and uncompared:
        return NOTHING_COMPARED, uncompared
    return (max(errs) if errs else 0.0), uncompared


def reference_enter_of(st: _Step, module: str, before: int) -> int:
    best = -1
    for r in st.ordered:
        if r.seq > before:
            break
        if r.module == module and r.phase == "forward" and r.enter <= before:
            best = max(best, r.enter)
    return best


def reference_source_output(a: Record, st: _Step) -> Record | None:
    src = st.recs.get(a.same_as) if a.same_as >= 0 else None
    if src is None or src.phase != "forward" or src.kind != "output" or src.module in ("", a.module):
        return None
    return src if src.enter >= 0 else None


def reference_incoming(row: Row, st: _Step, prev_step: _Step | None) -> tuple[float, list[Record]]:
    a = row.pair.a
    assert a is not None
    if a.phase == "forward" and a.kind == "output":
        seqs = [r.seq for r in st.ordered if r.phase == "forward" and a.enter <= r.seq < a.seq]
        if seqs:
            return reference_step_incoming(st, seqs)
    if a.phase == "forward" and a.kind == "input" and a.parent:
        start = reference_enter_of(st, a.parent, a.seq)
        src = reference_source_output(a, st)
        if src is not None:
            seqs = [r.seq for r in st.ordered if r.phase == "forward" and src.enter <= r.seq < src.seq]
            return reference_step_incoming(st, seqs, a)
        seqs = [r.seq for r in st.ordered if r.phase == "forward" and start <= r.seq < a.seq and r.module != a.module]
        if seqs:
            return reference_step_incoming(st, seqs, a)
    local = st.local_of(a) if a.phase == "param_grad" and not _is_local(row) else None
    if local is not None:
        return local[1], []
    if a.phase == "param_grad":
        seqs = [r.seq for r in st.ordered
                if r.module == a.module and (r.phase == "backward" or (r.phase == "forward" and r.kind == "input"))]
        if seqs:
            return reference_step_incoming(st, seqs)
    if a.phase == "weights" and prev_step is not None:
        seqs = [r.seq for r in prev_step.ordered if r.phase == "param_grad" and r.module == a.module
                and r.slot == a.slot]
        return reference_step_incoming(prev_step, seqs)
    if a.phase == "loss":
        seqs = [r.seq for r in st.ordered if r.phase == "forward" and r.module == "" and r.kind == "output"]
        if seqs:
            return reference_step_incoming(st, seqs)
    return reference_step_incoming(st, [r.seq for r in st.ordered if r.phase == a.phase and r.seq < a.seq])


def reference_search(rows: list[Row], records: dict[int, list[Record]], jump: float):
    """The old search loop: (row, incoming, introduced) of the first divergence."""
    steps = sorted(records)
    by_step: dict[int, list[Row]] = {s: [r for r in rows if r.step == s] for s in steps}
    lookups = {s: _Step(records[s], by_step[s]) for s in steps}
    first_drift = None
    for i, step in enumerate(steps):
        st, prev = lookups[step], (lookups[steps[i - 1]] if i > 0 else None)
        candidates = [r for r in by_step[step] if r.verdict == "diverged" and r.pair.a is not None]
        if step > 0 and not any(r.phase != "weights" for r in candidates):
            candidates = []
        candidates.sort(key=lambda r: (PHASE_RANK[r.phase], not _is_local(r), r.pair.a.seq))
        for row in candidates:
            came_in = reference_incoming(row, st, prev)
            if row.err > jump * came_in[0]:
                return row, came_in, True
            if first_drift is None:
                first_drift = (row, came_in, False)
    return first_drift


# --------------------------------------------------------------------------------------- random steps
def random_step(rng: random.Random, step: int, layers: int, nan: bool = False) -> tuple[list[Record], list[Row]]:
    recs: list[Record] = []

    def add(phase: str, module: str, kind: str, slot: str = "0", call: int = 0, **kw) -> Record:
        r = Record(step=step, seq=len(recs), phase=phase, module=module, call=call, kind=kind, slot=slot,
                   module_class="M", dtype="float32", shape=(2,), numel=2, has_data=True, **kw)
        recs.append(r)
        return r

    subs = ["norm", "attn", "attn.core", "mlp", "mlp.fc1", "mlp.fc2"]
    for i in range(layers):
        for s in ("attn", "mlp.fc1", "mlp.fc2"):
            add("weights", f"layers.{i}.{s}", "param", "weight")
    outputs: list[Record] = []
    root = add("forward", "", "input", "0", enter=0)
    prev = add("forward", "embed", "output", enter=len(recs), parent="")
    for i in range(layers):
        layer = f"layers.{i}"
        enter = len(recs)
        add("forward", layer, "input", "0", same_as=prev.seq, enter=enter, parent="")
        extra = None
        if rng.random() < 0.5:  # an input no module produced (made by code between modules), passed on below
            extra = add("forward", layer, "input", "1", enter=enter, parent="")
        for s in subs:
            name = f"{layer}.{s}"
            parent = layer if "." not in s else f"{layer}.{s.split('.')[0]}"
            for call in range(2 if rng.random() < 0.15 else 1):
                e = len(recs)
                if extra is not None and rng.random() < 0.3:  # the layer's own input again: not a module's output
                    add("forward", name, "input", "0", call=call, same_as=extra.seq, enter=e, parent=parent)
                elif rng.random() < 0.7:
                    add("forward", name, "input", "0", call=call, same_as=prev.seq, enter=e, parent=parent)
                else:
                    add("forward", name, "input", "0", call=call, enter=e, parent=parent)
                if rng.random() < 0.1:
                    add("forward", name, "input", "mask", call=call, enter=e, parent=parent)
                prev = add("forward", name, "output", call=call, enter=e, parent=parent)
                outputs.append(prev)
        if rng.random() < 0.5:
            prev = add("forward", layer, "output", same_as=prev.seq, enter=enter, parent="")
        else:
            prev = add("forward", layer, "output", enter=enter, parent="")
        outputs.append(prev)
    add("forward", "", "output", same_as=prev.seq, enter=root.seq)
    add("loss", "", "loss", "value")
    for out in reversed(outputs):
        if rng.random() < 0.8:
            add("backward", out.module, "grad_output", call=out.call, grad_of=out.seq, enter=out.enter,
                parent=out.parent)
        if rng.random() < 0.4:
            add("backward", out.module, "grad_input", call=out.call, grad_of=out.seq - 1, enter=out.enter,
                parent=out.parent)
    local = rng.random() < 0.5
    for i in range(layers):
        for s in ("attn", "mlp.fc1", "mlp.fc2"):
            if local:
                add("param_grad", f"layers.{i}.{s}", "grad_local", "weight")
            add("param_grad", f"layers.{i}.{s}", "grad", "weight")
    rows = []
    for r in recs:
        verdict = rng.choices(["ok", "diverged", "unmatched", "uncertain", "shape"], [4, 6, 1, 0.3, 0.3])[0]
        err = 10 ** rng.uniform(-7, -2)
        if nan and rng.random() < 0.02:
            err = math.nan
        metrics = None if verdict in ("unmatched", "shape") else Metrics(
            rel_l2=err, max_abs=err, max_rel=err, cosine=1.0, ulp_share=0.0, nonfinite_mismatch=0, source="tensor")
        pair = Pair(r, None if verdict == "unmatched" else r, "exact")
        row = Row(step=step, phase=r.phase, pair=pair, metrics=metrics, tol=1e-5, verdict=verdict)  # type: ignore[arg-type]
        row.linked = verdict == "unmatched" and rng.random() < 0.5
        rows.append(row)
    return recs, rows


CASES = [(seed, layers, nan) for seed in range(12) for layers, nan in ((1, False), (3, False), (6, seed % 3 == 0))]


@pytest.mark.parametrize("seed, layers, nan", CASES)
def test_every_rows_incoming_error_is_the_plain_scans(seed, layers, nan):
    rng = random.Random(seed)
    (recs0, rows0), (recs1, rows1) = random_step(rng, 0, layers, nan), random_step(rng, 1, layers, nan)
    st0, st1 = _Step(recs0, rows0), _Step(recs1, rows1)
    checked = 0
    for rows, st, prev in ((rows0, st0, None), (rows1, st1, st0)):
        for row in rows:
            if row.pair.a is None:
                continue
            want = reference_incoming(row, st, prev)
            query = _query(row, st, prev)
            got_value = query.step.came_in(query)
            assert got_value == want[0] or (math.isnan(got_value) and math.isnan(want[0])), row.pair.a.label
            full = _incoming(row, st, prev)
            assert full[0] == want[0] or (math.isnan(full[0]) and math.isnan(want[0])), row.pair.a.label
            assert [r.seq for r in full[1]] == [r.seq for r in want[1]]
            checked += 1
    assert checked == len(rows0) + len(rows1)


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("jump", [1.5, 3.0, 30.0])
def test_the_first_divergence_is_the_plain_scans(seed, jump):
    rng = random.Random(100 + seed)
    layers = rng.choice([1, 2, 4])
    (recs0, rows0), (recs1, rows1) = random_step(rng, 0, layers), random_step(rng, 1, layers)
    rows = rows0 + rows1
    want = reference_search(rows, {0: recs0, 1: recs1}, jump)
    first = find_first_divergence(rows, {0: recs0, 1: recs1}, jump)
    if want is None:
        assert first is None
        return
    row, (came_in, uncompared), introduced = want
    assert first is not None
    assert (first.step, first.phase, first.module_a, first.kind, first.slot, first.call, first.introduced) == \
        (row.step, row.phase, row.pair.a.module, row.pair.a.kind, row.pair.a.slot, row.pair.a.call, introduced)
    if came_in == NOTHING_COMPARED:  # nothing came in that was compared: said as NaN
        assert math.isnan(first.incoming)
    else:
        assert first.incoming == came_in or (math.isnan(first.incoming) and math.isnan(came_in))
    assert first.uncompared == sorted({r.label for r in uncompared})


def test_enter_of_finds_the_call_that_holds_a_record_like_the_scan():
    rng = random.Random(7)
    recs, rows = random_step(rng, 0, 4)
    st = _Step(recs, rows)
    modules = {r.module for r in recs} | {"nowhere"}
    for module in sorted(modules):
        for before in range(-1, len(recs) + 1):
            assert st.enter_of(module, before) == reference_enter_of(st, module, before), (module, before)
