"""``--every N`` / ``capture(..., every=N)``: every Nth training step recorded, stored under its step number, the
steps between untouched (statistics of a whole run for the layer drift table at a fraction of the cost)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("megatron.core")

import tensordiff
from examples.gpt.models import GPTSpec, build_mcore_gpt, make_batch, mcore_loss
from tensordiff.store import CaptureFile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train(path: str, steps: int, every: int, call_step: bool = True, train_steps: int = 7) -> list[float]:
    spec = GPTSpec()
    model = build_mcore_gpt(spec)
    opt = torch_adam(model)
    losses = []
    cap = tensordiff.capture(model, path, steps=steps, every=every, tensors="none", optimizer=opt)
    with cap:
        for step in range(train_steps):
            tokens, labels, _ = make_batch(spec, seed=step)
            loss = mcore_loss(model, tokens, labels)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if call_step:
                cap.step(loss)
            losses.append(loss.item())
    return losses


def torch_adam(model):
    import torch

    return torch.optim.Adam(model.parameters(), lr=1e-3)


def test_every_third_step_is_stored_under_its_step_number(tmp_path):
    every = str(tmp_path / "every.h5")
    losses = _train(every, steps=3, every=3)
    full = str(tmp_path / "full.h5")
    assert _train(full, steps=7, every=1) == losses  # capture never changes the numbers
    with CaptureFile(every) as ce, CaptureFile(full) as cf:
        assert ce.steps == [0, 3, 6]
        assert sorted(ce.scalars()["loss"]) == list(range(7))  # the per-step loss of every step, captured or not
        for step in ce.steps:  # the same records with the same statistics as the capture of every step
            a, b = ce.records(step), cf.records(step)
            assert [(r.phase, r.module, r.slot) for r in a] == [(r.phase, r.module, r.slot) for r in b]
            assert np.allclose([r.l2 for r in a], [r.l2 for r in b], rtol=1e-6, atol=0)


def test_every_without_step_calls_records_the_first_step_and_says_so(tmp_path):
    path = str(tmp_path / "nostep.h5")
    with pytest.warns(Warning, match=r"every=2 counts step\(\) calls, and none came: only the first step was recorded"):
        _train(path, steps=3, every=2, call_step=False, train_steps=3)
    with CaptureFile(path) as cap:
        assert cap.steps == [0]


def test_megatron_launcher_every_n(tmp_path):
    out = str(tmp_path / "ev.h5")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    proc = subprocess.run([sys.executable, "-m", "tensordiff", "capture", "--megatron", "-o", out, "--tensors", "none",
                           "--steps", "3", "--every", "4", "--", sys.executable,
                           os.path.join(ROOT, "examples", "megatron_loop", "train.py"), "--train-iters", "10"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with CaptureFile(out) as cap:
        assert cap.steps == [0, 4, 8]
        assert [cap.step_attrs(s)["iteration"] for s in cap.steps] == [1, 5, 9]  # Megatron-LM's numbering
        assert sorted(cap.scalars()["loss"]) == list(range(10))


def test_every_zero_is_refused(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tensordiff", "capture", "-o", str(tmp_path / "x.h5"), "--every", "0",
                           "--", sys.executable, "-c", "pass"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "tensordiff: error: --every 0: expected 1 (every step) or more"


def test_steps_all_records_every_step_until_the_run_ends(tmp_path):
    """``--steps all --tensors none``: statistics always on, every iteration of the run recorded (the loop runs 6),
    the file closed when the run ends; a word that is neither a number nor 'all' is one line, exit 2."""
    out = str(tmp_path / "all.h5")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    proc = subprocess.run([sys.executable, "-m", "tensordiff", "capture", "--megatron", "-o", out, "--tensors", "none",
                           "--steps", "all", "--", sys.executable,
                           os.path.join(ROOT, "examples", "megatron_loop", "train.py"), "--train-iters", "6"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with CaptureFile(out) as cap:
        assert cap.steps == list(range(6))
        assert {r.phase for s in cap.steps for r in cap.records(s) if r.has_data} == {"loss"}  # the loss value only
    bad = subprocess.run([sys.executable, "-m", "tensordiff", "capture", "-o", out, "--steps", "many", "--",
                          sys.executable, "-c", "pass"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert bad.stderr.strip() == "tensordiff: error: --steps 'many': give a whole number of steps, or 'all'"
