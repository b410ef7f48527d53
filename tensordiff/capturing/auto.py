"""Capture a PyTorch training program that does not call tensordiff itself (``tensordiff capture --auto``).

``auto_main`` (the entry point ``--auto`` runs the program through) installs ``AutoCapture``. It
registers torch's *global* module and optimizer hooks (public torch APIs, nothing patched):

* the model is the first module call with trainable parameters that is a *training* call
  (gradients enabled, not in inference mode, the module in train mode); evaluation calls before
  it are skipped, so a script that evaluates first still finds its model;
* from then on the model is captured like ``tensordiff.capture`` does (``TrainingCapture``), but
  a step holds training calls only: a top-level call under ``torch.no_grad()`` /
  ``torch.inference_mode()`` or in ``eval()`` mode is skipped with everything it calls, so the
  records of a step are those of the same script without its evaluation;
* a step ends with its ``optimizer.step()``; after the last captured step every hook is removed,
  global and per module, and the file is closed;
* the loss is recorded when the model's output holds exactly one scalar floating tensor that
  requires grad (``logits, loss = model(x, targets=y)``, a Hugging Face ``output.loss``); a loss
  computed outside the model is not known in this mode.

Nothing here may break the program: a failure warns, removes every hook and training goes on.
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import types
from functools import partial
from typing import Any

import torch
import torch.optim.optimizer as _optim

from .._warn import warn as _warn_line
from ..record import flatten
from .options import CaptureOptions, options_from_env, report_status
from .recorder import open_recorders
from .torch.adapter import TorchCapture

__all__ = ["AutoCapture", "ProgramCapture", "TrainingCapture", "training_call"]


def training_call(module: torch.nn.Module) -> bool:
    """Whether a call of ``module`` belongs to a training step: gradients on, not inference mode, train mode."""
    return torch.is_grad_enabled() and not torch.is_inference_mode_enabled() and module.training


def _scalar_loss(output: Any) -> torch.Tensor | None:
    """The one scalar floating tensor that requires grad in the model's output, else None (no guess)."""
    found = [t for _, t in flatten(output, "", lambda v: isinstance(v, torch.Tensor))
             if t.dim() == 0 and t.is_floating_point() and t.requires_grad]
    return found[0] if len(found) == 1 else None


def _call_kwargs(module: torch.nn.Module) -> dict[str, Any]:
    """The keyword arguments of ``module``'s call in flight.

    torch gives global forward pre-hooks the positional arguments only. ``Module._call_impl`` (and its
    ``inner``) hold the keyword ones in their frame: read, never written. {} when no such frame is found.
    """
    frame: types.FrameType | None = sys._getframe(1)
    for _ in range(8):
        if frame is None:
            break
        code = frame.f_code
        if code.co_name in ("inner", "_call_impl") and code.co_filename.endswith("module.py"):
            local = frame.f_locals
            if local.get("self") is module and isinstance(local.get("kwargs"), dict):
                return dict(local["kwargs"])
        frame = frame.f_back
    return {}


class TrainingCapture(TorchCapture):
    """``TorchCapture`` that records training calls only, and the loss when the model returns it.

    A top-level call (the model's, or one of its modules called on its own) that is not a training call
    is skipped with everything it calls; ``skipped`` counts them. Calls nested in a training call are all
    recorded, ``no_grad`` or not (a frozen part of the model belongs to the step).
    """

    def __init__(self, model: torch.nn.Module, options: CaptureOptions, **kw: Any):
        self._skip_depth = 0
        self.skipped = 0
        super().__init__(model, options, **kw)

    def _install(self) -> None:
        # module hooks only: AutoCapture's global optimizer hooks take the parameter gradients and end the steps
        for name, module in self.model.named_modules():
            self._handles.append(module.register_forward_pre_hook(partial(self._pre_hook, name), with_kwargs=True))
            self._handles.append(module.register_forward_hook(partial(self._post_hook, name)))

    def _pre_hook(self, name: str, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        try:
            if name == "" and training_call(module):
                self._skip_depth = 0  # a training call of the model is never inside an evaluation (heals after a raise)
            if self._skip_depth:
                self._skip_depth += 1
                return
            if not self.call_depth and not training_call(module):
                self._skip_depth = 1
                self.skipped += 1
                return
        except Exception as err:
            self.fail(err)
            return
        super()._pre_hook(name, module, args, kwargs)

    def _post_hook(self, name: str, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if self._skip_depth:
            self._skip_depth -= 1
            return
        super()._post_hook(name, module, args, output)
        if name == "" and not self.call_depth and self.state.recording and not self.loss_recorded:
            try:
                loss = _scalar_loss(output)
            except Exception as err:
                self.fail(err)
                return
            if loss is not None:
                self.loss(loss)  # the step's first forward, under gradient accumulation

    def first_call(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """The model's call in flight when the capture starts: recorded as from its start (its own pre-hooks were
        collected before the capture's were added)."""
        self._pre_hook("", module, args, kwargs)


class ProgramCapture:
    """What the ways of capturing a program that never calls tensordiff share (``--auto``, ``--megatron``): the
    options from ``tensordiff capture``'s environment, one warning, and giving up without raising into the program.
    Subclasses set ``label`` (how warnings name them) and ``removed`` (what giving up took away), and ``close()``."""

    label = ""
    removed = ""
    options: CaptureOptions | None = None
    capture: Any = None
    _gave_up = False

    def _load_options(self) -> bool:
        """Capture is on (``tensordiff capture`` set it): the options are loaded. False, said once, otherwise."""
        try:
            self.options = options_from_env(None, None, None)
        except Exception as err:
            self._warn(f"{self.label} not started ({err})")
            return False
        return self.options is not None

    def close(self, finished: bool = False) -> None:
        raise NotImplementedError

    def _give_up(self, err: BaseException) -> None:
        """A failure outside the recorder: warn, remove everything, never raise into the program."""
        self._gave_up = True
        with contextlib.suppress(Exception):
            if self.capture is not None:
                self.capture.fail(err)
            else:
                report_status(f"{self.label} stopped: {type(err).__name__}: {err}")
                self._warn(f"{self.label} stopped ({type(err).__name__}: {err}); {self.removed}")
        with contextlib.suppress(Exception):
            self.close()

    @staticmethod
    def _warn(message: str) -> None:
        with contextlib.suppress(Exception):
            _warn_line(f"tensordiff: {message}; training goes on")


class AutoCapture(ProgramCapture):
    """Finds the model and the training steps of a PyTorch program through torch's global hooks."""

    label = "autocapture"
    removed = "hooks removed"

    def __init__(self) -> None:
        self.options: CaptureOptions | None = None
        self.capture: TrainingCapture | None = None
        self.skipped = 0  # top-level evaluation calls before the model was found
        self._depth = 0  # module calls in flight, until the model is found (top-level: 0)
        self._module_handles: list[Any] = []
        self._optimizer_handles: list[Any] = []
        self._installed = False
        self._closed = False
        self._gave_up = False

    def install(self) -> bool:
        """Register the global hooks when ``tensordiff capture`` turned capture on; False (nothing done) otherwise."""
        if not self._load_options():
            return False
        hooks = torch.nn.modules.module
        self._module_handles = [hooks.register_module_forward_pre_hook(self._module_pre),
                                hooks.register_module_forward_hook(self._module_post, always_call=True)]
        self._optimizer_handles = [_optim.register_optimizer_step_pre_hook(self._optimizer_pre),
                                   _optim.register_optimizer_step_post_hook(self._optimizer_post)]
        self._installed = True
        atexit.register(self.close)
        return True

    @property
    def steps(self) -> int:
        """Steps recorded so far."""
        return self.capture.state.step if self.capture is not None else 0

    # hooks --------------------------------------------------------------------
    def _module_pre(self, module: torch.nn.Module, args: tuple) -> None:
        try:
            depth = self._depth
            self._depth += 1
            if self.capture is not None or self._closed:
                return None
            training = training_call(module)
            if depth and not training:
                return None  # inside an evaluation call (or a module's own no_grad part)
            if not any(p.requires_grad for p in module.parameters()):
                return None  # a loss module, a wrapper without parameters: its callees may be the model
            if not training:
                self.skipped += 1
                return None
            self._start(module, args)
        except Exception as err:
            self._give_up(err)
        return None

    def _module_post(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        self._depth = max(self._depth - 1, 0)
        return None

    def _start(self, module: torch.nn.Module, args: tuple) -> None:
        """The model is found, in its first training call: capture it from this call on."""
        self._remove(self._module_handles)  # no more global module hooks
        assert self.options is not None
        if open_recorders():
            # the program's own tensordiff.capture() writes the file: step aside rather than fight over it
            self._gave_up = True
            self.close()
            with contextlib.suppress(Exception):
                sys.stderr.write("tensordiff: the program calls tensordiff.capture() itself; --auto is not needed and "
                                 "stepped aside\n")
            return
        kwargs = _call_kwargs(module)
        self.capture = TrainingCapture(module, self.options)
        self.capture.first_call(module, args, kwargs)

    def _optimizer_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.capture is not None:
            self.capture.optimizer_step_begin(optimizer)

    def _optimizer_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        cap = self.capture
        if cap is None:
            return
        try:
            cap.optimizer_step_end()
            if cap.state.step_ready or cap.state.resting:  # a step every=N skips is counted as well
                cap.step()  # the step ends with its optimizer step: what follows (evaluation, logging) is not in it
            if cap.finished:
                self.close()
        except Exception as err:
            self._give_up(err)

    # ending -------------------------------------------------------------------
    def close(self, finished: bool = False) -> None:
        """Remove every hook and close the capture (after the last step, on failure, at the end of the program).

        ``finished``: the program ended normally; if no training step was seen, say so (``tensordiff capture``
        reports it)."""
        if self._closed or not self._installed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
        self._remove(self._module_handles)
        self._remove(self._optimizer_handles)
        cap = self.capture
        if cap is None:
            if not finished or self._gave_up:
                return
            if self.skipped:
                report_status(f"autocapture saw no training step: the {self.skipped} module call(s) with parameters ran "
                              "without gradients or in eval mode (no_grad, inference_mode, model.eval())")
            else:
                report_status("autocapture saw no training step: no torch.nn.Module with trainable parameters ran")
            return
        failed = cap.state.failed
        cap.close()
        if not failed:
            skipped = self.skipped + cap.skipped
            with contextlib.suppress(Exception):
                sys.stderr.write(f"tensordiff: autocapture recorded {cap.state.step} training step(s) of "
                                 f"{type(cap.model).__name__} to {cap.path}; {skipped} evaluation call(s) skipped; "
                                 "hooks removed\n")

    @staticmethod
    def _remove(handles: list[Any]) -> None:
        for handle in handles:
            with contextlib.suppress(Exception):
                handle.remove()
        handles.clear()

