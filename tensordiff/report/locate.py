"""``tensordiff locate``: where the curves part, the checkpoint both runs resume from, the two commands, and (after
``--run``) the resumed iterations side by side with the first divergence as ``diff`` prints it."""

from __future__ import annotations

import shlex
from collections import defaultdict
from typing import Any

from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text

from ..config import ConfigDiff, Difference
from ..explain.place import as_dict as first_as_dict
from ..runs.compare import pct
from ..runs.locate import LocatePlan
from .diff import DiffReport
from .theme import Name, wide

#: Settings a resume from another run's checkpoint restores from that checkpoint: torch optimizers' saved parameter
#: groups carry Adam's betas and epsilon (Megatron-LM's scheduler sets the learning rate and weight decay itself).
RESTORED_BY_RESUME = ("adam_beta1", "adam_beta2", "adam_eps")
#: The optimizer's settings besides the learning rate (what a one-factor update with equal learning rates points to).
OPTIMIZER_KEYS = ("optimizer", "adam_beta1", "adam_beta2", "adam_eps", "weight_decay", "clip_grad")


class LocateReport:
    def __init__(self, plan: LocatePlan, result: Any = None, updates: list | None = None,
                 lrs: tuple[dict, dict] = ({}, {}), settings: ConfigDiff | None = None):
        self.plan = plan
        self.settings = settings
        """the two runs' settings compared (their logs or commands), or None where they could not be read"""
        self.result = result
        self.updates = updates or []
        """``fit_updates``: each side's own update between consecutive resumed iterations, ``ΔB = r · ΔA``"""
        self.lrs = lrs
        """the captured learning rates of each side by capture step"""

    def parting(self) -> bool:
        """The loss curves part at the iteration looked at (not one asked for where they agree)."""
        return self.plan.comparison.first_over == self.plan.step

    def unexplained_parting(self) -> bool:
        """The resumed iterations agree (exit 0) while the curves part: never said as agreement."""
        return self.result is not None and self.result.exit_code == 0 and self.parting()

    def restored(self) -> list[Difference]:
        """Differences the resume erases: with --mode shared a Megatron-LM B loads A's optimizer state, whose saved
        parameter groups (betas, epsilon) replace B's flags."""
        if self.settings is None or self.plan.mode != "shared" or self.plan.b.kind != "megatron":
            return []
        return [d for d in self.settings.differences if d.row.key in RESTORED_BY_RESUME]

    def lr_equal(self) -> bool:
        """Every one-factor update's iteration logged equal learning rates on both sides."""
        la, lb = self.lrs
        fits = [f for f in self.updates if f.one_factor]
        return bool(fits) and all(f.p in la and f.p in lb and la[f.p] and abs(lb[f.p] / la[f.p] - 1.0) < 1e-6
                                  for f in fits)

    def update_lines(self) -> list[str]:
        """Each resumed update that one factor explains for every parameter, in words (the learning rate)."""
        out = []
        la, lb = self.lrs
        for fit in self.updates:
            if not fit.one_factor:
                continue
            it = self.plan.iteration_of(fit.p)
            lr = (f"; the logged learning rates of iteration {it}: A {la[fit.p]:.6g}, B {lb[fit.p]:.6g} (ratio "
                  f"{lb[fit.p] / la[fit.p]:.4g})" if fit.p in la and fit.p in lb and la[fit.p] else "")
            out.append(f"iteration {it}: B's update is {fit.factor:.4g} × A's for all {fit.parameters} parameters "
                       f"(worst residual {fit.worst:.1%}){lr}")
        return out

    def drift(self) -> tuple[int, int, float, str] | None:
        """Own mode: (parameters that differ, compared, worst rel L2, its name) at the first resumed iteration."""
        if self.result is None or not self.result.steps:
            return None
        first = self.result.steps[0]
        rows = [r for r in self.result.rows if r.step == first and r.phase == "weights" and r.metrics is not None]
        if not rows:
            return None
        worst = max(rows, key=lambda r: r.err)
        return (sum(r.verdict == "diverged" for r in rows), len(rows), worst.err,
                worst.pair.a.label if worst.pair.a is not None else "?")

    def iterations(self) -> list[dict[str, Any]]:
        """Per resumed iteration: compared rows, diverged rows, the first diverged record."""
        if self.result is None:
            return []
        by_step: dict[int, list] = defaultdict(list)
        for r in self.result.rows:
            by_step[r.step].append(r)
        out = []
        for step in self.result.steps:
            rows = by_step.get(step, [])
            diverged = [r for r in rows if r.verdict == "diverged"]
            first = min(diverged, key=lambda r: r.pair.a.seq if r.pair.a is not None else 1 << 60) if diverged else None
            out.append({"iteration": self.plan.iteration_of(step), "capture_step": step,
                        "compared": sum(r.metrics is not None for r in rows), "diverged": len(diverged),
                        "first_diverged": None if first is None or first.pair.a is None else
                        f"{first.phase} {first.pair.a.label}"})
        return out

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        plan, res = self.plan, self.result
        cmp = plan.comparison
        yield Text(f"A {cmp.a.describe()}")
        yield Text(f"B {cmp.b.describe()}")
        if cmp.first_over == plan.step:
            la, lb = cmp.a.loss.get(plan.step), cmp.b.loss.get(plan.step)
            yield Text(f"The loss curves part at iteration {plan.step}: relative loss error {pct(cmp.rel_loss[plan.step])}"
                       f" > {pct(cmp.threshold)} (A {la:.6g}, B {lb:.6g}).", style="tensordiff.diverged")
        else:
            yield Text(f"Looking at iteration {plan.step} (asked for).")
        if self.settings is not None and self.settings.differences:
            said = "; ".join(f"{d.row.label}: A {d.a.value}, B {d.b.value}" for d in self.settings.differences)
            yield Text(f"The two runs' settings differ in {len(self.settings.differences)} that change what a run "
                       f"computes (tensordiff config, from their logs or commands): {said}.",
                       style="tensordiff.diverged")
        elif self.settings is not None:
            yield Text("The two runs' settings (tensordiff config, from their logs or commands) differ in nothing that "
                       "changes what a run computes.")
        restored = self.restored()
        if restored:
            yield Text("With --mode shared, B resumes A's optimizer state, and Megatron-LM restores its saved parameter "
                       f"groups over B's flags: B runs every resumed iteration with A's "
                       f"{', '.join(d.row.label for d in restored)}, so that difference cannot show there; --mode own "
                       "resumes each run with its own.", style="tensordiff.diverged")
        saved = "; ".join(f"{side} saved {_steps(steps)}" for side, steps in plan.saved.items() if steps)
        if plan.resume:
            how = ("each run from its own checkpoint" if plan.mode == "own" else "both runs from A's checkpoint "
                   "(shared state: weights and optimizer)")
            yield Text(f"Checkpoints: {saved}. Resuming {how} of iteration {plan.resume}, capturing iterations "
                       f"{plan.resume + 1}..{plan.step + 1}.")
        else:
            yield Text(f"Checkpoints: {saved or 'none'}. None before iteration {plan.step}: both runs start from their "
                       f"beginning, capturing iterations 1..{plan.step + 1}.")
        state = plan.state.result if plan.state is not None else None
        if state is not None:
            yield Text(f"Shared state: A's iteration {plan.resume} converted for B with {state['mapping']}: "
                       f"{state['weights']} weights, {state['moments']} Adam moments, global_step "
                       f"{state['global_step']} -> {state['file']}.")
            for note in state["notes"]:
                yield Text(f"  {note}")
            if state["mismatches"]:
                yield Text("The optimizers differ (from one state, B's update will not be A's): "
                           + "; ".join(state["mismatches"]) + ".", style="tensordiff.diverged")
        table = Table(title="resume commands", title_justify="left", show_lines=True)
        for col in ("side", "loads", "command (run under capture)"):
            table.add_column(col, overflow="fold")
        for side in (plan.a, plan.b):
            table.add_row(side.name, f"{side.loads or '(its start)'}" + (f" @ {side.iteration}" if side.iteration else ""),
                          shlex.join(side.capture_command))
        yield wide(table)
        if res is None:
            yield Text("Run both (in any order, on their own machines if need be), then: tensordiff diff "
                       f"{plan.a.capture} {plan.b.capture} --first-divergence; or pass --run.")
            return
        table = Table(title="resumed iterations", title_justify="left")
        for col in ("iteration", "compared", "diverged", "first diverged record"):
            table.add_column(col, justify="right" if col in ("iteration", "compared", "diverged") else "left")
        for it in self.iterations():
            table.add_row(str(it["iteration"]), str(it["compared"]), str(it["diverged"]), Name(it["first_diverged"] or "-"),
                          style="tensordiff.diverged" if it["diverged"] else None)
        yield wide(table)
        drift = self.drift()
        if plan.mode == "own" and drift is not None:
            n, total, worst, name = drift
            if n:
                yield Text(f"Own state: at iteration {plan.resume} the weights had already drifted apart: {n} of "
                           f"{total} parameters differ, worst {name} (relative L2 {worst:.2e}). The first divergence "
                           "below is this drift; --mode shared resumes both from A's state to find the first "
                           "thing B computes differently.", style="tensordiff.diverged")
            else:
                yield Text(f"Own state: at iteration {plan.resume} the weights of both runs still agree ({total} "
                           "parameters compared).")
        yield DiffReport(res, first_only=True, iteration_of=plan.iteration_of)
        lines = self.update_lines()
        if lines:
            lead = ("Beyond the drift, each side's own optimizer update" if plan.mode == "own" and drift and drift[0]
                    else "Each side's optimizer update")
            why = "the learning rates differ"
            if self.lr_equal():
                optim = [d.row.label for d in (self.settings.differences if self.settings else [])
                         if d.row.key in OPTIMIZER_KEYS]
                why = ("yet the logged learning rates are equal: not the learning rate, the optimizer's other "
                       "settings or state" + (f" (the runs' settings differ in {', '.join(optim)})" if optim else ""))
            yield Text(f"{lead} fits one factor for every parameter: {why}.\n  "
                       + "\n  ".join(lines), style="tensordiff.diverged")
        if self.unexplained_parting():
            cause = (f" The runs' settings differ in {', '.join(d.row.label for d in self.settings.differences)}: "
                     "the likely cause." if self.settings is not None and self.settings.differences else "")
            erased = " The shared resume erased it (above)." if self.restored() else ""
            yield Text(f"Inconclusive: every resumed iteration agrees, yet the loss curves part at iteration "
                       f"{plan.step}: what parts them is not in what the resumed runs computed.{cause}{erased}",
                       style="tensordiff.diverged")
        first = res.first
        if first is not None:
            top = f"; likely cause: {res.hints[0].title}" if getattr(res, "hints", None) else ""
            said = DiffReport(res, iteration_of=plan.iteration_of)._steps(top)
            yield Text(f"First divergence: iteration {plan.iteration_of(first.step)}, {first.phase}, "
                       f"{first.module_a}{said}.", style="tensordiff.diverged")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"tensordiff_locate": 1, **self.plan.as_dict(),
                               "runs": self.plan.comparison.as_dict(),
                               "settings": None if self.settings is None else self.settings.as_dict(),
                               "erased_by_resume": [d.row.key for d in self.restored()]}
        if self.result is not None:
            diff = DiffReport(self.result).to_dict()
            first = self.result.first
            out["iterations"] = self.iterations()
            out["first_divergence"] = None if first is None else {
                **first_as_dict(first), "iteration": self.plan.iteration_of(first.step)}
            out["hints"] = diff.get("hints", [])
            out["outcome"] = "inconclusive" if self.unexplained_parting() else self.result.outcome
            if self.unexplained_parting():
                out["inconclusive_reasons"] = [f"the resumed iterations agree while the loss curves part at iteration "
                                               f"{self.plan.step}"]
            out["updates"] = [{**fit.as_dict(), "iteration": self.plan.iteration_of(fit.p)} for fit in self.updates]
            drift = self.drift()
            if drift is not None:
                out["weights_at_resume"] = {"differ": drift[0], "compared": drift[1], "worst_rel_l2": drift[2],
                                            "worst": drift[3]}
        return out


def _steps(steps: list[int]) -> str:
    if len(steps) <= 6:
        return ", ".join(map(str, steps))
    return f"{', '.join(map(str, steps[:3]))}, ..., {', '.join(map(str, steps[-2:]))} ({len(steps)})"
