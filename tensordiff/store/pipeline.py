"""Pipeline-parallel rank files read as one run: the union of the stages, in the single-device space (merge on read).

Each rank of a megatron-core run with PP > 1 holds one stage: its share of the layers under stage-local numbers
(``decoder.layers.0`` ... on every stage), and in its ``parallel`` attribute ``pp``, ``pp_rank`` and
``layer_offset`` (the global number of its first layer, from megatron's 1-based global ``layer_number``).
``PipelineCapture`` merges each stage's tensor- and data-parallel rank files with ``MergedCapture(stage=k)``, then
joins the stages:

* **names**: ``decoder.layers.{i}`` of stage k is ``decoder.layers.{i + layer_offset}`` (module, parent and
  ``param_splits`` names); two stages holding one global layer is an error (wrong offsets), never a silent merge;
* **order**: weights, the forward pass (stage 0's, then stage 1's, ..., micro-batch by micro-batch), the loss,
  the backward pass (the last stage's first), the parameter gradients; seq, links (``same_as``), ``grad_of`` and
  ``enter`` are renumbered in that order, and a module call that spans stages (the model, its decoder block)
  enters where its first stage entered it;
* **records several stages hold**, once in the single-device run:
  - the output of a module that spans stages, and its gradient: the last stage's. An earlier stage's output is
    the hidden state it hands over to the next stage (the boundary), the very tensor its last layer returned,
    which stays in the merge as that layer's output;
  - the loss: the last stage's (the others hold, at most, its broadcast);
  - anything else (token ids, masks, rotary embeddings: computed or fed on every stage): the first stage's; the
    other stages' copies are checked against it by the cross-rank check ("PP ranks 0/1 differ").
* **tied embeddings** (``share_embeddings_and_output_weights``): the last stage's ``output_layer.weight`` is its copy
  of the first stage's ``embedding.word_embeddings.weight`` (both marked ``tied`` in ``param_splits``: megatron's
  ``shared_embedding``), kept equal by the embedding group's all-reduce of their gradients. The copy's weights and
  reduced gradient are the original's records held by another stage: joined under the original's name, checked
  against it ("PP ranks 0/1 differ": a missing embedding all-reduce), and the last stage's output layer argument
  that is the copy (``output_layer input.weight``, a link) is the original, as in the single-device run. Before any
  reduction (``grad_local``) each copy holds its own stage's share: the merged local gradient is their sum;
* **the boundary**: the first float input that a stage k > 0 did not compute itself (its first layer's
  ``hidden_states``) is the tensor it received; ``received_from(record)`` names what stage k - 1 sent (its
  model output, i.e. its last layer's output) for the ``pp-boundary`` hint.

Not merged (one error line each): stages of different TP x DP sizes, files without ``layer_offset``, virtual
pipeline stages (model chunks).
"""

from __future__ import annotations

import json
import re
from bisect import bisect_left
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..errors import CaptureFileError
from ..record import PHASE_RANK, Record
from ..stats import host_stats
from .base import ReaderBase
from .merged import MergedCapture, _local_batch, _same_stats
from .plan import Plan, SumPlan
from .reader import CaptureFile

_LAYER = re.compile(r"(^|\.)(decoder\.layers\.)(\d+)(?=\.|$)")


def _coords(cap: CaptureFile) -> dict[str, Any]:
    try:
        value = json.loads(str(cap.attrs.get("parallel", "") or "{}"))
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def pipeline_stages(files: list[CaptureFile]) -> int:
    """The largest pipeline-parallel size the rank files declare (1 when none does)."""
    return max([int(_coords(cap).get("pp", 1) or 1) for cap in files] + [1])


def global_layer_name(name: str, offset: int) -> str:
    """``decoder.layers.{i}...`` -> ``decoder.layers.{i + offset}...`` (other names unchanged)."""
    if not offset or not name:
        return name
    return _LAYER.sub(lambda m: f"{m.group(1)}{m.group(2)}{int(m.group(3)) + offset}", name)


def _layer_of(name: str) -> str | None:
    m = _LAYER.search(name)
    return name[:m.end()] if m else None


@dataclass
class _Step:
    records: list[Record]
    local: dict[int, tuple[int, Record]]  # merged seq -> (stage, the stage's record)
    merged: dict[tuple[int, int], Record]  # (stage, the stage's seq) -> merged record (dropped: the one kept)
    copies: list[tuple[Record, int, Record]]  # (merged record, another stage, its copy): the cross-stage check
    received: dict[int, Record]  # merged seq of a stage's received input -> merged record of what was sent
    #: merged seq of a tied weight's local gradient -> [(stage, the stage's record)]: the merged one is their sum
    summed: dict[int, list[tuple[int, Record]]]
    #: merged seq of a tied weight's record (weights, reduced gradient) -> [(stage, its copy there)]
    tied: dict[int, list[tuple[int, Record]]]


class PipelineCapture(ReaderBase):
    """The stage files of a pipeline-parallel run as one capture (see the module docstring): its stages, each a
    ``MergedCapture`` of the stage's rank files, joined; the reader contract, with the capabilities of merged rank
    files and of pipeline stages (``received_from``, ``tied_copies``, ``stage_of``, ``offsets``)."""

    merged = True

    def __init__(self, paths: list[str], pattern: str = "", opened: dict[str, CaptureFile] | None = None):
        """``opened``: the rank files already open (``open_capture``), taken over: this capture closes them."""
        super().__init__(pattern or paths[0])
        self._paths = list(paths)
        self._stages: list[MergedCapture] = []
        self._opened = opened if opened is not None else {}
        try:
            self._setup_pipeline(paths)
        except Exception:
            self.close()
            raise

    def _setup_pipeline(self, paths: list[str]) -> None:
        coords: dict[str, dict[str, Any]] = {}
        for path in paths:
            if path in self._opened:
                coords[path] = _coords(self._opened[path])
            else:
                with CaptureFile(path) as cap:
                    coords[path] = _coords(cap)
        worlds = {c.get("world_size") for c in coords.values()}
        if len(worlds) != 1 or None in worlds:
            raise CaptureFileError(f"{self.path}: the files come from runs of different sizes ({sorted(map(str, worlds))} "
                                   "ranks) or hold no rank coordinates; pass the rank files of one run")
        size = int(next(iter(worlds)))  # type: ignore[arg-type]
        ranks = [int(c.get("rank", -1)) for c in coords.values()]
        missing = sorted(set(range(size)) - set(ranks))
        if missing or len(set(ranks)) != len(ranks):
            raise CaptureFileError(f"{self.path}: a run of {size} ranks needs one file per rank; missing rank(s) "
                                   f"{missing or 'none, but some appear twice'} ({len(paths)} file(s) given)")
        pp = {int(c.get("pp", 1)) for c in coords.values()}
        if len(pp) != 1:
            raise CaptureFileError(f"{self.path}: the files disagree on the number of pipeline stages ({sorted(pp)})")
        self.pp = pp.pop()
        if any(int(c.get("vpp", 1) or 1) > 1 for c in coords.values()):
            raise CaptureFileError(f"{self.path}: virtual pipeline stages (model chunks) are not merged yet")
        by_stage: list[list[str]] = [[] for _ in range(self.pp)]
        offsets: list[set[int]] = [set() for _ in range(self.pp)]
        for path, c in coords.items():
            stage = int(c.get("pp_rank", -1))
            if not 0 <= stage < self.pp:
                raise CaptureFileError(f"{path}: pipeline rank {c.get('pp_rank')} of a {self.pp}-stage run")
            if "layer_offset" not in c:
                raise CaptureFileError(f"{path}: pipeline stage {stage} without its layer offset ('layer_offset' in the "
                                       "'parallel' attribute): its layers cannot be numbered globally; re-capture with "
                                       "this tensordiff")
            by_stage[stage].append(path)
            offsets[stage].add(int(c["layer_offset"]))
        for stage, found in enumerate(offsets):
            if len(found) != 1:
                raise CaptureFileError(f"{self.path}: the ranks of pipeline stage {stage} disagree on its layer offset "
                                       f"({sorted(found)})")
        self.offsets = [next(iter(o)) for o in offsets]
        if self.offsets != sorted(self.offsets) or len(set(self.offsets)) != len(self.offsets):
            raise CaptureFileError(f"{self.path}: the pipeline stages' layer offsets {self.offsets} do not increase "
                                   "stage by stage")
        for stage, stage_paths in enumerate(by_stage):
            self._stages.append(MergedCapture(sorted(stage_paths), self.path, stage=stage, opened=self._opened))
        shapes = {(s.tp, s.dp) for s in self._stages}
        if len(shapes) != 1:
            raise CaptureFileError(f"{self.path}: pipeline stages of different TP x DP sizes "
                                   f"({', '.join(f'{t} x {d}' for t, d in sorted(shapes))}) are not merged")
        first = self._stages[0]
        self.tp, self.dp, self.sp = first.tp, first.dp, first.sp
        self.attrs = dict(first.attrs)
        self.attrs["merged_from"] = json.dumps({"files": len(paths), "tp": self.tp, "dp": self.dp, "pp": self.pp})
        self._tied = self._tied_copies()
        copies = {name for _, name in self._tied}
        self._param_splits = {global_layer_name(name, self.offsets[k]): split
                              for k, s in enumerate(self._stages) for name, split in s._param_splits.items()
                              if not (k == self.pp - 1 and name in copies)}
        for original, copy in self._tied:  # the original names its copy on the last stage (explain/ranks.py)
            if isinstance(self._param_splits.get(original), dict):
                self._param_splits[original] = {**self._param_splits[original], "tied_copy": copy}
        if self._param_splits:
            self.attrs["param_splits"] = json.dumps(self._param_splits, sort_keys=True)
        common = set(first.steps)
        for s in self._stages:
            common &= set(s.steps)
        self.steps = sorted(common)
        self.incomplete_steps = sorted({x for s in self._stages for x in s.steps + s.incomplete_steps} - common)
        self._merged: dict[int, _Step] = {}

    # ------------------------------------------------------------------ the reader contract
    @property
    def paths(self) -> list[str]:
        return list(self._paths)

    def close(self) -> None:
        for stage in self._stages:
            stage.close()
        for cap in self._opened.values():  # files no stage took (an error before the stages)
            cap.close()
        self._opened = {}

    def step_attrs(self, step: int) -> dict[str, Any]:
        out = dict(self._stages[-1].step_attrs(step))  # the loss is the last stage's
        out["records"] = len(self.records(step))
        walls = [s.step_attrs(step).get("wall_time") for s in self._stages]
        times = [float(w) for w in walls if isinstance(w, (int, float, np.floating))]
        if len(times) == len(walls):
            out["wall_time"] = max(times)  # the stages run side by side
        return out

    def scalars(self) -> dict[str, dict[int, float]]:
        out: dict[str, dict[int, float]] = {}
        for stage in self._stages:  # a later stage's value wins: the loss is computed on the last one
            for name, values in stage.scalars().items():
                out.setdefault(name, {}).update(values)
        return out

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self._stages)

    def records(self, step: int) -> list[Record]:
        return self._step(step).records

    def array(self, record: Record) -> np.ndarray | None:
        summed = self._summed(record)
        if summed is not None:
            return _sum([self._stages[k].array(rec) for k, rec in summed])
        found = self._local(record)
        return None if found is None else self._stages[found[0]].array(found[1])

    def plan(self, record: Record) -> Plan | None:
        summed = self._summed(record)
        if summed is not None:
            plans = [self._stages[k].plan(rec) for k, rec in summed]
            return None if any(p is None for p in plans) else SumPlan(tuple(p for p in plans if p is not None))
        found = self._local(record)
        return None if found is None else self._stages[found[0]].plan(found[1])

    def dp_copies(self, record: Record) -> list[np.ndarray] | None:
        if self._summed(record) is not None:
            return None  # each DP rank's local gradient of a tied weight is a sum over stages: not kept apart
        found = self._local(record)
        return None if found is None else self._stages[found[0]].dp_copies(found[1])

    def tp_copies(self, record: Record) -> list[np.ndarray] | None:
        found = self._local(record)
        return None if found is None else self._stages[found[0]].tp_copies(found[1])

    def inconsistent_records(self, step: int) -> list[tuple[Record, str, list[int]]]:
        """The stages' own cross-rank checks (TP, DP) in merged names, and the records several stages hold that must
        be identical on each (token ids, masks, rotary embeddings): group "PP"."""
        st = self._step(step)
        out = []
        for k, stage in enumerate(self._stages):
            for rec, group, ranks in stage.inconsistent_records(step):
                merged = st.merged.get((k, rec.seq))
                out.append((merged or rec, group, ranks))
        for merged, k, copy in st.copies:
            owner, local = st.local[merged.seq]
            if not _same_stats(local, copy):
                out.append((merged, "PP", [self._first_rank(owner), self._first_rank(k)]))
        order = {r.seq: i for i, r in enumerate(st.records)}
        return sorted(out, key=lambda item: order.get(item[0].seq, -1) if item[0].step == step else -1)

    def received_from(self, record: Record) -> tuple[Record, int, int] | None:
        """For a tensor that a pipeline stage received (its first layer's input), what the previous stage sent (its
        model output, i.e. its last layer's output) as a merged record, with the sending and receiving stages."""
        if record.step not in self.steps:
            return None
        st = self._step(record.step)
        sent = st.received.get(record.seq)
        if sent is None:
            return None
        stage = st.local[record.seq][0]
        return sent, stage - 1, stage

    def tied_copies(self, record: Record) -> list[tuple[int, np.ndarray]] | None:
        """For a tied weight's record (its weights or reduced gradient, merged: the first stage's), each stage's copy
        of it as (stage, tensor), the first stage's first; None for another record or where one is not stored."""
        if record.step not in self.steps:
            return None
        st = self._step(record.step)
        copies = st.tied.get(record.seq)
        if not copies:
            return None
        out = []
        for k, rec in [st.local[record.seq], *copies]:
            x = self._stages[k].array(rec)
            if x is None:
                return None
            out.append((k, x))
        return out

    def tied_copy_name(self, module: str, slot: str) -> str:
        """The name of the last stage's copy of tied weight ``module.slot`` (''  where it has none)."""
        return str(self.param_split(module, slot).get("tied_copy", ""))

    def param_split(self, module: str, slot: str) -> dict[str, Any]:
        """How megatron split a parameter, in global layer names (``tied_copy``: the name of a tied weight's copy)."""
        return dict(self._param_splits.get(f"{module}.{slot}" if module else slot, {}))

    def stage_of(self, record: Record) -> int | None:
        """The pipeline stage whose file holds ``record`` (merged), or None."""
        found = self._local(record)
        return None if found is None else found[0]

    # ------------------------------------------------------------------ joining the stages
    def _tied_copies(self) -> list[tuple[str, str]]:
        """(the first stage's parameter, the last stage's copy of it) for the tied word embeddings: the parameters
        each marks ``tied`` in its ``param_splits`` (megatron's ``shared_embedding``), paired in order; [] when the
        two stages do not mark as many (a run without tied embeddings, a capture before the mark)."""
        if self.pp < 2:
            return []

        def tied(stage: MergedCapture) -> list[str]:
            return [name for name, split in stage._param_splits.items() if isinstance(split, dict) and split.get("tied")]

        first, last = tied(self._stages[0]), tied(self._stages[-1])
        return list(zip(first, last)) if len(first) == len(last) else []

    def _summed(self, record: Record) -> list[tuple[int, Record]] | None:
        if record.step not in self.steps or record.kind != "grad_local":
            return None
        return self._step(record.step).summed.get(record.seq)

    def _first_rank(self, stage: int) -> int:
        return self._stages[stage]._rank_of(0)

    def _local(self, record: Record) -> tuple[int, Record] | None:
        if record.step not in self.steps:
            return None
        return self._step(record.step).local.get(record.seq)

    def _step(self, step: int) -> _Step:
        if step not in self._merged:
            self._merged[step] = self._join(step)
        return self._merged[step]

    def _join(self, step: int) -> _Step:
        if self.dp > 1:  # each stage cuts its data-parallel shards by the local batch of the model's first input
            batches = [_local_batch(s._grid[0][0].records(step)) for s in self._stages]
            bad = next((k for k, b in enumerate(batches) if b != batches[0]), None)
            if bad is not None:
                raise CaptureFileError(
                    f"{self.path}: pipeline stage {bad} records no model input of stage 0's local batch "
                    f"({batches[bad]} vs {batches[0]}): its data-parallel shards cannot be told from replicated "
                    "tensors; pass the token ids (or the labels) to the model on every stage")
        per_stage = [s.records(step) for s in self._stages]
        last = len(per_stage) - 1
        renamed = [[replace(r, module=global_layer_name(r.module, self.offsets[k]),
                            parent=global_layer_name(r.parent, self.offsets[k])) for r in recs]
                   for k, recs in enumerate(per_stage)]
        tied = {}  # the last stage's copy of a tied weight (module, slot) -> the first stage's original
        for original, copy in self._tied:
            tied[tuple(copy.rpartition(".")[::2])] = original.rpartition(".")[::2]
        tied_seqs = {r.seq for r in renamed[last] if r.phase in ("weights", "param_grad") and (r.module, r.slot) in tied}
        if tied_seqs:  # the copy's weights and gradients are the original's records, held by another stage
            renamed[last] = [replace(r, module=tied[(r.module, r.slot)][0], slot=tied[(r.module, r.slot)][1])
                             if r.seq in tied_seqs else r for r in renamed[last]]
        handed = [_handed_over(recs) if k < last else set() for k, recs in enumerate(per_stage)]
        holders: dict[tuple, list[int]] = {}
        for k, recs in enumerate(renamed):
            for r in recs:
                if r.seq in handed[k]:
                    continue  # the hidden state this stage sends on: the next stage's input, not this key's owner
                stages = holders.setdefault(r.key, [])
                if not stages or stages[-1] != k:
                    stages.append(k)
        owner: dict[tuple, int] = {}
        for key, stages in holders.items():
            phase, module, *_ = key
            if len(stages) > 1 and _layer_of(module) is not None:
                raise CaptureFileError(
                    f"{self.path}: pipeline stages {stages[0]} and {stages[1]} both hold {module} (step {step}) once "
                    f"their layers are numbered globally (layer offsets {self.offsets}): the offsets do not match the "
                    "layers the stages hold")
            owner[key] = stages[-1] if phase == "loss" else stages[0]  # the loss is the last stage's
        # phases in the order the last stage recorded them (the loss where its script ended the step)
        first_seen: dict[str, int] = {}
        for r in per_stage[last]:
            first_seen.setdefault(r.phase, r.seq)
        phase_rank = {p: i for i, p in enumerate(sorted(first_seen, key=first_seen.__getitem__))}
        micro = [_micro_batches(recs) for recs in per_stage]
        kept = [(k, i) for k, recs in enumerate(renamed) for i, r in enumerate(recs)
                if r.seq not in handed[k] and owner[r.key] == k]

        def order(item: tuple[int, int]) -> tuple:
            k, i = item
            r = renamed[k][i]
            stage_order = last - k if r.phase == "backward" else k
            return (phase_rank.get(r.phase, len(phase_rank) + PHASE_RANK.get(r.phase, 9)), micro[k].get(r.seq, 0),
                    stage_order, r.seq)

        kept.sort(key=order)
        new_seq = {(k, renamed[k][i].seq): n for n, (k, i) in enumerate(kept)}
        by_key = {renamed[k][i].key: n for n, (k, i) in enumerate(kept)}
        local_by_seq = [{r.seq: r for r in recs} for recs in renamed]
        sorted_seqs = [sorted(d) for d in local_by_seq]

        def resolve(k: int, seq: int) -> int:
            """The merged seq of stage k's record ``seq``: itself if kept, else its link's source, else the kept record
            of its key; -1 if none."""
            while seq >= 0:
                if (k, seq) in new_seq:
                    return new_seq[(k, seq)]
                r = local_by_seq[k].get(seq)
                if r is None:
                    return -1
                if r.same_as >= 0:
                    seq = r.same_as
                    continue
                return by_key.get(r.key, -1)
            return -1

        def position(k: int, seq: int) -> int:
            """An ``enter`` (the seq of the next record when a module was entered) in merged numbering."""
            if seq < 0:
                return -1
            at = bisect_left(sorted_seqs[k], seq)
            return resolve(k, sorted_seqs[k][at]) if at < len(sorted_seqs[k]) else len(kept)

        first_enter: dict[tuple[str, int], int] = {}  # a module call spanning stages enters on its first stage
        for k, recs in enumerate(renamed):
            for r in recs:
                if r.phase == "forward" and r.enter >= 0 and (r.module, r.call) not in first_enter:
                    first_enter[(r.module, r.call)] = position(k, r.enter)
        records: list[Record] = []
        local: dict[int, tuple[int, Record]] = {}
        merged: dict[tuple[int, int], Record] = {}
        for n, (k, i) in enumerate(kept):
            r = renamed[k][i]
            enter = position(k, r.enter)
            if r.phase in ("forward", "backward") and (r.module, r.call) in first_enter:
                enter = first_enter[(r.module, r.call)]
            rec = replace(r, seq=n, same_as=resolve(k, r.same_as) if r.same_as >= 0 else -1,
                          grad_of=resolve(k, r.grad_of) if r.grad_of >= 0 else -1, enter=enter)
            records.append(rec)
            local[n] = (k, per_stage[k][i])
            merged[(k, r.seq)] = rec
        copies: list[tuple[Record, int, Record]] = []
        summed: dict[int, list[tuple[int, Record]]] = {}
        tied_copies: dict[int, list[tuple[int, Record]]] = {}
        for k, recs in enumerate(renamed):
            for i, r in enumerate(recs):
                if (k, r.seq) in merged:
                    continue
                target = resolve(k, r.seq)
                if target >= 0:
                    merged[(k, r.seq)] = records[target]
                if target >= 0 and r.kind == "grad_local" and k == last and r.seq in tied_seqs:
                    # a tied copy's gradient before any reduction: its stage's share of the original's
                    summed.setdefault(target, [local[target]]).append((k, per_stage[k][i]))
                    continue
                kind_ok = r.same_as < 0 and r.kind not in ("output", "grad_output") and r.phase != "loss"
                if kind_ok and target >= 0:
                    copies.append((records[target], k, per_stage[k][i]))
                    if k == last and r.seq in tied_seqs:
                        tied_copies.setdefault(target, []).append((k, per_stage[k][i]))
        for target, parts in summed.items():
            records[target] = _summed_record(records[target], [self._stages[k].array(rec) for k, rec in parts])
            for key, rec in merged.items():
                if rec.seq == target:
                    merged[key] = records[target]
        received = {}
        for k in range(1, len(per_stage)):
            got = _received_input(per_stage[k])
            sent = _sent_output(per_stage[k - 1], got.call if got is not None else 0) if got is not None else None
            if got is not None and sent is not None and (k, got.seq) in merged and (k - 1, sent.seq) in merged:
                received[merged[(k, got.seq)].seq] = merged[(k - 1, sent.seq)]
        return _Step(records, local, merged, copies, received, summed, tied_copies)


def _sum(parts: list[np.ndarray | None]) -> np.ndarray | None:
    """The sum of the stages' shares of one tensor, in float64, in the first share's dtype (None where one is not
    stored)."""
    if not parts or any(p is None for p in parts):
        return None
    arrays = [p for p in parts if p is not None]
    return np.sum(np.stack([p.astype(np.float64) for p in arrays]), axis=0).astype(arrays[0].dtype)


def _summed_record(rec: Record, parts: list[np.ndarray | None]) -> Record:
    """``rec`` (a tied weight's local gradient) with the statistics of the sum of the stages' shares; NaN where a
    share is not stored (its pair is then skipped, never passed: ``Record.stats_known``)."""
    total = _sum(parts)
    if total is None:
        nan = float("nan")
        return replace(rec, min=nan, max=nan, mean=nan, l2=nan, nan=0, inf=0, has_data=False)
    mn, mx, s, l2, nan_count, inf_count = host_stats(total)
    return replace(rec, min=mn, max=mx, mean=s / total.size if total.size else 0.0, l2=l2, nan=int(nan_count),
                   inf=int(inf_count), has_data=True)


def _micro_batches(records: list[Record]) -> dict[int, int]:
    """seq -> micro-batch (the model's call index) for a stage's forward and backward records."""
    roots = sorted((r.enter, r.call) for r in records if r.module == "" and r.phase == "forward" and r.enter >= 0)
    starts = sorted(set(roots))
    out: dict[int, int] = {}
    if not starts:
        return out
    keys = [s for s, _ in starts]
    for r in records:
        if r.phase == "forward":
            at = bisect_left(keys, r.seq + 1) - 1
            out[r.seq] = starts[at][1] if at >= 0 else 0
    for r in records:
        if r.phase == "backward" and r.grad_of in out:
            out[r.seq] = out[r.grad_of]
    return out


def _handed_over(records: list[Record]) -> set[int]:
    """seqs of a stage's records that are links to the tensor it sends on (its model output, its decoder block's
    output, and their gradients): in the single-device run those keys belong to the last stage."""
    by_seq = {r.seq: r for r in records}
    sent = {s.seq for s in (_sent_output(records, r.call) for r in records
                            if r.phase == "forward" and r.module == "" and r.kind == "output") if s is not None}
    out = {r.seq for r in records if r.phase == "forward" and r.kind == "output" and r.seq not in sent
           and _canonical(r, by_seq) in sent}
    out |= {r.seq for r in records if r.phase == "backward" and r.grad_of in out}
    return out


def _canonical(rec: Record, by_seq: dict[int, Record]) -> int:
    while rec.same_as >= 0 and rec.same_as in by_seq:
        rec = by_seq[rec.same_as]
    return rec.seq


def _received_input(records: list[Record]) -> Record | None:
    """A later stage's received tensor: its first floating-point forward input that is no link to a tensor the stage
    computed and not one of the model's own inputs (the batch)."""
    for r in records:
        if (r.phase == "forward" and r.kind == "input" and r.module != "" and r.same_as < 0
                and r.dtype.startswith(("float", "bfloat"))):
            return r
    return None


def _sent_output(records: list[Record], call: int) -> Record | None:
    """What a stage sends on: its model output (the root module's), resolved to the record that first held it."""
    by_seq = {r.seq: r for r in records}
    for r in records:
        if r.phase == "forward" and r.module == "" and r.kind == "output" and r.call == call:
            while r.same_as >= 0 and r.same_as in by_seq:
                r = by_seq[r.same_as]
            return r
    return None

