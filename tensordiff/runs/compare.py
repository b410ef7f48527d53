"""Two runs side by side: aligned by step, judged by the relative loss error after a warm-up.

Optional thresholds on the final and validation perplexities and on the mean relative grad-norm
difference; every threshold that fails is named in the verdict.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..errors import RunsError
from .run import Run

#: The largest relative loss error two runs may show (``--threshold``: 0.01 is 1%), and the steps not judged at
#: the start (``--warmup``): ``runs`` and ``locate`` alike.
DEFAULT_THRESHOLD = 0.01
DEFAULT_WARMUP = 0


@dataclass
class Comparison:
    """The result of ``compare_runs``: the measures, the verdict, and what the report shows."""

    a: Run
    b: Run
    steps: list[int]
    threshold: float
    warmup: int
    rel_loss: dict[int, float]
    mean_rel_loss: float
    max_rel_loss: float
    max_rel_step: int | None
    first_over: int | None
    final_loss: tuple[float, float] | None
    final_ppl: tuple[float, float] | None
    val: tuple[int, float, float] | None
    grad_norm_mean_rel: float | None
    grad_norm_max_rel: float | None
    window: tuple[int, int] | None = None
    """only steps in [lo, hi] are judged (``--window``)"""
    failures: list[str] = field(default_factory=list)
    """the user thresholds that failed, in words (the loss threshold first)"""
    ppl_threshold: float | None = None
    grad_norm_threshold: float | None = None

    @property
    def passed(self) -> bool:
        return not self.failures

    def measures(self) -> list[tuple[str, str, str, str]]:
        """(measure, A, B, relative) rows of the report, as text (the terminal table and the HTML share them)."""
        rows = [("mean relative loss error", "", "", pct(self.mean_rel_loss))]
        if self.max_rel_step is not None:
            s = self.max_rel_step
            rows.append((f"max relative loss error (step {s})", f"{self.a.loss[s]:.6g}", f"{self.b.loss[s]:.6g}",
                         pct(self.max_rel_loss)))
        if self.final_loss and self.final_ppl:
            (la, lb), (pa, pb) = self.final_loss, self.final_ppl
            rows.append((f"final training loss (step {self.steps[-1]})", f"{la:.6g}", f"{lb:.6g}", pct(_rel(la, lb))))
            rows.append(("final training perplexity", f"{pa:.6g}", f"{pb:.6g}", pct(_rel(pa, pb))))
        if self.val is not None:
            step, la, lb = self.val
            pa, pb = _ppl(la), _ppl(lb)
            rows.append((f"validation loss (step {step})", f"{la:.6g}", f"{lb:.6g}", pct(_rel(la, lb))))
            rows.append((f"validation perplexity (step {step})", f"{pa:.6g}", f"{pb:.6g}", pct(_rel(pa, pb))))
        if self.grad_norm_mean_rel is not None:
            rows.append(("grad norm, mean / max relative difference", "", "",
                         f"{pct(self.grad_norm_mean_rel)} / {pct(self.grad_norm_max_rel)}"))
        return rows

    def judged_text(self) -> str:
        if self.window is not None:
            return f"in steps {max(self.window[0], self.warmup + 1)}..{min(self.window[1], self.steps[-1])}"
        return f"after step {self.warmup}"

    def verdict(self) -> str:
        if self.passed:
            text = f"PASS: the relative loss error stays within {_thr(self.threshold)} {self.judged_text()}"
            extra = [f"perplexity within {_thr(self.ppl_threshold)}" if self.ppl_threshold is not None else "",
                     f"grad norm within {_thr(self.grad_norm_threshold)}" if self.grad_norm_threshold is not None else ""]
            extra = [e for e in extra if e]
            return text + ("; " + ", ".join(extra) if extra else "") + "."
        return "FAIL: " + "; ".join(self.failures) + "."

    def as_dict(self) -> dict[str, Any]:
        def clean(v: Any) -> Any:
            return None if isinstance(v, float) and not math.isfinite(v) else v

        return {
            "tensordiff_runs": 1,
            "a": {"path": self.a.path, "kind": self.a.kind, "steps": len(self.a.loss), "relogged": sorted(self.a.relogged)},
            "b": {"path": self.b.path, "kind": self.b.kind, "steps": len(self.b.loss), "relogged": sorted(self.b.relogged)},
            "common_steps": len(self.steps), "threshold": self.threshold, "warmup": self.warmup,
            "window": list(self.window) if self.window else None, "ppl_threshold": self.ppl_threshold,
            "grad_norm_threshold": self.grad_norm_threshold, "failures": self.failures,
            "mean_rel_loss": clean(self.mean_rel_loss), "max_rel_loss": clean(self.max_rel_loss),
            "max_rel_step": self.max_rel_step, "first_step_over_threshold": self.first_over,
            "final_loss": self.final_loss, "final_ppl": self.final_ppl,
            "validation": None if self.val is None else {"step": self.val[0], "loss_a": self.val[1], "loss_b": self.val[2],
                                                         "ppl_a": _ppl(self.val[1]), "ppl_b": _ppl(self.val[2])},
            "grad_norm_mean_rel": self.grad_norm_mean_rel, "grad_norm_max_rel": self.grad_norm_max_rel,
            "passed": self.passed,
            "rel_loss": {str(k): clean(v) for k, v in self.rel_loss.items()},
        }


def pct(x: float | None) -> str:
    """A relative error as a percentage, readable at any size (0.0042% rather than 0.000%)."""
    if x is None or not math.isfinite(x):
        return "n/a" if x is None else str(x)
    return f"{x:.3%}" if x >= 1e-3 or x == 0 else f"{x * 100:.2g}%"


def _thr(x: float) -> str:
    """A threshold as the user wrote it: 1.00%, 0.05%."""
    return f"{x:.2%}" if x >= 1e-4 else pct(x)


def _ppl(loss: float) -> float:
    return math.exp(min(loss, 700))  # no overflow for a diverged run


def _rel(a: float, b: float) -> float:
    return abs(b - a) / abs(a) if a != 0 else (0.0 if b == 0 else math.inf)


def _over(x: float, threshold: float) -> bool:
    """``x`` exceeds ``threshold``; NaN always does (a comparison with NaN is false: never a silent pass)."""
    return not x <= threshold


def _order(x: float) -> float:
    """Sort key of a relative error: NaN above everything."""
    return math.inf if math.isnan(x) else x


def compare_runs(a: Run, b: Run, threshold: float = DEFAULT_THRESHOLD, warmup: int = DEFAULT_WARMUP,
                 window: tuple[int, int] | None = None,
                 ppl_threshold: float | None = None, grad_norm_threshold: float | None = None) -> Comparison:
    """Align by step (only steps both logged) and judge the relative loss error after ``warmup`` steps
    (and inside ``window``, both ends included). Optional thresholds: the relative difference of the
    final and validation perplexities (``ppl_threshold``), the mean relative grad-norm difference."""
    for name, value in (("--threshold", threshold), ("--ppl-threshold", ppl_threshold),
                        ("--grad-norm-threshold", grad_norm_threshold)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise RunsError(f"{name} {value}: a relative error threshold is a finite number >= 0 (0.01 is 1%)")
    steps = sorted(set(a.loss) & set(b.loss))
    if not steps:
        raise RunsError(f"{a.path} (steps {min(a.loss)}..{max(a.loss)}) and {b.path} (steps {min(b.loss)}..{max(b.loss)}) "
                        "share no logged step; log both at a common interval")
    lo, hi = window if window is not None else (steps[0], steps[-1])
    rel = {s: _rel(a.loss[s], b.loss[s]) for s in steps}
    judged = [s for s in steps if s > warmup and lo <= s <= hi]
    if not judged:
        raise RunsError(f"no common step is judged: the runs share steps {steps[0]}..{steps[-1]}, the warm-up ends at "
                        f"{warmup}" + (f" and the window is {lo}..{hi}" if window else "") +
                        "; lower --warmup or widen --window")
    values = [rel[s] for s in judged]
    worst = max(judged, key=lambda s: _order(rel[s]))
    first_over = next((s for s in judged if _over(rel[s], threshold)), None)
    last = steps[-1]
    final = (a.loss[last], b.loss[last])
    ppl = (_ppl(final[0]), _ppl(final[1]))
    val_steps = sorted(set(a.val_loss) & set(b.val_loss))
    val = (val_steps[-1], a.val_loss[val_steps[-1]], b.val_loss[val_steps[-1]]) if val_steps else None
    gn_steps = [s for s in sorted(set(a.grad_norm) & set(b.grad_norm)) if s > warmup and lo <= s <= hi]
    gn = [_rel(a.grad_norm[s], b.grad_norm[s]) for s in gn_steps]
    gn_mean = sum(gn) / len(gn) if gn else None
    failures = []
    for run in (a, b):  # a NaN or inf loss is never within any threshold, even on both sides
        bad = next((s for s in judged if not math.isfinite(run.loss[s])), None)
        if bad is not None:
            failures.append(f"{run.path}: the loss is {run.loss[bad]} at step {bad} (first non-finite judged step)")
    if first_over is not None:
        failures.append(f"the relative loss error first exceeds {_thr(threshold)} at step {first_over} "
                        f"(max {pct(rel[worst])} at step {worst})")
    if ppl_threshold is not None:
        checks = [("final training perplexity", ppl)]
        if val is not None:
            checks.append((f"validation perplexity at step {val[0]}", (_ppl(val[1]), _ppl(val[2]))))
        for name, (pa, pb) in checks:
            if _over(_rel(pa, pb), ppl_threshold):
                failures.append(f"the {name} differs by {pct(_rel(pa, pb))} > {_thr(ppl_threshold)}")
    if grad_norm_threshold is not None:
        if gn_mean is None:
            failures.append("a grad-norm threshold was given but the runs share no logged grad norm")
        elif _over(gn_mean, grad_norm_threshold):
            failures.append(f"the mean relative grad-norm difference is {pct(gn_mean)} > {_thr(grad_norm_threshold)}")
    return Comparison(
        a=a, b=b, steps=steps, threshold=threshold, warmup=warmup, rel_loss=rel,
        mean_rel_loss=sum(values) / len(values), max_rel_loss=rel[worst], max_rel_step=worst, first_over=first_over,
        final_loss=final, final_ppl=ppl, val=val,
        grad_norm_mean_rel=gn_mean, grad_norm_max_rel=max(gn) if gn else None,
        window=window, failures=failures, ppl_threshold=ppl_threshold,
        grad_norm_threshold=grad_norm_threshold,
    )
