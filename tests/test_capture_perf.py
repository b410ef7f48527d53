"""Capture at scale: statistics in one pass with FP32 accumulation (exact where they can be, within the documented
1e-6 elsewhere), full tensors copied off the training thread, and the choice of which records are stored in full."""

import math
import warnings

import numpy as np
import pytest
import torch

import tensordiff
from examples.gpt.models import GPTSpec, build_mcore_gpt, make_batch, mcore_loss
from tensordiff.capturing.options import CaptureOptions
from tensordiff.capturing.torch.adapter import TorchCapture
from tensordiff.capturing.torch.copies import HostCopier
from tensordiff.capturing.torch.stats import StatsCollector, reduce_stats_eager, triton_available
from tensordiff.store import CaptureFile

CUDA = torch.cuda.is_available()


def _reference(t: torch.Tensor) -> list[float]:
    """[min, max, sum, l2, nan, inf] in float64, the slow way, by the one rule (tensordiff/stats.py): NaN and Inf
    counted, min, max, sum and l2 over the finite values."""
    x = t.detach().cpu()
    if x.is_complex():
        x = torch.view_as_real(x)
    d = x.reshape(-1).double()
    nan, inf = float(torch.isnan(d).sum()), float(torch.isinf(d).sum())
    d = d[torch.isfinite(d)]
    if d.numel() == 0:
        return [0.0] * 4 + [nan, inf]
    return [float(d.min()), float(d.max()), float(d.sum()), float(torch.linalg.vector_norm(d)), nan, inf]


def _tensors(device: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(3_000_000, generator=g) * 3 + 0.5
    out = [torch.randn(4, 128, 256, generator=g).to(dt) for dt in (torch.float32, torch.bfloat16, torch.float16)]
    out += [big, big.to(torch.bfloat16), torch.randn(7, generator=g, dtype=torch.float64),
            torch.arange(10, dtype=torch.int64), torch.tensor([True, False, True]),
            torch.randn(5, generator=g, dtype=torch.complex64), torch.empty(0, 3),
            torch.randn(64, 32, generator=g).t(),  # not contiguous
            torch.tensor([1.0, -float("inf"), 3.0, float("inf")]),
            torch.tensor([1.0, float("nan"), float("inf"), -2.0, float("nan")]).to(torch.bfloat16)]
    return [t.to(device) for t in out]


def _check(stats: list, ref: list[float], t: torch.Tensor) -> None:
    mn, mx, total, l2, nan, inf = stats
    assert (nan, inf) == (ref[4], ref[5])
    assert (mn, mx) == (ref[0], ref[1])  # exact: min and max of the finite values in their own dtype
    x = t.detach().cpu()
    x = (torch.view_as_real(x) if x.is_complex() else x).reshape(-1).double()
    scale = float(x[torch.isfinite(x)].abs().sum())
    assert abs(total - ref[2]) <= 1e-6 * scale + 1e-12
    assert l2 == pytest.approx(ref[3], rel=1e-6, abs=1e-12)


def test_cpu_statistics_match_a_float64_reduction():
    collector = StatsCollector()
    tensors = _tensors("cpu")
    rows = collector.collect([collector.add(t) for t in tensors])
    for t, row in zip(tensors, rows):
        _check(list(row), _reference(t), t)


def test_eager_statistics_stay_in_the_tensor_dtype_with_fp32_accumulation():
    x = torch.full((1 << 20,), 0.1, dtype=torch.bfloat16)
    mn, mx, total, l2, nan, inf = reduce_stats_eager(x).tolist()
    exact = float(x[0].double()) * x.numel()
    assert mn == mx == float(x[0].double())
    assert abs(total - exact) <= 1e-6 * exact  # a BF16 accumulator would be off by far more
    assert l2 == pytest.approx(float(x[0].double()) * math.sqrt(x.numel()), rel=1e-6)
    assert (nan, inf) == (0, 0)


@pytest.mark.skipif(not (CUDA and triton_available()), reason="needs a CUDA GPU with Triton")
def test_fused_gpu_statistics_match_a_float64_reduction():
    collector = StatsCollector()
    tensors = _tensors("cuda")
    handles = [collector.add(t) for t in tensors]
    assert any(isinstance(h, tuple) for h in handles)  # the fused kernel ran for the float tensors
    for step in range(2):  # the per-step buffers are reused
        rows = collector.collect(handles) if step == 0 else collector.collect([collector.add(t) for t in tensors])
        for t, row in zip(tensors, rows):
            _check(list(row), _reference(t), t)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernel", ["nvrtc", "triton", "eager"])
def test_each_gpu_statistics_kernel_matches_a_float64_reduction(monkeypatch, kernel):
    """The NVRTC kernel launched through ctypes (the default), the Triton kernel and the eager reductions give the
    same rows, to the documented precision, on aligned, misaligned (odd offsets: no vector loads), multi-block and
    NaN/Inf tensors of the three float dtypes."""
    from tensordiff.capturing.torch import cuda_stats as torch_cuda_stats

    monkeypatch.setenv("TENSORDIFF_STATS_KERNEL", kernel)
    if kernel == "triton" and not triton_available():
        pytest.skip("no Triton")
    g = torch.Generator().manual_seed(1)
    base = torch.randn(5_000_003, generator=g) * 2 - 0.25
    base[123], base[4_000_000], base[77] = float("nan"), float("inf"), -float("inf")
    tensors = []
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        x = base.to(dt).cuda()
        tensors += [x, x[3:], x[:1000], x[5:13]]
    collector = StatsCollector()
    handles = [collector.add(t) for t in tensors]
    if kernel == "nvrtc":
        assert torch_cuda_stats.fast_stats(0) is not None, torch_cuda_stats.fast_stats_why()
        assert collector._fast not in (None, False) and all(isinstance(h, tuple) for h in handles)
    for t, row in zip(tensors, collector.collect(handles)):
        _check(list(row), _reference(t), t)


def test_cpu_copy_is_taken_at_hook_time():
    copier = HostCopier()
    x = torch.arange(6, dtype=torch.float32)
    c = copier.copy(x)
    x.add_(100)
    assert c.result().tolist() == [0, 1, 2, 3, 4, 5] and c.nbytes == 24


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_copy_is_taken_at_hook_time_and_off_the_training_thread():
    copier = HostCopier(staging_bytes=64 << 20)
    xs = [torch.randn(1 << 20, device="cuda", dtype=dt) for dt in (torch.float32, torch.bfloat16)] * 20
    expected = [x.cpu().clone() for x in xs]
    copies = [copier.copy(x) for x in xs]
    for x in xs:
        x.mul_(2)  # later changes by the model never reach the copies
    assert all(torch.equal(c.result(), e) for c, e in zip(copies, expected))
    assert copier.waited > 0  # 20 x 6 MiB through a 64 MiB staging budget waited for room, and still came out right
    copier.close()


def _gpt_capture(tmp_path, name, **kw):
    """One captured step of a tiny megatron-core GPT, on the GPU where there is one (megatron-core then puts its
    buffers there: a CPU model on a CUDA host does not run)."""
    spec = GPTSpec(num_layers=2, hidden_size=64, vocab_size=128, seq_length=16, batch_size=2)
    device = "cuda" if CUDA else "cpu"
    model = build_mcore_gpt(spec, seed=1).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens, labels, _ = (t.to(device) for t in make_batch(spec, seed=0))
    path = str(tmp_path / name)
    with tensordiff.capture(model, path, steps=1, optimizer=opt, **kw) as cap:
        loss = mcore_loss(model, tokens, labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        cap.step(loss)
    return path


def test_records_above_the_size_limit_keep_statistics_only(tmp_path):
    every = _gpt_capture(tmp_path, "all.h5")
    capped = _gpt_capture(tmp_path, "capped.h5", tensors_max_mb=16 / 1024)  # 16 KiB
    with CaptureFile(every) as a, CaptureFile(capped) as b:
        ra, rb = a.records(0), b.records(0)
        assert [r.module for r in ra] == [r.module for r in rb]
        big = [(x, y) for x, y in zip(ra, rb) if x.has_data and x.same_as < 0 and x.numel * 4 > 16 * 1024
               and x.kind != "loss"]
        small = [(x, y) for x, y in zip(ra, rb) if x.has_data and x.same_as < 0 and x.numel * 4 <= 16 * 1024]
        assert big and small
        assert not any(y.has_data for _, y in big)
        assert all(y.has_data for _, y in small)
        assert all(x.l2 == y.l2 and x.max == y.max for x, y in big)  # statistics kept
        assert b.attrs["tensors_max_mb"] == pytest.approx(16 / 1024)


def test_records_of_modules_not_matched_keep_statistics_only(tmp_path):
    path = _gpt_capture(tmp_path, "match.h5", tensors_match=r"decoder\.layers\.1\.mlp")
    with CaptureFile(path) as c:
        stored = {r.module for r in c.records(0) if r.has_data and r.kind != "loss"}
        assert stored and all("decoder.layers.1.mlp" in m for m in stored)


def test_billion_parameter_models_default_to_64_mib_a_record(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(40_000, 25_000, bias=False, device="meta"))  # 1.0e9 parameters
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cap = TorchCapture(model, CaptureOptions(path=str(tmp_path / "big.h5")))
        cap.close()
    assert cap.options.tensors_max_mb == 64
    assert any("1.0B parameters" in str(w.message) and "64 MiB" in str(w.message) for w in seen)
    small = TorchCapture(torch.nn.Linear(4, 4), CaptureOptions(path=str(tmp_path / "small.h5")))
    small.close()
    assert small.options.tensors_max_mb is None


def test_bad_selection_options_are_refused_in_one_line():
    with pytest.raises(tensordiff.errors.UsageError, match="tensors_max_mb=-1"):
        CaptureOptions(path="x.h5", tensors_max_mb=-1)
    with pytest.raises(tensordiff.errors.UsageError, match="bad regular expression"):
        CaptureOptions(path="x.h5", tensors_match="(")


def test_statistics_agree_with_the_stored_tensors(tmp_path):
    path = _gpt_capture(tmp_path, "agree.h5")
    with CaptureFile(path) as c:
        checked = 0
        for r in c.records(0):
            arr = c.array(r) if r.has_data and r.same_as < 0 else None
            if arr is None or r.numel == 0 or not np.issubdtype(arr.dtype, np.floating):
                continue
            d = arr.astype(np.float64)
            assert (r.min, r.max) == (d.min(), d.max())
            assert r.l2 == pytest.approx(float(np.sqrt((d * d).sum())), rel=1e-6)
            checked += 1
        assert checked > 50


def test_a_writer_process_writes_the_same_file_as_the_writer_threads(tmp_path):
    threads = _gpt_capture(tmp_path, "threads.h5", writer="thread")
    process = _gpt_capture(tmp_path, "process.h5", writer="process")
    with CaptureFile(threads) as a, CaptureFile(process) as b:
        ra, rb = a.records(0), b.records(0)
        assert len(ra) == len(rb) > 100
        for x, y in zip(ra, rb):
            assert (x.module, x.kind, x.slot, x.l2, x.has_data, x.same_as) == (y.module, y.kind, y.slot, y.l2,
                                                                                y.has_data, y.same_as)
            if x.has_data and x.same_as < 0:
                assert np.array_equal(a.array(x), b.array(y), equal_nan=True)
        assert a.scalars() == b.scalars() and b.scalars()["loss"]
        assert a.step_attrs(0)["loss"] == b.step_attrs(0)["loss"]


KILLED = """
import os, signal, sys, time, torch
sys.path.insert(0, {root!r})
import tensordiff
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
cap = tensordiff.capture(model, {path!r}, steps=5, optimizer=opt, tensors="all", writer="process")
for step in range(3):
    loss = model(torch.randn(8, 64)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    cap.step(loss)
while cap._writer._pending_bytes:  # every step handed to the child (the parent's queue is what a kill loses)
    time.sleep(0.01)
os.kill(os.getpid(), signal.SIGKILL)  # no close(), no atexit: the child may still be writing
"""


def test_steps_handed_to_the_writer_process_survive_a_sigkill_of_the_training_process(tmp_path):
    import os
    import subprocess
    import sys
    import time

    path = str(tmp_path / "killed.h5")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", KILLED.format(root=root, path=path)], timeout=120)
    assert proc.returncode == -9
    for _ in range(100):  # the child finishes the file after its parent died
        try:
            with CaptureFile(path) as c:
                if c.steps == [0, 1, 2]:
                    break
        except Exception:
            pass
        time.sleep(0.1)
    with CaptureFile(path) as c:
        assert c.steps == [0, 1, 2]
        assert all(c.array(r) is not None for r in c.records(2) if r.has_data and r.same_as < 0)


def test_capture_command_refuses_bad_selection_flags_in_one_line(tmp_path):
    import subprocess
    import sys

    for flags, expected in ((["--tensors-max-mb", "-1"], "--tensors-max-mb -1"),
                            (["--tensors-match", "("], "bad regular expression")):
        proc = subprocess.run([sys.executable, "-m", "tensordiff", "capture", "-o", str(tmp_path / "x.h5"), *flags,
                               "--", sys.executable, "-c", "pass"], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2
        assert expected in proc.stderr and "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
