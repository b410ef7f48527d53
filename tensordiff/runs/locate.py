"""From the curve to the layer: where two long runs part, which checkpoint to resume from, and how.

``plan_locate`` takes two runs (logs or captures) and their checkpoint folders, finds the step ``K`` where the
loss curves part (``compare_runs``), picks the latest checkpoint ``J`` before it, and writes the two resume
commands that capture iterations ``J+1 .. K+1`` of each side from there:

* Megatron-LM (``pretrain_gpt.py`` or any program taking its flags): ``--load DIR --ckpt-step J
  --exit-interval K+1``, ``--save``/``--save-interval`` dropped (the original checkpoints stay as they are;
  ``--train-iters`` is kept, so the learning-rate schedule is the original one), run under
  ``tensordiff capture --megatron``;
* MindFormers (a command with ``--config X.yaml``): a copy of the YAML that loads the step-``J`` checkpoint and
  resumes (``load_checkpoint``, ``resume_training``), stops after iteration ``K+1`` and writes into its own output
  folder, run under ``tensordiff capture --mindformers``.

Two modes. *own*: each side resumes from its own checkpoint (how far the weights had drifted at ``J`` is the first
thing the diff shows). *shared*: B resumes from A's step-``J`` state, optimizer moments included, so that the
first divergence is the first thing B computes differently from the same state. For two runs of one framework B
loads A's folder; for Megatron-LM A and MindFormers B the plan converts A's state at ``J`` (weights, Adam moments,
step: ``tensordiff.ckpt.state.convert_state``, with the mapping table given) into ``OUT/shared_state/`` and B's YAML
copy resumes from it. MindFormers A with Megatron-LM B is refused (no Megatron-LM optimizer state is written).

Framework-free: the plan is text; running it is ``tensordiff.cli.locate``.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field
from typing import Any

import yaml

from .._yaml import load_yaml
from ..ckpt.dirs import saved_steps
from ..errors import RunsError, UsageError
from .compare import DEFAULT_THRESHOLD, DEFAULT_WARMUP, Comparison, compare_runs
from .readers import read_run

MODES = ("own", "shared")

#: Megatron-LM flags that save checkpoints or stop the run: the resumed run must do neither on its own
_MEGATRON_DROP = {"--save": 1, "--save-interval": 1, "--exit-interval": 1, "--exit-duration-in-mins": 1,
                  "--finetune": 0, "--no-load-optim": 0, "--no-load-rng": 0, "--ckpt-step": 1, "--load": 1}


class NothingToLocate(RunsError):
    """The loss curves do not part: there is no step to resume before (``comparison`` says how close they stay)."""

    def __init__(self, message: str, comparison: Comparison):
        super().__init__(message)
        self.comparison = comparison


@dataclass
class SidePlan:
    """One side's resume: where from, and the command that captures it."""

    name: str
    """'A' or 'B'."""
    kind: str
    """'megatron' or 'mindformers'."""
    loads: str | None
    """the checkpoint folder the resumed run loads (None: the run starts from its own beginning)"""
    iteration: int
    """the iteration of that checkpoint (0: none)"""
    command: list[str]
    """the training command, resumed"""
    capture: str
    """the capture file it writes"""
    capture_command: list[str]
    log: str
    files: dict[str, str] = field(default_factory=dict)
    """files the plan writes before running (a YAML copy): path -> text"""

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "loads": self.loads, "iteration": self.iteration,
                "command": shlex.join(self.command), "capture": self.capture,
                "capture_command": shlex.join(self.capture_command), "log": self.log, "files": sorted(self.files)}


@dataclass
class StatePlan:
    """Shared mode across frameworks: A's Megatron-LM state at ``iteration`` converted into ``dst`` for B's Trainer
    (``tensordiff.ckpt.state.convert_state``; ``tensordiff.cli.locate`` does it before running anything)."""

    src: str
    iteration: int
    dst: str
    file: str
    """the .ckpt B resumes from (``dst/rank_0/PREFIX_rank_0-E_S.ckpt``)"""
    mapping: str
    variables: dict[str, str]
    prefix: str
    steps_per_epoch: int
    config: str | None
    """B's YAML: its optimizer is checked against A's"""
    result: dict[str, Any] | None = None
    """what the conversion wrote (``ConvertedState.as_dict``), once done"""

    def as_dict(self) -> dict[str, Any]:
        return {"src": self.src, "iteration": self.iteration, "dst": self.dst, "file": self.file,
                "mapping": self.mapping, "variables": self.variables, "steps_per_epoch": self.steps_per_epoch,
                "result": self.result}

    def convert(self) -> dict[str, Any]:
        from ..ckpt.state import convert_state

        self.result = convert_state(self.src, self.iteration, self.dst, self.mapping, self.variables,
                                    prefix=self.prefix, steps_per_epoch=self.steps_per_epoch,
                                    config=self.config).as_dict()
        return self.result


@dataclass
class LocatePlan:
    comparison: Comparison
    step: int
    """K: the first iteration whose relative loss error passes the threshold (or the one asked for)"""
    resume: int
    """J: the checkpointed iteration both sides resume from"""
    mode: str
    a: SidePlan
    b: SidePlan
    out: str
    saved: dict[str, list[int]]
    """the checkpointed iterations of each side"""
    state: StatePlan | None = None
    """shared mode across frameworks: A's state converted for B"""

    @property
    def steps(self) -> int:
        """Iterations captured: J+1 .. K+1."""
        return self.step + 1 - self.resume

    def iteration_of(self, capture_step: int) -> int:
        """The training iteration a capture step of the resumed runs is (captures count from 0)."""
        return self.resume + 1 + capture_step

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "resume": self.resume, "mode": self.mode, "captured_iterations":
                [self.resume + 1, self.step + 1], "saved": self.saved, "out": self.out,
                "a": self.a.as_dict(), "b": self.b.as_dict(),
                "shared_state": None if self.state is None else self.state.as_dict()}


def side_kind(command: list[str]) -> str:
    """'mindformers' for a command with ``--config X.yaml``, else 'megatron' (Megatron-LM's flags)."""
    for i, item in enumerate(command):
        value = command[i + 1] if item == "--config" and i + 1 < len(command) else (
            item.partition("=")[2] if item.startswith("--config=") else "")
        if value.endswith((".yaml", ".yml")):
            return "mindformers"
    return "megatron"


def _without(command: list[str], drop: dict[str, int]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(command):
        flag, eq, _ = command[i].partition("=")
        if flag in drop:
            i += 1 if eq else 1 + drop[flag]
            continue
        out.append(command[i])
        i += 1
    return out


def _flag(command: list[str], name: str) -> str | None:
    for i, item in enumerate(command):
        if item == name and i + 1 < len(command):
            return command[i + 1]
        if item.startswith(name + "="):
            return item.partition("=")[2]
    return None


def megatron_resume(command: list[str], load: str | None, iteration: int, stop: int, own: bool = True) -> list[str]:
    """A Megatron-LM command resumed from ``load`` at ``iteration`` (None: from its own start), stopping after
    iteration ``stop`` without saving. From another run's checkpoint (``own=False``), the command keeps its own
    learning-rate schedule (``--override-opt_param-scheduler``; Megatron-LM otherwise asserts that it matches the
    checkpoint's, or with ``--use-checkpoint-opt_param-scheduler`` takes the other run's)."""
    if load is None:  # from the start: keep what the run loaded at the start (its initial checkpoint)
        keep = {k: v for k, v in _MEGATRON_DROP.items() if k not in ("--load", "--finetune", "--no-load-optim",
                                                                      "--no-load-rng", "--ckpt-step")}
        return _without(command, keep) + ["--exit-interval", str(stop)]
    resumed = _without(command, _MEGATRON_DROP) + ["--load", load, "--ckpt-step", str(iteration),
                                                   "--exit-interval", str(stop)]
    if not own:
        resumed = _without(resumed, {"--use-checkpoint-opt_param-scheduler": 0, "--override-opt_param-scheduler": 0})
        resumed.append("--override-opt_param-scheduler")
    return resumed


def mindformers_resume(command: list[str], load: str | None, iteration: int, stop: int, out: str,
                       name: str) -> tuple[list[str], dict[str, str]]:
    """A MindFormers command on a copy of its YAML that resumes from ``load`` (the checkpoint of ``iteration``: a
    legacy ``rank_R/*.ckpt`` file or a 2.0 ``iteration_NNNNNNNN`` folder) and stops after ``stop``
    (``runner_config.stop_step``, the Trainer's global step); returns the command and the YAML copy to write (path ->
    text). ``runner_config.epochs`` stays: it is the total, and the Trainer skips the steps already done."""
    config = _flag(command, "--config")
    if config is None or not os.path.exists(config):
        raise UsageError(f"{config or '--config'}: the MindFormers command's YAML is not there; pass the command as "
                         "you run it, with --config PATH")
    with open(config, encoding="utf-8") as fh:
        doc = load_yaml(fh.read(), config, "MindFormers config")
    if not isinstance(doc, dict):
        raise UsageError(f"{config}: not a MindFormers YAML (a mapping of sections)")
    if load is not None:
        # legacy layout (a file, or the one the plan writes before running): the folder holding rank_R/, and the
        # file's name to resume from
        if load.endswith(".ckpt"):
            doc["load_checkpoint"] = os.path.abspath(os.path.dirname(os.path.dirname(load)))
            doc["resume_training"] = os.path.basename(load)
            doc["load_ckpt_format"] = "ckpt"
        else:  # checkpoint 2.0: the iteration_NNNNNNNN folder
            doc["load_checkpoint"] = os.path.abspath(load)
            doc["resume_training"] = True
            doc["load_ckpt_format"] = "safetensors"
    doc["output_dir"] = os.path.abspath(os.path.join(out, f"output_{name.lower()}"))
    runner = doc.setdefault("runner_config", {})
    if isinstance(runner, dict):
        runner["stop_step"] = stop
    callbacks = doc.get("callbacks")
    if isinstance(callbacks, list):  # no checkpoint saving in the resumed run
        doc["callbacks"] = [c for c in callbacks if not (isinstance(c, dict) and c.get("type") == "CheckpointMonitor")]
    path = os.path.abspath(os.path.join(out, f"resume_{name.lower()}.yaml"))
    new = []
    i = 0
    while i < len(command):
        if command[i] == "--config":
            new += ["--config", path]
            i += 2
            continue
        new.append("--config=" + path if command[i].startswith("--config=") else command[i])
        i += 1
    return new, {path: yaml.safe_dump(doc, sort_keys=False)}


def _latest(saved: dict[int, str], before: int) -> int:
    return max((j for j in saved if j <= before), default=0)


def plan_locate(run_a: str, run_b: str, ckpt_a: str, ckpt_b: str | None, cmd_a: list[str], cmd_b: list[str],
                out: str, mode: str = "own", threshold: float = DEFAULT_THRESHOLD, warmup: int = DEFAULT_WARMUP,
                step: int | None = None,
                tensors: str = "all", mapping: str | None = None, variables: dict[str, str] | None = None,
                steps_per_epoch: int = 1) -> LocatePlan:
    """The plan: K (where the curves part, or ``step``), J (the checkpoint to resume from), both commands.

    Shared mode with Megatron-LM A and MindFormers B: ``mapping``/``variables`` convert A's state for B
    (``plan.state``), ``steps_per_epoch`` is B's dataset's (the epoch the converted checkpoint says it is in)."""
    if mode not in MODES:
        raise UsageError(f"--mode {mode}: expected one of {', '.join(MODES)}")
    comparison = compare_runs(read_run(run_a), read_run(run_b), threshold=threshold, warmup=warmup)
    k = step if step is not None else comparison.first_over
    if k is None:
        raise NothingToLocate("The loss curves do not part: nothing to locate (pass --step K to look at an iteration "
                              "anyway).", comparison)
    saved_a = saved_steps(ckpt_a)
    saved_b = saved_steps(ckpt_b) if ckpt_b else {}
    if mode == "own" and ckpt_b is None:
        raise UsageError("--mode own resumes each side from its own checkpoints: pass --ckpt-b too (or --mode shared)")
    # J: the latest checkpoint before K (so that step K itself is computed again), on both sides in own mode
    if mode == "own":
        j = _latest({s: p for s, p in saved_a.items() if s in saved_b}, k - 1)
    else:
        j = _latest(saved_a, k - 1)
    kind_a, kind_b = side_kind(cmd_a), side_kind(cmd_b)
    state = None
    if mode == "shared" and kind_a != kind_b and j:
        if kind_a == "mindformers":
            raise UsageError("--mode shared mindformers → megatron: tensordiff converts a Megatron-LM state for "
                             "MindFormers only (it writes no Megatron-LM optimizer checkpoint); make the Megatron-LM "
                             "run A (swap the two runs), or use --mode own")
        if not mapping:
            raise UsageError("--mode shared megatron → mindformers converts A's state (weights, Adam moments, step) "
                             "for B with a mapping table: pass --mapping NAME and its --var (e.g. --mapping "
                             "mcore-mindformers-llama --var heads=32 --var groups=8)")
        from ..ckpt.state import legacy_name

        dst = os.path.abspath(os.path.join(out, "shared_state"))
        state = StatePlan(os.path.abspath(ckpt_a), j, dst,
                          os.path.join(dst, "rank_0", legacy_name("shared", j, steps_per_epoch)), mapping,
                          dict(variables or {}), "shared", steps_per_epoch, _flag(cmd_b, "--config"))
    os.makedirs(out, exist_ok=True)
    stop = k + 1
    sides = []
    for name, kind, cmd, saved, own in (("A", kind_a, cmd_a, saved_a, ckpt_a), ("B", kind_b, cmd_b, saved_b, ckpt_b)):
        source = own if mode == "own" or name == "A" else ckpt_a
        source_saved = saved if mode == "own" or name == "A" else saved_a
        load = source_saved.get(j) if j else None
        if state is not None and name == "B":
            source, load = state.dst, state.file
        files: dict[str, str] = {}
        if kind == "megatron":
            resumed = megatron_resume(cmd, source if j else None, j, stop, own=source == own)
        else:
            resumed, files = mindformers_resume(cmd, load, j, stop, out, name)
        capture = os.path.abspath(os.path.join(out, f"{name.lower()}.h5"))
        wrap = ["tensordiff", "capture", f"--{kind}", "-o", capture, "--steps", str(stop - j), "--tensors", tensors,
                "--"]
        sides.append(SidePlan(name, kind, load if kind == "mindformers" else (source if j else None), j, resumed,
                              capture, wrap + resumed, os.path.abspath(os.path.join(out, f"{name.lower()}.log")), files))
    return LocatePlan(comparison, k, j, mode, sides[0], sides[1], out,
                      {"A": sorted(saved_a), "B": sorted(saved_b)}, state)
