"""The optimizer-step hint on megatron-core's own optimizer (``get_megatron_optimizer``: torch's AdamW, gradient
clipping at 1.0 as Megatron-LM does by default), in the megatron-core loop captured with ``tensordiff capture
--megatron``: Adam is rebuilt from each side's captured gradients through the clip, and the setting that differs
(Megatron-LM's ``--adam-beta2`` / ``--adam-eps``) is named. No mocks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")

from tests.helpers import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOOP = os.path.join(ROOT, "examples", "megatron_loop", "train.py")


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("adam")

    def run(name: str, *extra: str) -> str:
        path = str(tmp / f"{name}.h5")
        if not os.path.exists(path):
            proc = subprocess.run([sys.executable, "-m", "tensordiff", "capture", "--megatron", "-o", path, "--steps",
                                   "3", "--tensors", "all", "--", sys.executable, LOOP, "--steps", "3", *extra],
                                  capture_output=True, text=True, env=subprocess_env(ROOT), cwd=str(tmp), timeout=600)
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        return path

    def diff(a: str, b: str) -> dict:
        out = str(tmp / f"{os.path.basename(a)}-{os.path.basename(b)}.json")
        proc = subprocess.run([sys.executable, "-m", "tensordiff", "diff", a, b, "--first-divergence", "--json", out],
                              capture_output=True, text=True, env=subprocess_env(ROOT), cwd=str(tmp), timeout=600)
        assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
        with open(out) as fh:
            return json.load(fh)

    return run, diff


def test_beta2_is_named_through_megatrons_gradient_clipping(loop):
    run, diff = loop
    doc = diff(run("ref"), run("beta2", "--adam-beta2", "0.95"))
    assert (doc["first_divergence"]["step"], doc["first_divergence"]["phase"]) == (2, "weights")
    top = doc["hints"][0]
    assert top["cause"] == "optimizer-step" and top["details"]["fit"] == "adam" and top["explained"] > 0.99
    assert top["details"]["differs"] == {"beta2": {"A": [0.999], "B": [0.95]}}
    # the grad norms (~2.5) exceed the clip (1.0): it had to be fitted; any clip below them scales both steps alike
    clips = top["details"]["consistent"]["A"].split("clip ")[1].split(" or ")
    assert "1" in clips and "none" not in clips
    assert "adam_beta2 A 0.999, B 0.95" in top["evidence"]  # the settings the captures recorded


def test_epsilon_is_named_on_megatrons_optimizer(loop):
    # at Adam's first step a clip by s = 1/|g| and epsilon are one: the update is s·g / (s·|g| + ε) = g / (|g| + ε/s),
    # so the fitted epsilon is B's 1e-4 times the clipped step's gradient norm (what the capture logged)
    from tensordiff.store import open_capture

    run, diff = loop
    doc = diff(run("ref"), run("eps", "--adam-eps", "1e-4"))
    assert (doc["first_divergence"]["step"], doc["first_divergence"]["phase"]) == (1, "weights")
    top = doc["hints"][0]
    assert top["cause"] == "optimizer-step" and top["details"]["fit"] == "adam" and top["explained"] > 0.99
    assert list(top["details"]["differs"]) == ["eps"]
    with open_capture(run("eps")) as cap:
        norm = cap.scalars()["grad_norm"][0]
    assert norm > 1.0 and top["details"]["b"]["eps"] == pytest.approx(1e-4 * norm, rel=0.05)
