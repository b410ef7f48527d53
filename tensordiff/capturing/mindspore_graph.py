"""MindSpore graph mode (GRAPH_MODE, ``mindspore.jit``): capture through probes compiled into the graph.

Python hooks never run in a compiled graph, and kernel scope names do not say reliably which cell a
kernel belongs to (shared graphs, expanded ops, gradients built elsewhere). So the cell boundaries are
made explicit instead, and attribution holds by construction:

* every selected cell gets a class of its own (``type(cell)`` subclassed, ``cell.__class__`` swapped
  back afterwards: parameter names, ``cells_and_names`` and the cell's state are untouched) whose
  ``construct`` calls the original and passes each tensor output through two probes of its own:
  a *record* probe (a ``pyfunc`` custom op marked as having a side effect, so it runs even when the
  output is unused, and whose result is dropped) and a *gradient* probe (an identity whose ``bprop``
  hands the incoming gradient to a record probe; eliminated with the output when nobody uses it, as a
  PyNative tensor hook never fires there);
* the optimizer (when given) gets the same treatment for the gradients it receives: the step's
  parameter gradients;
* MindSpore caches compiled graphs under a key holding its hook version; installing and removing the
  probes bumps it (by registering and removing a no-op hook, MindSpore's public API), so the next step
  compiles with the probes and the first step after the capture compiles without them: the steps after
  capture run the user's own graph.

The probes call back into Python with host arrays, on MindSpore's runtime threads (a lock serialises
them). Records get the same names as a PyNative capture's (module, call, ``output`` / ``grad_output``,
slot). Not recorded in graph mode: cell inputs and their gradients (the file says so in its
``not_recorded`` attribute, and the diff accounts for them); the weights are read when capture starts
and after each captured step. The probes are ``pyfunc`` ops, which MindSpore runs on the CPU backend
only: on another device target capture refuses with one line, and training goes on.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from ..errors import UsageError
from .mindspore import MindSporeCapture, MindSporeTensors, numpy_stats

NOT_RECORDED = ("input", "grad_input")  # kinds a graph-mode capture never records
MAX_SLOTS = 16  # probed outputs of one cell (a cell returning more keeps the rest unrecorded)
_MS_TO_NUMPY = {"Float32": np.float32, "Float64": np.float64, "Float16": np.float16, "Int32": np.int32,
                "Int64": np.int64, "Int16": np.int16, "Int8": np.int8, "UInt8": np.uint8, "Bool": np.bool_}


_FLOATS = (ms.float32, ms.float16, ms.bfloat16, ms.float64)


def _first(*items: Any) -> Any:
    return items[0]


class _Probe:
    """One recording point: a side-effecting ``pyfunc`` op that hands its input to ``sink`` and a gradient
    probe whose backward hands the incoming gradient to ``grad_sink``."""

    def __init__(self, sink: Callable[[np.ndarray], None], grad_sink: Callable[[np.ndarray], None] | None):
        self.dtypes: list[Any] = []  # the MindSpore dtype seen at compile time: scalars arrive as Python floats

        def infer_dtype(dtype: Any) -> Any:
            self.dtypes.append(dtype)
            return dtype

        def record(x: Any) -> Any:
            sink(self._array(x))
            return x

        self.record = ops.Custom(record, out_shape=_first, out_dtype=infer_dtype, func_type="pyfunc")
        self.record.add_prim_attr("side_effect_io", True)
        self.grad: Any = None
        if grad_sink is not None:
            def record_grad(d: Any) -> Any:
                grad_sink(self._array(d))
                return d

            grad_op = ops.Custom(record_grad, out_shape=_first, out_dtype=_first, func_type="pyfunc")

            def bprop(x: Any, out: Any, dout: Any) -> Any:
                return (grad_op(dout),)

            def identity(x: Any) -> Any:  # a function of its own: ops with one function are one op to the compiler
                return x

            self.grad = ops.Custom(identity, out_shape=_first, out_dtype=_first, func_type="pyfunc", bprop=bprop)

    def _array(self, x: Any) -> np.ndarray:
        if isinstance(x, np.ndarray):
            return x
        dtype = _MS_TO_NUMPY.get(str(self.dtypes[-1]).removeprefix("Tensor[").rstrip("]")) if self.dtypes else None
        return np.asarray(x, dtype=dtype)


def probe_outputs(records: tuple, grads: tuple, out: Any) -> Any:
    """Graph code: record each tensor of ``out`` (a tensor, or a tuple of tensors and other values) and return it
    through its gradient probe (a float tensor) or as it is."""
    if isinstance(out, Tensor):
        records[0](out)
        if ops.is_floating_point(out):
            return grads[0](out)
        return out
    if isinstance(out, tuple):
        for i, o in enumerate(out):
            if isinstance(o, Tensor) and i < len(records):
                records[i](o)
        return tuple(grads[i](o) if isinstance(o, Tensor) and i < len(grads) and o.dtype in _FLOATS else o
                     for i, o in enumerate(out))
    return out


def record_all(records: tuple, values: Any) -> Any:
    """Graph code: record each tensor of a tuple (the optimizer's gradients); nothing returned."""
    for i, g in enumerate(values):
        if isinstance(g, Tensor) and i < len(records):
            records[i](g)
    return values


def _probed_cell_class(cls: Any, tag: str) -> type:
    def construct(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = cls.construct(self, *args, **kwargs)
        return probe_outputs(self._td_records, self._td_grads, out)

    return type(f"{cls.__name__}_TdProbe{tag}", (cls,), {"construct": construct, "__module__": cls.__module__})


def _probed_optimizer_class(cls: Any, tag: str) -> type:
    def construct(self: Any, gradients: Any, *rest: Any) -> Any:
        record_all(self._td_records, gradients)
        return cls.construct(self, gradients, *rest)

    return type(f"{cls.__name__}_TdProbe{tag}", (cls,), {"construct": construct, "__module__": cls.__module__})


def graph_mode_wanted(graph: bool | None = None) -> bool:
    """``graph`` when given; else ``TENSORDIFF_GRAPH`` (1: the step is a ``jit`` function run from PyNative); else
    whether MindSpore is in GRAPH_MODE."""
    if graph is not None:
        return graph
    flag = os.environ.get("TENSORDIFF_GRAPH", "").strip().lower()
    if flag:
        return flag not in ("0", "false", "no")
    return bool(ms.get_context("mode") == ms.GRAPH_MODE)


def bump_graph_cache(cell: Any) -> None:
    """Make MindSpore compile its graphs again at their next call (the compile cache key holds the hook version,
    which registering and removing a hook moves on)."""
    cell.register_forward_hook(_no_hook).remove()


def _no_hook(*_: Any) -> None:
    return None


class GraphTensors(MindSporeTensors):
    """Host arrays from the probes (statistics now: the buffer is MindSpore's until the callback returns), and
    MindSpore tensors (weights, loss) as in PyNative."""

    def is_tensor(self, value: Any) -> bool:
        return isinstance(value, np.ndarray) or super().is_tensor(value)

    def describe(self, t: Any) -> tuple[str | None, tuple[int, ...]]:
        if isinstance(t, np.ndarray):
            return str(t.dtype), tuple(int(d) for d in t.shape)
        dtype, shape = super().describe(t)
        return dtype or super().late_dtype(t), shape

    def stats(self, t: Any) -> Any:
        if isinstance(t, np.ndarray):
            return numpy_stats(t)
        return super().stats(t)

    def copy(self, t: Any) -> np.ndarray:
        return np.array(t, copy=True) if isinstance(t, np.ndarray) else super().copy(t)

    def hook_grad(self, t: Any, fn: Any) -> Any:
        return None  # gradients come from the gradient probes


class MindSporeGraphCapture(MindSporeCapture):
    """Records the first ``options.steps`` steps of ``cell`` run in GRAPH_MODE or under ``mindspore.jit``."""

    def __init__(self, cell: Any, options: Any, optimizer: Any = None, meta: dict | None = None,
                 cells: str | None = None):
        target = ms.get_context("device_target")
        if target != "CPU":
            raise UsageError(f"graph-mode capture runs on the CPU backend only (its probes are pyfunc ops); this run's "
                             f"device target is {target}: capture it in PyNative mode, or run the graph on the CPU")
        self._pattern = re.compile(cells) if cells else None
        self._lock = threading.RLock()
        self._swapped: list[tuple[Any, type, tuple[str, ...]]] = []
        self._fwd_seqs: dict[tuple[str, str], list[int]] = defaultdict(list)
        self._bwd_counts: dict[tuple[str, str], int] = defaultdict(int)
        self._out_calls: dict[tuple[str, str], int] = defaultdict(int)
        meta = {**(meta or {}), "capture_mode": "graph", "not_recorded": ",".join(NOT_RECORDED)}
        if cells:
            meta["cells"] = cells
        super().__init__(cell, options, optimizer=optimizer, meta=meta)
        with self._lock:
            self._ensure_step()  # the weights of the first step, read now: never from inside a running graph

    # installation ---------------------------------------------------------------
    def _check_mode(self) -> None:
        return None  # graph mode is what this class is for

    def _backend(self) -> GraphTensors:
        return GraphTensors()

    def _install(self) -> None:
        for name, c in self.cell.cells_and_names():
            if type(c).construct is ms.nn.Cell.construct or isinstance(c, (ms.nn.CellList, ms.nn.CellDict)):
                continue  # containers are never called
            if self._pattern is not None and name and not self._pattern.search(name):
                continue
            probes = [_Probe(self._sink(name, str(i)), self._grad_sink(name, str(i))) for i in range(MAX_SLOTS)]
            self._swap(c, _probed_cell_class(type(c), str(len(self._swapped))),
                       tuple(p.record for p in probes), tuple(p.grad for p in probes))
        if self.optimizer is not None:
            owners = [self._param_ids.get(id(p)) or tuple(p.name.rpartition(".")[::2]) for p in self.optimizer.parameters]
            probes = [_Probe(self._param_grad_sink(mod, pname), None) for mod, pname in owners]
            self._swap(self.optimizer, _probed_optimizer_class(type(self.optimizer), "opt"),
                       tuple(p.record for p in probes), ())
        bump_graph_cache(self.cell)

    def _swap(self, c: Any, cls: type, records: tuple, grads: tuple) -> None:
        original = type(c)
        object.__setattr__(c, "_td_records", records)
        object.__setattr__(c, "_td_grads", grads)
        c.__class__ = cls
        self._swapped.append((c, original, ("_td_records", "_td_grads")))

    def _remove_framework_hooks(self) -> None:
        if not self._swapped:
            return
        for c, original, attrs in reversed(self._swapped):
            c.__class__ = original
            for attr in attrs:
                if attr in c.__dict__:
                    object.__delattr__(c, attr)
        self._swapped.clear()
        bump_graph_cache(self.cell)

    # probe callbacks (MindSpore's runtime threads) ------------------------------
    def _sink(self, module: str, slot: str) -> Callable[[np.ndarray], None]:
        parent = module.rpartition(".")[0] if module else ""
        cls = self._classes.get(module, "")

        def sink(x: np.ndarray) -> None:
            with self._lock:
                if not self.active or not self._in_step:
                    return
                try:
                    key = (module, slot)
                    call = self._out_calls[key]
                    self._out_calls[key] += 1
                    seq = self._record("forward", "output", module, call, slot, cls, x, parent=parent, track=False,
                                       same_as=self._same_bytes("forward", x))
                    self._fwd_seqs[key].append(seq)
                except Exception as err:
                    self._fail(err)

        return sink

    def _grad_sink(self, module: str, slot: str) -> Callable[[np.ndarray], None]:
        parent = module.rpartition(".")[0] if module else ""
        cls = self._classes.get(module, "")

        def sink(d: np.ndarray) -> None:
            with self._lock:
                if not self.active or not self._in_step or not self.options.grads:
                    return
                try:
                    key = (module, slot)
                    fwd = self._fwd_seqs.get(key, [])
                    k = self._bwd_counts[key]
                    self._bwd_counts[key] += 1
                    of = fwd[len(fwd) - 1 - k] if k < len(fwd) else -1  # backward visits the calls in reverse
                    call = self._rows[of]["call"] if of >= 0 else k
                    self._record("backward", "grad_output", module, call, slot, cls, d, parent=parent, grad_of=of,
                                 track=False, same_as=self._same_bytes("backward", d))
                except Exception as err:
                    self._fail(err)

        return sink

    def _param_grad_sink(self, module: str, pname: str) -> Callable[[np.ndarray], None]:
        cls = self._classes.get(module, "")

        def sink(g: np.ndarray) -> None:
            with self._lock:
                if not self.active or not self._in_step:
                    return
                try:
                    self._grads_taken = True
                    self._record("param_grad", "grad", module, 0, pname, cls, g, track=False)
                except Exception as err:
                    self._fail(err)

        return sink

    def _same_bytes(self, phase: str, x: np.ndarray) -> int:
        """The seq of an earlier record of this step and phase holding the same bytes (dtype, shape and a BLAKE2b
        digest), else -1 and ``x`` is remembered. In PyNative a cell returning its child's output tensor is recorded
        as a link to it (and its gradient once); the graph hands over copies, so identity is recognised by content,
        which is what a link promises the diff."""
        data = np.ascontiguousarray(x)
        key = (phase, str(data.dtype), data.shape, hashlib.blake2b(data.view(np.uint8).data, digest_size=16).digest())
        earlier = self._digests.get(key)
        if earlier is not None:
            return earlier
        self._digests[key] = self._seq
        return -1

    # steps ------------------------------------------------------------------------
    def grads(self, grads: Any, params: Sequence[Any] | None = None) -> None:
        """Parameter gradients from ``value_and_grad``; ignored for a step whose optimizer probes recorded them."""
        with self._lock:
            if not self._grads_taken:
                super().grads(grads, params)

    def step(self, loss: Any = None, grads: Any = None, **scalars: Any) -> None:
        self._synchronize()  # the graph's probes have all called back before the step is closed
        with self._lock:
            super().step(loss, grads=grads, **scalars)
            if self.active and not self._in_step:
                self._ensure_step()  # the next step's weights, read now (after the update)

    def close(self) -> None:
        self._synchronize()
        with self._lock:
            super().close()

    def _synchronize(self) -> None:
        """Wait for the graph in flight: reading a parameter waits for the graph that updates it (MindSpore's own
        ``runtime.synchronize`` logs an error on the CPU)."""
        if self._params and self.active:
            with contextlib.suppress(Exception):
                self._params[0][2].asnumpy()

    def _seq_has_activity(self) -> bool:
        return any(row["phase"] != "weights" for row in self._rows)

    def _end_step(self) -> None:
        if self._in_step and not self._seq_has_activity():
            # a step opened for its weights that never ran (capture closed first): not a step of the run
            self._in_step = False
            self._reset_step()
            return
        self._set_enters()
        super()._end_step()

    def _reset_step(self) -> None:
        super()._reset_step()
        self._digests: dict[tuple, int] = {}
        if hasattr(self, "_fwd_seqs"):
            self._fwd_seqs.clear()
            self._bwd_counts.clear()
            self._out_calls.clear()

    def _set_enters(self) -> None:
        """Where each call was entered, as a PyNative capture has it: the first record of the cells it called
        (its own first output where it called none), found from the nesting of the names."""
        forward = [row for row in self._rows if row["phase"] == "forward"]
        parents = {name.rpartition(".")[0] for name in self._classes if name}
        prev_end: dict[str, int] = {}  # module -> index in ``forward`` of its previous call's last record
        enters: dict[tuple[str, int], int] = {}
        for i, row in enumerate(forward):
            key = (row["module"], row["call"])
            if key not in enters:
                enter = row["seq"]
                module = row["module"]
                if module in parents or not module:
                    prefix = f"{module}." if module else ""
                    for other in forward[prev_end.get(module, -1) + 1: i]:
                        if not module or other["module"].startswith(prefix):
                            enter = other["seq"]
                            break
                enters[key] = enter
            row["enter"] = enters[key]
            prev_end[row["module"]] = i
        by_seq = {row["seq"]: row for row in self._rows}
        by_call = {(row["module"], row["slot"], row["call"]): row["seq"] for row in forward}
        for row in self._rows:
            if row["phase"] == "backward" and row["grad_of"] < 0:  # its gradient came before its value
                row["grad_of"] = by_call.get((row["module"], row["slot"], row["call"]), -1)
            if row["phase"] == "backward" and row["grad_of"] >= 0:
                row["enter"] = by_seq[row["grad_of"]]["enter"]
