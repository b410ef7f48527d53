"""The diff: align two captures step by step, compare every pair, judge it, find the first divergence.

Pairs are compared in a pool of ``jobs`` threads (numpy's loops and reductions release the GIL), each thread
holding one tensor pair at a time, so memory is bounded by ``jobs`` times the largest pair, not the file. A tensor
recorded under several names (``same_as`` links) is read and compared once per pairing: the rows that pair the
same two tensors share one result. Rows, verdicts and the report do not depend on ``jobs``.
Imports neither torch nor mindspore, and does not explain: ``tensordiff.explain`` does that.
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from concurrent.futures import Executor, Future, ThreadPoolExecutor

from .. import _progress as progress
from .. import dtypes
from ..errors import AlignmentError, UsageError
from ..mapping import RenameRules
from ..record import Record
from ..store import CaptureReader, open_capture
from ..store.fanout import ENV_JOBS, executor_for
from .accounting import account, masks_by_meaning, rope_by_meaning
from .align import Pair, align_step
from .autoselect import CANNOT_EXPRESS, orient
from .coverage import coverage, judge_outcome, mark_uncertain, mark_unmatched, not_recorded, not_recorded_phases
from .divergence import find_first_divergence
from .exactness import apply_exactness, parallel_of, reproducible, same_stack
from .judge import Measured, compare_pair, compute_dtype, measure_pair, tensor_key
from .nonfinite import describe, first_nonfinite
from .reference import judge_against_reference
from .result import DiffOptions, DiffResult, Row
from .routing import account_routing
from .tolerance import LOADED_ROUNDINGS, judged_dtype
from .workers import BATCH_BYTES, BATCH_PAIRS, measure_batch, records_of


def diff(path_a: str, path_b: str, options: DiffOptions | None = None) -> DiffResult:
    """Compare two capture files. Raises TensordiffError subclasses on bad input."""
    options = options or DiffOptions()
    with open_capture(path_a) as given_a, open_capture(path_b) as given_b:
        ca, cb, swapped, mapping, mapping_note = _oriented(given_a, given_b, options)
        if swapped:
            path_a, path_b = path_b, path_a
        _check_shards(ca, cb)
        common = sorted(set(ca.steps) & set(cb.steps))
        if options.steps is not None:
            missing = [s for s in options.steps if s not in common]
            if missing:
                raise UsageError(f"step(s) {missing} are not in both captures; both have steps {common}")
            common = sorted(options.steps)
        if not common:
            for cap in (ca, cb):
                if not cap.steps:
                    raise AlignmentError(f"{cap.path}: holds no complete step (the run stopped before its first step ended); "
                                         "re-run the capture")
            raise AlignmentError(f"{path_a} (steps {ca.steps}) and {path_b} (steps {cb.steps}) have no step in common")
        rows: list[Row] = []
        matched_by_name = 0
        first_step = min(ca.steps + cb.steps)  # its weights are the ones the runs loaded
        run_dtype = dtypes.coarsest(compute_dtype(ca, common[0]), compute_dtype(cb, common[0]))
        pending: list[tuple[Row, Future[Measured]]] = []
        many = max(_files(ca), _files(cb))  # rank files: merged and compared in worker processes where they pay
        with (executor_for(many) if many > 1 else contextlib.nullcontext()) as executor, \
                _Measurer(ca, cb, options.ulp_k, compare_jobs(options.jobs), executor) as measurer:
            with progress.task(f"aligning {len(common)} step(s)", len(common), "steps") as shown:
                for step in common:  # aligning the next step while the workers compare this one's pairs
                    pairs = align_step(ca.records(step), cb.records(step), mapping, options.order_fallback)
                    for pair in pairs:
                        rec = pair.a or pair.b
                        assert rec is not None
                        row = Row(step=step, phase=rec.phase, pair=pair)
                        if pair.matched:
                            if pair.how not in ("order", "tensor") and rec.phase != "loss" and rec.module != "":
                                matched_by_name += 1
                            pending.append((row, measurer.submit(pair)))
                        rows.append(row)
                    shown.advance()
            measurer.flush()
            with progress.task(f"comparing {len(pending)} tensor pairs of {len(common)} step(s)", len(pending),
                               "pairs") as shown:
                for row, measured in pending:  # in row order: the first error raised is the one a serial diff raises
                    pair = row.pair
                    row.metrics, row.tol, row.verdict, row.note = compare_pair(
                        ca, cb, pair, options.tolerances, options.ulp_k, run_dtype, measured=measured.result(),
                        first_step=first_step)
                    row.judged = judged_dtype(pair.a.dtype, pair.b.dtype, run_dtype)  # type: ignore[union-attr]
                    if pair.how == "order":
                        row.note = (row.note + "; " if row.note else "") + "matched by order"
                    shown.advance()
        for row, earlier in rope_by_meaning(rows, ca.array, cb.array):  # RoPE tables in two conventions
            if earlier is not None:  # a statistics-only step holding the same tables: judged as then
                row.metrics, row.tol, row.verdict = earlier.metrics, earlier.tol, earlier.verdict
                row.note, row.judged = f"{earlier.note} (step {earlier.step}; the same values here)", earlier.judged
                continue
            row.metrics, row.tol, row.verdict, row.note = compare_pair(
                ca, cb, row.pair, options.tolerances, options.ulp_k, run_dtype, first_step=first_step)
            row.judged = judged_dtype(row.pair.a.dtype, row.pair.b.dtype, run_dtype)  # type: ignore[union-attr]
            # a table no arithmetic of the run made: held to one rounding of its dtype (frequencies rounded to BF16
            # with a model cast whole), not to the arithmetic's tolerance, so that another base is never passed over
            narrow = dtypes.MANTISSA_BITS.get(row.judged, 52) <= dtypes.MANTISSA_BITS["float16"]
            if narrow and row.metrics is not None and options.tolerances.override is None:
                row.tol = min(row.tol, LOADED_ROUNDINGS * dtypes.resolution(row.judged))
                if row.verdict == "ok" and row.metrics.rel_l2 > row.tol:
                    row.verdict = "diverged"
            row.note = "RoPE tables compared by meaning: B's cos and sin read back as angles" + (
                f"; {row.note}" if row.note else "")
        if matched_by_name == 0 and CANNOT_EXPRESS in mapping_note:
            raise AlignmentError(f"{path_a} and {path_b} cannot be compared: {mapping_note.removeprefix('none: ')}")
        if matched_by_name == 0:
            raise AlignmentError(
                f"{path_a} and {path_b} have no module in common ({_sample(ca, common[0])} vs {_sample(cb, common[0])}); "
                "give a mapping file with --mapping, or let `tensordiff map A B -o mapping.yaml` propose one "
                "(see docs/mapping.md)"
            )
        records_a = {step: ca.records(step) for step in common}
        records_b = {step: cb.records(step) for step in common}
        exact_note = ""
        if options.exact and not options.reference:
            stack = same_stack(ca.attrs, cb.attrs, compute_dtype(ca, common[0]), compute_dtype(cb, common[0]))
            noise = options.tolerances.noise
            exact_note = reproducible(rows, stack, bool(noise) and all(v == 0 for v in noise.values()))
            if exact_note:
                apply_exactness(rows, exact_note, records_a, records_b)
        if options.reference:
            judge_against_reference(rows, ca, cb, common, options)
        mark_uncertain(rows)
        skip_a, skip_b = not_recorded(ca.attrs), not_recorded(cb.attrs)
        masks_by_meaning(rows)
        mark_unmatched(rows, skip_a, skip_b, not_recorded_phases(ca.attrs), not_recorded_phases(cb.attrs))
        findings = account(rows, {"A": records_a, "B": records_b}, {"A": ca.array, "B": cb.array})
        flips = account_routing(rows, ca, cb)
        covered = coverage(rows)
        first = find_first_divergence(rows, records_a, options.jump, records_b)
        result = DiffResult(
            path_a=path_a, path_b=path_b, attrs_a=dict(ca.attrs), attrs_b=dict(cb.attrs), rows=rows, steps=common,
            first=first, options=options,
            only_a_steps=sorted(set(ca.steps) - set(cb.steps)), only_b_steps=sorted(set(cb.steps) - set(ca.steps)),
            coverage=covered, mapping_note=mapping_note, swapped=swapped,  # 'drift' set since: the counts hold
            rank_inconsistencies=[f"{side}: {line}" for side, cap in (("A", ca), ("B", cb))
                                  for step in common for line in cap.inconsistencies(step)],
            interrupted=[f"{side} step {step}: {why}" for side, cap in (("A", ca), ("B", cb)) for step in common
                         for why in [cap.step_attrs(step).get("interrupted")] if why],
            findings=findings, exact=exact_note, routing=flips,
            nonfinite={side: describe(first_nonfinite(cap)) for side, cap in (("A", ca), ("B", cb))},
        )
        result.outcome, result.reasons = judge_outcome(result)
        return result


def _oriented(first: CaptureReader, second: CaptureReader, options: DiffOptions) \
        -> tuple[CaptureReader, CaptureReader, bool, RenameRules | None, str]:
    """(A, B, whether they are the captures given in the other order, the mapping, its note): a mapping's sides are
    matched to the captures by their content (``autoselect.orient``), on the first step both hold."""
    common = sorted(set(first.steps) & set(second.steps))
    if options.steps:
        common = sorted(set(common) & set(options.steps)) or common
    if not common or (options.mapping is None and not options.auto_mapping):
        return first, second, False, options.mapping, ""
    step = common[0]
    swapped, mapping, note = orient(first.attrs, second.attrs, first.records(step), second.records(step),
                                    options.mapping, options.auto_mapping)
    return (second, first, True, mapping, note) if swapped else (first, second, False, mapping, note)


#: The default number of comparing threads is the usable cores up to this: past it a host's memory bandwidth, not
#: its cores, bounds the compare, while memory (one tensor pair per thread) keeps growing.
MAX_DEFAULT_JOBS = 8


def compare_jobs(jobs: int | None = None) -> int:
    """Threads comparing tensor pairs: ``jobs``, else ``TENSORDIFF_JOBS`` (which also sizes the pool reading rank
    files' indexes), else the cores this process may use, at most ``MAX_DEFAULT_JOBS``."""
    if jobs is None and os.environ.get(ENV_JOBS, "").strip():
        try:
            jobs = int(os.environ[ENV_JOBS])
        except ValueError:
            raise UsageError(f"{ENV_JOBS}={os.environ[ENV_JOBS]!r}: expected a number of threads") from None
        if jobs < 1:
            raise UsageError(f"{ENV_JOBS}={jobs}: give a number of threads, 1 or more")
    if jobs is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, min(cores, MAX_DEFAULT_JOBS))
    return max(1, jobs)


def _files(cap: CaptureReader) -> int:
    """How many rank files a capture reads (1: a plain file)."""
    return len(cap.paths)


class _Measurer:
    """Measures matched pairs (``judge.measure_pair``) in ``jobs`` threads, or here with one, or, given the rank files'
    ``executor`` (many rank files: ``store/fanout.py``), in its worker processes, in batches with their plans
    (``workers.py``); a pair whose two tensors were already submitted under other records (``judge.tensor_key``)
    shares that result instead of reading them again. At most ``jobs`` pairs are read at a time (threads) or one
    batch per worker: the queue holds pairs, never tensors."""

    def __init__(self, ca: CaptureReader, cb: CaptureReader, ulp_k: int, jobs: int, executor: Executor | None = None):
        self._ca, self._cb, self._ulp_k = ca, cb, ulp_k
        self._executor = executor
        self._pool = ThreadPoolExecutor(jobs, thread_name_prefix="tensordiff-diff") \
            if jobs > 1 and executor is None else None
        self._seen: dict[tuple, Future[Measured]] = {}
        self._batch: list[tuple[Pair, Future[Measured], tuple[dict, dict]]] = []
        self._batch_bytes = 0
        self._session = uuid.uuid4().hex  # the workers' open files belong to this diff

    def submit(self, pair: Pair) -> Future[Measured]:
        key = tensor_key(pair)
        if key is not None and key in self._seen:
            return self._seen[key]
        sides = records_of(pair)
        plans = self._plans(sides) if self._executor is not None and key is not None else None
        if plans is not None:
            future: Future[Measured] = Future()
            self._batch.append((pair, future, plans))
            self._batch_bytes += sum(r.numel for side in sides for r in side) * 4
            if len(self._batch) >= BATCH_PAIRS or self._batch_bytes >= BATCH_BYTES:
                self.flush()
        elif self._pool is not None and key is not None:
            future = self._pool.submit(measure_pair, self._ca, self._cb, pair, self._ulp_k)
        else:  # one job, or statistics only (nothing to read in the common case): here, at once
            future = Future()
            future.set_result(measure_pair(self._ca, self._cb, pair, self._ulp_k))
        if key is not None:
            self._seen[key] = future
        return future

    def _plans(self, sides: tuple[list[Record], list[Record]]) -> tuple[dict, dict] | None:
        """The plans of a pair's records (``workers.records_of``) on each side, keyed (step, seq); None where a record
        with a stored tensor has none (a reader of another format): that pair is measured here."""
        out: tuple[dict, dict] = ({}, {})
        for cap, recs, table in zip((self._ca, self._cb), sides, out):
            for rec in recs:
                plan = cap.plan(rec)
                if plan is None and rec.has_data:
                    return None
                table[(rec.step, rec.seq)] = plan
        return out

    def flush(self) -> None:
        """Send the pairs gathered so far to the workers, with the plans of their records."""
        if not self._batch:
            return
        batch, self._batch, self._batch_bytes = self._batch, [], 0
        plans_a: dict = {}
        plans_b: dict = {}
        for _, _, (pa, pb) in batch:
            plans_a.update(pa)
            plans_b.update(pb)
        assert self._executor is not None
        done = self._executor.submit(measure_batch, [pair for pair, _, _ in batch], plans_a, plans_b, self._ulp_k,
                                     self._session)

        def hand_out(f: Future) -> None:
            err = f.exception()
            for i, (_, future, _) in enumerate(batch):
                if err is not None:
                    future.set_exception(err)
                else:
                    ok, value = f.result()[i]
                    future.set_result(value) if ok else future.set_exception(value)

        done.add_done_callback(hand_out)

    def __enter__(self) -> _Measurer:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:  # on an error: drop the pairs not started, wait for those being compared
            self._pool.shutdown(wait=True, cancel_futures=exc[0] is not None)


def _layout(cap: CaptureReader) -> dict:
    return {} if "merged_from" in cap.attrs else parallel_of(cap.attrs)


def _check_shards(ca: CaptureReader, cb: CaptureReader) -> None:
    """One rank file of a distributed run holds shards: against a run of another layout it cannot be compared
    alone (its tensors would be skipped for shape): say which rank files are missing."""
    la, lb = _layout(ca), _layout(cb)
    shape_a = (la.get("world_size", 1), la.get("tp", 1), la.get("dp", la.get("world_size", 1)), la.get("pp", 1))
    shape_b = (lb.get("world_size", 1), lb.get("tp", 1), lb.get("dp", lb.get("world_size", 1)), lb.get("pp", 1))
    if shape_a == shape_b:
        return  # the same layout on both sides: rank i against rank i is a fair comparison
    for cap, layout in ((ca, la), (cb, lb)):
        world = int(layout.get("world_size", 1))
        if world > 1:
            rank = int(layout.get("rank", 0))
            parts = ", ".join(f"{k.upper()} {layout[k]}" for k in ("tp", "dp", "pp") if int(layout.get(k, 1)) > 1)
            missing = [r for r in range(world) if r != rank]
            raise AlignmentError(
                f"{cap.path}: rank {rank} of a {world}-rank run ({parts or 'data parallel'}), compared with a run of "
                f"another layout: the other rank files hold the rest of its tensors (missing ranks "
                f"{', '.join(map(str, missing))}); pass them all, quoted: '{_rank_glob(cap.path)}'")


def _rank_glob(path: str) -> str:
    return re.sub(r"\.rank\d+(\.[^.]+)$", r".rank*\1", path)


def _sample(cap: CaptureReader, step: int) -> str:
    names = []
    for rec in cap.records(step):
        if rec.phase in ("forward", "weights") and rec.module and rec.module not in names:
            names.append(rec.module)
        if len(names) == 2:
            break
    return f"{cap.framework}: " + ", ".join(names) if names else f"{cap.framework}: no modules"
