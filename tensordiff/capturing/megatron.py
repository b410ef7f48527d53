"""Capture a megatron-core training loop without an edit to it (``tensordiff capture --megatron``).

It attaches where a training loop meets megatron-core, so Megatron-LM's ``pretrain_gpt.py`` and any other loop
built on the same parts (Megatron-Bridge, NeMo-style or hand-written ones) are covered by the same code:

* ``megatron.core.pipeline_parallel.get_forward_backward_func`` (the schedule every such loop calls) returns the
  schedule wrapped: its first training call (``forward_only=False``) starts the capture on the model chunks it is
  given (DDP-wrapped; several chunks, virtual pipeline stages, as one ``ModuleList``). Each call records its
  micro-batches in order (calls 0..M-1 of each module, the backward of each as it runs); when the schedule returns,
  its gradients are final (it has run ``finalize_model_grads``), and the parameter gradients are taken then
  (``main_grad``, the gradient buffers of megatron-core's DDP). A second training call before the optimizer step
  (Megatron-LM's re-run of an iteration, ``--rerun-mode``) starts the step again: only the last pass is kept;
* ``megatron.core.optimizer.get_megatron_optimizer`` returns the optimizer with its ``step`` wrapped: the tensordiff
  step ends when it returns, with the loss of this rank's micro-batches (``sum loss / sum tokens`` over what the
  loss function reported, as Megatron-LM reduces ``lm loss``), the grad norm it returns, the learning rate and the
  loss scale as per-step scalars;
* in Megatron-LM (``megatron.training.training`` is loaded when the schedule is first asked for), its ``train_step``
  is wrapped too: the step then ends when ``train_step`` returns, with the loss Megatron logs (``loss_dict``: the
  ``lm loss`` reduced over the data-parallel ranks), the step number as its log prints it (``iteration``) and the
  same scalars.

Scalars are recorded for every iteration of the run (``tensordiff runs`` reads them); the first ``--steps``
iterations are captured in full. Every wrapper is taken away at the end (the program's exit, or on failure): the
functions are restored, the optimizer's ``step`` is its own again. Nothing here may break the program: a failure
warns once, removes every hook and training goes on.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import sys
from typing import Any

import torch

from .auto import ProgramCapture, TrainingCapture
from .options import report_status
from .recorder import open_recorders, optimizer_scalars

__all__ = ["MegatronCapture", "reported_loss"]

#: the key of the loss in what Megatron-LM's loss function reports (``loss_dict``); else the one key there is
LOSS_KEY = "lm loss"


def reported_loss(reported: Any) -> torch.Tensor | None:
    """The loss of one iteration from what the loss function reported per micro-batch (a list of dicts), or from
    Megatron-LM's ``loss_dict``: ``[sum, tokens]`` pairs are summed and divided, single values averaged (both as
    Megatron-LM does); None where there is none (a pipeline stage before the last) or no single loss key."""
    if isinstance(reported, dict):
        reported = [reported]
    if not isinstance(reported, (list, tuple)) or not reported or not all(isinstance(d, dict) for d in reported):
        return None
    keys = list(reported[0])
    key = LOSS_KEY if LOSS_KEY in keys else (keys[0] if len(keys) == 1 else None)
    if key is None:
        return None
    values = [d.get(key) for d in reported]
    if not all(isinstance(v, torch.Tensor) for v in values):
        return None
    flat = [v.detach().reshape(-1).float() for v in values]
    if all(v.numel() == 2 for v in flat):
        total = torch.stack(flat).sum(dim=0)
        return total[0] / total[1]
    if all(v.numel() == 1 for v in flat):
        return torch.cat(flat).mean()
    return None


class MegatronStepCapture(TrainingCapture):
    """``TrainingCapture`` whose steps are Megatron's iterations (``iteration``: the number its log prints)."""

    def _install(self) -> None:
        super()._install()
        self._install_local_grads()  # DP > 1: the gradients before the reduction too (the distributed optimizer's)


class MegatronCapture(ProgramCapture):
    """Wraps megatron-core's schedule and optimizer (and Megatron-LM's ``train_step``) while the program runs."""

    label = "--megatron capture"
    removed = "wrappers removed"

    def __init__(self) -> None:
        self.capture: MegatronStepCapture | None = None
        self._restore: list[tuple[Any, str, Any]] = []  # (owner, attribute, original)
        self._optimizers: list[Any] = []  # optimizers whose step is wrapped (an instance attribute)
        self._loss: torch.Tensor | None = None  # this rank's loss of the pass that ran last
        self._pass_done = False  # a schedule pass ran and its step has not ended yet
        self._in_train_step = False
        self._installed = False
        self._closed = False
        self._gave_up = False

    # installing ---------------------------------------------------------------
    def install(self) -> bool:
        """Wrap megatron-core's entry points when ``tensordiff capture`` turned capture on; False otherwise."""
        if not self._load_options():
            return False
        try:
            import megatron.core.optimizer as optimizer_mod
            import megatron.core.pipeline_parallel as pp
            import megatron.core.pipeline_parallel.schedules as schedules
        except Exception as err:  # not a megatron-core environment: the program runs as it is
            report_status(f"--megatron: {sys.executable} cannot import megatron.core ({type(err).__name__}: {err}); "
                          "install megatron-core there, or capture the program with --auto")
            return False
        original = schedules.get_forward_backward_func
        wrapped = functools.wraps(original)(functools.partial(self._get_schedule, original))
        for owner in (schedules, pp):
            self._patch(owner, "get_forward_backward_func", wrapped)
        get_opt = optimizer_mod.get_megatron_optimizer
        self._patch(optimizer_mod, "get_megatron_optimizer",
                    functools.wraps(get_opt)(functools.partial(self._get_optimizer, get_opt)))
        self._installed = True
        atexit.register(self.close)
        return True

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self._restore.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    # wrappers -----------------------------------------------------------------
    def _get_schedule(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        schedule = original(*args, **kwargs)
        if self._closed:
            return schedule
        self._attach_megatron_lm()
        return functools.wraps(schedule)(functools.partial(self._schedule, schedule))

    def _get_optimizer(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        optimizer = original(*args, **kwargs)
        if not self._closed:
            self._wrap_optimizer(optimizer)
        return optimizer

    def _attach_megatron_lm(self) -> None:
        """Megatron-LM's training loop is loaded: wrap its ``train_step`` (looked up by name at each iteration)."""
        training = sys.modules.get("megatron.training.training")
        if training is None or any(owner is training for owner, _, _ in self._restore):
            return
        train_step = getattr(training, "train_step", None)
        if callable(train_step):
            self._patch(training, "train_step",
                        functools.wraps(train_step)(functools.partial(self._train_step, train_step)))

    def _wrap_optimizer(self, optimizer: Any) -> None:
        if any(o is optimizer for o in self._optimizers) or not callable(getattr(optimizer, "step", None)):
            return
        step = optimizer.step
        optimizer.step = functools.wraps(step)(functools.partial(self._optimizer_step, optimizer, step))
        self._optimizers.append(optimizer)

    def _schedule(self, schedule: Any, *args: Any, **kwargs: Any) -> Any:
        training = not kwargs.get("forward_only", False) and not self._closed
        if training:
            try:
                self._before_pass(kwargs.get("model", args[2] if len(args) > 2 else None))
            except Exception as err:
                self._give_up(err)
        result = schedule(*args, **kwargs)
        if training and self.capture is not None and not self._gave_up:
            try:
                self._after_pass(result)
            except Exception as err:
                self._give_up(err)
        return result

    def _before_pass(self, model: Any) -> None:
        cap = self.capture
        if cap is None:
            if model is None:
                raise ValueError("the schedule was called without a model")
            self._start(model)
            return
        if self._pass_done:
            if self._in_train_step:  # the same iteration again (a re-run): keep its last pass only
                if cap.active:
                    cap.restart_step()
            elif not self._optimizers:  # a loop whose optimizer tensordiff does not see: the last iteration is over
                self._end_step()
            # else: one more pass before the optimizer step (accumulated by hand): the same step goes on

    def _start(self, model: Any) -> None:
        assert self.options is not None
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        if open_recorders():  # the program's own tensordiff.capture() writes the file
            self._gave_up = True
            with contextlib.suppress(Exception):
                sys.stderr.write("tensordiff: the program calls tensordiff.capture() itself; --megatron is not needed "
                                 "and stepped aside\n")
            self.close()
            return
        root = chunks[0] if len(chunks) == 1 else torch.nn.ModuleList(chunks)
        self.capture = MegatronStepCapture(root, self.options)

    def _after_pass(self, result: Any) -> None:
        cap = self.capture
        assert cap is not None
        self._loss = reported_loss(result)
        self._pass_done = True
        if cap.state.wants_grads:
            cap.take_param_grads()  # final: the schedule has reduced them (finalize_model_grads)

    def _optimizer_step(self, optimizer: Any, step: Any, *args: Any, **kwargs: Any) -> Any:
        out = step(*args, **kwargs)
        if not self._in_train_step and self._pass_done and not self._gave_up:
            try:
                self._end_step(optimizer, _grad_norm(out))
            except Exception as err:
                self._give_up(err)
        return out

    def _train_step(self, train_step: Any, *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            return train_step(*args, **kwargs)
        self._in_train_step = True
        try:
            out = train_step(*args, **kwargs)
        finally:
            self._in_train_step = False
        if self._pass_done and not self._gave_up:
            try:
                optimizer = kwargs.get("optimizer", args[3] if len(args) > 3 else None)
                loss_dict = out[0] if isinstance(out, tuple) and out else None
                grad_norm = out[5] if isinstance(out, tuple) and len(out) > 5 else None
                iteration = kwargs.get("iteration")
                loss = reported_loss(loss_dict) if loss_dict else None
                self._end_step(optimizer, grad_norm, loss=loss,
                               iteration=iteration + 1 if isinstance(iteration, int) else None)
            except Exception as err:
                self._give_up(err)
        return out

    def _end_step(self, optimizer: Any = None, grad_norm: Any = None, loss: Any = None,
                  iteration: int | None = None) -> None:
        """End the iteration: the step in flight (while capturing), then the per-step scalars."""
        cap = self.capture
        self._pass_done = False
        if cap is None:
            return
        loss = self._loss if loss is None else loss
        self._loss = None
        scalars: dict[str, Any] = {}
        if grad_norm is not None:
            scalars["grad_norm"] = grad_norm
        scalars.update(optimizer_scalars(optimizer))
        cap.set_iteration(iteration)  # counted from 1, as Megatron-LM's log does: its scalars land where the log's N is
        if cap.loss_recorded and loss is not None:  # the model returned the loss itself: recorded already
            scalars = {"loss": loss, **scalars}
            loss = None
        cap.step(loss, **scalars)

    # ending -------------------------------------------------------------------
    def close(self, finished: bool = False) -> None:
        """Restore every wrapped function and method, close the capture; with ``finished`` (the program ended
        normally) and no training step seen, say so (``tensordiff capture`` reports it)."""
        if self._closed or not self._installed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
        for owner, name, original in reversed(self._restore):
            with contextlib.suppress(Exception):
                setattr(owner, name, original)
        self._restore.clear()
        for optimizer in self._optimizers:
            with contextlib.suppress(Exception):
                del optimizer.step  # the class's own again
        self._optimizers.clear()
        cap = self.capture
        if cap is None:
            if finished and not self._gave_up:
                report_status("--megatron saw no megatron-core training step: the program never called the schedule "
                              "from megatron.core.pipeline_parallel.get_forward_backward_func() for training; is it a "
                              "Megatron training program? (a plain PyTorch one: use --auto)")
            return
        if self._pass_done and not self._gave_up:  # a loop whose optimizer step tensordiff did not see
            with contextlib.suppress(Exception):
                self._end_step()
        failed = cap.state.failed
        cap.close()
        if not failed and not self._gave_up:
            with contextlib.suppress(Exception):
                sys.stderr.write(f"tensordiff: --megatron recorded {cap.state.step} training step(s) of "
                                 f"{type(cap.model).__name__} to {cap.path}; wrappers removed\n")


def _grad_norm(out: Any) -> Any:
    """The grad norm from what a megatron-core optimizer's ``step()`` returns: (success, grad norm, zeros)."""
    return out[1] if isinstance(out, tuple) and len(out) > 1 else None
