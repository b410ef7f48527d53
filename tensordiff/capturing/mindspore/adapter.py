"""MindSpore adapter: cell and tensor hooks that record one training step at a time (PyNative).

What is hooked, and why:

* forward pre-hooks (with kwargs) on every cell: call index, cell nesting, inputs;
* forward hooks: outputs;
* tensor hooks (``Tensor.register_hook``) on every recorded floating-point tensor: its
  gradient, in the order backward produces it. This records the same things as
  ``Cell.register_backward_hook`` (gradients of a cell's outputs and inputs) but keeps
  one record per tensor slot, like the PyTorch adapter, and does not insert the
  ``CellBackwardHook`` operation into the graph;
* the optimizer cell's forward pre-hook (when an optimizer is given): the gradients it
  receives are the step's parameter gradients; its forward hook ends the step. ``grads_at``: another cell
  whose first argument is the same gradient tuple, earlier (a wrapper's gradient clipping, so that the
  gradients are recorded before clipping, as megatron-core's are).
  Without an optimizer, pass the gradients from ``value_and_grad`` to ``step(grads=...)``.

Graph mode runs no Python hooks: ``tensordiff.capture`` takes ``graph.py``'s probes
there, and this class refuses it. Everything is removed after the last captured step or on exit.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import mindspore as ms
import numpy as np

from ...errors import UsageError
from ...frameworks.mindspore import check_pynative, dtype_name, host_view, to_numpy
from ...stats import host_stats
from ..backend import TensorBackend
from ..model_config import model_config_attr
from ..options import CaptureOptions, base_attrs, rank_path
from ..recorder import Recorder
from .parallel import layout as parallel_layout

_GRAD_DTYPES = (ms.float32, ms.float16, ms.bfloat16, ms.float64)


def _host_stats_of(t: Any) -> tuple[float, ...]:
    return host_stats(host_view(t))


def _requires_grad_now() -> bool:
    try:
        from mindspore.common.api import _pynative_executor

        return bool(_pynative_executor.requires_grad())
    except Exception:  # private API moved: hook every float tensor (hooks that never fire cost little)
        return True


class MindSporeTensors(TensorBackend):
    """Reads MindSpore tensors for the recorder (PyNative: activations reduced once, at the end of the step)."""

    def is_tensor(self, value: Any) -> bool:
        return isinstance(value, ms.Tensor)

    def describe(self, t: Any) -> tuple[str | None, tuple[int, ...]]:
        # Tensor.dtype waits for the op that makes the tensor: ask at the end of the step instead
        return (dtype_name(t.dtype) if isinstance(t, ms.Parameter) else None), tuple(int(d) for d in t.shape)

    def late_dtype(self, t: Any) -> str:
        return dtype_name(t.dtype)

    def stats(self, t: Any) -> Any:
        # PyNative dispatches ops asynchronously: reading a tensor now would wait for it and stall the
        # pipeline at every hook. Activations and gradients are kept and reduced once, at the end of the
        # step; parameters (updated in place by the optimizer) are reduced now.
        return _host_stats_of(t) if isinstance(t, ms.Parameter) else t

    def host_stats(self, pending: list[Any]) -> list[Sequence[float]]:
        return [p if isinstance(p, tuple) else _host_stats_of(p) for p in pending]

    def copy(self, t: Any) -> np.ndarray:
        return to_numpy(t)

    def to_numpy(self, copy: np.ndarray) -> np.ndarray:
        return copy

    def hook_grad(self, t: Any, fn: Any) -> Any:
        if isinstance(t, ms.Parameter) or not _requires_grad_now():
            return None
        if t.dtype not in _GRAD_DTYPES:  # an integer tensor's "gradient" (zeros a custom bprop returns): none in torch
            return None

        def hook(grad: Any) -> Any:
            fn(grad)
            return grad  # unchanged: the same tensor object goes on

        try:
            return t.register_hook(hook)
        except RuntimeError:  # "requires grad is false": ids, masks, buffers; integer tensors
            return None

    def loss_tensor(self, value: Any) -> Any:
        return value if isinstance(value, ms.Tensor) else ms.Tensor(np.float64(float(value)))

    def scalar(self, t: Any) -> float:
        return float(np.mean(to_numpy(t).astype(np.float64)))

    def perturb(self, params: Sequence[Any], seed: int) -> None:
        rng = np.random.default_rng(seed)
        for p in params:
            x = to_numpy(p)
            if x.dtype.kind != "f" or not x.size:  # numpy floats only (BF16 parameters are left as they are)
                continue
            toward = np.where(rng.integers(0, 2, x.shape).astype(bool), np.inf, -np.inf).astype(x.dtype)
            p.set_data(ms.Tensor(np.where(x == 0, x, np.nextafter(x, toward))))  # zeros stay zeros


class MindSporeCapture(Recorder):
    """Records the first ``options.steps`` training steps of ``cell``. Use via :func:`tensordiff.capture`. Without
    ``optimizer``, ``step(loss, grads)`` (or :meth:`grads`) takes the gradients ``value_and_grad`` returns."""

    framework = "mindspore"

    def __init__(self, cell: Any, options: CaptureOptions, optimizer: Any = None, meta: dict | None = None,
                 grads_at: Any = None):
        self._check_mode()
        self.cell = cell
        self.optimizer = optimizer
        #: the cell whose first argument is the step's gradients, in ``optimizer.parameters`` order
        self.grads_at = grads_at if grads_at is not None and optimizer is not None else optimizer
        rank, world = 0, 1
        try:
            from mindspore.communication import get_group_size, get_rank

            rank, world = get_rank(), get_group_size()
        except Exception:  # communication not initialised: a single process
            pass
        assert options.path is not None
        path = rank_path(options.path, rank, world)
        coords = parallel_layout()
        dist = {"parallel": json.dumps(coords, sort_keys=True)} if coords else {}
        attrs = base_attrs("mindspore", ms.__version__, options, rank=rank, world_size=world,
                           device=str(ms.get_context("device_target")).lower(), model_class=type(cell).__name__,
                           model_config=model_config_attr(cell), **dist,
                           **(meta or {}))
        params = []
        self._param_ids: dict[int, tuple[str, str]] = {}
        for full, p in cell.parameters_and_names():
            mod, _, pname = full.rpartition(".")
            params.append((mod, pname, p))
            self._param_ids[id(p)] = (mod, pname)
        classes = {name: type(c).__name__ for name, c in cell.cells_and_names()}
        super().__init__(self._backend(), options, path, attrs, params, classes)
        self._install()

    def _check_mode(self) -> None:
        check_pynative()

    def _backend(self) -> TensorBackend:
        return MindSporeTensors()

    # public API ---------------------------------------------------------------
    def grads(self, grads: Any, params: Sequence[Any] | None = None) -> None:
        """Record the step's parameter gradients: a dict name -> gradient, or a sequence matching
        ``params`` (default: ``cell.trainable_params()``, the order ``value_and_grad`` returns)."""
        if not self.active:
            return
        try:
            self._ensure_step()
            self._param_grads(self._pair_grads(grads, params))
        except Exception as err:
            self.fail(err)

    def before_step_impl(self, grads: Any, scalars: dict[str, Any]) -> None:
        """``step(loss, grads)``: the step's gradients (see :meth:`grads`) are recorded first."""
        if grads is not None:
            self.grads(grads)

    # hooks --------------------------------------------------------------------
    def _install(self) -> None:
        for name, cell in self.cell.cells_and_names():
            if getattr(cell, "_tensordiff_internal", False):
                continue  # a cell standing in for a primitive (tensordiff.compat): not one of the model's cells
            self._handles.append(cell.register_forward_pre_hook(self._make_pre_hook(name), with_kwargs=True))
            if getattr(cell, "has_bprop", False):  # MindSpore never calls a custom-bprop cell's forward hooks
                self._handles.append(_CallHook(cell, self._make_post_hook(name)))
            else:
                self._handles.append(cell.register_forward_hook(self._make_post_hook(name)))
        if self.optimizer is not None:
            self._handles.append(self.grads_at.register_forward_pre_hook(self._grads_pre_hook))
            self._handles.append(self.optimizer.register_forward_hook(self._optimizer_post_hook))

    def _make_pre_hook(self, name: str) -> Any:
        def pre_hook(cell: Any, args: tuple, kwargs: dict) -> None:
            self.on_call(name, args, kwargs)

        return pre_hook

    def _make_post_hook(self, name: str) -> Any:
        def post_hook(cell: Any, args: tuple, output: Any) -> None:
            self.on_return(name, output)

        return post_hook

    def _grads_pre_hook(self, cell: Any, args: tuple) -> None:
        if self.state.wants_grads and args:
            try:
                self._param_grads(self._pair_grads(args[0], list(self.optimizer.parameters)))
            except Exception as err:
                self.fail(err)
        return None

    def _optimizer_post_hook(self, optimizer: Any, args: tuple, output: Any) -> None:
        self.optimizer_step_end()
        return None

    def _pair_grads(self, grads: Any, params: Sequence[Any] | None) -> list[tuple[str, str, Any]]:
        if isinstance(grads, dict):
            by_name = {f"{m}.{n}" if m else n: (m, n) for m, n, _ in self._params}
            by_param_name = {p.name: (m, n) for m, n, p in self._params}
            out = []
            for key, grad in grads.items():
                where = by_name.get(key) or by_param_name.get(key)
                if where is None:
                    raise UsageError(f"gradient for {key!r}: no such parameter in {type(self.cell).__name__}")
                out.append((where[0], where[1], grad))
            return out
        params = list(params) if params is not None else list(self.cell.trainable_params())
        grads = list(grads)
        if len(grads) != len(params):
            raise UsageError(f"{len(grads)} gradients for {len(params)} parameters: pass params= in the order "
                             "value_and_grad used")
        out = []
        for p, grad in zip(params, grads):
            where = self._param_ids.get(id(p))
            if where is None:  # a parameter outside the captured cell (or a copy): keep its own name
                mod, _, pname = p.name.rpartition(".")
                where = (mod, pname)
            out.append((where[0], where[1], grad))
        return out


class _CallHook:
    """The forward hook of a cell with a custom ``bprop`` (MindFormers' loss cells), which MindSpore's PyNative never
    calls: the cell gets a subclass of its class (``bprop`` and all inherited) whose ``__call__`` calls the hook on
    what the call returns (the tensor the caller gets, so a gradient hook on it fires), until ``remove()`` puts the
    class back, as a hook handle is removed."""

    def __init__(self, cell: Any, post_hook: Any):
        self.cell, self.original = cell, type(cell)

        class WithForwardHook(self.original):  # type: ignore[name-defined]
            def __call__(self, *args: Any, **kwargs: Any) -> Any:
                out = super().__call__(*args, **kwargs)
                post_hook(self, args, out)
                return out

        WithForwardHook.__name__ = WithForwardHook.__qualname__ = self.original.__name__
        WithForwardHook.__module__ = self.original.__module__
        cell.__class__ = WithForwardHook

    def remove(self) -> None:
        self.cell.__class__ = self.original
