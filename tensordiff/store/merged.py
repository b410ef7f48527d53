"""Rank files of one distributed run read as one capture, in the logical single-device space (merge on read).

``open_capture(path)`` (``opener.py``) is what every reader calls: a plain capture file, or a glob
(``'run.rank*.h5'``) of the rank files of one run, which ``MergedCapture`` presents as any reader
(``CaptureReader``, ``base.py``: ``attrs``, ``steps``, ``records(step)``, ``array(record)``), so alignment,
comparison, divergence and hints run unchanged.

How each record merges comes from the files themselves and a rule table shipped as data
(``tensordiff/store/splits/megatron-core.yaml``), never from importing megatron:

* **tensor parallel**: a parameter (and its gradient) marked ``tensor_model_parallel`` in the file's
  ``param_splits`` is concatenated along its ``partition_dim``, with its ``partition_stride`` (a gated fc1 holds
  ``[gate_r; up_r]`` on rank r); an activation by its module class's rule (a column-parallel output along its last
  dim, attention heads along dim 2, ...); the rest is replicated (rank 0's copy is read);
* **data parallel**: forward activations and their gradients are concatenated along the batch dim (dim 1 of
  Megatron's ``[S, B, ...]``, dim 0 where the table says the batch comes first; a tensor whose batch dim is not
  the local batch, a mask ``[1, 1, S, S]``, is replicated); activation gradients are scaled by 1/DP (each rank's
  loss is its local mean); the loss is the mean over DP; parameters and their reduced gradients are replicated.

Statistics merge exactly from each shard's (numel, min, max, mean, L2). A missing rank file, or rank files of two
runs, is a ``CaptureFileError`` naming what is missing. Pipeline-parallel runs: each stage's TP x DP rank files are
merged here (``stage=k``) and ``PipelineCapture`` (``pipeline.py``) joins the stages.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .. import _progress as progress
from .._yaml import load_yaml
from ..errors import CaptureFileError, MappingError
from ..mapping.names import unwrap
from ..record import ROW_FIELDS, Record
from ..stats import host_stats
from .base import CaptureReader, ReaderBase
from .format import shape_text
from .plan import MergePlan, MergeSpec, dp_row, join_tp, read_grid, read_plan, sum_parts
from .reader import CaptureFile
from .writer import CaptureWriter


@dataclass(frozen=True)
class _Rule:
    module: re.Pattern | None
    classes: frozenset[str] | None
    kinds: frozenset[str] | None
    slots: frozenset[str] | None
    tp_dim: int | None
    tp_stride: str  # "" or "weight": the stride of the module's weight
    batch_first: bool
    swap01: bool = False  # sequence parallel: the single-device run holds the merged tensor with dims 0, 1 swapped

    def hits(self, rec: Record) -> bool:
        return ((self.module is None or self.module.fullmatch(unwrap(rec.module)) is not None)
                and (self.classes is None or rec.module_class in self.classes)
                and (self.kinds is None or rec.kind in self.kinds)
                and (self.slots is None or rec.slot in self.slots))


def _load_rules(name: str = "megatron-core", path: str | None = None) -> tuple[list[_Rule], list[_Rule]]:
    """The table's tensor-parallel rules and its sequence-parallel rules (``path``: another table file)."""
    path = path or os.path.join(os.path.dirname(os.path.abspath(__file__)), "splits", name + ".yaml")
    with open(path, encoding="utf-8") as fh:
        doc = load_yaml(fh.read(), path, "split table")
    if not isinstance(doc, dict):
        raise MappingError(f"{path}: a split table is a YAML mapping with 'rules:' (see the file's header)")
    version = doc.get("tensordiff_splits")
    if version is not None and (isinstance(version, bool) or version != 1):
        raise MappingError(f"{path}: tensordiff_splits: {version!r}: this tensordiff reads version 1")

    def texts(raw: dict[str, Any], key: str, where: str) -> frozenset[str] | None:
        value = raw.get(key)
        if value is None or value == []:
            return None
        value = [value] if isinstance(value, str) and key == "class" else value
        if not isinstance(value, list) or not all(isinstance(x, (str, int)) for x in value):
            raise MappingError(f"{path}: {where}: '{key}:' is a list of names, got {value!r}")
        return frozenset(str(x) for x in value)

    def rule(raw: Any, key: str, where: str) -> _Rule:
        if not isinstance(raw, dict):
            raise MappingError(f"{path}: {where}: a rule is a mapping (class:, kinds:, slots:, {key}:), got {raw!r}")
        split = raw.get(key) or {}
        if not isinstance(split, dict) or ("dim" in split and (isinstance(split["dim"], bool)
                                                              or not isinstance(split["dim"], int))):
            raise MappingError(f"{path}: {where}: '{key}:' is {{dim: D}} with an integer D, got {split!r}")
        if "stride" in split and split["stride"] != "weight":
            raise MappingError(f"{path}: {where}: '{key}: stride:' is 'weight' (the stride of the module's weight), "
                               f"got {split['stride']!r}")
        module = raw.get("module")
        if module is not None and not isinstance(module, str):
            raise MappingError(f"{path}: {where}: 'module:' is a regex as text, got {module!r}")
        try:
            compiled = re.compile(module) if module is not None else None
        except re.error as err:
            raise MappingError(f"{path}: {where}: bad regular expression {module!r} ({err})") from None
        return _Rule(module=compiled, classes=texts(raw, "class", where), kinds=texts(raw, "kinds", where),
                     slots=texts(raw, "slots", where), tp_dim=split.get("dim"), tp_stride=str(split.get("stride", "")),
                     batch_first=raw.get("batch_first", False) is True, swap01=split.get("swap01", False) is True)

    out = []
    for section, key in (("rules", "tp"), ("sequence_parallel", "sp")):
        items = doc.get(section) or []
        if not isinstance(items, list):
            raise MappingError(f"{path}: '{section}:' is a list of rules, got {items!r}")
        out.append([rule(raw, key, f"{section} {i + 1}") for i, raw in enumerate(items)])
    return out[0], out[1]


class MergedCapture(ReaderBase):
    """The rank files of one run as one capture (no one HDF5 file behind it): the reader contract, with the
    capabilities of merged rank files (``tp``, ``dp``, ``sp``, ``tp_copies``, ``dp_copies``, the cross-rank check)."""

    merged = True

    def __init__(self, paths: list[str], pattern: str = "", stage: int | None = None,
                 opened: dict[str, CaptureFile] | None = None):
        """``opened``: the rank files already open (``open_capture``), taken over: this capture closes them."""
        super().__init__(pattern or paths[0])
        self._paths = list(paths)
        self._stage = stage  # a pipeline stage's rank files (PipelineCapture joins the stages), or the whole run
        self._files = []
        for p in paths:
            self._files.append(opened.pop(p) if opened and p in opened else CaptureFile(p))
        self._by_path = {cap.path: cap for cap in self._files}
        try:
            self._setup(paths)
        except Exception:
            self.close()
            raise

    def _setup(self, paths: list[str]) -> None:
        coords = []
        for cap in self._files:
            raw = cap.attrs.get("parallel")
            if not raw:
                raise CaptureFileError(f"{cap.path}: holds no rank coordinates ('parallel' attribute); captures of "
                                       "distributed runs written by this tensordiff have them: re-run the capture")
            coords.append(json.loads(str(raw)))
        world = {c.get("world_size") for c in coords}
        if len(world) != 1:
            raise CaptureFileError(f"{self.path}: the files come from runs of different sizes ({sorted(world)} ranks); "
                                   "pass the rank files of one run")
        size = int(next(iter(world)))
        ranks = [int(c.get("rank", -1)) for c in coords]
        missing = sorted(set(range(size)) - set(ranks))
        if self._stage is not None:
            size = len(paths)  # the stage's ranks; PipelineCapture checked the whole run's
        elif missing or len(set(ranks)) != len(ranks):
            raise CaptureFileError(f"{self.path}: a run of {size} ranks needs one file per rank; missing rank(s) "
                                   f"{missing or 'none, but some appear twice'} ({len(paths)} file(s) given)")
        elif any(int(c.get("pp", 1)) > 1 for c in coords):
            raise CaptureFileError(f"{self.path}: pipeline-parallel stage files: read them with open_capture() or "
                                   "PipelineCapture, which join the stages")
        self.tp = int(coords[0].get("tp", 1))
        self.dp = int(coords[0].get("dp", size // self.tp if self.tp else size))
        if self.tp * self.dp != size:
            raise CaptureFileError(f"{self.path}: TP {self.tp} x DP {self.dp} is not the {size} ranks (context or "
                                   "expert parallelism is not merged yet)")
        # grid[dp_rank][tp_rank] -> file
        self._grid: list[list[CaptureFile]] = [[None] * self.tp for _ in range(self.dp)]  # type: ignore[list-item]
        for cap, c in zip(self._files, coords):  # without megatron's coordinates: every rank is a DP rank
            rank = int(c.get("rank", 0))
            self._grid[int(c.get("dp_rank", rank // self.tp))][int(c.get("tp_rank", rank % self.tp))] = cap
        first = self._grid[0][0]
        self.attrs = dict(first.attrs)
        self.attrs["merged_from"] = json.dumps({"files": len(self._files), "tp": self.tp, "dp": self.dp})
        self.attrs["world_size"], self.attrs["rank"] = 1, 0
        common = set(first.steps)
        for cap in self._files:
            common &= set(cap.steps)
        self.steps = sorted(common)
        self.incomplete_steps = sorted(set(first.steps) - common)
        splits = json.loads(str(first.attrs.get("param_splits", "") or "{}"))
        self._param_splits: dict[str, dict[str, Any]] = splits if isinstance(splits, dict) else {}
        # megatron-core's activations are [S, B, ...]; a run without its parallel_state (plain torch DDP) is taken
        # as batch first, and the megatron-core class rules do not apply to it
        self._megatron = coords[0].get("source") == "megatron.core.parallel_state"
        self._rules, self._sp_rules = _load_rules() if self._megatron else ([], [])
        self.sp = bool(coords[0].get("sequence_parallel", False)) and self.tp > 1
        self._records: dict[int, list[Record]] = {}
        self._specs: dict[tuple[int, int], MergeSpec] = {}  # (step, seq) -> spec
        self._shards: dict[int, list[dict[tuple, Record]]] = {}  # step -> per file (grid order) key -> record

    # ------------------------------------------------------------------ the reader contract
    @property
    def paths(self) -> list[str]:
        return list(self._paths)

    def close(self) -> None:
        for cap in self._files:
            cap.close()

    def step_attrs(self, step: int) -> dict[str, Any]:
        out = dict(self._grid[0][0].step_attrs(step))
        losses = [self._grid[d][0].step_attrs(step).get("loss") for d in range(self.dp)]
        values = [float(x) for x in losses if isinstance(x, (int, float, np.floating))]
        if len(values) == len(losses):
            out["loss"] = float(np.mean(values))  # the global loss: the mean of the DP ranks' local means
        return out

    def scalars(self) -> dict[str, dict[int, float]]:
        return self._grid[0][0].scalars()

    def nbytes(self) -> int:
        return sum(cap.nbytes() for cap in self._files)

    def records(self, step: int) -> list[Record]:
        if step not in self._records:
            self._records[step] = self._merge_step(step)
        return self._records[step]

    def array(self, record: Record) -> np.ndarray | None:
        return read_plan(self.plan(record), self._read)

    def plan(self, record: Record) -> MergePlan | None:
        """How ``record``'s merged tensor is read, as plain data (``read_plan`` follows it here or in a worker
        process): the rank files' records to read and how to join them; None where the merge knows no such record."""
        if record.step not in self._records and record.step in self.steps:
            self.records(record.step)  # a record read by another reader of the same files: merge its step first
        spec = self._specs.get((record.step, record.seq))
        shards = self._shards.get(record.step)
        if spec is None or shards is None:
            return None
        key = record.key
        if spec.dp_shards is not None:  # rows: TP ranks; in a row the DP ranks' parts in their order
            order = sorted(range(self.dp), key=lambda d: spec.dp_shards[d])  # type: ignore[index]
            cells = [[(d, t) for d in order] for t in range(self.tp if spec.tp_dim is not None else 1)]
        else:  # rows: DP ranks; in a row the TP ranks joined or summed (or rank 0's copy)
            cells = [[(d, t) for t in range(self.tp if spec.tp_dim is not None or spec.tp_sum else 1)]
                     for d in range(self.dp if spec.dp_dim is not None or spec.dp_mean else 1)]
        grid = []
        for row in cells:
            leaves = []
            for d, t in row:
                rec = shards[d * self.tp + t].get(key)
                if rec is None:
                    return None
                leaves.append((self._grid[d][t].path, rec))
            grid.append(tuple(leaves))
        return MergePlan(spec, tuple(grid))

    def _read(self, path: str, record: Record) -> np.ndarray | None:
        return self._by_path[path].array(record)

    def tp_copies(self, record: Record) -> list[np.ndarray] | None:
        """The copies each tensor-parallel rank (of the first data-parallel rank) holds of a record the merge reads
        as replicated, or None (a split record, a single TP rank, tensors not stored)."""
        if self.tp < 2:
            return None
        if record.step not in self._records and record.step in self.steps:
            self.records(record.step)
        spec = self._specs.get((record.step, record.seq))
        shards = self._shards.get(record.step)
        if spec is None or shards is None or spec.tp_dim is not None:
            return None
        out = []
        for t in range(self.tp):
            rec = shards[t].get(record.key)
            x = self._grid[0][t].array(rec) if rec is not None else None
            if x is None:
                return None
            out.append(x)
        return out

    def dp_copies(self, record: Record) -> list[np.ndarray] | None:
        """Each data-parallel rank's own tensor of a record the merge averages over DP (a local gradient, kind
        ``grad_local``), TP-joined as the merge joins it, or None (another record, tensors not stored)."""
        plan = self.plan(record) if record.kind == "grad_local" else None
        if plan is None or not plan.spec.dp_mean:
            return None
        rows = read_grid(plan.grid, self._read)
        return None if rows is None else [dp_row(plan.spec, row) for row in rows]

    def inconsistent_records(self, step: int) -> list[tuple[Record, str, list[int]]]:
        """Records that must be identical on the ranks that hold them (replicated across TP, parameters and reduced
        parameter gradients across DP) but differ, judged from their statistics, as (record, "TP" or "DP", [the
        group's first rank, the ranks that differ from it]); ``inconsistencies`` says them in words. An unreduced
        gradient or a missing all-reduce shows here with no reference run at all."""
        self.records(step)
        shards = self._shards[step]
        out = []
        for rec in self._grid[0][0].records(step):
            spec = self._specs.get((step, rec.seq))
            if spec is None or rec.same_as >= 0:
                continue
            key = rec.key
            groups: list[tuple[str, list[int]]] = []
            if spec.tp_dim is None and not spec.tp_sum and self.tp > 1:
                groups += [("TP", [d * self.tp + t for t in range(self.tp)]) for d in range(self.dp)]
            if spec.dp_dim is None and not spec.dp_mean and spec.dp_shards is None and self.dp > 1:
                groups += [("DP", [d * self.tp + t for d in range(self.dp)]) for t in range(self.tp)]
            for name, members in groups:
                stats = [shards[i][key] for i in members]
                first = stats[0]
                bad = [i for i, r in zip(members, stats) if not _same_stats(first, r)]
                if bad:
                    out.append((rec, name, [self._rank_of(i) for i in [members[0], *bad]]))
                    break
        return out

    def param_split(self, module: str, slot: str) -> dict[str, Any]:
        """How megatron split a parameter (``tp``, ``dim``, ``stride``, ``sp``), from the rank files; {} if unmarked."""
        return dict(self._param_splits.get(f"{module}.{slot}" if module else slot, {}))

    def _rank_of(self, index: int) -> int:
        cap = self._grid[index // self.tp][index % self.tp]
        try:
            return int(json.loads(str(cap.attrs.get("parallel", "{}"))).get("rank", index))
        except ValueError:
            return index

    # ------------------------------------------------------------------ merging
    def _merge_step(self, step: int) -> list[Record]:
        per_file = [[self._grid[d][t].records(step) for t in range(self.tp)] for d in range(self.dp)]
        flat = [recs for row in per_file for recs in row]
        base = flat[0]
        keys = [r.key for r in base]
        shards = [{r.key: r for r in recs} for recs in flat]
        for i, recs in enumerate(flat[1:], 1):
            if len(recs) != len(base) or any(k not in shards[i] for k in keys):
                cap = self._grid[i // self.tp][i % self.tp]
                raise CaptureFileError(f"{cap.path}: step {step} holds other records than {self._grid[0][0].path} "
                                       f"({len(recs)} vs {len(base)}): the rank files are not of one run")
        self._shards[step] = shards
        local_batch = _local_batch(base)
        local_tokens = _local_tokens(base)
        held = _parameters_held(base)
        tokens = _tokens_shape(base)
        sharded = self._grad_shards(step)
        out = []
        for rec in base:
            spec = self._spec(held.get(rec.seq, rec), local_batch, local_tokens, tokens)
            if sharded and rec.kind == "grad" and rec.phase == "param_grad":
                spec = self._shard_spec(rec, spec, sharded)
            self._specs[(step, rec.seq)] = spec
            parts = [s[rec.key] for s in shards]
            out.append(self._local_grad(rec, parts, spec) if rec.kind == "grad_local" else
                       _merged_record(rec, parts, spec, self.tp, self.dp))
        return out

    def _grad_shards(self, step: int) -> list[dict[str, Any]]:
        """Per file (grid order) its step's ``grad_shards`` (megatron's distributed optimizer; capturing/torch/adapter.py):
        parameter -> [start, end, shape]; [] where the run has none."""
        out = []
        for d in range(self.dp):
            for t in range(self.tp):
                cap = self._grid[d][t]
                raw = cap.step_attrs(step).get("grad_shards")
                try:
                    table = json.loads(str(raw)) if raw else {}
                except ValueError:
                    table = None
                if not isinstance(table, dict):
                    raise CaptureFileError(f"{cap.path}: step {step}'s grad_shards attribute is not a JSON table of "
                                           "parameter -> [start, end, shape]; re-run the capture")
                out.append(table)
        return out if any(out) else []

    def _shard_spec(self, rec: Record, spec: MergeSpec, sharded: list[dict[str, Any]]) -> MergeSpec:
        """The spec of a reduced gradient the DP ranks hold in parts: the parts must tile the parameter exactly."""
        name = f"{rec.module}.{rec.slot}" if rec.module else rec.slot
        entries: list[Any] = [table.get(name) for table in sharded]
        if all(e is None for e in entries):
            return spec
        where = self._grid[0][0].path
        try:
            ranges = [[(int(e[0]), int(e[1])) for e in entries[d * self.tp:(d + 1) * self.tp]] for d in range(self.dp)]
            shape = tuple(int(n) for n in entries[0][2])
        except (TypeError, ValueError, IndexError):
            raise CaptureFileError(f"{where}: step {rec.step}: the gradient shards of {name} are missing on some rank "
                                   "files or malformed; pass the rank files of one run") from None
        numel = math.prod(shape)
        for t in range(self.tp):  # each TP rank's DP parts: contiguous, no gap, no overlap, the whole parameter
            parts = sorted((ranges[d][t] for d in range(self.dp)), key=lambda r: r)
            edge = 0
            for lo, hi in parts:
                if lo == hi:
                    continue
                if lo != edge:
                    raise CaptureFileError(f"{where}: step {rec.step}: the DP ranks' parts of {name}'s gradient do not "
                                           f"tile it (elements {edge}..{lo} held by none, or held twice); pass the "
                                           "rank files of one run")
                edge = hi
            if edge != numel:
                raise CaptureFileError(f"{where}: step {rec.step}: the DP ranks' parts of {name}'s gradient cover "
                                       f"{edge} of its {numel} elements; pass every rank file of the run")
        owned = tuple(r if r[0] < r[1] else (numel, numel) for r in (ranges[d][0] for d in range(self.dp)))
        return MergeSpec(tp_dim=spec.tp_dim, tp_stride=spec.tp_stride, dp_shards=owned, shard_shape=shape)

    def _local_grad(self, rec: Record, parts: list[Record], spec: MergeSpec) -> Record:
        """A parameter's gradient before the data-parallel reduction (kind ``grad_local``) of the merged run: the mean
        over the DP ranks of their local gradients (each rank's loss is its local mean), TP-concatenated as ``grad``
        is, summed over TP for a sequence-parallel parameter (a partial sum on each TP rank). The statistics of a mean
        do not follow from each rank's statistics: they are computed from the tensors, and where a rank stored
        statistics only they are NaN (``Record.stats_known`` is False) and the pair is not compared, never passed."""
        shape = list(rec.shape)
        if spec.tp_dim is not None and shape:
            shape[spec.tp_dim % len(shape)] *= self.tp
        if not all(p.has_data for p in parts):
            nan = math.nan
            return replace(rec, shape=tuple(shape), numel=int(np.prod(shape, dtype=np.int64)), min=nan, max=nan,
                           mean=nan, l2=nan, nan=0, inf=0, has_data=False)
        pieces = []
        for d in range(self.dp):
            xs = []
            for t in range(self.tp):
                x = self._grid[d][t].array(parts[d * self.tp + t])
                if x is None:
                    raise CaptureFileError(f"{self._grid[d][t].path}: {rec.label} of step {rec.step} is marked stored "
                                           "but holds no tensor; re-run the capture")
                xs.append(x)
            pieces.append(join_tp(xs, spec.tp_dim, spec.tp_stride) if spec.tp_dim is not None else
                          sum_parts(xs) if spec.tp_sum else xs[0])
        mean = np.mean(np.stack([p.astype(np.float64) for p in pieces]), axis=0)
        mn, mx, total, l2, nan, inf = host_stats(mean)  # the one rule of tensordiff/stats.py
        return replace(rec, shape=tuple(shape), numel=int(mean.size), mean=total / mean.size if mean.size else 0.0,
                       min=mn, max=mx, l2=l2, nan=int(nan), inf=int(inf), has_data=True)

    def _spec(self, rec: Record, local_batch: int | None, local_tokens: frozenset[int] = frozenset(),
              tokens: tuple[int, int] | None = None) -> MergeSpec:
        """How ``rec`` is laid out across the ranks; ``tokens``: the model's token ids' shape [B, S] on one rank."""
        tp_dim: int | None = None
        stride = 1
        batch_first = False
        if rec.kind in ("param", "grad", "grad_local"):
            split = self._param_splits.get(f"{rec.module}.{rec.slot}" if rec.module else rec.slot)
            if split and split.get("tp") and self.tp > 1:
                tp_dim, stride = int(split.get("dim", 0)), int(split.get("stride", 1))
            if rec.kind == "grad_local":  # before the DP reduction: the mean over DP (a TP partial sum under SP)
                return MergeSpec(tp_dim=tp_dim, tp_stride=stride, dp_mean=self.dp > 1,
                             tp_sum=bool(split and split.get("sp") and tp_dim is None and self.tp > 1))
            return MergeSpec(tp_dim=tp_dim, tp_stride=stride)
        if rec.phase == "loss":
            return MergeSpec(dp_mean=self.dp > 1)
        rule = next((r for r in self._rules if r.hits(rec)), None)
        if rule is not None:
            batch_first = rule.batch_first
            if rule.tp_dim is not None and self.tp > 1:
                tp_dim = rule.tp_dim
                if rule.tp_stride == "weight":
                    split = self._param_splits.get(f"{rec.module}.weight", {})
                    stride = int(split.get("stride", 1))
        swap01 = False
        # a record shaped like the model's token ids [B, S, ...] is batch first, whatever its class: megatron's own
        # activations are [S, B, ...] (a torch Embedding looking up positions is not)
        whole = tokens is not None and tokens[0] != tokens[1] and tuple(rec.shape[:2]) == tokens
        if whole:
            batch_first = True
        if tp_dim is None and self.sp:
            sp_rule = next((r for r in self._sp_rules if r.hits(rec)), None)
            if sp_rule is not None and sp_rule.swap01 and whole:
                sp_rule = None  # still [B, S, H] on every rank: not scattered here (the embedding adds positions first)
            if sp_rule is not None and sp_rule.tp_dim is not None:
                tp_dim, swap01, batch_first = sp_rule.tp_dim, sp_rule.swap01, False  # [S/T, B, ...]
        dp_dim: int | None = None
        if self.dp > 1 and rec.shape and local_batch is not None:
            if self._megatron:  # megatron-core: [S, B, ...] unless the table says batch first
                bdim = 0 if batch_first or len(rec.shape) < 2 else 1
                dp_dim = bdim if rec.shape[bdim] == local_batch else None
            else:  # no rule table: the batch is dim 0 ([B, S, ...]) or dim 1 (Megatron-style [S, B, ...]), or
                # dim 0 holds the tokens flattened batch first ([B*S, V] logits of a loss)
                fits = [d for d in (0, 1) if d < len(rec.shape) and rec.shape[d] == local_batch]
                if not fits and rec.shape[0] in local_tokens:
                    fits = [0]
                dp_dim = fits[0] if fits else None
        if (dp_dim is None and self.dp > 1 and rec.numel == 1 and rec.phase in ("forward", "backward")
                and rec.dtype.startswith(("float", "bfloat"))):
            return MergeSpec(tp_dim=tp_dim, tp_stride=stride, dp_mean=True)  # a scalar per rank (a local mean loss)
        scale = 1.0 / self.dp if self.dp > 1 and rec.phase == "backward" and dp_dim is not None else 1.0
        return MergeSpec(tp_dim=tp_dim, tp_stride=stride, dp_dim=dp_dim, scale=scale, swap01=swap01)


def _parameters_held(records: list[Record]) -> dict[int, Record]:
    """Activations that are a parameter, and their gradients: seq -> the parameter. Such a record is sharded as that
    parameter is, and checked across ranks as it (through its link): a forward argument the capture linked to the
    parameter's weights record (``same_as``: the very tensor, e.g. megatron's tied output layer called with
    ``weight=`` the word embeddings' vocabulary shard), or, by value (shape and statistics on this rank), an
    activation holding a parameter of its module (or of one inside it) as it is: the bias megatron's
    ColumnParallelLinear returns apart (``skip_bias_add``) is its bias shard on each rank, not a tensor replicated
    across TP."""
    params: dict[tuple, list[Record]] = {}
    weights: dict[int, Record] = {}
    for r in records:
        if r.phase == "weights":
            params.setdefault((r.shape, r.min, r.max, r.mean, r.l2), []).append(r)
            weights[r.seq] = r
    out: dict[int, Record] = {}
    for r in records:
        if r.phase == "forward" and r.same_as in weights:
            out[r.seq] = weights[r.same_as]
        elif r.phase == "forward" and r.kind in ("input", "output") and r.same_as < 0 and r.numel > 1:
            owner = next((p for p in params.get((r.shape, r.min, r.max, r.mean, r.l2), ())
                          if p.module == r.module or p.module.startswith(r.module + ".") or r.module == ""), None)
            if owner is not None:
                out[r.seq] = owner
        elif r.phase == "forward" and r.same_as in out:
            out[r.seq] = out[r.same_as]
        elif r.phase == "backward" and r.grad_of in out:
            out[r.seq] = replace(out[r.grad_of], kind="grad_local")  # this rank's share, before any DP mean
    return out


def _same_stats(a: Record, b: Record, rtol: float = 1e-6) -> bool:
    if a.numel != b.numel or a.nan != b.nan or a.inf != b.inf:
        return False
    if a.l2 == b.l2 and a.mean == b.mean and a.min == b.min and a.max == b.max:  # replicas are usually bit-equal
        return True
    scale = max(abs(a.l2), abs(b.l2), 1e-30)
    return all(abs(x - y) <= rtol * max(abs(x), abs(y), scale / max(a.numel, 1) ** 0.5)
               for x, y in ((a.l2, b.l2), (a.mean, b.mean), (a.min, b.min), (a.max, b.max)))


def _tokens_shape(records: list[Record]) -> tuple[int, int] | None:
    """[B, S] of the model's first 2-D argument (its token ids) on this rank, or None."""
    for r in records:
        if r.phase == "forward" and r.module == "" and r.kind == "input" and len(r.shape) == 2:
            return int(r.shape[0]), int(r.shape[1])
    return None


def _local_batch(records: list[Record]) -> int | None:
    """The local batch size: the first dim of the model's first argument (token ids [B, S])."""
    for r in records:
        if r.phase == "forward" and r.module == "" and r.kind == "input" and r.shape:
            return int(r.shape[0])
    return None


def _local_tokens(records: list[Record]) -> frozenset[int]:
    """The local numbers of tokens, B x S: from the model's first argument [B, S], and from the activations
    [B, S', ...] of its layers (a model that takes [B, S+1] ids and shifts them itself computes on S' = S)."""
    batch = _local_batch(records)
    if batch is None:
        return frozenset()
    out = set()
    for r in records:
        if r.phase == "forward" and r.module == "" and r.kind == "input" and len(r.shape) == 2:
            out.add(int(r.shape[0] * r.shape[1]))
            break
    out.update(batch * int(r.shape[1]) for r in records
               if r.phase == "forward" and len(r.shape) >= 3 and r.shape[0] == batch and r.module)
    return frozenset(out)


def _merged_record(rec: Record, parts: list[Record], spec: MergeSpec, tp: int, dp: int) -> Record:
    """``rec`` with the merged shape and statistics (exact from each shard's numel, min, max, mean and L2)."""
    if spec.dp_shards is not None:  # DP parts of one gradient (on each TP rank): every part is a piece of it
        used = [p for p in parts if p.numel > 0] if spec.tp_dim is not None else \
            [parts[d * tp] for d in range(dp) if parts[d * tp].numel > 0]
        shape = list(spec.shard_shape)
        if spec.tp_dim is not None and shape:
            shape[spec.tp_dim % len(shape)] *= tp
        numel = sum(p.numel for p in used)
        return replace(rec, shape=tuple(shape), numel=numel,
                       mean=sum(p.mean * p.numel for p in used) / numel if numel else 0.0,
                       min=min((p.min for p in used), default=0.0), max=max((p.max for p in used), default=0.0),
                       l2=math.sqrt(sum(p.l2 ** 2 for p in used)), nan=sum(p.nan for p in used),
                       inf=sum(p.inf for p in used), has_data=all(p.has_data for p in used))
    if spec.tp_dim is None and spec.dp_dim is None and not spec.dp_mean and spec.scale == 1.0 and not spec.swap01:
        return rec
    grid = [[parts[d * tp + t] for t in range(tp)] for d in range(dp)]
    used = [grid[d][t] for d in range(dp if spec.dp_dim is not None or spec.dp_mean else 1)
            for t in range(tp if spec.tp_dim is not None else 1)]
    shape = list(rec.shape)
    if spec.tp_dim is not None and shape:
        shape[spec.tp_dim % len(shape)] *= tp
    if spec.dp_dim is not None and shape:
        shape[spec.dp_dim] *= dp
    if spec.swap01 and len(shape) >= 2:
        shape[0], shape[1] = shape[1], shape[0]
    if spec.dp_mean:  # the loss: a scalar per rank
        mean = float(np.mean([p.mean for p in used]))
        return replace(rec, mean=mean, min=mean, max=mean, l2=abs(mean))
    numel = sum(p.numel for p in used)
    s = spec.scale
    mean = sum(p.mean * p.numel for p in used) / numel * s if numel else 0.0
    lo, hi = min(p.min for p in used) * s, max(p.max for p in used) * s
    return replace(rec, shape=tuple(shape), numel=numel, mean=mean, min=min(lo, hi), max=max(lo, hi),
                   l2=math.sqrt(sum(p.l2 ** 2 for p in used)) * abs(s), nan=sum(p.nan for p in used),
                   inf=sum(p.inf for p in used), has_data=all(p.has_data for p in used))



def write_capture_copy(cap: CaptureReader, out: str) -> int:
    """Write what ``cap`` reads (a merged run, say) into one capture file at ``out``; returns the records written."""
    attrs = {k: v for k, v in cap.attrs.items() if k != "tensordiff_format"}
    writer = CaptureWriter(out, attrs, background=False)
    written = 0
    try:
        with progress.task(f"writing {out}", len(cap.steps), "steps") as shown:
            for step in cap.steps:
                rows, data = [], {}
                for rec in cap.records(step):
                    row = {name: getattr(rec, name) for name in ROW_FIELDS if name != "shape"}
                    row["shape"] = shape_text(rec.shape)
                    x = cap.array(rec) if rec.has_data and rec.same_as < 0 else None
                    if x is not None:
                        data[rec.seq] = x
                    elif rec.same_as < 0:
                        row["has_data"] = 0
                    rows.append(row)
                writer.submit(step, rows, data, cap.step_attrs(step))
                written += len(rows)
                shown.advance()
        for name, values in cap.scalars().items():
            for step, value in values.items():
                writer.submit_scalars(step, {name: value})
    finally:
        writer.close()
    return written
