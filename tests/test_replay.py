"""tensordiff replay: one module of side A's code on B's captured inputs, torch and MindSpore."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")

from examples.gpt import train
from tensordiff.cli import main
from tensordiff.explain.replay import load_factory, replay

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def gelu(tmp_path_factory):
    folder = tmp_path_factory.mktemp("replay")
    a, b = str(folder / "a.h5"), str(folder / "b.h5")
    train.main(["--capture", a, "--train-steps", "1", "--capture-steps", "1"])
    train.main(["--capture", b, "--train-steps", "1", "--capture-steps", "1", "--fault", "gelu-tanh"])
    return a, b


def test_introduced_where_the_fault_is(gelu):
    res = replay(*gelu, "decoder.layers.1.mlp", load_factory("examples.gpt.models:replay_model"))
    assert res.verdict == "introduced"
    assert res.replay_a == 0.0  # the replay reproduces A bit for bit
    assert res.replay_b_vs_a == 0.0  # same inputs on both sides: A's code gives A's answer
    assert res.replay_b == pytest.approx(res.ab)


def test_inherited_downstream_of_the_fault(gelu, capsys):
    assert main(["replay", *gelu, "--module", "decoder.final_layernorm", "--model", "examples.gpt.models:replay_model"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "came in with the inputs" in out


def test_bad_replay_requests_are_one_line(gelu, capsys):
    assert main(["replay", *gelu, "--module", "decoder.layers.9", "--model", "examples.gpt.models:replay_model"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no forward call 0 of module 'decoder.layers.9'" in err
    assert main(["replay", *gelu, "--module", "decoder.layers.1.mlp", "--model", "no_such_module:f"]) == 2
    assert "cannot import no_such_module" in capsys.readouterr().err
    # a function, but not one that builds a model from nothing
    assert main(["replay", *gelu, "--module", "decoder.layers.1.mlp", "--model", "json:loads"]) == 2
    assert capsys.readouterr().err == ("tensordiff: error: --model: calling the factory failed (TypeError: loads() "
                                       "missing 1 required positional argument: 's'); it must be a function that takes "
                                       "no arguments and returns side A's model\n")


def test_a_model_without_the_module_is_one_line_not_a_traceback(gelu, capsys, tmp_path, monkeypatch):
    (tmp_path / "other_model.py").write_text("import torch\n\ndef build():\n    return torch.nn.Sequential(torch.nn.Linear(2, "
                                             "2))\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["replay", *gelu, "--module", "decoder.layers.1.mlp", "--model", "other_model:build"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("tensordiff: error: --module decoder.layers.1.mlp: calling it in the model built by the factory "
                          "failed (AttributeError")


@pytest.mark.skipif(importlib.util.find_spec("mindspore") is None, reason="needs MindSpore")
def test_megatron_code_on_mindspore_inputs_and_mindspore_replay(tmp_path):
    out = tmp_path / "run"
    subprocess.run([sys.executable, os.path.join(ROOT, "examples/megatron_vs_mindformers/run.py"), "--family", "gpt2",
                    "--fault", "gelu-approx", "--out", str(out)], capture_output=True, text=True, timeout=600)
    a, b = str(out / "megatron.h5"), str(out / "mindspore.h5")
    mapping = os.path.join(ROOT, "examples/megatron_vs_mindformers/ms_gpt_pair.yaml")
    report = str(tmp_path / "r.json")
    env = dict(os.environ, PYTHONPATH=ROOT)
    # megatron-core's layer 0 on the inputs MindSpore's layer 0 received: the GELU difference is made inside it
    proc = subprocess.run([sys.executable, "-m", "tensordiff", "replay", a, b, "--module", "decoder.layers.0", "--mapping",
                           mapping, "--model", "examples.megatron_vs_mindformers.megatron_side:gpt2_model", "--json",
                           report], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    with open(report) as fh:
        res = json.load(fh)
    assert res["verdict"] == "introduced" and res["replay_a"] < 1e-6
    # MindSpore's own cell replayed on its own inputs: faithful, nothing introduced
    cmd = [sys.executable, "-m", "tensordiff", "replay", b, b, "--module", "decoder.layers.0.mlp", "--json", report]
    proc = subprocess.run(cmd + ["--model", "examples.megatron_vs_mindformers.ms_gpt:replay_model_gelu_approx"],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open(report) as fh:
        res = json.load(fh)
    assert res["verdict"] == "inherited" and res["replay_a"] == 0.0 and res["module_class"] == "MLP"
    # a factory that builds another model than the run (erf GELU) is caught, not trusted
    proc = subprocess.run(cmd + ["--model", "examples.megatron_vs_mindformers.ms_gpt:replay_model"],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 2 and "does not reproduce A's own output" in proc.stdout
