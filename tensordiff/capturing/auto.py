"""Capture a PyTorch training program that does not call tensordiff itself.

Used by ``hooks/torch_autocapture.py``. It registers torch's *global* module and
optimizer hooks (public torch APIs, no patching), takes the first module with
parameters that runs as the model, captures it like ``tensordiff.capture`` would, and
ends a step after each optimizer step. All global hooks are removed once the model
is found and when the program ends. The loss is not known in this mode.
"""

from __future__ import annotations

import atexit
import warnings
from typing import Any

import torch
import torch.optim.optimizer as _optim

from .options import options_from_env
from .torch import TorchCapture


class AutoCapture:
    """Finds the model and the steps of a PyTorch program through torch's global hooks."""

    def __init__(self) -> None:
        self.options = options_from_env(None, None, None)
        self.capture: TorchCapture | None = None
        self._handles: list[Any] = []

    def install(self) -> bool:
        if self.options is None:
            return False
        self._handles = [
            torch.nn.modules.module.register_module_forward_pre_hook(self._module_pre),
            _optim.register_optimizer_step_pre_hook(self._optimizer_pre),
            _optim.register_optimizer_step_post_hook(self._optimizer_post),
        ]
        atexit.register(self.close)
        return True

    def _module_pre(self, module: torch.nn.Module, args: tuple) -> None:
        if self.capture is not None or next(module.parameters(), None) is None:
            return None
        self._handles.pop(0).remove()  # the model is found: no more global module hooks
        try:
            self.capture = TorchCapture(module, self.options)  # type: ignore[arg-type]
            # this call's own pre-hooks were collected before ours were added: run ours by hand
            self.capture._pre_hook("", module, args, {})
        except Exception as err:
            warnings.warn(f"tensordiff: autocapture not started ({err}); training goes on", RuntimeWarning, stacklevel=2)
        return None

    def _optimizer_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.capture is not None:
            self.capture._optimizer_pre_hook(optimizer, args, kwargs)

    def _optimizer_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.capture is not None:
            self.capture._optimizer_post_hook(optimizer, args, kwargs)
            if not self.capture.active:
                self.close()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self.capture is not None:
            self.capture.close()
