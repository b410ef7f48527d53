"""The run comes first: a capture that runs out of room stops itself, warns once, and training goes on unchanged.

A file-size limit (``ulimit -f``, no root needed) stands in for a full disk: the writer refuses the step that would
pass it before HDF5 sees the error (HDF5 can crash the process when its own flush hits a full disk)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import numpy as np
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
with tensordiff.capture(m, sys.argv[1], steps=40, optimizer=opt, tensors="all", durable=sys.argv[2] == "durable",
                        writer=None if sys.argv[2] in ("default", "durable", "fallback") else sys.argv[2]) as cap:
    for i in range(40):
        loss = m(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        cap.step(loss)
        print(f"returned {i}", flush=True)
"""


@pytest.mark.parametrize("mode", ["default", "durable", "fallback"])
def test_a_sigkill_loses_no_step_whose_step_call_returned(tmp_path, mode):
    """Kill loop, fixed seed: SIGKILL at a random moment after step k's ``cap.step()`` returned; the file opens and
    holds every step 0..k complete, with the default capture (the writer process finishes what it was handed),
    with ``durable=True`` (the thread writer flushed it before step() returned), and when the writer process does
    not answer (``fallback``: the training process writes the file itself, after one warning)."""
    import random
    import signal
    import time

    rng = random.Random(15)
    env = dict(os.environ, TENSORDIFF_WRITER_START_TIMEOUT="0" if mode == "fallback" else "60")
    for trial in range(3 if mode == "default" else 2):  # benchmarks/kill_loop.py runs the long loop
        path = str(tmp_path / f"killed{trial}.h5")
        target, delay = rng.randrange(2, 30), rng.uniform(0.0, 0.05)
        proc = subprocess.Popen([sys.executable, "-c", KILLED, path, mode], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)
        returned = -1
        assert proc.stdout is not None
        for line in proc.stdout:
            returned = int(line.split()[1])
            if returned >= target:
                time.sleep(delay)
                proc.send_signal(signal.SIGKILL)
                break
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == -signal.SIGKILL, (trial, proc.returncode)
        started = f"tensordiff: the writer process for {path} did not start (no answer in 0 s)"
        assert (started in err) == (mode == "fallback"), err
        deadline = time.time() + 60
        while mode == "default" and _writer_alive(path) and time.time() < deadline:
            time.sleep(0.1)  # the writer process finishes the file on its own, after its parent is gone
        with CaptureFile(path) as c:
            kept = c.steps
            assert kept[: returned + 1] == list(range(returned + 1)), (trial, target, returned, kept)
            assert all(len(c.records(s)) > 0 for s in kept)


def _writer_alive(path: str) -> bool:
    """A writer process (``python -m tensordiff.store.writer_process``) still has ``path`` open."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if any(os.readlink(os.path.join("/proc", pid, "fd", fd)) == path
                   for fd in os.listdir(os.path.join("/proc", pid, "fd"))):
                return True
        except OSError:
            continue
    return False


ODD = r"""
import sys, torch, tensordiff
torch.manual_seed(0)


class Odd(torch.nn.Module):  # outputs of every awkward kind: bool, int, empty, complex, all zeros
    def forward(self, y):
        return y > 0, torch.argmax(y, dim=-1), y[:, :0], torch.complex(y, y * float(sys.argv[2])), torch.zeros_like(y) * y


class Root(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.odd, self.out = torch.nn.Linear(8, 8), Odd(), torch.nn.Linear(8, 1)

    def forward(self, x):
        y = self.lin(x)
        mask, idx, empty, c, z = self.odd(y)
        return self.out(y * mask + c.real + z).mean() + 0 * idx.sum() + empty.sum()


class Norm(torch.nn.Module):  # |h| as sqrt(h * h + eps): with eps = 0 its gradient at h = 0 is 0 * inf = NaN
    def forward(self, h):
        return torch.sqrt(h * h + float(sys.argv[3]))


m = torch.nn.Sequential(Root()) if sys.argv[4] == "odd" else torch.nn.Sequential(
    torch.nn.Linear(8, 8), torch.nn.ReLU(), Norm(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(m.parameters(), lr=0.1)
x = torch.randn(4, 8)
with tensordiff.capture(m, sys.argv[1], steps=2, optimizer=opt, tensors="all") as cap:
    for _ in range(2):
        loss = m(x).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        cap.step(loss)
"""


def _odd(tmp_path, name, imag=1.0, eps=1e-6, model="odd"):
    path = str(tmp_path / name)
    proc = subprocess.run([sys.executable, "-c", ODD, path, str(imag), str(eps), model], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return path


def test_bool_int_empty_complex_and_zero_tensors_are_compared(tmp_path, capsys):
    from tensordiff import cli

    a, b = _odd(tmp_path, "a.h5"), _odd(tmp_path, "b.h5")
    assert cli.main(["diff", a, b, "--json", str(tmp_path / "same.json")]) == 0
    rows = json.loads((tmp_path / "same.json").read_text())["rows"]
    kinds = {r["dtype_a"] for r in rows if r["module_a"] == "0.odd" and r["kind"] == "output"}
    assert kinds == {"bool", "int64", "float32", "complex64"}
    assert all(r["verdict"] == "ok" for r in rows)  # zero-norm pairs (the zeros, the empty slice) included
    # only the imaginary part differs: a divergence, named at the complex output (its real part is the same)
    c = _odd(tmp_path, "c.h5", imag=2.0)
    assert cli.main(["diff", a, c, "--json", str(tmp_path / "imag.json")]) == 1
    first = json.loads((tmp_path / "imag.json").read_text())["first_divergence"]
    assert (first["step"], first["phase"], first["tensor_a"]) == (0, "forward", "0.odd output.3")


def test_the_first_nan_or_inf_is_named_in_execution_order(tmp_path, capsys):
    """sqrt(h * h) after a ReLU is finite forward and NaN backward where h = 0: the first non-finite value is a
    gradient, after a forward pass that is finite everywhere."""
    from tensordiff import cli

    a = _odd(tmp_path, "a.h5", eps=1e-6, model="sqrt")
    b = _odd(tmp_path, "b.h5", eps=0.0, model="sqrt")
    assert cli.main(["ls", b]) == 0
    out = capsys.readouterr().out
    assert "first NaN/Inf (execution order): step 0 backward 1 grad_output.0: 14 NaN" in out  # ReLU's, from Norm
    assert cli.main(["ls", a]) == 0 and "NaN/Inf: none in any step" in capsys.readouterr().out
    assert cli.main(["diff", a, b, "--json", str(tmp_path / "r.json")]) == 1
    out = capsys.readouterr().out
    assert "B's first NaN/Inf (execution order): step 0 backward 1 grad_output.0" in out and "A's first NaN" not in out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["first_nonfinite"] == {"a": None, "b": "step 0 backward 1 grad_output.0: 14 NaN, 0 Inf of 32 values"}


BACKTRACK = r"""
import json, sys, torch, tensordiff
torch.manual_seed(0)
m = torch.nn.Sequential()
m.add_module("a" * 60 + "cb", torch.nn.Linear(4, 4))  # a name on which the pattern below backtracks without end
opt = torch.optim.SGD(m.parameters(), lr=0.1)
x = torch.randn(2, 4)
losses = []
match = sys.argv[2] if sys.argv[2] != "-" else None
with tensordiff.capture(m, sys.argv[1], steps=2, optimizer=opt, tensors="all", tensors_match=match) as cap:
    for _ in range(3):
        loss = m(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        cap.step(loss)
        losses.append(loss.item())
print(json.dumps(losses))
"""


def test_a_tensors_match_regex_that_never_ends_stops_capture_not_training(tmp_path):
    runs = {}
    for name, match in (("plain", "-"), ("bomb", "(a|aa)*c$")):
        proc = subprocess.run([sys.executable, "-c", BACKTRACK, str(tmp_path / f"{name}.h5"), match],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs[name] = (json.loads(proc.stdout), proc.stderr)
    assert runs["bomb"][0] == runs["plain"][0]  # the same numbers, every step
    warned = [line for line in runs["bomb"][1].splitlines() if "tensordiff:" in line]
    assert len(warned) == 1 and "capture stopped (MappingError: tensors_match='(a|aa)*c$': the regular expression" in \
        warned[0] and "catastrophic backtracking" in warned[0] and "training goes on" in warned[0]


TERMINATED = r"""
import signal, sys, torch, tensordiff
if sys.argv[2] == "own":  # the program's own handler, installed before the capture: it must still run
    def own(signum, frame):
        print("own handler", flush=True)
        sys.exit(7)
    signal.signal(signal.SIGTERM, own)
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
opt = torch.optim.SGD(m.parameters(), lr=0.01)
x = torch.randn(128, 256)
with tensordiff.capture(m, sys.argv[1], steps=60, optimizer=opt) as cap:   # the defaults
    for i in range(60):
        loss = m(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        cap.step(loss)
        print(f"returned {i}", flush=True)
"""


@pytest.mark.parametrize("handler", ["default", "own"])
def test_a_sigterm_keeps_every_returned_step_and_ends_the_process_as_it_would_have(tmp_path, handler):
    """torchrun stops the other workers with SIGTERM when one rank fails: the capture finishes the steps it was
    handed and closes the file, then the signal does what it would have done (the default: the process dies of
    SIGTERM; a handler of the program's own: it runs)."""
    import random
    import signal
    import time

    rng = random.Random(27 if handler == "default" else 28)
    for trial in range(2):
        path = str(tmp_path / f"term{trial}.h5")
        target, delay = rng.randrange(2, 40), rng.uniform(0.0, 0.03)
        proc = subprocess.Popen([sys.executable, "-c", TERMINATED, path, handler], stdout=subprocess.PIPE, text=True)
        returned, out = -1, []
        assert proc.stdout is not None
        for line in proc.stdout:
            out.append(line)
            if line.startswith("returned"):
                returned = int(line.split()[1])
                if returned >= target:
                    time.sleep(delay)
                    proc.send_signal(signal.SIGTERM)
                    break
        rest, _ = proc.communicate(timeout=120)
        out.append(rest)
        assert proc.returncode == (-signal.SIGTERM if handler == "default" else 7), (trial, proc.returncode)
        assert ("own handler" in "".join(out)) == (handler == "own")
        with CaptureFile(path) as c:
            kept = c.steps
            assert kept[: returned + 1] == list(range(returned + 1)), (trial, target, returned, kept)


RANKS = r"""
import os, sys, time, torch, tensordiff
rank = int(os.environ["RANK"])
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
opt = torch.optim.SGD(m.parameters(), lr=0.01)
x = torch.randn(32, 64)
with tensordiff.capture(m, os.path.join(sys.argv[1], f"run.rank{rank}.h5"), steps=400, optimizer=opt) as cap:
    for i in range(400):
        loss = m(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        cap.step(loss)
        print(f"rank {rank} returned {i}", flush=True)
        if rank == 1 and i == 12:
            raise RuntimeError("rank 1 fails, the others are stopped")   # the fault the user is chasing
        time.sleep(0.02)
"""


def test_under_torchrun_the_ranks_stopped_after_one_fails_keep_every_returned_step(tmp_path):
    """One rank raises; torchrun stops the others with SIGTERM: their captures still hold every step they returned."""
    import shutil

    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not installed")
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    proc = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", str(script), str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0  # the run failed, as it would have without tensordiff
    returned = max(int(line.split()[-1]) for line in proc.stdout.splitlines() if line.startswith("rank 0 returned"))
    assert returned < 399  # rank 0 was stopped, not left to finish
    with CaptureFile(str(tmp_path / "run.rank0.h5")) as c:
        assert c.steps[: returned + 1] == list(range(returned + 1)), (returned, c.steps[-3:])
    with CaptureFile(str(tmp_path / "run.rank1.h5")) as c:
        assert c.steps == list(range(13))  # the failing rank: every step it returned, closed on the way out


UNDER_WAY = r"""
import os, signal, sys, threading
import numpy as np
from tensordiff.capturing.recorder import Deferred
from tensordiff.store import writer_process

writer_process.PIECE = 1 << 20  # several pieces for the one tensor
path, mode = sys.argv[1], sys.argv[2]


def row(seq, same_as=-1, has_data=1):
    return {"seq": seq, "phase": "forward", "module": "lin", "call": 0, "kind": "output", "slot": str(seq),
            "module_class": "Linear", "dtype": "float32", "shape": "3000000", "min": 0.0, "max": 2999999.0,
            "mean": 1499999.5, "l2": 1.0, "nan": 0, "inf": 0, "numel": 3000000, "has_data": has_data,
            "same_as": same_as, "grad_of": -1, "enter": 0, "parent": ""}


arr = np.arange(3_000_000, dtype=np.float32)
host = np.ones(4, dtype=np.float32)
gate = threading.Event()


def copy():  # a GPU copy still on its way to the host until the gate opens
    gate.wait()
    return arr


w = writer_process.ProcessWriter(path, {"framework": "torch"}, durable=True)
small = dict(row(2), shape="4", numel=4)
w.submit(0, [row(0), row(1, same_as=0), small], {0: Deferred(copy, arr.nbytes, gate.is_set), 2: host}, {})
print("returned 0", flush=True)  # while the copy is under way
loss = dict(row(0), phase="loss", shape="", numel=1)
w.submit(1, [loss], {0: Deferred(lambda: (gate.wait(), np.float32(0.5))[1], 4, lambda: False)}, {})  # its loss: a GPU copy
print("returned 1", flush=True)  # though the queue (1 MB) holds step 0's 12 MB still under way
if mode == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
gate.set()
w.close()
"""


@pytest.mark.parametrize("mode", ["finish", "kill"])
def test_a_step_returns_before_its_gpu_copies_and_a_kill_keeps_their_statistics(tmp_path, mode):
    """The writer process takes a step's records (and the tensors already on the host) when ``step()`` ends and its
    tensors still on their way from the GPU after it: the next step is handed over while they are under way. When
    the training process dies before they arrive, the step is still written, those records keep their statistics
    (``has_data`` 0, their links too), the step says ``tensors_lost``, and the writer says so once."""
    import signal
    import time

    path = str(tmp_path / "underway.h5")
    proc = subprocess.run([sys.executable, "-c", UNDER_WAY, path, mode], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, TENSORDIFF_WRITER_START_TIMEOUT="60", TENSORDIFF_WRITE_QUEUE_GB="0.001"))
    assert proc.stdout.split("\n")[:2] == ["returned 0", "returned 1"], proc.stderr
    deadline = time.time() + 60
    while _writer_alive(path) and time.time() < deadline:
        time.sleep(0.1)
    with CaptureFile(path) as c:
        assert c.steps == [0, 1]
        recs = {r.seq: r for r in c.records(0)}
        assert c.array(recs[2]).tolist() == [1.0] * 4  # on the host at step(): handed over with the step
        if mode == "finish":
            assert proc.returncode == 0, proc.stderr
            assert recs[0].has_data == 1 and recs[1].has_data == 1
            np.testing.assert_array_equal(c.array(recs[0]), np.arange(3_000_000, dtype=np.float32))
            assert "tensors_lost" not in c.step_attrs(0)
            assert c.array(c.records(1)[0]) == np.float32(0.5)
        else:
            assert proc.returncode == -signal.SIGKILL
            assert recs[0].has_data == 0 and recs[1].has_data == 0 and recs[0].max == 2999999.0
            assert int(c.step_attrs(0)["tensors_lost"]) == 1 and int(c.step_attrs(1)["tensors_lost"]) == 1
            assert c.records(1)[0].has_data == 0
            assert proc.stderr.count("did not reach the writer") == 2, proc.stderr  # one line a step


INTERRUPTED = r"""
import sys, torch, tensordiff
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
opt = torch.optim.SGD(m.parameters(), lr=0.01)
x = torch.randn(128, 256)
with tensordiff.capture(m, optimizer=opt) as cap:  # tensordiff capture -o sets the file and the steps
    for i in range(200):
        loss = m(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        cap.step(loss)
        print(f"returned {i}", flush=True)
"""


def test_a_ctrl_c_stops_the_run_keeps_every_returned_step_and_exits_130(tmp_path):
    """Ctrl-C in a terminal: SIGINT to the whole process group (tensordiff capture, the training program, its writer
    process) at random moments. The program gets its KeyboardInterrupt and stops, as without tensordiff; the file
    keeps every step whose step() returned; tensordiff capture exits 130 and says which file holds how many steps."""
    import random
    import signal
    import time

    rng = random.Random(44)
    script = tmp_path / "train.py"
    script.write_text(INTERRUPTED)
    for trial in range(3):  # benchmarks/kill_loop.py --cli --signals INT runs the long loop
        path = str(tmp_path / f"int{trial}.h5")
        target, delay = rng.randrange(2, 40), rng.uniform(0.0, 0.05)
        proc = subprocess.Popen([sys.executable, "-m", "tensordiff", "capture", "-o", path, "--steps", "200",
                                 "--tensors", "all", "--", sys.executable, str(script)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True,
                                # as from a terminal: a pytest-xdist worker ignores SIGINT, and an ignored signal
                                # stays ignored in every program it starts
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        returned = -1
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("returned"):
                returned = int(line.split()[1])
                if returned >= target:
                    time.sleep(delay)
                    os.killpg(proc.pid, signal.SIGINT)
                    break
        out, err = proc.communicate(timeout=120)
        last = max([returned] + [int(x.split()[1]) for x in out.splitlines() if x.startswith("returned")])
        assert proc.returncode == 130, (trial, target, last, proc.returncode, err[-2000:])
        assert last < 199, "the run went on after the Ctrl-C"
        with CaptureFile(path) as c:
            kept = c.steps
        assert kept[: last + 1] == list(range(last + 1)), (trial, target, last, kept)
        assert f"{path} keeps {len(kept)} complete step(s)" in err, err[-2000:]
        assert "stopped by SIGINT" in err
