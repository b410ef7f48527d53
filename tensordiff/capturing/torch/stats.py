"""Per-tensor statistics [min, max, sum, l2, nan, inf] for capture, at memory bandwidth.

One pass over the tensor in its own dtype with FP32 accumulation, results kept on the
tensor's device and brought to the host once per step:

* CUDA, by default: one CUDA C kernel per tensor, compiled by NVRTC and launched through ctypes
  (``cuda_stats.py``: ~9 µs of host time a record on an H200, 2.4 TB/s on large BF16 tensors),
  writing its row of a per-step float64 device buffer.
* CUDA with Triton (when NVRTC is not to be had, or ``TENSORDIFF_STATS_KERNEL=triton``): one fused
  kernel per tensor (a second, tiny one for tensors spread over many programs). No temporaries, no
  float64 upcast of the tensor, two launches at most.
* CUDA without Triton: a few eager reductions with FP32 accumulation (float64 for float64 tensors
  and integers).
* The CPU: numpy on the tensor's memory, in float64 chunks of 64Ki values (a few microseconds for
  a small tensor, where a torch op costs more to dispatch than to run); NaN and Inf counted only
  when min or max is not finite.

Precision, against a float64 reduction of the same values: min, max, nan and inf exact; on the CPU
sum and l2 too, to float64 rounding; on CUDA sum and l2 accumulate in FP32 within a block, then in
float64 across blocks: within 1e-6 of sum(|x|) and of l2 (tests/test_capture_perf.py). NaN
propagates as in a float64 reduction: a tensor holding a NaN has min, max, sum and l2 NaN.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Sequence
from itertools import chain
from typing import Any

import numpy as np
import torch

from ..._warn import warn as _warn
from ...stats import host_stats
from .cuda_stats import ENV_KERNEL, fast_stats

__all__ = ["StatsCollector", "cpu_stats", "reduce_stats_eager", "triton_available"]

_ENV_NO_TRITON = "TENSORDIFF_NO_TRITON"
BLOCK = 2048  # elements per program per loop iteration
SINGLE_MAX = 1 << 16  # up to this many elements: one program, one launch, the final row written directly
ROWS = 4096  # rows per chunk of the per-step result buffer
_NO_SWITCH = contextlib.nullcontext()


_FLOATS = frozenset({torch.float32, torch.float16, torch.bfloat16})  # reduced in their own dtype, FP32 accumulation


try:  # Triton is optional: CUDA builds of torch ship it, CPU builds do not
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["row"])  # one compiled variant per dtype, not three per row value
    def _stats_kernel(x_ptr, part_ptr, out_ptr, row, n, BLOCK: tl.constexpr, FINAL: tl.constexpr):
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        lanes = tl.arange(0, BLOCK)
        vmin = tl.full([BLOCK], float("inf"), tl.float32)
        vmax = tl.full([BLOCK], float("-inf"), tl.float32)
        vsum = tl.zeros([BLOCK], tl.float32)
        vsq = tl.zeros([BLOCK], tl.float32)
        vnan = tl.zeros([BLOCK], tl.int32)
        vinf = tl.zeros([BLOCK], tl.int32)
        start = pid.to(tl.int64) * BLOCK
        stride = nprog.to(tl.int64) * BLOCK
        for base in range(start, n, stride):
            offs = base + lanes
            inside = offs < n
            x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
            isnan = x != x
            isinf = (x == float("inf")) | (x == float("-inf"))
            vnan += isnan.to(tl.int32)
            vinf += isinf.to(tl.int32)
            ok = inside & (x == x) & ~isinf  # the finite values only (tensordiff/stats.py)
            vmin = tl.minimum(vmin, tl.where(ok, x, float("inf")))
            vmax = tl.maximum(vmax, tl.where(ok, x, float("-inf")))
            xf = tl.where(ok, x, 0.0)
            vsum += xf
            vsq += xf * xf
        mn = tl.min(vmin, axis=0)
        mx = tl.max(vmax, axis=0)
        nan = tl.sum(vnan, axis=0)
        inf = tl.sum(vinf, axis=0)
        if FINAL:  # one program: the row itself
            o = out_ptr + row * 6
            tl.store(o + 0, mn.to(tl.float64))
            tl.store(o + 1, mx.to(tl.float64))
            tl.store(o + 2, tl.sum(vsum.to(tl.float64), axis=0))
            tl.store(o + 3, tl.sqrt(tl.sum(vsq.to(tl.float64), axis=0)))
            tl.store(o + 4, nan.to(tl.float64))
            tl.store(o + 5, inf.to(tl.float64))
        else:  # a partial row per program, in float64 so the counts stay exact
            p = part_ptr + pid * 6
            tl.store(p + 0, mn.to(tl.float64))
            tl.store(p + 1, mx.to(tl.float64))
            tl.store(p + 2, tl.sum(vsum.to(tl.float64), axis=0))
            tl.store(p + 3, tl.sum(vsq.to(tl.float64), axis=0))
            tl.store(p + 4, nan.to(tl.float64))
            tl.store(p + 5, inf.to(tl.float64))

    @triton.jit(do_not_specialize=["row"])
    def _finish_kernel(part_ptr, out_ptr, row, nparts, PARTS: tl.constexpr):
        i = tl.arange(0, PARTS)
        inside = i < nparts
        p = part_ptr + i * 6
        o = out_ptr + row * 6
        tl.store(o + 0, tl.min(tl.load(p + 0, mask=inside, other=float("inf")), axis=0))
        tl.store(o + 1, tl.max(tl.load(p + 1, mask=inside, other=float("-inf")), axis=0))
        tl.store(o + 2, tl.sum(tl.load(p + 2, mask=inside, other=0.0), axis=0))
        tl.store(o + 3, tl.sqrt(tl.sum(tl.load(p + 3, mask=inside, other=0.0), axis=0)))
        tl.store(o + 4, tl.sum(tl.load(p + 4, mask=inside, other=0.0), axis=0))
        tl.store(o + 5, tl.sum(tl.load(p + 5, mask=inside, other=0.0), axis=0))

    _TRITON = True
except Exception:  # pragma: no cover - no Triton (CPU builds of torch)
    _TRITON = False


def _kernel_choice() -> str:
    """``TENSORDIFF_STATS_KERNEL``: nvrtc (default), triton or eager; ``TENSORDIFF_NO_TRITON=1`` means eager."""
    choice = os.environ.get(ENV_KERNEL, "").strip().lower() or "nvrtc"
    if os.environ.get(_ENV_NO_TRITON, "") not in ("", "0"):
        return "eager"
    return choice if choice in ("nvrtc", "triton", "eager") else "nvrtc"


def triton_available() -> bool:
    """True when CUDA tensors get the fused Triton reduction (Triton importable, not switched off)."""
    return _TRITON and _kernel_choice() != "eager" and torch.cuda.is_available()


def reduce_stats_eager(t: torch.Tensor) -> torch.Tensor:
    """[min, max, sum, l2, nan, inf] as a float64 tensor on ``t``'s device, from eager reductions:
    FP32 accumulation for float16/bfloat16/float32, float64 for float64 and integers."""
    x = t.detach()
    if x.numel() == 0:
        return torch.zeros(6, dtype=torch.float64, device=x.device)
    if x.is_complex():
        x = torch.view_as_real(x)
    if x.dtype in _FLOATS:
        acc = torch.float32
    else:
        acc = torch.float64
        if not x.is_floating_point():
            x = x.to(torch.float64)
    fin = torch.isfinite(x)
    nan, inf = torch.isnan(x).sum(), torch.isinf(x).sum()
    if x.is_floating_point():  # the finite values only (tensordiff/stats.py); one more pass in this fallback path
        mn = torch.where(fin, x, torch.tensor(math.inf, dtype=x.dtype, device=x.device)).amin()
        mx = torch.where(fin, x, torch.tensor(-math.inf, dtype=x.dtype, device=x.device)).amax()
        x = torch.where(fin, x, torch.zeros((), dtype=x.dtype, device=x.device))
    else:
        mn, mx = torch.aminmax(x)
    if x.device.type == "cpu":
        # torch's CPU norm and dot accumulate in one long run (5e-5 off at 3M values); its sum is a cascade (3e-8)
        xf = x.reshape(-1).to(acc)
        total = xf.sum()
        l2 = torch.mul(xf, xf).sum().sqrt()
    else:
        total = x.sum(dtype=acc)
        l2 = torch.linalg.vector_norm(x, dtype=acc)
    return torch.stack([v.to(torch.float64) for v in (mn, mx, total, l2, nan, inf)])


def cpu_stats(t: torch.Tensor) -> tuple[float, float, float, float, float, float]:
    """[min, max, sum, l2, nan, inf] of a CPU tensor, computed now by ``tensordiff.stats.host_stats`` (the rule every
    adapter follows: min, max, sum and l2 over the finite values; float64 accumulation)."""
    x = t.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    if x.is_floating_point() and x.dtype not in (torch.float32, torch.float64):  # BF16, FP16, FP8: exact in FP32
        x = x.to(torch.float32)
    return host_stats(x.numpy())


class StatsCollector:
    """The statistics of one step's tensors: ``add(t)`` starts a reduction and returns a handle,
    ``collect(handles)`` brings them all to the host (one sync per device)."""

    def __init__(self) -> None:
        self._triton = triton_available()
        # the NVRTC kernel launched through ctypes (cuda_stats.py): None until the first CUDA tensor, False when
        # it is not to be had (Triton, then eager reductions, take over)
        self._fast: Any = None if torch.cuda.is_available() and _kernel_choice() == "nvrtc" else False
        # float64 [ROWS, 6] result rows by device index, kept across steps; rows used this step
        self._chunks: dict[int, list[torch.Tensor]] = {}
        self._used: dict[int, int] = {}
        self._parts: dict[tuple[torch.device, int], torch.Tensor] = {}  # per-stream scratch for partial rows
        self._programs: dict[torch.device, int] = {}

    def add(self, t: torch.Tensor) -> Any:
        if t.is_cuda:
            if self._fast is not False and t.dtype in _FLOATS:
                handle = self._add_fast(t)
                if handle is not None:
                    return handle
        elif t.device.type == "cpu":
            return cpu_stats(t)  # detaches once (a detach costs several microseconds)
        x = t.detach()
        if self._triton and x.is_cuda and x.dtype in _FLOATS and x.numel() > 0:
            return self._add_triton(x)
        return reduce_stats_eager(x)

    def _add_fast(self, t: torch.Tensor) -> tuple[int, int] | None:
        """The NVRTC kernel (``cuda_stats.py``): one launch through ctypes, a few microseconds of host time."""
        index = t.get_device()
        fast = self._fast
        if fast is None or index not in fast._devices:
            fast = fast_stats(index)
            if fast is None:
                self._fast = False
                return None
            self._fast = fast
        if t.numel() == 0:
            return None
        if not t.is_contiguous():
            t = t.contiguous()  # freed after the launch: the allocator reuses it in stream order
        row = self._used.get(index, 0)
        chunks = self._chunks.get(index)
        if chunks is None:
            chunks = self._chunks[index] = []
        if row // ROWS >= len(chunks):
            chunks.append(torch.empty((ROWS, 6), dtype=torch.float64, device=t.device))
        self._used[index] = row + 1
        try:
            fast.launch(t, index, chunks[row // ROWS].data_ptr(), row % ROWS)
        except Exception as err:  # the driver refused the launch: Triton or eager reductions from here on
            self._used[index] = row  # the row stays free
            self._fast = False
            with contextlib.suppress(Exception):
                _warn(f"tensordiff: the NVRTC statistics kernel could not be launched ({err}); using "
                      f"{'Triton' if self._triton else 'eager reductions'} instead")
            return None
        return index, row

    def _add_triton(self, x: torch.Tensor) -> tuple[int, int]:
        if not x.is_contiguous():
            x = x.contiguous()
        device = x.device
        index = x.get_device()
        row = self._used.get(index, 0)
        chunks = self._chunks.setdefault(index, [])
        if row // ROWS >= len(chunks):
            chunks.append(torch.empty((ROWS, 6), dtype=torch.float64, device=device))
        self._used[index] = row + 1
        out = chunks[row // ROWS]
        local = row % ROWS
        n = x.numel()
        with torch.cuda.device(device) if device.index != torch.cuda.current_device() else _NO_SWITCH:
            if n <= SINGLE_MAX:
                _stats_kernel[(1,)](x, out, out, local, n, BLOCK=BLOCK, FINAL=True, num_warps=4)
            else:
                programs = min(triton.cdiv(n, BLOCK * 4), self._max_programs(device))
                key = (device, torch.cuda.current_stream(device).cuda_stream)
                part = self._parts.get(key)
                if part is None:  # kernels on one stream run in order: one scratch per stream is enough
                    part = self._parts[key] = torch.empty((self._max_programs(device), 6), dtype=torch.float64,
                                                          device=device)
                _stats_kernel[(programs,)](x, part, out, local, n, BLOCK=BLOCK, FINAL=False, num_warps=8)
                _finish_kernel[(1,)](part, out, local, programs, PARTS=triton.next_power_of_2(programs), num_warps=4)
        return index, row

    def _max_programs(self, device: torch.device) -> int:
        if device not in self._programs:
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            self._programs[device] = min(1024, 4 * sms)
        return self._programs[device]

    def collect(self, handles: Sequence[Any]) -> np.ndarray:
        """[min, max, sum, l2, nan, inf] of each of ``handles`` on the host: a float64 [len(handles), 6] array (one
        wait for each device); the per-step buffers are reused by the next step."""
        n = len(handles)
        if not self._used and not any(isinstance(h, torch.Tensor) for h in handles):  # all computed on the CPU
            return np.fromiter(chain.from_iterable(handles), dtype=np.float64, count=6 * n).reshape(n, 6)
        out = np.zeros((n, 6), dtype=np.float64)
        on_host: list[int] = []
        eager: dict[torch.device, list[int]] = {}
        on_device: dict[int, tuple[list[int], list[int]]] = {}  # device index -> (positions, rows)
        for i, h in enumerate(handles):
            if type(h) is tuple and len(h) == 2:
                at = on_device.get(h[0])
                if at is None:
                    at = on_device[h[0]] = ([], [])
                at[0].append(i)
                at[1].append(h[1])
            elif isinstance(h, torch.Tensor):
                eager.setdefault(h.device, []).append(i)
            else:  # computed on the CPU already
                on_host.append(i)
        if on_host:
            out[on_host] = [handles[i] for i in on_host]
        for indices in eager.values():
            out[indices] = torch.stack([handles[i] for i in indices]).cpu().numpy()
        for index, used in self._used.items():
            chunks = self._chunks[index][: (used + ROWS - 1) // ROWS]
            torch.cuda.synchronize(index)  # the kernels ran on whichever stream the hooks were called on
            host = torch.cat(chunks).cpu().numpy()[:used]
            at = on_device.get(index)
            if at is not None:
                out[at[0]] = host[at[1]]
        self._used = {}
        none = ~(np.isfinite(out[:, 0]) & np.isfinite(out[:, 1]))  # no finite value: min and max 0, as on the host
        out[none, :2] = 0.0
        return out
