"""Megatron and MindFormers, each captured through its own launcher, from one checkpoint and one batch, diffed.

    python examples/launchers/run.py                       # agree: exit 0
    python examples/launchers/run.py --fault norm-eps      # MindFormers' YAML with another RMSNorm epsilon: exit 1
    python examples/launchers/run.py --tp 2 --graph        # Megatron at TP=2 under torchrun, MindFormers in GRAPH_MODE
    python examples/launchers/run.py --mf-dp 2             # the Trainer data-parallel over 2 msrun workers

The Megatron side is ``examples/megatron_loop/train.py``, a loop built as Megatron-LM's is (megatron-core's schedule,
its DDP and distributed optimizer, Adam, clipping at 1.0), captured by ``tensordiff capture --megatron``; it never
imports tensordiff's capture. The MindFormers side is MindFormers' own Trainer run from ``llama_tiny.yaml`` (the same
model and training: AdamW, clipping at 1.0) by ``run_mindformer.py`` (a stand-in for MindFormers' script of that name),
captured by ``tensordiff capture --mindformers``, which adds the ``TensordiffCapture`` callback to a copy of the YAML.
Between them: ``tensordiff batch`` (the batch for Megatron and, as a MindRecord file, for the Trainer's dataset) and
``tensordiff ckpt convert`` (Megatron's starting weights into the ``load_checkpoint`` of the YAML).

It prints every command it runs (the workflow to copy for your own runs) and exits with ``tensordiff diff``'s code:
0 agree, 1 a divergence, 2 an error, 3 inconclusive. Files go to --out (default out/launchers/[FAULT][-tpN][-graph]).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

#: one mistake in the MindFormers YAML: (what it is, the line as written, the line with the fault)
FAULTS = {
    "none": ("no fault", "", ""),
    "norm-eps": ("RMSNorm epsilon 1e-2 instead of 1e-6", "rms_norm_eps: 1.0e-6", "rms_norm_eps: 1.0e-2"),
    "rope-base": ("RoPE base 500000 instead of 10000", "theta: 10000.0", "theta: 500000.0"),
}
#: the model's sizes, as llama_tiny.yaml and examples/distributed/mcore_train.py have them
VOCAB, SEQ, BATCH, HEADS, GROUPS = 128, 16, 2, 4, 2


def _shown(cmd: list[str]) -> str:
    """A command as it pastes in the output folder (where it runs): files by their full paths, ``tensordiff``
    for ``python -m tensordiff``."""
    if cmd[:3] == [sys.executable, "-m", "tensordiff"]:
        cmd = ["tensordiff", *cmd[3:]]
    return " ".join(shlex.quote(c) for c in cmd)


def _run(cmd: list[str], cwd: str, verbose: bool) -> int:
    print(f"$ {_shown(cmd)}", flush=True)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))  # msrun's workers
    if verbose:
        return subprocess.call(cmd, env=env, cwd=cwd)
    proc = subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout.splitlines():  # the frameworks' chatter stays out; what tensordiff says is shown
        if line.startswith("tensordiff") or " iteration " in line or "{ Epoch:" in line:
            print("  " + (line[line.index("{ Epoch:"):] if "{ Epoch:" in line else line.strip()), flush=True)
    if proc.returncode != 0:
        print(proc.stdout[-6000:], file=sys.stderr)
    return proc.returncode


def write_config(path: str, fault: str, graph: bool, dp: int = 1) -> None:
    """llama_tiny.yaml with the fault's line changed, ``mode: 0`` for GRAPH_MODE, and for data parallelism over ``dp``
    msrun workers the Trainer's parallel settings (each rank a 1/dp share of the batch, the gradients averaged)."""
    with open(os.path.join(HERE, "llama_tiny.yaml"), encoding="utf-8") as f:
        text = f.read()
    _, line, faulty = FAULTS[fault]
    if line:
        assert line in text, f"llama_tiny.yaml has no `{line}`"
        text = text.replace(line, faulty)
    if graph:
        text = text.replace("  mode: 1 ", "  mode: 0 ")
    if dp > 1:
        import yaml

        config = yaml.safe_load(text)
        config["use_parallel"] = True
        config["parallel"] = {"parallel_mode": 0, "gradients_mean": True, "full_batch": False,
                              "enable_parallel_optimizer": False}
        config["parallel_config"] = {"data_parallel": dp, "model_parallel": 1, "pipeline_stage": 1,
                                     "micro_batch_num": 1}
        for section in (config["model"]["model_config"], config["train_dataset"], config["runner_config"]):
            section["batch_size"] = BATCH // dp
        text = yaml.safe_dump(config, sort_keys=False)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fault", choices=sorted(FAULTS), default="none", help="one mistake in the MindFormers YAML")
    p.add_argument("--tp", type=int, default=1, choices=(1, 2), help="Megatron's tensor parallelism (2: torchrun)")
    p.add_argument("--graph", action="store_true", help="the MindFormers Trainer in GRAPH_MODE (else PyNative)")
    p.add_argument("--mf-dp", type=int, default=1, choices=(1, 2),
                   help="the MindFormers Trainer data-parallel over this many msrun workers (2: msrun)")
    p.add_argument("--steps", type=int, default=2, help="iterations captured (default 2; 3 are trained)")
    p.add_argument("--out", help="output folder")
    p.add_argument("--reuse", action="store_true", help="keep the batch, Megatron's capture and the converted checkpoint "
                                                        "already in --out: only the MindFormers side and the diff run "
                                                        "(to try a change of the YAML quickly)")
    p.add_argument("--verbose", action="store_true", help="show the frameworks' own output")
    args = p.parse_args(argv)
    name = "-".join([args.fault] + ([f"tp{args.tp}"] if args.tp > 1 else []) + (["graph"] if args.graph else [])
                    + ([f"mfdp{args.mf_dp}"] if args.mf_dp > 1 else []))
    out = os.path.abspath(args.out or os.path.join(ROOT, "out", "launchers", name))
    os.makedirs(out, exist_ok=True)
    py, td = sys.executable, [sys.executable, "-m", "tensordiff"]
    write_config(os.path.join(out, "llama_tiny.yaml"), args.fault, args.graph, args.mf_dp)
    launcher = [py] if args.tp == 1 else [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                          str(args.tp)]
    msrun = shutil.which("msrun", path=os.path.dirname(py)) or shutil.which("msrun") or "msrun"
    mf_launcher = [py] if args.mf_dp == 1 else [msrun, "--worker_num", str(args.mf_dp), "--local_worker_num",
                                                 str(args.mf_dp), "--master_port", str(_free_port()), "--join",
                                                 "True", "--log_dir", "msrun_logs"]
    megatron = "megatron.h5" if args.tp == 1 else "megatron.rank*.h5"
    mindformers = "mindformers.h5" if args.mf_dp == 1 else "mindformers.rank*.h5"
    steps = [
        td + ["batch", "-o", "batch.h5", "--vocab", str(VOCAB), "--seq", str(SEQ), "--batch", str(BATCH), "--seed", "0",
              "--mindrecord", "batch.mindrecord"],
        td + ["capture", "--megatron", "-o", "megatron.h5", "--steps", str(args.steps), "--"] + launcher +
        [os.path.join(ROOT, "examples", "megatron_loop", "train.py"), "--tp", str(args.tp), "--data", "batch.h5",
         "--save-init", "init.safetensors", "--batch", str(BATCH), "--steps", str(args.steps + 1)],
        td + ["ckpt", "convert", "init.safetensors", "init.ckpt", "--mapping", "mcore-mindformers-llama", "--to",
              "mindformers", "--var", f"heads={HEADS}", "--var", f"groups={GROUPS}"],
        td + ["capture", "--mindformers", "-o", "mindformers.h5", "--steps", str(args.steps), "--", *mf_launcher,
              os.path.join(HERE, "run_mindformer.py"), "--config", os.path.join(out, "llama_tiny.yaml")],
    ]
    kept = ["batch.h5", "batch.mindrecord", "init.ckpt", "megatron.h5" if args.tp == 1 else "megatron.rank0.h5"]
    if args.reuse and all(os.path.exists(os.path.join(out, f)) for f in kept):
        print(f"run.py: --reuse: {', '.join(kept)} kept from the earlier run in {out}", flush=True)
        steps = steps[3:]
    print(f"$ cd {shlex.quote(out)}", flush=True)
    for cmd in steps:
        code = _run(cmd, out, args.verbose)
        if code != 0:
            print(f"run.py: the step above failed with exit code {code}", file=sys.stderr)
            return 2
    cmd = td + ["diff", megatron, mindformers, "--first-divergence", "--json", "report.json"]
    print(f"$ {_shown(cmd)}", flush=True)
    return subprocess.call(cmd, cwd=out)


if __name__ == "__main__":
    sys.exit(main())
