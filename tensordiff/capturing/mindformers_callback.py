"""``TensordiffCapture``: the MindSpore callback that captures a MindFormers Trainer run, set in its YAML alone.

::

    callbacks:
      - type: MFLossMonitor
      - type: TensordiffCapture
        output: run.h5      # optional; else TENSORDIFF_OUTPUT (``tensordiff capture -o``)
        steps: 2

MindFormers builds callbacks by name from its registry. ``register()`` puts this class there; without a line of
Python, MindFormers' own ``auto_register`` does it (``auto_register: tensordiff_capture.TensordiffCapture`` in the
entry, with ``--register_path`` / ``REGISTER_PATH`` naming ``REGISTER_DIR``, or ``REGISTER_DIR--tensordiff_capture.
TensordiffCapture`` when the register path is another one); ``tensordiff capture --mindformers`` writes that for you.

When training begins (before the first step compiles: GRAPH_MODE probes are compiled in), the callback starts
``tensordiff.capture``'s MindSpore capture (``MindSporeGraphCapture`` in GRAPH_MODE, else ``MindSporeCapture``) on the
model inside the Trainer's wrapper (``MFTrainOneStepCell.network``, through any tool cells: gradient accumulation,
pipeline, virtual dataset, data order) with the wrapper's optimizer. The parameter gradients are those the wrapper's
gradient clipping receives when it clips (``use_clip_grad``): after the loss scale and the reduction, before clipping,
as megatron-core's are recorded; else the optimizer's input. At each step end it ends the tensordiff step with the
loss MFLossMonitor reports (from ``cb_params.net_outputs``, read by MindFormers' own parser) and records the step's
learning rate, global norm and loss scale as per-step scalars, at the Trainer's step number
(``cb_params.cur_step_num``, from 1; also the step attribute ``iteration``). After ``steps`` steps every probe and
hook is gone; the scalars go on for the whole run and the file is closed when training ends. A failure warns once and
training goes on.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import numpy as np
from mindspore.train import Callback

from .._warn import warn as _warn_line
from .mindformers_register import NAME, REGISTER_DIR, REGISTER_MODULE
from .options import report_status

__all__ = ["REGISTER_DIR", "REGISTER_MODULE", "TensordiffCapture", "register"]

#: Cells the Trainer wraps the model in (each keeps the wrapped cell as ``.network``), by class name.
_TOOL_CELLS = ("MFTrainOneStepCell", "MFPipelineWithLossScaleCell", "TrainOneStepCell", "TrainOneStepWithLossScaleCell",
               "GradAccumulationCell", "GradAccumulationCellWithTwoOutput", "GradAccumulationCellWithMultiOutputs",
               "PipelineCell", "PipelineCellWithTwoOutput", "PipelineCellWithMultiOutputs", "MicroBatchInterleaved",
               "SequenceSplit", "_VirtualDatasetCell", "DataOrderWrapperCell", "WithLossCell")


def register() -> None:
    """Put ``TensordiffCapture`` into MindFormers' registry (callbacks), so ``type: TensordiffCapture`` builds it."""
    from mindformers.tools.register import MindFormerModuleType, MindFormerRegister

    MindFormerRegister.register_cls(TensordiffCapture, module_type=MindFormerModuleType.CALLBACK)


def unwrap(train_network: Any) -> tuple[Any, list[str]]:
    """The model inside the Trainer's train network, and the class names of the cells around it, outermost first."""
    cell, around = train_network, []
    while any(c.__name__ in _TOOL_CELLS for c in type(cell).__mro__):
        inner = getattr(cell, "network", None)
        inner = getattr(cell, "_backbone", None) if inner is None else inner  # WithLossCell's
        if inner is None or inner is cell:
            break
        around.append(type(cell).__name__)
        cell = inner
    return cell, around


def clipping(train_network: Any) -> Any:
    """The gradient-clipping cell of the Trainer's wrapper (``MFTrainOneStepCell.clip_grad_norm`` when its
    ``use_clip_grad`` is on), or None. Its input is the step's gradients after the loss scale and the data-parallel
    reduction, before clipping: recorded there, they are megatron-core's (which clips inside its optimizer step)."""
    cell = train_network
    while cell is not None:
        clip = getattr(cell, "clip_grad_norm", None)
        if getattr(cell, "use_clip_grad", False) is True and clip is not None and callable(clip):
            return clip
        inner = getattr(cell, "network", None)
        cell = inner if inner is not cell else None
    return None


def step_outputs(net_outputs: Any) -> tuple[Any, dict[str, float]]:
    """(loss, scalars) of one train step's outputs, the loss as MFLossMonitor reports it (MindFormers' parser of
    ``cb_params.net_outputs``); scalars ``lr``, ``grad_norm``, ``loss_scale`` where the wrapper returns them."""
    from mindformers.core.callback.callback import _get_loss_output

    loss, _overflow, scale, lr, norm = _get_loss_output(net_outputs)
    scalars: dict[str, float] = {}
    for name, value in (("lr", lr), ("grad_norm", norm), ("loss_scale", scale)):
        if value is None or isinstance(value, (bool, np.bool_)):
            continue  # MindFormers' "False": not returned by this wrapper
        with contextlib.suppress(TypeError, ValueError):
            scalars[name] = float(np.mean(np.asarray(value, dtype=np.float64)))
    return loss, scalars


class TensordiffCapture(Callback):
    """Captures the first ``steps`` training steps of the Trainer's model into ``output`` (see the module doc).

    ``output`` and ``steps`` as ``tensordiff.capture``'s ``path`` and ``steps`` (``tensordiff capture -o FILE
    --steps N`` overrides them); ``tensors``, ``tensors_max_mb``, ``tensors_match``, ``cells``, ``writer`` and
    ``durable`` as there too. An unknown key warns and is ignored: the Trainer is never stopped by this callback.
    """

    def __init__(self, output: str | None = None, steps: int | None = None, tensors: str | None = None,
                 tensors_max_mb: float | None = None, tensors_match: str | None = None, cells: str | None = None,
                 writer: str | None = None, durable: bool = False, **unknown: Any):
        super().__init__()
        self.output, self.steps, self.tensors = output, steps, tensors
        self.tensors_max_mb, self.tensors_match, self.cells = tensors_max_mb, tensors_match, cells
        self.writer, self.durable = writer, bool(durable)
        self.capture: Any = None
        self.model: Any = None
        self._failed = False
        if unknown:
            self._warn(f"unknown option(s) {', '.join(sorted(unknown))} ignored (known: output, steps, tensors, "
                       "tensors_max_mb, tensors_match, cells, writer, durable)")

    # MindSpore's callback hooks --------------------------------------------------------------
    def on_train_begin(self, run_context: Any) -> None:
        if self.capture is not None or self._failed:
            return
        try:
            self._start(run_context.original_args())
        except Exception as err:
            self._give_up(err, "not started")

    def on_train_step_end(self, run_context: Any) -> None:
        cap = self.capture
        if cap is None or self._failed:
            return
        try:
            cb = run_context.original_args()
            loss, scalars = step_outputs(cb.net_outputs)
            step = int(cb.cur_step_num)
            cap.set_iteration(step)  # the scalars of Trainer step N land where MindFormers' log says N
            cap.step(None if loss is None else _loss_tensor(loss), **scalars)
        except Exception as err:
            self._give_up(err)

    def on_train_end(self, run_context: Any) -> None:
        self.close()

    def __exit__(self, *exc: Any) -> None:  # MindSpore's callback manager: training ended, with an error too
        self.close()

    # capture ---------------------------------------------------------------------------------
    def _start(self, cb: Any) -> None:
        """``tensordiff.capture``'s MindSpore branch (this stage may not import the package root): options merged with
        ``tensordiff capture``'s environment, graph probes in GRAPH_MODE, hooks in PyNative."""
        from .mindspore.adapter import MindSporeCapture
        from .mindspore.graph import MindSporeGraphCapture, graph_mode_wanted
        from .options import ENV_DISABLE, ENV_OUTPUT, options_from_env

        options = options_from_env(self.output, self.steps, self.tensors, tensors_max_mb=self.tensors_max_mb,
                                   tensors_match=self.tensors_match, writer=self.writer, durable=self.durable)
        if options is None:
            self._failed = True
            if os.environ.get(ENV_DISABLE, "") in ("", "0"):
                self._warn(f"no output file: set `output: run.h5` in the callback's YAML entry, or run the training "
                           f"under `tensordiff capture -o run.h5 --mindformers -- ...` ({ENV_OUTPUT})")
            return
        model, around = unwrap(cb.train_network)
        optimizer = cb.optimizer if cb.get("optimizer") is not None else getattr(cb.train_network, "optimizer", None)
        self.model = model
        clip = clipping(cb.train_network)
        meta = {"mindformers_trainer": "TensordiffCapture callback",
                "mindformers_wrapper": " > ".join(around) or type(cb.train_network).__name__,
                "param_grad_at": "before clipping (the wrapper's clip_grad_norm input)" if clip is not None else
                                 "the optimizer's input"}
        if graph_mode_wanted(None):
            self.capture = MindSporeGraphCapture(model, options, optimizer=optimizer, meta=meta, cells=self.cells,
                                                 grads_at=clip)
        else:
            self.capture = MindSporeCapture(model, options, optimizer=optimizer, meta=meta, grads_at=clip)

    def close(self) -> None:
        """Close the capture (every probe and hook removed, the file complete); idempotent, never raises."""
        cap, self.capture = self.capture, None
        if cap is not None:
            try:
                cap.close()
            except Exception as err:
                self._warn(f"closing {getattr(cap, 'path', 'the capture')} failed ({type(err).__name__}: {err})")

    def _give_up(self, err: BaseException, what: str = "stopped") -> None:
        """Stop capturing for good: one warning line (the recorder's, once it has started), every hook removed."""
        first, self._failed = not self._failed, True
        cap, self.capture = self.capture, None
        with contextlib.suppress(Exception):
            if cap is None:
                if first:
                    report_status(f"capture {what}: {type(err).__name__}: {err}")  # tensordiff capture says why
                    self._warn(f"capture {what} ({type(err).__name__}: {err})")
                return
            cap.fail(err)
            cap.close()

    @staticmethod
    def _warn(message: str) -> None:
        with contextlib.suppress(Exception):
            _warn_line(f"tensordiff: {NAME}: {message}; training goes on")


def _loss_tensor(loss: Any) -> Any:
    """MFLossMonitor's loss (a numpy number: the mean of the step's loss output) as a 0-d tensor of its dtype."""
    import mindspore as ms

    return ms.Tensor(np.asarray(loss))
