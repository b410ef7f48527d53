"""Layer drift across a whole run: for each layer, the step at which its statistics first depart between two runs
beyond their own noise, from statistics-only captures (``tensors="none"``, every step or every Nth).

* Records are lined up step by step the way ``tensordiff diff`` lines them up (``diff.align.align_step``, with the
  mapping ``--mapping`` names or the built-in one ``diff.autoselect.orient`` picks (in either order): megatron-core against
  MindFormers or Hugging Face goes through the same rename rules, joins and layout transforms of the statistics).
* Each matched record's **departure** at a step is the largest of: the relative difference of the L2 norms, of the
  abs-maxima, and the difference of the means over A's RMS (the first two and the last are at most the relative L2
  error of the whole tensor; a different count of NaN or Inf elements is an infinite departure).
* **Noise** is measured on the first ``baseline`` common steps, where the two runs should agree: a record's
  tolerance is ``max(factor x its largest departure there, floor)``, the floor by dtype being ``diff``'s own relative
  L2 limit (``diff.tolerance``: 1e-5 for float32, 3e-2 for bfloat16, ...), since a statistic cannot move more than
  the tensor does. Its **ratio** at a step is departure / tolerance. The factor is 10 by default: between two
  implementations (megatron-core against Hugging Face GPT-2 carrying the same weights, FP32, AdamW) rounding
  differences grow in training, by 1.6x the largest baseline departure within 30 steps; 3 (``diff``'s noise
  factor) called that growth a drift.
* Records are grouped by **layer** (``decoder.layers.17``; outside the numbered layers, the top module such as
  ``embedding``, ``decoder.final_layernorm``, ``output_layer``), named by A's side, and **kind**: ``weights``,
  ``forward`` (module outputs), ``backward`` (gradients of module outputs and inputs), ``param_grad``. A cell's ratio
  is its largest record ratio; a forward cell's is its layer's own output's (else its last compared record's: an inner tensor
  whose difference the layer's output does not carry, such as a key-bias shift that the softmax removes, which
  Adam grows from a zero gradient's rounding, is not the layer departing; the departing record is still named
  from all of the layer's records).
* **First drift** of a (layer, kind): the first step after the baseline whose ratio exceeds 1 and exceeds it again at
  at least 2 of the next 3 logged steps (all of them when fewer follow), so that a one-off spike is not a drift.
  The earliest-drifting layer is the one with the smallest first drift step; at a tie, the one whose departing
  record ran first in that step (weights, forward, backward, parameter gradients, in execution order).

Nothing passes silently: steps held by one run only, records matched on one side only, and records without
statistics are counted and stated. Framework-free: numpy and the store.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .. import dtypes
from ..diff.align import Pair, align_step, joined_record
from ..diff.autoselect import orient
from ..diff.judge import compute_dtype
from ..diff.tolerance import DEFAULT_RTOL, judged_dtype
from ..errors import RunsError
from ..mapping import RenameRules
from ..mapping.names import unwrap
from ..record import Record
from ..store import CaptureReader

#: The kinds of a layer's records, in the order a step produces them.
KINDS: tuple[str, ...] = ("weights", "forward", "backward", "param_grad")
KIND_TEXT = {"weights": "weights", "forward": "activations", "backward": "activation gradients",
             "param_grad": "parameter gradients"}
DEFAULT_BASELINE = 5
DEFAULT_FACTOR = 10.0
#: Persistence: a step over its tolerance counts when at least ``CONFIRM`` of the next ``AHEAD`` logged steps are too.
AHEAD, CONFIRM = 3, 2
RULE = (f"tolerance = max({{factor}} x the largest departure in the first {{baseline}} common steps, the dtype's "
        f"floor); first drift = the first later step over its tolerance that is over it again at >= {CONFIRM} of the "
        f"next {AHEAD} logged steps (all of them when fewer follow)")

_LAYER = re.compile(r"^(.*?\b(?:layers|layer|h|blocks|block)\.\d+)(?:\.|$)")
_CONTAINERS = {"decoder", "encoder", "model", "transformer", "language_model", "backbone"}


@functools.lru_cache(maxsize=65536)
def layer_of(module: str) -> str:
    """The layer a module belongs to: ``decoder.layers.17.mlp.linear_fc1`` -> ``decoder.layers.17``; outside the
    numbered layers the top module (``embedding.word_embeddings`` -> ``embedding``; ``decoder.final_layernorm`` as
    it is, ``decoder`` being a container); the root is ``<model>``."""
    name = unwrap(module)
    if not name:
        return "<model>"
    m = _LAYER.match(name)
    if m:
        return m.group(1)
    parts = name.split(".")
    if parts[0] in _CONTAINERS and len(parts) > 1:
        return ".".join(parts[:2])
    return parts[0]


def kind_of(rec: Record) -> str | None:
    """The drift kind of a record, or None for what is not followed (module inputs: other modules' outputs; the loss:
    the loss curves')."""
    if rec.phase == "weights":
        return "weights"
    if rec.phase == "forward":
        return "forward" if rec.kind == "output" else None
    if rec.phase in ("backward", "param_grad"):
        return rec.phase
    return None


def departure(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    """Departure of B's statistics from A's, each ``(numel, min, max, mean, l2, nan, inf)``: the largest of
    |Δl2| / max(l2), |Δabsmax| / max(absmax), |Δmean| / rms(A); a different NaN or Inf count is inf."""
    na, mina, maxa, meana, l2a, nana, infa = a
    _, minb, maxb, meanb, l2b, nanb, infb = b
    if nana != nanb or infa != infb:
        return math.inf
    if not all(math.isfinite(v) for v in (mina, maxa, meana, l2a, minb, maxb, meanb, l2b)):
        return math.nan

    def rel(x: float, y: float) -> float:
        scale = max(abs(x), abs(y))
        return abs(x - y) / scale if scale > 0 else 0.0

    out = max(rel(l2a, l2b), rel(max(abs(mina), abs(maxa)), max(abs(minb), abs(maxb))))
    rms = l2a / math.sqrt(na) if na > 0 else 0.0
    if rms > 0:
        out = max(out, abs(meanb - meana) / rms)
    elif meana != meanb:
        out = math.inf
    return out


def first_departure(ratios: Sequence[float], start: int) -> int | None:
    """Index of the first ``i >= start`` with ``ratios[i] > 1`` that is confirmed by the persistence rule (NaN: no
    value at that step, neither over nor under), or None."""
    known = [i for i in range(len(ratios)) if not math.isnan(ratios[i])]
    for pos, i in enumerate(known):
        if i < start or not ratios[i] > 1:
            continue
        ahead = known[pos + 1:pos + 1 + AHEAD]
        need = min(CONFIRM, len(ahead))
        if sum(1 for j in ahead if ratios[j] > 1) >= need:
            return i
    return None


@dataclass
class Cell:
    """One (layer, kind): its records' ratios by step (max over the records), and what is known of it."""

    layer: str
    kind: str
    ratios: list[float]
    first: int | None = None
    """index into ``DriftTable.steps`` of the first drift, or None"""
    first_seq: int = 0
    """at the first drift step: the lowest seq (A's execution order) of a record over its tolerance"""
    first_record: str = ""
    """that record's label"""
    records: int = 0


@dataclass
class DriftTable:
    """What ``layer_drift`` finds: the layer x step matrix of departure / tolerance, the first drift step of each
    layer and kind, the earliest-drifting layer, and everything that was not compared."""

    path_a: str
    path_b: str
    steps: list[int]
    """the common logged steps, as iterations (a capture's step k is iteration k + 1, as ``runs`` counts)"""
    layers: list[str]
    """rows, in A's execution order"""
    cells: dict[tuple[str, str], Cell]
    baseline: int
    factor: float
    mapping_note: str = ""
    steps_only_a: list[int] = field(default_factory=list)
    steps_only_b: list[int] = field(default_factory=list)
    only_a: int = 0
    """record instances (summed over steps) of A with no counterpart in B"""
    only_b: int = 0
    only_examples: list[str] = field(default_factory=list)
    no_stats: int = 0
    """matched record instances whose statistics are unknown on a side or cannot follow B's layout transform"""
    other_size: int = 0
    """matched record instances whose tensors hold another number of elements on each side (a broadcast, a padded
    vocabulary): their statistics do not compare"""
    other_size_examples: list[str] = field(default_factory=list)
    missing_cells: int = 0
    """(record, step) values absent on a step of a record seen at other steps"""
    noisy_baseline: str = ""
    """set when the runs already differ in the baseline steps (the tolerance then measures a difference, not noise)"""
    loss_rel: list[float] = field(default_factory=list)
    """relative loss difference per step (NaN where a side has no loss)"""
    loss_parts: int | None = None
    """index into ``steps`` where the loss curves part by the same rule (against the float dtype's floor)"""

    # views ----------------------------------------------------------------
    def layer_ratios(self, layer: str) -> list[float]:
        """The layer's row of the heat map: its largest ratio over the kinds at each step (NaN: nothing there)."""
        rows = [c.ratios for (la, _), c in self.cells.items() if la == layer]
        out = []
        for i in range(len(self.steps)):
            vals = [r[i] for r in rows if not math.isnan(r[i])]
            out.append(max(vals) if vals else math.nan)
        return out

    def layer_first(self, layer: str) -> Cell | None:
        """The earliest-drifting kind of ``layer``, or None."""
        cands = [c for (la, _), c in self.cells.items() if la == layer and c.first is not None]
        return min(cands, key=_order) if cands else None

    def ranking(self) -> list[Cell]:
        """Layers that drift, earliest first (one cell each: its earliest kind)."""
        cells = [c for c in (self.layer_first(la) for la in self.layers) if c is not None]
        return sorted(cells, key=_order)

    @property
    def drifted(self) -> bool:
        return any(c.first is not None for c in self.cells.values())

    def step_of(self, index: int | None) -> int | None:
        return None if index is None else self.steps[index]

    def judged_text(self) -> str:
        judged = self.steps[self.baseline:]
        return f"steps {judged[0]}..{judged[-1]}" if judged else "no step"

    def verdict(self) -> str:
        loss = (f"the loss departs beyond its own noise at step {self.steps[self.loss_parts]}"
                if self.loss_parts is not None else "the loss does not depart beyond its noise by the same rule")
        ranking = self.ranking()
        if ranking and self.loss_parts is not None:
            gap = self.steps[self.loss_parts] - self.steps[ranking[0].first]  # type: ignore[index]
            if gap > 0:
                loss += f", {gap} step{'s' if gap != 1 else ''} later"
        if not ranking:
            return (f"no layer departs beyond its noise in {self.judged_text()} ({len(self.layers)} layers; tolerance "
                    f"from steps {self.steps[0]}..{self.steps[self.baseline - 1]}); {loss}.")
        first = ranking[0]
        text = (f"layer {first.layer} ({first.kind}) first departs at step {self.steps[first.first]}")  # type: ignore
        if len(ranking) == 1:
            text += ", the only layer that does"
        else:
            nxt = ranking[1]
            gap = self.steps[nxt.first] - self.steps[first.first]  # type: ignore[index]
            if gap > 0:
                text += f", {gap} step{'s' if gap != 1 else ''} before any other ({nxt.layer}, {nxt.kind})"
            else:
                same = sum(1 for c in ranking[1:] if c.first == first.first)
                text += (f", with {same} other layer{'s' if same != 1 else ''} at the same step; it ran first in "
                         f"that step ({first.first_record})")
        return text + f"; {loss}."

    def notes(self) -> list[str]:
        """What was not compared, in words (empty when everything was)."""
        out = []
        if self.steps_only_a or self.steps_only_b:
            for side, only in (("A", self.steps_only_a), ("B", self.steps_only_b)):
                if only:
                    out.append(f"{len(only)} step{'s' if len(only) != 1 else ''} logged by {side} only "
                               f"({_steps_text(only)}): not compared")
        if self.only_a or self.only_b:
            ex = "; e.g. " + ", ".join(self.only_examples) if self.only_examples else ""
            out.append(f"records without a counterpart: {self.only_a} of A's, {self.only_b} of B's (summed over the "
                       f"steps){ex}: not compared")
        if self.no_stats:
            out.append(f"{self.no_stats} matched records without statistics (unknown on a side, or a layout transform "
                       "statistics cannot follow): not compared")
        if self.other_size:
            out.append(f"{self.other_size} matched records whose tensors differ in size between the runs (e.g. "
                       f"{', '.join(self.other_size_examples)}): their statistics do not compare, not compared")
        if self.missing_cells:
            out.append(f"{self.missing_cells} (record, step) values missing on some steps: left blank")
        if self.noisy_baseline:
            out.append(self.noisy_baseline)
        return out

    def as_dict(self) -> dict[str, Any]:
        def clean(v: float) -> float | None:
            return None if math.isnan(v) else (1e308 if math.isinf(v) else float(f"{v:.4g}"))

        first = {la: {k: self.step_of(c.first) for (l2, k), c in self.cells.items() if l2 == la} for la in self.layers}
        ranking = self.ranking()
        earliest = None
        if ranking:
            c = ranking[0]
            nxt = ranking[1] if len(ranking) > 1 else None
            earliest = {"layer": c.layer, "kind": c.kind, "step": self.step_of(c.first), "record": c.first_record,
                        "next": None if nxt is None else {"layer": nxt.layer, "kind": nxt.kind,
                                                          "step": self.step_of(nxt.first)}}
        return {
            "a": self.path_a, "b": self.path_b, "steps": self.steps, "layers": self.layers, "kinds": list(KINDS),
            "baseline": self.baseline, "baseline_steps": self.steps[:self.baseline], "factor": self.factor,
            "rule": RULE.format(factor=self.factor, baseline=self.baseline),
            "step_numbering": "iterations from 1 (a capture's step k is iteration k + 1)",
            "ratios": [[clean(v) for v in self.layer_ratios(la)] for la in self.layers],
            "ratios_by_kind": {k: [[clean(v) for v in self.cells[(la, k)].ratios] if (la, k) in self.cells else None
                                   for la in self.layers] for k in KINDS},
            "first_drift": first,
            "first_drift_layer": {la: self.step_of(getattr(self.layer_first(la), "first", None))
                                  for la in self.layers},
            "earliest": earliest, "drifted": self.drifted,
            "loss_rel": [clean(v) for v in self.loss_rel], "loss_parts_at": self.step_of(self.loss_parts),
            "verdict": self.verdict(), "notes": self.notes(), "mapping": self.mapping_note,
            "steps_only_a": self.steps_only_a, "steps_only_b": self.steps_only_b,
            "records_only_a": self.only_a, "records_only_b": self.only_b, "records_without_statistics": self.no_stats,
            "records_of_another_size": self.other_size,
            "missing_values": self.missing_cells,
        }


def _order(c: Cell) -> tuple[int, int]:
    return (c.first if c.first is not None else 1 << 62, c.first_seq)


def _steps_text(steps: list[int]) -> str:
    if len(steps) > 6:
        return f"{', '.join(map(str, steps[:3]))}, ..., {steps[-1]}"
    return ", ".join(map(str, steps))


def _stats_a(r: Record) -> tuple[float, ...]:
    return (r.numel, r.min, r.max, r.mean, r.l2, r.nan, r.inf)


def _floor(dtype_a: str, dtype_b: str, run_dtype: str) -> float:
    judged = judged_dtype(dtype_a, dtype_b, run_dtype)
    if not dtypes.is_float(judged):
        return 0.0
    return DEFAULT_RTOL.get(judged, DEFAULT_RTOL["float32"])


def has_step_statistics(cap: CaptureReader) -> bool:
    """Whether ``cap`` holds statistics for at least 2 steps (what ``layer_drift`` needs)."""
    return len(cap.steps) >= 2


class _Aligner:
    """``align_step`` per step, the pairing reused while a step's records have the same keys and shapes as the last
    aligned step's (a training run records the same tensors every step)."""

    def __init__(self, mapping: RenameRules | None, order_fallback: bool):
        self.mapping, self.order_fallback = mapping, order_fallback
        self._sig: tuple[list, list] | None = None
        self._plan: list[tuple[int | None, tuple[int, ...] | None, Pair]] = []

    def pairs(self, recs_a: list[Record], recs_b: list[Record]) -> list[Pair]:
        sig = ([(r.phase, r.module, r.call, r.kind, r.slot, r.shape, r.same_as) for r in recs_a],
               [(r.phase, r.module, r.call, r.kind, r.slot, r.shape, r.same_as) for r in recs_b])
        if sig != self._sig:
            pairs = align_step(recs_a, recs_b, self.mapping, self.order_fallback)
            pos_a = {id(r): i for i, r in enumerate(recs_a)}
            pos_b = {id(r): i for i, r in enumerate(recs_b)}
            plan = []
            for p in pairs:
                ia = pos_a.get(id(p.a)) if p.a is not None else None
                ib = tuple(pos_b[id(r)] for r in p.b_records) if p.b is not None and all(
                    id(r) in pos_b for r in p.b_records) else None
                plan.append((ia, ib, p))
            self._sig, self._plan = sig, plan
            return pairs
        out = []
        for ia, ib, p in self._plan:  # same records, new statistics: the same pairs over this step's records
            a = recs_a[ia] if ia is not None else None
            if ib is None or p.b is None:
                out.append(replace(p, a=a))
            elif p.parts and p.join is not None:
                parts = tuple(recs_b[i] for i in ib)
                out.append(replace(p, a=a, b=joined_record(parts, p.join), parts=parts))
            else:
                out.append(replace(p, a=a, b=recs_b[ib[0]]))
        return out


def layer_drift(ca: CaptureReader, cb: CaptureReader, baseline: int = DEFAULT_BASELINE, factor: float = DEFAULT_FACTOR,
                mapping: RenameRules | None = None, auto_mapping: bool = True, order_fallback: bool = True,
                loss: dict[int, tuple[float, float]] | None = None) -> DriftTable:
    """The drift table of two captures holding statistics for many steps (see the module docstring).

    ``loss``: iteration -> (A's loss, B's loss), to say where the loss curves part by the same rule (default: the
    captures' own per-step losses)."""
    if baseline < 1:
        raise RunsError(f"--drift-baseline {baseline}: the noise is measured on at least 1 step")
    if not (factor > 0 and math.isfinite(factor)):
        raise RunsError(f"drift factor {factor}: a finite number > 0")
    common = sorted(set(ca.steps) & set(cb.steps))
    if len(common) <= baseline:
        raise RunsError(f"{ca.path} and {cb.path} share {len(common)} captured step(s); the drift table needs more than "
                        f"the {baseline} baseline steps (--drift-baseline N, or capture more steps)")
    # the mapping's sides matched to the captures by content, as diff does: A is its first side
    swapped, mapping, mapping_note = orient(ca.attrs, cb.attrs, ca.records(common[0]), cb.records(common[0]), mapping,
                                            auto_mapping)
    if swapped:
        ca, cb = cb, ca
        loss = {k: (b, a) for k, (a, b) in loss.items()} if loss is not None else None
    run_dtype = dtypes.coarsest(compute_dtype(ca, common[0]), compute_dtype(cb, common[0]))
    aligner = _Aligner(mapping, order_fallback)
    n = len(common)
    # per followed record (A's key): layer, kind, floor, first seq, label, departures by step index
    series: dict[tuple, dict[str, Any]] = {}
    table = DriftTable(path_a=ca.path, path_b=cb.path, steps=[s + 1 for s in common], layers=[], cells={},
                       baseline=baseline, factor=factor, mapping_note=mapping_note,
                       steps_only_a=[s + 1 for s in sorted(set(ca.steps) - set(cb.steps))],
                       steps_only_b=[s + 1 for s in sorted(set(cb.steps) - set(ca.steps))])
    order: dict[str, tuple[int, int]] = {}  # layer -> (0: by its first forward output, 1: other, seq)
    for i, step in enumerate(common):
        recs_a, recs_b = ca.records(step), cb.records(step)
        for p in aligner.pairs(recs_a, recs_b):
            rec = p.a or p.b
            assert rec is not None
            if kind_of(rec) is None or rec.same_as >= 0:
                continue
            if not p.matched:
                if p.a is not None:
                    table.only_a += 1
                else:
                    table.only_b += 1
                if len(table.only_examples) < 3 and rec.label not in table.only_examples:
                    table.only_examples.append(f"{'A' if p.a is not None else 'B'} {rec.label}")
                continue
            a = p.a
            assert a is not None and p.b is not None
            # statistics cannot follow a returned bias added to one side's output (megatron's skip_bias_add)
            st_b = p.b_stats() if p.b.stats_known and p.bias_a is None and p.bias_b is None else None
            if not a.stats_known or st_b is None:
                table.no_stats += 1
                continue
            if st_b[0] != a.numel:
                table.other_size += 1
                if len(table.other_size_examples) < 2 and a.label not in table.other_size_examples:
                    table.other_size_examples.append(a.label)
                continue
            kind = kind_of(a)
            assert kind is not None
            layer = layer_of(a.module)
            s = series.get(a.key)
            if s is None:
                s = series[a.key] = {"layer": layer, "kind": kind, "floor": _floor(a.dtype, p.b.dtype, run_dtype),
                                     "dep": np.full(n, np.nan), "seq": np.full(n, np.iinfo(np.int64).max, np.int64),
                                     "label": a.label, "out": kind == "forward" and a.module == layer
                                     and a.kind == "output"}
            key = (0 if kind == "forward" else 1, a.seq)
            if key < order.get(layer, (2, 0)):
                order[layer] = key
            numel, mn, mx, mean, l2 = st_b
            s["dep"][i] = departure(_stats_a(a), (numel, mn, mx, mean, l2, p.b.nan, p.b.inf))
            s["seq"][i] = a.seq
        ca.forget(step)  # a whole run's records would otherwise stay in memory
        cb.forget(step)
    # layers in A's execution order: by their first forward output, then the rest as first seen
    seen_fwd = sorted((v, la) for la, v in order.items())
    table.layers = [la for _, la in seen_fwd]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    worst_base: tuple[float, str] = (0.0, "")
    for s in series.values():
        dep = s["dep"]
        base = dep[:baseline]
        known_base = base[~np.isnan(base)]
        noise = float(known_base.max()) if known_base.size else 0.0
        if noise > worst_base[0] and math.isfinite(noise):
            worst_base = (noise, s["label"])
        if not math.isfinite(noise):
            noise = 0.0  # a NaN/Inf mismatch in the baseline: the tolerance stays at its floor, the rest counts
        tol = max(factor * noise, s["floor"])
        with np.errstate(divide="ignore", invalid="ignore"):
            s["ratio"] = np.where(dep == 0, 0.0, dep / tol) if tol > 0 else np.where(dep == 0, 0.0, np.inf)
        s["ratio"][np.isnan(dep)] = np.nan
        table.missing_cells += int(np.isnan(dep).sum())
        groups.setdefault((s["layer"], s["kind"]), []).append(s)
    if worst_base[0] > 0.01:
        table.noisy_baseline = (f"the runs already differ in the baseline steps (up to {worst_base[0]:.2%} in "
                                f"{worst_base[1]}): the tolerance there measures a difference, not noise; compare "
                                "the first steps with `tensordiff diff`")
    for (layer, kind), members in groups.items():
        # a layer's forward departs where its output does: an inner tensor over its tolerance whose difference the
        # layer's output does not carry (a key-bias shift that the softmax removes) is not the layer departing
        outputs = [m for m in members if m["out"]] if kind == "forward" else members
        if kind == "forward" and not outputs:  # the layer's output not compared: its last record compared instead
            outputs = [max(members, key=lambda m: int(m["seq"].min()))]
        stack = np.vstack([m["ratio"] for m in outputs])
        with np.errstate(invalid="ignore"):
            all_nan = np.all(np.isnan(stack), axis=0)
            ratios = np.where(all_nan, np.nan, np.nanmax(np.where(np.isnan(stack), -np.inf, stack), axis=0))
        cell = Cell(layer=layer, kind=kind, ratios=[float(v) for v in ratios], records=len(members))
        cell.first = first_departure(cell.ratios, baseline)
        if cell.first is not None:
            over = [m for m in members if m["ratio"][cell.first] > 1]
            best = min(over, key=lambda m: int(m["seq"][cell.first]))
            cell.first_seq, cell.first_record = int(best["seq"][cell.first]), best["label"]
        table.cells[(layer, kind)] = cell
    table.cells = {k: table.cells[k] for la in table.layers for k in ((la, kind) for kind in KINDS)
                   if k in table.cells}
    table.loss_rel, table.loss_parts = _loss_parting(table.steps, loss if loss is not None else _capture_loss(ca, cb,
                                                                                                             common),
                                                     baseline, factor, run_dtype)
    return table


def _capture_loss(ca: CaptureReader, cb: CaptureReader, common: Iterable[int]) -> dict[int, tuple[float, float]]:
    out = {}
    sa, sb = ca.scalars().get("loss", {}), cb.scalars().get("loss", {})
    for step in common:
        la = sa.get(step, ca.step_attrs(step).get("loss"))
        lb = sb.get(step, cb.step_attrs(step).get("loss"))
        if la is not None and lb is not None:
            out[step + 1] = (float(la), float(lb))
    return out


def _loss_parting(steps: list[int], loss: dict[int, tuple[float, float]], baseline: int, factor: float,
                  run_dtype: str) -> tuple[list[float], int | None]:
    """The relative loss difference per step and where it first departs by the layers' rule (the loss is held to
    the floor of the runs' compute dtype)."""
    rel = []
    for s in steps:
        if s not in loss:
            rel.append(math.nan)
            continue
        la, lb = loss[s]
        scale = max(abs(la), abs(lb))
        rel.append(abs(lb - la) / scale if scale > 0 else (0.0 if la == lb else math.inf))
    base = [v for v in rel[:baseline] if math.isfinite(v)]
    floor = _floor("float32", "float32", run_dtype)
    tol = max(factor * max(base, default=0.0), floor)
    ratios = [v if math.isnan(v) else (0.0 if v == 0 else v / tol) for v in rel]
    return rel, first_departure(ratios, baseline)
