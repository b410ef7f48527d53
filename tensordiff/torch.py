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

import time
import warnings
import weakref
from collections import defaultdict
from functools import partial
from typing import Any, Iterator

import ml_dtypes
import numpy as np
import torch

from ._capture_common import CaptureOptions, base_attrs, rank_path
from .store import CaptureWriter, shape_text

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


def _flatten(value: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(slot, tensor) pairs of a nested output or argument structure."""
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _flatten(item, f"{prefix}.{i}" if prefix else str(i))
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _flatten(item, f"{prefix}.{key}" if prefix else str(key))


class TorchCapture:
    """Records the first ``options.steps`` training steps of ``model``. Use via :func:`tensordiff.capture`."""

    def __init__(self, model: torch.nn.Module, options: CaptureOptions, optimizer: Any = None, meta: dict | None = None):
        self.model = model
        self.options = options
        self.optimizer = optimizer
        rank, world = 0, 1
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        assert options.path is not None
        self.path = rank_path(options.path, rank, world)
        attrs = base_attrs("torch", torch.__version__, options, rank=rank, world_size=world,
                           model_class=type(model).__name__, **(meta or {}))
        self._writer = CaptureWriter(self.path, attrs, background=options.background)
        self._names = {id(m): name for name, m in model.named_modules()}
        self._classes = {name: type(m).__name__ for name, m in model.named_modules()}
        self._params: list[tuple[str, str, torch.nn.Parameter]] = []
        for full, p in model.named_parameters():
            mod, _, pname = full.rpartition(".")
            self._params.append((mod, pname, p))
        self._handles: list[Any] = []
        self._tensor_handles: list[Any] = []
        self._step = 0
        self._step_id = 0
        self._in_step = False
        self._step_ready = False
        self._done = False
        self._failed = False
        self._grads_taken = False
        self._reset_step()
        self._install()

    # public API ---------------------------------------------------------------
    @property
    def active(self) -> bool:
        return not (self._done or self._failed)

    def __enter__(self) -> "TorchCapture":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def loss(self, value: Any) -> None:
        """Record the loss of the step in flight (a tensor or a number)."""
        if not self.active:
            return
        try:
            self._ensure_step()
            t = value.detach() if isinstance(value, torch.Tensor) else torch.tensor(float(value), dtype=torch.float64)
            self._loss = t
            self._record("loss", "loss", "loss", 0, "value", "Loss", t, full=True)
        except Exception as err:
            self._fail(err)

    def step(self, loss: Any = None) -> None:
        """End the step in flight (recording ``loss`` first, if given)."""
        if loss is not None:
            self.loss(loss)
        if not self.active:
            return
        try:
            self._end_step()
        except Exception as err:
            self._fail(err)

    def close(self) -> None:
        """Finish the step in flight, remove every hook, close the file."""
        if self._in_step and not self._failed:
            try:
                self._end_step()
            except Exception as err:
                self._fail(err)
        self._remove_hooks()
        self._writer.close()

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

    def _remove_hooks(self) -> None:
        for handle in self._handles + self._tensor_handles:
            handle.remove()
        self._handles.clear()
        self._tensor_handles.clear()

    def _fail(self, err: BaseException) -> None:
        if not self._failed:
            warnings.warn(
                f"tensordiff: capture stopped ({type(err).__name__}: {err}); hooks removed, training goes on; "
                f"completed steps are in {self.path}",
                RuntimeWarning,
                stacklevel=3,
            )
        self._failed = True
        self._in_step = False
        self._remove_hooks()

    def _pre_hook(self, name: str, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if not self.active:
            return None
        try:
            if not self._stack and name == "":
                if self._step_ready:
                    self._end_step()
                    if not self.active:
                        return None
            self._ensure_step()
            call = self._calls[name]
            self._calls[name] += 1
            enter = self._seq
            parent = self._stack[-1][0] if self._stack else ""
            self._stack.append((name, call, enter, parent))
            if self.options.inputs:
                for slot, t in _flatten(list(args), ""):
                    self._record("forward", "input", name, call, slot, self._classes.get(name, ""), t,
                                 enter=enter, parent=parent, grad_kind="grad_input")
                for slot, t in _flatten(kwargs, ""):
                    self._record("forward", "input", name, call, slot, self._classes.get(name, ""), t,
                                 enter=enter, parent=parent, grad_kind="grad_input")
        except Exception as err:
            self._fail(err)
        return None

    def _post_hook(self, name: str, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if not self.active or not self._in_step:
            return None
        try:
            while self._stack and self._stack[-1][0] != name:
                self._stack.pop()  # a child raised; drop its frame
            if not self._stack:
                return None
            _, call, enter, parent = self._stack.pop()
            for slot, t in _flatten(output, ""):
                self._record("forward", "output", name, call, slot or "0", self._classes.get(name, ""), t,
                             enter=enter, parent=parent, grad_kind="grad_output")
        except Exception as err:
            self._fail(err)
        return None

    def _grad_hook(self, step_id: int, fwd: dict, grad: torch.Tensor) -> None:
        if not self.active or step_id != self._step_id or grad is None:
            return None
        try:
            self._record("backward", fwd["grad_kind"], fwd["module"], fwd["call"], fwd["slot"], fwd["module_class"],
                         grad, enter=fwd["enter"], parent=fwd["parent"], grad_of=fwd["seq"], track=False)
        except Exception as err:
            self._fail(err)
        return None

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

    # step bookkeeping -----------------------------------------------------------
    def _reset_step(self) -> None:
        self._seq = 0
        self._rows: list[dict[str, Any]] = []
        self._pending: list[tuple[int, torch.Tensor]] = []
        self._data: dict[int, torch.Tensor] = {}
        self._seen: dict[int, tuple[Any, int, int]] = {}
        self._stack: list[tuple[str, int, int, str]] = []
        self._calls: dict[str, int] = defaultdict(int)
        self._loss: torch.Tensor | None = None
        self._grad_snapshots: dict[int, torch.Tensor] = {}
        self._grads_taken = False
        self._step_ready = False
        self._t0 = time.perf_counter()

    def _ensure_step(self) -> None:
        if self._in_step:
            return
        self._reset_step()
        self._in_step = True
        self._step_id += 1
        self._full = self.options.full_tensors_at(self._step)
        for mod, pname, p in self._params:
            self._record("weights", "param", mod, 0, pname, self._classes.get(mod, ""), p, track=False)

    def _take_param_grads(self) -> None:
        self._grads_taken = True
        for mod, pname, p in self._params:
            grad = getattr(p, "main_grad", None)
            if grad is None:
                grad = p.grad
            if grad is None:
                grad = self._grad_snapshots.get(id(p))
            if grad is not None:
                self._record("param_grad", "grad", mod, 0, pname, self._classes.get(mod, ""), grad, track=False)

    def _record(self, phase: str, kind: str, module: str, call: int, slot: str, module_class: str, t: torch.Tensor, *,
                enter: int = -1, parent: str = "", grad_of: int = -1, grad_kind: str = "", track: bool = True,
                full: bool | None = None) -> int:
        seq = self._seq
        self._seq += 1
        row: dict[str, Any] = {
            "seq": seq, "phase": phase, "module": module, "call": call, "kind": kind, "slot": slot,
            "module_class": module_class, "dtype": dtype_name(t.dtype), "shape": shape_text(t.shape),
            "min": 0.0, "max": 0.0, "mean": 0.0, "l2": 0.0, "nan": 0, "inf": 0, "numel": t.numel(),
            "has_data": 0, "same_as": -1, "grad_of": grad_of, "enter": enter, "parent": parent,
        }
        self._rows.append(row)
        seen = self._seen.get(id(t)) if track else None
        if seen is not None and seen[0]() is t and seen[1] == t._version:
            row["same_as"] = seen[2]
            return seq
        self._pending.append((seq, reduce_stats(t)))
        if self._full if full is None else full:
            self._data[seq] = t.detach().to("cpu", copy=True)
            row["has_data"] = 1
        if track:
            self._seen[id(t)] = (weakref.ref(t), t._version, seq)
            if self.options.grads and grad_kind and t.requires_grad and t.grad_fn is not None and torch.is_grad_enabled():
                fwd = {"seq": seq, "module": module, "call": call, "slot": slot, "module_class": module_class,
                       "enter": enter, "parent": parent, "grad_kind": grad_kind}
                self._tensor_handles.append(t.register_hook(partial(self._grad_hook, self._step_id, fwd)))
        return seq

    def _end_step(self) -> None:
        if not self._in_step:
            return
        if not self._grads_taken:
            self._take_param_grads()
        for handle in self._tensor_handles:
            handle.remove()
        self._tensor_handles.clear()
        rows = self._rows
        # one host sync per device for the whole step
        by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = defaultdict(list)
        for seq, stats in self._pending:
            by_device[stats.device].append((seq, stats))
        for items in by_device.values():
            host = torch.stack([s for _, s in items]).cpu().numpy()
            for (seq, _), values in zip(items, host):
                row = rows[seq]
                mn, mx, total, l2, nan, inf = values.tolist()
                row.update(min=mn, max=mx, mean=total / row["numel"] if row["numel"] else 0.0, l2=l2,
                           nan=int(nan), inf=int(inf))
        for row in rows:
            if row["same_as"] >= 0:
                src = rows[row["same_as"]]
                for key in ("min", "max", "mean", "l2", "nan", "inf", "has_data"):
                    row[key] = src[key]
        data = {seq: to_numpy(t) for seq, t in self._data.items()}
        attrs: dict[str, Any] = {"wall_time": time.perf_counter() - self._t0}
        if self._loss is not None:
            attrs["loss"] = float(self._loss.double().mean())
        self._writer.submit(self._step, rows, data, attrs)
        self._step += 1
        self._in_step = False
        self._reset_step()
        if self._step >= self.options.steps:
            self._done = True
            self._remove_hooks()
