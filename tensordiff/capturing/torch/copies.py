"""Host copies of full tensors for capture, without stalling the training thread on CUDA.

At hook time a CUDA tensor is cloned on the device (ordered on the current stream, at device
memory bandwidth, so later in-place changes by the model cannot reach the copy). A background
thread waits for each clone, moves it to host memory through two reused pinned bounce buffers
on its own stream, and frees the clone. Clones in flight are bounded by a staging budget in
device memory (``TENSORDIFF_STAGING_GB``; default half the device memory free at the first copy,
so that a whole step of a 1B model stages at device speed and the training thread never waits
for PCIe): a copy that would go over it waits for the copier to catch up, a tensor larger than
the whole budget is copied synchronously, and a clone the device has no memory for (out of
memory) is copied synchronously too: the step is slower, the run never fails for it.

A copy is a ``HostCopy``: ``result()`` gives the host tensor, waiting for the copier if needed
(the capture writer calls it on its own thread, so ``cap.step()`` never waits for the copies).
CPU tensors are cloned at once.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Any

import torch

__all__ = ["HostCopier", "HostCopy"]

ENV_STAGING = "TENSORDIFF_STAGING_GB"
BOUNCE = 64 << 20  # bytes per pinned bounce buffer
STAGING_SHARE = 0.5  # of the device memory free at the first copy, when TENSORDIFF_STAGING_GB does not say


class HostCopy:
    """A host copy that may still be under way."""

    __slots__ = ("_done", "_error", "_value", "from_device", "nbytes")

    def __init__(self, nbytes: int, value: torch.Tensor | None = None, from_device: bool = False):
        self.nbytes = nbytes
        self.from_device = from_device  # a copy of an accelerator's tensor (the writer streams it after its step)
        self._value = value
        self._error: BaseException | None = None
        self._done = threading.Event()
        if value is not None:
            self._done.set()

    def _set(self, value: torch.Tensor | None, error: BaseException | None = None) -> None:
        self._value, self._error = value, error
        self._done.set()

    def result(self) -> torch.Tensor:
        self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._value is not None
        return self._value


class HostCopier:
    """Takes host copies of tensors; one per capture (its thread starts with the first CUDA copy)."""

    def __init__(self, staging_bytes: int | None = None):
        self._budget = staging_bytes
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Condition()
        self._staged = 0  # bytes of device clones not yet on the host
        self._streams: dict[torch.device, Any] = {}
        self._bounce: dict[torch.device, list[torch.Tensor]] = {}
        self.waited = 0  # copies that waited for staging room (reported by benchmarks)

    def copy(self, t: torch.Tensor) -> HostCopy:
        x = t.detach()
        if x.device.type == "cpu":
            return HostCopy(x.numel() * x.element_size(), x.clone(memory_format=torch.contiguous_format))
        if x.device.type != "cuda":
            return HostCopy(x.numel() * x.element_size(), x.to("cpu", copy=True), from_device=True)
        return self._copy_cuda(x)

    def _budget_for(self, device: torch.device) -> int:
        if self._budget is None:
            env = os.environ.get(ENV_STAGING, "")
            try:
                self._budget = int(float(env) * (1 << 30)) if env else None
            except ValueError:
                self._budget = None
            if self._budget is None:
                free, _ = torch.cuda.mem_get_info(device)
                self._budget = int(free * STAGING_SHARE)
        return self._budget

    def _copy_cuda(self, x: torch.Tensor) -> HostCopy:
        nbytes = x.numel() * x.element_size()
        budget = self._budget_for(x.device)
        if nbytes > budget or nbytes == 0:  # too large to stage: copy now (synchronous)
            return HostCopy(nbytes, x.to("cpu", copy=True), from_device=True)
        with self._lock:
            while self._staged + nbytes > budget:
                self.waited += 1
                self._lock.wait()
            self._staged += nbytes
        try:
            clone = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        except torch.cuda.OutOfMemoryError:  # the run needs the memory: this one now, synchronously
            with self._lock:
                self._staged -= nbytes
            return HostCopy(nbytes, x.to("cpu", copy=True), from_device=True)
        clone.copy_(x)  # on the current stream: ordered after the op that made x, before any later change to it
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(x.device))
        pending = HostCopy(nbytes, from_device=True)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tensordiff-copier", daemon=True)
            self._thread.start()
        self._queue.put((clone, ready, pending))
        return pending

    def close(self) -> None:
        """Finish the copies under way and stop the thread (the copies already taken stay readable)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        self._bounce.clear()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            clone, ready, pending = job
            try:
                pending._set(self._to_host(clone, ready))
            except BaseException as err:  # reported by whoever asks for the copy (the writer warns and goes on)
                pending._set(None, err)
            finally:
                nbytes = clone.numel() * clone.element_size()
                del clone
                with self._lock:
                    self._staged -= nbytes
                    self._lock.notify_all()

    def _to_host(self, clone: torch.Tensor, ready: Any) -> torch.Tensor:
        device = clone.device
        ready.synchronize()  # the clone is complete (this thread waits, not the training thread)
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
            self._bounce[device] = [torch.empty(BOUNCE, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        bounce = self._bounce[device]
        host = torch.empty(clone.shape, dtype=clone.dtype)
        src = clone.reshape(-1).view(torch.uint8)
        dst = host.reshape(-1).view(torch.uint8)
        n = src.numel()
        events: list[Any] = [None, None]
        pieces = [(start, min(n, start + BOUNCE)) for start in range(0, n, BOUNCE)]
        with torch.cuda.stream(stream):
            for i, (a, b) in enumerate(pieces):  # DMA of piece i overlaps the host copy of piece i-1
                k = i % 2
                if events[k] is not None:
                    prev_a, prev_b = events[k][1]
                    events[k][0].synchronize()
                    dst[prev_a:prev_b].copy_(bounce[k][: prev_b - prev_a])
                bounce[k][: b - a].copy_(src[a:b], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
                events[k] = (ev, (a, b))
            for k in range(2):  # the last one or two pieces still in their bounce buffers
                if events[k] is not None:
                    ev, (a, b) = events[k]
                    ev.synchronize()
                    dst[a:b].copy_(bounce[k][: b - a])
        return host
