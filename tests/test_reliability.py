"""The run comes first: a capture that runs out of room stops itself, warns once, and training goes on unchanged.

A file-size limit (``ulimit -f``, no root needed) stands in for a full disk: the writer refuses the step that would
pass it before HDF5 sees the error (HDF5 can crash the process when its own flush hits a full disk)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from tensordiff.store import CaptureFile

TRAIN = r"""
import json, sys, torch, tensordiff
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
opt = torch.optim.SGD(m.parameters(), lr=0.1)
x = torch.randn(64, 256)
losses = []
path = sys.argv[1] if sys.argv[1] != "-" else None
with tensordiff.capture(m, path, steps=int(sys.argv[2]), optimizer=opt, tensors=sys.argv[3]) as cap:
    for i in range(int(sys.argv[2])):
        loss = m(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        cap.step(loss)
        losses.append(loss.item())
print(json.dumps(losses))
"""


def _train(path, steps, tensors, limit=None):
    def limited():
        if limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = subprocess.run([sys.executable, "-c", TRAIN, path, str(steps), tensors], capture_output=True, text=True,
                          timeout=600, preexec_fn=limited)
    return proc


@pytest.mark.parametrize(("tensors", "steps", "limit"), [("all", 12, 12 << 20), ("none", 400, 9 << 20 | 1 << 19)])
def test_a_capture_that_runs_out_of_room_stops_and_training_goes_on(tmp_path, tensors, steps, limit):
    plain = _train("-", steps, tensors)
    assert plain.returncode == 0, plain.stderr[-2000:]
    path = str(tmp_path / "run.h5")
    proc = _train(path, steps, tensors, limit=limit)
    assert proc.returncode == 0, proc.stderr[-3000:]  # never a crash (SIGSEGV, SIGXFSZ) of the training
    assert json.loads(proc.stdout) == json.loads(plain.stdout)  # the same numbers, every step
    warned = [line for line in proc.stderr.splitlines() if "tensordiff:" in line]
    assert len(warned) == 1 and "file-size limit" in warned[0] and "capture stopped" in warned[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    with CaptureFile(path) as c:
        kept = c.steps
        assert kept == list(range(len(kept))) and 0 < len(kept) < steps  # every step before the refused one
        for step in kept:
            assert len(c.records(step)) > 0
    assert not os.path.exists(path + ".reserve")


class _Payload:
    """What a hostile pickle holds: loading it would run a shell command that leaves a file behind."""

    def __init__(self, mark: str):
        self.mark = mark

    def __reduce__(self):
        return (os.system, (f"touch {self.mark}",))


def test_a_hostile_torch_checkpoint_is_refused_and_never_run(tmp_path):
    import pickle
    import zipfile

    mark = tmp_path / "ran"
    zipped, plain = tmp_path / "evil.pt", tmp_path / "evil_plain.pt"
    with zipfile.ZipFile(zipped, "w") as z:  # torch.save's layout, data.pkl naming os.system
        z.writestr("archive/data.pkl", pickle.dumps({"w": _Payload(str(mark))}, protocol=2))
        z.writestr("archive/version", "3\n")
    plain.write_bytes(pickle.dumps({"w": _Payload(str(mark))}))
    for path, expected in ((zipped, "refused: loading it would call posix.system (code, not tensors)"),
                           (plain, "refused by torch's safe loader (weights_only=True")):
        proc = subprocess.run([sys.executable, "-m", "tensordiff", "ckpt", "diff", str(path), str(path)],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2
        errors = [line for line in proc.stderr.splitlines() if line.startswith("tensordiff:")]
        assert errors == [errors[0]] and errors[0].startswith(f"tensordiff: error: {path}: {expected}"), proc.stderr
        assert "Traceback" not in proc.stderr
    assert not mark.exists()


KILLED = r"""
import sys, torch, tensordiff
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
opt = torch.optim.SGD(m.parameters(), lr=0.01)
x = torch.randn(128, 256)
with tensordiff.capture(m, sys.argv[1], steps=40, optimizer=opt, tensors="all", durable=True) as cap:
    for i in range(40):
        loss = m(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        cap.step(loss)
        print(f"returned {i}", flush=True)
"""


def test_a_sigkill_loses_no_step_whose_step_call_returned_with_durable(tmp_path):
    """Kill loop, fixed seed: SIGKILL at a random moment after step k's ``cap.step()`` returned; the file opens and
    holds every step 0..k complete (the guarantee ``durable=True`` documents)."""
    import random
    import signal
    import time

    rng = random.Random(15)
    for trial in range(4):
        path = str(tmp_path / f"killed{trial}.h5")
        target, delay = rng.randrange(2, 30), rng.uniform(0.0, 0.05)
        proc = subprocess.Popen([sys.executable, "-c", KILLED, path], stdout=subprocess.PIPE, text=True)
        returned = -1
        assert proc.stdout is not None
        for line in proc.stdout:
            returned = int(line.split()[1])
            if returned >= target:
                time.sleep(delay)
                proc.send_signal(signal.SIGKILL)
                break
        proc.wait(timeout=120)
        assert proc.returncode == -signal.SIGKILL, (trial, proc.returncode)
        with CaptureFile(path) as c:
            kept = c.steps
            assert kept[: returned + 1] == list(range(returned + 1)), (trial, target, returned, kept)
            assert all(len(c.records(s)) > 0 for s in kept)
