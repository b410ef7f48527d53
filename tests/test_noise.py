"""tensordiff noise: one side's run-to-run noise as per-tensor tolerances for diff."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tensordiff.cli import main

pytest.importorskip("megatron.core")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = [sys.executable, os.path.join(ROOT, "examples", "gpt", "train.py"), "--train-steps", "1"]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    folder = tmp_path_factory.mktemp("noise")
    path = str(folder / "noise.json")
    assert main(["noise", "-o", path, "--steps", "1", "--", *TRAIN]) == 0
    with open(path) as fh:
        return path, json.load(fh), folder


def test_one_ulp_perturbation_measures_rounding_noise(measured):
    _, doc, _ = measured
    assert doc["tensordiff_noise"] == 1 and "one ulp" in doc["how"]
    by_phase = {}
    for phase, _module, _call, _kind, _slot, value in doc["records"]:
        by_phase.setdefault(phase, []).append(value)
    # every weight moved by one FP32 ulp: relative change 2^-24..2^-23 (zeros stay zeros)
    assert 2 ** -25 < max(by_phase["weights"]) < 2 ** -22
    # it grows through the model but stays at rounding level
    assert 1e-8 < max(by_phase["forward"]) < 1e-5
    assert 1e-8 < max(by_phase["param_grad"]) < 1e-5


@pytest.fixture(scope="module")
def gelu_pair(tmp_path_factory):
    """a.h5 (the GPT example) and b.h5 (the same with the tanh GELU), one step each."""
    from examples.gpt import train

    folder = tmp_path_factory.mktemp("gelu")
    a, b = str(folder / "a.h5"), str(folder / "b.h5")
    train.main(["--capture", a, "--train-steps", "1", "--capture-steps", "1"])
    train.main(["--capture", b, "--train-steps", "1", "--capture-steps", "1", "--fault", "gelu-tanh"])
    return a, b


def test_noise_file_sets_tolerances_and_real_faults_still_show(measured, gelu_pair, capsys):
    path, doc, folder = measured
    a, b = gelu_pair
    assert main(["diff", a, a, "--noise-file", path]) == 0
    capsys.readouterr()
    assert main(["diff", a, b, "--noise-file", path, "--first-divergence", "--json", str(folder / "r.json")]) == 1
    with open(folder / "r.json") as fh:
        report = json.load(fh)
    first = report["first_divergence"]
    assert first["module_a"] == "decoder.layers.1.mlp.linear_fc2"
    noise = {(r[1], r[3], r[4]): r[5] for r in doc["records"] if r[0] == "forward"}
    assert first["tolerance"] == pytest.approx(max(1e-5, 3 * noise[("decoder.layers.1.mlp.linear_fc2", "input", "0")]))


def test_two_identical_captures_have_no_noise(gelu_pair, tmp_path):
    a = gelu_pair[0]
    out = str(tmp_path / "n.json")
    assert main(["noise", a, a, "-o", out]) == 0
    with open(out) as fh:
        assert {r[5] for r in json.load(fh)["records"]} == {0.0}


def test_bad_noise_file_is_one_line(tmp_path, capsys):
    bad = tmp_path / "n.json"
    bad.write_text('{"records": 3}')
    cap = tmp_path / "x.h5"
    cap.write_bytes(b"")
    assert main(["diff", str(cap), str(cap), "--noise-file", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(bad) in err and "not a tensordiff noise file" in err
