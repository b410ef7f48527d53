"""store codec: the writer's parallel gzip + shuffle chunks are standard HDF5 (plain h5py reads them bit for bit,
the datasets declare the gzip and shuffle filters), every dtype and shape comes back bit-exact (edge chunks, 0-d,
empty, several chunks), chunks deflate does not shrink are stored raw, and the reader's own chunk decoding returns
what h5py returns, for this writer's files, the old writer's (h5py's own chunks) and anything it hands to h5py."""

from __future__ import annotations

import zlib
from concurrent.futures import ThreadPoolExecutor

import h5py
import numpy as np
import pytest
from helpers import T, ml_dtypes, needs_ml_dtypes, rows_of

from tensordiff import dtypes
from tensordiff.errors import CaptureFileError
from tensordiff.store import CaptureFile, CaptureWriter, codec
from tensordiff.store.reader import read_dataset

UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
NARROW = ("bfloat16", "float8_e4m3fn")
DTYPES = ["float32", "float16", "int64", "int32", "uint8", "bool", *(pytest.param(n, marks=needs_ml_dtypes) for n in NARROW)]
#: Shapes around an 8 KiB chunk: several chunks, partial edge chunks along the first and the last axis, one
#: chunk, below the 64 KiB chunking threshold (contiguous), 0-d, empty.
SHAPES = [(301, 67), (3, 7, 4099), (40001,), (2, 1, 65536), (9, 4096), (3, 5), (), (0, 5)]


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(codec, "CHUNK_BYTES", 8192)  # many chunks from small test arrays


@pytest.fixture(params=codec.available())
def implementation(request):
    before = codec.implementation()
    codec.set_implementation(request.param)
    yield request.param
    codec.set_implementation(before)


def numpy_dtype(name: str) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, name) if name in NARROW else name)


def tensor(name: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Activation-like values (compressible), with a NaN and an Inf where the dtype has them."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * 3
    dtype = numpy_dtype(name)
    if dtype.kind == "b":
        return np.asarray(x > 0)
    if dtype.kind in "iu":
        return np.asarray(np.abs(x) * 10 if dtype.kind == "u" else x * 1000).astype(dtype)
    out = np.asarray(x).astype(dtype)
    if out.size > 2:
        out.reshape(-1)[1] = np.nan
        if name != "float8_e4m3fn":
            out.reshape(-1)[-1] = np.inf
    return out


def bits(x: np.ndarray) -> np.ndarray:
    return x.view(UINT[x.dtype.itemsize]) if x.dtype.kind != "b" else x


def write(path: str, arrays: list[np.ndarray], **options) -> None:
    rows, data = rows_of([T("forward", f"m{i}", "output", "0", x) for i, x in enumerate(arrays)])
    writer = CaptureWriter(path, {"framework": "torch"}, **options)
    writer.submit(0, rows, data, {})
    writer.close()
    assert writer.error is None


@pytest.mark.parametrize("name", DTYPES)
def test_the_parallel_writer_round_trips_every_dtype_and_shape_bit_for_bit(tmp_path, name, implementation):
    path = str(tmp_path / "c.h5")
    arrays = [tensor(name, shape, seed) for seed, shape in enumerate(SHAPES)]
    write(path, arrays, threads=3)
    with CaptureFile(path) as cap:
        for rec, x in zip(cap.records(0), arrays):
            got = cap.array(rec)
            assert got.dtype == x.dtype and got.shape == x.shape
            assert np.array_equal(bits(got), bits(x))
    with h5py.File(path, "r") as fh:                     # plain h5py: the standard gzip + shuffle pipeline
        for seq, x in enumerate(arrays):
            ds = fh[f"steps/000000/data/{seq}"]
            raw, _ = dtypes.to_storage(x)
            assert ds.dtype == raw.dtype and np.array_equal(bits(ds[()].reshape(raw.shape)), bits(raw))  # 0-d: (1,)
            if raw.nbytes >= 64 * 1024:
                assert (ds.compression, ds.compression_opts, ds.shuffle) == ("gzip", 1, True)
                assert ds.chunks == codec.chunk_shape(raw.shape, raw.itemsize)
                assert ds.id.get_num_chunks() >= 8          # several chunks, edges among them
            else:
                assert ds.chunks is None                     # small, 0-d and empty: contiguous, as before


def test_chunks_are_contiguous_runs_of_the_array_near_the_target_size():
    assert codec.chunk_shape((4096, 4096), 2, 4 * 2**20) == (512, 4096)
    assert codec.chunk_shape((2, 32, 2048, 2048), 2, 4 * 2**20) == (1, 1, 1024, 2048)
    assert codec.chunk_shape((10_000_000,), 4, 4 * 2**20) == (2**20,)
    assert codec.chunk_shape((3, 100), 4, 4 * 2**20) == (3, 100)        # smaller than a chunk: one chunk
    assert codec.chunk_shape((7, 3 * 2**20), 1, 4 * 2**20) == (1, 3 * 2**20)  # a row near the target: one row
    assert codec.slab_axis((7, 3, 5), (1, 2, 5)) == 1 and codec.slab_axis((7, 3, 5), (2, 2, 5)) is None


@pytest.mark.parametrize("itemsize", [1, 2, 3, 4, 8])
def test_shuffle_is_hdf5s_byte_transpose_and_unshuffle_undoes_it(itemsize):
    raw = np.random.default_rng(itemsize).integers(0, 256, 1000 * itemsize, dtype=np.uint8)
    shuffled = codec.shuffle(raw, itemsize)
    assert np.array_equal(shuffled, raw.reshape(-1, itemsize).T.reshape(-1))
    assert np.array_equal(codec.unshuffle(shuffled, itemsize), raw)


def test_a_chunk_deflate_cannot_shrink_is_stored_raw_with_both_filters_skipped(tmp_path):
    path = str(tmp_path / "noise.h5")
    noise = np.random.default_rng(0).integers(0, 2**32, (64, 1024), dtype=np.uint32)  # random bits: incompressible
    smooth = np.zeros((64, 1024), np.float32)
    write(path, [noise, smooth])
    with h5py.File(path, "r") as fh:
        ds, dz = fh["steps/000000/data/0"], fh["steps/000000/data/1"]
        mask, stored = ds.id.read_direct_chunk((0, 0))
        assert mask == 0b11 and stored == noise[:ds.chunks[0]].tobytes()    # shuffle (bit 0) and deflate (bit 1) skipped
        assert dz.id.read_direct_chunk((0, 0))[0] == 0 and len(dz.id.read_direct_chunk((0, 0))[1]) < 1000
        assert np.array_equal(ds[()], noise) and np.array_equal(dz[()], smooth)
    with CaptureFile(path) as cap:
        a, b = (cap.array(r) for r in cap.records(0))
        assert np.array_equal(a, noise) and np.array_equal(b, smooth)


def test_compression_none_stores_chunks_without_filters(tmp_path):
    path = str(tmp_path / "raw.h5")
    x = tensor("float32", (301, 67))
    write(path, [x], compression="none")
    with h5py.File(path, "r") as fh:
        ds = fh["steps/000000/data/0"]
        assert ds.compression is None and not ds.shuffle and ds.chunks is not None
    with CaptureFile(path) as cap:
        assert np.array_equal(bits(cap.array(cap.records(0)[0])), bits(x))


OLD_LAYOUTS = [dict(chunks=True, compression="gzip", compression_opts=1, shuffle=True),   # the writer before issue 13
               dict(chunks=(17, 5, 3), compression="gzip", compression_opts=1, shuffle=True),  # edges on all axes
               dict(chunks=(50, 7, 5), compression="gzip", shuffle=True),   # one chunk
               dict(chunks=True, compression="gzip"), dict(chunks=True, shuffle=True), dict(chunks=True),
               dict(chunks=True, compression="lzf", shuffle=True), dict(chunks=True, fletcher32=True,
                                                                        compression="gzip", shuffle=True),
               dict(chunks=True, scaleoffset=0), dict()]


@pytest.mark.parametrize("layout", OLD_LAYOUTS, ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()) or "contiguous")
@pytest.mark.parametrize("dtype", ["float32", "uint16", "int64", "float16", "uint8"])
def test_the_reader_returns_what_h5py_reads_for_files_h5py_wrote(tmp_path, layout, dtype):
    x = tensor(dtype, (50, 7, 5), seed=3) if dtype != "uint16" else \
        tensor("float16", (50, 7, 5)).view(np.uint16)                       # BF16-like bits
    if layout.get("scaleoffset") is not None and dtype.startswith("float"):
        layout = {**layout, "scaleoffset": None}
    with h5py.File(tmp_path / "old.h5", "w") as fh:
        ds = fh.create_dataset("x", data=x, **{k: v for k, v in layout.items() if v is not None})
        got = read_dataset(ds)
        assert got.dtype == ds.dtype and np.array_equal(bits(got), bits(ds[()])) and np.array_equal(bits(got), bits(x))


def test_a_capture_from_the_old_writer_reads_back_identically(tmp_path):
    """h5py's own chunks (chunks=True: not runs of the array) and its own deflate, read through CaptureFile."""
    path = str(tmp_path / "old.h5")
    x = tensor("float32", (300, 64, 3))
    write(path, [x], background=False)
    with h5py.File(path, "r+") as fh:
        del fh["steps/000000/data/0"]
        fh["steps/000000/data"].create_dataset("0", data=x, chunks=True, compression="gzip", compression_opts=1,
                                               shuffle=True)
        assert codec.slab_axis(x.shape, fh["steps/000000/data/0"].chunks) is None
    with CaptureFile(path) as cap:
        assert np.array_equal(bits(cap.array(cap.records(0)[0])), bits(x))


def test_a_chunk_never_written_reads_as_hdf5_fills_it(tmp_path):
    with h5py.File(tmp_path / "fill.h5", "w") as fh:
        ds = fh.create_dataset("x", shape=(100, 50), dtype="f4", chunks=(30, 20), compression="gzip", shuffle=True,
                               fillvalue=7.0)
        ds[:30, :20] = 1.0
        got = read_dataset(ds)
        assert np.array_equal(got, ds[()]) and got[99, 49] == 7.0 and got[0, 0] == 1.0


def test_a_damaged_chunk_is_one_capture_file_error(tmp_path):
    path = str(tmp_path / "bad.h5")
    x = tensor("float32", (301, 67))
    write(path, [x])
    with h5py.File(path, "r+") as fh:
        ds = fh["steps/000000/data/0"]
        ds.id.write_direct_chunk((0, 0), b"not a zlib stream", filter_mask=0)
    with CaptureFile(path) as cap, pytest.raises(CaptureFileError, match=r"tensor .* of step 0 is damaged"):
        cap.array(cap.records(0)[0])


def test_readers_in_many_threads_get_every_tensor_right(tmp_path, implementation):
    path = str(tmp_path / "many.h5")
    arrays = [tensor("float32", (97 + i, 301), seed=i) for i in range(24)]
    write(path, arrays, threads=2)
    with CaptureFile(path) as cap, ThreadPoolExecutor(4) as pool:
        recs = cap.records(0)
        for _ in range(3):
            for got, x in zip(pool.map(cap.array, recs), arrays):
                assert np.array_equal(bits(got), bits(x))


def test_encode_and_decode_are_the_zlib_stream_and_shuffle_hdf5_expects():
    part = np.arange(2048, dtype=np.uint16).view(np.uint8)
    mask, stored = codec.encode(part, 2, (0, 1))
    assert mask == 0 and zlib.decompress(stored) == part.reshape(-1, 2).T.tobytes()
    assert codec.decode(mask, stored, part.size, 2, (0, 1)).tobytes() == part.tobytes()
    out = np.empty(1000, np.uint8)                                      # an edge chunk's first 500 elements
    codec.decode(mask, stored, part.size, 2, (0, 1), out)
    assert out.tobytes() == part[:1000].tobytes()
    with pytest.raises(ValueError, match="a chunk holds 4096 bytes, 8 expected"):
        codec.decode(mask, stored, 8, 2, (0, 1))


def test_noise_planes_go_into_the_zlib_stream_as_stored_blocks_that_any_inflater_reads(tmp_path):
    """FP32 activations: the three low byte planes (mantissa) are noise, stored uncompressed inside the zlib
    stream; the sign/exponent plane is compressed. zlib, h5py and CaptureFile all read it back."""
    x = tensor("float32", (512, 1024))
    part = x.reshape(-1).view(np.uint8)
    mask, stream = codec.encode(part, 4, (0, 1))
    shuffled = part.reshape(-1, 4).T.tobytes()
    assert mask == 0 and zlib.decompress(stream) == shuffled
    assert stream[2] & 0b111 == 0b000                       # the first block after the header: stored, not final
    assert 0.75 * part.size < len(stream) < 0.95 * part.size  # 3 planes copied, the exponent plane compressed
    path = str(tmp_path / "planes.h5")
    write(path, [x])
    with h5py.File(path, "r") as fh:
        ds = fh["steps/000000/data/0"]
        assert ds.id.read_direct_chunk((0, 0))[1][2] & 0b111 == 0 and np.array_equal(bits(ds[()]), bits(x))
    with CaptureFile(path) as cap:
        assert np.array_equal(bits(cap.array(cap.records(0)[0])), bits(x))
