"""Kill loop: a CPU torch training loop under the default capture, stopped at a random moment after some step's
``cap.step()`` returned, by SIGKILL, SIGTERM or SIGINT; then the file is read. Prints, per signal and writer, the
kills, the steps returned, and the returned steps missing from the file (the guarantee: none).

    python benchmarks/kill_loop.py                     # 20 kills per signal, the default (process) writer
    python benchmarks/kill_loop.py --writer thread --kills 20
    python benchmarks/kill_loop.py --device cuda --tensors all   # a GPU model, full tensors at every step
    python benchmarks/kill_loop.py --cli --signals INT       # Ctrl-C in a terminal: SIGINT to the process group of
                                                             # `tensordiff capture -- python train.py` (exit 130)
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PROGRAM = r"""
import sys, torch, tensordiff
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).to(sys.argv[3])
opt = torch.optim.SGD(m.parameters(), lr=0.01)
x = torch.randn(128, 256, device=sys.argv[3])
writer = None if sys.argv[2] == "default" else sys.argv[2]
path = None if sys.argv[1] == "-" else sys.argv[1]  # "-": tensordiff capture -o sets it
with tensordiff.capture(m, path, steps=60, optimizer=opt, writer=writer, tensors=sys.argv[4]) as cap:
    for i in range(60):
        loss = m(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        cap.step(loss)
        print(f"returned {i}", flush=True)
"""


def one(path: str, writer: str, signum: int, target: int, delay: float, device: str = "cpu",
        tensors: str = "first", cli: bool = False) -> tuple[int, list[int], int, float]:
    """(the last step returned, the steps in the file, the exit status, seconds from the signal to the exit).
    ``cli``: the program runs under ``tensordiff capture``, and the signal goes to their whole process group (as a
    terminal's Ctrl-C does)."""
    from tensordiff.store import CaptureFile

    env = dict(os.environ, PYTHONPATH=ROOT)
    program = [sys.executable, "-c", PROGRAM, "-" if cli else path, writer, device, tensors]
    if cli:
        program = [sys.executable, "-m", "tensordiff", "capture", "-o", path, "--steps", "60", "--tensors", tensors,
                   "--", *program]
    proc = subprocess.Popen(program, stdout=subprocess.PIPE, text=True, env=env, start_new_session=cli,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as from a terminal
    returned, sent = -1, 0.0
    assert proc.stdout is not None
    for line in proc.stdout:
        returned = int(line.split()[1])
        if returned >= target:
            time.sleep(delay)
            if cli:
                os.killpg(proc.pid, signum)
            else:
                proc.send_signal(signum)
            sent = time.perf_counter()
            break
    try:
        proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return returned, [], -999, 120.0
    took = time.perf_counter() - sent
    time.sleep(0.5 if signum == signal.SIGKILL else 0.0)  # the writer process finishes the file on its own
    try:
        with CaptureFile(path) as c:
            kept = [s for s in c.steps if c.records(s)]
    except Exception:  # an unreadable file counts as every step lost
        kept = []
    return returned, kept, proc.returncode, took


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--writer", default="default", choices=("default", "process", "thread"))
    p.add_argument("--seed", type=int, default=27)
    p.add_argument("--device", default="cpu", help="where the model runs (cuda: a GPU model)")
    p.add_argument("--tensors", default="first", choices=("first", "all", "none"))
    p.add_argument("--signals", default="KILL,TERM,INT", help="which signals (default KILL,TERM,INT)")
    p.add_argument("--cli", action="store_true", help="run under tensordiff capture, signal the process group")
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    bad = 0
    with tempfile.TemporaryDirectory() as folder:
        for signum in [getattr(signal, f"SIG{name}") for name in args.signals.split(",")]:
            lost_total, returned_total, worst, statuses = 0, 0, 0.0, set()
            for k in range(args.kills):
                path = os.path.join(folder, f"{signum}-{k}.h5")
                ret, kept, status, took = one(path, args.writer, signum, rng.randrange(0, 55), rng.uniform(0, 0.03),
                                             args.device, args.tensors, args.cli)
                lost = len(set(range(ret + 1)) - set(kept))
                lost_total += lost
                returned_total += ret + 1
                worst = max(worst, took)
                statuses.add(status)
                bad += lost > 0
            print(f"{signal.Signals(signum).name:8s} {args.device} tensors={args.tensors} writer={args.writer:8s} "
                  + ("under tensordiff capture, to the process group; " if args.cli else "")
                  + f"kills {args.kills}: steps returned "
                  f"{returned_total}, returned steps missing from the file {lost_total}; exit statuses "
                  f"{sorted(statuses)}; longest exit after the signal {worst:.2f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
