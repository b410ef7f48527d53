"""store: what CaptureWriter writes, CaptureFile reads back unchanged (fields, statistics, tensors bit for
bit in every dtype, links, scalars); incomplete steps are skipped; a file that is not a capture is one
CaptureFileError naming it."""

from __future__ import annotations

import dataclasses
import math
import os
import warnings

import h5py
import numpy as np
import pytest
from helpers import T, ml_dtypes, needs_ml_dtypes, rows_of

from tensordiff import dtypes
from tensordiff.errors import CaptureFileError, TensordiffError
from tensordiff.record import FLOAT_COLUMNS, INDEX_DTYPE, INT_COLUMNS, ROW_FIELDS, TEXT_COLUMNS, Record
from tensordiff.store import FORMAT_VERSION, CaptureFile, CaptureWriter
from tensordiff.store.format import FORMAT_ATTR

NARROW = ("bfloat16", "float8_e4m3fn", "float8_e5m2")
DTYPE_NAMES = ["float32", "float16", "int64", *(pytest.param(n, marks=needs_ml_dtypes) for n in NARROW)]
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def bits(x: np.ndarray) -> np.ndarray:
    return x.view(UINT[x.dtype.itemsize])


def numpy_dtype(name: str) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, name) if name in NARROW else name)


def values(name: str) -> np.ndarray:
    """A [3, 5] array of dtype ``name`` with varied bits: signs, small and large values, for floats a NaN and an Inf."""
    dtype = numpy_dtype(name)
    if dtype.kind == "i":
        return np.array([[-(2 ** 62), -1, 0, 1, 2 ** 62 + 3], [5, 6, 7, 8, 9], [10, 11, 12, 13, 14]], dtype=dtype)
    x = np.random.default_rng(0).standard_normal((3, 5)) * np.array([1e-3, 0.5, 1.0, 7.0, 100.0])
    out = x.astype(dtype)
    out[2, 3] = np.nan
    if name != "float8_e4m3fn":  # e4m3fn has no infinity
        out[2, 4] = -np.inf
    return out


def write(path: str, steps: dict[int, list[T]], background: bool, attrs: dict | None = None) -> CaptureWriter:
    writer = CaptureWriter(path, {"framework": "torch", "framework_version": "9.9", **(attrs or {})},
                           background=background)
    for step, tensors in steps.items():
        rows, data = rows_of(tensors)
        writer.submit(step, rows, data, {"wall_time": 0.5, "loss": 2.0 + step})
    writer.close()
    return writer


def test_the_index_row_holds_every_field_of_a_record_but_its_step():
    """A record's fields and its columns on disk are declared together (``record.py``): one column per field, in the
    fields' order, each an integer, a number or text."""
    assert ROW_FIELDS == INDEX_DTYPE.names == tuple(f.name for f in dataclasses.fields(Record) if f.name != "step")
    assert sorted((*INT_COLUMNS, *FLOAT_COLUMNS, *TEXT_COLUMNS)) == sorted(ROW_FIELDS)
    assert h5py.check_string_dtype(INDEX_DTYPE["module"]).encoding == "utf-8"


@pytest.mark.parametrize("background", [True, False], ids=["background", "inline"])
def test_records_come_back_with_their_fields_and_statistics(tmp_path, background):
    path = str(tmp_path / "c.h5")
    x = np.array([[1.0, -2.0], [3.0, 4.0]], dtype=np.float32)
    steps = {0: [T("weights", "fc", "param", "weight", x, module_class="Linear"),
                 T("forward", "fc", "input", "0", x, same_as=0, enter=1, parent="blk", module_class="Linear"),
                 T("forward", "fc", "output", "0", 2 * x, call=1, enter=1, parent="blk", module_class="Linear"),
                 T("backward", "fc", "grad_output", "0", -x, grad_of=2, enter=1, parent="blk", store=False),
                 T("loss", "", "loss", "value", np.array(2.5, dtype=np.float32))],
             1: [T("weights", "fc", "param", "weight", x + 1)]}
    writer = write(path, steps, background, attrs={"meta": {"lr": 0.1}})
    assert writer.error is None
    with CaptureFile(path) as cap:
        assert cap.steps == [0, 1] and cap.incomplete_steps == []
        assert cap.framework == "torch" and cap.attrs["framework_version"] == "9.9"
        assert cap.attrs[FORMAT_ATTR] == FORMAT_VERSION and cap.attrs["meta"] == '{"lr": 0.1}'
        assert cap.step_attrs(1)["loss"] == 3.0 and cap.step_attrs(1)["records"] == 1
        recs = cap.records(0)
        assert [r.seq for r in recs] == [0, 1, 2, 3, 4]
        w, inp, out, grad, loss = recs
        assert (w.step, w.phase, w.module, w.kind, w.slot, w.module_class, w.dtype, w.shape) == \
               (0, "weights", "fc", "param", "weight", "Linear", "float32", (2, 2))
        # statistics of [[1, -2], [3, 4]] by hand
        assert (w.min, w.max, w.mean, w.l2, w.nan, w.inf, w.numel) == (-2.0, 4.0, 1.5, math.sqrt(30.0), 0, 0, 4)
        assert w.has_data and w.same_as == -1 and w.grad_of == -1 and w.enter == -1 and w.parent == ""
        assert (inp.same_as, inp.enter, inp.parent, inp.has_data) == (0, 1, "blk", True)  # a link holds its source's tensor
        assert (out.call, out.max, out.min) == (1, 8.0, -4.0)
        assert (grad.grad_of, grad.has_data, grad.l2) == (2, False, math.sqrt(30.0))
        assert cap.array(grad) is None                       # statistics only
        assert (loss.shape, loss.numel, loss.max) == ((), 1, 2.5)
        assert cap.array(loss).shape == () and float(cap.array(loss)) == 2.5
        assert [r.step for r in cap.iter_records()] == [0] * 5 + [1]
        assert cap.records(0) is recs                        # read once per step


@pytest.mark.parametrize("background", [True, False], ids=["background", "inline"])
@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_tensors_come_back_bit_exact_in_their_own_dtype(tmp_path, name, background):
    path = str(tmp_path / f"{name}.h5")
    x = values(name)
    big = np.random.default_rng(1).standard_normal((300, 64)).astype(numpy_dtype(name))  # FP32/INT64: >= 64 KiB, gzip
    write(path, {0: [T("forward", "m", "output", "0", x), T("forward", "m", "output", "1", big)]}, background)
    with CaptureFile(path) as cap:
        small_rec, big_rec = cap.records(0)
        assert small_rec.dtype == name and small_rec.shape == (3, 5)
        for rec, expected in ((small_rec, x), (big_rec, big)):
            got = cap.array(rec)
            assert got.dtype == numpy_dtype(name) and got.shape == expected.shape
            assert np.array_equal(bits(got), bits(expected))


@needs_ml_dtypes
def test_the_file_stores_narrow_floats_as_raw_bits(tmp_path):
    path = str(tmp_path / "raw.h5")
    x = np.array([1.0, -2.0, 0.5], dtype=ml_dtypes.bfloat16)
    write(path, {0: [T("forward", "m", "output", "0", x)]}, background=False)
    with h5py.File(path, "r") as fh:
        raw = fh["steps/000000/data/0"][()]
    assert raw.dtype == np.uint16 and raw.tolist() == [0x3F80, 0xC000, 0x3F00]


def test_reading_a_narrow_float_without_ml_dtypes_is_one_clear_error(tmp_path, monkeypatch):
    path = str(tmp_path / "bf16.h5")
    # BF16 as the file holds it: raw uint16 bits under the logical dtype name (no ml_dtypes needed to write it)
    write(path, {0: [T("forward", "m", "output", "0", np.array([0x3F80, 0xC000], np.uint16), dtype="bfloat16")]},
          background=False)
    monkeypatch.delitem(dtypes.NUMPY_DTYPES, "bfloat16", raising=False)   # as in an environment without ml_dtypes
    with CaptureFile(path) as cap:
        (rec,) = cap.records(0)
        assert rec.dtype == "bfloat16"
        with pytest.raises(TensordiffError, match="reading bfloat16 tensors needs the ml_dtypes package"):
            cap.array(rec)


def test_a_linked_record_reads_the_tensor_of_the_record_it_points_to(tmp_path):
    path = str(tmp_path / "link.h5")
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    y = -np.arange(6, dtype=np.float32).reshape(2, 3)
    write(path, {0: [T("forward", "a", "output", "0", x), T("forward", "b", "output", "0", y),
                     T("forward", "c", "input", "0", x, same_as=0, extra={"has_data": 1}),
                     T("forward", "d", "input", "0", y, same_as=1, extra={"has_data": 1})]}, background=True)
    with h5py.File(path, "r") as fh:
        assert sorted(fh["steps/000000/data"].keys()) == ["0", "1"]   # the links store nothing of their own
    with CaptureFile(path) as cap:
        recs = cap.records(0)
        assert [r.same_as for r in recs] == [-1, -1, 0, 1]
        assert np.array_equal(cap.array(recs[2]), x) and np.array_equal(cap.array(recs[3]), y)


def test_scalars_are_read_per_name_and_step_and_a_later_value_of_a_step_wins(tmp_path):
    path = str(tmp_path / "s.h5")
    for background in (True, False):
        writer = CaptureWriter(path, {"framework": "torch"}, background=background)
        writer.submit_scalars(0, {"loss": 5.0, "lr": 1e-3})
        writer.submit_scalars(1, {"loss": 4.0})
        writer.submit_scalars(0, {"loss": 4.5})     # step 0 logged again (a resumed run)
        writer.submit_scalars(2, {"grad_norm": 0.25})
        writer.close()
        writer.submit_scalars(3, {"loss": 1.0})      # after close: ignored, no error
        with CaptureFile(path) as cap:
            assert cap.scalars() == {"loss": {0: 4.5, 1: 4.0}, "lr": {0: 1e-3}, "grad_norm": {2: 0.25}}
            assert cap.steps == []


def test_scalars_never_wait_behind_a_step_being_written(tmp_path):
    import threading

    path = str(tmp_path / "slow.h5")
    writer = CaptureWriter(path, {"framework": "torch"}, max_pending=1)
    disk_free = threading.Event()
    write_step = writer._write

    def slow_disk(*job):  # the writer thread holds each step until the test lets it go
        disk_free.wait(30)
        write_step(*job)

    writer._write = slow_disk  # type: ignore[method-assign]
    rows, data = rows_of([T("forward", "fc", "output", "0", np.ones(4, np.float32))])
    writer.submit(0, rows, data, {})  # taken by the writer thread, which now waits
    writer.submit(1, rows, data, {})  # fills the one-deep queue: a third step would block
    logged = threading.Thread(target=lambda: [writer.submit_scalars(s, {"loss": float(s)}) for s in range(100)])
    logged.start()
    logged.join(5)
    assert not logged.is_alive()  # 100 scalars submitted while both steps wait
    disk_free.set()
    writer.close()
    with CaptureFile(path) as cap:
        assert cap.steps == [0, 1] and cap.scalars()["loss"] == {s: float(s) for s in range(100)}


def test_a_capture_without_scalars_has_none(tmp_path):
    path = str(tmp_path / "n.h5")
    write(path, {0: [T("forward", "m", "output", "0", np.ones(2, np.float32))]}, background=False)
    with CaptureFile(path) as cap:
        assert cap.scalars() == {}


def test_a_long_scalar_name_with_a_multibyte_character_at_the_cut_still_reads(tmp_path):
    path = str(tmp_path / "u.h5")
    writer = CaptureWriter(path, {"framework": "torch"}, background=False)
    writer.submit_scalars(0, {"a" * 47 + "é": 1.0, "loss": 2.0})
    writer.close()
    with CaptureFile(path) as cap:
        assert cap.scalars()["loss"] == {0: 2.0}


def test_a_step_without_the_complete_mark_is_ignored(tmp_path):
    path = str(tmp_path / "crash.h5")
    x = np.ones((2, 2), np.float32)
    write(path, {0: [T("forward", "m", "output", "0", x)], 1: [T("forward", "m", "output", "0", x)]}, background=False)
    with h5py.File(path, "a") as fh:                   # what a run killed while writing step 2 leaves behind
        grp = fh.create_group("steps/000002")
        grp.create_dataset("index", data=fh["steps/000001/index"][()])
        grp.create_group("data")
        del fh["steps/000001"].attrs["complete"]      # and step 1's mark never written
    with CaptureFile(path) as cap:
        assert cap.steps == [0] and cap.incomplete_steps == [1, 2]
        assert [r.step for r in cap.iter_records()] == [0]


def test_a_write_error_stops_the_capture_with_a_warning_and_keeps_earlier_steps(tmp_path):
    path = str(tmp_path / "w.h5")
    rows, data = rows_of([T("forward", "m", "output", "0", np.ones(3, np.float32))])
    writer = CaptureWriter(path, {"framework": "torch"}, background=False)
    writer.submit(0, rows, data, {})
    with pytest.warns(RuntimeWarning, match="writing step 0 to .*w.h5 failed"):
        writer.submit(0, rows, data, {})               # step 0 again: its group exists
    assert writer.error is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        writer.submit(1, rows, data, {})               # dropped silently: the capture has stopped
    writer.close()
    with CaptureFile(path) as cap:
        assert cap.steps == [0]


# ------------------------------------------------------------------------------------------- errors
def error_of(path: str) -> str:
    with pytest.raises(CaptureFileError) as err:
        CaptureFile(path)
    text = str(err.value)
    assert text.startswith(f"{path}: ") and "\n" not in text
    return text


def test_a_missing_file_is_named(tmp_path):
    assert "no such file" in error_of(str(tmp_path / "missing.h5"))


def test_a_directory_is_named(tmp_path):
    assert "is a directory, not a capture file" in error_of(str(tmp_path))


@pytest.mark.parametrize("content", [b"", b"step,loss\n0,2.5\n", b"\x89HDF\r\n\x1a\n" + b"\x00" * 40],
                         ids=["empty", "csv", "truncated-hdf5"])
def test_a_file_that_is_not_hdf5_is_named(tmp_path, content):
    path = tmp_path / "bad.h5"
    path.write_bytes(content)
    assert "not a readable HDF5 file" in error_of(str(path))


def test_an_hdf5_file_without_the_format_attribute_is_named(tmp_path):
    path = str(tmp_path / "other.h5")
    with h5py.File(path, "w") as fh:
        fh.create_dataset("x", data=np.ones(3))
    assert f"not a tensordiff capture (no '{FORMAT_ATTR}' attribute)" in error_of(path)


def test_a_newer_format_version_is_named_with_both_versions(tmp_path):
    path = str(tmp_path / "new.h5")
    write(path, {0: [T("forward", "m", "output", "0", np.ones(2, np.float32))]}, background=False)
    with h5py.File(path, "a") as fh:
        fh.attrs[FORMAT_ATTR] = FORMAT_VERSION + 1
    text = error_of(path)
    assert f"capture format {FORMAT_VERSION + 1} is newer than this tensordiff reads ({FORMAT_VERSION})" in text
    assert "upgrade tensordiff" in text


def test_the_writer_creates_missing_folders(tmp_path):
    path = str(tmp_path / "deep" / "er" / "c.h5")
    write(path, {0: [T("forward", "m", "output", "0", np.ones(2, np.float32))]}, background=True)
    assert os.path.isfile(path)
    with CaptureFile(path) as cap:
        assert cap.steps == [0] and cap.nbytes() == os.path.getsize(path)


def test_an_attribute_too_large_for_hdf5_is_stored_as_metadata_and_read_back(tmp_path):
    import json

    from helpers import T, write_capture

    from tensordiff.store import CaptureFile

    big = {f"decoder.layers.{i}.mlp.experts.{j}.weight": {"tp": True, "dim": 0, "stride": 1}
           for i in range(40) for j in range(64)}  # a MoE model's parameter splits: far over 64 KiB
    path = write_capture(str(tmp_path / "big.h5"), [[T("forward", "m", "output", "0", np.ones(2, np.float32))]],
                         param_splits=json.dumps(big), small="kept as an attribute")
    with CaptureFile(path) as cap:
        assert json.loads(cap.attrs["param_splits"]) == big
        assert cap.attrs["small"] == "kept as an attribute"
