"""Three-way diff: B judged by its error against an FP32 reference, next to A's own error against it."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from examples.megatron_vs_mindformers import megatron_side
from tensordiff.batch import make, save
from tensordiff.cli import main
from tensordiff.diff import DiffOptions, diff
from tensordiff.explain.place import explanation


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("reference")
    batch = str(folder / "batch.h5")
    save(batch, make(128, 16, 2, seed=0))
    out = {}
    for name, extra in (("fp32", []), ("bf16", ["--bf16"]), ("bf16-eps", ["--bf16", "--fault", "norm-eps"])):
        out[name] = str(folder / f"{name}.h5")
        megatron_side.main(["--family", "llama", "--batch", batch, "--capture", out[name], "--train-steps", "1",
                            "--capture-steps", "1", *extra])
    return out


def test_a_moderate_fault_in_bf16_is_placed_only_with_the_reference(runs):
    """RMSNorm epsilon 3e-4 instead of 1e-6 in one BF16 run: judged by tolerance against the other BF16 run the error
    hides in BF16 noise (found late, or nowhere); against the FP32 reference it stands out where it is made. On one
    bitwise reproducible stack (both BF16 runs on this CPU) same-stack exactness places it without a reference."""
    plain = diff(runs["bf16"], runs["bf16-eps"], DiffOptions(exact=False))
    assert plain.first is None or plain.first.module_a != "module.decoder.layers.1.pre_mlp_layernorm"
    exact = diff(runs["bf16"], runs["bf16-eps"])
    assert (exact.first.phase, exact.first.module_a, exact.first.kind) == (
        "forward", "module.decoder.layers.1.pre_mlp_layernorm", "output")
    assert "bfloat16" in exact.exact and "same-stack exactness" in explanation(exact.first)
    three = diff(runs["bf16"], runs["bf16-eps"], DiffOptions(reference=runs["fp32"]))
    first = three.first
    assert (first.phase, first.module_a, first.kind) == ("forward", "module.decoder.layers.1.pre_mlp_layernorm", "output")
    assert first.introduced
    row = next(r for r in three.rows if r.pair.a is not None and r.pair.a.label == first.label_a and r.phase == "forward")
    assert row.ref_a < 0.01 < row.err  # A's own BF16 error vs B's error, both against FP32
    assert row.tol == pytest.approx(3 * row.ref_a)


def test_the_side_that_is_off_is_named(runs, capsys):
    # A = BF16, B = FP32 = the reference: nothing to blame on B, and A is the side further from the reference
    three = diff(runs["bf16"], runs["fp32"], DiffOptions(reference=runs["fp32"]))
    assert three.first is None
    notes = [r for r in three.rows if "A is further from the reference than B" in r.note]
    assert len(notes) > 50
    assert main(["diff", runs["bf16"], runs["bf16-eps"], "--reference", runs["fp32"], "--first-divergence",
                 "--width", "100"]) == 1
    out = capsys.readouterr().out
    assert "A↔R" in out and "B↔R" in out and "away from the reference" in out


def test_a_step_not_captured_is_one_line(runs, tmp_path, capsys):
    assert main(["diff", runs["bf16"], runs["bf16-eps"], "--reference", runs["fp32"], "--step", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("tensordiff: error:")
