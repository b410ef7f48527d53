"""store writer queue: bounded by the bytes of full tensors. With policy 'drop' a step that does not fit is written
without its full tensors (has_data 0, statistics kept, one warning for the run); with 'wait' submit blocks until
it fits and nothing is dropped; statistics-only steps never wait; options come from arguments or the environment.

The writer thread is held on a test event (its ``_write`` wrapped), so what is queued is known without timing."""

from __future__ import annotations

import math
import threading
import warnings

import numpy as np
import pytest
from helpers import T, rows_of

from tensordiff.store import CaptureFile, CaptureWriter
from tensordiff.store.writer import default_threads

BIG = np.arange(4096, dtype=np.float32).reshape(64, 64)   # 16 KiB per step, over the tiny limits below
LIMIT_GB = 1e-6                                            # 1 kB: any second step with tensors is over it


def step_tensors(k: int, store: bool = True) -> list[T]:
    """A stored tensor (statistics only: not ``store``), a link to it and a statistics-only gradient."""
    return [T("forward", "fc", "output", "0", BIG + k, store=store),
            T("forward", "act", "input", "0", BIG + k, same_as=0),
            T("backward", "fc", "grad_output", "0", -BIG, store=False)]


def held_writer(path: str, fail: bool = False, **options) -> tuple[CaptureWriter, threading.Event]:
    """A background writer whose thread waits on the returned event before writing each step (then fails to,
    with ``fail``)."""
    writer = CaptureWriter(path, {"framework": "torch"}, queue_gb=LIMIT_GB, **options)
    disk_free = threading.Event()
    write_step = writer._write

    def held(*job):
        disk_free.wait(60)
        if fail:
            raise OSError("disk full")
        write_step(*job)

    writer._write = held  # type: ignore[method-assign]
    return writer, disk_free


def submit(writer: CaptureWriter, step: int, stats_only: bool = False) -> None:
    rows, data = rows_of(step_tensors(step, store=not stats_only))
    writer.submit(step, rows, data, {"loss": float(step)})


def test_drop_keeps_statistics_and_links_and_warns_once(tmp_path):
    path = str(tmp_path / "drop.h5")
    writer, disk_free = held_writer(path, policy="drop")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        submit(writer, 0)              # nothing pending: always taken, whatever its size
        submit(writer, 1)              # 16 KiB pending, limit 1 kB: dropped
        submit(writer, 2)              # dropped again, silently
    texts = [str(w.message) for w in caught]
    assert texts == ["tensordiff: writer behind by 0.0 GB; full tensors of step 1 dropped, statistics kept"]
    assert writer.dropped_steps == [1, 2]
    disk_free.set()
    writer.close()
    assert writer.error is None
    with CaptureFile(path) as cap:
        assert cap.steps == [0, 1, 2]
        kept = cap.records(0)
        assert [r.has_data for r in kept] == [True, True, False]
        assert np.array_equal(cap.array(kept[1]), BIG)
        assert "tensors_dropped" not in cap.step_attrs(0)
        for step in (1, 2):
            out, link, grad = cap.records(step)
            assert (out.has_data, link.has_data, grad.has_data) == (False, False, False)
            assert cap.array(out) is None and cap.array(link) is None
            assert out.max == 4095.0 + step and out.l2 == pytest.approx(math.sqrt(float(np.sum((BIG + step) ** 2.0))))
            assert link.max == 4095.0 + step and grad.min == -4095.0          # statistics kept
            assert cap.step_attrs(step)["tensors_dropped"] == 1 and cap.step_attrs(step)["loss"] == float(step)


def test_wait_blocks_until_the_step_fits_and_drops_nothing(tmp_path):
    path = str(tmp_path / "wait.h5")
    writer, disk_free = held_writer(path, policy="wait")
    waiting = threading.Event()
    writer._on_wait = waiting.set
    submit(writer, 0)
    second = threading.Thread(target=submit, args=(writer, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second.start()
        assert waiting.wait(60)                          # submit of step 1 waits for room
        assert second.is_alive() and len(writer._steps) <= 1
        disk_free.set()                                  # step 0 written: step 1 fits
        second.join(60)
        assert not second.is_alive()
        writer.close()
    assert writer.error is None and writer.dropped_steps == []
    with CaptureFile(path) as cap:
        assert cap.steps == [0, 1]
        for step in (0, 1):
            out, link, _ = cap.records(step)
            assert out.has_data and link.has_data and np.array_equal(cap.array(link), BIG + step)


@pytest.mark.parametrize("policy", ["wait", "drop"])
def test_statistics_only_steps_never_wait(tmp_path, policy):
    path = str(tmp_path / "stats.h5")
    writer, disk_free = held_writer(path, policy=policy)
    submit(writer, 0)                                    # held on the writer thread
    done = threading.Event()

    def training():
        for step in range(1, 6):
            submit(writer, step, stats_only=True)
            writer.submit_scalars(step, {"loss": float(step)})
        done.set()

    thread = threading.Thread(target=training)
    thread.start()
    assert done.wait(60)                                 # five steps queued while step 0 is not written
    disk_free.set()
    thread.join()
    writer.close()
    assert writer.dropped_steps == []
    with CaptureFile(path) as cap:
        assert cap.steps == [0, 1, 2, 3, 4, 5]
        assert cap.records(0)[0].has_data and not any(r.has_data for r in cap.records(3))
        assert cap.scalars()["loss"] == {s: float(s) for s in range(1, 6)}


def test_a_write_error_releases_a_submit_waiting_for_room(tmp_path):
    path = str(tmp_path / "err.h5")
    writer, disk_free = held_writer(path, policy="wait", fail=True)
    waiting = threading.Event()
    writer._on_wait = waiting.set
    submit(writer, 0)
    blocked = threading.Thread(target=submit, args=(writer, 1))
    blocked.start()
    assert waiting.wait(60)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                  # the writer thread's "capture stopped" warning
        disk_free.set()                                  # writing step 0 fails: the capture stops
        blocked.join(60)
        assert not blocked.is_alive()                    # and the waiting submit gave up
        writer.close()
    assert isinstance(writer.error, OSError) and str(writer.error) == "disk full"
    with CaptureFile(path) as cap:
        assert cap.steps == []


def test_options_come_from_the_environment_and_bad_values_fall_back_with_a_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("TENSORDIFF_WRITE_THREADS", "3")
    monkeypatch.setenv("TENSORDIFF_WRITE_QUEUE_GB", "0.5")
    monkeypatch.setenv("TENSORDIFF_WRITE_POLICY", "drop")
    monkeypatch.setenv("TENSORDIFF_WRITE_COMPRESSION", "none")
    writer = CaptureWriter(str(tmp_path / "a.h5"), {}, background=False)
    writer.close()
    assert (writer.threads, writer.queue_bytes, writer.policy, writer.compression) == (3, 500_000_000, "drop", "none")
    writer = CaptureWriter(str(tmp_path / "b.h5"), {}, background=False, threads=2, queue_gb=1, policy="wait",
                           compression="gzip")
    writer.close()
    assert (writer.threads, writer.queue_bytes, writer.policy, writer.compression) == (2, 10**9, "wait", "gzip")
    monkeypatch.setenv("TENSORDIFF_WRITE_THREADS", "many")
    monkeypatch.setenv("TENSORDIFF_WRITE_POLICY", "later")
    with pytest.warns(RuntimeWarning) as caught:
        writer = CaptureWriter(str(tmp_path / "c.h5"), {}, background=False)
    writer.close()
    assert writer.threads == default_threads() and writer.policy == "wait"
    texts = sorted(str(w.message) for w in caught)
    assert texts == ["tensordiff: TENSORDIFF_WRITE_POLICY='later' is not one of wait, drop; using wait",
                     f"tensordiff: TENSORDIFF_WRITE_THREADS='many' is not an integer >= 1; using {default_threads()}"]
    monkeypatch.delenv("TENSORDIFF_WRITE_THREADS")
    with pytest.raises(ValueError, match="policy must be one of"):
        CaptureWriter(str(tmp_path / "d.h5"), {}, policy="later")
