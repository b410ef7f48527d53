"""Name the first divergence: the first tensor, in execution order, whose error exceeds
its tolerance *and* is introduced there rather than inherited.

Order: weights at the start of step 0, its forward pass, the loss, its backward pass in
the order it ran, its parameter gradients, then the next step.

"Introduced" means the error is more than ``jump`` times what came into that tensor:

* a forward output of module M: M's inputs, and M's children inside this call;
* a forward input of M that no module produced (it was made by code between modules):
  what its enclosing module had seen up to that point;
* a gradient: the gradients produced before it in the backward pass;
* a parameter gradient: the module's own inputs and output gradients;
* a weight after step k: that parameter's gradient in step k.

A row that exceeds its tolerance without such a jump is accumulated drift; the search
goes on, and reports the first diverged row (marked not introduced) only if nothing
later is introduced.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from typing import Any

from .. import dtypes
from ..record import PHASE_RANK, Record, is_inside, module_label
from .result import FirstDivergence, Row

#: ``incoming`` when none of what came in was compared: any error counts as introduced there.
NOTHING_COMPARED = -1.0


def _rel(name: str, parent: str) -> str:
    return name[len(parent) + 1:] if parent and name.startswith(parent + ".") else module_label(name)


def _child_of(parent: str, name: str) -> str:
    """The direct child of ``parent`` on the way to ``name`` (full dotted name)."""
    rest = _rel(name, parent).split(".")
    # ModuleList entries are numbers: keep "layers.0" together
    take = 2 if len(rest) > 1 and rest[1].isdigit() else 1
    head = ".".join(rest[:take])
    return f"{parent}.{head}" if parent else head


class _Step:
    """Lookups over A's records of one step."""

    def __init__(self, records: list[Record], rows: list[Row]):
        self.recs = {r.seq: r for r in records}
        self.ordered = sorted(records, key=lambda r: r.seq)
        self.err: dict[int, float] = {}
        self.verdict: dict[int, str] = {}
        self.tensor_err: dict[int, float] = {}  # by the seq that first held the tensor: a link shares its source's
        self.own_row: set[int] = set()  # A's records paired (or not) in their own right: not vouched for by a link
        #: each parameter's local gradient (before the data-parallel reduction) as compared: (module, call, slot) ->
        #: (verdict, rel L2); A's own ``grad_local`` or, where A has none, A's gradient standing in for it
        self.local: dict[tuple[str, int, str], tuple[str, float]] = {}
        for row in rows:
            if row.pair.a is None:
                continue
            if _is_local(row):
                key = (row.pair.a.module, row.pair.a.call, row.pair.a.slot)
                if row.metrics is not None and row.verdict != "uncertain":
                    self.local[key] = (row.verdict, row.metrics.rel_l2)
                if row.pair.stand_in == "a":
                    continue  # A's gradient has its own row
            if not (row.verdict == "unmatched" and row.linked):
                self.own_row.add(row.pair.a.seq)
            if row.metrics is not None and row.verdict != "uncertain":
                self.err[row.pair.a.seq] = row.metrics.rel_l2
                self.verdict[row.pair.a.seq] = row.verdict
                canon = self.canonical(row.pair.a)
                self.tensor_err[canon] = max(self.tensor_err.get(canon, 0.0), row.metrics.rel_l2)
        # built on first use, once per step: per-phase range maxima, fixed groups, each module's forward records
        self._nan = any(math.isnan(v) for v in (*self.err.values(), *self.tensor_err.values()))
        self._indexes: dict[str, _PhaseIndex] = {}
        self._group_map: dict[tuple, list[int]] | None = None
        self._group_answers: dict[tuple, float] = {}
        self._forward: dict[str, tuple[list[int], list[int], bool]] | None = None

    def error_of(self, seq: int) -> tuple[float | None, bool]:
        """What record ``seq`` brings to ``incoming`` (as its loop judges it, the diverged record's own tensor
        aside): (its error, None when it was not compared; True when it counts as not compared)."""
        rec = self.recs[seq]
        canon = self.canonical(rec)
        if seq in self.err:
            return self.err[seq], False
        if seq not in self.own_row and canon in self.tensor_err:
            return self.tensor_err[canon], False
        return None, rec.kind in _FLOW_KINDS

    def local_of(self, a: Record) -> tuple[str, float] | None:
        """(verdict, rel L2) of the local gradient of the parameter whose gradient ``a`` is, when compared."""
        return self.local.get((a.module, a.call, a.slot)) if a.kind == "grad" else None

    @staticmethod
    def canonical(rec: Record) -> int:
        return rec.same_as if rec.same_as >= 0 else rec.seq

    def max_err(self, seqs: list[int]) -> float:
        vals = [self.err[s] for s in seqs if s in self.err]
        return max(vals) if vals else 0.0

    def incoming(self, seqs: list[int], of: Record | None = None) -> tuple[float, list[Record]]:
        """The largest error among ``seqs`` whose tensor was compared (under any of its records), and those whose
        tensor was not (no counterpart, ignored by the mapping, another shape, a pairing by order only): what came
        in can only be said to agree where it was compared. ``of``: the diverged record (its own tensor is not
        something that came in)."""
        own = self.canonical(of) if of is not None else None
        errs, uncompared = [], []
        for s in seqs:
            rec = self.recs[s]
            canon = self.canonical(rec)
            if canon == own:
                continue
            if s in self.err:
                errs.append(self.err[s])
            elif s not in self.own_row and canon in self.tensor_err:
                errs.append(self.tensor_err[canon])
            elif rec.kind in _FLOW_KINDS:
                uncompared.append(rec)
        if not errs and uncompared:
            return NOTHING_COMPARED, uncompared
        return (max(errs) if errs else 0.0), uncompared

    def enter_of(self, module: str, before: int) -> int:
        """Where the call of ``module`` that holds seq ``before`` was entered: the latest ``enter`` among the module's
        forward records up to ``before`` (-1: none). A bisection in the module's records (built once per step)."""
        found = self._forward_of().get(module)
        if found is None:
            return -1
        seqs, best_enter, ordered = found
        if not ordered:  # an enter after its own record: the plain scan, which checks each one against ``before``
            return max((e for q, e in zip(seqs, best_enter) if q <= before and e <= before), default=-1)
        k = bisect_right(seqs, before)
        return best_enter[k - 1] if k else -1

    def _forward_of(self) -> dict[str, tuple[list[int], list[int], bool]]:
        """Per module: its forward records' seqs, the running max of their ``enter`` (or each one's own ``enter``
        where some record's ``enter`` is after its seq), and whether the running max may be used."""
        if self._forward is None:
            by_module: dict[str, list[Record]] = {}
            for r in self.ordered:
                if r.phase == "forward":
                    by_module.setdefault(r.module, []).append(r)
            self._forward = {}
            for module, recs in by_module.items():
                ordered = all(r.enter <= r.seq for r in recs)
                enters, best = [], -1
                for r in recs:
                    best = max(best, r.enter)
                    enters.append(best if ordered else r.enter)
                self._forward[module] = ([r.seq for r in recs], enters, ordered)
        return self._forward

    def records_in(self, q: _Query) -> list[int]:
        """The seqs a query names, in seq order (the plain scan)."""
        if q.group:
            return list(self._groups().get(q.group, []))
        return [r.seq for r in self.ordered if r.phase == q.phase and q.lo <= r.seq < q.hi
                and (q.module is None or r.module != q.module)]

    def count_in(self, phase: str, lo: int, hi: int, module: str | None = None) -> int:
        """How many of ``phase``'s records lie in seqs [lo, hi) (those of ``module`` left out): two bisections."""
        seqs = self._phase_index(phase).seqs
        n = bisect_left(seqs, hi) - bisect_left(seqs, lo)
        if module is not None and n:
            own = self._phase_index(phase).by_module.get(module, [])
            n -= bisect_left(own, hi) - bisect_left(own, lo)
        return n

    def group_size(self, key: tuple) -> int:
        return len(self._groups().get(key, []))

    def _groups(self) -> dict[tuple, list[int]]:
        """The fixed sets of records a query may name, built in one pass: per module what came into its parameter
        gradients (its backward records and forward inputs), per (module, slot) the parameter gradients, and the
        model's forward outputs (what came into the loss)."""
        if self._group_map is None:
            groups: dict[tuple, list[int]] = {}
            for r in self.ordered:
                if r.phase == "backward" or (r.phase == "forward" and r.kind == "input"):
                    groups.setdefault(("param_grad", r.module), []).append(r.seq)
                if r.phase == "param_grad":
                    groups.setdefault(("grads", r.module, r.slot), []).append(r.seq)
                if r.phase == "forward" and r.module == "" and r.kind == "output":
                    groups.setdefault(("loss",), []).append(r.seq)
            self._group_map = groups
        return self._group_map

    def came_in(self, q: _Query) -> float:
        """``incoming(records_in(q), q.of)[0]`` without the list of uncompared records: a range query on the phase's
        index (O(1) per range, plus the few records left out), or a group's answer computed once."""
        if q.local is not None:
            return q.local
        if q.group or self._nan:  # NaN errors: Python's max depends on their order; the plain scan keeps it
            key = (q.group, q.of.seq if q.of is not None else None) if q.group else None
            if key is not None and key in self._group_answers:
                return self._group_answers[key]
            value = self.incoming(self.records_in(q), q.of)[0]
            if key is not None:
                self._group_answers[key] = value
            return value
        index = self._phase_index(q.phase)
        i, j = bisect_left(index.seqs, q.lo), bisect_left(index.seqs, q.hi)
        cut: set[int] = set()  # positions inside [i, j) that the query leaves out
        if q.module is not None:
            own = index.by_module.get(q.module, [])
            cut.update(index.pos[s] for s in own[bisect_left(own, q.lo):bisect_left(own, q.hi)])
        if q.of is not None:
            same = index.by_tensor.get(self.canonical(q.of), [])
            cut.update(index.pos[s] for s in same[bisect_left(same, q.lo):bisect_left(same, q.hi)])
        best, compared, uncompared, start = -math.inf, 0, 0, i
        for stop in [*sorted(cut), j]:
            if stop > start:
                best = max(best, index.range_max(start, stop))
                compared += index.compared[stop] - index.compared[start]
                uncompared += index.uncompared[stop] - index.uncompared[start]
            start = stop + 1
        if not compared:
            return NOTHING_COMPARED if uncompared else 0.0
        return best

    def _phase_index(self, phase: str) -> _PhaseIndex:
        found = self._indexes.get(phase)
        if found is None:
            found = self._indexes[phase] = _PhaseIndex(self, [r for r in self.ordered if r.phase == phase])
        return found


_FLOW_KINDS = ("input", "output", "param", "grad", "grad_local", "grad_input", "grad_output")


@dataclass(frozen=True)
class _Query:
    """What came into a diverged record, as ``_incoming`` names it: the records of ``phase`` with seqs in
    [lo, hi), those of ``module`` left out; or a fixed ``group`` of records; or a ``local`` gradient's error. ``of``:
    the diverged record (its own tensor is not something that came in). ``step``: whose records (the previous step
    for a weight)."""

    step: _Step
    phase: str = ""
    lo: int = -1
    hi: int = -1
    module: str | None = None
    of: Record | None = None
    group: tuple = ()
    local: float | None = None

    def full(self) -> tuple[float, list[Record]]:
        """(largest error that came in, the records not compared): the plain scan, for the one row reported."""
        if self.local is not None:
            return self.local, []
        return self.step.incoming(self.step.records_in(self), self.of)


class _PhaseIndex:
    """One phase's records of a step in seq order, for range queries: a sparse table of range maxima of their errors
    (-inf where none), prefix counts of compared and of not-compared records, and each module's and each tensor's
    seqs (for the records a query leaves out). Built in O(n log n) once; a range costs O(1)."""

    def __init__(self, st: _Step, recs: list[Record]):
        self.seqs = [r.seq for r in recs]
        self.pos = {s: i for i, s in enumerate(self.seqs)}
        self.by_module: dict[str, list[int]] = {}
        self.by_tensor: dict[int, list[int]] = {}
        values: list[float] = []
        self.compared = [0]
        self.uncompared = [0]
        for r in recs:
            self.by_module.setdefault(r.module, []).append(r.seq)
            self.by_tensor.setdefault(st.canonical(r), []).append(r.seq)
            err, missing = st.error_of(r.seq)
            values.append(err if err is not None else -math.inf)
            self.compared.append(self.compared[-1] + (err is not None))
            self.uncompared.append(self.uncompared[-1] + missing)
        self.table = [values]  # table[k][i]: the max of values[i : i + 2**k]
        width = 1
        while 2 * width <= len(values):
            last = self.table[-1]
            self.table.append([max(x, y) for x, y in zip(last, last[width:])])
            width *= 2

    def range_max(self, i: int, j: int) -> float:
        """max(values[i:j]) for i < j."""
        k = (j - i).bit_length() - 1
        row = self.table[k]
        return max(row[i], row[j - (1 << k)])


def _is_local(row: Row) -> bool:
    """The row compares a local gradient (before the data-parallel reduction): A's own, or A's gradient standing in
    for the one A did not record."""
    return row.pair.a is not None and (row.pair.a.kind == "grad_local" or row.pair.stand_in == "a")


#: Leaf names of attention modules, for a module whose class does not say so.
_ATTENTION_NAMES = ("attn", "attention", "self_attn", "self_attention")


def _is_attention(module: str, st: _Step) -> bool:
    """``module`` is an attention block: its class or its leaf name says so."""
    cls = next((r.module_class for r in st.ordered if r.module == module and r.module_class), "")
    return "attention" in cls.lower() or module.rsplit(".", 1)[-1] in _ATTENTION_NAMES


def _source_output(a: Record, st: _Step) -> Record | None:
    """The forward output of another module that ``a`` (a forward input) is the very same tensor as, if any."""
    src = st.recs.get(a.same_as) if a.same_as >= 0 else None
    if src is None or src.phase != "forward" or src.kind != "output" or src.module in ("", a.module):
        return None
    return src if src.enter >= 0 else None


def _query(row: Row, st: _Step, prev_step: _Step | None) -> _Query:
    """What came into the diverged tensor (see the module docstring), as a query on the step's records."""
    a = row.pair.a
    assert a is not None
    if a.phase == "forward" and a.kind == "output" and st.count_in("forward", a.enter, a.seq):
        return _Query(st, "forward", a.enter, a.seq)
    if a.phase == "forward" and a.kind == "input" and a.parent:
        start = st.enter_of(a.parent, a.seq)
        src = _source_output(a, st)
        if src is not None:  # a link to another module's output: what came into that module
            return _Query(st, "forward", src.enter, src.seq, of=a)
        if st.count_in("forward", start, a.seq, a.module):
            return _Query(st, "forward", start, a.seq, a.module, of=a)
    local = st.local_of(a) if a.phase == "param_grad" and not _is_local(row) else None
    if local is not None:
        return _Query(st, local=local[1])  # what came into the reduction: the local gradient
    if a.phase == "param_grad" and st.group_size(("param_grad", a.module)):
        return _Query(st, group=("param_grad", a.module))
    if a.phase == "weights" and prev_step is not None:
        return _Query(prev_step, group=("grads", a.module, a.slot))
    if a.phase == "loss" and st.group_size(("loss",)):
        return _Query(st, group=("loss",))
    # default: everything that ran before it in this phase
    return _Query(st, a.phase, -1, a.seq)


def _incoming(row: Row, st: _Step, prev_step: _Step | None) -> tuple[float, list[Record]]:
    """What came into the diverged tensor: the largest error among it, and the records that were not compared."""
    return _query(row, st, prev_step).full()


def _locate(row: Row, st: _Step, prev_step: _Step | None) -> tuple[str, str, dict[str, Any], dict[str, Any]]:
    """(location, case, structured where, facts) for a diverged row of A: where the difference is introduced, which
    of the cases below it is, and what ``explain.place`` needs to say why in words."""
    a = row.pair.a
    b = row.pair.b
    assert a is not None and b is not None
    mod = module_label(a.module)
    if a.phase == "forward" and a.kind == "input" and not dtypes.is_float(a.dtype) and not dtypes.is_float(b.dtype):
        return ("in the inputs the runs were fed", "batch", {"input": a.label, "module": a.module},
                {"dtype": a.dtype})
    if a.phase == "weights":
        if a.step == 0:
            return (f"in {mod}.{a.slot} before the first step (the checkpoint)", "checkpoint",
                    {"module": a.module, "param": a.slot}, {})
        return (f"in the optimizer update of {mod}.{a.slot} after step {a.step - 1}", "optimizer_update",
                {"module": a.module, "param": a.slot, "after_step": a.step - 1}, {})
    if a.phase == "loss":
        return ("in the loss computation", "loss", {}, {})
    if a.phase == "param_grad" and not _is_local(row) and (st.local_of(a) or ("",))[0] == "ok":
        reduced = [st.verdict[r.seq] for r in st.ordered if r.phase == "param_grad" and r.kind == "grad"
                   and r.seq in st.verdict]
        bad = sum(v == "diverged" for v in reduced)
        local_ok = sum(v == "ok" for v, _ in st.local.values())
        return ("in the data-parallel gradient reduction", "dp_reduction",
                {"module": "", "reduction": True, "data_parallel": True, "param": f"{a.module}.{a.slot}",
                 "param_grads_differ": bad, "param_grads": len(reduced), "local_grads_agree": local_ok,
                 "local_grads": len(st.local)}, {})
    if a.phase == "param_grad":
        local = _is_local(row)
        grads = [st.verdict[r.seq] for r in st.ordered if r.phase == "param_grad" and r.seq in st.verdict
                 and r.kind != "grad_local"]  # the reduced gradients (a run without local ones: its only ones)
        backward = [st.verdict[r.seq] for r in st.ordered if r.phase == "backward" and r.seq in st.verdict]
        bad = sum(v == "diverged" for v in grads)
        if not local and len(grads) >= 2 and bad >= 0.9 * len(grads) and backward and "diverged" not in backward:
            return ("in the gradient reduction", "grad_reduction",
                    {"module": "", "reduction": True, "param_grads_differ": bad, "param_grads": len(grads)}, {})
        if local:
            return (f"in the weight gradient of {mod}.{a.slot}", "local_weight_grad",
                    {"module": a.module, "param": a.slot, "local": True}, {})
        return (f"in the weight gradient of {mod}.{a.slot}", "weight_grad", {"module": a.module, "param": a.slot}, {})
    if a.phase == "forward" and a.kind == "output":
        children = [r for r in st.ordered if r.phase == "forward" and r.kind == "output" and a.enter <= r.seq < a.seq
                    and is_inside(r.module, a.module)]
        if not children:
            return f"in {mod}", "module", {"module": a.module}, {"module_class": a.module_class}
        last = _child_of(a.module, children[-1].module)
        return (f"inside {mod} after {_rel(last, a.module)}", "after_child", {"module": a.module, "after": last},
                {"after": _rel(last, a.module)})
    if a.phase == "forward" and a.kind == "input":
        parent = a.parent
        if a.enter >= 0 and not a.module and not parent:
            return "in the model input", "model_input", {"input": a.slot}, {}
        src = _source_output(a, st)
        if src is not None and st.verdict.get(src.seq) == "ok":  # the very same tensor in A, and B's agrees there
            return (f"between {module_label(src.module)} and {mod}", "handover",
                    {"module": a.module, "handed_over_from": src.module}, {"source_class": src.module_class})
        if src is not None:
            return (f"in {module_label(src.module)}", "source_module", {"module": src.module},
                    {"input_of": a.module, "source_class": src.module_class})
        start = st.enter_of(parent, a.seq) if parent else -1
        before = [r for r in st.ordered if r.phase == "forward" and r.kind == "output" and start <= r.seq < a.seq
                  and is_inside(r.module, parent) and not (r.module == a.module or is_inside(r.module, a.module))]
        plabel = module_label(parent)
        if before:
            prev = _child_of(parent, before[-1].module)
            loc = f"inside {plabel} between {_rel(prev, parent)} and {_rel(a.module, parent)}"
            where: dict[str, Any] = {"module": parent, "between": [prev, a.module]}
        else:
            loc = f"inside {plabel} before {_rel(a.module, parent)}"
            where = {"module": parent, "before": a.module}
        if before and _is_attention(parent, st):
            # attention computed as code (Hugging Face, SDPA): the scores, mask, softmax, RoPE and dropout between
            # the q/k/v projections and the output projection are no module of their own
            where["attention_core"] = True
            return (f"in the attention core of {plabel} (between {_rel(prev, parent)} and {_rel(a.module, parent)})",
                    "attention_core", where, {})
        return loc, "between_modules", where, {}
    if a.phase == "backward":
        fwd = st.recs.get(a.grad_of)
        model_output = fwd is not None and fwd.kind == "output" and (
            fwd.module == "" or any(r.module == "" and r.kind == "output" and r.same_as == fwd.seq for r in st.ordered))
        if fwd is not None and model_output:
            return ("in the loss's gradient (its reduction, scaling or labels)", "loss_grad", {"module": "", "loss": True},
                    {"output": fwd.tensor_label})
        if fwd is not None and fwd.kind == "input":
            return f"in the backward of {mod}", "module_backward", {"module": a.module}, {}
        consumers = [r for r in st.ordered
                     if r.phase == "forward" and r.kind == "input" and fwd is not None and r.same_as == fwd.seq]
        if consumers:
            user = consumers[0].module
            return (f"in the backward of {module_label(user)}", "consumer_backward",
                    {"module": user, "of_output": a.module}, {})
        parent = a.parent
        nxt = None
        if fwd is not None:
            for r in st.ordered:
                if (r.phase == "forward" and r.seq > fwd.seq and r.kind == "input" and r.module != a.module
                        and not is_inside(r.module, a.module)):
                    nxt = r.module
                    break
        plabel = module_label(parent)
        if nxt is not None:
            loc = f"in the backward of code inside {plabel} between {_rel(a.module, parent)} and {_rel(nxt, parent)}"
        else:
            loc = f"in the backward of code inside {plabel} after {_rel(a.module, parent)}"
        return loc, "code_backward", {"module": parent, "between": [a.module, nxt]}, {}
    return f"in {mod}", "", {"module": a.module}, {}


def find_first_divergence(rows: list[Row], records_a: dict[int, list[Record]], jump: float,
                          records_b: dict[int, list[Record]] | None = None) -> FirstDivergence | None:
    steps = sorted(records_a)
    by_step: dict[int, list[Row]] = {s: [] for s in steps}
    for row in rows:
        by_step.setdefault(row.step, []).append(row)
    lookups = {s: _Step(records_a[s], by_step[s]) for s in steps}
    first_drift: tuple[Row, _Query, _Step | None, _Step] | None = None
    for i, step in enumerate(steps):
        st = lookups[step]
        prev = lookups[steps[i - 1]] if i > 0 else None
        candidates = [r for r in by_step[step] if r.verdict == "diverged" and r.pair.a is not None]
        if step > 0 and any(r.phase == "weights" for r in candidates) and all(
                r.phase == "weights" or _absorbed(r.pair.a, st) for r in candidates):  # type: ignore[arg-type]
            # Weights that drifted apart in the optimizer step without changing anything this step computes
            # beyond tensors whose difference a module absorbs (its outputs agree): e.g. Adam turning the
            # pure-noise gradient of attention's key bias into +-lr updates, which shift each head's keys by
            # one vector; the scores move by a constant per query row and the softmax removes it. Shown as
            # 'drift', not a divergence.
            for r in candidates:
                r.verdict = "drift"
                r.note = ("differs, but nothing computed in this step differs" if r.phase == "weights" else
                          "differs, but the module it runs in gives the same output (a difference it absorbs)")
            candidates = []
        # local gradients (before the data-parallel reduction) before the reduced ones, as a run records them
        candidates.sort(key=lambda r: (PHASE_RANK[r.phase], not _is_local(r), r.pair.a.seq))  # type: ignore[union-attr]
        for row in candidates:  # each candidate's incoming error from the step's indexes: linear in the rows
            query = _query(row, st, prev)
            # a same-stack exactness divergence: what came in (inputs and weights) is bitwise identical, whatever the
            # step's other records show: introduced here
            if row.exact or row.err > jump * query.step.came_in(query):
                return _make(row, st, prev, query.full(), True, (records_b or {}).get(step))
            if first_drift is None:
                first_drift = (row, query, prev, st)
    if first_drift is not None:
        row, query, prev, st = first_drift
        origin = _origin(row, by_step[row.step], st, prev)
        if origin is not None:
            return _make(origin[0], st, prev, origin[1].full(), True, (records_b or {}).get(row.step), grew_to=row)
        return _make(row, st, prev, query.full(), False)
    return None


#: An accumulated divergence has an origin when one earlier record of its step made at least this share of its
#: error out of bitwise identical inputs.
ORIGIN_SHARE = 0.5


def _origin(drift: Row, rows: list[Row], st: _Step, prev: _Step | None) -> tuple[Row, _Query] | None:
    """The place an accumulated divergence comes from, when there is one: the first record of its step, before it,
    that is within its tolerance but was made from inputs that are bitwise identical on both sides (everything that
    came in and was compared differs by exactly 0) and already carries at least ``ORIGIN_SHARE`` of the error that
    later exceeds the tolerance. Rounding that grows layer by layer starts small everywhere; a difference in the code
    that a wide tolerance (BF16: 3e-2) hides at its own record starts large at one place: a RoPE base changed in BF16
    makes 2.8e-2 at the attention core from identical q, k, v, and 4.3e-2 two modules later."""
    assert drift.pair.a is not None

    def rank(row: Row) -> tuple[int, int]:
        return PHASE_RANK[row.phase], row.pair.a.seq  # type: ignore[union-attr]

    floor = ORIGIN_SHARE * drift.err
    earlier = sorted((r for r in rows if r.pair.a is not None and r.metrics is not None and r.verdict == "ok"
                      and r.err >= floor and rank(r) < rank(drift)), key=rank)
    for row in earlier:
        query = _query(row, st, prev)
        if query.step.came_in(query) == 0.0:
            return row, query
    return None


def _absorbed(a: Record, st: _Step) -> bool:
    """A forward tensor whose difference a module call absorbs: a call that encloses it (for an input, its own
    module's call too) has every output compared and within its tolerance."""
    if a.phase != "forward":
        return False
    calls: dict[tuple[str, int], list[Record]] = {}
    for o in st.ordered:
        if (o.phase == "forward" and o.kind == "output" and o.seq > a.seq and 0 <= o.enter <= a.seq
                and (is_inside(a.module, o.module) or (a.kind == "input" and o.module == a.module))):
            calls.setdefault((o.module, o.enter), []).append(o)
    return any(all((st.verdict.get(o.seq) or st.verdict.get(st.canonical(o))) == "ok" for o in outs)
               for outs in calls.values())


def _b_source(b: Record, records_b: list[Record] | None) -> Record | None:
    """The B record that first held B's tensor, when it is another module's output (a cell B has, A not)."""
    if records_b is None or b.same_as < 0:
        return None
    src = next((r for r in records_b if r.seq == b.same_as), None)
    if src is not None and src.kind == "output" and src.module != b.module and not is_inside(b.module, src.module):
        return src
    return None


def _make(row: Row, st: _Step, prev: _Step | None, incoming: tuple[float, list[Record]], introduced: bool,
          records_b: list[Record] | None = None, grew_to: Row | None = None) -> FirstDivergence:
    """``grew_to``: ``row`` is within its tolerance and is the origin (``_origin``) of this later row's divergence."""
    a, b = row.pair.a, row.pair.b
    assert a is not None and b is not None
    came_in, uncompared = incoming
    location, case, where, facts = _locate(row, st, prev)
    src = _b_source(b, records_b) if a.phase == "forward" and a.kind == "input" else None
    if src is not None:
        where = dict(where, b_module=src.module, b_module_class=src.module_class)
    facts = dict(facts, judged=row.judged or a.dtype, exact=row.exact, nothing_compared=came_in == NOTHING_COMPARED,
                 uncompared_records=len(uncompared))
    if row.ab is not None:  # three-way: B judged against the reference
        facts["reference_a"] = row.ref_a
    if grew_to is not None:
        later = grew_to.pair.a
        assert later is not None
        facts["grew_to"] = {"label": later.label, "phase": later.phase, "rel_l2": grew_to.err,
                            "tolerance": grew_to.tol}
    return FirstDivergence(
        step=a.step, phase=a.phase, module_a=a.module, module_b=b.module, kind=a.kind, slot=a.slot, call=a.call,
        label_a=a.label, label_b=b.label, rel_l2=row.err, tolerance=row.tol,
        incoming=math.nan if came_in == NOTHING_COMPARED else came_in, introduced=introduced,
        location=location, case=case, where=where, facts=facts, uncompared=sorted({r.label for r in uncompared}),
    )
