"""Where a full-tensor step's drain spends its time: each stage of the way from the GPU to the file, alone.

    python3 benchmarks/drain_parts.py [--gb 4] [--dir /tmp] [--threads 1,8]

A step's full tensors travel: GPU -> pinned host buffer (``capturing/torch/copies.py``) -> host memory -> the pipe to
the writer process (``store/writer_process.py``) -> shuffle and deflate in the writer's thread pool (``store/codec.py``)
-> HDF5 and the disk. This prints the rate of each stage on its own, over ``--gb`` GB of BF16 values shaped like
activations (normal, scale 0.02), then the whole way without the GPU: ``CaptureWriter`` in this process and
``ProcessWriter`` (the default), submit to close. The slowest stage is what bounds the drain (issue 46: >= 5 GB/s).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from tensordiff.store import codec  # noqa: E402

PIECE = 32 << 20


def _rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:6.2f} GB/s ({seconds:.2f} s for {nbytes / 1e9:.2f} GB)"


def _tensor(nbytes: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    base = (rng.standard_normal(1 << 22) * 0.02).astype(ml_dtypes.bfloat16)
    return np.resize(base, nbytes // 2)


def gpu_stage(nbytes: int) -> None:
    try:
        import torch
    except ImportError:
        print("gpu -> host: torch not importable, skipped")
        return
    if not torch.cuda.is_available():
        print("gpu -> host: no CUDA device, skipped")
        return
    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    for pinned in (True, False):
        dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=pinned)
        dst.copy_(src)  # warm
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=pinned)
        torch.cuda.synchronize()
        print(f"gpu -> {'pinned' if pinned else 'pageable'} host: {_rate(nbytes, time.perf_counter() - t0)}")
    host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    host.copy_(src)
    out = np.empty(nbytes, np.uint8)
    t0 = time.perf_counter()
    np.copyto(out, host.view(torch.uint8).numpy())
    print(f"pinned -> fresh host memory (numpy copy): {_rate(nbytes, time.perf_counter() - t0)}")


def pipe_stage(data: np.ndarray) -> None:
    from tensordiff.store.writer_process import _widen

    reader = ("import sys\nb = bytearray(32 << 20)\nf = sys.stdin.buffer.raw\nn = 0\n"
              "while True:\n    k = f.readinto(b)\n    if not k: break\n    n += k\nprint(n)\n")
    proc = subprocess.Popen([sys.executable, "-c", reader], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdin is not None
    size = _widen(proc.stdin.fileno())
    flat = data.view(np.uint8)
    t0 = time.perf_counter()
    for start in range(0, flat.nbytes, PIECE):
        proc.stdin.write(flat[start:start + PIECE].data)
    proc.stdin.close()
    assert proc.stdout is not None
    got = int(proc.stdout.read())
    proc.wait()
    assert got == flat.nbytes, (got, flat.nbytes)
    print(f"pipe to a child process ({size >> 10} KiB pipe): {_rate(flat.nbytes, time.perf_counter() - t0)}")


def encode_stage(data: np.ndarray, threads: list[int]) -> None:
    shape = codec.chunk_shape(data.shape, data.itemsize)
    parts = [part for _, part in codec.contiguous_chunks(data, shape)]
    positions = (0, 1)  # shuffle, then deflate (HDF5's order as the writer sets it)
    for n in threads:
        with ThreadPoolExecutor(n) as pool:
            t0 = time.perf_counter()
            out = list(pool.map(lambda p: codec.encode(p, data.itemsize, positions), parts))
            dt = time.perf_counter() - t0
        stored = sum(len(s) if isinstance(s, bytes | bytearray) else memoryview(s).nbytes for _, s in out)
        print(f"shuffle + deflate ({codec.implementation()}), {n} thread(s), {len(parts)} chunks of "
              f"{parts[0].nbytes >> 20} MiB: {_rate(data.nbytes, dt)}, ratio {stored / data.nbytes:.2f}")


def disk_stage(folder: str, nbytes: int) -> None:
    block = np.random.default_rng(1).integers(0, 256, PIECE, dtype=np.uint8)
    path = os.path.join(folder, "drain_parts.bin")
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        for _ in range(max(1, nbytes // PIECE)):
            os.write(fd, block.data)
        os.fsync(fd)
    finally:
        os.close(fd)
        os.remove(path)
    print(f"disk write + fsync in {folder}: {_rate(max(1, nbytes // PIECE) * PIECE, time.perf_counter() - t0)}")


def writer_stage(folder: str, data: np.ndarray) -> None:
    from tensordiff.store import CaptureWriter
    from tensordiff.store.format import shape_text
    from tensordiff.store.writer_process import ProcessWriter

    per = 64 << 20  # records of 64 MiB, as a 1B model's largest default records
    chunks = [data[i:i + per // 2] for i in range(0, data.size, per // 2)]
    rows = [{"seq": i, "phase": "forward", "module": f"layers.{i}", "call": 0, "kind": "output", "slot": "0",
             "module_class": "L", "dtype": "bfloat16", "shape": shape_text(c.shape), "numel": c.size, "has_data": 1,
             "same_as": -1, "grad_of": -1, "enter": i, "parent": "", "min": 0.0, "max": 0.0, "mean": 0.0, "l2": 0.0,
             "nan": 0, "inf": 0} for i, c in enumerate(chunks)]
    for cls in (CaptureWriter, ProcessWriter):
        path = os.path.join(folder, f"drain_{cls.__name__}.h5")
        w = cls(path, {"framework": "bench"})
        t0 = time.perf_counter()
        w.submit(0, [dict(r) for r in rows], dict(enumerate(chunks)), {})
        handed = time.perf_counter() - t0
        w.close()
        total = time.perf_counter() - t0
        size = os.path.getsize(path)
        os.remove(path)
        print(f"{cls.__name__}: handed over in {handed:.2f} s, file closed after {total:.2f} s: "
              f"{_rate(data.nbytes, total)}; {size / data.nbytes:.2f} of the bytes on disk")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=4.0)
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--threads", default="1,8")
    args = p.parse_args()
    nbytes = int(args.gb * 1e9) // PIECE * PIECE
    print(f"host: {os.cpu_count()} CPUs; {nbytes / 1e9:.2f} GB of BF16 values; writing in {args.dir}")
    gpu_stage(nbytes)
    data = _tensor(nbytes)
    pipe_stage(data)
    encode_stage(data, [int(t) for t in args.threads.split(",")])
    disk_stage(args.dir, nbytes)
    writer_stage(args.dir, data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
