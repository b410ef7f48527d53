"""Accounting by structure and value: which records with no counterpart carry nothing the diff has not compared.

Two correct programs written by different people record different things: a dropout module at p=0 on one side, a
mask built in another convention, the attention probabilities one kernel returns and another keeps inside. None of
these is a difference, and none may be passed over silently either. Each rule below accounts for a record by what
it *is* (its values and where it sits), never by its name, and the report names the rule and the reason for every
record it accounts. Rules, in the order they are tried:

``same-tensor``
    the record holds exactly the values of a record of its own side that was compared (a tensor handed to several
    modules, returned twice, or copied): compared there.
``pass-through``
    a module without parameters returns its input unchanged (dropout at p=0 or in eval, ``Identity``, megatron's
    ``IdentityOp``, a cast to the same dtype), and in backward hands the gradient through unchanged: it computes
    nothing. A module *named* like dropout that changes its input is never accounted: it is reported (an active
    dropout).
``mask``
    attention masks in any convention (bool True = masked or True = attend, additive float, multiplicative 0/1;
    ``[1, 1, S, S]`` or ``[B, 1, S, S]``; padding masks ``[B, S]``) are reduced to what they mean, which positions
    may attend to which, and compared exactly with the other side's masks; a side that passes no mask applies its
    own causal masking, so a mask with no counterpart is accounted only when it is exactly causal (or masks nothing).
``positions``
    position ids present on one side only that are exactly 0..S-1 in every row (what the other side uses by default).
``labels``
    labels present on one side only that are the input ids shifted by one (the other side shifts inside its loss).
``rope``
    a RoPE angle table on one side whose cos and sin are the other side's cos/sin tables, to the precision of the
    coarser of the two (1e-5 in FP32; a BF16 table is cos(angle) rounded to BF16). In a narrow dtype the tables may
    also be of the inverse frequencies rounded to it (a model cast whole to BF16 casts its RoPE buffer too).
``loss-mask``
    a loss mask on one side only that is all ones, or leaves out exactly the tokens the other side's mask or ignore
    index leaves out; one leaving out the positions of one token id (a pad token) is a finding naming it.
``consumer``
    a record whose consumer was compared and agrees at its precision (a module's input by that call's outputs, a
    value computed for other modules by their outputs, an output gradient by the module's input gradients); never
    with the model, the decoder or a layer stack as the consumer, never for a record that is a finding.
``inside``
    a record of a parameter-free module (or an extra output) strictly inside a module both sides recorded and whose
    compared records agree (SDPA on one side, explicit softmax and dropout on the other); in backward, a module whose
    own gradients are recorded and agree, or, where neither side recorded them, whose parameters' gradients all do.
    Never for a module with parameters that were not compared and found to agree (megatron's core attention holding
    GPT-OSS's sinks is compared by them), never with the model, the decoder or a layer stack as the enclosing module:
    a mapping that pairs nothing inside the decoder stays inconclusive.
``bias``
    the bias megatron's linear layers return for their caller to add (``skip_bias_add``): added to the module's
    output before it was compared with the other side's, which includes it (``Pair.bias_a`` / ``bias_b``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from .. import dtypes
from ..record import Record, is_inside, module_label
from ..transforms import Split
from .align import Pair
from .result import COMPARED, Accounted, Row

_NUMBERED = re.compile(r"(^|\.)\d+(\.|$)")


Read = Callable[[Record], "np.ndarray | None"]


def _sig(rec: Record) -> tuple:
    return rec.dtype, rec.shape, rec.min, rec.max, rec.mean, rec.l2, rec.nan, rec.inf


def _same_sig(x: tuple, y: tuple) -> bool:
    """Two signatures (``_sig``) alike, a NaN statistic (not known) equal to a NaN."""
    return len(x) == len(y) and all(u == v or (isinstance(u, float) and isinstance(v, float) and u != u and v != v)
                                    for u, v in zip(x, y))


def _value_sig(rec: Record) -> tuple:
    """What two records holding the same values in any shape or order share (a tensor, its flattened view, a copy
    with two dimensions swapped): not the mean and L2, whose last bits depend on the order they were summed in."""
    return rec.dtype, rec.numel, rec.min, rec.max, rec.nan, rec.inf


def _equal(x: np.ndarray | None, y: np.ndarray | None) -> bool | None:
    """Whether two stored tensors hold the same values in the same order, whatever their shapes (a view, a
    reshape, a copy), or one is the other with its first two dimensions swapped; None: one was not stored."""
    if x is None or y is None:
        return None
    if x.size != y.size or x.dtype != y.dtype:
        return False
    nan = x.dtype.kind in "fc"
    if np.array_equal(x.reshape(-1), y.reshape(-1), equal_nan=nan):
        return True
    # a copy with the first two dimensions swapped ([B, S, H] made [S, B, H] contiguous: megatron's embedding)
    return bool(x.ndim >= 2 and y.shape == (x.shape[1], x.shape[0], *x.shape[2:]) and x.shape[0] > 1 < x.shape[1]
                and np.array_equal(np.swapaxes(x, 0, 1), y, equal_nan=nan))


# ---------------------------------------------------------------------------------------------------- masks
@dataclass(frozen=True)
class Mask:
    """What a mask means: ``attend[..., q, k]`` (True = may attend), leading dims dropped where they all agree;
    ``padding``: a [B, S] key padding mask (True = a real token)."""

    attend: np.ndarray
    convention: str
    padding: bool = False

    @property
    def causal(self) -> bool:
        a = self.attend
        if self.padding:
            return False
        return a.ndim == 2 and a.shape[0] == a.shape[1] and bool(np.array_equal(a, np.tri(a.shape[0], dtype=bool)))

    @property
    def nothing(self) -> bool:
        """Masks nothing (every position attends everywhere)."""
        return bool(self.attend.all())

    def same_meaning(self, other: Mask) -> bool:
        a, b = self.attend, other.attend
        if self.padding or other.padding:
            return self.padding == other.padding and a.shape == b.shape and bool(np.array_equal(a, b))
        try:
            a, b = np.broadcast_arrays(a, b)
        except ValueError:
            return False
        return bool(np.array_equal(a, b))


def _squeeze_leading(attend: np.ndarray) -> np.ndarray:
    flat = attend.reshape(-1, *attend.shape[-2:])
    if all(np.array_equal(flat[0], f) for f in flat[1:]):
        return flat[0]
    return attend


def _unused_keys_dropped(x: np.ndarray, q: int) -> np.ndarray:
    """``x`` without key columns after the first ``q`` that every query masks (Hugging Face StableLM's eager mask is
    ``[B, 1, S, S + 1]``, its last column masked for all): they change nothing attention computes."""
    if x.shape[-1] <= q:
        return x
    head, tail = x[..., :q], x[..., q:]
    if x.dtype.kind == "b":
        on = head[..., np.arange(q), np.arange(q)]
        if (on.all() and not tail.any()) or (not on.any() and tail.all()):
            return head  # True = attend with the tail all False, or True = masked with the tail all True
        return x
    f = dtypes.floats(x)
    if f is not None and (f[..., q:] <= -1e4).all() and (f[..., np.arange(q), np.arange(q)] == 0).all():
        return head
    return x


def as_mask(x: np.ndarray | None) -> Mask | None:
    """The meaning of ``x`` when it is an attention mask, else None. Square masks need their diagonal attended
    (every query sees itself), which also tells which polarity a bool mask has."""
    if x is None or x.ndim < 2 or x.size == 0 or x.size > (1 << 26):
        return None
    if x.ndim == 2 and x.dtype.kind in "iub" and x.shape[1] > 1:  # [B, S] padding mask: 1 = a real token
        values = np.unique(x)
        if set(values.tolist()) <= {0, 1} and x.dtype.kind != "b" and values.size and 1 in values:
            return Mask(x.astype(bool), "padding 0/1", padding=True)
    q, k = x.shape[-2], x.shape[-1]
    if q < 2 or k < q or x.ndim < 2:
        return None
    x = _unused_keys_dropped(x, q)
    k = x.shape[-1]
    diag = np.arange(q), np.arange(k - q, k)
    if x.dtype.kind == "b":
        on = x[..., diag[0], diag[1]]
        if on.all():
            attend, how = x, "bool, True = attend"
        elif not on.any():
            attend, how = ~x, "bool, True = masked"
        else:
            return None
    elif dtypes.floats(x) is not None:  # FP32, FP16, BF16 alike (an additive mask holds the dtype's min)
        x = dtypes.floats(x)
        assert x is not None
        finite = x[np.isfinite(x)]
        if np.isnan(x).any() or ((x > 0).any() and not set(np.unique(x).tolist()) <= {0.0, 1.0}):
            return None
        values = np.unique(x)
        if set(values.tolist()) <= {0.0, 1.0} and 1.0 in values and x.ndim > 2:
            attend, how = x == 1.0, "multiplicative 0/1"
        elif ((x == 0) | (x <= -1e4)).all() and (finite.size == 0 or finite.max() <= 0):
            attend, how = x == 0, "additive float (0 / large negative)"
        else:
            return None
        if not attend[..., diag[0], diag[1]].all():
            return None
    else:
        return None
    return Mask(_squeeze_leading(np.asarray(attend)), how)


def maybe_mask(rec: Record) -> bool:
    """Whether ``rec`` may hold a mask, from its statistics alone (the cheap test before ``as_mask`` reads it)."""
    if len(rec.shape) < 2 or rec.nan:
        return False
    if rec.dtype == "bool" or rec.dtype.startswith(("int", "uint")):
        return rec.min >= 0 and rec.max <= 1
    return rec.max <= 0 or (rec.min == 0 and rec.max == 1)


def compare_masks(xa: np.ndarray, xb: np.ndarray) -> tuple[np.ndarray, np.ndarray, str] | None:
    """Two masks in any conventions as float arrays of what they mean (1 = may attend), broadcast to one shape, and
    a note naming the conventions; None when either is no mask or their shapes cannot mean the same positions."""
    ma, mb = as_mask(xa), as_mask(xb)
    if ma is None or mb is None:
        return None
    if ma.padding != mb.padding:  # a padding mask that masks nothing, in a causal model, means the causal mask
        pad, full = (ma, mb) if ma.padding else (mb, ma)
        if not (pad.nothing and full.causal):
            return None
        x = full.attend.astype(np.float32)
        return (x, x, f"masks compared by meaning: a padding mask that masks nothing ({'A' if pad is ma else 'B'} "
                f"{tuple((xa if pad is ma else xb).shape)}) with its model's causal masking is the other's causal mask")
    try:
        a, b = np.broadcast_arrays(ma.attend, mb.attend)
    except ValueError:
        return None
    return (a.astype(np.float32), b.astype(np.float32),
            f"masks compared by meaning: A {ma.convention} {tuple(xa.shape)}, B {mb.convention} {tuple(xb.shape)}")


def _positions(x: np.ndarray | None) -> bool:
    """Position ids 0..S-1 in every row."""
    if x is None or x.dtype.kind not in "iu" or x.ndim not in (1, 2) or x.shape[-1] < 2:
        return False
    return bool((x.reshape(-1, x.shape[-1]) == np.arange(x.shape[-1])).all())


# ---------------------------------------------------------------------------------------------------- the rules
class _Side:
    """One side's records of one step, with what was compared."""

    def __init__(self, name: str, records: list[Record], rows: list[Row], read: Read):
        self.name, self.records, self.read = name, records, read
        self.by_seq = {r.seq: r for r in records}
        self.compared: set[tuple[int, int]] = set()
        self.ok_modules: dict[str, set[str]] = {}  # module -> phases with a compared row of it (all ok)
        self.bad_modules: set[str] = set()
        for row in rows:
            if row.verdict not in COMPARED:
                continue
            for rec in self.of(row):
                self.compared.add(rec.tensor_id)
                self.ok_modules.setdefault(rec.module, set()).add(rec.phase)
                if row.verdict != "ok":
                    self.bad_modules.add(rec.module)
        in_rows = {rec.seq for row in rows for rec in self.of(row)}
        #: tensors the mapping ignores on purpose (held by a record in no row): a copy of one carries the same
        #: information, unless a record in a row holds it too and is left unaccounted (``pending``)
        self.ignored = {r.tensor_id for r in records if r.seq not in in_rows}
        #: tensors of this side's records with no counterpart not accounted for (yet): never an anchor
        self.pending: set[tuple[int, int]] = set()
        #: tensors accounted for by a rule: (the record, why), an anchor for a record holding their values
        self.vouched: dict[tuple[int, int], tuple[Record, Accounted]] = {}
        #: tensors compared and within tolerance ('ok'), and tensors compared or paired and not ('diverged',
        #: 'drift', 'uncertain', 'shape', 'skipped'): what a consumer's rows say
        self.ok_tensors: set[tuple[int, int]] = set()
        self.bad_tensors: set[tuple[int, int]] = set()
        for row in rows:
            if row.verdict == "unmatched":
                continue
            for rec in self.of(row):
                (self.ok_tensors if row.verdict == "ok" else self.bad_tensors).add(rec.tensor_id)
                if row.verdict in ("uncertain", "shape"):
                    self.bad_modules.add(rec.module)
        #: forward tensor -> the input records taking it (the calls consuming it)
        self.consumers: dict[tuple[int, int], list[Record]] = {}
        for r in records:
            if r.phase == "forward" and r.kind == "input":
                self.consumers.setdefault(r.tensor_id, []).append(r)
        self.param_modules = {r.module for r in records if r.phase == "weights"}
        self.calls: dict[tuple[str, int], list[Record]] = {}
        for r in records:
            self.calls.setdefault((r.module, r.call), []).append(r)
        self.modules = {r.module for r in records if r.phase == "forward"}
        #: seq of an accounted record -> the tensor of its side its reason cites (``_settle`` checks it)
        self.cites: dict[int, tuple[int, int]] = {}
        #: seqs of records a finding is about (an active dropout, a loss mask leaving out pad tokens): no later
        #: rule accounts for them
        self.flagged: set[int] = set()
        self._arrays: dict[int, np.ndarray | None] = {}
        self.token_ids: list[tuple[Record, np.ndarray]] | None = None
        self.left_out: dict[int, tuple[list[tuple[Record, np.ndarray]], np.ndarray | None]] = {}
        self._grads: dict[tuple[int, int], list[Record]] | None = None

    def of(self, row: Row) -> tuple[Record, ...]:
        if self.name == "A":
            return (row.pair.a,) if row.pair.a is not None else ()
        return row.pair.b_records

    def array(self, rec: Record) -> np.ndarray | None:
        key = rec.tensor_id[1]
        if key not in self._arrays:
            self._arrays[key] = self.read(rec) if rec.has_data else None
        return self._arrays[key]

    def anchor(self, rec: Record) -> bool:
        """Whether ``rec``'s tensor may vouch for a record holding its values: compared, accounted for, or ignored
        on purpose by the mapping and held by no record left unaccounted."""
        t = rec.tensor_id
        return t in self.compared or t in self.vouched or (t in self.ignored and t not in self.pending)

    def grads_of(self, tensor: tuple[int, int]) -> list[Record]:
        """The output gradients of the forward tensor ``tensor`` (at the module that produced it)."""
        if self._grads is None:
            self._grads = {}
            for r in self.records:
                fwd = self.by_seq.get(r.grad_of) if r.phase == "backward" and r.kind == "grad_output" else None
                if fwd is not None:
                    self._grads.setdefault(fwd.tensor_id, []).append(r)
        return self._grads.get(tensor, [])

    def has_params(self, module: str) -> bool:
        return any(m == module or is_inside(m, module) for m in self.param_modules)

    def holds_stack(self, module: str) -> bool:
        """The model, or a module holding numbered modules within three levels (a layer stack ``layers.3``, the
        decoder, MindFormers' ``model`` over ``decoder.layers.3``); a megatron decoder layer holding its experts
        deeper (``mlp.experts.local_experts.3``) is not one."""
        if module == "":
            return True
        prefix = module + "."
        return any(m.startswith(prefix) and _NUMBERED.search(".".join(m[len(prefix):].split(".")[:3]))
                   for m in self.modules)


def _equal_values(side: _Side, rec: Record, candidates: Iterable[Record]) -> Record | None:
    """A candidate with exactly ``rec``'s values (stored tensors compared; statistics where neither was stored)."""
    for cand in candidates:
        if cand.seq == rec.seq:
            continue
        same = _equal(side.array(rec), side.array(cand))
        if same or (same is None and not rec.has_data and not cand.has_data and cand.shape == rec.shape):
            return cand
    return None


def account(rows: list[Row], records: dict[str, dict[int, list[Record]]], read: dict[str, Read]) -> list[str]:
    """Set ``Row.accounted`` on the unmatched rows the rules account for; returns findings to report (an active
    dropout, a loss mask leaving out pad tokens). ``records``/``read``: per side ('A', 'B'), the records of each
    compared step and a tensor reader."""
    findings: list[str] = []
    earlier: dict[tuple[str, tuple], tuple[tuple, Accounted]] = {}  # (side, record key) -> (values, why)
    steps = sorted({r.step for r in rows})
    for step in steps:
        step_rows = [r for r in rows if r.step == step]
        sides = {s: _Side(s, records[s].get(step, []), step_rows, read[s]) for s in ("A", "B")}
        lone = {s: [r for r in step_rows if r.verdict == "unmatched" and not r.linked and not r.not_recorded
                    and sides[s].of(r)] for s in ("A", "B")}
        for s in ("A", "B"):
            _refresh(sides[s], lone[s])
            _returned_bias(sides[s], lone[s], step_rows)
            _by_value(sides[s], lone[s], findings)
        _masks(sides, lone)
        _rope(sides, lone, findings)
        for s in ("A", "B"):
            _inputs(sides[s], lone[s])
            _inside(sides[s], lone[s])
        _loss_masks(sides, lone, findings)
        for s in ("A", "B"):
            side = sides[s]
            _links_of_accounted(side, lone[s])
            for row in lone[s]:  # a statistics-only step: the same values as an earlier step's accounted record
                rec = _rec(side, row)
                seen = earlier.get((s, rec.key))
                if row.accounted is None and seen is not None and _same_sig(seen[0], _sig(rec)) and rec.seq not in side.flagged:
                    row.accounted = Accounted(seen[1].rule, f"{seen[1].why} (the same values in an earlier step)")
            _refresh(side, lone[s])
            _consumers(side, lone[s])
            if any(row.accounted is None for row in lone[s]):  # copies of what the later rules accounted for
                _by_value(side, lone[s], findings)
            _links_of_accounted(side, lone[s])
            _settle(side, lone[s])
            for row in lone[s]:
                rec = _rec(side, row)
                if row.accounted is not None and rec.has_data:
                    earlier.setdefault((s, rec.key), (_sig(rec), row.accounted))
    return findings


def _refresh(side: _Side, lone: list[Row]) -> None:
    """``side.pending`` and ``side.vouched`` from what the rules have accounted for so far."""
    side.pending, side.vouched = set(), {}
    for row in lone:
        rec = _rec(side, row)
        if row.accounted is None:
            side.pending.add(rec.tensor_id)
        else:
            side.vouched.setdefault(rec.tensor_id, (rec, row.accounted))
    side.pending -= side.vouched.keys()  # a tensor one record of which is accounted for: its links follow


def _settle(side: _Side, lone: list[Row]) -> None:
    """No record is accounted for by reference to a record of its side that is itself left unaccounted: a record
    whose anchor (``side.cites``) no other accounted record holds, and that is not compared or ignored on purpose by
    itself, is unaccounted again, until none is."""
    changed = True
    while changed:
        changed = False
        held: dict[tuple[int, int], set[int]] = {}
        for row in lone:
            if row.accounted is not None:
                rec = _rec(side, row)
                held.setdefault(rec.tensor_id, set()).add(rec.seq)
        unaccounted = {_rec(side, row).tensor_id for row in lone if row.accounted is None}
        for row in lone:
            rec = _rec(side, row)
            cited = side.cites.get(rec.seq)
            if row.accounted is None or cited is None or (cited in side.compared and cited not in unaccounted):
                continue
            if held.get(cited, set()) - {rec.seq}:
                continue  # another accounted record holds it
            if cited in side.ignored and cited not in unaccounted:
                continue  # ignored on purpose, and no record in a row left unaccounted holds it
            row.accounted = None
            del side.cites[rec.seq]
            changed = True
    _refresh(side, lone)


def masks_by_meaning(rows: list[Row]) -> None:
    """A pair of masks compared by meaning in a step with tensors, holding the same values in a statistics-only
    step (the statistics of two conventions differ even where the masks agree; an additive BF16 mask of the dtype's
    minimum overflows its L2, so that its statistics are not known): judged as then. Runs before
    ``coverage.mark_unmatched``, so that a record holding such a mask's tensor is linked to it in that step too."""
    then: dict[tuple, tuple[tuple, tuple, Row]] = {}
    for row in rows:
        a, b = row.pair.a, row.pair.b
        if a is None or b is None:
            continue
        key = (a.key, b.key)
        if row.metrics is not None and row.metrics.source == "tensor" and row.note.startswith("masks compared by meaning"):
            then.setdefault(key, (_sig(a), _sig(b), row))
        elif (row.verdict in ("shape", "skipped") or (row.metrics is not None and row.metrics.source == "stats")) \
                and key in then:
            sig_a, sig_b, first = then[key]
            if _same_sig(sig_a, _sig(a)) and _same_sig(sig_b, _sig(b)):
                row.metrics, row.verdict = first.metrics, first.verdict
                row.note = f"{first.note} (step {first.step}; the same values here)"


def _rec(side: _Side, row: Row) -> Record:
    return side.of(row)[0]


def _returned_bias(side: _Side, lone: list[Row], rows: list[Row]) -> None:
    """A bias returned apart and added to its module's output where that output was compared."""
    added = {}
    for row in rows:
        bias = row.pair.bias_a if side.name == "A" else row.pair.bias_b
        if bias is not None and row.verdict in COMPARED:
            added[bias.tensor_id] = row
    for row in lone:
        rec = _rec(side, row)
        if row.accounted is None and rec.tensor_id in added:
            owner = added[rec.tensor_id]
            label = (owner.pair.a if side.name == "A" else owner.pair.b).label  # type: ignore[union-attr]
            row.accounted = Accounted("bias", f"the bias {module_label(rec.module)} returns for its caller to add "
                                      f"(skip_bias_add), added to {label} before it was compared")
            side.compared.add(rec.tensor_id)


def _by_value(side: _Side, lone: list[Row], findings: list[str]) -> None:
    """same-tensor and pass-through: grow the compared tensors through equal values until nothing changes. An
    anchor is a record compared, accounted for by a rule, or ignored on purpose by the mapping, never one held by a
    record left unaccounted (``_Side.anchor``)."""
    by_sig: dict[tuple, list[Record]] = {}
    for rec in side.records:
        if rec.same_as < 0:
            by_sig.setdefault(_value_sig(rec), []).append(rec)
    changed = True
    while changed:
        changed = False
        _refresh(side, lone)
        for row in lone:
            rec = _rec(side, row)
            if row.accounted is not None or rec.seq in side.flagged:
                continue
            if rec.phase not in ("forward", "backward"):
                continue
            through = _pass_through(side, rec)
            if through is not None and (through.tensor_id in side.compared or through.tensor_id in side.vouched):
                seen = "was compared" if through.tensor_id in side.compared else \
                    f"is accounted for ({side.vouched[through.tensor_id][1].rule})"
                row.accounted = Accounted("pass-through", f"{module_label(rec.module)} ({rec.module_class or '?'}) "
                                          f"returns its input unchanged; {through.label} {seen}")
                side.cites[rec.seq] = through.tensor_id
            else:
                cands = [c for c in by_sig.get(_value_sig(rec), ()) if c.tensor_id != rec.tensor_id]
                twin = _equal_values(side, rec, [c for c in cands if c.tensor_id in side.compared])
                vouched = None if twin is not None else _equal_values(
                    side, rec, [c for c in cands if c.tensor_id in side.vouched])
                ignored = None if twin is not None or vouched is not None else _equal_values(
                    side, rec, [c for c in cands if c.tensor_id in side.ignored and c.tensor_id not in side.pending])
                if vouched is not None:
                    first = side.vouched[vouched.tensor_id]
                    row.accounted = Accounted("same-tensor", f"the same values as {first[0].label}, accounted for "
                                              f"above ({first[1].rule})")
                    side.cites[rec.seq] = vouched.tensor_id
                    changed = True
                    continue
                if ignored is not None:
                    row.accounted = Accounted("same-tensor", f"the same values as {ignored.label}, which the mapping "
                                              "ignores on purpose")
                    side.cites[rec.seq] = ignored.tensor_id
                    changed = True
                    continue
                if twin is None:
                    if through is None and "dropout" in rec.module_class.lower() and rec.kind == "output":
                        finding = (f"{side.name}'s {module_label(rec.module)} ({rec.module_class}) changes its input: "
                                   "an active dropout (p > 0 in training); set its probability to 0 to compare")
                        if finding not in findings:
                            findings.append(finding)
                        side.flagged.add(rec.seq)
                    continue
                row.accounted = Accounted("same-tensor", f"the same values as {twin.label}, compared there")
                side.cites[rec.seq] = twin.tensor_id
            side.compared.add(rec.tensor_id)
            changed = True


def _pass_through(side: _Side, rec: Record) -> Record | None:
    """The input (or, for a gradient, the output gradient) of the same call that ``rec`` equals, when ``rec``'s
    module has no parameters and ``rec`` is its output (or input gradient); else None."""
    if side.has_params(rec.module):
        return None
    pairs = {"output": "input", "input": "output", "grad_input": "grad_output", "grad_output": "grad_input"}
    other = pairs.get(rec.kind)
    if other is None:
        return None
    cands = [r for r in side.calls.get((rec.module, rec.call), ()) if r.kind == other and r.shape == rec.shape
             and r.dtype == rec.dtype]
    return _equal_values(side, rec, cands)


def _masks(sides: dict[str, _Side], lone: dict[str, list[Row]]) -> None:
    """Masks with no counterpart, by meaning: the same as a mask of the other side, or causal where it has none."""
    found: dict[str, list[tuple[Row, Record, Mask]]] = {"A": [], "B": []}
    for s, side in sides.items():
        for row in lone[s]:
            rec = _rec(side, row)
            if row.accounted is None and rec.phase == "forward" and rec.kind in ("input", "output") and maybe_mask(rec):
                mask = as_mask(side.array(rec)) if rec.has_data else None
                if mask is not None:
                    found[s].append((row, rec, mask))
    if not any(found.values()):
        return  # no lone mask: the other side's masks are not read
    every = {s: [as_mask(sides[s].array(r)) for r in sides[s].records if r.phase == "forward" and r.has_data
                 and r.same_as < 0 and r.kind in ("input", "output") and maybe_mask(r)]
             for s in sides}
    for s, items in found.items():
        other = "B" if s == "A" else "A"
        theirs = [m for m in every[other] if m is not None]
        for row, rec, mask in items:
            match = next((m for m in theirs if m.same_meaning(mask)), None)
            shape = "x".join(map(str, rec.shape))
            if match is not None:
                row.accounted = Accounted("mask", f"a mask [{shape}] ({mask.convention}) meaning what {other}'s mask "
                                          f"({match.convention}) means")
            elif mask.padding and mask.nothing:
                row.accounted = Accounted("mask", f"a padding mask [{shape}] that masks nothing (every token real)")
            elif mask.causal and not any(m.causal or (m.nothing and not m.padding) for m in theirs):
                # a square mask of the other side attending everywhere is full attention; a padding mask of ones
                # (Hugging Face's attention_mask) masks no token, and the model applies its causal masking itself
                row.accounted = Accounted("mask", f"the causal mask [{shape}] ({mask.convention}); {other} passes none "
                                          "(or only a padding mask of ones) and applies causal masking itself")
            elif mask.causal and not theirs:
                row.accounted = Accounted("mask", f"the causal mask [{shape}] ({mask.convention}); {other} passes none")
            elif mask.causal and any(m.causal for m in theirs):
                row.accounted = Accounted("mask", f"the causal mask [{shape}] ({mask.convention}), as {other}'s")
            else:  # a mask meaning other positions than the other side's masking: never accounted by a later rule
                sides[s].flagged.add(rec.seq)


def _angles(x: np.ndarray | None) -> np.ndarray | None:
    """``x`` as a RoPE angle table [S, D] (position times the inverse frequencies: row 0 zeros, row s = s * row 1, to
    the precision of ``x``'s dtype), or None."""
    f = dtypes.floats(x)
    if x is None or f is None or x.ndim < 2 or x.shape[-1] < 2 or x.size > (1 << 24):
        return None
    t = f.reshape(-1, x.shape[-1]).astype(np.float64)
    if t.shape[0] < 3 or not np.isfinite(t).all() or np.any(t[0]) or not np.any(t[1]):
        return None
    rtol = max(1e-5, 2 * dtypes.resolution(dtypes.name_of(x.dtype)))  # row s is s * row 1 rounded in x's dtype
    if not np.allclose(t, np.outer(np.arange(t.shape[0]), t[1]), rtol=rtol, atol=1e-6):
        return None
    return t


def _trig(x: np.ndarray | None, first: float) -> np.ndarray | None:
    """``x`` as a cos (``first`` 1) or sin (``first`` 0) table [S, D], every leading slice alike, or None."""
    f = dtypes.floats(x)
    if x is None or f is None or x.ndim < 2 or x.size == 0 or x.size > (1 << 24):
        return None
    t = f.reshape(-1, *x.shape[-2:]).astype(np.float64)
    if not np.isfinite(t).all() or np.abs(t).max() > 1 + 1e-6 or not np.allclose(t[:, 0], first, atol=1e-6):
        return None
    if any(not np.array_equal(t[0], u) for u in t[1:]):
        return None
    return t[0]


def _full_width(table: np.ndarray, d: int) -> np.ndarray:
    """A cos or sin table [S, D'] as ``d`` columns: its first ``d``, or, at half the width, each frequency twice."""
    if table.shape[-1] * 2 == d:
        table = np.concatenate([table, table], axis=-1)
    return table[:, :d]


class RopeAngles(Split):
    """B's RoPE cos and sin tables read back as the angle table A holds (``[S, 1, 1, D]``, megatron's
    ``rotary_pos_emb``): atan2 of sin and cos, unwrapped along the positions (consecutive positions differ by an
    inverse frequency, at most 1 rad), in A's shape. Compared so, the two conventions are judged by relative L2 at
    the coarser side's tolerance like any pair: a base or layout that differs is a divergence at the table, and the
    RoPE hints read both tables."""

    name = "rope_angles"

    def __init__(self, shape: tuple[int, ...]):
        super().__init__(0)
        self.shape = tuple(shape)

    def __str__(self) -> str:
        return "rope_angles(cos, sin)"

    def parts_shapes(self, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
        raise ValueError("an angle table is not split into cos and sin tables")

    def joined_shape(self, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
        return self.shape

    def split(self, x: np.ndarray) -> list[np.ndarray]:
        raise ValueError("an angle table is not split into cos and sin tables")

    def join(self, parts: list[np.ndarray]) -> np.ndarray:
        s, d = self.shape[0], self.shape[-1]
        # B's first d dims where B rotates more of each head than A (A's partial rotary): those then differ; a table
        # of half the dims (one column per frequency: GPT-OSS) is the rotate-half table with its halves alike
        cos, sin = (_full_width(np.asarray(dtypes.floats(p), dtype=np.float64).reshape(-1, s, p.shape[-1])[0], d)
                    for p in parts)
        return np.unwrap(np.arctan2(sin, cos), axis=0).reshape(self.shape)


def rope_by_meaning(rows: list[Row], read_a: Read, read_b: Read) -> list[tuple[Row, Row | None]]:
    """A's RoPE angle table with no counterpart and one call's cos and sin tables of B with none (Hugging Face's
    ``rotary_emb`` outputs 0 and 1): paired as one comparison (``RopeAngles``), B's two rows taken into it (removed
    from ``rows``). Returns the rows to measure, each with None, or, in a statistics-only step whose three records
    hold the same values as in an earlier step's pair, that pair's row (judged as then). Runs before
    ``coverage.mark_unmatched``: what holds the same tensors is linked to the pair."""
    out: list[tuple[Row, Row | None]] = []
    then: dict[tuple, tuple[tuple, Row]] = {}
    taken: set[int] = set()
    by_step: dict[int, list[Row]] = {}
    for row in rows:
        by_step.setdefault(row.step, []).append(row)
    for step_rows in by_step.values():
        lone_a = [r for r in step_rows if r.verdict == "unmatched" and r.pair.a is not None and r.pair.b is None
                  and r.pair.a.phase == "forward" and r.pair.a.kind == "output" and r.pair.a.same_as < 0]
        lone_b = [r for r in step_rows if r.verdict == "unmatched" and r.pair.b is not None and r.pair.a is None
                  and r.pair.b.phase == "forward" and r.pair.b.kind == "output" and r.pair.b.same_as < 0]
        if not lone_a or not lone_b:
            continue
        calls: dict[tuple[str, int], list[Row]] = {}
        for r in lone_b:
            calls.setdefault((r.pair.b.module, r.pair.b.call), []).append(r)  # type: ignore[union-attr]
        for row in lone_a:
            a = row.pair.a
            assert a is not None
            for (_, _), outs in calls.items():
                if len(outs) != 2 or any(id(r) in taken for r in outs):
                    continue
                cos_row, sin_row = sorted(outs, key=lambda r: r.pair.b.slot)  # type: ignore[union-attr]
                cos, sin = cos_row.pair.b, sin_row.pair.b
                assert cos is not None and sin is not None
                key = (a.key, cos.key, sin.key)
                sigs = (_sig(a), _sig(cos), _sig(sin))
                earlier = None
                if a.has_data and cos.has_data and sin.has_data:
                    angles = _angles(read_a(a))
                    ct, st = _trig(read_b(cos), 1.0), _trig(read_b(sin), 0.0)
                    if angles is None or ct is None or st is None or ct.shape != st.shape \
                            or ct.shape[:-1] != angles.shape[:-1] \
                            or (ct.shape[-1] < angles.shape[-1] and 2 * ct.shape[-1] != angles.shape[-1]):
                        continue  # B may rotate more dims than A (A's partial rotary): its first ones are compared
                elif key in then and all(_same_sig(x, y) for x, y in zip(then[key][0], sigs)):
                    earlier = then[key][1]
                else:
                    continue
                row.pair = Pair(a=a, b=cos, how="rule", parts=(cos, sin), join=RopeAngles(a.shape))
                taken.update((id(cos_row), id(sin_row)))
                if earlier is None:
                    then.setdefault(key, (sigs, row))
                out.append((row, earlier))
                break
    if taken:
        rows[:] = [r for r in rows if id(r) not in taken]
    return out


def rope_base(first: np.ndarray) -> float | None:
    """RoPE's base from the angles of position 1 (= the inverse frequencies base^(-2i/D), i < D/2), or None."""
    half = first.shape[-1]
    if half < 2:
        return None
    inv = first[1:].astype(np.float64)
    i = np.arange(1, half, dtype=np.float64)
    ok = (inv > 0) & (inv < 1)
    if not ok.any():
        return None
    return float(np.median(inv[ok] ** (-(2 * half) / (2 * i[ok]))))


def _rope_difference(s: str, rec: Record, angles: np.ndarray, other: str, found: dict, atol: float) -> str:
    """A finding naming how ``s``'s angle table and ``other``'s cos/sin tables (``found``) differ: the base each
    reads as (position 1's frequencies) and the first position where they part."""
    (_, cos_rec, cos), (_, sin_rec, sin) = found["cos"], found["sin"]
    half = angles.shape[-1] // 2
    theirs = np.arctan2(sin[1, :half], cos[1, :half]) if cos.shape[0] > 1 else None
    ours_base = rope_base(angles[1, :half])
    their_base = rope_base(theirs) if theirs is not None else None
    parts = (np.flatnonzero((np.abs(np.cos(angles) - cos) > atol).any(axis=-1)) if cos.shape == angles.shape
             else np.zeros(0, dtype=np.int64))
    where = f"; they part from position {int(parts[0])} of {angles.shape[0]}" if len(parts) else ""
    bases = (f": {s}'s reads as RoPE base {ours_base:.4g}, {other}'s as base {their_base:.4g}"
             if ours_base is not None and their_base is not None else "")
    return (f"the RoPE tables differ: cos and sin of {s}'s angle table {rec.label} are not {other}'s "
            f"{cos_rec.label} and {sin_rec.label}{bases}{where}. A RoPE base (rope_theta, rotary_base), scaling or "
            "position convention differs between the runs; the attention that applies them is where it shows")


def _same_rope(angles: np.ndarray, cos: np.ndarray, sin: np.ndarray, atol: float, judged: str) -> str | None:
    """How cos and sin tables hold the angle table ``angles`` ([S, D], row s = s * the inverse frequencies): '' when
    they are cos and sin of it; a phrase when they are cos and sin of the angles of its inverse frequencies rounded
    to ``judged`` (a narrow dtype): a model cast whole to BF16 (Hugging Face's ``.to(torch.bfloat16)``) rounds its
    RoPE frequency buffer with its weights, a rounding of that precision and no other convention; None otherwise."""
    if cos.shape != angles.shape:
        return None
    if np.allclose(np.cos(angles), cos, rtol=0, atol=atol) and np.allclose(np.sin(angles), sin, rtol=0, atol=atol):
        return ""
    if dtypes.MANTISSA_BITS.get(judged, 52) >= dtypes.MANTISSA_BITS["float32"]:
        return None
    coarse = np.outer(np.arange(angles.shape[0], dtype=np.float64), dtypes.rounded(angles[1], judged))
    coarse = coarse.astype(np.float32).astype(np.float64)  # the product taken in FP32, as RoPE code computes it
    if np.allclose(np.cos(coarse), cos, rtol=0, atol=atol) and np.allclose(np.sin(coarse), sin, rtol=0, atol=atol):
        return f" with its inverse frequencies rounded to {judged} (a RoPE buffer cast with the model's weights)"
    return None


def _rope(sides: dict[str, _Side], lone: dict[str, list[Row]], findings: list[str]) -> None:
    """A RoPE angle table on one side (megatron's rotary_pos_emb [S, 1, 1, D]) and cos/sin tables of one call on the
    other (Hugging Face's rotary_emb [1, S, D] each): the same information when cos and sin of the angles are the
    tables (to 1e-5). Tables that disagree stay unaccounted and are a finding naming the base each reads as: a RoPE
    difference is never passed over, even where its effect downstream stays below the dtype's tolerance."""
    for s, other in (("A", "B"), ("B", "A")):
        side, them = sides[s], sides[other]
        tables: list[tuple[Row, Record, np.ndarray]] = []
        for row in lone[s]:
            rec = _rec(side, row)
            if row.accounted is None and rec.phase == "forward" and rec.kind == "output" and rec.has_data:
                angles_of = _angles(side.array(rec))
                if angles_of is not None:
                    tables.append((row, rec, angles_of))
        if not tables:
            continue
        trig: dict[tuple[str, int], dict[str, tuple[Row, Record, np.ndarray]]] = {}
        for row in lone[other]:
            rec = _rec(them, row)
            if row.accounted is not None or rec.phase != "forward" or rec.kind != "output" or not rec.has_data:
                continue
            for name, first in (("cos", 1.0), ("sin", 0.0)):
                t = _trig(them.array(rec), first)
                if t is not None:
                    trig.setdefault((rec.module, rec.call), {}).setdefault(name, (row, rec, t))
        for row, rec, angles in tables:
            for found in trig.values():
                if set(found) != {"cos", "sin"}:
                    continue
                (cos_row, cos_rec, cos), (sin_row, sin_rec, sin) = found["cos"], found["sin"]
                # at the precision of the coarser side: a BF16 table is cos(angle) rounded to BF16
                judged = dtypes.coarsest(dtypes.coarsest(rec.dtype, cos_rec.dtype), sin_rec.dtype)
                atol = 1e-5 + dtypes.resolution(judged)
                how = _same_rope(angles, cos, sin, atol, judged)
                if how is None:
                    continue
                shape = "x".join(map(str, rec.shape))
                row.accounted = Accounted("rope", f"a RoPE angle table [{shape}]: cos and sin of it{how} are "
                                          f"{other}'s {cos_rec.label} and {sin_rec.label} (to {atol:.1e}, {judged})")
                for r, table, kind in ((cos_row, cos_rec, "cos"), (sin_row, sin_rec, "sin")):
                    r.accounted = Accounted("rope", f"a RoPE {kind} table [{'x'.join(map(str, table.shape))}] of the "
                                            f"angles in {s}'s {rec.label}")
                break
        pairs = [found for found in trig.values() if set(found) == {"cos", "sin"}]
        if pairs and any(row.accounted is None for row, _, _ in tables):
            # tables that disagree: a RoPE difference, never accounted by a later rule
            for row, rec, angles in tables:
                if row.accounted is None:
                    side.flagged.add(rec.seq)
                    judged = dtypes.coarsest(rec.dtype, pairs[0]["cos"][1].dtype)
                    finding = _rope_difference(s, rec, angles, other, pairs[0], 1e-5 + dtypes.resolution(judged))
                    if finding not in findings:
                        findings.append(finding)
            for found in pairs:
                for r, table, _ in found.values():
                    if r.accounted is None:
                        them.flagged.add(table.seq)


# ---------------------------------------------------------------------------------------------------- loss masks
def _token_ids(side: _Side) -> list[tuple[Record, np.ndarray]]:
    """Integer ``[B, S]`` forward tensors stored in full, each once: the input ids, the labels (not position ids,
    not 0/1 masks)."""
    if side.token_ids is None:
        side.token_ids = []
        seen: set[tuple[int, int]] = set()
        for r in side.records:
            if (r.phase != "forward" or r.kind not in ("input", "output") or len(r.shape) != 2 or not r.has_data
                    or not r.dtype.startswith(("int", "uint")) or r.tensor_id in seen or r.shape[1] < 2):
                continue
            seen.add(r.tensor_id)
            x = side.array(r)
            if x is None or x.dtype.kind not in "iu" or _positions(x) or (x.min() >= 0 and x.max() <= 1):
                continue
            side.token_ids.append((r, x))
    return side.token_ids


def _as_loss_mask(side: _Side, rec: Record) -> np.ndarray | None:
    """``rec`` as a loss (or label) mask: 0/1 values shaped like this side's token ids (``[B, S]``, ``[S, B]`` or
    flattened ``[B*S]``), as a flat bool array in the ids' order (True = the token counts); else None."""
    source = side.by_seq.get(rec.tensor_id[1], rec)
    if (rec.phase != "forward" or rec.kind not in ("input", "output") or not rec.has_data or source.phase != "forward"
            or rec.nan or rec.min < 0 or rec.max > 1 or len(rec.shape) not in (1, 2)
            or not (rec.dtype == "bool" or rec.dtype.startswith(("int", "uint")) or dtypes.is_float(rec.dtype))):
        return None
    for ids, _ in _token_ids(side):
        b, sq = ids.shape
        if rec.shape not in ((b, sq), (sq, b), (b * sq,)) or (len(rec.shape) == 1 and b < 2):
            continue
        x = side.array(rec)
        f = dtypes.floats(x) if x is not None and x.dtype.kind not in "biu" else x
        if f is None or not np.isin(f, (0, 1)).all():
            return None
        keep = np.asarray(f) == 1
        if keep.shape == (sq, b) and (b, sq) != (sq, b):
            keep = keep.T
        return keep.reshape(-1)
    return None


def _left_out(side: _Side, numel: int) -> tuple[list[tuple[Record, np.ndarray]], np.ndarray | None]:
    """What ``side`` leaves out of its loss, by value, for ``numel`` tokens: its loss masks (record, flat keep) and
    the tokens its labels mark with an ignore index (a negative id), or None where no labels hold one."""
    if numel in side.left_out:
        return side.left_out[numel]
    masks, ignored = [], None
    seen: set[tuple[int, int]] = set()
    for r in side.records:
        if r.tensor_id in seen or r.numel != numel or not r.has_data:
            continue
        seen.add(r.tensor_id)
        keep = _as_loss_mask(side, r)
        if keep is not None and keep.size == numel:
            masks.append((r, keep))
    for _, x in _token_ids(side):
        if x.size == numel and (x < 0).any():
            ignored = (x.reshape(-1) < 0) | (ignored if ignored is not None else False)
    side.left_out[numel] = masks, ignored
    return masks, ignored


def _loss_masks(sides: dict[str, _Side], lone: dict[str, list[Row]], findings: list[str]) -> None:
    """Loss and label masks with no counterpart, by value: all ones masks nothing (the other side, passing none,
    counts every token too); one leaving out exactly the tokens the other side's mask or ignore index leaves out
    means the same; one leaving out the tokens of one id in the input ids (a pad token) is a finding."""
    for s, other in (("A", "B"), ("B", "A")):
        side, them = sides[s], sides[other]
        reported: set[tuple] = set()
        for row in lone[s]:
            rec = _rec(side, row)
            if row.accounted is not None or rec.seq in side.flagged or not rec.has_data or rec.min < 0 or rec.max > 1:
                continue
            keep = _as_loss_mask(side, rec)
            if keep is None:
                continue
            shape = "x".join(map(str, rec.shape))
            theirs, their_ignored = _left_out(them, keep.size)
            _, own_ignored = _left_out(side, keep.size)
            if keep.all():
                if any(not k.all() for _, k in theirs) or (
                        their_ignored is not None and not (own_ignored is not None and (their_ignored <= own_ignored).all())):
                    continue  # the other side leaves tokens out: its own mask is what to look at
                as_theirs = (f"as in {other}'s {theirs[0][0].label}" if theirs else
                             "as on the other side, which passes none")
                row.accounted = Accounted("loss-mask", f"a loss mask of all ones [{shape}]: every token counts, "
                                          f"{as_theirs}")
                continue
            out = ~keep
            n = int(out.sum())
            same = next((r for r, k in theirs if np.array_equal(~k, out)), None)
            if same is not None:
                row.accounted = Accounted("loss-mask", f"a loss mask [{shape}] leaving out {n} of {keep.size} tokens, "
                                          f"the ones {other}'s {same.label} leaves out")
                continue
            if their_ignored is not None and np.array_equal(their_ignored, out):
                row.accounted = Accounted("loss-mask", f"a loss mask [{shape}] leaving out the {n} of {keep.size} "
                                          f"tokens {other}'s labels mark with an ignore index")
                continue
            side.flagged.add(rec.seq)
            pad = _pad_token(side, out)
            elsewhere = (f"{other}'s loss masks leave out other tokens" if theirs else
                         f"{other} passes no loss mask and counts every token")
            if pad is None:
                row.note = f"a loss mask leaving out {n} of {keep.size} tokens; {elsewhere}"
                continue
            ids, value = pad
            row.note = (f"a loss mask leaving out the {n} token(s) whose id in {ids.label} is {value}: a pad token; "
                        f"{elsewhere}")
            if (ids.seq, value, n) in reported:
                continue
            reported.add((ids.seq, value, n))
            finding = (f"{s}'s {rec.label} [{shape}], a loss mask, leaves out the {n} of {keep.size} token(s) whose id "
                       f"in {ids.label} is {value}: {s}'s model takes {value} for its pad token and masks it out of the "
                       f"loss; {elsewhere}. If {value} is a real token of this data, give {s}'s model a pad token id "
                       "the data never holds (MindFormers: pad_token_id), or pass both sides the same loss mask")
            if finding not in findings:
                findings.append(finding)


def _pad_token(side: _Side, out: np.ndarray) -> tuple[Record, int] | None:
    """(the token ids, the id) where ``out`` (flat, True = left out) is exactly where one id sits in token ids of
    ``side``."""
    for ids, x in _token_ids(side):
        flat = x.reshape(-1)
        if flat.size != out.size:
            continue
        values = np.unique(flat[out])
        if values.size == 1 and not (flat[~out] == values[0]).any():
            return ids, int(values[0])
    return None


# ---------------------------------------------------------------------------------------------------- consumers
def _call_agrees(side: _Side, module: str, call: int, phase: str, kinds: tuple[str, ...]) -> list[Record] | None:
    """The records of kind ``kinds`` of one module call that were compared and agree, when there is one and none
    of the call's others diverged or is left unaccounted; None for the model, the decoder or a layer stack, a
    module with any row that did not agree, or a call with nothing of those kinds compared."""
    if module == "" or module in side.bad_modules or side.holds_stack(module):
        return None
    recs = [r for r in side.calls.get((module, call), ()) if r.phase == phase and r.kind in kinds]
    if any(r.tensor_id in side.bad_tensors or (r.tensor_id in side.pending and r.tensor_id not in side.ok_tensors)
           for r in recs):
        return None
    ok = [r for r in recs if r.tensor_id in side.ok_tensors]
    return ok or None


def _consumed_by(side: _Side, rec: Record) -> str | None:
    """Why ``rec`` is accounted for by what consumes it, or None: a module's input by that module's outputs, a
    module's output by the outputs of the modules taking it as input, an output gradient by the module's input
    gradients, an input gradient by the output gradient of the module that produced the input."""
    def shown(recs: list[Record]) -> str:
        return ", ".join(r.label for r in recs[:2]) + (f" (+{len(recs) - 2})" if len(recs) > 2 else "")

    if rec.phase == "forward" and rec.kind == "input":
        ok = _call_agrees(side, rec.module, rec.call, "forward", ("output",))
        return None if ok is None else (f"an input of {module_label(rec.module)} with no counterpart, consumed there: "
                                        f"its outputs ({shown(ok)}) were compared and agree")
    if rec.phase == "forward" and rec.kind == "output":
        calls = sorted({(c.module, c.call) for c in side.consumers.get(rec.tensor_id, ())
                        if (c.module, c.call) != (rec.module, rec.call)})
        if not calls:
            return None
        agreeing = []
        for module, call in calls:
            ok = _call_agrees(side, module, call, "forward", ("output",))
            if ok is None:
                return None
            agreeing += ok
        names = ", ".join(module_label(m) for m, _ in calls[:2]) + (f" (+{len(calls) - 2})" if len(calls) > 2 else "")
        return (f"computed by {module_label(rec.module)} for {names}, whose outputs ({shown(agreeing)}) were compared "
                "and agree")
    if rec.phase == "backward" and rec.kind == "grad_output":
        ok = _call_agrees(side, rec.module, rec.call, "backward", ("grad_input",))
        return None if ok is None else (f"an output gradient of {module_label(rec.module)} with no counterpart, "
                                        f"consumed by its backward: its input gradients ({shown(ok)}) were compared "
                                        "and agree")
    if rec.phase == "backward" and rec.kind == "grad_input":
        forward = side.by_seq.get(rec.grad_of)
        if forward is None:
            return None
        into = [g for g in side.grads_of(forward.tensor_id) if g.module != rec.module]
        if not into:
            return None
        ok = []
        for g in into:
            if g.module == "" or g.module in side.bad_modules or side.holds_stack(g.module) \
                    or g.tensor_id in side.bad_tensors:
                return None
            if g.tensor_id in side.ok_tensors:
                ok.append(g)
        return None if not ok else (f"the gradient {module_label(rec.module)} hands back for its input "
                                    f"{forward.tensor_label}, summed into {shown(ok)}, which was compared and agrees")
    return None


def _consumers(side: _Side, lone: list[Row]) -> None:
    """Records accounted for by what consumes them, when that was compared and agrees (``_consumed_by``)."""
    for row in lone:
        rec = _rec(side, row)
        if row.accounted is not None or rec.seq in side.flagged:
            continue
        why = _consumed_by(side, rec)
        if why is not None:
            row.accounted = Accounted("consumer", why)


def _links_of_accounted(side: _Side, lone: list[Row]) -> None:
    """Records holding a tensor accounted for under another name of their side (a table handed to every layer)."""
    accounted = {_rec(side, row).tensor_id: row.accounted for row in lone if row.accounted is not None}
    for row in lone:
        rec = _rec(side, row)
        if row.accounted is None and rec.tensor_id in accounted and rec.seq not in side.flagged:
            first = accounted[rec.tensor_id]
            assert first is not None
            row.accounted = Accounted(first.rule, f"the same tensor as a record accounted for above: {first.why}")
            side.cites[rec.seq] = rec.tensor_id


def _inputs(side: _Side, lone: list[Row]) -> None:
    """Position ids and labels one side passes and the other derives itself."""
    ids = [r for r in side.records if r.phase == "forward" and r.kind == "input" and r.dtype in ("int64", "int32")
           and r.has_data]
    for row in lone:
        rec = _rec(side, row)
        if row.accounted is not None or rec.phase != "forward" or rec.kind != "input":
            continue
        x = side.array(rec)
        if x is None or x.dtype.kind not in "iu":
            continue
        if _positions(x):
            row.accounted = Accounted("positions", f"position ids 0..{x.shape[-1] - 1} in every row (the default "
                                      "positions of the other side)")
            continue
        for cand in ids:
            y = side.array(cand)
            if (cand.seq != rec.seq and y is not None and y.shape == x.shape and x.ndim == 2
                    and cand.tensor_id in side.compared and np.array_equal(x[:, :-1], y[:, 1:])):
                row.accounted = Accounted("labels", f"next-token labels: {cand.label} shifted by one (the other side "
                                          "shifts inside its loss)")
                side.cites[rec.seq] = cand.tensor_id
                break


def _gradients_agree(side: _Side, outer: str) -> bool:
    """Every parameter inside ``outer`` had its gradient compared, and it agrees: the backward through ``outer``
    computed what the other side's did even where neither recorded ``outer``'s own gradients (an MoE block's
    shared expert)."""
    inner = [m for m in side.param_modules if m == outer or is_inside(m, outer)]
    return bool(inner) and all("param_grad" in side.ok_modules.get(m, set()) and m not in side.bad_modules
                               for m in inner)


def _inside(side: _Side, lone: list[Row]) -> None:
    """Records of parameter-free modules, and extra outputs, strictly inside a module whose compared records agree."""
    for row in lone:
        rec = _rec(side, row)
        if row.accounted is not None or rec.phase not in ("forward", "backward") or rec.seq in side.flagged:
            continue
        extra = rec.kind in ("output", "grad_output") and rec.module in side.ok_modules
        own = side.ok_modules.get(rec.module, set())
        if not extra and side.has_params(rec.module) and not ("weights" in own and rec.module not in side.bad_modules):
            continue  # a module with parameters only when they were compared and agree (attention sinks)
        parts = rec.module.split(".") if rec.module else []
        start = len(parts) if extra else len(parts) - 1
        for n in range(start, 0, -1):
            outer = ".".join(parts[:n])
            phases = side.ok_modules.get(outer)
            if not phases or outer in side.bad_modules:
                continue
            if side.holds_stack(outer):
                break  # never the decoder, the model, a layer stack
            if "forward" not in phases or (rec.phase == "backward" and "backward" not in phases
                                           and not _gradients_agree(side, outer)):
                continue
            what = (f"an extra output of {outer}" if extra else f"{module_label(rec.module)} "
                    f"({rec.module_class or '?'})")
            row.accounted = Accounted("inside", f"{what}, computed inside {outer}, whose compared records agree")
            break
