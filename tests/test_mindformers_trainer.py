"""The MindFormers 1.9 Trainer captured through its YAML alone: the TensordiffCapture callback and
``tensordiff capture --mindformers``, on the real Trainer (MindSpore 2.9 CPU, FP32, legacy Llama, 2 layers).

Three runs, shared by the tests (module fixture, in parallel), each a process of ``tests/scripts/mf_trainer.py`` (a
stand-in for run_mindformer.py, which the wheel lacks: ``Trainer(args=config, model=..., train_dataset=...).train()``):

* PyNative, the YAML's ``callbacks`` holding ``- type: TensordiffCapture`` with MindFormers' ``auto_register`` key and
  ``--register_path`` (no line of Python names tensordiff);
* GRAPH_MODE, a YAML without the callback, run under ``tensordiff capture --mindformers -o graph.h5 --steps 2``;
* the reference: the same model, initial weights, batches and SGD step in a hand loop (PyNative) captured directly
  through ``tensordiff.capture(model, path, steps=2, optimizer=opt)``.

Each run trains 3 steps; 2 are captured. Measured: PyNative agrees with the hand loop bit for bit, GRAPH_MODE within
4e-8 relative (gradients of cell inputs are not recorded in graph mode, as the diff says).
"""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from test_mindformers_cpu import mindformers, ms  # noqa: F401  (MindFormers imported from a scratch directory)

from tensordiff._warn import TensordiffWarning
from tensordiff.capturing.mindformers_register import REGISTER_DIR
from tensordiff.store import CaptureFile

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
SCRIPT = os.path.join(TESTS, "scripts", "mf_trainer.py")

CONFIG = """\
seed: 0
run_mode: train
output_dir: ./output
use_parallel: False
context:
  mode: {mode}
  device_target: CPU
model:
  model_config:
    type: LlamaConfig
    batch_size: 2
    seq_length: 16
    hidden_size: 64
    num_layers: 2
    num_heads: 4
    n_kv_heads: 2
    vocab_size: 128
    intermediate_size: 128
    max_position_embedding: 64
    pad_token_id: 0
    compute_dtype: float32
    layernorm_compute_type: float32
    softmax_compute_type: float32
    rotary_dtype: float32
    param_init_type: float32
    embedding_init_type: float32
    use_flash_attention: False
    fused_rms_norm: False
    use_rope_slice: True
  arch:
    type: LlamaForCausalLM
trainer:
  type: CausalLanguageModelingTrainer
  model_name: llama_tiny
runner_config:
  epochs: 1
  batch_size: 2
  sink_mode: False
  sink_size: 1
  gradient_accumulation_steps: 1
runner_wrapper:
  type: CPUTrainOneStepCell  # MFTrainOneStepCell with an overflow check that has CPU kernels (mf_trainer.py)
  use_clip_grad: True        # for the global norm; 100 never clips here
  max_grad_norm: 100.0
optimizer:
  type: SGD
  learning_rate: 0.01
lr_schedule:
  type: ConstantWarmUpLR
  learning_rate: 0.01
  warmup_steps: 0
  total_steps: -1
callbacks:
  - type: MFLossMonitor
    per_print_times: 1
{extra}"""

CALLBACK = """\
  - type: TensordiffCapture
    output: pynative.h5
    steps: 2
    auto_register: tensordiff_capture.TensordiffCapture
"""

#: MFLossMonitor's line: ``{ Epoch:[  1/  1], step:[    1/    3], loss:[5.004621/5.004621], ... global_norm: [4.21]``
LOG_LINE = re.compile(r"step:\[\s*(\d+)/\s*\d+\], loss:\[([\d.]+)/.*global_norm: \[([\d.e+-]+)\]")


def _env():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), NO_COLOR="1")
    for name in ("TENSORDIFF_OUTPUT", "TENSORDIFF_STEPS", "TENSORDIFF_TENSORS", "TENSORDIFF_DISABLE", "REGISTER_PATH"):
        env.pop(name, None)
    return env


def _td(*args, cwd=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "tensordiff", *args], capture_output=True, text=True, env=_env(),
                          cwd=cwd, timeout=timeout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mf-trainer")
    (root / "pynative.yaml").write_text(CONFIG.format(mode=1, extra=CALLBACK))
    (root / "graph.yaml").write_text(CONFIG.format(mode=0, extra=""))
    (root / "hand.yaml").write_text(CONFIG.format(mode=1, extra=""))
    commands = {
        "pynative": [sys.executable, SCRIPT, "--config", "../pynative.yaml", "--register_path", REGISTER_DIR],
        "graph": [sys.executable, "-m", "tensordiff", "capture", "--mindformers", "-o", str(root / "graph.h5"),
                  "--steps", "2", "--", sys.executable, SCRIPT, "--config", "../graph.yaml"],
        "hand": [sys.executable, SCRIPT, "--config", "../hand.yaml", "--hand", str(root / "hand.h5")],
    }
    procs = {}
    for name, cmd in commands.items():
        (root / name).mkdir()
        procs[name] = subprocess.Popen(cmd, cwd=root / name, env=_env(), stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True)
    out = {}
    for name, proc in procs.items():
        text, _ = proc.communicate(timeout=400)
        assert proc.returncode == 0, f"{name} run failed:\n{text[-3000:]}"
        out[name] = text
    return {"root": root, "out": out, "pynative": str(root / "pynative" / "pynative.h5"),
            "graph": str(root / "graph.h5"), "hand": str(root / "hand.h5"),
            "logs": {name: str(root / name / "output" / "log" / "rank_0" / "info.log") for name in ("pynative", "graph")}}


def _logged(log):
    """{step: (loss, global norm)} as MFLossMonitor logged them."""
    with open(log, encoding="utf-8") as f:
        return {int(m.group(1)): (float(m.group(2)), float(m.group(3))) for m in map(LOG_LINE.search, f) if m}


# ------------------------------------------------------------------------------------------------
# the Trainer captured, against the hand loop


@pytest.mark.parametrize("run", ["pynative", "graph"])
def test_trainer_capture_agrees_with_hand_loop(runs, run):
    assert "hooks left: 0" in runs["out"][run]  # every probe and hook gone after the run (checked by the script)
    with CaptureFile(runs[run]) as cap:
        assert cap.steps == [0, 1]
        assert [cap.step_attrs(s)["iteration"] for s in cap.steps] == [1, 2]  # the Trainer's step numbers
        assert cap.attrs["model_class"] == "LlamaForCausalLM"
        assert cap.attrs["mindformers_wrapper"] == "CPUTrainOneStepCell"
        assert cap.attrs.get("capture_mode") == ("graph" if run == "graph" else None)
    diff = _td("diff", runs["hand"], runs[run], "--json", str(runs["root"] / f"{run}.json"))
    assert diff.returncode == 0, diff.stdout[-3000:] + diff.stderr
    assert "No divergence" in diff.stdout
    report = json.loads((runs["root"] / f"{run}.json").read_text())
    assert report["outcome"] == "agree" and report["first_divergence"] is None


def test_cli_wrote_a_patched_copy_and_left_the_yaml_alone(runs):
    assert re.search(r"tensordiff: wrote .*graph\.h5: 2 step\(s\)", runs["out"]["graph"])
    copy = runs["graph"] + ".mindformers.yaml"
    import yaml

    with open(copy, encoding="utf-8") as f:
        callbacks = yaml.safe_load(f)["callbacks"]
    assert [c["type"] for c in callbacks] == ["MFLossMonitor", "TensordiffCapture"]
    assert callbacks[1]["auto_register"] == f"{REGISTER_DIR}--tensordiff_capture.TensordiffCapture"
    assert "TensordiffCapture" not in (runs["root"] / "graph.yaml").read_text()


@pytest.mark.parametrize("run", ["pynative", "graph"])
def test_loss_and_scalars_are_what_mflossmonitor_logs(runs, run):
    logged = _logged(runs["logs"][run])
    assert sorted(logged) == [1, 2, 3]
    with CaptureFile(runs[run]) as cap:
        scalars = cap.scalars()
        losses = {s + 1: cap.step_attrs(s)["loss"] for s in cap.steps}
    assert sorted(scalars) == ["grad_norm", "loss", "loss_scale", "lr"]
    assert sorted(scalars["loss"]) == [0, 1, 2]  # every step of the run, the third after the captured two
    for step, (loss, norm) in logged.items():
        assert abs(scalars["loss"][step - 1] - loss) <= 5e-7, step  # the log prints 6 decimals
        assert scalars["grad_norm"][step - 1] == pytest.approx(norm, rel=1e-6), step
        assert scalars["lr"][step - 1] == pytest.approx(0.01) and scalars["loss_scale"][step - 1] == 1.0
    assert losses == {1: scalars["loss"][0], 2: scalars["loss"][1]}


def test_tensordiff_runs_reads_the_callback_scalars(runs):
    report = runs["root"] / "runs.json"
    proc = _td("runs", runs["logs"]["pynative"], runs["pynative"], "--json", str(report))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(report.read_text())
    assert data["b"]["kind"] == "tensordiff capture" and data["b"]["steps"] == 3 and data["common_steps"] == 3
    assert data["passed"] is True and data["max_rel_loss"] < 1e-6 and data["grad_norm_max_rel"] < 1e-6


# ------------------------------------------------------------------------------------------------
# bad input: one line, exit 2


def _bad(tmp_path, *cmd):
    proc = _td("capture", "--mindformers", "-o", str(tmp_path / "x.h5"), "--", sys.executable, SCRIPT, *cmd,
               cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "x.h5").exists()
    return lines[0]


def test_bad_commands_and_configs(tmp_path):
    assert "has no --config FILE" in _bad(tmp_path, "--mode", "1")
    line = _bad(tmp_path, "--config", "missing.yaml")
    assert "missing.yaml: no such config file" in line and "--config" in line
    (tmp_path / "broken.yaml").write_text("model: [1, 2\nrun_mode: train\n")
    line = _bad(tmp_path, "--config", str(tmp_path / "broken.yaml"))
    assert "broken.yaml: not valid YAML at line" in line
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    assert "not a MindFormers config" in _bad(tmp_path, "--config", str(tmp_path / "list.yaml"))


def test_misspelt_callback_named_before_running(tmp_path):
    (tmp_path / "typo.yaml").write_text(CONFIG.format(mode=1, extra="  - type: TensordiffCaptur\n    steps: 2\n"))
    line = _bad(tmp_path, "--config", str(tmp_path / "typo.yaml"))
    assert "typo.yaml: callbacks entry `type: TensordiffCaptur` is not a known callback" in line
    assert "did you mean `type: TensordiffCapture`?" in line


# ------------------------------------------------------------------------------------------------
# registration, and failures that never stop training


def _tiny_model_train(callback):
    """A real mindspore.train.Model run (PyNative, 2 steps) of a Dense layer with ``callback``; its weight after."""
    import mindspore.dataset as ds

    ms.set_context(mode=ms.PYNATIVE_MODE)
    net = ms.nn.Dense(4, 2)
    x = np.random.RandomState(0).randn(4, 4).astype(np.float32)
    data = ds.NumpySlicesDataset({"x": x, "y": x[:, :2]}, shuffle=False).batch(2)
    before = net.weight.asnumpy().copy()
    ms.train.Model(net, ms.nn.MSELoss(), ms.nn.SGD(net.trainable_params(), 0.1)).train(
        1, data, callbacks=[callback], dataset_sink_mode=False)
    return before, net.weight.asnumpy()


def test_register_builds_the_callback_from_a_config_entry(tmp_path):
    from mindformers.core.callback.build_callback import build_callback
    from mindformers.tools.register import MindFormerModuleType, MindFormerRegister

    from tensordiff.capturing.mindformers_callback import TensordiffCapture, register

    register()
    assert MindFormerRegister.get_cls(MindFormerModuleType.CALLBACK, "TensordiffCapture") is TensordiffCapture
    built = build_callback([{"type": "TensordiffCapture", "output": str(tmp_path / "m.h5"), "steps": 1}])
    assert len(built) == 1 and isinstance(built[0], TensordiffCapture)
    before, after = _tiny_model_train(built[0])
    assert not np.array_equal(before, after)
    with CaptureFile(str(tmp_path / "m.h5")) as cap:  # a plain Model: its network is the WithLossCell's backbone
        assert cap.steps == [0] and cap.attrs["model_class"] == "Dense"
        assert sorted(cap.scalars()["loss"]) == [0, 1]


@pytest.mark.parametrize("options, message", [
    ({}, "TensordiffCapture: no output file: set `output: run.h5`"),
    ({"output": "x.h5", "tensors": "every"}, "capture not started (UsageError: tensors='every'"),
])
def test_a_capture_that_cannot_start_warns_once_and_training_goes_on(tmp_path, monkeypatch, options, message):
    from tensordiff.capturing.mindformers_callback import TensordiffCapture

    monkeypatch.chdir(tmp_path)
    with pytest.warns(TensordiffWarning) as caught:
        before, after = _tiny_model_train(TensordiffCapture(**options))
    assert [str(w.message) for w in caught if message in str(w.message)] and len(caught) == 1
    assert not np.array_equal(before, after) and os.listdir(tmp_path) == []


def test_unknown_option_warns_and_is_ignored():
    from tensordiff.capturing.mindformers_callback import TensordiffCapture

    with pytest.warns(TensordiffWarning, match=r"unknown option\(s\) step ignored"):
        cb = TensordiffCapture(output="x.h5", step=2)
    assert cb.output == "x.h5" and cb.steps is None
