"""Step bookkeeping shared by the framework adapters (no framework imported here).

An adapter (``torch/adapter.py``, ``mindspore/adapter.py``) installs the hooks and hands over a
``TensorBackend`` that says how to read a tensor: its dtype name, shape, statistics, a host
copy, a backward hook. This class turns hook calls into records: call indices, module
nesting, links for tensors seen before, one step group per training step, handed to the
background writer. ``StepState`` holds where it stands; ``NullCapture`` stands in when capture is off;
``CaptureHandle`` is what either is to the training program.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol, runtime_checkable

import numpy as np

from .. import dtypes
from .._text import first_line
from .._warn import warn as _warn
from ..record import flatten
from ..store.format import shape_text
from ..store.rows import StepRows
from ..store.writer import CaptureWriter
from ..store.writer_process import ProcessWriter
from .backend import TensorBackend
from .options import BIG_MODEL_MAX_MB, BIG_MODEL_PARAMS, CaptureOptions, report_status
from .signals import SignalGuard

STAT_KEYS = ("min", "max", "mean", "l2", "nan", "inf")
_LINKED = STAT_KEYS + ("has_data",)


def open_recorders() -> list[Recorder]:
    """The recorders of this process still recording (``--auto`` steps aside when the program has its own)."""
    return [r for r in list(_OPEN) if not r.state.closed and not r.finished]


@runtime_checkable
class CaptureHandle(Protocol):
    """What ``tensordiff.capture()`` returns: a ``Recorder`` (its framework's adapter) while capture is on, else a
    ``NullCapture``. Like a hook's ``RemovableHandle``, the one object that undoes what was installed: ``close()``
    (or leaving the ``with`` block) removes every hook and closes the file. MindSpore's adds ``grads(grads)``."""

    @property
    def path(self) -> str | None:
        """The capture file (this rank's), or None when capture is off."""

    @property
    def active(self) -> bool:
        """Recording the step in flight."""

    def step(self, loss: Any = None, **scalars: Any) -> None:
        """End the step in flight (recording ``loss`` first, if given); keyword scalars are logged with it."""

    def loss(self, value: Any) -> None:
        """Record the loss of the step in flight."""

    def log(self, step: int | None = None, **values: Any) -> None:
        """Append per-step scalars."""

    def close(self) -> None:
        """Finish the step in flight, remove every hook, close the file."""

    def __enter__(self) -> CaptureHandle: ...

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None: ...


@dataclass
class StepState:
    """Where a recorder stands: every flag and counter of its steps, in one place (``Recorder.state``; only the
    recorder changes it).

    A step is *open* (``in_step``) from its first record (a module's call, ``loss()``, an adapter reading the
    weights) until it is handed to the writer (``step_written``); its optimizer step marks it *ready*
    (``step_ready``: the next top-level call or ``step()`` ends it). After a written step the recorder is *done*
    (every step asked for is written), *resting* (``every=N``: the steps in between, counted by ``step()``) or
    waiting for the next step to open. *failed*: a hook raised, every hook is removed; *closed*: the file is."""

    step: int = 0  # captured steps handed to the writer
    step_id: int = 0  # the open step's serial: a gradient hook of an earlier step does nothing
    iteration: int = 0  # step() calls: the training step in flight, where its scalars land
    step_iteration: int = 0  # the training step the open step is (every=N: its number in the file)
    in_step: bool = False
    step_ready: bool = False
    grads_taken: bool = False  # the open step's parameter gradients are recorded
    resting: bool = False  # every=N: a step between the captured ones (every hook does nothing)
    done: bool = False
    failed: bool = False
    closed: bool = False
    interrupted: str = ""  # the exception that ended the run inside the capture block, if one did

    @property
    def active(self) -> bool:
        """Hooks record: not done, failed, or resting."""
        return not (self.done or self.failed or self.resting)

    @property
    def finished(self) -> bool:
        """Every step asked for is written, or the capture stopped."""
        return self.done or self.failed

    @property
    def recording(self) -> bool:
        """A step is open and hooks record into it."""
        return self.in_step and self.active

    @property
    def wants_grads(self) -> bool:
        """The open step records and has no parameter gradients yet."""
        return self.recording and not self.grads_taken

    def open_step(self) -> None:
        """A captured step starts."""
        self.in_step = True
        self.step_id += 1
        self.step_iteration = self.iteration

    def clear_step(self) -> None:
        """The flags of a step that has not started."""
        self.grads_taken = False
        self.step_ready = False

    def step_written(self) -> None:
        """The open step is in the writer's hands."""
        self.step += 1
        self.in_step = False

    def stop(self) -> None:
        """The capture failed: nothing more is recorded."""
        self.failed = True
        self.in_step = False


class Recorder:
    """Records the first ``options.steps`` training steps, whatever the framework. Its boundary, in three parts:

    * what a controller does (an adapter's hooks, ``--auto``, ``--megatron``, the MindFormers callback), the public
      methods: ``on_call`` / ``on_return`` (a module starts, returns), ``optimizer_step_begin`` /
      ``optimizer_step_end``, ``take_param_grads``, ``restart_step``, ``set_iteration``, ``loss``, ``step``, ``log``,
      ``fail``, ``close``; and ``state`` (a ``StepState``, read only) for where it stands. Each checks the state
      first, and none raises into the model (``take_param_grads`` excepted: its caller stops the capture);
    * what a subclass (an adapter) overrides: the hooks named in ``HOOKS``, nothing else;
    * what a subclass uses besides the public methods: the names in ``FOR_ADAPTERS``.
    """

    #: the methods a subclass overrides (each documented where the base class defines it)
    HOOKS = ("reset_step_impl", "param_grads_impl", "take_param_grads_impl", "step_attrs_impl", "end_step_impl",
             "remove_hooks_impl", "sync_impl", "before_step_impl", "after_step_impl")
    #: what a subclass may use of the recorder's own: the model's parameters (module, attribute, parameter) and
    #: module classes, the hook handles to remove at the end, the lock its step() and close() hold, recording
    #: (``_record``, ``_ensure_step``, ``_param_grads``) and the open step's records (``_rows``, indexed by seq;
    #: ``_seq``, the next; ``_data``, the full tensors by seq)
    FOR_ADAPTERS = ("_params", "_classes", "_handles", "_lock", "_record", "_ensure_step", "_param_grads", "_rows",
                    "_seq", "_data")

    framework = ""

    def __init__(self, backend: TensorBackend, options: CaptureOptions, path: str, attrs: dict[str, Any],
                 params: Sequence[tuple[str, str, Any]], classes: dict[str, str]):
        self._state = StepState()
        self._lock = threading.RLock()
        self._t = backend
        self.options = options
        self.path = path
        writer = options.writer or "process"
        if writer == "process" and options.background and not options.durable:
            # step() returns once the step is in the child's hands: a SIGKILL of this process after it loses nothing
            self._writer: CaptureWriter = ProcessWriter(path, attrs, durable=True)
        else:  # the thread writer (asked for, or durable): step() returns once the step is written and flushed
            self._writer = CaptureWriter(path, attrs, background=options.background, durable=True)
        _OPEN.add(self)
        self._signals = SignalGuard(self._finish_on_signal, self._writer.busy, self._writer.defer)
        self._signals.install()
        self._params = list(params)  # (module, attribute, parameter)
        self._classes = classes
        self._handles: list[Any] = []
        self._tensor_handles: list[Any] = []
        self._optimizer_scalars: dict[str, float] = {}  # the optimizer's settings of the step in flight
        self._loss: float | None = None  # the step's loss, once read from its tensor (``_loss_t``)
        self._loss_t: Any = None
        self._default_size_limit()
        self._reset_step()

    def _default_size_limit(self) -> None:
        """Models of 1B parameters or more store full tensors up to 64 MiB a record unless told otherwise: at 1B the
        [batch, heads, seq, seq] attention scores alone are tens of GB a step (docs/performance.md)."""
        if self.options.tensors_max_mb is not None or self.options.tensors == "none":
            return
        count = 0
        for _, _, p in self._params:
            shape = self._t.describe(p)[1]
            count += math.prod(shape)
        if count >= BIG_MODEL_PARAMS:
            self.options.tensors_max_mb = BIG_MODEL_MAX_MB
            with contextlib.suppress(Exception):
                _warn(f"tensordiff: {count / 1e9:.1f}B parameters: full tensors stored up to "
                              f"{BIG_MODEL_MAX_MB:g} MiB a record, statistics for larger ones; "
                              "set tensors_max_mb=0 (--tensors-max-mb 0) to store all")

    # hooks: what a subclass overrides (HOOKS) -----------------------------------
    def reset_step_impl(self) -> None:
        """Forget the subclass's records of a step (called after the recorder forgot its own, from ``__init__`` on)."""

    def param_grads_impl(self, grads: Sequence[tuple[str, str, Any]]) -> None:
        """Record the step's parameter gradients, (module, attribute, gradient): each as kind ``grad``."""
        for mod, pname, grad in grads:
            if grad is not None:
                self._record("param_grad", "grad", mod, 0, pname, self._classes.get(mod, ""), grad, track=False)

    def take_param_grads_impl(self) -> None:
        """Find the step's parameter gradients, final now, and hand them to ``_param_grads`` (an adapter that can)."""

    def step_attrs_impl(self) -> dict[str, Any]:
        """Attributes of the step being written, beyond its wall time and loss (subclasses that have more)."""
        return {} if self.iteration is None else {"iteration": self.iteration}

    def end_step_impl(self) -> bool:
        """The open step is about to be written: finish its records. False: it is no step of the run (dropped)."""
        return True

    def remove_hooks_impl(self) -> None:
        """Undo anything beyond the handles (subclasses that need it)."""

    def sync_impl(self) -> None:
        """Before ``step()`` and ``close()``: wait for the framework's work in flight whose hooks may still record."""

    def before_step_impl(self, grads: Any, scalars: dict[str, Any]) -> None:
        """``step()`` begins (the lock held), given ``grads``: record them, in an adapter that takes the step's
        parameter gradients there (MindSpore's ``value_and_grad`` ones). Elsewhere they are a scalar like the others."""
        if grads is not None:
            scalars["grads"] = grads

    def after_step_impl(self) -> None:
        """``step()`` has ended the step (the lock held)."""

    #: the training loop's own number of the step in flight (Megatron's iteration, a Trainer's step), if it has one
    iteration: int | None = None

    # public API ---------------------------------------------------------------
    @property
    def state(self) -> StepState:
        """Where the recorder stands (read only: the recorder's methods change it)."""
        return self._state

    @property
    def active(self) -> bool:
        """Recording the step in flight (not finished, and not a step ``every`` skips)."""
        return self._state.active

    @property
    def finished(self) -> bool:
        """Every step asked for is recorded, or the capture stopped."""
        return self._state.finished

    @property
    def step_loss(self) -> float | None:
        """The loss recorded for the step in flight, if one was (reading it waits for the device)."""
        if self._loss is None and self._loss_t is not None:
            self._loss = self._t.scalar(self._loss_t)
        return self._loss

    @property
    def loss_recorded(self) -> bool:
        """Whether the step in flight has its loss (``step_loss`` without waiting for the device)."""
        return self._loss_t is not None

    @property
    def call_depth(self) -> int:
        """Module calls of the step in flight entered and not returned (0: between top-level calls)."""
        return len(self._stack)

    def _due(self) -> bool:
        """Whether the training step ``step()`` is about to start is one ``every`` records."""
        return self._state.iteration % self.options.every == 0

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, exc_type: Any = None, exc: Any = None, tb: Any = None) -> None:
        if exc_type is not None:  # the step in flight is written, marked as cut short: a diff never passes it
            self._state.interrupted = f"{getattr(exc_type, '__name__', exc_type)}: {exc}"[:300]
        self.close()

    def loss(self, value: Any) -> None:
        """Record the loss of the step in flight (a tensor or a number)."""
        if not self.active:
            return
        try:
            self._ensure_step()
            t = self._t.loss_tensor(value)
            # its value is read with the step's statistics (``_end_step``): the device may still be computing it
            self._loss, self._loss_t = None, t
            self._record("loss", "loss", "loss", 0, "value", "Loss", t, full=True, track=False)
        except Exception as err:
            self.fail(err)

    def step(self, loss: Any = None, grads: Any = None, **scalars: Any) -> None:
        """End the step in flight (recording ``loss``, and ``grads`` where the adapter takes them, first, if given).

        ``loss`` and any keyword scalars (``grad_norm=``, ``lr=``, ``val_loss=`` ...) are also
        appended to the file's per-step scalars, for every step of the run, including those
        after the captured ones: ``tensordiff runs`` reads them. The optimizer's settings seen at its step
        (``optimizer_scalars``: lr, betas, epsilon, weight decay) come with them."""
        self.sync_impl()
        with self._lock:
            self.before_step_impl(grads, scalars)
            self._end_training_step(loss, scalars)
            self.after_step_impl()

    def _end_training_step(self, loss: Any, scalars: dict[str, Any]) -> None:
        """The step ends, then its scalars are logged: the step's records are packed while the device may still be
        computing, and its statistics, its loss and the scalars given as tensors are read after one wait for it."""
        state = self._state
        scalars = {**self._optimizer_scalars, **scalars}
        self._optimizer_scalars = {}
        if loss is not None:
            self.loss(loss)
        at = state.iteration
        state.iteration += 1
        ended, written = False, None
        if state.resting:  # every=N: count the step, wake up for the next one due
            state.resting = not self._due()
        elif self.active and state.in_step:
            try:
                written = self._end_step()
                ended = True
            except Exception as err:
                self.fail(err)
        if loss is not None:
            value = written if ended else self.step_loss
            scalars = {"loss": value if value is not None else loss, **scalars}
        if scalars:
            self.log(at, **scalars)

    def log(self, step: int | None = None, **values: Any) -> None:
        """Append per-step scalars (numbers or one-element tensors), e.g. ``cap.log(val_loss=v)``.

        ``step`` defaults to the step that ``step()`` ended last (0 before the first): validation
        logged after ``cap.step(loss)`` lands on that step, as Megatron-LM's "validation loss at
        iteration N" does. Cheap and kept for the whole run, after the captured steps too; never raises."""
        if self._state.closed or not values:
            return
        try:
            at = max(self._state.iteration - 1, 0) if step is None else int(step)
            out = {name: float(v) if isinstance(v, (int, float)) else self._t.scalar(self._t.loss_tensor(v))
                   for name, v in values.items() if v is not None}
            self._writer.submit_scalars(at, out)
        except Exception as err:
            _warn(f"tensordiff: scalars {sorted(values)} not recorded ({type(err).__name__}: {err}); "
                          "training goes on")

    def set_iteration(self, iteration: int | None = None) -> None:
        """Number the step in flight as the training loop does, from 1 (Megatron-LM's iteration, a Trainer's step):
        the step attribute ``iteration``; given, the step's scalars land at ``iteration - 1``. None: the number is
        ``step()``'s own count."""
        if iteration is not None:
            self._state.iteration = iteration - 1
        self.iteration = self._state.iteration + 1

    def on_call(self, name: str, args: Any, kwargs: dict) -> None:
        """A module/cell starts (a framework pre-hook): never raises into the model (a failure stops the capture)."""
        if self.active:
            try:
                self._begin_call(name, args, kwargs)
            except Exception as err:
                self.fail(err)

    def on_return(self, name: str, output: Any) -> None:
        """A module/cell returns (a framework post-hook): never raises into the model."""
        if self.active:
            try:
                self._end_call(name, output)
            except Exception as err:
                self.fail(err)

    def optimizer_step_begin(self, optimizer: Any = None) -> None:
        """The optimizer is about to update the parameters: its settings (``optimizer_scalars``) go with the step's
        scalars, and the step's parameter gradients, final now, are recorded unless they are already."""
        if not self._state.recording:
            return
        self._optimizer_scalars = optimizer_scalars(optimizer)  # the settings this step runs with
        if not self._state.grads_taken:
            try:
                self.take_param_grads()
            except Exception as err:
                self.fail(err)

    def optimizer_step_end(self) -> None:
        """The optimizer has updated the parameters: the step ends at the next top-level call, or ``step()``."""
        if self._state.recording:
            self._state.step_ready = True

    def take_param_grads(self) -> None:
        """The step's parameter gradients are final: record them (``take_param_grads_impl``). Raises what reading
        them raises: a controller that calls it stops the capture on a failure."""
        self._state.grads_taken = True
        self.take_param_grads_impl()

    def restart_step(self) -> None:
        """Forget the step in flight, its records and gradient hooks (a pass of the same step follows)."""
        for handle in self._tensor_handles:
            handle.remove()
        self._tensor_handles.clear()
        self._state.in_step = False
        self._reset_step()

    def fail(self, err: BaseException) -> None:
        """Stop capturing for good: one warning, every hook removed; the steps written stay (training goes on)."""
        if not self._state.failed:
            text = first_line(err, limit=10_000, default="")
            report_status(f"capture stopped: {type(err).__name__}: {text}")
            _warn(f"tensordiff: capture stopped ({type(err).__name__}: {text}); hooks removed, training goes on; "
                  f"completed steps are in {self.path}")
        self._state.stop()
        self._remove_hooks()

    def _finish_on_signal(self, timeout: float) -> None:
        """SIGTERM / SIGHUP: the steps handed to the writer are written and the file closed within ``timeout``; the
        step in flight is left out (it is not whole); every hook is removed."""
        if self._state.closed:
            return
        self._remove_hooks()
        self._state.closed = True
        self._writer.close(timeout)

    def close(self) -> None:
        """Finish the step in flight, remove every hook, close the file."""
        self.sync_impl()
        with self._lock:
            self._signals.remove()
            if self._state.in_step and not self._state.failed:
                try:
                    self._end_step()
                except Exception as err:
                    self.fail(err)
            self._remove_hooks()
            self._state.closed = True
            self._writer.close()
            with contextlib.suppress(Exception):
                self._t.close()

    # bookkeeping --------------------------------------------------------------
    def _remove_hooks(self) -> None:
        for handle in self._handles + self._tensor_handles:
            if handle is not None:
                handle.remove()
        self._handles.clear()
        self._tensor_handles.clear()
        self.remove_hooks_impl()

    def _reset_step(self) -> None:
        self._seq = 0
        self._rows: list[dict[str, Any]] = []
        self._pending: list[tuple[int, Any]] = []
        self._late: dict[int, Any] = {}
        self._data: dict[int, Any] = {}
        self._seen: dict[int, tuple[Any, int, int]] = {}
        self._stack: list[tuple[str, int, int, str]] = []
        # the step's parameters as recorded (phase weights): id -> (ref, version, seq), and their storage aliases
        self._param_seqs: dict[int, tuple[Any, int, int]] = {}
        self._param_aliases: dict[Any, tuple[Any, int, int]] = {}
        # inputs whose gradient is hooked, per open call (its enter seq): (tensor ref, version, hook)
        self._watched: dict[int, list[tuple[Any, int, Any]]] = {}
        self._calls: dict[str, int] = defaultdict(int)
        self._loss, self._loss_t = None, None
        self._state.clear_step()
        self._t0 = time.perf_counter()
        self.reset_step_impl()

    def _ensure_step(self) -> None:
        """Open a step unless one is open: its weights are recorded first."""
        if self._state.in_step:
            return
        self._reset_step()
        self._state.open_step()
        step = self._state.step
        self._full = self.options.full_tensors_at(step)
        if step == 0 and self.options.perturb is not None:
            # asked for on purpose: tensordiff noise's second run
            self._t.perturb([p for _, _, p in self._params], self.options.perturb)
        for mod, pname, p in self._params:
            seq = self._record("weights", "param", mod, 0, pname, self._classes.get(mod, ""), p, track=False)
            self._note_parameter(p, seq)

    def _note_parameter(self, p: Any, seq: int) -> None:
        """Remember parameter ``p``, recorded as ``seq``: a forward argument that is ``p`` (megatron's tied output layer
        is called with ``weight=`` the word embeddings' weight) is recorded as a link to it (``_parameter_link``)."""
        try:
            entry = (weakref.ref(p), self._t.version(p), seq)
        except TypeError:  # not weak-referenceable: no links to it
            return
        self._param_seqs[id(p)] = entry
        key = self._t.alias_key(p)
        if key is not None:
            self._param_aliases.setdefault(key, entry)

    def _parameter_link(self, t: Any) -> int:
        """The seq of the step's weights record of the parameter that forward argument ``t`` is, else -1: the very
        tensor object, or a tensor with no autograd history over the same storage in the same layout (``p.detach()``,
        ``p.data``), either unchanged since the weights were recorded. The link says the argument *is* that parameter:
        the merge of rank files shards it as the parameter is sharded and the cross-rank check checks the parameter
        (store/merged.py). A differentiable view of a parameter is recorded as itself (its gradient is hooked)."""
        entry = self._param_seqs.get(id(t))
        if entry is not None and entry[0]() is t:
            return entry[2] if self._t.version(t) == entry[1] else -1
        if not self._param_aliases:
            return -1
        key = self._t.alias_key(t, untracked=True)
        entry = self._param_aliases.get(key) if key is not None else None
        if entry is None:
            return -1
        p = entry[0]()
        return entry[2] if p is not None and self._t.version(p) == entry[1] else -1

    def _begin_call(self, name: str, args: Any, kwargs: dict) -> None:
        """A module/cell starts: new call index, nesting, inputs."""
        if not self._stack and name == "" and self._state.step_ready:
            self._end_step()
            if not self.active:
                return
        self._ensure_step()
        call = self._calls[name]
        self._calls[name] += 1
        enter = self._seq
        parent = self._stack[-1][0] if self._stack else ""
        self._stack.append((name, call, enter, parent))
        if self.options.inputs:
            cls = self._classes.get(name, "")
            for slot, t in _tensors(args, kwargs, self._t.is_tensor):
                self._record("forward", "input", name, call, slot, cls, t, enter=enter, parent=parent,
                             grad_kind="grad_input", same_as=self._parameter_link(t))

    def _end_call(self, name: str, output: Any) -> None:
        """A module/cell returns: its outputs."""
        if not self._state.in_step:
            return
        while self._stack and self._stack[-1][0] != name:
            self._stack.pop()  # a child raised; drop its frame
        if not self._stack:
            return
        _, call, enter, parent = self._stack.pop()
        self._rehook_modified_inputs(enter)
        cls = self._classes.get(name, "")
        is_tensor = self._t.is_tensor
        for slot, t in (("0", output),) if is_tensor(output) else flatten(output, "", is_tensor):
            self._record("forward", "output", name, call, slot or "0", cls, t, enter=enter, parent=parent,
                         grad_kind="grad_output")

    def _rehook_modified_inputs(self, enter: int) -> None:
        """A module that modified an input in place (megatron's FP32 softmax masks its scores in place, on a view)
        leaves the gradient hook on that input's old autograd node, which may never run: hook the modified tensor
        too. The gradient is recorded once, by whichever hook runs first."""
        for ref, version, hook in self._watched.pop(enter, ()):
            t = ref()
            if t is None or self._t.version(t) == version:
                continue
            handle = self._t.hook_grad(t, hook)
            if handle is not None:
                self._tensor_handles.append(handle)

    def _grad_hook(self, step_id: int, fwd: dict, grad: Any) -> None:
        if not self.active or step_id != self._state.step_id or grad is None or fwd.get("done"):
            return
        fwd["done"] = True
        try:
            self._record("backward", fwd["grad_kind"], fwd["module"], fwd["call"], fwd["slot"], fwd["module_class"],
                         grad, enter=fwd["enter"], parent=fwd["parent"], grad_of=fwd["seq"], track=False)
        except Exception as err:
            self.fail(err)

    def _param_grads(self, grads: Sequence[tuple[str, str, Any]]) -> None:
        """Record the parameter gradients of the step, (module, attribute, gradient) (``param_grads_impl``)."""
        self._state.grads_taken = True
        self.param_grads_impl(grads)

    def _record(self, phase: str, kind: str, module: str, call: int, slot: str, module_class: str, t: Any, *,
                enter: int = -1, parent: str = "", grad_of: int = -1, grad_kind: str = "", track: bool = True,
                full: bool | None = None, same_as: int = -1) -> int:
        # called ~1,000 times a step from inside the model's hooks: kept to plain stores and lookups
        seq = self._seq
        self._seq = seq + 1
        backend = self._t
        dtype, shape = backend.describe(t)
        if dtype is None:
            self._late[seq] = t
        numel = math.prod(shape)
        row: dict[str, Any] = {
            "seq": seq, "phase": phase, "module": module, "call": call, "kind": kind, "slot": slot,
            "module_class": module_class, "dtype": dtype, "shape": _shape_text(shape),
            "min": 0.0, "max": 0.0, "mean": 0.0, "l2": 0.0, "nan": 0, "inf": 0, "numel": numel,
            "has_data": 0, "same_as": -1, "grad_of": grad_of, "enter": enter, "parent": parent,
        }
        self._rows.append(row)
        if same_as >= 0:  # the adapter knows it is a tensor recorded before (graph mode: the same bytes)
            row["same_as"] = same_as
            return seq
        if track:
            seen = self._seen.get(id(t))
            if seen is not None and seen[0]() is t and seen[1] == backend.version(t):
                row["same_as"] = seen[2]
                return seq
        self._pending.append((seq, backend.stats(t)))
        if full is None:
            full = self._full and self.options.full_tensor_selected(module, numel * _itemsize(dtype))
        if full:
            self._data[seq] = backend.copy(t)
            row["has_data"] = 1
        if track:
            try:
                ref = weakref.ref(t)
            except TypeError:  # not weak-referenceable: no links for it
                ref = None
            version = backend.version(t)
            if ref is not None:
                self._seen[id(t)] = (ref, version, seq)
            if grad_kind and self.options.grads:
                fwd = {"seq": seq, "module": module, "call": call, "slot": slot, "module_class": module_class,
                       "enter": enter, "parent": parent, "grad_kind": grad_kind}
                hook = partial(self._grad_hook, self._state.step_id, fwd)
                handle = backend.hook_grad(t, hook)
                if handle is not None:
                    self._tensor_handles.append(handle)
                    if kind == "input" and enter >= 0 and ref is not None:
                        self._watched.setdefault(enter, []).append((ref, version, hook))
        return seq

    def _end_step(self) -> float | None:
        """Hand the open step to the writer; the loss it was written with (None: none, or no step written)."""
        state = self._state
        if not state.in_step:
            return None
        if not self.end_step_impl():
            self.restart_step()
            return None
        if not state.grads_taken:
            self.take_param_grads()
        for handle in self._tensor_handles:
            handle.remove()
        self._tensor_handles.clear()
        rows = self._rows
        for seq, t in self._late.items():
            rows[seq]["dtype"] = self._t.late_dtype(t)
        packed = StepRows.pack(rows)  # now, while the device may still be computing the step
        if rows and packed is None:
            raise RuntimeError("the step's records do not all have the same fields")
        if packed is not None:
            self._writer.prepare(packed)
        # resolved on the writer's thread: a copy still on its way to the host never holds up the training step
        data = {seq: Deferred(partial(self._t.to_numpy, t), self._t.copy_nbytes(t), partial(self._t.copy_ready, t))
                for seq, t in self._data.items()}
        values = self._t.host_stats([s for _, s in self._pending])  # waits for the device
        if packed is not None:
            _fill_stats(packed, [seq for seq, _ in self._pending], values)
        attrs: dict[str, Any] = {"wall_time": time.perf_counter() - self._t0}
        loss = self.step_loss
        if loss is not None:
            attrs["loss"] = loss
        if state.interrupted:
            attrs["interrupted"] = state.interrupted
        attrs.update(self.step_attrs_impl())
        # step() returns once the writer holds the step (its process, or its thread's flushed write): a SIGKILL after
        # it loses nothing (docs/reliability.md). The writer process takes a GPU model's full tensors still on their
        # way to the host after the step: training never waits for them; a SIGKILL before they arrive loses those
        # tensors (the step keeps their statistics and says so: tensors_lost)
        every = self.options.every
        # every=N: stored under its training step number (0, N, 2N, ...), so that runs and diff line steps up
        self._writer.submit(state.step if every == 1 else state.step_iteration, packed if packed is not None else rows,
                            data, attrs)
        state.step_written()
        self._reset_step()
        if state.step >= self.options.steps:
            state.done = True
            self._remove_hooks()
        elif every > 1 and state.iteration == state.step_iteration and not state.closed:
            # ended by the next step's first call, not by step(): nothing counts the steps to skip
            state.done = True
            self._remove_hooks()
            _warn(f"tensordiff: every={every} counts step() calls, and none came: only the first step was recorded "
                  f"to {self.path}; call cap.step(loss) once per training step")
        elif every > 1:
            state.resting = not self._due()
        return loss


_OPEN: weakref.WeakSet[Recorder] = weakref.WeakSet()


def _fill_stats(rows: StepRows, seqs: list[int], values: Any) -> None:
    """The step's statistics into its packed rows (row i is the record of seq i): ``values`` holds [min, max, sum,
    l2, nan, inf] of the records ``seqs`` (mean = sum / numel); a link (``same_as``) takes its record's."""
    table, col = rows.table, rows.number_fields.index
    if seqs:
        v = np.asarray(values, dtype=np.float64).reshape(len(seqs), 6)
        at = np.asarray(seqs, dtype=np.intp)
        numel = table[at, col("numel")]
        mean = np.divide(v[:, 2], numel, out=np.zeros(len(at)), where=numel > 0)
        for name, got in zip(STAT_KEYS, (v[:, 0], v[:, 1], mean, v[:, 3], v[:, 4], v[:, 5])):
            table[at, col(name)] = got
    same = table[:, col("same_as")]
    links = np.flatnonzero(same >= 0)
    if not links.size:
        return
    src = same[links].astype(np.intp)
    for _ in range(len(table)):  # a link to a link (an adapter's): followed to the record
        further = table[src, col("same_as")]
        hop = further >= 0
        if not hop.any():
            break
        src[hop] = further[hop].astype(np.intp)
    for name in _LINKED:
        table[links, col(name)] = table[src, col(name)]

_SLOTS = tuple(str(i) for i in range(64))


def _tensors(args: Sequence[Any], kwargs: dict, is_tensor: Callable[[Any], bool]) -> list[tuple[str, Any]]:
    """``flatten`` of a call's positional then keyword arguments ('0', '1.0', 'key', ...), with a fast path for
    the usual call: positional tensors and plain values."""
    out: list[tuple[str, Any]] = []
    for i, value in enumerate(args):
        if is_tensor(value):
            out.append((_SLOTS[i] if i < 64 else str(i), value))
        elif isinstance(value, (list, tuple, dict)):
            out.extend(flatten(value, str(i), is_tensor))
    if kwargs:
        out.extend(flatten(kwargs, "", is_tensor))
    return out


_SHAPES: dict[tuple[int, ...], str] = {}


def _shape_text(shape: tuple[int, ...]) -> str:
    """``shape_text``, remembered: a model records the same few shapes thousands of times a step."""
    try:
        text = _SHAPES.get(shape)
    except TypeError:  # sizes that do not hash (symbolic)
        return shape_text(shape)
    if text is None:
        text = shape_text(shape)
        if len(_SHAPES) < 65536:
            _SHAPES[shape] = text
    return text


def _itemsize(dtype: str | None) -> int:
    np_dtype = dtypes.NUMPY_DTYPES.get(dtype or "")
    return np_dtype.itemsize if np_dtype is not None else 4


class Deferred:
    """A full tensor handed to the writer before it reached the host: ``nbytes`` now, the array when called;
    ``ready()`` says whether it was taken in host memory at hook time (else it is a copy from an accelerator, which
    the writer process streams after its step)."""

    __slots__ = ("_get", "_ready", "nbytes")

    def __init__(self, get: Callable[[], np.ndarray], nbytes: int, ready: Callable[[], bool] | None = None):
        self._get = get
        self._ready = ready
        self.nbytes = nbytes

    def ready(self) -> bool:
        return self._ready is None or bool(self._ready())

    def __call__(self) -> np.ndarray:
        return self._get()


class NullCapture:
    """Stands in when capture is off: a ``CaptureHandle`` (with MindSpore's ``grads`` too) that records nothing."""

    path = None

    def __enter__(self) -> NullCapture:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def step(self, loss: Any = None, grads: Any = None, **scalars: Any) -> None:
        return None

    def log(self, step: int | None = None, **values: Any) -> None:
        return None

    def loss(self, value: Any) -> None:
        return None

    def grads(self, grads: Any, params: Any = None) -> None:
        return None

    def close(self) -> None:
        return None

    @property
    def active(self) -> bool:
        return False


def optimizer_scalars(optimizer: Any) -> dict[str, float]:
    """The learning rate (of the first parameter group, as Megatron-LM logs it), Adam's betas and epsilon and the
    weight decay of that group, and the loss scale, as per-step scalars (``lr``, ``adam_beta1``, ``adam_beta2``,
    ``adam_eps``, ``weight_decay``, ``loss_scale``); what the optimizer does not have is left out."""
    out: dict[str, float] = {}
    if optimizer is None:
        return out
    with contextlib.suppress(Exception):
        groups = optimizer.param_groups
        if groups:
            group = groups[0]
            out["lr"] = float(group["lr"])
            betas = group.get("betas")
            if isinstance(betas, (tuple, list)) and len(betas) == 2:
                out["adam_beta1"], out["adam_beta2"] = float(betas[0]), float(betas[1])
            for key, name in (("eps", "adam_eps"), ("weight_decay", "weight_decay")):
                if isinstance(group.get(key), (int, float)):
                    out[name] = float(group[key])
    with contextlib.suppress(Exception):
        scale = optimizer.get_loss_scale()
        out["loss_scale"] = float(scale.item() if hasattr(scale, "item") else scale)
    return out
