"""PyTorch adapter: module and tensor hooks that record one training step at a time.

What is hooked, and why:

* forward pre-hooks (with kwargs) on every module: call index, module nesting, inputs;
* forward hooks: outputs;
* gradient hooks on every recorded non-leaf tensor that requires grad (a pre-hook on the
  autograd node that computes its gradient): its gradient, in the order backward
  produces it. Full module backward hooks are not used: they
  wrap outputs in views and break models that modify outputs in place
  (Megatron's cross-entropy does), which would crash the run being observed;
* optimizer step pre/post hooks (when an optimizer is given): parameter gradients
  before the update, then the end of the step.

Statistics are reduced on the tensor's device in float64 and brought to the host
once per step; full tensors are copied at hook time (the model may later change
them in place). Everything is removed after the last captured step or on exit.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np
import torch

from ..._warn import warn as _warn
from ...frameworks.torch import dtype_name, to_numpy
from ..backend import TensorBackend
from ..model_config import model_config_attr
from ..options import CaptureOptions, base_attrs, rank_path
from ..recorder import Recorder
from . import parallel
from .copies import HostCopier, HostCopy
from .dp import LocalGrads, data_parallel_size
from .stats import StatsCollector


class TorchTensors(TensorBackend):
    """Reads torch tensors for the recorder: fused statistics on the tensor's device, brought to the host once per
    step (``stats.py``); full tensors staged on the device and moved to the host by a background
    thread (``copies.py``)."""

    def __init__(self) -> None:
        self._stats = StatsCollector()
        self._copier = HostCopier()
        self.stats = self._stats.add  # type: ignore[method-assign]  # called per record: one Python frame less

    def is_tensor(self, value: Any) -> bool:
        return isinstance(value, torch.Tensor)

    def describe(self, t: torch.Tensor) -> tuple[str, tuple[int, ...]]:
        return dtype_name(t.dtype), t.shape  # torch.Size is a tuple

    def stats(self, t: torch.Tensor) -> Any:
        return self._stats.add(t)

    def host_stats(self, pending: list[Any]) -> np.ndarray:
        return self._stats.collect(pending)

    def copy(self, t: torch.Tensor) -> HostCopy:
        return self._copier.copy(t)

    def to_numpy(self, copy: HostCopy) -> np.ndarray:
        return to_numpy(copy.result())

    def copy_ready(self, copy: HostCopy) -> bool:
        return not copy.from_device  # a GPU's tensors follow their step (training never pipes them itself)

    def close(self) -> None:
        self._copier.close()

    def version(self, t: torch.Tensor) -> int:
        return t._version

    def alias_key(self, t: torch.Tensor, untracked: bool = False) -> Any:
        if (untracked and t.grad_fn is not None) or t.numel() == 0:
            return None
        try:
            return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)
        except Exception:  # no storage (meta, fake or functional tensors)
            return None

    def hook_grad(self, t: torch.Tensor, fn: Any) -> Any:
        """A pre-hook on the node that will compute ``t``'s gradient, reading that gradient (its ``output_nr``) and
        returning None (nothing changed). A tensor hook (``t.register_hook``) runs on the same node with the same
        gradient, but builds the tensor's hook dictionary and handle in Python first (~1 µs more a record). As with
        a tensor hook, one registered before ``t`` is modified in place stays on the old node."""
        node = t.grad_fn
        if node is None or not t.requires_grad or not torch.is_grad_enabled():
            return None
        return node.register_prehook(partial(_nth_grad, t.output_nr, fn))

    def loss_tensor(self, value: Any) -> torch.Tensor:
        if isinstance(value, torch.Tensor):  # a copy: its value is read at the end of the step, after the device's work
            return value.detach().clone()
        return torch.tensor(float(value), dtype=torch.float64)

    def scalar(self, t: torch.Tensor) -> float:
        return float(t.double().mean())

    def perturb(self, params: Sequence[Any], seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in params:
                if p.is_floating_point() and p.numel():
                    up = torch.randint(0, 2, p.shape, generator=g).to(p.device).bool()
                    toward = torch.where(up, torch.full_like(p, math.inf), torch.full_like(p, -math.inf))
                    p.copy_(torch.where(p == 0, p, torch.nextafter(p, toward)))  # zeros stay zeros (no denormals)


def _nth_grad(index: int, fn: Any, grad_outputs: Sequence[Any]) -> None:
    """A node pre-hook (``hook_grad``): ``fn`` given the gradient of the node's output ``index``."""
    fn(grad_outputs[index] if index < len(grad_outputs) else None)


def _distributed_attrs(model: torch.nn.Module) -> dict[str, Any]:
    """``parallel`` (this rank's coordinates) and ``param_splits`` (how megatron split each parameter), when known."""
    out: dict[str, Any] = {}
    coords = parallel.layout(model)
    if coords:
        out["parallel"] = json.dumps(coords, sort_keys=True)
        splits = parallel.param_splits(model)
        if splits:
            out["param_splits"] = json.dumps(splits, sort_keys=True)
    return out


def _device(model: torch.nn.Module) -> str:
    """Where the model computes: 'cpu', or the accelerator and its name ('cuda NVIDIA H200')."""
    for p in model.parameters():
        if p.device.type == "cuda":
            return f"cuda {torch.cuda.get_device_name(p.device)}"
        if p.device.type not in ("cpu", "meta"):
            return p.device.type
    return "cpu"


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
        attrs = base_attrs("torch", torch.__version__, options, rank=rank, world_size=world, device=_device(model),
                           model_class=type(model).__name__, model_config=model_config_attr(model),
                           **_distributed_attrs(model), **(meta or {}))
        params = []
        for full, p in model.named_parameters():
            mod, _, pname = full.rpartition(".")
            params.append((mod, pname, p))
        classes = {name: type(m).__name__ for name, m in model.named_modules()}
        super().__init__(TorchTensors(), options, path, attrs, params, classes)
        self._grad_snapshots: dict[int, torch.Tensor] = {}
        self._local: LocalGrads | None = None
        self._grad_shards: dict[str, list[Any]] = {}  # the step's parameter -> [start, end, shape] (_sharded_grads)
        self._install()

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
        self._install_local_grads()

    def _install_local_grads(self) -> None:
        dp = data_parallel_size(self.model)
        if dp > 1:  # the gradients before the data-parallel reduction: kind grad_local (dp.py)
            try:
                self._local = LocalGrads(self.model, self._params, dp, lambda: self.state.recording, self.fail)
            except Exception as err:  # the rest of the capture goes on without them
                with contextlib.suppress(Exception):  # warnings turned into errors (-W error) must not reach the run
                    _warn(f"tensordiff: gradients before the data-parallel reduction not recorded "
                                  f"({type(err).__name__}: {err}); the capture goes on")

    def _pre_hook(self, name: str, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        self.on_call(name, args, kwargs)

    def _post_hook(self, name: str, module: torch.nn.Module, args: tuple, output: Any) -> None:
        self.on_return(name, output)

    def _accumulated_hook(self, p: torch.Tensor) -> None:
        if self.state.recording and p.grad is not None:
            try:
                self._grad_snapshots[id(p)] = p.grad.detach().clone()
            except Exception as err:
                self.fail(err)

    def _optimizer_pre_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.optimizer_step_begin(optimizer)

    def _optimizer_post_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.optimizer_step_end()

    # the recorder's hooks -------------------------------------------------------
    def reset_step_impl(self) -> None:
        self._grad_snapshots = {}
        self._grad_shards = {}
        local = getattr(self, "_local", None)
        if local is not None:
            local.forget()

    def param_grads_impl(self, grads: Sequence[tuple[str, str, Any]]) -> None:
        if self._local is not None:  # before the reduction, then after it (grad)
            # stored at every step unless --tensors none: a data-parallel mean of local gradients (the merged run's)
            # has no statistics without the tensors (store/merged.py)
            full = self.options.tensors != "none"
            for mod, pname, grad in self._local.take():
                self._record("param_grad", "grad_local", mod, 0, pname, self._classes.get(mod, ""), grad, track=False,
                             full=full)
            if self._local.sharded:  # after the reduction each rank holds only its shard of each: that part
                self._sharded_grads(grads)
                return
        super().param_grads_impl(grads)

    def _sharded_grads(self, grads: Sequence[tuple[str, str, Any]]) -> None:
        """Megatron's distributed optimizer: each parameter's reduced gradient as far as this rank holds it, a 1-D
        record of the flattened elements [start, end) it owns (empty where it owns none), kind ``grad``; the step
        attribute ``grad_shards`` says which part and the parameter's shape, and the merge of the DP ranks' files
        puts the parts together (store/merged.py)."""
        assert self._local is not None
        ids = {(mod, pname): id(p) for mod, pname, p in self._params}
        shards: dict[str, list[Any]] = {}
        for mod, pname, grad in grads:
            if grad is None:
                continue
            lo, hi = self._local.owned.get(ids.get((mod, pname), -1), (0, 0))
            shards[f"{mod}.{pname}" if mod else pname] = [lo, hi, list(grad.shape)]
            self._record("param_grad", "grad", mod, 0, pname, self._classes.get(mod, ""),
                         grad.detach().reshape(-1)[lo:hi], track=False)
        self._grad_shards = shards

    def step_attrs_impl(self) -> dict[str, Any]:
        out = super().step_attrs_impl()
        if self._local is not None:
            out["grad_reduction"] = json.dumps(self._local.info(), sort_keys=True)
            if self._local.sharded and self._grad_shards:
                out["grad_shards"] = json.dumps(self._grad_shards, sort_keys=True)
        return out

    def remove_hooks_impl(self) -> None:
        if self._local is not None:
            self._local.remove()

    def take_param_grads_impl(self) -> None:
        grads = []
        for mod, pname, p in self._params:
            grad = getattr(p, "main_grad", None)
            if grad is None:
                grad = p.grad
            if grad is None:
                grad = self._grad_snapshots.get(id(p))
            grads.append((mod, pname, grad))
        self._param_grads(grads)
