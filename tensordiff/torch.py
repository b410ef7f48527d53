"""PyTorch adapter: module and tensor hooks that record one training step at a time.

What is hooked, and why:

* forward pre-hooks (with kwargs) on every module: call index, module nesting, inputs;
* forward hooks: outputs;
* tensor hooks on every recorded non-leaf tensor that requires grad: its gradient,
  in the order backward produces it. Full module backward hooks are not used: they
  wrap outputs in views and break models that modify outputs in place
  (Megatron's cross-entropy does), which would crash the run being observed;
* optimizer step pre/post hooks (when an optimizer is given): parameter gradients
  before the update, then the end of the step.

Statistics are reduced on the tensor's device in float64 and brought to the host
once per step; full tensors are copied at hook time (the model may later change
them in place). Everything is removed after the last captured step or on exit.
"""

from __future__ import annotations

import math
from collections import defaultdict
from functools import partial
from typing import Any, Sequence

import ml_dtypes
import numpy as np
import torch

from ._capture_common import CaptureOptions, base_attrs, rank_path
from ._recorder import Recorder, flatten

_NUMPY_VIEW = {
    torch.bfloat16: (torch.int16, ml_dtypes.bfloat16),
    torch.float8_e4m3fn: (torch.uint8, ml_dtypes.float8_e4m3fn),
    torch.float8_e5m2: (torch.uint8, ml_dtypes.float8_e5m2),
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor as a numpy array of the same width (BF16 -> ml_dtypes.bfloat16)."""
    view = _NUMPY_VIEW.get(t.dtype)
    if view is not None:
        return t.view(view[0]).numpy().view(view[1])
    return t.numpy()


def reduce_stats(t: torch.Tensor) -> torch.Tensor:
    """[min, max, sum, l2, nan, inf] in float64, computed on the tensor's device."""
    x = t.detach()
    if x.numel() == 0:
        return torch.zeros(6, dtype=torch.float64, device=x.device)
    if x.is_complex():
        x = torch.view_as_real(x)
    if not x.is_floating_point():
        x = x.to(torch.float64)
    mn, mx = torch.aminmax(x)
    if x.device.type == "cpu":
        # CPU: branching costs no device sync, and float64 BLAS beats the reductions' dtype path
        d = x.reshape(-1).to(torch.float64)
        finite = bool(torch.isfinite(mn)) and bool(torch.isfinite(mx))
        zero = torch.zeros((), dtype=torch.float64)
        return torch.stack(
            [
                mn.to(torch.float64),
                mx.to(torch.float64),
                d.sum(),
                torch.dot(d, d).sqrt() if finite else torch.linalg.vector_norm(d),
                zero if finite else torch.isnan(d).sum().to(torch.float64),
                zero if finite else torch.isinf(d).sum().to(torch.float64),
            ]
        )
    return torch.stack(
        [
            mn.to(torch.float64),
            mx.to(torch.float64),
            x.sum(dtype=torch.float64),
            torch.linalg.vector_norm(x, dtype=torch.float64),
            torch.isnan(x).sum().to(torch.float64),
            torch.isinf(x).sum().to(torch.float64),
        ]
    )


class TorchCapture(Recorder):
    """Records the first ``options.steps`` training steps of ``model``. Use via :func:`tensordiff.capture`."""

    framework = "torch"

    def __init__(self, model: torch.nn.Module, options: CaptureOptions, optimizer: Any = None, meta: dict | None = None):
        self.model = model
        self.optimizer = optimizer
        rank, world = 0, 1
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        assert options.path is not None
        path = rank_path(options.path, rank, world)
        attrs = base_attrs("torch", torch.__version__, options, rank=rank, world_size=world,
                           model_class=type(model).__name__, **(meta or {}))
        params = []
        for full, p in model.named_parameters():
            mod, _, pname = full.rpartition(".")
            params.append((mod, pname, p))
        classes = {name: type(m).__name__ for name, m in model.named_modules()}
        super().__init__(options, path, attrs, params, classes)
        self._grad_snapshots: dict[int, torch.Tensor] = {}
        self._install()

    # tensors ------------------------------------------------------------------
    def _is_tensor(self, value: Any) -> bool:
        return isinstance(value, torch.Tensor)

    def _describe(self, t: torch.Tensor) -> tuple[str, tuple[int, ...]]:
        return dtype_name(t.dtype), tuple(t.shape)

    def _stats(self, t: torch.Tensor) -> torch.Tensor:
        return reduce_stats(t)

    def _host_stats(self, pending: list[torch.Tensor]) -> list[Sequence[float]]:
        # one host sync per device for the whole step
        out: list[Sequence[float]] = [()] * len(pending)
        by_device: dict[torch.device, list[int]] = defaultdict(list)
        for i, stats in enumerate(pending):
            by_device[stats.device].append(i)
        for indices in by_device.values():
            host = torch.stack([pending[i] for i in indices]).cpu().numpy()
            for i, values in zip(indices, host):
                out[i] = values.tolist()
        return out

    def _copy(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu", copy=True)

    def _to_numpy(self, copy: torch.Tensor) -> np.ndarray:
        return to_numpy(copy)

    def _version(self, t: torch.Tensor) -> int:
        return t._version

    def _hook_grad(self, t: torch.Tensor, fn: Any) -> Any:
        if t.requires_grad and t.grad_fn is not None and torch.is_grad_enabled():
            return t.register_hook(fn)
        return None

    def _loss_tensor(self, value: Any) -> torch.Tensor:
        return value.detach() if isinstance(value, torch.Tensor) else torch.tensor(float(value), dtype=torch.float64)

    def _scalar(self, t: torch.Tensor) -> float:
        return float(t.double().mean())

    # hooks --------------------------------------------------------------------
    def _install(self) -> None:
        for name, module in self.model.named_modules():
            self._handles.append(module.register_forward_pre_hook(partial(self._pre_hook, name), with_kwargs=True))
            self._handles.append(module.register_forward_hook(partial(self._post_hook, name)))
        if self.optimizer is not None:
            self._handles.append(self.optimizer.register_step_pre_hook(self._optimizer_pre_hook))
            self._handles.append(self.optimizer.register_step_post_hook(self._optimizer_post_hook))
        else:
            # no optimizer to tell us when gradients are final: keep the last accumulated value,
            # since zero_grad() may clear .grad before the step ends
            for _, _, p in self._params:
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._accumulated_hook))

    def _pre_hook(self, name: str, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        self._on_call(name, args, kwargs)

    def _post_hook(self, name: str, module: torch.nn.Module, args: tuple, output: Any) -> None:
        self._on_return(name, output)

    def _accumulated_hook(self, p: torch.Tensor) -> None:
        if self.active and self._in_step and p.grad is not None:
            try:
                self._grad_snapshots[id(p)] = p.grad.detach().clone()
            except Exception as err:
                self._fail(err)

    def _optimizer_pre_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.active and self._in_step and not self._grads_taken:
            try:
                self._take_param_grads()
            except Exception as err:
                self._fail(err)

    def _optimizer_post_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.active and self._in_step:
            self._step_ready = True

    def _perturb(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for _, _, p in self._params:
                if p.is_floating_point() and p.numel():
                    up = torch.randint(0, 2, p.shape, generator=g).to(p.device).bool()
                    toward = torch.where(up, torch.full_like(p, math.inf), torch.full_like(p, -math.inf))
                    p.copy_(torch.where(p == 0, p, torch.nextafter(p, toward)))  # zeros stay zeros (no denormals)

    def _reset_step(self) -> None:
        super()._reset_step()
        self._grad_snapshots = {}

    def _take_param_grads(self) -> None:
        grads = []
        for mod, pname, p in self._params:
            grad = getattr(p, "main_grad", None)
            if grad is None:
                grad = p.grad
            if grad is None:
                grad = self._grad_snapshots.get(id(p))
            grads.append((mod, pname, grad))
        self._param_grads(grads)


def _from_numpy(x: np.ndarray) -> torch.Tensor:
    """The inverse of ``to_numpy``: ml_dtypes arrays come back as torch BF16/FP8 through their raw bits."""
    x = np.ascontiguousarray(x)
    for torch_dtype, (_, np_dtype) in _NUMPY_VIEW.items():
        if x.dtype == np_dtype:
            bits = np.uint16 if x.dtype.itemsize == 2 else np.uint8
            return torch.from_numpy(x.view(bits)).view(torch_dtype)
    return torch.from_numpy(x)


def replay_call(model: torch.nn.Module, module_name: str, inputs: list[tuple[str, np.ndarray]],
                weights: dict[str, np.ndarray]) -> np.ndarray:
    """Call ``module_name`` of ``model`` with captured inputs and weights; its output.0 as numpy (``tensordiff replay``)."""
    sub = model.get_submodule(module_name) if module_name else model
    first = next(sub.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    with torch.no_grad():
        params = dict(sub.named_parameters())
        for name, value in weights.items():
            if name in params:
                params[name].copy_(_from_numpy(value).to(params[name].device))
    positional: dict[int, torch.Tensor] = {}
    kwargs: dict[str, torch.Tensor] = {}
    for slot, x in inputs:
        t = _from_numpy(x).to(device)
        if slot.isdigit():
            positional[int(slot)] = t
        elif "." not in slot:
            kwargs[slot] = t
    args = [positional.get(i) for i in range(max(positional) + 1)] if positional else []
    with torch.no_grad():
        out = sub(*args, **kwargs)
    for _, t in flatten(out, "", lambda v: isinstance(v, torch.Tensor)):
        return to_numpy(t.detach().to("cpu"))
    raise ValueError(f"{module_name} returned no tensor")
