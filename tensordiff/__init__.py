"""tensordiff: find where two training runs first part ways, layer by layer.

Capture::

    with tensordiff.capture(model, "run.h5", steps=2, optimizer=opt) as cap:
        for batch in data:
            loss = model(batch).mean()
            loss.backward()
            opt.step(); opt.zero_grad()
            cap.step(loss)

Then ``tensordiff diff a.h5 b.h5 --first-divergence``.

Pipeline, one sub-package per stage: ``capturing`` (hooks record each step) → ``store`` (the
HDF5 file) → ``diff`` (align, compare, judge, the first divergence) → ``explain`` (likely causes,
replay) → ``report`` (tables, JSON). Beside it: ``ckpt`` (one checkpoint for both frameworks),
``runs`` (whole training runs), ``config`` (two runs' settings), ``batch`` (one batch file for both frameworks),
``cli`` (the commands; ``__main__``: ``python -m tensordiff``). torch and MindSpore are imported only in
``frameworks`` (tensors as numpy, files read without unpickling), the capture adapters and ``compat`` (CPU shims).

Leaves every stage may use: ``errors`` (one error class per kind of input), ``record`` (one captured tensor),
``dtypes`` (dtype names, narrow floats, ULPs), ``stats`` (a record's statistics), ``transforms`` (tensor layouts),
``mapping`` (pair files), ``_progress`` (the progress of long work: a bar on a terminal), ``_text``, ``_yaml``,
``_regex``, ``_warn``, ``_watchdog``, ``_version``, ``_native`` (C loops for the diff's hot paths, compiled on first
use).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._version import __version__
from ._warn import warn as _warn

if TYPE_CHECKING:
    from .capturing.recorder import CaptureHandle

__all__ = ["__version__", "capture"]

#: The sub-packages and modules reachable as attributes after ``import tensordiff`` (``tensordiff.batch.load``,
#: ``tensordiff.diff.diff``, ...), imported on first use so that ``import tensordiff`` stays light.
_LAZY = frozenset({"batch", "capturing", "ckpt", "cli", "compat", "diff", "dtypes", "errors", "explain", "frameworks",
                   "mapping", "record", "report", "runs", "stats", "store", "transforms"})


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _LAZY)


def _is_torch_module(obj: Any) -> bool:
    return any(c.__module__.startswith("torch.nn") and c.__name__ == "Module" for c in type(obj).__mro__)


def _is_mindspore_cell(obj: Any) -> bool:
    return any(c.__module__.startswith("mindspore.nn") and c.__name__ == "Cell" for c in type(obj).__mro__)


def capture(model: Any, path: str | None = None, steps: int | None = None, *, optimizer: Any = None,
            tensors: str | None = None, inputs: bool = True, grads: bool = True, background: bool = True,
            tensors_max_mb: float | None = None, tensors_match: str | None = None, writer: str | None = None,
            meta: dict | None = None, graph: bool | None = None, cells: str | None = None, durable: bool = False,
            every: int = 1) -> CaptureHandle:
    """Record the first ``steps`` training steps of ``model`` into the HDF5 file ``path``.

    ``model`` is a ``torch.nn.Module`` or a ``mindspore.nn.Cell``. MindSpore in GRAPH_MODE (or ``graph=True``, for
    a ``mindspore.jit`` step run from PyNative) is captured through probes compiled into the graph (CPU backend):
    cell outputs and their gradients, weights, parameter gradients (through ``optimizer``), the loss; ``cells``,
    a regex on cell names, narrows the probed cells (default: every cell).
    Returns a ``CaptureHandle`` (``tensordiff.capturing.recorder``): a context manager with ``step(loss=None)``,
    ``loss(value)``, ``log(**scalars)`` and ``close()`` (MindSpore: also ``grads(grads)`` and ``step(loss, grads=...)``
    for the gradients ``value_and_grad`` returns, unless ``optimizer`` is given).
    ``tensors_max_mb`` and ``tensors_match`` (a regex on module names) narrow which records of a full-tensor step are
    stored in full; the rest keep their statistics. Models of 1B parameters or more default to 64 MiB per record.
    ``writer='process'`` (the default) writes the file from a child process: HDF5 never holds the training process's
    GIL, and ``step()`` returns once its step is in the child's hands, so a killed run (SIGKILL included) loses no
    step whose ``step()`` returned; ``'thread'`` writes from threads of this process, each step written and flushed
    before ``step()`` returns.
    ``every=N`` records every Nth step (0, N, 2N, ..., counted by ``step()``; ``steps`` of them, stored under their
    training step numbers; the hooks do nothing in between): statistics of a whole run for ``tensordiff runs``' layer
    drift table at a fraction of the cost.
    ``durable=True`` (or ``TENSORDIFF_DURABLE=1``): ``step()`` returns only once its step is flushed to the file (the
    thread writer is used; the step waits for the write). A SIGTERM or SIGHUP closes the file with every step handed
    over, then does what it would have done without tensordiff.
    ``tensordiff capture -o FILE --steps N -- cmd`` sets FILE, N and the tensor mode
    through the environment, overriding the arguments; with no path at all the
    capture is off and the returned object records nothing. A capture that cannot
    start warns and records nothing: the training run always goes on.
    """
    from .capturing.options import options_from_env, report_status
    from .capturing.recorder import NullCapture

    options = options_from_env(path, steps, tensors, inputs=inputs, grads=grads, background=background,
                               tensors_max_mb=tensors_max_mb, tensors_match=tensors_match, writer=writer,
                               durable=durable, every=every)
    if options is None:
        return NullCapture()
    try:
        if _is_torch_module(model):
            from .capturing.torch.adapter import TorchCapture

            return TorchCapture(model, options, optimizer=optimizer, meta=meta)
        if _is_mindspore_cell(model):
            from .capturing.mindspore.graph import MindSporeGraphCapture, graph_mode_wanted

            if graph_mode_wanted(graph):
                return MindSporeGraphCapture(model, options, optimizer=optimizer, meta=meta, cells=cells)
            from .capturing.mindspore.adapter import MindSporeCapture

            return MindSporeCapture(model, options, optimizer=optimizer, meta=meta)
        from .errors import UsageError

        raise UsageError(f"cannot capture a {type(model).__module__}.{type(model).__name__}: "
                         "expected a torch.nn.Module or a mindspore.nn.Cell")
    except Exception as err:  # the training run comes first: warn and record nothing

        report_status(f"capture not started: {err}")
        _warn(f"tensordiff: capture not started ({type(err).__name__}: {err}); training goes on without it")
        return NullCapture()
