"""Same-stack exactness (``tensordiff.diff.exactness``): on one bitwise reproducible stack, a module whose inputs and
weights are bitwise identical and whose output is not is a divergence, whatever its size; across stacks, or where
one side visibly runs other steps inside the module, tolerances judge.

Synthetic captures of a chain of three linear modules, ``fc0 -> fc1 -> fc2``; B's fc1 output is off by 1e-9
relative (far inside the FP32 tolerance of 1e-5).
"""

from __future__ import annotations

import numpy as np
from helpers import T, write_capture

from tensordiff.diff import DiffOptions, diff
from tensordiff.explain.place import explanation

RNG = np.random.default_rng(3)
X = RNG.standard_normal((4, 8)).astype(np.float32)
WS = [RNG.standard_normal((8, 8)).astype(np.float32) for _ in range(3)]
STACK = {"device": "cpu", "framework_version": "2.13.0"}
LINK = {"has_data": 1}


def chain(nudge: float = 0.0, extra_inside: bool = False) -> list[T]:
    recs = [T("weights", f"fc{i}", "param", "weight", w, module_class="Linear") for i, w in enumerate(WS)]
    h, prev = X, -1
    for i, w in enumerate(WS):
        seq = len(recs)
        recs.append(T("forward", f"fc{i}", "input", "0", h, module_class="Linear", same_as=prev,
                      extra=LINK if prev >= 0 else {}))
        if extra_inside and i == 1:
            recs.append(T("forward", "fc1.act", "output", "0", np.tanh(h), module_class="Tanh", parent="fc1"))
        h = (h @ w).astype(np.float32)
        if i == 1 and nudge:
            h = (h * np.float32(1 + nudge)).astype(np.float32)
        prev = len(recs)
        recs.append(T("forward", f"fc{i}", "output", "0", h, module_class="Linear", enter=seq))
    return recs


def run(tmp_path, b_recs, options=None, attrs_b=STACK, a_recs=None):
    pa = write_capture(str(tmp_path / "a.h5"), [a_recs or chain()], **STACK)
    pb = write_capture(str(tmp_path / "b.h5"), [b_recs], **attrs_b)
    return diff(pa, pb, options or DiffOptions())


def test_a_difference_below_tolerance_with_bitwise_identical_inputs_is_a_divergence(tmp_path):
    nudge = 2e-7
    res = run(tmp_path, chain(nudge))
    first = res.first
    assert res.outcome == "diverged" and (first.module_a, first.kind) == ("fc1", "output")
    assert first.rel_l2 < first.tolerance and "same-stack exactness" in explanation(first)
    row = next(r for r in res.rows if r.pair.a is not None and r.pair.a.label == "fc1 output.0")
    assert row.exact and row.verdict == "diverged"
    assert "bitwise identical" in res.exact
    assert first.introduced and "The difference is introduced in fc1" in explanation(first)


def test_no_exact_judges_by_tolerance_only(tmp_path):
    res = run(tmp_path, chain(2e-7), DiffOptions(exact=False))
    assert res.outcome == "agree" and res.exact == ""


def test_another_stack_is_judged_by_tolerance(tmp_path):
    res = run(tmp_path, chain(2e-7), attrs_b={"device": "cuda NVIDIA H200", "framework_version": "2.13.0"})
    assert res.outcome == "agree" and res.exact == ""


def test_another_implementation_inside_the_module_is_judged_by_tolerance(tmp_path):
    """B runs a recorded step inside fc1 that A does not: another implementation, rounding may differ."""
    res = run(tmp_path, chain(2e-7, extra_inside=True))
    assert res.first is None and not any(r.exact for r in res.rows)


def test_a_program_that_is_not_bitwise_reproducible_is_judged_by_tolerance(tmp_path):
    """The first forward pairs already differ by rounding: nothing shows the program bitwise reproducible."""
    noisy = chain()
    noisy[3] = T("forward", "fc0", "input", "0", X * np.float32(1 + 1e-7), module_class="Linear")
    res = run(tmp_path, chain(2e-7), a_recs=noisy)
    assert not any(r.exact for r in res.rows) and res.exact == ""
