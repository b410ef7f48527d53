"""The writer process takes large tensors through shared memory (a file it maps, then unlinks), small ones and
everything else through its pipe: the file written is the same either way, nothing is left behind, and a shared
memory that is full or switched off sends everything through the pipe."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from tensordiff.capturing.recorder import Deferred
from tensordiff.store import CaptureFile
from tensordiff.store import writer_process as wp

pytestmark = pytest.mark.skipif(not hasattr(os, "posix_fallocate"), reason="posix_fallocate: Linux")


def _row(seq: int, numel: int) -> dict:
    return {"seq": seq, "phase": "forward", "module": f"m{seq}", "call": 0, "kind": "output", "slot": "0",
            "module_class": "Linear", "dtype": "float32", "shape": str(numel), "min": 0.0, "max": 0.0, "mean": 0.0,
            "l2": 0.0, "nan": 0, "inf": 0, "numel": numel, "has_data": 1, "same_as": -1, "grad_of": -1, "enter": 0,
            "parent": ""}


ARRAYS = {0: np.arange(600_000, dtype=np.float32),            # 2.4 MB, on the host at step(): shared memory
          1: np.linspace(-1, 1, 900_000, dtype=np.float32),   # 3.6 MB, a GPU copy after the step: shared memory
          2: np.ones(16, dtype=np.float32)}                   # small: the pipe


def _write(path: str) -> wp.ProcessWriter:
    w = wp.ProcessWriter(path, {"framework": "torch"})
    later = ARRAYS[1]
    data = {0: ARRAYS[0], 1: Deferred(lambda: later, later.nbytes, lambda: False), 2: ARRAYS[2]}
    w.submit(0, [_row(s, a.size) for s, a in ARRAYS.items()], data, {})
    w.close()
    assert not w._fallback, "the writer process did not start"
    return w


def _read(path: str) -> dict[int, np.ndarray]:
    with CaptureFile(path) as c:
        assert c.steps == [0] and "tensors_lost" not in c.step_attrs(0)
        return {r.seq: c.array(r) for r in c.records(0)}


@pytest.fixture
def shm(tmp_path, monkeypatch):
    folder = tmp_path / "shm"
    folder.mkdir()
    monkeypatch.setattr(wp, "SHM_DIR", str(folder))
    monkeypatch.setenv(wp.START_ENV, "60")
    return folder


def test_large_tensors_cross_in_shared_memory_and_none_is_left(tmp_path, shm):
    w = _write(str(tmp_path / "a.h5"))
    assert w._shm_count == 2 and w._shm  # the two large ones, not the small one
    got = _read(str(tmp_path / "a.h5"))
    for seq, want in ARRAYS.items():
        np.testing.assert_array_equal(got[seq], want)
    assert os.listdir(shm) == []


def test_a_full_shared_memory_sends_them_through_the_pipe(tmp_path, shm, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    w = _write(str(tmp_path / "b.h5"))
    assert w._shm is False and w._shm_count == 1  # tried once, then off for the rest of the run
    got = _read(str(tmp_path / "b.h5"))
    for seq, want in ARRAYS.items():
        np.testing.assert_array_equal(got[seq], want)
    assert os.listdir(shm) == []


def test_switched_off_nothing_goes_through_shared_memory(tmp_path, shm, monkeypatch):
    monkeypatch.setenv(wp.SHM_ENV, "0")
    w = _write(str(tmp_path / "c.h5"))
    assert w._shm_count == 0
    np.testing.assert_array_equal(_read(str(tmp_path / "c.h5"))[1], ARRAYS[1])


def test_a_nearly_full_shared_memory_is_left_alone_and_the_pipe_takes_over(tmp_path, shm, monkeypatch):
    real = os.statvfs

    class Nearly:
        def __init__(self, st):
            self.f_frsize, self.f_blocks = 4096, 1 << 20   # 4 GiB
            self.f_bavail = (1 << 18) + 100                 # a quarter free and 400 KB: not for a 2.4 MB tensor

    monkeypatch.setattr(os, "statvfs", lambda p: Nearly(real(p)))
    w = _write(str(tmp_path / "d.h5"))
    assert w._shm_count == 0 and w._shm is True  # not switched off: room may come back
    np.testing.assert_array_equal(_read(str(tmp_path / "d.h5"))[0], ARRAYS[0])
