"""The diff's pool of comparing threads (``--jobs``, ``DiffOptions.jobs``) and its reading each tensor once.

The captures: a chain of Linear modules, each one's output recorded again as the next one's input (a ``same_as``
link, as the capture hooks record it), over two steps; B's values off by chosen relative errors, so that rows are
ok, diverged and (in step 1) drifting."""

from __future__ import annotations

import os

import numpy as np
import pytest
from helpers import T, write_capture

from tensordiff.cli import main
from tensordiff.diff import DiffOptions, diff
from tensordiff.diff.engine import MAX_DEFAULT_JOBS, compare_jobs
from tensordiff.errors import UsageError
from tensordiff.explain.place import explanation
from tensordiff.store import CaptureFile

LAYERS = 6


def chain_step(errors: dict[int, float], seed: int = 0) -> list[T]:
    """One step of ``LAYERS`` Linear layers: weights, then each layer's input (a link to the previous output, from
    layer 1 on) and output, the loss, each output's gradient; layer i's output off by ``errors[i]`` (relative)."""
    rng = np.random.default_rng(seed)
    recs = [T("weights", f"layers.{i}", "param", "weight", rng.standard_normal((8, 8)).astype(np.float32),
              module_class="Linear") for i in range(LAYERS)]
    y = rng.standard_normal((4, 8)).astype(np.float32)  # the model's input
    out_seq = -1
    for i in range(LAYERS):
        enter = len(recs)
        if i == 0:
            recs.append(T("forward", "layers.0", "input", "0", y, enter=enter, module_class="Linear"))
        else:
            recs.append(T("forward", f"layers.{i}", "input", "0", y, same_as=out_seq, enter=enter,
                          module_class="Linear", extra={"has_data": 1}))
        y = np.tanh(rng.standard_normal((4, 8))).astype(np.float32)
        noise = rng.standard_normal(y.shape).astype(np.float32)
        y = (y + errors.get(i, 0.0) * np.linalg.norm(y) * noise / np.linalg.norm(noise)).astype(np.float32)
        out_seq = len(recs)
        recs.append(T("forward", f"layers.{i}", "output", "0", y, enter=enter, module_class="Linear"))
    recs.append(T("loss", "", "loss", "value", np.array(0.5, np.float32), module_class="Loss"))
    for i in reversed(range(LAYERS)):
        grad_of = next(k for k, r in enumerate(recs) if r.phase == "forward" and r.module == f"layers.{i}"
                       and r.kind == "output")
        recs.append(T("backward", f"layers.{i}", "grad_output", "0", rng.standard_normal((4, 8)).astype(np.float32),
                      grad_of=grad_of, module_class="Linear"))
    return recs


@pytest.fixture
def captures(tmp_path):
    a = write_capture(str(tmp_path / "a.h5"), [chain_step({}, 0), chain_step({}, 1)])
    b = write_capture(str(tmp_path / "b.h5"), [chain_step({2: 1e-6, 3: 1e-3}, 0), chain_step({4: 1e-2}, 1)])
    return a, b


def fingerprint(result) -> list:
    rows = [(r.step, r.phase, r.pair.a.label if r.pair.a else None, r.pair.b.label if r.pair.b else None, r.verdict,
             r.note, r.tol, r.judged, r.linked, r.metrics.as_dict() if r.metrics else None) for r in result.rows]
    first = result.first
    return [rows, result.outcome, result.reasons, explanation(first) if first else None,
            {k: v.to_dict() if hasattr(v, "to_dict") else repr(v) for k, v in result.coverage.items()}]


@pytest.mark.parametrize("jobs", [2, 3, 8])
def test_the_result_is_the_same_for_any_number_of_jobs(captures, jobs):
    serial = diff(*captures, DiffOptions(jobs=1))
    assert serial.first is not None and serial.first.module_a == "layers.3"   # 1e-3 after 1e-6: introduced there
    assert [r.verdict for r in serial.rows].count("diverged") >= 2
    assert fingerprint(diff(*captures, DiffOptions(jobs=jobs))) == fingerprint(serial)


@pytest.mark.parametrize("jobs", [1, 3])
def test_a_tensor_recorded_under_two_names_is_read_once(captures, monkeypatch, jobs):
    reads: list[tuple[str, int, int]] = []
    real = CaptureFile.array

    def counting(self, record):
        reads.append((os.path.basename(self.path), record.step, record.same_as if record.same_as >= 0 else record.seq))
        return real(self, record)

    monkeypatch.setattr(CaptureFile, "array", counting)
    result = diff(*captures, DiffOptions(jobs=jobs))
    links = [r for r in result.rows if r.pair.a is not None and r.pair.a.same_as >= 0]
    assert len(links) == 2 * (LAYERS - 1) and all(r.verdict in ("ok", "diverged") for r in links)
    assert len(reads) == len(set(reads))                      # no tensor read twice on either side
    from tensordiff.diff.judge import IDENTICAL

    compared = [r for r in result.rows if r.metrics is not None and r.metrics != IDENTICAL]  # identical: never read
    linked = [r for r in links if r.metrics != IDENTICAL]
    assert len(reads) == 2 * (len(compared) - len(linked))    # every compared row's tensors, the links' once
    for link in links:                                        # a link's row carries its source's numbers
        (source,) = [r for r in result.rows if r.pair.a is not None and r.pair.a.step == link.pair.a.step
                     and r.pair.a.seq == link.pair.a.same_as]
        assert link.metrics == source.metrics and link.verdict == source.verdict


def test_the_default_is_the_usable_cores_up_to_eight_and_the_environment_sets_it(monkeypatch):
    monkeypatch.delenv("TENSORDIFF_JOBS", raising=False)
    assert compare_jobs() == max(1, min(len(os.sched_getaffinity(0)), MAX_DEFAULT_JOBS))
    assert compare_jobs(3) == 3
    monkeypatch.setenv("TENSORDIFF_JOBS", "5")
    assert compare_jobs() == 5 and compare_jobs(2) == 2      # --jobs wins over the environment


@pytest.mark.parametrize("value", ["many", "0"])
def test_a_bad_tensordiff_jobs_is_one_line_and_exit_2(captures, monkeypatch, capsys, value):
    monkeypatch.setenv("TENSORDIFF_JOBS", value)
    with pytest.raises(UsageError, match="TENSORDIFF_JOBS"):
        compare_jobs()
    capsys.readouterr()
    assert main(["diff", *captures, "--no-hints"]) == 2
    err = capsys.readouterr().err.strip()
    assert "TENSORDIFF_JOBS" in err and len(err.splitlines()) == 1


def test_jobs_below_one_are_refused():
    with pytest.raises(UsageError, match="--jobs 0"):
        DiffOptions(jobs=0)


def test_the_cli_passes_jobs_to_the_compare(captures, capsys):
    assert main(["diff", *captures, "--jobs", "1", "--no-hints", "--no-color"]) == 1
    serial = capsys.readouterr().out
    assert main(["diff", *captures, "--jobs", "4", "--no-hints", "--no-color"]) == 1
    assert capsys.readouterr().out == serial
    assert main(["diff", *captures, "--jobs", "0"]) == 2
    assert "--jobs 0" in capsys.readouterr().err


def test_pairs_stored_as_the_same_bytes_are_identical_without_decoding(tmp_path, monkeypatch):
    """Two captures holding the same tensors (a rerun of a deterministic program): every stored pair is found
    identical from its compressed chunks, never decoded, with the metrics the elementwise compare gives identical
    tensors; one element changed in one chunk of a large tensor is read and compared as usual, and diverges."""
    import tensordiff.diff.judge as judge
    from tensordiff.store import reader

    rng = np.random.default_rng(3)
    big = rng.standard_normal(3_000_000).astype(np.float32)  # several compressed chunks
    steps_a = [chain_step({}, 0) + [T("forward", "head", "output", "0", big, module_class="Linear")]]
    steps_b = [chain_step({}, 0) + [T("forward", "head", "output", "0", big, module_class="Linear")]]
    a = write_capture(str(tmp_path / "a.h5"), steps_a)
    b = write_capture(str(tmp_path / "b.h5"), steps_b)
    decoded = []
    monkeypatch.setattr(reader, "read_dataset", lambda ds, real=reader.read_dataset: decoded.append(ds.name) or real(ds))
    same = diff(a, b, DiffOptions(jobs=1))
    assert same.outcome == "agree" and decoded == []
    compared = [r for r in same.rows if r.metrics is not None and r.metrics.source == "tensor"]
    assert compared and all(r.metrics == judge.IDENTICAL for r in compared)

    changed = big.copy()
    changed[2_500_000] += 1.0
    c = write_capture(str(tmp_path / "c.h5"), [chain_step({}, 0) + [T("forward", "head", "output", "0", changed,
                                                                     module_class="Linear")]])
    other = diff(a, c, DiffOptions(jobs=1))
    head = next(r for r in other.rows if r.pair.a is not None and r.pair.a.module == "head")
    assert 0 < head.metrics.rel_l2 < 1e-3 and head.metrics.max_abs == pytest.approx(1.0, rel=1e-6)
    assert len(decoded) == 2  # only the head's two tensors were read
