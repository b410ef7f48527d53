"""The first divergence through the real engine (``tensordiff.diff.diff``) on tiny synthetic captures: the first
row, in execution order, whose error is *introduced* there (more than ``jump`` times what came in), not inherited.

The model, recorded as the capture hooks would record it (module nesting, ``enter``, ``parent``, ``same_as``
links for a tensor seen again, ``grad_of`` for gradients)::

    Net ('')                      x -> block -> y,   loss = mean(y**2) / 2
      Block ('block')             h1 = fc1(x);  a = 2 * h1  (code inside block, no module);  y = fc2(a)
        Linear ('block.fc1')      x @ W1
        Linear ('block.fc2')      a @ W2

B is either the same model with one fault (B's values then follow from it, backward included), or A's values
with an error of a chosen relative size put onto chosen tensors (to set up growth exactly)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from helpers import T, write_capture

from tensordiff.cli import main
from tensordiff.diff import DiffOptions, diff
from tensordiff.errors import UsageError
from tensordiff.explain.place import explanation

RNG = np.random.default_rng(0)
X = RNG.standard_normal((4, 3)).astype(np.float32)
W1 = RNG.standard_normal((3, 5)).astype(np.float32)
W2 = RNG.standard_normal((5, 2)).astype(np.float32)
LR = 0.1


def run_model(x=X, w1=W1, w2=W2, between=2.0, fc2_factor=1.0) -> dict[str, np.ndarray]:
    """Every tensor of one training step (float32), gradients by hand."""
    f32 = np.float32
    h1 = (x @ w1).astype(f32)
    a = (between * h1).astype(f32)
    y = ((a @ w2) * fc2_factor).astype(f32)
    loss = np.array(0.5 * np.mean(y.astype(np.float64) ** 2), dtype=f32)
    dy = (y / y.size).astype(f32)
    da = (fc2_factor * dy @ w2.T).astype(f32)
    dh1 = (between * da).astype(f32)
    return {"W1": w1, "W2": w2, "x": x, "h1": h1, "a": a, "y": y, "loss": loss, "dy": dy, "da": da, "dh1": dh1,
            "dW1": (x.T @ dh1).astype(f32), "dW2": (fc2_factor * a.T @ dy).astype(f32)}


def step_records(v: dict[str, np.ndarray], extra_weight: np.ndarray | None = None) -> list[T]:
    """One step in the recorder's order; a record that is another's tensor again links to it (``same_as``) and,
    as the recorder does, carries the source's has_data."""
    link = {"has_data": 1}
    weights = [T("weights", "block.fc1", "param", "weight", v["W1"], module_class="Linear"),
               T("weights", "block.fc2", "param", "weight", v["W2"], module_class="Linear")]
    if extra_weight is not None:
        weights.append(T("weights", "block", "param", "unused_bias", extra_weight, module_class="Block"))
    n = len(weights)  # seq of the first forward record
    return weights + [
        T("forward", "", "input", "0", v["x"], enter=n, module_class="Net"),                                    # n
        T("forward", "block", "input", "0", v["x"], same_as=n, enter=n + 1, module_class="Block", extra=link),  # n+1
        T("forward", "block.fc1", "input", "0", v["x"], same_as=n, enter=n + 2, parent="block",
          module_class="Linear", extra=link),                                                                    # n+2
        T("forward", "block.fc1", "output", "0", v["h1"], enter=n + 2, parent="block", module_class="Linear"),  # n+3
        T("forward", "block.fc2", "input", "0", v["a"], enter=n + 4, parent="block", module_class="Linear"),    # n+4
        T("forward", "block.fc2", "output", "0", v["y"], enter=n + 4, parent="block", module_class="Linear"),   # n+5
        T("forward", "block", "output", "0", v["y"], same_as=n + 5, enter=n + 1, module_class="Block", extra=link),
        T("forward", "", "output", "0", v["y"], same_as=n + 5, enter=n, module_class="Net", extra=link),
        T("loss", "", "loss", "value", v["loss"], module_class="Loss"),
        T("backward", "block.fc2", "grad_output", "0", v["dy"], grad_of=n + 5, enter=n + 4, parent="block",
          module_class="Linear"),
        T("backward", "block.fc2", "grad_input", "0", v["da"], grad_of=n + 4, enter=n + 4, parent="block",
          module_class="Linear"),
        T("backward", "block.fc1", "grad_output", "0", v["dh1"], grad_of=n + 3, enter=n + 2, parent="block",
          module_class="Linear"),
        T("param_grad", "block.fc1", "grad", "weight", v["dW1"], module_class="Linear"),
        T("param_grad", "block.fc2", "grad", "weight", v["dW2"], module_class="Linear"),
    ]


def off_by(x: np.ndarray, rel: float, seed: int) -> np.ndarray:
    """``x`` plus random noise of relative L2 size ``rel``."""
    u = np.random.default_rng(seed).standard_normal(x.shape)
    return (x + rel * np.linalg.norm(x) * u / np.linalg.norm(u)).astype(x.dtype)


def with_errors(v: dict[str, np.ndarray], **rel: float) -> dict[str, np.ndarray]:
    out = dict(v)
    for i, (name, r) in enumerate(rel.items()):
        out[name] = off_by(v[name], r, seed=10 + i)
    return out


def capture_pair(tmp_path, a_steps: list[list[T]], b_steps: list[list[T]]) -> tuple[str, str]:
    return (write_capture(str(tmp_path / "a.h5"), a_steps), write_capture(str(tmp_path / "b.h5"), b_steps))


def first_of(tmp_path, b_values: dict[str, np.ndarray], options: DiffOptions | None = None):
    a, b = capture_pair(tmp_path, [step_records(run_model())], [step_records(b_values)])
    result = diff(a, b, options)
    return result, result.first


def row(result, phase: str, module: str, kind: str):
    (found,) = [r for r in result.rows if r.phase == phase and r.pair.a is not None and r.pair.a.module == module
                and r.pair.a.kind == kind]
    return found


# --------------------------------------------------------------------------------------------- tests
def test_a_module_whose_inputs_agree_and_output_differs_is_named_as_introducing(tmp_path):
    result, first = first_of(tmp_path, run_model(fc2_factor=1.001))
    assert row(result, "forward", "block.fc2", "input").err == 0.0
    assert (first.step, first.phase, first.module_a, first.module_b, first.kind, first.slot) == \
           (0, "forward", "block.fc2", "block.fc2", "output", "0")
    assert first.introduced is True and first.incoming == 0.0
    assert first.rel_l2 == pytest.approx(1e-3 / 1.001, rel=1e-3) and first.tolerance == 1e-5
    assert first.location == "in block.fc2" and first.where == {"module": "block.fc2"}
    assert "The difference is introduced in block.fc2" in explanation(first)
    assert "The inputs of block.fc2 (Linear) agree and its output does not" in explanation(first)
    # what follows from it also differs, but is not what is named
    assert row(result, "forward", "", "output").verdict == "diverged"
    assert row(result, "backward", "block.fc2", "grad_input").verdict == "diverged"


def test_an_error_that_came_in_with_the_inputs_is_inherited_and_the_introducing_row_is_named(tmp_path):
    # x is off by 6e-6 (within FP32's 1e-5); fc1's output by 1.5e-5: over the tolerance, but less than 3x what
    # came in (inherited); fc2's input likewise; fc2's output by 1e-3, ~70x its input's error: introduced there
    b = with_errors(run_model(), x=6e-6, h1=1.5e-5, a=1.5e-5, y=1e-3)
    result, first = first_of(tmp_path, b)
    fc1_out = row(result, "forward", "block.fc1", "output")
    assert fc1_out.verdict == "diverged" and fc1_out.err < 3 * row(result, "forward", "block.fc1", "input").err
    assert row(result, "forward", "", "input").verdict == "ok"
    assert (first.phase, first.module_a, first.kind, first.introduced) == ("forward", "block.fc2", "output", True)
    assert first.incoming == pytest.approx(1.5e-5, rel=0.05)
    assert first.location == "in block.fc2"


def test_a_bigger_jump_makes_the_same_growth_inherited_and_the_first_exceedance_is_reported(tmp_path):
    b = with_errors(run_model(), x=6e-6, h1=1.5e-5, a=1.5e-5, y=1e-3)
    _, first = first_of(tmp_path, b, DiffOptions(jump=1000.0))  # 1e-3 / 1.5e-5 is under 1000
    assert (first.module_a, first.kind, first.introduced) == ("block.fc1", "output", False)


def test_a_different_model_input_is_named_and_not_the_layers_that_inherit_it(tmp_path):
    result, first = first_of(tmp_path, run_model(x=off_by(X, 1e-3, seed=1)))
    assert row(result, "forward", "block.fc1", "output").verdict == "diverged"
    assert row(result, "forward", "block.fc2", "output").verdict == "diverged"
    assert (first.phase, first.module_a, first.kind, first.slot) == ("forward", "", "input", "0")
    assert first.introduced is True and first.location == "in the model input"
    assert "were not fed the same batch" in explanation(first)


def test_gradual_growth_below_the_jump_is_reported_as_not_introduced(tmp_path):
    # each tensor less than 3x the error of what came into it: no single place introduces it
    b = with_errors(run_model(), x=6e-6, h1=1.5e-5, a=3e-5, y=6e-5)
    result, first = first_of(tmp_path, b)
    assert [r.verdict for r in result.rows if r.phase == "forward" and r.pair.a.kind == "output"] == ["diverged"] * 4
    assert (first.phase, first.module_a, first.kind) == ("forward", "block.fc1", "output")  # the first over tolerance
    assert first.introduced is False
    assert first.incoming == pytest.approx(6e-6, rel=0.05) and first.rel_l2 == pytest.approx(1.5e-5, rel=0.05)
    assert "No single place introduces it" in explanation(first) and "First exceeded in block.fc1" in explanation(first)
    assert "introduced in" not in explanation(first)


def test_growth_from_a_difference_made_out_of_identical_inputs_is_named_where_it_was_made(tmp_path):
    # fc1's output differs by 8e-6 (within FP32's 1e-5) while its input and weights are bitwise identical; it grows
    # to 1.1e-5 (over) at fc2's input, less than 3x: accumulated, but most of it was made at fc1, from nothing
    b = with_errors(run_model(), h1=8e-6, a=1.1e-5, y=1.2e-5)
    result, first = first_of(tmp_path, b)
    assert row(result, "forward", "block.fc1", "output").verdict == "ok"
    assert row(result, "forward", "block.fc2", "input").verdict == "diverged"
    assert (first.phase, first.module_a, first.kind, first.introduced) == ("forward", "block.fc1", "output", True)
    assert first.incoming == 0.0 and first.rel_l2 == pytest.approx(8e-6, rel=0.05)
    assert "made from inputs that are bitwise identical" in explanation(first)
    assert "grows to 1.1e-05 at block.fc2 input.0" in explanation(first)


@pytest.mark.parametrize("errors", [dict(x=1e-7, h1=8e-6, a=1.1e-5, y=1.2e-5),   # what came in was not identical
                                    dict(h1=4e-6, a=1.1e-5, y=1.2e-5)])          # less than half of what exceeds
def test_growth_without_such_an_origin_stays_accumulated(tmp_path, errors):
    _, first = first_of(tmp_path, with_errors(run_model(), **errors))
    assert (first.module_a, first.kind, first.introduced) == ("block.fc2", "input", False)
    assert "No single place introduces it" in explanation(first)


def test_weights_differing_at_step_0_name_the_checkpoint(tmp_path):
    result, first = first_of(tmp_path, run_model(w2=(W2 * 1.01).astype(np.float32)))
    assert row(result, "weights", "block.fc1", "param").verdict == "ok"
    assert (first.step, first.phase, first.module_a, first.kind, first.slot) == (0, "weights", "block.fc2", "param", "weight")
    assert first.introduced is True
    assert first.location == "in block.fc2.weight before the first step (the checkpoint)"
    assert "did not load the same checkpoint" in explanation(first)
    assert first.where == {"module": "block.fc2", "param": "weight"}


def test_an_input_made_by_code_between_modules_is_located_between_the_siblings(tmp_path):
    result, first = first_of(tmp_path, run_model(between=2.002))   # B's `2 * h1` is off by 1e-3
    assert row(result, "forward", "block.fc1", "output").verdict == "ok"
    assert (first.phase, first.module_a, first.kind, first.slot) == ("forward", "block.fc2", "input", "0")
    assert first.introduced is True and first.incoming == 0.0
    assert first.location == "inside block between fc1 and fc2"
    assert first.where == {"module": "block", "between": ["block.fc1", "block.fc2"]}
    assert "made by code inside block that is not a module of its own" in explanation(first)


def test_code_between_the_projections_of_an_attention_block_is_named_its_attention_core(tmp_path):
    """The same code inside a module whose class is an attention (Hugging Face's LlamaAttention computes RoPE, the
    scores, softmax and dropout as code between its q/k/v and output projections): the attention core is named."""
    def records(v):
        return [dataclasses.replace(r, module_class="LlamaAttention") if r.module == "block" else r
                for r in step_records(v)]

    a, b = capture_pair(tmp_path, [records(run_model())], [records(run_model(between=2.002))])
    first = diff(a, b).first
    assert (first.module_a, first.kind) == ("block.fc2", "input")
    assert first.location == "in the attention core of block (between fc1 and fc2)"
    assert first.where == {"module": "block", "between": ["block.fc1", "block.fc2"], "attention_core": True}
    assert "the attention's output" in explanation(first) and "softmax" in explanation(first)


def test_different_optimizer_updates_are_named_after_the_step_with_matching_gradients(tmp_path):
    v0 = run_model()
    w1_a = (W1 - LR * v0["dW1"]).astype(np.float32)
    w1_b = (W1 - 1.5 * LR * v0["dW1"]).astype(np.float32)      # B's learning rate is 1.5x A's for fc1
    a, b = capture_pair(tmp_path, [step_records(v0), step_records(run_model(w1=w1_a))],
                        [step_records(v0), step_records(run_model(w1=w1_b))])
    result = diff(a, b)
    first = result.first
    assert result.steps == [0, 1] and not any(r.verdict == "diverged" for r in result.rows if r.step == 0)
    assert (first.step, first.phase, first.module_a, first.slot, first.introduced) == (1, "weights", "block.fc1", "weight", True)
    assert first.location == "in the optimizer update of block.fc1.weight after step 0"
    assert first.where == {"module": "block.fc1", "param": "weight", "after_step": 0}


def test_weights_that_drift_apart_without_changing_anything_computed_are_drift_not_a_divergence(tmp_path):
    v = run_model()
    bias = np.linspace(-1, 1, 5).astype(np.float32)
    a, b = capture_pair(tmp_path, [step_records(v, bias), step_records(v, bias)],
                        [step_records(v, bias), step_records(v, bias + 1e-3)])
    result = diff(a, b)
    (drifted,) = [r for r in result.rows if r.verdict not in ("ok",)]
    assert (drifted.step, drifted.pair.a.slot, drifted.verdict) == (1, "unused_bias", "drift")
    assert drifted.note == "differs, but nothing computed in this step differs"
    assert result.first is None


def test_a_clean_pair_has_no_first_divergence_and_exits_0(tmp_path, capsys):
    v = run_model()
    a, b = capture_pair(tmp_path, [step_records(v)], [step_records(v)])
    result = diff(a, b)
    assert result.first is None and result.steps == [0]
    assert {r.verdict for r in result.rows} == {"ok"} and len(result.rows) == 16
    assert all(r.metrics.rel_l2 == 0.0 for r in result.rows)
    assert main(["diff", a, b, "--no-hints"]) == 0
    faulty = write_capture(str(tmp_path / "c.h5"), [step_records(run_model(fc2_factor=1.001))])
    assert main(["diff", a, faulty, "--no-hints", "--first-divergence"]) == 1
    assert main(["diff", a, str(tmp_path / "missing.h5"), "--no-hints"]) == 2
    out = capsys.readouterr()
    assert "missing.h5: no such file" in out.err


def test_a_jump_of_one_or_less_is_refused():
    with pytest.raises(UsageError, match="jump=1"):
        DiffOptions(jump=1)


def test_the_package_is_called_as_the_guide_writes_it(tmp_path):
    """``tensordiff.diff('a.h5', 'b.h5')``, as ``tensordiff.capture(...)`` is called: the same result as
    ``tensordiff.diff.diff``."""
    import tensordiff

    a, b = capture_pair(tmp_path, [step_records(run_model())], [step_records(run_model(fc2_factor=1.001))])
    called = tensordiff.diff(a, b)
    assert (called.first.module_a, called.first.kind) == ("block.fc2", "output")
    assert called.exit_code == diff(a, b).exit_code == 1


def test_every_case_the_locator_names_has_its_sentence_in_explain():
    """``_locate``'s cases (read from its source) and ``explain.place.CAUSES`` are the same set: a new case without
    a sentence, or a sentence no case reaches, fails here."""
    import ast
    import inspect

    from tensordiff.diff import divergence
    from tensordiff.explain.place import CAUSES

    tree = ast.parse(inspect.getsource(divergence._locate))
    cases = {node.value.elts[1].value for node in ast.walk(tree)
             if isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple)
             and isinstance(node.value.elts[1], ast.Constant)}
    assert cases - {""} == set(CAUSES)
    assert {"module", "checkpoint", "attention_core", "loss_grad"} <= cases  # the scan read the returns


def test_the_json_report_and_the_diagnosis_carry_the_sentence_the_panel_shows(tmp_path, capsys):
    import json

    from tensordiff.explain import diagnose

    a, b = capture_pair(tmp_path, [step_records(run_model())], [step_records(run_model(fc2_factor=1.001))])
    report = tmp_path / "r.json"
    assert main(["diff", a, b, "--json", str(report), "--no-hints"]) == 1
    first = json.loads(report.read_text())["first_divergence"]
    said = diagnose(a, b, hints=False)
    assert first["explanation"] == said.explanation == explanation(said.first)
    assert first["explanation"].startswith("Step 0, forward: block.fc2 output.0 differs from B's block.fc2 output.0")
    assert list(first)[list(first).index("location") + 1] == "explanation"
    assert "block.fc2 (Linear)" in capsys.readouterr().out
