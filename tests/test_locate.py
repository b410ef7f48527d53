"""``tensordiff locate``: from the iteration where two long runs' loss curves part to the layer and the cause.

End to end on the real megatron-core loop (examples/locate/run.py: two runs of 30 iterations, checkpoints every 10,
B's cosine decay over 100 iterations instead of 300), and the resume commands it writes for both launchers."""

from __future__ import annotations

import json
import math
import os
import re

import pytest
import yaml

from tensordiff.cli import main as cli
from tensordiff.runs.locate import megatron_resume, mindformers_resume, plan_locate, side_kind

pytest.importorskip("megatron.core")


def _cosine(iteration: int, decay: int, warmup: int = 5, lr: float = 1e-3, min_lr: float = 1e-4) -> float:
    """The learning rate megatron-core's scheduler gives after ``iteration`` steps (cosine, linear warm-up)."""
    ratio = (iteration - warmup) / (decay - warmup)
    return min_lr + (lr - min_lr) * 0.5 * (math.cos(math.pi * ratio) + 1.0)


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    from examples.locate import run

    out = str(tmp_path_factory.mktemp("locate"))
    assert run.main(["--iters", "30", "--out", out]) == 0
    return out


def _json(example, name):
    with open(os.path.join(example, name), encoding="utf-8") as fh:
        return json.load(fh)


def _losses(path: str) -> dict[int, float]:
    """iteration -> lm loss, read from a Megatron-style log line by line (independently of tensordiff's reader)."""
    out = {}
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            m = re.search(r"iteration\s+(\d+)/\s*\d+ \|.*\blm loss: ([0-9.eE+-]+)", line)
            if m:
                out[int(m.group(1))] = float(m.group(2))
    return out


def test_runs_names_the_iteration_where_the_curves_part(example):
    runs = _json(example, "runs.json")
    a, b = _losses(os.path.join(example, "a.log")), _losses(os.path.join(example, "b.log"))
    assert len(a) == len(b) == 30
    # the schedules agree through the warm-up and part after it: the first iteration over 1% in the logs themselves
    parted = next(i for i in sorted(a) if abs(b[i] - a[i]) / abs(a[i]) > runs["threshold"])
    assert parted > 5 and _cosine(parted, 100) != _cosine(parted, 300)
    assert runs["first_step_over_threshold"] == parted and not runs["passed"]


def test_shared_state_names_the_learning_rate(example):
    doc = _json(example, "locate_shared.json")
    assert (doc["step"], doc["resume"], doc["mode"]) == (22, 20, "shared")
    assert doc["captured_iterations"] == [21, 23]
    assert doc["b"]["loads"].endswith("ckpt_a") and "--override-opt_param-scheduler" in doc["b"]["command"]
    # everything of iteration 21 agrees (one state, one batch); the weights after its update do not
    assert (doc["iterations"][0]["iteration"], doc["iterations"][0]["diverged"]) == (21, 0)
    first = doc["first_divergence"]
    assert (first["iteration"], first["phase"], first["kind"]) == (22, "weights", "param")
    top = doc["hints"][0]
    assert top["cause"] == "optimizer-step" and top["details"]["fit"] == "lr"
    assert top["details"]["factor"] == pytest.approx(_cosine(20, 100) / _cosine(20, 300), rel=1e-4)
    assert top["explained"] > 0.99
    assert doc["updates"][0]["factor"] == pytest.approx(top["details"]["factor"], rel=1e-9)


def test_own_state_says_how_far_the_weights_had_drifted(example):
    doc = _json(example, "locate_own.json")
    assert (doc["step"], doc["resume"], doc["mode"]) == (22, 20, "own")
    assert doc["b"]["loads"].endswith("ckpt_b") and "--override-opt_param-scheduler" not in doc["b"]["command"]
    drift = doc["weights_at_resume"]
    assert drift["differ"] == drift["compared"] == 15 and 1e-4 < drift["worst_rel_l2"] < 1e-1
    assert (doc["first_divergence"]["iteration"], doc["first_divergence"]["phase"]) == (21, "weights")
    assert doc["hints"][0]["cause"] == "checkpoint"
    # beyond the drift, each side's own update of iteration 21 is one factor of the other's: the learning rate
    first = doc["updates"][0]
    assert first["iteration"] == 21 and first["one_factor"] and first["parameters"] == 15
    assert first["factor"] == pytest.approx(_cosine(20, 100) / _cosine(20, 300), rel=0.02)


def test_curves_that_do_not_part_leave_nothing_to_locate(example, capsys):
    code = cli(["locate", os.path.join(example, "a.log"), os.path.join(example, "a.log"), "--ckpt-a",
                os.path.join(example, "ckpt_a"), "--ckpt-b", os.path.join(example, "ckpt_a"), "--cmd-a", "python t.py",
                "--cmd-b", "python t.py", "--out", os.path.join(example, "none"), "--no-color"])
    assert code == 0 and "The loss curves do not part: nothing to locate" in capsys.readouterr().out


def test_plan_only_writes_the_commands(example, capsys):
    a, b = (os.path.join(example, n) for n in ("a.log", "b.log"))
    code = cli(["locate", a, b, "--ckpt-a", os.path.join(example, "ckpt_a"), "--ckpt-b", os.path.join(example, "ckpt_b"),
                "--cmd-a", "torchrun --nproc-per-node 8 pretrain_gpt.py --save /ck/a --save-interval 10 --train-iters 30",
                "--cmd-b", "torchrun --nproc-per-node 8 pretrain_gpt.py --save /ck/b --train-iters 30",
                "--step", "15", "--out", os.path.join(example, "plan"), "--no-color", "--width", "200",
                "--json", os.path.join(example, "plan.json")])
    text = capsys.readouterr().out
    assert code == 0 and "Looking at iteration 15 (asked for)" in text
    doc = _json(example, "plan.json")
    assert doc["a"]["command"].endswith("--load " + os.path.join(example, "ckpt_a") + " --ckpt-step 10 --exit-interval 16")
    assert "--save" not in doc["a"]["command"] and "--save" not in doc["b"]["command"]


def test_missing_checkpoint_folder_is_one_line(example, capsys):
    code = cli(["locate", os.path.join(example, "a.log"), os.path.join(example, "b.log"), "--ckpt-a", "/no/such",
                "--ckpt-b", "/no/such", "--cmd-a", "python t.py", "--cmd-b", "python t.py", "--out",
                os.path.join(example, "bad")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "/no/such: no such folder" in err[0]


# ------------------------------------------------------------------------- the commands, without running them
def test_megatron_resume_flags():
    cmd = ["torchrun", "pretrain_gpt.py", "--save", "/ck", "--save-interval=100", "--load", "/init", "--finetune",
           "--train-iters", "5000", "--exit-interval", "1000"]
    assert megatron_resume(cmd, "/ck", 1400, 1501) == [
        "torchrun", "pretrain_gpt.py", "--train-iters", "5000", "--load", "/ck", "--ckpt-step", "1400",
        "--exit-interval", "1501"]
    # no checkpoint before K: the run starts as it did (its initial --load and --finetune kept), and stops after K+1
    assert megatron_resume(cmd, None, 0, 8) == [
        "torchrun", "pretrain_gpt.py", "--load", "/init", "--finetune", "--train-iters", "5000", "--exit-interval", "8"]
    shared = megatron_resume(cmd + ["--use-checkpoint-opt_param-scheduler"], "/other", 1400, 1501, own=False)
    assert shared[-1] == "--override-opt_param-scheduler" and "--use-checkpoint-opt_param-scheduler" not in shared


def test_mindformers_resume_yaml(tmp_path):
    config = tmp_path / "llama.yaml"
    config.write_text(yaml.safe_dump({"output_dir": "./output", "runner_config": {"epochs": 6, "batch_size": 2},
                                      "callbacks": [{"type": "MFLossMonitor"},
                                                    {"type": "CheckpointMonitor", "save_checkpoint_steps": 2}]}))
    assert side_kind(["python", "run_mindformer.py", "--config", str(config)]) == "mindformers"
    assert side_kind(["torchrun", "pretrain_gpt.py", "--config-file", "x.yaml"]) == "megatron"
    legacy = tmp_path / "output" / "checkpoint" / "rank_0" / "llama_rank_0-4_1.ckpt"
    legacy.parent.mkdir(parents=True)
    legacy.write_bytes(b"")
    cmd, files = mindformers_resume(["python", "run_mindformer.py", "--config", str(config)], str(legacy), 4, 6,
                                    str(tmp_path / "out"), "B")
    (path, text), = files.items()
    assert cmd == ["python", "run_mindformer.py", "--config", path]
    doc = yaml.safe_load(text)
    assert doc["load_checkpoint"] == str(tmp_path / "output" / "checkpoint")
    assert (doc["resume_training"], doc["load_ckpt_format"]) == ("llama_rank_0-4_1.ckpt", "ckpt")
    assert doc["runner_config"] == {"epochs": 6, "batch_size": 2, "stop_step": 6}
    assert [c["type"] for c in doc["callbacks"]] == ["MFLossMonitor"]
    assert doc["output_dir"] == str(tmp_path / "out" / "output_b")
    v2 = tmp_path / "output" / "checkpoint" / "iteration_00000004"
    v2.mkdir()
    _, files = mindformers_resume(["python", "run_mindformer.py", f"--config={config}"], str(v2), 4, 6,
                                  str(tmp_path / "out"), "B")
    doc = yaml.safe_load(next(iter(files.values())))
    assert (doc["load_checkpoint"], doc["resume_training"], doc["load_ckpt_format"]) == (str(v2), True, "safetensors")


def test_shared_mode_megatron_to_mindformers_converts_a_state(example, tmp_path, capsys):
    """Megatron-LM A, MindFormers B: A's state at J is written for B's Trainer, and B's YAML copy resumes from it."""
    from tensordiff.ckpt import mindformers_dir

    config = tmp_path / "b.yaml"
    with open(os.path.join(os.path.dirname(__file__), "..", "examples", "launchers", "llama_tiny.yaml"),
              encoding="utf-8") as fh:
        config.write_text(fh.read())
    out = tmp_path / "out"
    a, b = (os.path.join(example, n) for n in ("a.log", "b.log"))
    args = ["locate", a, b, "--ckpt-a", os.path.join(example, "ckpt_a"), "--cmd-a", "python train.py",
            "--cmd-b", f"python run_mindformer.py --config {config}", "--mode", "shared", "--out", str(out),
            "--no-color", "--width", "200", "--json", str(tmp_path / "plan.json")]
    with pytest.raises(Exception, match="pass --mapping NAME"):
        plan_locate(a, b, os.path.join(example, "ckpt_a"), None, ["python", "train.py"],
                    ["python", "run_mindformer.py", "--config", str(config)], str(out), mode="shared")
    code = cli(args + ["--mapping", "mcore-mindformers-llama", "--var", "heads=4", "--var", "groups=2"])
    text = capsys.readouterr().out
    assert code == 0 and "Shared state: A's iteration 20 converted for B" in text
    doc = _json(tmp_path, "plan.json")
    state = doc["shared_state"]
    assert state["file"] == str(out / "shared_state" / "rank_0" / "shared_rank_0-20_1.ckpt")
    assert (state["result"]["global_step"], state["result"]["weights"], state["result"]["moments"]) == (20, 21, 42)
    assert mindformers_dir.iterations(state["dst"]) == {20: state["file"]}
    b_yaml = yaml.safe_load((out / "resume_b.yaml").read_text())
    assert (b_yaml["load_checkpoint"], b_yaml["resume_training"], b_yaml["load_ckpt_format"]) == (
        str(out / "shared_state"), "shared_rank_0-20_1.ckpt", "ckpt")
    assert b_yaml["runner_config"]["stop_step"] == 23 and doc["b"]["loads"] == state["file"]


def test_shared_mode_mindformers_to_megatron_is_refused(example, tmp_path):
    config = tmp_path / "a.yaml"
    config.write_text("runner_config: {epochs: 30}\n")
    with pytest.raises(Exception, match="converts a Megatron-LM state for MindFormers only"):
        plan_locate(os.path.join(example, "a.log"), os.path.join(example, "b.log"), os.path.join(example, "ckpt_a"),
                    None, ["python", "run_mindformer.py", "--config", str(config)], ["python", "train.py"],
                    str(tmp_path / "out"), mode="shared", mapping="mcore-mindformers-llama")


def test_curves_that_part_while_the_shared_resume_agrees_are_inconclusive_and_the_setting_is_named(tmp_path):
    """B differs in Adam's beta2 (0.95 for 0.999): the curves part; resumed from A's state, B runs with A's saved
    parameter groups (megatron-core's optimizer load restores the betas over B's flags) and every resumed iteration
    agrees. That is never "agree": exit 3, the two runs' settings compared from their commands name beta2, and the
    report says the shared resume erased it."""
    from examples.locate import run

    out = str(tmp_path / "beta2")
    assert run.main(["--iters", "20", "--variant", "beta2", "--mode", "shared", "--out", out]) == 0
    doc = _json(out, "locate_shared.json")
    assert doc["mode"] == "shared" and [it["diverged"] for it in doc["iterations"]] == [0] * len(doc["iterations"])
    assert doc["outcome"] == "inconclusive" and doc["first_divergence"] is None
    assert doc["inconclusive_reasons"] == [f"the resumed iterations agree while the loss curves part at iteration "
                                           f"{doc['step']}"]
    assert [d["key"] for d in doc["settings"]["differences"]] == ["adam_beta2"]
    assert doc["erased_by_resume"] == ["adam_beta2"]
    code = cli(["locate", os.path.join(out, "a.log"), os.path.join(out, "b.log"), "--ckpt-a",
                os.path.join(out, "ckpt_a"), "--cmd-a", "python train.py --lr 1e-3 --adam-beta2 0.999",
                "--cmd-b", "python train.py --lr 1e-3 --adam-beta2 0.95", "--mode", "shared", "--out",
                str(tmp_path / "plan")])
    assert code == 0  # the plan only: nothing ran, nothing judged
