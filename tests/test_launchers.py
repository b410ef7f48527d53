"""Megatron and MindFormers, each captured through its launcher, from one checkpoint and one batch
(examples/launchers/run.py, ``make launchers``): a megatron-core loop with the schedule, DDP and the distributed
optimizer under ``tensordiff capture --megatron`` (TP=1, and TP=2 under torchrun), and the MindFormers 1.9 Trainer
from its YAML under ``tensordiff capture --mindformers`` (PyNative and GRAPH_MODE). Clean: agree, every record
compared or accounted for. A mistake in the YAML: found where it is made, with its cause ranked first."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

for _name in ("megatron", "mindspore", "mindformers"):  # find, do not import (MindFormers writes ./output/log)
    if importlib.util.find_spec(_name) is None:
        pytest.skip(f"{_name} is not installed", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = os.path.join(ROOT, "examples", "launchers", "run.py")


def _run(tmp_path, *args, out=None):
    out = out or tmp_path / "out"
    proc = subprocess.run([sys.executable, RUN, "--out", str(out), *args], capture_output=True, text=True,
                          timeout=900, cwd=tmp_path)
    report = out / "report.json"
    assert report.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(report) as f:
        return proc.returncode, json.load(f), proc.stdout, out


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """The clean TP=1 PyNative pair (the fault tests reuse its batch, checkpoint and Megatron capture)."""
    return _run(tmp_path_factory.mktemp("launchers"))


def _reused(tmp_path, clean, *args):
    """run.py on a copy of the clean run's folder with --reuse: only the MindFormers side and the diff run again."""
    out = tmp_path / "out"
    shutil.copytree(clean[3], out, ignore=shutil.ignore_patterns("output", "mindformers.h5*", "report.json"))
    result = _run(tmp_path, *args, "--reuse", out=out)
    assert "--reuse: batch.h5, batch.mindrecord, init.ckpt, megatron.h5 kept" in result[2]
    return result


@pytest.mark.parametrize("args", [(), ("--graph",), ("--tp", "2", "--mf-dp", "2")],
                         ids=["tp1-pynative", "tp1-graph", "tp2-msrun-dp2"])
def test_clean_pair_agrees(tmp_path, clean, args):
    code, report, stdout, out = clean if not args else \
        _reused(tmp_path, clean, *args) if args == ("--graph",) else _run(tmp_path, *args)
    assert code == 0, stdout[-3000:]
    assert report["outcome"] == "agree" and report["inconclusive_reasons"] == [] and report["first_divergence"] is None
    assert report["mapping_note"].startswith("mcore-mindformers-llama (heads=4, groups=2), picked from the captures")
    s = report["summary"]
    # graph mode records no gradients of cell inputs: fewer pairs there
    assert s["diverged"] == 0 and s["only_a"] == 0 and s["only_b"] == 0 and s["ok"] >= 160
    compared = {(r["step"], r["phase"], r["module_a"].removeprefix("module.")) for r in report["rows"]
                if r["verdict"] == "ok"}
    for step in (0, 1):  # both iterations; the parameter gradients before clipping on both sides (clipping is on)
        for phase in ("weights", "forward", "param_grad"):
            assert (step, phase, "decoder.layers.1.self_attention.linear_qkv") in compared, (step, phase)
        assert any(k[:2] == (step, "loss") for k in compared)
    # each side went through its launcher: Megatron's iterations, the Trainer's steps, their logged scalars
    from tensordiff.store import open_capture

    tp2 = "--tp" in args
    megatron = "megatron.rank*.h5" if tp2 else "megatron.h5"
    mindformers = "mindformers.rank*.h5" if "--mf-dp" in args else "mindformers.h5"
    if not args:
        assert "--megatron recorded 2 training step(s) of DistributedDataParallel" in stdout
        # the commands paste as printed: run in the output folder, the repository's files by their full paths
        assert f"$ cd {out}\n" in stdout
        assert f"$ tensordiff capture --megatron -o megatron.h5 --steps 2 -- {sys.executable} {ROOT}/examples/" in stdout
    if "--mf-dp" not in args:  # under msrun the Trainer's log goes to msrun_logs/
        assert stdout.count("{ Epoch:") == 3
    with open_capture(str(out / megatron)) as a, open_capture(str(out / mindformers)) as b:
        assert [a.step_attrs(s)["iteration"] for s in a.steps] == [1, 2]
        assert [b.step_attrs(s)["iteration"] for s in b.steps] == [1, 2]
        assert b.attrs["param_grad_at"].startswith("before clipping")
        la, lb = a.scalars()["loss"], b.scalars()["loss"]
        assert sorted(la) == sorted(lb) == [0, 1, 2]
        if "--mf-dp" not in args:  # (under msrun each rank logs its own local loss)
            assert all(abs(la[i] - lb[i]) < 1e-5 for i in range(3))
        assert all(abs(a.scalars()["grad_norm"][i] - b.scalars()["grad_norm"][i]) < 1e-4 for i in range(3))


@pytest.mark.parametrize("fault, module_a, module_b, cause", [
    ("norm-eps", "decoder.layers.0.input_layernorm", "model.layers.0.attention_norm", "norm-epsilon"),
    ("rope-base", "decoder.layers.0.self_attention.linear_proj", "model.layers.0.attention.wo", "rope"),
])
def test_a_mistake_in_the_yaml_is_found_where_it_is(tmp_path, clean, fault, module_a, module_b, cause):
    code, report, stdout, _ = _reused(tmp_path, clean, "--fault", fault)
    assert code == 1, stdout[-3000:]
    first = report["first_divergence"]
    assert (first["step"], first["phase"]) == (0, "forward")
    assert first["module_a"] == "module." + module_a and first["module_b"] == module_b
    assert report["hints"][0]["cause"] == cause
