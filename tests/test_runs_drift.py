"""`tensordiff runs A.h5 B.h5` on statistics captured every step: the layer x step drift table.

The captures are real: the tiny megatron-core GPT trained on the CPU for 30 steps (tests/scripts/drift_gpt.py), a
clean pair (the same seed: no drift), a pair whose B scales one layer's norm weight from iteration 15 on (the table
must name that layer, at that step), a B that stops early and records no gradients (stated, not silent), and
Hugging Face's GPT-2 carrying the same weights, lined up through the mapping `tensordiff diff` picks."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")

from helpers import subprocess_env

from tensordiff.record import Record
from tensordiff.runs.drift import departure, first_departure, layer_drift, layer_of
from tensordiff.store import ReaderBase

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
SCRIPT = os.path.join(TESTS, "scripts", "drift_gpt.py")
STEPS, FAULT_STEP, FAULT_LAYER = 30, 15, 2


def _env() -> dict[str, str]:
    return subprocess_env(ROOT)


@pytest.fixture(scope="module")
def caps(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("drift")
    plans = {
        "a": [],
        "clean": [],
        "fault": ["--fault-layer", str(FAULT_LAYER), "--fault-step", str(FAULT_STEP)],
        "short": ["--steps", "20", "--no-grads"],
        "hf": ["--hf"],
        "hf_fault": ["--hf", "--fault-layer", str(FAULT_LAYER), "--fault-step", str(FAULT_STEP)],
    }
    out, started = {}, []
    for name, extra in plans.items():  # two at a time (2 cores)
        path = str(tmp / f"{name}.h5")
        cmd = [sys.executable, SCRIPT, "-o", path, "--steps", str(STEPS), *extra]
        started.append((name, path, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                                     env=_env(), cwd=ROOT)))
        if len(started) == 2 or name == list(plans)[-1]:
            for done, done_path, proc in started:
                stdout, stderr = proc.communicate(timeout=300)
                assert proc.returncode == 0, (done, stdout[-2000:], stderr[-3000:])
                out[done] = done_path
            started = []
    out["tmp"] = str(tmp)
    return out


def _runs(*args: str) -> tuple[subprocess.CompletedProcess, dict]:
    json_path = args[-1]
    proc = subprocess.run([sys.executable, "-m", "tensordiff", "runs", *args[:-1], "--json", json_path, "--width", "160"],
                          capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    with open(json_path) as fh:
        return proc, json.load(fh)


def test_clean_pair_no_drift(caps):
    proc, doc = _runs(caps["a"], caps["clean"], os.path.join(caps["tmp"], "clean.json"))
    assert proc.returncode == 0, proc.stdout
    drift = doc["drift"]
    assert drift["drifted"] is False and drift["earliest"] is None
    assert all(v is None for v in drift["first_drift_layer"].values())
    assert drift["notes"] == [] and drift["records_only_a"] == drift["records_only_b"] == 0
    assert drift["loss_parts_at"] is None
    assert "NO DRIFT: no layer departs beyond its noise in steps 6..30" in proc.stdout
    ratios = drift["ratios"]
    assert len(ratios) == len(drift["layers"]) and all(len(r) == STEPS for r in ratios)
    assert all(v == 0 for row in ratios for v in row)  # the same seed on the CPU: bit-identical statistics


def test_faulted_layer_named_with_its_step(caps):
    plot, page = os.path.join(caps["tmp"], "fault.png"), os.path.join(caps["tmp"], "fault.html")
    proc, doc = _runs(caps["a"], caps["fault"], "--plot", plot, "--html", page, "--fail-on-drift",
                      os.path.join(caps["tmp"], "fault.json"))
    assert proc.returncode == 1, proc.stdout  # --fail-on-drift: the loss alone passes (within 1%)
    assert doc["passed"] is True
    drift = doc["drift"]
    layer = f"decoder.layers.{FAULT_LAYER}"
    assert drift["earliest"]["layer"] == layer, drift["verdict"]
    assert abs(drift["earliest"]["step"] - FAULT_STEP) <= 2
    assert drift["first_drift"][layer]["weights"] == FAULT_STEP
    # nothing departs before the fault; the layers before it: their gradients at the fault, their activations only
    # once the optimizer has moved their weights with those gradients (a step later or more)
    assert all(s is None or s >= FAULT_STEP for s in drift["first_drift_layer"].values())
    for before in ("embedding", "decoder.layers.0", "decoder.layers.1"):
        assert drift["first_drift"][before]["backward"] == FAULT_STEP, before
        assert drift["first_drift"][before]["forward"] in (None, *range(FAULT_STEP + 1, STEPS + 1)), before
    assert drift["verdict"].startswith(f"layer {layer} (weights) first departs at step {FAULT_STEP}")
    # the matrix: layers x steps of departure / tolerance, below 1 before the fault
    steps, ratios = drift["steps"], drift["ratios"]
    assert steps == list(range(1, STEPS + 1)) and len(ratios) == len(drift["layers"])
    row = ratios[drift["layers"].index(layer)]
    assert len(row) == STEPS and max(row[:FAULT_STEP - 1]) <= 1 and row[FAULT_STEP - 1] > 1
    assert set(drift["ratios_by_kind"]) == {"weights", "forward", "backward", "param_grad"}
    assert drift["baseline"] == 5 and drift["baseline_steps"] == [1, 2, 3, 4, 5] and "2 of the next 3" in drift["rule"]
    assert f"DRIFT: layer {layer} (weights) first departs at step {FAULT_STEP}" in proc.stdout
    with open(plot, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(page, encoding="utf-8") as fh:
        text = fh.read()
    assert "<h2>Layer drift</h2>" in text and "layer drift heat map" in text and layer in text


def test_missing_steps_and_records_are_stated(caps):
    proc, doc = _runs(caps["a"], caps["short"], os.path.join(caps["tmp"], "short.json"))
    drift = doc["drift"]
    assert drift["steps_only_a"] == list(range(21, STEPS + 1)) and drift["steps_only_b"] == []
    assert drift["records_only_a"] > 0  # B recorded no gradients of module outputs
    notes = " ".join(drift["notes"])
    assert "10 steps logged by A only (21, 22, 23, ..., 30): not compared" in notes
    assert "records without a counterpart" in notes and "A decoder" in notes
    assert "10 steps logged by A only" in proc.stdout and "records without a counterpart" in proc.stdout
    assert drift["drifted"] is False  # what both recorded is the same run
    assert "backward" not in drift["first_drift"]["decoder.layers.0"]  # A's only: no column of its own


def test_other_framework_through_diffs_mapping(caps):
    """megatron-core against Hugging Face GPT-2 carrying the same weights: the records line up through the built-in
    mapping diff picks and the table names A's layers; the clean pair's rounding differences stay within the noise,
    the faulted layer is named at the fault."""
    _, doc = _runs(caps["a"], caps["hf"], os.path.join(caps["tmp"], "hf.json"))
    drift = doc["drift"]
    assert drift["mapping"].startswith("mcore-hf-gpt2")
    assert drift["drifted"] is False, drift["verdict"]
    assert any(v for row in drift["ratios"] for v in row if v)  # not bit-identical: real noise, within tolerance
    assert drift["records_only_a"] > 0 and "records without a counterpart" in " ".join(drift["notes"])
    assert drift["records_of_another_size"] > 0  # HF's position embeddings are not expanded over the batch
    _, doc = _runs(caps["a"], caps["hf_fault"], os.path.join(caps["tmp"], "hf_fault.json"))
    drift = doc["drift"]
    layer = f"decoder.layers.{FAULT_LAYER}"
    assert layer in drift["layers"] and "transformer.h.2" not in drift["layers"]
    assert drift["earliest"]["layer"] == layer and drift["earliest"]["step"] == FAULT_STEP, drift["verdict"]
    assert drift["first_drift"][layer]["weights"] == FAULT_STEP


def test_no_drift_option_and_logs(caps, tmp_path):
    proc, doc = _runs(caps["a"], caps["clean"], "--no-drift", str(tmp_path / "n.json"))
    assert doc["drift"] is None and "layer drift" not in proc.stdout
    log = tmp_path / "a.log"
    log.write_text("".join(f" iteration {i:8d}/      30 | lm loss: {5 - i / 100:.6E} |\n" for i in range(1, 31)))
    proc, doc = _runs(str(log), str(log), str(tmp_path / "l.json"))
    assert proc.returncode == 0 and doc["drift"] is None
    proc, doc = _runs(caps["a"], caps["clean"], "--drift-baseline", "40", str(tmp_path / "b.json"))
    assert doc["drift"]["measured"] is False and "baseline alone takes 40" in doc["drift"]["why"]


# the rule itself, on numbers ---------------------------------------------------------------------------------------

def test_first_departure_rule():
    assert first_departure([0, 0, 0, 5, 0, 0, 0, 0], 2) is None  # a one-off spike
    assert first_departure([0, 0, 0, 5, 0, 2, 2, 0], 2) == 3  # over again at 2 of the next 3
    assert first_departure([0, 0, 0, 5, 2, 0, 0, 0], 2) is None  # once in the next 3 is not enough
    assert first_departure([9, 9, 0, 0, 0, 0], 2) is None  # the baseline is not judged
    assert first_departure([0, 0, 0, 0, 0, 2], 2) == 5  # the last step: nothing follows to deny it
    assert first_departure([0, 0, 0, 2, 2], 2) == 3  # fewer than 3 follow: all of them
    assert first_departure([0, 0, 2, math.nan, 2, math.nan, 0], 2) is None  # steps without a value are skipped
    assert first_departure([0, 0, 2, math.nan, 2, 2], 2) == 2


def test_departure_and_layers():
    a = (100, -1.0, 2.0, 0.1, 10.0, 0, 0)
    assert departure(a, a) == 0
    assert departure(a, (100, -1.0, 2.0, 0.1, 10.1, 0, 0)) == pytest.approx(0.1 / 10.1)
    assert departure(a, (100, -1.0, 2.2, 0.1, 10.0, 0, 0)) == pytest.approx(0.2 / 2.2)
    assert departure(a, (100, -1.0, 2.0, 0.2, 10.0, 0, 0)) == pytest.approx(0.1)  # the mean's move over A's RMS (1.0)
    assert departure(a, (100, -1.0, 2.0, 0.1, 10.0, 1, 0)) == math.inf  # a NaN appears
    assert layer_of("module.module.decoder.layers.17.mlp.linear_fc1") == "decoder.layers.17"
    assert layer_of("model.layers.3.self_attn.q_proj") == "model.layers.3"
    assert layer_of("transformer.h.11.attn") == "transformer.h.11"
    assert layer_of("embedding.word_embeddings") == "embedding"
    assert layer_of("decoder.final_layernorm") == "decoder.final_layernorm"
    assert layer_of("") == "<model>"


class _Cap(ReaderBase):
    """A capture in memory: one weight record per layer and step, with the given L2 norms (statistics only)."""

    def __init__(self, path: str, l2: dict[str, list[float]]):
        super().__init__(path)
        self.attrs = {"framework": "torch", "model_class": "M"}
        self.steps = list(range(len(next(iter(l2.values())))))
        self._l2 = l2

    def records(self, step: int) -> list[Record]:
        return [Record(step=step, seq=i, phase="weights", module=f"decoder.layers.{i}.mlp", call=0, kind="param",
                       slot="weight", module_class="Linear", dtype="float32", shape=(4,), min=-1.0, max=1.0, mean=0.0,
                       l2=v[step], numel=4) for i, v in enumerate(self._l2.values())]

    def scalars(self) -> dict:
        return {"loss": dict.fromkeys(self.steps, 1.0)}

    def step_attrs(self, step: int) -> dict:
        return {}

    def array(self, record: Record) -> None:
        return None

    def nbytes(self) -> int:
        return 0


def test_noise_from_the_baseline():
    """Runs that differ by noise from the start: a layer is held to its own baseline departure times the factor, not
    to the floor."""
    n = 20
    a = _Cap("a", {"l0": [1.0] * n, "l1": [1.0] * n})
    noisy = [1.0 + (1e-3 if i % 2 else -1e-3) for i in range(n)]  # 1e-3, far above the float32 floor
    grows = [1.0 + (1e-3 if i % 2 else -1e-3) for i in range(12)] + [1.0 + 2e-2] * (n - 12)
    table = layer_drift(a, _Cap("b", {"l0": noisy, "l1": grows}), baseline=5)
    assert table.layers == ["decoder.layers.0", "decoder.layers.1"]
    assert table.cells[("decoder.layers.0", "weights")].first is None
    assert table.step_of(table.cells[("decoder.layers.1", "weights")].first) == 13  # iteration 13: capture step 12
    assert table.verdict().startswith("layer decoder.layers.1 (weights) first departs at step 13, the only layer")
    table = layer_drift(a, _Cap("b", {"l0": noisy, "l1": grows}), baseline=5, factor=30)
    assert not table.drifted  # 2e-2 is within 30x the 1e-3 of the baseline
