"""The adapter contract: what the framework-free ``Recorder`` needs to know about a framework's tensors.

One subclass per framework (``capturing/torch/adapter.py``, ``capturing/mindspore/adapter.py``). The recorder
calls these from inside the model's hooks, so each must be cheap, must not synchronise the
device where it can avoid it, and must never change the tensor it is given.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["TensorBackend"]


class TensorBackend(ABC):
    """How to read, copy and hook one framework's tensors."""

    @abstractmethod
    def is_tensor(self, value: Any) -> bool:
        """True for the framework's tensors (what module inputs and outputs are searched for)."""

    @abstractmethod
    def describe(self, t: Any) -> tuple[str | None, tuple[int, ...]]:
        """(dtype name as in ``tensordiff.dtypes``, shape). A dtype of None is asked for again at the end of
        the step with ``late_dtype`` (reading it now would wait for an asynchronous op)."""

    def late_dtype(self, t: Any) -> str:
        """The dtype name of a tensor ``describe`` could not name at once."""
        raise NotImplementedError(f"{type(self).__name__}.describe returned no dtype but has no late_dtype")

    @abstractmethod
    def stats(self, t: Any) -> Any:
        """Start the reduction of [min, max, sum, l2, nan, inf] (on the tensor's device); a handle for ``host_stats``."""

    @abstractmethod
    def host_stats(self, pending: list[Any]) -> np.ndarray | Sequence[Sequence[float]]:
        """Bring the started reductions to the host, with as few device syncs as possible: [min, max, sum, l2, nan,
        inf] for each of ``pending``, in order (a float64 [n, 6] array, or n rows of 6 numbers)."""

    @abstractmethod
    def copy(self, t: Any) -> Any:
        """A host copy taken now (the model may change the tensor in place later)."""

    @abstractmethod
    def to_numpy(self, copy: Any) -> np.ndarray:
        """A host copy as numpy, in its own dtype (BF16/FP8 as ``ml_dtypes``). Called on the writer's thread: it may
        wait for a copy still under way."""

    def copy_nbytes(self, copy: Any) -> int:
        """The bytes of a host copy (what the writer's queue counts)."""
        return int(getattr(copy, "nbytes", 0))

    def copy_ready(self, copy: Any) -> bool:
        """Whether a copy was taken in host memory at hook time: the writer process takes such copies with their
        step; copies from an accelerator's memory follow the step (the training thread never waits for them)."""
        return True

    def close(self) -> None:
        """Release what the backend holds (after the writer has taken every copy)."""
        return None

    def version(self, t: Any) -> int:
        """In-place modification counter (0 where the framework has none): a changed tensor is recorded anew."""
        return 0

    def alias_key(self, t: Any, untracked: bool = False) -> Any:
        """A hashable key equal for two tensors over the same memory in the same layout (storage, offset, shape,
        strides, dtype), or None (unknown, or with ``untracked``: ``t`` carries autograd history). Finds a forward
        argument that is a parameter under another tensor object."""
        return None

    def hook_grad(self, t: Any, fn: Callable[[Any], None]) -> Any:
        """Register ``fn(grad)`` to run when the gradient of ``t`` is computed; a handle with ``remove()``, or None."""
        return None

    @abstractmethod
    def loss_tensor(self, value: Any) -> Any:
        """The loss as a detached framework tensor (``value`` may be a tensor or a number) that the model's later
        in-place changes do not reach: its value is read at the end of the step."""

    @abstractmethod
    def scalar(self, t: Any) -> float:
        """Mean of a tensor as a Python float (the step's loss attribute, per-step scalars)."""

    @abstractmethod
    def perturb(self, params: Sequence[Any], seed: int) -> None:
        """Move every floating-point parameter by one ulp in a random direction, zeros kept (``tensordiff noise``)."""
