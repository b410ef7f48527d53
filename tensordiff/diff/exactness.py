"""Same-stack exactness: on one framework, version, device and dtype, a bitwise reproducible program computes
bitwise identical outputs from bitwise identical inputs, so a difference introduced there is the code's, whatever
its size.

Tolerances exist for differences that arithmetic makes (another kernel, another reduction order, another
framework). When both captures come from the same stack and the program is bitwise reproducible, a module whose
inputs and weights are bitwise identical on both sides and whose output is not computes something else: a GELU
tanh approximation in one layer of a BF16 model changes the loss by 2e-5, inside any BF16 tolerance, and is still
the one place the code differs. Such a pair is a divergence ("exact").

It applies where both captures saw the same steps inside the module (the same code, as far as a capture can
see); where one side runs other recorded steps there (SDPA against explicit softmax and dropout modules), the
two are different implementations and tolerances judge them.

Reproducible means measured (a ``tensordiff noise`` file whose every record is 0) or seen in the captures: the
first compared pairs of the forward pass, in execution order, are bitwise identical. The rule judges forward
outputs only: a module's output is a function of its inputs and weights, while the gradient a capture records for
a module's input is the whole gradient of that tensor, which other consumers of it (a residual branch) add to.
``--no-exact`` turns the rule off.
"""

from __future__ import annotations

import json

from ..record import Record, is_inside
from .result import COMPARED, Row

#: The attributes that must be equal for two captures to be one stack. ``capture_mode`` is "graph" for a MindSpore
#: program compiled as a graph, absent for eager (PyNative) ones: the graph compiler picks and fuses kernels of its
#: own, so eager against graph is other arithmetic (the lm head's MatMul differs in the last bits on an AVX2 CPU).
STACK_KEYS = ("framework", "framework_version", "megatron_core_version", "transformers_version", "mindformers_version",
              "device", "capture_mode")
#: Bitwise identical pairs, first in a phase, that show a program reproducible.
EVIDENCE = 3


def same_stack(attrs_a: dict, attrs_b: dict, dtype_a: str, dtype_b: str) -> str:
    """A sentence naming the shared stack, or '' when the captures differ in framework, version, device or dtype."""
    if "device" not in attrs_a or "device" not in attrs_b or dtype_a != dtype_b or not dtype_a:
        return ""
    if any(str(attrs_a.get(k, "")) != str(attrs_b.get(k, "")) for k in STACK_KEYS):
        return ""
    if _layout(attrs_a) != _layout(attrs_b):
        return ""  # another parallel layout is other arithmetic (partial sums all-reduced, shards joined)
    return f"{attrs_a.get('framework')} {attrs_a.get('framework_version')} on {attrs_a.get('device')}, {dtype_a}"


def parallel_of(attrs: dict) -> dict:
    """A capture's parallel coordinates (its ``parallel`` attribute: tp, dp, pp, rank, world_size), {} if none."""
    try:
        value = json.loads(str(attrs.get("parallel", "") or "{}"))
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _layout(attrs: dict) -> tuple:
    """The parallel layout a capture was made with (merged rank files included), without the rank."""
    return ("merged_from" in attrs, tuple(sorted((k, str(v)) for k, v in parallel_of(attrs).items() if k != "rank")))


def _bitwise(row: Row) -> bool:
    m = row.metrics
    return m is not None and m.source == "tensor" and m.max_abs == 0 and m.nonfinite_mismatch == 0


def reproducible(rows: list[Row], stack: str, zero_noise: bool) -> str:
    """Why this pair's program is bitwise reproducible on ``stack`` (a sentence), or '' when nothing shows it."""
    if not stack:
        return ""
    if zero_noise:
        return f"{stack}; a noise file measured reruns bitwise equal"
    first = [r for r in rows if r.step == rows[0].step and r.phase == "forward" and r.verdict in COMPARED
             and r.metrics is not None and r.metrics.source == "tensor" and r.pair.a is not None
             and r.pair.a.l2 > 0][:EVIDENCE]
    if len(first) == EVIDENCE and all(_bitwise(r) for r in first):
        return f"{stack}; the first {EVIDENCE} pairs of forward are bitwise identical"
    return ""


def _inside(records: list[Record], module: str) -> list[tuple]:
    """What a capture saw of ``module`` in the forward pass: its own inputs and outputs and everything inside it, as
    (name below it, kind, slot, shape), sorted (an extra output, HF eager attention's probabilities, is another
    implementation as much as an extra module inside)."""
    cut = len(module) + 1 if module else 0
    return sorted((r.module[cut:] if r.module != module else "", r.kind, r.slot, r.shape) for r in records
                  if r.phase == "forward" and (r.module == module or is_inside(r.module, module)))


def apply_exactness(rows: list[Row], why: str, records_a: dict[int, list[Record]],
                    records_b: dict[int, list[Record]]) -> int:
    """Mark 'diverged' every forward output within tolerance whose module call had bitwise identical inputs (and
    weights) on both sides but not a bitwise identical output, where both sides saw the same steps
    inside the module (the same code, as far as a capture can see: where one side runs other recorded steps in
    it, SDPA against explicit softmax and dropout, it is another implementation and tolerances judge it).
    Returns how many were marked."""
    marked = 0
    for step, recs in records_a.items():
        recs_b = records_b.get(step, [])
        step_rows = [r for r in rows if r.step == step]
        by_tensor: dict[tuple[int, int], Row] = {}
        for r in step_rows:
            a = r.pair.a
            if a is not None and r.verdict in COMPARED:
                by_tensor.setdefault(a.tensor_id, r)
        weights: dict[str, list[Row]] = {}
        for r in step_rows:
            if r.phase == "weights" and r.pair.a is not None:
                weights.setdefault(r.pair.a.module, []).append(r)
        calls: dict[tuple[str, int], dict[str, list[Record]]] = {}
        for rec in recs:
            calls.setdefault((rec.module, rec.call), {}).setdefault(rec.kind, []).append(rec)
        for r in step_rows:
            a = r.pair.a
            if (a is None or r.verdict != "ok" or r.phase != "forward" or r.metrics is None
                    or r.metrics.source != "tensor" or _bitwise(r)):
                continue
            if (r.phase, a.kind) != ("forward", "output"):
                continue
            call = calls.get((a.module, a.call), {})
            inputs = call.get("input", [])
            if not inputs:
                continue
            rows_in = [by_tensor.get(x.tensor_id) for x in inputs]
            if any(x is None or not _bitwise(x) for x in rows_in):
                continue
            params = [w for m, ws in weights.items() if m == a.module or is_inside(m, a.module) for w in ws]
            if any(not _bitwise(w) for w in params):
                continue
            b = r.pair.b
            if b is None or _inside(recs, a.module) != _inside(recs_b, b.module):
                continue
            r.verdict = "diverged"
            r.exact = True
            r.note = ((r.note + "; ") if r.note else "") + (
                f"exact: its inputs{' and weights' if params else ''} are bitwise identical on both sides and the "
                f"program is bitwise reproducible ({why}): a difference of any size here is the code's")
            marked += 1
    return marked
