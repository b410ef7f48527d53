"""Hugging Face Llama vs megatron-core, end to end: one checkpoint, two unmodified scripts, one diff.

    python examples/hf_vs_megatron/run.py                    # clean: exit 0
    python examples/hf_vs_megatron/run.py --fault rms-eps    # one mistake on the Hugging Face side

Neither training script imports tensordiff: both are captured with ``tensordiff capture --auto``,
the checkpoint is converted with the built-in ``mcore-hf-llama`` table, and ``tensordiff diff``
picks the built-in ``mcore-hf-llama`` mapping (q/k/v and gate/up joined) from the captures.
Prints every command it runs and exits with ``tensordiff diff``'s code (0 agree, 1 divergence,
2 error, 3 inconclusive). Files go to --out.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

#: one mistake a migration makes on the Hugging Face side -> the hf_train.py arguments that make it
FAULTS = {
    "none": [],
    "rms-eps": ["--rms-eps", "1e-3"],            # the RMSNorm epsilon of another config
    "rope-theta": ["--rope-theta", "500000"],    # Llama 3's RoPE base on a Llama 2 model
    "gelu": ["--act", "gelu_pytorch_tanh"],      # GeGLU instead of SwiGLU
}


def _run(cmd: list[str], cwd: str, verbose: bool) -> int:
    shown = " ".join(shlex.quote(os.path.relpath(c, ROOT) if os.path.isabs(c) and c.startswith(ROOT) else c) for c in cmd)
    print(f"$ {shown}", flush=True)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if verbose or (cmd[1:3] == ["-m", "tensordiff"] and cmd[3] == "diff"):
        return subprocess.call(cmd, env=env, cwd=cwd)
    proc = subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith(("tensordiff", "megatron-core", "hf llama")):
            print("  " + line)
    if proc.returncode != 0:
        print(proc.stdout[-6000:], file=sys.stderr)
    return proc.returncode


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fault", choices=sorted(FAULTS), default="none")
    p.add_argument("--out", help="output folder (default out/hf_vs_megatron/FAULT)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--verbose", action="store_true", help="show the frameworks' own output")
    args = p.parse_args(argv)
    out = os.path.abspath(args.out or os.path.join(ROOT, "out", "hf_vs_megatron", args.fault))
    os.makedirs(out, exist_ok=True)
    py, td = sys.executable, [sys.executable, "-m", "tensordiff"]
    steps = ["--steps", str(args.steps)]
    for cmd in (
        td + ["capture", "--auto", "-o", "mcore.h5"] + steps + ["--", py, os.path.join(HERE, "megatron_train.py"),
                                                                 "--save-weights", "mcore.safetensors"] + steps,
        td + ["ckpt", "convert", "mcore.safetensors", "hf.safetensors", "--mapping", "mcore-hf-llama",
              "--var", "heads=4", "--var", "groups=2"],
        td + ["capture", "--auto", "-o", "hf.h5"] + steps + ["--", py, os.path.join(HERE, "hf_train.py"),
                                                              "--weights", "hf.safetensors"] + steps + FAULTS[args.fault],
    ):
        code = _run(cmd, out, args.verbose)
        if code != 0:
            return code
    return _run(td + ["diff", "mcore.h5", "hf.h5", "--first-divergence"], out, args.verbose)


if __name__ == "__main__":
    sys.exit(main())
