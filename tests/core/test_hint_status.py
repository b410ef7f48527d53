"""Whether each cause could be tested at the first divergence: a check with nothing to test on says why, in the
``Diagnosis``, the report and the JSON (synthetic captures; numpy, h5py and rich only)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import T, render, write_capture

from tensordiff.explain import diagnose
from tensordiff.explain.hints import CHECKED, CHECKS, DIFF, DIFF_IF_GIVEN, PP_STAGES, SITE, TP_RANKS
from tensordiff.report.diff import DiffReport


def _pair(tmp_path, b_out: np.ndarray, x: np.ndarray, a_out: np.ndarray):
    def steps(out):
        return [[T("forward", "m", "input", "0", x, module_class="Tanh"),
                 T("forward", "m", "output", "0", out, module_class="Tanh", enter=0)]]
    return (write_capture(str(tmp_path / "a.h5"), steps(a_out)),
            write_capture(str(tmp_path / "b.h5"), steps(b_out), framework="mindspore"))


def test_no_check_can_run_on_nan(tmp_path):
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    b = np.tanh(x)
    b[1, 2] = np.nan
    res = diagnose(*_pair(tmp_path, b, x, np.tanh(x)))
    assert res.first is not None and res.first.module_a == "m"
    assert res.hints == [] and res.checked == ()
    assert [c.cause for c in res.checks] == list(CHECKED)
    assert {c.reason for c in res.checks} == {"NaN or Inf in A or B"}
    text = render(DiffReport(res, first_only=True))
    assert text.rstrip().endswith("No cause could be tested here: NaN or Inf in A or B.")
    assert "No known cause" not in text
    report = DiffReport(res).to_dict()
    assert report["checks"][0] == {"cause": "activation", "ran": False, "reason": "NaN or Inf in A or B"}


def test_the_table_of_checks_names_each_cause_once_with_its_own_rank():
    """``CHECKS``: the order reports name the causes in; its ranks, the order they run in (a tie in the share
    explained goes to the earlier: the more specific cause)."""
    causes = [c.cause for c in CHECKS]
    assert len(set(causes)) == len(causes) and sorted(c.rank for c in CHECKS) == list(range(len(CHECKS)))
    assert {c.needs for c in CHECKS} <= {SITE, DIFF, DIFF_IF_GIVEN, TP_RANKS, PP_STAGES}
    assert [c.cause for c in sorted(CHECKS, key=lambda c: c.rank)] == [
        "vocabulary padding", "pipeline stages", "dropout", "RoPE", "attention scale", "activation", "norm epsilon",
        "dtype", "layout", "bias", "loss normalisation", "aux loss", "tied embeddings", "router normalisation",
        "constant factor", "partial sum", "checkpoint", "optimizer step"]
    assert "partial sum" not in CHECKED and "pipeline stages" not in CHECKED  # named only with a merged side


def test_no_first_divergence_no_checks(tmp_path):
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    res = diagnose(*_pair(tmp_path, np.tanh(x), x, np.tanh(x)))
    assert res.first is None and res.checks == [] and res.checked == ()
    assert DiffReport(res).to_dict()["checks"] == []


def test_hints_off_no_checks(tmp_path):
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    res = diagnose(*_pair(tmp_path, np.tanh(x) * 1.5, x, np.tanh(x)), hints=False)
    assert res.first is not None and res.checks == [] and res.checked == ()
    assert "No known cause" not in render(DiffReport(res))


def test_partial_hint_names_what_was_not_tested(tmp_path):
    """A hint that explains part of the gap only (here B = 1.5 × A plus noise) is followed by the causes that
    could not be tested."""
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    a = np.tanh(x)
    b = (1.5 * a + 0.1 * np.cos(np.arange(12) ** 2).reshape(3, 4)).astype(np.float32)
    res = diagnose(*_pair(tmp_path, b, x, a))
    assert res.hints and res.hints[0].cause == "factor" and res.hints[0].explained < 0.9
    text = " ".join(render(DiffReport(res, first_only=True)).split())
    assert ("Not tested here: RoPE (needs q/k (4-D) or an attention output (3-D), this one is 2-D); attention scale "
            "(not an attention output (a 3-D forward tensor) or the scores a softmax module takes); "
            "bias (the module has no bias); tied embeddings (not a parameter gradient of a matrix (forward)); router "
            "normalisation (not a block's 3-D forward output); checkpoint (no weights compared at step 0).") in text


def test_rows_that_differ_from_some_row_on_are_no_padded_vocabulary_outside_a_vocabulary_dimension(tmp_path):
    """A fused QKV weight whose last rank's k and v rows are swapped (rows 96..127 of 128 differ): the padded
    vocabulary hint needs a vocabulary dimension (the word embeddings have 256 rows), so it does not fire; the
    layout hint names the rows moved."""
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((256, 32)).astype(np.float32)
    qkv = rng.standard_normal((128, 32)).astype(np.float32)
    moved = qkv.copy()
    moved[96:112], moved[112:128] = qkv[112:128], qkv[96:112]

    def steps(w):
        return [[T("weights", "embedding.word_embeddings", "param", "weight", emb, module_class="VocabParallelEmbedding"),
                 T("weights", "decoder.layers.0.self_attention.linear_qkv", "param", "weight", w,
                   module_class="ColumnParallelLinear")]]

    a = write_capture(str(tmp_path / "a.h5"), steps(qkv))
    b = write_capture(str(tmp_path / "b.h5"), steps(moved), framework="mindspore")
    res = diagnose(a, b)
    assert res.first.module_a == "decoder.layers.0.self_attention.linear_qkv"
    assert "vocab-padding" not in [h.cause for h in res.hints]
    assert res.hints[0].cause == "layout" and "B 96-111 = A 112-127" in res.hints[0].title


def test_a_bias_not_loaded_is_the_checkpoint_cause_with_its_zeros_named_not_a_zero_factor(tmp_path):
    """B's q/k/v bias is all zeros at the first step (not loaded): one cause, the checkpoint, saying so; no
    "B = 0 × A" factor tied with it."""
    rng = np.random.default_rng(1)
    bias = rng.standard_normal(48).astype(np.float32)

    def steps(b):
        return [[T("weights", "decoder.layers.0.self_attention.linear_qkv", "param", "bias", b,
                   module_class="ColumnParallelLinear")]]

    a = write_capture(str(tmp_path / "a.h5"), steps(bias))
    b = write_capture(str(tmp_path / "b.h5"), steps(np.zeros_like(bias)), framework="mindspore")
    res = diagnose(a, b)
    assert [h.cause for h in res.hints] == ["checkpoint"]
    assert "linear_qkv.bias is all zeros: not loaded" in res.hints[0].title


def _one_stack(path, weight: T, x: np.ndarray, module: str, cls: str, out: np.ndarray) -> str:
    """A capture of one bitwise reproducible stack: ``weight`` (its dtype is the run's), two modules passing ``x``
    through that agree bitwise on both sides (what shows the program reproducible), then ``module`` on ``x``."""
    steps = [[weight,
              T("forward", "pre", "input", "0", x, module_class="Identity"),
              T("forward", "pre", "output", "0", x, module_class="Identity", enter=1),
              T("forward", "norm", "input", "0", x, module_class="Identity"),
              T("forward", "norm", "output", "0", x, module_class="Identity", enter=3),
              T("forward", module, "input", "0", x, module_class=cls),
              T("forward", module, "output", "0", out, module_class=cls, enter=5)]]
    return write_capture(str(path), steps, device="cpu", framework_version="2.13.0")


def test_a_linear_computed_in_float64_on_one_side_is_a_dtype_cause(tmp_path):
    """B computes one linear layer in float64 and stores float32: its output is the exact product rounded once, A's
    carries float32 accumulation. The difference is far inside FP32's tolerance; same-stack exactness finds it, and
    the dtype hint names the wider compute (in either argument order)."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((64, 512)).astype(np.float32)
    w = rng.standard_normal((96, 512)).astype(np.float32)
    fp32 = x @ w.T
    wide = (x.astype(np.float64) @ w.T.astype(np.float64)).astype(np.float32)
    assert not np.array_equal(fp32, wide)

    weight = T("weights", "fc", "param", "weight", w, module_class="Linear")
    a = _one_stack(tmp_path / "a.h5", weight, x, "fc", "Linear", fp32)
    b = _one_stack(tmp_path / "b.h5", weight, x, "fc", "Linear", wide)
    for first, second, side in ((a, b, "B"), (b, a, "A")):
        res = diagnose(first, second)
        assert res.first is not None and res.first.module_a == "fc" and res.first.rel_l2 < res.first.tolerance
        top = res.hints[0]
        assert top.cause == "dtype" and top.details["dtype"] == "float64" and top.details["side"] == side, top


def test_gelu_tanh_below_one_bf16_rounding_is_told_by_the_shape_of_the_difference(tmp_path):
    """BF16 GELU, tanh form on B, erf on A: per element they differ by less than one BF16 rounding (2e-4 against
    2^-8), so no rebuild tells them apart by size; same-stack exactness finds the place, and the activation hint
    tells the two functions by the elements each gives exactly once rounded to BF16."""
    from math import erf

    ml_dtypes = pytest.importorskip("ml_dtypes")  # BF16 arrays (the core environment has none)
    bf16 = ml_dtypes.bfloat16
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((256, 512)) * 1.5).astype(bf16).astype(np.float64)
    erf_v = np.vectorize(erf)
    gelu_erf = 0.5 * x * (1.0 + erf_v(x / np.sqrt(2.0)))
    gelu_tanh = 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))
    a_out, b_out, x = gelu_erf.astype(bf16), gelu_tanh.astype(bf16), x.astype(bf16)

    weight = T("weights", "norm", "param", "weight", np.ones(512, dtype=bf16), module_class="Identity")
    a = _one_stack(tmp_path / "a.h5", weight, x, "act", "GELU", a_out)
    b = _one_stack(tmp_path / "b.h5", weight, x, "act", "GELU", b_out)
    res = diagnose(a, b)
    assert res.first is not None and res.first.module_a == "act" and res.first.rel_l2 < res.first.tolerance
    top = res.hints[0]
    assert top.cause == "activation" and top.details["rounded"] and top.explained > 0.9, top
    assert (top.details["a"], top.details["b"]) == ("gelu (erf, exact)", "gelu (tanh approximation)")
