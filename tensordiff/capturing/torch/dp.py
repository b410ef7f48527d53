"""The parameter gradients before the data-parallel reduction (record kind ``grad_local``), beside ``grad`` (after it).

Recorded only in a run with DP > 1, from one of three sources, picked from the model the capture was given:

* **megatron-core ``DistributedDataParallel``**: each bucket group's ``start_grad_sync`` is wrapped (an attribute
  of that bucket group object, removed again): before megatron scales the bucket by its
  ``gradient_scaling_factor`` (1/DP) and all-reduces it, each parameter's ``main_grad`` is copied. That is the
  gradient accumulated on this rank, in the dtype of the buffer the collective reduces (FP32 with
  ``grad_reduce_in_fp32``). The first call of a step wins: with ``overlap_grad_reduce`` a repeated call is a no-op.
* **torch ``DistributedDataParallel``**: a post-accumulate-grad hook on each parameter copies ``param.grad`` right
  after autograd accumulated it, which is before DDP's reducer copies it into its bucket and reduces it (its hook on
  the same accumulator runs after the tensor's own hooks). The comm hook the program registered (``bf16_compress_hook``,
  PowerSGD, ...) runs as it was registered; its name is written with the step. Not a comm hook of our own: the
  reducer takes one comm hook, once, and keeps it for the life of the model, so wrapping the program's hook is
  impossible once it is registered, would make the program's own later registration fail, and would outlive the
  capture.
* **no DDP wrapper** (the program all-reduces ``param.grad`` itself after backward): the same post-accumulate-grad
  hook; the last value of the step is the local gradient.

Each step's ``grad_reduction`` attribute (JSON) says which source it was and what is known of the reduction:
``{"by": "megatron DDP" | "torch DDP" | "the program, after backward (no DDP wrapper)", "dp": N,
"buffer_dtype": ..., "scale": ..., "comm_hook": ...}``. Nothing here changes a gradient (copies only), raises into
the run (a failure stops the capture, ``Recorder.fail``) or stays installed after the last captured step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from ...frameworks.torch import dtype_name
from . import parallel

_MISSING = object()


def _megatron_ddp(model: Any) -> Any:
    """megatron-core's DistributedDataParallel: the model or one of its ``.module`` wrappers, else None."""
    seen = 0
    while model is not None and seen < 4:
        groups = getattr(model, "bucket_groups", None)
        if isinstance(groups, list) and hasattr(model, "finish_grad_sync") and all(
                hasattr(g, "start_grad_sync") and hasattr(g, "buckets") for g in groups):
            return model
        model, seen = getattr(model, "module", None), seen + 1
    return None


def _torch_ddp(model: Any) -> Any:
    seen = 0
    while model is not None and seen < 4:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return model
        model, seen = getattr(model, "module", None), seen + 1
    return None


def _owned_ranges(group: Any) -> dict[int, tuple[int, int]]:
    """For megatron's distributed optimizer: each parameter of a bucket group -> the (start, end) of its flattened
    elements that fall in this rank's shard of the bucket (the part the reduce-scatter writes here; (0, 0): none).
    The shards are megatron's: each bucket's ``grad_data`` cut into equal parts, one per rank of the group. Where a
    parameter lies in its bucket is read from memory (``main_grad`` is a view of the bucket's buffer), so megatron's
    padding between parameters needs no knowledge of its index maps."""
    size = int(group.intra_distributed_optimizer_instance_size)
    rank = int(group.intra_distributed_optimizer_instance_rank)
    out: dict[int, tuple[int, int]] = {}
    for bucket in group.buckets:
        data = bucket.grad_data
        shard = data.numel() // size
        own_lo, own_hi = rank * shard, (rank + 1) * shard
        for p in getattr(bucket, "params_list", None) or list(bucket.params):
            grad = getattr(p, "main_grad", None)
            if grad is None:
                continue
            start = (grad.data_ptr() - data.data_ptr()) // data.element_size()
            if not 0 <= start <= data.numel() - grad.numel():
                raise ValueError("a main_grad outside its bucket's buffer")
            lo, hi = max(start, own_lo), min(start + grad.numel(), own_hi)
            out[id(p)] = (lo - start, hi - start) if lo < hi else (0, 0)
    return out


def data_parallel_size(model: Any) -> int:
    """DP of this run: a torch DDP's process group, else megatron's ``parallel_state``, else the world size."""
    try:
        ddp = _torch_ddp(model)
        if ddp is not None:
            return int(torch.distributed.get_world_size(ddp.process_group))
        coords = parallel.layout(model)
        return int(coords.get("dp", coords.get("world_size", 1)))
    except Exception:
        return 1


class LocalGrads:
    """Copies of the parameter gradients before the DP reduction, for the step in flight (see the module docstring).

    ``active()`` says whether the capture takes them now; ``fail(err)`` stops the capture. ``take()`` hands the
    step's copies over in parameter order and forgets them; ``remove()`` undoes every hook and wrapper."""

    def __init__(self, model: Any, params: list[tuple[str, str, Any]], dp: int, active: Callable[[], bool],
                 fail: Callable[[BaseException], None]):
        self.dp = dp
        self._params = params
        self._active = active
        self._fail = fail
        self._copies: dict[int, torch.Tensor] = {}
        self._undo: list[Callable[[], None]] = []
        self._removed = False
        self._megatron = _megatron_ddp(model)
        self._ddp = _torch_ddp(model) if self._megatron is None else None
        #: megatron's distributed optimizer reduce-scatters the gradients: after the reduction each rank's
        #: ``main_grad`` is right only in the shard it owns; ``owned`` says which part of each parameter that is
        self.sharded = bool(self._megatron is not None and getattr(getattr(self._megatron, "ddp_config", None),
                                                                   "use_distributed_optimizer", False))
        #: id(param) -> (start, end): the elements of the flattened parameter whose reduced gradient this rank holds
        self.owned: dict[int, tuple[int, int]] = {}
        try:
            if self._megatron is not None:
                for group in list(self._megatron.bucket_groups) + list(
                        getattr(self._megatron, "expert_parallel_bucket_groups", None) or []):
                    self._wrap_bucket_group(group)
                    if self.sharded:
                        self.owned.update(_owned_ranges(group))
            else:
                for _, _, p in params:
                    if p.requires_grad:
                        handle = p.register_post_accumulate_grad_hook(self._accumulated)
                        self._undo.append(handle.remove)
        except BaseException:
            self.remove()  # nothing half-installed stays behind
            raise

    # sources ---------------------------------------------------------------------------------------------------
    def _wrap_bucket_group(self, group: Any) -> None:
        before = group.__dict__.get("start_grad_sync", _MISSING)
        original = group.start_grad_sync  # bound method, or a wrapper the program put there

        def start_grad_sync(*args: Any, **kwargs: Any) -> Any:
            if not self._removed and self._active():
                try:
                    for bucket in group.buckets:
                        for p in getattr(bucket, "params_list", None) or list(bucket.params):
                            if id(p) not in self._copies and getattr(p, "main_grad", None) is not None:
                                self._copies[id(p)] = p.main_grad.detach().clone()
                except Exception as err:
                    self._fail(err)
            return original(*args, **kwargs)

        group.start_grad_sync = start_grad_sync

        def undo() -> None:
            if group.__dict__.get("start_grad_sync") is start_grad_sync:
                if before is _MISSING:
                    del group.start_grad_sync
                else:
                    group.start_grad_sync = before
            # else: wrapped again by someone else since; ours stays in their chain as a pass-through (_removed)
        self._undo.append(undo)

    def _accumulated(self, p: torch.Tensor) -> None:
        if self._removed or not self._active() or p.grad is None:
            return
        try:
            self._copies[id(p)] = p.grad.detach().clone()  # the last accumulation of the step wins
        except Exception as err:
            self._fail(err)

    # the recorder's side ---------------------------------------------------------------------------------------
    def take(self) -> list[tuple[str, str, torch.Tensor]]:
        out = [(mod, pname, self._copies[id(p)]) for mod, pname, p in self._params if id(p) in self._copies]
        self._copies = {}
        return out

    def forget(self) -> None:
        self._copies = {}

    def info(self) -> dict[str, Any]:
        """What is known of this step's reduction (the step attribute ``grad_reduction``)."""
        out: dict[str, Any] = {"dp": self.dp}
        try:
            if self._megatron is not None:
                out["by"] = "megatron DDP"
                groups = list(self._megatron.bucket_groups)
                buckets = [b for g in groups for b in g.buckets]
                out["buffer_dtype"] = sorted({dtype_name(b.grad_data.dtype) for b in buckets})
                out["scale"] = sorted({float(b.gradient_scaling_factor) for b in buckets})
                config = getattr(self._megatron, "ddp_config", None)
                for key in ("grad_reduce_in_fp32", "average_in_collective", "use_distributed_optimizer"):
                    if hasattr(config, key):
                        out[key] = bool(getattr(config, key))
            elif self._ddp is not None:
                out["by"] = "torch DDP"
                hooks = [getattr(h, "__name__", None) or type(h).__name__
                         for h, _ in getattr(self._ddp, "_comm_hooks", [])]
                out["comm_hook"] = hooks[0] if hooks else None
            else:
                out["by"] = "the program, after backward (no DDP wrapper)"
        except Exception:
            pass
        return out

    def remove(self) -> None:
        if self._removed:
            return
        self._removed = True
        self._copies = {}
        for undo in reversed(self._undo):
            with contextlib.suppress(Exception):  # a half-torn-down model must not fail the run
                undo()
        self._undo.clear()
