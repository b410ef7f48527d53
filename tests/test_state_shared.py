"""Shared state across frameworks: Megatron's state at iteration J, converted, resumed by the MindFormers Trainer.

The megatron-core loop (examples/megatron_loop/train.py, as examples/launchers/run.py sets it up: the tiny Llama, one
batch, its own init) trains 4 iterations and saves at 4 (torch_dist). ``convert_state`` writes that state (weights,
Adam moments, step) as a MindFormers legacy folder; the Trainer resumes from it for iterations 5..6 while the loop
resumes from its own checkpoint; both are captured (--tensors all) and ``tensordiff diff`` must agree. With the moments
zeroed the weights after iteration 5's update part, and the optimizer-step hint says so.

Real frameworks, one set of runs for the module (the three resumed runs in parallel): about a minute here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import yaml

pytest.importorskip("megatron.core")
pytest.importorskip("mindformers")

from tensordiff.ckpt import files, megatron_dir, mindformers_dir
from tensordiff.ckpt.state import check_hyper, convert_state, epoch_of, legacy_name
from tensordiff.ckpt.table import ConversionTable
from tensordiff.cli import main as cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "examples", "megatron_loop", "train.py")
RUN_MF = os.path.join(ROOT, "examples", "launchers", "run_mindformer.py")
YAML = os.path.join(ROOT, "examples", "launchers", "llama_tiny.yaml")
MAPPING, VARS = "mcore-mindformers-llama", {"heads": "4", "groups": "2"}
J, TOTAL = 4, 6


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _run(cmd: list[str], cwd: str) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-5000:]
    return proc.stdout


def _resume_yaml(folder: str, state: str, file: str, save: bool) -> str:
    """llama_tiny.yaml resuming from the converted folder (the notes' recipe), stopping after TOTAL."""
    with open(YAML, encoding="utf-8") as fh:
        c = yaml.safe_load(fh)
    c.update(load_checkpoint=state, resume_training=os.path.basename(file), load_ckpt_format="ckpt",
             output_dir=os.path.join(folder, "output"))
    c["runner_config"].update(epochs=TOTAL, stop_step=TOTAL)
    if save:  # the Trainer's own save of step 6: what it writes after resuming from the converted state
        c["callbacks"].append({"type": "CheckpointMonitor", "prefix": "resumed", "save_checkpoint_steps": 2,
                               "keep_checkpoint_max": 5})
    path = os.path.join(folder, "resume.yaml")
    with open(path, "w", encoding="utf-8") as fh:
        yaml.safe_dump(c, fh, sort_keys=False)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("state_shared"))
    py = sys.executable
    _run([py, "-m", "tensordiff", "batch", "-o", "batch.h5", "--vocab", "128", "--seq", "16", "--batch", "2", "--seed",
          "0", "--mindrecord", "batch.mindrecord"], base)
    train = [py, TRAIN, "--data", "batch.h5", "--batch", "2", "--steps", str(TOTAL)]
    _run(train + ["--save", "ckpt_a", "--save-interval", str(J), "--exit-interval", str(J)], base)
    state = convert_state(os.path.join(base, "ckpt_a"), J, os.path.join(base, "shared_state"), MAPPING, VARS,
                          prefix="shared", config=YAML)
    # the negative: the same state with Adam's moments zeroed (what resuming with a fresh optimizer would give B)
    zeroed = os.path.join(base, "zeroed_state")
    shutil.copytree(os.path.join(base, "shared_state"), zeroed)
    zfile = os.path.join(zeroed, "rank_0", os.path.basename(state.file))
    os.chmod(zfile, 0o600)
    tensors, _ = files.load_with_skipped(zfile)
    files.save({k: np.zeros_like(v) if k.startswith("adam_") else v for k, v in tensors.items()}, zfile)
    jobs = {
        "megatron": ([py, "-m", "tensordiff", "capture", "--megatron", "-o", "megatron.h5", "--steps", "2", "--tensors",
                      "all", "--"] + train + ["--load", "ckpt_a", "--ckpt-step", str(J), "--save", "ckpt_resumed",
                                              "--save-interval", str(TOTAL)], base),
    }
    for name, folder_state, save in (("mindformers", state.dst, True), ("zeroed", zeroed, False)):
        folder = os.path.join(base, name)
        os.makedirs(folder)
        for f in ("batch.mindrecord", "batch.mindrecord.db"):
            shutil.copy(os.path.join(base, f), folder)
        config = _resume_yaml(folder, folder_state, state.file, save)
        jobs[name] = ([py, "-m", "tensordiff", "capture", "--mindformers", "-o", os.path.join(base, f"{name}.h5"),
                       "--steps", "2", "--tensors", "all", "--", py, RUN_MF, "--config", config], folder)
    procs = {n: subprocess.Popen(cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for n, (cmd, cwd) in jobs.items()}
    logs = {}
    for name, proc in procs.items():
        logs[name] = proc.communicate(timeout=600)[0]
        assert proc.returncode == 0, f"{name}:\n{logs[name][-5000:]}"
    return {"base": base, "state": state, "logs": logs}


def _diff(runs, b: str, capsys) -> tuple[int, dict]:
    base = runs["base"]
    report = os.path.join(base, f"diff_{b}.json")
    code = cli(["diff", os.path.join(base, "megatron.h5"), os.path.join(base, f"{b}.h5"), "--first-divergence",
                "--json", report, "--no-color"])
    said = capsys.readouterr()
    assert os.path.exists(report), f"diff exited {code} without its report:\n{said.out[-3000:]}\n{said.err[-3000:]}"
    with open(report, encoding="utf-8") as fh:
        return code, json.load(fh)


def test_the_trainer_resumed_from_the_converted_state_agrees_step_for_step(runs, capsys):
    code, doc = _diff(runs, "mindformers", capsys)
    assert code == 0 and doc["first_divergence"] is None
    # MindFormers' own log (its start-up INFO lines are not on stdout under tensordiff capture)
    with open(os.path.join(runs["base"], "mindformers", "output", "log", "rank_0", "info.log"), encoding="utf-8") as fh:
        assert "dataset skip 4 steps" in fh.read()
    assert "Epoch:[  5/  6]" in runs["logs"]["mindformers"] and "Epoch:[  6/  6]" in runs["logs"]["mindformers"]


def test_the_state_file_holds_what_the_trainer_writes(runs):
    state = runs["state"]
    assert os.path.basename(state.file) == legacy_name("shared", J) == "shared_rank_0-4_1.ckpt"
    with open(os.path.join(state.dst, "rank_0", "meta.json"), encoding="utf-8") as fh:
        assert json.load(fh) == {"last_epoch": J, "last_step": 1, "last_ckpt_file": "shared_rank_0-4_1.ckpt"}
    (step, ours), = mindformers_dir.iterations(state.dst).items()
    assert step == J and state.global_step == J and (state.weights, state.moments) == (21, 42)
    mine = files.frameworks.get("mindspore").load_checkpoint(ours)[0]
    # the Trainer's own save of step 6, after resuming from ours: same entries, dtypes and shapes; its counters went on
    theirs_file = mindformers_dir.iterations(os.path.join(runs["base"], "mindformers", "output"))[TOTAL]
    theirs = files.frameworks.get("mindspore").load_checkpoint(theirs_file)[0]
    assert {k: (v.dtype, v.shape) for k, v in mine.items()} == {k: (v.dtype, v.shape) for k, v in theirs.items()}
    assert {k: int(np.asarray(mine[k]).reshape(-1)[0]) for k in ("global_step", "step_num", "epoch_num")} == dict.fromkeys(
        ("global_step", "step_num", "epoch_num"), J)
    assert {k: int(np.asarray(theirs[k]).reshape(-1)[0]) for k in ("global_step", "step_num", "epoch_num",
                                                                    "global_batch_size")} == {
        "global_step": TOTAL, "step_num": TOTAL, "epoch_num": TOTAL, "global_batch_size": 2}


def test_the_moments_after_two_more_steps_agree_across_frameworks(runs):
    """Megatron's Adam moments at 6 (its own resume) and the Trainer's (resumed from the converted state at 4)."""
    meg, _, info = megatron_dir.load_dir(os.path.join(runs["base"], "ckpt_resumed"), TOTAL)
    assert info["step"] == TOTAL
    mf, _, mf_info = mindformers_dir.load_dir(os.path.join(runs["base"], "mindformers", "output"), TOTAL)
    assert mf_info["global_step"] == TOTAL
    table = ConversionTable.load(MAPPING, VARS)
    for kind, lead in (("exp_avg", "adam_m"), ("exp_avg_sq", "adam_v")):
        ours = table.convert({k[len(f"optimizer.{kind}."):]: v for k, v in meg.items()
                              if k.startswith(f"optimizer.{kind}.")}, source="mcore").tensors
        assert len(ours) == 21
        for name, value in ours.items():
            other = mf[f"{lead}.{name}"]
            err = np.linalg.norm(other - value) / max(np.linalg.norm(value), 1e-30)
            assert err < 1e-4, (lead, name, err)


def test_zeroed_moments_part_at_the_weights_after_the_first_update(runs, capsys):
    code, doc = _diff(runs, "zeroed", capsys)
    assert code == 1
    first = doc["first_divergence"]
    assert (first["step"], first["phase"], first["kind"]) == (1, "weights", "param")  # iteration 6's weights
    assert doc["hints"][0]["cause"] == "optimizer-step"


def test_hyper_parameters_are_equivalent_and_a_difference_is_named(runs, tmp_path):
    state = runs["state"]
    assert state.mismatches == [] and {g["eps"] for g in state.hyper} == {1e-8}
    assert {tuple(g["betas"]) for g in state.hyper} == {(0.9, 0.999)}
    with open(YAML, encoding="utf-8") as fh:
        c = yaml.safe_load(fh)
    c["optimizer"].update(eps=1.0e-6, weight_decay=0.1, betas=[0.9, 0.95])
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump(c))
    found = check_hyper(state.hyper, str(other))
    assert any(m.startswith("eps: A's Adam 1e-08, B's YAML 1e-06") for m in found)
    assert any(m.startswith("betas:") for m in found) and any(m.startswith("weight_decay: A's Adam 0") for m in found)


def test_epochs_and_file_names():
    assert epoch_of(4) == (4, 1) and epoch_of(10, 4) == (3, 2) and epoch_of(8, 4) == (2, 4)
    assert legacy_name("llama", 10, 4) == "llama_rank_0-3_2.ckpt"
