"""CPU shims for megatron-core (tested with 0.16.1, torch CPU build, no Transformer Engine/Apex).

megatron-core assumes CUDA. To run a tiny ``GPTModel`` (local layer spec) on the CPU:

0. Process groups: megatron needs ``torch.distributed`` and its ``parallel_state``
   (TP=PP=1). ``init_megatron_cpu`` creates a one-process gloo group and calls
   ``parallel_state.initialize_model_parallel(1, 1)``.
1. ``torch.cuda.current_device()``: ``DotProductAttention`` takes its score buffer from
   ``parallel_state.get_global_memory_buffer()``, which allocates on
   ``torch.cuda.current_device()``; RoPE code also moves tensors there. On a CPU-only torch
   that raises "Torch not compiled with CUDA enabled". ``enable()`` makes it answer ``"cpu"``
   (only when CUDA is unavailable); ``disable()`` restores the original function exactly;
   ``megatron_cpu()`` is the context-manager form.
2. RNG tracker: attention wraps dropout in ``get_cuda_rng_tracker().fork()``, which fails
   ("cuda rng state model-parallel-rng is not added") unless CUDA RNG states were added.
   On CPU we install megatron's own no-op tracker via
   ``model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)`` (its ``fork()`` is a
   ``nullcontext``, so dropout, if any, draws from the CPU generator).

Not shimmed (avoid instead): ``attention_mask=None`` with a causal mask type builds the mask
with ``device="cuda"`` -- pass an explicit bool mask ``[1, 1, S, S]`` (True = masked).

3. Pipeline parallelism (``pipeline_cpu()``, a context manager, only when CUDA is unavailable):
   ``LanguageModule.setup_embeddings_and_output_layer`` moves the embedding to ``.cuda()``, the
   schedule allocates its token counter with ``device="cuda"`` and ``p2p_communication`` calls
   ``torch.cuda.synchronize()``. Inside the block ``torch.Tensor.cuda`` is the identity,
   ``torch.cuda.synchronize`` a no-op, and a ``TorchFunctionMode`` rewrites a CUDA ``device=``
   (``"cuda"``, ``"cuda:N"``, ``torch.device("cuda")``, an index) to the CPU; the exact original
   objects are put back on exit.

4. MoE router without Transformer Engine: megatron-core 0.16.1's ``RouterGatingLinearFunction`` tests
   ``te_general_gemm is not None``, a name ``moe_utils`` binds only when Transformer Engine imports
   (``NameError`` otherwise). ``init_megatron_cpu`` binds it to ``None`` where it is missing, so the router
   takes its ``torch.mm`` path.

torch and megatron are imported lazily; importing this module costs nothing.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

_ORIG_CURRENT_DEVICE: Callable[[], Any] | None = None  # set while shim 1 is enabled


def _cpu_current_device() -> str:
    """Replacement for ``torch.cuda.current_device`` on CPU-only machines."""
    return "cpu"


def is_enabled() -> bool:
    """Whether shim 1 (``torch.cuda.current_device`` -> ``"cpu"``) is active."""
    return _ORIG_CURRENT_DEVICE is not None


def enable() -> None:
    """Patch ``torch.cuda.current_device`` to return ``"cpu"``; no-op if CUDA is available."""
    global _ORIG_CURRENT_DEVICE
    import torch

    if torch.cuda.is_available() or _ORIG_CURRENT_DEVICE is not None:
        return
    _ORIG_CURRENT_DEVICE = torch.cuda.current_device
    torch.cuda.current_device = _cpu_current_device


def disable() -> None:
    """Restore the original ``torch.cuda.current_device`` (no-op if not enabled)."""
    global _ORIG_CURRENT_DEVICE
    import torch

    if _ORIG_CURRENT_DEVICE is None:
        return
    torch.cuda.current_device = _ORIG_CURRENT_DEVICE
    _ORIG_CURRENT_DEVICE = None


@contextlib.contextmanager
def megatron_cpu() -> Iterator[None]:
    """Enable shim 1 inside the block; restore the previous state on exit."""
    was_enabled = is_enabled()
    enable()
    try:
        yield
    finally:
        if not was_enabled:
            disable()


def _rng_tracker_forks() -> bool:
    from megatron.core import tensor_parallel

    try:
        with tensor_parallel.get_cuda_rng_tracker().fork():
            pass
        return True
    except Exception:
        return False


def init_megatron_cpu(seed: int = 1234) -> None:
    """Idempotently prepare megatron-core for single-process use (CPU-safe).

    Creates a one-process gloo group (in-process store, no network port) if none,
    initialises model parallelism (TP=PP=1), sets up the RNG tracker, seeds torch, binds the MoE router's
    missing Transformer Engine GEMM (shim 4) and enables shim 1 (left enabled; call ``disable()`` to restore
    ``torch.cuda.current_device``).
    """
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.moe import moe_utils

    enable()
    if not hasattr(moe_utils, "te_general_gemm"):  # shim 4: no Transformer Engine, the router's torch.mm path
        moe_utils.te_general_gemm = None
    if not dist.is_initialized():
        # an in-process store: no port to pick, nothing left in os.environ for child processes to trip on
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    elif not _rng_tracker_forks():
        # megatron's inference tracker: add/set_states are no-ops, fork() is a nullcontext.
        tensor_parallel.model_parallel_cuda_manual_seed(
            seed, inference_rng_tracker=True, force_reset_rng=True
        )


@contextlib.contextmanager
def sequence_parallel_torch_norms() -> Iterator[None]:
    """Let the local layer spec's torch norms be built under ``sequence_parallel=True`` (inside the block only).

    megatron-core's ``WrappedTorchNorm`` refuses sequence parallelism (its fused norms are CUDA-only). Inside this
    block it builds the torch ``LayerNorm``/``RMSNorm`` and marks their parameters ``sequence_parallel = True``, as
    megatron's fused norms do: their gradients are partial sums over the sequence shards until the training script
    (megatron's ``finalize_model_grads``) all-reduces them over the tensor-parallel group. Restored on exit.
    """
    from megatron.core.transformer import torch_norm

    original = torch_norm.WrappedTorchNorm.__dict__["__new__"]  # the staticmethod object itself

    def build(cls: Any, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> Any:
        import torch

        kind = getattr(config, "normalization", "LayerNorm")
        norm_cls = torch.nn.RMSNorm if kind == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_cls(normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = bool(getattr(config, "sequence_parallel", False))
        return norm

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(build)
    try:
        yield
    finally:
        torch_norm.WrappedTorchNorm.__new__ = original


class _CudaDeviceToCpu:
    """A ``torch.overrides.TorchFunctionMode`` (built lazily: torch is imported on use) that sends every
    ``device="cuda"`` of a factory function or ``Tensor.to`` to the CPU."""

    @staticmethod
    def build() -> Any:
        import torch
        from torch.overrides import TorchFunctionMode

        def cpu_if_cuda(device: Any) -> Any:
            if isinstance(device, torch.device):
                return torch.device("cpu") if device.type == "cuda" else device
            if isinstance(device, str):
                return "cpu" if device.split(":")[0] == "cuda" else device
            if isinstance(device, int) and not isinstance(device, bool):
                return "cpu"  # a bare index is a CUDA device
            return device

        class CudaDeviceToCpu(TorchFunctionMode):
            def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
                kwargs = dict(kwargs or {})
                if "device" in kwargs:
                    kwargs["device"] = cpu_if_cuda(kwargs["device"])
                if func is torch.Tensor.to and len(args) > 1 and isinstance(args[1], (str, torch.device, int)) \
                        and not isinstance(args[1], bool):
                    args = (args[0], cpu_if_cuda(args[1]), *args[2:])
                return func(*args, **kwargs)

        return CudaDeviceToCpu()


_MISSING = object()


def _identity_cuda(self: Any, *args: Any, **kwargs: Any) -> Any:
    """Replacement for ``torch.Tensor.cuda`` on CPU-only machines: the tensor itself."""
    return self


def _no_synchronize(device: Any = None) -> None:
    """Replacement for ``torch.cuda.synchronize`` on CPU-only machines: nothing to wait for."""
    return None


@contextlib.contextmanager
def pipeline_cpu() -> Iterator[None]:
    """Run megatron-core's pipeline-parallel code on the CPU inside the block (shim 3 of the module docstring):
    ``Tensor.cuda`` -> identity, ``torch.cuda.synchronize`` -> no-op, ``device="cuda"`` -> CPU. Does nothing when
    CUDA is available; restores the exact original objects on exit. Wrap the model's construction (the embedding
    setup) and each ``get_forward_backward_func()(...)`` call; also enables shim 1 for the block if it is off."""
    import torch

    if torch.cuda.is_available():
        yield
        return
    # torch.Tensor inherits ``cuda`` from torch._C.TensorBase: an own attribute only while shimmed (deleted after),
    # unless something had set one on torch.Tensor itself (put back as it was)
    own_cuda = torch.Tensor.__dict__.get("cuda", _MISSING)
    original_sync = torch.cuda.synchronize
    with megatron_cpu():
        torch.Tensor.cuda = _identity_cuda
        torch.cuda.synchronize = _no_synchronize
        try:
            with _CudaDeviceToCpu.build():
                yield
        finally:
            if own_cuda is _MISSING:
                del torch.Tensor.cuda
            else:
                torch.Tensor.cuda = own_cuda
            torch.cuda.synchronize = original_sync


_CUDA_TYPES = {"torch.FloatTensor": "torch.cuda.FloatTensor", "torch.HalfTensor": "torch.cuda.HalfTensor",
               "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}


@contextlib.contextmanager
def optimizer_cpu() -> Iterator[None]:
    """Build and step megatron-core's optimizers (the distributed optimizer too) on the CPU inside the block: shim 3
    (``pipeline_cpu``), and ``Tensor.type()`` without an argument names a CPU float tensor by its CUDA type
    (``torch.cuda.FloatTensor``), which the distributed optimizer checks its parameters against. Does nothing when
    CUDA is available; restores the exact original method on exit."""
    import torch

    if torch.cuda.is_available():
        yield
        return
    original = torch.Tensor.type
    own = torch.Tensor.__dict__.get("type", _MISSING)

    def cuda_named_type(self: Any, *args: Any, **kwargs: Any) -> Any:
        name = original(self, *args, **kwargs)
        return _CUDA_TYPES.get(name, name) if not args and not kwargs else name

    with pipeline_cpu():
        torch.Tensor.type = cuda_named_type
        try:
            yield
        finally:
            if own is _MISSING:
                del torch.Tensor.type
            else:
                torch.Tensor.type = own
