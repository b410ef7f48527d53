"""How fast the capture store writes and reads full tensors: CaptureWriter's parallel gzip + shuffle against h5py's
own (the writer before issue 13), per deflate library and thread count, and CaptureFile.array() from a pool.

    python benchmarks/store_io.py                 # ~0.4 GB, a couple of minutes on 2 cores
    python benchmarks/store_io.py --gb 4 --chunk-mib 1 4 --plugins

The step written is activation-like data: BF16 and FP32 tensors of 1-64 MiB (normal values with per-channel
scales and a few outlier channels, and softmax-like rows), one capture step holding all of them, submitted
to a background CaptureWriter; the write time runs from submit() to the end of close() (data in the page cache,
no fsync). Reads: every record's CaptureFile.array() from a thread pool of 1, 2, N readers (N = the cores), the
file in the page cache. One table: write MB/s of tensor bytes, file/tensor bytes, read MB/s per reader count.
`before` is h5py's create_dataset(gzip 1, shuffle) on one thread (the writer up to issue 13) read by h5py's
`ds[()]`. `--plugins` adds hdf5plugin's codecs (if installed) written by h5py: files that need the plugin to read.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import h5py
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tensordiff import dtypes
from tensordiff.store import CaptureFile, CaptureWriter, codec
from tensordiff.store.format import FORMAT_ATTR, FORMAT_VERSION, INDEX_DTYPE, shape_text, step_group_name
from tensordiff.store.reader import read_dataset
from tensordiff.store.writer import default_threads


def make_step(gb: float, seed: int = 0) -> dict[int, np.ndarray]:
    """Activation-like tensors of 1-64 MiB, half BF16 and half FP32 by bytes, ``gb`` GB in all."""
    import ml_dtypes

    rng = np.random.default_rng(seed)
    out: dict[int, np.ndarray] = {}
    total = 0
    while total < gb * 1e9:
        mib = int(rng.choice([1, 2, 4, 8, 16, 32, 64]))
        dtype = np.dtype(ml_dtypes.bfloat16) if len(out) % 2 == 0 else np.dtype(np.float32)
        hidden = int(rng.choice([1024, 2048, 4096]))
        rows = max(1, mib * 2**20 // (hidden * dtype.itemsize))
        if len(out) % 5 == 4:  # attention-probability-like: softmax rows, mostly tiny values
            x = rng.standard_normal((rows, hidden), dtype=np.float32) * 3
            x = np.exp(x - x.max(axis=1, keepdims=True))
            x /= x.sum(axis=1, keepdims=True)
        else:  # hidden states: per-channel scales, a few outlier channels
            x = rng.standard_normal((rows, hidden), dtype=np.float32)
            x *= rng.random(hidden, dtype=np.float32) * 2 + 0.1
            x[:, rng.integers(0, hidden, 4)] *= 30
        out[len(out)] = x.astype(dtype).reshape(2, rows // 2, hidden) if rows % 2 == 0 else x.astype(dtype)
        total += out[len(out) - 1].nbytes
    return out


def rows_for(data: dict[int, np.ndarray]) -> list[dict[str, Any]]:
    rows = []
    for seq, x in data.items():
        row = dict.fromkeys(INDEX_DTYPE.names or (), 0)
        row.update(seq=seq, phase="forward", module=f"layers.{seq}", kind="output", slot="0", module_class="Linear",
                   dtype=dtypes.name_of(x.dtype), shape=shape_text(x.shape), numel=x.size, has_data=1, same_as=-1,
                   grad_of=-1, enter=-1, parent="")
        rows.append(row)
    return rows


def timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[float, float]:
    """Wall seconds and CPU seconds of this process (all threads) of ``fn(*args, **kwargs)``: CPU seconds per GB is the cost a
    busy or shared machine does not blur, and cores / (CPU s per GB) the GB/s that enough cores would give."""
    w0, c0 = time.perf_counter(), time.process_time()
    fn(*args, **kwargs)
    return time.perf_counter() - w0, time.process_time() - c0


def write_writer(path: str, data: dict[int, np.ndarray], **options: Any) -> None:
    writer = CaptureWriter(path, {"framework": "torch"}, **options)
    writer.submit(0, rows_for(data), data, {})
    writer.close()
    if writer.error is not None:
        raise writer.error


def write_h5py(path: str, data: dict[int, np.ndarray], **filters: Any) -> None:
    """What CaptureWriter did before: h5py (HDF5) compresses each tensor on the calling thread."""
    with h5py.File(path, "w", libver=("earliest", "v110")) as f:
        f.attrs[FORMAT_ATTR] = FORMAT_VERSION
        f.attrs["framework"] = "torch"
        grp = f.create_group(step_group_name(0))
        rows = rows_for(data)
        index = np.zeros(len(rows), dtype=INDEX_DTYPE)
        for i, r in enumerate(rows):
            index[i] = tuple(r[name] for name in INDEX_DTYPE.names or ())
        grp.create_dataset("index", data=index)
        dgrp = grp.create_group("data")
        for seq, x in data.items():
            raw, _ = dtypes.to_storage(x)
            dgrp.create_dataset(str(seq), data=raw, chunks=True, **filters)
        grp.attrs["records"] = len(rows)
        f.flush()
        grp.attrs["complete"] = 1


def read_all(path: str, readers: int, plain: bool) -> tuple[float, float]:
    """Wall and CPU seconds to read every tensor of step 0 with ``readers`` threads (``plain``: h5py's ds[()],
    as before)."""
    with CaptureFile(path) as cap:
        records = cap.records(0)
        fetch: Callable[[Any], Any]
        if plain:
            data = cap._file["steps/000000/data"]
            fetch = lambda rec: data[str(rec.seq)][()]
        else:
            fetch = cap.array

        def run() -> None:
            with ThreadPoolExecutor(readers) as pool:
                for _ in pool.map(fetch, records):
                    pass

        return timed(run)


def check_same(path: str, data: dict[int, np.ndarray]) -> None:
    with CaptureFile(path) as cap:
        for rec in cap.records(0):
            got = cap.array(rec)
            assert got is not None and got.tobytes() == data[rec.seq].tobytes(), f"{path}: tensor {rec.seq} differs"
        ds = cap._file["steps/000000/data/0"]
        assert np.array_equal(read_dataset(ds), ds[()])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=0.4, help="tensor bytes in the step (default 0.4)")
    p.add_argument("--threads", type=int, nargs="+", help="writer threads to try (default 1 2 N)")
    p.add_argument("--readers", type=int, nargs="+", help="reader threads to try (default 1 2 N)")
    p.add_argument("--chunk-mib", type=float, nargs="+", default=[codec.CHUNK_BYTES / 2**20],
                   help="chunk sizes to try, MiB (default the writer's)")
    p.add_argument("--impl", nargs="+", choices=["zlib", "isal"], help="deflate libraries to try (default: installed)")
    p.add_argument("--plugins", action="store_true", help="also hdf5plugin's Zstd / Blosc2-LZ4 / LZ4 (if installed)")
    p.add_argument("--no-before", action="store_true", help="skip h5py's single-threaded gzip (slow)")
    p.add_argument("--dir", help="where to write (default a temporary folder)")
    args = p.parse_args()
    cores = os.cpu_count() or 1
    threads = sorted(set(args.threads or [1, 2, cores]))
    readers = sorted(set(args.readers or [1, 2, cores]))
    folder = tempfile.mkdtemp(prefix="td-store-io-", dir=args.dir)
    try:
        t0 = time.perf_counter()
        data = make_step(args.gb)
        nbytes = sum(x.nbytes for x in data.values())
        bf16 = sum(x.nbytes for x in data.values() if x.dtype.itemsize == 2)
        print(f"{len(data)} tensors, {nbytes / 1e9:.2f} GB ({bf16 / nbytes:.0%} BF16 by bytes), made in "
              f"{time.perf_counter() - t0:.1f} s; {cores} cores, deflate libraries: {', '.join(codec.available())}; "
              f"writer default {default_threads()} threads, chunks {codec.CHUNK_BYTES / 2**20:g} MiB", flush=True)
        head = f"{'writer':<34} {'threads':>7} {'write MB/s':>10} {'cpu s/GB':>8} {'file/tensor':>11} " + \
            f"{'read cpu s/GB':>13} " + " ".join(f"{f'read x{r} MB/s':>13}" for r in readers)
        print(head)
        print("-" * len(head))

        def row(label: str, nthreads: int | str, seconds: tuple[float, float], path: str, plain: bool | None) -> None:
            ratio = os.path.getsize(path) / nbytes
            reads = ""
            if plain is not None:
                times = [read_all(path, r, plain) for r in readers]
                reads = f"{times[0][1] / nbytes * 1e9:>13.2f} " + \
                    " ".join(f"{nbytes / wall / 1e6:>13.0f}" for wall, _ in times)
            print(f"{label:<34} {nthreads!s:>7} {nbytes / seconds[0] / 1e6:>10.0f} {seconds[1] / nbytes * 1e9:>8.2f} "
                  f"{ratio:>11.3f} {reads}", flush=True)

        if not args.no_before:
            path = os.path.join(folder, "before.h5")
            seconds = timed(write_h5py, path, data, compression="gzip", compression_opts=1, shuffle=True)
            check_same(path, data)
            row("before: h5py gzip-1+shuffle", 1, seconds, path, plain=True)
            row("  same file, read by CaptureFile", "-", seconds, path, plain=False)
        for mib in args.chunk_mib:
            codec.CHUNK_BYTES = int(mib * 2**20)
            for impl in [i for i in codec.available()[::-1] if i in (args.impl or [i])]:  # zlib first
                codec.set_implementation(impl)
                for n in threads:
                    path = os.path.join(folder, f"{impl}-{n}-{mib}.h5")
                    seconds = timed(write_writer, path, data, threads=n)
                    last = n == threads[-1]
                    if last:
                        check_same(path, data)
                    row(f"gzip-1+shuffle, {impl}, {mib:g} MiB chunks", n, seconds, path, plain=False if last else None)
                    os.remove(path)
            path = os.path.join(folder, f"none-{mib}.h5")
            seconds = timed(write_writer, path, data, compression="none")
            check_same(path, data)
            row(f"raw (compression='none'), {mib:g} MiB", 1, seconds, path, plain=False)
            os.remove(path)
        if args.plugins:
            plugins(folder, data, nbytes, readers, row)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def plugins(folder: str, data: dict[int, np.ndarray], nbytes: int, readers: list[int], row: Callable) -> None:
    try:
        import hdf5plugin
    except ImportError:
        print("hdf5plugin: not installed (pip install hdf5plugin)")
        return
    for label, filters in (("zstd-1+shuffle (plugin)", dict(shuffle=True, **hdf5plugin.Zstd(clevel=1))),
                           ("blosc2 lz4 bitshuffle (plugin)", dict(**hdf5plugin.Blosc2(
                               cname="lz4", clevel=5, filters=hdf5plugin.Blosc2.BITSHUFFLE))),
                           ("lz4 (plugin)", dict(**hdf5plugin.LZ4()))):
        path = os.path.join(folder, "plugin.h5")
        seconds = timed(write_h5py, path, data, **filters)
        row(label, 1, seconds, path, plain=True)
        os.remove(path)


if __name__ == "__main__":
    main()
