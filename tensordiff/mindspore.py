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
  receives are the step's parameter gradients; its forward hook ends the step.
  Without an optimizer, pass the gradients from ``value_and_grad`` to ``step(grads=...)``.

Graph mode cannot run Python hooks: capture refuses it with a message pointing to
PyNative. Everything is removed after the last captured step or on exit.
"""

from __future__ import annotations

from typing import Any, Sequence

import ml_dtypes
import mindspore as ms
import numpy as np

from ._capture_common import CaptureOptions, base_attrs, rank_path
from ._recorder import Recorder
from .errors import UsageError


def dtype_name(dtype: Any) -> str:
    """MindSpore dtype -> tensordiff's name ('Float32' -> 'float32', 'BFloat16' -> 'bfloat16')."""
    return str(dtype).lower()


def to_numpy(t: Any) -> np.ndarray:
    """A host copy of a MindSpore tensor, same width (BF16 -> ml_dtypes.bfloat16 bits)."""
    if t.dtype == ms.bfloat16:
        return np.array(t.view(ms.int16).asnumpy(), copy=True).view(ml_dtypes.bfloat16)
    return np.array(t.asnumpy(), copy=True)


def numpy_stats(x: np.ndarray) -> tuple[float, float, float, float, float, float]:
    """[min, max, sum, l2, nan, inf] in float64."""
    if x.size == 0:
        return (0.0,) * 6  # type: ignore[return-value]
    if x.dtype == np.bool_ or x.dtype.kind in "iu":
        d = x.reshape(-1).astype(np.float64)
        return float(d.min()), float(d.max()), float(d.sum()), float(np.sqrt(np.dot(d, d))), 0.0, 0.0
    d = x.reshape(-1).astype(np.float64)
    finite = np.isfinite(d)
    if finite.all():
        return float(d.min()), float(d.max()), float(d.sum()), float(np.sqrt(np.dot(d, d))), 0.0, 0.0
    nan = float(np.isnan(d).sum())
    inf = float(np.isinf(d).sum())
    with np.errstate(invalid="ignore", over="ignore"):
        return float(np.nanmin(d)), float(np.nanmax(d)), float(d.sum()), float(np.linalg.norm(d)), nan, inf


def _host_view_stats(t: Any) -> tuple[float, ...]:
    x = t.view(ms.int16).asnumpy().view(ml_dtypes.bfloat16) if t.dtype == ms.bfloat16 else t.asnumpy()
    return numpy_stats(x)


def check_pynative() -> None:
    """Python hooks only run in PyNative mode: refuse graph mode with the fix."""
    if ms.get_context("mode") != ms.PYNATIVE_MODE:
        raise UsageError(
            "MindSpore is in GRAPH_MODE, where Python hooks do not run; capture needs PyNative: call "
            "mindspore.set_context(mode=mindspore.PYNATIVE_MODE) before building the model"
        )


def _requires_grad_now() -> bool:
    try:
        from mindspore.common.api import _pynative_executor

        return bool(_pynative_executor.requires_grad())
    except Exception:  # private API moved: hook every float tensor (hooks that never fire cost little)
        return True


class MindSporeCapture(Recorder):
    """Records the first ``options.steps`` training steps of ``cell``. Use via :func:`tensordiff.capture`."""

    framework = "mindspore"

    def __init__(self, cell: Any, options: CaptureOptions, optimizer: Any = None, meta: dict | None = None):
        check_pynative()
        self.cell = cell
        self.optimizer = optimizer
        rank, world = 0, 1
        try:
            from mindspore.communication import get_group_size, get_rank

            rank, world = get_rank(), get_group_size()
        except Exception:  # communication not initialised: a single process
            pass
        assert options.path is not None
        path = rank_path(options.path, rank, world)
        attrs = base_attrs("mindspore", ms.__version__, options, rank=rank, world_size=world,
                           model_class=type(cell).__name__, **(meta or {}))
        params = []
        self._param_ids: dict[int, tuple[str, str]] = {}
        for full, p in cell.parameters_and_names():
            mod, _, pname = full.rpartition(".")
            params.append((mod, pname, p))
            self._param_ids[id(p)] = (mod, pname)
        classes = {name: type(c).__name__ for name, c in cell.cells_and_names()}
        super().__init__(options, path, attrs, params, classes)
        self._install()

    # tensors ------------------------------------------------------------------
    def _is_tensor(self, value: Any) -> bool:
        return isinstance(value, ms.Tensor)

    def _describe(self, t: Any) -> tuple[str | None, tuple[int, ...]]:
        # Tensor.dtype waits for the op that makes the tensor: ask at the end of the step instead
        return (dtype_name(t.dtype) if isinstance(t, ms.Parameter) else None), tuple(int(d) for d in t.shape)

    def _late_dtype(self, t: Any) -> str:
        return dtype_name(t.dtype)

    def _stats(self, t: Any) -> Any:
        # PyNative dispatches ops asynchronously: reading a tensor now would wait for it and stall the
        # pipeline at every hook. Activations and gradients are kept and reduced once, at the end of the
        # step; parameters (updated in place by the optimizer) are reduced now.
        return _host_view_stats(t) if isinstance(t, ms.Parameter) else t

    def _host_stats(self, pending: list[Any]) -> list[Sequence[float]]:
        return [p if isinstance(p, tuple) else _host_view_stats(p) for p in pending]

    def _copy(self, t: Any) -> np.ndarray:
        return to_numpy(t)

    def _to_numpy(self, copy: np.ndarray) -> np.ndarray:
        return copy

    def _hook_grad(self, t: Any, fn: Any) -> Any:
        if isinstance(t, ms.Parameter) or not _requires_grad_now():
            return None

        def hook(grad: Any) -> Any:
            fn(grad)
            return grad  # unchanged: the same tensor object goes on

        try:
            return t.register_hook(hook)
        except RuntimeError:  # "requires grad is false": ids, masks, buffers; integer tensors
            return None

    def _loss_tensor(self, value: Any) -> Any:
        return value if isinstance(value, ms.Tensor) else ms.Tensor(np.float64(float(value)))

    def _scalar(self, t: Any) -> float:
        return float(np.mean(to_numpy(t).astype(np.float64)))

    def _perturb(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _, _, p in self._params:
            x = to_numpy(p)
            if x.dtype.kind != "f" or not x.size:  # numpy floats only (BF16 parameters are left as they are)
                continue
            toward = np.where(rng.integers(0, 2, x.shape).astype(bool), np.inf, -np.inf).astype(x.dtype)
            p.set_data(ms.Tensor(np.where(x == 0, x, np.nextafter(x, toward))))  # zeros stay zeros

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
            self._fail(err)

    def step(self, loss: Any = None, grads: Any = None, **scalars: Any) -> None:  # type: ignore[override]
        """End the step in flight, recording ``loss`` and ``grads`` (see :meth:`grads`) first, if given;
        keyword scalars as in :meth:`Recorder.step`."""
        if grads is not None:
            self.grads(grads)
        super().step(loss, **scalars)

    # hooks --------------------------------------------------------------------
    def _install(self) -> None:
        for name, cell in self.cell.cells_and_names():
            self._handles.append(cell.register_forward_pre_hook(self._make_pre_hook(name), with_kwargs=True))
            self._handles.append(cell.register_forward_hook(self._make_post_hook(name)))
        if self.optimizer is not None:
            self._handles.append(self.optimizer.register_forward_pre_hook(self._optimizer_pre_hook))
            self._handles.append(self.optimizer.register_forward_hook(self._optimizer_post_hook))

    def _make_pre_hook(self, name: str) -> Any:
        def pre_hook(cell: Any, args: tuple, kwargs: dict) -> None:
            self._on_call(name, args, kwargs)

        return pre_hook

    def _make_post_hook(self, name: str) -> Any:
        def post_hook(cell: Any, args: tuple, output: Any) -> None:
            self._on_return(name, output)

        return post_hook

    def _optimizer_pre_hook(self, optimizer: Any, args: tuple) -> None:
        if self.active and self._in_step and not self._grads_taken and args:
            try:
                self._param_grads(self._pair_grads(args[0], list(optimizer.parameters)))
            except Exception as err:
                self._fail(err)
        return None

    def _optimizer_post_hook(self, optimizer: Any, args: tuple, output: Any) -> None:
        if self.active and self._in_step:
            self._step_ready = True
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


def replay_call(model: Any, module_name: str, inputs: list[tuple[str, np.ndarray]],
                weights: dict[str, np.ndarray]) -> np.ndarray:
    """Call cell ``module_name`` of ``model`` with captured inputs and weights; its output.0 (``tensordiff replay``)."""
    from ._recorder import flatten

    check_pynative()
    cells = dict(model.cells_and_names())
    if module_name not in cells:
        raise UsageError(f"the model has no cell {module_name!r}")
    sub = cells[module_name]
    params = dict(sub.parameters_and_names())
    for name, value in weights.items():
        if name in params:
            params[name].set_data(ms.Tensor(np.ascontiguousarray(value)))
    positional: dict[int, Any] = {}
    kwargs: dict[str, Any] = {}
    for slot, x in inputs:
        t = ms.Tensor(np.ascontiguousarray(x))
        if slot.isdigit():
            positional[int(slot)] = t
        elif "." not in slot:
            kwargs[slot] = t
    args = [positional.get(i) for i in range(max(positional) + 1)] if positional else []
    out = sub(*args, **kwargs)
    for _, t in flatten(out, "", lambda v: isinstance(v, ms.Tensor)):
        return to_numpy(t)
    raise ValueError(f"{module_name} returned no tensor")
