"""MindSpore graph mode (GRAPH_MODE, ``mindspore.jit``): capture through probes compiled into the graph.

Python hooks never run in a compiled graph, and kernel scope names do not say reliably which cell a
kernel belongs to (shared graphs, expanded ops, gradients built elsewhere). So the cell boundaries are
made explicit instead, and attribution holds by construction:

* every cell gets a class of its own (a subclass of its class, ``cell.__class__`` swapped back afterwards:
  parameter names, ``cells_and_names`` and the cell's state are untouched) whose ``construct`` records the
  call's tensor arguments, calls ``super().construct`` and records each tensor output, passing float
  outputs through a gradient probe;
* three custom ``pyfunc`` ops per capture do it, told apart by a constant *tag* input (cell, argument or
  output slot): a record op marked as having a side effect (it runs even for an output nobody uses), an
  identity whose ``bprop`` hands the incoming gradient, with the forward value, to a third op (the value
  says which call of a cell the gradient belongs to; eliminated with an output nobody uses, as a PyNative
  tensor hook never fires there);
* the optimizer (when given) gets the same for the gradients it receives: the parameter gradients;
* MindSpore caches compiled graphs under a key holding its hook version; installing and removing the
  probes moves it on (registering and removing a no-op hook, its public API), so the next step compiles
  with the probes and the first step after the capture without them: later steps run the user's graph.

The probes call back into Python with host arrays, on MindSpore's runtime threads (a lock serialises
them). Records get the names of a PyNative capture's (module, call, kind, slot); tensors with the same
bytes become links, as one tensor object does in PyNative. Not recorded: the gradients of cell inputs
(a probe there sees only its call's share of the gradient; the file's ``not_recorded`` says so and the
diff accounts for them), except an identity cell's (its output's gradient, named as PyNative names it).
Weights are read when capture starts and after each captured step, never from inside a running graph.
``pyfunc`` ops run on the CPU backend only: on another device target capture refuses with one line, and
training goes on.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import os
import re
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from ...errors import UsageError
from ...stats import host_stats
from .adapter import MindSporeCapture, MindSporeTensors

_NO_GRAD = (ms.bool_,)  # outputs never passed through the gradient probe
_GRAD_FLOATS = (ms.float32, ms.float16, ms.bfloat16, ms.float64)

# A probe's tag says what it records: ((cell id * STRIDE + local) * 2 + scalar flag), local as in TAG_*.
STRIDE = 1 << 14
TAG_ARG, TAG_ARG_NESTED, TAG_KW, TAG_KW_NESTED, TAG_OUT, TAG_OUT_NESTED = 0, 256, 1024, 1280, 2048, 2304
INTERNAL = "_tensordiff_internal"  # a cell with this attribute true is never probed
NESTED = 16  # tensors recorded inside one tuple argument or output


def _first(*items: Any) -> Any:
    return items[0]


def record(ops_: tuple, cell: int, local: int, x: Any) -> None:
    """Graph code: hand ``x`` to the record probe under its tag (a 0-d tensor as one element: the host callback
    would get a Python float)."""
    if x.ndim == 0:
        ops_[0](x.reshape((1,)), Tensor((cell * STRIDE + local) * 2 + 1, ms.int32))
    else:
        ops_[0](x, Tensor((cell * STRIDE + local) * 2, ms.int32))


def through_grad(ops_: tuple, cell: int, local: int, x: Any) -> Any:
    """Graph code: ``x`` through the gradient probe (its gradient is recorded under the tag) unless it is boolean.
    Integer tensors too: the dtype the compiler infers can be wrong (MindFormers' embedding Morph infers its
    input's int32 for a float output); the callback drops the gradients of values that are not floats."""
    if x.dtype not in _NO_GRAD:
        return ops_[1](x, Tensor((cell * STRIDE + local) * 2, ms.int32))
    return x


def record_tuple(ops_: tuple, cell: int, base: int, values: tuple) -> None:
    """Graph code: record the tensors of a tuple argument or output under ``base`` + their index."""
    for j, b in enumerate(values):
        if isinstance(b, Tensor) and j < NESTED:
            record(ops_, cell, base + j, b)


def probe_args(ops_: tuple, cell: int, args: tuple) -> tuple:
    """Graph code: record the tensors among a call's positional arguments (one tuple level deep). The arguments go
    on unchanged, and their gradients are not probed: a probe here would see only the share of the gradient that
    flows through this call, where a PyNative tensor hook sees the tensor's whole gradient (a residual input's).
    Returned (and used by the caller): the compiler drops a call whose result nobody uses, side effects and all."""
    for i, a in enumerate(args):
        if isinstance(a, Tensor) and i < 256:
            record(ops_, cell, TAG_ARG + i, a)
        elif isinstance(a, tuple) and i < 48:
            record_tuple(ops_, cell, TAG_ARG_NESTED + i * NESTED, a)
    return args  # as it came: a tuple built anew loses its None constants (the callee's `if x is None` branches)


def probe_kwargs(ops_: tuple, cell: int, names: tuple, kwargs: dict) -> dict:
    """Graph code: the same for keyword arguments named in the cell's ``construct`` signature; ``kwargs`` returned as
    it came (a dict built anew here fails to unpack in MindSpore 2.9 when it holds None)."""
    for k, v in kwargs.items():
        if isinstance(v, Tensor) and k in names:
            record(ops_, cell, TAG_KW + names.index(k), v)
        elif isinstance(v, tuple) and k in names and names.index(k) < 48:
            record_tuple(ops_, cell, TAG_KW_NESTED + names.index(k) * NESTED, v)
    return kwargs


def probe_outputs(ops_: tuple, cell: int, out: Any) -> Any:
    """Graph code: record each tensor of ``out`` (a tensor, or a tuple of tensors, tuples and other values) and
    return it, float tensors through their gradient probes."""
    if isinstance(out, Tensor):
        record(ops_, cell, TAG_OUT, out)
        return through_grad(ops_, cell, TAG_OUT, out)
    if isinstance(out, tuple):
        for i, o in enumerate(out):
            if isinstance(o, Tensor) and i < 256:
                record(ops_, cell, TAG_OUT + i, o)
            elif isinstance(o, tuple) and i < 16:
                record_tuple(ops_, cell, TAG_OUT_NESTED + i * NESTED, o)
        return tuple(through_grad(ops_, cell, TAG_OUT + i, o) if isinstance(o, Tensor) and i < 256 else o
                     for i, o in enumerate(out))
    return out


def record_all(ops_: tuple, cell: int, values: Any) -> Any:
    """Graph code: record each tensor of a tuple (the optimizer's gradients)."""
    for i, g in enumerate(values):
        if isinstance(g, Tensor) and i < STRIDE:
            record(ops_, cell, i, g)
    return values


def probe_dout(ops_: tuple, cell: int, out: Any, dout: Any) -> Any:
    """Graph code, in a custom ``bprop``: the gradients of a cell's outputs (``dout``) through the gradient record op
    with the forward values (``out``), float ones only; returned for the cell's own ``bprop``."""
    if isinstance(dout, Tensor):
        if dout.dtype in _GRAD_FLOATS:
            return ops_[2](dout, Tensor((cell * STRIDE + TAG_OUT) * 2, ms.int32), out)
        return dout
    if isinstance(dout, tuple):
        return tuple(ops_[2](d, Tensor((cell * STRIDE + TAG_OUT + i) * 2, ms.int32), o)
                     if isinstance(d, Tensor) and d.dtype in _GRAD_FLOATS and i < 256 else d
                     for i, (d, o) in enumerate(zip(dout, out)))
    return dout


def _bprop_arity(cls: Any) -> int:
    """How many inputs a cell class's custom ``bprop`` takes (-1: it has none, or its signature is not a plain one)."""
    fn = getattr(cls, "bprop", None)
    if not callable(fn):
        return -1
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return -1
    if any(p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params):
        return -1
    return len(params) - 3  # self, out, dout


def _probing_bprop(original: Any, arity: int) -> Any:
    """A ``bprop`` of ``arity`` inputs handing ``dout`` to ``probe_dout`` before the cell's own ``original`` (the
    compiler wants a bprop's exact parameters, so each arity is spelled out); None for another arity (the cell's
    output gradients are then not probed)."""
    def bprop1(self: Any, a0: Any, out: Any, dout: Any) -> Any:
        return original(self, a0, out, probe_dout(self._td_probes, self._td_cell, out, dout))

    def bprop2(self: Any, a0: Any, a1: Any, out: Any, dout: Any) -> Any:
        return original(self, a0, a1, out, probe_dout(self._td_probes, self._td_cell, out, dout))

    def bprop3(self: Any, a0: Any, a1: Any, a2: Any, out: Any, dout: Any) -> Any:
        return original(self, a0, a1, a2, out, probe_dout(self._td_probes, self._td_cell, out, dout))

    return {1: bprop1, 2: bprop2, 3: bprop3}.get(arity)


def _probed_cell_class(cls: Any, tag: str) -> type:
    """The class a probed cell gets. A cell with a custom ``bprop`` (MindFormers' loss cells) runs that instead of the
    gradient of its ``construct``: its output gradients are probed in a ``bprop`` around it."""

    class Probed(cls):
        def construct(self: Any, *args: Any, **kwargs: Any) -> Any:
            probes, cell = self._td_probes, self._td_cell
            args = probe_args(probes, cell, args)
            kwargs = probe_kwargs(probes, cell, self._td_names, kwargs)
            # super(), not cls.construct(self, ...): the compiler folds the model's `if self.flag:` branches only
            # when construct runs as the cell's own method
            return probe_outputs(probes, cell, super().construct(*args, **kwargs))

    arity = _bprop_arity(cls)
    bprop = _probing_bprop(cls.bprop, arity) if arity >= 0 else None
    if bprop is not None:
        Probed.bprop = bprop
    Probed.__name__ = Probed.__qualname__ = f"{cls.__name__}_TdProbe{tag}"
    Probed.__module__ = cls.__module__
    return Probed


def _probed_grads_class(cls: Any, tag: str) -> type:
    """The class of the cell that receives the step's gradients as its first argument (the optimizer, or a wrapper's
    gradient clipping): each gradient recorded on the way in."""
    class ProbedGrads(cls):
        def construct(self: Any, gradients: Any, *rest: Any) -> Any:
            gradients = record_all(self._td_probes, self._td_cell, gradients)
            return super().construct(gradients, *rest)

    ProbedGrads.__name__ = ProbedGrads.__qualname__ = f"{cls.__name__}_TdProbe{tag}"
    ProbedGrads.__module__ = cls.__module__
    return ProbedGrads


def _make_probes(on_value: Callable[[int, np.ndarray], None],
                 on_grad: Callable[[int, np.ndarray, np.ndarray], None]) -> tuple:
    """The three custom ops of one capture: (record, gradient probe, gradient record); the gradient probe's backward
    calls the third, as does a custom ``bprop``'s probe.
    Tags, not op instances, say what is recorded: one op per capture, whatever the model's size (creating a
    custom op costs ~0.5 ms)."""

    def record_value(x: np.ndarray, tag: np.ndarray) -> np.ndarray:
        on_value(int(tag), x)
        return x

    def record_grad(d: np.ndarray, tag: np.ndarray, x: np.ndarray) -> np.ndarray:
        on_grad(int(tag), d, x)
        return d

    def identity(x: np.ndarray, tag: np.ndarray) -> np.ndarray:
        return x

    rec = ops.Custom(record_value, out_shape=_first, out_dtype=_first, func_type="pyfunc")
    rec.add_prim_attr("side_effect_io", True)  # runs even when nothing uses what it returns
    grad_rec = ops.Custom(record_grad, out_shape=_first, out_dtype=_first, func_type="pyfunc")

    def bprop(x: Any, tag: Any, out: Any, dout: Any) -> Any:
        return grad_rec(dout, tag, x), ops.zeros_like(tag)  # x: which call's output this gradient is for

    grad = ops.Custom(identity, out_shape=_first, out_dtype=_first, func_type="pyfunc", bprop=bprop)
    return rec, grad, grad_rec


def decode(tag: int, names: Sequence[str]) -> tuple[str, str, bool]:
    """(kind 'input' | 'output', slot as a PyNative capture names it, scalar) of a probe's ``tag`` in its cell."""
    local = (tag >> 1) % STRIDE
    scalar = bool(tag & 1)
    if local >= TAG_OUT_NESTED:
        i, j = divmod(local - TAG_OUT_NESTED, NESTED)
        return "output", f"{i}.{j}", scalar
    if local >= TAG_OUT:
        return "output", str(local - TAG_OUT), scalar
    if local >= TAG_KW_NESTED:
        k, j = divmod(local - TAG_KW_NESTED, NESTED)
        return "input", f"{names[k]}.{j}", scalar
    if local >= TAG_KW:
        return "input", names[local - TAG_KW], scalar
    if local >= TAG_ARG_NESTED:
        i, j = divmod(local - TAG_ARG_NESTED, NESTED)
        return "input", f"{i}.{j}", scalar
    return "input", str(local), scalar


def graph_mode_wanted(graph: bool | None = None) -> bool:
    """``graph`` when given; else ``TENSORDIFF_GRAPH`` (1: the step is a ``jit`` function run from PyNative); else
    whether MindSpore is in GRAPH_MODE."""
    if graph is not None:
        return graph
    flag = os.environ.get("TENSORDIFF_GRAPH", "").strip().lower()
    if flag:
        return flag not in ("0", "false", "no")
    return bool(ms.get_context("mode") == ms.GRAPH_MODE)


def _value_key(x: np.ndarray) -> tuple:
    """(dtype, shape, BLAKE2b digest of the bytes) of an array."""
    data = np.ascontiguousarray(x)
    return str(data.dtype), data.shape, hashlib.blake2b(data.view(np.uint8).data, digest_size=16).digest()


def _split(name: str) -> tuple[str, str]:
    module, _, attribute = name.rpartition(".")
    return module, attribute


def _argument_names(cls: Any) -> tuple[str, ...]:
    """The names ``cls.construct`` takes arguments by (keyword arguments are recorded under them)."""
    try:
        params = inspect.signature(cls.construct).parameters
    except (TypeError, ValueError):
        return ()
    return tuple(n for n, p in params.items() if n != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


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
            return host_stats(t)
        return super().stats(t)

    def copy(self, t: Any) -> np.ndarray:
        return np.array(t, copy=True) if isinstance(t, np.ndarray) else super().copy(t)

    def hook_grad(self, t: Any, fn: Any) -> Any:
        return None  # gradients come from the gradient probes


class MindSporeGraphCapture(MindSporeCapture):
    """Records the first ``options.steps`` steps of ``cell`` run in GRAPH_MODE or under ``mindspore.jit``."""

    def __init__(self, cell: Any, options: Any, optimizer: Any = None, meta: dict | None = None,
                 cells: str | None = None, grads_at: Any = None):
        target = ms.get_context("device_target")
        if target != "CPU":
            raise UsageError(f"graph-mode capture runs on the CPU backend only (its probes are pyfunc ops); this run's "
                             f"device target is {target}: capture it in PyNative mode, or run the graph on the CPU")
        self._pattern = re.compile(cells) if cells else None
        self._swapped: list[tuple[Any, type]] = []
        self._probed: list[tuple[str, tuple[str, ...]]] = []  # cell id -> (cell name, construct's argument names)
        self._owners: list[tuple[str, str]] = []  # the optimizer's parameters: (module, attribute)
        skipped = ["grad_input"] if options.inputs else ["input", "grad_input"]
        meta = {**(meta or {}), "capture_mode": "graph", "not_recorded": ",".join(skipped)}
        if cells:
            meta["cells"] = cells
        super().__init__(cell, options, optimizer=optimizer, meta=meta, grads_at=grads_at)
        with self._lock:
            self._ensure_step()  # the weights of the first step, read now: never from inside a running graph

    # installation ---------------------------------------------------------------
    def _check_mode(self) -> None:
        return None  # graph mode is what this class is for

    def _backend(self) -> GraphTensors:
        return GraphTensors()

    def _install(self) -> None:
        probes = _make_probes(self._on_value, self._on_grad)
        for name, c in self.cell.cells_and_names():
            if type(c).construct is ms.nn.Cell.construct or isinstance(c, (ms.nn.CellList, ms.nn.CellDict)):
                continue  # containers are never called
            if getattr(c, INTERNAL, False):
                continue  # a cell standing in for a primitive (tensordiff.compat): not one of the model's cells
            if self._pattern is not None and name and not self._pattern.search(name):
                continue
            names = _argument_names(type(c))  # of the model's class, before the swap
            self._swap(c, _probed_cell_class(type(c), str(len(self._probed))), probes, names)
            self._probed.append((name, names))
        if self.optimizer is not None:
            self._owners = [self._param_ids.get(id(p)) or _split(p.name) for p in self.optimizer.parameters]
            self._swap(self.grads_at, _probed_grads_class(type(self.grads_at), "opt"), probes, ())
            self._probed.append(("", ()))  # the gradients' cell id: its tags are parameter indices
        bump_graph_cache(self.cell)

    def _swap(self, c: Any, cls: type, probes: tuple, names: tuple[str, ...]) -> None:
        original = type(c)
        object.__setattr__(c, "_td_probes", probes)
        object.__setattr__(c, "_td_cell", len(self._probed))
        object.__setattr__(c, "_td_names", names)
        c.__class__ = cls
        self._swapped.append((c, original))

    def remove_hooks_impl(self) -> None:
        if not self._swapped:
            return
        for c, original in reversed(self._swapped):
            c.__class__ = original
            for attr in ("_td_probes", "_td_cell", "_td_names"):
                if attr in c.__dict__:
                    object.__delattr__(c, attr)
        self._swapped.clear()
        bump_graph_cache(self.cell)

    # probe callbacks (MindSpore's runtime threads) ------------------------------
    def _on_value(self, tag: int, x: np.ndarray) -> None:
        with self._lock:
            if not self.state.recording:
                return
            try:
                cell = (tag >> 1) // STRIDE
                module, names = self._probed[cell]
                if self.optimizer is not None and cell == len(self._probed) - 1:
                    mod, pname = self._owners[(tag >> 1) % STRIDE]
                    self._param_grads([(mod, pname, x)])
                    return
                kind, slot, scalar = decode(tag, names)
                if kind == "input" and not self.options.inputs:
                    return
                x = x.reshape(()) if scalar else x
                key = (module, kind, slot)
                call = self._calls_of[key]
                self._calls_of[key] += 1
                value = _value_key(x)
                seq = self._record("forward", kind, module, call, slot, self._classes.get(module, ""), x,
                                   parent=module.rpartition(".")[0] if module else "", track=False,
                                   same_as=self._same_bytes(value))
                self._fwd_seqs[key].append(seq)
                self._by_value[(key, value)].append(seq)
            except Exception as err:
                self.fail(err)

    def _on_grad(self, tag: int, d: np.ndarray, x: np.ndarray) -> None:
        with self._lock:
            if not self.state.recording or not self.options.grads:
                return
            try:
                module, names = self._probed[(tag >> 1) // STRIDE]
                kind, slot, _ = decode(tag, names)
                if kind == "input" and not self.options.inputs:
                    return
                if isinstance(x, np.ndarray) and x.dtype.kind != "f":
                    return  # the gradient of an integer output (the probe is there for outputs inferred wrongly)
                key = (module, kind, slot)
                # the call whose output this is: the forward record of the same value (a cell called twice on
                # parallel branches, RoPE on q and k, has its backward calls in any order); else the reverse order
                same = self._by_value.get((key, _value_key(x))) if isinstance(x, np.ndarray) else None
                fwd = self._fwd_seqs.get(key, [])
                k = self._bwd_counts[key]
                self._bwd_counts[key] += 1
                if same:
                    of = same.pop(0)
                else:
                    of = fwd[len(fwd) - 1 - k] if k < len(fwd) else -1
                call = self._rows[of]["call"] if of >= 0 else k
                if not isinstance(d, np.ndarray):  # a 0-d gradient arrives as a Python number: its value's dtype
                    d = np.asarray(d, dtype=self._rows[of]["dtype"] if of >= 0 else np.float32)
                seq = self._record("backward", f"grad_{kind}", module, call, slot, self._classes.get(module, ""), d,
                                   parent=module.rpartition(".")[0] if module else "", grad_of=of, track=False)
                self._grad_values[seq] = _value_key(d)  # linked at the end of the step (_link_gradients)
            except Exception as err:
                self.fail(err)

    def _same_bytes(self, value: tuple) -> int:
        """The seq of an earlier forward record of this step holding the same bytes (``value``: dtype, shape and a
        BLAKE2b digest), else -1 and this one is remembered (gradients: ``_link_gradients``). In PyNative a cell
        returning its child's output tensor is recorded as a link to it; the graph hands over copies, so identity
        is recognised by content, which is what a link promises the diff."""
        earlier = self._digests.get(value)
        if earlier is not None:
            return earlier
        self._digests[value] = self._seq
        return -1

    # steps ------------------------------------------------------------------------
    def grads(self, grads: Any, params: Sequence[Any] | None = None) -> None:
        """Parameter gradients from ``value_and_grad``; ignored for a step whose optimizer probes recorded them."""
        with self._lock:
            if not self.state.grads_taken:
                super().grads(grads, params)

    def sync_impl(self) -> None:
        """Wait for the graph in flight, so that its probes have all called back before a step ends or the capture
        closes: reading a parameter waits for the graph that updates it (MindSpore's own ``runtime.synchronize``
        logs an error on the CPU)."""
        if self._params and self.active:
            with contextlib.suppress(Exception):
                self._params[0][2].asnumpy()

    def after_step_impl(self) -> None:
        if self.active and not self.state.in_step:
            self._ensure_step()  # the next step's weights, read now (after the update)

    def _seq_has_activity(self) -> bool:
        return any(row["phase"] != "weights" for row in self._rows)

    def end_step_impl(self) -> bool:
        if not self._seq_has_activity():
            return False  # a step opened for its weights that never ran (capture closed first): not a step of the run
        self._set_enters()
        self._name_pass_through_gradients()
        self._link_gradients()
        return True

    def reset_step_impl(self) -> None:
        # per (module, kind, slot): the calls recorded, their forward seqs, the gradients seen
        self._calls_of: dict[tuple[str, str, str], int] = defaultdict(int)
        self._fwd_seqs: dict[tuple[str, str, str], list[int]] = defaultdict(list)
        self._bwd_counts: dict[tuple[str, str, str], int] = defaultdict(int)
        self._digests: dict[tuple, int] = {}  # forward value key -> the seq holding it
        self._by_value: dict[tuple, list[int]] = defaultdict(list)  # (module, kind, slot), value -> forward seqs
        self._grad_values: dict[int, tuple] = {}  # backward seq -> value key

    def _name_pass_through_gradients(self) -> None:
        """A cell that returns one of its inputs (an identity norm) has, in PyNative, one tensor for both: recorded
        first as the input, hooked there, its gradient named ``grad_input``. Here the output probe sees it; the
        record takes the input's name, as the PyNative capture of the same model has it."""
        rows = self._rows
        for row in rows:
            of = row["grad_of"]
            if row["phase"] != "backward" or row["kind"] != "grad_output" or of < 0:
                continue
            src = rows[of]["same_as"]
            if src < 0:
                continue
            first = rows[src]
            if first["kind"] == "input" and first["module"] == row["module"] and first["call"] == row["call"]:
                row["kind"], row["slot"], row["grad_of"] = "grad_input", first["slot"], src

    def _link_gradients(self) -> None:
        """Gradients with the same bytes are one tensor's, as PyNative sees it: a cell returning its child's output
        has one output tensor, hooked once, at the child's (first) record. Here each probe hands over its own copy,
        and the outermost cell's arrives first; so the record whose value was recorded first in the forward holds
        the data and the others become links to it."""
        groups: dict[tuple, list[int]] = defaultdict(list)
        for seq, value in self._grad_values.items():
            groups[value].append(seq)
        rows = self._rows
        for seqs in groups.values():
            if len(seqs) < 2:
                continue
            owner = min(seqs, key=lambda q: (rows[q]["grad_of"] < 0, rows[q]["grad_of"], q))
            for q in seqs:
                if q != owner:
                    rows[q]["same_as"] = owner
                    self._data.pop(q, None)
        for row in rows:  # a link never points at a link (the diff reads the source's data)
            src = row["same_as"]
            if src >= 0 and rows[src]["same_as"] >= 0:
                row["same_as"] = rows[src]["same_as"]

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
        outputs = {(row["module"], row["slot"], row["call"]): row["seq"] for row in forward if row["kind"] == "output"}
        for row in self._rows:  # rows[seq] is the record of seq
            if row["phase"] == "backward" and row["grad_of"] < 0:  # its gradient came before its value
                row["grad_of"] = outputs.get((row["module"], row["slot"], row["call"]), -1)
            if row["phase"] == "backward" and row["grad_of"] >= 0:
                row["enter"] = self._rows[row["grad_of"]]["enter"]
