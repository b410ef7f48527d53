"""Isolated replay: run one module of side A's code on the inputs side B captured.

``tensordiff replay A.h5 B.h5 --module NAME --model pkg.mod:factory`` builds the model with the factory
(side A's framework), takes the module NAME, loads its weights from A's capture, and calls it twice: on
A's captured inputs (a check that the replay reproduces A) and on B's captured inputs (brought into
A's layout by the mapping). Then:

* A's code on B's inputs gives B's output → the difference came in with the inputs (inherited);
* it gives something else → the module itself computes differently on the two sides (introduced here).

The framework-specific call lives in ``tensordiff.frameworks`` (``replay_call`` of torch and MindSpore);
anything it raises (a module the model does not have, inputs it does not take) becomes one ReplayError.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from .. import frameworks
from .._text import first_line
from ..diff.align import align_step
from ..diff.metrics import rel_l2
from ..errors import ReplayError, TensordiffError, UsageError
from ..mapping import RenameRules
from ..record import Record
from ..store import open_capture

ReplayVerdict = Literal["introduced", "inherited", "unfaithful"]


@dataclass
class ReplayResult:
    module: str
    step: int
    call: int
    module_class: str
    ab: float
    """A's output vs B's output, as captured."""
    replay_a: float
    """A's code on A's inputs vs A's output (should be ~0: the replay is faithful)."""
    replay_b: float
    """A's code on B's inputs vs B's output."""
    replay_b_vs_a: float
    """A's code on B's inputs vs A's output."""
    verdict: ReplayVerdict
    """'introduced', 'inherited', or 'unfaithful' (the replay does not reproduce A)."""
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in self.__dict__.items()}

    def sentence(self) -> str:
        if self.verdict == "unfaithful":
            return (f"The replay does not reproduce A's own output (rel L2 {self.replay_a:.2g}): the factory's model or "
                    "the captured inputs do not match the run; nothing can be concluded.")
        if self.verdict == "inherited":
            return (f"A's {self.module} on B's inputs gives B's output (rel L2 {self.replay_b:.2g}): the difference "
                    f"({self.ab:.2g}) came in with the inputs; it is made upstream.")
        return (f"A's {self.module} on B's inputs does not give B's output (rel L2 {self.replay_b:.2g}, the same order as "
                f"the gap {self.ab:.2g}): the difference is introduced in {self.module} itself.")


def load_factory(spec: str) -> Callable[[], Any]:
    """``pkg.module:function`` (importable from the current directory) -> the function."""
    mod_name, _, fn_name = spec.partition(":")
    if not mod_name or not fn_name:
        raise UsageError(f"--model {spec!r}: expected MODULE:FUNCTION, e.g. --model examples.gpt.models:replay_model")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(mod_name)
    except ImportError as err:
        raise ReplayError(f"--model {spec}: cannot import {mod_name} ({err}); run from the folder that holds it or "
                          "set PYTHONPATH") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ReplayError(f"--model {spec}: {mod_name} has no function {fn_name!r}")
    return fn


def _slot_key(slot: str) -> tuple[int, str]:
    return (0, f"{int(slot):06d}") if slot.isdigit() else (1, slot)


def replay(path_a: str, path_b: str, module: str, factory: Callable[[], Any], step: int | None = None, call: int = 0,
           mapping: RenameRules | None = None, rtol: float = 1e-5) -> ReplayResult:
    with open_capture(path_a) as ca, open_capture(path_b) as cb:
        steps = sorted(set(ca.steps) & set(cb.steps))
        if not steps:
            raise ReplayError(f"{path_a} and {path_b} have no step in common")
        step = steps[0] if step is None else step
        if step not in steps:
            raise ReplayError(f"step {step} is not in both captures (both have {steps})")
        recs_a = ca.records(step)
        mine = [r for r in recs_a if r.phase == "forward" and r.module == module and r.call == call]
        if not mine:
            names = sorted({r.module for r in recs_a if r.phase == "forward" and module.split(".")[-1] in r.module})[:5]
            raise ReplayError(f"{path_a}: no forward call {call} of module {module!r} at step {step}"
                              + (f"; similar: {', '.join(names)}" if names else ""))
        inputs = sorted((r for r in mine if r.kind == "input"), key=lambda r: _slot_key(r.slot))
        outputs = [r for r in mine if r.kind == "output" and r.slot == "0"]
        if not outputs:
            raise ReplayError(f"{path_a}: {module} has no output.0 recorded at step {step}")
        out_a = outputs[0]
        partner = {p.a.seq: p for p in align_step(recs_a, cb.records(step), mapping, order_fallback=False)
                   if p.a is not None and p.b is not None}
        notes: list[str] = []

        def b_side(rec: Record) -> np.ndarray | None:
            pair = partner.get(rec.seq)
            if pair is None:
                return None
            return pair.b_tensor(cb.array)

        x_a: list[tuple[str, np.ndarray]] = []
        x_b: list[tuple[str, np.ndarray]] = []
        for rec in inputs:
            xa = ca.array(rec)
            if xa is None:
                raise ReplayError(f"{path_a}: step {step} holds statistics only; replay needs the tensors "
                                  "(capture with --tensors all, or replay step 0)")
            xb = b_side(rec)
            if xb is None:
                notes.append(f"input {rec.slot}: not captured on B, A's used")
                xb = xa
            x_a.append((rec.slot, xa))
            x_b.append((rec.slot, xb))
        weights = {}
        prefix = module + "." if module else ""
        for rec in recs_a:
            if rec.phase == "weights" and (rec.module == module or rec.module.startswith(prefix)):
                rel = rec.module[len(prefix):] if rec.module != module else ""
                value = ca.array(rec)
                if value is not None:
                    weights[f"{rel}.{rec.slot}" if rel else rec.slot] = value
        y_a = ca.array(out_a)
        y_b = b_side(out_a)
        if y_b is None or y_a is None:
            raise ReplayError(f"{module} output.0 is not captured on both sides at step {step}")
        framework = str(ca.attrs.get("framework", ""))
    if framework not in frameworks.NAMES:
        raise ReplayError(f"replay runs torch or mindspore captures; A was written by {framework or 'an unknown framework'}")
    run = frameworks.get(framework).replay_call
    try:
        model = factory()
    except TensordiffError:
        raise
    except Exception as err:  # the user's factory: not one that builds a model from nothing
        raise ReplayError(f"--model: calling the factory failed ({type(err).__name__}: {first_line(err, default='')}); "
                          "it must be a function that takes no arguments and returns side A's model") from None
    try:
        y_aa = run(model, module, x_a, weights)
        y_ab = run(model, module, x_b, weights)
    except TensordiffError:
        raise
    except Exception as err:  # the model's own code: a module it lacks, inputs it does not take
        text = first_line(err, default="")
        raise ReplayError(f"--module {module}: calling it in the model built by the factory failed ({type(err).__name__}: "
                          f"{text}); check that --model builds side A's model and --module names one of its "
                          "modules") from None

    ab, ra, rb, rba = rel_l2(y_a, y_b), rel_l2(y_aa, y_a), rel_l2(y_ab, y_b), rel_l2(y_ab, y_a)
    verdict: ReplayVerdict
    if ra > max(rtol, 0.1 * ab):
        verdict = "unfaithful"
    elif rb <= max(rtol, 0.1 * ab):
        verdict = "inherited"
    else:
        verdict = "introduced"
    return ReplayResult(module, step, call, out_a.module_class, ab, ra, rb, rba, verdict, notes)
