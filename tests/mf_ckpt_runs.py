"""Real MindFormers 1.9 Trainer runs that save checkpoints, shared by the tests that read them.

``run(name)`` runs (once per process, then cached) ``examples/launchers/run_mindformer.py`` on a copy of
``examples/launchers/llama_tiny.yaml`` with random weights (seed 0), the one-batch MindRecord of ``tensordiff batch``
(one step an epoch, the same batch every step) and a ``CheckpointMonitor`` saving every ``EVERY`` steps:

* ``legacy``: 6 steps, the default layout: ``output/checkpoint/rank_0/llama_tiny_rank_0-E_S.ckpt`` + ``meta.json``;
* ``legacy-resume``: resumed from the step-``RESUME_LEGACY`` file of ``legacy`` (``load_checkpoint``: its
  ``checkpoint`` folder, ``resume_training``: the file name), steps 5..6;
* ``v2``: 6 steps, ``use_legacy_format: False``: ``output/checkpoint/iteration_0000000N/`` (model and opt
  safetensors, ``common.json``) + ``latest_checkpointed_iteration.txt``;
* ``v2-resume``: resumed from ``v2``'s ``iteration_00000002`` (``resume_training: True``), steps 3..6.

Each run is about 10-15 s here. ``Run.losses``: global step -> (loss, global norm), as the Trainer's log prints them.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import yaml

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
LAUNCHERS = os.path.join(ROOT, "examples", "launchers")
STEPS, EVERY, RESUME_LEGACY, RESUME_V2 = 6, 2, 4, 2
PREFIX = "llama_tiny"

#: ``{ Epoch:[  3/  6], step:[    1/    1], loss:[4.574961/4.574961], ... global_norm: [1.8185508]``
_LINE = re.compile(r"\{ Epoch:\[\s*(\d+)/\s*\d+\], step:\[\s*(\d+)/\s*(\d+)\], loss:\[([-\d.]+)/.*"
                   r"global_norm: \[([-\d.e+]+)\]")


@dataclass
class Run:
    folder: str  # where the Trainer ran: output/ is under it
    stdout: str
    losses: dict[int, tuple[float, float]]

    @property
    def checkpoint(self) -> str:
        return os.path.join(self.folder, "output", "checkpoint")


_BASE: list[str] = []
_RUNS: dict[str, Run] = {}


def _base() -> str:
    if not _BASE:
        _BASE.append(tempfile.mkdtemp(prefix="tensordiff-mfckpt-"))
        atexit.register(shutil.rmtree, _BASE[0], True)
        _py([sys.executable, "-m", "tensordiff", "batch", "-o", "batch.h5", "--vocab", "128", "--seq", "16",
             "--batch", "2", "--seed", "0", "--mindrecord", "batch.mindrecord"], _BASE[0])
    return _BASE[0]


def _py(cmd: list[str], cwd: str) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-5000:]
    return proc.stdout


def config(legacy: bool = True, load: str = "", resume: bool | str = False) -> dict:
    """llama_tiny.yaml for a run of ``STEPS`` steps that saves every ``EVERY`` steps."""
    with open(os.path.join(LAUNCHERS, "llama_tiny.yaml"), encoding="utf-8") as f:
        c = yaml.safe_load(f)
    c["load_checkpoint"] = load  # '': the model's own random initialisation (seed 0)
    c["resume_training"] = resume
    c["runner_config"]["epochs"] = STEPS  # the total: a resumed run skips the steps already done
    monitor = {"type": "CheckpointMonitor", "prefix": PREFIX, "save_checkpoint_steps": EVERY,
               "keep_checkpoint_max": 10}
    if not legacy:
        c["use_legacy_format"] = monitor["use_legacy_format"] = False
        c["load_ckpt_format"] = "safetensors"
    c["callbacks"].append(monitor)
    return c


def run(name: str) -> Run:
    """The run ``name`` (see the module's docstring), made on first use."""
    if name in _RUNS:
        return _RUNS[name]
    base = _base()
    if name == "legacy":
        c = config()
    elif name == "legacy-resume":
        c = config(load=run("legacy").checkpoint, resume=f"{PREFIX}_rank_0-{RESUME_LEGACY}_1.ckpt")
    elif name == "v2":
        c = config(legacy=False)
    elif name == "v2-resume":
        c = config(legacy=False, load=os.path.join(run("v2").checkpoint, f"iteration_{RESUME_V2:08d}"), resume=True)
    else:
        raise KeyError(name)
    folder = os.path.join(base, name)
    os.makedirs(folder)
    for f in ("batch.mindrecord", "batch.mindrecord.db"):
        shutil.copy(os.path.join(base, f), folder)
    with open(os.path.join(folder, "run.yaml"), "w", encoding="utf-8") as f:
        yaml.safe_dump(c, f, sort_keys=False)
    stdout = _py([sys.executable, os.path.join(LAUNCHERS, "run_mindformer.py"), "--config",
                  os.path.join(folder, "run.yaml")], folder)
    losses = {(int(e) - 1) * int(n) + int(s): (float(loss), float(norm))
              for e, s, n, loss, norm in _LINE.findall(stdout)}
    _RUNS[name] = Run(folder, stdout, losses)
    return _RUNS[name]
